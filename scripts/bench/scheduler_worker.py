"""Scheduler benchmark worker: runs inside the vLLM venv (stock, or with the e2
view first on PYTHONPATH), drives vLLM's real v1 Scheduler with fake model
outputs and reports JSON lines on the file descriptor ``--result-fd`` (vLLM
logs to stdout, so stdout is left to it). Not imported by the driver.

The KV cache is planned as the capacity probe plans it (a CUDA boot's
VllmConfig from a zoo config.json, vLLM's own ``get_kv_cache_configs``); the
functions are the capacity worker's own (worker_target.py, worker_planner.py).

* ``steps``: a saturated stream (the waiting queue never runs dry); reads
  ``{"steps": N}`` lines on stdin and answers each with the time of
  ``schedule()`` + ``update_from_output()`` of the next N steps. One process per
  side stays up, so the driver can alternate short rounds between the sides.
* ``soak``: N seeded requests arriving in bursts, with shared prefixes and
  client aborts, stepped to the end; then every request must be finished and
  the pool audited for leaked blocks, slab pages and states.
* ``faults``: the soak as is, then again with allocation refusals injected
  after prefix hits and at state block boundaries (scheduler_faults.py); every
  request must finish with the same tokens both times.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from itertools import islice
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# Appended, not prepended: neither folder may shadow a module vLLM imports.
sys.path += [str(HERE), str(HERE.parent / "e2" / "probes")]

import worker_planner  # noqa: E402
import worker_target  # noqa: E402
import worker_workload  # noqa: E402
from scheduler_workload import RequestShape, WorkloadSpec, arrivals, stream  # noqa: E402
from state_oracle import StateOracle  # noqa: E402

MAX_STEPS = 2_000_000
Send = Callable[[dict], None]  # writes one JSON line to the driver


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("steps", "soak", "faults"))
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--budget-gib", type=float, required=True)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--mamba-cache-mode", choices=("none", "align"), default="none")
    parser.add_argument("--workload", default="{}", help="WorkloadSpec fields as JSON")
    parser.add_argument("--requests", type=int, default=10_000, help="soak: request count")
    parser.add_argument("--mean-burst", type=int, default=8, help="soak: requests per burst")
    parser.add_argument("--waiting", type=int, default=64,
                        help="steps: requests kept waiting behind the running batch")
    parser.add_argument("--result-fd", type=int, required=True)
    return parser.parse_args()


# ---------------------------------------------------------------- engine side


_TARGET_EMULATED = False


def _emulate_target(model: Path) -> None:
    """vLLM's CUDA platform at the capacity probe's default capability, once."""
    global _TARGET_EMULATED
    if _TARGET_EMULATED:
        return
    config = json.loads((model / "config.json").read_text())
    worker_target.load_model_classes(config["architectures"])
    worker_target.emulate_cuda("8.6")
    _TARGET_EMULATED = True


class SchedulerHarness:
    """vLLM's Scheduler on a planned KV cache, its requests, and a fake model."""

    def __init__(self, args: argparse.Namespace, spec: WorkloadSpec,
                 check_states: bool = False) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import (
            get_request_block_hasher,
            init_none_hash,
            resolve_kv_cache_block_sizes,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        # The KV cache a CUDA boot on the RTX 3090 plans, as the capacity probe's.
        _emulate_target(Path(args.model))
        job = worker_planner.Job(
            out=Path(os.devnull), budget_gib=args.budget_gib, tp=1,
            max_num_seqs=args.max_num_seqs, max_model_len=spec.max_model_len,
            kv_dtype="auto", mamba_cache_mode=args.mamba_cache_mode, lengths=(),
            max_num_batched_tokens=args.max_num_batched_tokens)
        vllm_config, backend, _ = worker_planner.build_config(job, Path(args.model))
        specs, _ = worker_planner.build_specs(vllm_config, backend)
        kv_config, self.planner = worker_planner.plan(
            vllm_config, backend, specs, int(args.budget_gib * worker_planner.GIB))
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_config, vllm_config)
        # log_stats as an engine runs by default: usage and prefix-cache stats each step.
        self.scheduler = Scheduler(
            vllm_config=vllm_config, kv_cache_config=copy.deepcopy(kv_config),
            structured_output_manager=StructuredOutputManager(vllm_config),
            log_stats=True, block_size=block_size, hash_block_size=hash_block_size)
        self.hasher = None
        if vllm_config.cache_config.enable_prefix_caching:
            init_none_hash(sha256)
            self.hasher = get_request_block_hasher(hash_block_size, sha256)
        manager = self.scheduler.kv_cache_manager
        self.pool = manager.block_pool
        self.free_at_start = self.pool.get_num_free_blocks()
        self.requests: dict[str, Any] = {}
        self.steps = self.preemptions = 0
        # Prefix-cache tokens, new requests apart from resumed (preempted) ones:
        # a resumed request mostly hits its own blocks, so a side that preempts
        # more gets more of those without caching anything better.
        self.prefix_hit_tokens = self.prefix_queries = 0
        self.resume_hit_tokens = self.resume_queries = 0
        self.batch_sizes: list[int] = []
        # The fake model: a constant token, or (faults mode) one that follows
        # from the request's history.
        self.next_token = lambda request: worker_workload.FAKE_TOKEN
        self.scheduled_tokens: list[int] = []
        # As EngineCore does once its scheduler exists: the startup heap (the
        # pool's block objects among it) leaves the collector's oldest generation,
        # whose passes would otherwise walk every block a few times a second.
        from vllm.utils.gc_utils import freeze_gc_heap

        freeze_gc_heap()
        # With check_states (the soak and the faults) in mamba `align` mode, the
        # worker's state copies are replayed and every cached state checked.
        self.oracle = (StateOracle(self.scheduler)
                       if check_states and args.mamba_cache_mode == "align" else None)

    def add(self, shape: RequestShape) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        request = Request(
            request_id=shape.request_id, prompt_token_ids=list(shape.prompt),
            sampling_params=SamplingParams(max_tokens=shape.max_tokens, ignore_eos=True),
            pooling_params=None, block_hasher=self.hasher)
        self.requests[shape.request_id] = request
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def step(self) -> tuple[int, int]:
        """One engine step; returns the nanoseconds of schedule() + update_from_output(),
        as this thread's CPU time (what other processes' load barely moves) and wall."""
        from vllm.v1.outputs import ModelRunnerOutput

        scheduler = self.scheduler
        cpu_start, wall_start = time.thread_time_ns(), time.perf_counter_ns()
        output = scheduler.schedule()
        cpu = time.thread_time_ns() - cpu_start
        wall = time.perf_counter_ns() - wall_start
        if self.oracle is not None:
            self.oracle.before_forward(output)
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = scheduler.requests[req_id]
            done_prefill = request.num_computed_tokens >= request.num_tokens
            sampled.append([self.next_token(request)] if done_prefill else [])
        runner_output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
            pooler_output=[])
        cpu_start, wall_start = time.thread_time_ns(), time.perf_counter_ns()
        outputs = scheduler.update_from_output(output, runner_output)
        cpu += time.thread_time_ns() - cpu_start
        wall += time.perf_counter_ns() - wall_start
        if self.oracle is not None:
            self.oracle.after_step()
        self.steps += 1
        self.preemptions += len(output.preempted_req_ids or ())
        self.batch_sizes.append(len(req_ids))
        self.scheduled_tokens.append(output.total_num_scheduled_tokens)
        for engine_output in outputs.values():
            stats = engine_output.scheduler_stats
            if stats is not None and stats.prefix_cache_stats is not None:
                cache = stats.prefix_cache_stats
                self.prefix_hit_tokens += cache.hits
                self.prefix_queries += cache.queries
                self.resume_hit_tokens += cache.preempted_hits
                self.resume_queries += cache.preempted_queries
        return cpu, wall


def audit(harness: SchedulerHarness) -> dict:
    """What the pool holds once every request is done: must be nothing but idle
    pages of prefix-cached attention blocks (E2), which must reclaim fully."""
    manager = harness.scheduler.kv_cache_manager
    coordinator = manager.coordinator
    pool = harness.pool
    result: dict[str, Any] = {
        "num_pages": pool.num_gpu_blocks,
        "free_at_start": harness.free_at_start,
        "free_at_end": pool.get_num_free_blocks(),
        "leaked_blocks": harness.free_at_start - pool.get_num_free_blocks(),
        "requests_holding_blocks": sorted({
            rid for m in coordinator.single_type_managers for rid, blocks in
            m.req_to_blocks.items() if blocks}),
    }
    clean = result["leaked_blocks"] == 0 and not result["requests_holding_blocks"]
    # E2's slabs: attention blocks, and request states where packed.
    for key, name in (("slab", "slab_pool"), ("state_slab", "state_slab")):
        slab = getattr(coordinator, name, None)
        if slab is not None:
            result[key], slab_clean = _audit_slab(slab)
            # Blocks the slab keeps outside whole pages (page 0 past its null
            # blocks, the tail) are never a pool page: the pool's free count
            # misses a block left there.
            result["leaked_blocks"] += result[key]["blocks_outside_pages_in_use"]
            clean &= slab_clean
    # Then (the slab's idle pages handed back) every page but the null page is
    # free in the pool's own queue, and none holds a reference: no state leaked.
    result["blocks_in_use"] = sum(1 for b in pool.blocks if b.ref_cnt > 0 and not b.is_null)
    result["pool_queue_free"] = pool.free_block_queue.num_free_blocks
    clean &= (not result["blocks_in_use"]
              and result["pool_queue_free"] == pool.num_gpu_blocks - 1)
    result["clean"] = bool(clean)
    return result


def _audit_slab(slab: Any) -> tuple[dict, bool]:
    """A slab's pages once every request is done: each held page idle, and all
    of them handed back to the pool on reclaim."""
    k = slab.blocks_per_page
    held = sorted(slab.page_blocks)
    busy = [p for p in held if slab.free_block_queue.free_in_page[p] != k]
    in_use = sum(1 for b in slab.blocks if b.ref_cnt > 0 and not b.is_null)
    outside_in_use = slab.num_blocks_outside_pages_in_use
    reclaimed = slab.reclaim(len(held))
    detail = {
        "blocks_per_page": k,
        "blocks_in_use": in_use,
        "held_pages": len(held),
        "blocks_outside_pages": slab.num_blocks_outside_pages,
        "blocks_outside_pages_in_use": outside_in_use,
        # a held page (page 0 and the tail too) with a block in use: a leak
        "busy_held_pages": len(busy) + (1 if outside_in_use else 0),
        "reclaimed_pages": reclaimed,
        "pages_after_reclaim": len(slab.page_blocks),
    }
    clean = (not in_use and not busy and not outside_in_use and reclaimed == len(held)
             and not slab.page_blocks)
    return detail, clean


# ---------------------------------------------------------------- modes


def run_steps(args: argparse.Namespace, harness: SchedulerHarness, spec: WorkloadSpec,
              send: Send) -> None:
    shapes = stream(spec)
    send({"ready": True, "planner": harness.planner})
    for line in sys.stdin:
        count = json.loads(line)["steps"]
        cpu, wall = [], []
        for _ in range(count):
            # Top up outside the timed part: the batch stays full, requests keep waiting.
            _, waiting = harness.scheduler.get_request_counts()
            for shape in islice(shapes, max(0, args.waiting - waiting)):
                harness.add(shape)
            step_cpu, step_wall = harness.step()
            cpu.append(step_cpu)
            wall.append(step_wall)
        running, waiting = harness.scheduler.get_request_counts()
        send({"cpu_ns": cpu, "wall_ns": wall, "batch": harness.batch_sizes[-count:],
              "tokens": harness.scheduled_tokens[-count:], "running": running,
              "waiting": waiting,
              "preemptions": harness.preemptions, "usage": harness.scheduler.kv_cache_manager.usage})


def drive_soak(args: argparse.Namespace, harness: SchedulerHarness,
               spec: WorkloadSpec) -> dict:
    """The soak's requests, arriving in bursts with client aborts, stepped until
    every one is done; returns what happened to them."""
    shapes = list(islice(stream(spec), args.requests))
    arrive = arrivals(spec.seed, args.requests, args.mean_burst)
    aborts: dict[int, list[str]] = {}
    for shape, step in zip(shapes, arrive):
        if shape.abort_after is not None:
            aborts.setdefault(step + shape.abort_after, []).append(shape.request_id)
    started, cpu_started = time.monotonic(), time.process_time()
    scheduler = harness.scheduler
    next_shape = aborted = 0
    step = 0
    while next_shape < len(shapes) or scheduler.has_unfinished_requests():
        while next_shape < len(shapes) and arrive[next_shape] <= step:
            harness.add(shapes[next_shape])
            next_shape += 1
        for request_id in aborts.pop(step, ()):
            if not harness.requests[request_id].is_finished():
                harness.abort(request_id)
                aborted += 1
        if scheduler.has_unfinished_requests():
            harness.step()
        step += 1
        if step > MAX_STEPS:
            raise RuntimeError(f"the soak did not finish in {MAX_STEPS} steps")
    seconds, cpu_seconds = time.monotonic() - started, time.process_time() - cpu_started
    unfinished = [r for r, req in harness.requests.items() if not req.is_finished()]
    short = [r for r, req in harness.requests.items()
             if req.is_finished() and req.status.name == "FINISHED_LENGTH_CAPPED"
             and req.num_output_tokens != req.max_tokens]
    return {"requests": len(shapes), "finished": len(shapes) - len(unfinished),
            "unfinished": unfinished[:20], "aborted": aborted, "wrong_length": short[:20],
            "steps": harness.steps, "preemptions": harness.preemptions,
            "prefix_hit_tokens": harness.prefix_hit_tokens,
            "prefix_query_tokens": harness.prefix_queries,
            "resume_hit_tokens": harness.resume_hit_tokens,
            "resume_query_tokens": harness.resume_queries,
            "prompt_tokens": sum(len(s.prompt) for s in shapes),
            "max_batch": max(harness.batch_sizes, default=0),
            "states": harness.oracle.counts.as_dict() if harness.oracle else None,
            "seconds": round(seconds, 2), "cpu_seconds": round(cpu_seconds, 2)}


def run_soak(args: argparse.Namespace, harness: SchedulerHarness, spec: WorkloadSpec,
             send: Send) -> None:
    result = drive_soak(args, harness, spec)
    send({**result, "audit": audit(harness), "planner": harness.planner})


def same_tokens(one: tuple[list[int], bool], other: tuple[list[int], bool]) -> bool:
    """Equal outputs; a request the client aborted (at a fixed step, which the
    faults' retries shift) needs only agree on the tokens both runs made."""
    (tokens, aborted), (other_tokens, other_aborted) = one, other
    if aborted or other_aborted:
        common = min(len(tokens), len(other_tokens))
        return tokens[:common] == other_tokens[:common]
    return tokens == other_tokens


def run_faults(args: argparse.Namespace, harness: SchedulerHarness, spec: WorkloadSpec,
               send: Send) -> None:
    """The soak twice, as is and with allocation refusals (scheduler_faults.py);
    the fake model's tokens follow each request's history, so a resume that
    lost or repeated a token shows as a different output."""
    from scheduler_faults import AllocationFaults, history_token

    outputs = {}
    runs = {}
    for run in ("as_is", "faults"):
        if run == "faults":
            harness = SchedulerHarness(args, spec, check_states=True)
            faults = AllocationFaults.install(harness.scheduler)
        harness.next_token = history_token
        runs[run] = drive_soak(args, harness, spec)
        runs[run]["audit"] = audit(harness)
        outputs[run] = {r: (list(req.output_token_ids), req.status.name == "FINISHED_ABORTED")
                        for r, req in harness.requests.items()}
    differ = sorted(r for r in outputs["as_is"]
                    if not same_tokens(outputs["as_is"][r], outputs["faults"][r]))
    send({"runs": runs, "differing_outputs": differ[:20], "num_differing": len(differ),
          "output_tokens": sum(len(tokens) for tokens, _ in outputs["as_is"].values()),
          "refusals": {"after_prefix_hit": faults.after_prefix_hit,
                       "at_state_boundary": faults.at_state_boundary},
          "state_block_size": faults.state_block_size, "planner": harness.planner})


def main() -> int:
    args = _parse()
    result = os.fdopen(args.result_fd, "w", buffering=1)

    def send(payload: dict) -> None:
        result.write(json.dumps(payload) + "\n")

    try:
        import vllm

        spec = WorkloadSpec(**json.loads(args.workload))
        harness = SchedulerHarness(args, spec, check_states=args.mode != "steps")
        send({"vllm_file": vllm.__file__, "pool": type(harness.pool).__name__})
        modes = {"steps": run_steps, "soak": run_soak, "faults": run_faults}
        modes[args.mode](args, harness, spec, send)
    except Exception as exc:  # noqa: BLE001 - reported to the driver, with the trace
        send({"error": f"{type(exc).__name__}: {exc}",
              "traceback": traceback.format_exc()[-4000:]})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
