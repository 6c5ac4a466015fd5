#!/usr/bin/env bash
# ibnbd-migrate over the rdma provider (Soft-RoCE in the VM rig), without QEMU (a nested TCG
# guest would take minutes): a synthetic migration stream (a valid QEVM head with the machine
# type and the VM uuid, then 1 MiB of random bytes, 2 MiB of zeroes, 29 MiB of random bytes) is
# saved from stdin over two rdma paths, listed (committed, machine type, uuid, the two zero
# pieces elided), verified, and restored to stdout byte for byte; then one byte of the second
# stored chunk is flipped in the server's file: verify and restore fail naming that piece
# (piece 3: pieces 1 and 2 were zero and are not stored). TAP-like output; exit 1 when anything
# failed, 77 when something the test needs is absent.
#
#   tests/vm/run-in-vm.sh -- bash tests/migrate/vm_migrate_rdma.sh BUILD_DIR   (ctest: vm_migrate_rdma)
#   IBTRS_MIG_FABRIC=tcp (default rdma), with IBTRS_RDMA_ADDR_A=B=127.0.0.1: the same on a host
set -u -o pipefail
fabric=${IBTRS_MIG_FABRIC:-rdma}

build=$(cd "${1:?usage: $0 BUILD_DIR}" && pwd) || exit 1
. "$(dirname "${BASH_SOURCE[0]}")/../lib/ibnbd_bins.sh"
. "$(dirname "${BASH_SOURCE[0]}")/../lib/tap.sh"
ibnbd_bins "$build"
agent=$build/client/migrate/ibnbd-migrate
[ -x "$agent" ] || { echo "1..0 # SKIP $agent not built"; exit 77; }
[ -n "${IBTRS_RDMA_ADDR_A:-}" ] && [ -n "${IBTRS_RDMA_ADDR_B:-}" ] ||
  { echo "1..0 # SKIP needs the VM rig's veth addresses (IBTRS_RDMA_ADDR_A/B unset)"; exit 77; }
command -v sha256sum >/dev/null || { echo "1..0 # SKIP sha256sum is missing"; exit 77; }

work=$(mktemp -d /var/tmp/ibnbd-vm-mig.XXXXXX)
pids=()
cleanup() {
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill "${pids[i]}" 2>/dev/null
    wait "${pids[i]}" 2>/dev/null
  done
  rm -rf "$work"
}
trap cleanup EXIT
# Every agent run is bounded: a hang fails the case, not the VM's timeout.
t() { timeout 120 "$@"; }

mkdir -p "$work/export"
truncate -s 256M "$work/export/images.img"
ibnbd_auth "$work"
"$srv" --listen "$fabric:$IBTRS_RDMA_ADDR_B:0" --listen "$fabric:$IBTRS_RDMA_ADDR_B:0" "${srv_auth[@]}" \
  --dev-search-path "$work/export" --control-socket "$work/srv.sock" \
  --ready-file "$work/srv.ready" >"$work/srv.log" 2>&1 &
pids+=($!)
wait_for "$work/srv.ready" || { echo "not ok - server start: $(cat "$work/srv.log")"; exit 1; }
# The source address picks veth0's Soft-RoCE device (rxe0); the server listens on rxe1's.
mapfile -t paths < <(sed -n "s/^listening /$fabric:$IBTRS_RDMA_ADDR_A@/p" "$work/srv.ready")
[ "${#paths[@]}" = 2 ] || { echo "not ok - two $fabric listeners: $(cat "$work/srv.ready")"; exit 1; }
m() { t "$agent" "$1" images.img from "${paths[@]}" host-key "$host_key" "${@:2}"; }

# The stream: QEVM, version 3, QEMU_VM_CONFIGURATION with the machine type, the uuid subsection
# (what parse_stream_identity reads), then the body.
uuid_hex=0123456789abcdeffedcba9876543210
{
  printf 'QEVM\x00\x00\x00\x03\x07\x00\x00\x00\x0dpc-i440fx-7.2'
  printf '\x05\x12configuration/uuid\x00\x00\x00\x01'
  printf '\x01\x23\x45\x67\x89\xab\xcd\xef\xfe\xdc\xba\x98\x76\x54\x32\x10'
} >"$work/head.bin"
head_len=$(stat -c %s "$work/head.bin")
{
  cat "$work/head.bin"
  head -c $((1048576 - head_len)) /dev/urandom
  head -c $((2 << 20)) /dev/zero
  head -c $((29 << 20)) /dev/urandom
} >"$work/stream.bin"
want=$(sha256sum <"$work/stream.bin" | cut -d' ' -f1)

# Case: save from stdin over two rdma paths. Expect: exit 0, the "saved" line.
if m save image r1 <"$work/stream.bin" >"$work/out" 2>"$work/err"; then
  ok "save 32 MiB from stdin over $fabric"
else
  not_ok "save over $fabric" "exit $?: $(tail -3 "$work/err")"
fi

# Case: list. Expect: r1 committed, the stream's length, 2 zero pieces, machine type and uuid.
m list >"$work/list" 2>"$work/err"
read -r _ state bytes _ zero machine uuid _ < <(grep '^r1 ' "$work/list")
[ "${state:-}" = committed ] && [ "${bytes:-}" = $((32 << 20)) ] && [ "${zero:-}" = 2 ] &&
  [ "${machine:-}" = pc-i440fx-7.2 ] && [ "${uuid//-/}" = "$uuid_hex" ] &&
  ok "list: committed, 32 MiB, 2 zero pieces, machine type and uuid from the stream" ||
  not_ok "list" "$(cat "$work/list" "$work/err")"

# Case: verify, restore to stdout. Expect: ok; the same sha256.
check_cmd "verify over $fabric" m verify image r1
got=$(m restore image r1 2>"$work/err" | sha256sum | cut -d' ' -f1)
[ "$got" = "$want" ] && ok "restore to stdout: sha256 equal" || not_ok "restore sha256" "$got != $want: $(tail -3 "$work/err")"

# Case: one byte of stored chunk 1 (piece 3) flipped in the server's file. The first image's
# extent starts at 1 MiB and its data 1 MiB into it: stored chunk k at (2 + k) MiB.
# Expect: verify and restore fail, both naming piece 3 and the CRC mismatch.
off=$((3 * 1048576 + 777))
b=$(od -An -tu1 -j "$off" -N1 "$work/export/images.img" | tr -d ' ')
printf "\\x$(printf %02x $((b ^ 0x40)))" | dd of="$work/export/images.img" bs=1 seek="$off" conv=notrunc status=none
if m verify image r1 >"$work/out" 2>"$work/err"; then
  not_ok "verify finds the flipped byte" "verify passed"
else
  grep -q "piece 3 .*CRC32C mismatch" "$work/err" && ok "verify names piece 3 (CRC32C mismatch)" ||
    not_ok "verify names the piece" "$(cat "$work/err")"
fi
m restore image r1 >"$work/restored" 2>"$work/err"
rc=$?
[ "$rc" != 0 ] && grep -q "piece 3 .*CRC32C mismatch" "$work/err" &&
  [ "$(stat -c %s "$work/restored")" -le $((3 << 20)) ] &&
  ok "restore stops at piece 3 before handing its bytes out" ||
  not_ok "restore refuses the corrupt piece" "exit $rc, $(stat -c %s "$work/restored") bytes out: $(tail -2 "$work/err")"

exit "$failed"
