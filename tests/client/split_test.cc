// How block requests are cut into transport requests (client/src/lib/split.h).
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "lib/split.h"

namespace ibnbd::client {
namespace {

// Segments over one fake registration (the splitter only carries the pointer along).
struct Segs {
  std::vector<std::byte> mem;
  std::vector<ibtrs::IoSeg> segs;
  explicit Segs(const std::vector<uint32_t>& lens) {
    mem.resize(std::accumulate(lens.begin(), lens.end(), size_t{0}) + 1);
    size_t off = 0;
    for (uint32_t l : lens) {
      segs.push_back(ibtrs::IoSeg{mem.data() + off, l, nullptr});
      off += l;
    }
  }
};

struct Cut {
  std::vector<std::vector<ibtrs::IoSeg>> parts;
  std::error_code err;
};

Cut cut(std::span<const ibtrs::IoSeg> segs, uint32_t max_part, uint32_t block) {
  Cut c;
  SegSplitter sp(segs, max_part, block);
  for (;;) {
    ibtrs::IoSeg out[kMaxPartSegs];
    uint8_t n = 0;
    auto len = sp.next(out, n);
    if (!len.ok()) {
      c.err = len.error();
      return c;
    }
    if (*len == 0) return c;
    c.parts.emplace_back(out, out + n);
  }
}

uint64_t bytes(const std::vector<ibtrs::IoSeg>& p) {
  uint64_t n = 0;
  for (auto& s : p) n += s.len;
  return n;
}

// Case: the limits of the wire and of the device. Expect: whole blocks, never above what a
// 32-bit bi_size says; 0 when a block does not fit.
TEST(Split, PartLimitRoundsDownToBlocksAndTheWire) {
  EXPECT_EQ(part_limit(126976, 512), 126976u);
  EXPECT_EQ(part_limit(126976, 4096), 126976u);
  EXPECT_EQ(part_limit(130000, 4096), 126976u);
  EXPECT_EQ(part_limit(1000, 4096), 0u);
  EXPECT_EQ(part_limit(uint64_t{1} << 40, 512), 0xfffffe00u);
  EXPECT_EQ(part_limit(uint64_t{1} << 40, 65536), 0xffff0000u);
  EXPECT_EQ(range_parts(1 << 20, 126976), 9u);
  EXPECT_EQ(range_parts(126976, 126976), 1u);
}

// Case: one 1 MiB segment, parts of 126976 bytes (a 128 KiB chunk). Expect: 9 parts covering
// the buffer in order, the last one the rest.
TEST(Split, OneBigSegmentBecomesConsecutiveParts) {
  Segs s({1 << 20});
  auto c = cut(s.segs, 126976, 512);
  ASSERT_FALSE(c.err);
  ASSERT_EQ(c.parts.size(), 9u);
  std::byte* expect = s.mem.data();
  for (size_t i = 0; i < c.parts.size(); ++i) {
    ASSERT_EQ(c.parts[i].size(), 1u);
    EXPECT_EQ(c.parts[i][0].addr, expect);
    EXPECT_EQ(c.parts[i][0].len, i < 8 ? 126976u : (1u << 20) - 8 * 126976u);
    expect += c.parts[i][0].len;
  }
  EXPECT_EQ(count_parts(s.segs, 126976, 512).value(), 9u);
}

// Case: 40 segments of 1536 bytes. Expect: parts of at most 15 segments, each a multiple of
// 4096 (the block), a segment split at the block boundary continues in the next part, and the
// bytes come out in order exactly once.
TEST(Split, SegmentCountLimitCutsAtABlockBoundaryInsideASegment) {
  Segs s(std::vector<uint32_t>(40, 1536));
  auto c = cut(s.segs, 1 << 20, 4096);
  ASSERT_FALSE(c.err);
  std::byte* expect = s.mem.data();
  uint64_t total = 0;
  for (auto& p : c.parts) {
    EXPECT_LE(p.size(), kMaxPartSegs);
    EXPECT_EQ(bytes(p) % 4096, 0u);
    for (auto& sg : p) {
      EXPECT_EQ(sg.addr, expect);
      expect += sg.len;
    }
    total += bytes(p);
  }
  EXPECT_EQ(total, 40u * 1536);
  EXPECT_EQ(c.parts.size(), count_parts(s.segs, 1 << 20, 4096).value());
  // 15 x 1536 = 23040 -> 20480 (5 blocks); the split segment's tail starts the next part.
  EXPECT_EQ(bytes(c.parts[0]), 20480u);
  EXPECT_EQ(c.parts[1][0].len, 1024u);
}

// Case: empty segments among the others. Expect: skipped, never handed to the transport.
TEST(Split, EmptySegmentsAreSkipped) {
  Segs s({0, 512, 0, 0, 1024, 0});
  auto c = cut(s.segs, 4096, 512);
  ASSERT_FALSE(c.err);
  ASSERT_EQ(c.parts.size(), 1u);
  ASSERT_EQ(c.parts[0].size(), 2u);
  EXPECT_EQ(bytes(c.parts[0]), 1536u);
}

// Case: 32 segments of 16 bytes (one 512-byte block in all). Expect: EINVAL, since 15 of them
// never hold a block; also for a list that ends inside a block.
TEST(Split, SegmentsThatCannotFormABlockAreRefused) {
  Segs tiny(std::vector<uint32_t>(32, 16));
  EXPECT_EQ(count_parts(tiny.segs, 1 << 20, 512).error(), errc(EINVAL));
  Segs ragged({512, 100});
  EXPECT_EQ(count_parts(ragged.segs, 1 << 20, 512).error(), errc(EINVAL));
}

// Case: segments straddling the part size. Expect: parts exactly max_part long until the rest.
TEST(Split, PartsFillUpToTheLimitAcrossSegments) {
  Segs s({3000, 5192, 8192});  // 16384 in all
  auto c = cut(s.segs, 4096, 512);
  ASSERT_FALSE(c.err);
  ASSERT_EQ(c.parts.size(), 4u);
  for (auto& p : c.parts) EXPECT_EQ(bytes(p), 4096u);
  ASSERT_EQ(c.parts[0].size(), 2u);
  EXPECT_EQ(c.parts[0][1].len, 1096u);
}

}  // namespace
}  // namespace ibnbd::client
