#!/usr/bin/env python3
"""QEMU 7.2's own RDMA migration (`migrate rdma:` / `-incoming rdma:`) into and out of migration
images through ibnbd-migrate, over Soft-RoCE in the VM rig (rxe0 -> rxe1 over the veth pair),
QEMU nested inside the guest (TCG). TAP-like output ("ok - NAME" / "not ok - NAME: why", "# ..."
notes with each case's time); exit 1 when anything failed, 77 when something it needs is absent.

    tests/vm/run-in-vm.sh -- python3 tests/migrate/vm_migrate_qemu_rdma.py BUILD_DIR
                                                       (ctest: vm_migrate_qemu_rdma, in vm_suite)
    IBNBD_QRDMA_CASES="peer save"   runs only those cases (peer save exec pinall pinmax kill hostile
                                    corrupt cut; rcut is not in the default set)

Guests are small and paused (-m 32, -S, 16 MiB of random bytes loaded at 1 MiB), as in
../shared/reference/qemu-rdma-migration.md; the images live on an ibnbd-server volume reached
over tcp on loopback (the image transport is not the subject here). Cases:
  peer     QEMU -> QEMU `migrate rdma:` over rxe: the rig and QEMU work (a failure here is the
           rig's, not the agent's);
  save     QEMU `migrate rdma:` -> `ibnbd-migrate save ... rdma` (dynamic registration), then
           restored over exec: - RAM sha256 equal, `cont` runs;
  exec     an exec:-saved image restored by `ibnbd-migrate restore ... rdma` into `-incoming
           rdma:` - equal, runs;
  pinall   rdma-pin-all on both sides: saved over rdma, restored over rdma - equal, runs;
  pinmax   a pin-max below the guest's RAM: the agent refuses pin-all with a clear error, QEMU's
           migration fails at once, the image stays PARTIAL;
  kill     the agent killed mid-save: QEMU's migration fails, the image stays PARTIAL, and its
           rdma restore is refused (QEMU's incoming migration fails, QEMU exits non-zero);
  hostile  qemu-rdma-peer (a test tool speaking the protocol badly) against the agent's save:
           a bad version is rejected; a bad type, a REGISTER outside the block, a bad stream get
           ERROR and a close; an RDMA WRITE outside the registered chunk is refused by the device
           and the agent names its failed QP; each save exits with an error, its image PARTIAL
           (IBNBD_QRDMA_HOSTILE="all": also a short message and a COMPRESS across chunks);
  corrupt  one byte flipped in the first chunk of an image saved earlier (found through the
           volume's directory), then its rdma restore: refused at that chunk before any byte
           reaches QEMU (QEMU's incoming migration fails, QEMU exits non-zero), the agent and
           `ibnbd-migrate verify` name the chunk;
  cut      both veths cut (netem loss 100% on their egress: a silent loss) 1 MiB into a throttled rdma save
           whose agent has `timeout 6`: the agent exits non-zero within its timeout + 4 s saying
           why (nothing heard, or the transport's retries exhausted), the image stays PARTIAL;
           the filters go whatever happens; QEMU's migration has failed by then, or is cancelled
           at once (QEMU 7.2 has no keepalive: a source waiting for READY over a dead link waits
           until cancelled); then rdma_cm must connect again (rping). Last: rxe was seen to
           refuse new rdma_cm connections for a while after such drops (vm-multipath.sh);
  rcut     (not in the default set) the same during an rdma restore, cut as soon as QEMU's
           incoming migration is active: the agent's bound and words are checked, QEMU's end
           only noted (its incoming side can be neither cancelled nor told over a dead link).
"""
import hashlib
import os
import re
import signal
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qemu_migrate as qm  # noqa: E402  (Qmp, Env: the server, the pattern, spawn; check)

MiB = qm.MiB
qm.GUEST_MB = 32
qm.PATTERN = 16 * MiB
ADDR = os.environ.get("IBTRS_RDMA_ADDR_B", "")
ADDR_A = os.environ.get("IBTRS_RDMA_ADDR_A", "")  # rping's source: rxe0 -> rxe1, as QEMU's sources
CASES = os.environ.get("IBNBD_QRDMA_CASES", "peer save exec pinall pinmax kill hostile corrupt cut").split()
# The cut: the veths under rxe0 / rxe1 (tests/vm/README.md), the agent's timeout during it.
NETDEVS = [os.environ.get("IBTRS_RDMA_NETDEV_A", "veth0"), os.environ.get("IBTRS_RDMA_NETDEV_B", "veth1")]
CUT_TIMEOUT = 6
RPING_PORTS = list(range(4500, 4510))


class Rig(qm.Env):
    """qm.Env (the server on tcp loopback, images.img, the pattern) with one source QEMU for every
    save: its firmware is 64 KiB of HLT, so between migrations it can `cont` (halting at the
    reset vector, RAM untouched) and `stop` again - QEMU refuses to migrate a VM "paused due to a
    previous migration". Each QEMU start and the first RDMA migration of a boot are the costly
    parts under nested TCG; RAM is compared by md5 (sha256 is 12x slower there)."""

    def __init__(self, build):
        super().__init__(build)
        self.bios = os.path.join(self.work, "hlt.bin")
        with open(self.bios, "wb") as f:
            f.write(b"\xf4" * (64 * 1024))
        self.port = 4460
        self.src = None
        self.partial = {}  # image -> what left it PARTIAL: checked by one `list` at the end
        self.started = {}  # QEMUs started ahead: name -> (process, QMP socket)

    def start(self, name, incoming=False):
        """Starts a QEMU without waiting for it (QEMU's start costs seconds under nested TCG)."""
        qmp = os.path.join(self.work, name + ".qmp")
        argv = ["qemu-system-x86_64", "-machine", "pc", "-accel", "tcg", "-m", str(qm.GUEST_MB), "-bios", self.bios,
                "-display", "none", "-nodefaults", "-nic", "none", "-serial", "none", "-S",
                "-qmp", f"unix:{qmp},server=on,wait=off",
                "-device", f"loader,file={os.path.join(self.work, 'pattern.bin')},addr=0x100000"]
        if incoming:
            argv += ["-incoming", "defer"]
        self.started[name] = (self.spawn(argv, name + ".log"), qmp)

    def qemu(self, name, incoming=False):
        """(process, QMP) of QEMU `name`, started now unless start() did it earlier."""
        if name not in self.started:
            self.start(name, incoming)
        p, qmp = self.started.pop(name)
        return p, qm.Qmp(qmp)

    def memsum(self, q, name):
        path = os.path.join(self.work, name + ".mem")
        q.cmd("pmemsave", val=0, size=qm.GUEST_MB * MiB, filename=path)
        with open(path, "rb") as f:
            h = hashlib.md5(f.read()).hexdigest()
        os.unlink(path)
        return h

    def next_port(self):
        self.port += 1
        return self.port

    def source(self, pin_all=False, bandwidth=None):
        """The shared source, paused and ready to migrate: (qmp, RAM md5)."""
        if self.src is None:
            p, q = self.qemu("src")
            self.src = (p, q, self.memsum(q, "src"))
        _, q, h = self.src
        if q.cmd("query-status").get("status") == "postmigrate":
            q.cmd("cont")
            q.cmd("stop")
        q.cmd("migrate-set-parameters", **{"max-bandwidth": bandwidth or 10 * 1024 * MiB})
        q.cmd("migrate-set-capabilities", capabilities=[{"capability": "rdma-pin-all", "state": pin_all}])
        return q, h

    def log(self, name):
        return qm.agent_log(self, name)

    def wait_line(self, log, pattern, timeout=30):
        """The first match of `pattern` in a log file, waiting for it (None after `timeout`)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = re.search(pattern, self.log(log))
            if m:
                return m
            time.sleep(0.05)
        return None

    def states(self):
        """Every image's state from one `ibnbd-migrate list` (each agent start costs a session)."""
        out = subprocess.run([self.agent, "list", "images.img", "from", self.paths[0], "host-key", self.key],
                             capture_output=True, text=True)
        return {l.split()[0]: l.split()[1] for l in out.stdout.splitlines()[1:] if len(l.split()) > 1}

    def agent_save(self, image, *extra, max_size="96M", timeout=60):
        """`ibnbd-migrate save ... rdma ADDR:0`: (agent, the port it printed, or None). Each save
        is bounded (`max`): a PARTIAL image keeps its extent, by default the largest free one."""
        log = f"agent-{image}.log"
        agent = self.spawn(self.migrate_args("save", image, "session", "mig-" + image, "rdma", f"{ADDR}:0",
                                             "timeout", str(timeout), "max", max_size, *extra), log)
        m = self.wait_line(log, r"waiting for QEMU on rdma:\S+:(\d+)")
        return agent, (int(m.group(1)) if m else None)


def stop(p, q):
    q.close()
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def finish(q, agent, timeout=90):
    st = qm.wait_migration(q, timeout)
    try:
        rc = agent.wait(60) if agent is not None else None
    except subprocess.TimeoutExpired:
        agent.kill()
        rc = "hung"
    return st, rc


def save_rdma(env, image, pin_all=False, agent_extra=(), during=None, bandwidth=None):
    """The source saved by `migrate rdma:` into the agent: (md5, status, agent rc, agent log)."""
    q, h = env.source(pin_all, bandwidth)
    agent, port = env.agent_save(image, *agent_extra)
    if port is None:
        agent.kill()
        return h, "agent did not listen", None, env.log(f"agent-{image}.log")
    q.cmd("migrate", uri=f"rdma:{ADDR}:{port}")
    if during:
        during(agent)
    st, rc = finish(q, agent)
    return h, st, rc, env.log(f"agent-{image}.log")


def save_exec(env, image):
    q, h = env.source()
    cmd = " ".join(env.migrate_args("save", image, "session", "mig-" + image, "max", "96M"))
    q.cmd("migrate", uri=f"exec:{cmd} 2>>{env.work}/agent-{image}.log")
    return h, qm.wait_migration(q, 90)


def restore_exec(env, image):
    """`-incoming exec:ibnbd-migrate restore ...`: (status, md5)."""
    dst, q = env.qemu("dst-" + image, incoming=True)
    try:
        cmd = " ".join(env.migrate_args("restore", image))
        q.cmd("migrate-incoming", uri=f"exec:{cmd} 2>>{env.work}/agent-r-{image}.log")
        st = qm.wait_migration(q, 90)
        if st != "completed":
            return st, None
        h = env.memsum(q, "dst-" + image)
        q.cmd("cont")
        return ("completed" if q.cmd("query-status").get("running") else "not running"), h
    finally:
        stop(dst, q)


def restore_rdma(env, image, pin_all=False, dst_name=None):
    """`-incoming rdma:` fed by `ibnbd-migrate restore ... rdma`: (status, md5, qemu rc, log,
    agent rc). The destination is QEMU "dst-IMAGE" unless named."""
    dst, q = env.qemu(dst_name or "dst-" + image, incoming=True)
    log = f"agent-r-{image}.log"
    try:
        port = env.next_port()
        q.cmd("migrate-incoming", uri=f"rdma:{ADDR}:{port}")
        agent = env.spawn(env.migrate_args("restore", image, "rdma", f"{ADDR}:{port}", "timeout", "60",
                                           *(["pin-all"] if pin_all else [])), log)
        st, arc = finish(q, agent)
        if st != "completed":
            try:
                rc = dst.wait(20)
            except subprocess.TimeoutExpired:
                rc = None
            return st, None, rc, env.log(log), arc
        h = env.memsum(q, "dst-" + image)
        q.cmd("cont")
        running = q.cmd("query-status").get("running")
        return ("completed" if running else "not running"), h, None, env.log(log), arc
    finally:
        stop(dst, q)


def timed(name, fn, env):
    t0 = time.time()
    try:
        fn(env)
    finally:
        print(f"# {name}: {time.time() - t0:.1f} s", flush=True)


def case_peer(env):
    # Case: QEMU -> QEMU over rxe, no agent. Expect: completed, RAM equal (the rig works).
    q, h = env.source()
    dst, qd = env.qemu("dst-peer", incoming=True)
    try:
        port = env.next_port()
        qd.cmd("migrate-incoming", uri=f"rdma:{ADDR}:{port}")
        q.cmd("migrate", uri=f"rdma:{ADDR}:{port}")
        st = qm.wait_migration(q, 90)
        std = qm.wait_migration(qd, 30)
        h2 = env.memsum(qd, "dst-peer") if std == "completed" else None
        qm.check("peer: QEMU -> QEMU migrate rdma: over rxe completes, RAM equal",
                 st == "completed" and h2 == h, f"source {st}, destination {std}")
    finally:
        stop(dst, qd)


def case_save(env):
    # Case: migrate rdma: into the agent (dynamic registration), restore over exec:.
    # Expect: both complete, the agent reports dynamic registration, RAM equal, `cont` runs.
    h, st, rc, log = save_rdma(env, "rd")
    qm.check("rdma save (dynamic registration) completes", st == "completed" and rc == 0 and
             "dynamic registration" in log, f"{st}, agent {rc}: {log[-600:]}")
    rst, h2 = restore_exec(env, "rd")
    qm.check("rdma-saved image restored over exec: RAM equal, runs", rst == "completed" and h2 == h,
             f"{rst} {h2} != {h}: {env.log('agent-r-rd.log')[-300:]}")


def case_exec(env):
    # Case: an exec:-saved image restored over rdma: (dynamic registration).
    h, st = save_exec(env, "ex")
    qm.check("exec save completes", st == "completed", st)
    rst, h2, _, log, _ = restore_rdma(env, "ex")
    qm.check("exec-saved image restored over rdma: RAM equal, runs", rst == "completed" and h2 == h and
             "dynamic registration" in log, f"{rst} {h2} != {h}: {log[-600:]}")


def case_pinall(env):
    # Case: rdma-pin-all on the source, saved over rdma; restored over rdma asking pin-all.
    h, st, rc, log = save_rdma(env, "pa", pin_all=True)
    qm.check("rdma save with rdma-pin-all completes, pinned", st == "completed" and rc == 0 and "pin-all" in log,
             f"{st}, agent {rc}: {log[-600:]}")
    rst, h2, _, rlog, _ = restore_rdma(env, "pa", pin_all=True)
    qm.check("pin-all image restored over rdma with pin-all: RAM equal, runs",
             rst == "completed" and h2 == h and "pin-all" in rlog, f"{rst} {h2} != {h}: {rlog[-600:]}")


def case_pinmax(env):
    # Case: pin-all above the agent's pin-max. Expect: a clear error, QEMU fails (no hang),
    # the image stays PARTIAL.
    _, st, rc, log = save_rdma(env, "pm", pin_all=True, agent_extra=("pin-max", "16M"))
    qm.check("pin-all above pin-max: refused with the numbers, QEMU fails",
             st == "failed" and rc not in (0, None, "hung") and "pin-all needs" in log, f"{st}, agent {rc}: {log[-600:]}")
    env.partial["pm"] = "pin-all above pin-max"


def case_kill(env):
    # Case: the agent killed 1 s into a save (the source throttled to 4 MiB/s).
    # Expect: QEMU's migration fails, the image stays PARTIAL, its rdma restore is refused.
    def kill_agent(agent):
        time.sleep(1.0)
        agent.send_signal(signal.SIGKILL)

    _, st, _, log = save_rdma(env, "kl", bandwidth=4 * MiB, during=kill_agent)
    qm.check("agent killed mid-save: QEMU's migration fails", st == "failed", f"{st}: {log[-300:]}")
    env.partial["kl"] = "the agent killed mid-save"
    rst, _, rc, rlog, _ = restore_rdma(env, "kl")
    qm.check("rdma restore of a PARTIAL image: refused, QEMU exits non-zero", rst != "completed" and
             rc not in (0, None), f"{rst}, qemu exit {rc}: {rlog[-300:]}")


def case_hostile(env):
    tool = os.path.join(env.build, "tests/migrate/qemu-rdma-peer")
    if not os.access(tool, os.X_OK):
        qm.not_ok("hostile peer", f"{tool} not built")
        return
    # Each case: a fresh agent save; the tool connects and misbehaves.
    # Expect: the tool's verdict line "ok" (it saw ERROR, or the reject, or the device refusing
    # its write), the agent exits non-zero with the reason, the image is PARTIAL.
    cases = [("version", "refused the source's connection"), ("type", "control message type"),
             ("length", "control header says"), ("register", "register: address"),
             ("compress", "leave its chunk"), ("stream", "the stream"),
             ("write", "queue pair went to error")]
    # The decoder's every check is a unit test (unit_migrate_qemu_rdma) and a fuzz target; here
    # one of each kind of failure the agent handles: a reject, a header, the layout, the stream,
    # the device. IBNBD_QRDMA_HOSTILE="all" (or names) runs the others too.
    only = os.environ.get("IBNBD_QRDMA_HOSTILE", "version type register stream write").split()
    if only == ["all"]:
        only = []
    for i, (name, why) in enumerate(cases):
        if only and name not in only:
            continue
        env.hostile_runs = getattr(env, "hostile_runs", 0) + 1  # names stay apart when repeated
        image = f"h{env.hostile_runs}"
        agent, port = env.agent_save(image, max_size="8M")
        if port is None:
            qm.not_ok(f"hostile {name}", "agent did not listen")
            agent.kill()
            continue
        r = subprocess.run([tool, name, f"{ADDR}:{port}"], capture_output=True, text=True, timeout=60)
        try:
            rc = agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
            rc = "hung"
        log = env.log(f"agent-{image}.log")
        env.partial[image] = f"hostile {name}"
        qm.check(f"hostile {name}: the agent refuses it (a reject, ERROR, or its failed QP named), exits with an error",
                 r.returncode == 0 and rc not in (0, None, "hung") and rc > 0 and why in log,
                 f"tool {r.returncode}: {r.stdout.strip()} {r.stderr.strip()[-200:]}; agent {rc}: {log[-400:]}")


def first_chunk(volume, image):
    """The volume offset of `image`'s stored chunk 0 when it is COMMITTED, read as
    docs/migration-image.md lays it out: the directory copy (primary at 0, mirror in the last
    4096 bytes) with the highest generation, the image's slot, its header's data_offset. None
    when the image is not there or not committed. (No agent start: each costs seconds here.)"""
    with open(volume, "rb") as f:
        size = f.seek(0, 2)
        copies = []
        for at in (0, size - 4096):
            f.seek(at)
            d = f.read(4096)
            if d[:8] == b"IBNBDDIR":
                copies.append((struct.unpack_from("<Q", d, 16)[0], d))
        if not copies:
            return None
        d = max(copies)[1]
        for i in range(struct.unpack_from("<I", d, 12)[0]):
            slot = d[64 + 128 * i:64 + 128 * (i + 1)]
            if slot[:64].rstrip(b"\0") == image.encode() and struct.unpack_from("<I", slot, 80)[0] == 2:
                start = struct.unpack_from("<Q", slot, 64)[0]
                f.seek(start)
                h = f.read(4096)
                if h[:8] != b"IBNBDIMG":
                    return None
                return start + struct.unpack_from("<Q", h, 192)[0]
    return None


def case_corrupt(env):
    # Case: one byte flipped 4 KiB into the first stored chunk of an image saved completely
    # earlier (the save, exec or pinall case's), then `restore ... rdma` of it.
    # Expect: QEMU's incoming migration fails and QEMU exits non-zero; the agent exits with an
    # error naming the chunk ("CRC32C mismatch", piece 0) before it has sent QEMU any RAM (no
    # "rounds" summary); `ibnbd-migrate verify` names the same chunk.
    vol = os.path.join(env.work, "export/images.img")
    image, at = next(((i, a) for i in ("rd", "ex", "pa") for a in [first_chunk(vol, i)] if a is not None),
                     (None, None))
    if at is None:
        qm.not_ok("corrupt", "no committed image of the save/exec/pinall cases to corrupt")
        return
    env.corrupted = image
    with open(vol, "r+b") as f:
        f.seek(at)
        magic = f.read(4)
        f.seek(at + 4096)
        b = f.read(1)
        f.seek(at + 4096)
        f.write(bytes([b[0] ^ 0x20]))
    qm.check("corrupt: the image's chunk 0 found through the directory (a stream's magic there)",
             magic == b"QEVM", f"{image} at {at}: {magic!r}")
    # verify beside the restore (each agent start costs seconds here): both only read.
    verify = subprocess.Popen(env.migrate_args("verify", image), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
    rst, _, rc, log, arc = restore_rdma(env, image, dst_name="dst-co")
    qm.check("corrupt chunk: rdma restore refused, QEMU's incoming migration fails, QEMU exits non-zero",
             rst != "completed" and rc not in (0, None), f"{rst}, qemu exit {rc}: {log[-300:]}")
    qm.check("corrupt chunk: the agent names it and fails before any RAM went out",
             arc not in (0, None, "hung") and arc > 0 and "CRC32C mismatch" in log and "piece 0" in log and
             " rounds, " not in log, f"agent {arc}: {log[-400:]}")
    try:
        _, verr = verify.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        verify.kill()
        _, verr = verify.communicate()
    qm.check("corrupt chunk: verify names it too", verify.returncode not in (0, None) and "CRC32C mismatch" in verr and
             "piece 0" in verr, f"verify {verify.returncode}: {verr[-400:]}")


def tc_cut(add):
    """Cuts both veths (add: netem dropping every packet they send) or mends them: "" or what
    tc said. netem's loss is silent (the sender is told the packet went), as a cut cable is; a
    filter's drop would fail rxe's send at once. No clsact/ingress qdisc: the first one flips a
    kernel static key, and that live code patching has killed the nested TCG guest (an
    unexpected int3 in a TCP connect) 2 s after it, with the qdiscs made before any QEMU ran.
    Only RoCEv2 crosses the veths here (the image volume is on loopback). The netem qdiscs are
    made (loss 0%) before any QEMU runs and only changed here: replacing a qdisc under traffic
    fails the sends of that moment, and rxe then fails its QP at once - no silent loss. One tc
    for both veths (-force: each line is tried; a process start costs here)."""
    lines = [f"qdisc change dev {d} root netem loss {100 if add else 0}%" for d in NETDEVS]
    r = subprocess.run(["tc", "-force", "-batch", "-"], input="\n".join(lines) + "\n", capture_output=True, text=True)
    return "" if r.returncode == 0 else f"tc {lines}: {r.stderr.strip()}"


def rdma_cm_works(timeout=30):
    """Seconds until one rping over rxe0 -> rxe1 succeeds (None: not within `timeout`)."""
    t0 = time.time()
    port = str(RPING_PORTS.pop(0))
    while time.time() - t0 < timeout:
        srv = subprocess.Popen(["rping", "-s", "-a", ADDR, "-p", port, "-C", "1"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        time.sleep(0.2)
        try:
            c = subprocess.run(["rping", "-c", "-a", ADDR, "-I", ADDR_A, "-p", port, "-C", "1"],
                               capture_output=True, timeout=5)
            good = c.returncode == 0
        except subprocess.TimeoutExpired:
            good = False
        try:
            srv.wait(2)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()
        if good:
            return time.time() - t0
        time.sleep(0.5)
    return None



def case_cut(env):
    # Case: both veths cut 1 MiB into an rdma save throttled to 4 MiB/s, the agent's
    # `timeout` 6 s. Expect: the agent exits with an error (not a signal) within 6 + 4 s of the
    # cut and says why (nothing heard within its timeout, or the transport's retries exhausted),
    # not a crash or a hang; the image stays PARTIAL; QEMU's migration has failed by then or
    # ends at once when cancelled.
    q, _ = env.source(bandwidth=4 * MiB)
    agent, port = env.agent_save("ct", timeout=CUT_TIMEOUT)
    if port is None:
        agent.kill()
        qm.not_ok("cut", "agent did not listen: " + env.log("agent-ct.log")[-300:])
        return
    env.partial["ct"] = "the link cut mid-save"
    q.cmd("migrate", uri=f"rdma:{ADDR}:{port}")
    # Cut once pages flow (1 MiB of 16 at 4 MiB/s): the connection is up, the save well short
    # of its end (2 s at most: still mid-save, should the counter stay still).
    deadline = time.time() + 2
    while time.time() < deadline and q.cmd("query-migrate").get("ram", {}).get("transferred", 0) < MiB:
        time.sleep(0.05)
    cut_and_watch(env, "cut", q, agent, "agent-ct.log", "stays PARTIAL", cancel=True)


def migration_state(q):
    try:
        st = q.cmd("query-migrate").get("status", "none")
    except (EOFError, OSError):
        return "qemu exited"
    return None if st in ("setup", "active", "device", "pre-switchover", "none", "cancelling") else st


def cut_and_watch(env, name, q, agent, log_name, final, cancel):
    """Cuts; watches the agent (and QEMU's migration, `q`) until the agent has ended (its
    timeout + 6 s at most); removes the filters whatever happens; gives QEMU 0.3 s more, then
    `migrate_cancel` when `cancel` (a source: QEMU 7.2 has no keepalive, and a source waiting for
    READY over a dead link waits until cancelled; its wait loop checks for that every 100 ms).
    Checks the agent's bound and words (and `final` in its log), QEMU's end when `cancel`; then
    waits for rdma_cm to connect again. Returns how QEMU's migration ended, for the notes."""
    st = rc = t_q = t_a = None
    try:
        err = tc_cut(True)
        t0 = time.time()
        qm.check(f"{name}: both veths cut (netem loss 100%)", not err, err)
        while time.time() - t0 < CUT_TIMEOUT + 6 and t_a is None:
            if t_q is None:
                st = migration_state(q)
                t_q = time.time() - t0 if st else None
            if agent.poll() is not None:
                rc, t_a = agent.returncode, time.time() - t0
            time.sleep(0.1)
    finally:
        err = tc_cut(False)
    if t_a is None:
        agent.kill()
        rc = "hung"
    how = "by itself"
    deadline = time.time() + 0.3
    while st is None and time.time() < deadline:
        st = migration_state(q)
        t_q = time.time() - t0 if st else None
        time.sleep(0.1)
    if st is None and cancel:
        how = "cancelled after the agent gave up"
        q.cmd("migrate_cancel")
        deadline = time.time() + 5
        while st is None and time.time() < deadline:
            st = migration_state(q)
            time.sleep(0.1)
        t_q = time.time() - t0
    # The agent's own lines, without its once-a-second progress.
    log = "\n".join(l for l in env.log(log_name).splitlines() if not re.match(r"ibnbd-migrate: (saved|restored) ", l))
    said = re.search(r"nothing from the peer in [0-9.]+ s|stopped acknowledging|closed the connection|"
                     r"queue pair went to error \(the link failed", log)
    print(f"# {name}: the agent exited {rc} after {t_a if t_a is None else round(t_a, 1)} s: "
          f"{said.group(0) if said else '?'}; QEMU's migration {st} {how} after "
          f"{t_q if t_q is None else round(t_q, 1)} s", flush=True)
    qm.check(f"{name}: the filters are removed", not err, err)
    qm.check(f"{name}: the agent exits with an error within {CUT_TIMEOUT} + 4 s, saying why",
             rc not in (0, None, "hung") and rc > 0 and t_a <= CUT_TIMEOUT + 4 and said is not None and
             final in log, f"agent {rc} after {t_a} s: {log[-500:]}")
    if cancel:
        qm.check(f"{name}: QEMU's migration ends (failed, or cancelled at once once the agent gave up)",
                 st in ("failed", "cancelled"), f"{st} after {t_q} s: {env.log('src.log')[-300:]}")
    # Case: rdma_cm after the filters are gone. Expect: a connection within 30 s (the tests
    # after this one, vm_multipath in the suite, need it).
    back = rdma_cm_works()
    print(f"# {name}: rdma_cm connects again {back if back is None else round(back, 1)} s after the filters went",
          flush=True)
    qm.check(f"{name}: rdma_cm connects again within 30 s of the filters' removal", back is not None)
    return st, how


def case_rcut(env):
    # Case (not in the default set): both veths cut as soon as the destination's incoming
    # migration is active, during `restore ... rdma` (agent timeout 6 s) of an image saved
    # earlier. Expect: the agent exits with an error within 6 + 4 s saying why; QEMU's incoming
    # migration fails (QEMU exits) within 30 s.
    vol = os.path.join(env.work, "export/images.img")
    image = next((i for i in ("pa", "ex", "rd") if i != env.corrupted and first_chunk(vol, i) is not None), None)
    if image is None:
        qm.not_ok("rcut", "no committed, uncorrupted image of the exec/pinall/save cases")
        return
    p, q = env.qemu("dst-rc", incoming=True)
    try:
        port = env.next_port()
        q.cmd("migrate-incoming", uri=f"rdma:{ADDR}:{port}")
        agent = env.spawn(env.migrate_args("restore", image, "rdma", f"{ADDR}:{port}", "timeout", str(CUT_TIMEOUT)),
                          "agent-r-rc.log")
        deadline = time.time() + 20
        while time.time() < deadline and q.cmd("query-migrate").get("status") != "active":
            time.sleep(0.02)
        # QEMU's incoming side cannot be cancelled; it ends only if it had something unacknowledged
        # on the wire at the cut (its RC retries run out) - noted, not checked.
        cut_and_watch(env, "rcut", q, agent, "agent-r-rc.log", "restore " + image, cancel=False)
    finally:
        stop(p, q)


# The destinations each case restores into, started together at the beginning.
DESTINATIONS = {"peer": ["dst-peer"], "save": ["dst-rd"], "exec": ["dst-ex"], "pinall": ["dst-pa"], "kill": ["dst-kl"],
                "corrupt": ["dst-co"], "rcut": ["dst-rc"]}


def run(env):
    env.corrupted = None
    cut = "cut" in CASES or "rcut" in CASES
    if cut:
        subprocess.run(["tc", "-force", "-batch", "-"], capture_output=True, text=True,
                       input="".join(f"qdisc replace dev {d} root netem loss 0%\n" for d in NETDEVS))
    try:
        run_cases(env)
    finally:
        if cut:
            subprocess.run(["tc", "-force", "-batch", "-"], capture_output=True, text=True,
                           input="".join(f"qdisc del dev {d} root\n" for d in NETDEVS))


def run_cases(env):
    for name in CASES:
        for d in DESTINATIONS.get(name, []):
            env.start(d, incoming=True)
    for name in CASES:
        fn = globals().get("case_" + name)
        if fn is None:
            qm.not_ok(name, "no such case")
            continue
        try:
            timed(name, fn, env)
        except Exception as e:  # a broken case fails with its reason, the source's and agent's logs
            logs = sorted((f for f in os.listdir(env.work) if f.startswith("agent-")),
                          key=lambda f: os.path.getmtime(os.path.join(env.work, f)))
            last = env.log(logs[-1])[-500:] if logs else ""
            qm.not_ok(name, f"{e!r}; source QEMU: {env.log('src.log')[-300:]}; agent: {last}")
    # Case: every agent's log (failing agents included: their exit status says nothing about a
    # sanitizer's report). Expect: no AddressSanitizer / LeakSanitizer / UBSan report.
    reports = [f for f in sorted(os.listdir(env.work)) if f.startswith("agent-") and
               re.search(r"Sanitizer|runtime error:", env.log(f))]
    qm.check("no sanitizer report in any agent's log", not reports,
             "; ".join(f"{f}: {env.log(f)[-300:]}" for f in reports[:3]))
    # Case: every failed save above. Expect: its image is listed PARTIAL (restores refuse it).
    if env.partial:
        states = env.states()
        bad = {i: states.get(i, "absent") for i in env.partial if states.get(i) != "partial"}
        qm.check(f"the {len(env.partial)} failed saves left their images PARTIAL", not bad,
                 ", ".join(f"{i} ({env.partial[i]}): {st}" for i, st in bad.items()))


def main():
    if not ADDR:
        print("1..0 # SKIP needs the VM rig's Soft-RoCE addresses (IBTRS_RDMA_ADDR_B unset)")
        return 77
    qemu = subprocess.run(["sh", "-c", "ldd \"$(command -v qemu-system-x86_64)\""], capture_output=True, text=True)
    if qemu.returncode == 0 and "librdmacm" not in qemu.stdout:
        print("1..0 # SKIP this qemu-system-x86_64 has no RDMA migration (not linked with librdmacm)")
        return 77
    return qm.main_with(Rig, run, ("client/migrate/ibnbd-migrate", "server/ibnbd-server", "client/cli/ibnbd"))


if __name__ == "__main__":
    sys.exit(main())
