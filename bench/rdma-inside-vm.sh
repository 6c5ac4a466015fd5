#!/usr/bin/env bash
# The rdma half of bench/fabric.sh, run inside the VM rig (tests/vm): ibtrs-fabric-perf over the
# rdma provider vs perftest (ib_write_bw / ib_write_lat) on the same rxe0 -> rxe1 Soft-RoCE pair,
# measured back to back in one VM boot.
#
#   bench/rdma-inside-vm.sh PERF-BINARY SECONDS
set -uo pipefail
[ "${IBTRS_VM:-}" = 1 ] || { echo "run inside the VM: bash bench/fabric.sh --rdma-only" >&2; exit 2; }
perf=$1
seconds=$2
A=$IBTRS_RDMA_ADDR_A
B=$IBTRS_RDMA_ADDR_B
GA=$IBTRS_RDMA_GID_INDEX_A
GB=$IBTRS_RDMA_GID_INDEX_B
tmp=$(mktemp -d)

json_field() { sed -n "s/.*\"$1\":\([0-9.]*\).*/\1/p" | tail -1; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }
wait_tcp_port() { for _ in $(seq 200); do ss -Hltn "sport = :$1" | grep -q . && return 0; sleep 0.1; done; return 1; }
wait_cm_port() { for _ in $(seq 200); do rdma resource show cm_id 2>/dev/null | grep -q "state LISTEN.*:$1" && return 0; sleep 0.1; done; return 1; }

# perftest pair: server on rxe1, client on rxe0; prints the client's result line.
perftest() {  # TOOL ARGS...
  local tool=$1
  shift
  timeout 120 "$tool" -d "$IBTRS_RDMA_DEV_B" -x "$GB" -F "$@" >"$tmp/pt-srv" 2>&1 &
  local spid=$!
  wait_tcp_port 18515
  timeout 120 "$tool" -d "$IBTRS_RDMA_DEV_A" -x "$GA" -F "$@" "$B" >"$tmp/pt-cli" 2>&1
  wait "$spid" 2>/dev/null
  grep -A1 '#bytes' "$tmp/pt-cli" | tail -1
}

port=19515
# Bandwidth against an event-driven server (plain WRITEs need no server CPU); round trips against
# a busy-polling one, as ib_write_lat polls on both ends.
"$perf" server --listen "rdma:$B:$port" >"$tmp/srv" 2>&1 &
srv=$!
"$perf" server --listen "rdma:$B:$((port + 1))" --busy-poll >"$tmp/srvb" 2>&1 &
srvb=$!
wait_cm_port $port && wait_cm_port $((port + 1)) ||
  { echo "ibtrs-fabric-perf server did not start"; cat "$tmp/srv" "$tmp/srvb"; exit 1; }

echo "## rdma provider on Soft-RoCE in the VM (limit: perftest on the same rxe pair; same boot)"
echo
echo "| measure | ibtrs rdma | limit | ratio | target |"
echo "| --- | --- | --- | --- | --- |"
for size in 4096 65536 1048576; do
  # perftest MB/sec is 2^20 bytes per second.
  limit=$(perftest ib_write_bw -s $size -D "$seconds" | awk '{print $4}')
  ours=$("$perf" client --connect "rdma:$B:$port" --source "rdma:$A" --test bw --sizes $size --seconds "$seconds" --depth 32 --buffer $size --busy-poll --json | json_field mib_s)
  printf '| WRITE %s B bandwidth | %.1f MiB/s | ib_write_bw: %.1f MiB/s | %s | >= 0.80 |\n' $size "$ours" "$limit" "$(ratio "$ours" "$limit")"
done
# ib_write_lat reports half the round trip (t_typical column 5); ours reports the round trip.
line=$(perftest ib_write_lat -s 8 -n 5000)
lat_half=$(awk '{print $5}' <<<"$line")
out=$("$perf" client --connect "rdma:$B:$((port + 1))" --source "rdma:$A" --test lat --iters 5000 --busy-poll --json)
ours_p50=$(json_field p50_us <<<"$out")
rtt_limit=$(awk -v h="$lat_half" 'BEGIN { printf "%.1f", 2 * h }')
printf '| 8 B WRITE_WITH_IMM round trip p50 | %.1f us | ib_write_lat 2 x t_typical: %.1f us | %s | <= 1.25 (>= 0.80 of its rate) |\n' \
  "$ours_p50" "$rtt_limit" "$(ratio "$ours_p50" "$rtt_limit")"
echo
echo "(verify run over rdma: $("$perf" client --connect "rdma:$B:$port" --source "rdma:$A" --test verify --size 64k --iters 500 --depth 8))"
kill $srv $srvb 2>/dev/null
wait $srv $srvb 2>/dev/null
rm -rf "$tmp"
