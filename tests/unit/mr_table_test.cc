#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

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

}  // namespace
}  // namespace ibtrs::fabric
