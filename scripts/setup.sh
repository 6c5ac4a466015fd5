#!/usr/bin/env bash
# Installs every Debian package the build, the tests, the VM rig and the benchmarks need.
# Idempotent: packages already present are skipped, so a second run only checks.
set -euo pipefail

packages=(
  # build
  build-essential cmake ninja-build pkg-config g++ clang libclang-rt-14-dev
  # man pages: markdown rendered at build (docs/man), man to read them (tests/install)
  go-md2man man-db
  # libraries
  libibverbs-dev librdmacm-dev liburing-dev libboost-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libfuse3-dev fuse3
  # TLS and host authentication (DH-HMAC-CHAP): OpenSSL, and zlib for the secrets' CRC-32
  libssl-dev zlib1g-dev
  # real RDMA tooling (used inside the VM rig and by the benchmarks)
  rdma-core ibverbs-utils rdmacm-utils perftest
  # VM rig: QEMU/TCG with Debian's 6.12 kernel, busybox initramfs
  qemu-system-x86 busybox-static kmod cpio xz-utils zstd iproute2
  # benchmark peers and limits; stress-ng loads the CPUs beside a run (bench/fio_ab.sh --load);
  # gnuplot draws the benchmarks' charts (bench/chart.sh)
  iperf3 nbdkit fio stress-ng gnuplot-nox
  # NBD clients of the client daemon's NBD export (tests/nbd/nbd_tools.sh): nbdinfo, nbdcopy,
  # nbdfuse, nbdsh; qemu-img and qemu-nbd; the kernel's nbd-client (VM tests); the ext4 and
  # loop tools of the nbdfuse + losetup case
  libnbd-bin qemu-utils nbd-client e2fsprogs mount jq
  # the install test: systemd-analyze verify on the units (tests/install/install.sh)
  systemd
  # the reliability soak (tools/soak/soak.sh): its hook speaks to the client daemon's socket;
  # its VM slice (soak-vm.sh) puts the volume on a device-mapper table over a loop device
  python3 dmsetup
  # RBD exports (blockdev's rbd backend) and the single-host Ceph cluster of the tests and the
  # benchmark (scripts/ceph-dev.sh); qemu-block-extra: qemu-nbd's rbd: driver (bench/rbd.sh)
  librbd-dev librados-dev ceph-mon ceph-osd ceph-mgr ceph-common rbd-nbd qemu-block-extra
  # the threads' stacks of a test's daemons when their IO stops (tests/rbd/cluster.sh)
  gdb
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
else
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The configured source tree of the installed fio, for the fio external ioengine (client/fio):
# Debian ships no fio headers. Cached, so a second run only checks; a failure here leaves the
# engine unbuilt (IBNBD_FIO_ENGINE=AUTO) but the rest of the setup stands.
if fio_tree=$(bash "$(dirname "$0")/fio-headers.sh"); then
  echo "setup: fio headers in $fio_tree"
else
  echo "setup: no fio headers (see above): the fio engine will not be built" >&2
fi

# promtool, which lints the daemons' Prometheus metrics in the tests: taken out of Debian's
# prometheus package into a cache, not installed (the package would start a Prometheus server
# on this machine). Cached; a failure here only makes that check skip.
if promtool=$(bash "$(dirname "$0")/promtool.sh"); then
  echo "setup: promtool at $promtool"
else
  echo "setup: no promtool (see above): the metrics lint will skip" >&2
fi
