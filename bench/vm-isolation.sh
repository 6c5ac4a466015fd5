#!/usr/bin/env bash
# Isolation A/B on real RDMA (Soft-RoCE in the VM rig, TCG): what per-session protection
# domains and per-read memory windows cost. Two ibtrs-load builds, A (--before: one PD per
# device, read buffers registered for remote write) and B (--after, default this tree's), each
# with its own server on 198.18.0.2, alternated A B A B in one VM boot:
#   - session setup: ClientSession::open as the client sees it (open_ms of --count 1 runs);
#     B allocates a PD on each side and queue_depth memory windows on the client;
#   - 4 KiB reads at QD 1 and QD 32 (B: a window bind and a LOCAL_INV per read) and writes.
# A benchmark, not a test: it asserts nothing.
#
#   bash bench/vm-isolation.sh --before PATH [--after PATH] [--rounds N] [--seconds S]
set -uo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
source "$top/bench/ab-lib.sh"
ab_args 3 4 "$@"
opens=8

if [ "${IBTRS_VM:-}" != 1 ]; then
  exec bash "$top/tests/vm/run-in-vm.sh" --timeout 1500 -- \
    bash "$top/bench/vm-isolation.sh" --before "$before" --after "$after" --rounds "$rounds" --seconds "$seconds"
fi

A=$IBTRS_RDMA_ADDR_A
B=$IBTRS_RDMA_ADDR_B
tmp=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT

wait_ready() { for _ in $(seq 300); do [ -s "$1" ] && return 0; sleep 0.1; done; return 1; }

"$before" server --listen "rdma:$B:12381" --size 256M --ready-file "$tmp/a" >"$tmp/a.log" 2>&1 &
pids+=($!)
"$after" server --listen "rdma:$B:12382" --size 256M --ready-file "$tmp/b" >"$tmp/b.log" 2>&1 &
pids+=($!)
wait_ready "$tmp/a" && wait_ready "$tmp/b" || { echo "servers did not start"; cat "$tmp/a.log" "$tmp/b.log"; exit 1; }

run=0
one() {  # one SIDE ARGS...: the client's JSON line
  local side=$1 bin=$before port=12381
  shift
  [ "$side" = B ] && { bin=$after; port=12382; }
  run=$((run + 1))
  timeout 120 "$bin" client --session "iso-$run" --path "rdma:$A@rdma:$B:$port" --size 256M --io-threads 1 \
    --json "$@" 2>"$tmp/err" | grep '^{' || echo "{}"
}

declare -A vals
for ((r = 0; r < rounds; r++)); do
  for ((i = 0; i < opens; i++)); do
    for side in A B; do vals[$side,open]+="$(one "$side" --count 1 | json_field open_ms)"$'\n'; done
  done
  for w in "randread 1" "randread 32" "randwrite 32"; do
    read -r rw qd <<<"$w"
    for side in A B; do
      out=$(one "$side" --rw "$rw" --bs 4k --qd "$qd" --seconds "$seconds")
      vals[$side,$rw$qd,iops]+="$(json_field iops <<<"$out")"$'\n'
      vals[$side,$rw$qd,p50]+="$(json_field lat_p50_us <<<"$out")"$'\n'
    done
  done
done

echo "## isolation A/B on Soft-RoCE in the VM ($(uname -r), TCG; $rounds rounds, alternated)"
echo
echo "| measure | A (before) median | B (after) median | B/A |"
echo "| --- | --- | --- | --- |"
row() {
  local name=$1 key=$2 a b
  a=$(printf '%s' "${vals[A,$key]}" | median)
  b=$(printf '%s' "${vals[B,$key]}" | median)
  echo "| $name | $a | $b | $(awk -v a="$a" -v b="$b" 'BEGIN { if (a > 0) printf "%.2f", b / a; else print "n/a" }') |"
}
row "session open ms ($((rounds * opens)) opens each)" open
for w in "randread 1" "randread 32" "randwrite 32"; do
  read -r rw qd <<<"$w"
  row "4k $rw qd$qd IOPS" "$rw$qd,iops"
  row "4k $rw qd$qd p50 us" "$rw$qd,p50"
done
echo
echo "A runs per cell: open ms: $(printf '%s' "${vals[A,open]}" | tr '\n' ' ')"
echo "B runs per cell: open ms: $(printf '%s' "${vals[B,open]}" | tr '\n' ' ')"
