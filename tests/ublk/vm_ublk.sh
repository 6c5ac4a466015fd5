#!/usr/bin/env bash
# ublk end to end, run INSIDE the VM rig (ublk_drv, Soft-RoCE):
#
#   tests/vm/run-in-vm.sh --timeout 600 -- bash tests/ublk/vm_ublk.sh BUILD_DIR [rdma|tcp]
#   (ctest: vm_ublk_rdma, vm_ublk_tcp; the fabric also from IBNBD_UBLK_FABRIC, default rdma)
#
# ibnbd-server exports a 128 MiB file on 198.18.0.2 (rxe1/veth1); ibnbd-client maps it from
# 198.18.0.1 with --ublk. Then, each step bounded in time:
#   mkfs.ext4 on /dev/ublkbN, mount, write files; fio (randwrite, verify=crc32c) on a file in it;
#   a second path, then each path disconnected and reconnected under fio with verify;
#   kill -9 of ibnbd-client in the middle of a rate-limited fio write run, restart with the same
#   --state-dir: the daemon takes the device back (USER_RECOVERY), fio finishes with no error and
#   its verify passes; the files written before are intact; unmount, e2fsck -fn clean; remount
#   and fio --verify_only again; unmount, unmap: /dev/ublkb* is gone and the record too; a
#   restart with a stale record and a damaged one; SIGTERM deletes the daemon's devices.
# TAP-like output ("ok - NAME" / "not ok - NAME: why"). Exit: 0 all ok, 1 a step failed, 77
# skipped (not in the VM rig, no /dev/ublk-control, a tool missing).
set -u -o pipefail

build=${1:?usage: $0 BUILD_DIR [rdma|tcp]}
fabric=${2:-${IBNBD_UBLK_FABRIC:-rdma}}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/../lib/ibnbd_bins.sh"
. "$here/../lib/tap.sh"
ibnbd_bins "$build"

skip() { echo "1..0 # SKIP $*"; exit 77; }
[ "${IBTRS_VM:-}" = 1 ] && [ -n "${IBTRS_RDMA_ADDR_A:-}" ] && [ -n "${IBTRS_RDMA_ADDR_B:-}" ] ||
  skip "not inside the VM rig: run it through tests/vm/run-in-vm.sh"
[ -e /dev/ublk-control ] || skip "no /dev/ublk-control (ublk_drv)"
for t in jq fio mkfs.ext4 e2fsck mount umount timeout sha256sum blkdiscard blockdev cmp; do
  command -v "$t" >/dev/null || skip "no $t"
done
A=$IBTRS_RDMA_ADDR_A B=$IBTRS_RDMA_ADDR_B
# Two listeners (two ports): the path-cut case adds a second path to the same server.
case "$fabric" in
  rdma) listen=(--listen "rdma:$B:0" --listen "rdma:$B:0") src="rdma:$A@" ;;
  tcp) listen=(--listen "tcp:$B:0" --listen "tcp:$B:0") src="" ;;  # the client's packets leave through veth0
  *) echo "fabric must be rdma or tcp" >&2; exit 2 ;;
esac
echo "# fabric $fabric"

work=$(mktemp -d /tmp/ibnbd-ublk.XXXXXX)  # the VM's overlay: RAM
mkdir -p "$work/export" "$work/mnt"
srv_pid="" cl_pid="" fio_pid=""
t0=$SECONDS

# With the time since the start: TCG runs are slow, the log shows where.
ok() { echo "ok - $1 ($((SECONDS - t0)) s)"; }
# A step that everything after it needs.
fatal() {
  not_ok "$1" "$2"
  echo "# client log:"; tail -n 30 "$work/cl.log" 2>/dev/null | sed 's/^/#   /'
  echo "# server log:"; tail -n 15 "$work/srv.log" 2>/dev/null | sed 's/^/#   /'
  echo "# dmesg:"; dmesg 2>/dev/null | tail -n 20 | sed 's/^/#   /'
  exit 1
}
# wait_file FILE [SECONDS]: the ready files of the daemons.
wait_file() { for _ in $(seq $((${2:-30} * 10))); do [ -e "$1" ] && return 0; sleep 0.1; done; return 1; }

cleanup() {
  [ -n "$fio_pid" ] && kill -9 "$fio_pid" 2>/dev/null
  mountpoint -q "$work/mnt" && umount -l "$work/mnt" 2>/dev/null
  # TERM: the daemon deletes its ublk devices and unmaps.
  [ -n "$cl_pid" ] && kill "$cl_pid" 2>/dev/null && timeout 60 tail --pid="$cl_pid" -f /dev/null
  [ -n "$srv_pid" ] && kill "$srv_pid" 2>/dev/null && wait "$srv_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

c() { timeout 120 "$ibnbd" --socket "$work/cl.sock" client "$@"; }

start_client() {
  rm -f "$work/cl.ready"
  "$cld" "${cld_auth[@]}" --control-socket "$work/cl.sock" --ready-file "$work/cl.ready" --state-dir "$work/state" \
    --hb-interval-ms 300 --reconnect-delay-ms 300 >>"$work/cl.log" 2>&1 &
  cl_pid=$!
  # A restart recovers first (map retries EBUSY up to 30 s, the kernel's quiesce up to 20 s).
  wait_file "$work/cl.ready" 90
}

truncate -s 128M "$work/export/vol.img"
ibnbd_auth "$work"
"$srv" "${listen[@]}" "${srv_auth[@]}" --dev-search-path "$work/export" --control-socket "$work/srv.sock" \
  --ready-file "$work/srv.ready" --hb-interval-ms 300 >"$work/srv.log" 2>&1 &
srv_pid=$!
wait_file "$work/srv.ready" || fatal "server start" "$(tail -3 "$work/srv.log")"
addr=$(sed -n "s/^listening /$src/p" "$work/srv.ready" | sed -n 1p)
addr2=$(sed -n "s/^listening /$src/p" "$work/srv.ready" | sed -n 2p)
start_client || fatal "client start" "$(tail -3 "$work/cl.log")"
ok "daemons up ($addr)"

# Case: map with --ublk. Expect: /dev/ublkbN, shown by device show, with the volume's size.
c device map vol.img from "$addr" rw session u1 --ublk >"$work/out" 2>&1 || fatal "map --ublk" "$(cat "$work/out")"
dev=$(c -f json device show vol.img | jq -r '.[0].ublk')
[ -b "$dev" ] || fatal "map --ublk" "no block device '$dev'"
sz=$(blockdev --getsize64 "$dev")
[ "$sz" = $((128 << 20)) ] && ok "map --ublk: $dev, 128 MiB" || not_ok "ublk size" "$sz"
[ -n "$(ls "$work/state"/ublk-*.json 2>/dev/null)" ] && ok "record written" || not_ok "record written" "none in $work/state"

# Case: the raw device. Expect: O_DIRECT data reaches the server's file and reads back; the
# limits the server gave are the block device's; write-zeroes and discard work when advertised.
q=/sys/block/${dev#/dev/}/queue
echo "# write_cache '$(cat $q/write_cache)', fua $(cat $q/fua 2>/dev/null), discard_max_bytes $(cat $q/discard_max_bytes)," \
  "write_zeroes_max_bytes $(cat $q/write_zeroes_max_bytes), max_sectors_kb $(cat $q/max_sectors_kb), nr queues $(ls /sys/block/${dev#/dev/}/mq | wc -l)"
head -c $((8 << 20)) /dev/urandom >"$work/pat"
if timeout 60 dd if="$work/pat" of="$dev" bs=1M oflag=direct,sync status=none &&
   cmp <(timeout 60 dd if="$dev" bs=1M count=8 iflag=direct status=none) "$work/pat" &&
   cmp <(head -c $((8 << 20)) "$work/export/vol.img") "$work/pat"; then
  ok "O_DIRECT writes reach the server's file and read back"
else not_ok "raw data" "mismatch"; fi
if [ "$(cat $q/write_zeroes_max_bytes)" != 0 ]; then
  timeout 60 blkdiscard -z -o 0 -l $((4 << 20)) "$dev" &&
    cmp -n $((4 << 20)) <(timeout 60 dd if="$dev" bs=1M count=4 iflag=direct status=none) /dev/zero &&
    ok "write-zeroes (blkdiscard -z)" || not_ok "write-zeroes" "failed or not zero"
fi
if [ "$(cat $q/discard_max_bytes)" != 0 ]; then
  timeout 60 blkdiscard -o $((4 << 20)) -l $((4 << 20)) "$dev" && ok "discard (blkdiscard)" || not_ok discard "failed"
fi

# Case: a filesystem on it. Expect: mkfs, mount and files as on any disk.
timeout 120 mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$dev" >"$work/out" 2>&1 ||
  fatal mkfs.ext4 "$(tail -3 "$work/out")"
timeout 30 mount "$dev" "$work/mnt" || fatal mount "failed"
ok "mkfs.ext4 + mount"
head -c $((4 << 20)) /dev/urandom >"$work/mnt/f1"
cp "$build/client/daemon/ibnbd-client" "$work/mnt/f2"
(cd "$work/mnt" && sha256sum f1 f2) >"$work/sums"
timeout 60 sync || fatal "sync" "timed out"
ok "files written"

fio_args=(--name=ublk --filename="$work/mnt/fio.dat" --size=24M --ioengine=libaio --direct=1
          --iodepth=8 --bsrange=4k-64k --rw=randwrite --verify=crc32c --verify_fatal=1
          --randrepeat=1 --randseed=7 --output-format=terse --terse-version=3)
# Case: fio with verify. Expect: no error.
if timeout 180 fio "${fio_args[@]}" --size=8M >"$work/fio0" 2>&1; then ok "fio randwrite + verify"
else not_ok "fio randwrite + verify" "$(tail -3 "$work/fio0")"; fi

# Case: a second path to the server, then each path cut in turn (disconnect, reconnect) while
# fio writes with verify: the queue threads reap the connections being torn down, and their
# requests fail over. Expect: fio ends with no error and its verify passes, the mapping counts
# no IO error, and the queue threads reaped completions themselves (ublk_reaped > 0).
paths_of() { c -f json path list u1 | jq -r '.[].pathname'; }
if c path add u1 "$addr2" >"$work/out" 2>&1 && [ "$(paths_of | wc -l)" = 2 ]; then
  ok "second path added"
  p1=$(paths_of | sed -n 1p) p2=$(paths_of | sed -n 2p)
  timeout 300 fio "${fio_args[@]}" --rate=,4m --randseed=11 >"$work/fio-cut" 2>&1 &
  fio_pid=$!
  cut_ok=1
  for p in "$p1" "$p2"; do
    sleep 1
    c path disconnect u1 "$p" >"$work/out" 2>&1 || { cut_ok=0; not_ok "disconnect $p" "$(cat "$work/out")"; }
    sleep 1
    c path reconnect u1 "$p" >"$work/out" 2>&1 || { cut_ok=0; not_ok "reconnect $p" "$(cat "$work/out")"; }
  done
  kill -0 "$fio_pid" 2>/dev/null || echo "# fio ended before the last reconnect: the cuts were not all under IO"
  up=$(c -f json path list u1 | jq -r '[.[] | select(.state == "connected")] | length')
  [ "$up" = 2 ] || { cut_ok=0; not_ok "paths after the cuts" "$up of 2 connected"; }
  [ "$cut_ok" = 1 ] && ok "each path disconnected and reconnected under fio"
  if wait "$fio_pid"; then ok "fio across the path cuts: no error, verify passed"
  else not_ok "fio across the path cuts" "exit $?: $(grep -iE 'err|verify' "$work/fio-cut" | head -5)"; fi
  fio_pid=""
  read -r errs reaped reqs <<<"$(c -f json device show vol.img | jq -r '.[0] | "\(.errors) \(.ublk_reaped) \(.ublk_requests)"')"
  [ "$errs" = 0 ] && ok "no IO errors on the mapping after the cuts" || not_ok "mapping errors after the cuts" "$errs"
  echo "# ublk: $reqs requests, $reaped completions reaped by the queue threads"
  [ "${reaped:-0}" -gt 0 ] 2>/dev/null && ok "the queue threads reaped completions" ||
    not_ok "reaping" "ublk_reaped '$reaped' of $reqs requests"
  c path delete u1 "$p2" >"$work/out" 2>&1 && ok "second path deleted" || not_ok "path delete" "$(cat "$work/out")"
else
  not_ok "path add" "$(cat "$work/out")"
fi

# Case: the client daemon dies (kill -9) in the middle of a fio write run (rate-limited writes:
# ~6 s for 24 MiB), and is restarted with the same state dir. Expect: the same /dev/ublkbN taken
# back, fio finishes with exit 0 and verify passes (requests of the dead daemon re-issued).
timeout 300 fio "${fio_args[@]}" --rate=,4m >"$work/fio1" 2>&1 &
fio_pid=$!
sleep 2
kill -0 "$fio_pid" 2>/dev/null || fatal "kill -9 mid-IO" "fio ended before the kill: $(tail -3 "$work/fio1")"
# Kill while the device has requests in flight (rate-limited fio idles between bursts).
for _ in $(seq 200); do
  read -r inflight_r inflight_w <"/sys/block/${dev#/dev/}/inflight"
  [ $((inflight_r + inflight_w)) -gt 0 ] && break
  sleep 0.01
done
kill -9 "$cl_pid"
echo "# killed with $inflight_r reads + $inflight_w writes in flight on $dev"
wait "$cl_pid" 2>/dev/null
t_kill=$SECONDS
kill -0 "$fio_pid" 2>/dev/null && ok "kill -9 of ibnbd-client while fio writes" ||
  not_ok "kill -9 mid-IO" "fio already done"
start_client || fatal "restart" "no ready file: $(tail -5 "$work/cl.log")"
grep -q "recovered as $dev" "$work/cl.log" && ok "restarted daemon recovered $dev ($((SECONDS - t_kill)) s after the kill)" ||
  not_ok "recovery" "$(grep recovery "$work/cl.log" | tail -3)"
dev2=$(c -f json device show vol.img | jq -r '.[0].ublk')
[ "$dev2" = "$dev" ] && ok "device show says $dev again" || not_ok "device show after recovery" "'$dev2'"
if wait "$fio_pid"; then ok "fio finished without errors, verify passed"
else not_ok "fio across the crash" "exit $?: $(grep -iE 'err|verify' "$work/fio1" | head -5)"; fi
fio_pid=""
(cd "$work/mnt" && sha256sum -c --quiet "$work/sums") >"$work/out" 2>&1 &&
  ok "files written before the crash intact" || not_ok "files intact" "$(cat "$work/out")"
errs=$(c -f json device show vol.img | jq -r '.[0].errors')
[ "$errs" = 0 ] && ok "no IO errors on the mapping" || not_ok "mapping errors" "$errs"
dmesg | grep -iE "I/O error|EXT4-fs error|Buffer I/O" >"$work/out" && not_ok "kernel log" "$(head -3 "$work/out")" ||
  ok "no I/O or ext4 errors in the kernel log"

# Case: unmap while mounted. Expect: EBUSY, the filesystem keeps its disk.
c device unmap vol.img >"$work/out" 2>&1
rc=$?
[ "$rc" = 16 ] && [ -b "$dev" ] && ok "unmap of a mounted device is EBUSY" || not_ok "unmap while mounted" "exit $rc: $(cat "$work/out")"

# Case: unmount and check. Expect: e2fsck finds nothing; the data is still there after a remount.
timeout 60 umount "$work/mnt" || fatal umount "failed"
if timeout 120 e2fsck -fn "$dev" >"$work/out" 2>&1; then ok "e2fsck -fn clean"
else not_ok "e2fsck -fn" "$(tail -5 "$work/out")"; fi
timeout 30 mount "$dev" "$work/mnt" || fatal "remount" "failed"
if timeout 180 fio "${fio_args[@]}" --verify_only >"$work/fio2" 2>&1; then ok "fio --verify_only after remount"
else not_ok "fio --verify_only" "$(tail -3 "$work/fio2")"; fi
timeout 60 umount "$work/mnt" || fatal umount "failed"

# Case: unmap. Expect: the ublk device is gone, and its record.
c device unmap vol.img >"$work/out" 2>&1 && ok unmap || not_ok unmap "$(cat "$work/out")"
for _ in $(seq 50); do [ -e "$dev" ] || break; sleep 0.1; done
left=$(ls /dev/ublkb* /dev/ublkc* 2>/dev/null)
[ -z "$left" ] && ok "no /dev/ublkb* left" || not_ok "ublk devices left" "$left"
[ -z "$(ls "$work/state"/ublk-*.json 2>/dev/null)" ] && ok "record removed" || not_ok "record removed" "$(ls "$work/state")"

# Case: a restart finds a record of a ublk device that does not exist (any more) and a damaged
# file. Expect: the record is dropped and its volume not left mapped, the damaged file reported
# and kept, the daemon serves.
kill -9 "$cl_pid"
wait "$cl_pid" 2>/dev/null
jq -n --arg a "$addr" '{version: 1, ublk_id: 77, session: "u1", paths: [$a], device: "vol.img", access_mode: "rw"}' \
  >"$work/state/ublk-77.json"
echo '{"version": 1, "ublk_id"' >"$work/state/ublk-78.json"
start_client || fatal "restart with stale records" "$(tail -5 "$work/cl.log")"
grep -q "ublkb77 (vol.img): .*record dropped" "$work/cl.log" && [ ! -e "$work/state/ublk-77.json" ] &&
  ok "a record of a missing ublk device is dropped" || not_ok "stale record" "$(grep ublkb77 "$work/cl.log")"
grep -q "ublk-78.json: not a valid record" "$work/cl.log" && ok "a damaged record is reported" ||
  not_ok "damaged record" "$(tail -3 "$work/cl.log")"
n=$(c -f json device list | jq length)
[ "$n" = 0 ] && ok "nothing left mapped by the failed recovery" || not_ok "failed recovery left a mapping" "$n"
rm -f "$work/state/ublk-78.json"

# Case: --ublk again on a mapping that has a ublk device. Expect: EEXIST. Then SIGTERM.
# Expect: the daemon deletes the devices it serves, and their records.
c device map vol.img from "$addr" rw session u1 --ublk >"$work/out" 2>&1 || not_ok "map again" "$(cat "$work/out")"
c device map vol.img from "$addr" rw session u1 --ublk >"$work/out" 2>&1
rc=$?
[ "$rc" = 17 ] && ok "a second --ublk of the same device is EEXIST" || not_ok "second --ublk" "exit $rc"
dev3=$(c -f json device show vol.img | jq -r '.[0].ublk')
kill "$cl_pid"
timeout 60 tail --pid="$cl_pid" -f /dev/null
cl_pid=""
for _ in $(seq 50); do [ -e "$dev3" ] || break; sleep 0.1; done
[ ! -e "$dev3" ] && [ -z "$(ls "$work/state"/ublk-*.json 2>/dev/null)" ] &&
  ok "SIGTERM deleted $dev3 and its record" || not_ok "SIGTERM" "$dev3 still there or a record left"

grep -E "stopping|recovered as" "$work/cl.log" | sed 's/^/# /'
echo "# $((SECONDS - t0)) s"
exit $failed
