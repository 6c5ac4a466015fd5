#!/usr/bin/env bash
# QEMU's own RDMA migration against the agent's, inside the VM rig (tests/vm: Debian's 6.12 kernel
# under TCG, Soft-RoCE rxe0 -> rxe1 over a veth pair, QEMU 7.2 nested in the guest, also TCG).
# One boot, one table. A paused guest of --guest-mb MiB (64 KiB of HLT as firmware, 3/4 of its RAM
# random bytes loaded at 1 MiB, the rest zero: the test's guest, vm_migrate_qemu_rdma.py, scaled)
# serves every save; each restore gets a fresh destination (-incoming defer). Rows:
#   qemu rdma       QEMU -> QEMU `migrate rdma:` (dynamic registration): `migrate` until both
#                   QEMUs say completed
#   agent rdma      save: `migrate rdma:` into `ibnbd-migrate save ... rdma` until QEMU says
#                   completed and the agent has committed (exited); restore: `ibnbd-migrate
#                   restore ... rdma` into `migrate-incoming rdma:` until the destination says
#                   completed
#   agent unix      the same through a unix socket (bench/migrate.sh's method on the host)
# The image volume is served by ibnbd-server inside the VM over tcp on loopback (the image
# transport is not the subject), on the VM's tmpfs. Rates: MiB/s of stream bytes, the length of
# the image the agent stored (the QEMU -> QEMU row moves the same guest's stream: its rate uses
# the agent rdma image's length). agent CPU: user + sys seconds of the agent per GiB of stream
# (/usr/bin/time). Ratios (of medians): agent rdma / qemu rdma, agent rdma / agent unix.
# A warm-up round goes first and is not counted: L0's TCG translates the nested QEMU's, rxe's and
# the agent's paths once per boot (the boot's first RDMA migration costs ~12 s more). Every row
# runs once per round, rows interleaved; the table has each row's median (min..max beside it).
# Under TCG (twice nested) the absolute rates say nothing about hardware; only the ratios, taken
# side by side in one boot, mean anything. A benchmark, not a test: it asserts nothing.
#
#   bash bench/migrate-vm.sh [--guest-mb N] [--rounds N] [--chart PNG|none]
#                               (default 64 MiB, 3 rounds; ~4 min; the chart of the table,
#                               bench/chart.sh, into bench/out/migrate-vm-<UTC time>.png)
#
# Why a script of its own and not a --vm mode of bench/migrate.sh: that one runs on the host with
# a 2 GiB guest whose RAM is a file mapping, fio raw rows and exec/multifd/fd rows; none of that
# carries over into a nested TCG guest, and the rdma rows need the rig's rxe pair. The build
# directory comes from $IBTRS_BUILD (default build, with -DIBTRS_RDMA=ON). Addresses: the VM's
# private 198.18.0.1 -> 198.18.0.2 pair, loopback and unix sockets only.
set -uo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
source "$top/bench/chart-lib.sh"
guest_mb=64
rounds=3
chart=
while [ $# -gt 0 ]; do
  case "$1" in
    --guest-mb) guest_mb=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --chart) chart=$(chart_arg "$PWD" "$2") || exit 2; shift 2 ;;
    *) echo "usage: $0 [--guest-mb N] [--rounds N] [--chart PNG|none]" >&2; exit 2 ;;
  esac
done
case "$rounds" in '' | *[!0-9]* | 0) echo "--rounds takes a whole number above 0" >&2; exit 2 ;; esac
case "$guest_mb" in '' | *[!0-9]*) echo "--guest-mb takes a whole number" >&2; exit 2 ;; esac
# The volume is 1 GiB (tests/migrate/qemu_migrate.py) and holds two images of a round at once.
if [ "$guest_mb" -lt 16 ] || [ "$guest_mb" -gt 384 ]; then echo "--guest-mb: 16..384" >&2; exit 2; fi
build=$(cd "${IBTRS_BUILD:-$top/build}" && pwd)

if [ "${IBTRS_VM:-}" != 1 ]; then
  nice ninja -C "$build" ibnbd-migrate ibnbd-server ibnbd >/dev/null || { echo "build failed" >&2; exit 1; }
  # The guest prints the table; the host draws it (the guest's files live in a throw-away overlay).
  out=$(mktemp "${TMPDIR:-/tmp}/migrate-vm.XXXXXX")
  trap 'rm -f "$out"' EXIT
  bash "$top/tests/vm/run-in-vm.sh" --timeout 1500 --env IBTRS_BUILD="$build" -- \
    bash "$top/bench/migrate-vm.sh" --guest-mb "$guest_mb" --rounds "$rounds" | tee "$out"
  rc=${PIPESTATUS[0]}
  bench_chart "$chart" migrate-vm "$out" \
    "bench/migrate-vm.sh --guest-mb $guest_mb --rounds $rounds, $(date -u +%Y-%m-%d), commit $(git -C "$top" rev-parse --short HEAD 2>/dev/null)" \
    "MiB/s (median)=MiB/s (median of the rounds)" "agent CPU s/GiB=agent CPU (s per GiB)"
  exit "$rc"
fi

for t in qemu-system-x86_64 python3 /usr/bin/time; do
  command -v "$t" >/dev/null || { echo "$t is missing (scripts/setup.sh installs it)" >&2; exit 1; }
done
[ -n "${IBTRS_RDMA_ADDR_B:-}" ] || { echo "no Soft-RoCE addresses in this VM" >&2; exit 1; }
start=$(date +%s)

IBNBD_TOP=$top python3 - "$build" "$guest_mb" "$rounds" <<'EOF'
import os, re, statistics, subprocess, sys, time

sys.path.insert(0, os.path.join(os.environ["IBNBD_TOP"], "tests/migrate"))
import qemu_migrate as qm  # noqa: E402  (Qmp, the server)
import vm_migrate_qemu_rdma as vr  # noqa: E402  (Rig: the shared HLT source, destinations)

build, guest_mb, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
MiB = qm.MiB
qm.GUEST_MB = guest_mb
qm.PATTERN = guest_mb * 3 // 4 * MiB
ADDR = vr.ADDR
BUSY = ("setup", "active", "device", "pre-switchover", "wait-unplug", "none")


def wait_done(q, until=None, timeout=600):
    """Polls query-migrate (every 20 ms: a QMP round trip costs the nested QEMU time) until
    completed and until() holds; the time then."""
    deadline = time.time() + timeout
    done = False
    while time.time() < deadline:
        if not done:
            st = q.cmd("query-migrate").get("status", "none")
            if st not in BUSY and st != "completed":
                raise RuntimeError("migration " + st)
            done = st == "completed"
        if done and (until is None or until()):
            return time.monotonic()
        time.sleep(0.02)
    raise RuntimeError("timeout")


def timed(env, argv, name):
    """The agent under /usr/bin/time (its user + sys seconds into NAME.cpu), stderr to NAME.log."""
    cpu = os.path.join(env.work, name + ".cpu")
    return env.spawn(["/usr/bin/time", "-f", "%U %S", "-o", cpu] + argv, name + ".log"), cpu


def cpu_of(path):
    try:
        u, s = open(path).read().split()[-2:]
        return float(u) + float(s)
    except (OSError, ValueError):
        return None


def image_bytes(env, image):
    for line in subprocess.run([env.agent, "list", "images.img", "from", env.paths[0], "host-key", env.key],
                               capture_output=True, text=True).stdout.splitlines()[1:]:
        f = line.split()
        if f and f[0] == image and f[1] == "committed":
            return int(f[2])
    raise RuntimeError(f"image {image} not committed")


def agent_ok(p, log_name, env):
    p.wait(60)
    if p.returncode != 0:
        raise RuntimeError(f"agent exit {p.returncode}: {env.log(log_name + '.log')[-300:]}")


DESTS = {}  # destination QEMUs of the round, connected before anything is timed: name -> (process, QMP)


def qemu_rdma(env, r):
    q, _ = env.source()
    p, qd = DESTS.pop(f"dst-q{r}")
    try:
        port = env.next_port()
        qd.cmd("migrate-incoming", uri=f"rdma:{ADDR}:{port}")
        t0 = time.monotonic()
        q.cmd("migrate", uri=f"rdma:{ADDR}:{port}")
        wait_done(q)
        return None, wait_done(qd) - t0, None
    finally:
        vr.stop(p, qd)


def save(env, r, way):
    q, _ = env.source()
    image = f"{way}{r}"
    extra = ["rdma", f"{ADDR}:0", "timeout", "120"] if way == "rdma" else ["unix", f"{env.work}/{image}.sock"]
    a, cpu = timed(env, env.migrate_args("save", image, "max", f"{guest_mb * 2}M", *extra), "save-" + image)
    if way == "rdma":
        m = env.wait_line(f"save-{image}.log", r"waiting for QEMU on rdma:\S+:(\d+)")
        if m is None:
            raise RuntimeError("agent did not listen: " + env.log(f"save-{image}.log")[-300:])
        uri = f"rdma:{ADDR}:{m.group(1)}"
    else:
        if env.wait_line(f"save-{image}.log", r"waiting for QEMU on ") is None:
            raise RuntimeError("agent did not listen: " + env.log(f"save-{image}.log")[-300:])
        uri = f"unix:{env.work}/{image}.sock"
    t0 = time.monotonic()
    q.cmd("migrate", uri=uri)
    t1 = wait_done(q, lambda: a.poll() is not None)
    agent_ok(a, "save-" + image, env)
    return image_bytes(env, image), t1 - t0, cpu_of(cpu)


def restore(env, r, way):
    image = f"{way}{r}"
    p, qd = DESTS.pop(f"dst-{way}{r}")
    try:
        if way == "rdma":
            port = env.next_port()
            qd.cmd("migrate-incoming", uri=f"rdma:{ADDR}:{port}")
            extra = ["rdma", f"{ADDR}:{port}", "timeout", "120"]
        else:
            sock = f"{env.work}/{image}-in.sock"
            qd.cmd("migrate-incoming", uri=f"unix:{sock}")
            extra = ["unix", sock]
        t0 = time.monotonic()
        a, cpu = timed(env, env.migrate_args("restore", image, *extra), "restore-" + image)
        t1 = wait_done(qd)
        agent_ok(a, "restore-" + image, env)
        return image_bytes(env, image), t1 - t0, cpu_of(cpu)
    finally:
        vr.stop(p, qd)


ROWS = [("qemu rdma", "save", lambda e, r: qemu_rdma(e, r)),
        ("agent rdma", "save", lambda e, r: save(e, r, "rdma")),
        ("agent rdma", "restore", lambda e, r: restore(e, r, "rdma")),
        ("agent unix", "save", lambda e, r: save(e, r, "unix")),
        ("agent unix", "restore", lambda e, r: restore(e, r, "unix"))]


def run(env):
    runs, errors = {}, []
    for r in range(rounds + 1):  # round 0: the warm-up
        names = (f"dst-q{r}", f"dst-rdma{r}", f"dst-unix{r}")
        for d in names:
            env.start(d, incoming=True)
        for d in names:  # up (QMP answers) before anything is timed
            p, path = env.started.pop(d)
            DESTS[d] = (p, qm.Qmp(path))
        for name, side, fn in ROWS:
            try:
                n, s, cpu = fn(env, r)
                if r > 0:
                    runs.setdefault((name, side), []).append((n, s, cpu))
            except Exception as e:
                errors.append(f"round {r} {side} {name}: {e}")
        for way in ("rdma", "unix"):
            subprocess.run(env.migrate_args("delete", f"{way}{r}"), capture_output=True)
    return runs, errors


env = vr.Rig(build)
try:
    runs, errors = run(env)
finally:
    env.cleanup()

stream = statistics.median(x[0] for x in runs.get(("agent rdma", "save"), [(0, 0, 0)]))


def med_rate(key):
    r = runs.get(key)
    if not r:
        return None
    return statistics.median((x[0] or stream) / MiB / x[1] for x in r)


print(f"# QEMU RDMA migration vs the agent in the VM rig ({time.strftime('%Y-%m-%d', time.gmtime())}, "
      f"{os.uname().release} under TCG, {os.cpu_count()} vCPUs, QEMU nested, also TCG)")
print()
print(f"A paused {guest_mb} MiB guest, {guest_mb * 3 // 4} MiB of it random; median of {rounds} rounds after a warm-up "
      "round; rows: the header of bench/migrate-vm.sh. Under TCG only the ratios mean anything.")
print()
print("| row | MiB/s (median) | min..max | s (median) | stream MiB | agent CPU s/GiB | vs qemu rdma | vs agent unix |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for side in ("save", "restore"):
    for name in ("qemu rdma", "agent rdma", "agent unix"):
        r = runs.get((name, side))
        if name == "qemu rdma" and side == "restore":
            continue
        if not r:
            print(f"| {side} {name} | failed | | | | | | |")
            continue
        rates = [(x[0] or stream) / MiB / x[1] for x in r]
        cpus = [x[2] / ((x[0] or stream) / 2**30) for x in r if x[2] is not None]
        q = med_rate(("qemu rdma", "save"))
        u = med_rate(("agent unix", side))
        vs_q = f"{med_rate((name, side)) / q:.2f}" if q and name != "qemu rdma" else ""
        vs_u = f"{med_rate((name, side)) / u:.2f}" if u and name == "agent rdma" else ""
        print(f"| {side} {name} | {statistics.median(rates):.1f} | {min(rates):.1f}..{max(rates):.1f} | "
              f"{statistics.median(x[1] for x in r):.2f} | {statistics.median((x[0] or stream) for x in r) / MiB:.1f} | "
              f"{f'{statistics.median(cpus):.2f}' if cpus else ''} | {vs_q} | {vs_u} |")
if errors:
    print()
    print("errors:")
    for e in errors:
        print("    " + e)
EOF
echo
echo "the run took $(($(date +%s) - start)) s in the VM"
