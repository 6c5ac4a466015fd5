#!/usr/bin/env bash
# fio benchmark of our stack against its peers, one run, one table. Every target serves the
# same 1 GiB file on tmpfs (buffered: tmpfs has no real O_DIRECT), or with --fs ext4 on ext4 on a
# loop device over a sparse file in /var/tmp (buffered too; needs root; unmounted and removed at
# exit), so rows differ only by the path to it:
#   file            fio io_uring on the file itself: the limit (no network, no server)
#   nbdkit-unix/-tcp  nbdkit's file plugin (defaults: buffered pread/pwrite on its threads),
#                   fio's nbd engine over a unix socket / loopback tcp
#   qemu-nbd-unix/-tcp  qemu-nbd -f raw --cache=writeback --aio=threads (buffered like the
#                   others; --aio=io_uring on tmpfs goes through io_uring's worker threads and
#                   measured no better; --cache=none would be O_DIRECT, which tmpfs only
#                   pretends), --shared=8, image locking off (another server has the file
#                   open), fio's nbd engine over a unix socket / loopback tcp
#   ibnbd-1p / -2p  ibnbd-server, fio through our external ioengine (libibnbd-fio.so) over one
#                   loopback tcp path / two; library defaults (io_threads min(cores, 8) per
#                   path, min-inflight) and the engine's: getevents reaps the job's
#                   completions itself (ibnbd_reap=caller: it reads the path's socket, no
#                   transport IO thread in between) and waits adaptively (ibnbd_poll=adaptive:
#                   sleeps until shortly before the expected completion, spins within a budget,
#                   blocks when the CPU is contended); mapped in migration mode (rnbd's rule:
#                   one writer plus one migration opener) because the daemon below holds the
#                   device rw the whole run
#   ibnbd-1p-block  ibnbd-1p with ibnbd_poll=block: getevents sleeps at once (the default
#                   before the adaptive wait)
#   ibnbd-1p-thread ibnbd-1p with ibnbd_reap=thread: transport IO threads receive the
#                   completions and hand them to getevents through a futex (the mode before)
#   ibnbd-1p-srvblock ibnbd-1p against a second ibnbd-server with --poll block: its IO threads
#                   sleep as soon as their CQs are drained (the server's default before the
#                   adaptive busy-poll); started only when the row is selected
#   ibnbd-1p-allblock ibnbd-1p-srvblock with ibnbd_poll=block: nothing spins on either side, the
#                   baseline the adaptive waits must not lose more than 10 % to on a loaded host
#                   (issue 14; run with `stress-ng --cpu 2` beside it)
#   ibnbd-1p-poll   ibnbd-1p with ibnbd_poll_us=200: getevents spins up to 200 us before it
#                   sleeps, whatever the load (the CPU column shows what that costs)
#   ibnbd-nbd       two hops: ibnbd-server <- ibnbd-client daemon (device map rw, one path,
#                   then device export on a unix socket) <- fio's nbd engine
# Workloads: 4 KiB randread / randwrite at QD1 and QD32, 1 MiB sequential read / write at QD8;
# one job each. Every row runs with --iodepth_batch_submit=QD --iodepth_batch_complete_max=QD
# (fio hands an engine that has a commit hook everything it queued since it last waited; the nbd
# engine sends each request as it is queued either way).
# Columns: fio's IOPS and MiB/s, total latency (mean), completion latency (p99); CPU per IO: the
# fio job process (usr + sys, with the engine's transport threads) plus the serving processes
# (/proc/PID/stat, 10 ms ticks), divided by the IOs; CPU stall: the share of the run's wall time in
# which some runnable task waited for a CPU (/proc/pressure/cpu "some", the whole host: spinning
# that takes a CPU another task of the run needs shows here). Ratios: against the best peer of the
# workload (most IOPS; lowest mean latency), the peers being nbdkit and qemu-nbd.
# A benchmark, not a test: it asserts nothing.
#
#   bash bench/fio.sh [--seconds N] [--fs tmpfs|ext4] [--only REGEX] [--workloads REGEX]
#                     [--nbd-base DIR] [--perf] [--chart PNG|none]
#   (default 5 s per run and tmpfs; 66 runs, about 7 minutes)
#
# --fs ext4 puts the volumes on ext4 on a loop device over a file (root) instead of tmpfs.
# --only REGEX runs only the targets whose name matches (an extended regex over the whole name),
# e.g. --only 'nbdkit-unix|ibnbd-nbd'; --workloads REGEX likewise over the workload names
# ("4k randread qd32", "1m write qd8", ...). Rows and ratios of what was left out stay empty.
# --nbd-base DIR adds the row ibnbd-nbd-base: the ibnbd-nbd setup with the client daemon of
# another build directory (say, main's), mapped in migration mode; it runs right after
# ibnbd-nbd in every workload, so that an A/B of two daemons shares the host's load.
# --perf runs fio under `perf stat` and attaches it to each serving process for the run, and
# prints a second table: context switches and system calls per IO of fio and of each serving
# process (counts the host's load does not move; perf needs kernel.perf_event_paranoid <= 1 or
# root).
# --chart PNG draws the table (bench/chart.sh: IOPS, mean and p99 latency per target per
# workload) into PNG; by default into bench/out/fio-<UTC time>.png, "none" for no chart.
#
# The build directory comes from $IBTRS_BUILD (default build); the binaries are built there if
# needed (the engine needs the fio headers: scripts/fio-headers.sh). Only loopback addresses and
# unix sockets are used.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
caller_dir=$PWD
cd "$top"
seconds=5
fs=tmpfs
only=
only_workloads=
nbd_base=
perf=0
chart=
source "$top/bench/chart-lib.sh"
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --fs) fs=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    --workloads) only_workloads=$2; shift 2 ;;
    --nbd-base) nbd_base=$2; shift 2 ;;
    --perf) perf=1; shift ;;
    --chart) chart=$(chart_arg "$caller_dir" "$2") || exit 2; shift 2 ;;
    *) echo "usage: $0 [--seconds N] [--fs tmpfs|ext4] [--only REGEX] [--workloads REGEX] [--nbd-base DIR] [--perf] [--chart PNG|none]" >&2; exit 2 ;;
  esac
done
case "$fs" in tmpfs | ext4) ;; *) echo "--fs: tmpfs or ext4" >&2; exit 2 ;; esac
[ "$fs" = tmpfs ] || [ "$(id -u)" = 0 ] || { echo "--fs ext4 needs root (losetup, mount)" >&2; exit 2; }
case "$seconds" in '' | *[!0-9]* | 0) echo "--seconds takes a whole number above 0" >&2; exit 2 ;; esac
for t in fio nbdkit qemu-nbd jq python3; do
  command -v "$t" >/dev/null || { echo "$t is missing (scripts/setup.sh installs it)" >&2; exit 1; }
done

build=${IBTRS_BUILD:-build}
if [ ! -f "$build/build.ninja" ]; then
  cmake -S . -B "$build" -G Ninja -DIBNBD_FIO_ENGINE=ON >/dev/null
fi
ninja -C "$build" -j "$(nproc)" ibnbd-server ibnbd-client ibnbd ibnbd_fio >/dev/null
build=$(cd "$build" && pwd)  # the runs below happen in the tmpfs directory
srv="$build/server/ibnbd-server"
cld="$build/client/daemon/ibnbd-client"
cli="$build/client/cli/ibnbd"
engine="$build/client/fio/libibnbd-fio.so"

source "$top/bench/scratch-lib.sh"
scratch_setup ibnbd-fio-bench "$fs"  # 1 GiB written below, so that reads find pages

wait_file() {  # wait_file FILE PID: until FILE exists, while PID lives (10 s at most)
  for _ in $(seq 200); do
    [ -e "$1" ] && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.05
  done
  return 1
}
wait_port() {  # wait_port PORT PID: until 127.0.0.1:PORT accepts, while PID lives
  for _ in $(seq 200); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.05
  done
  return 1
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
started() {  # started NAME LOG: the last background process failed to come up
  echo "$1 did not start:" >&2
  cat "$2" >&2
  exit 1
}

img="$export_dir/vol.img"
dd if=/dev/urandom of="$img" bs=1M count=1024 status=none
sync "$img"

# --allow-any-host (the server warns): IO is what is measured here, and authentication costs
# only at connect (docs/security.d/auth-bench.md).
"$srv" --allow-any-host --listen tcp:127.0.0.1:0 --listen tcp:127.0.0.1:0 --dev-search-path "$export_dir" \
  --control-socket "$tmp/srv.sock" --ready-file "$tmp/srv.ready" >"$tmp/srv.log" 2>&1 &
pids+=($!)
srv_pid=$!
wait_file "$tmp/srv.ready" "$srv_pid" || started ibnbd-server "$tmp/srv.log"
mapfile -t addrs < <(sed -n 's/^listening //p' "$tmp/srv.ready")
srvb_pid=
if [ -z "$only" ] || [[ ibnbd-1p-srvblock =~ ^($only)$ ]] || [[ ibnbd-1p-allblock =~ ^($only)$ ]]; then
  "$srv" --allow-any-host --listen tcp:127.0.0.1:0 --dev-search-path "$export_dir" --poll block \
    --control-socket "$tmp/srvb.sock" --ready-file "$tmp/srvb.ready" >"$tmp/srvb.log" 2>&1 &
  pids+=($!)
  srvb_pid=$!
  wait_file "$tmp/srvb.ready" "$srvb_pid" || started "ibnbd-server --poll block" "$tmp/srvb.log"
  srvb_addr=$(sed -n 's/^listening //p' "$tmp/srvb.ready" | head -1)
fi

nbdkit --foreground --exit-with-parent --unix "$tmp/nbdkit.sock" file "$img" >"$tmp/nbdkit-unix.log" 2>&1 &
pids+=($!)
nbdkit_unix_pid=$!
wait_file "$tmp/nbdkit.sock" "$nbdkit_unix_pid" || started nbdkit "$tmp/nbdkit-unix.log"
nbdkit_port=$(free_port)
nbdkit --foreground --exit-with-parent --ipaddr 127.0.0.1 --port "$nbdkit_port" file "$img" \
  >"$tmp/nbdkit-tcp.log" 2>&1 &
pids+=($!)
nbdkit_tcp_pid=$!
wait_port "$nbdkit_port" "$nbdkit_tcp_pid" || started nbdkit "$tmp/nbdkit-tcp.log"

qemu_opts="driver=raw,file.driver=file,file.filename=$img,file.locking=off,file.aio=threads,cache.direct=off"
qemu-nbd --persistent --shared=8 --image-opts "$qemu_opts" --socket "$tmp/qemu.sock" \
  >"$tmp/qemu-unix.log" 2>&1 &
pids+=($!)
qemu_unix_pid=$!
wait_file "$tmp/qemu.sock" "$qemu_unix_pid" || started qemu-nbd "$tmp/qemu-unix.log"
qemu_port=$(free_port)
qemu-nbd --persistent --shared=8 --image-opts "$qemu_opts" --bind 127.0.0.1 --port "$qemu_port" \
  >"$tmp/qemu-tcp.log" 2>&1 &
pids+=($!)
qemu_tcp_pid=$!
wait_port "$qemu_port" "$qemu_tcp_pid" || started qemu-nbd "$tmp/qemu-tcp.log"

# Our NBD export: the client daemon maps the volume over one path and exports it.
"$cld" --control-socket "$tmp/cl.sock" --ready-file "$tmp/cl.ready" >"$tmp/cl.log" 2>&1 &
pids+=($!)
cld_pid=$!
wait_file "$tmp/cl.ready" "$cld_pid" || started ibnbd-client "$tmp/cl.log"
"$cli" --socket "$tmp/cl.sock" client device map vol.img from "${addrs[0]}" rw >/dev/null
"$cli" --socket "$tmp/cl.sock" client device export vol.img unix "$tmp/ibnbd-nbd.sock" >/dev/null
cld_base_pid=
if [ -n "$nbd_base" ]; then
  base_cld="$(cd "$nbd_base" && pwd)/client/daemon/ibnbd-client"
  [ -x "$base_cld" ] || { echo "--nbd-base: no $base_cld" >&2; exit 1; }
  "$base_cld" --control-socket "$tmp/clb.sock" --ready-file "$tmp/clb.ready" >"$tmp/clb.log" 2>&1 &
  pids+=($!)
  cld_base_pid=$!
  wait_file "$tmp/clb.ready" "$cld_base_pid" || started "ibnbd-client (base)" "$tmp/clb.log"
  "$cli" --socket "$tmp/clb.sock" client device map vol.img from "${addrs[0]}" migration >/dev/null
  "$cli" --socket "$tmp/clb.sock" client device export vol.img unix "$tmp/ibnbd-nbd-base.sock" >/dev/null
fi

run_no=0
# target_args TARGET: the fio options that pick the target.
target_args() {
  case "$1" in
    file) echo "--ioengine=io_uring --filename=$img" ;;
    nbdkit-unix) echo "--ioengine=nbd --uri=nbd+unix:///?socket=$tmp/nbdkit.sock" ;;
    nbdkit-tcp) echo "--ioengine=nbd --uri=nbd://127.0.0.1:$nbdkit_port/" ;;
    qemu-nbd-unix) echo "--ioengine=nbd --uri=nbd+unix:///?socket=$tmp/qemu.sock" ;;
    qemu-nbd-tcp) echo "--ioengine=nbd --uri=nbd://127.0.0.1:$qemu_port/" ;;
    ibnbd-1p) echo "--ioengine=external:$engine --ibnbd_paths=${addrs[0]} --ibnbd_device=vol.img --ibnbd_mode=migration --ibnbd_session=bench-$$-$run_no" ;;
    ibnbd-1p-thread) echo "--ioengine=external:$engine --ibnbd_paths=${addrs[0]} --ibnbd_device=vol.img --ibnbd_mode=migration --ibnbd_reap=thread --ibnbd_session=bench-$$-$run_no" ;;
    ibnbd-1p-block) echo "--ioengine=external:$engine --ibnbd_paths=${addrs[0]} --ibnbd_device=vol.img --ibnbd_mode=migration --ibnbd_poll=block --ibnbd_session=bench-$$-$run_no" ;;
    ibnbd-1p-srvblock) echo "--ioengine=external:$engine --ibnbd_paths=$srvb_addr --ibnbd_device=vol.img --ibnbd_mode=migration --ibnbd_session=bench-$$-$run_no" ;;
    ibnbd-1p-allblock) echo "--ioengine=external:$engine --ibnbd_paths=$srvb_addr --ibnbd_device=vol.img --ibnbd_mode=migration --ibnbd_poll=block --ibnbd_session=bench-$$-$run_no" ;;
    ibnbd-1p-poll) echo "--ioengine=external:$engine --ibnbd_paths=${addrs[0]} --ibnbd_device=vol.img --ibnbd_mode=migration --ibnbd_poll_us=200 --ibnbd_session=bench-$$-$run_no" ;;
    ibnbd-2p) echo "--ioengine=external:$engine --ibnbd_paths=${addrs[0]},${addrs[1]} --ibnbd_device=vol.img --ibnbd_mode=migration --ibnbd_session=bench-$$-$run_no" ;;
    ibnbd-nbd) echo "--ioengine=nbd --uri=nbd+unix:///vol.img?socket=$tmp/ibnbd-nbd.sock" ;;
    ibnbd-nbd-base) echo "--ioengine=nbd --uri=nbd+unix:///vol.img?socket=$tmp/ibnbd-nbd-base.sock" ;;
  esac
}
# serving_pids TARGET: the processes whose CPU time counts for the target besides fio.
serving_pids() {
  case "$1" in
    file) ;;
    nbdkit-unix) echo "$nbdkit_unix_pid" ;;
    nbdkit-tcp) echo "$nbdkit_tcp_pid" ;;
    qemu-nbd-unix) echo "$qemu_unix_pid" ;;
    qemu-nbd-tcp) echo "$qemu_tcp_pid" ;;
    ibnbd-1p | ibnbd-1p-block | ibnbd-1p-thread | ibnbd-1p-poll | ibnbd-2p) echo "$srv_pid" ;;
    ibnbd-1p-srvblock | ibnbd-1p-allblock) echo "$srvb_pid" ;;
    ibnbd-nbd) echo "$srv_pid $cld_pid" ;;
    ibnbd-nbd-base) echo "$srv_pid $cld_base_pid" ;;
  esac
}
ticks() {  # ticks PID...: utime + stime of the processes (all their threads), clock ticks
  local sum=0 p
  for p in "$@"; do
    # Fields after the command name (which may hold spaces): utime and stime are 12 and 13.
    sum=$((sum + $(sed 's/.*) //' "/proc/$p/stat" | awk '{print $12 + $13}')))
  done
  echo "$sum"
}
hz=$(getconf CLK_TCK)
# CPU pressure (PSI): microseconds in which some runnable task waited for a CPU, since boot; empty
# where the kernel has no PSI (CONFIG_PSI off, or psi=0).
psi_some_us() { sed -n 's/^some .*total=\([0-9]*\)$/\1/p' /proc/pressure/cpu 2>/dev/null || true; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a != "" && b != "" && b > 0) printf "%.2f", a / b; else print "" }'; }

peers="nbdkit-unix nbdkit-tcp qemu-nbd-unix qemu-nbd-tcp"
declare -A iops_of lat_of cpu_of
rows=()
# run WORKLOAD TARGET RW BS QD: one fio run; keeps its row (ratios are added once the
# workload's peers are known).
run() {
  local workload=$1 target=$2 rw=$3 bs=$4 qd=$5
  run_no=$((run_no + 1))
  local out="$tmp/run-$run_no.json" rc=0
  local spids
  read -r -a spids <<<"$(serving_pids "$target")"
  local t0 psi0 wall0
  t0=$(ticks "${spids[@]}")
  psi0=$(psi_some_us)
  wall0=$(date +%s%N)
  local wrap=() perf_pids=() p
  if [ "$perf" = 1 ]; then
    wrap=(perf stat -x, -e context-switches,raw_syscalls:sys_enter -o "$tmp/perf-$run_no-fio.csv" --)
    for p in "${spids[@]}"; do
      perf stat -x, -e context-switches,raw_syscalls:sys_enter -p "$p" -o "$tmp/perf-$run_no-$p.csv" &
      perf_pids+=($!)
    done
  fi
  # shellcheck disable=SC2046
  timeout -k 5 $((seconds + 60)) "${wrap[@]}" fio --name="r$run_no" $(target_args "$target") \
    --rw="$rw" --bs="$bs" --iodepth="$qd" --iodepth_batch_submit="$qd" \
    --iodepth_batch_complete_max="$qd" --size=1G --time_based --runtime="$seconds" \
    --output-format=json --output="$out" >"$tmp/run-$run_no.log" 2>&1 || rc=$?
  local t1 psi1 wall1 stall=""
  t1=$(ticks "${spids[@]}")
  psi1=$(psi_some_us)
  wall1=$(date +%s%N)
  [ -z "$psi0" ] || [ -z "$psi1" ] ||
    stall=$(awk -v d=$((psi1 - psi0)) -v w=$(((wall1 - wall0) / 1000)) 'BEGIN { printf "%.0f", 100 * d / w }')
  for p in "${perf_pids[@]}"; do kill -INT "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  if [ "$rc" != 0 ] || ! jq -e '.jobs[0]' "$out" >/dev/null 2>&1; then
    rows+=("$workload|$target|failed (exit $rc)")
    tail -3 "$tmp/run-$run_no.log" >&2
    return 0
  fi
  local side=read
  case "$rw" in *write*) side="write" ;; esac
  local line
  line=$(jq -r --arg s "$side" --argjson srv_s "$(awk -v t=$((t1 - t0)) -v hz="$hz" 'BEGIN { print t / hz }')" \
    '.jobs[0] as $j | $j[$s] as $d | ($d.total_ios) as $n |
     (($j.usr_cpu + $j.sys_cpu) / 100 * $j.job_runtime / 1000) as $fio_s |
     "\($d.iops) \($d.bw_bytes / 1048576) \($d.lat_ns.mean / 1000) \(($d.clat_ns.percentile["99.000000"] // 0) / 1000) \(if $n > 0 then ($fio_s + $srv_s) * 1e6 / $n else 0 end) \($j.error)"' "$out")
  local iops mibs mean p99 cpu err
  read -r iops mibs mean p99 cpu err <<<"$line"
  iops_of[$workload/$target]=$iops
  lat_of[$workload/$target]=$mean
  cpu_of[$workload/$target]=$cpu
  rows+=("$workload|$target|$(printf '%.0f|%.1f|%.1f|%.1f|%.1f' "$iops" "$mibs" "$mean" "$p99" "$cpu")|$stall|$err")
  if [ "$perf" = 1 ]; then
    local ios cells
    ios=$(jq -r --arg s "$side" '.jobs[0][$s].total_ios' "$out")
    cells="fio $(per_io "$tmp/perf-$run_no-fio.csv" "$ios")"
    for p in "${spids[@]}"; do cells+="; $(proc_name "$p") $(per_io "$tmp/perf-$run_no-$p.csv" "$ios")"; done
    perf_rows+=("$workload|$target|$cells")
  fi
}
# per_io CSV IOS: "CS/IO SYSCALLS/IO" from a perf stat -x, file.
per_io() {
  awk -F, -v n="$2" '$3 == "context-switches" { cs = $1 } $3 ~ /sys_enter/ { sc = $1 }
    END { if (n > 0) printf "%.2f cs, %.2f syscalls", cs / n, sc / n; else print "no IO" }' "$1"
}
proc_name() {
  case "$1" in
    "$srv_pid") echo ibnbd-server ;;
    "$srvb_pid") echo ibnbd-server-block ;;
    "$cld_pid") echo ibnbd-client ;;
    "$cld_base_pid") echo ibnbd-client-base ;;
    *) cat "/proc/$1/comm" 2>/dev/null || echo "$1" ;;
  esac
}
perf_rows=()

selected() { [ -z "$only" ] || [[ $1 =~ ^($only)$ ]]; }

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
start=$(date +%s)
workloads=("4k randread qd1:randread:4k:1" "4k randread qd32:randread:4k:32"
  "4k randwrite qd1:randwrite:4k:1" "4k randwrite qd32:randwrite:4k:32"
  "1m read qd8:read:1m:8" "1m write qd8:write:1m:8")
for row in "${workloads[@]}"; do
  IFS=: read -r workload rw bs qd <<<"$row"
  [ -z "$only_workloads" ] || [[ $workload =~ ^($only_workloads)$ ]] || continue
  for target in $peers file ibnbd-1p ibnbd-1p-block ibnbd-1p-srvblock ibnbd-1p-allblock ibnbd-1p-thread ibnbd-1p-poll ibnbd-2p ibnbd-nbd ${nbd_base:+ibnbd-nbd-base}; do
    selected "$target" || continue
    run "$workload" "$target" "$rw" "$bs" "$qd"
  done
done

# best_peer WORKLOAD KIND: the peer with the most IOPS (iops) or the lowest mean latency (lat).
best_peer() {
  local best="" p
  for p in $peers; do
    local v=${iops_of[$1/$p]:-}
    [ -n "$v" ] || continue
    if [ "$2" = iops ]; then
      if [ -z "$best" ] || awk -v a="$v" -v b="${iops_of[$1/$best]}" 'BEGIN { exit !(a > b) }'; then best=$p; fi
    else
      if [ -z "$best" ] || awk -v a="${lat_of[$1/$p]}" -v b="${lat_of[$1/$best]}" 'BEGIN { exit !(a < b) }'; then best=$p; fi
    fi
  done
  echo "$best"
}

echo "# fio benchmark ($(date -u +%Y-%m-%d), $(nproc) cores, $(uname -r), load average before: $load_before)"
echo
echo "fio $(fio --version | sed 's/^fio-//'), one job, ${seconds} s per run, a 1 GiB file on $fs; targets and"
echo "options: the header of bench/fio.sh. Ratios against the workload's best peer (nbdkit, qemu-nbd):"
echo "IOPS / its IOPS, mean latency / its mean latency."
echo
{
echo "| workload | target | IOPS | MiB/s | mean us | p99 us | CPU us/IO | CPU stall % | IOPS vs best peer | mean lat vs best peer |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for r in "${rows[@]}"; do
  IFS='|' read -r workload target iops mibs mean p99 cpu stall err <<<"$r"
  if [ -z "$mibs" ]; then
    echo "| $workload | $target | $iops | | | | | | | |"
    continue
  fi
  bi=$(best_peer "$workload" iops)
  bl=$(best_peer "$workload" lat)
  ri=$(ratio "${iops_of[$workload/$target]}" "${iops_of[$workload/$bi]:-}")
  rl=$(ratio "${lat_of[$workload/$target]}" "${lat_of[$workload/$bl]:-}")
  [ "$err" = 0 ] || ri="$ri (fio error $err)"
  echo "| $workload | $target | $iops | $mibs | $mean | $p99 | $cpu | $stall | $ri | $rl |"
done
} | tee "$tmp/table.md"
echo
for w in "4k randread qd32" "4k randwrite qd32"; do
  bi=$(best_peer "$w" iops)
  for t in ibnbd-1p ibnbd-1p-block ibnbd-1p-srvblock; do
    echo "$t / best peer ($bi), $w IOPS: $(ratio "${iops_of[$w/$t]:-}" "${iops_of[$w/$bi]:-}") (target >= 2)"
  done
  echo "ibnbd-1p-poll / best peer ($bi), $w IOPS: $(ratio "${iops_of[$w/ibnbd-1p-poll]:-}" "${iops_of[$w/$bi]:-}") (target >= 3)"
done
for w in "1m read qd8" "1m write qd8"; do
  bi=$(best_peer "$w" iops)
  echo "ibnbd-1p / best peer ($bi), $w IOPS: $(ratio "${iops_of[$w/ibnbd-1p]:-}" "${iops_of[$w/$bi]:-}") (target >= 1.1)"
done
for w in "4k randread qd1" "4k randwrite qd1"; do
  for t in ibnbd-1p ibnbd-1p-block ibnbd-1p-srvblock ibnbd-1p-poll; do
    echo "$t / nbdkit-unix, $w mean latency: $(ratio "${lat_of[$w/$t]:-}" "${lat_of[$w/nbdkit-unix]:-}") (target <= 0.8)"
  done
done
for w in "4k randread qd1" "4k randwrite qd1" "4k randread qd32" "4k randwrite qd32"; do
  echo "ibnbd-1p (adaptive waits) / ibnbd-1p-allblock, $w: mean latency $(ratio "${lat_of[$w/ibnbd-1p]:-}" "${lat_of[$w/ibnbd-1p-allblock]:-}") (loaded host: target <= 1.1), CPU per IO $(ratio "${cpu_of[$w/ibnbd-1p]:-}" "${cpu_of[$w/ibnbd-1p-allblock]:-}")"
done
for w in "4k randread qd32" "4k randwrite qd32" "1m read qd8" "1m write qd8"; do
  echo "ibnbd-nbd (two hops) / nbdkit-unix, $w IOPS: $(ratio "${iops_of[$w/ibnbd-nbd]:-}" "${iops_of[$w/nbdkit-unix]:-}") (target >= 1.0)"
done
for w in "4k randread qd1" "4k randwrite qd1"; do
  echo "ibnbd-nbd (two hops) / nbdkit-unix, $w mean latency: $(ratio "${lat_of[$w/ibnbd-nbd]:-}" "${lat_of[$w/nbdkit-unix]:-}") (target <= 1.0)"
done
if [ -n "$nbd_base" ]; then
  for row in "${workloads[@]}"; do
    w=${row%%:*}
    echo "ibnbd-nbd / ibnbd-nbd-base, $w: IOPS $(ratio "${iops_of[$w/ibnbd-nbd]:-}" "${iops_of[$w/ibnbd-nbd-base]:-}"), mean latency $(ratio "${lat_of[$w/ibnbd-nbd]:-}" "${lat_of[$w/ibnbd-nbd-base]:-}")"
  done
fi
if [ "$perf" = 1 ]; then
  echo
  echo "Per IO (perf stat; fio wrapped, serving processes attached for the run):"
  echo
  echo "| workload | target | context switches and system calls per IO |"
  echo "| --- | --- | --- |"
  for r in "${perf_rows[@]}"; do
    IFS='|' read -r workload target cells <<<"$r"
    echo "| $workload | $target | $cells |"
  done
fi
echo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg); the run took $(($(date +%s) - start)) s"
bench_chart "$chart" fio "$tmp/table.md" \
  "bench/fio.sh --seconds $seconds, $fs, $(date -u +%Y-%m-%d), commit $(git -C "$top" rev-parse --short HEAD 2>/dev/null)" \
  IOPS "mean us=mean latency (us)" "p99 us=p99 completion latency (us)"
