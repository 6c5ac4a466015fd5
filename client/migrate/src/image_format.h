// The on-volume structs of migration images (docs/migration-image.md is the specification;
// every offset there is asserted here). Everything read from a volume goes through the decode
// functions below, which check magic, version, CRC and every field's range before anything
// uses it: a volume is data from another host.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "base/le.h"
#include "ibnbd/migrate_image.h"

namespace ibnbd::migrate::fmt {

using base::le32;
using base::le64;

inline constexpr uint32_t kVersion = 1;
inline constexpr size_t kBlock = 4096;                 // directory and header size
inline constexpr uint64_t kExtentAlign = 1ull << 20;   // extents and data_offset
inline constexpr uint32_t kSlots = 30;
inline constexpr uint32_t kNoChunk = 0xFFFFFFFFu;      // index: an elided zero piece
inline constexpr uint32_t kMinChunk = 64u << 10;
inline constexpr uint32_t kMaxChunk = 16u << 20;
inline constexpr std::string_view kDirMagic = "IBNBDDIR";
inline constexpr std::string_view kImgMagic = "IBNBDIMG";

enum SlotState : uint32_t { kSlotFree = 0, kSlotPartial = 1, kSlotCommitted = 2 };

struct Slot {
  char name[64];         // UTF-8, NUL-padded, 1..63 bytes
  le64 start;            // extent offset on the volume, multiple of 1 MiB
  le64 length;           // extent bytes, multiple of 1 MiB
  le32 state;            // SlotState
  unsigned char reserved[44];
};
BASE_WIRE_STRUCT(Slot, 128);

struct Directory {
  char magic[8];         // "IBNBDDIR"
  le32 version;          // 1
  le32 slot_count;       // 30
  le64 generation;       // +1 per update; the valid copy with the highest wins
  le64 volume_size;      // when formatted
  unsigned char reserved0[28];
  le32 crc;              // CRC32C of the 4096 bytes with this field zero
  Slot slots[kSlots];
  unsigned char reserved1[192];
};
BASE_WIRE_STRUCT(Directory, kBlock);
static_assert(offsetof(Directory, crc) == 60 && offsetof(Directory, slots) == 64);

struct StreamDesc {
  le64 length;           // bytes of the stream
  le64 chunks;           // pieces (index entries) of the stream
  le64 first_entry;      // its first index entry
};
BASE_WIRE_STRUCT(StreamDesc, 24);

struct Header {
  char magic[8];         // "IBNBDIMG"
  le32 version;          // 1
  le32 state;            // ImageState: 1 PARTIAL, 2 COMMITTED
  le32 chunk_size;       // bytes per piece, power of two in [64 KiB, 16 MiB]
  le32 stream_count;     // 1 + multifd channels, 1..kMaxStreams
  le64 created_ns;       // CLOCK_REALTIME at the start of the save
  le64 committed_ns;     // 0 while PARTIAL
  unsigned char vm_uuid[16];
  char machine_type[64]; // NUL-padded
  char name[64];         // NUL-padded, as in the directory
  le64 extent_length;    // header .. header mirror
  le64 data_offset;      // of stored chunk 0, from the extent's start
  le64 stored_chunks;    // chunks written
  le64 index_offset;     // from the extent's start
  le64 index_entries;    // all streams
  le32 index_crc;        // CRC32C of the index
  le32 reserved0;
  StreamDesc streams[kMaxStreams];
  unsigned char reserved1[3476];
  le32 crc;              // CRC32C of the header with this field zero
};
BASE_WIRE_STRUCT(Header, kBlock);
static_assert(offsetof(Header, extent_length) == 184 && offsetof(Header, streams) == 232 &&
              offsetof(Header, crc) == 4092);

struct IndexEntry {
  le32 stored;           // stored chunk number, or kNoChunk (an all-zero piece, not written)
  le32 crc;              // CRC32C of the piece's bytes
  le32 length;           // bytes (chunk_size except for a stream's last piece)
  le32 reserved;
};
BASE_WIRE_STRUCT(IndexEntry, 16);

// Names: 1..63 bytes, no '/', no control characters, not "." or "..".
bool valid_name(std::string_view name);
std::string fixed_string(const char* p, size_t cap);  // up to the first NUL
void set_fixed_string(char* p, size_t cap, std::string_view s);

// A directory as the code uses it; encode() fills magic, version and CRC.
struct DirView {
  uint64_t generation = 0;
  uint64_t volume_size = 0;
  struct Entry {
    std::string name;
    uint64_t start = 0;
    uint64_t length = 0;
    uint32_t state = kSlotFree;
  };
  std::array<Entry, kSlots> slots{};
};
void encode(const DirView& d, Directory& out);
// EBADMSG: no magic (not formatted); EILSEQ: magic but a bad CRC or a field out of range
// (extents must lie inside `volume_size` bytes, not overlap, be aligned);
// EPROTONOSUPPORT: another version.
Result<DirView> decode(const Directory& in, uint64_t volume_size);

void seal(Header& h);  // fills magic, version and CRC
// EBADMSG: no magic; EILSEQ: bad CRC or fields out of range; EPROTONOSUPPORT: another version.
// The header's extent_length may be below the slot's `slot_length` (a crash after the header
// was committed and before the directory shrank the slot); the layout is checked against it.
Status check(const Header& h, uint64_t slot_length);

}  // namespace ibnbd::migrate::fmt
