"""The serve probe's fixed settings: the tiny model, the engines' limits, the sides.

Every serve module reads them from here, so both sides and every case agree.
"""

from __future__ import annotations

SEED = 0
SERVED_NAME = "tiny"
VOCAB = 512                        # tiny_model.CONFIG["vocab_size"]; ids 0-2 are special
MAX_MODEL_LEN = 1024
MAX_TOKENS = 16
KV_CACHE_BYTES = 12 << 20          # under 2k tokens for the tiny model: preemption
TP_SIZES = (1, 2, 4)               # what the tiny model's heads split into
MAX_NUM_SEQS = 32
BOOT_TIMEOUT = 600
HOLD_S = 2.0                       # a paused engine queues the concurrent requests this long
REQUEST_TIMEOUT = 600
# Each mode is one engine boot a side: sync and async scheduling on the hybrid
# model; "align", sync scheduling on the align geometry (tiny_model.GEOMETRIES)
# with prefills chunked at ALIGN_BATCHED_TOKENS, where E2's state block (256)
# is finer than stock's block and larger than its own attention block, as on
# the real models. E2 also runs the align cases with prefix caching off: its
# tokens must match that engine's as well as stock's.
MODES = ("sync", "async", "align")
# Not run unless asked for (--mode gate): Qwen3.5-0.8B's geometry (serve_gate).
ALL_MODES = (*MODES, "gate", "gate-fp8")
GEOMETRY = {"sync": "hybrid", "async": "hybrid", "align": "align"}
ALIGN_MAX_MODEL_LEN = 2048
# Not a multiple of 256 nor of stock's block (288 to 544): chunks end where
# each engine's own alignment puts them, never where the budget alone would.
ALIGN_BATCHED_TOKENS = 600
ALIGN_KV_CACHE_BYTES = 24 << 20    # 20k tokens and more: the align cases never preempt
SIDES = ("stock", "e2")
CPU_ASYNC_SKIP = "not run on the CPU (the GPU host covers them)"
GATE_FP8_CPU_SKIP = "not run on the CPU (fp8 KV through FlashInfer is a CUDA path)"
# Seconds between a concurrent case's requests as they queue at the paused engine.
QUEUE_GAP_S = 0.25
FORMAT = 1
# Top tokens a concurrent case's requests return per position: where stock and E2
# batch the requests differently, greedy tokens may part at a near tie (bf16 sums in
# an order that follows the batch on AMX and AVX512-BF16 CPUs), and each side's
# token must then be among the other's top ones (vLLM's check_logprobs_close).
TOP_LOGPROBS = 5
