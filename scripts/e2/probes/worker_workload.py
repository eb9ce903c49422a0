"""The capacity worker's workload: vLLM's real v1 Scheduler on a planned KV cache,
fed fake model outputs, measuring how many requests of total length L run at once.

Runs inside the vLLM venv beside capacity_worker.py, which imports it as a
top-level module (the script's folder is on sys.path; the venv has no e2
package): stdlib and vllm imports only.
"""

from __future__ import annotations

import copy
from typing import Any

# The output token every fake step samples; not an EOS of any zoo model.
FAKE_TOKEN = 7

# Tokens each request generates after its prompt (ignore_eos, exact length).
MAX_DECODE = 16
# Steps after which a workload that has not finished is a scheduler that stopped
# making progress.
MAX_STEPS = 200_000


def ideal_concurrency(facts: dict, budget_bytes: int, length: int, max_num_seqs: int) -> int:
    per_request = facts["state_bytes_per_request"] + length * facts["kv_bytes_per_token"]
    return min(max_num_seqs, budget_bytes // per_request)


def run_workload(vllm_config: Any, kv_cache_config: Any, length: int, count: int,
                 shared_prefix: bool, ideal: int) -> dict:
    """Submit ``count`` requests of total length ``length`` and step to completion.

    Preemptions below the ideal are those of a step that began, or was admitting,
    with fewer requests than the ideal holds: memory that should have sufficed."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    scheduler, hasher = _scheduler(vllm_config, kv_cache_config, count * length)
    decode = min(MAX_DECODE, max(1, length // 8))
    prompt_len = length - decode
    prefix_len = prompt_len // 2 if shared_prefix else 0
    params = SamplingParams(max_tokens=decode, ignore_eos=True)
    requests = []
    for i in range(count):
        # Distinct per request after the prefix; token 0 is the shared prefix.
        tokens = [0] * prefix_len + [1000 + i] * (prompt_len - prefix_len)
        requests.append(Request(request_id=f"r{i}", prompt_token_ids=tokens,
                                sampling_params=params, pooling_params=None,
                                block_hasher=hasher))
    for request in requests:
        scheduler.add_request(request)
    pool = scheduler.kv_cache_manager.block_pool
    free_at_start = pool.get_num_free_blocks()
    counts = _step_to_completion(scheduler, ideal)
    leaked = (free_at_start - pool.get_num_free_blocks()
              + _slab_blocks_outside_pages_in_use(scheduler))
    return {"requests": count, "prompt_tokens": prompt_len, "decode_tokens": decode,
            "shared_prefix_tokens": prefix_len, "steps": counts["steps"],
            "saturation": counts["peak_before_preemption"], "peak_running": counts["peak"],
            "preemptions": counts["preemptions"],
            "preemptions_below_ideal": counts["below_ideal"],
            "leaked_blocks": leaked,
            "finished": sum(1 for r in requests if r.is_finished())}


def _slab_blocks_outside_pages_in_use(scheduler: Any) -> int:
    """Blocks held among those E2's slab keeps outside whole pages (page 0's past its
    null blocks, the tail past the last page): the pool's free count never sees them,
    so a leak there is counted here (0 on stock)."""
    slab = getattr(scheduler.kv_cache_manager.coordinator, "slab_pool", None)
    return slab.num_blocks_outside_pages_in_use if slab is not None else 0


def _scheduler(vllm_config: Any, kv_cache_config: Any, tokens: int) -> tuple[Any, Any]:
    """vLLM's v1 Scheduler on copies of the configs, and the block hasher its requests
    need when prefix caching is on (else None).

    The per-step token budget is lifted to the whole workload (``tokens``):
    admission is then bounded only by the KV pool (full prompt reserved up front)
    and max_num_seqs, which is what saturation measures."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config = copy.deepcopy(vllm_config)
    config.scheduler_config.max_num_batched_tokens = tokens
    config.scheduler_config.max_num_scheduled_tokens = tokens
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, config)
    scheduler = Scheduler(vllm_config=config, kv_cache_config=copy.deepcopy(kv_cache_config),
                          structured_output_manager=StructuredOutputManager(config),
                          log_stats=False, block_size=block_size,
                          hash_block_size=hash_block_size)
    hasher = None
    if config.cache_config.enable_prefix_caching:
        init_none_hash(sha256)
        hasher = get_request_block_hasher(hash_block_size, sha256)
    return scheduler, hasher


def _step_to_completion(scheduler: Any, ideal: int) -> dict[str, int]:
    """Schedule and feed every step a fake sampled token until no request is left;
    the running counts the workload reports."""
    from vllm.v1.outputs import ModelRunnerOutput

    peak = peak_before_preemption = preemptions = below_ideal = steps = 0
    while scheduler.has_unfinished_requests():
        steps += 1
        if steps > MAX_STEPS:
            raise RuntimeError(f"workload did not finish in {MAX_STEPS} steps")
        running_before = len(scheduler.running)
        output = scheduler.schedule()
        preempted = len(output.preempted_req_ids or ())
        preemptions += preempted
        running = len(scheduler.running)
        if preempted and max(running_before, running + preempted) < ideal:
            below_ideal += preempted
        peak = max(peak, running)
        if preemptions == 0:
            peak_before_preemption = max(peak_before_preemption, running)
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = scheduler.requests[req_id]
            done_prefill = request.num_computed_tokens >= request.num_tokens
            sampled.append([FAKE_TOKEN] if done_prefill else [])
        scheduler.update_from_output(output, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
            pooler_output=[]))
    return {"steps": steps, "peak": peak, "peak_before_preemption": peak_before_preemption,
            "preemptions": preemptions, "below_ideal": below_ideal}
