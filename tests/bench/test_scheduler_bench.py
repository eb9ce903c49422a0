"""The scheduler benchmark on the real vLLM venv, stock and E2 (the e2 view of
overlay/): a short soak finishes clean on both sides after preempting and
hitting the prefix cache, allocations refused after prefix hits and at state
block boundaries retry to the same tokens, the audit sees a leak when one is
left, the step benchmark pairs its steps and, in `align` mode, times them
unpaired. Each side's process boots in about half a minute."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"
sys.path.insert(0, str(BENCH))
import bench_scheduler  # noqa: E402
import scheduler_report  # noqa: E402
from bench_scheduler import SIDES, Soak, StepBench, Worker  # noqa: E402
from scheduler_workload import WorkloadSpec  # noqa: E402

SOAK = Soak(requests=300, workload=WorkloadSpec(seed=5, abort_share=0.05))

# Run in the venv: a few requests left running, then aborted, then (E2) a slab
# block taken that no request owns. The audit must call the first and last dirty.
AUDIT_PROBE = """
import argparse, json, sys
from itertools import islice
from pathlib import Path
sys.path.append(sys.argv[1])
import scheduler_worker as w
from scheduler_workload import WorkloadSpec, stream
args = argparse.Namespace(model=Path(sys.argv[2]), budget_gib=1.0, max_num_seqs=256,
                          max_num_batched_tokens=8192, mamba_cache_mode="align")
spec = WorkloadSpec(seed=0)
harness = w.SchedulerHarness(args, spec)
for shape in islice(stream(spec), 4):
    harness.add(shape)
for _ in range(3):
    harness.step()
report = {"running": w.audit(harness)}
for request_id in list(harness.requests):
    harness.abort(request_id)
report["aborted"] = w.audit(harness)
slab = getattr(harness.scheduler.kv_cache_manager.coordinator, "slab_pool", None)
if slab is not None:
    slab.get_new_blocks(1)
    report["stray_slab_block"] = w.audit(harness)
Path(sys.argv[3]).write_text(json.dumps(report))
"""


@pytest.fixture(scope="module")
def runtime(upstream_cache, cache):
    return bench_scheduler.make_runtime(cache)


@pytest.fixture(scope="module")
def soak(runtime, tmp_path_factory) -> dict[str, dict]:
    logs = tmp_path_factory.mktemp("soak")
    extra = ["--requests", str(SOAK.requests), "--mean-burst", str(SOAK.mean_burst)]

    def one(side: str) -> dict:
        worker = Worker(runtime, side, "soak", SOAK, logs, extra)
        try:
            assert worker.receive()["pool"] == ("PagePool" if side == "e2" else "BlockPool")
            return worker.receive()
        finally:
            worker.close()

    with ThreadPoolExecutor(2) as pool:  # both at once: only the outcome is checked here
        return dict(zip(SIDES, pool.map(one, SIDES)))


@pytest.mark.parametrize("side", SIDES)
def test_short_soak_finishes_clean(soak, side):
    result = soak[side]
    assert scheduler_report.soak_problems(side, result) == []
    assert result["finished"] == result["requests"] == SOAK.requests
    # It exercised what it claims to: preemption, prefix hits, client aborts.
    # E2 admits with the room its requests will take: it preempts no more than
    # stock does (here, not at all), so stock carries the preemption path.
    if side == "stock":
        assert result["preemptions"] > 0
    else:
        assert result["preemptions"] <= soak["stock"]["preemptions"]
    assert result["prefix_hit_tokens"] > 0
    # Resumed requests hit their own blocks: counted apart, only stock has many.
    if side == "stock":
        assert result["resume_hit_tokens"] > 0
    else:
        # 256-token align checkpoints find more of the shared prefixes than
        # stock's 544-token ones, in less memory for attention.
        assert result["prefix_hit_tokens"] >= soak["stock"]["prefix_hit_tokens"]
    assert result["aborted"] > 0
    audit = result["audit"]
    assert audit["leaked_blocks"] == 0 and audit["blocks_in_use"] == 0
    attention = [g for g in result["planner"]["groups"] if g["kind"] == "FullAttentionSpec"]
    if side == "e2":
        assert attention[0]["block_size"] == 16      # natural blocks: the slab is on
        assert audit["slab"]["pages_after_reclaim"] == 0
        assert audit["slab"]["busy_held_pages"] == 0
    else:
        assert attention[0]["block_size"] == 544     # upstream's aligned block
        assert "slab" not in audit


@pytest.fixture(scope="module")
def audit_probe(runtime, tmp_path_factory) -> dict[str, dict]:
    scratch = tmp_path_factory.mktemp("audit")
    model = bench_scheduler.ZOO / "Qwen3.5-0.8B"

    def one(side: str) -> dict:
        out = scratch / f"{side}.json"
        done = subprocess.run([str(runtime.python), "-c", AUDIT_PROBE, str(BENCH), str(model),
                               str(out)], env=runtime.env(side), cwd=scratch,
                              capture_output=True, text=True, timeout=600)
        assert out.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
        return json.loads(out.read_text())

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(SIDES, pool.map(one, SIDES)))


@pytest.mark.parametrize("side", SIDES)
def test_audit_sees_requests_still_holding_blocks(audit_probe, side):
    running = audit_probe[side]["running"]
    assert not running["clean"]
    assert running["leaked_blocks"] > 0
    assert running["requests_holding_blocks"]
    assert audit_probe[side]["aborted"]["clean"]


def test_audit_sees_a_stray_slab_block(audit_probe):
    assert "stray_slab_block" not in audit_probe["stock"]
    stray = audit_probe["e2"]["stray_slab_block"]
    assert not stray["clean"]
    assert stray["slab"]["busy_held_pages"] == 1
    assert stray["slab"]["blocks_in_use"] == 1
    assert stray["leaked_blocks"] == 1


def test_step_bench_pairs_the_two_sides(runtime, tmp_path):
    figures = bench_scheduler.run_steps(runtime, StepBench(), rounds=2, steps=4, warmup=10,
                                        log_dir=tmp_path, pairs=2)
    # two fresh pairs of workers, their rounds pooled
    assert figures["steps"] == 16 and figures["rounds"] == 4
    assert len(figures["pair_ratios"]) == 2
    assert figures["batch"] > 0
    assert figures["stock_median"] > 0 and figures["e2_median"] > 0
    assert 0.2 < figures["ratio"] < 5


def test_align_step_bench_times_unpaired_steps(runtime, tmp_path):
    """In `align` mode the sides chunk prefills at their own state blocks: the
    pairing check would refuse the run, so the ratio is of the medians."""
    figures = bench_scheduler.run_steps(runtime, bench_scheduler.ALIGN_STEPS, rounds=2,
                                        steps=4, warmup=10, log_dir=tmp_path)
    assert not bench_scheduler.ALIGN_STEPS.paired and StepBench().paired
    assert figures["steps"] == 8 and figures["pair_ratios"] == [figures["ratio"]]
    assert figures["ratio"] == pytest.approx(figures["e2_median"] / figures["stock_median"])
    assert figures["batch"] > 0
    assert min(figures["tokens"].values()) >= figures["batch"]


@pytest.fixture(scope="module")
def faults(runtime, tmp_path_factory) -> dict[str, dict]:
    return bench_scheduler.run_faults(runtime, SOAK, tmp_path_factory.mktemp("faults"))


@pytest.mark.parametrize("side", SIDES)
def test_refused_allocations_retry_to_the_same_tokens(faults, side):
    result = faults[side]
    assert scheduler_report.fault_problems(side, result) == []
    as_is, refused = result["runs"]["as_is"], result["runs"]["faults"]
    assert as_is["finished"] == refused["finished"] == SOAK.requests
    # Both moments were hit, each refusal taken by the scheduler's retry path:
    # a waiting request stays waiting, a running one costs a preemption.
    assert result["refusals"]["after_prefix_hit"] > 0
    assert result["refusals"]["at_state_boundary"] > 0
    if side == "e2":  # E2 barely preempts as is: the refusals' preemptions show
        assert refused["preemptions"] > as_is["preemptions"]
    # The fake model's tokens follow each request's history: the same tokens
    # mean no request lost or repeated one on its way through the retries.
    assert result["output_tokens"] > SOAK.requests
    assert result["num_differing"] == 0
    assert result["state_block_size"] == (256 if side == "e2" else 544)
