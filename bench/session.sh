#!/usr/bin/env bash
# Session benchmark: ibtrs-load (client and RAM-volume server on the public session API) over the
# tcp provider on loopback, with one path and with two (the second to the server's second
# port), each multipath policy, and nbdkit + fio over a unix socket as the comparison peer.
# One run, one markdown table. A benchmark, not a test: it asserts nothing.
#
#   bash bench/session.sh [--seconds N] [--quick]
#
# The build directory comes from $IBTRS_BUILD (default build); ibtrs-load is built there if
# needed. Only loopback addresses and a unix socket are used.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
seconds=5
quick=0
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --quick) quick=1; seconds=1; shift ;;
    *) echo "usage: $0 [--seconds N] [--quick]" >&2; exit 2 ;;
  esac
done
case "$seconds" in '' | *[!0-9]* | 0) echo "--seconds takes a whole number above 0" >&2; exit 2 ;; esac

build=${IBTRS_BUILD:-build}
if [ ! -f "$build/build.ninja" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
ninja -C "$build" -j "$(nproc)" ibtrs-load >/dev/null
load="$build/transport/ibtrs-load"

tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do
    # A peer that ignores SIGTERM for 5 s is killed outright.
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  pids=()
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

json_field() {  # json_field FIELD <<< '{"a":1,...}': a top-level number
  sed -n "s/.*\"$1\":\([0-9.]*\).*/\1/p" | tail -1
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a != "" && b != "" && b > 0) printf "%.2f", a / b; else print "n/a" }'; }

wait_file() {  # wait_file FILE PID: until FILE exists, while PID lives (10 s at most)
  for _ in $(seq 200); do
    [ -e "$1" ] && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.05
  done
  return 1
}

# ---- ibtrs-load server: two loopback ports, chunks big enough for 1 MiB requests -------------
# 128 chunks of 2 MiB: max io 2 MiB - 4 KiB, and 128 permits for the QD 128 rows.
# start_server NAME ARGS...: an ibtrs-load server; its addresses go to the array `listen`.
start_server() {
  local name=$1
  shift
  "$load" server "$@" --ready-file "$tmp/$name.ready" >"$tmp/$name.log" 2>&1 &
  local pid=$!
  pids+=("$pid")
  if ! wait_file "$tmp/$name.ready" "$pid"; then
    echo "ibtrs-load server did not start:" >&2
    cat "$tmp/$name.log" >&2
    exit 1
  fi
  mapfile -t listen < <(sed -n 's/^listening //p' "$tmp/$name.ready")
}
start_server server --listen tcp:127.0.0.1:0 --listen tcp:127.0.0.1:0 --queue-depth 128 --chunk-size 2M \
  --size 1G
[ "${#listen[@]}" -eq 2 ] || { echo "server reported ${#listen[@]} addresses, wanted 2" >&2; exit 1; }
path1=${listen[0]}
path2=${listen[1]}

run_no=0
declare -A base_iops  # workload -> 1-path IOPS

# run_load WORKLOAD NPATHS POLICY RW BS QD: one client run, prints its table row. POLICY
# "always-invalidate" runs one path against the re-keying server ($inv_path), rated against the
# plain server's 1-path row.
run_load() {
  local workload=$1 npaths=$2 policy=$3 rw=$4 bs=$5 qd=$6
  local first=$path1 pol=$policy
  if [ "$policy" = always-invalidate ]; then first=$inv_path; pol=min-inflight; fi
  local args=(--session "bench-$$-$run_no" --path "$first" --policy "$pol" --rw "$rw" --bs "$bs" --qd "$qd"
    --seconds "$seconds" --json)
  run_no=$((run_no + 1))
  [ "$npaths" = 2 ] && args+=(--path "$path2")
  local log="$tmp/client-$run_no.log" rc=0
  timeout -k 5 $((seconds + 60)) "$load" client "${args[@]}" >"$log" 2>&1 || rc=$?
  local json
  json=$(tail -1 "$log")
  case "$json" in
    '{'*) ;;
    *)
      echo "| $workload | $npaths | $policy | failed (exit $rc) | | | | |"
      echo "client run failed (exit $rc): ${args[*]}" >&2
      tail -5 "$log" >&2
      return 0
      ;;
  esac
  local iops mibs p50 p99 errors r=""
  iops=$(json_field iops <<<"$json")
  mibs=$(json_field mib_s <<<"$json")
  p50=$(json_field lat_p50_us <<<"$json")
  p99=$(json_field lat_p99_us <<<"$json")
  errors=$(json_field errors <<<"$json")
  if [ "$npaths" = 1 ] && [ "$policy" = min-inflight ]; then
    base_iops[$workload]=$iops
  elif [ -n "${base_iops[$workload]:-}" ]; then
    r=$(ratio "$iops" "${base_iops[$workload]}")
  fi
  [ "$errors" = 0 ] || r="$r ($errors IO errors)"
  printf '| %s | %s | %s | %.0f | %.1f | %.1f | %.1f | %s |\n' "$workload" "$npaths" "$policy" "$iops" "$mibs" \
    "$p50" "$p99" "$r"
}

echo "# session benchmark ($(date -u +%Y-%m-%d), $(nproc) cores, $(uname -r))"
echo
echo "ibtrs-load client and server over the tcp provider on loopback, ${seconds} s per run; server"
echo "--queue-depth 128 --chunk-size 2M. ratio: 2-path IOPS / 1-path IOPS of the same workload"
echo "(always-invalidate rows: 1 path to a server re-keying chunks per IO / 1 path to a plain one);"
echo "nbdkit rows: ibtrs 1-path IOPS / nbdkit IOPS."
echo
echo "| workload | paths | policy | IOPS | MiB/s | p50 us | p99 us | ratio |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- |"

if [ "$quick" = 1 ]; then
  rows=("4k randread qd1:randread:4k:1" "4k randread qd32:randread:4k:32" "4k randwrite qd32:randwrite:4k:32"
    "128k read qd8:read:128k:8" "1m write qd8:write:1m:8")
else
  rows=()
  for rw in randread randwrite; do
    for qd in 1 32 128; do rows+=("4k $rw qd$qd:$rw:4k:$qd"); done
  done
  for bs in 128k 1m; do
    for rw in read write; do rows+=("$bs $rw qd8:$rw:$bs:8"); done
  done
fi
for row in "${rows[@]}"; do
  IFS=: read -r workload rw bs qd <<<"$row"
  run_load "$workload" 1 min-inflight "$rw" "$bs" "$qd"
  run_load "$workload" 2 min-inflight "$rw" "$bs" "$qd"
done
for policy in round-robin min-latency; do
  run_load "4k randread qd32" 2 "$policy" randread 4k 32
done

# ---- always_invalidate: a server that re-registers each chunk per IO (RKEY_RSP) ---------------
start_server inv --listen tcp:127.0.0.1:0 --queue-depth 128 --chunk-size 2M --size 1G --always-invalidate
inv_path=${listen[0]}
for row in "4k randread qd32:randread:4k:32" "4k randwrite qd32:randwrite:4k:32" "128k read qd8:read:128k:8"; do
  IFS=: read -r workload rw bs qd <<<"$row"
  run_load "$workload" 1 always-invalidate "$rw" "$bs" "$qd"
done

# ---- nbdkit + fio: the same 4 KiB QD 32 workloads against a RAM-backed file -----------------
if ! command -v nbdkit >/dev/null || ! command -v fio >/dev/null; then
  bash scripts/setup.sh >&2 || true
fi
declare -A nbd_iops
if command -v nbdkit >/dev/null && command -v fio >/dev/null; then
  img=$(mktemp -p /dev/shm ibtrs-bench-XXXXXX.img)
  # tmpfs: the file is RAM like our server's volume; removed with the temp dir's cleanup.
  cleanup_img() { rm -f "$img"; cleanup; }
  trap cleanup_img EXIT
  truncate -s 1G "$img"
  nbdkit --foreground --exit-with-parent --unix "$tmp/nbd.sock" file "$img" >"$tmp/nbdkit.log" 2>&1 &
  nbd_pid=$!
  pids+=("$nbd_pid")
  if ! wait_file "$tmp/nbd.sock" "$nbd_pid"; then
    echo "nbdkit did not start:" >&2
    cat "$tmp/nbdkit.log" >&2
  else
    for rw in randread randwrite; do
      # terse v3 fields: 7/8 read KiB/s and IOPS, 24/30 read clat p50/p99 (us); 48/49, 65/71 the
      # same for writes.
      rc=0
      timeout -k 5 $((seconds + 60)) fio --name=nbd --ioengine=nbd --uri="nbd+unix:///?socket=$tmp/nbd.sock" \
        --rw=$rw --bs=4k --iodepth=32 --size=1G --runtime="$seconds" --time_based --output-format=terse \
        --output="$tmp/fio-$rw" >"$tmp/fio-$rw.log" 2>&1 || rc=$?
      if [ "$rc" != 0 ] || [ ! -s "$tmp/fio-$rw" ]; then
        echo "| 4k $rw qd32 | nbdkit | - | failed (exit $rc) | | | | |"
        tail -5 "$tmp/fio-$rw.log" >&2
        continue
      fi
      w=0
      [ "$rw" = randwrite ] && w=1
      read -r iops kib p50 p99 < <(awk -F';' -v w="$w" '{
        if (w) { i = 49; b = 48; a = 65; c = 71 } else { i = 8; b = 7; a = 24; c = 30 }
        split($a, x, "="); split($c, y, "="); print $i, $b, x[2], y[2] }' "$tmp/fio-$rw")
      nbd_iops[$rw]=$iops
      printf '| 4k %s qd32 | nbdkit (unix socket, fio) | - | %.0f | %.1f | %.1f | %.1f | %s |\n' "$rw" "$iops" \
        "$(awk -v k="$kib" 'BEGIN { print k / 1024 }')" "$p50" "$p99" "$(ratio "${base_iops[4k $rw qd32]:-}" "$iops")"
    done
  fi
else
  echo "| 4k qd32 | nbdkit | - | not measured: nbdkit or fio missing | | | | |"
fi

echo
for rw in randread randwrite; do
  [ -n "${nbd_iops[$rw]:-}" ] || continue
  echo "ibtrs / nbdkit, 4 KiB $rw QD 32 IOPS: $(ratio "${base_iops[4k $rw qd32]:-}" "${nbd_iops[$rw]}") (target >= 2)"
done
