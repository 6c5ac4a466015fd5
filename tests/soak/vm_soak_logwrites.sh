#!/usr/bin/env bash
# ctest vm_soak_logwrites (issue 17), INSIDE the VM rig: crash consistency at the flush points
# of a real file system. tools/soak/soak-vm.sh --ext4 --log-writes: ext4 on /dev/ublkbN, the
# backend dm-log-writes, a writer making files durable (fsync + syncfs, a log mark before and
# after each), server kill -9 on a schedule; then the log replayed to a sample of the durable
# marks, each image recovered (mount), its files checked against their recorded sha256 and
# e2fsck -fn'd, and the checker's self-check (a replay missing one logged write) must be caught.
#
#   tests/vm/run-in-vm.sh --modprobe dm_mod --modprobe loop --modprobe dm_log_writes -- \
#       bash tests/soak/vm_soak_logwrites.sh BUILD_DIR
#   env: SOAK_VM_SEED (17), SOAK_VM_DURATION (20s), SOAK_VM_LOG_POINTS (6)
# Exit 77 (skip) when soak-vm.sh skips (not in the VM rig, no ublk_drv, no dm-log-writes).
set -u -o pipefail

build=$(cd "${1:?usage: $0 BUILD_DIR}" && pwd) || exit 1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
seed=${SOAK_VM_SEED:-17}
out=$(mktemp /tmp/vm-soak-logwrites.XXXXXX)
trap 'rm -f "$out"' EXIT

bash "$here/../../tools/soak/soak-vm.sh" "$build" --target ublk --ext4 --log-writes --seed "$seed" \
  --duration "${SOAK_VM_DURATION:-20s}" --faults server-kill --size 32M --log-size 128M \
  --log-points "${SOAK_VM_LOG_POINTS:-6}" | tee "$out"
rc=$?
[ "$rc" = 77 ] && exit 77
if [ "$rc" != 0 ]; then
  echo "not ok - vm soak log-writes (seed $seed): exit $rc"
  exit 1
fi
# What a clean exit must also have shown: a fault ran, points were checked, the self-check
# caught its broken replay.
why=()
grep -qE '^== ext4 crash consistency: .*, [1-9][0-9]* faults' "$out" || why+=("no server kill ran")
grep -qE '^== log-writes: .*, [1-9][0-9]* checked .*violation: 0$' "$out" || why+=("no durable point checked clean")
grep -q '^== log-writes self-check: ' "$out" || why+=("no self-check")
if [ ${#why[@]} -ne 0 ]; then
  echo "not ok - vm soak log-writes (seed $seed): ${why[*]}"
  exit 1
fi
echo "ok - vm soak log-writes (seed $seed): $(grep '^== log-writes: ' "$out" | cut -c16-)"
