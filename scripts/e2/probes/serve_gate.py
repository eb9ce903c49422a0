"""The serve probe's GPU gate: Qwen3.5-0.8B's geometry with dummy weights, as served by default.

``e2 probe serve --mode gate`` (and ``gate-fp8``) boots stock and E2 on the
zoo's Qwen3.5-0.8B config (``--load-format dummy``: nothing is downloaded, the
config folder is all the engine reads) with vLLM's default path for hybrids:
prefix caching on (so Mamba ``align`` mode), Model Runner V2 and CUDA graphs on
a GPU (no ``--enforce-eager``), default scheduling and prefill budget. The KV
budget (GATE_KV_CACHE_BYTES a rank) holds a few dozen long prompts' blocks, so
cached prefixes and states are evicted and packed while the mixed case runs.

The cases: one long prompt sent four times; shared-prefix prompts prefilling
beside short decodes, then their siblings; 64 mixed prompts (siblings of both
prefixes and fresh ones). E2 also runs the gate's cases with prefix caching off
(``no_prefix_caching``), whose tokens its own must equal; ``gate-fp8`` (fp8 KV,
FlashInfer) runs stock and E2 only, on the first three cases. The verdict adds
E2's prefix-cache hit tokens over the mode's cases: at least GATE_HIT_RATIO of
stock's; and any CUDA error in an engine's log fails the mode.

vLLM's dummy weights are uniform in ±1e-3, so the logits are nearly flat and
greedy tokens can part at near ties where two engines batch or chunk a request
differently: sequential cases compare every token, concurrent ones (which
return their top tokens) up to a near tie (serve_compare.parted_at_a_near_tie).

``--gate-scale F`` scales every prompt length (not the request counts) for a
shorter run where the engines are slow (the CPU); the record says which.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from e2.probes.serve_settings import MAX_TOKENS, SEED, SERVED_NAME

GATE_MODES = ("gate", "gate-fp8")
# The zoo's config folder (scripts/e2/probes/models/).
GATE_MODEL = Path(__file__).resolve().parent / "models" / "Qwen3.5-0.8B"
GATE_MAX_MODEL_LEN = 4096
GATE_MAX_NUM_SEQS = 64
# A rank's KV budget: about 160 of stock's 544-token pages at TP 1 (a 3,000-token
# prompt takes 12 with its states), so the mixed case evicts and packs.
GATE_KV_CACHE_BYTES = 1 << 30
GATE_HIT_RATIO = 0.95
# Spacing of a concurrent case's requests into the paused engine: in order, quickly.
GATE_QUEUE_GAP_S = 0.05
# Token ids drawn below Qwen3.5's special tokens (248,044 and up).
GATE_VOCAB = 248_000
# The cases gate-fp8 runs (its engines: stock and E2, no reference).
FP8_CASES = ("gate-repeat", "gate-beside-decodes", "gate-siblings")
REFERENCE_MODES = ("align", "gate")
LOG_ERROR = re.compile(r"^.*(?:CUDA error|illegal memory access|device-side assert|"
                       r"CUBLAS_STATUS_\w+|NCCL error).*$", re.M)


def gate_settings(scale: float = 1.0) -> dict:
    """What the record's header names of the gate's engines and cases."""
    return {"model": f"{GATE_MODEL.name} (config only, --load-format dummy)",
            "max_model_len": GATE_MAX_MODEL_LEN, "max_num_seqs": GATE_MAX_NUM_SEQS,
            "kv_cache_memory_bytes": GATE_KV_CACHE_BYTES, "max_tokens": MAX_TOKENS,
            "scale": scale, "hit_ratio": GATE_HIT_RATIO, "fp8_cases": list(FP8_CASES)}


def gate_engine_args(model: str, port: int, mode: str, tp: int, prefix_caching: bool = True,
                     eager: bool = False, kv_bytes: int = GATE_KV_CACHE_BYTES,
                     vision: bool = True) -> list[str]:
    """``vllm serve``'s arguments for a gate engine: vLLM's defaults but for the
    dummy weights, the limits and the budget. ``eager`` only on the CPU."""
    args = ["--model", model, "--served-model-name", SERVED_NAME, "--load-format", "dummy",
            "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(GATE_MAX_MODEL_LEN),
            "--max-num-seqs", str(GATE_MAX_NUM_SEQS),
            "--kv-cache-memory-bytes", str(kv_bytes),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            "--seed", str(SEED)]
    if vision:
        # the language model is the question; the vision processor would want a tokenizer
        args.append("--language-model-only")
    if mode == "gate-fp8":
        args += ["--kv-cache-dtype", "fp8", "--attention-backend", "FLASHINFER"]
    if eager:
        args.append("--enforce-eager")
    if tp > 1:
        args += ["--tensor-parallel-size", str(tp)]
    return args


def has_vision(model: Path) -> bool:
    return "vision_config" in json.loads((model / "config.json").read_text())


def scaled(n: int, scale: float) -> int:
    return max(8, round(n * scale))


def log_errors(log: str) -> list[str]:
    """An engine log's CUDA (or NCCL) error lines, at most five."""
    return [line.strip()[:300] for line in LOG_ERROR.findall(log)][:5]


def hit_problems(mode: str, stock: dict, e2: dict) -> tuple[dict[str, str], list[str]]:
    """A gate mode's prefix-cache hit tokens over its cases, per side, and the
    problems: E2's below GATE_HIT_RATIO of stock's, or a CUDA error logged."""
    hits = {side: sum(c.get("prefix_cache_hits", 0) for c in m.get("cases", {}).values())
            for side, m in (("stock", stock), ("e2", e2))}
    shown = {side: f"{n} prefix-cache hit tokens" for side, n in hits.items()}
    problems = []
    if hits["e2"] < GATE_HIT_RATIO * hits["stock"]:
        problems.append(f"e2 hit {hits['e2']} prefix tokens, under {GATE_HIT_RATIO} of "
                        f"stock's {hits['stock']}")
    for label, entry in (("stock", stock), ("e2", e2),
                         ("e2 with prefix caching off", e2.get("no_prefix_caching", {}))):
        for line in entry.get("log_errors", []):
            problems.append(f"{label}: the engine logged {line!r}")
    return shown, problems
