#!/usr/bin/env bash
# A/B of fio engine builds, side by side: one ibnbd-server and one nbdkit (unix socket) serve
# the same 1 GiB tmpfs file, and every round runs each variant once per workload, in turn, so
# that the load of a shared host falls on all of them alike. A variant is NAME=ENGINE.so[:extra
# fio options, comma separated], e.g. before=/tmp/old.so after=build/.../libibnbd-fio.so
# caller=build/.../libibnbd-fio.so:--ibnbd_reap=caller. Prints one line per run (IOPS, mean and
# p99 latency, CPU us per IO of fio plus the server) and the load average before and after.
# Then the medians over the rounds per workload and variant, with IOPS and mean latency against
# nbdkit's medians. With --perf, fio runs under `perf stat` and each line ends with the fio
# process's context switches and system calls per IO (perf needs kernel.perf_event_paranoid
# <= 1 or root); the medians table leaves them out. With --load N, `stress-ng --cpu N` runs
# beside the whole benchmark (a contended host: an adaptive wait must not lose to blocking
# there). A benchmark, not a test.
#
#   bash bench/fio_ab.sh [--seconds N] [--rounds N] [--workloads "rw:bs:qd ..."] [--perf]
#                        [--load N] NAME=SO[:OPTS]...
#
# Server binary: $IBTRS_BUILD/server/ibnbd-server (default build).
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
seconds=3
rounds=2
workloads="randread:4k:1 randwrite:4k:1 randread:4k:32 randwrite:4k:32"
variants=()
perf=0
load=0
while [ $# -gt 0 ]; do
  case "$1" in
    --perf) perf=1; shift ;;
    --load) load=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --workloads) workloads=$2; shift 2 ;;
    *=*) variants+=("$1"); shift ;;
    *) echo "usage: $0 [--seconds N] [--rounds N] [--workloads LIST] NAME=SO[:OPTS]..." >&2; exit 2 ;;
  esac
done
[ "${#variants[@]}" -gt 0 ] || { echo "no variant given" >&2; exit 2; }
case "$load" in '' | *[!0-9]*) echo "--load takes a number of CPU workers" >&2; exit 2 ;; esac
if [ "$load" -gt 0 ]; then
  command -v stress-ng >/dev/null || { echo "stress-ng is missing (scripts/setup.sh installs it)" >&2; exit 1; }
fi
build=$(cd "$top/${IBTRS_BUILD:-build}" && pwd)
srv="$build/server/ibnbd-server"

tmp=$(mktemp -d /dev/shm/ibnbd-fio-ab.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
cd "$tmp"
mkdir export
dd if=/dev/urandom of=export/vol.img bs=1M count=1024 status=none
# --allow-any-host (the server warns): IO is what is measured here, and authentication costs
# only at connect (docs/security.d/auth-bench.md).
"$srv" --allow-any-host --listen tcp:127.0.0.1:0 --dev-search-path "$tmp/export" --control-socket "$tmp/srv.sock" \
  --ready-file "$tmp/srv.ready" >"$tmp/srv.log" 2>&1 &
srv_pid=$!
pids+=("$srv_pid")
nbdkit --foreground --exit-with-parent --unix "$tmp/nbdkit.sock" file "$tmp/export/vol.img" \
  >"$tmp/nbdkit.log" 2>&1 &
nbd_pid=$!
pids+=("$nbd_pid")
for _ in $(seq 200); do [ -e "$tmp/srv.ready" ] && [ -e "$tmp/nbdkit.sock" ] && break; sleep 0.05; done
addr=$(sed -n 's/^listening //p' "$tmp/srv.ready" | head -1)
[ -n "$addr" ] || { cat "$tmp/srv.log" >&2; exit 1; }
if [ "$load" -gt 0 ]; then
  # Bounded like every run here: the benchmark's own length and a minute more.
  nw=$(wc -w <<<"$workloads")
  stress-ng --cpu "$load" --timeout $((rounds * nw * (${#variants[@]} + 1) * (seconds + 5) + 60)) \
    >"$tmp/stress.log" 2>&1 &
  pids+=($!)
  sleep 1  # its workers up before the first run
fi

ticks() {
  local sum=0 p
  for p in "$@"; do sum=$((sum + $(sed 's/.*) //' "/proc/$p/stat" | awk '{print $12 + $13}'))); done
  echo "$sum"
}
hz=$(getconf CLK_TCK)
n=0
# one NAME RW BS QD ARGS...: one fio run, one line.
one() {
  local name=$1 rw=$2 bs=$3 qd=$4 spid=$5
  shift 5
  n=$((n + 1))
  local t0 t1 rc=0
  t0=$(ticks "$spid")
  local pre=()
  [ "$perf" = 1 ] && pre=(perf stat -x, -o "$tmp/$n.perf" -e context-switches,raw_syscalls:sys_enter)
  timeout -k 5 $((seconds + 60)) "${pre[@]}" fio --name="ab$n" "$@" --rw="$rw" --bs="$bs" --iodepth="$qd" \
    --iodepth_batch_submit="$qd" --iodepth_batch_complete_max="$qd" --size=1G --time_based \
    --runtime="$seconds" --output-format=json --output="$tmp/$n.json" >"$tmp/$n.log" 2>&1 || rc=$?
  t1=$(ticks "$spid")
  if [ "$rc" != 0 ]; then echo "$rw $bs qd$qd $name failed (exit $rc): $(tail -2 "$tmp/$n.log")"; return; fi
  local side=read
  case "$rw" in *write*) side=write ;; esac
  jq -r --arg s "$side" --arg name "$name" --arg w "$rw $bs qd$qd" \
    --argjson srv_s "$(awk -v t=$((t1 - t0)) -v hz="$hz" 'BEGIN { print t / hz }')" \
    '.jobs[0] as $j | $j[$s] as $d | ($d.total_ios) as $n |
     (($j.usr_cpu + $j.sys_cpu) / 100 * $j.job_runtime / 1000) as $fio_s |
     "\($w) | \($name) | \($d.iops | floor) | \($d.lat_ns.mean / 1000 * 10 | floor / 10) | \(($d.clat_ns.percentile["99.000000"] // 0) / 1000 | floor) | \(if $n > 0 then (($fio_s + $srv_s) * 1e6 / $n * 10 | floor / 10) else 0 end)"' \
    "$tmp/$n.json" | { read -r l; if [ "$perf" = 1 ]; then
      local ios
      ios=$(jq --arg s "$side" '.jobs[0][$s].total_ios' "$tmp/$n.json")
      echo "$l | $(awk -F, -v n="$ios" '/^[0-9]/ { printf "%s%.2f", sep, $1 / n; sep = " | " }' "$tmp/$n.perf")"
    else echo "$l"; fi; }
}

echo "# load average before: $(cut -d' ' -f1-3 /proc/loadavg); $rounds rounds of ${seconds} s$([ "$load" -gt 0 ] && echo "; stress-ng --cpu $load beside")"
if [ "$perf" = 1 ]; then
  echo "| workload | variant | IOPS | mean us | p99 us | CPU us/IO | fio ctx switches/IO | fio syscalls/IO |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
else
  echo "| workload | variant | IOPS | mean us | p99 us | CPU us/IO |"
  echo "| --- | --- | --- | --- | --- | --- |"
fi
exec 3>&1
exec > >(tee "$tmp/lines")
for ((r = 1; r <= rounds; r++)); do
  for w in $workloads; do
    IFS=: read -r rw bs qd <<<"$w"
    one nbdkit-unix "$rw" "$bs" "$qd" "$nbd_pid" --ioengine=nbd "--uri=nbd+unix:///?socket=$tmp/nbdkit.sock"
    for v in "${variants[@]}"; do
      name=${v%%=*}
      spec=${v#*=}
      so=${spec%%:*}
      extra=()
      [ "$so" != "$spec" ] && IFS=, read -r -a extra <<<"${spec#*:}"
      one "$name" "$rw" "$bs" "$qd" "$srv_pid" "--ioengine=external:$so" "--ibnbd_paths=$addr" \
        --ibnbd_device=vol.img "--ibnbd_session=ab-$$-$n" "${extra[@]}"
    done
  done
done
exec >&3
sleep 0.2  # tee's last lines
echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "Medians over $rounds rounds:"
echo
echo "| workload | variant | IOPS | mean us | p99 us | CPU us/IO | IOPS / nbdkit | mean lat / nbdkit |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
# Per (workload, variant): the median of each column (the lower middle for an even count).
awk -F' [|] ' 'NF >= 6 && $2 != "variant" && $1 !~ /^---/ {
    k = $1 SUBSEP $2
    if (!(k in cnt)) { order[++nk] = k }
    i = ++cnt[k]; iops[k, i] = $3; mean[k, i] = $4; p99[k, i] = $5; cpu[k, i] = $6
  }
  function med(arr, k, n,   a, i, j, t) {
    for (i = 1; i <= n; i++) a[i] = arr[k, i] + 0
    for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
    return a[int((n + 1) / 2)]
  }
  END {
    for (o = 1; o <= nk; o++) {
      k = order[o]; split(k, kv, SUBSEP); n = cnt[k]
      mi[k] = med(iops, k, n); mm[k] = med(mean, k, n); mp[k] = med(p99, k, n); mc[k] = med(cpu, k, n)
    }
    for (o = 1; o <= nk; o++) {
      k = order[o]; split(k, kv, SUBSEP); b = kv[1] SUBSEP "nbdkit-unix"
      printf "| %s | %s | %d | %.1f | %d | %.1f | %.2f | %.2f |\n", kv[1], kv[2], mi[k], mm[k], mp[k], mc[k],
        (b in mi && mi[b] > 0) ? mi[k] / mi[b] : 0, (b in mm && mm[b] > 0) ? mm[k] / mm[b] : 0
    }
  }' "$tmp/lines"
