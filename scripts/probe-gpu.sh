#!/usr/bin/env bash
# Both probes, stock vs E2, against the engine images on the GPU host, and the
# seam tests on CUDA tensors in the E2 image.
#
#   scripts/probe-gpu.sh ssh://user@gpu-host        (or: make probe-gpu-full HOST=ssh://user@gpu-host)
#
# The gate each series change needs is the shorter scripts/probe-gate.sh (make probe-gpu).
#
# TP (default 4), BUDGET_GIB (KV budget per rank for the capacity planner,
# default 8) and REPORT (default docs/validation) can be set in the environment.
# The Docker engine on HOST builds the E2 image from the pinned base (which it
# must be able to pull or already hold) and runs both engines with --gpus all.
set -euo pipefail
host="${1:-}"
if [ -z "$host" ]; then
    echo "usage: scripts/probe-gpu.sh DOCKER_HOST   (e.g. ssh://user@gpu-host)" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
export DOCKER_HOST="$host" HF_HUB_OFFLINE=1
tp="${TP:-4}"
budget="${BUDGET_GIB:-8}"
report="${REPORT:-docs/validation}"

e2 verify
# --no-fallback: the pinned CUDA base or nothing (never the CPU base stand-in).
e2 image build --no-fallback                     # tag: vllm-e2:<version>-<series digest>
# The worker and planner seam tests on CUDA tensors, in that image (its python3 and
# CUDA torch; the kit brings the rest, so nothing is downloaded there).
e2 test kit .e2/seam-kit --image --gpus all --report "$report"
e2 probe serve --docker --gpus all --tp "$tp" --report "$report"
# The planner and scheduler run here (CPU) and model the CUDA boot; --boot then
# boots both images on the host with dummy weights for the models whose weights
# fit 4x24 GB, and records each engine's own "KV cache size" line beside the plan.
e2 probe capacity --zoo --tp "$tp" --budget-gib "$budget" --results "$report"
e2 probe capacity --model Qwen3.5-0.8B --model Qwen3.5-4B --model Qwen3.5-27B \
    --model Nemotron-H-8B --model Granite-4.0-H-Tiny --tp "$tp" --budget-gib "$budget" \
    --boot --docker --gpus all --results "$report"
