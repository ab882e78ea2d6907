#!/usr/bin/env bash
# The GPU check: run from a source checkout on a GPU host that has torch (2.11+),
# transformers, safetensors and tokenizers; no install, no network. Prints one
# table (tests/gpu results, decode tokens/s vs transformers' generate, the
# training steps vs plain torch with MFU, four tenants batched vs one by one,
# a sweep of 8 LoRA runs of one tenant in flight vs one after another, peak
# memory). Budget: 8 minutes on one H100/H200.
#
#   bash scripts/gpu_check.sh              # on the GPU
#   bash scripts/gpu_check.sh --smoke      # tiny sizes, same code (CPU when no GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
LIMIT=480  # the 8-minute budget on a GPU; --smoke on a loaded CPU may take longer
case " $* " in *" --smoke "*) LIMIT=1800 ;; esac
exec timeout "${GPU_CHECK_TIMEOUT_S:-$LIMIT}" "$PY" scripts/gpu_check.py "$@"
