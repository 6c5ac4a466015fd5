#!/usr/bin/env bash
# Two paths against one on rate-limited links: the fio engine (client/fio) in a "client"
# network namespace reaches ibnbd-server in a "server" namespace over two veth pairs, each
# shaped to the same rate in both directions (tc tbf). Rows: one path, two paths (min-inflight,
# the library default), and nbdkit over the first link (the simplest peer, fio's nbd engine).
# Because the links, not the CPUs, are the limit, the ratios hold on a loaded host too (the
# load is printed). The issue 14 target: two paths >= 1.8x one.
#
#   bash bench/multipath-netns.sh [--seconds N] [--rate RATE]     (root; default 5 s, 400mbit)
#
# Workloads: 4 KiB randread / randwrite at QD32, 1 MiB read / write at QD8, one job each. The
# volume is a 1 GiB file on tmpfs. Addresses: 198.18.20.0/24 and 198.18.21.0/24 (the
# benchmarking range), inside the namespaces only. Build directory: $IBTRS_BUILD (default build).
# A benchmark, not a test: it asserts nothing.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
seconds=5
rate=400mbit
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    *) echo "usage: $0 [--seconds N] [--rate RATE]" >&2; exit 2 ;;
  esac
done
case "$seconds" in '' | *[!0-9]* | 0) echo "--seconds takes a whole number above 0" >&2; exit 2 ;; esac
[ "$(id -u)" = 0 ] || { echo "needs root (network namespaces)" >&2; exit 1; }
for t in fio nbdkit jq ip tc; do
  command -v "$t" >/dev/null || { echo "$t is missing (scripts/setup.sh installs it)" >&2; exit 1; }
done

build=${IBTRS_BUILD:-build}
if [ ! -f "$build/build.ninja" ]; then
  cmake -S . -B "$build" -G Ninja -DIBNBD_FIO_ENGINE=ON >/dev/null
fi
ninja -C "$build" -j "$(nproc)" ibnbd-server ibnbd_fio >/dev/null
build=$(cd "$build" && pwd)
srv="$build/server/ibnbd-server"
engine="$build/client/fio/libibnbd-fio.so"

nsc=ibnbd-bc-$$
nss=ibnbd-bs-$$
a_c=198.18.20.1 a_s=198.18.20.2
b_c=198.18.21.1 b_s=198.18.21.2
port=4711
nbd_port=10809
tmp=$(mktemp -d /dev/shm/ibnbd-mp-bench.XXXXXX)
pids=()
cleanup() {
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill "${pids[i]}" 2>/dev/null || true
    wait "${pids[i]}" 2>/dev/null || true
  done
  ip netns del "$nsc" 2>/dev/null || true
  ip netns del "$nss" 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ip netns add "$nsc"
ip netns add "$nss"
ip -n "$nsc" link set lo up
ip -n "$nss" link set lo up
for l in "vma:vna:$a_c:$a_s" "vmb:vnb:$b_c:$b_s"; do
  IFS=: read -r c s cip sip <<<"$l"
  ip -n "$nsc" link add name "$c" type veth peer name "$s" netns "$nss"
  ip -n "$nsc" addr add "$cip/24" dev "$c"
  ip -n "$nss" addr add "$sip/24" dev "$s"
  ip -n "$nsc" link set "$c" up
  ip -n "$nss" link set "$s" up
  # Both directions: writes leave the client side, read data leaves the server side.
  ip netns exec "$nsc" tc qdisc add dev "$c" root tbf rate "$rate" burst 256kb latency 20ms
  ip netns exec "$nss" tc qdisc add dev "$s" root tbf rate "$rate" burst 256kb latency 20ms
done

wait_file() {  # wait_file FILE PID: until FILE exists, while PID lives (10 s at most)
  for _ in $(seq 200); do
    [ -e "$1" ] && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.05
  done
  return 1
}

mkdir -p "$tmp/export"
img="$tmp/export/vol.img"
dd if=/dev/urandom of="$img" bs=1M count=1024 status=none
# --allow-any-host (the server warns): only this script's namespaces reach it.
ip netns exec "$nss" "$srv" --allow-any-host --listen "tcp:$a_s:$port" --listen "tcp:$b_s:$port" \
  --dev-search-path "$tmp/export" --control-socket "$tmp/srv.sock" --ready-file "$tmp/srv.ready" \
  >"$tmp/srv.log" 2>&1 &
pids+=($!)
wait_file "$tmp/srv.ready" "${pids[-1]}" || { cat "$tmp/srv.log" >&2; exit 1; }
ip netns exec "$nss" nbdkit --foreground --exit-with-parent --ipaddr "$a_s" --port "$nbd_port" \
  file "$img" >"$tmp/nbdkit.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
  ip netns exec "$nsc" bash -c "exec 3<>/dev/tcp/$a_s/$nbd_port" 2>/dev/null && break
  sleep 0.05
done

p1="tcp:$a_c@tcp:$a_s:$port"
p2="tcp:$b_c@tcp:$b_s:$port"
run_no=0
declare -A mibs_of
rows=()
run() {  # run WORKLOAD TARGET RW BS QD
  local workload=$1 target=$2 rw=$3 bs=$4 qd=$5 args
  run_no=$((run_no + 1))
  case $target in
    nbdkit) args="--ioengine=nbd --uri=nbd://$a_s:$nbd_port/" ;;
    ibnbd-1p) args="--ioengine=external:$engine --ibnbd_paths=$p1 --ibnbd_device=vol.img --ibnbd_session=mp-$$-$run_no" ;;
    ibnbd-2p) args="--ioengine=external:$engine --ibnbd_paths=$p1,$p2 --ibnbd_device=vol.img --ibnbd_session=mp-$$-$run_no" ;;
  esac
  local out="$tmp/run-$run_no.json" rc=0 c0 s0 c1 s1
  read -r c0 s0 < <(wire_bytes)
  # shellcheck disable=SC2086
  (cd "$tmp" && timeout -k 5 $((seconds + 60)) ip netns exec "$nsc" fio --name="r$run_no" $args \
    --rw="$rw" --bs="$bs" --iodepth="$qd" --iodepth_batch_submit="$qd" \
    --iodepth_batch_complete_max="$qd" --size=1G --time_based --runtime="$seconds" \
    --output-format=json --output="$out" >"$tmp/run-$run_no.log" 2>&1) || rc=$?
  read -r c1 s1 < <(wire_bytes)
  if [ "$rc" != 0 ] || ! jq -e '.jobs[0]' "$out" >/dev/null 2>&1; then
    rows+=("$workload|$target|failed (exit $rc)||||")
    tail -3 "$tmp/run-$run_no.log" >&2
    return 0
  fi
  local side=read
  case "$rw" in *write*) side=write ;; esac
  local iops mibs n
  read -r iops mibs n < <(jq -r --arg s "$side" '.jobs[0][$s] | "\(.iops) \(.bw_bytes / 1048576) \(.total_ios)"' "$out")
  mibs_of[$workload/$target]=$mibs
  # Bytes on the wire per IO, each way (headers, acknowledgements and heartbeats included): what
  # the shaped links carry for one IO's payload.
  local wire
  wire=$(awk -v c=$((c1 - c0)) -v s=$((s1 - s0)) -v n="$n" 'BEGIN { if (n > 0) printf "%.0f|%.0f", c / n, s / n; else print "|" }')
  rows+=("$workload|$target|$(printf '%.0f|%.1f' "$iops" "$mibs")|$wire")
}
wire_bytes() {  # wire_bytes: bytes sent so far by the client's and the server's links
  local c=0 sv=0 d
  for d in vma vmb; do c=$((c + $(ip netns exec "$nsc" cat "/sys/class/net/$d/statistics/tx_bytes"))); done
  for d in vna vnb; do sv=$((sv + $(ip netns exec "$nss" cat "/sys/class/net/$d/statistics/tx_bytes"))); done
  echo "$c $sv"
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a != "" && b != "" && b > 0) printf "%.2f", a / b; else print "" }'; }

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for w in "4k randread qd32:randread:4k:32" "4k randwrite qd32:randwrite:4k:32" \
  "1m read qd8:read:1m:8" "1m write qd8:write:1m:8"; do
  IFS=: read -r workload rw bs qd <<<"$w"
  for target in nbdkit ibnbd-1p ibnbd-2p; do run "$workload" "$target" "$rw" "$bs" "$qd"; done
done

limit=$(awk -v r="$rate" 'BEGIN { n = r + 0; u = tolower(r); sub(/^[0-9.]+/, "", u);
  m = (u == "gbit") ? 1e9 : (u == "mbit") ? 1e6 : (u == "kbit") ? 1e3 : 1; printf "%.1f", n * m / 8 / 1048576 }')
echo "# two paths against one on shaped links ($(date -u +%Y-%m-%d), $(nproc) cores, $(uname -r), load average before: $load_before)"
echo
echo "fio $(fio --version | sed 's/^fio-//'), one job, ${seconds} s per run; two veth pairs between two network"
echo "namespaces, each shaped to $rate both ways (tc tbf): $limit MiB/s per link and direction."
echo
echo "| workload | target | IOPS | MiB/s | wire B/IO client->server | server->client | vs ibnbd-1p | vs nbdkit |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
for r in "${rows[@]}"; do
  IFS='|' read -r workload target iops mibs cw sw <<<"$r"
  echo "| $workload | $target | $iops | $mibs | $cw | $sw | $(ratio "$mibs" "${mibs_of[$workload/ibnbd-1p]:-}") | $(ratio "$mibs" "${mibs_of[$workload/nbdkit]:-}") |"
done
echo
for w in "4k randread qd32" "4k randwrite qd32" "1m read qd8" "1m write qd8"; do
  echo "ibnbd-2p / ibnbd-1p, $w: $(ratio "${mibs_of[$w/ibnbd-2p]:-}" "${mibs_of[$w/ibnbd-1p]:-}") (target >= 1.8)"
done
echo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
