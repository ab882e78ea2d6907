#!/usr/bin/env bash
# Create .venv and install treadle with the server and dev extras.
# torch==2.13.0 goes first: a CPU wheel of it is on local disk here, and any
# other way of resolving torch pulls a multi-GB CUDA build.
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
.venv/bin/python -m pip install -q -e '.[server,dev]'
echo "treadle: environment ready in .venv" >&2
