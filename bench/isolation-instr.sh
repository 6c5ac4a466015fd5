#!/usr/bin/env bash
# Isolation A/B in instructions per IO: the same 4 KiB QD 32 workloads as bench/isolation.sh,
# each process run under callgrind, which counts the instructions it executes. Unlike IOPS on a
# shared host this hardly depends on the load: it shows what a change adds to the IO path
# (system calls count as one instruction each, so it is user space that is compared).
# loopback: `ibtrs-load local` (client and server in one process); tcp: client and server
# processes, counted separately. A benchmark, not a test: it asserts nothing.
#
#   bash bench/isolation-instr.sh --before PATH [--after PATH] [--count N]
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
source "$top/bench/ab-lib.sh"
count=20000
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --count) count=$2; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
ab_args 1 1 "${args[@]}"
command -v valgrind >/dev/null || { echo "needs valgrind (callgrind)" >&2; exit 2; }

tmp=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT

cg() { valgrind --tool=callgrind --callgrind-out-file=/dev/null "$@" 2>&1; }
collected() { sed -n 's/.*Collected : \([0-9]*\).*/\1/p' | tail -1; }
per_io() { awk -v a="$1" -v n="$count" 'BEGIN { if (a > 0) printf "%.0f", a / n; else print "n/a" }'; }

# tcp_run BIN RW [SERVER ARGS]: "client_per_io server_per_io" (the server counts its setup and
# teardown too, for a fresh server per run).
tcp_run() {
  local bin=$1 rw=$2 addr spid out
  shift 2
  rm -f "$tmp/ready"
  valgrind --tool=callgrind --callgrind-out-file=/dev/null "$bin" server --listen tcp:127.0.0.1:0 \
    --queue-depth 128 --io-threads 1 --ready-file "$tmp/ready" "$@" >"$tmp/server.log" 2>&1 &
  spid=$!
  pids+=("$spid")
  for _ in $(seq 600); do [ -s "$tmp/ready" ] && break; sleep 0.1; done
  addr=$(sed -n 's/^listening //p' "$tmp/ready" | head -1)
  out=$(cg "$bin" client --path "$addr" --session "instr-$rw" --rw "$rw" --bs 4k --qd 32 \
    --count "$count" --io-threads 1 | collected)
  kill "$spid"
  wait "$spid" 2>/dev/null || true
  echo "$(per_io "$out") $(per_io "$(collected <"$tmp/server.log")")"
}

echo "# isolation A/B in instructions per IO ($(date -u +%Y-%m-%d), callgrind, $count IOs)"
echo
echo "A: $before"
echo "B: $after"
echo
echo "| fabric | rw | A instr/IO | B instr/IO | B − A | B/A |"
echo "| --- | --- | --- | --- | --- | --- |"
for rw in randread randwrite; do
  for side in A B; do
    bin=$before
    [ "$side" = B ] && bin=$after
    v=$(cg "$bin" local --listen "loopback:instr$side:0" --queue-depth 128 --io-threads 1 -- \
      --session s --rw "$rw" --bs 4k --qd 32 --count "$count" --io-threads 1 | collected)
    declare "lb_$side=$(per_io "$v")"
    read -r c s < <(tcp_run "$bin" "$rw")
    declare "tc_$side=$c" "ts_$side=$s"
    read -r c s < <(tcp_run "$bin" "$rw" --always-invalidate)
    declare "ic_$side=$c" "is_$side=$s"
  done
  row() { awk -v f="$1" -v r="$rw" -v a="$2" -v b="$3" 'BEGIN {
    printf "| %s | %s | %d | %d | %+d | %.3f |\n", f, r, a, b, b - a, b / a }'; }
  row "loopback (client + server)" "$lb_A" "$lb_B"
  row "tcp client" "$tc_A" "$tc_B"
  row "tcp server" "$ts_A" "$ts_B"
  row "tcp client, always_invalidate" "$ic_A" "$ic_B"
  row "tcp server, always_invalidate" "$is_A" "$is_B"
done
