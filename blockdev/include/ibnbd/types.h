// Vocabulary of the IBNBD block protocol shared by the wire codec (blockdev/src/proto), the
// storage backends (blockdev/src/backend), the server daemon and the client library. Values of
// the enums are the kernel's (drivers/block/rnbd/rnbd-proto.h) so the wire stays comparable.
#pragma once

#include <compare>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "base/result.h"

namespace ibnbd {

using base::errc;
using base::Result;
using base::Status;

// Who may hold a device open at once (kernel: RNBD_ACCESS_*). ro: any number of readers; rw: only
// while no other writer holds it; migration: while fewer than two writers hold it (the source and
// the destination hypervisor during a live migration).
enum class AccessMode : uint8_t { ro = 0, rw = 1, migration = 2 };
std::optional<AccessMode> parse_access_mode(std::string_view s);  // "ro" | "rw" | "migration"
std::string_view to_string(AccessMode m);

// Operation of an IO (low 8 bits of the wire `rw`, kernel RNBD_OP_*; block_status is ours,
// protocol 5: the kernel's rnbd has no such op).
enum class IoOp : uint8_t {
  read = 0,
  write = 1,
  flush = 2,
  discard = 3,
  secure_erase = 4,
  write_zeroes = 5,
  block_status = 6,  // which parts of a range hold data (NVMe Get LBA Status, NBD BLOCK_STATUS)
};
std::string_view to_string(IoOp op);

// Flags of an IO (bits 8.. of the wire `rw`, kernel RNBD_F_*).
enum IoFlag : uint32_t {
  kIoSync = 1u << 8,
  kIoFua = 1u << 9,
  kIoPreflush = 1u << 10,
  kIoNoUnmap = 1u << 11,  // write-zeroes must allocate (no hole)
};
inline constexpr uint32_t kIoFlagsMask = kIoSync | kIoFua | kIoPreflush | kIoNoUnmap;

// Cache policy bits of an opened device (kernel RNBD_FUA / RNBD_WRITEBACK).
enum CachePolicy : uint8_t {
  kCacheFua = 1,
  kCacheWriteBack = 2,
};

inline constexpr uint32_t kSectorSize = 512;  // the wire counts in 512-byte sectors

// Allocation state of a stretch of a device (BLOCK_STATUS). The bits are NBD's base:allocation
// (NBD_STATE_HOLE, NBD_STATE_ZERO), so a frontend passes them on as they are. 0: data, which is
// always a true answer.
enum ExtentFlag : uint32_t {
  kExtentHole = 1u << 0,  // not allocated: writing there allocates
  kExtentZero = 1u << 1,  // reads as zeros
};
inline constexpr uint32_t kExtentFlagsMask = kExtentHole | kExtentZero;

struct Extent {
  uint64_t length = 0;  // bytes, > 0
  uint32_t flags = 0;   // ExtentFlag bits
  bool operator==(const Extent&) const = default;
};

// Extents one BLOCK_STATUS answer carries at most. An answer describes a prefix of the range
// asked for (at least one extent); the caller asks again from where it ended.
inline constexpr uint32_t kMaxExtents = 128;

// One answer: extents e[0..count) in order from the range's start, no gaps.
struct ExtentList {
  uint32_t count = 0;
  Extent e[kMaxExtents];
  uint64_t covered() const {
    uint64_t n = 0;
    for (uint32_t i = 0; i < count; ++i) n += e[i].length;
    return n;
  }
};

// The identity of an exported store: what makes two names one device. Access rules count
// holders per FileId, never per name, so a symlink, "./f.img" or "/root/f.img" cannot add a
// second writer to a file already held rw. A regular file is its (st_dev, st_ino); a block
// device is its st_rdev, so two device nodes of one disk are one device too. Stable while the
// server holds the store open (an inode number is not reused while a descriptor holds it).
// An RBD image is its cluster, pool, namespace, image id and snapshot (`rbd`, dev = ino = 0):
// the image id survives renames and is never reused.
struct FileId {
  bool block = false;  // a block device (dev = st_rdev, ino = 0)
  uint64_t dev = 0;    // st_dev of a regular file; st_rdev of a block device
  uint64_t ino = 0;    // st_ino of a regular file
  std::string rbd;     // "FSID/POOL_ID/NAMESPACE/IMAGE_ID@SNAP" of an RBD image, else ""
  auto operator<=>(const FileId&) const = default;
};

// What a client learns about a device when it opens it (the kernel's OPEN_RSP fields).
struct DeviceGeometry {
  uint64_t nsectors = 0;                  // size in 512-byte sectors
  uint32_t logical_block_size = 512;      // bytes
  uint32_t physical_block_size = 512;     // bytes
  uint32_t max_hw_sectors = 0;            // largest READ/WRITE in sectors
  uint32_t max_write_zeroes_sectors = 0;  // 0: not supported
  uint32_t max_discard_sectors = 0;       // 0: not supported
  uint32_t discard_granularity = 0;       // bytes
  uint32_t discard_alignment = 0;         // bytes
  uint16_t max_segments = 0;
  bool secure_discard = false;
  uint8_t cache_policy = 0;  // CachePolicy bits
  bool operator==(const DeviceGeometry&) const = default;
};

// The block server's counters of a device and of a session (cumulative since the device was
// opened / the session came up): BlockServer's devices() and sessions() fill them, and the
// server daemon's typed reports (control/server_reports.h) carry them to its answers.
struct BlockStats {
  uint64_t read_ops = 0, read_bytes = 0;
  uint64_t write_ops = 0, write_bytes = 0;
  uint64_t flush_ops = 0, discard_ops = 0, write_zeroes_ops = 0;
  uint64_t status_ops = 0;  // BLOCK_STATUS questions (protocol 5): they read no data
  uint64_t errors = 0;
  int64_t inflight = 0;
  bool operator==(const BlockStats&) const = default;
};

}  // namespace ibnbd
