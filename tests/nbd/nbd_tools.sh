#!/usr/bin/env bash
# Real NBD clients against a volume of ibnbd-server, mapped by ibnbd-client and exported over
# NBD (a unix socket and loopback tcp) through the `ibnbd` CLI: nbdinfo, nbdcopy, qemu-img,
# nbdfuse + a loop device with ext4 on it, fio's nbd engine, and hostile input (bash and python
# sockets) while a good client keeps working. TAP-like output ("ok - NAME" / "not ok - NAME:
# why"); exit 1 when anything failed, 77 when a tool is missing (scripts/setup.sh installs
# them all, so CI never skips).
#
#   bash tests/nbd/nbd_tools.sh BUILD_DIR        (ctest: nbd_tools)
set -u -o pipefail

build=$(cd "${1:?usage: $0 BUILD_DIR}" && pwd) || exit 1
. "$(dirname "${BASH_SOURCE[0]}")/../lib/ibnbd_bins.sh"
. "$(dirname "${BASH_SOURCE[0]}")/../lib/tap.sh"
ibnbd_bins "$build"
for t in nbdinfo nbdcopy nbdfuse qemu-img fio jq python3 sha256sum cmp mkfs.ext4 fsck.ext4 losetup fusermount3; do
  command -v "$t" >/dev/null || { echo "1..0 # SKIP $t is missing (scripts/setup.sh installs it)"; exit 77; }
done

work=$(mktemp -d /var/tmp/ibnbd-nbd-test.XXXXXX)
cd "$work" || exit 1  # fio and friends write their state files into the current directory
pids=()
loopdev=""
cleanup() {
  mountpoint -q "$work/mnt" 2>/dev/null && umount "$work/mnt"
  [ -n "$loopdev" ] && losetup -d "$loopdev" 2>/dev/null
  mountpoint -q "$work/fuse" 2>/dev/null && fusermount3 -u "$work/fuse"
  # Newest first: the client daemon unmaps (CLOSE) while the server still answers.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill "${pids[i]}" 2>/dev/null
    wait "${pids[i]}" 2>/dev/null
  done
  rm -rf "$work"
}
trap cleanup EXIT

# Every client command is bounded: a hung NBD client must fail the test, not stall it.
t() { timeout 30 "$@"; }

mkdir -p "$work/export" "$work/fuse" "$work/mnt"
truncate -s 64M "$work/export/a.img"
truncate -s 8M "$work/export/ro.img"
ibnbd_auth "$work"
"$srv" --listen tcp:127.0.0.1:0 "${srv_auth[@]}" --dev-search-path "$work/export" --control-socket "$work/srv.sock" \
  --ready-file "$work/srv.ready" >"$work/srv.log" 2>&1 &
srv_pid=$!
pids+=($!)
wait_for "$work/srv.ready" || { echo "not ok - server start: $(cat "$work/srv.log")"; exit 1; }
addr=$(sed -n 's/^listening //p' "$work/srv.ready" | head -1)
"$cld" "${cld_auth[@]}" --control-socket "$work/cl.sock" --ready-file "$work/cl.ready" >"$work/cl.log" 2>&1 &
cld_pid=$!
pids+=($!)
wait_for "$work/cl.ready" || { echo "not ok - client start: $(cat "$work/cl.log")"; exit 1; }
c() { "$ibnbd" --socket "$work/cl.sock" client "$@"; }

# Case: map and export over a unix socket and loopback tcp (port 0), tcp without the word
# insecure first. Expect: that is refused (EPERM: no TLS, any local user could connect); with
# insecure the daemon answers with the real port; device list shows both addresses; the unix
# socket is owner-only (srwx------ less the umask: 0600).
check_cmd "map a.img" c device map a.img from "$addr" rw
c device export a.img unix "$work/a.sock" tcp 127.0.0.1:0 >"$work/out" 2>"$work/err"
rc=$?
[ "$rc" = 1 ] && grep -q insecure "$work/err" && ok "tcp without 'insecure' is refused (EPERM)" ||
  not_ok "tcp without 'insecure' is refused" "exit $rc: $(tail -1 "$work/err")"
[ ! -e "$work/a.sock" ] && ok "a refused export leaves no socket" || not_ok "a refused export leaves no socket" "$(ls -l "$work/a.sock")"
check_cmd "export over unix and tcp" c -f json device export a.img unix "$work/a.sock" tcp 127.0.0.1:0 insecure
mode=$(stat -c %a "$work/a.sock")
[ "$mode" = 600 ] && ok "the unix socket is owner-only" || not_ok "the unix socket is owner-only" "mode $mode"
port=$(c -f json device exports | jq -r '.[0].tcp' | sed 's/.*://')
sock=$work/a.sock
unix_uri="nbd+unix:///a.img?socket=$sock"
tcp_uri="nbd://127.0.0.1:$port/a.img"
[ -n "$port" ] && [ "$port" != 0 ] && ok "tcp port $port" || not_ok "tcp port" "got '$port'"
c -f json device list | jq -e '.[0].nbd | test("unix:.*tcp:127.0.0.1:")' >/dev/null &&
  ok "device list shows the export" || not_ok "device list shows the export" "$(c device list)"
expect_fail() {  # expect_fail NAME ERRNO CMD...
  local name=$1 want=$2 rc
  shift 2
  "$@" >"$work/out" 2>"$work/err"
  rc=$?
  [ "$rc" = "$want" ] && ok "$name" || not_ok "$name" "exit $rc, want $want: $(tail -1 "$work/err")"
}
expect_fail "a second export of the device is EEXIST" 17 c device export a.img tcp 0 insecure
expect_fail "a non-loopback address needs 'remote' (EPERM)" 1 c device export a.img tcp 0.0.0.0:0 insecure
expect_fail "a bad tcp address is EINVAL" 22 c device export a.img tcp nowhere:1 insecure
expect_fail "export of an unmapped device is ENOENT" 2 c device export nothing.img tcp 0 insecure
expect_fail "a mode beyond 0777 is EINVAL" 22 c device export a.img unix "$work/b.sock" mode 1777
expect_fail "an unknown group is EINVAL" 22 c device export a.img unix "$work/b.sock" group no-such-group-13

# Case: nbdinfo over both sockets. Expect: the size and the block sizes of the device.
for uri in "$unix_uri" "$tcp_uri"; do
  if t nbdinfo --json "$uri" >"$work/info.json" 2>"$work/err"; then
    got=$(jq -r '.exports[0] | "\(."export-size") \(.block_size_minimum) \(.block_size_preferred) \(.block_size_maximum) \(.can_multi_conn) \(.can_flush) \(.can_fua)"' "$work/info.json")
    want="$((64 << 20)) 512 4096 $((32 << 20)) true true true"
    [ "$got" = "$want" ] && ok "nbdinfo ${uri%%:*}: size and block sizes" || not_ok "nbdinfo ${uri%%:*}" "got '$got', want '$want'"
  else
    not_ok "nbdinfo ${uri%%:*}" "$(cat "$work/err")"
  fi
done
t nbdinfo --list "nbd+unix:///?socket=$sock" 2>&1 | grep -q 'export="a.img"' &&
  ok "nbdinfo --list names the export" || not_ok "nbdinfo --list" "$(t nbdinfo --list "nbd+unix:///?socket=$sock" 2>&1 | head -3)"

# Case: the kernel client's userspace half lists exports (NBD_OPT_LIST; transmission needs the
# nbd module, which only the VM rig has). Expect: the export's name.
if command -v nbd-client >/dev/null; then
  t nbd-client -l 127.0.0.1 "$port" 2>&1 | grep -qx "a.img" && ok "nbd-client -l lists the export" ||
    not_ok "nbd-client -l" "$(t nbd-client -l 127.0.0.1 "$port" 2>&1 | head -3)"
fi

# Case: nbdcopy of random data into the export (unix) and back out (tcp), with multi-conn.
# Expect: the same sha256.
head -c 48M /dev/urandom >"$work/in.bin"
check_cmd "nbdcopy into the export" t nbdcopy --connections=4 "$work/in.bin" "$unix_uri"
if t nbdcopy --connections=4 "$tcp_uri" "$work/out.bin" 2>"$work/err"; then
  [ "$(head -c 48M "$work/out.bin" | sha256sum)" = "$(sha256sum <"$work/in.bin")" ] &&
    ok "nbdcopy out of the export: same sha256" || not_ok "nbdcopy out of the export" "sha256 differs"
else
  not_ok "nbdcopy out of the export" "$(cat "$work/err")"
fi

# Case: qemu-img convert (raw) into the export and out of it; the image is half random, half
# zeroes, so qemu zeroes through WRITE_ZEROES. Expect: cmp finds no difference.
head -c 32M /dev/urandom >"$work/img.raw"
truncate -s 64M "$work/img.raw"
check_cmd "qemu-img convert into the export (nbd:unix:)" t qemu-img convert -n -f raw -O raw "$work/img.raw" "nbd:unix:$sock:exportname=a.img"
check_cmd "qemu-img convert out of the export (nbd://)" t qemu-img convert -f raw -O raw "$tcp_uri" "$work/back.raw"
check_cmd "qemu-img: cmp" cmp "$work/img.raw" "$work/back.raw"

# Case: a 1 GiB sparse volume with 3 MiB of data at three offsets (0, 300 MiB, the last MiB),
# mapped ro and exported (BLOCK_STATUS: the server's SEEK_DATA/SEEK_HOLE through the protocol to
# NBD's base:allocation). Expect: nbdinfo --map shows exactly 3 MiB of data and the rest as
# hole,zero; nbdcopy and qemu-img convert -n copy it to sparse files byte-equal (cmp) that stay
# sparse (du under 16 MiB); the server read about the data only (under 32 MiB, not 1 GiB, for
# both copies): the holes were skipped, not read.
truncate -s 1G "$work/export/sparse.img"
for mib in 0 300 1023; do
  head -c 1M /dev/urandom | dd of="$work/export/sparse.img" bs=1M seek=$mib conv=notrunc status=none
done
srv_read() {  # bytes the server sent of sparse.img (tx: its READ data)
  "$ibnbd" --socket "$work/srv.sock" server -f json device list |
    jq '[.[] | select(.device | test("sparse.img")) | .tx_bytes] | add'
}
check_cmd "map sparse.img ro" c device map sparse.img from "$addr" ro
check_cmd "export sparse.img" c device export sparse.img unix "$work/sparse.sock"
suri="nbd+unix:///sparse.img?socket=$work/sparse.sock"
if t nbdinfo --map "$suri" >"$work/map.txt" 2>"$work/err"; then
  got=$(awk '$3 == 0 {d += $2} $3 == 3 {h += $2} END {print d + 0, h + 0}' "$work/map.txt")
  want="$((3 << 20)) $(((1 << 30) - (3 << 20)))"
  [ "$got" = "$want" ] && ok "nbdinfo --map: 3 MiB data, the rest hole,zero" ||
    not_ok "nbdinfo --map" "data/hole bytes '$got', want '$want': $(head -5 "$work/map.txt")"
else
  not_ok "nbdinfo --map" "$(cat "$work/err")"
fi
read0=$(srv_read)
sparse_copy() {  # sparse_copy NAME FILE: byte-equal to the server's file and sparse
  if ! cmp -s "$work/export/sparse.img" "$2"; then not_ok "$1: byte-equal" "cmp differs"; return; fi
  local kib
  kib=$(du -k "$2" | cut -f1)
  [ "$kib" -lt 16384 ] && ok "$1: byte-equal, the copy stays sparse (${kib} KiB)" ||
    not_ok "$1: the copy stays sparse" "du ${kib} KiB"
}
rm -f "$work/sparse.nbdcopy"
check_cmd "nbdcopy of the sparse volume" t nbdcopy "$suri" "$work/sparse.nbdcopy"
sparse_copy "nbdcopy" "$work/sparse.nbdcopy"
truncate -s 1G "$work/sparse.qemu"
check_cmd "qemu-img convert -n of the sparse volume" t qemu-img convert -n -f raw -O raw \
  "nbd:unix:$work/sparse.sock:exportname=sparse.img" "$work/sparse.qemu"
sparse_copy "qemu-img convert -n" "$work/sparse.qemu"
read1=$(srv_read)
# At least the data of both copies (the counter counts), well under one 1 GiB read.
read=$((${read1:-0} - ${read0:-0}))
[ "$read" -ge $((6 << 20)) ] && [ "$read" -lt $((32 << 20)) ] &&
  ok "the server read $((read >> 10)) KiB for two copies of 1 GiB: the holes were skipped" ||
  not_ok "the holes were skipped" "the server read $read bytes ('$read0' -> '$read1')"
rm -f "$work/sparse.nbdcopy" "$work/sparse.qemu"
check_cmd "unmap sparse.img" c device unmap sparse.img

# Case: nbdfuse exposes the export as a file; losetup makes it a real /dev/loopN; ext4 on it,
# files written, unmounted, fsck. Expect: files read back the same after a remount, fsck clean.
if [ ! -e /dev/loop-control ] || [ ! -e /dev/fuse ]; then
  echo "ok - nbdfuse + loop device # SKIP no /dev/loop-control or /dev/fuse here"
else
  t nbdfuse -P "$work/fuse.pid" "$work/fuse/disk" --unix "$sock" >"$work/fuse.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do [ -s "$work/fuse.pid" ] && break; sleep 0.1; done
  if loopdev=$(losetup -f --show "$work/fuse/disk" 2>"$work/err"); then
    ok "losetup on the nbdfuse file ($loopdev)"
    check_cmd "mkfs.ext4 on $loopdev" mkfs.ext4 -q -F "$loopdev"
    check_cmd "mount" mount "$loopdev" "$work/mnt"
    for i in 1 2 3; do head -c $((i * 3))M /dev/urandom >"$work/f$i"; cp "$work/f$i" "$work/mnt/f$i"; done
    check_cmd "umount" umount "$work/mnt"
    check_cmd "fsck clean" fsck.ext4 -fn "$loopdev"
    check_cmd "mount again" mount -o ro "$loopdev" "$work/mnt"
    same_files() { for i in 1 2 3; do cmp "$work/f$i" "$work/mnt/f$i" || return 1; done; }
    check_cmd "files read back the same" same_files
    umount "$work/mnt"
    losetup -d "$loopdev" && loopdev=""
  else
    not_ok "losetup on the nbdfuse file" "$(cat "$work/err") $(cat "$work/fuse.log")"
  fi
  fusermount3 -u "$work/fuse" 2>/dev/null
fi

# Case: fio's nbd engine (one connection per job) over both sockets, random writes verified
# with crc32c. Expect: no error.
for uri in "$unix_uri" "$tcp_uri"; do
  check_cmd "fio ioengine=nbd ${uri%%:*}, verify=crc32c" t fio --name=v --ioengine=nbd --uri="$uri" \
    --rw=randwrite --bs=4k --size=16M --offset=16M --iodepth=16 --verify=crc32c --do_verify=1 \
    --verify_fatal=1 --verify_state_save=0 --output="$work/fio.out"
done

# Case: hostile input while fio verifies 32 MiB over tcp: garbage instead of a handshake (bash
# /dev/tcp and python), a WRITE larger than the maximum payload, reads and writes out of range.
# Expect: clean protocol errors or a closed connection for the offender, fio unaffected, the
# export still answers.
t fio --name=bg --ioengine=nbd --uri="$tcp_uri" --rw=write --bs=64k --size=32M --iodepth=8 \
  --verify=crc32c --do_verify=1 --verify_fatal=1 --verify_state_save=0 --output="$work/bg.out" &
bg=$!
if timeout 10 bash -c "exec 3<>/dev/tcp/127.0.0.1/$port; printf 'GET / HTTP/1.0\r\n\r\n' >&3; cat <&3 >/dev/null"; then
  ok "bash: garbage handshake is closed by the server"
else
  not_ok "bash: garbage handshake" "the connection stayed open"
fi
size=$((64 << 20))
timeout 30 python3 - "$sock" "$size" >"$work/py.out" 2>&1 <<'EOF'
import os, socket, struct, sys
path, size = sys.argv[1], int(sys.argv[2])
OPT, REQ, SIMPLE = 0x49484156454F5054, 0x25609513, 0x67446698

def conn():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    return s

def recv(s, n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise EOFError
        b += c
    return b

def closed(s):
    try:
        while s.recv(65536):
            pass
        return True
    except (ConnectionResetError, EOFError):
        return True
    except socket.timeout:
        return False

def go(s):
    assert recv(s, 18)[:8] == b"NBDMAGIC"
    s.sendall(struct.pack(">I", 3))
    s.sendall(struct.pack(">QII", OPT, 7, 6) + b"\0\0\0\0\0\0")
    while True:
        magic, opt, typ, ln = struct.unpack(">QIII", recv(s, 20))
        recv(s, ln)
        if typ == 1:
            return
        assert typ == 3, hex(typ)

def request(s, typ, off, ln, data=b""):
    s.sendall(struct.pack(">IHHQQI", REQ, 0, typ, 0xabc, off, ln) + data)

def reply(s, ln=0):
    magic, err, handle = struct.unpack(">IIQ", recv(s, 16))
    assert magic == SIMPLE and handle == 0xabc
    if err == 0 and ln:
        recv(s, ln)
    return err

def case(name, cond):
    print(("ok - " if cond else "not ok - ") + "python: " + name)

s = conn()
s.sendall(os.urandom(4096))
case("random bytes instead of a handshake: closed", closed(s))
s = conn()
recv(s, 18)
s.sendall(b"\0\0\0\3" + os.urandom(64))
case("garbage option: closed", closed(s))
s = conn()
go(s)
request(s, 0, size, 4096)
case("READ past the end: EINVAL", reply(s) == 22)
request(s, 0, size - 512, 4096)
case("READ across the end: EINVAL", reply(s) == 22)
request(s, 1, size, 4096, b"x" * 4096)
case("WRITE past the end: ENOSPC", reply(s) == 28)
request(s, 0, 1 << 62, 4096)
case("READ at 2^62: EINVAL", reply(s) == 22)
request(s, 0, 100, 512)
case("misaligned READ: EINVAL", reply(s) == 22)
request(s, 0, 0, 4096)
case("the connection still serves a good READ", reply(s, 4096) == 0)
request(s, 1, 0, 64 << 20)
try:
    s.sendall(b"y" * 65536)  # the server may have stopped reading already
except (BrokenPipeError, ConnectionResetError):
    pass
case("oversized WRITE: EINVAL", reply(s) == 22)
case("... then the server closes", closed(s))
EOF
cat "$work/py.out"
grep -q "^not ok" "$work/py.out" && failed=1
grep -q "^ok" "$work/py.out" || not_ok "python hostile client" "$(tail -3 "$work/py.out")"
if wait $bg; then ok "fio beside the hostile clients: verified"; else not_ok "fio beside the hostile clients" "$(grep -E 'err|verify' "$work/bg.out" | head -3)"; fi
check_cmd "nbdinfo after the hostile clients" t nbdinfo "$unix_uri"
errs=$(c -f json device exports | jq '.[0].errors')
[ "${errs:-0}" -ge 5 ] && ok "the export counted the refused requests ($errs)" || not_ok "refused requests counted" "errors=$errs"

# Case: a read-only mapping, exported to a group. Expect: the socket has the mode and group
# asked for; NBD says read-only and refuses writes.
check_cmd "map ro.img ro" c device map ro.img from "$addr" ro
check_cmd "export ro.img" c device export ro.img unix "$work/ro.sock" mode 0660 group "$(id -g)"
got=$(stat -c '%a %g' "$work/ro.sock")
[ "$got" = "660 $(id -g)" ] && ok "mode and group of the socket" || not_ok "mode and group of the socket" "$got"
t nbdinfo --json "nbd+unix:///?socket=$work/ro.sock" | jq -e '.exports[0].is_read_only == true' >/dev/null &&
  ok "read-only export" || not_ok "read-only export" "not flagged read-only"
if t nbdcopy "$work/in.bin" "nbd+unix:///?socket=$work/ro.sock" >/dev/null 2>&1; then
  not_ok "writes to a read-only export fail" "nbdcopy succeeded"
else
  ok "writes to a read-only export fail"
fi

# Case: unexport, then export again, then unmap with the export up. Expect: the socket goes
# away with the export; unmap stops the export first.
check_cmd "unexport ro.img" c device unexport ro.img
[ ! -e "$work/ro.sock" ] && ok "unexport removes the socket" || not_ok "unexport removes the socket" "still there"
expect_fail "unexport of a device not exported is ENOENT" 2 c device unexport ro.img

# Case: a TLS export (STARTTLS, PSK) over tcp, without the word insecure: a key made by `ibnbd
# key psk`; nbdinfo and nbdcopy with libnbd's tls-psk-file. Expect: the key file is 0600; the
# export lists nbds:// URIs; nbdinfo over TLS sees the read-only device; nbdcopy reads it out
# byte-equal to the server's file; plaintext, a wrong key and an unknown identity are refused; a
# PSK file readable by others is refused (EACCES).
check_cmd "key psk" "$ibnbd" key psk alice out "$work/alice.psk"
[ "$(stat -c %a "$work/alice.psk")" = 600 ] && ok "the PSK file is 0600" || not_ok "the PSK file is 0600" "$(stat -c %a "$work/alice.psk")"
"$ibnbd" key psk alice out "$work/wrong.psk" >/dev/null && "$ibnbd" key psk mallory out "$work/mallory.psk" >/dev/null
cp "$work/alice.psk" "$work/open.psk" && chmod 644 "$work/open.psk"
expect_fail "a PSK file readable by others is EACCES" 13 c device export ro.img tcp 127.0.0.1:0 tls-psk "$work/open.psk"
check_cmd "export ro.img over tcp with TLS (no insecure)" c device export ro.img tcp 127.0.0.1:0 tls-psk "$work/alice.psk"
tls_tcp=$(c -f json device exports | jq -r '.[] | select(.device == "ro.img") | .tcp')
c -f json device exports | jq -r '.[] | select(.device == "ro.img") | .uris[]' | grep -q "^nbds://$tls_tcp/ro.img" &&
  ok "the export lists an nbds:// URI" || not_ok "the export lists an nbds:// URI" "$(c device exports)"
tls_uri="nbds://alice@$tls_tcp/ro.img?tls-psk-file=$work/alice.psk"
t nbdinfo --json "$tls_uri" 2>"$work/err" | jq -e '.exports[0].is_read_only == true and .exports[0]."export-size" == 8388608' >/dev/null &&
  ok "nbdinfo over TLS" || not_ok "nbdinfo over TLS" "$(cat "$work/err")"
if t nbdcopy "$tls_uri" "$work/ro-tls.bin" 2>"$work/err" && cmp -s "$work/ro-tls.bin" "$work/export/ro.img"; then
  ok "nbdcopy over TLS: byte-equal to the server's file"
else
  not_ok "nbdcopy over TLS" "$(cat "$work/err")"
fi
refused() {  # refused NAME URI: nbdinfo must fail
  if t nbdinfo "$2" >/dev/null 2>&1; then not_ok "$1" "nbdinfo connected"; else ok "$1"; fi
}
refused "plaintext to the TLS export is refused" "nbd://$tls_tcp/ro.img"
refused "a wrong key is refused" "nbds://alice@$tls_tcp/ro.img?tls-psk-file=$work/wrong.psk"
refused "an unknown identity is refused" "nbds://mallory@$tls_tcp/ro.img?tls-psk-file=$work/mallory.psk"
check_cmd "unexport the TLS export" c device unexport ro.img
check_cmd "unmap a.img with the export up" c device unmap a.img
[ ! -e "$sock" ] && ok "unmap stopped the export" || not_ok "unmap stopped the export" "socket still there"
if t nbdinfo "$tcp_uri" >/dev/null 2>&1; then not_ok "nothing listens after unmap" "nbdinfo connected"; else ok "nothing listens after unmap"; fi
n=$(c -f json device exports | jq length)
[ "$n" = 0 ] && ok "no exports left" || not_ok "no exports left" "$n"

# Case: the daemons stop on SIGTERM (client first: it closes its devices on the server).
# Expect: both exit 0, and a sanitizer build reports nothing in their logs.
for p in "$cld_pid" "$srv_pid"; do
  kill "$p" 2>/dev/null
  wait "$p"
  rc=$?
  [ "$rc" = 0 ] && ok "daemon $p exits 0 on SIGTERM" || not_ok "daemon $p exits 0 on SIGTERM" "exit $rc"
done
for p in "${pids[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
pids=()
if grep -l "Sanitizer" "$work/srv.log" "$work/cl.log" >/dev/null 2>&1; then
  not_ok "daemon logs are sanitizer-clean" "$(grep -h -A3 "Sanitizer" "$work/srv.log" "$work/cl.log" | head -8)"
else
  ok "daemon logs are sanitizer-clean"
fi

exit $failed
