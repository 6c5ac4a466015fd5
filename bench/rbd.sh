#!/usr/bin/env bash
# RBD gateway benchmark: one run, one table, one cluster. A single-host Ceph cluster
# (scripts/ceph-dev.sh: mon + memstore OSD, cephx on, no mgr) holds a 1 GiB image written in
# full first; every row reads and writes that image through another path:
#   librbd       fio's rbd engine straight to librbd (the limit: no network hop of ours)
#   ibnbd        fio through our external ioengine (libibnbd-fio.so) -> ibnbd-server (one
#                loopback tcp path) -> librbd; mapped in migration mode because the daemon below
#                holds the image rw the whole run
#   ibnbd-nbd    fio's nbd engine -> ibnbd-client's NBD export (unix socket) -> ibnbd-server ->
#                librbd: what a VM or nbd-client sees
#   qemu-nbd     fio's nbd engine -> qemu-nbd -f raw with QEMU's rbd driver (qemu-block-extra;
#                --cache=writeback, --shared=8, --persistent, unix socket): the simplest
#                gateway peer
# The image's exclusive lock moves to whichever client writes (librbd hands it over on request);
# each row's first write pays for that once.
# Workloads: 4 KiB randread / randwrite at QD32, 1 MiB sequential read / write at QD8; one job.
# Columns: IOPS, MiB/s, mean latency; CPU per IO (usr+sys) of fio (librbd runs inside it in the
# librbd row), of the gateway processes (ibnbd-server, + ibnbd-client for ibnbd-nbd, qemu-nbd)
# and of ceph-osd (/proc/PID/stat over the run). Ratios: ibnbd and ibnbd-nbd against librbd (target
# >= 0.9x at 4k QD32 and 1 MiB) and against qemu-nbd (target >= 1.5x). On this 2-core host the
# OSD, the gateway and fio share the cores: the ratios say what each path costs there.
# A benchmark, not a test: it asserts nothing.
#
#   bash bench/rbd.sh [--seconds N] [--only REGEX] [--server-poll adaptive|block|spin]
#                     [--chart PNG|none]  (default 5 s per run: 16 runs, ~2.5 min; the server's
#                                       default --poll adaptive; the chart of the table,
#                                       bench/chart.sh, into bench/out/rbd-<UTC time>.png)
#
# The build directory comes from $IBTRS_BUILD (default build); the binaries are built there if
# needed. Skips (exit 0, reason printed) without Ceph, qemu-nbd's rbd driver or fio's rbd engine.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
caller_dir=$PWD
cd "$top"
source "$top/bench/chart-lib.sh"
seconds=5
only=
server_poll=adaptive
chart=
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    --server-poll) server_poll=$2; shift 2 ;;
    --chart) chart=$(chart_arg "$caller_dir" "$2") || exit 2; shift 2 ;;
    *) echo "usage: $0 [--seconds N] [--only REGEX] [--server-poll adaptive|block|spin] [--chart PNG|none]" >&2; exit 2 ;;
  esac
done
case "$seconds" in '' | *[!0-9]* | 0) echo "--seconds takes a whole number above 0" >&2; exit 2 ;; esac
for t in fio qemu-nbd ceph-mon ceph-osd rbd jq python3 /usr/bin/time; do
  command -v "$t" >/dev/null || { echo "skipped: $t is missing (scripts/setup.sh installs it)"; exit 0; }
done
fio --enghelp=rbd >/dev/null 2>&1 || { echo "skipped: this fio has no rbd engine"; exit 0; }
ls /usr/lib/x86_64-linux-gnu/qemu/block-rbd.so >/dev/null 2>&1 ||
  { echo "skipped: qemu-nbd has no rbd driver (qemu-block-extra)"; exit 0; }

build=${IBTRS_BUILD:-build}
[ -f "$build/build.ninja" ] || cmake -S . -B "$build" -G Ninja >/dev/null
ninja -C "$build" -j "$(nproc)" ibnbd-server ibnbd-client ibnbd ibnbd_fio >/dev/null
build=$(cd "$build" && pwd)
srv="$build/server/ibnbd-server"
cld="$build/client/daemon/ibnbd-client"
cli="$build/client/cli/ibnbd"
engine="$build/client/fio/libibnbd-fio.so"

# The scratch directory and the processes in $pids as the other benchmarks keep them
# (bench/scratch-lib.sh: on tmpfs, which the memstore OSD's directory may be); the cluster goes
# after its clients and before the directory.
source "$top/bench/scratch-lib.sh"
scratch_setup ibnbd-rbd-bench tmpfs
work=$tmp
trap 'for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill "${pids[i]}" 2>/dev/null || true; wait "${pids[i]}" 2>/dev/null || true; done
      pids=(); bash "$top/scripts/ceph-dev.sh" stop "$work/ceph" >/dev/null 2>&1 || true; scratch_cleanup' EXIT
wait_file() { for _ in $(seq 200); do [ -e "$1" ] && return 0; sleep 0.05; done; return 1; }

echo "# load before: $(cut -d' ' -f1-3 /proc/loadavg)"
bash "$top/scripts/ceph-dev.sh" start "$work/ceph" --osd-mb 3072 --no-mgr >"$work/ceph.env" 2>"$work/ceph.err" ||
  { echo "ceph-dev start failed: $(tail -3 "$work/ceph.err")"; exit 1; }
export CEPH_CONF=$work/ceph/ceph.conf
keyring=$work/ceph/ceph.client.admin.keyring
rbd create rbd/bench --size 1G
fio --name=fill --ioengine=rbd --clientname=admin --pool=rbd --rbdname=bench --rw=write --bs=4M --iodepth=4 \
  --size=1G >/dev/null

"$cli" key generate host nqn.2014-08.org.nvmexpress:uuid:be4c0000-0000-4000-8000-000000000001 out "$work/host.key" >/dev/null
cat >"$work/srv.json" <<EOF
{"hosts": [{"key_file": "$work/host.key", "access": [{"devices": "rbd:rbd/**", "mode": "migration"}]}],
 "rbd": {"conf": "$CEPH_CONF", "client_id": "admin", "keyring": "$keyring"}}
EOF
"$srv" --config "$work/srv.json" --poll "$server_poll" --listen tcp:127.0.0.1:0 --dev-search-path "$work" --control-socket "$work/srv.sock" \
  --ready-file "$work/srv.ready" >"$work/srv.log" 2>&1 &
srv_pid=$!
pids+=($!)
wait_file "$work/srv.ready" || { echo "ibnbd-server did not start: $(tail -3 "$work/srv.log")"; exit 1; }
addr=$(sed -n 's/^listening //p' "$work/srv.ready" | head -1)
"$cld" --host-key "$work/host.key" --control-socket "$work/cl.sock" --ready-file "$work/cl.ready" >"$work/cl.log" 2>&1 &
cld_pid=$!
pids+=($!)
wait_file "$work/cl.ready" || { echo "ibnbd-client did not start"; exit 1; }
"$cli" --socket "$work/cl.sock" client device map rbd:rbd/bench from "$addr" rw >/dev/null
"$cli" --socket "$work/cl.sock" client device export rbd:rbd/bench unix "$work/ibnbd.sock" name bench >/dev/null
qemu-nbd -f raw --cache=writeback --shared=8 --persistent --socket="$work/qemu.sock" \
  "rbd:rbd/bench:conf=$CEPH_CONF:id=admin:keyring=$keyring" >"$work/qemu.log" 2>&1 &
qemu_pid=$!
pids+=($!)
wait_file "$work/qemu.sock" || { echo "qemu-nbd did not start: $(tail -3 "$work/qemu.log")"; exit 1; }
osd_pid=$(cat "$work/ceph/run/osd.0.pid")

engine_args() {  # engine_args TARGET
  case "$1" in
    librbd) echo "--ioengine=rbd --clientname=admin --pool=rbd --rbdname=bench" ;;
    ibnbd) echo "--ioengine=external:$engine --ibnbd_paths=$addr --ibnbd_device=rbd:rbd/bench --ibnbd_mode=migration --ibnbd_host_key=$work/host.key --ibnbd_session=bench-fio" ;;
    ibnbd-nbd) echo "--ioengine=nbd --uri=nbd+unix:///bench?socket=$work/ibnbd.sock" ;;
    qemu-nbd) echo "--ioengine=nbd --uri=nbd+unix:///?socket=$work/qemu.sock" ;;
  esac
}
gateways_of() {  # the processes between fio and the OSD for TARGET
  case "$1" in
    librbd) echo "" ;;
    ibnbd) echo "$srv_pid" ;;
    ibnbd-nbd) echo "$srv_pid $cld_pid" ;;
    qemu-nbd) echo "$qemu_pid" ;;
  esac
}
ticks() {  # usr+sys clock ticks of the PIDs
  local t=0 p
  for p in "$@"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0))); done
  echo "$t"
}
hz=$(getconf CLK_TCK)

declare -A iops_of
rows=()
workloads=("4k randread qd32|--rw=randread --bs=4k --iodepth=32|read"
  "4k randwrite qd32|--rw=randwrite --bs=4k --iodepth=32|write"
  "1m read qd8|--rw=read --bs=1M --iodepth=8|read"
  "1m write qd8|--rw=write --bs=1M --iodepth=8|write")
targets=(librbd ibnbd ibnbd-nbd qemu-nbd)
for w in "${workloads[@]}"; do
  IFS='|' read -r wname wargs side <<<"$w"
  for target in "${targets[@]}"; do
    [ -z "$only" ] || [[ $target =~ ^($only)$ ]] || continue
    out="$work/$target-${wname// /_}.json"
    gw=$(gateways_of "$target")
    # shellcheck disable=SC2086
    g0=$(ticks $gw) o0=$(ticks "$osd_pid")
    rc=0
    # shellcheck disable=SC2046
    timeout -k 5 $((seconds + 60)) /usr/bin/time -f "%U %S" -o "$work/fio.time" fio --output-format=json --output="$out" \
      --name=bench $(engine_args "$target") $wargs --size=1G --time_based --runtime="$seconds" --ramp_time=1 \
      >"$work/fio.err" 2>&1 || rc=$?
    # shellcheck disable=SC2086
    g1=$(ticks $gw) o1=$(ticks "$osd_pid")
    if [ "$rc" != 0 ] || ! jq -e '.jobs[0]' "$out" >/dev/null 2>&1; then
      rows+=("$wname|$target|failed (fio exit $rc: $(tail -1 "$work/fio.err"))")
      continue
    fi
    # CPU over the whole fio run (ramp, setup and exit included) divided by the IOs of the ramp
    # and the measured run (fio's IOPS x their span): fio's from /usr/bin/time (its job
    # process and librbd's threads in it), the others' from /proc.
    fio_s=$(awk '{ print $1 + $2 }' "$work/fio.time")
    line=$(jq -r --arg s "$side" --argjson g "$(awk -v t=$((g1 - g0)) -v hz="$hz" 'BEGIN { print t / hz }')" \
      --argjson f "$fio_s" \
      --argjson o "$(awk -v t=$((o1 - o0)) -v hz="$hz" 'BEGIN { print t / hz }')" \
      '.jobs[0] as $j | $j[$s] as $d | ($d.iops * ($j.job_runtime / 1000 + 1)) as $span |
       "\($d.iops) \($d.bw_bytes / 1048576) \($d.lat_ns.mean / 1000) \(if $span > 0 then $f * 1e6 / $span else 0 end) \(if $span > 0 then $g * 1e6 / $span else 0 end) \(if $span > 0 then $o * 1e6 / $span else 0 end)"' "$out")
    read -r iops mibs mean cfio cgw cosd <<<"$line"
    iops_of[$wname/$target]=$iops
    rows+=("$wname|$target|$(printf '%.0f|%.1f|%.1f|%.0f|%.0f|%.0f' "$iops" "$mibs" "$mean" "$cfio" "$cgw" "$cosd")")
  done
done

ratio() {  # ratio WORKLOAD A B: IOPS of A / IOPS of B
  local a=${iops_of[$1/$2]:-} b=${iops_of[$1/$3]:-}
  [ -n "$a" ] && [ -n "$b" ] && awk -v a="$a" -v b="$b" 'BEGIN { if (b > 0) printf "%.2fx", a / b }'
}
echo
echo "bash bench/rbd.sh --seconds $seconds --server-poll $server_poll  ($(nproc) cores, load after: $(cut -d' ' -f1-3 /proc/loadavg), commit $(git -C "$top" rev-parse --short HEAD))"
echo
{
echo "| workload | target | IOPS | MiB/s | mean lat (us) | CPU us/IO fio | gateway | OSD | / librbd | / qemu-nbd |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for r in "${rows[@]}"; do
  IFS='|' read -r wname target rest <<<"$r"
  case "$rest" in failed*) echo "| $wname | $target | $rest | | | | | | | |"; continue ;; esac
  echo "| $wname | $target | ${rest//|/ | } | $(ratio "$wname" "$target" librbd) | $(ratio "$wname" "$target" qemu-nbd) |"
done
} | tee "$tmp/table.md"
bench_chart "$chart" rbd "$tmp/table.md" "bench/rbd.sh --seconds $seconds, $(date -u +%Y-%m-%d), commit $(git -C "$top" rev-parse --short HEAD 2>/dev/null)" \
  IOPS "mean lat (us)=mean latency (us)" "gateway=gateway CPU (us per IO)"
