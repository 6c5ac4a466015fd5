#!/usr/bin/env bash
# The soak's environment and its fault hook (issue 17; tools/soak/README.md): ibnbd-server in one
# network namespace, the client (ibnbd-soak on the client library, or ibnbd-client with an NBD
# export) in another, joined by two veth pairs (198.18.0.0/15 only); the exported file sparse on
# a small tmpfs (a real ENOSPC) behind ibnbd-soak-fs (EIO and a slow backend); then ibnbd-soak
# drives the volume while it runs the faults of its seed through this script's hook mode.
#
#   bash tools/soak/soak.sh BUILD_DIR [--target lib|nbd] [--seed N] [--duration 60s]
#        [--faults all|K1,K2,...] [--size 64M] [--json FILE] [--keep] [-- IBNBD-SOAK ARGS...]
#   bash tools/soak/soak.sh hook start|stop KIND [ARGS]    (ibnbd-soak calls it; SOAK_WORK set)
#
# Layout:  client ns  vca 198.18.20.1/24 <-> vsa 198.18.20.2/24  server ns   (path A)
#                     vcb 198.18.21.1/24 <-> vsb 198.18.21.2/24              (path B)
# Exit: ibnbd-soak's (0 clean, 1 defects, 2 usage, 3 setup), 77 skipped (not root, no ip netns,
# a binary not built). Every process it starts is stopped and every mount and namespace removed
# on any exit; every run is bounded (--duration, plus timeouts on each step).
# shellcheck disable=SC2317  # functions called from traps
set -u -o pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PORT=1234
A_SRC=198.18.20.1 A_DST=198.18.20.2
B_SRC=198.18.21.1 B_DST=198.18.21.2
HB_MS=200
HB_MISSED=5
RECONNECT_MS=200
SESSION=soak

# shellcheck source-path=SCRIPTDIR source=soak-lib.sh
. "$HERE/soak-lib.sh"

path_spec() {  # path_spec A|B -> the client's path argument
  case $1 in
    A) echo "tcp:$A_SRC@tcp:$A_DST:$PORT" ;;
    B) echo "tcp:$B_SRC@tcp:$B_DST:$PORT" ;;
    *) return 1 ;;
  esac
}
listen_spec() { case $1 in A) echo "tcp:$A_DST:$PORT" ;; B) echo "tcp:$B_DST:$PORT" ;; *) return 1 ;; esac; }
client_dev() { case $1 in A) echo vca ;; B) echo vcb ;; *) return 1 ;; esac; }
server_dev() { case $1 in A) echo vsa ;; B) echo vsb ;; *) return 1 ;; esac; }
client_mapped() {
  map_volume vol.img || return 1
  timeout 30 "$CLI" --socket "$WORK/cl.sock" client device export vol.img unix "$WORK/vol.sock" >/dev/null ||
    { log "export failed"; return 1; }
}

# ---- hook mode ------------------------------------------------------------------------------

# env_hook PHASE KIND [ARGS]: the kinds this environment does its own way (hook_mode)
env_hook() {
  local phase=$1 kind=$2
  shift 2
  case $kind:$phase in
    path-cut:start | link-flap:start) ip -n "$NSC" link set "$(client_dev "$1")" down ;;
    path-cut:stop | link-flap:stop) ip -n "$NSC" link set "$(client_dev "$1")" up ;;
    eio:start) echo "eio $1 $2" >"$EXPORT_DIR/.soak-ctl" ;;
    slow:start) echo "slow $1" >"$EXPORT_DIR/.soak-ctl" ;;
    eio:stop | slow:stop) echo clear >"$EXPORT_DIR/.soak-ctl" ;;
    # Both ends of the path's veth pair, so both directions are impaired.
    netem:start)
      tc -n "$NSC" qdisc replace dev "$(client_dev "$1")" root netem "${@:2}" &&
        tc -n "$NSS" qdisc replace dev "$(server_dev "$1")" root netem "${@:2}" ;;
    netem:stop)
      local rc=0
      tc -n "$NSC" qdisc del dev "$(client_dev "$1")" root 2>/dev/null || rc=1
      tc -n "$NSS" qdisc del dev "$(server_dev "$1")" root 2>/dev/null || rc=1
      return $rc ;;
    *) echo "soak.sh hook: unknown $phase $kind" >&2; return 2 ;;
  esac
}

[ "${1:-}" = hook ] && hook_mode "$@"

# ---- run mode -------------------------------------------------------------------------------

skip() { echo "1..0 # SKIP $*"; exit 77; }
env_option() { :; }
parse_run_args lib "$@"
case $TARGET in lib | nbd) ;; *) echo "soak.sh: --target lib or nbd" >&2; exit 2 ;; esac

[ "$(id -u)" = 0 ] || skip "not root: network namespaces and a tmpfs mount need it"
command -v ip >/dev/null || skip "no ip(8)"
SRV=$BUILD/server/ibnbd-server CLD=$BUILD/client/daemon/ibnbd-client CLI=$BUILD/client/cli/ibnbd
SOAK=$BUILD/tools/soak/ibnbd-soak FS=$BUILD/tools/soak/ibnbd-soak-fs
for b in "$SRV" "$CLD" "$CLI" "$SOAK"; do [ -x "$b" ] || skip "$b not built"; done
[ "$TARGET" = nbd ] && ! command -v python3 >/dev/null && skip "no python3 (the hook speaks to the client daemon's socket)"

WORK=$(mktemp -d "${TMPDIR:-/var/tmp}/ibnbd-soak.XXXXXX")
NSC=ibnbd-soak-c-$$ NSS=ibnbd-soak-s-$$
MOUNTED_TMPFS=0 FS_PID=""

cleanup() {
  local rc=$? p ns
  trap - EXIT INT TERM HUP
  [ -n "${SOAK_PID:-}" ] && kill -TERM "$SOAK_PID" 2>/dev/null && wait "$SOAK_PID" 2>/dev/null
  stop_daemons
  for ns in "$NSC" "$NSS"; do
    if [ -e "/run/netns/$ns" ]; then
      for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
      ip netns del "$ns" 2>/dev/null
    fi
  done
  if [ -n "$FS_PID" ]; then
    fusermount3 -u "$WORK/fs" 2>/dev/null || umount -l "$WORK/fs" 2>/dev/null
    kill -TERM "$FS_PID" 2>/dev/null
    wait "$FS_PID" 2>/dev/null
  fi
  [ "$MOUNTED_TMPFS" = 1 ] && umount -l "$WORK/tmpfs" 2>/dev/null
  if [ "$KEEP" = 1 ] || [ "$rc" = 1 ]; then
    echo "# soak.sh: logs kept in $WORK"
  else
    rm -rf "$WORK"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# Namespaces and links.
ip netns add "$NSC" 2>/dev/null || skip "ip netns add failed"
ip netns add "$NSS" 2>/dev/null || skip "ip netns add failed"
setup_links() {
  local c s src dst ns
  for ns in "$NSC" "$NSS"; do ip -n "$ns" link set lo up || return 1; done
  for c in vca:vsa:$A_SRC:$A_DST vcb:vsb:$B_SRC:$B_DST; do
    IFS=: read -r c s src dst <<<"$c"
    ip -n "$NSC" link add name "$c" type veth peer name "$s" netns "$NSS" || return 1
    ip -n "$NSC" addr add "$src/24" dev "$c" && ip -n "$NSS" addr add "$dst/24" dev "$s" || return 1
    ip -n "$NSC" link set "$c" up && ip -n "$NSS" link set "$s" up || return 1
  done
  for ns in "$NSC" "$NSS"; do
    ip netns exec "$ns" sysctl -q -w net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1 2>/dev/null
  done
  return 0
}
err=$(setup_links 2>&1) || skip "veth pairs: $err"
# tc netem (sch_netem) for the netem fault: not every kernel has it (this project's CI host does
# not; the VM rig's does).
have_netem=0
if command -v tc >/dev/null && tc -n "$NSC" qdisc add dev vca root netem delay 1ms 2>/dev/null; then
  tc -n "$NSC" qdisc del dev vca root
  have_netem=1
fi
case ,$FAULTS, in *,netem,*) [ "$have_netem" = 1 ] || skip "--faults netem: no tc netem here (sch_netem)" ;; esac

# The store: a sparse file on a tmpfs just larger than it (filled, it gives ENOSPC), behind
# ibnbd-soak-fs when it can mount (EIO and slow faults), else exported directly.
size_bytes=$(numfmt --from=iec "$SIZE") || { echo "soak.sh: bad --size $SIZE" >&2; exit 2; }
mkdir -p "$WORK/tmpfs" "$WORK/fs" "$WORK/cl-state"
mount -t tmpfs -o "size=$((size_bytes + (8 << 20)))" ibnbd-soak "$WORK/tmpfs" || skip "cannot mount a tmpfs"
MOUNTED_TMPFS=1
truncate -s "$size_bytes" "$WORK/tmpfs/vol.img"
EXPORT_DIR=$WORK/tmpfs
have_fs=0
# SOAK_NO_FS=1: the file exported directly from the tmpfs (no FUSE in the server's IO path).
if [ "${SOAK_NO_FS:-0}" != 1 ] && [ -x "$FS" ] && [ -e /dev/fuse ] && command -v fusermount3 >/dev/null; then
  "$FS" "$WORK/tmpfs" "$WORK/fs" --pidfile "$WORK/fs.pid" >"$WORK/fs.log" 2>&1 &
  FS_PID=$!
  for _ in $(seq 100); do [ -e "$WORK/fs/.soak-ctl" ] && break; sleep 0.05; done
  if [ -e "$WORK/fs/.soak-ctl" ]; then
    EXPORT_DIR=$WORK/fs
    have_fs=1
  else
    log "ibnbd-soak-fs did not mount ($(tail -1 "$WORK/fs.log")): no eio or slow faults"
    kill "$FS_PID" 2>/dev/null
    FS_PID=""
  fi
fi

if [ "$FAULTS" = all ]; then
  FAULTS=path-cut,link-flap,server-kill,server-stop,enospc,policy,path-remove
  [ "$TARGET" = nbd ] && FAULTS+=,client-kill
  [ "$have_fs" = 1 ] && FAULTS+=,eio,slow
  [ "$have_netem" = 1 ] && FAULTS+=,netem
fi

"$CLI" key generate host nqn.2014-08.org.nvmexpress:uuid:50a30000-0000-4000-8000-000000000017 \
  out "$WORK/host.key" >/dev/null || { echo "soak.sh: key generate failed" >&2; exit 3; }
printf '{"hosts": [{"key_file": "%s", "access": [{"devices": "**", "mode": "rw"}]}]}\n' "$WORK/host.key" \
  >"$WORK/hosts.json"
cat >"$WORK/env" <<EOF
WORK=$WORK NSC=$NSC NSS=$NSS SRV=$SRV CLD=$CLD CLI=$CLI EXPORT_DIR=$EXPORT_DIR
EOF
export SOAK_WORK=$WORK
start_server || exit 3

args=(--duration "$DURATION" --interval 10s --faults "$FAULTS" --hook "bash $HERE/soak.sh hook"
  --hook-log "$WORK/hook.log" --hb-timeout-ms $((HB_MS * HB_MISSED)) --watch "server=$WORK/srv.pid")
[ -n "$SEED" ] && args+=(--seed "$SEED")
[ -n "$JSON" ] && args+=(--json "$JSON")
log "work dir $WORK, target $TARGET, faults $FAULTS"
if [ "$TARGET" = lib ]; then
  ip netns exec "$NSC" "$SOAK" --lib vol.img --paths "$(path_spec A),$(path_spec B)" \
    --host-key "$WORK/host.key" --session "$SESSION" --hb-interval-ms "$HB_MS" --hb-missed "$HB_MISSED" \
    --reconnect-delay-ms "$RECONNECT_MS" --watch "client=self" "${args[@]}" "${EXTRA[@]}" &
else
  start_client_daemon || exit 3
  "$SOAK" --nbd "$WORK/vol.sock" --export vol.img --watch "client-daemon=$WORK/cl.pid" "${args[@]}" "${EXTRA[@]}" &
fi
SOAK_PID=$!
wait "$SOAK_PID"
rc=$?
SOAK_PID=""
# The daemons stop as an admin stops them; a sanitizer's report, at exit or before, fails the
# run as a defect would.
stop_daemons
rc=$(sanitizer_verdict "$rc" "$WORK"/srv.log "$WORK"/cl.log "$WORK"/fs.log)
if [ "$rc" != 0 ]; then
  echo "# soak.sh: ibnbd-soak exit $rc"
  show_logs
fi
exit "$rc"
