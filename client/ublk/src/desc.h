// The pure translations between ublk and the client library, tested without the kernel: a
// request descriptor into IoOp + IoFlag (the descriptor comes from the kernel's shared mapping:
// every field is checked, nothing in it may crash the daemon), and a device's geometry into
// ublk parameters.
#pragma once

#include <cstdint>

#include "ibnbd/client.h"
#include "ibnbd/types.h"
#include "ibnbd/ublk_uapi.h"

namespace ibnbd::ublk {

struct UblkRequest {
  IoOp op = IoOp::read;
  uint32_t flags = 0;   // kIoFua (WRITE), kIoNoUnmap (WRITE_ZEROES)
  uint64_t offset = 0;  // bytes
  uint64_t len = 0;     // bytes; 0 for FLUSH
};

// Errors: EOPNOTSUPP (WRITE_SAME, zone or unknown operations), EINVAL (a READ / WRITE longer
// than `buf_bytes` -- the tag's buffer -- or of no sectors; a range that overflows 64 bits).
// Flags other than FUA and NOUNMAP (FAILFAST_*, META, SWAP) are hints and dropped; FUA is kept
// on WRITE only (the block layer sets it on nothing else), NOUNMAP on WRITE_ZEROES only.
Result<UblkRequest> decode_desc(const uapi::ublksrv_io_desc& d, uint32_t buf_bytes);

// The result to commit for a request that succeeded: bytes for READ / WRITE (the driver
// completes exactly that many; fewer would be re-queued as partial), 0 for the others.
inline int32_t success_result(const UblkRequest& r) {
  return (r.op == IoOp::read || r.op == IoOp::write) ? static_cast<int32_t>(r.len) : 0;
}

// SET_PARAMS for a remote device: sizes from its geometry, READ_ONLY for an ro mapping,
// VOLATILE_CACHE / FUA from its cache policy (the server's write-back cache and FUA support; with
// VOLATILE_CACHE the block layer sends FLUSH, which we pass on), DISCARD / WRITE_ZEROES limits
// when the server supports them and the mapping may write. The wire has no rotational bit (the
// kernel's rnbd made it obsolete), so the device is non-rotational. `max_io_bytes` (the tag's
// buffer) bounds every request. Errors: EINVAL (a logical block that is not a power of two in
// 512..4096 -- the driver takes at most PAGE_SHIFT, 4 KiB on x86-64 --, a physical block that is
// not a power of two, max_io_bytes below one logical block, a size of 0).
Result<uapi::ublk_params> make_params(const DeviceGeometry& g, bool read_only, uint32_t max_io_bytes);

}  // namespace ibnbd::ublk
