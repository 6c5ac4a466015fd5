#!/usr/bin/env bash
# What client sessions cost the server in memory: ibnbd-server exports a 64 MiB file on tmpfs
# over loopback tcp, one fio process opens N sessions through the ibnbd engine (--thread
# --numjobs=N: every job its own session, one path, the device mapped ro), and the server's
# VmRSS and VmSize (/proc/PID/status) are read before, with the N sessions open, and after
# they closed. Sessions are idle: each job reads one 4 KiB block a second (--rate_iops=1), so
# it touches one chunk. --job "FIO OPTIONS" replaces that workload (e.g. "--rw=read --bs=1m
# --iodepth=8 --rate_iops=8": what sessions that move 1 MiB requests keep resident).
# Prints one markdown table and the load average before and after. A benchmark, not a test.
#
#   bash bench/session_memory.sh [--sessions N] [--job "FIO OPTIONS"] [--server PATH]
#                                [--server-opts "..."]
#
# --sessions: default 200. The server runs with --max-sessions and --max-chunk-memory large
# enough for N (its defaults are 256 sessions and 8 GiB of chunks; add your own with
# --server-opts). Binaries: $IBTRS_BUILD (default build): ibnbd-server, ibnbd, the fio engine.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
sessions=200
job="--rw=read --bs=4k --iodepth=1 --rate_iops=1"
server=""
server_opts=""
while [ $# -gt 0 ]; do
  case "$1" in
    --sessions) sessions=$2; shift 2 ;;
    --job) job=$2; shift 2 ;;
    --server) server=$2; shift 2 ;;
    --server-opts) server_opts=$2; shift 2 ;;
    *) echo "usage: $0 [--sessions N] [--job OPTS] [--server PATH] [--server-opts OPTS]" >&2; exit 2 ;;
  esac
done
case "$sessions" in '' | *[!0-9]* | 0) echo "--sessions takes a whole number above 0" >&2; exit 2 ;; esac
for t in fio jq; do
  command -v "$t" >/dev/null || { echo "$t is missing (scripts/setup.sh installs it)" >&2; exit 1; }
done
build=$(cd "$top/${IBTRS_BUILD:-build}" && pwd)
[ -n "$server" ] || server="$build/server/ibnbd-server"
cli="$build/client/cli/ibnbd"
engine="$build/client/fio/libibnbd-fio.so"
for f in "$server" "$cli" "$engine"; do
  [ -x "$f" ] || [ -f "$f" ] || { echo "no $f (ninja ibnbd-server ibnbd ibnbd_fio)" >&2; exit 2; }
done

tmp=$(mktemp -d /dev/shm/ibnbd-sessmem.XXXXXX)
pids=()
cleanup() {
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill "${pids[i]}" 2>/dev/null || true
    wait "${pids[i]}" 2>/dev/null || true
  done
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
cd "$tmp"
mkdir export
dd if=/dev/urandom of=export/vol.img bs=1M count=64 status=none

# shellcheck disable=SC2086
"$server" --allow-any-host --listen tcp:127.0.0.1:0 --dev-search-path "$tmp/export" \
  --control-socket "$tmp/srv.sock" --ready-file "$tmp/srv.ready" \
  --max-sessions $((sessions + 16)) --max-chunk-memory $(((sessions + 16) * 256))M $server_opts \
  >"$tmp/srv.log" 2>&1 &
srv_pid=$!
pids+=("$srv_pid")
for _ in $(seq 200); do [ -e "$tmp/srv.ready" ] && break; sleep 0.05; done
addr=$(sed -n 's/^listening //p' "$tmp/srv.ready" 2>/dev/null | head -1)
[ -n "$addr" ] || { echo "ibnbd-server did not start:" >&2; cat "$tmp/srv.log" >&2; exit 1; }

kib() { awk -v k="$2" '$1 == k":" { print $2 }' "/proc/$1/status"; }
mib() { awk -v k="$1" 'BEGIN { printf "%.1f", k / 1024 }'; }
nsessions() {  # sessions with a connected path (the server's usage against its limits)
  timeout 10 "$cli" --socket "$tmp/srv.sock" server limits list -f json 2>/dev/null |
    jq '([.[] | select(.resource == "sessions")][0].used) - ([.[] | select(.resource == "handshaking_sessions")][0].used)' \
      2>/dev/null || echo 0
}

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
sleep 1
rss0=$(kib "$srv_pid" VmRSS)
vsz0=$(kib "$srv_pid" VmSize)
thr0=$(kib "$srv_pid" Threads)

# The sessions: runtime long enough for all of them to come up and be measured; the script
# stops fio once it has read the figures. The jobs start at random times over sessions/10
# seconds: all at once, their connections overflow the server's pending-connection queue (128
# sockets; three per session here) while its control thread admits them one by one.
# shellcheck disable=SC2086
timeout -k 5 600 fio --thread --name=sm --ioengine="external:$engine" --ibnbd_paths="$addr" \
  --ibnbd_device=vol.img --ibnbd_mode=ro --ibnbd_session=sm --size=64M \
  --numjobs="$sessions" --startdelay=0-$((sessions / 10 + 1))s --time_based --runtime=300 $job \
  >"$tmp/fio.log" 2>&1 &
fio_pid=$!
pids+=("$fio_pid")

# Wait until every session is up (each also opened a short probe session that is gone again).
up=0
for _ in $(seq 600); do
  up=$(nsessions)
  [ "$up" -ge "$sessions" ] && break
  kill -0 "$fio_pid" 2>/dev/null || break
  sleep 0.5
done
[ "$up" -ge "$sessions" ] || { echo "only $up of $sessions sessions came up:" >&2; tail -5 "$tmp/fio.log" >&2; exit 1; }
sleep 3
rss1=$(kib "$srv_pid" VmRSS)
vsz1=$(kib "$srv_pid" VmSize)
thr1=$(kib "$srv_pid" Threads)
kill "$fio_pid" 2>/dev/null || true
wait "$fio_pid" 2>/dev/null || true
for _ in $(seq 100); do [ "$(nsessions)" -eq 0 ] && break; sleep 0.2; done
sleep 1
rss2=$(kib "$srv_pid" VmRSS)
vsz2=$(kib "$srv_pid" VmSize)

per() { awk -v a="$1" -v b="$2" -v n="$sessions" 'BEGIN { printf "%.2f", (b - a) / 1024 / n }'; }
echo "# ibnbd-server memory per session ($(date -u +%Y-%m-%d), $(nproc) cores, $(uname -r), load average before: $load_before)"
echo
echo "$sessions sessions (fio ibnbd engine, one loopback tcp path each): fio $job; server: $server $server_opts"
echo
echo "| | VmRSS MiB | VmSize MiB | threads |"
echo "| --- | --- | --- | --- |"
echo "| before | $(mib "$rss0") | $(mib "$vsz0") | $thr0 |"
echo "| $sessions sessions open | $(mib "$rss1") | $(mib "$vsz1") | $thr1 |"
echo "| after they closed | $(mib "$rss2") | $(mib "$vsz2") | $(kib "$srv_pid" Threads) |"
echo
echo "per session: VmRSS $(per "$rss0" "$rss1") MiB, VmSize $(per "$vsz0" "$vsz1") MiB (target: VmRSS <= 8 MiB)"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
