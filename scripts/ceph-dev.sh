#!/usr/bin/env bash
# A single-host Ceph cluster for tests and benchmarks, from Debian's packages (scripts/setup.sh
# installs them): one ceph-mon, one ceph-mgr and one ceph-osd on memstore (the data lives in the
# OSD's memory), cephx on, everything (config, keyrings, data, logs, pids) under one directory.
# Only loopback: the mon listens on 127.0.0.1 (msgr v2 and v1 on a free port pair).
#
#   scripts/ceph-dev.sh start DIR [--osd-mb N] [--osd-store memstore|bluestore] [--no-mgr]
#       starts the cluster (~10 s here), creates pool "rbd" (application rbd) and two cephx users:
#       client.admin (DIR/ceph.client.admin.keyring) and client.ibnbd, caps "profile rbd"
#       (DIR/ceph.client.ibnbd.keyring, what ibnbd-server is given). Prints the environment
#       (CEPH_CONF=DIR/ceph.conf) on stdout. Fails, with the failing daemon's log tail, after 60 s.
#   scripts/ceph-dev.sh stop DIR      stops every daemon of DIR (SIGTERM, then SIGKILL after 10 s)
#                                     and removes DIR
#   scripts/ceph-dev.sh status DIR    `ceph -s` of the cluster; exit 1 when it is not running
#   scripts/ceph-dev.sh osd-restart DIR [DOWN_SECONDS]
#                                     kill -9 the OSD, wait, start it again (memstore loses its
#                                     data with it: tests that restart it start the cluster with
#                                     --osd-store bluestore, a file in DIR, which must not be on
#                                     tmpfs: bluestore opens it O_DIRECT)
#
# Sizes seen here: ceph-osd ~1.2 GB RSS with 2 GiB of memstore, ceph-mgr ~300 MB, ceph-mon ~35 MB.
set -euo pipefail

usage() {
  sed -n '/^#   scripts/,/^#$/p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

[ $# -ge 2 ] || usage
cmd=$1 dir=$2
shift 2

conf=$dir/ceph.conf
# Every ceph CLI call: bounded (a mon that is not there makes `ceph` wait forever by default).
ceph_() { timeout 30 ceph -c "$conf" --connect-timeout 10 "$@"; }

free_port_pair() {  # a free port P with P+1 free too (msgr v2 on P, v1 on P+1)
  python3 - <<'EOF'
import socket
for _ in range(200):
    a = socket.socket(); a.bind(("127.0.0.1", 0)); p = a.getsockname()[1]
    try:
        b = socket.socket(); b.bind(("127.0.0.1", p + 1)); b.close(); a.close(); print(p); break
    except OSError:
        a.close()
EOF
}

daemon_pids() { cat "$dir"/run/*.pid 2>/dev/null || true; }

stop_cluster() {
  local pids p
  pids=$(daemon_pids)
  [ -n "$pids" ] || return 0
  # shellcheck disable=SC2086
  kill $pids 2>/dev/null || true
  for _ in $(seq 100); do
    local alive=0
    for p in $pids; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && return 0
    sleep 0.1
  done
  # shellcheck disable=SC2086
  kill -9 $pids 2>/dev/null || true
}

# A failed start takes down what it started; a failed osd-restart leaves the cluster to its
# owner (who may still read its state, and stops it at its own exit). The reason comes first
# and last, so a caller's `tail` shows it.
keep_cluster=0
fail() {
  echo "ceph-dev: $1" >&2
  for l in "$dir"/log/*.log; do
    [ -f "$l" ] && { echo "--- $l" >&2; tail -n 15 "$l" >&2; }
  done
  [ "$keep_cluster" = 1 ] || stop_cluster
  echo "ceph-dev: $1" >&2
  exit 1
}

wait_until() {  # wait_until SECONDS WHAT CMD...: polls CMD every 0.2 s
  local secs=$1 what=$2
  shift 2
  local end=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $end ] || fail "$what did not happen within $secs s"
    sleep 0.2
  done
}

start_osd() {
  ceph-osd -c "$conf" --id 0 >>"$dir/log/osd.0.out" 2>&1 || fail "ceph-osd did not start"
}

osd_up() { ceph_ osd dump --format json | python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(0 if d["osds"] and d["osds"][0]["up"] == 1 else 1)'; }

case "$cmd" in
start)
  osd_mb=2048 mgr=1 store=memstore
  while [ $# -gt 0 ]; do
    case "$1" in
      --osd-mb) osd_mb=$2; shift 2 ;;
      --no-mgr) mgr=0; shift ;;
      --osd-store) store=$2; shift 2 ;;
      *) usage ;;
    esac
  done
  case "$store" in memstore | bluestore) ;; *) echo "ceph-dev: --osd-store memstore|bluestore" >&2; exit 2 ;; esac
  for t in ceph-mon ceph-osd ceph ceph-authtool monmaptool rbd; do
    command -v "$t" >/dev/null || { echo "ceph-dev: $t is missing (scripts/setup.sh installs Ceph)" >&2; exit 77; }
  done
  [ "$mgr" = 0 ] || command -v ceph-mgr >/dev/null || { echo "ceph-dev: ceph-mgr is missing" >&2; exit 77; }
  [ ! -e "$dir/run" ] || { echo "ceph-dev: $dir holds a cluster already (stop it first)" >&2; exit 1; }
  mkdir -p "$dir"/{run,log,mon/a,osd/0,mgr/x}
  dir=$(cd "$dir" && pwd)
  conf=$dir/ceph.conf
  port=$(free_port_pair)
  fsid=$(cat /proc/sys/kernel/random/uuid)
  t0=$SECONDS
  cat >"$conf" <<EOF
[global]
fsid = $fsid
mon host = [v2:127.0.0.1:$port,v1:127.0.0.1:$((port + 1))]
mon initial members = a
public network = 127.0.0.0/8
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
keyring = $dir/ceph.\$name.keyring
osd pool default size = 1
osd pool default min size = 1
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
osd objectstore = $store
memstore device bytes = $((osd_mb << 20))
osd memory target = 1073741824
run dir = $dir/run
pid file = $dir/run/\$name.pid
admin socket = $dir/run/\$name.asok
log file = $dir/log/\$name.log
mon allow pool size one = true
auth allow insecure global id reclaim = false
mon allow pool delete = true
mon warn on pool no redundancy = false
mon data avail warn = 1
mon data avail crit = 0
osd fast shutdown = true
# Loopback only, one host: no need for the defaults sized for data centres.
ms bind ipv6 = false
osd op num threads per shard = 1
osd op num shards = 2
[mon.a]
mon data = $dir/mon/a
keyring = $dir/mon/a/keyring
[osd.0]
osd data = $dir/osd/0
keyring = $dir/osd/0/keyring
# bluestore (--osd-store bluestore): a sparse file of the memstore size, no separate db or wal.
bluestore block path = $dir/osd/block.0
bluestore block create = true
bluestore block size = $((osd_mb << 20))
bluestore block db create = false
bluestore block wal create = false
bluestore cache size = 134217728
[mgr.x]
mgr data = $dir/mgr/x
keyring = $dir/mgr/x/keyring
EOF
  # Keyrings: the mon's (mon.) and the admin's, which the mon learns at mkfs.
  ceph-authtool --create-keyring "$dir/mon/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
  ceph-authtool --create-keyring "$dir/ceph.client.admin.keyring" --gen-key -n client.admin \
    --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' --cap mds 'allow *' >/dev/null
  ceph-authtool "$dir/mon/keyring" --import-keyring "$dir/ceph.client.admin.keyring" >/dev/null
  # The monmap names the mon's address: without one, the mon binds the default ports.
  monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$port,v1:127.0.0.1:$((port + 1))]" \
    "$dir/monmap" >/dev/null || fail "monmaptool failed"
  ceph-mon -c "$conf" --id a --mkfs --monmap "$dir/monmap" --keyring "$dir/mon/keyring" >"$dir/log/mon.a.out" 2>&1 ||
    fail "ceph-mon --mkfs failed: $(tail -n 3 "$dir/log/mon.a.out")"
  ceph-mon -c "$conf" --id a >>"$dir/log/mon.a.out" 2>&1 || fail "ceph-mon did not start"
  wait_until 20 "the mon answering" ceph_ mon stat
  # The OSD: an id, a key with the OSD profile, its store.
  uuid=$(cat /proc/sys/kernel/random/uuid)
  ceph-authtool --create-keyring "$dir/osd/0/keyring" --gen-key -n osd.0 >/dev/null
  key=$(ceph-authtool -p -n osd.0 "$dir/osd/0/keyring")
  printf '{"cephx_secret": "%s"}\n' "$key" >"$dir/osd/0/secret.json"
  id=$(ceph_ osd new "$uuid" -i "$dir/osd/0/secret.json") || fail "ceph osd new failed"
  [ "$id" = 0 ] || fail "the new OSD got id $id, want 0"
  ceph-osd -c "$conf" --id 0 --mkfs --osd-uuid "$uuid" >"$dir/log/osd.0.out" 2>&1 ||
    fail "ceph-osd --mkfs failed: $(tail -n 3 "$dir/log/osd.0.out")"
  start_osd
  if [ "$mgr" = 1 ]; then
    ceph_ auth get-or-create mgr.x mon 'allow profile mgr' osd 'allow *' mds 'allow *' \
      -o "$dir/mgr/x/keyring" >/dev/null || fail "the mgr's key"
    ceph-mgr -c "$conf" --id x >"$dir/log/mgr.x.out" 2>&1 || fail "ceph-mgr did not start"
  fi
  wait_until 30 "osd.0 up" osd_up
  ceph_ osd pool create rbd 8 8 >/dev/null 2>&1 || fail "pool rbd"
  ceph_ osd pool application enable rbd rbd >/dev/null 2>&1 || fail "pool rbd: application"
  # The gateway's own user: what an RBD client needs on pool rbd and nothing more.
  ceph_ auth get-or-create client.ibnbd mon 'profile rbd' osd 'profile rbd pool=rbd' mgr 'profile rbd pool=rbd' \
    -o "$dir/ceph.client.ibnbd.keyring" >/dev/null || fail "client.ibnbd"
  # Ready when an image can be created and removed.
  wait_until 30 "an rbd image created" timeout 20 rbd -c "$conf" create rbd/ceph-dev-probe --size 1M
  timeout 20 rbd -c "$conf" rm rbd/ceph-dev-probe >/dev/null 2>&1 || true
  echo "# ceph-dev: cluster up in $((SECONDS - t0)) s (mon 127.0.0.1:$port, osd $store, mgr $mgr)" >&2
  echo "CEPH_CONF=$conf"
  echo "CEPH_ADMIN_KEYRING=$dir/ceph.client.admin.keyring"
  echo "CEPH_IBNBD_KEYRING=$dir/ceph.client.ibnbd.keyring"
  ;;
stop)
  [ -f "$conf" ] || { echo "ceph-dev: no cluster in $dir" >&2; exit 1; }
  stop_cluster
  rm -rf -- "$dir"
  ;;
status)
  [ -f "$conf" ] || { echo "ceph-dev: no cluster in $dir" >&2; exit 1; }
  ceph_ -s
  ;;
osd-restart)
  keep_cluster=1
  [ -f "$conf" ] || { echo "ceph-dev: no cluster in $dir" >&2; exit 1; }
  down=${1:-2}
  pid=$(cat "$dir/run/osd.0.pid")
  kill -9 "$pid"
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  sleep "$down"
  start_osd
  wait_until 30 "osd.0 up again" osd_up
  # Up is not yet serving (its PGs peer first): ready when an image can be made again.
  wait_until 30 "an rbd image created after the restart" timeout 20 rbd -c "$conf" create rbd/ceph-dev-probe --size 1M
  timeout 20 rbd -c "$conf" rm rbd/ceph-dev-probe >/dev/null 2>&1 || true
  ;;
*) usage ;;
esac
