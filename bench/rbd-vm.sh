#!/usr/bin/env bash
# The kernel-facing half of bench/rbd.sh, run inside the VM rig (tests/vm: Debian's 6.12 kernel
# under TCG, Soft-RoCE rxe0 -> rxe1 over a veth pair, ublk_drv, nbd): an RBD image as a block
# device through rbd-nbd (Ceph's own NBD gateway: librbd in a daemon, the kernel's NBD client in
# front) against the same image through ibnbd-server's rbd backend and the client daemon's ublk
# device. One VM boot, one single-host Ceph cluster inside the guest (scripts/ceph-dev.sh: mon and
# a memstore OSD, cephx on, no mgr), one table. Rows (each on an image of its own, filled once,
# so that no two rows trade the image's exclusive lock):
#   rbd-nbd          `rbd-nbd map` -> /dev/nbdN, fio io_uring O_DIRECT on it: the peer
#   ibnbd-ublk-tcp   ibnbd-server (rbd backend) on 198.18.0.2, the client daemon maps the image
#                    over one tcp path from 198.18.0.1 with --ublk, fio io_uring O_DIRECT on
#                    /dev/ublkbN
#   ibnbd-ublk-rdma  the same over one rdma path (rxe)
# Workloads: 4 KiB randread / randwrite at QD1 and QD32, 1 MiB sequential read / write at QD8,
# one job. Under TCG the OSD, librbd and the kernel are all emulated: absolute figures are far
# below a host's and only the ratios against rbd-nbd, taken side by side in one boot, mean
# anything (the issue asks for the ratio only). A benchmark, not a test: it asserts nothing.
#
#   bash bench/rbd-vm.sh [--seconds N] [--image-mb N]   (default 3 s per run, 128 MiB images;
#                                                         18 runs, ~5 minutes with the boot)
#
# The build directory comes from $IBTRS_BUILD (default build, with -DIBTRS_RDMA=ON and librbd).
# Skips (exit 0, reason printed) without rbd-nbd or Ceph. Addresses: the VM's private
# 198.18.0.1 -> 198.18.0.2 pair, the guest's loopback (the cluster) and unix sockets only.
set -uo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
seconds=3
image_mb=128
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --image-mb) image_mb=$2; shift 2 ;;
    *) echo "usage: $0 [--seconds N] [--image-mb N]" >&2; exit 2 ;;
  esac
done
for v in "$seconds" "$image_mb"; do
  case "$v" in '' | *[!0-9]* | 0) echo "--seconds and --image-mb take whole numbers above 0" >&2; exit 2 ;; esac
done
build=$(cd "${IBTRS_BUILD:-$top/build}" && pwd)
srv=$build/server/ibnbd-server
cld=$build/client/daemon/ibnbd-client
cli=$build/client/cli/ibnbd

if [ "${IBTRS_VM:-}" != 1 ]; then
  for t in rbd-nbd ceph-mon ceph-osd rbd; do
    command -v "$t" >/dev/null || { echo "skip: $t is missing (scripts/setup.sh installs it)"; exit 0; }
  done
  ninja -C "$build" ibnbd-server ibnbd-client ibnbd >/dev/null || { echo "build failed" >&2; exit 1; }
  grep -q '^IBNBD_RBD:STRING=OFF' "$build/CMakeCache.txt" && { echo "skip: the build has IBNBD_RBD=OFF"; exit 0; }
  # The memstore OSD keeps the images in its memory (~3x their size with its overhead), the
  # guest's tmpfs the cluster's files: 3 GiB covers three 128 MiB images.
  exec bash "$top/tests/vm/run-in-vm.sh" --timeout 1500 --mem 3072 --env IBTRS_BUILD="$build" -- \
    bash "$top/bench/rbd-vm.sh" --seconds "$seconds" --image-mb "$image_mb"
fi

for t in fio jq rbd-nbd; do
  command -v "$t" >/dev/null || { echo "$t is missing (scripts/setup.sh installs it)" >&2; exit 1; }
done
[ -e /dev/ublk-control ] || { echo "no /dev/ublk-control in the VM" >&2; exit 1; }
A=$IBTRS_RDMA_ADDR_A
B=$IBTRS_RDMA_ADDR_B
tmp=$(mktemp -d /tmp/ibnbd-rbd-vm.XXXXXX)  # the VM's overlay: RAM (memstore needs no O_DIRECT)
pids=()
nbd_dev=""
cleanup() {
  [ -z "$nbd_dev" ] || timeout 30 rbd-nbd unmap "$nbd_dev" >/dev/null 2>&1
  # Newest first; TERM makes the client daemon delete its ublk devices and unmap.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill "${pids[i]}" 2>/dev/null
    timeout 60 tail --pid="${pids[i]}" -f /dev/null 2>/dev/null
  done
  timeout 60 bash "$top/scripts/ceph-dev.sh" stop "$tmp/ceph" >/dev/null 2>&1
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
cd "$tmp"  # fio's state files

wait_file() { for _ in $(seq 600); do [ -e "$1" ] && return 0; sleep 0.1; done; return 1; }
started() { echo "$1 did not start:" >&2; tail -5 "$2" >&2; exit 1; }
c() { timeout 120 "$cli" --socket "$tmp/cl.sock" client "$@"; }

t0=$(date +%s)
bash "$top/scripts/ceph-dev.sh" start "$tmp/ceph" --osd-mb $((image_mb * 3 + 256)) --no-mgr \
  >"$tmp/ceph.env" 2>"$tmp/ceph.err" || started "the Ceph cluster" "$tmp/ceph.err"
export CEPH_CONF=$tmp/ceph/ceph.conf
keyring=$tmp/ceph/ceph.client.admin.keyring
echo "# cluster up in the guest in $(($(date +%s) - t0)) s"
for img in n t r; do
  timeout 300 rbd create "rbd/img-$img" --size "${image_mb}M" &&
    timeout 600 rbd bench --io-type write --io-size 4M --io-threads 2 --io-total "${image_mb}M" \
      --io-pattern seq "rbd/img-$img" >/dev/null ||
    { echo "creating and filling rbd/img-$img failed" >&2; exit 1; }
done
echo "# images filled after $(($(date +%s) - t0)) s"

timeout 120 rbd-nbd map rbd/img-n --id admin >"$tmp/rbd-nbd.out" 2>"$tmp/rbd-nbd.log" ||
  started rbd-nbd "$tmp/rbd-nbd.log"
nbd_dev=$(tail -1 "$tmp/rbd-nbd.out")
[ -b "$nbd_dev" ] || { echo "rbd-nbd map gave '$nbd_dev'" >&2; exit 1; }

# --allow-any-host (the server warns): IO is what is measured here, and authentication costs
# only at connect (docs/security.d/auth-bench.md).
cat >"$tmp/srv.json" <<EOF
{"rbd": {"conf": "$CEPH_CONF", "client_id": "admin", "keyring": "$keyring"}}
EOF
"$srv" --config "$tmp/srv.json" --allow-any-host --listen "rdma:$B:0" --listen "tcp:$B:0" \
  --dev-search-path "$tmp" --control-socket "$tmp/srv.sock" --ready-file "$tmp/srv.ready" >"$tmp/srv.log" 2>&1 &
pids+=($!)
wait_file "$tmp/srv.ready" || started ibnbd-server "$tmp/srv.log"
rdma_path=$(sed -n "s/^listening \(rdma:.*\)/rdma:$A@\1/p" "$tmp/srv.ready" | head -1)
tcp_path=$(sed -n 's/^listening \(tcp:.*\)/\1/p' "$tmp/srv.ready" | head -1)
"$cld" --control-socket "$tmp/cl.sock" --ready-file "$tmp/cl.ready" --state-dir "$tmp/state" \
  >"$tmp/cl.log" 2>&1 &
pids+=($!)
wait_file "$tmp/cl.ready" || started ibnbd-client "$tmp/cl.log"
c device map rbd:rbd/img-t from "$tcp_path" rw session t --ublk >/dev/null || started "map (tcp)" "$tmp/cl.log"
c device map rbd:rbd/img-r from "$rdma_path" rw session r --ublk >/dev/null || started "map (rdma)" "$tmp/cl.log"
ublk_t=$(c -f json device show rbd:rbd/img-t | jq -r '.[0].ublk')
ublk_r=$(c -f json device show rbd:rbd/img-r | jq -r '.[0].ublk')
[ -b "$ublk_t" ] && [ -b "$ublk_r" ] || { echo "no ublk devices ('$ublk_t', '$ublk_r')" >&2; exit 1; }

targets="rbd-nbd ibnbd-ublk-tcp ibnbd-ublk-rdma"
dev_of() {
  case "$1" in
    rbd-nbd) echo "$nbd_dev" ;;
    ibnbd-ublk-tcp) echo "$ublk_t" ;;
    ibnbd-ublk-rdma) echo "$ublk_r" ;;
  esac
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a != "" && b != "" && b > 0) printf "%.2f", a / b; else print "" }'; }

declare -A iops_of lat_of
rows=()
run_no=0
run() {  # run WORKLOAD TARGET RW BS QD
  local workload=$1 target=$2 rw=$3 bs=$4 qd=$5
  run_no=$((run_no + 1))
  local out="$tmp/run-$run_no.json" rc=0
  timeout -k 5 $((seconds + 120)) fio --name="r$run_no" --ioengine=io_uring --direct=1 \
    --filename="$(dev_of "$target")" --rw="$rw" --bs="$bs" --iodepth="$qd" \
    --iodepth_batch_submit="$qd" --iodepth_batch_complete_max="$qd" --size="${image_mb}M" \
    --time_based --runtime="$seconds" --ramp_time=1 \
    --output-format=json --output="$out" >"$tmp/run-$run_no.log" 2>&1 || rc=$?
  if [ "$rc" != 0 ] || ! jq -e '.jobs[0]' "$out" >/dev/null 2>&1; then
    rows+=("$workload|$target|failed (exit $rc)")
    tail -3 "$tmp/run-$run_no.log" >&2
    return 0
  fi
  local side=read
  case "$rw" in *write*) side="write" ;; esac
  local iops mibs mean p99 err
  read -r iops mibs mean p99 err <<<"$(jq -r --arg s "$side" '.jobs[0] as $j | $j[$s] as $d |
    "\($d.iops) \($d.bw_bytes / 1048576) \($d.lat_ns.mean / 1000) \(($d.clat_ns.percentile["99.000000"] // 0) / 1000) \($j.error)"' "$out")"
  iops_of[$workload/$target]=$iops
  lat_of[$workload/$target]=$mean
  rows+=("$workload|$target|$(printf '%.0f|%.1f|%.0f|%.0f' "$iops" "$mibs" "$mean" "$p99")|$err")
}

start=$(date +%s)
workloads=("4k randread qd1:randread:4k:1" "4k randread qd32:randread:4k:32"
  "4k randwrite qd1:randwrite:4k:1" "4k randwrite qd32:randwrite:4k:32"
  "1m read qd8:read:1m:8" "1m write qd8:write:1m:8")
for row in "${workloads[@]}"; do
  IFS=: read -r workload rw bs qd <<<"$row"
  for target in $targets; do
    run "$workload" "$target" "$rw" "$bs" "$qd"
  done
done

echo "# RBD as a block device in the VM rig ($(date -u +%Y-%m-%d), $(uname -r) under TCG, $(nproc) vCPUs)"
echo
echo "fio $(fio --version | sed 's/^fio-//'), io_uring O_DIRECT, one job, ${seconds} s per run after 1 s of ramp,"
echo "${image_mb} MiB images on a memstore OSD in the guest; rows: the header of bench/rbd-vm.sh."
echo "Ratios: IOPS and mean latency against rbd-nbd (Ceph's NBD gateway through the kernel's NBD client)."
echo
echo "| workload | target | IOPS | MiB/s | mean us | p99 us | IOPS vs rbd-nbd | lat vs rbd-nbd |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
for r in "${rows[@]}"; do
  IFS='|' read -r workload target iops mibs mean p99 err <<<"$r"
  if [ -z "$mibs" ]; then
    echo "| $workload | $target | $iops | | | | | |"
    continue
  fi
  rk=$(ratio "$iops" "${iops_of[$workload/rbd-nbd]:-}")
  [ "$err" = 0 ] || rk="$rk (fio error $err)"
  echo "| $workload | $target | $iops | $mibs | $mean | $p99 | $rk |" \
    "$(ratio "${lat_of[$workload/$target]}" "${lat_of[$workload/rbd-nbd]:-}") |"
done
echo
echo "the run took $(($(date +%s) - start)) s"
