"""What the scheduler benchmark prints of its results, and what fails a run:
the step ratio over its target, a side's soak or fault run that did not come
out clean. Each side's results come keyed by side, stock first."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench_scheduler import Soak, StepBench

STEP_TARGET = 1.05


def fault_problems(side: str, result: dict) -> list[str]:
    """Why a side failed the fault run; empty when every refusal kind happened
    and every request came out as in the run without faults, pool clean."""
    problems = [problem for run in result["runs"].values()
                for problem in soak_problems(side, run)]
    for kind, count in result["refusals"].items():
        if not count:
            problems.append(f"{side}: no allocation was refused {kind.replace('_', ' ')}")
    if result["num_differing"]:
        problems.append(f"{side}: {result['num_differing']} requests' tokens differ from the "
                        f"run without faults (first: {', '.join(result['differing_outputs'])})")
    return problems


def soak_problems(side: str, result: dict) -> list[str]:
    """Why a side's soak failed; empty when it passed."""
    problems = []
    if result["finished"] != result["requests"]:
        problems.append(f"{side}: {result['requests'] - result['finished']} requests never "
                        f"finished (first: {', '.join(result['unfinished'])})")
    if result["wrong_length"]:
        problems.append(f"{side}: requests finished with the wrong number of tokens: "
                        f"{', '.join(result['wrong_length'])}")
    if not result["audit"]["clean"]:
        problems.append(f"{side}: the pool is not back to its start: "
                        f"{json.dumps(result['audit'])}")
    states = result.get("states")
    if states and (states["distinct_wrong"] or states["wrong_resumes"]):
        problems.append(f"{side}: {states['distinct_wrong']} cached states hold another "
                        f"token count's state, {states['wrong_resumes']} chunks resumed from "
                        f"a wrong state (first: {'; '.join(states['examples'][:3])})")
    return problems


def states_line(result: dict) -> str:
    """What the state oracle saw of a soak (align mode), or nothing."""
    states = result.get("states")
    if not states:
        return ""
    return (f"; states: {states['distinct_wrong']} cached ones wrong of "
            f"{states['cached_checked']:,} checks, {states['wrong_resumes']} wrong resumes "
            f"in {states['chunks']:,} chunks")


def print_steps(bench: StepBench, figures: dict, steps: int) -> bool:
    """The step figures; False when a paired ratio misses its target (the
    unpaired `align` figure has none)."""
    ok = figures["ratio"] <= STEP_TARGET or not bench.paired
    pairs = len(figures["pair_ratios"])
    print(f"scheduler step, {bench.model}, {bench.budget_gib:g} GiB, {bench.max_num_seqs} seqs, "
          f"mamba cache {bench.mamba_cache_mode}, saturated; {pairs} worker pair"
          f"{'s' if pairs > 1 else ''}, {figures['rounds'] // pairs} rounds of {steps} steps "
          "a side each, interleaved")
    wall = figures["wall"]
    print(f"  stock  schedule+update  {figures['stock_median']:6.2f} ms CPU/step (median; "
          f"wall {wall['stock_median']:.2f})   (baseline)")
    target = f"target <= {STEP_TARGET}" if bench.paired else "no target"
    print(f"  e2     schedule+update  {figures['e2_median']:6.2f} ms CPU/step (median; "
          f"wall {wall['e2_median']:.2f})   ratio {figures['ratio']:.3f} ({target})")
    tokens = figures["tokens"]
    if bench.paired:
        print(f"         the ratio is the median of {figures['steps']} paired steps' ratios "
              f"(batch {figures['batch']:.0f} on both, ", end="")
    else:
        print(f"         the ratio is of the medians of {figures['steps']} steps a side, which "
              f"do not pair: each side chunks prefills at its own state block (batch "
              f"{figures['batch']:.0f}, tokens a step {tokens['stock']:.1f} stock and "
              f"{tokens['e2']:.1f} E2, ", end="")
    print(f"KV usage at the end {figures['stock_usage']:.0%} "
          f"stock, {figures['e2_usage']:.0%} E2); round ratios "
          f"{figures['round_ratio_min']:.2f}..{figures['round_ratio_max']:.2f}, "
          f"pair ratios {', '.join(f'{r:.3f}' for r in figures['pair_ratios'])}, "
          f"wall {wall['ratio']:.3f}")
    return ok


def print_soak(soak: Soak, results: dict[str, dict]) -> bool:
    print(f"soak, {soak.requests} requests (seed {soak.workload.seed}), {soak.model}, "
          f"{soak.budget_gib:g} GiB ({results['stock']['planner']['num_blocks']} pages), "
          f"mamba cache {soak.mamba_cache_mode} + prefix caching")

    def lines(side: str, r: dict) -> list[str]:
        slab = r["audit"].get("slab")
        held = (f", slab pages held at the end {slab['held_pages']} (all idle, reclaimed)"
                if slab and r["audit"]["clean"] else "")
        return [f"  {side:5}  {r['finished']}/{r['requests']} finished ({r['aborted']} aborted), "
                f"{r['steps']} steps, {r['preemptions']} preemptions, {r['seconds']:.0f} s "
                f"({r['cpu_seconds']:.0f} s CPU); leaked blocks "
                f"{r['audit']['leaked_blocks']}{held}",
                f"         prefix-hit tokens: {r['prefix_hit_tokens']:,} of "
                f"{r['prompt_tokens']:,} prompt tokens on admission, "
                f"{r['resume_hit_tokens']:,} more on resuming preempted requests"
                f"{states_line(r)}"]

    return print_sides(results, lines, soak_problems, "LEAK")


def print_faults(soak: Soak, results: dict[str, dict]) -> bool:
    print(f"faults, the soak's first {soak.requests} requests twice: as is, then with "
          f"allocations refused after prefix hits and at state block boundaries")

    def lines(side: str, r: dict) -> list[str]:
        as_is, faults = r["runs"]["as_is"], r["runs"]["faults"]
        same = (f"{r['output_tokens']} output tokens the same" if not r["num_differing"]
                else f"{r['num_differing']} requests differ")
        return [f"  {side:5}  refused {r['refusals']['after_prefix_hit']} after a prefix hit, "
                f"{r['refusals']['at_state_boundary']} at a {r['state_block_size']}-token state "
                f"block boundary; preemptions {as_is['preemptions']} -> "
                f"{faults['preemptions']}; {faults['finished']}/{faults['requests']} "
                f"finished, {same}"]

    return print_sides(results, lines, fault_problems, "FAULT")


def hit_problems(results: dict[str, dict]) -> list[str]:
    """Why E2 failed a prefix-hit soak: fewer first-admission hits than stock,
    a wrong cached state on either side, or a preemption where stock has none
    (below saturation)."""
    stock, e2 = results["stock"], results["e2"]
    problems = soak_problems("stock", stock) + soak_problems("e2", e2)
    if e2["prefix_hit_tokens"] < stock["prefix_hit_tokens"]:
        problems.append(f"e2: {e2['prefix_hit_tokens']:,} prefix-hit tokens on admission, "
                        f"fewer than stock's {stock['prefix_hit_tokens']:,}")
    if e2["preemptions"] > stock["preemptions"]:
        problems.append(f"e2: {e2['preemptions']} preemptions, stock {stock['preemptions']}")
    return problems


def print_prefix_hits(rows: list[tuple[Soak, dict[str, dict]]]) -> bool:
    """The prefix-hit table: first-admission hits and the oracle, per model and
    budget; False when any row has a problem."""
    print("prefix hits, mamba align + prefix caching, the soak's workload; first-admission "
          "prefix-hit tokens (resumed requests apart), wrong cached states, preemptions")
    print(f"  {'model':20} {'GiB':>4} {'requests':>8} {'stock hits':>12} {'e2 hits':>12} "
          f"{'ratio':>6}  {'wrong s/e':>9}  {'preempt s/e':>11}  {'resume hits s/e':>17}")
    problems = []
    for soak, results in rows:
        stock, e2 = results["stock"], results["e2"]
        wrong = [(r.get("states") or {}).get("distinct_wrong", "-") for r in (stock, e2)]
        print(f"  {soak.model:20} {soak.budget_gib:>4g} {soak.requests:>8} "
              f"{stock['prefix_hit_tokens']:>12,} {e2['prefix_hit_tokens']:>12,} "
              f"{e2['prefix_hit_tokens'] / max(stock['prefix_hit_tokens'], 1):>6.2f}  "
              f"{wrong[0]:>4}/{wrong[1]:<4}  "
              f"{stock['preemptions']:>5}/{e2['preemptions']:<5}  "
              f"{stock['resume_hit_tokens']:>8,}/{e2['resume_hit_tokens']:<8,}")
        problems += [f"{soak.model} {soak.budget_gib:g} GiB: {p}" for p in hit_problems(results)]
    for problem in problems:
        print(f"  HITS {problem}")
    return not problems


def print_sides(results: dict[str, dict], lines: Callable[[str, dict], list[str]],
                problems_of: Callable[[str, dict], list[str]], label: str) -> bool:
    """Each side's lines, then every problem under ``label``; True when none."""
    problems = []
    for side, result in results.items():
        print("\n".join(lines(side, result)))
        problems += problems_of(side, result)
    for problem in problems:
        print(f"  {label} {problem}")
    return not problems
