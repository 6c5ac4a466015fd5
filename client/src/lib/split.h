// How a block request becomes transport requests: pure arithmetic, no state of the session, so
// it is tested on its own (tests/client/split_test.cc).
//
// A transport request carries at most ClientSession::kMaxSegments data segments and
// max_io_size bytes; the server's device takes at most max_hw_sectors per READ/WRITE (and its
// own limits for DISCARD / WRITE_ZEROES). Every part must be a whole number of logical blocks,
// since the server checks each part on its own.
#pragma once

#include <cstdint>
#include <span>

#include "ibnbd/types.h"
#include "ibtrs/client.h"

namespace ibnbd::client {

inline constexpr uint32_t kMaxPartSegs = ibtrs::ClientSession::kMaxSegments;

// The largest part for a byte limit: `limit` rounded down to whole blocks and to what the
// wire's 32-bit bi_size can say. 0 when not even one block fits.
uint32_t part_limit(uint64_t limit, uint32_t block);

// Cuts a list of data segments into parts of at most `max_part` bytes (a multiple of `block`)
// and kMaxPartSegs segments, each a whole number of blocks. A part may end inside a segment;
// the segment then continues in the next part. Segments of length 0 are skipped.
class SegSplitter {
 public:
  SegSplitter(std::span<const ibtrs::IoSeg> segs, uint32_t max_part, uint32_t block)
      : segs_(segs), max_part_(max_part), block_(block) {}

  // Writes the next part's segments to `out` (room for kMaxPartSegs) and their count to
  // `nseg`; returns the part's length, 0 after the last part. EINVAL: kMaxPartSegs segments in
  // a row hold less than one block, or the segments end in the middle of a block.
  Result<uint32_t> next(ibtrs::IoSeg* out, uint8_t& nseg);

 private:
  void unconsume(uint32_t bytes);

  std::span<const ibtrs::IoSeg> segs_;
  size_t i_ = 0;      // current segment
  uint32_t off_ = 0;  // bytes of it already in earlier parts
  uint32_t max_part_;
  uint32_t block_;
};

// How many parts SegSplitter makes of `segs` (a dry run, so that a request the splitter would
// refuse half-way is refused before anything is sent). EINVAL as SegSplitter::next.
Result<uint32_t> count_parts(std::span<const ibtrs::IoSeg> segs, uint32_t max_part, uint32_t block);

// Parts of a dataless range (DISCARD, WRITE_ZEROES, SECURE_ERASE) of `len` bytes.
inline uint64_t range_parts(uint64_t len, uint32_t max_part) { return (len + max_part - 1) / max_part; }

}  // namespace ibnbd::client
