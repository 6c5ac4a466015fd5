#include "history.h"

#include <algorithm>
#include <cstring>

#include "base/pattern.h"
#include "crc32c.h"

namespace ibnbd::soak {
namespace {

// The header at the start of each stamped sector (little-endian host order: the checker reads
// what it wrote on the same host).
struct Header {
  uint32_t magic;
  uint32_t crc;  // CRC32C of the whole sector with this field 0
  uint64_t seed;
  uint64_t block;
  uint32_t gen;
  uint16_t index;
  uint16_t flags;
};
static_assert(sizeof(Header) == 32);

uint32_t sector_crc(const std::byte* s) {
  // The CRC field counts as zero: CRC of [0, 4), four zero bytes, then the rest.
  static constexpr std::byte kZero[4] = {};
  uint32_t c = migrate::crc32c(std::span(s, 4));
  c = migrate::crc32c(std::span(kZero, 4), c);
  return migrate::crc32c(std::span(s + 8, kSector - 8), c);
}

bool all_zero(const std::byte* s) {
  uint64_t acc = 0;
  for (uint32_t i = 0; i < kSector; i += 8) {
    uint64_t w;
    std::memcpy(&w, s + i, 8);
    acc |= w;
  }
  return acc == 0;
}

}  // namespace

void stamp_block(std::byte* buf, uint32_t block_bytes, uint64_t seed, uint64_t block, uint32_t gen) {
  for (uint32_t i = 0; i < block_bytes / kSector; ++i) {
    std::byte* s = buf + static_cast<size_t>(i) * kSector;
    Header h{kStampMagic, 0, seed, block, gen, static_cast<uint16_t>(i), 0};
    std::memcpy(s, &h, sizeof h);
    // A stamp is an on-disk format, not base::Pattern's bytes: the checker parses the header
    // (and soak-vm.sh --log-writes replays logs of earlier runs), so the body keeps the bytes it
    // always had, a splitmix64 sequence from (seed, block, gen, sector) (base/pattern.h's).
    uint64_t x = seed ^ (block * base::kGolden64) ^ (static_cast<uint64_t>(gen) << 32) ^ i;
    for (uint32_t o = sizeof h; o < kSector; o += 8) {
      const uint64_t w = base::splitmix64(x);
      std::memcpy(s + o, &w, 8);
    }
    const uint32_t crc = sector_crc(s);
    std::memcpy(s + offsetof(Header, crc), &crc, 4);
  }
}

SectorView read_sector(const std::byte* s, uint64_t seed, uint64_t block, uint32_t index) {
  Header h;
  std::memcpy(&h, s, sizeof h);
  if (h.magic != kStampMagic) {
    if (all_zero(s)) return {SectorKind::zero, 0, block};
    return {SectorKind::foreign, 0, 0};
  }
  if (sector_crc(s) != h.crc) return {SectorKind::torn, h.gen, h.block};
  if (h.seed != seed) return {SectorKind::foreign, h.gen, h.block};
  if (h.block != block || h.index != index) return {SectorKind::misplaced, h.gen, h.block};
  return {SectorKind::valid, h.gen, h.block};
}

const char* to_string(Verdict v) {
  switch (v) {
    case Verdict::ok: return "ok";
    case Verdict::torn: return "torn";
    case Verdict::corrupt: return "corrupt";
    case Verdict::lost_allowed: return "lost_allowed";
    case Verdict::suspect: return "suspect";
    case Verdict::stale: return "stale";
    case Verdict::lost: return "lost";
    case Verdict::lost_flushed: return "lost_flushed";
  }
  return "?";
}

History::History(uint64_t blocks, uint32_t block_bytes, uint32_t logical_block, uint64_t seed)
    : table_(blocks), block_bytes_(block_bytes), logical_(logical_block), seed_(seed) {
  if (logical_ < kSector || logical_ > block_bytes_) logical_ = kSector;
}

bool History::durable(const BlockState& s) const {
  return s.fua != 0 || s.ack_seq == 0 || s.ack_seq <= durable_upto_;
}

uint32_t History::begin_write(uint64_t b) { return ++table_[b].hi; }

void History::write_done(uint64_t b, uint32_t gen, bool fua, int err, uint32_t kills) {
  BlockState& s = table_[b];
  if (err != 0) {
    ++counts_.writes_failed;
    return;
  }
  ++counts_.writes_acked;
  // What survives a loss of `gen` now: the previous acknowledged gen if it was durable by now,
  // else whatever was durable before it.
  if (durable(s)) s.durable = s.acked;
  s.acked = gen;
  s.lo = gen;
  s.ack_seq = ++ack_seq_;
  s.ack_kills = kills;
  s.fua = fua ? 1 : 0;
  s.suspect = 0;
}

void History::flush_done(uint64_t cover, int err) {
  if (err != 0) return;
  ++counts_.flushes;
  durable_upto_ = std::max(durable_upto_, cover);
}

Verdict History::check_read(uint64_t b, const std::byte* data, std::string* why) {
  BlockState& s = table_[b];
  ++counts_.reads_checked;
  const uint32_t sectors = block_bytes_ / kSector;
  const uint32_t per_logical = logical_ / kSector;
  uint32_t gmin = UINT32_MAX, gmax = 0;
  auto say = [&](const std::string& what) {
    if (why != nullptr)
      *why = "block " + std::to_string(b) + ": " + what + " (lo " + std::to_string(s.lo) + " acked " +
             std::to_string(s.acked) + " hi " + std::to_string(s.hi) + " durable " +
             std::to_string(s.durable) + (durable(s) ? ", acked durable" : ", acked not durable") +
             ", kills " + std::to_string(kills_) + " at ack " + std::to_string(s.ack_kills) + ")";
  };
  uint32_t group_gen = 0;
  for (uint32_t i = 0; i < sectors; ++i) {
    const SectorView v = read_sector(data + static_cast<size_t>(i) * kSector, seed_, b, i);
    switch (v.kind) {
      case SectorKind::torn:
        ++counts_.torn;
        say("sector " + std::to_string(i) + " torn (CRC mismatch, header gen " + std::to_string(v.gen) + ")");
        return Verdict::torn;
      case SectorKind::misplaced:
        ++counts_.corrupt;
        say("sector " + std::to_string(i) + " holds block " + std::to_string(v.block) + " gen " +
            std::to_string(v.gen) + " (misplaced)");
        return Verdict::corrupt;
      case SectorKind::foreign:
        ++counts_.corrupt;
        say("sector " + std::to_string(i) + " holds no stamp of this run");
        return Verdict::corrupt;
      case SectorKind::zero:
      case SectorKind::valid:
        break;
    }
    if (i % per_logical == 0) {
      group_gen = v.gen;
    } else if (v.gen != group_gen) {
      ++counts_.torn;
      say("logical block at sector " + std::to_string(i - i % per_logical) + " mixes gens " +
          std::to_string(group_gen) + " and " + std::to_string(v.gen));
      return Verdict::torn;
    }
    gmin = std::min(gmin, v.gen);
    gmax = std::max(gmax, v.gen);
  }
  if (gmax > s.hi) {
    ++counts_.corrupt;
    say("gen " + std::to_string(gmax) + " was never written");
    return Verdict::corrupt;
  }
  if (gmin >= s.lo) {
    if (gmax > s.acked) ++counts_.landed;
    if (s.suspect) {  // an older gen before, the acknowledged one now: that read was stale
      s.suspect = 0;
      ++counts_.stale;
      say("an earlier read returned an older gen; now gens " + std::to_string(gmin) + ".." + std::to_string(gmax));
      return Verdict::stale;
    }
    return Verdict::ok;
  }
  // Older than acknowledged.
  const bool was_durable = durable(s);
  const auto follow = [&] {  // the device holds gmin..gmax now: the state follows it
    s.acked = gmin;
    s.lo = gmin;
    s.durable = std::min(s.durable, gmin);
    s.ack_seq = 0;  // what a restarted server reads back is what its store holds
    s.fua = 0;
    s.suspect = 0;
  };
  if (!was_durable && kills_ > s.ack_kills && gmin >= s.durable) {
    ++counts_.lost_allowed;
    say("gen " + std::to_string(gmin) + " after a server kill: an unflushed write lost (allowed)");
    follow();
    return Verdict::lost_allowed;
  }
  if (!s.suspect) {
    s.suspect = 1;
    say("gen " + std::to_string(gmin) + " older than acknowledged: reading again");
    return Verdict::suspect;
  }
  const bool flushed = was_durable || gmin < s.durable;
  say(std::string("gen ") + std::to_string(gmin) + " again: " +
      (flushed ? "a durable (flushed or FUA) write lost" : "an acknowledged write lost"));
  if (flushed)
    ++counts_.lost_flushed;
  else
    ++counts_.lost;
  follow();
  return flushed ? Verdict::lost_flushed : Verdict::lost;
}

}  // namespace ibnbd::soak
