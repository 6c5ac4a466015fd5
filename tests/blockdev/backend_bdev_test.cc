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

namespace ibnbd {
namespace {

using test::AlignedBuf;
using test::run_io;
using test::TempDir;

constexpr uint64_t kDevSize = 32 << 20;

// A loop device over <dir>/backing.img. `fd` holds it: it goes away when the test's descriptors
// close (autoclear).
struct Loop {
  std::optional<TempDir> dir;
  std::string backing;
  std::string dev;
  UniqueFd fd;
};

std::string make_loop(Loop& l, uint32_t block_size, bool direct_backing = false) {
  if (::access("/dev/loop-control", F_OK) != 0) return "no /dev/loop-control";
  l.dir = TempDir::make("/var/tmp");
  if (!l.dir) return "mkdtemp in /var/tmp";
  l.backing = *l.dir / "backing.img";
  if (!test::make_file(l.backing, kDevSize)) return "cannot create the backing file";
  UniqueFd ctl(::open("/dev/loop-control", O_RDWR | O_CLOEXEC));
  if (!ctl) return std::string("open /dev/loop-control: ") + strerror(errno);
  UniqueFd back(::open(l.backing.c_str(), O_RDWR | O_CLOEXEC));
  if (!back) return "open backing";
  for (int attempt = 0; attempt < 8; ++attempt) {
    int n = ::ioctl(ctl.get(), LOOP_CTL_GET_FREE);
    if (n < 0) return std::string("LOOP_CTL_GET_FREE: ") + strerror(errno);
    l.dev = "/dev/loop" + std::to_string(n);
    l.fd.reset(::open(l.dev.c_str(), O_RDWR | O_CLOEXEC));
    if (!l.fd) return "open " + l.dev + ": " + strerror(errno);
    loop_config cfg{};
    cfg.fd = static_cast<uint32_t>(back.get());
    cfg.block_size = block_size;
    cfg.info.lo_flags = LO_FLAGS_AUTOCLEAR | (direct_backing ? LO_FLAGS_DIRECT_IO : 0);
    if (::ioctl(l.fd.get(), LOOP_CONFIGURE, &cfg) == 0) return {};
    if (errno != EBUSY) return std::string("LOOP_CONFIGURE: ") + strerror(errno);
    // Another process took it between GET_FREE and CONFIGURE: ask again.
  }
  return "no free loop device";
}

#define LOOP_OR_SKIP(l, ...)                        \
  do {                                              \
    std::string why_ = make_loop(l, __VA_ARGS__);   \
    if (!why_.empty()) GTEST_SKIP() << why_;        \
  } while (0)

std::unique_ptr<IoEngine> engine() {
  auto e = IoEngine::create({64});
  EXPECT_TRUE(e.ok()) << e.error().message();
  return e.ok() ? std::move(*e) : nullptr;
}

// Case: a 512-byte-sector loop device opened through resolve_export (a device node made inside
// the search root). Expect: kind block_device, O_DIRECT, geometry from the ioctls and sysfs
// (size, 512 logical block, discard limits of the loop queue), random patterns read back.
TEST(BlockDevice, GeometryAndPatterns) {
  Loop l;
  LOOP_OR_SKIP(l, 512);
  struct stat st {};
  ASSERT_EQ(::stat(l.dev.c_str(), &st), 0);
  const std::string root = *l.dir / "exports";
  ASSERT_EQ(::mkdir(root.c_str(), 0700), 0);
  ASSERT_EQ(::mknod((root + "/disk0").c_str(), S_IFBLK | 0600, st.st_rdev), 0);
  auto t = resolve_export(root, "s", "disk0");
  ASSERT_TRUE(t.ok()) << t.error().message();
  EXPECT_EQ(t->kind, ExportTarget::Kind::block_device);
  auto b = Backend::open(*t, {});
  ASSERT_TRUE(b.ok()) << b.error().message();
  Backend& be = **b;
  EXPECT_EQ(be.kind(), Backend::Kind::block_device);
  EXPECT_TRUE(be.direct());
  const DeviceGeometry g = be.geometry();
  EXPECT_EQ(g.nsectors, kDevSize / 512);
  EXPECT_EQ(g.logical_block_size, 512u);
  EXPECT_GT(g.max_hw_sectors, 0u);
  EXPECT_GT(g.max_segments, 0u);
  EXPECT_GT(g.max_discard_sectors, 0u) << "loop punches holes in its backing file";
  EXPECT_GT(g.max_write_zeroes_sectors, 0u);
  EXPECT_TRUE(g.cache_policy & kCacheFua);
  auto e = engine();
  ASSERT_TRUE(e);
  std::mt19937_64 rng(9);
  AlignedBuf w(256 << 10), rd(256 << 10);
  for (int i = 0; i < 100; ++i) {
    const uint32_t len = 512 * static_cast<uint32_t>(1 + rng() % 512);
    const uint64_t off = 512 * (rng() % ((kDevSize - len) / 512));
    test::fill_pattern(w.sub(0, len), i, off);
    ASSERT_EQ(run_io(*e, test::rw(be, IoOp::write, off, w.sub(0, len),
                                  i % 3 ? 0u : uint32_t{kIoFua})),
              0);
    ASSERT_EQ(run_io(*e, test::rw(be, IoOp::read, off, rd.sub(0, len))), 0);
    ASSERT_EQ(test::check_pattern(rd.sub(0, len), i, off), -1) << off << " " << len;
  }
  EXPECT_EQ(run_io(*e, test::range_op(be, IoOp::flush, 0, 0)), 0);
  EXPECT_EQ(run_io(*e, test::rw(be, IoOp::read, kDevSize - 512, rd.sub(0, 1024))), EIO);
}

// Case: DISCARD on the loop device, plain and with PREFLUSH + FUA (fdatasync round, then the
// ioctl on the helper thread, then fdatasync). Expect: the range reads as zeros, neighbours are
// intact, the backing file's blocks drop (loop turns the discard into a punched hole).
TEST(BlockDevice, DiscardOnTheHelperThread) {
  Loop l;
  LOOP_OR_SKIP(l, 512);
  auto b = Backend::open_path(l.dev, {});
  ASSERT_TRUE(b.ok()) << b.error().message();
  Backend& be = **b;
  ASSERT_TRUE(be.can_discard());
  auto e = engine();
  ASSERT_TRUE(e);
  AlignedBuf w(8 << 20), rd(8 << 20);
  test::fill_pattern(w.span(), 77, 0);
  ASSERT_EQ(run_io(*e, test::rw(be, IoOp::write, 0, w.span())), 0);
  ASSERT_EQ(run_io(*e, test::range_op(be, IoOp::flush, 0, 0)), 0);
  const uint64_t before = test::st_blocks(l.backing);
  ASSERT_EQ(run_io(*e, test::range_op(be, IoOp::discard, 1 << 20, 2 << 20)), 0);
  ASSERT_EQ(run_io(*e, test::range_op(be, IoOp::discard, 4 << 20, 1 << 20,
                                      kIoPreflush | kIoFua)),
            0);
  EXPECT_LE(test::st_blocks(l.backing), before - (3 << 20) / 512);
  ASSERT_EQ(run_io(*e, test::rw(be, IoOp::read, 0, rd.span())), 0);
  EXPECT_EQ(test::check_pattern(rd.sub(0, 1 << 20), 77, 0), -1);
  EXPECT_TRUE(test::all_zero(rd.sub(1 << 20, 2 << 20)));
  EXPECT_EQ(test::check_pattern(rd.sub(3 << 20, 1 << 20), 77, 3 << 20), -1);
  EXPECT_TRUE(test::all_zero(rd.sub(4 << 20, 1 << 20)));
  EXPECT_EQ(test::check_pattern(rd.sub(5 << 20, 3 << 20), 77, 5 << 20), -1);
  // A discard off the logical block is the kernel's EINVAL, through the callback.
  EXPECT_EQ(run_io(*e, test::range_op(be, IoOp::discard, 100, 512)), EINVAL);
  // Loop devices do not do secure erase: the ioctl's EOPNOTSUPP reaches the caller.
  EXPECT_EQ(run_io(*e, test::range_op(be, IoOp::secure_erase, 0, 4096)), EOPNOTSUPP);
}

// Case: WRITE_ZEROES on the loop device with and without NOUNMAP. Expect: zeros in the range and
// the data around it intact either way (blkdev_fallocate: ZERO_RANGE, PUNCH_HOLE).
TEST(BlockDevice, WriteZeroes) {
  Loop l;
  LOOP_OR_SKIP(l, 512);
  auto b = Backend::open_path(l.dev, {});
  ASSERT_TRUE(b.ok()) << b.error().message();
  Backend& be = **b;
  auto e = engine();
  ASSERT_TRUE(e);
  AlignedBuf w(4 << 20), rd(4 << 20);
  for (uint32_t flags : {0u, uint32_t{kIoNoUnmap}, kIoNoUnmap | kIoFua | kIoPreflush}) {
    SCOPED_TRACE(flags);
    test::fill_pattern(w.span(), flags + 3, 0);
    ASSERT_EQ(run_io(*e, test::rw(be, IoOp::write, 0, w.span())), 0);
    ASSERT_EQ(run_io(*e, test::range_op(be, IoOp::write_zeroes, 1 << 20, 1 << 20, flags)), 0);
    ASSERT_EQ(run_io(*e, test::rw(be, IoOp::read, 0, rd.span())), 0);
    EXPECT_EQ(test::check_pattern(rd.sub(0, 1 << 20), flags + 3, 0), -1);
    EXPECT_TRUE(test::all_zero(rd.sub(1 << 20, 1 << 20)));
    EXPECT_EQ(test::check_pattern(rd.sub(2 << 20, 2 << 20), flags + 3, 2 << 20), -1);
  }
}

// Case: a loop device with 4096-byte logical blocks. Expect: the geometry says 4096, and a
// 512-byte request is refused at submit (EINVAL) rather than failing in the kernel.
TEST(BlockDevice, FourKLogicalBlocks) {
  Loop l;
  LOOP_OR_SKIP(l, 4096);
  auto b = Backend::open_path(l.dev, {});
  ASSERT_TRUE(b.ok()) << b.error().message();
  Backend& be = **b;
  EXPECT_EQ(be.geometry().logical_block_size, 4096u);
  EXPECT_EQ(be.io_align(), 4096u);
  auto e = engine();
  ASSERT_TRUE(e);
  AlignedBuf buf(8192);
  EXPECT_EQ(run_io(*e, test::rw(be, IoOp::read, 512, buf.sub(0, 4096))), EINVAL);
  EXPECT_EQ(run_io(*e, test::rw(be, IoOp::read, 0, buf.sub(0, 512))), EINVAL);
  test::fill_pattern(buf.span(), 1, 4096);
  ASSERT_EQ(run_io(*e, test::rw(be, IoOp::write, 4096, buf.span())), 0);
  AlignedBuf rd(8192);
  ASSERT_EQ(run_io(*e, test::rw(be, IoOp::read, 4096, rd.span())), 0);
  EXPECT_EQ(test::check_pattern(rd.span(), 1, 4096), -1);
}

// Case: a read-only open of the device, and an exclusive open while another exclusive holder
// exists. Expect: writes EROFS; the second exclusive open EBUSY.
TEST(BlockDevice, ReadOnlyAndExclusive) {
  Loop l;
  LOOP_OR_SKIP(l, 512);
  OpenOptions ro;
  ro.read_only = true;
  auto b = Backend::open_path(l.dev, ro);
  ASSERT_TRUE(b.ok()) << b.error().message();
  auto e = engine();
  ASSERT_TRUE(e);
  AlignedBuf buf(4096);
  EXPECT_EQ(run_io(*e, test::rw(**b, IoOp::read, 0, buf.span())), 0);
  EXPECT_EQ(run_io(*e, test::rw(**b, IoOp::write, 0, buf.span())), EROFS);
  EXPECT_EQ(run_io(*e, test::range_op(**b, IoOp::discard, 0, 4096)), EROFS);
  OpenOptions ex;
  ex.exclusive = true;
  auto x1 = Backend::open_path(l.dev, ex);
  ASSERT_TRUE(x1.ok()) << x1.error().message();
  auto x2 = Backend::open_path(l.dev, ex);
  ASSERT_FALSE(x2.ok());
  EXPECT_EQ(x2.error().value(), EBUSY);
}

// Case: the backing file grows and the loop device is told (LOOP_SET_CAPACITY). Expect:
// refresh_size() reports the new size and the new tail is readable.
TEST(BlockDevice, ResizeIsDetected) {
  Loop l;
  LOOP_OR_SKIP(l, 512);
  auto b = Backend::open_path(l.dev, {});
  ASSERT_TRUE(b.ok()) << b.error().message();
  EXPECT_EQ((*b)->size(), kDevSize);
  ASSERT_EQ(::truncate(l.backing.c_str(), 2 * kDevSize), 0);
  ASSERT_EQ(::ioctl(l.fd.get(), LOOP_SET_CAPACITY, 0), 0);
  auto s = (*b)->refresh_size();
  ASSERT_TRUE(s.ok()) << s.error().message();
  EXPECT_EQ(*s, 2 * kDevSize);
  EXPECT_EQ((*b)->geometry().nsectors, 2 * kDevSize / 512);
  auto e = engine();
  ASSERT_TRUE(e);
  AlignedBuf buf(4096);
  EXPECT_EQ(run_io(*e, test::rw(**b, IoOp::read, 2 * kDevSize - 4096, buf.span())), 0);
}

}  // namespace
}  // namespace ibnbd
