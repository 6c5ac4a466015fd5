#!/usr/bin/env bash
# Fabric benchmark: each provider beside the limit measured in the same run.
#   tcp:  ibtrs-fabric-perf over the tcp provider vs iperf3 (bandwidth) and a plain TCP
#         ping-pong (round trip), all on loopback.
#   rdma: ibtrs-fabric-perf over the rdma provider vs perftest's ib_write_bw / ib_write_lat on
#         the same Soft-RoCE pair, inside the VM rig (tests/vm).
# Prints markdown tables of ratios. A benchmark, not a test: it asserts nothing.
#
#   bash bench/fabric.sh [--seconds S] [--tcp-only | --rdma-only] [--build DIR]
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
seconds=3
build=build-bench
run_tcp=1
run_rdma=1
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --tcp-only) run_rdma=0; shift ;;
    --rdma-only) run_tcp=0; shift ;;
    --build) build=$2; shift 2 ;;
    *) echo "usage: $0 [--seconds S] [--tcp-only|--rdma-only] [--build DIR]"; exit 2 ;;
  esac
done

if [ -z "${IBTRS_VM:-}" ]; then
  bash scripts/setup.sh >/dev/null
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DIBTRS_TESTS=OFF >/dev/null
  ninja -C "$build" ibtrs-fabric-perf tcp-pingpong event-loop >/dev/null
fi
perf="$build/transport/ibtrs-fabric-perf"
pingpong="$build/bench/tcp-pingpong"
eventloop="$build/bench/event-loop"

json_field() {  # json_field FIELD <<< '{"a":1,...}'
  sed -n "s/.*\"$1\":\([0-9.]*\).*/\1/p" | tail -1
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; pids=(); }
trap cleanup EXIT

start_bg() {  # start_bg LOG READY COMMAND...: READY is a log pattern, or port:N (listening)
  local log=$1 ready=$2
  shift 2
  "$@" >"$log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do
    case "$ready" in
      port:*) ss -Hltn "sport = :${ready#port:}" | grep -q . && return 0 ;;
      *) grep -q "$ready" "$log" && return 0 ;;
    esac
    sleep 0.05
  done
  echo "benchmark peer did not start: $*" >&2
  cat "$log" >&2
  return 1
}

iperf_mib() {  # iperf_mib HOST PORT LEN: receiver throughput in MiB/s
  iperf3 -c "$1" -p "$2" -t "$seconds" -l "$3" -f m 2>/dev/null |
    awk '/receiver/ { for (i = 1; i <= NF; i++) if ($i == "Mbits/sec") print $(i - 1) * 1000000 / 8 / 1048576 }'
}

echo "# fabric benchmark ($(date -u +%Y-%m-%d), $(nproc) cores, $(uname -r))"

if [ "$run_tcp" = 1 ]; then
  tmp=$(mktemp -d)
  port=$((20000 + RANDOM % 20000))
  start_bg "$tmp/srv" listening "$perf" server --listen "tcp:127.0.0.1:$port"
  start_bg "$tmp/srvb" listening "$perf" server --listen "tcp:127.0.0.1:$((port + 1))" --busy-poll
  start_bg "$tmp/ipf" port:$((port + 2)) iperf3 -s -p $((port + 2))
  start_bg "$tmp/pp" listening "$pingpong" server $((port + 3))

  echo
  echo "## tcp provider on loopback (limits: iperf3, plain TCP ping-pong; same run)"
  echo
  echo "| measure | ibtrs tcp | limit | ratio | target |"
  echo "| --- | --- | --- | --- | --- |"
  # Bandwidth: three alternating runs of ours and iperf3 per size, medians compared (loopback
  # throughput on a shared 2-core machine swings by 2x between runs).
  median() { grep . | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
  for size in 4k 64k 256k 1m; do
    ours_runs=""
    limit_runs=""
    for _ in 1 2 3; do
      # One buffer of the write size on each side, as iperf3 reuses one buffer.
      ours_runs+="$("$perf" client --connect "tcp:127.0.0.1:$port" --test bw --sizes $size --seconds "$seconds" --depth 32 --buffer $size --json | json_field mib_s)"$'\n'
      limit_runs+="$(iperf_mib 127.0.0.1 $((port + 2)) $size)"$'\n'
    done
    ours=$(median <<<"$ours_runs")
    limit=$(median <<<"$limit_runs")
    target=""
    [ "$size" = 1m ] && target=">= 0.90"
    [ "$size" = 4k ] && limit4k=$limit
    printf '| WRITE %s bandwidth (median of 3) | %.0f MiB/s | iperf3 -l %s: %.0f MiB/s | %s | %s |\n' "$size" "$ours" "$size" "$limit" "$(ratio "$ours" "$limit")" "$target"
  done
  # The same 4 KiB writes posted 8 per post_send call (one sendmsg per batch), as an upper
  # layer with several requests queued would post them.
  runs=""
  for _ in 1 2 3; do
    runs+="$("$perf" client --connect "tcp:127.0.0.1:$port" --test bw --sizes 4k --seconds "$seconds" --depth 32 --batch 8 --buffer 4k --json | json_field mib_s)"$'\n'
  done
  printf '| WRITE 4k bandwidth, 8 per post (median of 3) | %.0f MiB/s | iperf3 -l 4k: %.0f MiB/s | %s |  |\n' "$(median <<<"$runs")" "$limit4k" "$(ratio "$(median <<<"$runs")" "$limit4k")"
  for mode in event busy; do
    flag=""; srvport=$port
    [ $mode = busy ] && { flag="--busy-poll"; srvport=$((port + 1)); }
    out=$("$perf" client --connect "tcp:127.0.0.1:$srvport" --test lat --iters 20000 --json $flag)
    lim=$("$pingpong" client 127.0.0.1 $((port + 3)) --iters 20000 --json $flag)
    for f in p50 avg; do
      o=$(json_field ${f}_us <<<"$out")
      l=$(json_field ${f}_us <<<"$lim")
      printf '| 8 B WRITE_WITH_IMM round trip, %s, %s | %.1f us | tcp ping-pong: %.1f us | %s | <= 1.30 |\n' "$mode" "$f" "$o" "$l" "$(ratio "$o" "$l")"
    done
  done
  cleanup

  echo
  echo "## event-loop styles for the tcp provider (server side under test, blocking client)"
  echo
  echo "| style | 8 B round trip p50 | avg | 1 MiB stream | stream vs blocking |"
  echo "| --- | --- | --- | --- | --- |"
  base=""
  for style in blocking epoll uring asio; do
    p=$((port + 10))
    port=$((port + 1))
    start_bg "$tmp/el-$style" listening "$eventloop" server $style $p
    rtt=$("$eventloop" client $p rtt --iters 20000)
    "$eventloop" client $p stream --seconds "$seconds"
    for _ in $(seq 50); do grep -q stream_mib_s "$tmp/el-$style" && break; sleep 0.1; done
    mib=$(json_field stream_mib_s <"$tmp/el-$style")
    [ -z "$base" ] && base=$mib
    printf '| %s | %.1f us | %.1f us | %.0f MiB/s | %s |\n' $style "$(json_field rtt_p50_us <<<"$rtt")" "$(json_field rtt_avg_us <<<"$rtt")" "$mib" "$(ratio "$mib" "$base")"
    cleanup
  done
  rm -rf "$tmp"
fi

if [ "$run_rdma" = 1 ]; then
  if [ -z "${IBTRS_VM:-}" ]; then
    # Real RDMA lives in the VM rig: run this script there for the rdma part.
    echo
    bash tests/vm/run-in-vm.sh --timeout 900 -- bash bench/fabric.sh --rdma-only --seconds "$seconds" --build "$build"
  else
    bash bench/rdma-inside-vm.sh "$perf" "$seconds"
  fi
fi
