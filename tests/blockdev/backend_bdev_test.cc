// The backends on a real block device: a loop device over a sparse file, attached with
// LOOP_CTL_GET_FREE + LOOP_CONFIGURE (Linux >= 5.8) and detached by LO_FLAGS_AUTOCLEAR when the
// last descriptor closes. Skipped, with the reason, where loop devices are unavailable.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/fs.h>
#include <linux/loop.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <random>

#include "backend_test_util.h"
#include "ibnbd/backend.h"

namespace ibnbd::test {
namespace {

constexpr uint64_t kDevSize = 32 << 20;

// A loop device over a sparse scratch file in /var/tmp, the backend opened on the device and an
// engine. `loop_fd` holds the device: it goes away with the test's descriptors (autoclear).
class LoopDev : public ::testing::Test {
 protected:
  std::string attach(uint32_t block_size, const OpenOptions& o = {}) {
    if (std::string why = make_loop(block_size); !why.empty()) return why;
    return r.open(dev, o, 64);
  }

  std::string make_loop(uint32_t block_size) {
    if (::access("/dev/loop-control", F_OK) != 0) return "no /dev/loop-control";
    if (std::string why = r.make_file_in("/var/tmp", kDevSize); !why.empty()) return why;
    base::UniqueFd ctl(::open("/dev/loop-control", O_RDWR | O_CLOEXEC));
    if (!ctl) return std::string("open /dev/loop-control: ") + strerror(errno);
    base::UniqueFd back(::open(r.path.c_str(), O_RDWR | O_CLOEXEC));
    if (!back) return "open the backing file";
    for (int attempt = 0; attempt < 8; ++attempt) {
      int n = ::ioctl(ctl.get(), LOOP_CTL_GET_FREE);
      if (n < 0) return std::string("LOOP_CTL_GET_FREE: ") + strerror(errno);
      dev = "/dev/loop" + std::to_string(n);
      loop_fd.reset(::open(dev.c_str(), O_RDWR | O_CLOEXEC));
      if (!loop_fd) return "open " + dev + ": " + strerror(errno);
      loop_config cfg{};
      cfg.fd = static_cast<uint32_t>(back.get());
      cfg.block_size = block_size;
      cfg.info.lo_flags = LO_FLAGS_AUTOCLEAR;
      if (::ioctl(loop_fd.get(), LOOP_CONFIGURE, &cfg) == 0) return {};
      if (errno != EBUSY) return std::string("LOOP_CONFIGURE: ") + strerror(errno);
      // Another process took it between GET_FREE and CONFIGURE: ask again.
    }
    return "no free loop device";
  }

  Rig r;  // r.path is the loop device's backing file
  std::string dev;
  base::UniqueFd loop_fd;
};

#define ATTACH_OR_SKIP(...)                  \
  do {                                       \
    std::string why_ = attach(__VA_ARGS__);  \
    if (!why_.empty()) GTEST_SKIP() << why_; \
  } while (0)

// Case: a 512-byte-sector loop device opened through resolve_export (a device node made inside
// the search root). Expect: kind block_device, O_DIRECT, geometry from the ioctls and sysfs
// (size, 512 logical block, discard limits of the loop queue), random patterns read back.
TEST_F(LoopDev, GeometryAndPatterns) {
  ATTACH_OR_SKIP(512);
  struct stat st {};
  ASSERT_EQ(::stat(dev.c_str(), &st), 0);
  const std::string root = *r.dir / "exports";
  ASSERT_EQ(::mkdir(root.c_str(), 0700), 0);
  ASSERT_EQ(::mknod((root + "/disk0").c_str(), S_IFBLK | 0600, st.st_rdev), 0);
  auto t = resolve_export(root, "s", "disk0");
  ASSERT_TRUE(t.ok()) << t.error().message();
  EXPECT_EQ(t->kind, ExportTarget::Kind::block_device);
  auto b = Backend::open(*t, {});
  ASSERT_TRUE(b.ok()) << b.error().message();
  Backend& exported = **b;
  EXPECT_EQ(exported.kind(), Backend::Kind::block_device);
  EXPECT_TRUE(exported.direct());
  const DeviceGeometry g = exported.geometry();
  EXPECT_EQ(g.nsectors, kDevSize / 512);
  EXPECT_EQ(g.logical_block_size, 512u);
  EXPECT_GT(g.max_hw_sectors, 0u);
  EXPECT_GT(g.max_segments, 0u);
  EXPECT_GT(g.max_discard_sectors, 0u) << "loop punches holes in its backing file";
  EXPECT_GT(g.max_write_zeroes_sectors, 0u);
  EXPECT_TRUE(g.cache_policy & kCacheFua);
  std::mt19937_64 rng(9);
  AlignedBuf w(256 << 10), rd(256 << 10);
  for (int i = 0; i < 100; ++i) {
    const uint32_t len = 512 * static_cast<uint32_t>(1 + rng() % 512);
    const uint64_t off = 512 * (rng() % ((kDevSize - len) / 512));
    fill_pattern(w.sub(0, len), i, off);
    ASSERT_EQ(run_io(*r.eng,
                     rw(exported, IoOp::write, off, w.sub(0, len), i % 3 ? 0u : uint32_t{kIoFua})),
              0);
    ASSERT_EQ(run_io(*r.eng, rw(exported, IoOp::read, off, rd.sub(0, len))), 0);
    ASSERT_EQ(check_pattern(rd.sub(0, len), i, off), -1) << off << " " << len;
  }
  EXPECT_EQ(run_io(*r.eng, range_op(exported, IoOp::flush, 0, 0)), 0);
  EXPECT_EQ(run_io(*r.eng, rw(exported, IoOp::read, kDevSize - 512, rd.sub(0, 1024))), EIO);
}

// Case: DISCARD on the loop device, plain and with PREFLUSH + FUA (fdatasync round, then the
// ioctl on the helper thread, then fdatasync). Expect: the range reads as zeros, neighbours are
// intact, the backing file's blocks drop (loop turns the discard into a punched hole).
TEST_F(LoopDev, DiscardOnTheHelperThread) {
  ATTACH_OR_SKIP(512);
  ASSERT_TRUE(r.be->can_discard());
  AlignedBuf w(8 << 20), rd(8 << 20);
  fill_pattern(w.span(), 77, 0);
  ASSERT_EQ(run_io(*r.eng, rw(*r.be, IoOp::write, 0, w.span())), 0);
  ASSERT_EQ(run_io(*r.eng, range_op(*r.be, IoOp::flush, 0, 0)), 0);
  const uint64_t before = st_blocks(r.path);
  ASSERT_EQ(run_io(*r.eng, range_op(*r.be, IoOp::discard, 1 << 20, 2 << 20)), 0);
  ASSERT_EQ(run_io(*r.eng, range_op(*r.be, IoOp::discard, 4 << 20, 1 << 20, kIoPreflush | kIoFua)),
            0);
  EXPECT_LE(st_blocks(r.path), before - (3 << 20) / 512);
  ASSERT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, 0, rd.span())), 0);
  expect_zeroed_ranges(rd.span(), 77, {{1 << 20, 2 << 20}, {4 << 20, 1 << 20}});
  // A discard off the logical block is the kernel's EINVAL, through the callback.
  EXPECT_EQ(run_io(*r.eng, range_op(*r.be, IoOp::discard, 100, 512)), EINVAL);
  // Loop devices do not do secure erase: the ioctl's EOPNOTSUPP reaches the caller.
  EXPECT_EQ(run_io(*r.eng, range_op(*r.be, IoOp::secure_erase, 0, 4096)), EOPNOTSUPP);
}

// Case: WRITE_ZEROES on the loop device with and without NOUNMAP. Expect: zeros in the range and
// the data around it intact either way (blkdev_fallocate: ZERO_RANGE, PUNCH_HOLE).
TEST_F(LoopDev, WriteZeroes) {
  ATTACH_OR_SKIP(512);
  AlignedBuf w(4 << 20), rd(4 << 20);
  for (uint32_t flags : {0u, uint32_t{kIoNoUnmap}, kIoNoUnmap | kIoFua | kIoPreflush}) {
    SCOPED_TRACE(flags);
    fill_pattern(w.span(), flags + 3, 0);
    ASSERT_EQ(run_io(*r.eng, rw(*r.be, IoOp::write, 0, w.span())), 0);
    ASSERT_EQ(run_io(*r.eng, range_op(*r.be, IoOp::write_zeroes, 1 << 20, 1 << 20, flags)), 0);
    ASSERT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, 0, rd.span())), 0);
    expect_zeroed_ranges(rd.span(), flags + 3, {{1 << 20, 1 << 20}});
  }
}

// Case: a loop device with 4096-byte logical blocks. Expect: the geometry says 4096, and a
// 512-byte request is refused at submit (EINVAL) rather than failing in the kernel.
TEST_F(LoopDev, FourKLogicalBlocks) {
  ATTACH_OR_SKIP(4096);
  EXPECT_EQ(r.be->geometry().logical_block_size, 4096u);
  EXPECT_EQ(r.be->io_align(), 4096u);
  AlignedBuf buf(8192);
  EXPECT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, 512, buf.sub(0, 4096))), EINVAL);
  EXPECT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, 0, buf.sub(0, 512))), EINVAL);
  fill_pattern(buf.span(), 1, 4096);
  ASSERT_EQ(run_io(*r.eng, rw(*r.be, IoOp::write, 4096, buf.span())), 0);
  AlignedBuf rd(8192);
  ASSERT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, 4096, rd.span())), 0);
  EXPECT_EQ(check_pattern(rd.span(), 1, 4096), -1);
}

// Case: a read-only open of the device, and an exclusive open while another exclusive holder
// exists. Expect: writes EROFS; the second exclusive open EBUSY.
TEST_F(LoopDev, ReadOnlyAndExclusive) {
  OpenOptions ro;
  ro.read_only = true;
  ATTACH_OR_SKIP(512, ro);
  AlignedBuf buf(4096);
  EXPECT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, 0, buf.span())), 0);
  EXPECT_EQ(run_io(*r.eng, rw(*r.be, IoOp::write, 0, buf.span())), EROFS);
  EXPECT_EQ(run_io(*r.eng, range_op(*r.be, IoOp::discard, 0, 4096)), EROFS);
  OpenOptions ex;
  ex.exclusive = true;
  auto x1 = Backend::open_path(dev, ex);
  ASSERT_TRUE(x1.ok()) << x1.error().message();
  auto x2 = Backend::open_path(dev, ex);
  ASSERT_FALSE(x2.ok());
  EXPECT_EQ(x2.error().value(), EBUSY);
}

// Case: the backing file grows and the loop device is told (LOOP_SET_CAPACITY). Expect:
// refresh_size() reports the new size and the new tail is readable.
TEST_F(LoopDev, ResizeIsDetected) {
  ATTACH_OR_SKIP(512);
  EXPECT_EQ(r.be->size(), kDevSize);
  ASSERT_EQ(::truncate(r.path.c_str(), 2 * kDevSize), 0);
  ASSERT_EQ(::ioctl(loop_fd.get(), LOOP_SET_CAPACITY, 0), 0);
  auto s = r.be->refresh_size();
  ASSERT_TRUE(s.ok()) << s.error().message();
  EXPECT_EQ(*s, 2 * kDevSize);
  EXPECT_EQ(r.be->geometry().nsectors, 2 * kDevSize / 512);
  AlignedBuf buf(4096);
  EXPECT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, 2 * kDevSize - 4096, buf.span())), 0);
}

}  // namespace
}  // namespace ibnbd::test
