"""The scheduler benchmark's own logic: the seeded workload both sides replay, and
the paired step-time ratio. Plain Python; the vLLM side is in test_scheduler_bench."""

from __future__ import annotations

import sys
from itertools import islice
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
from scheduler_workload import (  # noqa: E402
    PREFIX_TOKENS,
    SUFFIX_TOKENS,
    WorkloadSpec,
    arrivals,
    prefixes,
    step_ratio,
    stream,
)


def take(spec: WorkloadSpec, n: int):
    return list(islice(stream(spec), n))


def test_stream_is_a_function_of_the_seed():
    spec = WorkloadSpec(seed=3, abort_share=0.1)
    assert take(spec, 200) == take(WorkloadSpec(seed=3, abort_share=0.1), 200)
    assert take(spec, 200) != take(WorkloadSpec(seed=4, abort_share=0.1), 200)
    assert [r.request_id for r in take(spec, 3)] == ["r0", "r1", "r2"]


def test_lengths_stay_in_bounds_and_fit_the_model():
    spec = WorkloadSpec(seed=1, prompt_min=16, prompt_max=1024, decode_min=4,
                        decode_max=64, prefix_min=32, prefix_max=2000, max_model_len=2048)
    requests = take(spec, 2000)
    assert all(16 <= len(r.prompt) <= 1024 for r in requests)
    assert all(4 <= r.max_tokens <= 64 for r in requests)
    assert all(len(r.prompt) + r.max_tokens <= spec.max_model_len for r in requests)
    # Without prefixes, log-uniform: more short prompts than long, both ends reached.
    plain = [len(r.prompt) for r in requests if r.prefix_id is None]
    assert sum(n < 128 for n in plain) > 2 * sum(n >= 512 for n in plain)
    assert min(plain) < 20 and max(plain) > 1000


def test_shared_prefixes_are_the_only_common_tokens():
    spec = WorkloadSpec(seed=2, num_prefixes=4, prefix_share=0.5)
    shared = prefixes(spec)
    requests = take(spec, 1000)
    with_prefix = [r for r in requests if r.prefix_id is not None]
    assert 400 < len(with_prefix) < 600
    for request in with_prefix:
        head = shared[request.prefix_id][:len(request.prompt) - 1]
        assert request.prompt[:len(head)] == head
        assert len(request.prompt) > len(head)   # a token of its own after the prefix
        assert all(t in SUFFIX_TOKENS for t in request.prompt[len(head):])
    assert all(t in PREFIX_TOKENS for p in shared for t in p)
    assert all(t in SUFFIX_TOKENS for r in requests if r.prefix_id is None for t in r.prompt)
    # Every prefix is used by many requests: hits, not one-offs.
    assert {r.prefix_id for r in with_prefix} == set(range(4))


def test_aborts_follow_their_share():
    assert all(r.abort_after is None for r in take(WorkloadSpec(seed=0), 500))
    aborted = [r for r in take(WorkloadSpec(seed=0, abort_share=0.1), 2000) if r.abort_after
               is not None]
    assert 120 < len(aborted) < 280
    assert all(0 <= r.abort_after <= 64 for r in aborted)


@pytest.mark.parametrize("fields, message", [
    (dict(prompt_max=8000, decode_max=500, max_model_len=8192), "exceeds max_model_len"),
    (dict(prompt_min=0), "prompt lengths"),
    (dict(decode_min=5, decode_max=4), "decode lengths"),
    (dict(prefix_share=1.5), "fractions"),
])
def test_bad_workload_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        WorkloadSpec(**fields)


def test_arrivals_come_in_bursts_with_lulls():
    steps = arrivals(seed=0, count=10_000, mean_burst=8)
    assert len(steps) == 10_000
    assert steps == sorted(steps) and steps[0] == 0
    gaps = [b - a for a, b in zip(steps, steps[1:]) if b != a]
    assert max(gaps) >= 300 and min(gaps) >= 1
    assert arrivals(seed=0, count=100, mean_burst=8) == steps[:100]


def test_step_ratio_pairs_steps():
    stock = [[1.0, 2.0, 4.0], [8.0, 1.0, 2.0]]
    e2 = [[1.1, 2.2, 4.4], [8.8, 1.1, 2.2]]
    figures = step_ratio(stock, e2)
    assert figures["ratio"] == pytest.approx(1.1)
    assert figures["stock_median"] == pytest.approx(2.0)
    assert figures["steps"] == 6 and figures["rounds"] == 2
    # Pairing: the steps vary 8x, yet each E2 step is 10% over its stock twin.
    assert figures["round_ratio_min"] == pytest.approx(1.1)


def test_step_ratio_shrugs_off_a_burst_of_load():
    stock = [[10.0] * 9 + [10.0]]
    e2 = [[10.3] * 9 + [90.0]]   # one step hit by another process
    assert step_ratio(stock, e2)["ratio"] == pytest.approx(1.03)


@pytest.mark.parametrize("stock, e2", [
    ([[1.0]], [[1.0], [1.0]]),
    ([[1.0, 2.0]], [[1.0]]),
    ([[]], [[]]),
    ([], []),
])
def test_step_ratio_refuses_unpaired_rounds(stock, e2):
    with pytest.raises(ValueError):
        step_ratio(stock, e2)
