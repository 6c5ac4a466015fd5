#!/bin/bash
# Stage 2 of the VM rig, run as PID 1 by tests/vm/init after switch_root into
# the overlay root (so this is the host's bash and the host's tools).
# run-in-vm.sh copies this file into the per-run ctl share on every run, so
# editing it does not rebuild the initramfs.
#
# Loads modules, mounts --rw-share dirs, sets up veth0/veth1 + rxe0/rxe1, runs
# the command with stdout/stderr on the virtio ports "ibtrs.stdout" and
# "ibtrs.stderr", writes "rc=N" (or "setup-error MSG") to
# /run/ibtrs-vm/status and powers off.
#
# Every process start costs ~60 ms under TCG, so this script prefers bash
# builtins (read, echo > /proc/sys/...) and batches (ip -batch, modprobe -a).

CTL=/run/ibtrs-vm
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root LANG=C.UTF-8
exec </dev/null >/dev/console 2>&1

# sync_bounded: sync, for at most 30 s. A command may leave a file system on a device whose IO
# never returns (a test's wedged block device, its tasks in D state): a plain sync would then
# hold the power-off, and the run would end at the host's --timeout instead of with its status.
# Returns 1 when it did not finish (then at once: the sync is still stuck). The limit is wall
# time: under TCG a loaded guest's sleep 0.1 takes far longer than 0.1 s.
SYNC_STUCK=0
sync_bounded() {
  local p t0=$SECONDS
  [ "$SYNC_STUCK" = 0 ] || return 1
  sync &
  p=$!
  while [ $((SECONDS - t0)) -lt 30 ]; do
    kill -0 "$p" 2>/dev/null || return 0
    sleep 0.2
  done
  SYNC_STUCK=1
  warn "sync did not finish within 30 s (a device whose IO does not return?): powering off without it" 2>/dev/null
  return 1
}

# shellcheck disable=SC2317 # invoked by the EXIT trap
poweroff_now() {
  # poweroff -f syncs first, unless -n: after a stuck sync it would hang there.
  if sync_bounded; then
    [ -x /bin/busybox ] && /bin/busybox poweroff -f
  else
    [ -x /bin/busybox ] && /bin/busybox poweroff -f -n
  fi
  echo o >/proc/sysrq-trigger
  sleep 30
}
# PID 1 must never exit (that is a kernel panic): power off instead.
trap poweroff_now EXIT

uptime_s() { local up _; read -r up _ </proc/uptime; echo "$up"; }
log() { echo "ibtrs-vm: [$(uptime_s)] $*"; }

# The virtio serial ports by name (no udev, so no /dev/virtio-ports/ links).
OUT=/dev/console ERR=/dev/console
for d in /sys/class/virtio-ports/*; do
  read -r name 2>/dev/null <"$d/name" || continue
  case "$name" in
    ibtrs.stdout) OUT="/dev/${d##*/}" ;;
    ibtrs.stderr) ERR="/dev/${d##*/}" ;;
  esac
done

warn() { log "warning: $*"; echo "ibtrs-vm: warning: $*" >>"$ERR"; }

write_status() { echo "$1" >"$CTL/status"; }
setup_error() {
  log "setup error: $*"
  echo "ibtrs-vm: setup error: $*" >>"$ERR"
  write_status "setup-error $*"
  exit 1
}

# Set by the config file (written by run-in-vm.sh).
vm_cmd=(false) vm_env=() vm_rw_shares=() vm_modules=()
# shellcheck source=/dev/null
. "$CTL/config" || setup_error "cannot read $CTL/config"
: "${IBTRS_VM_VERBOSE:=0}" "${IBTRS_VM_MTU:=1500}"
if [ "$IBTRS_VM_VERBOSE" != 0 ]; then
  log "stage 2 started"
  # IBTRS_VM_VERBOSE=2: trace the setup with timestamps on the console.
  [ "$IBTRS_VM_VERBOSE" = 2 ] && { PS4='+ ${EPOCHREALTIME} '; set -x; }
fi

# The rig's self-test (check.sh) makes a boot die or hang here, before the command starts (as
# early as it can: each such boot costs the self-test its time).
IBTRS_VM_BOOT_ATTEMPT=1
# shellcheck source=/dev/null
[ -r "$CTL/attempt" ] && . "$CTL/attempt"
case "${IBTRS_VM_TEST_BOOT_FAULT:-}:$IBTRS_VM_BOOT_ATTEMPT" in
  panic-first:1|panic-always:*) log "test fault: panic before the command"; echo c >/proc/sysrq-trigger ;;
  hang-first:1) log "test fault: hang before the command"; exec {hang_fd}<> <(:); read -r -u "$hang_fd" ;;
esac

i=0
for d in "${vm_rw_shares[@]}"; do
  [ -d "$d" ] || mkdir -p "$d" || setup_error "cannot create mount point $d"
  mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=mmap "rw$i" "$d" \
    || setup_error "cannot mount --rw-share $d (9p tag rw$i)"
  i=$((i + 1))
done

# ------------------------------------------------------------------ modules
read -r kernel_release </proc/sys/kernel/osrelease
[ "$kernel_release" = "$IBTRS_VM_KVER" ] || warn "running kernel $kernel_release, expected $IBTRS_VM_KVER"
modules=(veth rdma_rxe ib_uverbs rdma_ucm ublk_drv nbd "${vm_modules[@]}")
[ "$IBTRS_VM_VERBOSE" = 0 ] || log "modprobe ${modules[*]}"
if ! modprobe -a "${modules[@]}" 2>/dev/null; then
  for m in "${modules[@]}"; do
    modprobe "$m" || warn "modprobe $m failed; continuing without it"
  done
fi
[ -d /sys/kernel/config ] && mount -t configfs configfs /sys/kernel/config 2>/dev/null

# ------------------------------------------------------------------ network
# See README.md "Networking" for why this is one namespace with policy routes.
ADDR_A=198.18.0.1 ADDR_B=198.18.0.2
setsys() { echo "$2" >"/proc/sys/$1" || warn "cannot set $1=$2"; }
setsys net/ipv4/conf/all/rp_filter 0
setsys net/ipv4/conf/default/rp_filter 0
[ "$IBTRS_VM_VERBOSE" = 0 ] || log "network setup"
if ip -batch - <<EOF
link set lo up
link add veth0 mtu $IBTRS_VM_MTU type veth peer name veth1 mtu $IBTRS_VM_MTU
EOF
then
  for dev in veth0 veth1; do
    setsys "net/ipv4/conf/$dev/rp_filter" 0
    setsys "net/ipv4/conf/$dev/accept_local" 1
    setsys "net/ipv6/conf/$dev/disable_ipv6" 1
  done
  # Both addresses are local, so by default the kernel delivers A<->B traffic
  # over "lo", and an rdma_cm client without an explicit source address ends
  # up on the server's rxe device (rxe loops the packets back internally).
  # Make the two addresses behave like two hosts instead: locally generated
  # traffic to B always leaves through veth0 (source A) and traffic to A
  # through veth1 (source B); on input the local table delivers it with
  # skb->dev = the receiving veth, i.e. to the right rxe device (this needs
  # accept_local=1 and rp_filter=0, set above).
  ip -batch - <<EOF || warn "network setup incomplete"
addr add $ADDR_A/24 dev veth0
addr add $ADDR_B/24 dev veth1
link set veth0 up
link set veth1 up
rule add pref 90 iif lo from $ADDR_A to $ADDR_A lookup local
rule add pref 91 iif lo from $ADDR_B to $ADDR_B lookup local
rule add pref 100 iif lo to $ADDR_B lookup 100
rule add pref 101 iif lo to $ADDR_A lookup 101
route add $ADDR_B dev veth0 src $ADDR_A table 100
route add $ADDR_A dev veth1 src $ADDR_B table 101
rule add pref 1000 lookup local
rule del pref 0 lookup local
EOF
  rdma link add rxe0 type rxe netdev veth0 || warn "rdma link add rxe0 failed"
  rdma link add rxe1 type rxe netdev veth1 || warn "rdma link add rxe1 failed"
else
  warn "cannot create veth0/veth1 (no RDMA devices)"
fi

# RoCE v2 GID index of ::ffff:ADDR on DEV; the GID table fills in async.
gid_index() { # DEV ADDR -> sets $gid
  local want f n v t
  gid=""
  # shellcheck disable=SC2086 # split the dotted quad into printf arguments
  printf -v want '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' ${2//./ }
  [ -d "/sys/class/infiniband/$1/ports/1/gids" ] || return 1
  for f in /sys/class/infiniband/"$1"/ports/1/gids/*; do
    read -r v 2>/dev/null <"$f" || continue
    [ "$v" = "$want" ] || continue
    n=${f##*/}
    read -r t 2>/dev/null <"/sys/class/infiniband/$1/ports/1/gid_attrs/types/$n" || continue
    [ "$t" = "RoCE v2" ] || continue
    gid=$n
    return 0
  done
  return 1
}
port_active() { local s; read -r s 2>/dev/null <"/sys/class/infiniband/$1/ports/1/state" && [[ "$s" == *ACTIVE* ]]; }
exec {sleep_fd}<> <(:) # a pipe nobody writes to: "read -t" on it sleeps
GID_A="" GID_B=""
for ((try = 0; try < 200; try++)); do
  gid_index rxe0 "$ADDR_A" && GID_A=$gid && gid_index rxe1 "$ADDR_B" && GID_B=$gid \
    && port_active rxe0 && port_active rxe1 && break
  GID_A="" GID_B=""
  read -r -t 0.05 -u "$sleep_fd" || true # sleep 50 ms without starting a process
done
if [ -z "$GID_A" ] || [ -z "$GID_B" ]; then
  warn "rxe0/rxe1 not ACTIVE with RoCE v2 GIDs for $ADDR_A/$ADDR_B"
fi

for f in /dev/infiniband/uverbs0 /dev/infiniband/uverbs1 /dev/infiniband/rdma_cm /dev/ublk-control /dev/nbd0; do
  [ -e "$f" ] || warn "$f is missing"
done
exec {sleep_fd}<&-
log "setup done"

# ------------------------------------------------------------------ command
cd "$IBTRS_VM_CWD" 2>/dev/null || setup_error "cwd $IBTRS_VM_CWD does not exist in the VM"
vm_base_env=(
  PATH="$PATH" HOME=/root USER=root LOGNAME=root SHELL=/bin/bash LANG=C.UTF-8 TERM=dumb
  PWD="$IBTRS_VM_CWD" TMPDIR=/tmp
  IBTRS_VM=1 IBTRS_VM_DEADLINE="${IBTRS_VM_DEADLINE:-}"
  IBTRS_RDMA_ADDR_A="$ADDR_A" IBTRS_RDMA_ADDR_B="$ADDR_B"
  IBTRS_RDMA_DEV_A=rxe0 IBTRS_RDMA_DEV_B=rxe1
  IBTRS_RDMA_NETDEV_A=veth0 IBTRS_RDMA_NETDEV_B=veth1
  IBTRS_RDMA_GID_INDEX_A="$GID_A" IBTRS_RDMA_GID_INDEX_B="$GID_B"
)
ulimit -l unlimited 2>/dev/null # RDMA memory registration
ulimit -n 65536 2>/dev/null
[ "$IBTRS_VM_VERBOSE" = 0 ] || log "running:$(printf ' %q' "${vm_cmd[@]}")"
# Written before the command starts: a guest that dies after this is not booted again.
echo started >"$CTL/started" || setup_error "cannot write $CTL/started"
env -i "${vm_base_env[@]}" "${vm_env[@]}" "${vm_cmd[@]}" </dev/null >>"$OUT" 2>>"$ERR"
rc=$?
log "command exited with $rc"

sync_bounded
for d in "${vm_rw_shares[@]}"; do umount "$d" 2>/dev/null || umount -l "$d" 2>/dev/null; done
write_status "rc=$rc"
exit 0
