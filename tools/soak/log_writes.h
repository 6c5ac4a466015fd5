// A reader and replayer of dm-log-writes logs (issue 17: crash consistency at every FLUSH/FUA
// point). The kernel's target (drivers/md/dm-log-writes.c, Documentation/admin-guide/
// device-mapper/log-writes.rst) records every write that reached the device, in the order the
// device made it durable: a write enters the log when a FLUSH that follows its completion
// completes (or at once for FUA), and userspace marks (`dmsetup message DEV 0 mark NAME`) are
// entries of their own. Replaying the log up to a mark rebuilds the device as a power loss at
// that moment could have left it. Debian ships no replay tool (xfstests' replay-log is not
// packaged): this is ours, written from the format alone.
//
// Format (all integers little-endian, "block" = the log's sectorsize, the data device's logical
// block size):
//   block 0         the super block (WireSuper), the rest of the block zero
//   then, nr_entries times:
//     1 block       a WireEntry, followed in the same block by a MARK's name (data_len bytes,
//                   no NUL), the rest zero
//     nr_sectors blocks   the data written, unless the entry is a DISCARD or a MARK
// An entry's sector and nr_sectors count blocks of sectorsize, not 512-byte sectors.
//
// Everything read from a log is checked before it is used: a log is data from a device that may
// have been cut short (the kernel rewrites the super's nr_entries only at FUA and MARK entries)
// or damaged. A bad log is an error naming the entry and the field, never a crash, an overflow
// or an allocation sized by a field.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/le.h"
#include "ibtrs/result.h"

namespace ibnbd::soak::logwrites {

using base::le32;
using base::le64;

inline constexpr uint64_t kMagic = 0x6a736677736872ull;  // WRITE_LOG_MAGIC
inline constexpr uint64_t kVersion = 1;                   // WRITE_LOG_VERSION
// The entry flags (LOG_*_FLAG). METADATA marks a REQ_META bio: replayed like any write.
inline constexpr uint64_t kFlush = 1u << 0;
inline constexpr uint64_t kFua = 1u << 1;
inline constexpr uint64_t kDiscard = 1u << 2;
inline constexpr uint64_t kMark = 1u << 3;
inline constexpr uint64_t kMetadata = 1u << 4;
inline constexpr uint64_t kKnownFlags = kFlush | kFua | kDiscard | kMark | kMetadata;
// A block device's logical block size: 512 up to 64 KiB (the largest page size) and a power of
// two; the kernel writes the super and each entry header into one such block.
inline constexpr uint32_t kMinSectorSize = 512;
inline constexpr uint32_t kMaxSectorSize = 64u << 10;

// struct log_write_super. The kernel's C struct is 28 bytes of fields padded to 32 (the le64s'
// alignment), copied into the block from its stack: the padding is not zeroed and never read.
struct WireSuper {
  le64 magic;        // kMagic
  le64 version;      // kVersion
  le64 nr_entries;   // entries logged when the super was last written
  le32 sectorsize;   // bytes per block of the log and per sector of an entry
  unsigned char padding[4];
};
BASE_WIRE_STRUCT(WireSuper, 32);

// struct log_write_entry
struct WireEntry {
  le64 sector;       // first block written (sectorsize units)
  le64 nr_sectors;   // blocks written (or discarded); 0 for a MARK and a FLUSH without data
  le64 flags;        // kFlush | kFua | kDiscard | kMark | kMetadata
  le64 data_len;     // a MARK's name length; 0 otherwise (inline data: not from this kernel)
};
BASE_WIRE_STRUCT(WireEntry, 32);

// Where the log's bytes come from: a file or block device (FdSource), memory in the tests.
class Source {
 public:
  virtual ~Source() = default;
  virtual uint64_t size() const = 0;
  // Reads exactly out.size() bytes at off (the caller keeps off + size <= size()).
  virtual ibtrs::Status read_at(uint64_t off, std::span<std::byte> out) = 0;
};

// A log by path (a file or a block device), read with pread.
ibtrs::Result<std::unique_ptr<Source>> open_source(const std::string& path);

// Where a replay writes: the device (or image file) being rebuilt.
class Sink {
 public:
  virtual ~Sink() = default;
  virtual uint64_t size() const = 0;
  virtual ibtrs::Status write_at(uint64_t off, std::span<const std::byte> data) = 0;
  // A logged DISCARD: the range reads back as zeroes afterwards, or (BLKDISCARD on a device
  // that does not zero) as what a real discard may leave: the old data or zeroes.
  virtual ibtrs::Status discard(uint64_t off, uint64_t len) = 0;
  virtual ibtrs::Status sync() = 0;
};

struct Entry {
  uint64_t index = 0;
  uint64_t sector = 0;       // blocks
  uint64_t nr_sectors = 0;   // blocks
  uint64_t flags = 0;
  std::string mark;          // a MARK's name, as logged
  uint64_t data_offset = 0;  // in the log: the data's first byte (writes only)
  uint64_t next_offset = 0;  // in the log: the next entry's header

  bool is_mark() const { return (flags & kMark) != 0; }
  bool is_discard() const { return (flags & kDiscard) != 0; }
  bool has_data() const { return !is_mark() && !is_discard() && nr_sectors != 0; }
};

// A walk over a log's entries in order. Every call checks what it reads; on an error, why()
// says which entry and which field.
class Reader {
 public:
  // Reads and checks the super block.
  static ibtrs::Result<Reader> open(Source& src, std::string* why);

  uint32_t sectorsize() const { return sectorsize_; }
  uint64_t nr_entries() const { return nr_entries_; }

  // The next entry's header (its data is not read), or nullopt after the last.
  ibtrs::Result<std::optional<Entry>> next(std::string* why);
  // Continues the walk at a known entry (index and offset of its header, from an earlier walk
  // of the same log).
  void seek(uint64_t index, uint64_t offset) {
    index_ = index;
    offset_ = offset;
  }

 private:
  Reader(Source& src, uint32_t ss, uint64_t n) : src_(&src), sectorsize_(ss), nr_entries_(n) {}
  Source* src_;
  uint32_t sectorsize_;
  uint64_t nr_entries_;
  uint64_t index_ = 0;
  uint64_t offset_ = 0;  // set by open(): one block, after the super
  std::vector<std::byte> block_;  // one header block
};

// A target by path, which must exist: a file (a DISCARD punches a hole: zeroes) or a block device
// (BLKDISCARD); where neither works, zeroes are written. Its size is the file's or device's.
ibtrs::Result<std::unique_ptr<Sink>> open_sink(const std::string& path);

// An entry of a replay's range: "N" (an index) or "mark:NAME" (the first MARK so named).
struct Point {
  std::optional<uint64_t> index;
  std::string mark;
  bool matches(const Entry& e) const { return index ? e.index == *index : e.is_mark() && e.mark == mark; }
  std::string str() const { return index ? std::to_string(*index) : "mark:" + mark; }
};
ibtrs::Result<Point> parse_point(std::string_view s);

struct ReplayOptions {
  std::optional<Point> start_after;  // entries up to and including it are already on the target
  Point to;                          // the last entry applied
  std::optional<uint64_t> drop;      // an entry NOT applied: a broken stack, for the self-test
};

struct ReplayStats {
  uint64_t first = 0;          // index of the first entry applied (or to's, when none was)
  uint64_t last = 0;           // index of `to`
  uint64_t writes = 0;         // entries whose data was written
  uint64_t discards = 0;
  uint64_t bytes = 0;          // data bytes written
  uint64_t dropped = 0;        // 1 when --drop skipped an entry
};

// Applies the entries after start_after up to and including `to` to the target. Both points
// are found and every entry of the range checked (fits the log and the target) before the
// first byte is written: a bad range or log leaves the target as it was.
ibtrs::Result<ReplayStats> replay(Source& log, Sink& target, const ReplayOptions& o, std::string* why);

// Calls fn with every entry of the log (headers only, checked) in order; for --list and
// --flush-points. Stops at fn's first error.
ibtrs::Status for_each(Source& log, const std::function<ibtrs::Status(const Entry&)>& fn, std::string* why);

// A point a driver checks: a FLUSH or FUA (the device made something durable) or a MARK.
inline bool is_flush_point(const Entry& e) { return (e.flags & (kFlush | kFua | kMark)) != 0; }

// "FLUSH|FUA", "WRITE" for a plain write, "MARK", ...
std::string flag_names(uint64_t flags);
// A mark's name for printing: bytes outside 0x21..0x7e and the backslash as \xNN.
std::string printable(std::string_view name);

}  // namespace ibnbd::soak::logwrites
