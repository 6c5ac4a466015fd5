#!/usr/bin/env bash
# Isolation A/B (issue 13 part A): 4 KiB QD 32 random reads and writes with two ibtrs-load
# builds, A (--before: a build without per-session protection domains and read windows) and B
# (--after, default this tree's), alternated A B A B ... on the same host so that load drifts
# hit both alike. tcp: a server process per build on 127.0.0.1 and its own client; loopback:
# `ibtrs-load local` (server and client in one process, as the loopback fabric needs). Also the
# always_invalidate server on tcp (A: a registration per IO, B: a key flip). The host load
# (/proc/loadavg, 1-minute) is printed before and after every run.
# A benchmark, not a test: it asserts nothing.
#
#   bash bench/isolation.sh --before PATH [--after PATH] [--rounds N] [--seconds S]
#
# Build A from the commit before the change, e.g.:
#   git worktree add /tmp/base 339793c && cmake -S /tmp/base -B /tmp/base/build -G Ninja &&
#   ninja -C /tmp/base/build ibtrs-load
# The `local` mode must exist in both (tools/ibtrs_load.cc; add it to A by hand if older).
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
source "$top/bench/ab-lib.sh"
ab_args 5 4 "$@"

tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

load1() { cut -d' ' -f1 /proc/loadavg; }
wait_ready() { for _ in $(seq 200); do [ -s "$1" ] && return 0; sleep 0.05; done; return 1; }

# start_server BIN NAME [ARGS]: a tcp server of build BIN; its address goes to $addr.
start_server() {
  local bin=$1 name=$2
  shift 2
  "$bin" server --listen tcp:127.0.0.1:0 --queue-depth 128 --size 1G --io-threads 1 \
    --ready-file "$tmp/$name.ready" "$@" >"$tmp/$name.log" 2>&1 &
  pids+=($!)
  wait_ready "$tmp/$name.ready" || { echo "server $name did not start" >&2; cat "$tmp/$name.log" >&2; exit 1; }
  addr=$(sed -n 's/^listening //p' "$tmp/$name.ready" | head -1)
}
start_server "$before" tcp-a; tcp_a=$addr
start_server "$after" tcp-b; tcp_b=$addr
start_server "$before" inv-a --always-invalidate; inv_a=$addr
start_server "$after" inv-b --always-invalidate; inv_b=$addr

n=0
# one RUN FABRIC RW: prints "iops load_before load_after"
one() {
  local side=$1 fabric=$2 rw=$3 bin=$before addr=""
  [ "$side" = B ] && bin=$after
  n=$((n + 1))
  local client=(--session "iso-$$-$n" --rw "$rw" --bs 4k --qd 32 --seconds "$seconds" --io-threads 1 --json)
  local l0 l1 out
  l0=$(load1)
  case "$fabric" in
    loopback) out=$("$bin" local --listen "loopback:iso$n:0" --queue-depth 128 --size 1G --io-threads 1 -- "${client[@]}" 2>/dev/null | grep '^{' || true) ;;
    tcp) [ "$side" = A ] && addr=$tcp_a || addr=$tcp_b
      out=$("$bin" client --path "$addr" "${client[@]}" 2>/dev/null | grep '^{' || true) ;;
    tcp-inv) [ "$side" = A ] && addr=$inv_a || addr=$inv_b
      out=$("$bin" client --path "$addr" "${client[@]}" 2>/dev/null | grep '^{' || true) ;;
  esac
  l1=$(load1)
  echo "$(json_field iops <<<"$out") $l0 $l1"
}


echo "# isolation A/B ($(date -u +%Y-%m-%d), $(nproc) cores, $(uname -r))"
echo
echo "A: $before"
echo "B: $after"
echo "4 KiB QD 32, ${seconds} s per run, $rounds rounds of A then B; 1 IO thread per side;"
echo "server --queue-depth 128. IOPS per run with the 1-minute load average before -> after it."
echo
echo "| fabric | rw | A IOPS per run (load) | B IOPS per run (load) | A median | B median | B/A |"
echo "| --- | --- | --- | --- | --- | --- | --- |"
for fabric in tcp loopback tcp-inv; do
  for rw in randread randwrite; do
    a_runs="" b_runs="" a_vals="" b_vals=""
    for _ in $(seq "$rounds"); do
      read -r ia la0 la1 < <(one A "$fabric" "$rw")
      read -r ib lb0 lb1 < <(one B "$fabric" "$rw")
      a_runs+="${ia:-fail} ($la0->$la1) "
      b_runs+="${ib:-fail} ($lb0->$lb1) "
      a_vals+="${ia:-0}"$'\n'
      b_vals+="${ib:-0}"$'\n'
    done
    am=$(printf '%s' "$a_vals" | median)
    bm=$(printf '%s' "$b_vals" | median)
    ratio=$(awk -v a="$am" -v b="$bm" 'BEGIN { if (a > 0) printf "%.3f", b / a; else print "n/a" }')
    echo "| $fabric | $rw | $a_runs| $b_runs| $am | $bm | $ratio |"
  done
done
