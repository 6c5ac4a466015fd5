#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <set>
#include <thread>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "fabric/secure_random.h"
#include "fabric/mr_table.h"

namespace ibtrs::fabric {
namespace {

TEST(MrTable, ChecksKeyBoundsAndAccess) {
  MrTable t;
  std::vector<std::byte> mem(4096);
  auto key = t.add(mem.data(), mem.size(), kRemoteWrite);
  ASSERT_TRUE(key.ok());
  EXPECT_NE(*key, 0u) << "key 0 is never valid";
  const uint64_t base = reinterpret_cast<uint64_t>(mem.data());
  MrTable::Fault f;
  EXPECT_TRUE(t.acquire(*key, base, 4096, kRemoteWrite, &f));
  EXPECT_TRUE(t.acquire(*key, base + 4096, 0, kRemoteWrite, &f)) << "empty window at the end";
  EXPECT_FALSE(t.acquire(*key, base + 1, 4096, kRemoteWrite, &f));
  EXPECT_EQ(f, MrTable::Fault::out_of_bounds);
  EXPECT_FALSE(t.acquire(*key, base - 1, 1, kRemoteWrite, &f));
  EXPECT_EQ(f, MrTable::Fault::out_of_bounds);
  EXPECT_FALSE(t.acquire(*key, base + 8, UINT64_MAX - 4, kRemoteWrite, &f)) << "length overflow";
  EXPECT_FALSE(t.acquire(*key, base, 1, kRemoteRead, &f));
  EXPECT_EQ(f, MrTable::Fault::no_access);
  EXPECT_FALSE(t.acquire(*key + 1, base, 1, kRemoteWrite, &f));
  EXPECT_EQ(f, MrTable::Fault::bad_key);
  EXPECT_TRUE(t.check(*key, base, 1, kLocalWrite)) << "remote write implies local write";
}

TEST(MrTable, StaleKeyNeverReachesAReusedSlot) {
  MrTable t;
  std::vector<std::byte> a(64), b(64);
  auto ka = t.add(a.data(), a.size(), kRemoteWrite);
  ASSERT_TRUE(ka.ok());
  t.remove(*ka);
  auto kb = t.add(b.data(), b.size(), kRemoteWrite);
  ASSERT_TRUE(kb.ok());
  EXPECT_NE(*ka, *kb);
  EXPECT_FALSE(t.check(*ka, reinterpret_cast<uint64_t>(b.data()), 1, kRemoteWrite));
  EXPECT_TRUE(t.check(*kb, reinterpret_cast<uint64_t>(b.data()), 1, kRemoteWrite));
  t.remove(*ka);  // a stale remove is harmless
  EXPECT_TRUE(t.check(*kb, reinterpret_cast<uint64_t>(b.data()), 1, kRemoteWrite));
}

TEST(MrTable, RejectsBadRegistrations) {
  MrTable t;
  std::byte x;
  EXPECT_FALSE(t.add(nullptr, 1, 0).ok());
  EXPECT_FALSE(t.add(&x, 0, 0).ok());
  EXPECT_FALSE(t.add(&x, 1, 1u << 9).ok());
}

// Case: a writer keeps acquiring windows of a region while another thread deregisters it.
// Expect: once remove() has returned, no acquire succeeds and no Ref is still held.
TEST(MrTable, RemoveWaitsForPlacementsInFlight) {
  MrTable t;
  std::vector<std::byte> mem(1 << 16);
  auto key = t.add(mem.data(), mem.size(), kRemoteWrite);
  ASSERT_TRUE(key.ok());
  std::atomic<bool> removed{false};
  std::atomic<int> after_remove{0};
  std::thread writer([&] {
    for (int i = 0; i < 200000; ++i) {
      bool was_removed = removed.load();
      auto r = t.acquire(*key, reinterpret_cast<uint64_t>(mem.data()), 64, kRemoteWrite, nullptr);
      if (r) {
        r.ptr()[0] = std::byte{1};
        if (was_removed) after_remove.fetch_add(1);
      }
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  t.remove(*key);
  removed = true;
  writer.join();
  EXPECT_EQ(after_remove.load(), 0);
}

// Case: tables of capacity 65535, 4096 and 1.
// Expect: the index takes bit_width(capacity) bits and the tag every bit left (16, 19, 31).
TEST(MrTable, TagsAreAsWideAsTheCapacityAllows) {
  EXPECT_EQ(MrTable().tag_bits(), 16u);
  EXPECT_EQ(MrTable(4096).tag_bits(), 19u);
  EXPECT_EQ(MrTable(1).tag_bits(), 31u);
  EXPECT_EQ(MrTable(0).capacity(), MrTable::kMaxCapacity) << "0 means the largest table";
}

// Case: one slot registered and removed 4000 times in a row (the same index every time).
// Expect: no key repeats its predecessor; the tags are spread (close to 4000 distinct of 2^16,
// every tag bit set in 40..60% of them), so a key says nothing about the next one.
TEST(MrTable, EveryRegistrationDrawsARandomTag) {
  MrTable t;
  std::vector<std::byte> mem(64);
  std::vector<uint32_t> keys;
  for (int i = 0; i < 4000; ++i) {
    auto k = t.add(mem.data(), mem.size(), kRemoteWrite);
    ASSERT_TRUE(k.ok());
    keys.push_back(*k);
    t.remove(*k);
  }
  std::set<uint32_t> distinct(keys.begin(), keys.end());
  // Birthday bound: 4000 draws of 16 bits repeat ~120 times on average.
  EXPECT_GT(distinct.size(), 3700u);
  for (size_t i = 1; i < keys.size(); ++i) {
    EXPECT_EQ(keys[i] >> 16, keys[0] >> 16) << "same slot";
    EXPECT_NE(keys[i], keys[i - 1]);
  }
  for (uint32_t bit = 0; bit < t.tag_bits(); ++bit) {
    size_t ones = 0;
    for (uint32_t k : keys) ones += (k >> bit) & 1u;
    EXPECT_GT(ones, 1600u) << "bit " << bit;
    EXPECT_LT(ones, 2400u) << "bit " << bit;
  }
}

// Case: a table of capacity 8 filled with 6 regions and 2 windows, then one more of each.
// Expect: ENOMEM for both; in_use() counts 8; after one removal a registration fits again.
TEST(MrTable, CapacityCapsRegionsAndWindows) {
  MrTable t(8);
  std::vector<std::byte> mem(64);
  std::vector<uint32_t> keys;
  for (int i = 0; i < 6; ++i) {
    auto k = t.add(mem.data(), mem.size(), kRemoteWrite);
    ASSERT_TRUE(k.ok()) << i;
    keys.push_back(*k);
  }
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(t.alloc_window().ok()) << i;
  EXPECT_EQ(t.in_use(), 8u);
  EXPECT_EQ(t.add(mem.data(), mem.size(), kRemoteWrite).error(), errc(ENOMEM));
  EXPECT_EQ(t.alloc_window().error(), errc(ENOMEM));
  t.remove(keys.back());
  EXPECT_EQ(t.in_use(), 7u);
  EXPECT_TRUE(t.add(mem.data(), mem.size(), kRemoteWrite).ok());
  EXPECT_EQ(t.in_use(), 8u);
}

// Case: a region revoked, restored, revoked again, then rekeyed; then rekeyed while live.
// Expect: a revoked key fails every lookup; restore brings the same key back; rekey gives a new
// key that works while the old one does not, and a stale key neither rekeys nor comes back; the
// slot stays the same one (no registration).
TEST(MrTable, RevokeAndRekeyFlipTheKey) {
  MrTable t;
  std::vector<std::byte> mem(4096);
  const uint64_t base = reinterpret_cast<uint64_t>(mem.data());
  auto k0 = t.add(mem.data(), mem.size(), kRemoteWrite);
  ASSERT_TRUE(k0.ok());
  t.revoke(*k0);
  EXPECT_FALSE(t.check(*k0, base, 1, kRemoteWrite));
  EXPECT_FALSE(t.check(*k0, base, 1, 0)) << "a revoked region is no lkey either";
  EXPECT_EQ(t.in_use(), 1u);
  ASSERT_TRUE(t.restore(*k0).ok());
  EXPECT_TRUE(t.check(*k0, base, 1, kRemoteWrite)) << "restored under the same key";
  EXPECT_TRUE(t.restore(*k0).ok()) << "a live key stays live";
  t.revoke(*k0);
  auto k1 = t.rekey(*k0);
  ASSERT_TRUE(k1.ok());
  EXPECT_NE(*k1, *k0);
  EXPECT_EQ(*k1 >> t.tag_bits(), *k0 >> t.tag_bits());
  EXPECT_TRUE(t.check(*k1, base, 4096, kRemoteWrite));
  auto k2 = t.rekey(*k1);
  ASSERT_TRUE(k2.ok());
  EXPECT_FALSE(t.check(*k1, base, 1, kRemoteWrite));
  EXPECT_TRUE(t.check(*k2, base, 1, kRemoteWrite));
  EXPECT_EQ(t.rekey(*k1).error(), errc(ENOENT)) << "only the current key rekeys";
  EXPECT_EQ(t.restore(*k1).error(), errc(ENOENT)) << "nor does a stale key come back";
  EXPECT_FALSE(t.check(*k1, base, 1, kRemoteWrite));
  t.remove(*k2);
  EXPECT_EQ(t.in_use(), 0u);
}

// Case: a window bound over [1024, 2048) of a kMwBind region for connection 7.
// Expect: remote writes for connection 7 inside the range pass; outside it, for another
// connection, for local use (an lkey) or without the access bit they fail; revoked it fails;
// bound again it has a new key and the old one fails.
TEST(MrTable, WindowsOpenTheirRangeToTheirConnectionOnly) {
  MrTable t;
  std::vector<std::byte> mem(4096);
  const uint64_t base = reinterpret_cast<uint64_t>(mem.data());
  auto region = t.add(mem.data(), mem.size(), kLocalWrite | kMwBind);
  auto w0 = t.alloc_window();
  ASSERT_TRUE(region.ok() && w0.ok());
  MrTable::Fault f;
  EXPECT_FALSE(t.acquire(*w0, base, 1, kRemoteWrite, &f, 7)) << "unbound";
  auto w1 = t.bind_window(*w0, *region, base + 1024, 1024, kRemoteWrite, 7);
  ASSERT_TRUE(w1.ok());
  EXPECT_TRUE(t.acquire(*w1, base + 1024, 1024, kRemoteWrite, &f, 7));
  EXPECT_FALSE(t.acquire(*w1, base + 1023, 2, kRemoteWrite, &f, 7));
  EXPECT_EQ(f, MrTable::Fault::out_of_bounds);
  EXPECT_FALSE(t.acquire(*w1, base + 2047, 2, kRemoteWrite, &f, 7));
  EXPECT_FALSE(t.acquire(*w1, base + 1024, 1, kRemoteWrite, &f, 8));
  EXPECT_EQ(f, MrTable::Fault::bad_key);
  EXPECT_FALSE(t.acquire(*w1, base + 1024, 1, kRemoteRead, &f, 7));
  EXPECT_EQ(f, MrTable::Fault::no_access);
  EXPECT_FALSE(t.check(*w1, base + 1024, 1, kLocalWrite)) << "a window is no lkey";
  EXPECT_FALSE(t.acquire(*region, base, 1, kRemoteWrite, &f, 7)) << "the region stays local";
  EXPECT_EQ(t.bind_window(*w1, *region, base, 64, kRemoteWrite, 7).error(), errc(EINVAL))
      << "bound windows are not bound again";
  t.revoke(*w1);
  EXPECT_FALSE(t.acquire(*w1, base + 1024, 1, kRemoteWrite, &f, 7));
  auto w2 = t.bind_window(*w1, *region, base + 1024, 1024, kRemoteWrite, 7);
  ASSERT_TRUE(w2.ok());
  EXPECT_NE(*w2, *w1);
  EXPECT_FALSE(t.acquire(*w1, base + 1024, 1, kRemoteWrite, &f, 7));
  EXPECT_TRUE(t.acquire(*w2, base + 1024, 1, kRemoteWrite, &f, 7));
  auto any = t.alloc_window();
  auto w3 = t.bind_window(*any, *region, base, 64, kRemoteWrite, 0);
  ASSERT_TRUE(w3.ok());
  EXPECT_TRUE(t.acquire(*w3, base, 64, kRemoteWrite, &f, 99)) << "owner 0 answers any connection";
}

// Case: binds over a region without kMwBind, past its end, with overflowing lengths, with
// local access, over a revoked region, and of a region slot as a window.
// Expect: EINVAL each.
TEST(MrTable, BadBindsAreRefused) {
  MrTable t;
  std::vector<std::byte> mem(4096);
  const uint64_t base = reinterpret_cast<uint64_t>(mem.data());
  auto plain = t.add(mem.data(), mem.size(), kRemoteWrite);
  auto bindable = t.add(mem.data(), mem.size(), kLocalWrite | kMwBind);
  auto no_local = t.add(mem.data(), mem.size(), kMwBind);
  auto w = t.alloc_window();
  ASSERT_TRUE(plain.ok() && bindable.ok() && no_local.ok() && w.ok());
  EXPECT_EQ(t.bind_window(*w, *plain, base, 64, kRemoteWrite, 1).error(), errc(EINVAL));
  EXPECT_EQ(t.bind_window(*w, *bindable, base + 4000, 97, kRemoteWrite, 1).error(), errc(EINVAL));
  EXPECT_EQ(t.bind_window(*w, *bindable, base + 8, UINT64_MAX - 4, kRemoteWrite, 1).error(),
            errc(EINVAL));
  EXPECT_EQ(t.bind_window(*w, *bindable, base, 0, kRemoteWrite, 1).error(), errc(EINVAL));
  EXPECT_EQ(t.bind_window(*w, *bindable, base, 64, kLocalWrite, 1).error(), errc(EINVAL));
  EXPECT_EQ(t.bind_window(*w, *no_local, base, 64, kRemoteWrite, 1).error(), errc(EINVAL))
      << "remote write needs local write on the region";
  EXPECT_TRUE(t.bind_window(*w, *no_local, base, 64, kRemoteRead, 1).ok());
  EXPECT_EQ(t.bind_window(*plain, *bindable, base, 64, kRemoteWrite, 1).error(), errc(EINVAL));
  auto w2 = t.alloc_window();
  t.revoke(*bindable);
  EXPECT_EQ(t.bind_window(*w2, *bindable, base, 64, kRemoteWrite, 1).error(), errc(EINVAL));
}

// Case: a window bound over a region; the region is then rekeyed, and (another window) removed
// and its slot reused by a new region.
// Expect: the windows die with their region's key: no access through them afterwards.
TEST(MrTable, AWindowDiesWithItsRegion) {
  MrTable t;
  std::vector<std::byte> mem(4096), other(4096);
  const uint64_t base = reinterpret_cast<uint64_t>(mem.data());
  auto region = t.add(mem.data(), mem.size(), kLocalWrite | kMwBind);
  auto w = t.alloc_window();
  auto key = t.bind_window(*w, *region, base, 4096, kRemoteWrite, 1);
  ASSERT_TRUE(key.ok());
  auto rekeyed = t.rekey(*region);
  ASSERT_TRUE(rekeyed.ok());
  EXPECT_FALSE(t.check(*key, base, 1, kRemoteWrite));
  EXPECT_FALSE(t.acquire(*key, base, 1, kRemoteWrite, nullptr, 1));
  auto w2 = t.alloc_window();
  auto key2 = t.bind_window(*w2, *rekeyed, base, 4096, kRemoteWrite, 1);
  ASSERT_TRUE(key2.ok());
  t.remove(*rekeyed);
  auto reuse = t.add(other.data(), other.size(), kLocalWrite | kMwBind);
  ASSERT_TRUE(reuse.ok());
  EXPECT_EQ(*reuse >> t.tag_bits(), *rekeyed >> t.tag_bits()) << "the slot is reused";
  EXPECT_FALSE(t.acquire(*key2, base, 1, kRemoteWrite, nullptr, 1));
}

// Case: a writer keeps acquiring a window while another thread revokes it.
// Expect: once revoke() has returned, no acquire succeeds and no Ref is still held (the
// revocation waited for the placement in flight).
TEST(MrTable, RevokeWaitsForPlacementsInFlight) {
  MrTable t;
  std::vector<std::byte> mem(1 << 16);
  const uint64_t base = reinterpret_cast<uint64_t>(mem.data());
  auto region = t.add(mem.data(), mem.size(), kLocalWrite | kMwBind);
  auto w = t.alloc_window();
  auto key = t.bind_window(*w, *region, base, mem.size(), kRemoteWrite, 3);
  ASSERT_TRUE(key.ok());
  std::atomic<bool> revoked{false};
  std::atomic<int> after{0};
  std::atomic<int> placed{0};
  std::thread writer([&] {
    for (int i = 0; i < 200000; ++i) {
      bool was = revoked.load();
      auto r = t.acquire(*key, base, 64, kRemoteWrite, nullptr, 3);
      if (r) {
        r.ptr()[0] = std::byte{1};
        placed.fetch_add(1);
        if (was) after.fetch_add(1);
      }
    }
  });
  while (placed.load() == 0) std::this_thread::yield();
  t.revoke(*key);
  revoked = true;
  writer.join();
  EXPECT_EQ(after.load(), 0);
}

// Case: a process draws key bits (filling its thread's block), forks, and parent and child each
// draw the next value.
// Expect: they differ: the child does not replay the block it inherited (fio forks its jobs).
TEST(SecureRandom, AForkedChildDrawsItsOwnBits) {
  (void)secure_random_u32();
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    uint32_t v = secure_random_u32();
    _exit(::write(fds[1], &v, sizeof(v)) == sizeof(v) ? 0 : 1);
  }
  uint32_t mine = secure_random_u32();
  uint32_t child = 0;
  ASSERT_EQ(::read(fds[0], &child, sizeof(child)), static_cast<ssize_t>(sizeof(child)));
  int status = 0;
  ::waitpid(pid, &status, 0);
  ::close(fds[0]);
  ::close(fds[1]);
  EXPECT_NE(mine, child);
}

}  // namespace
}  // namespace ibtrs::fabric
