#!/usr/bin/env python3
"""QEMU 7.2 (TCG, -nic none) saving to and restoring from migration images on an ibnbd-server
volume through ibnbd-migrate, as a hypervisor would. TAP-like output ("ok - NAME" / "not ok -
NAME: why"); exit 1 when anything failed, 77 when QEMU is missing.

    python3 tests/migrate/qemu_migrate.py BUILD_DIR        (ctest: qemu_migrate)

Cases (all guests stopped while saving: QEMU 7.2 under TCG loses pages in live migration of a
memory-writing guest, so byte-exactness is tested non-live, as `virsh save` does):
  exec save + exec restore, unix save + unix restore: pmemsave sha256 equal, `cont` runs;
  a byte flipped on the server: restore refused naming the chunk, QEMU exits non-zero;
  a path disconnected during a save: the save completes over the other path;
  the agent killed during a save: the image stays PARTIAL and is refused;
  multifd with 2 channels: round trip;
  fd: through QMP getfd (a socket pair per direction): round trip.
"""
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

MiB = 1 << 20
GUEST_MB = 256
PATTERN = 48 * MiB  # random bytes loaded at 1 MiB guest-physical (-device loader)

failed = False


def ok(name):
    print(f"ok - {name}", flush=True)


def not_ok(name, why):
    global failed
    failed = True
    print(f"not ok - {name}: {why}", flush=True)


def check(name, cond, why=""):
    ok(name) if cond else not_ok(name, why)
    return cond


class Qmp:
    """A minimal QMP client: one command at a time, events skipped."""

    def __init__(self, path, timeout=30):
        deadline = time.time() + timeout
        while True:
            try:
                self.s = socket.socket(socket.AF_UNIX)
                self.s.connect(path)
                break
            except OSError:
                self.s.close()
                if time.time() > deadline:
                    raise
                time.sleep(0.1)
        self.f = self.s.makefile("rwb")
        self._read()  # greeting
        self.cmd("qmp_capabilities")

    def _read(self):
        while True:
            line = self.f.readline()
            if not line:
                raise EOFError("QMP closed")
            msg = json.loads(line)
            if "event" not in msg:
                return msg

    def cmd(self, name, **args):
        self.f.write(json.dumps({"execute": name, "arguments": args}).encode() + b"\n")
        self.f.flush()
        r = self._read()
        if "error" in r:
            raise RuntimeError(f"{name}: {r['error']}")
        return r.get("return")

    def getfd(self, name, fd):
        """QMP getfd: hands `fd` to QEMU (SCM_RIGHTS) under `name`, for fd:NAME URIs."""
        msg = json.dumps({"execute": "getfd", "arguments": {"fdname": name}}).encode() + b"\n"
        socket.send_fds(self.s, [msg], [fd])
        r = self._read()
        if "error" in r:
            raise RuntimeError(f"getfd: {r['error']}")

    def close(self):
        try:
            self.s.close()
        except OSError:
            pass


class Env:
    def __init__(self, build):
        self.build = build
        self.work = tempfile.mkdtemp(prefix="ibnbd-qemu-mig.", dir="/var/tmp")
        self.procs = []
        self.agent = os.path.join(build, "client/migrate/ibnbd-migrate")
        self.cli = os.path.join(build, "client/cli/ibnbd")
        os.makedirs(os.path.join(self.work, "export"))
        with open(os.path.join(self.work, "export/images.img"), "wb") as f:
            f.truncate(1024 * MiB)
        # Authenticated, as the daemons run by default: one host key granted everything; the
        # agent and the client daemons present it.
        self.key = os.path.join(self.work, "host.key")
        subprocess.run([self.cli, "key", "generate", "host", "nqn.2014-08.org.nvmexpress:uuid:"
                        "9e000000-0000-4000-8000-000000000001", "out", self.key], check=True, capture_output=True)
        with open(os.path.join(self.work, "hosts.json"), "w") as f:
            f.write('{"hosts": [{"key_file": "%s", "access": [{"devices": "**", "mode": "migration"}]}]}' % self.key)
        ready = os.path.join(self.work, "srv.ready")
        self.srv = self.spawn([os.path.join(build, "server/ibnbd-server"), "--config",
                               os.path.join(self.work, "hosts.json"), "--listen", "tcp:127.0.0.1:0",
                               "--listen", "tcp:127.0.0.1:0", "--dev-search-path",
                               os.path.join(self.work, "export"), "--control-socket",
                               os.path.join(self.work, "srv.sock"), "--ready-file", ready,
                               "--hb-interval-ms", "200"], "srv.log")
        for _ in range(100):
            if os.path.exists(ready):
                break
            time.sleep(0.1)
        self.paths = [l.split()[1] for l in open(ready) if l.startswith("listening ")]
        with open(os.path.join(self.work, "pattern.bin"), "wb") as f:
            f.write(os.urandom(PATTERN))

    def spawn(self, argv, log, **kw):
        out = kw.pop("stdout", None)
        logf = open(os.path.join(self.work, log), "wb")
        # With stdout taken (the stream, in fd: restores) the log gets stderr alone.
        p = subprocess.Popen(argv, stdout=out if out is not None else logf,
                             stderr=logf if out is not None else subprocess.STDOUT, **kw)
        self.procs.append(p)
        return p

    def migrate_args(self, cmd, image, *extra):
        return [self.agent, cmd, "images.img", "from", *self.paths, "host-key", self.key, "image", image, *extra]

    def qemu(self, name, incoming=False):
        qmp = os.path.join(self.work, name + ".qmp")
        argv = ["qemu-system-x86_64", "-machine", "pc", "-accel", "tcg", "-m", str(GUEST_MB),
                "-display", "none", "-nodefaults", "-nic", "none", "-serial", "none", "-S",
                "-qmp", f"unix:{qmp},server=on,wait=off",
                "-device", f"loader,file={os.path.join(self.work, 'pattern.bin')},addr=0x100000"]
        if incoming:
            argv += ["-incoming", "defer"]
        p = self.spawn(argv, name + ".log")
        return p, Qmp(qmp)

    def memsum(self, q, name):
        path = os.path.join(self.work, name + ".mem")
        q.cmd("pmemsave", val=0, size=GUEST_MB * MiB, filename=path)
        h = hashlib.sha256(open(path, "rb").read()).hexdigest()
        os.unlink(path)
        return h

    def cleanup(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        shutil.rmtree(self.work, ignore_errors=True)


def wait_migration(q, timeout=120):
    """Status of the migration once it leaves setup/active (completed, failed, cancelled)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            st = q.cmd("query-migrate").get("status", "none")
        except (EOFError, OSError):
            return "qemu exited"
        if st not in ("setup", "active", "device", "pre-switchover", "wait-unplug", "none"):
            return st
        time.sleep(0.1)
    return "timeout"


def save(env, image, uri_kind, bandwidth=None, channels=0, during=None):
    """Saves a stopped source. Returns (source sha256, status, agent process or None)."""
    src, q = env.qemu("src-" + image)
    try:
        h = env.memsum(q, "src-" + image)
        q.cmd("migrate-set-parameters", **{"max-bandwidth": bandwidth or 10 * 1024 * MiB})
        agent = None
        if channels:
            q.cmd("migrate-set-capabilities", capabilities=[{"capability": "multifd", "state": True}])
            q.cmd("migrate-set-parameters", **{"multifd-channels": channels})
        if uri_kind == "exec":
            cmd = " ".join(env.migrate_args("save", image, "session", "mig-" + image))
            q.cmd("migrate", uri=f"exec:{cmd} 2>>{env.work}/agent-{image}.log")
        elif uri_kind == "fd":
            # A management tool's way: a socket pair, one end to QEMU by getfd, the agent
            # reading the other end as its stdin.
            ours, qemus = socket.socketpair()
            q.getfd("mig", qemus.fileno())
            qemus.close()
            agent = env.spawn(env.migrate_args("save", image, "session", "mig-" + image), f"agent-{image}.log",
                              stdin=ours)
            ours.close()
            q.cmd("migrate", uri="fd:mig")
        else:
            sock = os.path.join(env.work, image + ".sock")
            extra = ["unix", sock, "session", "mig-" + image] + (["channels", str(channels)] if channels else [])
            agent = env.spawn(env.migrate_args("save", image, *extra), f"agent-{image}.log")
            for _ in range(100):
                if os.path.exists(sock):
                    break
                time.sleep(0.1)
            q.cmd("migrate", uri=f"unix:{sock}")
        if during:
            during(agent)
        st = wait_migration(q)
        if agent is not None:
            try:
                agent.wait(60)
            except subprocess.TimeoutExpired:
                agent.kill()
        return h, st, agent
    finally:
        q.close()
        src.terminate()
        src.wait(10)


def restore(env, image, uri_kind, channels=0):
    """Restores into a fresh destination. Returns (status, sha256 or None, qemu exit code or None)."""
    dst, q = env.qemu("dst-" + image, incoming=True)
    try:
        if channels:
            q.cmd("migrate-set-capabilities", capabilities=[{"capability": "multifd", "state": True}])
            q.cmd("migrate-set-parameters", **{"multifd-channels": channels})
        agent = None
        if uri_kind == "exec":
            cmd = " ".join(env.migrate_args("restore", image))
            q.cmd("migrate-incoming", uri=f"exec:{cmd} 2>>{env.work}/agent-r-{image}.log")
        elif uri_kind == "fd":
            ours, qemus = socket.socketpair()
            q.getfd("mig", qemus.fileno())
            qemus.close()
            q.cmd("migrate-incoming", uri="fd:mig")
            agent = env.spawn(env.migrate_args("restore", image), f"agent-r-{image}.log", stdout=ours)
            ours.close()
        else:
            sock = os.path.join(env.work, image + "-in.sock")
            q.cmd("migrate-incoming", uri=f"unix:{sock}")
            agent = env.spawn(env.migrate_args("restore", image, "unix", sock), f"agent-r-{image}.log")
        st = wait_migration(q, 60)
        if agent is not None:
            try:
                agent.wait(30)
            except subprocess.TimeoutExpired:
                agent.kill()
        if st != "completed":
            try:
                rc = dst.wait(20)
            except subprocess.TimeoutExpired:
                rc = None
            return st, None, rc
        h = env.memsum(q, "dst-" + image)
        q.cmd("cont")
        running = q.cmd("query-status").get("running")
        return ("completed" if running else "not running"), h, None
    finally:
        q.close()
        if dst.poll() is None:
            dst.terminate()
            dst.wait(10)


def agent_log(env, name):
    try:
        return open(os.path.join(env.work, name)).read()
    except OSError:
        return ""


def run(env):
    # Case: exec save, exec restore. Expect: equal memory, the destination runs.
    h, st, _ = save(env, "ex", "exec")
    check("exec save completes", st == "completed", st)
    rst, h2, _ = restore(env, "ex", "exec")
    check("exec restore completes and runs", rst == "completed", rst)
    check("exec round trip: memory sha256 equal", h2 == h, f"{h2} != {h}")

    # Case: unix save, unix restore.
    h, st, agent = save(env, "ux", "unix")
    check("unix save completes", st == "completed" and agent.returncode == 0,
          f"{st}, agent {agent.returncode}: {agent_log(env, 'agent-ux.log')[-300:]}")
    rst, h2, _ = restore(env, "ux", "unix")
    check("unix round trip: memory sha256 equal, runs", rst == "completed" and h2 == h, f"{rst} {h2} != {h}")

    # Case: the list shows both, with the machine type read from the stream; verify passes.
    out = subprocess.run([env.agent, "list", "images.img", "from", env.paths[0], "host-key", env.key], capture_output=True, text=True)
    check("list shows committed images with the machine type",
          out.returncode == 0 and sum(l.split()[1:2] == ["committed"] for l in out.stdout.splitlines()[1:]) == 2
          and "pc-i440fx" in out.stdout, out.stdout)
    out = subprocess.run(env.migrate_args("verify", "ux"), capture_output=True, text=True)
    check("verify passes", out.returncode == 0, out.stderr)

    # Case: multifd with 2 channels through unix sockets.
    h, st, agent = save(env, "mf", "unix", channels=2)
    check("multifd save completes", st == "completed" and agent.returncode == 0,
          f"{st}: {agent_log(env, 'agent-mf.log')[-300:]}")
    rst, h2, _ = restore(env, "mf", "unix", channels=2)
    check("multifd round trip: memory sha256 equal", rst == "completed" and h2 == h, f"{rst} {h2} != {h}")

    # Case: save and restore through fds handed to QEMU with QMP getfd (migrate fd:NAME,
    # migrate-incoming fd:NAME), the agent on the other end of each socket pair.
    h, st, agent = save(env, "fd", "fd")
    check("fd save completes", st == "completed" and agent.returncode == 0,
          f"{st}, agent {agent.returncode}: {agent_log(env, 'agent-fd.log')[-300:]}")
    rst, h2, _ = restore(env, "fd", "fd")
    check("fd round trip: memory sha256 equal, runs", rst == "completed" and h2 == h, f"{rst} {h2} != {h}")

    # Case: a path of the agent's session disconnected on the server during a slow save.
    # Expect: the save completes over the other path; the restore is exact.
    def cut_path(_agent):
        time.sleep(1.0)
        r = subprocess.run([env.cli, "--socket", os.path.join(env.work, "srv.sock"), "-f", "json", "server",
                            "path", "list", "mig-pf"], capture_output=True, text=True)
        paths = json.loads(r.stdout) if r.returncode == 0 else []
        if paths:
            subprocess.run([env.cli, "--socket", os.path.join(env.work, "srv.sock"), "server", "path",
                            "disconnect", "mig-pf", paths[0]["pathname"]], capture_output=True)
        check("a path was cut during the save", len(paths) == 2, r.stdout + r.stderr)

    h, st, agent = save(env, "pf", "unix", bandwidth=40 * MiB, during=cut_path)
    check("save with a path cut completes", st == "completed" and agent.returncode == 0,
          f"{st}: {agent_log(env, 'agent-pf.log')[-300:]}")
    rst, h2, _ = restore(env, "pf", "unix")
    check("restore after failover: memory sha256 equal", rst == "completed" and h2 == h, f"{rst}")

    # Case: the agent killed during a save. Expect: the image stays PARTIAL; its restore is
    # refused and the destination QEMU exits non-zero.
    def kill_agent(agent):
        time.sleep(1.0)
        agent.send_signal(signal.SIGKILL)

    _, st, _ = save(env, "kl", "unix", bandwidth=20 * MiB, during=kill_agent)
    check("save with the agent killed fails", st != "completed", st)
    out = subprocess.run([env.agent, "list", "images.img", "from", env.paths[0], "host-key", env.key], capture_output=True, text=True)
    line = next((l for l in out.stdout.splitlines() if l.startswith("kl ")), "")
    check("the killed save is PARTIAL", "partial" in line, out.stdout)
    rst, _, rc = restore(env, "kl", "unix")
    check("restore of a PARTIAL image is refused, QEMU exits non-zero", rst != "completed" and rc not in (0, None),
          f"{rst}, qemu exit {rc}")
    rst, _, rc = restore(env, "kl", "exec")
    check("exec restore of a PARTIAL image: QEMU exits non-zero (no hang)", rst != "completed" and rc not in (0, None),
          f"{rst}, qemu exit {rc}")

    # Case: one byte of the "ex" image flipped on the server. Expect: the restore stops at that
    # chunk and names it; QEMU exits non-zero.
    vol = os.path.join(env.work, "export/images.img")
    with open(vol, "r+b") as f:
        f.seek(2 * MiB + 4096)  # image "ex" has the first extent: data from 1 MiB past its start
        b = f.read(1)
        f.seek(2 * MiB + 4096)
        f.write(bytes([b[0] ^ 0x20]))
    rst, _, rc = restore(env, "ex", "unix")
    log = agent_log(env, "agent-r-ex.log")
    check("corrupt chunk: restore refused, QEMU exits non-zero", rst != "completed" and rc not in (0, None),
          f"{rst}, qemu exit {rc}")
    check("corrupt chunk: the agent names the chunk", "CRC32C mismatch" in log and "piece 0" in log, log[-400:])
    out = subprocess.run(env.migrate_args("verify", "ex"), capture_output=True, text=True)
    check("verify finds it too", out.returncode != 0 and "CRC32C mismatch" in out.stderr, out.stderr)


def main_with(make_env, run_case, binaries):
    """The entry of a QEMU migration script: usage, skips (77) without QEMU or a binary of
    `binaries`, then run_case(make_env(build)), cleaned up whatever happens. Exit 1 on a failure."""
    if len(sys.argv) != 2:
        print(f"usage: {sys.argv[0]} BUILD_DIR", file=sys.stderr)
        return 2
    if shutil.which("qemu-system-x86_64") is None:
        print("1..0 # SKIP qemu-system-x86_64 is missing (scripts/setup.sh installs it)")
        return 77
    build = os.path.abspath(sys.argv[1])
    for b in binaries:
        if not os.access(os.path.join(build, b), os.X_OK):
            print(f"1..0 # SKIP {b} not built")
            return 77
    env = make_env(build)
    try:
        run_case(env)
    except Exception as e:  # a broken step fails the test with its reason, never hangs it
        not_ok("unexpected error", repr(e))
    finally:
        env.cleanup()
    return 1 if failed else 0


def main():
    return main_with(Env, run, ("client/migrate/ibnbd-migrate", "server/ibnbd-server", "client/cli/ibnbd"))


if __name__ == "__main__":
    sys.exit(main())
