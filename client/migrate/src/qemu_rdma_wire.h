// QEMU's RDMA migration protocol (`migrate rdma:` / `-incoming rdma:`) on the wire, as QEMU 7.2's
// migration/rdma.c speaks it: the rdma_cm private data (capabilities) and the control channel of
// SEND messages. Only this file knows the layout; docs/migration-image.md ("QEMU's RDMA migration
// protocol (as implemented)") describes it for humans with every difference from the 2013
// specification (docs/rdma.txt).
//
// Byte order: every integer is big-endian (network order: QEMU converts each field with
// htonl/htonll before a SEND and ntohl/ntohll after a RECV, and the capabilities likewise).
//
// Roles. The source (QEMU's `migrate rdma:`, or our restore) connects; the destination
// (`-incoming rdma:`, or our save) listens. Guest RAM moves by RDMA WRITE in 1 MiB chunks
// (kChunkShift) into memory the destination registered: either every RAM block at once (pin-all,
// rkeys in RAM BLOCKS RESULT) or chunk by chunk (REGISTER REQUEST -> REGISTER RESULT).
//
// Decoders take the bytes of one received SEND (header + payload) and validate everything a peer
// controls before anything uses it: the lengths, the type, the repeat count and, against a
// caller-given RamLayout, every block index, address, chunk and length, so that later code cannot
// be led to register, zero or accept writes outside the layout. They copy what they validated into
// host-order structs; only the QEMU FILE payload (opaque stream bytes) is handed out as a view.
// Everything here is stateless (a RamLayout does not change once made): any thread.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "base/le.h"  // big-endian wire integers and BASE_WIRE_STRUCT, the size / layout proof
#include "ibtrs/result.h"

namespace ibnbd::migrate::qrdma {

using ibtrs::Result;
using ibtrs::Status;

// QEMU writes the control channel in network byte order.
using base::be32;
using base::be64;

// ---- constants (rdma.c names in comments) ----
inline constexpr uint32_t kVersion = 1;                  // RDMA_CONTROL_VERSION_CURRENT
inline constexpr uint32_t kCapPinAll = 0x01;             // RDMA_CAPABILITY_PIN_ALL
inline constexpr uint32_t kKnownCaps = kCapPinAll;       // known_capabilities
inline constexpr size_t kControlMaxBuffer = 512 * 1024;  // RDMA_CONTROL_MAX_BUFFER: header + payload
inline constexpr uint32_t kMaxCommands = 4096;           // RDMA_CONTROL_MAX_COMMANDS_PER_MESSAGE
inline constexpr unsigned kChunkShift = 20;              // RDMA_REG_CHUNK_SHIFT
inline constexpr uint64_t kChunkSize = 1ull << kChunkShift;
inline constexpr size_t kFileIncrement = 32768;          // RDMA_SEND_INCREMENT: QEMU FILE payload QEMU sends
// RAM blocks in a layout. QEMU VMs have a handful (pc: 6, plus one per memory backend); the
// bound keeps a RAM BLOCKS RESULT (32 bytes each) far inside one control buffer.
inline constexpr size_t kMaxRamBlocks = 4096;

// Control message types, QEMU 7.2's numbering (enum in rdma.c; the 2013 seed numbered them from 1
// with 9 types; 7.2 has NONE = 0 and 11 more).
enum class MsgType : uint32_t {
  none = 0,                 // never sent; rdma.c's "expect anything"
  error = 1,                // a side failed: the migration is over
  ready = 2,                // the receiver posted a RECV: the peer may SEND one message
  qemu_file = 3,            // migration stream bytes (QEMUFile over SEND)
  ram_blocks_request = 4,   // source -> destination, at the first HOOK
  ram_blocks_result = 5,    // destination -> source: one DestBlock per RAM block
  compress = 6,             // source -> destination: fill a range (a zero chunk) instead of RDMA
  register_request = 7,     // source -> destination: register chunk(s) (dynamic registration)
  register_result = 8,      // destination -> source: rkey + host address per request
  register_finished = 9,    // source -> destination: the round's registrations are done
  unregister_request = 10,  // source -> destination (QEMU only with RDMA_UNREGISTRATION_EXAMPLE)
  unregister_finished = 11, // destination -> source
};
inline constexpr uint32_t kMaxMsgType = 11;
std::string_view to_string(MsgType t);

// ---- wire structs ----

// rdma_cm private data of connect (source) and accept (destination): RDMACapabilities.
struct CapsWire {
  be32 version;  // kVersion; the destination echoes the source's
  be32 flags;    // kCap*: the source's request; the destination's answer is a subset
};
BASE_WIRE_STRUCT(CapsWire, 8);

// Before every payload: RDMAControlHeader.
struct HeaderWire {
  be32 len;      // payload bytes after this header
  be32 type;     // MsgType
  be32 repeat;   // entries of the payload (see each type)
  be32 padding;  // QEMU never writes it (stack bytes for QEMU FILE); we write 0, ignore it
};
BASE_WIRE_STRUCT(HeaderWire, 16);

// RAM BLOCKS RESULT entry: RDMADestBlock (RDMARemoteBlock in older QEMUs), in the order of the
// stream's RAM block list.
struct DestBlockWire {
  be64 remote_host_addr;  // destination virtual address of the block (RDMA target base)
  be64 offset;            // the block's offset in the destination's ram_addr space
  be64 length;            // bytes (must equal the source's block length)
  be32 remote_rkey;       // pin-all: the block's rkey; 0 with dynamic registration
  be32 padding;
};
BASE_WIRE_STRUCT(DestBlockWire, 32);

// REGISTER REQUEST / UNREGISTER REQUEST entry: RDMARegister.
struct RegisterWire {
  be64 key;            // register: address in the destination's ram_addr space; unregister: chunk
  be32 current_index;  // RAM block index
  be32 padding;        // uninitialised by QEMU 7.2 (stack): ignored
  be64 chunks;         // register: further chunks after the first (0 = one chunk)
};
BASE_WIRE_STRUCT(RegisterWire, 24);

// REGISTER RESULT entry: RDMARegisterResult.
struct RegisterResultWire {
  be32 rkey;
  be32 padding;
  be64 host_addr;  // base the source adds (address - block offset) to: the block's host address
};
BASE_WIRE_STRUCT(RegisterResultWire, 16);

// COMPRESS payload: RDMACompress.
struct CompressWire {
  be32 value;      // fill byte (QEMU sends 0; its destination truncates to 8 bits)
  be32 block_idx;
  be64 offset;     // address in the destination's ram_addr space
  be64 length;
};
BASE_WIRE_STRUCT(CompressWire, 24);

// ---- capabilities ----

struct Caps {
  uint32_t version = kVersion;
  uint32_t flags = 0;
};
std::array<std::byte, sizeof(CapsWire)> encode_caps(Caps c);
// A peer's private data. rdma_cm may hand over more bytes than were sent (InfiniBand pads the
// REQ/REP private data to a fixed size), so trailing bytes are ignored; fewer than 8 bytes or a
// version other than 1 is an error (EBADMSG, EPROTONOSUPPORT).
Result<Caps> decode_caps(std::span<const std::byte> private_data, std::string* why = nullptr);
// The destination's answer to a source's caps, as QEMU's qemu_rdma_accept builds it: the version
// echoed, the flags masked to the known ones (and pin-all dropped when not allowed).
Caps answer_caps(Caps from_source, bool allow_pin_all);
// The source's check of the destination's answer: a valid Caps whose flags are a subset of what
// was asked (EPROTO otherwise). QEMU's source only looks at the pin-all bit; we are stricter.
Result<Caps> check_answer(Caps asked, std::span<const std::byte> private_data, std::string* why = nullptr);

// ---- RAM layout ----

// A RAM block as both sides index it: index = position in the stream's RAM block list (the
// destination sorts its blocks into the source's order before RAM BLOCKS RESULT).
struct RamBlockLayout {
  std::string name;     // for messages only (not on the control channel)
  uint64_t offset = 0;  // in the destination's ram_addr space (what REGISTER / COMPRESS carry)
  uint64_t length = 0;  // bytes, > 0
};

class RamLayout {
 public:
  RamLayout() = default;
  // Checks 1..kMaxRamBlocks blocks, lengths > 0, no overflow, no two blocks overlapping
  // (EINVAL, with why).
  static Result<RamLayout> make(std::vector<RamBlockLayout> blocks, std::string* why = nullptr);
  // A destination's own offsets: the blocks in order, each at the next 1 MiB boundary.
  static Result<RamLayout> packed(std::vector<RamBlockLayout> blocks, std::string* why = nullptr);

  size_t size() const { return blocks_.size(); }
  const RamBlockLayout& block(size_t i) const { return blocks_[i]; }
  const std::vector<RamBlockLayout>& blocks() const { return blocks_; }
  // Chunks of block i: ceil(length / 1 MiB). (QEMU allocates length / 1 MiB + 1 per block, one
  // empty chunk too many when the length is a multiple of 1 MiB; registering that one is refused.)
  uint64_t chunks(size_t i) const { return (blocks_[i].length + kChunkSize - 1) >> kChunkShift; }

 private:
  std::vector<RamBlockLayout> blocks_;
};

// ---- decoded messages (host order, validated) ----

// A REGISTER REQUEST entry: register the bytes [begin, end) of `block`, chunks first..last.
struct RegisterRequest {
  uint32_t block = 0;
  uint64_t addr = 0;         // as sent (destination ram_addr)
  uint64_t offset = 0;       // addr - block offset
  uint64_t chunks = 0;       // as sent: further chunks after the first
  uint64_t first_chunk = 0;  // offset >> kChunkShift
  uint64_t begin = 0;        // first_chunk << kChunkShift
  uint64_t end = 0;          // end of chunk first_chunk + chunks, clipped to the block length
};

// An UNREGISTER REQUEST entry.
struct UnregisterRequest {
  uint32_t block = 0;
  uint64_t chunk = 0;
};

struct RegisterResult {
  uint32_t rkey = 0;
  uint64_t host_addr = 0;
};

// COMPRESS: fill [offset, offset + length) of `block` with `value`. Validated to lie inside one
// chunk of the block (QEMU's source never sends more: it merges pages only within a chunk).
struct Compress {
  uint8_t value = 0;
  uint32_t block = 0;
  uint64_t addr = 0;    // as sent
  uint64_t offset = 0;  // in the block
  uint64_t length = 0;
};

struct DestBlock {
  uint64_t host_addr = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint32_t rkey = 0;
};

struct ControlMessage {
  MsgType type = MsgType::none;
  uint32_t repeat = 0;                       // as sent (meaningless for QEMU FILE)
  std::span<const std::byte> file;           // qemu_file: the payload, a view into the input
  std::vector<RegisterRequest> registers;    // register_request
  std::vector<UnregisterRequest> unregisters;  // unregister_request
  std::vector<RegisterResult> results;       // register_result
  std::vector<DestBlock> blocks;             // ram_blocks_result
  Compress compress;                         // compress
};

// Decodes one received SEND (`msg`: exactly the bytes the completion reported). Checks, in order:
//   - 16 <= size <= kControlMaxBuffer; header len == size - 16 (EBADMSG);
//   - type 1..11 (EPROTO: NONE and unknown types);
//   - per type (EBADMSG): ERROR, READY, RAM BLOCKS REQUEST, REGISTER FINISHED, UNREGISTER
//     FINISHED carry no payload; COMPRESS one entry (repeat 1); REGISTER / UNREGISTER REQUEST and
//     REGISTER RESULT 1..kMaxCommands entries, len == repeat x entry size; RAM BLOCKS RESULT
//     len a multiple of 32, 1..kMaxRamBlocks entries; repeat <= kMaxCommands for every type but
//     QEMU FILE, whose repeat QEMU 7.2 leaves uninitialised;
//   - against `layout` (ERANGE): block indexes, addresses inside their block, chunk ranges, the
//     COMPRESS range inside one chunk of its block, RAM BLOCKS RESULT with one entry per layout
//     block and equal lengths (what QEMU's source checks). COMPRESS, REGISTER / UNREGISTER
//     REQUEST and RAM BLOCKS RESULT need a layout (EPROTO without one: they cannot come before the
//     stream's RAM block list).
// `why` (optional) gets a one-line reason on error.
Result<ControlMessage> decode_control(std::span<const std::byte> msg, const RamLayout* layout,
                                      std::string* why = nullptr);

// ---- encoders: write one message into `out` (a registered SEND buffer), return its size ----
// ENOBUFS when `out` is too small, EINVAL when an argument breaks the rules the decoder enforces
// (so a message we send always decodes).

// ERROR, READY, RAM BLOCKS REQUEST, REGISTER FINISHED, UNREGISTER FINISHED: no payload, repeat 1.
Result<size_t> encode_empty(std::span<std::byte> out, MsgType type);
// QEMU FILE: up to kControlMaxBuffer - 16 bytes (QEMU itself sends at most kFileIncrement).
Result<size_t> encode_qemu_file(std::span<std::byte> out, std::span<const std::byte> bytes);
// RAM BLOCKS RESULT from the destination's layout: host_addrs[i] per block, rkeys[i] per block
// (pin-all) or empty (dynamic registration: 0).
Result<size_t> encode_ram_blocks_result(std::span<std::byte> out, const RamLayout& layout,
                                        std::span<const uint64_t> host_addrs,
                                        std::span<const uint32_t> rkeys);
// REGISTER REQUEST: (block, offset in block, further chunks) per entry; the address sent is the
// block's offset in `layout` (the destination's, from RAM BLOCKS RESULT) plus the offset.
struct RegisterArg {
  uint32_t block = 0;
  uint64_t offset = 0;
  uint64_t chunks = 0;
};
Result<size_t> encode_register_request(std::span<std::byte> out, const RamLayout& layout,
                                       std::span<const RegisterArg> regs);
Result<size_t> encode_unregister_request(std::span<std::byte> out, const RamLayout& layout,
                                         std::span<const UnregisterRequest> regs);
Result<size_t> encode_register_result(std::span<std::byte> out, std::span<const RegisterResult> results);
// COMPRESS of [offset, offset + length) of `block` (in one chunk), address from `layout`.
Result<size_t> encode_compress(std::span<std::byte> out, const RamLayout& layout, uint32_t block,
                               uint64_t offset, uint64_t length, uint8_t value = 0);

}  // namespace ibnbd::migrate::qrdma
