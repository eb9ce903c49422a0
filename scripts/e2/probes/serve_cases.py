"""The serve probe's cases and how one side runs them.

The cases come from what the engine itself reports (its block size and KV
capacity): prompts of block-1, block and block+1 tokens for the engine's block
and the kernel blocks below it; two requests sharing a long prefix (a
prefix-cache hit); more concurrent requests than the KV pool holds
(preemption and resume). Greedy, fixed ``max_tokens``, ``ignore_eos``;
prompts are token ids.

The align mode's cases (build_align_cases) run on the align geometry with
prefills chunked by the token budget: long prompts whose chunks and ends fall
off the state block, alone and beside short requests, then siblings that
resume from the states those prefills cached.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import asdict, dataclass

from e2 import console
from e2.probes.engines import Engine, Runner
from e2.probes.serve_gate import (
    FP8_CASES,
    GATE_MODES,
    GATE_QUEUE_GAP_S,
    GATE_VOCAB,
    REFERENCE_MODES,
    log_errors,
    scaled,
)
from e2.probes.serve_metrics import inspect_engine, metrics
from e2.probes.serve_settings import (
    ALIGN_BATCHED_TOKENS,
    ALIGN_MAX_MODEL_LEN,
    CPU_ASYNC_SKIP,
    GATE_FP8_CPU_SKIP,
    GEOMETRY,
    HOLD_S,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    MAX_TOKENS,
    MODES,
    QUEUE_GAP_S,
    SEED,
    SERVED_NAME,
    TOP_LOGPROBS,
    VOCAB,
)


@dataclass
class Case:
    name: str
    what: str
    prompts: list[list[int]]
    max_tokens: int
    concurrent: bool = False
    expect: str | None = None           # prefix_hits | preemptions: the path it must take
    gap: float = QUEUE_GAP_S            # seconds between a concurrent case's requests


def _tokens(rng: random.Random, n: int, vocab: int = VOCAB) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def edge_blocks(block: int) -> list[int]:
    """The block sizes whose edges the cases probe: the engine's, and the kernel
    block sizes below it (powers of two from 256 down to 16), where E2's
    natural attention block lies (16 with FlashAttention, 32 on the CPU)."""
    return [block] + [size for size in (256, 128, 64, 32, 16) if size < block]


def build_cases(block: int, capacity: int, max_model_len: int = MAX_MODEL_LEN,
                seed: int = SEED) -> list[Case]:
    """The cases for a stock engine with this block size and KV capacity (tokens);
    both sides run the same ones."""
    rng = random.Random(seed)
    cases = []
    for edge in edge_blocks(block):
        name = "len-block" if edge == block else f"len-{edge}"
        cases += [Case(f"{name}{d:+d}".replace("+0", ""), f"one prompt of {edge + d} tokens "
                       f"(block {edge}{d:+d})".replace("+0)", ")"), [_tokens(rng, edge + d)],
                       MAX_TOKENS) for d in (-1, 0, 1)]
    prefix_len = min(3 * block, max_model_len // 2)
    prefix = _tokens(rng, prefix_len)
    cases.append(Case("shared-prefix", f"two requests, one after the other, sharing a "
                      f"{prefix_len}-token prefix", [prefix + _tokens(rng, 7),
                                                     prefix + _tokens(rng, 9)],
                      MAX_TOKENS, expect="prefix_hits"))
    # Outputs of half a block: stock and E2 batch these requests differently (E2
    # preempts less), and a long bf16 greedy decode can flip a near-tie token
    # with the batch it ran in.
    prompt = min(block, max_model_len // 4)
    out = min(block // 2, max_model_len // 2)
    # Four times the pool, so stock preempts and resumes.
    count = min(MAX_NUM_SEQS, max(4, math.ceil(4 * capacity / (prompt + out)) + 1))
    cases.append(Case("oversubscribed", f"{count} concurrent requests of {prompt}+{out} tokens "
                      f"against a {capacity}-token KV pool", [_tokens(rng, prompt)
                                                              for _ in range(count)],
                      out, concurrent=True, expect="preemptions"))
    # Requests far shorter than the engine's block: stock rounds each one's
    # attention up to a whole block, E2 takes natural blocks, so at this budget
    # E2 runs more of them at once. Their outputs are half their prompts: the
    # sides batch them differently by design, and where bf16 kernels sum in an
    # order that follows the batch (AMX, AVX512-BF16), stock's own greedy
    # tokens move with it (16+16 on such a CPU: stock at 12 MB and at 64 MB part
    # at request 30's 14th token, where E2 agrees with stock at 64 MB).
    short = max(4, block // 8)
    cases.append(Case("oversubscribed-short", f"{MAX_NUM_SEQS} concurrent requests of "
                      f"{short}+{short // 2} tokens against a {capacity}-token KV pool",
                      [_tokens(rng, short) for _ in range(MAX_NUM_SEQS)], short // 2,
                      concurrent=True, expect="more_running"))
    return cases


def _siblings(rng: random.Random, prefix: list[int], cuts: list[int]) -> list[list[int]]:
    """``prefix`` less its last ``cut`` tokens, then as many fresh ones, for each cut."""
    return [prefix[:len(prefix) - cut] + _tokens(rng, cut) for cut in cuts]


def build_align_cases(block: int, budget: int = ALIGN_BATCHED_TOKENS,
                      max_model_len: int = ALIGN_MAX_MODEL_LEN, seed: int = SEED) -> list[Case]:
    """The align mode's cases for a stock engine with this block size: prompts of
    two budgets and a third (prefilled in three chunks or more, the last ending
    inside a block), then their siblings, which share all but a tail of 9 to
    400 tokens and so resume from whichever state each engine kept below it."""
    rng = random.Random(seed + 1)
    length = min(2 * budget + budget // 3 + 5, max_model_len - MAX_TOKENS)
    if length <= block:
        raise ValueError(f"align cases: a {length}-token prompt is not longer than "
                         f"stock's block of {block}")
    alone, beside = _tokens(rng, length), _tokens(rng, length)
    short = [_tokens(rng, 32) for _ in range(8)]
    cuts = [9, 40, 150, 400]
    return [
        Case("align-chunked", f"one prompt of {length} tokens, prefilled in chunks of at "
             f"most {budget}", [alone], MAX_TOKENS),
        Case("align-siblings", f"{len(cuts)} requests, one after the other, sharing all but "
             f"the last {'/'.join(map(str, cuts))} tokens of that prompt",
             _siblings(rng, alone, cuts), MAX_TOKENS, expect="prefix_hits"),
        Case("align-beside-decodes", f"a {length}-token prompt beside {len(short)} of 32 "
             "tokens: its chunks share the budget with their prefills and decodes",
             [beside, *short], MAX_TOKENS, concurrent=True),
        Case("align-siblings-concurrent", "8 requests at once sharing all but the last "
             "5 to 292 tokens of that prompt", _siblings(rng, beside, [5 + 41 * k
                                                                     for k in range(8)]),
             MAX_TOKENS, concurrent=True, expect="prefix_hits"),
    ]


def _gate_tokens(rng: random.Random, n: int) -> list[int]:
    return _tokens(rng, n, GATE_VOCAB)


def build_gate_cases(scale: float = 1.0, seed: int = SEED, mode: str = "gate") -> list[Case]:
    """The gate's cases (serve_gate), the same on every engine: token ids below
    Qwen3.5's special ones, prompt lengths times ``scale``."""
    rng = random.Random(seed + 2)
    long_prompt = _gate_tokens(rng, scaled(3000, scale))
    prefix = _gate_tokens(rng, scaled(1800, scale))
    short = [_gate_tokens(rng, scaled(16 + k, scale)) for k in range(32)]
    family = [prefix + _gate_tokens(rng, scaled(60 + 47 * k, scale)) for k in range(8)]
    siblings = [prefix + _gate_tokens(rng, scaled(25 + 61 * k, scale)) for k in range(8)]
    cases = [
        Case("gate-repeat", f"one prompt of {len(long_prompt)} tokens sent 4 times, one "
             "after the other", [long_prompt] * 4, MAX_TOKENS, expect="prefix_hits"),
        Case("gate-beside-decodes", f"{len(short)} short prompts ({len(short[0])} to "
             f"{len(short[-1])} tokens) decoding while 8 prompts sharing a "
             f"{len(prefix)}-token prefix prefill", [*short, *family], MAX_TOKENS,
             concurrent=True, gap=GATE_QUEUE_GAP_S),
        Case("gate-siblings", f"8 requests at once sharing that {len(prefix)}-token prefix, "
             "new tails", siblings, MAX_TOKENS, concurrent=True, expect="prefix_hits",
             gap=GATE_QUEUE_GAP_S),
        Case("gate-mixed", "64 requests at once: 16 siblings of the long prompt, 16 of the "
             "shared prefix, 32 fresh prompts of 8 tokens to "
             f"{scaled(2500, scale)}", _mixed(rng, long_prompt, prefix, scale), MAX_TOKENS,
             concurrent=True, expect="prefix_hits", gap=GATE_QUEUE_GAP_S),
    ]
    return [c for c in cases if mode != "gate-fp8" or c.name in FP8_CASES]


def _mixed(rng: random.Random, long_prompt: list[int], prefix: list[int],
           scale: float) -> list[list[int]]:
    cut = [long_prompt[:len(long_prompt) - scaled(10 + 93 * k, scale)] for k in range(16)]
    of_long = [p + _gate_tokens(rng, len(long_prompt) - len(p)) for p in cut]
    of_prefix = [prefix + _gate_tokens(rng, scaled(5 + 113 * k, scale)) for k in range(16)]
    fresh = [_gate_tokens(rng, max(8, scaled(2500, scale) * k // 31)) for k in range(32)]
    prompts = of_long + of_prefix + fresh
    rng.shuffle(prompts)
    return prompts


def _body(prompt: list[int] | list[list[int]], max_tokens: int,
          logprobs: bool = False) -> dict:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    if logprobs:
        body |= {"logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True}
    return body


def top_logprobs(choice: dict) -> list[list[list[float]]] | None:
    """Each output position's top tokens as [token id, logprob] pairs."""
    logprobs = choice.get("logprobs") or {}
    tops = logprobs.get("top_logprobs")
    if not tops:
        return None
    return [[[int(token.removeprefix("token_id:")), round(lp, 4)]
             for token, lp in (top or {}).items()] for top in tops]


# How often the concurrent case reads the engine's running-requests gauge.
RUNNING_POLL_S = 0.05


@dataclass
class RunningSamples:
    """``vllm:num_requests_running`` read through a case by the client that posts it
    (inside the container on the Docker path): its peak. Readings can miss steps, so
    the peak is a floor; the mean comes from the engine's own step counters
    (requests_per_step), not from readings, whose spacing follows timing."""

    values: list[int]

    @property
    def peak(self) -> int:
        return max(self.values, default=0)


def requests_per_step(generated_tokens: int, engine_steps: int) -> float:
    """Requests an engine step ran, on average over a case: every scheduled request
    samples one token a step (prompts fit in one step here, a resumed one included),
    so tokens generated over steps taken. The schedule is held to be the same on
    every run, so unlike the running gauge's readings this does not follow timing."""
    return round(generated_tokens / engine_steps, 2) if engine_steps else 0.0


def run_case(engine: Engine, case: Case) -> dict:
    before = metrics(engine)
    started = time.monotonic()
    running: RunningSamples | None = None
    if case.concurrent:
        # Concurrent requests, held at a paused engine until all are queued: otherwise
        # they land in the engine's steps by timing, the schedule (and with it the
        # preemptions) differs from run to run, and bf16 numerics follow the batch.
        posted = engine.post_all([_body(p, case.max_tokens, logprobs=True)
                                  for p in case.prompts], hold=HOLD_S, poll=RUNNING_POLL_S,
                                 gap=case.gap)
        answers, running = posted["answers"], RunningSamples(posted["running"])
        pairs = [(a, (a.get("choices") or [{}])[0]) for a in answers]
    else:
        pairs = []
        for prompt in case.prompts:
            answer = engine.post_all([_body(prompt, case.max_tokens)])["answers"][0]
            pairs.append((answer, (answer.get("choices") or [{}])[0]))
    seconds = round(time.monotonic() - started, 2)
    after = metrics(engine)
    requests = []
    for prompt, (answer, choice) in zip(case.prompts, pairs):
        ids = choice.get("token_ids")
        requests.append({"prompt_tokens": len(prompt), "token_ids": ids,
                         "finish_reason": choice.get("finish_reason"),
                         "error": answer.get("error") or (None if ids is not None
                                                          else "no token_ids in the answer")})
        if case.concurrent:
            requests[-1]["top_logprobs"] = top_logprobs(choice)

    def delta(name: str) -> int:
        return int(after.get(name, 0.0) - before.get(name, 0.0))

    return {"case": case.name, "seconds": seconds, "requests": requests,
            "prefix_cache_hits": delta("vllm:prefix_cache_hits_total"),
            "prefix_cache_queries": delta("vllm:prefix_cache_queries_total"),
            "preemptions": delta("vllm:num_preemptions_total"),
            "peak_running": running.peak if running else None,
            "mean_running": requests_per_step(delta("vllm:generation_tokens_total"),
                                              delta("vllm:iteration_tokens_total_count"))
            if running else None}


def run_side(runner: Runner, side: str, plans: dict[str, dict],
             modes: tuple[str, ...] = MODES, gate_scale: float = 1.0) -> dict:
    """The modes asked for (all by default) on one side: its engines' reports and
    each case's outputs. E2's align and gate modes run their cases twice, the
    second time with prefix caching off (``no_prefix_caching``): the reference
    its tokens must match.

    ``plans`` holds, per model geometry, the block size and KV capacity the
    cases are built for: the first engine started on it fills it, so both sides
    run the same prompts even where E2's blocks differ from stock's. The gate's
    cases are fixed (serve_gate), their prompts scaled by ``gate_scale``."""
    result: dict = {"modes": {}}
    for mode in modes:
        if mode == "gate-fp8" and runner.on_cpu:
            result["modes"][mode] = {"skipped": GATE_FP8_CPU_SKIP}
            continue
        plan = plans.setdefault(GEOMETRY.get(mode, mode), {"scale": gate_scale})
        entry = _run_engine(runner, side, mode, plan, result)
        if mode in REFERENCE_MODES and side == "e2":
            entry["no_prefix_caching"] = _run_engine(runner, side, mode, plan, result,
                                                     prefix_caching=False)
        result["modes"][mode] = entry
    return result


def _run_engine(runner: Runner, side: str, mode: str, plan: dict, result: dict,
                prefix_caching: bool = True) -> dict:
    label = f"{side} {mode}" + ("" if prefix_caching else " (no prefix caching)")
    with contextlib.ExitStack() as stack:
        with console.status(f"{label}: starting the engine"):
            engine = stack.enter_context(runner.start(side, mode, prefix_caching))
        info = inspect_engine(engine)
        console.info(f"{label}: healthy in {info.boot_s:.0f}s; block {info.block_size}, "
                     f"{info.kv_line}; async scheduling resolved: {info.async_resolved}")
        entry: dict = {"engine": asdict(info)}
        if "device" not in result and (device := runner.device(engine)):
            result["device"] = device
        if mode == "async" and info.async_resolved is not True:
            entry["skipped"] = _async_skip_reason(runner, info.async_resolved)
            console.info(f"{side} async: the engine resolved async_scheduling="
                         f"{info.async_resolved}; async cases {entry['skipped']}")
            return entry
        if mode in GATE_MODES:
            cases = build_gate_cases(plan["scale"], mode=mode)
        else:
            plan.setdefault("block", info.block_size)
            plan.setdefault("capacity", info.kv_capacity_tokens)
            cases = (build_align_cases(plan["block"]) if mode == "align"
                     else build_cases(plan["block"], plan["capacity"]))
        entry["cases"] = _run_cases(engine, cases)
        if mode in GATE_MODES:
            entry["log_errors"] = log_errors(engine.log())
        return entry


def _async_skip_reason(runner: Runner, resolved: bool | None) -> str:
    if resolved is None:
        return "not run: the engine's resolved config could not be read"
    if runner.on_cpu:
        return CPU_ASYNC_SKIP
    return "not run: the engine turned async scheduling off"


def _run_cases(engine: Engine, cases: list[Case]) -> dict[str, dict]:
    results = {}
    for case in cases:
        with console.status(f"{engine.side} {engine.mode}: {case.name}"):
            results[case.name] = {**run_case(engine, case), "what": case.what,
                                  "max_tokens": case.max_tokens, "expect": case.expect}
    return results
