#include "lib/split.h"

#include <algorithm>

namespace ibnbd::client {

uint32_t part_limit(uint64_t limit, uint32_t block) {
  // bi_size is le32 and a multiple of 512: 0xfffffe00 is the largest it can say.
  constexpr uint64_t kWireMax = UINT32_MAX & ~uint64_t{kSectorSize - 1};
  if (block == 0) return 0;
  const uint64_t l = std::min(limit, kWireMax);
  return static_cast<uint32_t>(l - l % block);
}

void SegSplitter::unconsume(uint32_t bytes) {
  while (bytes > 0) {
    if (off_ == 0) {
      do {
        --i_;
      } while (segs_[i_].len == 0);
      off_ = segs_[i_].len;
    }
    const uint32_t d = std::min(bytes, off_);
    off_ -= d;
    bytes -= d;
  }
}

Result<uint32_t> SegSplitter::next(ibtrs::IoSeg* out, uint8_t& nseg) {
  nseg = 0;
  uint32_t len = 0;
  while (i_ < segs_.size() && len < max_part_ && nseg < kMaxPartSegs) {
    const ibtrs::IoSeg& s = segs_[i_];
    const uint32_t take = std::min(s.len - off_, max_part_ - len);
    if (take > 0) {
      out[nseg++] = ibtrs::IoSeg{static_cast<std::byte*>(s.addr) + off_, take, s.mem};
      len += take;
      off_ += take;
    }
    if (off_ == s.len) {
      ++i_;
      off_ = 0;
    }
  }
  // Ran out of segments (or reached max_part, a multiple of the block) with a partial block in
  // hand: give it back to the next part, which starts at a block boundary then.
  uint32_t rem = len % block_;
  if (rem == 0) return len;
  if (i_ == segs_.size()) return errc(EINVAL);  // the request ends inside a block
  unconsume(rem);
  len -= rem;
  while (rem > 0) {
    ibtrs::IoSeg& last = out[nseg - 1];
    if (last.len <= rem) {
      rem -= last.len;
      --nseg;
    } else {
      last.len -= rem;
      rem = 0;
    }
  }
  if (len == 0) return errc(EINVAL);
  return len;
}

Result<uint32_t> count_parts(std::span<const ibtrs::IoSeg> segs, uint32_t max_part, uint32_t block) {
  SegSplitter sp(segs, max_part, block);
  ibtrs::IoSeg tmp[kMaxPartSegs];
  uint32_t n = 0;
  for (;;) {
    uint8_t nseg = 0;
    BASE_ASSIGN_OR_RETURN(uint32_t len, sp.next(tmp, nseg));
    if (len == 0) return n;
    ++n;
  }
}

}  // namespace ibnbd::client
