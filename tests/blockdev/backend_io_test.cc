// The IO engine on regular files: real bytes written and read back through io_uring, on tmpfs
// (buffered: tmpfs has no real O_DIRECT) and on a filesystem with O_DIRECT (found at run time).
#include <gtest/gtest.h>
#include <poll.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <random>
#include <thread>
#include <vector>

#include "backend/engine_slot.h"
#include "backend_test_util.h"
#include "proto/ibnbd_proto.h"
#include "ibnbd/backend.h"

namespace ibnbd::test {
namespace {

constexpr uint64_t kFileSize = 8 << 20;

// Where a scratch file lives: tmpfs (buffered: tmpfs has no real O_DIRECT) or a filesystem
// that takes O_DIRECT, found at run time.
enum class Fs { tmpfs, direct };

// Builds a rig on `fs`; an empty string on success, else why the test cannot run.
std::string make_rig(Rig& r, Fs fs, OpenOptions o = {}, uint32_t depth = 64,
                     uint64_t size = kFileSize) {
  const std::string base = fs == Fs::tmpfs ? "/dev/shm" : find_direct_io_dir();
  if (base.empty()) return "no filesystem with O_DIRECT among /var/tmp, /tmp, /work";
  if (std::string why = r.make_file_in(base, size); !why.empty()) return why;
  return r.open(r.path, o, depth);
}

#define RIG_OR_SKIP(rig, ...)                      \
  do {                                             \
    std::string why_ = make_rig(rig, __VA_ARGS__); \
    if (!why_.empty()) GTEST_SKIP() << why_;       \
  } while (0)

// The cases that must hold on both kinds of file.
class EachFs : public ::testing::TestWithParam<Fs> {
 protected:
  void SetUp() override { RIG_OR_SKIP(r, GetParam()); }
  Rig r;
};
std::string fs_name(const ::testing::TestParamInfo<Fs>& p) {
  return p.param == Fs::tmpfs ? "tmpfs" : "direct";
}
INSTANTIATE_TEST_SUITE_P(Files, EachFs, ::testing::Values(Fs::tmpfs, Fs::direct), fs_name);

// Writes random patterns at random offsets and sizes (multiples of `align`), each read back
// through the engine and compared, and checked once more with pread() on a buffered descriptor
// of its own as the ground truth.
void write_read_random(Rig& r, uint32_t align, int rounds, uint32_t max_len) {
  base::UniqueFd plain(::open(r.path.c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(plain.valid());
  std::mt19937_64 rng(42);
  AlignedBuf wbuf(max_len), rbuf(max_len);
  for (int i = 0; i < rounds; ++i) {
    const uint32_t len = align * static_cast<uint32_t>(1 + rng() % (max_len / align));
    const uint64_t off = align * (rng() % ((r.be->size() - len) / align + 1));
    const uint64_t seed = rng();
    fill_pattern(wbuf.sub(0, len), seed, off);
    ASSERT_EQ(run_io(*r.eng, rw(*r.be, IoOp::write, off, wbuf.sub(0, len))), 0)
        << "write off " << off << " len " << len;
    std::memset(rbuf.data(), 0xee, len);
    ASSERT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, off, rbuf.sub(0, len))), 0);
    ASSERT_EQ(check_pattern(rbuf.sub(0, len), seed, off), -1)
        << "read back differs, off " << off << " len " << len;
    std::vector<std::byte> truth(len);
    ASSERT_EQ(::pread(plain.get(), truth.data(), len, static_cast<off_t>(off)),
              static_cast<ssize_t>(len));
    ASSERT_EQ(check_pattern(truth, seed, off), -1) << "the file differs";
  }
}

// ---------------------------------------------------------------------------------------------

// Case: the internal user_data packing and the scatter-list walk past a short transfer.
// Expect: fields round-trip at their widths; whole segments are skipped and a partial one shrunk.
TEST(EngineInternals, TagPackingAndIovAdvance) {
  using backend::pack_tag;
  using backend::unpack_tag;
  const backend::Tag t = unpack_tag(pack_tag({4095, 3, 0xfedcba98}));
  EXPECT_EQ(t.slot, 4095u);
  EXPECT_EQ(t.stage, 3u);
  EXPECT_EQ(t.gen, 0xfedcba98u);
  std::byte b[100];
  iovec v[3] = {{b, 10}, {b + 10, 20}, {b + 30, 30}};
  uint32_t first = backend::advance_iov(v, 0, 3, 15);
  EXPECT_EQ(first, 1u);
  EXPECT_EQ(v[1].iov_base, b + 15);
  EXPECT_EQ(v[1].iov_len, 15u);
  first = backend::advance_iov(v, first, 3, 15);
  EXPECT_EQ(first, 2u);
  EXPECT_EQ(backend::advance_iov(v, first, 3, 30), 3u);
}

// Case: a file on tmpfs with the default "prefer O_DIRECT". Expect: buffered (tmpfs only
// pretends), 512-byte logical blocks, no alignment demands; 200 random writes at sector
// granularity read back exactly.
TEST(FileIo, TmpfsIsBufferedAndMovesRealBytes) {
  Rig r;
  RIG_OR_SKIP(r, Fs::tmpfs);
  EXPECT_FALSE(r.be->direct());
  EXPECT_EQ(r.be->io_align(), 1u);
  const DeviceGeometry g = r.be->geometry();
  EXPECT_EQ(g.logical_block_size, 512u);
  EXPECT_EQ(g.nsectors, kFileSize / 512);
  EXPECT_GT(g.max_discard_sectors, 0u) << "tmpfs punches holes";
  EXPECT_EQ(g.cache_policy, kCacheFua | kCacheWriteBack);
  write_read_random(r, 512, 200, 256 << 10);
}

// Case: an engine with sync_memory_files on a tmpfs file: 32 writes of 4 KiB at once, read back,
// then one of 1 MiB. Expect: the small ones are done inside submit() (ready(), the eventfd stays
// quiet) and called back by the next run_completions(), bytes intact; the large one goes through
// io_uring (not ready() after submit) and completes as before.
TEST(FileIo, TmpfsSmallRequestsAreDoneInsideSubmit) {
  Rig r;
  RIG_OR_SKIP(r, Fs::tmpfs);
  ASSERT_TRUE(r.be->memory_backed());
  EngineOptions eo;
  eo.queue_depth = 64;
  eo.sync_memory_files = true;
  auto e = IoEngine::create(eo);
  ASSERT_TRUE(e.ok());
  IoEngine& eng = **e;
  constexpr int kN = 32;
  AlignedBuf wbuf(kN * 4096), rbuf(kN * 4096);
  fill_pattern(wbuf.sub(0, kN * 4096), 9, 0);
  int calls = 0, errors = 0;
  struct Box {
    int* calls;
    int* errors;
  } box{&calls, &errors};
  auto cb = [](void* p, int err) {
    auto* b = static_cast<Box*>(p);
    ++*b->calls;
    *b->errors += err != 0;
  };
  for (int i = 0; i < kN; ++i) {
    BackendRequest q = rw(*r.be, IoOp::write, uint64_t(i) * 8192, wbuf.sub(uint64_t(i) * 4096, 4096));
    q.done = cb;
    q.ctx = &box;
    ASSERT_TRUE(eng.submit(q).ok());
  }
  EXPECT_TRUE(eng.ready());
  EXPECT_EQ(eng.in_flight(), uint32_t(kN));
  EXPECT_EQ(calls, 0) << "callbacks wait for run_completions()";
  pollfd p{eng.event_fd(), POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 0), 0) << "nothing went through the ring";
  EXPECT_EQ(eng.run_completions(), uint32_t(kN));
  EXPECT_EQ(calls, kN);
  EXPECT_EQ(errors, 0);
  EXPECT_FALSE(eng.ready());
  for (int i = 0; i < kN; ++i)
    ASSERT_EQ(run_io(eng, rw(*r.be, IoOp::read, uint64_t(i) * 8192, rbuf.sub(uint64_t(i) * 4096, 4096))), 0);
  EXPECT_EQ(std::memcmp(rbuf.data(), wbuf.data(), kN * 4096), 0);

  AlignedBuf big(1 << 20);
  BackendRequest q = rw(*r.be, IoOp::read, 0, big.span());
  q.done = cb;
  q.ctx = &box;
  ASSERT_TRUE(eng.submit(q).ok());
  EXPECT_FALSE(eng.ready()) << "1 MiB is past the inline limit";
  eng.drain();
  EXPECT_EQ(calls, kN + 1);
  EXPECT_EQ(errors, 0);
}

// Case: DirectIo::require on tmpfs. Expect: EINVAL (no silent page cache when asked for direct).
TEST(FileIo, RequiringDirectOnTmpfsFails) {
  auto d = TempDir::make("/dev/shm");
  ASSERT_TRUE(d);
  ASSERT_TRUE(make_file(*d / "f", 1 << 20));
  OpenOptions o;
  o.direct = DirectIo::require;
  auto b = Backend::open_path(*d / "f", o);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.error().value(), EINVAL);
}

// Case: a file on a filesystem with O_DIRECT. Expect: direct, the logical block is the reported
// alignment; 200 random aligned writes read back exactly.
TEST(FileIo, DirectFileMovesRealBytes) {
  Rig r;
  RIG_OR_SKIP(r, Fs::direct);
  ASSERT_TRUE(r.be->direct());
  EXPECT_GE(r.be->io_align(), 512u);
  EXPECT_EQ(r.be->geometry().logical_block_size, std::max(512u, r.be->io_align()));
  write_read_random(r, r.be->io_align(), 200, 512 << 10);
}

// Case: O_DIRECT and a request off the alignment: offset, length, buffer address. Expect:
// EINVAL at submit, nothing in flight.
TEST(FileIo, DirectRejectsMisalignedRequests) {
  Rig r;
  RIG_OR_SKIP(r, Fs::direct);
  ASSERT_TRUE(r.be->direct());
  const uint32_t a = r.be->io_align();
  AlignedBuf buf(8192);
  EXPECT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, 1, buf.sub(0, a))), EINVAL);
  EXPECT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, 0, buf.sub(0, a + 1))), EINVAL);
  if (r.be->mem_align() > 1) {
    EXPECT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, 0, buf.sub(1, a))), EINVAL);
  }
  EXPECT_EQ(r.eng->in_flight(), 0u);
}

// Case: a read and a write over a scatter list of uneven segments (direct and buffered).
// Expect: the segments are filled / taken in order.
TEST_P(EachFs, ScatterListsRoundTrip) {
  const uint32_t a = std::max(512u, r.be->io_align());
  AlignedBuf w(16 * a), rd(16 * a);
  fill_pattern(w.span(), 7, 3 * a);
  iovec wv[3] = {{w.data(), a}, {w.data() + a, 5 * a}, {w.data() + 6 * a, 10 * a}};
  iovec rv[4] = {{rd.data(), 2 * a},
                 {rd.data() + 2 * a, a},
                 {rd.data() + 3 * a, 12 * a},
                 {rd.data() + 15 * a, a}};
  BackendRequest wr = range_op(*r.be, IoOp::write, 3 * a, 16 * a);
  wr.iov = wv;
  ASSERT_EQ(run_io(*r.eng, wr), 0);
  BackendRequest rr = range_op(*r.be, IoOp::read, 3 * a, 16 * a);
  rr.iov = rv;
  ASSERT_EQ(run_io(*r.eng, rr), 0);
  EXPECT_EQ(check_pattern(rd.span(), 7, 3 * a), -1);
  // Segments that do not add up to len are refused.
  rr.len -= a;
  EXPECT_EQ(run_io(*r.eng, rr), EINVAL);
}

// Case: writes with FUA, with PREFLUSH, with both, and FLUSH alone, on both kinds of files.
// Expect: all complete without error and the data reads back (RWF_DSYNC on the write; a linked
// fdatasync before it).
TEST_P(EachFs, FuaPreflushAndFlush) {
  AlignedBuf w(64 << 10), rd(64 << 10);
  uint64_t seed = 100;
  for (uint32_t flags : {uint32_t{kIoFua}, uint32_t{kIoPreflush}, kIoFua | kIoPreflush,
                         kIoFua | kIoPreflush | kIoSync}) {
    const uint64_t off = (++seed % 16) * (128 << 10);
    fill_pattern(w.span(), seed, off);
    ASSERT_EQ(run_io(*r.eng, rw(*r.be, IoOp::write, off, w.span(), flags)), 0) << flags;
    ASSERT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, off, rd.span(), flags)), 0);
    EXPECT_EQ(check_pattern(rd.span(), seed, off), -1) << flags;
  }
  EXPECT_EQ(run_io(*r.eng, range_op(*r.be, IoOp::flush, 0, 0)), 0);
  EXPECT_EQ(run_io(*r.eng, range_op(*r.be, IoOp::flush, 0, 0, kIoPreflush | kIoFua)), 0);
}

// Case: DISCARD of a written range in the middle of a file. Expect: the range reads as zeros,
// its neighbours keep their data and the file's allocated blocks drop (the hole is punched).
TEST_P(EachFs, DiscardPunchesAHole) {
  ASSERT_TRUE(r.be->can_discard());
  AlignedBuf w(4 << 20), rd(4 << 20);
  fill_pattern(w.span(), 5, 0);
  ASSERT_EQ(run_io(*r.eng, rw(*r.be, IoOp::write, 0, w.span(), kIoFua)), 0);
  const uint64_t before = st_blocks(r.path);
  ASSERT_EQ(run_io(*r.eng, range_op(*r.be, IoOp::discard, 1 << 20, 2 << 20)), 0);
  EXPECT_LE(st_blocks(r.path), before - (2 << 20) / 512) << "blocks were not freed";
  ASSERT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, 0, rd.span())), 0);
  expect_zeroed_ranges(rd.span(), 5, {{1 << 20, 2 << 20}});
  // With FUA and PREFLUSH: the chain fdatasync -> punch -> fdatasync.
  ASSERT_EQ(run_io(*r.eng, range_op(*r.be, IoOp::discard, 0, 4096, kIoFua | kIoPreflush)), 0);
}

// Case: WRITE_ZEROES without NOUNMAP, then with NOUNMAP, on tmpfs (no FALLOC_FL_ZERO_RANGE: the
// engine falls back to punch + allocate) and on an O_DIRECT filesystem (ZERO_RANGE).
// Expect: both read as zeros with neighbours intact; without NOUNMAP the blocks are freed, with
// NOUNMAP they stay allocated.
TEST_P(EachFs, WriteZeroesWithAndWithoutUnmap) {
  ASSERT_TRUE(r.be->can_write_zeroes());
  AlignedBuf w(4 << 20), rd(4 << 20);
  for (uint32_t flags : {0u, uint32_t{kIoNoUnmap}, kIoNoUnmap | kIoFua}) {
    SCOPED_TRACE(flags);
    fill_pattern(w.span(), flags + 1, 0);
    ASSERT_EQ(run_io(*r.eng, rw(*r.be, IoOp::write, 0, w.span())), 0);
    ASSERT_EQ(run_io(*r.eng, range_op(*r.be, IoOp::flush, 0, 0)), 0);
    const uint64_t before = st_blocks(r.path);
    ASSERT_EQ(run_io(*r.eng, range_op(*r.be, IoOp::write_zeroes, 1 << 20, 2 << 20, flags)), 0);
    const uint64_t after = st_blocks(r.path);
    if (flags & kIoNoUnmap)
      EXPECT_GE(after, before) << "NOUNMAP must keep the blocks allocated";
    else
      EXPECT_LE(after, before - (2 << 20) / 512) << "without NOUNMAP the range is punched";
    ASSERT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, 0, rd.span())), 0);
    expect_zeroed_ranges(rd.span(), flags + 1, {{1 << 20, 2 << 20}});
  }
  EXPECT_EQ(r.be->zero_range_unsupported(), GetParam() == Fs::tmpfs);
}

// Case: a read ending past the exported size; a read of a file truncated behind the backend's
// back (the cached size is stale), entirely and partly past the new end. Expect: EIO in every
// case — at submit for the first, from the short-read logic for the others — never zeros.
TEST(FileIo, ReadsPastTheEndFail) {
  Rig r;
  RIG_OR_SKIP(r, Fs::tmpfs);
  AlignedBuf buf(64 << 10);
  EXPECT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, kFileSize - 4096, buf.span())), EIO);
  EXPECT_EQ(run_io(*r.eng, rw(*r.be, IoOp::write, kFileSize, buf.sub(0, 512))), EIO);
  EXPECT_EQ(run_io(*r.eng, range_op(*r.be, IoOp::discard, kFileSize - 512, 1024)), EIO);
  ASSERT_EQ(::truncate(r.path.c_str(), kFileSize / 2), 0);
  EXPECT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, kFileSize - (64 << 10), buf.span())), EIO);
  EXPECT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, kFileSize / 2 - 4096, buf.span())), EIO)
      << "a read straddling the end must not succeed with a partial buffer";
  // refresh_size() learns the new size: the same read is now refused at submit.
  auto s = r.be->refresh_size();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, kFileSize / 2);
  EXPECT_EQ(r.be->geometry().nsectors, kFileSize / 2 / 512);
  ASSERT_EQ(::truncate(r.path.c_str(), kFileSize * 2 + 100), 0);
  s = r.be->refresh_size();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, kFileSize * 2) << "the tail under one logical block is not exported";
  EXPECT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, kFileSize * 2 - 4096, buf.sub(0, 4096))), 0);
}

// Case: O_DIRECT, and the file truncated behind the backend's back to an end that is not
// block-aligned; a read across that end. Expect: EIO, never a partial buffer (ext4 answers the
// unaligned rest with 0 bytes; a filesystem answering EINVAL is caught by the alignment check).
TEST(FileIo, DirectReadAcrossAnUnalignedEndFails) {
  Rig r;
  RIG_OR_SKIP(r, Fs::direct);
  ASSERT_TRUE(r.be->direct());
  ASSERT_EQ(::truncate(r.path.c_str(), (1 << 20) + 100), 0);
  AlignedBuf buf(64 << 10);
  EXPECT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, 1 << 20, buf.span())), EIO);
  EXPECT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, (1 << 20) - 4096, buf.span())), EIO);
}

// Case: a read-only backend. Expect: reads and flushes work; WRITE, DISCARD, WRITE_ZEROES and
// SECURE_ERASE are EROFS; the geometry offers no discard or write-zeroes.
TEST(FileIo, ReadOnlyBackendRefusesWrites) {
  OpenOptions o;
  o.read_only = true;
  Rig r;
  RIG_OR_SKIP(r, Fs::tmpfs, o);
  AlignedBuf buf(4096);
  EXPECT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, 0, buf.span())), 0);
  EXPECT_EQ(run_io(*r.eng, range_op(*r.be, IoOp::flush, 0, 0)), 0);
  EXPECT_EQ(run_io(*r.eng, rw(*r.be, IoOp::write, 0, buf.span())), EROFS);
  EXPECT_EQ(run_io(*r.eng, range_op(*r.be, IoOp::discard, 0, 4096)), EROFS);
  EXPECT_EQ(run_io(*r.eng, range_op(*r.be, IoOp::write_zeroes, 0, 4096)), EROFS);
  EXPECT_EQ(run_io(*r.eng, range_op(*r.be, IoOp::secure_erase, 0, 4096)), EROFS);
  const DeviceGeometry g = r.be->geometry();
  EXPECT_EQ(g.max_discard_sectors, 0u);
  EXPECT_EQ(g.max_write_zeroes_sectors, 0u);
}

// Case: requests the engine refuses at submit: no callback, unknown op or flag, both a buffer
// and segments, too many segments, SECURE_ERASE on a file. Expect: EINVAL / EOPNOTSUPP.
TEST(FileIo, InvalidRequestsAreRefusedAtSubmit) {
  Rig r;
  RIG_OR_SKIP(r, Fs::tmpfs);
  AlignedBuf buf(4096);
  BackendRequest q = rw(*r.be, IoOp::read, 0, buf.span());
  EXPECT_EQ(r.eng->submit(q).error().value(), EINVAL) << "no callback";
  q.flags = 1u << 20;
  EXPECT_EQ(run_io(*r.eng, q), EINVAL);
  q.flags = 0;
  q.op = static_cast<IoOp>(9);
  EXPECT_EQ(run_io(*r.eng, q), EINVAL);
  q.op = IoOp::read;
  iovec v[kMaxIoSegments + 1];
  for (auto& x : v) x = {buf.data(), 256};
  q.iov = {v, 1};
  EXPECT_EQ(run_io(*r.eng, q), EINVAL) << "buffer and segments";
  q.buf = {};
  q.iov = v;
  q.len = 256 * (kMaxIoSegments + 1);
  EXPECT_EQ(run_io(*r.eng, q), EINVAL) << "too many segments";
  EXPECT_EQ(run_io(*r.eng, range_op(*r.be, IoOp::secure_erase, 0, 4096)), EOPNOTSUPP);
  // Zero-length requests complete (nothing to move) rather than hang.
  EXPECT_EQ(run_io(*r.eng, rw(*r.be, IoOp::read, 0, {})), 0);
  EXPECT_EQ(run_io(*r.eng, range_op(*r.be, IoOp::discard, 0, 0)), 0);
  EXPECT_EQ(r.eng->in_flight(), 0u);
}

// Case: a 1 MiB sparse file on a 256 KiB tmpfs mounted in a private mount namespace (root only),
// written from the start in 96 KiB pieces. Expect: two writes fit; the third gets 64 KiB in (a
// short write, resumed by the engine) and then ENOSPC, which reaches the caller as the errno —
// the 64 KiB that did fit are on the file.
TEST(FileIo, EnospcReachesTheCaller) {
  auto d = TempDir::make("/tmp");
  ASSERT_TRUE(d);
  // The namespace belongs to a short-lived thread: unshare(CLONE_NEWNS) changes only the calling
  // thread, and the open descriptor keeps the detached tmpfs alive after the thread is gone.
  std::string skip;
  std::unique_ptr<Backend> be;
  std::thread t([&] {
    if (::unshare(CLONE_NEWNS) != 0) {
      skip = std::string("unshare(CLONE_NEWNS): ") + strerror(errno);
      return;
    }
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        ::mount("tmpfs", d->path().c_str(), "tmpfs", 0, "size=256k") != 0) {
      skip = std::string("mount tmpfs: ") + strerror(errno);
      return;
    }
    const std::string f = *d / "small.img";
    if (!make_file(f, 1 << 20)) {
      skip = "cannot create the file";
      return;
    }
    auto b = Backend::open_path(f, {});
    if (!b) {
      skip = "open: " + b.error().message();
      return;
    }
    be = std::move(*b);
  });
  t.join();
  if (!skip.empty()) GTEST_SKIP() << skip;
  auto e = IoEngine::create({8});
  ASSERT_TRUE(e.ok());
  constexpr uint32_t kPiece = 96 << 10;
  AlignedBuf w(kPiece);
  int err = 0;
  uint64_t off = 0;
  for (; off < (1 << 20); off += kPiece) {
    fill_pattern(w.span(), 3, off);
    err = run_io(**e, rw(*be, IoOp::write, off, w.span()));
    if (err != 0) break;
  }
  EXPECT_EQ(err, ENOSPC);
  EXPECT_EQ(off, 2u * kPiece) << "the third write is the one that does not fit";
  std::vector<std::byte> tail(64 << 10);
  ASSERT_EQ(::pread(be->fd(), tail.data(), tail.size(), static_cast<off_t>(off)),
            static_cast<ssize_t>(tail.size()));
  EXPECT_EQ(check_pattern(tail, 3, off), -1) << "the short part of the write landed";
}

// Case: queue depth 64 and 64 writes of mixed sizes submitted before one kick, then 64 reads.
// Expect: the 65th submit is EAGAIN while all are in flight; every callback comes exactly once
// with its own context; data reads back. Completion order is whatever the kernel gives (mixed
// sizes usually finish out of order; printed, not required).
TEST(FileIo, SixtyFourInFlight) {
  const Fs fs = find_direct_io_dir().empty() ? Fs::tmpfs : Fs::direct;
  Rig r;
  RIG_OR_SKIP(r, fs, {}, 64, 64ull << 20);
  constexpr int kN = 64;
  const uint32_t kSlot = 1 << 20;
  AlignedBuf w(kN * kSlot), rd(kN * kSlot);
  struct Ctx {
    int index;
    int calls = 0;
    int err = -1;
    std::vector<int>* order;
  };
  std::vector<int> order;
  std::vector<Ctx> ctx(kN);
  auto cb = [](void* p, int err) {
    auto* c = static_cast<Ctx*>(p);
    ++c->calls;
    c->err = err;
    c->order->push_back(c->index);
  };
  auto len_of = [&](int i) {
    return i % 4 == 0 ? kSlot : static_cast<uint32_t>(4096 * (1 + i % 3));
  };
  for (IoOp op : {IoOp::write, IoOp::read}) {
    SCOPED_TRACE(op == IoOp::write ? "write" : "read");
    order.clear();
    for (int i = 0; i < kN; ++i) {
      ctx[i] = {i, 0, -1, &order};
      const uint64_t off = uint64_t(i) * kSlot;
      auto* mem = (op == IoOp::write ? w : rd).data() + off;
      if (op == IoOp::write) fill_pattern({mem, len_of(i)}, 11, off);
      BackendRequest q = rw(*r.be, op, off, {mem, len_of(i)});
      q.done = cb;
      q.ctx = &ctx[i];
      ASSERT_TRUE(r.eng->submit(q).ok()) << i;
    }
    EXPECT_EQ(r.eng->in_flight(), 64u);
    BackendRequest extra = rw(*r.be, op, 0, w.sub(0, 4096));
    extra.done = cb;
    extra.ctx = &ctx[0];
    EXPECT_EQ(r.eng->submit(extra).error().value(), EAGAIN);
    ASSERT_TRUE(r.eng->kick().ok());
    r.eng->drain();
    ASSERT_EQ(order.size(), size_t{kN});
    for (int i = 0; i < kN; ++i) {
      EXPECT_EQ(ctx[i].calls, 1) << i;
      EXPECT_EQ(ctx[i].err, 0) << i;
    }
    int out_of_order = 0;
    for (int i = 0; i < kN; ++i) out_of_order += order[i] != i;
    std::printf("[ info ] %s: %d of %d completions out of submission order\n",
                op == IoOp::write ? "write" : "read", out_of_order, kN);
  }
  for (int i = 0; i < kN; ++i)
    ASSERT_EQ(check_pattern(rd.sub(uint64_t(i) * kSlot, len_of(i)), 11, uint64_t(i) * kSlot), -1)
        << i;
}

// Case: a callback that submits the next request (a chain of 500 writes through a depth-2
// engine), completions waited for on the eventfd with poll(). Expect: all 500 run, the eventfd
// was readable whenever completions were pending, nothing is left in flight.
TEST(FileIo, CallbacksMaySubmitAndTheEventfdWakes) {
  Rig r;
  RIG_OR_SKIP(r, Fs::tmpfs, {}, 2);
  AlignedBuf buf(4096);
  struct Chain {
    IoEngine* eng;
    Backend* be;
    std::span<std::byte> buf;
    int left;
    int done = 0;
    int errors = 0;
  } chain{r.eng.get(), r.be.get(), buf.span(), 500};
  BackendRequest first = rw(*r.be, IoOp::write, 0, buf.span());
  first.ctx = &chain;
  // A named function, so the callback can submit its successor with itself as callback.
  struct Self {
    static void done(void* p, int err) {
      auto* c = static_cast<Chain*>(p);
      ++c->done;
      c->errors += err != 0;
      if (--c->left == 0) return;
      BackendRequest n = rw(*c->be, IoOp::write, uint64_t(c->left % 64) * 4096, c->buf);
      n.ctx = c;
      n.done = &Self::done;
      if (!c->eng->submit(n).ok()) ++c->errors;
    }
  };
  first.done = &Self::done;
  ASSERT_TRUE(r.eng->submit(first).ok());
  ASSERT_TRUE(r.eng->kick().ok());
  int wakeups = 0;
  while (r.eng->in_flight() > 0 && wakeups < 100000) {
    pollfd p{r.eng->event_fd(), POLLIN, 0};
    ASSERT_EQ(::poll(&p, 1, 10000), 1) << "the eventfd did not wake us";
    ++wakeups;
    r.eng->run_completions();
  }
  EXPECT_EQ(chain.done, 500);
  EXPECT_EQ(chain.errors, 0);
  EXPECT_EQ(r.eng->in_flight(), 0u);
}

// Case: the engine is destroyed with reads still in the kernel. Expect: the destructor waits
// for them (the buffers stay valid until it returns) and drops their callbacks.
TEST(FileIo, DestroyWithRequestsInFlight) {
  Rig r;
  RIG_OR_SKIP(r, Fs::tmpfs);
  AlignedBuf buf(16 << 20);
  int calls = 0;
  for (int i = 0; i < 16; ++i) {
    BackendRequest q = rw(*r.be, IoOp::read, 0, buf.sub(uint64_t(i) << 20, 1 << 20));
    q.ctx = &calls;
    q.done = [](void* p, int) { ++*static_cast<int*>(p); };
    ASSERT_TRUE(r.eng->submit(q).ok());
  }
  ASSERT_TRUE(r.eng->kick().ok());
  r.eng.reset();
  EXPECT_EQ(calls, 0);
}


// ------------------------------------------------------------------------------------------
// BLOCK_STATUS

// Asks the engine where the data of [off, off + len) is; the decoded answer, or an errno.
int status_of(Rig& r, uint64_t off, uint32_t len, ExtentList& out) {
  AlignedBuf ans(proto::kBlockStatusReplyBytes);
  BackendRequest q = range_op(*r.be, IoOp::block_status, off, len);
  q.buf = std::span(ans.span().data(), proto::kBlockStatusReplyBytes);
  if (int e = run_io(*r.eng, q); e != 0) return e;
  auto st = proto::decode_block_status_rsp(q.buf, len, out);
  return st.ok() ? 0 : st.error().value();
}

constexpr uint32_t kHoleZero = kExtentHole | kExtentZero;

// Case: an 8 MiB sparse file with 64 KiB of data at 1 MiB and 4 KiB at 5 MiB (SEEK_DATA /
// SEEK_HOLE on tmpfs and on the O_DIRECT filesystem). Expect: hole, data, hole, data, hole,
// exactly those ranges; a question starting inside the data starts with data; a read-only
// backend answers too (BLOCK_STATUS reads nothing).
TEST_P(EachFs, BlockStatusFindsTheHolesOfASparseFile) {
  AlignedBuf w(64 << 10);
  fill_pattern(w.span(), 9, 0);
  ASSERT_EQ(run_io(*r.eng, rw(*r.be, IoOp::write, 1 << 20, w.span(), kIoFua)), 0);
  ASSERT_EQ(run_io(*r.eng, rw(*r.be, IoOp::write, 5 << 20, w.span().first(4096), kIoFua)), 0);
  ExtentList l;
  ASSERT_EQ(status_of(r, 0, kFileSize, l), 0);
  ASSERT_EQ(l.count, 5u);
  EXPECT_EQ(l.e[0], (Extent{1 << 20, kHoleZero}));
  EXPECT_EQ(l.e[1], (Extent{64 << 10, 0}));
  EXPECT_EQ(l.e[2], (Extent{(4 << 20) - (64 << 10), kHoleZero}));
  EXPECT_EQ(l.e[3], (Extent{4096, 0}));
  EXPECT_EQ(l.e[4], (Extent{kFileSize - (5 << 20) - 4096, kHoleZero}));
  ASSERT_EQ(status_of(r, (1 << 20) + 4096, 1 << 20, l), 0);
  ASSERT_EQ(l.count, 2u);
  EXPECT_EQ(l.e[0], (Extent{60 << 10, 0}));
  EXPECT_EQ(l.covered(), 1u << 20);
  Rig ro;
  ASSERT_EQ(ro.open(r.path, OpenOptions{.read_only = true, .direct = r.be->direct() ? DirectIo::require : DirectIo::off}, 4), "");
  ASSERT_EQ(status_of(ro, 0, kFileSize, l), 0);
  EXPECT_EQ(l.count, 5u);
}

// Case: a file with 200 separate 4 KiB data blocks (400 extents). Expect: one answer holds
// kMaxExtents extents over a prefix; asking again from its end, and so on, walks the whole file
// in 4 answers, each bounded, together exactly the file's layout.
TEST(FileIo, BlockStatusAnswersArePrefixesOfBoundedLength) {
  Rig r;
  RIG_OR_SKIP(r, Fs::tmpfs);
  AlignedBuf w(4096);
  fill_pattern(w.span(), 3, 0);
  for (uint64_t i = 0; i < 200; ++i)
    ASSERT_EQ(run_io(*r.eng, rw(*r.be, IoOp::write, i * 32768 + 16384, w.span())), 0);
  uint64_t pos = 0;
  int answers = 0;
  uint64_t data = 0;
  ExtentList l;
  while (pos < kFileSize && answers < 10) {
    ASSERT_EQ(status_of(r, pos, static_cast<uint32_t>(kFileSize - pos), l), 0);
    ASSERT_GE(l.count, 1u);
    ASSERT_LE(l.count, kMaxExtents);
    for (uint32_t i = 0; i < l.count; ++i)
      if (l.e[i].flags == 0) data += l.e[i].length;
    pos += l.covered();
    ++answers;
  }
  EXPECT_EQ(pos, kFileSize);
  EXPECT_EQ(answers, 4) << "401 extents, 128 per answer";
  EXPECT_EQ(data, 200u * 4096);
}

// Case: BLOCK_STATUS the engine refuses: past the end, with flags, without an answer buffer
// (or one too small), a range off 512 bytes. Expect: EIO (as READ), EINVAL otherwise, and no
// callback.
TEST(FileIo, BlockStatusRefusals) {
  Rig r;
  RIG_OR_SKIP(r, Fs::tmpfs);
  AlignedBuf ans(proto::kBlockStatusReplyBytes);
  auto q = [&](uint64_t off, uint32_t len, uint32_t flags = 0, size_t buf = proto::kBlockStatusReplyBytes) {
    BackendRequest x = range_op(*r.be, IoOp::block_status, off, len, flags);
    x.buf = std::span(ans.span().data(), buf);
    x.done = [](void*, int) { ADD_FAILURE() << "called back"; };
    return r.eng->submit(x);
  };
  EXPECT_EQ(q(kFileSize - 4096, 8192).error(), std::errc::io_error);
  EXPECT_EQ(q(0, 4096, kIoFua).error(), std::errc::invalid_argument);
  EXPECT_EQ(q(0, 4096, 0, 0).error(), std::errc::invalid_argument);
  EXPECT_EQ(q(0, 4096, 0, proto::kBlockStatusReplyBytes - 1).error(), std::errc::invalid_argument);
  EXPECT_EQ(q(100, 4096).error(), std::errc::invalid_argument);
  EXPECT_EQ(q(0, 0).error(), std::errc::invalid_argument);
}

}  // namespace
}  // namespace ibnbd::test
