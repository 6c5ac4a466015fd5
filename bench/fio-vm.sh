#!/usr/bin/env bash
# The kernel-facing half of bench/fio.sh, run inside the VM rig (tests/vm: Debian's 6.12 kernel
# under TCG, Soft-RoCE rxe0 -> rxe1 over a veth pair, ublk_drv, nbd): what our stack gives a
# program that uses a real block device, over rdma and over tcp, beside the NBD peer doing the
# same through the kernel's NBD client. One VM boot, one table. Targets (every one serves a
# 256 MiB file on the VM's tmpfs, written once):
#   file               fio io_uring on the file itself: the limit (no network, no server)
#   nbdkit-fio         nbdkit's file plugin, fio's nbd engine over a unix socket (as on the host)
#   nbdkit-kernel      nbdkit's file plugin, /dev/nbd0 from nbd-client over a unix socket,
#                      fio io_uring O_DIRECT on it: the peer a block-device user would pick
#   nbdkit-kernel-tcp  the same over tcp to 198.18.0.2 (/dev/nbd2): the peer on the network
#                      path our tcp rows take
#   ibnbd-engine-rdma  ibnbd-server, fio through our external ioengine over one rdma path
#   ibnbd-engine-tcp   the same over one tcp path (198.18.0.1 -> 198.18.0.2 over the veth pair)
#   ibnbd-ublk-rdma    ibnbd-client daemon mapping the volume over rdma with --ublk, fio io_uring
#                      O_DIRECT on /dev/ublkbN
#   ibnbd-ublk-tcp     the same over tcp
#   ibnbd-nbd-kernel   two hops: the client daemon's NBD export (of the rdma mapping) on a unix
#                      socket, /dev/nbd1 from nbd-client, fio io_uring O_DIRECT on it
#   ibnbd-ublk-rdma-thread, ibnbd-ublk-tcp-thread  (not in the default set) the ublk rows from a
#                      second client daemon with --ublk-reap thread (completions through the
#                      transport's IO threads, as before the queue threads reaped), on volumes
#                      of their own: the A/B of the queue threads' reaping, interleaved
# The ublk rows also give the client daemon's context switches per IO (all its threads,
# voluntary + involuntary, from /proc/PID/task/*/status around the run): a count that the
# host's load does not move, where IOPS under TCG move with it; and the queue threads' eventfd
# wake-ups per IO (completions handed over through the inbox, device show's ublk_wakeups).
# The engine rows open their volume in migration mode (rnbd's rule: one writer plus one
# migration opener) because the daemon holds it rw for its ublk device the whole run. The rdma
# and tcp rows use two files, so that each mapping has its own volume.
# Workloads as bench/fio.sh: 4 KiB randread / randwrite at QD1 and QD32, 1 MiB sequential read
# / write at QD8, one job, --iodepth_batch_submit=QD --iodepth_batch_complete_max=QD.
# TCG emulates every instruction: absolute figures are far below the host's and the ratios,
# measured side by side in the same boot, are what the table is for. No CPU column: under TCG,
# and with the kernel's ublk and nbd work in no process, it would not mean anything.
# A benchmark, not a test: it asserts nothing.
#
#   bash bench/fio-vm.sh [--seconds N]     (default 3 s per run; 54 runs, about 7 minutes)
#   IBNBD_BENCH_TARGETS="nbdkit-kernel ibnbd-ublk-rdma" bash bench/fio-vm.sh    (a subset of rows)
#   IBNBD_BENCH_SERVER_ARGS="--poll block" bash bench/fio-vm.sh    (extra ibnbd-server options,
#                      e.g. an A/B of the IO threads' wait between two runs)
#
# The build directory comes from $IBTRS_BUILD (default build; with -DIBTRS_RDMA=ON and the fio
# engine). Addresses: the VM's private 198.18.0.1 -> 198.18.0.2 pair and unix sockets only.
set -uo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
seconds=3
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    *) echo "usage: $0 [--seconds N]" >&2; exit 2 ;;
  esac
done
case "$seconds" in '' | *[!0-9]* | 0) echo "--seconds takes a whole number above 0" >&2; exit 2 ;; esac
build=$(cd "${IBTRS_BUILD:-$top/build}" && pwd)
srv=$build/server/ibnbd-server
cld=$build/client/daemon/ibnbd-client
cli=$build/client/cli/ibnbd
engine=$build/client/fio/libibnbd-fio.so

if [ "${IBTRS_VM:-}" != 1 ]; then
  ninja -C "$build" ibnbd-server ibnbd-client ibnbd ibnbd_fio >/dev/null ||
    { echo "build failed (the engine needs the fio headers: scripts/fio-headers.sh)" >&2; exit 1; }
  # The -thread rows add two 256 MiB volumes: the guest's tmpfs (half its memory) needs 1.5 GiB.
  mem=2048
  case " ${IBNBD_BENCH_TARGETS:-} " in *-thread\ *) mem=3072 ;; esac
  exec bash "$top/tests/vm/run-in-vm.sh" --timeout 1500 --mem "$mem" --env IBTRS_BUILD="$build" \
    ${IBNBD_BENCH_TARGETS:+--env "IBNBD_BENCH_TARGETS=$IBNBD_BENCH_TARGETS"} \
    ${IBNBD_BENCH_SERVER_ARGS:+--env "IBNBD_BENCH_SERVER_ARGS=$IBNBD_BENCH_SERVER_ARGS"} -- \
    bash "$top/bench/fio-vm.sh" --seconds "$seconds"
fi

for t in fio nbdkit nbd-client jq; do
  command -v "$t" >/dev/null || { echo "$t is missing (scripts/setup.sh installs it)" >&2; exit 1; }
done
[ -e /dev/ublk-control ] || { echo "no /dev/ublk-control in the VM" >&2; exit 1; }
A=$IBTRS_RDMA_ADDR_A
B=$IBTRS_RDMA_ADDR_B
tmp=$(mktemp -d /tmp/ibnbd-fio-vm.XXXXXX)  # the VM's overlay: RAM
pids=()
cleanup() {
  timeout 20 nbd-client -d /dev/nbd0 >/dev/null 2>&1
  timeout 20 nbd-client -d /dev/nbd1 >/dev/null 2>&1
  timeout 20 nbd-client -d /dev/nbd2 >/dev/null 2>&1
  # Newest first; TERM makes the client daemon delete its ublk devices and unmap.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill "${pids[i]}" 2>/dev/null
    timeout 60 tail --pid="${pids[i]}" -f /dev/null 2>/dev/null
  done
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
cd "$tmp"  # fio's state files

wait_file() { for _ in $(seq 300); do [ -e "$1" ] && return 0; sleep 0.1; done; return 1; }
started() { echo "$1 did not start:" >&2; tail -5 "$2" >&2; exit 1; }
c() { timeout 120 "$cli" --socket "$tmp/cl.sock" client "$@"; }

peers="nbdkit-fio nbdkit-kernel nbdkit-kernel-tcp"
targets=${IBNBD_BENCH_TARGETS:-"file $peers ibnbd-engine-rdma ibnbd-engine-tcp ibnbd-ublk-rdma ibnbd-ublk-tcp ibnbd-nbd-kernel"}
thread_rows=0
case " $targets " in *-thread\ *) thread_rows=1 ;; esac

mkdir -p "$tmp/export"
vols="vol-r vol-t"
[ "$thread_rows" = 1 ] && vols="$vols vol-r2 vol-t2"
for v in $vols; do
  dd if=/dev/urandom of="$tmp/export/$v.img" bs=1M count=256 status=none
done

# --allow-any-host (the server warns): IO is what is measured here, and authentication costs
# only at connect (docs/security.d/auth-bench.md).
# shellcheck disable=SC2086  # word splitting of the extra options is wanted
"$srv" --allow-any-host --listen "rdma:$B:0" --listen "tcp:$B:0" --dev-search-path "$tmp/export" \
  ${IBNBD_BENCH_SERVER_ARGS:-} --control-socket "$tmp/srv.sock" --ready-file "$tmp/srv.ready" >"$tmp/srv.log" 2>&1 &
pids+=($!)
srv_pid=$!
wait_file "$tmp/srv.ready" || started ibnbd-server "$tmp/srv.log"
rdma_path=$(sed -n "s/^listening \(rdma:.*\)/rdma:$A@\1/p" "$tmp/srv.ready" | head -1)
tcp_path=$(sed -n 's/^listening \(tcp:.*\)/\1/p' "$tmp/srv.ready" | head -1)

nbdkit --foreground --exit-with-parent --unix "$tmp/nbdkit.sock" file "$tmp/export/vol-r.img" \
  >"$tmp/nbdkit.log" 2>&1 &
pids+=($!)
wait_file "$tmp/nbdkit.sock" || started nbdkit "$tmp/nbdkit.log"
timeout 60 nbd-client -unix "$tmp/nbdkit.sock" /dev/nbd0 -b 4096 >"$tmp/nbd0.log" 2>&1 ||
  started "nbd-client (nbdkit)" "$tmp/nbd0.log"
nbdkit --foreground --exit-with-parent --ipaddr "$B" --port 10809 file "$tmp/export/vol-t.img" \
  >"$tmp/nbdkit-tcp.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do ss -Hltn "sport = :10809" | grep -q . && break; sleep 0.1; done
timeout 60 nbd-client "$B" 10809 /dev/nbd2 -b 4096 >"$tmp/nbd2.log" 2>&1 ||
  started "nbd-client (nbdkit tcp)" "$tmp/nbd2.log"

"$cld" --control-socket "$tmp/cl.sock" --ready-file "$tmp/cl.ready" --state-dir "$tmp/state" \
  >"$tmp/cl.log" 2>&1 &
pids+=($!)
cl_pid=$!
wait_file "$tmp/cl.ready" || started ibnbd-client "$tmp/cl.log"
c device map vol-r.img from "$rdma_path" rw session r --ublk >/dev/null || started "map (rdma)" "$tmp/cl.log"
c device map vol-t.img from "$tcp_path" rw session t --ublk >/dev/null || started "map (tcp)" "$tmp/cl.log"
ublk_r=$(c -f json device show vol-r.img | jq -r '.[0].ublk')
ublk_t=$(c -f json device show vol-t.img | jq -r '.[0].ublk')
[ -b "$ublk_r" ] && [ -b "$ublk_t" ] || { echo "no ublk devices ('$ublk_r', '$ublk_t')" >&2; exit 1; }
cl2_pid=""
if [ "$thread_rows" = 1 ]; then
  "$cld" --control-socket "$tmp/cl2.sock" --ready-file "$tmp/cl2.ready" --state-dir "$tmp/state2" \
    --ublk-reap thread >"$tmp/cl2.log" 2>&1 &
  pids+=($!)
  cl2_pid=$!
  wait_file "$tmp/cl2.ready" || started "ibnbd-client (--ublk-reap thread)" "$tmp/cl2.log"
  c2() { timeout 120 "$cli" --socket "$tmp/cl2.sock" client "$@"; }
  c2 device map vol-r2.img from "$rdma_path" rw session r2 --ublk >/dev/null || started "map (rdma, thread)" "$tmp/cl2.log"
  c2 device map vol-t2.img from "$tcp_path" rw session t2 --ublk >/dev/null || started "map (tcp, thread)" "$tmp/cl2.log"
  ublk_r2=$(c2 -f json device show vol-r2.img | jq -r '.[0].ublk')
  ublk_t2=$(c2 -f json device show vol-t2.img | jq -r '.[0].ublk')
  [ -b "$ublk_r2" ] && [ -b "$ublk_t2" ] || { echo "no ublk devices ('$ublk_r2', '$ublk_t2')" >&2; exit 1; }
fi
c device export vol-r.img unix "$tmp/ibnbd-nbd.sock" >/dev/null || started "export" "$tmp/cl.log"
timeout 60 nbd-client -unix "$tmp/ibnbd-nbd.sock" /dev/nbd1 -N vol-r.img -b 4096 >"$tmp/nbd1.log" 2>&1 ||
  started "nbd-client (ibnbd export)" "$tmp/nbd1.log"

run_no=0
target_args() {  # target_args TARGET: the fio options that pick the target
  local eng="--ioengine=external:$engine --ibnbd_mode=migration --ibnbd_session=vmbench-$run_no"
  case "$1" in
    file) echo "--ioengine=io_uring --filename=$tmp/export/vol-r.img" ;;
    nbdkit-fio) echo "--ioengine=nbd --uri=nbd+unix:///?socket=$tmp/nbdkit.sock" ;;
    nbdkit-kernel) echo "--ioengine=io_uring --direct=1 --filename=/dev/nbd0" ;;
    nbdkit-kernel-tcp) echo "--ioengine=io_uring --direct=1 --filename=/dev/nbd2" ;;
    ibnbd-engine-rdma) echo "$eng --ibnbd_paths=$rdma_path --ibnbd_device=vol-r.img" ;;
    ibnbd-engine-tcp) echo "$eng --ibnbd_paths=$tcp_path --ibnbd_device=vol-t.img" ;;
    ibnbd-ublk-rdma) echo "--ioengine=io_uring --direct=1 --filename=$ublk_r" ;;
    ibnbd-ublk-tcp) echo "--ioengine=io_uring --direct=1 --filename=$ublk_t" ;;
    ibnbd-nbd-kernel) echo "--ioengine=io_uring --direct=1 --filename=/dev/nbd1" ;;
    ibnbd-ublk-rdma-thread) echo "--ioengine=io_uring --direct=1 --filename=$ublk_r2" ;;
    ibnbd-ublk-tcp-thread) echo "--ioengine=io_uring --direct=1 --filename=$ublk_t2" ;;
  esac
}
daemon_of() {  # daemon_of TARGET: the pid of the client daemon serving it, if one does
  case "$1" in
    *-thread) echo "$cl2_pid" ;;
    ibnbd-ublk-*) echo "$cl_pid" ;;
  esac
}
ublk_of() {  # ublk_of TARGET: "SOCKET VOLUME" of the ublk device serving it, if one does
  case "$1" in
    ibnbd-ublk-rdma) echo "$tmp/cl.sock vol-r.img" ;;
    ibnbd-ublk-tcp) echo "$tmp/cl.sock vol-t.img" ;;
    ibnbd-ublk-rdma-thread) echo "$tmp/cl2.sock vol-r2.img" ;;
    ibnbd-ublk-tcp-thread) echo "$tmp/cl2.sock vol-t2.img" ;;
  esac
}
ublk_wakeups() {  # ublk_wakeups SOCKET VOLUME: the queue threads' eventfd wake-ups so far
  timeout 60 "$cli" --socket "$1" client -f json device show "$2" | jq -r '.[0].ublk_wakeups // 0'
}
ctx_switches() {  # ctx_switches PID: voluntary + involuntary, all threads
  cat /proc/"$1"/task/*/status 2>/dev/null |
    awk '/^(non)?voluntary_ctxt_switches:/ { n += $2 } END { print n + 0 }'
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a != "" && b != "" && b > 0) printf "%.2f", a / b; else print "" }'; }

declare -A iops_of lat_of
rows=()
run() {  # run WORKLOAD TARGET RW BS QD
  local workload=$1 target=$2 rw=$3 bs=$4 qd=$5
  run_no=$((run_no + 1))
  local out="$tmp/run-$run_no.json" rc=0 dpid cs0=0 ublk wk0=0
  dpid=$(daemon_of "$target")
  ublk=$(ublk_of "$target")
  # shellcheck disable=SC2086
  [ -n "$ublk" ] && wk0=$(ublk_wakeups $ublk)
  [ -n "$dpid" ] && cs0=$(ctx_switches "$dpid")
  # shellcheck disable=SC2046
  timeout -k 5 $((seconds + 120)) fio --name="r$run_no" $(target_args "$target") \
    --rw="$rw" --bs="$bs" --iodepth="$qd" --iodepth_batch_submit="$qd" \
    --iodepth_batch_complete_max="$qd" --size=256M --time_based --runtime="$seconds" \
    --output-format=json --output="$out" >"$tmp/run-$run_no.log" 2>&1 || rc=$?
  if [ "$rc" != 0 ] || ! jq -e '.jobs[0]' "$out" >/dev/null 2>&1; then
    rows+=("$workload|$target|failed (exit $rc)")
    tail -3 "$tmp/run-$run_no.log" >&2
    return 0
  fi
  local side=read
  case "$rw" in *write*) side="write" ;; esac
  local iops mibs mean p99 err ios cs="" wk=""
  read -r iops mibs mean p99 err ios <<<"$(jq -r --arg s "$side" '.jobs[0] as $j | $j[$s] as $d |
    "\($d.iops) \($d.bw_bytes / 1048576) \($d.lat_ns.mean / 1000) \(($d.clat_ns.percentile["99.000000"] // 0) / 1000) \($j.error) \($d.total_ios)"' "$out")"
  [ -n "$dpid" ] && cs=$(awk -v a="$cs0" -v b="$(ctx_switches "$dpid")" -v n="$ios" \
    'BEGIN { if (n > 0) printf "%.2f", (b - a) / n }')
  # shellcheck disable=SC2086
  [ -n "$ublk" ] && wk=$(awk -v a="$wk0" -v b="$(ublk_wakeups $ublk)" -v n="$ios" \
    'BEGIN { if (n > 0) printf "%.2f", (b - a) / n }')
  iops_of[$workload/$target]=$iops
  lat_of[$workload/$target]=$mean
  rows+=("$workload|$target|$(printf '%.0f|%.1f|%.0f|%.0f' "$iops" "$mibs" "$mean" "$p99")|$err|$cs|$wk")
}

start=$(date +%s)
workloads=("4k randread qd1:randread:4k:1" "4k randread qd32:randread:4k:32"
  "4k randwrite qd1:randwrite:4k:1" "4k randwrite qd32:randwrite:4k:32"
  "1m read qd8:read:1m:8" "1m write qd8:write:1m:8")
for row in "${workloads[@]}"; do
  IFS=: read -r workload rw bs qd <<<"$row"
  for target in $targets; do
    run "$workload" "$target" "$rw" "$bs" "$qd"
  done
done

echo "# fio in the VM rig ($(date -u +%Y-%m-%d), $(uname -r) under TCG, $(nproc) vCPUs)"
echo "ibnbd-server options beyond the defaults: ${IBNBD_BENCH_SERVER_ARGS:-none}"
echo
echo "fio $(fio --version | sed 's/^fio-//'), one job, ${seconds} s per run, 256 MiB files on tmpfs; targets: the"
echo "header of bench/fio-vm.sh. Ratios: IOPS and mean latency against nbdkit through the kernel's"
echo "NBD client on a unix socket (the block-device peer), IOPS against the same over tcp and against"
echo "nbdkit through fio's nbd engine."
echo
echo "| workload | target | IOPS | MiB/s | mean us | p99 us | IOPS vs nbdkit-kernel | lat vs nbdkit-kernel | IOPS vs nbdkit-kernel-tcp | IOPS vs nbdkit-fio | daemon cs/IO | inbox wake-ups/IO |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for r in "${rows[@]}"; do
  IFS='|' read -r workload target iops mibs mean p99 err cs wk <<<"$r"
  if [ -z "$mibs" ]; then
    echo "| $workload | $target | $iops | | | | | | | | | |"
    continue
  fi
  rk=$(ratio "$iops" "${iops_of[$workload/nbdkit-kernel]:-}")
  [ "$err" = 0 ] || rk="$rk (fio error $err)"
  echo "| $workload | $target | $iops | $mibs | $mean | $p99 | $rk |" \
    "$(ratio "${lat_of[$workload/$target]}" "${lat_of[$workload/nbdkit-kernel]:-}") |" \
    "$(ratio "$iops" "${iops_of[$workload/nbdkit-kernel-tcp]:-}") |" \
    "$(ratio "$iops" "${iops_of[$workload/nbdkit-fio]:-}") | $cs | $wk |"
done
echo
echo "the run took $(($(date +%s) - start)) s"
