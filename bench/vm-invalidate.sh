#!/usr/bin/env bash
# The cost of per-IO invalidation (ServerOptions::always_invalidate, the kernel's
# always_invalidate) on real RDMA: ibtrs-load over Soft-RoCE in the VM rig, one server without and
# one with --always-invalidate, the same client workloads alternated A/B/A/B in one VM boot.
# A benchmark, not a test: it asserts nothing.
#
#   bash bench/vm-invalidate.sh [--seconds N] [--rounds N]     (boots the VM, runs inside it)
#
# The build directory comes from $IBTRS_BUILD (default build). Addresses: the VM's private
# 198.18.0.1 -> 198.18.0.2 veth pair only.
set -uo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
seconds=4
rounds=2
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    *) echo "usage: $0 [--seconds N] [--rounds N]" >&2; exit 2 ;;
  esac
done
case "$seconds$rounds" in '' | *[!0-9]*) echo "--seconds and --rounds take whole numbers" >&2; exit 2 ;; esac
build=$(cd "${IBTRS_BUILD:-$top/build}" && pwd)
load=$build/transport/ibtrs-load

if [ "${IBTRS_VM:-}" != 1 ]; then
  [ -x "$load" ] || { echo "build ibtrs-load first (ninja -C $build ibtrs-load)" >&2; exit 2; }
  exec env IBTRS_BUILD="$build" bash "$top/tests/vm/run-in-vm.sh" --timeout 900 -- \
    bash "$top/bench/vm-invalidate.sh" --seconds "$seconds" --rounds "$rounds"
fi

A=$IBTRS_RDMA_ADDR_A
B=$IBTRS_RDMA_ADDR_B
tmp=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT

json_field() { sed -n "s/.*\"$1\":\([0-9.]*\).*/\1/p" | tail -1; }
wait_ready() { for _ in $(seq 300); do [ -s "$1" ] && return 0; sleep 0.1; done; return 1; }

# Same geometry for both: 128 chunks of 256 KiB (room for 128 KiB requests).
"$load" server --listen "rdma:$B:12371" --queue-depth 128 --chunk-size 256K --size 256M --ready-file "$tmp/plain" \
  >"$tmp/plain.log" 2>&1 &
pids+=($!)
"$load" server --listen "rdma:$B:12372" --queue-depth 128 --chunk-size 256K --size 256M --always-invalidate \
  --ready-file "$tmp/inv" >"$tmp/inv.log" 2>&1 &
pids+=($!)
wait_ready "$tmp/plain" && wait_ready "$tmp/inv" ||
  { echo "servers did not start"; cat "$tmp/plain.log" "$tmp/inv.log"; exit 1; }

declare -A sum
run=0
one() {  # one KIND PORT RW BS QD: adds IOPS and p50 to sum[KIND,RW BS QD,*]
  local kind=$1 port=$2 rw=$3 bs=$4 qd=$5 out
  run=$((run + 1))
  out=$(timeout $((seconds + 60)) "$load" client --session "inv-$run" --path "rdma:$A@rdma:$B:$port" \
    --rw "$rw" --bs "$bs" --qd "$qd" --seconds "$seconds" --size 256M --io-threads 1 --json 2>"$tmp/err" | tail -1)
  case "$out" in
    '{'*) ;;
    *) echo "client failed ($kind $rw $bs qd$qd): $(tail -2 "$tmp/err")" >&2; return ;;
  esac
  sum[$kind,$rw $bs qd$qd,iops]=$(awk -v a="${sum[$kind,$rw $bs qd$qd,iops]:-0}" -v b="$(json_field iops <<<"$out")" 'BEGIN { print a + b }')
  sum[$kind,$rw $bs qd$qd,p50]=$(awk -v a="${sum[$kind,$rw $bs qd$qd,p50]:-0}" -v b="$(json_field lat_p50_us <<<"$out")" 'BEGIN { print a + b }')
}

workloads=("randread 4k 32" "randwrite 4k 32" "randread 4k 1" "read 128k 8")
for ((r = 0; r < rounds; r++)); do
  for w in "${workloads[@]}"; do
    read -r rw bs qd <<<"$w"
    one plain 12371 "$rw" "$bs" "$qd"
    one inv 12372 "$rw" "$bs" "$qd"
  done
done

echo "## always_invalidate on Soft-RoCE in the VM ($(uname -r), TCG; ${rounds} x ${seconds} s per cell, alternated)"
echo
echo "| workload | IOPS plain | IOPS always_invalidate | ratio | p50 us plain | p50 us always_invalidate |"
echo "| --- | --- | --- | --- | --- | --- |"
for w in "${workloads[@]}"; do
  read -r rw bs qd <<<"$w"
  k="$rw $bs qd$qd"
  awk -v w="$k" -v n="$rounds" -v a="${sum[plain,$k,iops]:-0}" -v b="${sum[inv,$k,iops]:-0}" \
    -v c="${sum[plain,$k,p50]:-0}" -v d="${sum[inv,$k,p50]:-0}" 'BEGIN {
      printf "| %s | %.0f | %.0f | %s | %.0f | %.0f |\n", w, a / n, b / n,
        (a > 0 ? sprintf("%.2f", b / a) : "n/a"), c / n, d / n }'
done
