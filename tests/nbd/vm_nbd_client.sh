#!/usr/bin/env bash
# The kernel's NBD client on a volume of ibnbd-server, mapped by ibnbd-client and exported over
# NBD: nbd-client connects /dev/nbdN to the export (unix socket; loopback tcp with two
# connections, which needs multi-conn), ext4 is made, mounted, written and checked, fio verifies
# through the filesystem and on the raw device while one IBNBD path is disconnected and
# reconnected. Needs the nbd module, so it runs inside the VM rig (ctest: vm_nbd_client_rdma,
# vm_nbd_client_tcp). TAP-like output; exit 1 when anything failed, 77 when something the test
# needs is absent.
#
#   bash tests/nbd/vm_nbd_client.sh BUILD_DIR
#   IBTRS_NBD_FABRIC=rdma (default) | tcp: how ibnbd-client reaches ibnbd-server (two paths
#   between the VM's veth0 and veth1 addresses)
set -u -o pipefail
fabric=${IBTRS_NBD_FABRIC:-rdma}

build=$(cd "${1:?usage: $0 BUILD_DIR}" && pwd) || exit 1
. "$(dirname "${BASH_SOURCE[0]}")/../lib/ibnbd_bins.sh"
. "$(dirname "${BASH_SOURCE[0]}")/../lib/tap.sh"
ibnbd_bins "$build"
for t in nbd-client jq fio mkfs.ext4 e2fsck sha256sum mountpoint; do
  command -v "$t" >/dev/null || { echo "1..0 # SKIP $t is missing (scripts/setup.sh installs it)"; exit 77; }
done
[ -b /dev/nbd0 ] && [ -b /dev/nbd1 ] || { echo "1..0 # SKIP no /dev/nbd0 and nbd1 (the nbd module: VM rig only)"; exit 77; }
[ -n "${IBTRS_RDMA_ADDR_A:-}" ] && [ -n "${IBTRS_RDMA_ADDR_B:-}" ] ||
  { echo "1..0 # SKIP needs the VM rig's veth addresses (IBTRS_RDMA_ADDR_A/B unset)"; exit 77; }
case "$fabric" in
  rdma | tcp) ;;
  *) echo "IBTRS_NBD_FABRIC: rdma or tcp, not '$fabric'" >&2; exit 2 ;;
esac

work=$(mktemp -d /var/tmp/ibnbd-vm-nbd.XXXXXX)
cd "$work" || exit 1  # fio's state files
pids=()
cleanup() {
  mountpoint -q "$work/mnt" && umount "$work/mnt"
  timeout 20 nbd-client -d /dev/nbd0 >/dev/null 2>&1
  timeout 20 nbd-client -d /dev/nbd1 >/dev/null 2>&1
  # Newest first: the client daemon unmaps (CLOSE) while the server still answers.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill "${pids[i]}" 2>/dev/null
    wait "${pids[i]}" 2>/dev/null
  done
  rm -rf "$work"
}
trap cleanup EXIT

must() {  # must NAME CMD...: like check_cmd, but nothing after it makes sense when it fails
  check_cmd "$@"
  [ "$failed" = 0 ] || { echo "# stopping: \"$1\" failed"; exit 1; }
}
# Every command that touches the block device is bounded: a hang fails the test, not the VM's
# timeout (TCG is slow: generous, still finite).
t() { timeout 120 "$@"; }

mkdir -p "$work/export" "$work/mnt"
truncate -s 128M "$work/export/vol.img"
ibnbd_auth "$work"
"$srv" --listen "$fabric:$IBTRS_RDMA_ADDR_B:0" --listen "$fabric:$IBTRS_RDMA_ADDR_B:0" "${srv_auth[@]}" \
  --dev-search-path "$work/export" --control-socket "$work/srv.sock" \
  --ready-file "$work/srv.ready" >"$work/srv.log" 2>&1 &
pids+=($!)
wait_for "$work/srv.ready" || { echo "not ok - server start: $(cat "$work/srv.log")"; exit 1; }
# The client's source address picks its own veth end (and Soft-RoCE device on rdma).
mapfile -t addrs < <(sed -n "s/^listening /$fabric:$IBTRS_RDMA_ADDR_A@/p" "$work/srv.ready")
"$cld" "${cld_auth[@]}" --control-socket "$work/cl.sock" --ready-file "$work/cl.ready" --hb-interval-ms 500 \
  --reconnect-delay-ms 200 >"$work/cl.log" 2>&1 &
pids+=($!)
wait_for "$work/cl.ready" || { echo "not ok - client start: $(cat "$work/cl.log")"; exit 1; }
c() { timeout 60 "$ibnbd" --socket "$work/cl.sock" client "$@"; }

# Case: map over two paths of $fabric and export over a unix socket and loopback tcp.
# Expect: both paths up, the export listed.
must "map over two $fabric paths" c device map vol.img from "${addrs[@]}" rw session s1
uu=$(c -f json session show s1 | jq -r '.[0].path_uu')
[ "$uu" = UU ] && ok "both paths up" || not_ok "both paths up" "path_uu $uu"
must "export" c device export vol.img unix "$work/vol.sock" tcp 127.0.0.1:0 insecure
port=$(c -f json device exports | jq -r '.[0].tcp' | sed 's/.*://')

# Case: the kernel client on the unix socket. Expect: /dev/nbd0 has the volume's size.
must "nbd-client -unix /dev/nbd0" t nbd-client -unix "$work/vol.sock" /dev/nbd0 -N vol.img -b 4096
size=$(blockdev --getsize64 /dev/nbd0 2>/dev/null)
[ "$size" = $((128 << 20)) ] && ok "/dev/nbd0 is 128 MiB" || not_ok "/dev/nbd0 size" "got '$size'"

# Case: ext4 on /dev/nbd0: mkfs, mount, files with known content, fio verify in the filesystem
# while a path is disconnected and reconnected, unmount, fsck, mount again.
# Expect: fsck clean, the files' sha256 unchanged after the remount, fio verify passes.
must "mkfs.ext4" t mkfs.ext4 -q -F /dev/nbd0
must "mount" t mount -t ext4 /dev/nbd0 "$work/mnt"
for i in 1 2 3; do head -c $((3 << 20)) /dev/urandom >"$work/f$i"; cp "$work/f$i" "$work/mnt/f$i"; done
(cd "$work" && sha256sum f1 f2 f3) >"$work/sums"
p0=$(c -f json path list s1 | jq -r '.[0].pathname')
t fio --name=fsverify --filename="$work/mnt/fio.dat" --size=24M --bs=16k --rw=randwrite \
  --ioengine=libaio --iodepth=8 --direct=1 --verify=crc32c --verify_fatal=1 --do_verify=1 \
  --output="$work/fio1.out" >/dev/null 2>&1 &
fio_pid=$!
sleep 1
kill -0 "$fio_pid" 2>/dev/null && ok "fio is running when the path goes down" ||
  not_ok "fio is running when the path goes down" "it finished within a second: the case tests nothing"
check_cmd "path disconnect during fio" c path disconnect s1 "$p0"
sleep 1
check_cmd "path reconnect during fio" c path reconnect s1 "$p0"
if wait "$fio_pid"; then ok "fio verify in ext4 across a path failure"; else not_ok "fio verify in ext4" "$(tail -5 "$work/fio1.out")"; fi
check_cmd "sync" t sync
check_cmd "umount" t umount "$work/mnt"
check_cmd "e2fsck clean" t e2fsck -fn /dev/nbd0
check_cmd "mount again" t mount -t ext4 /dev/nbd0 "$work/mnt"
(cd "$work/mnt" && sha256sum -c --quiet "$work/sums") >"$work/out" 2>&1 &&
  ok "files unchanged after remount" || not_ok "files unchanged after remount" "$(head -3 "$work/out")"
check_cmd "umount again" t umount "$work/mnt"
check_cmd "nbd-client -d /dev/nbd0" t nbd-client -d /dev/nbd0

# Case: the kernel client over loopback tcp with two connections (multi-conn), fio verify on
# the raw device with fsyncs (FLUSH), then a discard (TRIM). Expect: verify passes, no error.
must "nbd-client tcp -C 2 /dev/nbd1" t nbd-client 127.0.0.1 "$port" /dev/nbd1 -N vol.img -b 4096 -connections 2
t fio --name=rawverify --filename=/dev/nbd1 --size=32M --offset=64M --bs=64k --rw=randwrite \
  --ioengine=libaio --iodepth=16 --direct=1 --numjobs=1 --fsync=32 --verify=crc32c \
  --verify_fatal=1 --do_verify=1 --output="$work/fio2.out" >/dev/null 2>&1 &&
  ok "fio verify on /dev/nbd1 (2 connections)" || not_ok "fio verify on /dev/nbd1" "$(tail -5 "$work/fio2.out")"
check_cmd "blkdiscard through NBD TRIM" t blkdiscard -o $((64 << 20)) -l $((32 << 20)) /dev/nbd1
check_cmd "nbd-client -d /dev/nbd1" t nbd-client -d /dev/nbd1

# Case: the IBNBD side saw the IO of both kernel clients. Expect: bytes both ways, no error.
stats=$(c -f json device show vol.img | jq -r '.[0] | "\(.rx_bytes > 0) \(.tx_bytes > 0) \(.errors)"')
[ "$stats" = "true true 0" ] && ok "device stats: reads and writes, no error" || not_ok "device stats" "$(c device show vol.img)"
check_cmd "unexport" c device unexport vol.img
check_cmd "unmap" c device unmap vol.img

exit $failed
