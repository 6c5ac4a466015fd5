#!/usr/bin/env bash
# The soak's VM slice (issue 17; tools/soak/README.md), run INSIDE the VM rig (tests/vm/README.md):
# ibnbd-server and ibnbd-client over the tcp provider on the rig's veth pair, two paths (one
# server port each), the volume a kernel block device -- /dev/ublkbN (ublk) or /dev/nbdN (the
# kernel's nbd client on the daemon's NBD export) -- driven by `ibnbd-soak --file` while it runs
# the faults of its seed through this script's hook mode. The backend is a device-mapper target
# over a loop device on a small tmpfs: EIO (dm `error`), a slow store (dm `delay`) and ENOSPC (the
# tmpfs full) come from the kernel's block layer, not from a test layer.
#
#   tests/vm/run-in-vm.sh [--modprobe ...] -- bash tools/soak/soak-vm.sh BUILD_DIR
#        [--target ublk|nbd-kernel] [--seed N] [--duration 60s] [--faults all|K1,K2,...]
#        [--size 64M] [--netem 'delay 2ms 1ms loss 0.5% duplicate 0.5% reorder 10%']
#        [--json FILE] [--keep] [--ext4] [-- IBNBD-SOAK ARGS...]
#   bash tools/soak/soak-vm.sh hook start|stop KIND [ARGS]    (ibnbd-soak calls it; SOAK_WORK set)
#
# Paths: A tcp:198.18.0.1@tcp:198.18.0.2:12381, B the same to port 12382 (the rig has one address
# pair). A path cut drops that port's TCP segments on both veths (u32 filters on clsact ingress
# qdiscs made at setup, while the guest is idle: the first clsact flips a static key, which under
# TCG has panicked a guest with traffic flowing, tests/netns/vm-multipath.sh). --netem puts a
# netem qdisc on veth0 and veth1 (both directions) for the whole run: loss, delay, reordering and
# duplication under every scheduled fault, not a fault of the schedule.
# Client daemon kill -9: ublk only -- the restarted daemon recovers /dev/ublkbN from its state dir
# (UBLK_F_USER_RECOVERY_REISSUE: the requests the dead daemon held are re-issued, none fails).
# Not nbd-kernel: the kernel's nbd device whose socket died stays dead while anything holds it
# open (every request EIO, also after a new nbd-client attached a new socket to it: measured on
# 6.12), and bookworm's nbd-client 3.24 neither reconnects (-persist quits: NBD_DO_IT returns 0,
# "Kernel call returned.") nor knows the netlink RECONFIGURE that would replace the socket.
# Exit: ibnbd-soak's (0 clean, 1 defects, 2 usage, 3 setup), 77 skipped (not in the VM rig, a
# binary or tool missing). Every process it starts is stopped and every device it made removed
# on any exit; every step is bounded.
# shellcheck disable=SC2317  # functions called from traps
set -u -o pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
A=${IBTRS_RDMA_ADDR_A:-198.18.0.1} B=${IBTRS_RDMA_ADDR_B:-198.18.0.2}
NET_A=${IBTRS_RDMA_NETDEV_A:-veth0} NET_B=${IBTRS_RDMA_NETDEV_B:-veth1}
PORT_A=12381 PORT_B=12382
# TCG on a loaded host stalls for hundreds of ms: a lenient heartbeat (server-stop outlasts it).
HB_MS=300
HB_MISSED=5
RECONNECT_MS=300
SESSION=soakvm
NSS="" NSC=""
CL_READY_TRIES=1800  # a restart recovers the ublk device first: up to 90 s (client/README.md)

# shellcheck source-path=SCRIPTDIR source=soak-lib.sh
. "$HERE/soak-lib.sh"

port_of() { case $1 in A) echo "$PORT_A" ;; B) echo "$PORT_B" ;; *) return 1 ;; esac; }
path_spec() { echo "tcp:$A@tcp:$B:$(port_of "$1")"; }
listen_spec() { echo "tcp:$B:$(port_of "$1")"; }

# client_mapped: after a start of the client daemon. ublk: the first start maps; a restart has
# recovered the device already (the same /dev/ublkbN or the run fails). nbd-kernel: map and
# export.
client_mapped() {
  local dev
  if [ "$TARGET" = ublk ]; then
    if [ ! -s "$WORK/dev" ]; then
      map_volume "$VOL" --ublk || return 1
      dev=$(timeout 30 "$CLI" --socket "$WORK/cl.sock" client -f json device show "$VOL" | jq -r '.[0].ublk')
      [ -b "$dev" ] || { log "map --ublk gave no block device ('$dev')"; return 1; }
      echo "$dev" >"$WORK/dev"
    else
      dev=$(timeout 30 "$CLI" --socket "$WORK/cl.sock" client -f json device show "$VOL" | jq -r '.[0].ublk')
      [ "$dev" = "$(cat "$WORK/dev")" ] || { log "not recovered: device show says '$dev'"; return 1; }
    fi
  else
    map_volume "$VOL" || return 1
    timeout 30 "$CLI" --socket "$WORK/cl.sock" client device export "$VOL" unix "$WORK/vol.sock" >/dev/null ||
      { log "export failed"; return 1; }
  fi
}

# dm_table [error|delay OFFSET LENGTH|MS]: the backend's table: the loop device, linear; with a
# range of it failing (dm error), or all of it delayed (dm delay, ms per request).
dm_table() {
  local sectors=$((SIZE_BYTES / 512)) s e
  case ${1:-} in
    error)
      s=$(($2 / 512)) e=$((($2 + $3) / 512))
      [ "$s" -gt 0 ] && echo "0 $s linear $LOOP 0"
      echo "$s $((e - s)) error"
      [ "$e" -lt "$sectors" ] && echo "$e $((sectors - e)) linear $LOOP $e"
      return 0 ;;
    delay) echo "0 $sectors delay $LOOP 0 $2" ;;
    *) echo "0 $sectors linear $LOOP 0" ;;
  esac
}
# dm_swap TABLE...: load it and resume (the kernel suspends the device, letting its IO finish)
dm_swap() { dm_table "$@" | timeout 60 dmsetup load "$DM" && timeout 60 dmsetup resume --noudevsync "$DM"; }

# block_port PORT add|del: drop the TCP segments of a path's port both ways (client -> server arrives
# on veth1, server -> client on veth0)
block_port() {
  local port=$1 op=$2 pref=$(($1 - 12300))
  if [ "$op" = add ]; then
    tc filter add dev "$NET_B" ingress pref "$pref" protocol ip u32 match ip protocol 6 0xff \
      match ip dport "$port" 0xffff action drop &&
      tc filter add dev "$NET_A" ingress pref "$pref" protocol ip u32 match ip protocol 6 0xff \
        match ip sport "$port" 0xffff action drop
  else
    tc filter del dev "$NET_B" ingress pref "$pref" 2>/dev/null
    tc filter del dev "$NET_A" ingress pref "$pref" 2>/dev/null
    return 0
  fi
}

# ---- hook mode ------------------------------------------------------------------------------

# env_hook PHASE KIND [ARGS]: the kinds this environment does its own way (hook_mode)
env_hook() {
  local phase=$1 kind=$2
  shift 2
  case $kind:$phase in
    path-cut:start | link-flap:start) block_port "$(port_of "$1")" add ;;
    path-cut:stop | link-flap:stop) block_port "$(port_of "$1")" del ;;
    eio:start) dm_swap error "$1" "$2" ;;
    slow:start) dm_swap delay $((($1 + 999) / 1000)) ;;
    eio:stop | slow:stop) dm_swap ;;
    *) echo "soak-vm.sh hook: unknown $phase $kind" >&2; return 2 ;;
  esac
}

[ "${1:-}" = hook ] && hook_mode "$@"

# ---- run mode -------------------------------------------------------------------------------

skip() { echo "1..0 # SKIP $*"; exit 77; }
NETEM="" EXT4=0
env_option() {
  case $1 in
    --netem) NETEM=$2 took=2 ;;
    --ext4) EXT4=1 took=1 ;;
  esac
}
parse_run_args ublk "$@"
case $TARGET in ublk | nbd-kernel) ;; *) echo "soak-vm.sh: --target ublk or nbd-kernel" >&2; exit 2 ;; esac
SIZE_BYTES=$(numfmt --from=iec "$SIZE") && [ $((SIZE_BYTES % 4096)) = 0 ] ||
  { echo "soak-vm.sh: bad --size $SIZE (a multiple of 4 KiB)" >&2; exit 2; }

[ "${IBTRS_VM:-}" = 1 ] || skip "not inside the VM rig: run it through tests/vm/run-in-vm.sh"
[ "$(id -u)" = 0 ] || skip "not root"
SRV=$BUILD/server/ibnbd-server CLD=$BUILD/client/daemon/ibnbd-client CLI=$BUILD/client/cli/ibnbd
SOAK=$BUILD/tools/soak/ibnbd-soak
for b in "$SRV" "$CLD" "$CLI" "$SOAK"; do [ -x "$b" ] || skip "$b not built"; done
for t in jq python3 tc losetup numfmt; do command -v "$t" >/dev/null || skip "no $t"; done
if [ "$TARGET" = ublk ]; then
  [ -e /dev/ublk-control ] || skip "no /dev/ublk-control (ublk_drv)"
else
  command -v nbd-client >/dev/null || skip "no nbd-client"
  [ -b /dev/nbd0 ] || skip "no /dev/nbd0 (the nbd module)"
fi

WORK=$(mktemp -d /tmp/ibnbd-soakvm.XXXXXX)  # the guest's overlay: RAM
DM=ibnbd-soakvm-$$ VOL=ibnbd-soakvm-$$ LOOP="" HAVE_DM=0 MOUNTED_TMPFS=0 CLSACT=0 NETEM_ON=0 NBD=""

cleanup() {
  local rc=$?
  trap - EXIT INT TERM HUP
  [ -n "${SOAK_PID:-}" ] && kill -TERM "$SOAK_PID" 2>/dev/null && wait "$SOAK_PID" 2>/dev/null
  [ -n "${MNT:-}" ] && timeout 60 umount "$MNT" 2>/dev/null
  [ -n "$NBD" ] && timeout 20 nbd-client -d "$NBD" >/dev/null 2>&1
  stop_daemons
  block_port "$PORT_A" del
  block_port "$PORT_B" del
  if [ "$CLSACT" = 1 ]; then tc qdisc del dev "$NET_A" clsact 2>/dev/null; tc qdisc del dev "$NET_B" clsact 2>/dev/null; fi
  if [ "$NETEM_ON" = 1 ]; then tc qdisc del dev "$NET_A" root 2>/dev/null; tc qdisc del dev "$NET_B" root 2>/dev/null; fi
  [ "$HAVE_DM" = 1 ] && timeout 30 dmsetup remove --retry "$DM" 2>/dev/null
  [ -n "$LOOP" ] && losetup -d "$LOOP" 2>/dev/null
  [ "$MOUNTED_TMPFS" = 1 ] && umount -l "$WORK/tmpfs" 2>/dev/null
  if [ "$KEEP" = 1 ]; then echo "# soak-vm.sh: logs kept in $WORK (the guest's RAM)"; else rm -rf "$WORK"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# The store: a sparse file on a tmpfs just larger than it (full, it gives ENOSPC), through a loop
# device and a device-mapper table (EIO and slow), exported as /dev/mapper/$DM. Without
# device-mapper, or with SOAK_VM_NO_DM=1, the file itself is exported (enospc; no eio or slow).
mkdir -p "$WORK/tmpfs" "$WORK/cl-state"
mount -t tmpfs -o "size=$((SIZE_BYTES + (8 << 20)))" ibnbd-soakvm "$WORK/tmpfs" || skip "cannot mount a tmpfs"
MOUNTED_TMPFS=1
truncate -s "$SIZE_BYTES" "$WORK/tmpfs/vol.img"
EXPORT_DIR=$WORK/tmpfs VOL=vol.img
modprobe -q loop 2>/dev/null
modprobe -q dm_mod 2>/dev/null
modprobe -q dm_delay 2>/dev/null
if [ "${SOAK_VM_NO_DM:-0}" != 1 ] && command -v dmsetup >/dev/null && LOOP=$(losetup -f --show "$WORK/tmpfs/vol.img" 2>"$WORK/dm.err") &&
   dm_table | dmsetup create --noudevsync "$DM" 2>>"$WORK/dm.err"; then
  HAVE_DM=1
  dmsetup mknodes "$DM" 2>/dev/null
  EXPORT_DIR=/dev/mapper VOL=$DM
else
  log "no device-mapper backend ($(tail -1 "$WORK/dm.err")): the file exported, no eio or slow faults"
fi

# ENOSPC only from the file itself: the loop driver turns every error of its file but
# EOPNOTSUPP into EIO (drivers/block/loop.c, 6.12), so a full tmpfs under the dm backend would
# be an EIO no fault explains.
if [ "$EXT4" = 1 ]; then
  [ "$FAULTS" = all ] && FAULTS=server-kill,server-stop && [ "$TARGET" = ublk ] && FAULTS+=,client-kill
  [ -n "$SEED" ] || SEED=$(od -An -N2 -tu2 /dev/urandom | tr -d ' ')
  case ,$FAULTS, in
    *,path-cut,* | *,link-flap,* | *,eio,* | *,slow,* | *,enospc,* | *,policy,* | *,path-remove,*)
      echo "soak-vm.sh: --ext4 runs server-kill, server-stop and client-kill only" >&2; exit 2 ;;
  esac
fi
if [ "$FAULTS" = all ]; then
  FAULTS=path-cut,link-flap,server-kill,server-stop,policy,path-remove
  [ "$TARGET" = ublk ] && FAULTS+=,client-kill
  if [ "$HAVE_DM" = 1 ]; then FAULTS+=,eio,slow; else FAULTS+=,enospc; fi
fi
case ,$FAULTS, in
  *,client-kill,*) [ "$TARGET" = ublk ] ||
    { echo "soak-vm.sh: client-kill needs --target ublk (the kernel's nbd device cannot be re-attached: see the top of the file)" >&2; exit 2; } ;;
esac
case ,$FAULTS, in
  *,eio,* | *,slow,*) [ "$HAVE_DM" = 1 ] || skip "eio and slow need the device-mapper backend" ;;
esac
case ,$FAULTS, in
  *,enospc,*) [ "$HAVE_DM" = 0 ] ||
    { echo "soak-vm.sh: enospc needs SOAK_VM_NO_DM=1 (the loop device under dm makes ENOSPC an EIO)" >&2; exit 2; } ;;
esac
case ,$FAULTS, in
  *,path-cut,* | *,link-flap,*)
    # Made now, while the guest is idle (see the top of the file), and the filter's modules
    # loaded (a first filter loads them: seconds under TCG, with the path's IO waiting).
    modprobe -q cls_u32 2>/dev/null
    modprobe -q act_gact 2>/dev/null
    tc qdisc add dev "$NET_A" clsact && tc qdisc add dev "$NET_B" clsact || skip "no clsact qdisc for path cuts"
    CLSACT=1 ;;
esac
if [ -n "$NETEM" ]; then
  # shellcheck disable=SC2086  # netem's arguments, split
  { tc qdisc add dev "$NET_A" root netem $NETEM && tc qdisc add dev "$NET_B" root netem $NETEM; } ||
    { echo "soak-vm.sh: tc netem $NETEM failed (sch_netem?)" >&2; exit 3; }
  NETEM_ON=1
fi

"$CLI" key generate host nqn.2014-08.org.nvmexpress:uuid:50a30000-0000-4000-8000-000000000018 \
  out "$WORK/host.key" >/dev/null || { echo "soak-vm.sh: key generate failed" >&2; exit 3; }
printf '{"hosts": [{"key_file": "%s", "access": [{"devices": "**", "mode": "rw"}]}]}\n' "$WORK/host.key" \
  >"$WORK/hosts.json"
cat >"$WORK/env" <<EOF
WORK=$WORK SRV=$SRV CLD=$CLD CLI=$CLI EXPORT_DIR=$EXPORT_DIR TARGET=$TARGET VOL=$VOL DM=$DM
LOOP=$LOOP SIZE_BYTES=$SIZE_BYTES
EOF
export SOAK_WORK=$WORK
start_server || exit 3
start_client_daemon || exit 3
if [ "$TARGET" = ublk ]; then
  DEV=$(cat "$WORK/dev")
else
  NBD=/dev/nbd0
  timeout 60 nbd-client -unix "$WORK/vol.sock" "$NBD" -N "$VOL" -b 4096 >"$WORK/nbd.log" 2>&1 ||
    { echo "soak-vm.sh: nbd-client: $(tail -2 "$WORK/nbd.log")" >&2; exit 3; }
  DEV=$NBD
fi

# ext4_run: --ext4 instead of ibnbd-soak. ext4 on the device; a writer creates files (4 KiB to
# 256 KiB of random bytes) and rewrites old ones in place, each made durable (dd conv=fsync,
# then syncfs) before its checksum is recorded outside the device; meanwhile the faults of
# --faults (server-kill, server-stop, client-kill) at seeded times, 3-8 s apart. Then: unmount,
# e2fsck -fn, mount again (nothing from the page cache) and every recorded file must read back
# as recorded. Fails on a mismatch, a missing file, an error the writer saw, a dirty fsck.
ext4_run() {
  local mnt=$WORK/mnt end i n kinds k bad=0 faults=0 werr
  command -v mkfs.ext4 >/dev/null && command -v e2fsck >/dev/null || skip "no mkfs.ext4 / e2fsck"
  mkdir -p "$mnt"
  timeout 300 mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$DEV" >"$WORK/mkfs.log" 2>&1 &&
    timeout 60 mount "$DEV" "$mnt" || { echo "soak-vm.sh: mkfs.ext4 + mount: $(tail -2 "$WORK/mkfs.log")" >&2; return 3; }
  MNT=$mnt
  : >"$WORK/durable"
  (
    i=0 RANDOM=$((SEED + 1))
    while [ ! -e "$WORK/stop" ]; do
      if [ $i -gt 8 ] && [ $((RANDOM % 4)) = 0 ]; then f=f$((RANDOM % i + 1)) conv=fsync,notrunc
      else i=$((i + 1)) f=f$i conv=fsync; fi
      timeout 120 dd if=/dev/urandom of="$mnt/$f" bs=4k count=$((RANDOM % 64 + 1)) conv="$conv" status=none &&
        timeout 120 sync -f "$mnt" || { echo "$f" >>"$WORK/writer.err"; continue; }
      (cd "$mnt" && sha256sum "$f") >>"$WORK/durable"
    done
  ) &
  local writer=$!
  IFS=, read -r -a kinds <<<"$FAULTS"
  RANDOM=$SEED
  case $DURATION in
    *m) end=$((SECONDS + ${DURATION%m} * 60)) ;;
    *s) end=$((SECONDS + ${DURATION%s})) ;;
    *) end=$((SECONDS + DURATION)) ;;
  esac
  while [ $((SECONDS + 8)) -lt "$end" ]; do
    sleep $((RANDOM % 6 + 3))
    k=${kinds[$((RANDOM % ${#kinds[@]}))]}
    log "ext4: $k"
    hook_common start "$k" >>"$WORK/hook.log" 2>&1 || { log "ext4: $k start failed"; bad=1; }
    [ "$k" = server-stop ] && sleep $(((HB_MS * HB_MISSED) / 1000 + 1))
    sleep 0.$((RANDOM % 9 + 1))
    hook_common stop "$k" >>"$WORK/hook.log" 2>&1 || { log "ext4: $k stop failed"; bad=1; }
    faults=$((faults + 1))
  done
  touch "$WORK/stop"
  wait "$writer"
  # The latest record of each file is what it must hold.
  tac "$WORK/durable" | awk '!seen[$2]++' >"$WORK/expect"
  n=$(wc -l <"$WORK/expect")
  werr=$(wc -l <"$WORK/writer.err" 2>/dev/null || echo 0)
  timeout 120 umount "$mnt" || { echo "soak-vm.sh: umount failed" >&2; return 1; }
  MNT=""
  if ! timeout 300 e2fsck -fn "$DEV" >"$WORK/fsck.log" 2>&1; then
    echo "# e2fsck -fn: $(tail -5 "$WORK/fsck.log")"
    bad=1
  fi
  timeout 60 mount "$DEV" "$mnt" || { echo "soak-vm.sh: remount failed" >&2; return 1; }
  MNT=$mnt
  (cd "$mnt" && sha256sum -c --quiet "$WORK/expect") >"$WORK/check.log" 2>&1 || bad=1
  echo "== ext4 crash consistency: seed $SEED, $DURATION, $faults faults ($FAULTS), $(wc -l <"$WORK/durable") durable writes of $n files, writer errors $werr, mismatches $(grep -c -v '^$' "$WORK/check.log")"
  [ -s "$WORK/check.log" ] && sed 's/^/#   /' "$WORK/check.log" | head -20
  timeout 60 umount "$mnt"
  MNT=""
  [ "$werr" = 0 ] || bad=1
  [ "$bad" = 0 ] && echo "verdict        clean" || echo "verdict        DEFECTS"
  return "$bad"
}

if [ "$EXT4" = 1 ]; then
  ext4_run
  rc=$?
  stop_daemons
  rc=$(sanitizer_verdict "$rc" "$WORK"/srv.log "$WORK"/cl.log)
  [ "$rc" = 0 ] || show_logs
  exit "$rc"
fi

# shellcheck disable=SC2054  # A,B is one argument
args=(--file "$DEV" --duration "$DURATION" --interval 10s --faults "$FAULTS" --hook "bash $HERE/soak-vm.sh hook"
  --hook-log "$WORK/hook.log" --hb-timeout-ms $((HB_MS * HB_MISSED)) --path-labels A,B
  --watch "server=$WORK/srv.pid" --watch "client-daemon=$WORK/cl.pid")
[ -n "$SEED" ] && args+=(--seed "$SEED")
[ -n "$JSON" ] && args+=(--json "$JSON")
log "work dir $WORK, target $TARGET ($DEV), backend $EXPORT_DIR/$VOL, faults $FAULTS${NETEM:+, netem $NETEM}"
"$SOAK" "${args[@]}" "${EXTRA[@]}" &
SOAK_PID=$!
wait "$SOAK_PID"
rc=$?
SOAK_PID=""
[ -n "$NBD" ] && { timeout 20 nbd-client -d "$NBD" >/dev/null 2>&1; NBD=""; }
stop_daemons
rc=$(sanitizer_verdict "$rc" "$WORK"/srv.log "$WORK"/cl.log)
if [ "$rc" != 0 ]; then
  echo "# soak-vm.sh: ibnbd-soak exit $rc"
  show_logs
  echo "# kernel log:"; dmesg 2>/dev/null | tail -n 15 | sed 's/^/#   /'
fi
exit "$rc"
