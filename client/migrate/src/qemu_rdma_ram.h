// The save side's copy of guest RAM when QEMU's RDMA source (`migrate rdma:`) writes into the
// agent (docs/migration-image.md, "Saving from QEMU's RDMA source"): the memory its RDMA WRITEs
// land in, and which pages changed since the last report.
//
// Why content, not messages: QEMU's source sends REGISTER REQUEST only for the first write into
// a chunk; it caches the chunk's rkey (and the block's host address from the latest REGISTER
// RESULT) and writes into it again in later rounds without a message. So after each REGISTER
// FINISHED the only way to know which pages changed is to look: every page of a registered chunk
// keeps a 64-bit hash of what was last reported, and a page whose hash differs (or that was never
// reported) is reported again. The hash is not a MAC: a guest that crafts a page change keeping
// the hash only gets its own older page back on restore.
//
// Memory layout: each RAM block gets an address range of its own length, reserved PROT_NONE.
// A chunk becomes accessible (and counted against the pin limit) when it is registered; nothing
// else of the range is ever readable or writable. The range is needed because QEMU's source
// computes every write's target as (the block's host address from the LAST REGISTER RESULT) +
// offset: chunks must sit at base + chunk x 1 MiB, as they do in QEMU's own destination.
//
// Bounds: registered (mapped) bytes <= the pin limit (ENOMEM, with the numbers); per mapped page
// 8 bytes of hash; registrations <= 2 per mapped chunk + one per block; the layout itself <=
// kMaxLayoutBytes of address space. Not thread-safe: the endpoint's one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ibtrs/result.h"
#include "qemu_ram_stream.h"
#include "qemu_rdma_wire.h"

namespace ibnbd::migrate::qrdma {

// Address space the reservations of one layout may take (QEMU's x86 guests stop far below).
inline constexpr uint64_t kMaxLayoutBytes = 16ull << 40;

// Memory the RDMA device may write into. The endpoint registers with ibv_reg_mr (remote write);
// the tests use a fake. Destroying a Registration deregisters it.
class Registration {
 public:
  virtual ~Registration() = default;
  virtual uint32_t rkey() const = 0;
};

class Registrar {
 public:
  virtual ~Registrar() = default;
  // `why` gets a reason on error (e.g. the memlock limit).
  virtual Result<std::unique_ptr<Registration>> register_memory(std::byte* addr, size_t len, std::string* why) = 0;
};

// A 64-bit hash of `n` bytes (n a multiple of 32) and whether they are all zero, in one pass.
// Four lanes of multiply-rotate rounds (xxh64's round function) and a final avalanche.
uint64_t page_hash(const std::byte* p, size_t n, bool* all_zero);

class RamMirror {
 public:
  RamMirror(Registrar& reg, uint64_t pin_limit);
  ~RamMirror();
  RamMirror(const RamMirror&) = delete;
  RamMirror& operator=(const RamMirror&) = delete;

  // The destination layout (RamLayout::packed of the stream's blocks) and the stream's page size.
  // Reserves the address ranges. EINVAL: a block length not a multiple of the page size; E2BIG:
  // the layout is larger than kMaxLayoutBytes. Once.
  Status init(const RamLayout& layout, uint32_t page_size, std::string* why);
  bool ready() const { return !blocks_.empty(); }

  // What RAM BLOCKS RESULT and REGISTER RESULT carry as a block's address: its range's base.
  uint64_t host_addr(uint32_t block) const;
  // Pin-all: every block mapped and registered whole; the rkeys, one per block. ENOMEM when the
  // layout is larger than the pin limit. A second call returns the same keys.
  Result<std::vector<uint32_t>> pin_all(std::string* why);
  bool pinned_all() const { return pinned_all_; }
  // A REGISTER REQUEST entry (validated against the layout by decode_control): [begin, end) of
  // its block mapped and registered; the rkey covering it (an existing one when one does).
  Result<uint32_t> register_chunks(const RegisterRequest& r, std::string* why);
  // An UNREGISTER REQUEST entry: the registrations starting at the chunk are dropped; its memory
  // and content stay (they are the guest's RAM as far as the next report knows).
  Status unregister_chunk(const UnregisterRequest& r, std::string* why);
  // COMPRESS (validated: inside one chunk). A registered chunk gets the fill in memory (found by
  // the next report); an unregistered one with fill 0 and whole pages is reported now as ZERO
  // records through `out` (QEMU's case: no memory spent); any other fill or a part of a page maps
  // the chunk first (QEMU's source never sends one).
  Status compress(const Compress& c, qstream::PageWriter& out, std::string* why);
  // Every page of a registered chunk whose content differs from what was last reported, or was
  // never reported: as a PAGE record, or a ZERO record when it is all zero.
  Status report(qstream::PageWriter& out);

  uint64_t pinned_bytes() const { return pinned_bytes_; }
  size_t registrations() const { return registrations_; }
  uint64_t pages_reported() const { return pages_reported_; }

 private:
  struct Chunk {
    std::vector<std::unique_ptr<Registration>> regs;  // registrations starting at this chunk
    uint64_t reg_end = 0;                             // end (in the block) of the widest of them
    std::vector<uint64_t> hash;                       // per page: what was last reported
    std::vector<bool> sent;                           // per page: reported at all
  };
  struct Block {
    std::byte* base = nullptr;  // reservation
    size_t reserved = 0;
    uint64_t length = 0;
    std::unique_ptr<Registration> whole;  // pin-all
    std::map<uint64_t, Chunk> chunks;     // mapped chunks by index
  };

  Status map_chunk(uint32_t block, uint64_t chunk, std::string* why);
  uint64_t chunk_length(uint32_t block, uint64_t chunk) const;

  Registrar& reg_;
  uint64_t pin_limit_;
  uint32_t page_size_ = 0;
  std::vector<Block> blocks_;
  std::vector<std::string> names_;
  bool pinned_all_ = false;
  uint64_t pinned_bytes_ = 0;
  size_t registrations_ = 0;
  size_t max_registrations_ = 0;
  uint64_t pages_reported_ = 0;
};

}  // namespace ibnbd::migrate::qrdma
