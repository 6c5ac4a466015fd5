#!/usr/bin/env bash
# fio through the external ioengine (client/fio, libibnbd-fio.so) against ibnbd-server: a 64 MiB
# file on tmpfs served over two loopback tcp listeners, one session per job with both paths.
# Cases: random writes with crc32c verify (in both completion modes: the default ibnbd_reap=caller
# and ibnbd_reap=thread), a read-only verify pass over what they wrote, a
# trim job (trims then reads back zeroes through verify=pattern), and a read-only job refused a
# write by the access mode. Each case checks fio's exit status and its JSON (no job error, IO
# done). TAP-like output; exit 1 when anything failed, 77 only when the engine (or a daemon, or
# fio/jq) is not built or installed.
#
#   bash tests/fio/fio_engine.sh BUILD_DIR        (ctest: fio_engine)
#   IBNBD_FIO_FABRIC=rdma: inside the VM rig, both listeners on Soft-RoCE (ctest: vm_fio_engine_rdma,
#   through tests/vm/run-in-vm.sh). fio opens a probe session in its parent and then forks its jobs,
#   so this is also the case of a process that uses rdma after a fork.
set -u -o pipefail

build=$(cd "${1:?usage: $0 BUILD_DIR}" && pwd) || exit 1
engine=$build/client/fio/libibnbd-fio.so
[ -f "$engine" ] || {
  echo "1..0 # SKIP $engine not built (IBNBD_FIO_ENGINE; scripts/fio-headers.sh gives the fio headers)"
  exit 77
}
srv=$build/server/ibnbd-server
[ -x "$srv" ] || { echo "1..0 # SKIP $srv not built"; exit 77; }
ibnbd=$build/client/cli/ibnbd
[ -x "$ibnbd" ] || { echo "1..0 # SKIP $ibnbd not built"; exit 77; }
for t in fio jq; do
  command -v "$t" >/dev/null || { echo "1..0 # SKIP $t is missing (scripts/setup.sh installs it)"; exit 77; }
done

# The backing file on tmpfs: the test measures the engine and the stack, not a disk.
work=$(mktemp -d /dev/shm/ibnbd-fio-test.XXXXXX)
cd "$work" || exit 1  # fio writes its verify state files into the current directory
srv_pid=""
failed=0
cleanup() {
  [ -n "$srv_pid" ] && { kill "$srv_pid" 2>/dev/null; wait "$srv_pid" 2>/dev/null; }
  rm -rf "$work"
}
trap cleanup EXIT

ok() { echo "ok - $1"; }
not_ok() { echo "not ok - $1: $2"; failed=1; }
wait_for() { for _ in $(seq 100); do [ -e "$1" ] && return 0; sleep 0.1; done; return 1; }

mib=64  # the volume; every case scales with it
refusals=1 fabric_only=0
adaptive=(caller:1 caller:8 thread:1 thread:8)
case "${IBNBD_FIO_FABRIC:-tcp}" in
  tcp) listen=(--listen tcp:127.0.0.1:0 --listen tcp:127.0.0.1:0) src="" ;;
  rdma)
    [ "${IBTRS_VM:-}" = 1 ] && [ -n "${IBTRS_RDMA_ADDR_A:-}" ] ||
      { echo "1..0 # SKIP rdma: not inside the VM rig (tests/vm/run-in-vm.sh)"; exit 77; }
    listen=(--listen "rdma:$IBTRS_RDMA_ADDR_B:0" --listen "rdma:$IBTRS_RDMA_ADDR_B:0")
    src="rdma:$IBTRS_RDMA_ADDR_A@"
    mib=16  # TCG: a quarter of the data keeps the VM run near a minute
    # The refusals (a bad option, ro, a missing device) fail before or apart from any transfer:
    # the tcp run proves them; under TCG each costs a fio start and a session (~6 s). So do
    # the read-only and batching cases (session modes and fio's batching, not the fabric's).
    refusals=0 fabric_only=1
    # The adaptive wait over rdma: both completion modes, one depth each (the wait on an rdma
    # completion channel is what differs from tcp; depth is the policy's, tested on tcp).
    adaptive=(caller:8 thread:1) ;;
  *) echo "IBNBD_FIO_FABRIC must be tcp or rdma" >&2; exit 2 ;;
esac
echo "# fabric ${IBNBD_FIO_FABRIC:-tcp}"

mkdir -p export
truncate -s ${mib}M export/vol.img
half=$((mib / 2))
full_b=$((mib << 20))
half_b=$((half << 20))
# Authenticated, as the daemons run by default: the engine presents the host key (ibnbd_host_key).
"$ibnbd" key generate host nqn.2014-08.org.nvmexpress:uuid:f1000000-0000-4000-8000-000000000001 \
  out "$work/host.key" >/dev/null || { echo "not ok - key generate"; exit 1; }
printf '{"hosts": [{"key_file": "%s", "access": [{"devices": "**", "mode": "migration"}]}]}\n' \
  "$work/host.key" >"$work/hosts.json"
"$srv" "${listen[@]}" --config "$work/hosts.json" --dev-search-path "$work/export" \
  --control-socket "$work/srv.sock" --ready-file "$work/srv.ready" >"$work/srv.log" 2>&1 &
srv_pid=$!
wait_for "$work/srv.ready" || { echo "not ok - server start: $(cat "$work/srv.log")"; exit 1; }
mapfile -t addrs < <(sed -n "s/^listening /$src/p" "$work/srv.ready")
[ "${#addrs[@]}" = 2 ] || { echo "not ok - server listens on ${#addrs[@]} addresses, want 2"; exit 1; }
paths="${addrs[0]},${addrs[1]}"

# run_fio NAME EXPECT_RC [fio args...]: runs fio with the engine and JSON output into NAME.json.
# Every run is bounded: a hung engine must fail the test, not stall it.
run_fio() {
  local name=$1 want=$2
  shift 2
  local rc=0
  timeout -k 5 120 fio --output-format=json --output="$work/$name.json" --name="$name" \
    --ioengine="external:$engine" --ibnbd_paths="$paths" --ibnbd_device=vol.img --ibnbd_host_key="$work/host.key" \
    --ibnbd_session="fio-test-$name" "$@" >"$work/$name.out" 2>&1 || rc=$?
  if [ "$rc" != "$want" ]; then
    not_ok "$name: fio exit" "exit $rc, want $want: $(tail -5 "$work/$name.out")"
    return 1
  fi
  return 0
}
# json_check NAME JQ_EXPR WHAT: the expression over NAME.json must be true.
json_check() {
  local name=$1 expr=$2 what=$3
  if jq -e "$expr" "$work/$name.json" >/dev/null 2>&1; then ok "$name: $what"; else
    not_ok "$name: $what" "$(jq -c '.jobs[] | {error, read: .read.io_bytes, write: .write.io_bytes, trim: .trim.io_bytes}' \
      "$work/$name.json" 2>/dev/null || tail -5 "$work/$name.out")"
  fi
}

# Case: 4 KiB random writes at QD16 over both paths, each block with a crc32c header, verified
# by reading back after the write phase. Expect: exit 0, no job error, the whole device written
# and read back.
if run_fio randwrite-verify 0 --rw=randwrite --bs=4k --iodepth=16 --size=${mib}M \
  --verify=crc32c --verify_fatal=1 --do_verify=1; then
  json_check randwrite-verify ".jobs[0].error == 0 and .jobs[0].write.io_bytes == $full_b and .jobs[0].read.io_bytes == $full_b" \
    "$mib MiB written and verified, no error"
fi

# Case: the same in the other completion mode (ibnbd_reap=thread: transport IO threads run the
# completions and hand them over; the cases around run the default, caller reaping), over the
# first 16 MiB. Expect: exit 0, no job error, 16 MiB written and read back verified.
if run_fio randwrite-verify-thread 0 --rw=randwrite --bs=4k --iodepth=16 --size=16M \
  --ibnbd_reap=thread --verify=crc32c --verify_fatal=1 --do_verify=1; then
  json_check randwrite-verify-thread '.jobs[0].error == 0 and .jobs[0].write.io_bytes == 16777216 and .jobs[0].read.io_bytes == 16777216' \
    "16 MiB written and verified with IO-thread completions, no error"
fi

# Case: a job whose ibnbd_reap is neither mode. Expect: fio fails the job (exit 1), no hang.
if [ "$refusals" = 1 ]; then
  run_fio bad-reap 1 --rw=read --bs=4k --size=1M --ibnbd_reap=sometimes && ok "a bad ibnbd_reap fails the job"
fi

# Case: the adaptive wait (ibnbd_poll=adaptive, the default) with its run queue check off, so
# that it sleeps and spins even on a loaded host, in both completion modes, with its statistics
# (ibnbd_poll_stats): random writes, verified, 2 MiB at QD1 (512 round trips each way: a TCG
# guest over rxe on a busy host takes milliseconds per round trip) and 8 MiB at QD8. Expect:
# exit 0, no job error, the data verified, and the statistics show hybrid waits (after the 16
# blocking waits that learn the arrival time, the next plan is a hybrid one).
for mq in "${adaptive[@]}"; do
  mode=${mq%:*} qd=${mq#*:}
  name=adaptive-$mode-qd$qd
  size=$((qd == 1 ? 2 : 8))
  if run_fio "$name" 0 --rw=randwrite --bs=4k --iodepth=$qd --size=${size}M --ibnbd_reap=$mode \
    --ibnbd_poll=adaptive --ibnbd_poll_runnable=0 --ibnbd_poll_stats=1 --verify=crc32c \
    --verify_fatal=1 --do_verify=1; then
    json_check "$name" ".jobs[0].error == 0 and .jobs[0].write.io_bytes == $((size << 20)) and .jobs[0].read.io_bytes == $((size << 20))" \
      "$size MiB written and verified with adaptive waits ($mode, QD$qd)"
    hybrid=$(sed -n 's/^ibnbd: [0-9]* waits: hybrid \([0-9]*\) .*/\1/p' "$work/$name.out" | head -1)
    if [ "${hybrid:-0}" -gt 0 ]; then ok "$name: $hybrid hybrid waits"; else
      not_ok "$name: hybrid waits" "none: $(grep '^ibnbd:' "$work/$name.out")"
    fi
  fi
done

# Case: ibnbd_poll=block (sleep at once, the default before the adaptive wait), verified.
# Expect: exit 0, no job error, 8 MiB written and read back.
if run_fio block-verify 0 --rw=randwrite --bs=4k --iodepth=4 --size=8M --ibnbd_poll=block \
  --verify=crc32c --verify_fatal=1 --do_verify=1; then
  json_check block-verify '.jobs[0].error == 0 and .jobs[0].read.io_bytes == 8388608' \
    "8 MiB written and verified with blocking waits"
fi

# Case: a job whose ibnbd_poll is neither adaptive nor block. Expect: fio fails the job (exit 1).
if [ "$refusals" = 1 ]; then
  run_fio bad-poll 1 --rw=read --bs=4k --size=1M --ibnbd_poll=sometimes && ok "a bad ibnbd_poll fails the job"
fi

# Case: a separate read-only pass verifies the headers the first job left (fio checks crc32c and
# offset of every block a read job reads when verify is set), in sequential reads by two jobs of
# one half each: two more sessions, both ro. Expect: exit 0, no error, 2 x 32 MiB read.
if [ "$fabric_only" = 0 ] && run_fio readonly-verify 0 --rw=read --bs=4k --iodepth=8 --numjobs=2 --offset_increment=${half}M \
  --size=${half}M --ibnbd_mode=ro --verify=crc32c --verify_fatal=1; then
  json_check readonly-verify "[.jobs[] | .error == 0 and .read.io_bytes == $half_b] | all" \
    "both jobs verified $half MiB, no error"
fi

# Case: 16 KiB random writes at QD32 with fio's submission and completion batching (commit sends up to 16 io_us as
# one submission batch) and getevents spinning 20 us before it sleeps, in 16 KiB blocks over the
# first half. Expect: exit 0, no job error, 32 MiB written and read back verified.
if [ "$fabric_only" = 0 ] && run_fio batched-verify 0 --rw=randwrite --bs=16k --iodepth=32 --iodepth_batch_submit=16 \
  --iodepth_batch_complete_max=32 --ibnbd_poll_us=20 --size=${half}M --verify=crc32c --verify_fatal=1 \
  --do_verify=1; then
  json_check batched-verify ".jobs[0].error == 0 and .jobs[0].write.io_bytes == $half_b and .jobs[0].read.io_bytes == $half_b" \
    "$half MiB written in batches and verified, no error"
fi

# Case: trims of the whole device in random 64 KiB ranges, then a read-back verified against a
# zero pattern: the server punches holes in the tmpfs file, which read as zeroes. Expect: exit 0,
# no error, 64 MiB trimmed and every byte zero.
if run_fio trim 0 --rw=randtrim --bs=64k --iodepth=8 --size=${mib}M; then
  json_check trim ".jobs[0].error == 0 and .jobs[0].trim.io_bytes == $full_b" "$mib MiB trimmed, no error"
fi
if run_fio after-trim 0 --rw=read --bs=1m --iodepth=4 --size=${mib}M --ibnbd_mode=ro \
  --verify=pattern --verify_pattern=0 --verify_fatal=1; then
  json_check after-trim '.jobs[0].error == 0' "trimmed device reads back as zeroes"
fi

# Case: a flush every 8 writes (fio's fsync=8 is DDIR_SYNC, the engine's FLUSH). Expect: exit 0,
# no error, fio counts the syncs.
if run_fio flush 0 --rw=randwrite --bs=4k --iodepth=4 --size=4M --fsync=8; then
  json_check flush '.jobs[0].error == 0 and .jobs[0].sync.total_ios > 0' "flushes completed, no error"
fi

# Case: a write job that asks for ro. Expect: fio fails the job (exit 1) with EPERM from the
# library, and nothing hangs.
if [ "$refusals" = 1 ] && run_fio ro-write 1 --rw=write --bs=4k --iodepth=2 --size=1M --ibnbd_mode=ro; then
  json_check ro-write '.jobs[0].error == 1' "a write in ro mode fails with EPERM"
fi

# Case: a device the server does not have. Expect: fio exits 1 (the engine's setup fails), no hang.
if [ "$refusals" = 1 ]; then
  run_fio missing-device 1 --rw=read --bs=4k --size=1M --ibnbd_device=nope.img && ok "a missing device fails the job"
fi

exit $failed
