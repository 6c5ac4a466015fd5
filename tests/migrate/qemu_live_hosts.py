#!/usr/bin/env python3
"""Live migration between two hypervisors that share one volume through the `migration` access
mode, on one host: one ibnbd-server, two client daemons ("hypervisor A" and "hypervisor B", each
with its own control socket and state directory). TAP-like output; exit 1 when anything failed,
77 when QEMU is missing.

    python3 tests/migrate/qemu_live_hosts.py BUILD_DIR        (ctest: qemu_live_hosts)

The flow (docs/migration-image.md, "Live migration between two hosts"):
  A maps the volume rw; B maps it `migration` while A holds it (granted); a third rw opener and
  an agent with a session of its own are refused (EBUSY: two writers already);
  A and B export their mappings on unix sockets; a RUNNING source QEMU on A migrates (live) to
  `ibnbd-migrate save ... nbd A's socket` (exec:); the destination on B (-incoming defer, -S)
  restores through `ibnbd migrate restore ... nbd B's socket`: memory sha256 equal, `cont` runs;
  list and verify work through B's migration mapping (also through the `ibnbd migrate` CLI);
  A unmaps; B keeps working (a second save and verify through B, a multifd round trip over
  unix sockets through B's export); with B holding it in migration mode, a new rw opener is
  still refused (the kernel's rule: migration then rw no).

The guest cannot dirty memory (QEMU 7.2 under TCG loses dirtied pages in live migration): its
firmware is 64 KiB of HLT, so the CPU halts at the reset vector with interrupts off, and the RAM
holds random bytes from -device loader. The source really runs while it is migrated.
"""
import hashlib
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qemu_migrate as qm  # noqa: E402  (Qmp, Env: the server, the pattern, spawn; check)

MiB = qm.MiB


class Hosts(qm.Env):
    """qm.Env (server with two paths, images.img of 1 GiB, pattern.bin) plus client daemons."""

    def __init__(self, build):
        super().__init__(build)
        self.daemon = os.path.join(build, "client/daemon/ibnbd-client")
        self.bios = os.path.join(self.work, "hlt.bin")
        with open(self.bios, "wb") as f:
            f.write(b"\xf4" * (64 * 1024))  # HLT everywhere, the reset vector included

    def start_daemon(self, name):
        sock = os.path.join(self.work, name + ".sock")
        ready = os.path.join(self.work, name + ".ready")
        state = os.path.join(self.work, "state-" + name)
        os.makedirs(state)
        p = self.spawn([self.daemon, "--host-key", self.key, "--control-socket", sock, "--state-dir", state,
                        "--ready-file", ready, "--hb-interval-ms", "200"], name + ".log")
        for _ in range(100):
            if os.path.exists(ready) or p.poll() is not None:
                break
            time.sleep(0.1)
        return sock

    def ctl(self, sock, *args):
        return subprocess.run([os.path.join(self.build, "client/cli/ibnbd"), "--socket", sock, *args],
                              capture_output=True, text=True, timeout=60)

    def vm(self, name, incoming=False):
        qmp = os.path.join(self.work, name + ".qmp")
        argv = ["qemu-system-x86_64", "-machine", "pc", "-accel", "tcg", "-m", str(qm.GUEST_MB),
                "-bios", self.bios, "-display", "none", "-nodefaults", "-nic", "none", "-serial", "none",
                "-S", "-qmp", f"unix:{qmp},server=on,wait=off",
                "-device", f"loader,file={os.path.join(self.work, 'pattern.bin')},addr=0x100000"]
        if incoming:
            argv += ["-incoming", "defer"]
        return self.spawn(argv, name + ".log"), qm.Qmp(qmp)

    def agent_cmd(self, cmd, nbd_sock, *extra):
        return [self.agent, cmd, "images.img", "nbd", nbd_sock, *extra]


def run(h):
    check = qm.check
    cli_path = os.path.join(h.build, "client/cli/ibnbd")
    a_sock, b_sock, c_sock = h.start_daemon("hvA"), h.start_daemon("hvB"), h.start_daemon("hvC")

    # Case: A maps rw, then B maps migration while A holds it: granted (two writers: source and
    # destination of a live migration).
    r = h.ctl(a_sock, "client", "device", "map", "images.img", "from", *h.paths, "rw")
    check("A maps the volume rw", r.returncode == 0, r.stderr)
    r = h.ctl(b_sock, "client", "device", "map", "images.img", "from", *h.paths, "migration")
    check("B maps it in migration mode while A holds it", r.returncode == 0 and "migration" in r.stdout,
          r.stdout + r.stderr)
    # Case: a third writer is refused, whether rw (C's daemon) or an agent with its own session.
    r = h.ctl(c_sock, "client", "device", "map", "images.img", "from", *h.paths, "rw")
    check("a third rw map is refused with EBUSY", r.returncode == 16 and "busy" in r.stderr, f"{r.returncode} {r.stderr}")
    r = subprocess.run([h.agent, "delete", "images.img", "from", h.paths[0], "host-key", h.key, "image", "none"], capture_output=True,
                       text=True, timeout=60)
    check("an agent mapping migration on its own session is refused too (EBUSY)",
          r.returncode == 16 and "busy" in r.stderr, f"{r.returncode} {r.stderr}")

    a_nbd, b_nbd = os.path.join(h.work, "a-images.nbd"), os.path.join(h.work, "b-images.nbd")
    r = h.ctl(a_sock, "client", "device", "export", "images.img", "unix", a_nbd)
    check("A exports its rw mapping", r.returncode == 0, r.stderr)
    r = h.ctl(b_sock, "client", "device", "export", "images.img", "unix", b_nbd)
    check("B exports its migration mapping", r.returncode == 0, r.stderr)

    # Case: the source on A runs (live), migrates through A's mapping.
    src, sq = h.vm("src")
    dst = None
    try:
        sq.cmd("cont")
        check("the source runs before the migration", sq.cmd("query-status").get("status") == "running",
              str(sq.cmd("query-status")))
        # Bounded bandwidth: the migration takes about a second while the guest runs.
        sq.cmd("migrate-set-parameters", **{"max-bandwidth": 64 * MiB})
        cmd = " ".join(h.agent_cmd("save", a_nbd, "image", "live1"))
        sq.cmd("migrate", uri=f"exec:{cmd} 2>>{h.work}/agent-save.log")
        # 48 MiB of random RAM at 64 MiB/s: the migration is still active 0.3 s in.
        time.sleep(0.3)
        live = (sq.cmd("query-status").get("status"), sq.cmd("query-migrate").get("status"))
        st = qm.wait_migration(sq)
        check("live save through A's rw mapping completes", st == "completed",
              f"{st}: {qm.agent_log(h, 'agent-save.log')[-300:]}")
        check("the source was running while the migration was active", live == ("running", "active"), str(live))
        src_sum = h.memsum(sq, "src")

        # Case: the destination on B restores through B's migration mapping (CLI: ibnbd migrate).
        dst, dq = h.vm("dst", incoming=True)
        cmd = " ".join([cli_path, "migrate", "restore", "images.img", "nbd", b_nbd, "image", "live1"])
        dq.cmd("migrate-incoming", uri=f"exec:{cmd} 2>>{h.work}/agent-restore.log")
        st = qm.wait_migration(dq, 60)
        check("restore through B's migration mapping completes", st == "completed",
              f"{st}: {qm.agent_log(h, 'agent-restore.log')[-300:]}")
        if st == "completed":
            dst_sum = h.memsum(dq, "dst")
            check("memory sha256 equal (source after migration, destination)", dst_sum == src_sum,
                  f"{dst_sum} != {src_sum}")
            dq.cmd("cont")
            check("the destination runs after cont", dq.cmd("query-status").get("running") is True,
                  str(dq.cmd("query-status")))
        dq.close()
    finally:
        sq.close()
        for p in (src, dst):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(10)

    # Case: list and verify through B's migration mapping, by the agent and by the CLI.
    out = subprocess.run(h.agent_cmd("list", b_nbd), capture_output=True, text=True, timeout=60)
    line = next((l for l in out.stdout.splitlines() if l.startswith("live1 ")), "")
    check("list through B shows live1 committed with the machine type", "committed" in line and "pc-i440fx" in line,
          out.stdout + out.stderr)
    out = subprocess.run([cli_path, "migrate", "verify", "images.img", "nbd", b_nbd, "image", "live1"],
                         capture_output=True, text=True, timeout=60)
    check("ibnbd migrate verify through B passes", out.returncode == 0 and "ok" in out.stdout, out.stderr)

    # Case: A goes away; B keeps working (verify, a second save and its round trip via B).
    r = h.ctl(a_sock, "client", "device", "unmap", "images.img")
    check("A unmaps", r.returncode == 0, r.stderr)
    out = subprocess.run(h.agent_cmd("verify", b_nbd, "image", "live1"), capture_output=True, text=True, timeout=60)
    check("verify through B after A unmapped", out.returncode == 0, out.stderr)
    blob = os.urandom(3 * MiB + 12345)
    out = subprocess.run(h.agent_cmd("save", b_nbd, "image", "fromB"), input=blob, capture_output=True, timeout=60)
    check("B saves a new image through its migration mapping", out.returncode == 0, out.stderr.decode()[-300:])
    out = subprocess.run(h.agent_cmd("restore", b_nbd, "image", "fromB"), capture_output=True, timeout=60)
    check("and reads it back byte for byte",
          out.returncode == 0 and hashlib.sha256(out.stdout).digest() == hashlib.sha256(blob).digest(),
          out.stderr.decode()[-300:])
    # Case: multifd (2 channels) over unix sockets through B's export, both ways (the agent's
    # pumps write through one NBD connection from three threads). Expect: memory sha256 equal.
    src, sq = h.vm("mf-src")
    dst = None
    try:
        want = h.memsum(sq, "mf-src")
        sq.cmd("migrate-set-capabilities", capabilities=[{"capability": "multifd", "state": True}])
        sq.cmd("migrate-set-parameters", **{"multifd-channels": 2, "max-bandwidth": 10 * 1024 * MiB})
        sock = os.path.join(h.work, "mf.sock")
        agent = h.spawn(h.agent_cmd("save", b_nbd, "image", "mf", "unix", sock, "channels", "2"), "agent-mf.log")
        for _ in range(100):
            if os.path.exists(sock):
                break
            time.sleep(0.1)
        sq.cmd("migrate", uri=f"unix:{sock}")
        st = qm.wait_migration(sq)
        rc = agent.wait(60)
        check("multifd save through B's export", st == "completed" and rc == 0,
              f"{st}, agent {rc}: {qm.agent_log(h, 'agent-mf.log')[-300:]}")
        dst, dq = h.vm("mf-dst", incoming=True)
        dq.cmd("migrate-set-capabilities", capabilities=[{"capability": "multifd", "state": True}])
        dq.cmd("migrate-set-parameters", **{"multifd-channels": 2})
        sock = os.path.join(h.work, "mf-in.sock")
        dq.cmd("migrate-incoming", uri=f"unix:{sock}")
        agent = h.spawn(h.agent_cmd("restore", b_nbd, "image", "mf", "unix", sock), "agent-mf-r.log")
        st = qm.wait_migration(dq, 60)
        got = h.memsum(dq, "mf-dst") if st == "completed" else None
        check("multifd restore through B's export: memory sha256 equal", got == want,
              f"{st}: {qm.agent_log(h, 'agent-mf-r.log')[-300:]}")
        agent.wait(30)
        dq.close()
    finally:
        sq.close()
        for p in (src, dst):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(10)

    # Case: B holds it in migration mode; a new rw opener is refused (migration then rw: no).
    r = h.ctl(c_sock, "client", "device", "map", "images.img", "from", *h.paths, "rw")
    check("with B holding migration, a new rw map is refused", r.returncode == 16, f"{r.returncode} {r.stderr}")


def main():
    return qm.main_with(Hosts, run, ("client/migrate/ibnbd-migrate", "server/ibnbd-server", "client/cli/ibnbd",
                                     "client/daemon/ibnbd-client"))


if __name__ == "__main__":
    sys.exit(main())
