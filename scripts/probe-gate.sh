#!/usr/bin/env bash
# The GPU gate (make probe-gpu): stock vs E2 serving Qwen3.5-0.8B's geometry with
# dummy weights, as vLLM serves hybrids by default (prefix caching on, CUDA graphs),
# at TP 1 (with the fp8 KV / FlashInfer engines) and TP 2. Nothing is downloaded:
# the engines read the zoo's config.json; the pinned base must be on the host.
#
#   scripts/probe-gate.sh ssh://user@gpu-host        (or: make probe-gpu HOST=ssh://user@gpu-host)
#
# REPORT (default docs/validation) is where gate-gpu-tp1.* and gate-gpu-tp2.* go.
# Eight engine boots: stock, E2 and E2 without prefix caching at each TP, and
# stock and E2 with fp8 KV at TP 1. The longer suite is scripts/probe-gpu.sh
# (make probe-gpu-full).
set -euo pipefail
host="${1:-}"
if [ -z "$host" ]; then
    echo "usage: scripts/probe-gate.sh DOCKER_HOST   (e.g. ssh://user@gpu-host)" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
export DOCKER_HOST="$host" HF_HUB_OFFLINE=1
report="${REPORT:-docs/validation}"

e2 verify
# --no-fallback: the pinned CUDA base or nothing (never the CPU base stand-in);
# quick when the image for this series digest is already built.
e2 image build --no-fallback
status=0
e2 probe serve --docker --gpus all --mode gate --mode gate-fp8 --tp 1 --report "$report" || status=1
e2 probe serve --docker --gpus all --mode gate --tp 2 --report "$report" || status=1
exit "$status"
