#!/usr/bin/env bash
# Create .venv and install the project with every extra. Idempotent; safe to re-run.
# The ML stack and flytekit are installed in separate steps: one combined resolve can backtrack for minutes.
# Every step is held to constraints.txt, the exact versions CI tests, so a fresh machine gets the same set.
# After a deliberate upgrade in .venv, regenerate it with scripts/freeze_constraints.sh (a pip freeze of
# .venv without the project itself and without torch's +cpu tag).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
CONSTRAINTS=constraints.txt
# CPU build of torch 2.13.0 (on a GPU image install the CUDA build you need first; this then keeps it,
# so a preinstalled torch of another release lifts the torch pin instead of being replaced).
want_torch=$(sed -n 's/^torch==//p' constraints.txt)
have_torch=$(.venv/bin/python -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)
if [ -n "$have_torch" ] && [ "$have_torch" != "$want_torch" ]; then
  CONSTRAINTS=$(mktemp)
  trap 'rm -f "$CONSTRAINTS"' EXIT
  grep -v '^torch==' constraints.txt >"$CONSTRAINTS"
  echo "install: keeping the installed torch $have_torch (constraints.txt pins $want_torch)"
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS")
"${PIP[@]}" --upgrade pip
[ -n "$have_torch" ] || "${PIP[@]}" "torch==$want_torch"
"${PIP[@]}" -e .
"${PIP[@]}" -e ".[flyte]"
"${PIP[@]}" -e ".[reward,lm,pool,tracking,bench,dev]"
echo "installed into .venv ($(.venv/bin/python -c 'import torch, flytekit; print("torch", torch.__version__, "flytekit", flytekit.__version__)'))"
