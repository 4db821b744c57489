#!/usr/bin/env bash
# Create .venv and install the project with every extra. Idempotent; safe to re-run.
# The ML stack and flytekit are installed in separate steps: one combined resolve can backtrack for minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
# CPU build of torch 2.13.0 (on a GPU image install the CUDA build you need first; this then keeps it).
.venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e .
"${PIP[@]}" -e ".[flyte]"
"${PIP[@]}" -e ".[reward,lm,dev]"
echo "installed into .venv ($(.venv/bin/python -c 'import torch, flytekit; print("torch", torch.__version__, "flytekit", flytekit.__version__)'))"
