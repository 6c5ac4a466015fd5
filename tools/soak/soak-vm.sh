#!/usr/bin/env bash
# The soak's VM slice (issue 17; tools/soak/README.md), run INSIDE the VM rig (tests/vm/README.md):
# ibnbd-server and ibnbd-client over the tcp provider on the rig's veth pair, two paths (one
# server port each), the volume a kernel block device -- /dev/ublkbN (ublk) or /dev/nbdN (the
# kernel's nbd client on the daemon's NBD export) -- driven by `ibnbd-soak --file` while it runs
# the faults of its seed through this script's hook mode. The backend is a device-mapper target
# over a loop device on a small tmpfs: EIO (dm `error`), a slow store (dm `delay`) and ENOSPC (the
# tmpfs full) come from the kernel's block layer, not from a test layer.
#
#   tests/vm/run-in-vm.sh [--modprobe ... sch_netem sch_prio] -- bash tools/soak/soak-vm.sh BUILD_DIR
#        [--target ublk|nbd-kernel] [--seed N] [--duration 60s] [--faults all|K1,K2,...]
#        [--size 64M] [--netem 'delay 2ms 1ms loss 0.5% duplicate 0.5% reorder 10%']
#        [--json FILE] [--keep] [--ext4 [--log-writes [--log-size 256M] [--log-points 40]]]
#        [--logs DIR] [--watchdog SECONDS] [-- IBNBD-SOAK ARGS...]
#   bash tools/soak/soak-vm.sh hook start|stop KIND [ARGS]    (ibnbd-soak calls it; SOAK_WORK set)
#
# Paths: A tcp:198.18.0.1@tcp:198.18.0.2:12381, B the same to port 12382 (the rig has one address
# pair). A path cut drops that port's TCP segments on both veths (u32 filters on clsact ingress
# qdiscs made at setup, while the guest is idle: the first clsact flips a static key, which under
# TCG has panicked a guest with traffic flowing, tests/netns/vm-multipath.sh). The netem fault
# impairs one path both ways: prio qdiscs with a band per path's port (netem_tree, below).
# --netem puts a netem on veth0 and veth1 (both directions) for the whole run: loss, delay,
# reordering and duplication under every scheduled fault (with netem faults, as each band's base).
# Client daemon kill -9: ublk only -- the restarted daemon recovers /dev/ublkbN from its state dir
# (UBLK_F_USER_RECOVERY_REISSUE: the requests the dead daemon held are re-issued, none fails).
# Not nbd-kernel: the kernel's nbd device whose socket died stays dead while anything holds it
# open (every request EIO, also after a new nbd-client attached a new socket to it: measured on
# 6.12), and bookworm's nbd-client 3.24 neither reconnects (-persist quits: NBD_DO_IT returns 0,
# "Kernel call returned.") nor knows the netlink RECONFIGURE that would replace the socket.
# --logs DIR (a --rw-share of run-in-vm.sh): the run's output, the daemons' and the hook's logs,
# the writer's errors and the guest's dmesg are copied there while it runs and on any exit, with
# a full dump (tasks in D state and their kernel stacks, the daemons' session/path/device lists,
# the block devices' in-flight IO) on exit and from the watchdog (soak-diag.sh). --watchdog
# SECONDS: a run still going then is dumped and ended (exit 4), so that a hang is reported by
# the guest, not by the VM's limit; by default 60 s (or a sixth of the time, if more) before the
# VM's limit when the rig says it (IBTRS_VM_DEADLINE), else none; 0: none.
# Exit: ibnbd-soak's (0 clean, 1 defects, 2 usage, 3 setup), 4 ended by the watchdog, 77
# skipped (not in the VM rig, a binary or tool missing). Every process it starts is stopped and
# every device it made removed on any exit; every step is bounded, the watchdog included (a task
# in D state cannot be killed: it is named and left behind).
# shellcheck disable=SC2317  # functions called from traps
set -u -o pipefail
RUN_T0=$EPOCHSECONDS  # the watchdog counts from here: a starved guest spends minutes in setup

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
A=${IBTRS_RDMA_ADDR_A:-198.18.0.1} B=${IBTRS_RDMA_ADDR_B:-198.18.0.2}
NET_A=${IBTRS_RDMA_NETDEV_A:-veth0} NET_B=${IBTRS_RDMA_NETDEV_B:-veth1}
PORT_A=12381 PORT_B=12382
# TCG on a loaded host stalls for hundreds of ms: a lenient heartbeat (server-stop outlasts it).
HB_MS=300
HB_MISSED=5
RECONNECT_MS=300
SESSION=soakvm
# The client daemon's pending_timeout and remap_timeout (the library's defaults: the daemon has
# no option for them): IO that waits longer for a server fails with EIO by design.
PENDING_MS=30000
NSS="" NSC=""
CL_READY_TRIES=1800  # a restart recovers the ublk device first: up to 90 s (client/README.md)

# shellcheck source-path=SCRIPTDIR source=soak-lib.sh
. "$HERE/soak-lib.sh"
# shellcheck source-path=SCRIPTDIR source=soak-diag.sh
. "$HERE/soak-diag.sh"

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

# tcb ARGS...: tc, bounded (a hook step must return; rtnl held by a stuck task would block it)
tcb() { timeout 10 tc "$@"; }

# block_port PORT add|del: drop the TCP segments of a path's port both ways (client -> server arrives
# on veth1, server -> client on veth0)
block_port() {
  local port=$1 op=$2 pref=$(($1 - 12300))
  if [ "$op" = add ]; then
    tcb filter add dev "$NET_B" ingress pref "$pref" protocol ip u32 match ip protocol 6 0xff \
      match ip dport "$port" 0xffff action drop &&
      tcb filter add dev "$NET_A" ingress pref "$pref" protocol ip u32 match ip protocol 6 0xff \
        match ip sport "$port" 0xffff action drop
  else
    tcb filter del dev "$NET_B" ingress pref "$pref" 2>/dev/null
    tcb filter del dev "$NET_A" ingress pref "$pref" 2>/dev/null
    return 0
  fi
}

# ---- the netem fault: one path's traffic impaired, both directions --------------------------
# Both paths share the veth pair and the addresses; the server's port tells them apart both ways:
# client -> server leaves veth0 to that port, server -> client leaves veth1 from it. Each veth's
# root is a prio qdisc (made at setup, idle) whose u32 filters put path A's segments in band 1:1
# and B's in 1:2; the priomap sends everything else (no filter matched: the ARP, the rig's other
# traffic) to band 1:3. Each band's child is the base (pfifo, or --netem's netem: the whole-run
# impairment then holds on every band); the fault replaces the path's child on both veths with
# its netem and the stop puts the base back, each with a handle of its own (base 1N:, the fault's
# 2N: for band N) so that a replace makes a new qdisc, whose counters are the fault's alone, not
# a change of the old one's parameters. prio is strict priority, but a veth does not hold
# back its queue: the bands do not wait on each other. netem_report checks the fault's qdiscs
# carried packets both ways: a netem that impaired nothing would be a fake fault.
band_of() { case $1 in A) echo 1:1 ;; B) echo 1:2 ;; *) return 1 ;; esac; }
netem_base() { if [ -n "${NETEM_BASE:-}" ]; then echo "netem $NETEM_BASE"; else echo "pfifo limit 1000"; fi; }

# netem_tree: the prio qdiscs, their base children and the filters on both veths
netem_tree() {
  local dev dir b p base
  read -r -a base <<<"$(netem_base)"
  for dev in "$NET_A:dport" "$NET_B:sport"; do
    dir=${dev##*:} dev=${dev%:*}
    tcb qdisc add dev "$dev" root handle 1: prio bands 3 priomap 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 || return 1
    for b in 1 2 3; do tcb qdisc add dev "$dev" parent "1:$b" handle "1$b:" "${base[@]}" || return 1; done
    for p in A B; do
      tcb filter add dev "$dev" parent 1: pref "$(($(port_of "$p") - 12300))" protocol ip u32 \
        match ip protocol 6 0xff match ip "$dir" "$(port_of "$p")" 0xffff flowid "$(band_of "$p")" || return 1
    done
  done
}

# netem_set PATH fault NETEM-ARGS... | PATH base: the path's band on both veths gets that child
netem_set() {
  local band dev handle qd
  band=$(band_of "$1") || return 2
  if [ "$2" = fault ]; then handle=2${band#1:}: qd=(netem "${@:3}"); else handle=1${band#1:}: qd=(); read -r -a qd <<<"$(netem_base)"; fi
  # One tc for both veths (tc -batch: a fork less), the words as they came (no quoting in them)
  for dev in "$NET_A" "$NET_B"; do echo "qdisc replace dev $dev parent $band handle $handle ${qd[*]}"; done | tcb -batch -
}

# netem_count DEV BAND: "PACKETS DROPS" of the band's child qdisc, from tc -s's text read with
# builtins (a hook step under TCG on a loaded host took 20 s: every fork counts)
netem_count() {
  local out line hit=0
  out=$(tcb -s qdisc show dev "$1") || return 1
  while read -r line; do
    if [[ $line == qdisc\ * ]]; then
      hit=0
      [[ "$line " == *" parent $2 "* ]] && hit=1
    elif [ "$hit" = 1 ] && [[ $line =~ ^Sent\ [0-9]+\ bytes\ ([0-9]+)\ pkt\ \(dropped\ ([0-9]+), ]]; then
      echo "${BASH_REMATCH[1]} ${BASH_REMATCH[2]}"
      return 0
    fi
  done <<<"$out"
  return 1
}

# netem_report PATH: what the fault's netem qdiscs did (hook.log); 1 when one direction carried
# nothing (the filter missed the path's traffic: a fault that impaired nothing)
netem_report() {
  local band c s rc=0
  band=$(band_of "$1") || return 2
  if ! c=$(netem_count "$NET_A" "$band") || ! s=$(netem_count "$NET_B" "$band") || [ -z "$c" ] || [ -z "$s" ]; then
    log "netem $1: tc -s found no qdisc on band $band"
    return 1
  fi
  log "netem $1 band $band: client->server ($NET_A) sent ${c% *} pkts, dropped ${c#* }; server->client ($NET_B) sent ${s% *} pkts, dropped ${s#* }"
  for c in "$c" "$s"; do
    [ $((${c% *} + ${c#* })) -gt 0 ] || rc=1
  done
  [ "$rc" = 0 ] || log "netem $1: a direction saw no packet: the band's filter does not match path $1's traffic"
  return "$rc"
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
    netem:start) netem_set "$1" fault "${@:2}" ;;
    netem:stop)
      # The counts first (the replace drops the qdisc and them), the base back in any case.
      local rc=0
      netem_report "$1" || rc=1
      netem_set "$1" base || rc=1
      return "$rc" ;;
    *) echo "soak-vm.sh hook: unknown $phase $kind" >&2; return 2 ;;
  esac
}

[ "${1:-}" = hook ] && hook_mode "$@"

# ---- run mode -------------------------------------------------------------------------------

skip() { echo "1..0 # SKIP $*"; exit 77; }
NETEM="" EXT4=0 LOGW=0 LOG_SIZE=256M LOG_POINTS=40 LOGS="" WATCHDOG=""
env_option() {
  case $1 in
    --logs) LOGS=$2 took=2 ;;
    --watchdog) WATCHDOG=$2 took=2 ;;
    --netem) NETEM=$2 took=2 ;;
    --ext4) EXT4=1 took=1 ;;
    --log-writes) LOGW=1 took=1 ;;
    --log-size) LOG_SIZE=$2 took=2 ;;
    --log-points) LOG_POINTS=$2 took=2 ;;
  esac
}
parse_run_args ublk "$@"
case $TARGET in ublk | nbd-kernel) ;; *) echo "soak-vm.sh: --target ublk or nbd-kernel" >&2; exit 2 ;; esac
SIZE_BYTES=$(numfmt --from=iec "$SIZE") && [ $((SIZE_BYTES % 4096)) = 0 ] ||
  { echo "soak-vm.sh: bad --size $SIZE (a multiple of 4 KiB)" >&2; exit 2; }
if [ "$LOGW" = 1 ]; then
  [ "$EXT4" = 1 ] || { echo "soak-vm.sh: --log-writes goes with --ext4" >&2; exit 2; }
  if ! LOG_BYTES=$(numfmt --from=iec "$LOG_SIZE") || [ $((LOG_BYTES % 4096)) != 0 ] || [ "$LOG_BYTES" = 0 ]; then
    echo "soak-vm.sh: bad --log-size $LOG_SIZE (a multiple of 4 KiB)" >&2
    exit 2
  fi
  if ! [[ $LOG_POINTS =~ ^[1-9][0-9]*$ ]]; then echo "soak-vm.sh: bad --log-points $LOG_POINTS (1 or more)" >&2; exit 2; fi
fi

if [ -n "$LOGS" ]; then
  if ! [ -d "$LOGS" ] || ! [ -w "$LOGS" ]; then echo "soak-vm.sh: --logs $LOGS: not a writable directory" >&2; exit 2; fi
  # The daemons' logs then say when each path's reconnect failed and succeeded (a few lines
  # per fault), which is what a pause or an error after a fault is measured against.
  export IBTRS_LOG=${IBTRS_LOG:-info}
fi
if [ -z "$WATCHDOG" ]; then
  # The rig's limit (epoch seconds, host clock; the guest's clock is the host's under TCG).
  WATCHDOG=0
  if [[ ${IBTRS_VM_DEADLINE:-} =~ ^[0-9]+$ ]]; then
    left=$((IBTRS_VM_DEADLINE - RUN_T0))
    # The reason and the dump (~20 s) come well before the limit; the run's cleanup gets the
    # rest of the margin but 10 s (at most 90 s) before the watchdog's KILL.
    margin=$((left / 6 > 60 ? left / 6 : 60))
    WATCHDOG=$((left - margin))
    WATCHDOG_GRACE=$((margin - 40 > 90 ? 90 : margin - 40))
    [ "$WATCHDOG" -gt 0 ] || WATCHDOG=1
  fi
elif ! [[ $WATCHDOG =~ ^[0-9]+$ ]]; then
  echo "soak-vm.sh: bad --watchdog $WATCHDOG (seconds, 0: none)" >&2
  exit 2
fi
# An epoch, not a count from the watcher's start: setup before it can take minutes (a guest at
# host load ~30 took 200 s from its start to the loop device, and the VM's limit came first).
WATCHDOG_AT=0
[ "$WATCHDOG" = 0 ] || WATCHDOG_AT=$((RUN_T0 + WATCHDOG))

[ "${IBTRS_VM:-}" = 1 ] || skip "not inside the VM rig: run it through tests/vm/run-in-vm.sh"
[ "$(id -u)" = 0 ] || skip "not root"
SRV=$BUILD/server/ibnbd-server CLD=$BUILD/client/daemon/ibnbd-client CLI=$BUILD/client/cli/ibnbd
SOAK=$BUILD/tools/soak/ibnbd-soak REPLAY=$BUILD/tools/soak/ibnbd-log-replay
for b in "$SRV" "$CLD" "$CLI" "$SOAK"; do [ -x "$b" ] || skip "$b not built"; done
[ "$LOGW" = 0 ] || [ -x "$REPLAY" ] || skip "$REPLAY not built"
for t in jq python3 tc losetup numfmt; do command -v "$t" >/dev/null || skip "no $t"; done
if [ "$TARGET" = ublk ]; then
  [ -e /dev/ublk-control ] || skip "no /dev/ublk-control (ublk_drv)"
else
  command -v nbd-client >/dev/null || skip "no nbd-client"
  [ -b /dev/nbd0 ] || skip "no /dev/nbd0 (the nbd module)"
fi

WORK=$(mktemp -d /tmp/ibnbd-soakvm.XXXXXX)  # the guest's overlay: RAM
DM=ibnbd-soakvm-$$ VOL=ibnbd-soakvm-$$ LOOP="" HAVE_DM=0 MOUNTED_TMPFS=0 CLSACT=0 NETEM_ON=0 PRIO=0 NBD=""
LOGLOOP="" MOUNTED_LOGFS=0 CHECK_MNT="" CHECK_LOOP=""

# recover_orphan: a client daemon that died and was not restarted (a client-kill whose restart
# failed, a kill by the test) leaves /dev/ublkbN waiting for a recovery: every IO to it waits
# forever, and so does every task doing one (D state), a sync of the guest included. Started
# again (the server too, if it is gone) it recovers the device, and its stop_daemons then
# removes it: what is still queued completes or fails. Before the backend goes (lw_run).
recover_orphan() {
  local dev
  [ "$TARGET" = ublk ] && [ -s "$WORK/dev" ] || return 0
  dev=$(cat "$WORK/dev")
  if ! [ -b "$dev" ] || pid_alive "$(cat "$WORK/cl.pid" 2>/dev/null)"; then return 0; fi
  echo "# soak-vm.sh: the client daemon is gone and $dev waits for it: started again to recover it, then stopped (the device goes with it)"
  pid_alive "$(cat "$WORK/srv.pid" 2>/dev/null)" || start_server >>"$WORK/hook.log" 2>&1
  start_client_daemon "$CL_READY_TRIES" >>"$WORK/hook.log" 2>&1 ||
    echo "# soak-vm.sh: that failed ($(tail -n 1 "$WORK/hook.log")): $dev stays, its IO waiting"
}

# stalls_summary: the guest's stalls (diag_stalls), when there were any
stalls_summary() {
  [ -s "$WORK/stalls" ] || return 0
  awk '{ n++; t += $2; if ($2 > m) m = $2 } END { printf "# soak-vm.sh: guest stalls of 2 s or more (a starved VM): %d, the longest %.1f s, %.1f s in all\n", n, m / 1e6, t / 1e6 }' "$WORK/stalls"
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM HUP
  if [ -e "$WORK/watchdog" ]; then
    echo "# soak-vm.sh: ended by the watchdog after $WATCHDOG s (seed ${SEED:-?}; logs: ${LOGS:-none, no --logs})"
    rc=4
  fi
  [ -n "${STALLS_PID:-}" ] && kill "$STALLS_PID" 2>/dev/null
  stalls_summary
  # The dump first (the daemons still there); the watchdog stays on until the end: a cleanup
  # that hangs is ended too.
  [ -n "$LOGS" ] && [ ! -e "$WORK/watchdog" ] && diag_dump "exit-$rc"
  [ -n "${SOAK_PID:-}" ] && kill -TERM "$SOAK_PID" 2>/dev/null && { wait_gone "$SOAK_PID" || kill -KILL "$SOAK_PID"; }
  # The ext4 writer (a subshell; a step of it stuck in D state stays behind, named by bounded)
  [ -n "${WRITER_PID:-}" ] && kill -TERM "$WRITER_PID" 2>/dev/null
  if [ -n "${MNT:-}" ] && ! bounded 60 umount "$MNT" 2>/dev/null; then
    # Still in use (a task in D state on it): detached, so that nothing below walks into it --
    # rm -rf of the work dir went into a mounted ext4 whose device no longer answered, and hung
    # in D state until the VM's limit (session 9, the client daemon killed and not restarted).
    umount -l "$MNT" 2>/dev/null && echo "# soak-vm.sh: $MNT was still in use: detached (umount -l)"
  fi
  [ -n "$CHECK_MNT" ] && bounded 60 umount "$CHECK_MNT" 2>/dev/null
  [ -n "$CHECK_LOOP" ] && losetup -d "$CHECK_LOOP" 2>/dev/null
  [ -n "$NBD" ] && timeout 20 nbd-client -d "$NBD" >/dev/null 2>&1
  recover_orphan
  stop_daemons
  block_port "$PORT_A" del
  block_port "$PORT_B" del
  if [ "$CLSACT" = 1 ]; then tcb qdisc del dev "$NET_A" clsact 2>/dev/null; tcb qdisc del dev "$NET_B" clsact 2>/dev/null; fi
  # The root qdisc goes with its children: the prio tree, a netem fault still on (the run ended
  # or was killed within it), --netem's
  if [ "$NETEM_ON" = 1 ] || [ "$PRIO" = 1 ]; then tcb qdisc del dev "$NET_A" root 2>/dev/null; tcb qdisc del dev "$NET_B" root 2>/dev/null; fi
  [ "$HAVE_DM" = 1 ] && timeout 30 dmsetup remove --retry "$DM" 2>/dev/null
  [ -n "$LOOP" ] && losetup -d "$LOOP" 2>/dev/null
  [ -n "$LOGLOOP" ] && losetup -d "$LOGLOOP" 2>/dev/null
  [ "$MOUNTED_TMPFS" = 1 ] && umount -l "$WORK/tmpfs" 2>/dev/null
  [ "$MOUNTED_LOGFS" = 1 ] && umount -l "$WORK/logfs" 2>/dev/null
  # --one-file-system: never into a file system still mounted below (a detached one is not)
  if [ "$KEEP" = 1 ]; then echo "# soak-vm.sh: logs kept in $WORK (the guest's RAM)"; else rm -rf --one-file-system "$WORK"; fi
  diag_copy
  diag_end
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP
MAIN_PID=$$
diag_start
: >"$WORK/stalls"
diag_stalls "$WORK/stalls" &
STALLS_PID=$!

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
if [ "$LOGW" = 1 ]; then
  # --log-writes: dm-log-writes over the data's loop device, logging to a second loop device on
  # a tmpfs of its own (--log-size; the replays' images go there too). The kernel logs from the
  # table's load: mkfs is in the log, and a replay starts from zeroes, as the data file did.
  command -v dmsetup >/dev/null || skip "no dmsetup"
  modprobe dm_log_writes >"$WORK/dm.err" 2>&1
  timeout 30 dmsetup targets 2>/dev/null | grep -q '^log-writes ' ||
    skip "the VM kernel has no dm-log-writes target ($(uname -r): modprobe dm_log_writes said '$(tail -1 "$WORK/dm.err")')"
  mkdir -p "$WORK/logfs" "$WORK/check-mnt"
  mount -t tmpfs -o "size=$((LOG_BYTES + 3 * SIZE_BYTES + (16 << 20)))" ibnbd-soakvm-log "$WORK/logfs" ||
    skip "cannot mount a tmpfs for the log"
  MOUNTED_LOGFS=1
  truncate -s "$LOG_BYTES" "$WORK/logfs/log.img"
  if ! LOOP=$(losetup -f --show "$WORK/tmpfs/vol.img") || ! LOGLOOP=$(losetup -f --show "$WORK/logfs/log.img") ||
     ! echo "0 $((SIZE_BYTES / 512)) log-writes $LOOP $LOGLOOP" | timeout 60 dmsetup create --noudevsync "$DM" 2>>"$WORK/dm.err"; then
    echo "soak-vm.sh: the dm-log-writes backend: $(tail -1 "$WORK/dm.err")" >&2
    exit 3
  fi
  HAVE_DM=1
  dmsetup mknodes "$DM" 2>/dev/null
  EXPORT_DIR=/dev/mapper VOL=$DM
elif [ "${SOAK_VM_NO_DM:-0}" != 1 ] && command -v dmsetup >/dev/null && LOOP=$(losetup -f --show "$WORK/tmpfs/vol.img" 2>"$WORK/dm.err") &&
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
    *,path-cut,* | *,link-flap,* | *,eio,* | *,slow,* | *,enospc,* | *,policy,* | *,path-remove,* | *,netem,*)
      echo "soak-vm.sh: --ext4 runs server-kill, server-stop and client-kill only" >&2; exit 2 ;;
  esac
fi
# The netem fault's qdiscs (netem_tree), made now while the guest is idle, and tried: a fault's
# netem (with duplication: a kernel may refuse a duplicating netem beside other netems, as with
# --netem) on band A and the base back. Where that does not work the kind is left out of `all`,
# and asked for, the run skips with the reason.
NETEM_BASE=$NETEM HAVE_NETEM=0 NETEM_WHY=""
if [ "$EXT4" = 0 ]; then
  case ,$FAULTS, in
    ,all, | *,netem,*)
      modprobe -q sch_prio 2>/dev/null
      modprobe -q sch_netem 2>/dev/null
      modprobe -q cls_u32 2>/dev/null
      if ! NETEM_WHY=$(netem_tree 2>&1); then
        NETEM_WHY="the prio qdiscs and filters: ${NETEM_WHY//$'\n'/ }"
      elif ! NETEM_WHY=$(netem_set A fault delay 1ms loss 1% duplicate 1% reorder 5% 2>&1 && netem_set A base 2>&1); then
        NETEM_WHY="tc qdisc replace ... netem: ${NETEM_WHY//$'\n'/ } (sch_netem?)"
      else
        HAVE_NETEM=1
      fi
      PRIO=1
      if [ "$HAVE_NETEM" = 0 ]; then
        tcb qdisc del dev "$NET_A" root 2>/dev/null
        tcb qdisc del dev "$NET_B" root 2>/dev/null
        PRIO=0
        log "no netem fault: $NETEM_WHY"
      fi ;;
  esac
fi
if [ "$FAULTS" = all ]; then
  FAULTS=path-cut,link-flap,server-kill,server-stop,policy,path-remove
  [ "$TARGET" = ublk ] && FAULTS+=,client-kill
  if [ "$HAVE_DM" = 1 ]; then FAULTS+=,eio,slow; else FAULTS+=,enospc; fi
  [ "$HAVE_NETEM" = 1 ] && FAULTS+=,netem
fi
case ,$FAULTS, in *,netem,*) [ "$HAVE_NETEM" = 1 ] || skip "--faults netem: $NETEM_WHY" ;; esac
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
if [ -n "$NETEM" ] && [ "$PRIO" = 0 ]; then  # with the prio tree, its bands' base
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
NETEM_BASE=${NETEM_BASE@Q}
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

# ---- --log-writes: the log's durable points, replayed and checked -----------------------------

# lw_mark NAME: a mark in the log. The kernel keeps sectorsize - 33 bytes of a name (479 here) and
# the name is one word of `dmsetup message`: ours are "mkfs", "sQ" and "dQ".
lw_mark() { timeout 30 dmsetup message "$DM" 0 mark "$1"; }

# lw_expect Q: the files that must read back at mark dQ, as `sha256sum -c` input: each file's
# last write up to Q, when that write was recorded durable (a failed one leaves its file unknown
# until it is written again). The writer is sequential: at dQ no other write is in flight.
lw_expect() {
  awk -v q="$1" '$2 <= q { st[$3] = ($1 == "d") ? $4 : "" }
    END { for (f in st) if (st[f] != "") print st[f] "  " f }' "$WORK/marks"
}

# lw_check_image IMAGE Q INDEX: is IMAGE (a replay up to log entry INDEX, mark dQ) what a power
# loss there may leave? Journal recovery by mounting it, every file of lw_expect Q as recorded,
# then a clean e2fsck -fn. Mount + umount, then -fn, as xfstests' log-writes tests do: e2fsck -fn
# alone reports as damage what the journal still has to replay, and e2fsck -fy returns 1 both
# for a journal replayed and for real damage it repaired, so neither tells a consistent crash
# image from a broken one; the kernel's recovery is what a machine does after a power loss, and
# after it nothing may be left to fix. Prints each violation; returns 1 when there was one.
lw_check_image() {
  local img=$1 q=$2 idx=$3 where bad=0
  where="at mark d$q (log entry $idx)"
  lw_expect "$q" >"$WORK/lw.expect"
  CHECK_LOOP=$(losetup -f --show "$img") || { echo "# log-writes: losetup $img failed"; return 1; }
  if ! timeout 60 mount -t ext4 -o noatime "$CHECK_LOOP" "$WORK/check-mnt" 2>"$WORK/lw.mount"; then
    echo "VIOLATION $where: the file system does not mount: $(tail -1 "$WORK/lw.mount"); $(dmesg | tail -n 2 | tr '\n' ' ')"
    losetup -d "$CHECK_LOOP"
    CHECK_LOOP=""
    return 1
  fi
  CHECK_MNT=$WORK/check-mnt
  if ! (cd "$CHECK_MNT" && timeout 120 sha256sum -c --quiet "$WORK/lw.expect") >"$WORK/lw.sum" 2>&1; then
    grep -v '^sha256sum: ' "$WORK/lw.sum" | head -n 5 | sed "s/^/VIOLATION $where: file /"
    bad=1
  fi
  timeout 60 umount "$CHECK_MNT" || { echo "# log-writes: umount failed"; return 1; }
  CHECK_MNT=""
  if ! timeout 120 e2fsck -fn "$CHECK_LOOP" >"$WORK/lw.fsck" 2>&1; then
    echo "VIOLATION $where: e2fsck -fn after journal recovery: $(grep -v '^e2fsck\|^Pass\|^$' "$WORK/lw.fsck" | head -n 3 | tr '\n' ' ')"
    bad=1
  fi
  losetup -d "$CHECK_LOOP"
  CHECK_LOOP=""
  return "$bad"
}

# lap VAR: adds the microseconds since the last lap (LAP_T) to VAR; bash 5's EPOCHREALTIME, no
# fork (a fork costs milliseconds under TCG)
lap() {
  local -n acc=$1
  local u=${EPOCHREALTIME/[.,]/}
  acc=$((acc + u - LAP_T))
  LAP_T=$u
}
# secs US: microseconds as seconds with one decimal
secs() { echo "$(($1 / 1000000)).$(($1 % 1000000 / 100000))"; }

# lw_replay ARGS...: ibnbd-log-replay on the run's log, bounded
lw_replay() { timeout 300 "$REPLAY" --log "$WORK/logfs/log.img" "$@"; }

# lw_run: after the run, the daemons stopped. Removes the dm-log-writes device (its destructor
# logs a last mark and writes the super's final count), then replays the log onto a zeroed image
# up to the mkfs mark and from there, incrementally, to each checked durable mark dQ: all of
# them when there are at most --log-points, else a sample drawn from the seed plus the last. A
# copy of the image at each point goes through lw_check_image. Then the checker's self-check: a
# replay to the last mark of a new file's write, leaving out the largest write logged between
# its sQ and dQ marks, must be caught. Returns 1 on a violation or a missed self-check.
lw_run() {
  local lw=$WORK/logfs img st entries n checked=0 bad=0 prev idx q t0=$SECONDS
  local us_replay=0 us_copy=0 us_check=0
  img=$lw/replay.img
  st=$(timeout 30 dmsetup status "$DM") || { echo "# log-writes: dmsetup status failed"; return 1; }
  case $st in
    *logging_disabled*) echo "# log-writes: the log stopped (log device full? --log-size $LOG_SIZE): $st"; return 1 ;;
  esac
  timeout -k 10 60 dmsetup remove --retry "$DM" || { echo "# log-writes: dmsetup remove failed"; return 1; }
  HAVE_DM=0
  losetup -d "$LOGLOOP"
  LOGLOOP=""
  lw_replay --list >"$WORK/lw.list" 2>"$WORK/lw.err" || { echo "# log-writes: the log does not read: $(cat "$WORK/lw.err")"; return 1; }
  entries=$(grep -vc '^#' "$WORK/lw.list")
  awk '$2 == "MARK" && $5 ~ /^d[0-9]+$/ { print $1, substr($5, 2) }' "$WORK/lw.list" >"$WORK/lw.durable"
  awk '$2 == "MARK" && $5 ~ /^s[0-9]+$/ { print $1, substr($5, 2) }' "$WORK/lw.list" >"$WORK/lw.starts"
  n=$(wc -l <"$WORK/lw.durable")
  [ "$n" -gt 0 ] || { echo "# log-writes: no durable mark in the log ($entries entries)"; return 1; }
  # The sample, in log order: selection sampling (Knuth's algorithm S) of k - 1 of the first
  # n - 1 points, seeded, and the last (awk: python's start-up costs seconds under TCG).
  awk -v seed="$SEED" -v k="$LOG_POINTS" -v n="$n" 'BEGIN { srand(seed); need = k - 1 }
    n <= k || NR == n { print; next }
    rand() * (n - NR) < need { print; need-- }' "$WORK/lw.durable" >"$WORK/lw.points" || return 1
  truncate -s "$SIZE_BYTES" "$img"
  lw_replay --target "$img" --replay-to mark:mkfs >/dev/null 2>"$WORK/lw.err" ||
    { echo "# log-writes: replay to mark:mkfs: $(cat "$WORK/lw.err")"; return 1; }
  prev=mark:mkfs
  # fd 3: nothing in the loop reads the list from stdin by mistake
  while read -r idx q <&3; do
    LAP_T=${EPOCHREALTIME/[.,]/}
    lw_replay --target "$img" --start-after "$prev" --replay-to "$idx" >/dev/null 2>"$WORK/lw.err" ||
      { echo "# log-writes: replay to entry $idx: $(cat "$WORK/lw.err")"; return 1; }
    prev=$idx
    lap us_replay
    cp --sparse=always "$img" "$lw/check.img" || return 1
    lap us_copy
    lw_check_image "$lw/check.img" "$q" "$idx" || bad=$((bad + 1))
    lap us_check
    rm -f "$lw/check.img"
    checked=$((checked + 1))
  done 3<"$WORK/lw.points"
  echo "== log-writes: $entries log entries ($(du -m "$WORK/logfs/log.img" | cut -f1) MiB), $n durable marks, $checked checked (seed $SEED) in $((SECONDS - t0)) s (replays $(secs $us_replay) s, copies $(secs $us_copy) s, mount+files+fsck $(secs $us_check) s), points with a violation: $bad"
  lw_self_check || bad=1
  [ "$bad" = 0 ]
}

# lw_self_check: the check must fail on a broken stack. The last durable mark of a file's first
# write (a new file: its data and its metadata are both new, so leaving out either shows), the
# largest write logged between its sQ and dQ, and a replay without it: lw_check_image must report.
lw_self_check() {
  local q idx sidx f drop out
  while read -r idx q; do
    f=$(awk -v q="$q" '$1 == "s" && $2 == q { print $3 }' "$WORK/marks")
    [ -n "$f" ] || continue
    [ "$(awk -v f="$f" '$1 == "s" && $3 == f { print $2; exit }' "$WORK/marks")" = "$q" ] || continue
    sidx=$(awk -v q="$q" '$2 == q { print $1 }' "$WORK/lw.starts")
    [ -n "$sidx" ] || continue
    drop=$(awk -v a="$sidx" -v b="$idx" '!/^#/ && $1 > a && $1 < b && $2 ~ /^WRITE/ && $4 > 0 && $4 > best { best = $4; e = $1 }
      END { if (e != "") print e }' "$WORK/lw.list")
    [ -n "$drop" ] && break
  done < <(tac "$WORK/lw.durable")
  [ -n "${drop:-}" ] || { echo "# log-writes self-check: no new file's write with a logged write to leave out"; return 1; }
  rm -f "$WORK/logfs/self.img"
  truncate -s "$SIZE_BYTES" "$WORK/logfs/self.img"
  lw_replay --target "$WORK/logfs/self.img" --replay-to "$idx" --drop "$drop" >/dev/null 2>"$WORK/lw.err" ||
    { echo "# log-writes self-check: replay: $(cat "$WORK/lw.err")"; return 1; }
  out=$(lw_check_image "$WORK/logfs/self.img" "$q" "$idx")
  rm -f "$WORK/logfs/self.img"
  if [ -z "$out" ]; then
    echo "# log-writes self-check FAILED: a replay to d$q (entry $idx) without entry $drop ($(awk -v e="$drop" '$1 == e { print $3 "+" $4 }' "$WORK/lw.list") blocks, a write of new file $f) passed the check"
    return 1
  fi
  echo "== log-writes self-check: without entry $drop (a write between s$q and d$q, new file $f) the check reports: $(echo "$out" | head -n 1 | cut -c1-160)"
}

# ext4_run: --ext4 instead of ibnbd-soak. ext4 on the device; a writer creates files (4 KiB to
# 256 KiB of random bytes) and rewrites old ones in place, each made durable (dd conv=fsync,
# then syncfs) before its checksum is recorded outside the device; meanwhile the faults of
# --faults (server-kill, server-stop, client-kill) at seeded times, 3-8 s apart. Then: unmount,
# e2fsck -fn, mount again (nothing from the page cache) and every recorded file must read back
# as recorded. Fails on a mismatch, a missing file, an error the writer saw, a dirty fsck.
# Every step that does IO on the device is `bounded` (soak-lib.sh): a task stuck in D state
# there is named and left behind, and the run goes on to its verdict.
ext4_run() {
  local mnt=$WORK/mnt end i n kinds k bad=0 faults=0 werr wexp=0 t1 t2
  command -v mkfs.ext4 >/dev/null && command -v e2fsck >/dev/null || skip "no mkfs.ext4 / e2fsck"
  mkdir -p "$mnt"
  bounded 300 mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$DEV" >"$WORK/mkfs.log" 2>&1 &&
    bounded 60 mount "$DEV" "$mnt" || { echo "soak-vm.sh: mkfs.ext4 + mount: $(tail -2 "$WORK/mkfs.log")" >&2; return 3; }
  MNT=$mnt
  : >"$WORK/durable"
  : >"$WORK/marks"
  : >"$WORK/writer.err"
  if [ "$LOGW" = 1 ]; then lw_mark mkfs || return 3; fi
  # writer_err STEP: a line of writer.err: when (epoch us, then readable), the file, the step
  # and what it said (bounded's "did not end" when the step was given up)
  writer_err() {
    local said
    said=$(grep -m1 'did not end' "$WORK/writer.step" 2>/dev/null || tail -n 2 "$WORK/writer.step" 2>/dev/null)
    echo "${EPOCHREALTIME/[.,]/} $(date +%T.%N | cut -c1-12) $f $1: ${said//$'\n'/ }" >>"$WORK/writer.err"
  }
  (
    i=0 q=0 RANDOM=$((SEED + 1))
    while [ ! -e "$WORK/stop" ]; do
      if [ $i -gt 8 ] && [ $((RANDOM % 4)) = 0 ]; then f=f$((RANDOM % i + 1)) conv=fsync,notrunc
      else i=$((i + 1)) f=f$i conv=fsync; fi
      # --log-writes: write q of file f starts at mark sQ and is durable at mark dQ; $WORK/marks
      # says which file each Q is (a failed write has its s line and no d line).
      q=$((q + 1))
      if [ "$LOGW" = 1 ]; then
        echo "s $q $f" >>"$WORK/marks"
        lw_mark "s$q" 2>"$WORK/writer.step" || { writer_err "mark s$q"; continue; }
      fi
      # After an error the writer waits a second: a file system gone read-only fails every
      # step at once, and the log of it need not be thousands of lines.
      bounded 120 dd if=/dev/urandom of="$mnt/$f" bs=4k count=$((RANDOM % 64 + 1)) conv="$conv" status=none 2>"$WORK/writer.step" ||
        { writer_err "dd conv=$conv exit $?"; sleep 1; continue; }
      bounded 120 sync -f "$mnt" 2>"$WORK/writer.step" || { writer_err "syncfs exit $?"; sleep 1; continue; }
      if ! (cd "$mnt" && bounded 120 sha256sum "$f") >"$WORK/writer.sum" 2>"$WORK/writer.step"; then
        writer_err "sha256sum exit $?"
        sleep 1
        continue
      fi
      read -r sum <"$WORK/writer.sum"
      echo "$sum" >>"$WORK/durable"
      if [ "$LOGW" = 1 ]; then
        echo "d $q $f ${sum%% *}" >>"$WORK/marks"
        lw_mark "d$q" 2>"$WORK/writer.step" || writer_err "mark d$q"
      fi
    done
  ) &
  local writer=$!
  WRITER_PID=$writer
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
    t1=${EPOCHREALTIME/[.,]/}
    hook_common start "$k" >>"$WORK/hook.log" 2>&1 || { log "ext4: $k start failed"; bad=1; }
    t2=${EPOCHREALTIME/[.,]/}
    [ "$k" = server-stop ] && sleep $(((HB_MS * HB_MISSED) / 1000 + 1))
    sleep 0.$((RANDOM % 9 + 1))
    LAP_T=${EPOCHREALTIME/[.,]/}
    hook_common stop "$k" >>"$WORK/hook.log" 2>&1 || { log "ext4: $k stop failed"; bad=1; }
    # How long the steps took: a restart slower than the client's pending timeout (30 s) fails
    # the IO that waited for it.
    log "ext4: $k start $(secs $((t2 - t1))) s, stop $(secs $((${EPOCHREALTIME/[.,]/} - LAP_T))) s; writer errors $(wc -l <"$WORK/writer.err")"
    faults=$((faults + 1))
  done
  touch "$WORK/stop"
  # The writer's steps are bounded (120 s each, then 10 s to give up on one in D state).
  if ! await "$writer" 400; then
    echo "# soak-vm.sh: the writer did not stop within 400 s" >&2
    kill -TERM "$writer" 2>/dev/null
    bad=1
  fi
  WRITER_PID=""
  # The latest record of each file is what it must hold.
  tac "$WORK/durable" | awk '!seen[$2]++' >"$WORK/expect"
  n=$(wc -l <"$WORK/expect")
  werr=$(wc -l <"$WORK/writer.err" 2>/dev/null || echo 0)
  if [ "$werr" != 0 ]; then
    # Errors the configured behaviour explains do not fail the run (explain_errors,
    # soak-diag.sh); they are printed with their evidence, the others fail it.
    explain_errors "$WORK/writer.err" "$WORK/cl.log" "$WORK/stalls" "$PENDING_MS" >"$WORK/writer.explained"
    wexp=$(awk '$1 == "explained" { print $2; exit }' "$WORK/writer.explained")
    echo "# ext4 writer errors: $werr, explained by the client's timeout on a stalled guest: $wexp; the first:"
    sed -n '3,7p' "$WORK/writer.explained" | cut -d' ' -f2- | sed 's/^/#   /'
  fi
  if ! bounded 120 umount "$mnt"; then
    echo "== ext4 crash consistency: seed $SEED, $DURATION, $faults faults ($FAULTS), writer errors $werr: the file system did not unmount (a task still using it: dstate.txt of --logs)"
    echo "verdict        DEFECTS"
    return 1
  fi
  MNT=""
  if ! bounded 300 e2fsck -fn "$DEV" >"$WORK/fsck.log" 2>&1; then
    echo "# e2fsck -fn: $(tail -5 "$WORK/fsck.log")"
    bad=1
  fi
  bounded 60 mount "$DEV" "$mnt" || { echo "soak-vm.sh: remount failed" >&2; return 1; }
  MNT=$mnt
  (cd "$mnt" && bounded 120 sha256sum -c --quiet "$WORK/expect") >"$WORK/check.log" 2>&1 || bad=1
  echo "== ext4 crash consistency: seed $SEED, $DURATION, $faults faults ($FAULTS), $(wc -l <"$WORK/durable") durable writes of $n files, writer errors $werr (explained $wexp), mismatches $(grep -c -v '^$' "$WORK/check.log")"
  [ -s "$WORK/check.log" ] && sed 's/^/#   /' "$WORK/check.log" | head -20
  bounded 60 umount "$mnt"
  MNT=""
  [ "$werr" = "$wexp" ] || bad=1
  [ "$bad" = 0 ] && echo "verdict        clean" || echo "verdict        DEFECTS"
  return "$bad"
}

if [ "$EXT4" = 1 ]; then
  ext4_run
  rc=$?
  # A failed run's state while the daemons still have it (the exit's dump comes after them)
  [ "$rc" = 0 ] || diag_dump "ext4-$rc"
  recover_orphan
  stop_daemons
  if [ "$LOGW" = 1 ] && [ "$rc" != 3 ]; then
    lw_run
    lw=$?
    if [ "$lw" = 0 ]; then echo "verdict        log-writes clean"; else echo "verdict        log-writes DEFECTS"; fi
    [ "$rc" = 0 ] && rc=$lw
  fi
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
if [ "$PRIO" = 1 ]; then
  # The evidence that each netem fault impaired its path (tc -s of its qdiscs at its stop), and
  # where the bands' traffic went since their last change (band 3: what no filter matched).
  grep -h 'netem [AB] band\|netem [AB]: ' "$WORK/hook.log" | sed 's/^# soak-vm.sh /# /'
  for dev in "$NET_A" "$NET_B"; do
    echo "# $dev bands (pkts since the band's last change): $(tcb -s -j qdisc show dev "$dev" |
      jq -r '[.[] | select(.parent != null and (.parent | startswith("1:"))) | "\(.parent) \(.kind) \(.packets)"] | join(", ")')"
  done
fi
[ "$rc" = 0 ] || diag_dump "soak-$rc"
recover_orphan
[ -n "$NBD" ] && { timeout 20 nbd-client -d "$NBD" >/dev/null 2>&1; NBD=""; }
stop_daemons
rc=$(sanitizer_verdict "$rc" "$WORK"/srv.log "$WORK"/cl.log)
if [ "$rc" != 0 ]; then
  echo "# soak-vm.sh: ibnbd-soak exit $rc"
  show_logs
  echo "# kernel log:"; dmesg 2>/dev/null | tail -n 15 | sed 's/^/#   /'
fi
exit "$rc"
