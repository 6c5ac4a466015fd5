#!/usr/bin/env bash
# fio benchmark of the fio external ioengine (client/fio) against its peers, one run, one table:
#   file     fio io_uring on the tmpfs backing file itself: the limit (no network, no server)
#   nbdkit   nbdkit's file plugin on the same file over a unix socket, fio's nbd engine: the peer
#   ibnbd-1p / ibnbd-2p  ibnbd-server on the same file, fio through libibnbd-fio.so over one
#            loopback tcp path / two (the server's two listeners)
# Workloads: 4 KiB randread / randwrite at QD1 and QD32, 1 MiB sequential read / write at QD8;
# one job each. A benchmark, not a test: it asserts nothing.
#
#   bash bench/fio.sh [--seconds N]        (default 5 s per run; 24 runs)
#
# The build directory comes from $IBTRS_BUILD (default build); the server and the engine are
# built there if needed (the engine needs the fio headers: scripts/fio-headers.sh). Only
# loopback addresses and a unix socket are used.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
seconds=5
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    *) echo "usage: $0 [--seconds N]" >&2; exit 2 ;;
  esac
done
case "$seconds" in '' | *[!0-9]* | 0) echo "--seconds takes a whole number above 0" >&2; exit 2 ;; esac
for t in fio nbdkit jq; do
  command -v "$t" >/dev/null || { echo "$t is missing (scripts/setup.sh installs it)" >&2; exit 1; }
done

build=${IBTRS_BUILD:-build}
if [ ! -f "$build/build.ninja" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DIBNBD_FIO_ENGINE=ON >/dev/null
fi
ninja -C "$build" -j "$(nproc)" ibnbd-server ibnbd_fio >/dev/null
build=$(cd "$build" && pwd)  # the runs below happen in the tmpfs directory
srv="$build/server/ibnbd-server"
engine="$build/client/fio/libibnbd-fio.so"

# Everything on tmpfs: the backing file is the same for every target, so the rows differ only
# by the path to it.
tmp=$(mktemp -d /dev/shm/ibnbd-fio-bench.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
cd "$tmp"  # fio's state files

wait_file() {  # wait_file FILE PID: until FILE exists, while PID lives (10 s at most)
  for _ in $(seq 200); do
    [ -e "$1" ] && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.05
  done
  return 1
}

# 1 GiB, written once so that reads find pages (tmpfs holes would read for free).
mkdir -p "$tmp/export"
dd if=/dev/urandom of="$tmp/export/vol.img" bs=1M count=1024 status=none

"$srv" --listen tcp:127.0.0.1:0 --listen tcp:127.0.0.1:0 --dev-search-path "$tmp/export" \
  --control-socket "$tmp/srv.sock" --ready-file "$tmp/srv.ready" >"$tmp/srv.log" 2>&1 &
pids+=($!)
wait_file "$tmp/srv.ready" "${pids[-1]}" || { echo "ibnbd-server did not start:" >&2; cat "$tmp/srv.log" >&2; exit 1; }
mapfile -t addrs < <(sed -n 's/^listening //p' "$tmp/srv.ready")

nbdkit --foreground --exit-with-parent --unix "$tmp/nbd.sock" file "$tmp/export/vol.img" \
  >"$tmp/nbdkit.log" 2>&1 &
pids+=($!)
wait_file "$tmp/nbd.sock" "${pids[-1]}" || { echo "nbdkit did not start:" >&2; cat "$tmp/nbdkit.log" >&2; exit 1; }

run_no=0
# target_args TARGET: the fio options that pick the target.
target_args() {
  case "$1" in
    file) echo "--ioengine=io_uring --filename=$tmp/export/vol.img" ;;
    nbdkit) echo "--ioengine=nbd --uri=nbd+unix:///?socket=$tmp/nbd.sock" ;;
    ibnbd-1p) echo "--ioengine=external:$engine --ibnbd_paths=${addrs[0]} --ibnbd_device=vol.img --ibnbd_session=bench-$$-$run_no" ;;
    ibnbd-2p) echo "--ioengine=external:$engine --ibnbd_paths=${addrs[0]},${addrs[1]} --ibnbd_device=vol.img --ibnbd_session=bench-$$-$run_no" ;;
  esac
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a != "" && b != "" && b > 0) printf "%.2f", a / b; else print "n/a" }'; }

declare -A peer_iops peer_lat
# run WORKLOAD TARGET RW BS QD: one fio run, prints its table row.
run() {
  local workload=$1 target=$2 rw=$3 bs=$4 qd=$5
  run_no=$((run_no + 1))
  local out="$tmp/run-$run_no.json" rc=0
  # shellcheck disable=SC2046  # target_args is a list of options
  timeout -k 5 $((seconds + 60)) fio --name="r$run_no" $(target_args "$target") \
    --rw="$rw" --bs="$bs" --iodepth="$qd" --size=1G \
    --time_based --runtime="$seconds" --output-format=json --output="$out" >"$tmp/run-$run_no.log" 2>&1 || rc=$?
  if [ "$rc" != 0 ] || ! jq -e '.jobs[0]' "$out" >/dev/null 2>&1; then
    echo "| $workload | $target | failed (exit $rc) | | | | | |"
    tail -3 "$tmp/run-$run_no.log" >&2
    return 0
  fi
  local side=read
  case "$rw" in *write*) side=write ;; esac
  local iops mibs mean p99 err
  read -r iops mibs mean p99 err < <(jq -r --arg s "$side" '.jobs[0] as $j | $j[$s] |
    "\(.iops) \(.bw_bytes / 1048576) \(.lat_ns.mean / 1000) \((.clat_ns.percentile["99.000000"] // 0) / 1000) \($j.error)"' "$out")
  local r_iops="" r_lat=""
  if [ "$target" = nbdkit ]; then
    peer_iops[$workload]=$iops
    peer_lat[$workload]=$mean
  elif [ -n "${peer_iops[$workload]:-}" ]; then
    r_iops=$(ratio "$iops" "${peer_iops[$workload]}")
    r_lat=$(ratio "$mean" "${peer_lat[$workload]}")
  fi
  [ "$err" = 0 ] || r_iops="$r_iops (fio error $err)"
  printf '| %s | %s | %.0f | %.1f | %.1f | %.1f | %s | %s |\n' "$workload" "$target" "$iops" "$mibs" "$mean" "$p99" \
    "$r_iops" "$r_lat"
}

echo "# fio benchmark ($(date -u +%Y-%m-%d), $(nproc) cores, $(uname -r), load average before: $(cut -d' ' -f1-3 /proc/loadavg))"
echo
echo "fio $(fio --version | sed 's/^fio-//'), one job, ${seconds} s per run, a 1 GiB file on tmpfs. file: io_uring on"
echo "the file; nbdkit: file plugin, unix socket, fio's nbd engine; ibnbd-Np: ibnbd-server (tcp,"
echo "loopback, N paths) through the fio external ioengine. Latency: fio's total latency (mean)"
echo "and completion latency (p99). Ratios: IOPS / nbdkit IOPS, mean latency / nbdkit mean latency."
echo
echo "| workload | target | IOPS | MiB/s | mean us | p99 us | IOPS vs nbdkit | latency vs nbdkit |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
for row in "4k randread qd1:randread:4k:1" "4k randread qd32:randread:4k:32" \
  "4k randwrite qd1:randwrite:4k:1" "4k randwrite qd32:randwrite:4k:32" \
  "1m read qd8:read:1m:8" "1m write qd8:write:1m:8"; do
  IFS=: read -r workload rw bs qd <<<"$row"
  for target in nbdkit file ibnbd-1p ibnbd-2p; do
    run "$workload" "$target" "$rw" "$bs" "$qd"
  done
done
echo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
