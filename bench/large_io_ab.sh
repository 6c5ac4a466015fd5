#!/usr/bin/env bash
# A/B of ibnbd builds (server and fio engine together) on large IO, next to the peers: every
# variant's ibnbd-server, nbdkit and qemu-nbd serve one 1 GiB file, and every round runs each
# target once per workload, in turn, so that the load of a shared host falls on all of them
# alike. Peers as in bench/fio.sh (nbdkit file plugin, qemu-nbd --aio=threads writeback, fio's
# nbd engine over unix sockets); ibnbd targets: fio through the variant's engine over one
# loopback tcp path, or two with NAME=...:2p. Prints a line per run (MiB/s, mean and p99
# latency, CPU us per IO of fio and the server), then medians per target and workload against
# the best peer's median, and the load average before and after. A benchmark, not a test.
#
#   bash bench/large_io_ab.sh [--seconds N] [--rounds N] [--fs tmpfs|ext4]
#        [--workloads "rw:bs:qd ..."] NAME=SERVER,ENGINE[,2p]...
#
# --fs ext4: the file lives on ext4 on a loop device over a sparse file in /var/tmp (needs root;
# unmounted and removed at exit), so the servers go through a real file system's page cache
# instead of tmpfs. Default workloads: read:1m:8 write:1m:8. Only loopback and unix sockets.
set -euo pipefail

seconds=3
rounds=3
fs=tmpfs
workloads="read:1m:8 write:1m:8"
variants=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --fs) fs=$2; shift 2 ;;
    --workloads) workloads=$2; shift 2 ;;
    *=*) variants+=("$1"); shift ;;
    *) echo "usage: $0 [--seconds N] [--rounds N] [--fs tmpfs|ext4] [--workloads LIST] NAME=SERVER,ENGINE[,2p]..." >&2; exit 2 ;;
  esac
done
[ "${#variants[@]}" -gt 0 ] || { echo "no variant given" >&2; exit 2; }
case "$fs" in tmpfs | ext4) ;; *) echo "--fs: tmpfs or ext4" >&2; exit 2 ;; esac
for t in fio nbdkit qemu-nbd jq; do
  command -v "$t" >/dev/null || { echo "$t is missing (scripts/setup.sh installs it)" >&2; exit 1; }
done

source "$(cd "$(dirname "$0")" && pwd)/scratch-lib.sh"
scratch_setup ibnbd-large-ab "$fs"
img="$export_dir/vol.img"
dd if=/dev/urandom of="$img" bs=1M count=1024 status=none
sync "$img"

wait_file() { for _ in $(seq 200); do [ -e "$1" ] && return 0; sleep 0.05; done; return 1; }

declare -A addr1 addr2 engine_of srv_pid_of paths_of
targets=()
k=0
for v in "${variants[@]}"; do
  name=${v%%=*}
  IFS=, read -r server engine extra <<<"${v#*=}"
  [ -x "$server" ] && [ -f "$engine" ] || { echo "$name: no $server or $engine" >&2; exit 2; }
  k=$((k + 1))
  "$server" --allow-any-host --listen tcp:127.0.0.1:0 --listen tcp:127.0.0.1:0 --dev-search-path "$export_dir" \
    --control-socket "$tmp/srv$k.sock" --ready-file "$tmp/srv$k.ready" >"$tmp/srv$k.log" 2>&1 &
  pids+=($!)
  srv_pid_of[$name]=$!
  wait_file "$tmp/srv$k.ready" || { cat "$tmp/srv$k.log" >&2; exit 1; }
  mapfile -t a < <(sed -n 's/^listening //p' "$tmp/srv$k.ready")
  addr1[$name]=${a[0]}
  addr2[$name]=${a[1]}
  engine_of[$name]=$engine
  paths_of[$name]=${extra:-1p}
  targets+=("$name")
done
nbdkit --foreground --exit-with-parent --unix "$tmp/nbdkit.sock" file "$img" >"$tmp/nbdkit.log" 2>&1 &
pids+=($!)
srv_pid_of[nbdkit]=$!
qemu-nbd --persistent --shared=8 --socket "$tmp/qemu.sock" \
  --image-opts "driver=raw,file.driver=file,file.filename=$img,file.locking=off,file.aio=threads,cache.direct=off" \
  >"$tmp/qemu.log" 2>&1 &
pids+=($!)
srv_pid_of[qemu-nbd]=$!
wait_file "$tmp/nbdkit.sock" && wait_file "$tmp/qemu.sock" || { echo "a peer did not start" >&2; exit 1; }
peers="nbdkit qemu-nbd"
targets+=(nbdkit qemu-nbd)

target_args() {
  case "$1" in
    nbdkit) echo "--ioengine=nbd --uri=nbd+unix:///?socket=$tmp/nbdkit.sock" ;;
    qemu-nbd) echo "--ioengine=nbd --uri=nbd+unix:///?socket=$tmp/qemu.sock" ;;
    *)
      local p=${addr1[$1]}
      [ "${paths_of[$1]}" = 2p ] && p="$p,${addr2[$1]}"
      echo "--ioengine=external:${engine_of[$1]} --ibnbd_paths=$p --ibnbd_device=vol.img --ibnbd_mode=migration --ibnbd_session=ab-$1-$run_no"
      ;;
  esac
}
ticks() { sed 's/.*) //' "/proc/$1/stat" | awk '{print $12 + $13}'; }
hz=$(getconf CLK_TCK)

echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg); $fs, ${seconds} s runs, $rounds rounds"
declare -A res
run_no=0
for r in $(seq "$rounds"); do
  for w in $workloads; do
    IFS=: read -r rw bs qd <<<"$w"
    for t in "${targets[@]}"; do
      run_no=$((run_no + 1))
      out="$tmp/run-$run_no.json"
      t0=$(ticks "${srv_pid_of[$t]}")
      # shellcheck disable=SC2046
      timeout -k 5 $((seconds + 60)) fio --name="r$run_no" $(target_args "$t") --rw="$rw" --bs="$bs" \
        --iodepth="$qd" --iodepth_batch_submit="$qd" --iodepth_batch_complete_max="$qd" --size=1G \
        --time_based --runtime="$seconds" --output-format=json --output="$out" >"$tmp/run-$run_no.log" 2>&1 ||
        { echo "$w $t: fio failed"; tail -3 "$tmp/run-$run_no.log"; continue; }
      t1=$(ticks "${srv_pid_of[$t]}")
      side=read
      case "$rw" in *write*) side=write ;; esac
      line=$(jq -r --arg s "$side" --argjson srv "$(awk -v t=$((t1 - t0)) -v hz="$hz" 'BEGIN { print t / hz }')" \
        '.jobs[0] as $j | $j[$s] as $d | (($j.usr_cpu + $j.sys_cpu) / 100 * $j.job_runtime / 1000) as $f |
         "\($d.bw_bytes / 1048576) \($d.lat_ns.mean / 1000) \(($d.clat_ns.percentile["99.000000"] // 0) / 1000) \(if $d.total_ios > 0 then ($f + $srv) * 1e6 / $d.total_ios else 0 end)"' "$out")
      read -r mibs mean p99 cpu <<<"$line"
      printf '%-16s %-10s round %d: %8.1f MiB/s  mean %8.1f us  p99 %8.1f us  CPU %7.1f us/IO\n' \
        "$w" "$t" "$r" "$mibs" "$mean" "$p99" "$cpu"
      res[$w/$t]+="$mibs "
    done
  done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print ""; else if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
echo
echo "| workload | target | median MiB/s | vs best peer |"
echo "| --- | --- | --- | --- |"
for w in $workloads; do
  best=0
  for p in $peers; do
    m=$(echo "${res[$w/$p]:-}" | median)
    [ -n "$m" ] && awk -v a="$m" -v b="$best" 'BEGIN { exit !(a > b) }' && best=$m
  done
  for t in "${targets[@]}"; do
    m=$(echo "${res[$w/$t]:-}" | median)
    echo "| $w | $t | $(awk -v a="$m" 'BEGIN { if (a != "") printf "%.0f", a }') | $(awk -v a="$m" -v b="$best" 'BEGIN { if (a != "" && b > 0) printf "%.2f", a / b }') |"
  done
done
echo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
