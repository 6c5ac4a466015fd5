// The engine's per-request state (a slot, preallocated) and the helpers that pack a slot into an
// io_uring user_data and walk a scatter list past a short transfer. Internal; unit-tested.
#pragma once

#include <sys/uio.h>

#include <cassert>
#include <cstddef>
#include <cstdint>

#include "ibnbd/backend.h"

namespace ibnbd::backend {

// A request is a chain of stages, each at most one SQE (or one helper-thread job). Stages run in
// this order; a round submits the next stages not yet done as one linked chain.
enum Stage : uint8_t {
  kStagePreflush = 0,  // fdatasync before (PREFLUSH)
  kStageMain = 1,      // the operation itself
  kStageMain2 = 2,     // second half of write-zeroes by punch + allocate
  kStagePostSync = 3,  // fdatasync after (FUA where the operation cannot carry RWF_DSYNC)
  kStageCount = 4,
};
constexpr uint8_t stage_bit(uint8_t s) { return static_cast<uint8_t>(1u << s); }

// How a WRITE_ZEROES is carried out (see IoEngine in backend.h).
enum class ZeroWay : uint8_t {
  zero_range,   // FALLOC_FL_ZERO_RANGE: zeros, blocks stay allocated
  punch,        // FALLOC_FL_PUNCH_HOLE: zeros, blocks may be freed
  punch_alloc,  // punch, then allocate again: for filesystems without ZERO_RANGE (tmpfs)
};

// user_data of an SQE: slot | stage | generation. The generation catches a completion that
// arrives for a slot already reused (a bug, asserted in debug builds).
inline constexpr uint32_t kSlotBits = 16;  // queue depth <= 4096 fits
inline constexpr uint32_t kStageBits = 8;
static_assert(kStageCount <= (1u << kStageBits));

struct Tag {
  uint32_t slot;
  uint8_t stage;
  uint32_t gen;
};

constexpr uint64_t pack_tag(Tag t) {
  assert(t.slot < (1u << kSlotBits));
  return static_cast<uint64_t>(t.slot) | (static_cast<uint64_t>(t.stage) << kSlotBits) |
         (static_cast<uint64_t>(t.gen) << 32);
}
constexpr Tag unpack_tag(uint64_t v) {
  return {static_cast<uint32_t>(v & ((1u << kSlotBits) - 1)),
          static_cast<uint8_t>((v >> kSlotBits) & ((1u << kStageBits) - 1)),
          static_cast<uint32_t>(v >> 32)};
}

// Drops `bytes` from the front of iov[first..n): whole segments are skipped, a partial one is
// shortened in place. Returns the new first segment.
inline uint32_t advance_iov(iovec* iov, uint32_t first, uint32_t n, size_t bytes) {
  while (bytes > 0 && first < n) {
    if (bytes >= iov[first].iov_len) {
      bytes -= iov[first].iov_len;
      ++first;
    } else {
      iov[first].iov_base = static_cast<std::byte*>(iov[first].iov_base) + bytes;
      iov[first].iov_len -= bytes;
      bytes = 0;
    }
  }
  return first;
}

struct Slot {
  Backend* be = nullptr;
  IoOp op = IoOp::read;
  uint32_t flags = 0;
  uint64_t offset = 0;
  uint32_t len = 0;
  uint32_t done = 0;  // data bytes moved so far (READ/WRITE)
  iovec iov[kMaxIoSegments] = {};
  uint32_t niov = 0;
  uint32_t iov_first = 0;  // segments before it are fully moved
  IoDoneFn cb = nullptr;
  void* ctx = nullptr;
  uint32_t gen = 0;
  uint8_t planned = 0;  // stage bits this request needs
  uint8_t ok = 0;       // stage bits completed
  uint8_t round = 0;    // stage bits submitted in the current round
  uint8_t pending = 0;  // completions outstanding in the current round
  ZeroWay zero = ZeroWay::zero_range;
  bool fell_back = false;  // write-zeroes switched way once already
  bool progress = false;   // the current round moved data
  int err = 0;             // first error of the round (positive errno)
  uint8_t err_stage = 0;
  bool in_use = false;
};

}  // namespace ibnbd::backend
