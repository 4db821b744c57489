#!/usr/bin/env bash
# Regenerate constraints.txt (the exact versions that scripts/install.sh installs and CI tests) from .venv.
# Run it after a deliberate upgrade in .venv, then re-run the test suite and commit both.
# Drops the editable project and anything installed from a local path or URL; strips torch's local
# build tag (+cpu, +cu128, ...) so the pin matches the CPU and the CUDA wheel of the same release.
set -euo pipefail
cd "$(dirname "$0")/.."
{
  echo "# Exact versions that scripts/install.sh installs and CI tests (frozen from a .venv on Python" \
    "$(.venv/bin/python -c 'import platform; print(platform.python_version())'))."
  echo "# Regenerate with scripts/freeze_constraints.sh; do not edit by hand. torch carries no build tag, so a"
  echo "# CUDA wheel of the same release satisfies it."
  .venv/bin/python -m pip freeze --exclude-editable --disable-pip-version-check \
    | grep -v -e ' @ ' -e '^-e ' -e '^unirl-flyte==' \
    | sed -E 's/^(torch==[^+]+)\+.*$/\1/'
} >constraints.txt
echo "wrote constraints.txt ($(grep -vc '^#' constraints.txt) pins)"
