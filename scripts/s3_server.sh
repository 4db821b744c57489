#!/usr/bin/env bash
# A one-node S3 endpoint on 127.0.0.1 for integration tests and benchmarks: Debian's Ceph
# (a monitor, one in-memory OSD, radosgw). Needs root on Debian 12 for the first install.
#
#   scripts/s3_server.sh start   # install if missing, start, print the env (eval-able)
#   scripts/s3_server.sh env     # print the env of a running endpoint
#   scripts/s3_server.sh stop    # stop the daemons and delete the state directory
#
# Data lives in memory (memstore): stop loses it, which is what tests want.
# Settings: UNIRL_S3_DIR (state dir, default <repo>/.services/s3), UNIRL_S3_PORT (7480),
# UNIRL_S3_MON_PORT (6789), UNIRL_S3_MEM_MB (memstore size, 4096).
set -Eeuo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${UNIRL_S3_DIR:-$REPO/.services/s3}"
PORT="${UNIRL_S3_PORT:-7480}"
MON_PORT="${UNIRL_S3_MON_PORT:-6789}"
MEM_MB="${UNIRL_S3_MEM_MB:-4096}"
# Fixed test credentials: the endpoint only listens on 127.0.0.1 and holds throwaway data.
ACCESS_KEY="unirl-test-access"
SECRET_KEY="unirl-test-secret"
ENDPOINT="http://127.0.0.1:$PORT"
CONF="$DIR/ceph.conf"

say() { echo "s3_server: $*" >&2; }
trap 'say "failed (rc=$?) at line $LINENO: $BASH_COMMAND (logs: $DIR/log)"' ERR

install_if_missing() {
  if command -v radosgw >/dev/null && command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null; then
    return
  fi
  if [ "$(id -u)" != 0 ]; then
    say "ceph is not installed and this is not root; run as root once or: apt-get install radosgw ceph-mon ceph-osd"
    exit 1
  fi
  say "installing Ceph (radosgw, ceph-mon, ceph-osd) from Debian"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >&2
  apt-get install -y -q radosgw >&2
  # Without --no-install-recommends ceph-osd pulls in a large set of tools we do not need.
  apt-get install -y -q --no-install-recommends ceph-mon ceph-osd >&2
}

# python3 comes with ceph's own tools; curl may be missing on a minimal image.
answers() {
  python3 - "$ENDPOINT" <<'PY' 2>/dev/null
import sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=2)
except urllib.error.HTTPError:
    pass  # any HTTP answer (403 for anonymous) means the gateway is serving
PY
}

print_env() {
  cat <<ENV
export UNIRL_S3_ENDPOINT=$ENDPOINT
export AWS_ENDPOINT_URL=$ENDPOINT
export AWS_ACCESS_KEY_ID=$ACCESS_KEY
export AWS_SECRET_ACCESS_KEY=$SECRET_KEY
ENV
}

write_conf() {
  local fsid="$1"
  cat >"$CONF" <<CONF
[global]
fsid = $fsid
mon host = 127.0.0.1:$MON_PORT
mon initial members = a
public network = 127.0.0.0/8
# A throwaway single-node cluster: no cephx, and radosgw loops on auth error -13 unless the
# monitor client mode also allows crc.
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc secure
osd objectstore = memstore
memstore device bytes = $((MEM_MB * 1024 * 1024))
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon warn on pool no redundancy = false
osd crush chooseleaf type = 0
run dir = $DIR/run
log file = $DIR/log/\$name.log
admin socket = $DIR/run/\$name.asok
mon data = $DIR/mon/\$cluster-\$id
# The monitor refuses to start (exit 28, ENOSPC) when its filesystem's free space, as a whole
# percentage, is at or below this: a CI runner with 10 GiB free on a 250 GiB disk is at 4%, and one
# with 1.8 GiB free is at 0% (the percentage is truncated), which 0 does not pass. Its store is a few
# MB and the objects live in memory, so only a truly full disk should stop it: -1 turns the check off.
mon data avail crit = -1
mon data avail warn = -1
osd data = $DIR/osd/\$cluster-\$id
[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:$PORT
rgw data = $DIR/rgw
CONF
}

wait_for() {  # wait_for <seconds> <description> <command...>
  local limit="$1" what="$2"; shift 2
  local t=0
  until "$@" >/dev/null 2>&1; do
    sleep 0.5; t=$((t + 1))
    if [ "$t" -ge $((limit * 2)) ]; then say "timed out after ${limit}s waiting for $what (logs: $DIR/log)"; exit 1; fi
  done
}

start() {
  install_if_missing
  if [ -f "$DIR/run/started" ] && answers; then
    say "already running at $ENDPOINT"; print_env; return
  fi
  stop_daemons
  rm -rf "$DIR"
  mkdir -p "$DIR"/{run,log,mon,osd/ceph-0,rgw}
  local fsid osd_uuid
  fsid="$(cat /proc/sys/kernel/random/uuid)"
  osd_uuid="$(cat /proc/sys/kernel/random/uuid)"
  write_conf "$fsid"
  local c=(-c "$CONF")
  monmaptool --create --add a "127.0.0.1:$MON_PORT" --fsid "$fsid" "$DIR/monmap" >/dev/null
  ceph-mon "${c[@]}" --mkfs -i a --monmap "$DIR/monmap" >/dev/null
  ceph-mon "${c[@]}" -i a --pid-file "$DIR/run/mon.pid" || {
    local rc=$?
    sleep 1  # the daemon's log is written by its forked child, after the parent returned
    say "ceph-mon exited $rc; $(grep -h -m1 'error:' "$DIR"/log/*.log 2>/dev/null || true) (free space where UNIRL_S3_DIR points: $(df -h --output=avail "$DIR" | tail -1))"
    exit "$rc"
  }
  wait_for 30 "the monitor" ceph "${c[@]}" --connect-timeout 2 mon stat
  local id
  id="$(ceph "${c[@]}" osd new "$osd_uuid")"
  ceph-osd "${c[@]}" -i "$id" --mkfs --osd-uuid "$osd_uuid" >/dev/null 2>&1
  # A monitor seconds old sometimes answers the OSD's first command with 'wrong fsid' (the OSD has not
  # read the monmap yet) and the OSD exits during init; a second start succeeds.
  local attempt
  for attempt in 1 2 3 4; do
    if ceph-osd "${c[@]}" -i "$id" --pid-file "$DIR/run/osd.pid" 2>>"$DIR/log/osd-start.log"; then break; fi
    if [ "$attempt" = 4 ]; then say "ceph-osd would not start (logs: $DIR/log)"; exit 1; fi
    say "ceph-osd start attempt $attempt failed; retrying"
    sleep 1
  done
  wait_for 60 "the OSD to come up" bash -c "ceph ${c[*]} osd stat | grep -q '1 up'"
  radosgw "${c[@]}" -n client.rgw.a --pid-file "$DIR/run/rgw.pid"
  wait_for 90 "radosgw on $ENDPOINT" answers
  radosgw-admin "${c[@]}" user create --uid=unirl --display-name=unirl-tests \
    --access-key="$ACCESS_KEY" --secret-key="$SECRET_KEY" >/dev/null
  touch "$DIR/run/started"
  say "S3 endpoint ready at $ENDPOINT"
  print_env
}

stop_daemons() {
  local f pid
  for f in rgw osd mon; do
    if [ -f "$DIR/run/$f.pid" ]; then
      pid="$(cat "$DIR/run/$f.pid")"
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
      kill -9 "$pid" 2>/dev/null || true
      rm -f "$DIR/run/$f.pid"
    fi
  done
}

case "${1:-}" in
  start) start ;;
  stop) stop_daemons; rm -rf "$DIR"; say "stopped" ;;
  env) if answers; then print_env; else say "no endpoint answers at $ENDPOINT"; exit 1; fi ;;
  *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
