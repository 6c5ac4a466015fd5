// The soak checker's model of a volume (issue 17): what every block may hold, and the verdict on
// what a read returned. Pure (no IO, no threads): the checker's driver thread owns one History,
// and tests/soak/history_test.cc drives it alone.
//
// Stamps. Every 512-byte sector of every block the checker writes carries a self-describing
// header (magic, CRC32C of the sector, the writer's seed, the block number, the block's write
// generation, the sector's index) followed by bytes derived from the header, so that a read is
// classified from its data and this table alone. 512 bytes is the smallest logical block a
// device can have: a sector whose CRC does not match is a write torn below the logical block,
// which no device may produce, whatever happened to the write.
//
// The table. One fixed-size entry per block (BlockState, 32 bytes: memory is blocks x 32 and
// does not grow with the run's length), written only by the driver thread:
//   - gens: a block's writes are numbered 1, 2, ... (0: the volume's initial zeros). The driver
//     keeps one request per block in flight at a time, so gens reach the device in order.
//   - lo: the lowest gen a read may return (the last acknowledged write's), hi: the highest gen
//     ever submitted. Gens in (lo, hi] come from writes that failed (or whose fate is unknown):
//     they may have landed, wholly or per logical block.
//   - durability: a FUA write is durable when acknowledged; another write once a FLUSH that was
//     submitted after its acknowledgement completes (a global acknowledgement sequence against
//     the highest sequence a completed flush covers: no walk over the table per flush).
//
// Verdicts on a read of a block (no request on the block in flight):
//   ok        every sector holds a gen in [lo, hi], one gen per logical block
//   torn      a sector's CRC does not match (a write torn below 512 bytes), or the sectors of
//             one logical block hold different gens (torn below the logical block)
//   corrupt   a valid stamp of another block, sector or run (misplaced or foreign data), bytes
//             that are no stamp, or a gen above hi (data nobody wrote)
//   lost_allowed  an older gen than the last acknowledged one, where the flush/FUA contract
//             allows it: that write was not durable and a server was killed since it was
//             acknowledged, and what is there is at least the last durable gen. Counted once,
//             then the block's state follows what the device holds.
//   suspect   an older gen than acknowledged where the contract does not allow it: the caller
//             reads the block again; if the newer gen is there then, the first read was stale
//             (counted as `stale`), else the write was lost (`lost`, or `lost_flushed` when it was
//             durable or older than the last durable gen) and the state follows the device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace ibnbd::soak {

inline constexpr uint32_t kSector = 512;
inline constexpr uint32_t kStampMagic = 0x314b5349;  // "ISK1" little-endian

// Fills `block_bytes` (a multiple of kSector) at `buf` with the stamps of (seed, block, gen).
void stamp_block(std::byte* buf, uint32_t block_bytes, uint64_t seed, uint64_t block, uint32_t gen);

enum class SectorKind : uint8_t {
  zero,       // all zeros: gen 0 (never written; a sparse or fresh volume)
  valid,      // a stamp of this run, block and sector
  torn,       // the header's magic, but the CRC does not match
  misplaced,  // a valid stamp of this run for another block or sector
  foreign,    // a valid stamp of another run (seed), or not a stamp at all
};
struct SectorView {
  SectorKind kind = SectorKind::zero;
  uint32_t gen = 0;
  uint64_t block = 0;  // what the stamp says (misplaced)
};
SectorView read_sector(const std::byte* s, uint64_t seed, uint64_t block, uint32_t index);

struct BlockState {
  uint32_t lo = 0;
  uint32_t acked = 0;    // gen of the last acknowledged write (0: none)
  uint32_t hi = 0;       // highest gen submitted
  uint32_t durable = 0;  // the last gen known durable before `acked`
  uint64_t ack_seq = 0;  // acknowledgement sequence of `acked` (0: durable by construction)
  uint32_t ack_kills = 0;  // server kills completed before `acked` was acknowledged
  uint8_t fua = 0;
  uint8_t suspect = 0;  // a read saw an older gen; the next read decides stale or lost
  uint16_t spare = 0;
};
static_assert(sizeof(BlockState) == 32);

enum class Verdict : uint8_t { ok, torn, corrupt, lost_allowed, suspect, stale, lost, lost_flushed };
const char* to_string(Verdict v);

struct Counts {
  uint64_t reads_checked = 0;  // block reads classified
  uint64_t landed = 0;         // ok reads that found a failed write's data
  uint64_t lost_allowed = 0;
  uint64_t stale = 0;
  uint64_t lost = 0;
  uint64_t lost_flushed = 0;
  uint64_t torn = 0;
  uint64_t corrupt = 0;
  uint64_t writes_acked = 0;
  uint64_t writes_failed = 0;
  uint64_t flushes = 0;
  // A run is clean when none of these happened (lost_allowed and landed are within contract).
  uint64_t defects() const { return stale + lost + lost_flushed + torn + corrupt; }
};

class History {
 public:
  // `blocks` blocks of `block_bytes` (a multiple of kSector); `logical_block`: the device's
  // logical block size (a power of two from kSector to block_bytes).
  History(uint64_t blocks, uint32_t block_bytes, uint32_t logical_block, uint64_t seed);

  uint64_t blocks() const { return table_.size(); }
  uint32_t block_bytes() const { return block_bytes_; }
  uint64_t seed() const { return seed_; }
  const BlockState& state(uint64_t b) const { return table_[b]; }

  // A write of block b is about to be submitted: its gen (hi + 1); stamp the buffer with it.
  uint32_t begin_write(uint64_t b);
  // Its completion (err 0: acknowledged). A failed write's gen stays possible. `kills`: the
  // server kills completed when the acknowledgement arrived (set_kills' count then).
  void write_done(uint64_t b, uint32_t gen, bool fua, int err, uint32_t kills);
  // A FLUSH is being submitted: what it covers (pass it back to flush_done).
  uint64_t flush_begin() const { return ack_seq_; }
  void flush_done(uint64_t cover, int err);
  // The server kills completed so far (a killed server's process is gone): writes acknowledged
  // before a kill that were not durable may be lost.
  void set_kills(uint32_t n) { kills_ = n; }
  uint32_t kills() const { return kills_; }

  // Classifies what a read of block b returned (block_bytes at `data`). `why` (optional)
  // receives one line for the defect log when the verdict is not ok.
  Verdict check_read(uint64_t b, const std::byte* data, std::string* why = nullptr);

  bool durable(const BlockState& s) const;
  const Counts& counts() const { return counts_; }

 private:
  std::vector<BlockState> table_;
  uint32_t block_bytes_;
  uint32_t logical_;
  uint64_t seed_;
  uint64_t ack_seq_ = 0;        // last acknowledgement sequence handed out
  uint64_t durable_upto_ = 0;   // every ack_seq <= this is durable (a completed flush)
  uint32_t kills_ = 0;
  Counts counts_;
};

}  // namespace ibnbd::soak
