#!/usr/bin/env python3
"""A point-to-point IPv4 link between two network namespaces with a fixed one-way delay.

Fallback for kernels without sch_netem (tests/netns/multipath.sh): two TUN devices, one in each
namespace, and this process moves every packet from one to the other after --delay-ms, in both
directions, in order. It is an L3 link like a veth pair with `netem delay` on both ends, except
that the forwarding costs CPU (a few microseconds per packet), which only makes the delayed path
slower still.

  tundelay.py --ns-a NS --dev-a NAME --addr-a 198.18.12.1/24
              --ns-b NS --dev-b NAME --addr-b 198.18.12.2/24
              --delay-ms 5 [--mtu 9000] [--ready-file PATH]

The devices and their addresses exist while the process runs (they vanish with it). SIGTERM or
SIGINT ends it with status 0. The ready file is written once both sides are up.
"""

import argparse
import collections
import ctypes
import errno
import fcntl
import os
import select
import signal
import struct
import subprocess
import sys
import time

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000

_libc = ctypes.CDLL(None, use_errno=True)


def setns(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"setns({path}): {os.strerror(e)}")
    finally:
        os.close(fd)


def open_tun(name):
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def ip(ns, *args):
    subprocess.run(["ip", "-n", ns, *args], check=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for side in ("a", "b"):
        p.add_argument(f"--ns-{side}", required=True)
        p.add_argument(f"--dev-{side}", required=True)
        p.add_argument(f"--addr-{side}", required=True)
    p.add_argument("--delay-ms", type=float, required=True)
    p.add_argument("--mtu", type=int, default=9000)
    p.add_argument("--ready-file")
    a = p.parse_args()

    home = "/proc/self/ns/net"
    home_fd = os.open(home, os.O_RDONLY)
    setns(f"/run/netns/{a.ns_a}")
    fa = open_tun(a.dev_a)
    setns(f"/run/netns/{a.ns_b}")
    fb = open_tun(a.dev_b)
    if _libc.setns(home_fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns(home)")
    os.close(home_fd)

    for ns, dev, addr in ((a.ns_a, a.dev_a, a.addr_a), (a.ns_b, a.dev_b, a.addr_b)):
        ip(ns, "link", "set", dev, "mtu", str(a.mtu))
        ip(ns, "addr", "add", addr, "dev", dev)
        ip(ns, "link", "set", dev, "up")

    stop = False

    def on_signal(_sig, _frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    if a.ready_file:
        with open(a.ready_file + ".tmp", "w") as f:
            f.write("ready\n")
        os.rename(a.ready_file + ".tmp", a.ready_file)

    delay = a.delay_ms / 1000.0
    # queue[fd] holds (due, packet) read from fd, to be written to peer[fd]
    peer = {fa: fb, fb: fa}
    queue = {fa: collections.deque(), fb: collections.deque()}
    ep = select.epoll()
    ep.register(fa, select.EPOLLIN)
    ep.register(fb, select.EPOLLIN)
    forwarded = 0
    while not stop:
        now = time.monotonic()
        due = [q[0][0] for q in queue.values() if q]
        timeout = max(0.0, min(due) - now) if due else 1.0
        try:
            events = ep.poll(timeout)
        except InterruptedError:
            continue
        now = time.monotonic()
        for fd, _ in events:
            q = queue[fd]
            for _ in range(256):
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    break
                q.append((now + delay, pkt))
        now = time.monotonic()
        for fd, q in queue.items():
            out = peer[fd]
            while q and q[0][0] <= now:
                pkt = q.popleft()[1]
                try:
                    os.write(out, pkt)
                    forwarded += 1
                except OSError as e:
                    # EIO while the other side's device is down; the packet is lost, as on a wire
                    if e.errno not in (errno.EIO, errno.EAGAIN, errno.ENOBUFS):
                        raise
    print(f"tundelay: forwarded {forwarded} packets", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
