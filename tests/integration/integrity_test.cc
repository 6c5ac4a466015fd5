// Data integrity through the real client library and the real block server, against a model:
// every op, split and scattered requests, many in flight, both paths, the copying variants;
// the file behind the server checked at the end. Parameterized by the store: O_DIRECT on a disk
// filesystem (/var/tmp) and buffered on tmpfs (/dev/shm).
#include <cstring>

#include "integration_harness.h"

namespace ibnbd::itest {
namespace {

using ibtrs::IoSeg;

class Integrity : public Rig, public ::testing::WithParamInterface<Store> {
 protected:
  // Rig::bring_up, and the store is what it says: O_DIRECT on /var/tmp, buffered on tmpfs.
  std::shared_ptr<RemoteDevice> bring_up(const std::string& tag) {
    auto d = Rig::bring_up(tag, GetParam());
    if (d == nullptr) return nullptr;
    auto devs = server().devices();
    EXPECT_EQ(devs.size(), 1u);
    if (!devs.empty() && devs[0].direct != (GetParam() == Store::direct)) {
      // The parameter would not test what it names.
      if (GetParam() == Store::direct) {
        skip_ = "the filesystem of " + file().root() + " has no O_DIRECT";
      } else {
        ADD_FAILURE() << "tmpfs has no O_DIRECT, yet the server opened " << file().path() << " direct";
      }
    }
    return d;
  }

  // Per path (in the session's order): transport reads and writes sent so far.
  std::vector<std::pair<uint64_t, uint64_t>> path_counts() {
    std::vector<std::pair<uint64_t, uint64_t>> out;
    for (auto& p : session().transport().paths()) out.emplace_back(p.stats.read_cnt, p.stats.write_cnt);
    return out;
  }
};

// Case: a seeded random mix of 3000 requests with up to 24 in flight on non-overlapping ranges:
// read / write / write with FUA, PREFLUSH or both (one registered buffer, or up to 40 scattered
// segments with gaps, some ending inside a block), read_copy / write_copy, flush, discard,
// write-zeroes with and without NOUNMAP; sizes from one block to three transport requests and
// more; two paths, round-robin.
// Expect: every request completes once, with 0; every read returns what the model holds (a
// discarded or zeroed range reads as zeros); requests above max_part_bytes were split; both
// paths carried reads and writes; at the end the whole device read through the library and the
// file read behind the server's back (pread) both equal the model.
TEST_P(Integrity, RandomMixOfEveryOpMatchesTheModel) {
  auto d = bring_up("mix");
  if (!skip_.empty()) GTEST_SKIP() << skip_;
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->max_part_bytes(), kMaxIo) << "the transport's limit (a chunk set), not the file's";
  Model m(d->size_bytes(), d->geometry().logical_block_size);
  LoadOptions o;
  o.seed = test_seed(GetParam() == Store::direct ? 4001 : 4002);
  o.ops = 3000;
  o.depth = 24;
  LoadReport rep;
  {
    Load load(session(), *d, m, o);
    rep = load.run();
  }
  std::printf("[ load     ] %s\n", rep.summary().c_str());
  EXPECT_EQ(rep.failed, 0u);
  EXPECT_EQ(rep.mismatches, 0u);
  for (size_t k = 0; k < static_cast<size_t>(OpKind::kCount); ++k)
    EXPECT_GT(rep.by_kind[k], 0u) << to_string(static_cast<OpKind>(k)) << " was never sent";
  EXPECT_GT(rep.split, 0u);
  EXPECT_GT(rep.fua, 0u);
  EXPECT_GT(rep.preflush, 0u);
  EXPECT_GT(rep.no_unmap, 0u);
  const DeviceStats st = d->stats();
  EXPECT_GT(st.parts_sent, st.reads + st.writes + st.flushes + st.discards + st.write_zeroes)
      << "split requests went out as several parts";
  EXPECT_EQ(st.errors, 0u);
  EXPECT_EQ(st.inflight, 0u);
  for (auto [reads, writes] : path_counts()) {
    EXPECT_GT(reads, 0u) << "round-robin: both paths carry reads";
    EXPECT_GT(writes, 0u) << "round-robin: both paths carry writes";
  }
  EXPECT_EQ(verify_device(*d, session(), m), "");
  EXPECT_EQ(verify_file(file(), m), "");
}

// Case: 64 times, a write (one transport request: a registered buffer, a scattered list or the
// copying variant) immediately followed by a read of the same range from the same thread, two
// paths, round-robin.
// Expect: the read always returns the write's bytes although the two went over different paths
// (per-path counters say which path carried each); the file holds the writes.
TEST_P(Integrity, ReadAfterWriteAcrossPaths) {
  auto d = bring_up("raw");
  if (!skip_.empty()) GTEST_SKIP() << skip_;
  ASSERT_NE(d, nullptr);
  ASSERT_EQ(session().transport().paths().size(), 2u);
  const uint32_t block = d->geometry().logical_block_size;
  Model m(d->size_bytes(), block);
  std::mt19937_64 rng(test_seed(GetParam() == Store::direct ? 4011 : 4012));
  auto mem = session().alloc_buffer(2 * size_t{d->max_part_bytes()});
  ASSERT_TRUE(mem.ok());
  std::byte* wbuf = (*mem)->data();
  std::byte* rbuf = wbuf + d->max_part_bytes();
  std::vector<std::byte> copy(d->max_part_bytes());
  auto which = [](const std::vector<std::pair<uint64_t, uint64_t>>& a,
                  const std::vector<std::pair<uint64_t, uint64_t>>& b, bool write) {
    for (size_t i = 0; i < a.size(); ++i)
      if ((write ? b[i].second - a[i].second : b[i].first - a[i].first) == 1) return int(i);
    return -1;
  };
  int crossed = 0;
  for (int i = 0; i < 64; ++i) {
    const uint64_t nb = 1 + rng() % (d->max_part_bytes() / block);
    const size_t len = static_cast<size_t>(nb * block);
    const uint64_t off = (rng() % (d->size_bytes() / block - nb + 1)) * block;
    const uint64_t version = 100 + static_cast<uint64_t>(i);
    const auto before = path_counts();
    int e = 0;
    switch (i % 3) {
      case 0: {
        fill_pattern(wbuf, len, off, version);
        IoSeg seg{wbuf, static_cast<uint32_t>(len), mem->get()};
        e = sync_io([&](IoDone done) { return d->write(off, std::span(&seg, 1), 0, done); });
        break;
      }
      case 1: {  // two segments with a gap between them
        std::vector<std::byte> pat(len);
        fill_pattern(pat.data(), len, off, version);
        const size_t half = len / 2 / 8 * 8;
        std::memcpy(wbuf, pat.data(), half);
        std::memcpy(wbuf + half + 64, pat.data() + half, len - half);
        IoSeg segs[2] = {{wbuf, static_cast<uint32_t>(half), mem->get()},
                         {wbuf + half + 64, static_cast<uint32_t>(len - half), mem->get()}};
        if (half + 64 + (len - half) > d->max_part_bytes()) {  // no room for the gap: one segment
          std::memcpy(wbuf, pat.data(), len);
          segs[0].len = static_cast<uint32_t>(len);
          e = sync_io([&](IoDone done) { return d->write(off, std::span(segs, 1), kIoFua, done); });
        } else {
          e = sync_io([&](IoDone done) { return d->write(off, segs, kIoFua, done); });
        }
        break;
      }
      default:
        fill_pattern(copy.data(), len, off, version);
        e = sync_io([&](IoDone done) { return d->write_copy(off, std::span(copy.data(), len), 0, done); });
        break;
    }
    ASSERT_EQ(e, 0) << "write " << i << " @" << off << "+" << len;
    m.write_pattern(off, len, version);
    const auto mid = path_counts();
    std::fill_n(rbuf, len, std::byte{0xa5});
    IoSeg rseg{rbuf, static_cast<uint32_t>(len), mem->get()};
    ASSERT_EQ(sync_io([&](IoDone done) { return d->read(off, std::span(&rseg, 1), done); }), 0) << i;
    const auto after = path_counts();
    EXPECT_EQ(m.check(off, rbuf, len), "") << "read after write " << i << " @" << off << "+" << len;
    const int wp = which(before, mid, true);
    const int rp = which(mid, after, false);
    ASSERT_GE(wp, 0) << "the write was one transport request";
    ASSERT_GE(rp, 0) << "the read was one transport request";
    crossed += wp != rp ? 1 : 0;
  }
  EXPECT_EQ(crossed, 64) << "round-robin from one thread: every read took the other path";
  EXPECT_EQ(verify_file(file(), m), "");
}

INSTANTIATE_TEST_SUITE_P(Stores, Integrity, ::testing::Values(Store::direct, Store::buffered),
                         [](const ::testing::TestParamInfo<Store>& i) { return to_string(i.param); });

}  // namespace
}  // namespace ibnbd::itest
