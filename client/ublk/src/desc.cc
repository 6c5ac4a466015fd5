#include "desc.h"

#include <cerrno>
#include <algorithm>
#include <limits>

namespace ibnbd::ublk {

Result<UblkRequest> decode_desc(const uapi::ublksrv_io_desc& d, uint32_t buf_bytes) {
  const uint8_t op = static_cast<uint8_t>(d.op_flags & 0xff);
  const uint32_t flags = d.op_flags & ~0xffu;
  UblkRequest r;
  switch (op) {
    case uapi::kIoOpRead: r.op = IoOp::read; break;
    case uapi::kIoOpWrite:
      r.op = IoOp::write;
      if (flags & uapi::kIoFFua) r.flags |= kIoFua;
      break;
    case uapi::kIoOpFlush: r.op = IoOp::flush; return r;  // no range
    case uapi::kIoOpDiscard: r.op = IoOp::discard; break;
    case uapi::kIoOpWriteZeroes:
      r.op = IoOp::write_zeroes;
      if (flags & uapi::kIoFNoUnmap) r.flags |= kIoNoUnmap;
      break;
    default: return errc(EOPNOTSUPP);  // WRITE_SAME (never sent since 5.18), zones, unknown
  }
  constexpr uint64_t kMaxSector = std::numeric_limits<uint64_t>::max() / kSectorSize;
  if (d.nr_sectors == 0 || d.start_sector > kMaxSector - d.nr_sectors) return errc(EINVAL);
  r.offset = d.start_sector * kSectorSize;
  r.len = uint64_t{d.nr_sectors} * kSectorSize;
  if ((r.op == IoOp::read || r.op == IoOp::write) && r.len > buf_bytes) return errc(EINVAL);
  return r;
}

namespace {

// log2 of a power of two in [lo, hi], or -1.
int shift_of(uint32_t v, uint32_t lo, uint32_t hi) {
  if (v < lo || v > hi || (v & (v - 1)) != 0) return -1;
  int s = 0;
  while ((1u << s) != v) ++s;
  return s;
}

}  // namespace

Result<uapi::ublk_params> make_params(const DeviceGeometry& g, bool read_only, uint32_t max_io_bytes) {
  const int lbs = shift_of(g.logical_block_size, 512, 4096);
  if (lbs < 0 || g.nsectors == 0 || max_io_bytes < g.logical_block_size) return errc(EINVAL);
  // A physical block below the logical one (a server that says 0) is the logical one.
  int pbs = lbs;
  if (g.physical_block_size > g.logical_block_size) {
    pbs = shift_of(g.physical_block_size, g.logical_block_size, 1u << 30);
    if (pbs < 0) return errc(EINVAL);
  }
  uapi::ublk_params p{};
  p.len = sizeof(p);
  p.types = uapi::kParamTypeBasic;
  auto& b = p.basic;
  if (read_only) b.attrs |= uapi::kAttrReadOnly;
  if (g.cache_policy & kCacheWriteBack) b.attrs |= uapi::kAttrVolatileCache;
  if (g.cache_policy & kCacheFua) b.attrs |= uapi::kAttrFua;
  b.logical_bs_shift = static_cast<uint8_t>(lbs);
  b.physical_bs_shift = static_cast<uint8_t>(pbs);
  b.io_min_shift = static_cast<uint8_t>(pbs);
  b.io_opt_shift = static_cast<uint8_t>(pbs);
  b.max_sectors = max_io_bytes / kSectorSize;
  b.dev_sectors = g.nsectors;
  if (!read_only && (g.max_discard_sectors != 0 || g.max_write_zeroes_sectors != 0)) {
    p.types |= uapi::kParamTypeDiscard;
    auto& d = p.discard;
    // The driver refuses a zero granularity, and takes one discard range per request.
    d.discard_granularity = std::max(g.discard_granularity, g.logical_block_size);
    d.discard_alignment = g.discard_alignment;
    d.max_discard_sectors = g.max_discard_sectors;
    d.max_write_zeroes_sectors = g.max_write_zeroes_sectors;
    d.max_discard_segments = 1;
  }
  return p;
}

}  // namespace ibnbd::ublk
