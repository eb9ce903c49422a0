"""The scheduler benchmark's workload and statistics, in plain Python.

Shared by the worker (which runs inside the vLLM venv, stock or E2) and the
driver, and tested on its own: both sides of a run must see exactly the same
requests, so everything here is a pure function of a seed.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

# Token ids: prefixes and suffixes draw from disjoint ranges, so a prefix hit
# comes only from a shared prefix, never from two suffixes that happen to match.
PREFIX_TOKENS = range(1_000, 50_000)
SUFFIX_TOKENS = range(50_000, 150_000)


@dataclass(frozen=True)
class WorkloadSpec:
    """A seeded stream of random-length requests, some opening with a shared prefix."""

    seed: int = 0
    prompt_min: int = 16
    prompt_max: int = 4096
    decode_min: int = 1
    decode_max: int = 128
    num_prefixes: int = 24
    prefix_min: int = 256
    prefix_max: int = 2048
    prefix_share: float = 0.6     # fraction of requests that open with a shared prefix
    abort_share: float = 0.0      # fraction aborted by the client some steps after arrival
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        if not 0 < self.prompt_min <= self.prompt_max:
            raise ValueError(f"prompt lengths {self.prompt_min}..{self.prompt_max}")
        if not 0 < self.decode_min <= self.decode_max:
            raise ValueError(f"decode lengths {self.decode_min}..{self.decode_max}")
        if self.prompt_max + self.decode_max > self.max_model_len:
            raise ValueError(f"prompt_max {self.prompt_max} + decode_max {self.decode_max} "
                             f"exceeds max_model_len {self.max_model_len}")
        if self.num_prefixes and not 0 < self.prefix_min <= self.prefix_max:
            raise ValueError(f"prefix lengths {self.prefix_min}..{self.prefix_max}")
        if not (0.0 <= self.prefix_share <= 1.0 and 0.0 <= self.abort_share <= 1.0):
            raise ValueError("prefix_share and abort_share are fractions")


@dataclass(frozen=True)
class RequestShape:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    prefix_id: int | None         # which shared prefix it opens with
    abort_after: int | None       # steps after arrival at which the client aborts it


def prefixes(spec: WorkloadSpec) -> list[tuple[int, ...]]:
    rng = random.Random(f"prefixes-{spec.seed}")
    return [tuple(rng.choices(PREFIX_TOKENS, k=rng.randint(spec.prefix_min, spec.prefix_max)))
            for _ in range(spec.num_prefixes)]


def stream(spec: WorkloadSpec) -> Iterator[RequestShape]:
    """Requests forever (take as many as needed); request i is the same on every side."""
    shared = prefixes(spec)
    rng = random.Random(f"requests-{spec.seed}")
    index = 0
    while True:
        # Log-uniform length: many short prompts, a long tail.
        length = round(spec.prompt_min * (spec.prompt_max / spec.prompt_min) ** rng.random())
        prefix_id = None
        prompt: list[int] = []
        if shared and rng.random() < spec.prefix_share:
            prefix_id = rng.randrange(len(shared))
            prompt = list(shared[prefix_id][:spec.prompt_max - 1])
            length = max(length, len(prompt) + 1)   # at least one token after the prefix
        prompt += rng.choices(SUFFIX_TOKENS, k=length - len(prompt))
        abort_after = rng.randint(0, 64) if rng.random() < spec.abort_share else None
        yield RequestShape(f"r{index}", tuple(prompt), rng.randint(spec.decode_min,
                           spec.decode_max), prefix_id, abort_after)
        index += 1


def arrivals(seed: int, count: int, mean_burst: int) -> list[int]:
    """The step at which each of ``count`` requests arrives: bursts of 1..2*mean_burst
    requests a few steps apart, with now and then a long lull that lets the pool drain."""
    rng = random.Random(f"arrivals-{seed}")
    steps: list[int] = []
    step = 0
    while len(steps) < count:
        steps += [step] * min(count - len(steps), rng.randint(1, 2 * mean_burst))
        step += rng.randint(300, 600) if rng.random() < 0.03 else rng.randint(1, 20)
    return steps


# ---------------------------------------------------------------- statistics


def step_ratio(stock_rounds: Sequence[Sequence[float]],
               e2_rounds: Sequence[Sequence[float]]) -> dict:
    """E2 against stock from step times measured in rounds run alternately on the
    two sides, where step j of round i is the same step of the same workload on
    both (same requests scheduled, same tokens). The ratio is the median of the
    per-step ratios: pairing cancels the workload's own variation from step to
    step, the median a shared machine's bursts of load. The per-round ratios of
    medians give its spread."""
    if len(stock_rounds) != len(e2_rounds) or not stock_rounds:
        raise ValueError("need the same, non-zero number of rounds on both sides")
    if any(len(s) != len(e) or not s for s, e in zip(stock_rounds, e2_rounds)):
        raise ValueError("rounds of the two sides differ in length, or are empty")
    stock = [t for r in stock_rounds for t in r]
    e2 = [t for r in e2_rounds for t in r]
    if min(stock) <= 0:
        raise ValueError("a stock step took no time")
    rounds = [statistics.median(e) / statistics.median(s)
              for s, e in zip(stock_rounds, e2_rounds)]
    return {
        "stock_median": statistics.median(stock),
        "e2_median": statistics.median(e2),
        "ratio": statistics.median(e / s for s, e in zip(stock, e2)),
        "round_ratio_min": min(rounds), "round_ratio_max": max(rounds),
        "rounds": len(rounds), "steps": len(stock),
    }
