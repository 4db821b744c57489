#!/usr/bin/env bash
# Install everything, then run the GRPO workflow locally on its embedded tiny default (CPU).
# Usage: scripts/run_local.sh [extra pyflyte workflow args, e.g. --recipe tiny-grpo]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/pyflyte run workflows/grpo.py grpo "$@"
