// The save side's copy of guest RAM for QEMU's RDMA source (client/migrate/src/qemu_rdma_ram.h),
// without RDMA: a fake registrar stands in for ibv_reg_mr, and the tests write into the
// registered memory as the source's RDMA WRITEs would.
#include "qemu_rdma_ram.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <tuple>

namespace {

using namespace ibnbd::migrate;
using namespace ibnbd::migrate::qrdma;
using ibtrs::Status;

constexpr uint64_t MiB = 1ull << 20;
constexpr uint32_t kPage = 4096;

struct FakeRegistrar final : Registrar {
  struct Reg final : Registration {
    FakeRegistrar* owner;
    uint32_t key;
    Reg(FakeRegistrar* o, uint32_t k) : owner(o), key(k) {}
    ~Reg() override { owner->live.erase(key); }
    uint32_t rkey() const override { return key; }
  };
  uint32_t next = 100;
  std::map<uint32_t, std::pair<std::byte*, size_t>> live;  // rkey -> registered range
  Result<std::unique_ptr<Registration>> register_memory(std::byte* addr, size_t len, std::string*) override {
    live[next] = {addr, len};
    return std::unique_ptr<Registration>(new Reg(this, next++));
  }
  // What a remote RDMA WRITE through `rkey` would do (the device checks the range).
  bool write(uint32_t rkey, uint64_t addr, const void* src, size_t n) {
    auto it = live.find(rkey);
    if (it == live.end()) return false;
    auto* at = reinterpret_cast<std::byte*>(addr);
    if (at < it->second.first || at + n > it->second.first + it->second.second) return false;
    std::memcpy(at, src, n);
    return true;
  }
};

struct Rec {
  uint32_t block;
  uint64_t offset;
  bool zero;
  uint8_t fill;
  std::vector<std::byte> data;
};

struct Pages final : qstream::PageWriter {
  std::vector<Rec> recs;
  Status data(uint32_t block, uint64_t offset, std::span<const std::byte> page) override {
    recs.push_back({block, offset, false, 0, {page.begin(), page.end()}});
    return {};
  }
  Status zero(uint32_t block, uint64_t offset, uint8_t fill) override {
    recs.push_back({block, offset, true, fill, {}});
    return {};
  }
};

RamLayout layout() {
  return *RamLayout::packed({{"pc.ram", 0, 4 * MiB}, {"/rom@etc/acpi/tables", 0, 128 * 1024}});
}

std::vector<std::byte> pattern(uint8_t seed, size_t n = kPage) {
  std::vector<std::byte> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<std::byte>(seed + i * 13);
  return b;
}

RegisterRequest reg(uint32_t block, uint64_t chunk, uint64_t more = 0, uint64_t length = 4 * MiB) {
  RegisterRequest r;
  r.block = block;
  r.offset = chunk * MiB;
  r.chunks = more;
  r.first_chunk = chunk;
  r.begin = chunk * MiB;
  r.end = std::min((chunk + more + 1) * MiB, length);
  return r;
}

TEST(QemuRdmaRam, PageHashSeesEveryByte) {
  // Case: a page, and the same page with one bit flipped at each of 64 positions.
  // Expect: the hash differs every time; equal content, equal hash; zero detection.
  auto p = pattern(3);
  bool zero = true;
  const uint64_t h = page_hash(p.data(), p.size(), &zero);
  EXPECT_FALSE(zero);
  EXPECT_EQ(h, page_hash(pattern(3).data(), kPage, nullptr));
  for (size_t at = 0; at < kPage; at += 64) {
    auto q = p;
    q[at + (at / 64) % 64] ^= std::byte{0x01};
    EXPECT_NE(page_hash(q.data(), q.size(), nullptr), h) << at;
  }
  std::vector<std::byte> z(kPage);
  page_hash(z.data(), z.size(), &zero);
  EXPECT_TRUE(zero);
}

TEST(QemuRdmaRam, ChunksSitAtTheBlockBaseAsQemuAddressesThem) {
  // Case: chunk 3 registered, then chunk 0, of a 4 MiB block.
  // Expect: one host address per block; each registration covers exactly base + k MiB, 1 MiB;
  // a write through chunk 0's key into chunk 1 is outside it.
  FakeRegistrar fr;
  RamMirror m(fr, 64 * MiB);
  ASSERT_TRUE(m.init(layout(), kPage, nullptr).ok());
  auto k3 = m.register_chunks(reg(0, 3), nullptr);
  auto k0 = m.register_chunks(reg(0, 0), nullptr);
  ASSERT_TRUE(k3.ok() && k0.ok());
  const uint64_t base = m.host_addr(0);
  EXPECT_EQ(reinterpret_cast<uint64_t>(fr.live[*k3].first), base + 3 * MiB);
  EXPECT_EQ(fr.live[*k3].second, MiB);
  EXPECT_EQ(reinterpret_cast<uint64_t>(fr.live[*k0].first), base);
  auto p = pattern(1);
  EXPECT_TRUE(fr.write(*k0, base + 8192, p.data(), p.size()));
  EXPECT_FALSE(fr.write(*k0, base + MiB, p.data(), p.size()));
  EXPECT_EQ(m.pinned_bytes(), 2 * MiB);
}

TEST(QemuRdmaRam, ReportsWhatChangedByContent) {
  // Case: a chunk registered and written (two pages), reported; reported again unchanged; then
  // one page rewritten without any message (QEMU's cached rkey).
  // Expect: the first report has all 256 pages (written ones as data, the rest as ZERO), the
  // second none, the third exactly the rewritten page.
  FakeRegistrar fr;
  RamMirror m(fr, 64 * MiB);
  ASSERT_TRUE(m.init(layout(), kPage, nullptr).ok());
  auto k = m.register_chunks(reg(0, 1), nullptr);
  ASSERT_TRUE(k.ok());
  const uint64_t base = m.host_addr(0);
  auto a = pattern(1), b = pattern(2), c = pattern(3);
  ASSERT_TRUE(fr.write(*k, base + MiB, a.data(), kPage));
  ASSERT_TRUE(fr.write(*k, base + MiB + 5 * kPage, b.data(), kPage));
  Pages r1;
  ASSERT_TRUE(m.report(r1).ok());
  ASSERT_EQ(r1.recs.size(), 256u);
  EXPECT_EQ(r1.recs[0].offset, MiB);
  EXPECT_EQ(r1.recs[0].data, a);
  EXPECT_EQ(r1.recs[5].data, b);
  EXPECT_TRUE(r1.recs[1].zero);
  Pages r2;
  ASSERT_TRUE(m.report(r2).ok());
  EXPECT_TRUE(r2.recs.empty());
  ASSERT_TRUE(fr.write(*k, base + MiB + 5 * kPage, c.data(), kPage));
  Pages r3;
  ASSERT_TRUE(m.report(r3).ok());
  ASSERT_EQ(r3.recs.size(), 1u);
  EXPECT_EQ(r3.recs[0].offset, MiB + 5 * kPage);
  EXPECT_EQ(r3.recs[0].data, c);
}

TEST(QemuRdmaRam, CompressOfAnUnregisteredChunkCostsNoMemory) {
  // Case: COMPRESS (fill 0, whole pages) of an unregistered chunk; COMPRESS with fill 0x5a of
  // another; COMPRESS of part of a registered chunk.
  // Expect: the first reported at once as ZERO records, nothing pinned; the second maps its
  // chunk and is reported as data of 0x5a; the third changes the memory, found by report().
  FakeRegistrar fr;
  RamMirror m(fr, 64 * MiB);
  ASSERT_TRUE(m.init(layout(), kPage, nullptr).ok());
  Pages now;
  ASSERT_TRUE(m.compress({0, 0, 2 * MiB, 2 * MiB, 3 * kPage}, now, nullptr).ok());
  ASSERT_EQ(now.recs.size(), 3u);
  EXPECT_TRUE(now.recs[2].zero);
  EXPECT_EQ(now.recs[2].offset, 2 * MiB + 2 * kPage);
  EXPECT_EQ(m.pinned_bytes(), 0u);
  ASSERT_TRUE(m.compress({0x5a, 0, 0, 0, kPage}, now, nullptr).ok());
  EXPECT_EQ(now.recs.size(), 3u);
  EXPECT_EQ(m.pinned_bytes(), MiB);
  auto k = m.register_chunks(reg(0, 3), nullptr);
  ASSERT_TRUE(k.ok());
  const uint64_t base = m.host_addr(0);
  auto a = pattern(7);
  ASSERT_TRUE(fr.write(*k, base + 3 * MiB, a.data(), kPage));
  Pages r1;
  ASSERT_TRUE(m.report(r1).ok());
  ASSERT_EQ(r1.recs.size(), 512u);  // chunks 0 and 3
  EXPECT_EQ(r1.recs[0].data, std::vector<std::byte>(kPage, std::byte{0x5a}));
  ASSERT_TRUE(m.compress({0, 0, 3 * MiB, 3 * MiB, kPage}, now, nullptr).ok());
  Pages r2;
  ASSERT_TRUE(m.report(r2).ok());
  ASSERT_EQ(r2.recs.size(), 1u);
  EXPECT_TRUE(r2.recs[0].zero);
  EXPECT_EQ(r2.recs[0].offset, 3 * MiB);
}

TEST(QemuRdmaRam, PinLimitBoundsRegistration) {
  // Case: a 2 MiB pin limit: chunks 0 and 1, chunk 0 again, then chunk 2; pin-all of the 4.125
  // MiB layout. Expect: the first three fine (the repeat reuses its key), chunk 2 and pin-all
  // ENOMEM naming the limit; nothing more registered.
  FakeRegistrar fr;
  RamMirror m(fr, 2 * MiB);
  ASSERT_TRUE(m.init(layout(), kPage, nullptr).ok());
  auto a = m.register_chunks(reg(0, 0), nullptr);
  ASSERT_TRUE(a.ok() && m.register_chunks(reg(0, 1), nullptr).ok());
  auto again = m.register_chunks(reg(0, 0), nullptr);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *a);
  EXPECT_EQ(m.registrations(), 2u);
  std::string why;
  auto c = m.register_chunks(reg(0, 2), &why);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().value(), ENOMEM);
  EXPECT_NE(why.find("pin-max"), std::string::npos) << why;
  auto all = m.pin_all(&why);
  ASSERT_FALSE(all.ok());
  EXPECT_NE(why.find("pin-all needs 5 MiB"), std::string::npos) << why;
  EXPECT_EQ(fr.live.size(), 2u);
}

TEST(QemuRdmaRam, PinAllRegistersEveryBlockOnce) {
  // Case: pin-all, twice, then a REGISTER REQUEST. Expect: one key per block, the same keys the
  // second time, the block's key for the REGISTER; a report of all pages once.
  FakeRegistrar fr;
  RamMirror m(fr, 64 * MiB);
  ASSERT_TRUE(m.init(layout(), kPage, nullptr).ok());
  auto k = m.pin_all(nullptr);
  ASSERT_TRUE(k.ok());
  ASSERT_EQ(k->size(), 2u);
  EXPECT_EQ(fr.live[(*k)[0]].second, 4 * MiB);
  EXPECT_EQ(fr.live[(*k)[1]].second, 128 * 1024u);
  auto k2 = m.pin_all(nullptr);
  ASSERT_TRUE(k2.ok());
  EXPECT_EQ(*k2, *k);
  auto r = m.register_chunks(reg(0, 2), nullptr);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, (*k)[0]);
  Pages p;
  ASSERT_TRUE(m.report(p).ok());
  EXPECT_EQ(p.recs.size(), (4 * MiB + 128 * 1024) / kPage);
  EXPECT_EQ(fr.live.size(), 2u);
}

TEST(QemuRdmaRam, WiderRegistrationsAndUnregister) {
  // Case: REGISTER of chunks 0..2 in one entry, then of chunk 0 alone; UNREGISTER of chunk 0;
  // REGISTER of chunk 0 again. Expect: one 3 MiB registration reused by the second request;
  // after the unregister the memory keeps its content and a new key comes.
  FakeRegistrar fr;
  RamMirror m(fr, 64 * MiB);
  ASSERT_TRUE(m.init(layout(), kPage, nullptr).ok());
  auto wide = m.register_chunks(reg(0, 0, 2), nullptr);
  ASSERT_TRUE(wide.ok());
  EXPECT_EQ(fr.live[*wide].second, 3 * MiB);
  auto one = m.register_chunks(reg(0, 0), nullptr);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(*one, *wide);
  auto a = pattern(9);
  ASSERT_TRUE(fr.write(*wide, m.host_addr(0) + 2 * MiB, a.data(), kPage));
  ASSERT_TRUE(m.unregister_chunk({0, 0}, nullptr).ok());
  EXPECT_TRUE(fr.live.empty());
  EXPECT_EQ(m.unregister_chunk({0, 0}, nullptr).error().value(), ENOENT);
  Pages p;
  ASSERT_TRUE(m.report(p).ok());
  EXPECT_EQ(p.recs.size(), 3 * 256u);
  EXPECT_EQ(p.recs[512].data, a);
  auto again = m.register_chunks(reg(0, 0), nullptr);
  ASSERT_TRUE(again.ok());
  EXPECT_NE(*again, *wide);
}

TEST(QemuRdmaRam, RefusesWhatCannotBeMirrored) {
  // Case: a block whose length is not a multiple of the page size; calls before init.
  // Expect: EINVAL naming the block; EPROTO.
  FakeRegistrar fr;
  RamMirror m(fr, 64 * MiB);
  Pages p;
  EXPECT_EQ(m.register_chunks(reg(0, 0), nullptr).error().value(), EPROTO);
  EXPECT_EQ(m.compress({0, 0, 0, 0, kPage}, p, nullptr).error().value(), EPROTO);
  EXPECT_EQ(m.pin_all(nullptr).error().value(), EPROTO);
  std::string why;
  auto odd = *RamLayout::packed({{"odd", 0, MiB + 512}});
  EXPECT_EQ(m.init(odd, kPage, &why).error().value(), EINVAL);
  EXPECT_NE(why.find("odd"), std::string::npos) << why;
}

}  // namespace
