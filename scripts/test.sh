#!/usr/bin/env bash
# Install everything, start the services the integration tests need, run the whole test suite.
# Usage: scripts/test.sh [pytest args...]   (e.g. scripts/test.sh -m "not integration" for unit tests only)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
bash scripts/install_vllm.sh
# headless Chromium for the run-report browser test (Debian package; needs root once)
if ! command -v chromium >/dev/null 2>&1; then
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium
fi
cleanup() { if [ -n "${STARTED_S3:-}" ]; then bash scripts/s3_server.sh stop || true; fi; }
trap cleanup EXIT
if [ -z "${UNIRL_S3_ENDPOINT:-}" ]; then
  bash scripts/s3_server.sh start
  eval "$(bash scripts/s3_server.sh env)"
  STARTED_S3=1
fi
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
[ $rc -eq 5 ] && { echo "pytest collected no tests"; exit 1; }
exit $rc
