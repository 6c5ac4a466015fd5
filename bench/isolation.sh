#!/usr/bin/env bash
# Isolation A/B (issue 13 part A): 4 KiB QD 32 random reads and writes with two ibtrs-load
# builds, A (--before: a build without per-session protection domains and read windows) and B
# (--after, default this tree's), alternated A B A B ... on the same host so that load drifts
# hit both alike. tcp: a server process per build on 127.0.0.1 and its own client; loopback:
# `ibtrs-load local` (server and client in one process, as the loopback fabric needs). Also the
# always_invalidate server on tcp (A: a registration and an RKEY_RSP per IO, B: a key flip each
# way and no RKEY_RSP). Pairs run A B, B A, A B, ... The host load
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
  spid=$!
  wait_ready "$tmp/$name.ready" || { echo "server $name did not start" >&2; cat "$tmp/$name.log" >&2; exit 1; }
  addr=$(sed -n 's/^listening //p' "$tmp/$name.ready" | head -1)
}
start_server "$before" tcp-a; tcp_a=$addr; tcp_a_pid=$spid
start_server "$after" tcp-b; tcp_b=$addr; tcp_b_pid=$spid
start_server "$before" inv-a --always-invalidate; inv_a=$addr; inv_a_pid=$spid
start_server "$after" inv-b --always-invalidate; inv_b=$addr; inv_b_pid=$spid

# CPU seconds (user + system) a process has used so far, from /proc (clock ticks).
cpu_of() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%.3f", ($14 + $15) / hz }' "/proc/$1/stat"; }

n=0
# one SIDE FABRIC RW: prints "iops cpu_us_per_io load_before load_after". CPU per IO: the
# client's (and on tcp its server's) user + system time over the IOs done: unlike IOPS it
# barely moves when other work on the host takes the CPU away.
one() {
  local side=$1 fabric=$2 rw=$3 bin=$before addr="" spid=""
  [ "$side" = B ] && bin=$after
  n=$((n + 1))
  local client=(--session "iso-$$-$n" --rw "$rw" --bs 4k --qd 32 --seconds "$seconds" --io-threads 1 --json)
  local l0 l1 out cmd s0=0 s1=0
  case "$fabric" in
    loopback) cmd=("$bin" local --listen "loopback:iso$n:0" --queue-depth 128 --size 1G --io-threads 1 -- "${client[@]}") ;;
    tcp) [ "$side" = A ] && { addr=$tcp_a; spid=$tcp_a_pid; } || { addr=$tcp_b; spid=$tcp_b_pid; }
      cmd=("$bin" client --path "$addr" "${client[@]}") ;;
    tcp-inv) [ "$side" = A ] && { addr=$inv_a; spid=$inv_a_pid; } || { addr=$inv_b; spid=$inv_b_pid; }
      cmd=("$bin" client --path "$addr" "${client[@]}") ;;
  esac
  l0=$(load1)
  [ -n "$spid" ] && s0=$(cpu_of "$spid")
  out=$(/usr/bin/time -f 'cpu %U %S' -o "$tmp/time" "${cmd[@]}" 2>/dev/null | grep '^{' || true)
  [ -n "$spid" ] && s1=$(cpu_of "$spid")
  l1=$(load1)
  local ops cpu
  ops=$(json_field ops <<<"$out")
  cpu=$(awk -v s0="$s0" -v s1="$s1" -v ops="${ops:-0}" '/^cpu/ {
    if (ops > 0) printf "%.2f", ($2 + $3 + s1 - s0) * 1e6 / ops; else print "n/a" }' "$tmp/time")
  echo "$(json_field iops <<<"$out") $cpu $l0 $l1"
}


echo "# isolation A/B ($(date -u +%Y-%m-%d), $(nproc) cores, $(uname -r))"
echo
echo "A: $before"
echo "B: $after"
echo "4 KiB QD 32, ${seconds} s per run, $rounds rounds of an A and a B run (A B, B A, ...); 1 IO"
echo "thread per side;"
echo "server --queue-depth 128. Per run: IOPS, CPU us per IO (client + server), and the 1-minute"
echo "load average before -> after it. Medians over the runs; B/A of IOPS and of CPU per IO."
echo
echo "| fabric | rw | A runs: IOPS / CPU us per IO (load) | B runs | A median IOPS | B median IOPS | B/A IOPS | A median CPU us/IO | B median CPU us/IO | B/A CPU |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for fabric in tcp loopback tcp-inv; do
  for rw in randread randwrite; do
    a_runs="" b_runs="" a_vals="" b_vals="" a_cpu="" b_cpu=""
    for r in $(seq "$rounds"); do
      # A B, then B A: a load that drifts during a pair favours neither build.
      if [ $((r % 2)) = 1 ]; then
        read -r ia ca la0 la1 < <(one A "$fabric" "$rw")
        read -r ib cb lb0 lb1 < <(one B "$fabric" "$rw")
      else
        read -r ib cb lb0 lb1 < <(one B "$fabric" "$rw")
        read -r ia ca la0 la1 < <(one A "$fabric" "$rw")
      fi
      a_runs+="${ia:-fail} / $ca ($la0->$la1) "
      b_runs+="${ib:-fail} / $cb ($lb0->$lb1) "
      a_vals+="${ia:-0}"$'\n'
      b_vals+="${ib:-0}"$'\n'
      a_cpu+="$ca"$'\n'
      b_cpu+="$cb"$'\n'
    done
    am=$(printf '%s' "$a_vals" | median)
    bm=$(printf '%s' "$b_vals" | median)
    ac=$(printf '%s' "$a_cpu" | median)
    bc=$(printf '%s' "$b_cpu" | median)
    ratio=$(awk -v a="$am" -v b="$bm" 'BEGIN { if (a > 0) printf "%.3f", b / a; else print "n/a" }')
    cratio=$(awk -v a="$ac" -v b="$bc" 'BEGIN { if (a > 0) printf "%.3f", b / a; else print "n/a" }')
    echo "| $fabric | $rw | $a_runs| $b_runs| $am | $bm | $ratio | $ac | $bc | $cratio |"
  done
done
