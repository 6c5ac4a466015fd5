#!/usr/bin/env bash
# Migration image benchmark: one run, one table. A stopped QEMU 7.2 guest (TCG, -nic none) whose
# RAM is a private mapping of a file of random bytes (so the stream is the RAM, not ~9-byte zero
# pages), max-bandwidth raised to 100 GiB/s, saved and restored:
#   agent exec      `migrate exec:ibnbd-migrate save ...` (stdin) / -incoming exec:... (stdout)
#   agent unix      the agent listening on a unix socket / connecting to migrate-incoming unix:
#   agent multifd2  unix with the multifd capability and 2 channels (1 + 2 connections)
#   agent file      no QEMU: the agent saving the guest's RAM file from stdin (a regular file on
#                   tmpfs) and restoring it to /dev/null: the agent's own ceiling (its start,
#                   session and map included, as in the exec rows)
#   qemu fd: file   QEMU itself writing the same stream to a file on tmpfs handed over with
#                   getfd (migrate fd:NAME), and restoring from it (migrate-incoming fd:NAME):
#                   what the stream costs QEMU with no storage behind it
#   raw write/read  fio through our external ioengine (libibnbd-fio.so), 1 MiB sequential,
#                   QD 32 write (the agent's ring: 32 chunks) and QD 16 read (its read-ahead),
#                   over the same paths to the same server: the session's own rate
# The server exports sparse files on tmpfs (/dev/shm); every client uses the same loopback tcp
# path(s). Save time: `migrate` until QEMU says completed and the agent has committed (its
# final "saved" line, or its exit); restore time: migrate-incoming until completed. Rates are
# stream bytes (the image's length from `ibnbd-migrate list`, the file's size for fd:) / time.
# Every row runs once per round, the rounds interleave all rows, and the table shows each row's
# median over the rounds (min..max beside it: on a shared 2-core machine a neighbour's burst
# moves single runs by 2x). agent CPU: user + sys seconds of the agent per GiB of stream (from
# /usr/bin/time), which contention does not inflate the way it does wall time.
# Ratios (of medians): save rows / raw write and / fd: save; restore rows / raw read and / fd:
# restore. Target (issue 7): agent save >= 0.9 x raw write. A benchmark, not a test: it asserts
# nothing.
#
#   bash bench/migrate.sh [--guest-mb N] [--paths 1|2] [--rounds N]
#                                      (default 2048 MiB, 1 path, 3 rounds; ~4 min)
#
# The build directory comes from $IBTRS_BUILD (default build); the binaries are built there if
# needed. Skips (exit 0, reason printed) without qemu-system-x86_64, fio or the fio engine.
# Only loopback addresses and unix sockets are used.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
guest_mb=2048
npaths=1
rounds=3
while [ $# -gt 0 ]; do
  case "$1" in
    --guest-mb) guest_mb=$2; shift 2 ;;
    --paths) npaths=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    *) echo "usage: $0 [--guest-mb N] [--paths 1|2] [--rounds N]" >&2; exit 2 ;;
  esac
done
case "$rounds" in '' | *[!0-9]* | 0) echo "--rounds takes a whole number above 0" >&2; exit 2 ;; esac
case "$guest_mb" in '' | *[!0-9]*) echo "--guest-mb takes a whole number" >&2; exit 2 ;; esac
[ "$guest_mb" -ge 256 ] && [ "$guest_mb" -le 3072 ] || { echo "--guest-mb: 256..3072" >&2; exit 2; }
case "$npaths" in 1 | 2) ;; *) echo "--paths: 1 or 2" >&2; exit 2 ;; esac
for t in qemu-system-x86_64 fio python3 /usr/bin/time; do
  command -v "$t" >/dev/null || { echo "skipped: $t is missing (scripts/setup.sh installs it)"; exit 0; }
done

build=${IBTRS_BUILD:-build}
if [ ! -f "$build/build.ninja" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
targets="ibnbd-server ibnbd-migrate"
ninja -C "$build" -t targets all 2>/dev/null | grep -q '^ibnbd_fio:' && targets="$targets ibnbd_fio"
ninja -C "$build" -j "$(nproc)" $targets >/dev/null
build=$(cd "$build" && pwd)
srv="$build/server/ibnbd-server"
agent="$build/client/migrate/ibnbd-migrate"
engine="$build/client/fio/libibnbd-fio.so"
[ -f "$engine" ] || { echo "skipped: the fio engine is not built (scripts/fio-headers.sh, -DIBNBD_FIO_ENGINE=ON)"; exit 0; }

tmp=$(mktemp -d /dev/shm/ibnbd-mig-bench.XXXXXX)
pids=()
cleanup() {
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill "${pids[i]}" 2>/dev/null || true
    wait "${pids[i]}" 2>/dev/null || true
  done
  [ -n "${KEEP_TMP:-}" ] || rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
cd "$tmp"  # fio's state files

wait_file() {  # wait_file FILE PID: until FILE exists, while PID lives (10 s at most)
  for _ in $(seq 200); do
    [ -e "$1" ] && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.05
  done
  return 1
}

mkdir -p "$tmp/export"
# Images: room for one image at a time (each run deletes its image) plus the directory.
truncate -s $((guest_mb * 5 / 4 + 256))M "$tmp/export/images.img"
truncate -s "${guest_mb}M" "$tmp/export/raw.img"
dd if=/dev/urandom of="$tmp/ram.bin" bs=1M count="$guest_mb" status=none

# --allow-any-host (the server warns): IO is what is measured here, and authentication costs
# only at connect (docs/security.d/auth-bench.md).
"$srv" --allow-any-host --listen tcp:127.0.0.1:0 --listen tcp:127.0.0.1:0 --dev-search-path "$tmp/export" \
  --control-socket "$tmp/srv.sock" --ready-file "$tmp/srv.ready" >"$tmp/srv.log" 2>&1 &
pids+=($!)
wait_file "$tmp/srv.ready" "$!" || { echo "ibnbd-server did not start:" >&2; cat "$tmp/srv.log" >&2; exit 1; }
mapfile -t addrs < <(sed -n 's/^listening //p' "$tmp/srv.ready" | head -"$npaths")

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
start=$(date +%s)
rows="$tmp/rows.txt"  # NAME|BYTES|SECONDS|AGENT_CPU_SECONDS, one line per row and round
: >"$rows"

# ---- raw: fio through the engine, same server, same paths ------------------------------------
raw() {  # raw NAME RW QD ROUND
  local out="$tmp/fio-$2-$4.json" rc=0
  timeout -k 5 120 fio --name="$2" --ioengine="external:$engine" --ibnbd_paths="$(IFS=,; echo "${addrs[*]}")" \
    --ibnbd_device=raw.img --ibnbd_mode=migration --ibnbd_session="bench-raw-$$-$2-$4" --rw="$2" --bs=1m \
    --iodepth="$3" --iodepth_batch_submit="$3" --iodepth_batch_complete_max="$3" --size="${guest_mb}M" \
    --output-format=json --output="$out" >"$tmp/fio-$2-$4.log" 2>&1 || rc=$?
  if [ "$rc" != 0 ] || ! python3 -c 'import json,sys; json.load(open(sys.argv[1]))["jobs"][0]' "$out" 2>/dev/null; then
    echo "fio $1 failed (exit $rc): $(tail -1 "$tmp/fio-$2-$4.log")" >>"$tmp/errors.txt"
    return 0
  fi
  python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))["jobs"][0][sys.argv[2]]
print(sys.argv[3], d["io_bytes"], d["runtime"] / 1000, "", sep="|")' "$out" "$2" "$1" >>"$rows"
}

# ---- QEMU: a fresh stopped source per save, a fresh destination per restore ------------------
cat >"$tmp/driver.py" <<'EOF'
import json, os, re, shlex, socket, subprocess, sys, time

tmp, agent, guest_mb, paths = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
procs = []


# The tests' QMP client (tests/migrate/qemu_migrate.py: Qmp, with getfd).
sys.path.insert(0, os.environ["IBNBD_QMP_LIB"])
from qemu_migrate import Qmp  # noqa: E402


def qemu(name, incoming):
    qmp = f"{tmp}/{name}.qmp"
    mem = (f"memory-backend-ram,id=ram0,size={guest_mb}M" if incoming else
           f"memory-backend-file,id=ram0,size={guest_mb}M,mem-path={tmp}/ram.bin,share=off")
    argv = ["qemu-system-x86_64", "-machine", "pc,memory-backend=ram0", "-object", mem, "-m", f"{guest_mb}M",
            "-accel", "tcg", "-display", "none", "-nodefaults", "-nic", "none", "-serial", "none", "-S",
            "-qmp", f"unix:{qmp},server=on,wait=off"]
    if incoming:
        argv += ["-incoming", "defer"]
    p = subprocess.Popen(argv, stdout=open(f"{tmp}/{name}.log", "wb"), stderr=subprocess.STDOUT)
    procs.append(p)
    return p, Qmp(qmp)


def multifd(q, channels):
    if channels:
        q.cmd("migrate-set-capabilities", capabilities=[{"capability": "multifd", "state": True}])
        q.cmd("migrate-set-parameters", **{"multifd-channels": channels})


def wait_done(q, until=None, timeout=300):
    """Polls query-migrate every 5 ms until completed (and until() is true); returns the time."""
    deadline = time.time() + timeout
    done = False
    while time.time() < deadline:
        if not done:
            st = q.cmd("query-migrate").get("status", "none")
            if st in ("failed", "cancelled"):
                raise RuntimeError("migration " + st)
            done = st == "completed"
        if done and (until is None or until()):
            return time.monotonic()
        time.sleep(0.005)
    raise RuntimeError("timeout")


def agent_args(cmd, image, *extra):
    return [agent, cmd, "images.img", "from", *paths, "image", image, *extra]


def timed(argv, cpu_file):
    """argv under /usr/bin/time: the agent's user + sys seconds land in cpu_file."""
    return ["/usr/bin/time", "-f", "%U %S", "-o", cpu_file] + argv


def cpu_of(cpu_file):
    try:
        u, s = open(cpu_file).read().split()[-2:]
        return float(u) + float(s)
    except (OSError, ValueError):
        return None


def image_bytes(image):
    out = subprocess.run([agent, "list", "images.img", "from", *paths], capture_output=True, text=True).stdout
    for line in out.splitlines()[1:]:
        f = line.split()
        if f and f[0] == image and f[1] == "committed":
            return int(f[2])
    raise RuntimeError(f"image {image} is not committed: {out}")


def row(name, nbytes, secs, cpu):
    print(f"{name}|{nbytes}|{secs:.3f}|{'' if cpu is None else f'{cpu:.2f}'}", flush=True)


def save(way, image):
    # A fresh source each time: QEMU 7.2 does not migrate a VM paused by an earlier migration.
    src, q = qemu("src-" + image, False)
    try:
        q.cmd("migrate-set-parameters", **{"max-bandwidth": 100 << 30})
        multifd(q, 2 if way == "multifd2" else 0)
        log, cpu = f"{tmp}/agent-{image}.log", f"{tmp}/cpu-{image}.txt"
        if way == "fd":
            fd = os.open(f"{tmp}/stream.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            q.getfd("out", fd)
            os.close(fd)
            t0 = time.monotonic()
            q.cmd("migrate", uri="fd:out")
            t1 = wait_done(q)
            return os.path.getsize(f"{tmp}/stream.bin"), t1 - t0, None
        if way == "exec":
            # QEMU 7.2 reports completed only once the exec: command has exited, i.e. after the
            # agent's commit.
            cmd = shlex.join(timed(agent_args("save", image), cpu))
            t0 = time.monotonic()
            q.cmd("migrate", uri=f"exec:{cmd} 2>>{log}")
            t1 = wait_done(q)
        else:
            sock = f"{tmp}/{image}.sock"
            extra = ["unix", sock] + (["channels", "2"] if way == "multifd2" else [])
            a = subprocess.Popen(timed(agent_args("save", image, *extra), cpu), stdout=subprocess.DEVNULL,
                                 stderr=open(log, "wb"))
            procs.append(a)
            while not os.path.exists(sock):
                if a.poll() is not None:
                    raise RuntimeError(open(log).read())
                time.sleep(0.01)
            t0 = time.monotonic()
            q.cmd("migrate", uri=f"unix:{sock}")
            t1 = wait_done(q, lambda: a.poll() is not None)  # completed and committed
            if a.returncode != 0:
                raise RuntimeError(open(log).read())
        return image_bytes(image), t1 - t0, cpu_of(cpu)
    finally:
        src.kill()
        src.wait()


def restore(way, image):
    dst, q = qemu("dst-" + image, True)
    try:
        multifd(q, 2 if way == "multifd2" else 0)
        log, cpu = f"{tmp}/agent-r-{image}.log", f"{tmp}/cpu-r-{image}.txt"
        a = None
        if way == "fd":
            fd = os.open(f"{tmp}/stream.bin", os.O_RDONLY)
            q.getfd("in", fd)
            os.close(fd)
            t0 = time.monotonic()
            q.cmd("migrate-incoming", uri="fd:in")
        elif way == "exec":
            cmd = shlex.join(timed(agent_args("restore", image), cpu))
            t0 = time.monotonic()
            q.cmd("migrate-incoming", uri=f"exec:{cmd} 2>>{log}")
        else:
            sock = f"{tmp}/{image}-in.sock"
            t0 = time.monotonic()
            q.cmd("migrate-incoming", uri=f"unix:{sock}")
            a = subprocess.Popen(timed(agent_args("restore", image, "unix", sock), cpu),
                                 stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
            procs.append(a)
        t1 = wait_done(q)
        if a is not None:
            a.wait(30)
        elif way == "exec":
            time.sleep(0.2)  # the exec: agent exits as QEMU closes the pipe; then its times are out
        return t1 - t0, cpu_of(cpu)
    finally:
        dst.kill()
        dst.wait()


try:
    for way in ("exec", "unix", "multifd2", "fd"):
        image = "b-" + way
        try:
            n, s, c = save(way, image)
            row(f"save {way}", n, s, c)
        except Exception as e:
            print(f"save {way}: {e}", file=sys.stderr)
            continue
        try:
            s, c = restore(way, image)
            row(f"restore {way}", n, s, c)
        except Exception as e:
            print(f"restore {way}: {e}", file=sys.stderr)
        if way == "fd":
            os.unlink(f"{tmp}/stream.bin")
        else:
            subprocess.run(agent_args("delete", image), capture_output=True)
finally:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
EOF

# agent_file ROUND: the agent without QEMU, stdin from a file and stdout to /dev/null.
agent_file() {
  local t0 t1 t2
  t0=$(date +%s.%N)
  if ! /usr/bin/time -f "%U %S" -o "$tmp/cpu-file-save.txt" "$agent" save images.img from "${addrs[@]}" \
    image b-file <"$tmp/ram.bin" 2>"$tmp/agent-file.log"; then
    echo "agent file save failed: $(tail -1 "$tmp/agent-file.log")" >>"$tmp/errors.txt"
    return 0
  fi
  t1=$(date +%s.%N)
  /usr/bin/time -f "%U %S" -o "$tmp/cpu-file-restore.txt" "$agent" restore images.img from "${addrs[@]}" \
    image b-file >/dev/null 2>>"$tmp/agent-file.log" ||
    echo "agent file restore failed: $(tail -1 "$tmp/agent-file.log")" >>"$tmp/errors.txt"
  t2=$(date +%s.%N)
  "$agent" delete images.img from "${addrs[@]}" image b-file 2>/dev/null || true
  local n=$((guest_mb << 20))
  awk -v n="$n" -v a="$t0" -v b="$t1" -v c="$t2" -v cs="$(awk '{print $1 + $2}' "$tmp/cpu-file-save.txt")" \
    -v cr="$(awk '{print $1 + $2}' "$tmp/cpu-file-restore.txt")" \
    'BEGIN { printf "save file|%d|%.3f|%s\nrestore file|%d|%.3f|%s\n", n, b - a, cs, n, c - b, cr }' >>"$rows"
}

for round in $(seq "$rounds"); do
  raw "raw write" write 32 "$round"
  raw "raw read" read 16 "$round"
  agent_file "$round"
  IBNBD_QMP_LIB="$top/tests/migrate" timeout -k 5 600 python3 "$tmp/driver.py" "$tmp" "$agent" "$guest_mb" "${addrs[@]}" >>"$rows" 2>>"$tmp/errors.txt" || true
done

echo "# migration image benchmark ($(date -u +%Y-%m-%d), $(nproc) cores, $(uname -r), load average before: $load_before)"
echo
echo "bash bench/migrate.sh --guest-mb $guest_mb --paths $npaths --rounds $rounds; QEMU $(qemu-system-x86_64 --version | sed -n 's/.*version \([^ ]*\).*/\1/p') TCG,"
echo "a stopped ${guest_mb} MiB guest of random RAM; $npaths loopback tcp path(s); server volumes on tmpfs;"
echo "fio $(fio --version | sed 's/^fio-//') with libibnbd-fio.so for the raw rows. Medians of $rounds rounds; what each row is:"
echo "the header of bench/migrate.sh."
echo
python3 - "$rows" <<'EOF'
import statistics, sys

runs = {}
for line in open(sys.argv[1]):
    name, b, s, cpu = line.rstrip("\n").split("|")
    if float(s) > 0:
        runs.setdefault(name, []).append((int(b) * 8 / float(s) / 1e9, float(s), int(b), cpu))


def med(name):
    r = runs.get(name)
    return statistics.median(x[0] for x in r) if r else None


def ratio(a, b):
    a, b = med(a), med(b)
    return f"{a / b:.2f}" if a and b else "n/a"


print("| row | Gbit/s (median) | min..max | s (median) | agent CPU s/GiB | vs raw (write / read) | vs QEMU fd: file |")
print("| --- | --- | --- | --- | --- | --- | --- |")
labels = {"file": "agent file (no QEMU)", "exec": "agent exec", "unix": "agent unix", "multifd2": "agent multifd2",
          "fd": "qemu fd: file"}
order = ["raw write", "raw read"] + [f"{side} {w}" for side in ("save", "restore") for w in labels]
for name in order:
    side, way = name.split(" ", 1)
    label = name if side == "raw" else f"{side} {labels[way]}"
    r = runs.get(name)
    if not r:
        print(f"| {label} | failed | | | | | |")
        continue
    rates = [x[0] for x in r]
    secs = statistics.median(x[1] for x in r)
    cpus = [float(x[3]) / (x[2] / 2**30) for x in r if x[3]]
    cpu = f"{statistics.median(cpus):.2f}" if cpus else ""
    base = {"save": "raw write", "restore": "raw read"}.get(side)
    vs_raw = ratio(name, base) if base else "1.00"
    vs_fd = ratio(name, f"{side} fd") if base else ""
    print(f"| {label} | {med(name):.2f} | {min(rates):.2f}..{max(rates):.2f} | {secs:.3f} | {cpu} | {vs_raw} | {vs_fd} |")
print()
print(f"agent save / raw write (target >= 0.9): exec {ratio('save exec', 'raw write')}, "
      f"unix {ratio('save unix', 'raw write')}, multifd2 {ratio('save multifd2', 'raw write')}, "
      f"without QEMU {ratio('save file', 'raw write')}")
EOF
if [ -s "$tmp/errors.txt" ]; then
  echo
  echo "errors:"
  sed 's/^/    /' "$tmp/errors.txt"
fi
echo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg); the run took $(($(date +%s) - start)) s"
