"""Benchmarks of vLLM's v1 scheduler, stock vs E2 in one run: step time on a
saturated workload, and a leak soak with preemption and prefix hits.

Run: python scripts/bench/bench_scheduler.py [--rounds N] [--soak-requests N]

Both sides run scheduler_worker.py in the CPU test venv (made or reused as by
`e2 env --overlay`): stock without the e2 view on PYTHONPATH, E2 with it. The
KV cache is planned from a zoo config.json as a CUDA boot would plan it.

* Step time: one worker per side stays up; the driver alternates short rounds
  between them (stock-E2, then E2-stock), so a shared machine's changing load
  hits both sides alike, and does so with several fresh pairs of workers in
  turn (--pairs), the two of a pair with the same hash seed and each pair
  with its own, so no one process's dict layout sets the figure.
  Reported: the median step time per side and the median of the paired steps'
  ratios over all pairs (target <= 1.05), with each pair's ratio.
  Then the same in mamba cache mode `align` (prefix caching on), for the
  record: the sides chunk prefills at their own state block there, their
  steps do not pair, and the ratio is of their medians, with no target.
* Soak: N seeded requests of random length arriving in bursts (shared
  prefixes, client aborts, mamba cache mode `align` with prefix caching, a
  pool small enough to preempt), stepped to the end on each side. Every
  request must finish, the pool's free count must return to its start, no
  block may stay referenced and, on E2, every slab page must be idle and
  reclaim fully. A state oracle (state_oracle.py) replays the worker's state
  copies: every prefix-cached state must hold exactly its key's tokens and
  every chunk start from the state of exactly the tokens computed.
* Prefix hits (--only prefix-hits, not in a default run): the soak's workload
  without aborts for Qwen3.5-0.8B and Qwen3-Next at 1, 4 and 10 GiB: E2's
  first-admission prefix-hit tokens must be at least stock's, with no wrong
  state on either side and no more preemptions than stock.
* Faults: the soak's first requests twice per side, as is and with the KV
  cache refusing allocations right after prefix hits and at state block
  boundaries; every request must come out with the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2 import testenv  # noqa: E402
from e2.cache import Cache  # noqa: E402
from e2.errors import E2Error  # noqa: E402
from e2.probes.capacity import ZOO  # noqa: E402
from e2.probes.runtime import Runtime  # noqa: E402
from e2.series import Project  # noqa: E402
from scheduler_report import (  # noqa: E402
    print_faults,
    print_prefix_hits,
    print_soak,
    print_steps,
)
from scheduler_workload import WorkloadSpec, step_ratio  # noqa: E402

WORKER = Path(__file__).resolve().parent / "scheduler_worker.py"
SIDES = ("stock", "e2")


@dataclass(frozen=True)
class StepBench:
    """The saturated workload: decode-heavy requests, the batch full at
    max_num_seqs on both sides with requests always waiting behind it."""

    model: str = "Qwen3.5-0.8B"
    budget_gib: float = 10.0
    max_num_seqs: int = 256
    mamba_cache_mode: str = "none"
    workload: WorkloadSpec = field(default_factory=lambda: WorkloadSpec(
        seed=1, prompt_min=16, prompt_max=2048, decode_min=16, decode_max=512,
        num_prefixes=0))

    @property
    def paired(self) -> bool:
        """Whether both sides schedule the same steps. In mamba `align` mode each
        side chunks prefills at its own state block (stock 544 tokens, E2 256),
        so step j differs between them and only their medians compare."""
        return self.mamba_cache_mode != "align"


# The step in mamba `align` mode (prefix caching on): timed for the record,
# with no target, since its steps do not pair.
ALIGN_STEPS = StepBench(mamba_cache_mode="align")


@dataclass(frozen=True)
class Soak:
    model: str = "Qwen3.5-0.8B"
    budget_gib: float = 1.0           # 160 pool pages: ~30 requests at once, so it preempts
    max_num_seqs: int = 256
    mamba_cache_mode: str = "align"   # prefix caching on, as align requires
    requests: int = 10_000
    mean_burst: int = 8
    workload: WorkloadSpec = field(default_factory=lambda: WorkloadSpec(
        seed=0, abort_share=0.02))


# The prefix-hit matrix: the soak's workload without aborts, per model and
# budget, fewer requests where a budget holds more at once (the same work).
HIT_SOAKS = tuple(
    Soak(model=model, budget_gib=gib, requests=requests,
         workload=WorkloadSpec(seed=0))
    for model in ("Qwen3.5-0.8B", "Qwen3-Next-80B-A3B")
    for gib, requests in ((1.0, 4_000), (4.0, 3_000), (10.0, 3_000))
)


# ---------------------------------------------------------------- workers


class Worker:
    """scheduler_worker.py on one side; JSON lines come back on a pipe of their own."""

    def __init__(self, runtime: Runtime, side: str, mode: str, bench: StepBench | Soak,
                 log_dir: Path, extra: list[str], hash_seed: int | None = None):
        self.side = side
        env = runtime.env(side)
        if hash_seed is not None:
            env["PYTHONHASHSEED"] = str(hash_seed)
        self.log = log_dir / f"{mode}-{side}.log"
        read_fd, write_fd = os.pipe()
        command = [str(runtime.python), str(WORKER), mode, "--model", str(ZOO / bench.model),
                   "--budget-gib", str(bench.budget_gib),
                   "--max-num-seqs", str(bench.max_num_seqs),
                   "--mamba-cache-mode", bench.mamba_cache_mode,
                   "--workload", json.dumps(asdict(bench.workload)),
                   "--result-fd", str(write_fd), *extra]
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                env=env, cwd=log_dir, pass_fds=(write_fd,), text=True)
        os.close(write_fd)
        self.results: IO[str] = os.fdopen(read_fd)

    def receive(self) -> dict:
        line = self.results.readline()
        if not line:
            self.process.wait()
            tail = "\n".join(self.log.read_text().splitlines()[-20:])
            raise E2Error(f"the {self.side} worker exited {self.process.returncode} "
                          f"without a result; last lines of {self.log}:\n{tail}")
        message = json.loads(line)
        if "error" in message:
            raise E2Error(f"{self.side} worker: {message['error']}\n{message['traceback']}")
        return message

    def ask(self, request: dict) -> dict:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self.receive()

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.results.close()


def make_runtime(cache: Cache) -> Runtime:
    """The CPU test env and its e2 view, made or reused exactly as `e2 env --overlay`."""
    project = Project.find(Path(__file__).resolve().parent)
    env, view = testenv.prepare(project, project.load(), cache, "cpu",
                                overlay=True)
    assert view is not None
    probe = subprocess.run([str(env.python), "-c", "import importlib.util as u; "
                            "print(u.find_spec('torchvision') is None)"],
                           capture_output=True, text=True, timeout=120)
    return Runtime(env.python, view.path, None, probe.stdout.strip() == "True")


@dataclass(frozen=True)
class SwitchedOff(Runtime):
    """The E2 side with VLLM_E2_STATE_POOL=0 (E2's files on upstream's path): the
    benchmark against itself, whose ratio shows the measurement's own error."""

    def env(self, side: str) -> dict[str, str]:
        env = super().env(side)
        if side == "e2":
            env["VLLM_E2_STATE_POOL"] = "0"
        return env


def expected_pool(runtime: Runtime, side: str) -> str:
    return "PagePool" if side == "e2" and not isinstance(runtime, SwitchedOff) else "BlockPool"


def start_both(runtime: Runtime, mode: str, bench: StepBench | Soak, log_dir: Path,
               extra: list[str], hash_seed: int | None = None) -> dict[str, Worker]:
    workers = {side: Worker(runtime, side, mode, bench, log_dir, extra, hash_seed)
               for side in SIDES}
    try:
        for worker in workers.values():
            hello = worker.receive()
            expected = expected_pool(runtime, worker.side)
            if hello["pool"] != expected:
                raise E2Error(f"the {worker.side} side runs a {hello['pool']}, not a "
                              f"{expected} ({hello['vllm_file']})",
                              hint="is the e2 view current? e2 overlay; e2 env --overlay")
    except BaseException:
        for worker in workers.values():
            worker.close()
        raise
    return workers


# ---------------------------------------------------------------- benches


def run_steps(runtime: Runtime, bench: StepBench, rounds: int, steps: int, warmup: int,
              log_dir: Path, pairs: int = 1) -> dict:
    """Step times of ``pairs`` pairs of workers, one pair after the other, each
    pair's rounds interleaved. A process's string hashes (its request ids' places
    in the scheduler's dicts) follow its hash seed and shift its step times by
    a few percent either way for its whole life: the two workers of a pair share
    one seed, and each pair has its own, so the ratio is of like against like
    and no one seed sets it (the same code on both sides: pairs within 0.02 of
    1 with a shared seed, 0.95-1.00 without)."""
    cpu: dict[str, list[list[float]]] = {side: [] for side in SIDES}
    wall: dict[str, list[list[float]]] = {side: [] for side in SIDES}
    pair_ratios = []
    for seed in range(pairs):
        pair = _run_pair(runtime, bench, rounds, steps, warmup, log_dir, seed)
        for side in SIDES:
            cpu[side] += pair["cpu"][side]
            wall[side] += pair["wall"][side]
        pair_ratios.append(_ratio(bench, step_ratio(pair["cpu"]["stock"], pair["cpu"]["e2"])))
    figures = step_ratio(cpu["stock"], cpu["e2"])
    figures["wall"] = step_ratio(wall["stock"], wall["e2"])
    figures["ratio"] = _ratio(bench, figures)
    figures["wall"]["ratio"] = _ratio(bench, figures["wall"])
    figures["pair_ratios"] = pair_ratios
    figures["batch"] = pair["batch"]
    figures["tokens"] = pair["tokens"]
    for side in SIDES:
        for key in ("preemptions", "usage", "waiting"):
            figures[f"{side}_{key}"] = pair["last"][side][key]
        figures[f"{side}_num_blocks"] = pair["planners"][side]["num_blocks"]
    return figures


def _ratio(bench: StepBench, figures: dict) -> float:
    """E2 against stock: the median of the paired steps' ratios where the steps
    pair, else the ratio of the two sides' medians."""
    return figures["ratio"] if bench.paired else figures["e2_median"] / figures["stock_median"]


def _run_pair(runtime: Runtime, bench: StepBench, rounds: int, steps: int, warmup: int,
              log_dir: Path, hash_seed: int) -> dict:
    workers = start_both(runtime, "steps", bench, log_dir, [], hash_seed)
    try:
        planners = {side: w.receive()["planner"] for side, w in workers.items()}
        for worker in workers.values():
            worker.ask({"steps": warmup})
        cpu: dict[str, list[list[float]]] = {side: [] for side in SIDES}
        wall: dict[str, list[list[float]]] = {side: [] for side in SIDES}
        schedule: dict[str, list[tuple[int, int]]] = {side: [] for side in SIDES}
        last: dict[str, dict] = {}
        for round_ in range(rounds):
            # stock-E2, then E2-stock: neither side always runs right after the other.
            for side in SIDES if round_ % 2 == 0 else SIDES[::-1]:
                reply = workers[side].ask({"steps": steps})
                cpu[side].append([ns / 1e6 for ns in reply["cpu_ns"]])
                wall[side].append([ns / 1e6 for ns in reply["wall_ns"]])
                schedule[side] += zip(reply["batch"], reply["tokens"])
                last[side] = reply
    finally:
        for worker in workers.values():
            worker.close()
    # Step j is the same step on both sides only while both schedule alike; a
    # pool that binds on one side and not the other breaks the pairing.
    if bench.paired and schedule["stock"] != schedule["e2"]:
        diverged = next(i for i, (s, e) in enumerate(zip(schedule["stock"], schedule["e2"]))
                        if s != e)
        raise E2Error(f"the two sides scheduled differently from step {diverged} on "
                      f"({schedule['stock'][diverged]} vs {schedule['e2'][diverged]} "
                      "requests/tokens): the step times do not pair",
                      hint="give the step benchmark a budget where the batch, not the "
                           "pool, binds on both sides")
    return {"cpu": cpu, "wall": wall, "last": last, "planners": planners,
            "batch": sum(b for b, _ in schedule["stock"]) / len(schedule["stock"]),
            "tokens": {side: sum(t for _, t in schedule[side]) / len(schedule[side])
                       for side in SIDES}}


def run_soak(runtime: Runtime, soak: Soak, log_dir: Path) -> dict[str, dict]:
    extra = ["--requests", str(soak.requests), "--mean-burst", str(soak.mean_burst)]
    results = {}
    # One side after the other: each side's seconds are its own.
    for side in SIDES:
        worker = Worker(runtime, side, "soak", soak, log_dir, extra)
        try:
            worker.receive()
            results[side] = worker.receive()
        finally:
            worker.close()
    return results


def run_faults(runtime: Runtime, soak: Soak, log_dir: Path) -> dict[str, dict]:
    """The soak as is and with allocation refusals, on both sides at once (only
    the outcome counts here, not the seconds)."""
    extra = ["--requests", str(soak.requests), "--mean-burst", str(soak.mean_burst)]

    def one(side: str) -> dict:
        worker = Worker(runtime, side, "faults", soak, log_dir, extra)
        try:
            worker.receive()
            return worker.receive()
        finally:
            worker.close()

    with ThreadPoolExecutor(len(SIDES)) as pool:
        return dict(zip(SIDES, pool.map(one, SIDES)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="step-time rounds a side")
    parser.add_argument("--steps", type=int, default=50, help="steps per round")
    parser.add_argument("--warmup", type=int, default=200, help="untimed steps first")
    parser.add_argument("--pairs", type=int, default=5,
                        help="fresh stock/E2 worker pairs, one after the other")
    parser.add_argument("--soak-requests", type=int, default=Soak.requests)
    parser.add_argument("--seed", type=int, default=0, help="the soak's seed")
    parser.add_argument("--only", choices=("steps", "align-steps", "soak", "faults",
                                           "prefix-hits"),
                        help="run one part (prefix-hits: the soak per model and budget, "
                             "not part of a default run)")
    parser.add_argument("--fault-requests", type=int, default=1_000,
                        help="the soak's requests the fault run replays")
    parser.add_argument("--control", action="store_true",
                        help="run the E2 side with VLLM_E2_STATE_POOL=0: the ratio then "
                             "measures the benchmark's own error (expect 1.00)")
    parser.add_argument("--cache", type=Path, metavar="DIR",
                        help="e2's cache directory, where the test env is (default "
                             "$XDG_CACHE_HOME/vllm-e2)")
    args = parser.parse_args()
    if min(args.rounds, args.steps, args.pairs, args.soak_requests, args.fault_requests) < 1 \
            or args.warmup < 0:
        parser.error("--rounds, --steps, --pairs, --soak-requests and --fault-requests must "
                     "be positive")
    bench = StepBench()
    soak = Soak(requests=args.soak_requests,
                workload=WorkloadSpec(**{**asdict(Soak().workload), "seed": args.seed}))
    try:
        runtime = make_runtime(Cache.at(args.cache))
        if args.control:
            runtime = SwitchedOff(**asdict(runtime))
            print("control: the e2 side runs with VLLM_E2_STATE_POOL=0")
        with tempfile.TemporaryDirectory(prefix="e2-bench-sched-") as tmp:
            ok = True
            if args.only in (None, "steps"):
                figures = run_steps(runtime, bench, args.rounds, args.steps, args.warmup,
                                    Path(tmp), pairs=args.pairs)
                ok &= print_steps(bench, figures, args.steps)
            if args.only in (None, "align-steps"):
                figures = run_steps(runtime, ALIGN_STEPS, args.rounds, args.steps,
                                    args.warmup, Path(tmp), pairs=args.pairs)
                print_steps(ALIGN_STEPS, figures, args.steps)
            if args.only in (None, "soak"):
                ok &= print_soak(soak, run_soak(runtime, soak, Path(tmp)))
            if args.only in (None, "faults"):
                faults = replace(soak, requests=args.fault_requests)
                ok &= print_faults(faults, run_faults(runtime, faults, Path(tmp)))
            if args.only == "prefix-hits":
                ok &= print_prefix_hits([(hits, run_soak(runtime, hits, Path(tmp)))
                                         for hits in HIT_SOAKS])
    except E2Error as exc:
        print(f"error: {exc}" + (f"\n  hint: {exc.hint}" if exc.hint else ""), file=sys.stderr)
        return 2
    print("PASS" if ok else "OVER TARGET")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
