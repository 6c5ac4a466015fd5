#!/usr/bin/env bash
# ibnbd-server as a gateway to Ceph RBD images, against a real single-host cluster
# (scripts/ceph-dev.sh: a mon and a bluestore OSD on a file, cephx on). The server runs as
# client.ibnbd (caps "profile rbd" on pool rbd); clients authenticate as hosts and reach images as
# rbd:POOL/IMAGE[@SNAP] through ibnbd-client's NBD export (qemu-img, qemu-io, nbdcopy) and the
# fio engine. Every write is checked with `rbd export`, every read against `rbd import`ed data.
# TAP-like output ("ok - NAME" / "not ok - NAME: why"); exit 1 when anything failed, 77 when
# Ceph or a tool is missing (scripts/setup.sh installs them all, so CI never skips).
#
#   bash tests/rbd/rbd_gateway.sh BUILD_DIR        (ctest: rbd_gateway)
set -u -o pipefail

top=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=$(cd "${1:?usage: $0 BUILD_DIR}" && pwd) || exit 1
. "$top/tests/lib/ibnbd_bins.sh"
. "$top/tests/lib/tap.sh"
ibnbd_bins "$build"
engine=$build/client/fio/libibnbd-fio.so
for t in ceph-mon ceph-osd rbd qemu-img qemu-io nbdcopy nbdinfo fio jq python3 cmp; do
  command -v "$t" >/dev/null || { echo "1..0 # SKIP $t is missing (scripts/setup.sh installs it)"; exit 77; }
done
[ -f "$engine" ] || { echo "1..0 # SKIP $engine not built"; exit 77; }

. "$top/tests/rbd/cluster.sh"
rbd_cluster_start ibnbd-rbd-test
r() { t rbd "$@"; }  # as client.admin

# Images: "data" filled through the gateway, "src" filled by rbd import and read through it,
# "ops" for zeroes / discard / FUA / flush, "io" for fio under faults, "b-img" for host B.
head -c $((16 << 20)) /dev/urandom >"$work/data.bin"
head -c $((16 << 20)) /dev/urandom >"$work/src.bin"
head -c $((8 << 20)) /dev/urandom >"$work/ops.bin"
# "sparse": 64 MiB with 1 MiB of data at 8 MiB and at 40 MiB (rbd import writes no zero blocks).
truncate -s 64M "$work/sparse.bin" && head -c $((1 << 20)) /dev/urandom | dd of="$work/sparse.bin" bs=1M seek=8 conv=notrunc status=none &&
  head -c $((1 << 20)) /dev/urandom | dd of="$work/sparse.bin" bs=1M seek=40 conv=notrunc status=none ||
  { echo "not ok - making sparse.bin"; exit 1; }
r create rbd/data --size 16M && r import --no-progress "$work/src.bin" rbd/src && r import --no-progress "$work/ops.bin" rbd/ops &&
  r create rbd/io --size 32M && r create rbd/b-img --size 4M && r import --no-progress "$work/sparse.bin" rbd/sparse ||
  { echo "not ok - creating the images"; exit 1; }

# Two hosts: A may open every image of pool rbd in every mode and the files; B only rbd/b-* ro.
host_a=nqn.2014-08.org.nvmexpress:uuid:7e570000-0000-4000-8000-00000000000a
host_b=nqn.2014-08.org.nvmexpress:uuid:7e570000-0000-4000-8000-00000000000b
"$ibnbd" key generate host "$host_a" out "$work/a.key" >/dev/null && "$ibnbd" key generate host "$host_b" out "$work/b.key" >/dev/null ||
  { echo "not ok - key generate"; exit 1; }
mkdir -p "$work/export" && truncate -s 4M "$work/export/f.img"
server_config() {  # server_config KEYRING: the JSON config with that keyring for client.ibnbd
  cat <<EOF
{"hosts": [{"key_file": "$work/a.key", "access": [{"devices": "rbd:rbd/**", "mode": "migration"}, {"devices": "*.img", "mode": "rw"}]},
           {"key_file": "$work/b.key", "access": [{"devices": "rbd:rbd/b-*", "mode": "ro"}]}],
 "rbd": {"conf": "$CEPH_CONF", "client_id": "ibnbd", "keyring": "$1", "pools": ["rbd"], "connect_timeout_s": 5}}
EOF
}
server_config "$ibnbd_keyring" >"$work/srv.json"
start_server() {  # start_server CONFIG NAME [PORT]: sets srv_pid, srv_addr
  local name=$2
  rm -f "$work/$name.ready"
  "$srv" --config "$1" --listen "tcp:127.0.0.1:${3:-0}" --dev-search-path "$work/export" --control-socket "$work/$name.sock" \
    --ready-file "$work/$name.ready" >>"$work/$name.log" 2>&1 &
  srv_pid=$!
  pids+=($!)
  wait_for "$work/$name.ready" || { echo "not ok - $name start: $(tail -5 "$work/$name.log")"; exit 1; }
  srv_addr=$(sed -n 's/^listening //p' "$work/$name.ready" | head -1)
}
start_server "$work/srv.json" srv
addr=$srv_addr
srv_main=$srv_pid
start_client() {  # start_client NAME KEY
  "$cld" --host-key "$2" --control-socket "$work/$1.sock" --ready-file "$work/$1.ready" >"$work/$1.log" 2>&1 &
  pids+=($!)
  wait_for "$work/$1.ready" || { echo "not ok - $1 start: $(cat "$work/$1.log")"; exit 1; }
}
start_client cla "$work/a.key"
start_client clb "$work/b.key"
ca() { t "$ibnbd" --socket "$work/cla.sock" client "$@"; }
cb() { t "$ibnbd" --socket "$work/clb.sock" client "$@"; }
export_unix() {  # export_unix DEVICE NAME: the NBD URI of DEVICE exported on a unix socket
  ca device export "$1" unix "$work/$2.sock" name "$2" >/dev/null 2>"$work/err" || return 1
  echo "nbd+unix:///$2?socket=$work/$2.sock"
}
same() {  # same NAME FILE_A FILE_B
  if cmp -s "$2" "$3"; then ok "$1"; else not_ok "$1" "$(cmp "$2" "$3" 2>&1 | head -1)"; fi
}
# expect_errno NAME ERRNO CMD...: CMD fails, and the CLI's exit status is the errno.
expect_errno() {
  local name=$1 want=$2 rc
  shift 2
  "$@" >"$work/out" 2>"$work/err"
  rc=$?
  [ "$rc" = "$want" ] && ok "$name" || not_ok "$name" "exit $rc, want $want: $(tail -1 "$work/err")"
}

# Case: map rbd:rbd/data rw and fill it through the NBD export. Expect: nbdinfo shows the image's
# size; `rbd export` of the image is byte-equal to what went in.
check_cmd "map rbd:rbd/data rw" ca device map rbd:rbd/data from "$addr" rw
if uri=$(export_unix rbd:rbd/data data); then
  size=$(t nbdinfo --json "$uri" 2>/dev/null | jq -r '.exports[0]."export-size"')
  [ "$size" = $((16 << 20)) ] && ok "nbdinfo: the image's 16 MiB" || not_ok "nbdinfo size" "got '$size'"
  check_cmd "nbdcopy into rbd:rbd/data" t nbdcopy "$work/data.bin" "$uri"
  check_cmd "rbd export rbd/data" r export --no-progress rbd/data "$work/data.out"
  same "written through the gateway, read by rbd export: equal" "$work/data.bin" "$work/data.out"
else
  not_ok "export rbd:rbd/data" "$(tail -1 "$work/err")"
fi

# Case: an image filled by `rbd import`, read through the gateway (nbdcopy and qemu-img convert).
# Expect: byte-equal to the imported file.
check_cmd "map rbd:rbd/src ro" ca device map rbd:rbd/src from "$addr" ro
if uri=$(export_unix rbd:rbd/src src); then
  check_cmd "nbdcopy out of rbd:rbd/src" t nbdcopy "$uri" "$work/src.out"
  same "imported by rbd, read through the gateway: equal" "$work/src.bin" "$work/src.out"
  check_cmd "qemu-img convert out of rbd:rbd/src" t qemu-img convert -f raw -O raw "$uri" "$work/src.qemu"
  same "qemu-img read through the gateway: equal" "$work/src.bin" "$work/src.qemu"
else
  not_ok "export rbd:rbd/src" "$(tail -1 "$work/err")"
fi

# Case: a sparse image (2 MiB of data in 64 MiB) mapped ro and exported. Expect: the extents the
# gateway reads with rbd_diff_iterate2 reach NBD's base:allocation: nbdinfo --map shows both data
# ranges and holes for the rest (RADOS objects are 4 MiB: a data extent may round up to its
# objects, never beyond); nbdcopy's copy equals the image.
check_cmd "map rbd:rbd/sparse ro" ca device map rbd:rbd/sparse from "$addr" ro
if uri=$(export_unix rbd:rbd/sparse sparse); then
  if t nbdinfo --map "$uri" >"$work/sparse.map" 2>"$work/err"; then
    # Data bytes, and whether each written MiB lies inside a data extent.
    got=$(awk '$3 == 0 { d += $2; if ($1 <= 8388608 && $1 + $2 >= 9437184) a = 1; if ($1 <= 41943040 && $1 + $2 >= 42991616) b = 1 }
      END { print d + 0, a + 0, b + 0 }' "$work/sparse.map")
    read -r data has_a has_b <<<"$got"
    [ "$has_a" = 1 ] && [ "$has_b" = 1 ] && [ "$data" -ge $((2 << 20)) ] && [ "$data" -le $((8 << 20)) ] &&
      ok "nbdinfo --map: both written MiB data, $data bytes of data in 64 MiB, the rest holes" ||
      not_ok "rbd extents" "data bytes $data (2..8 MiB), 8 MiB in data $has_a, 40 MiB in data $has_b: $(head -6 "$work/sparse.map" | tr '\n' ' ')"
  else
    not_ok "nbdinfo --map of rbd:rbd/sparse" "$(cat "$work/err")"
  fi
  check_cmd "nbdcopy out of rbd:rbd/sparse" t nbdcopy "$uri" "$work/sparse.out"
  same "the sparse image through the gateway: equal" "$work/sparse.bin" "$work/sparse.out"
else
  not_ok "export rbd:rbd/sparse" "$(tail -1 "$work/err")"
fi
check_cmd "unmap rbd:rbd/sparse" ca device unmap rbd:rbd/sparse

# Case: the image grows (`rbd resize` by another client) while mapped, and nobody remaps it.
# Expect: within 5 s the gateway's notice (librbd's update watch -> the session's WATCH) gives
# the daemon's listing the new size, and a new NBD connection (nbdinfo) sees it too; the bytes
# before stay as they were.
if r resize --no-progress rbd/src --size 24M >/dev/null 2>&1; then
  got=""
  t_resized=$(date +%s%N)
  for _ in $(seq 50); do
    got=$(ca -f json device show rbd:rbd/src 2>/dev/null | jq -r '.[0].size')
    [ "$got" = $((24 << 20)) ] && break
    sleep 0.1
  done
  [ "$got" = $((24 << 20)) ] &&
    ok "rbd resize reached the mapping by itself: device show says 24 MiB ($((($(date +%s%N) - t_resized) / 1000000)) ms after rbd resize returned)" ||
    not_ok "rbd resize seen by the client" "device show says size '$got'"
  size=$(t nbdinfo --size "nbd+unix:///src?socket=$work/src.sock" 2>/dev/null)
  [ "$size" = $((24 << 20)) ] && ok "... and a new NBD connection: nbdinfo --size 24 MiB" ||
    not_ok "resize seen through NBD" "nbdinfo says '$size'"
  grep -q "rbd:rbd/src: size 16777216 -> 25165824 bytes" "$work/srv.log" && ok "the gateway logged the resize" ||
    not_ok "the gateway logged the resize" "$(grep -i size "$work/srv.log" | tail -2)"
  t qemu-img convert -f raw -O raw "nbd+unix:///src?socket=$work/src.sock" "$work/src.grown" 2>/dev/null
  head -c $((16 << 20)) "$work/src.grown" >"$work/src.head" 2>/dev/null
  same "... and the first 16 MiB are what was imported" "$work/src.bin" "$work/src.head"
else
  not_ok "rbd resize" "failed"
fi

# Case: every other operation, from qemu-io over NBD: write-zeroes that must allocate (NO_HOLE:
# NOUNMAP, thick-provisioned zeros), write-zeroes that may unmap, discard, a FUA write, flush.
# Expect: `rbd export` shows zeros in the three ranges, the FUA write's bytes, the rest as
# imported; the server counted them (write_zeroes 2, discard 1, flushes).
check_cmd "map rbd:rbd/ops rw" ca device map rbd:rbd/ops from "$addr" rw
if uri=$(export_unix rbd:rbd/ops ops); then
  check_cmd "qemu-io: zeroes, discard, FUA write, flush" t qemu-io -f raw \
    -c "write -z 1M 1M" -c "write -z -u 3M 1M" -c "discard 5M 1M" -c "write -f -P 0x5a 7M 64k" -c "flush" "$uri"
  check_cmd "rbd export rbd/ops" r export --no-progress rbd/ops "$work/ops.out"
  python3 - "$work/ops.bin" "$work/ops.out" >"$work/ops.check" 2>&1 <<'EOF'
import sys
M = 1 << 20
want = bytearray(open(sys.argv[1], "rb").read())
for off in (1 * M, 3 * M, 5 * M):
    want[off:off + M] = bytes(M)
want[7 * M:7 * M + 65536] = b"\x5a" * 65536
got = open(sys.argv[2], "rb").read()
if got != bytes(want):
    first = next(i for i in range(min(len(got), len(want))) if got[i] != want[i]) if len(got) == len(want) else -1
    print(f"differs (length {len(got)} vs {len(want)}, first difference at {first})")
    sys.exit(1)
EOF
  [ $? = 0 ] && ok "zeroes, discard, FUA write as rbd export sees them" || not_ok "ops in the image" "$(cat "$work/ops.check")"
  # The counters as the control socket gives them (one JSON object per line).
  st=$(python3 - "$work/srv.sock" <<'EOF'
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(b'{"cmd": "devices"}\n')
buf = b""
while not buf.endswith(b"\n"):
    buf += s.recv(65536)
for d in json.loads(buf)["devices"]:
    if d["name"] == "rbd:rbd/ops":
        st = d["stats"]
        print(d["kind"], st["write_zeroes_ops"], st["discard_ops"], st["flush_ops"] > 0, st["errors"])
EOF
)
  [ "$st" = "rbd 2 1 True 0" ] && ok "server counters: kind rbd, 2 write-zeroes, 1 discard, flushes, no error" ||
    not_ok "server counters" "got '$st'"
else
  not_ok "export rbd:rbd/ops" "$(tail -1 "$work/err")"
fi

# Case: a snapshot. Expect: rbd:rbd/data@s1 maps ro and reads as `rbd export` of the snapshot
# even after the head changed; a rw map of it is EROFS (30); a write through a ro map fails.
r snap create rbd/data@s1 >/dev/null 2>&1 || not_ok "rbd snap create" "failed"
check_cmd "map rbd:rbd/data@s1 ro" ca device map rbd:rbd/data@s1 from "$addr" ro
if uri=$(export_unix rbd:rbd/data@s1 snap); then
  t qemu-io -f raw -c "write -P 0x11 0 1M" "nbd+unix:///data?socket=$work/data.sock" >/dev/null 2>&1 ||
    not_ok "a write to the head after the snapshot" "failed"
  check_cmd "nbdcopy out of the snapshot" t nbdcopy "$uri" "$work/snap.out"
  r export --no-progress rbd/data@s1 "$work/snap.rbd" >/dev/null 2>&1
  same "the snapshot through the gateway equals rbd export of it" "$work/snap.rbd" "$work/snap.out"
  same "... and the data before the head changed" "$work/data.bin" "$work/snap.out"
  t qemu-io -f raw -c "write -P 0x22 0 4k" "$uri" >"$work/out" 2>&1 && not_ok "a write to the ro snapshot fails" "it succeeded" ||
    ok "a write to the ro snapshot fails"
else
  not_ok "export rbd:rbd/data@s1" "$(tail -1 "$work/err")"
fi
expect_errno "rw map of a snapshot is EROFS" 30 ca device map rbd:rbd/src@s1 from "$addr" rw session snap-rw

# Case: names that lead nowhere, and what a host may not open. Expect: the errno of each, and
# the gateway keeps serving (the first map reads on).
expect_errno "no such image: ENOENT" 2 ca device map rbd:rbd/missing from "$addr" ro session e1
expect_errno "no such snapshot: ENOENT" 2 ca device map rbd:rbd/src@nope from "$addr" ro session e2
expect_errno "a pool not configured: EACCES" 13 ca device map rbd:other/x from "$addr" ro session e3
expect_errno "a bad rbd name (an image name with a '/'): EINVAL" 22 ca device map "rbd:rbd/a/b" from "$addr" ro session e4
expect_errno "host B, an image its rules do not grant: EACCES" 13 cb device map rbd:rbd/src from "$addr" ro
expect_errno "host B, rw where it may read: EPERM" 1 cb device map rbd:rbd/b-img from "$addr" rw session b-rw
check_cmd "host B, ro where it may read" cb device map rbd:rbd/b-img from "$addr" ro
t nbdcopy "nbd+unix:///src?socket=$work/src.sock" "$work/src.again" 2>/dev/null
truncate -s 16M "$work/src.again" 2>/dev/null  # grown to 24 MiB above; the rest reads as zeros
same "after the refusals the gateway still serves" "$work/src.bin" "$work/src.again"

# Case: access modes across two clients (host A's daemon holds rbd:rbd/data rw; the fio engine
# is the second client). Expect: a second rw holder fails with EBUSY (16); ro beside it works.
fio_job() {  # fio_job NAME DEVICE [fio args]: the fio engine as host A (to $fio_addr, default
  # the main server; session fio-NAME unless the args name one), JSON in NAME.json
  local name=$1 dev=$2
  shift 2
  # IBNBD_FIO_PRELOAD: the ASan runtime for an instrumented engine in an uninstrumented fio.
  t env ${IBNBD_FIO_PRELOAD:+LD_PRELOAD=$IBNBD_FIO_PRELOAD ASAN_OPTIONS=detect_leaks=0} \
    fio --output-format=json --output="$work/$name.json" --name="$name" --ioengine="external:$engine" \
    --ibnbd_paths="${fio_addr:-$addr}" --ibnbd_device="$dev" --ibnbd_host_key="$work/a.key" --ibnbd_session="fio-$name" "$@" \
    >"$work/$name.out" 2>&1
}
fio_job rw-second rbd:rbd/data --rw=write --bs=64k --size=1M
grep -q "Device or resource busy" "$work/rw-second.out" && ok "a second rw holder of one image: EBUSY" ||
  not_ok "a second rw holder of one image: EBUSY" "$(tail -2 "$work/rw-second.out")"
if fio_job ro-beside rbd:rbd/data --rw=read --bs=64k --size=4M --ibnbd_mode=ro; then
  ok "ro beside the rw holder (fio engine)"
else
  not_ok "ro beside the rw holder" "$(tail -3 "$work/ro-beside.out")"
fi

# The fault cases: 8 MiB of 4 KiB random writes at 300 IOPS (~7 s: the fault at 2 s lands in
# the write phase), then fio reads every block back and checks it.
longest() { jq -r '[.jobs[0].write.clat_ns.max, .jobs[0].read.clat_ns.max] | max / 1e6 | floor' "$1"; }
# fio_opened NAME: waits (at most 30 s) until the gateway holds fio-NAME's image open, so that a
# fault lands in the IO, not in the session's establishment or librbd's open (which took more
# than the 2 s the cases slept, under ASan on a loaded host: session 9's CI run).
fio_opened() {
  local i
  for i in $(seq 150); do
    t "$ibnbd" --socket "$work/srv.sock" server -f json device list 2>/dev/null | grep -q "fio-$1" && return 0
    sleep 0.2
  done
  return 1
}

# Case: the OSD killed (kill -9) and started again 2 s later while fio writes and verifies
# through the gateway. Expect: IO pauses and resumes; fio exits 0 with every block verified.
fio_job osd rbd:rbd/io --rw=randwrite --bs=4k --iodepth=8 --size=8M --verify=crc32c --verify_fatal=1 \
  --do_verify=1 --rate_iops=300 &
fio_pid=$!
fio_opened osd || not_ok "fio-osd opened its image within 30 s" "$(tail -3 "$work/osd.out")"
sleep 1
bash "$top/scripts/ceph-dev.sh" osd-restart "$work/ceph" 2 >"$work/osd.err" 2>&1 || not_ok "osd restart" "$(grep "^ceph-dev:" "$work/osd.err" | tail -1)"
if wait "$fio_pid" && jq -e '.jobs[0].error == 0 and .jobs[0].read.io_bytes == 8388608' "$work/osd.json" >/dev/null; then
  ok "OSD restarted under IO: fio verified every block (longest IO $(longest "$work/osd.json") ms)"
else
  not_ok "OSD restarted under IO" "$(tail -3 "$work/osd.out")"
fi

# Case: the gateway killed (kill -9) while fio writes and verifies, started again on its port a
# second later. Expect: the client reconnects and re-opens the image (OPEN with kOpenReopen);
# the new gateway breaks its dead predecessor's exclusive lock at once (the log says so) rather
# than waiting ~30 s for the OSD to drop the dead client's watch; fio exits 0 with every block
# verified, the longest IO about the restart's time.
port=${addr##*:}
fio_job gw rbd:rbd/io --rw=randwrite --bs=4k --iodepth=8 --size=8M --verify=crc32c --verify_fatal=1 \
  --do_verify=1 --rate_iops=300 --offset=16M &
fio_pid=$!
fio_opened gw || not_ok "fio-gw opened its image within 30 s" "$(tail -3 "$work/gw.out")"
sleep 1
kill -9 "$srv_main"
wait "$srv_main" 2>/dev/null
sleep 1
start_server "$work/srv.json" srv "$port"
if wait "$fio_pid" && jq -e '.jobs[0].error == 0 and .jobs[0].read.io_bytes == 8388608' "$work/gw.json" >/dev/null; then
  ok "gateway killed and restarted under IO: fio verified every block (longest IO $(longest "$work/gw.json") ms)"
else
  not_ok "gateway killed and restarted under IO" "$(tail -3 "$work/gw.out")"
fi
grep -q "took the exclusive lock over" "$work/srv.log" && ok "the restarted gateway took the lock over (fenced its predecessor)" ||
  not_ok "the restarted gateway took the lock over" "$(grep -i "rbd\|OPEN" "$work/srv.log" | tail -3)"
ms=$(longest "$work/gw.json")
[ "${ms:-99999}" -lt 15000 ] && ok "no IO waited out the dead gateway's watch ($ms ms < 15 s)" ||
  not_ok "no IO waited out the dead gateway's watch" "longest IO $ms ms"

# Case: a gateway whose cephx key is wrong. Expect: rbd maps fail with the cluster's refusal
# (the server log names it), the server keeps serving its files.
printf '[client.ibnbd]\n\tkey = %s\n' "$(python3 -c 'import base64,os,struct; print(base64.b64encode(struct.pack("<hiih", 1, 0, 0, 16) + os.urandom(16)).decode())')" >"$work/bad.keyring"
server_config "$work/bad.keyring" >"$work/bad.json"
start_server "$work/bad.json" bad
bad_addr=$srv_addr
"$ibnbd" --socket "$work/cla.sock" client device map rbd:rbd/io from "$bad_addr" ro session bad-rbd >"$work/out" 2>"$work/err"
rc=$?
[ "$rc" != 0 ] && grep -q "connecting to the cluster" "$work/bad.log" && ok "a wrong cephx key: map refused (exit $rc), the server says why" ||
  not_ok "a wrong cephx key" "exit $rc: $(tail -2 "$work/bad.log") $(tail -1 "$work/err")"
check_cmd "... and that server still serves its files" ca device map f.img from "$bad_addr" rw session bad-file

# Case: per-session RADOS namespaces ("namespace": "%SESSNAME%"): namespace ns-a holds an image
# "img" with known bytes. Expect: session ns-a reads them as rbd:rbd/img; session ns-b, whose
# namespace does not exist, gets ENOENT; the head of pool rbd has no "img".
server_config "$ibnbd_keyring" | python3 -c 'import json,sys; c=json.load(sys.stdin); c["rbd"]["namespace"]="%SESSNAME%"; print(json.dumps(c))' >"$work/ns.json"
head -c $((1 << 20)) /dev/urandom >"$work/ns.bin"
if r namespace create rbd/ns-a && r import --no-progress "$work/ns.bin" rbd/ns-a/img >/dev/null 2>&1; then
  start_server "$work/ns.json" ns
  ns_addr=$srv_addr
  if ca device map rbd:rbd/img from "$ns_addr" ro session ns-a >"$work/out" 2>"$work/err" &&
    ca device export rbd:rbd/img unix "$work/ns-export.sock" name ns >/dev/null 2>"$work/err" &&
    t nbdcopy "nbd+unix:///ns?socket=$work/ns-export.sock" "$work/ns.out" 2>"$work/err"; then
    same "session ns-a reads rbd:rbd/img of namespace ns-a" "$work/ns.bin" "$work/ns.out"
  else
    not_ok "session ns-a maps rbd:rbd/img" "$(tail -1 "$work/err") $(tail -1 "$work/out") $(grep -i "rbd:rbd/img" "$work/ns.log" | tail -2)"
  fi
  fio_addr=$ns_addr fio_job ns-b rbd:rbd/img --rw=read --bs=4k --size=64k --ibnbd_mode=ro --ibnbd_session=ns-b
  grep -q "No such file or directory" "$work/ns-b.out" && ok "session ns-b (no such namespace): ENOENT for rbd:rbd/img" ||
    not_ok "session ns-b: ENOENT" "$(tail -2 "$work/ns-b.out")"
else
  not_ok "rbd namespace create / import" "failed"
fi

echo "# done in $((SECONDS - t0)) s"
exit $failed
