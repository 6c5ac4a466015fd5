// The soak checker's model (tools/soak/history.h) and fault schedule (soak.h), alone: what a
// read of a block is judged to be, for every class of issue 17, and that a seed fixes its plan.
#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <vector>

#include "history.h"
#include "soak.h"

namespace ibnbd::soak {
namespace {

constexpr uint32_t kBlock = 4096;
constexpr uint64_t kSeed = 0x17;

struct Buf {
  std::vector<std::byte> b = std::vector<std::byte>(kBlock);
  std::byte* data() { return b.data(); }
};

Buf stamped(uint64_t block, uint32_t gen, uint64_t seed = kSeed) {
  Buf b;
  stamp_block(b.data(), kBlock, seed, block, gen);
  return b;
}

// Writes gen of block b and acknowledges it (as the driver does).
uint32_t ack_write(History& h, uint64_t b, bool fua = false) {
  const uint32_t g = h.begin_write(b);
  h.write_done(b, g, fua, 0, h.kills());
  return g;
}

TEST(SoakStamp, EverySectorDescribesItself) {
  // Case: a stamped block, read sector by sector.
  // Expect: each sector valid with its gen; a flipped byte is torn; another block's stamp is
  // misplaced; another run's is foreign; zeros are gen 0; garbage is foreign.
  Buf b = stamped(7, 3);
  for (uint32_t i = 0; i < kBlock / kSector; ++i) {
    const SectorView v = read_sector(b.data() + i * kSector, kSeed, 7, i);
    EXPECT_EQ(v.kind, SectorKind::valid) << i;
    EXPECT_EQ(v.gen, 3u);
  }
  b.b[kSector + 100] ^= std::byte{1};
  EXPECT_EQ(read_sector(b.data() + kSector, kSeed, 7, 1).kind, SectorKind::torn);
  EXPECT_EQ(read_sector(b.data(), kSeed, 8, 0).kind, SectorKind::misplaced);
  EXPECT_EQ(read_sector(b.data() + 2 * kSector, kSeed, 7, 3).kind, SectorKind::misplaced);
  EXPECT_EQ(read_sector(b.data(), kSeed + 1, 7, 0).kind, SectorKind::foreign);
  Buf z;
  EXPECT_EQ(read_sector(z.data(), kSeed, 7, 0).kind, SectorKind::zero);
  z.b[5] = std::byte{0x42};
  EXPECT_EQ(read_sector(z.data(), kSeed, 7, 0).kind, SectorKind::foreign);
}

TEST(SoakHistory, FreshVolumeAndAcknowledgedWritesAreOk) {
  // Case: zeros before any write; the acknowledged gen after each write.
  // Expect: ok every time; no defects.
  History h(16, kBlock, 512, kSeed);
  Buf z;
  EXPECT_EQ(h.check_read(0, z.data()), Verdict::ok);
  for (int i = 0; i < 3; ++i) {
    const uint32_t g = ack_write(h, 0);
    EXPECT_EQ(h.check_read(0, stamped(0, g).data()), Verdict::ok);
  }
  EXPECT_EQ(h.counts().defects(), 0u);
  EXPECT_EQ(h.counts().reads_checked, 4u);
}

TEST(SoakHistory, OlderGenTwiceIsALostWrite) {
  // Case: gen 2 acknowledged; reads return gen 1 twice.
  // Expect: suspect first (read again), then lost; the block then follows the device (a third
  // read of gen 1 is ok, not counted again).
  History h(4, kBlock, 512, kSeed);
  ack_write(h, 1);
  ack_write(h, 1);
  std::string why;
  EXPECT_EQ(h.check_read(1, stamped(1, 1).data(), &why), Verdict::suspect);
  EXPECT_EQ(h.check_read(1, stamped(1, 1).data(), &why), Verdict::lost);
  EXPECT_NE(why.find("block 1"), std::string::npos) << why;
  EXPECT_EQ(h.check_read(1, stamped(1, 1).data()), Verdict::ok);
  EXPECT_EQ(h.counts().lost, 1u);
  EXPECT_EQ(h.counts().defects(), 1u);
}

TEST(SoakHistory, OlderGenThenNewerIsAStaleRead) {
  // Case: gen 2 acknowledged; a read returns gen 1, the next gen 2.
  // Expect: suspect, then stale (a defect: a read after an acknowledged write saw old data).
  History h(4, kBlock, 512, kSeed);
  ack_write(h, 2);
  ack_write(h, 2);
  EXPECT_EQ(h.check_read(2, stamped(2, 1).data()), Verdict::suspect);
  EXPECT_EQ(h.check_read(2, stamped(2, 2).data()), Verdict::stale);
  EXPECT_EQ(h.counts().stale, 1u);
}

TEST(SoakHistory, FailedWritesMayLandButNothingElse) {
  // Case: gen 1 acknowledged, gens 2 and 3 failed; reads of 1, 3 and half 2 / half 1; then 4.
  // Expect: all ok (3 counted as landed); gen 4 was never written: corrupt.
  History h(4, kBlock, 512, kSeed);
  ack_write(h, 0);
  for (int i = 0; i < 2; ++i) {
    const uint32_t g = h.begin_write(0);
    h.write_done(0, g, false, 5, h.kills());
  }
  EXPECT_EQ(h.check_read(0, stamped(0, 1).data()), Verdict::ok);
  EXPECT_EQ(h.check_read(0, stamped(0, 3).data()), Verdict::ok);
  Buf mixed = stamped(0, 2);
  Buf one = stamped(0, 1);
  std::memcpy(mixed.data() + kBlock / 2, one.data() + kBlock / 2, kBlock / 2);
  EXPECT_EQ(h.check_read(0, mixed.data()), Verdict::ok);  // 512-byte logical blocks: per sector
  EXPECT_EQ(h.counts().landed, 2u);
  EXPECT_EQ(h.check_read(0, stamped(0, 4).data()), Verdict::corrupt);
  EXPECT_EQ(h.counts().writes_failed, 2u);
}

TEST(SoakHistory, MixedGensInsideALogicalBlockAreTorn) {
  // Case: a 4096-byte logical block whose sectors hold two gens of a failed write.
  // Expect: torn (below the logical block), where 512-byte logical blocks would allow it.
  History h(4, kBlock, 4096, kSeed);
  ack_write(h, 0);
  const uint32_t g = h.begin_write(0);
  h.write_done(0, g, false, 5, h.kills());
  Buf mixed = stamped(0, 2);
  Buf one = stamped(0, 1);
  std::memcpy(mixed.data() + 3 * kSector, one.data() + 3 * kSector, kSector);
  EXPECT_EQ(h.check_read(0, mixed.data()), Verdict::torn);
  // And a torn sector is torn whatever the logical block.
  History h2(4, kBlock, 512, kSeed);
  Buf t = stamped(0, 1);
  ack_write(h2, 0);
  t.b[kSector * 2 + 77] ^= std::byte{0x80};
  EXPECT_EQ(h2.check_read(0, t.data()), Verdict::torn);
}

TEST(SoakHistory, UnflushedWriteMayBeLostAfterAServerKill) {
  // Case: gen 1 acknowledged and flushed, gen 2 acknowledged without a flush, the server
  // killed; a read returns gen 1.
  // Expect: lost_allowed (the flush/FUA contract), counted once; not a defect.
  History h(4, kBlock, 512, kSeed);
  ack_write(h, 3);
  const uint64_t cover = h.flush_begin();
  h.flush_done(cover, 0);
  ack_write(h, 3);
  h.set_kills(1);
  EXPECT_EQ(h.check_read(3, stamped(3, 1).data()), Verdict::lost_allowed);
  EXPECT_EQ(h.check_read(3, stamped(3, 1).data()), Verdict::ok);
  EXPECT_EQ(h.counts().lost_allowed, 1u);
  EXPECT_EQ(h.counts().defects(), 0u);
}

TEST(SoakHistory, FlushedOrFuaWriteLostAfterAKillIsADefect) {
  // Case: (a) gen 2 acknowledged then a flush submitted after it completes; (b) gen 2 a FUA
  // write; the server killed; reads return gen 1 twice.
  // Expect: lost_flushed in both.
  for (bool fua : {false, true}) {
    History h(4, kBlock, 512, kSeed);
    ack_write(h, 0);
    ack_write(h, 0, fua);
    if (!fua) h.flush_done(h.flush_begin(), 0);
    h.set_kills(1);
    EXPECT_EQ(h.check_read(0, stamped(0, 1).data()), Verdict::suspect) << fua;
    EXPECT_EQ(h.check_read(0, stamped(0, 1).data()), Verdict::lost_flushed) << fua;
  }
}

TEST(SoakHistory, AFlushCoversOnlyWritesCompletedBeforeItWasSent) {
  // Case: a flush submitted, then gen 1 acknowledged, then the flush completes; server killed;
  // zeros read back.
  // Expect: gen 1 was not covered: losing it is within contract.
  History h(4, kBlock, 512, kSeed);
  const uint64_t cover = h.flush_begin();
  ack_write(h, 0);
  h.flush_done(cover, 0);
  h.set_kills(1);
  Buf z;
  EXPECT_EQ(h.check_read(0, z.data()), Verdict::lost_allowed);
}

TEST(SoakHistory, NoKillSinceTheAckMeansNoLossAllowed) {
  // Case: the server killed, then gen 1 acknowledged (by the restarted server), zeros read.
  // Expect: suspect, then lost: that write was acknowledged after the kill.
  History h(4, kBlock, 512, kSeed);
  h.set_kills(1);
  ack_write(h, 0);
  Buf z;
  EXPECT_EQ(h.check_read(0, z.data()), Verdict::suspect);
  EXPECT_EQ(h.check_read(0, z.data()), Verdict::lost);
}

TEST(SoakHistory, LossBelowTheLastDurableGenIsADefect) {
  // Case: gen 1 FUA, gen 2 unflushed, server killed, zeros read (older than gen 1).
  // Expect: lost_flushed: what was durable is gone too.
  History h(4, kBlock, 512, kSeed);
  ack_write(h, 0, true);
  ack_write(h, 0);
  h.set_kills(1);
  Buf z;
  EXPECT_EQ(h.check_read(0, z.data()), Verdict::suspect);
  EXPECT_EQ(h.check_read(0, z.data()), Verdict::lost_flushed);
}

TEST(SoakSchedule, TheSeedFixesThePlanAndEveryKindComesFirstOnce) {
  // Case: two plans of one seed, one of another, over every kind.
  // Expect: the same plan for the same seed; the first N faults are N distinct kinds; every
  // fault ends before duration - tail; another seed gives another plan.
  ScheduleConfig c;
  c.seed = 42;
  c.duration_ms = 10 * 60 * 1000;
  c.kinds.assign(std::begin(kAllFaults), std::end(kAllFaults));
  c.eio_first = 0;
  c.eio_last = 1000;
  const auto a = make_schedule(c), b = make_schedule(c);
  ASSERT_EQ(a.size(), b.size());
  ASSERT_GE(a.size(), kFaultKinds);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(describe(a[i]), describe(b[i]));
  std::set<FaultKind> first;
  for (size_t i = 0; i < kFaultKinds; ++i) first.insert(a[i].kind);
  EXPECT_EQ(first.size(), kFaultKinds);
  for (const auto& p : a) {
    EXPECT_LE(p.at_ms + p.dur_ms, c.duration_ms - c.tail_ms) << describe(p);
    EXPECT_GE(p.at_ms, c.warmup_ms);
    if (p.kind == FaultKind::server_stop) {
      EXPECT_GT(p.dur_ms, c.hb_timeout_ms);
    }
    if (p.kind == FaultKind::eio) {
      EXPECT_LE(p.eio_block + p.eio_blocks, c.eio_last);
      EXPECT_GT(p.eio_blocks, 0u);
    }
    if (p.kind == FaultKind::netem) {  // a path, and parameters tc takes as they are
      EXPECT_TRUE(p.arg == "A" || p.arg == "B") << describe(p);
      EXPECT_TRUE(p.netem.starts_with("delay ") && p.netem.find(" loss ") != std::string::npos &&
                  p.netem.find(" duplicate ") != std::string::npos && p.netem.ends_with("%"))
          << p.netem;
      EXPECT_EQ(p.netem.find("  "), std::string::npos);
    } else {
      EXPECT_TRUE(p.netem.empty());
    }
  }
  c.seed = 43;
  const auto d = make_schedule(c);
  bool differ = d.size() != a.size();
  for (size_t i = 0; !differ && i < a.size(); ++i) differ = describe(a[i]) != describe(d[i]);
  EXPECT_TRUE(differ);
  // Parsing round trips.
  for (FaultKind k : kAllFaults) EXPECT_EQ(parse_fault(to_string(k)), k);
  EXPECT_FALSE(parse_fault("power-cut").has_value());
}

}  // namespace
}  // namespace ibnbd::soak
