// A streaming parser of QEMU 7.2 migration streams down to the records of the "ram" section, and
// the two rewriters the RDMA transport needs (docs/migration-image.md, "QEMU's RDMA migration
// protocol (as implemented)"):
//
//   InlineRewriter   save: a stream from QEMU's RDMA source carries no pages, only HOOK records
//                    where the destination runs its registration loop (pages arrive by RDMA WRITE
//                    meanwhile). At each HOOK it asks a PageSource for the pages that changed and
//                    writes them as PAGE / ZERO records in the HOOK's place: an ordinary stream
//                    that QEMU's exec: / unix: / fd: incoming loads.
//   RdmaSplitter     restore: from an ordinary stream, the bytes an RDMA source sends as QEMU FILE
//                    (pages removed, a HOOK at the start of every RAM round) and, between a
//                    round's begin and end, each page to RDMA-write (or COMPRESS).
//
// What the parser walks (savevm.c, ram.c of QEMU 7.2):
//   "QEVM", version 3; CONFIGURATION (0x07: machine type, subsections target-page-bits,
//   capabilities, uuid); COMMAND (0x08: be16 cmd, be16 len, data); SECTION_START (0x01: be32 id,
//   u8 len + idstr, be32 instance, be32 version) / PART (0x02) / END (0x03: be32 id) of "ram",
//   each followed by RAM records up to EOS and an optional SECTION_FOOTER (0x7e, be32 id).
//   RAM records: be64 (offset | flags): MEM_SIZE (the RAM block list: u8 len + idstr, be64 length
//   each), PAGE / ZERO (+ CONTINUE: same block as the previous record, else u8 len + idstr), HOOK,
//   EOS. Refused with EOPNOTSUPP and a reason: XBZRLE, COMPRESS_PAGE, multifd flush (QEMU >= 8.0),
//   postcopy / COLO commands, x-ignore-shared, iterable sections other than "ram" (block
//   migration, dirty bitmaps, VFIO).
//   After the END of "ram" (or an EOF), the rest — non-iterable device sections (FULL, 0x04),
//   EOF, the JSON VMDESCRIPTION — is passed through byte for byte: a FULL section has no length
//   and its footer byte may occur inside the device data, so its end can only be found by a
//   loader that knows every device's VMState. A FULL section before the RAM ends is refused.
//
// Bytes arrive in pieces of any size (one byte at a time works); the parser buffers at most one
// field or one page (64 KiB pages at most), never more. Not thread-safe: one thread feeds.
// Errors: EBADMSG (malformed stream), EOPNOTSUPP (a feature above), and whatever a callback
// returns, which stops the parser (every later call returns the same error).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ibtrs/result.h"

namespace ibnbd::migrate::qstream {

using ibtrs::Result;
using ibtrs::Status;

// RAM_SAVE_FLAG_* (ram.c; HOOK in qemu-file.h). MULTIFD_FLUSH appeared in QEMU 8.0.
inline constexpr uint64_t kFlagFull = 0x01;      // obsolete
inline constexpr uint64_t kFlagZero = 0x02;
inline constexpr uint64_t kFlagMemSize = 0x04;
inline constexpr uint64_t kFlagPage = 0x08;
inline constexpr uint64_t kFlagEos = 0x10;
inline constexpr uint64_t kFlagContinue = 0x20;
inline constexpr uint64_t kFlagXbzrle = 0x40;
inline constexpr uint64_t kFlagHook = 0x80;
inline constexpr uint64_t kFlagCompressPage = 0x100;
inline constexpr uint64_t kFlagMultifdFlush = 0x200;

inline constexpr uint32_t kDefaultPageBits = 12;  // x86's TARGET_PAGE_BITS (no subsection sent)
inline constexpr uint32_t kMinPageBits = 10;
inline constexpr uint32_t kMaxPageBits = 16;
inline constexpr size_t kMaxRamBlocks = 4096;     // = qrdma::kMaxRamBlocks

struct StreamOptions {
  // The target's page bits when the stream has no configuration/target-page-bits subsection
  // (QEMU sends it only when they differ from the target's minimum, so x86 never does).
  uint32_t page_bits = kDefaultPageBits;
};

struct RamBlock {
  std::string name;     // idstr, 1..255 bytes
  uint64_t length = 0;  // used_length, a multiple of the page size
};

// Which part of the RAM migration a record belongs to: the START section (ram_save_setup), a
// PART (ram_save_iterate) or the END (ram_save_complete).
enum class RamPhase : uint8_t { setup, iterate, complete };
std::string_view to_string(RamPhase p);

struct RamRound {
  RamPhase phase = RamPhase::setup;
  uint64_t index = 0;  // 0 for the START section, then one per PART / END section
};

// A PAGE or ZERO record. `data` is page_size bytes for PAGE (valid during the call only), empty
// for ZERO, whose page is filled with `fill` (QEMU writes 0; its loader memsets any value).
struct PageRecord {
  uint32_t block = 0;   // index into the MEM_SIZE list
  uint64_t offset = 0;  // bytes from the block's start, page aligned, < its length
  bool zero = false;
  uint8_t fill = 0;
  std::span<const std::byte> data;
};

// What the parser reports, in stream order. Every byte of the input reaches exactly one of
// bytes() (verbatim), page() (a PAGE / ZERO record) or hook() (a HOOK record).
class StreamEvents {
 public:
  virtual ~StreamEvents() = default;
  // Stream bytes that are not a page or HOOK record, unchanged, in pieces of any size.
  virtual Status bytes(std::span<const std::byte> b) = 0;
  // The MEM_SIZE list has been read (its bytes went to bytes()). Once, in the START section.
  virtual Status ram_blocks(std::span<const RamBlock> blocks) = 0;
  // A RAM round's records begin: after the list in the START section, after the header of a
  // PART / END section.
  virtual Status round_begin(const RamRound& r) = 0;
  virtual Status page(const PageRecord& p) = 0;
  virtual Status hook(const RamRound& r) = 0;
  // The round's EOS record is next (it then goes to bytes()).
  virtual Status round_end(const RamRound& r) = 0;
};

class RamStreamParser {
 public:
  explicit RamStreamParser(StreamEvents& ev, StreamOptions o = {});
  ~RamStreamParser();
  RamStreamParser(const RamStreamParser&) = delete;
  RamStreamParser& operator=(const RamStreamParser&) = delete;

  Status feed(std::span<const std::byte> in);
  // End of input. EBADMSG when the stream stopped before the END of "ram" (or an EOF section)
  // or inside a field.
  Status finish();

  const std::string& last_error() const;
  uint64_t consumed() const;                  // input bytes fed so far
  uint32_t page_size() const;
  const std::string& machine_type() const;    // from the configuration section ("" if absent)
  const std::vector<RamBlock>& blocks() const;
  bool ram_complete() const;                  // the END section of "ram" has been read

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Record encoders (the rewriters' and the tests'): a PAGE / ZERO record for `blocks[block]`,
// with CONTINUE when `*last_block` equals block (updated), and the HOOK and EOS records.
// EINVAL for a block or offset outside `blocks`, an unaligned offset or a PAGE of the wrong size.
class RecordWriter {
 public:
  RecordWriter(std::span<const RamBlock> blocks, uint32_t page_size);
  Status page(std::vector<std::byte>& out, uint32_t block, uint64_t offset, std::span<const std::byte> data);
  Status zero(std::vector<std::byte>& out, uint32_t block, uint64_t offset, uint8_t fill = 0);
  static void hook(std::vector<std::byte>& out);
  static void eos(std::vector<std::byte>& out);

 private:
  Status header(std::vector<std::byte>& out, uint32_t block, uint64_t offset, uint64_t flags);
  std::span<const RamBlock> blocks_;
  uint32_t page_size_;
  int64_t last_block_ = -1;
};

// Where a rewriter's output goes (an image writer, a pipe, a buffer).
class ByteSink {
 public:
  virtual ~ByteSink() = default;
  virtual Status write(std::span<const std::byte> b) = 0;
};

// ---- save direction ----

// Handed to PageSource::changed_pages, valid during that call only: writes the pages it is given
// as records at the HOOK's place. Validates block, offset (page aligned, inside the block) and the
// page size (EINVAL).
class PageWriter {
 public:
  virtual ~PageWriter() = default;
  virtual Status data(uint32_t block, uint64_t offset, std::span<const std::byte> page) = 0;
  virtual Status zero(uint32_t block, uint64_t offset, uint8_t fill = 0) = 0;
};

// The save side's view of guest RAM (the RDMA code: chunks QEMU wrote into, COMPRESS ranges).
// Called on the feeding thread, in stream order.
class PageSource {
 public:
  virtual ~PageSource() = default;
  // The stream's RAM blocks, before the first HOOK (the RAM BLOCKS exchange happens during it).
  virtual Status ram_blocks(std::span<const RamBlock> blocks) = 0;
  // At a HOOK: QEMU's destination would now run its registration loop until REGISTER FINISHED.
  // Report every page that changed since the previous call through `out` (any order; a page
  // reported twice is written twice, the later wins on load), then return.
  virtual Status changed_pages(const RamRound& round, PageWriter& out) = 0;
};

class InlineRewriter {
 public:
  InlineRewriter(ByteSink& out, PageSource& pages, StreamOptions o = {});
  ~InlineRewriter();
  InlineRewriter(const InlineRewriter&) = delete;
  InlineRewriter& operator=(const InlineRewriter&) = delete;

  Status feed(std::span<const std::byte> in);
  Status finish();  // also flushes the output
  const std::string& last_error() const;
  const RamStreamParser& parser() const;
  uint64_t hooks() const;          // HOOK records replaced
  uint64_t pages_written() const;  // PAGE + ZERO records written

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// ---- restore direction ----

// What an RDMA source does with an ordinary stream. Calls come in stream order:
//   file_bytes ... ram_blocks, round_begin(setup), [page ...], round_end, file_bytes ...
//   round_begin(iterate|complete), page ..., round_end, file_bytes ...
// When round_begin comes, the HOOK record has been passed to file_bytes: everything given so far
// must reach the destination before the round's control messages (RAM BLOCKS REQUEST at setup,
// REGISTER / COMPRESS for the pages, REGISTER FINISHED at round_end).
class RdmaSink {
 public:
  virtual ~RdmaSink() = default;
  // Pieces of any size (as the input came), valid during the call: the sink gathers them into
  // QEMU FILE messages.
  virtual Status file_bytes(std::span<const std::byte> b) = 0;
  virtual Status ram_blocks(std::span<const RamBlock> blocks) = 0;
  virtual Status round_begin(const RamRound& r) = 0;
  virtual Status page(const PageRecord& p) = 0;
  virtual Status round_end(const RamRound& r) = 0;
};

class RdmaSplitter {
 public:
  explicit RdmaSplitter(RdmaSink& sink, StreamOptions o = {});
  ~RdmaSplitter();
  RdmaSplitter(const RdmaSplitter&) = delete;
  RdmaSplitter& operator=(const RdmaSplitter&) = delete;

  // EOPNOTSUPP when the stream already carries HOOK records (it came from an RDMA source as is).
  Status feed(std::span<const std::byte> in);
  Status finish();
  const std::string& last_error() const;
  const RamStreamParser& parser() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace ibnbd::migrate::qstream
