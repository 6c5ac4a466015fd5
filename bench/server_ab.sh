#!/usr/bin/env bash
# A/B of two ibnbd-server builds under the same client: each serves its own 256 MiB tmpfs file on
# loopback tcp, and every round runs fio (the ibnbd engine of this build) once against each, in
# turn, so the load of a shared host falls on both alike. Prints IOPS per run, the medians, and
# the load average before and after. A benchmark, not a test.
#
#   bash bench/server_ab.sh [--rounds N] [--seconds N] [--rw randread|randwrite] [--qd N] A B
#     A, B: ibnbd-server binaries (e.g. an older build's and build/server/ibnbd-server)
# Engine: $IBTRS_BUILD/client/fio/libibnbd-fio.so (default build; ninja ibnbd_fio).
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
rounds=8 seconds=3 rw=randread qd=32
while [ $# -gt 2 ]; do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --rw) rw=$2; shift 2 ;;
    --qd) qd=$2; shift 2 ;;
    *) break ;;
  esac
done
[ $# -eq 2 ] || { echo "usage: $0 [--rounds N] [--seconds N] [--rw RW] [--qd N] SERVER_A SERVER_B" >&2; exit 2; }
bins=("$1" "$2")
so="$(cd "$top/${IBTRS_BUILD:-build}" && pwd)/client/fio/libibnbd-fio.so"
[ -f "$so" ] || { echo "no $so (ninja ibnbd_fio)" >&2; exit 2; }
tmp=$(mktemp -d /dev/shm/ibnbd-server-ab.XXXXXX)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT
addr=()
for v in 0 1; do
  mkdir -p "$tmp/$v"
  truncate -s 256M "$tmp/$v/vol.img"
  "${bins[v]}" --listen tcp:127.0.0.1:0 --dev-search-path "$tmp/$v" --control-socket "$tmp/$v.sock" \
    --ready-file "$tmp/$v.ready" >"$tmp/$v.log" 2>&1 &
  pids+=($!)
done
for v in 0 1; do
  for _ in $(seq 100); do [ -e "$tmp/$v.ready" ] && break; sleep 0.1; done
  addr[v]=$(sed -n 's/^listening //p' "$tmp/$v.ready")
  [ -n "${addr[v]}" ] || { cat "$tmp/$v.log" >&2; exit 1; }
done
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg); $rw 4k qd$qd, ${seconds} s runs"
declare -a res0 res1
for r in $(seq "$rounds"); do
  for v in 0 1; do
    fio --name=ab --ioengine="external:$so" "--ibnbd_paths=${addr[v]}" --ibnbd_device=vol.img \
      "--ibnbd_session=ab-$v-$r" --rw="$rw" --bs=4k --iodepth="$qd" --iodepth_batch_submit="$qd" \
      --iodepth_batch_complete_max="$qd" --size=256M --time_based --runtime="$seconds" \
      --output-format=json --output="$tmp/$v.$r.json" >/dev/null 2>&1
    iops=$(jq -r '.jobs[0].read.iops + .jobs[0].write.iops | floor' "$tmp/$v.$r.json")
    echo "round $r ${bins[v]}: $iops IOPS"
    if [ "$v" = 0 ]; then res0+=("$iops"); else res1+=("$iops"); fi
  done
done
median() { printf '%s\n' "$@" | sort -n | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : int((a[NR / 2] + a[NR / 2 + 1]) / 2) }'; }
echo "median A ${bins[0]}: $(median "${res0[@]}") IOPS"
echo "median B ${bins[1]}: $(median "${res1[@]}") IOPS"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
