// IBNBD block protocol wire format: every message of the block layer above IBTRS, and nothing
// else. (Kernel counterpart: drivers/block/rnbd/rnbd-proto.h; message types, access modes, ops
// and flags keep the kernel's values.) docs/protocol.md, "IBNBD block protocol", describes the
// same for humans; every struct below proves its size.
//
// A message is the IBTRS user header (`usr`) of one transport request; the transport's data is
// the block data. How each message rides (the "carrier", checked by the decoders):
//   SESS_INFO   transport READ; the server writes SESS_INFO_RSP into the client's buffer
//   OPEN        transport READ; the server writes OPEN_RSP into the client's buffer
//   CLOSE       transport WRITE without data
//   IO read     transport READ; the client's buffer (bi_size bytes) receives the data
//   IO write    transport WRITE carrying bi_size bytes of data
//   IO flush, discard, secure_erase, write_zeroes   transport WRITE without data
//   WATCH       transport READ; the server writes WATCH_RSP into the client's buffer when a
//               device of the session changed size (version 4; held until then)
//   IO block_status  transport READ of exactly kBlockStatusReplyBytes; the server writes
//               BLOCK_STATUS_RSP (the extents of a prefix of the range) into the buffer (version 5)
// The server answers every request with an errno in the transport's response.
//
// Encoders check our own output with the same rules the decoders apply to the peer's, so we
// never send what we would refuse. Decoders read only inside the span they are given and return
// host-endian, validated messages:
//   EBADMSG  too short, wrong length, unknown or unexpected type
//   EINVAL   a field out of range, reserved bytes set, a carrier that does not fit the message
// Version negotiation (negotiate_version / accept_version) answers EPROTONOSUPPORT and EPROTO.
// Every function here is pure (no state, no allocation but the decoded dev_name and a WATCH_RSP's
// entries): any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/le.h"
#include "ibnbd/types.h"
#include "ibtrs/client.h"

namespace ibnbd::proto {

using base::le16;
using base::le32;
using base::le64;

// Protocol version carried by SESS_INFO (kernel: RNBD_PROTO_VER_MAJOR). Both sides use the
// lower of the two; a peer below kMinProtoVersion is refused. 3: OPEN carries flags
// (kOpenReopen); a client sends them only when the session speaks 3. 4: WATCH / WATCH_RSP (size
// changes of open devices, NVMe's Asynchronous Event Request in the block protocol's words) and
// OPEN_RSP's size_epoch; a client sends WATCH only when the session speaks 4. 5: the IO op
// block_status / BLOCK_STATUS_RSP (holes and zeros of a range); a client sends it only when the
// session speaks 5 and answers "all data" itself otherwise.
inline constexpr uint8_t kProtoVersion = 5;
inline constexpr uint8_t kOpenFlagsVersion = 3;
inline constexpr uint8_t kWatchVersion = 4;
inline constexpr uint8_t kBlockStatusVersion = 5;
inline constexpr uint8_t kMinProtoVersion = 2;
static_assert(kMinProtoVersion <= kProtoVersion);

// The largest logical block size a device may have (OPEN_RSP).
inline constexpr uint32_t kMaxLogicalBlockSize = 64 * 1024;

// dev_name field of OPEN (kernel: NAME_MAX); the name itself needs a NUL, so 254 bytes at most.
inline constexpr size_t kDevNameField = 255;
inline constexpr size_t kDevNameMax = kDevNameField - 1;

enum class MsgType : uint16_t {
  sess_info = 0,
  sess_info_rsp = 1,
  open = 2,
  open_rsp = 3,
  io = 4,
  close = 5,
  watch = 6,
  watch_rsp = 7,
  block_status_rsp = 8,
};
std::string_view to_string(MsgType t);

// ------------------------------------------------------------------------------------------
// Wire structs

struct MsgHdr {
  le16 type;      // MsgType
  le16 reserved;  // 0
};
BASE_WIRE_STRUCT(MsgHdr, 4);

// Client -> server, first request of a session (and again after every reconnect).
struct SessInfoMsg {
  MsgHdr hdr;             // MsgType::sess_info
  uint8_t ver;            // highest version the client speaks
  uint8_t reserved[31];   // 0 from us; ignored, since a newer client may use them
};
BASE_WIRE_STRUCT(SessInfoMsg, 36);

// Server -> client, written into the SESS_INFO request's read buffer.
struct SessInfoRspMsg {
  MsgHdr hdr;             // MsgType::sess_info_rsp
  uint8_t ver;            // the version both sides now use: min(client's, server's)
  uint8_t reserved[31];   // 0
};
BASE_WIRE_STRUCT(SessInfoRspMsg, 36);

struct OpenMsg {
  MsgHdr hdr;                       // MsgType::open
  uint8_t access_mode;              // AccessMode: ro 0, rw 1, migration 2
  uint8_t flags;                    // OpenFlag bits (version 3; 0 before)
  uint8_t dev_name[kDevNameField];  // device name relative to the server's search path:
                                    // 1..254 bytes, no control characters, NUL padded
  uint8_t reserved1[3];             // 0
};
BASE_WIRE_STRUCT(OpenMsg, 264);

// Server -> client, written into the OPEN request's read buffer. Same size as the kernel's, but
// the block sizes are 32-bit (the kernel's le16 cannot say 64 KiB) and the obsolete rotational
// byte is gone.
struct OpenRspMsg {
  MsgHdr hdr;                     // MsgType::open_rsp
  le32 device_id;                 // names the device in CLOSE and IO of this session
  le64 nsectors;                  // size in 512-byte sectors
  le32 max_hw_sectors;            // largest READ/WRITE in sectors, > 0
  le32 max_write_zeroes_sectors;  // 0: WRITE_ZEROES not supported
  le32 max_discard_sectors;       // 0: DISCARD not supported
  le32 discard_granularity;       // bytes
  le32 discard_alignment;         // bytes
  le32 physical_block_size;       // bytes, power of two, >= logical_block_size
  le32 logical_block_size;        // bytes, power of two, 512..64 KiB
  le16 max_segments;              // segments per request the device takes
  uint8_t secure_discard;         // 0 or 1: SECURE_ERASE supported
  uint8_t cache_policy;           // CachePolicy bits (FUA 1, WRITEBACK 2)
  le64 size_epoch;                // version 4: the session's size epoch when nsectors was read
                                  // (WATCH_RSP); 0 before (a reserved field then)
};
BASE_WIRE_STRUCT(OpenRspMsg, 56);

struct CloseMsg {
  MsgHdr hdr;      // MsgType::close
  le32 device_id;  // from OPEN_RSP
};
BASE_WIRE_STRUCT(CloseMsg, 8);

struct IoMsg {
  MsgHdr hdr;          // MsgType::io
  le32 device_id;      // from OPEN_RSP
  le64 sector;         // first 512-byte sector
  le32 rw;             // IoOp in bits 0..7 | IoFlag bits (pack_rw)
  le32 bi_size;        // bytes, a multiple of 512; the data length of READ/WRITE, the range
                       // length of DISCARD/SECURE_ERASE/WRITE_ZEROES (no data travels), 0 for FLUSH
  le16 prio;           // ioprio of the request, passed to the backend as is
  uint8_t reserved[6]; // 0
};
BASE_WIRE_STRUCT(IoMsg, 32);

// Client -> server (version 4): left outstanding, one per session. `epoch` is the last size
// epoch the client saw (a WATCH_RSP's, 0 for none); the server answers at once when the
// session's epoch differs, else when a device of the session changes size (or the server lets
// go of the watch: a path of the session went down, the server stops).
struct WatchMsg {
  MsgHdr hdr;         // MsgType::watch
  le32 reserved;      // 0
  le64 epoch;
};
BASE_WIRE_STRUCT(WatchMsg, 16);

// Server -> client, written into the WATCH request's read buffer: the session's epoch and the
// size of every device it has open, by id (ascending). When the buffer holds fewer entries than
// the session has devices, count < total: the client asks again with a larger buffer.
struct WatchRspMsg {
  MsgHdr hdr;         // MsgType::watch_rsp
  le32 count;         // entries that follow
  le32 total;         // devices the session has open, >= count
  le32 reserved;      // 0
  le64 epoch;         // the session's size epoch, never 0
};
BASE_WIRE_STRUCT(WatchRspMsg, 24);

struct WatchEntryMsg {
  le32 device_id;     // as OPEN_RSP gave it
  le32 reserved;      // 0
  le64 nsectors;      // the device's size now, in 512-byte sectors
};
BASE_WIRE_STRUCT(WatchEntryMsg, 16);

// Server -> client (version 5), written into the read buffer of an IO of op block_status
// (IoMsg's sector and bi_size are the range): extents in order from the range's start, without
// gaps, covering a prefix of it (count >= 1; the client asks again from where they end).
struct BlockStatusRspMsg {
  MsgHdr hdr;           // MsgType::block_status_rsp
  le32 count;           // extents that follow, 1..kMaxExtents
  uint8_t reserved[8];  // 0
};
BASE_WIRE_STRUCT(BlockStatusRspMsg, 16);

struct ExtentMsg {
  le32 length;  // bytes, a multiple of 512, > 0 (a range is at most bi_size: 32 bits)
  le32 flags;   // ExtentFlag bits (hole 1, zero 2); others 0
};
BASE_WIRE_STRUCT(ExtentMsg, 8);

// The read buffer of a block_status IO: the header and kMaxExtents entries, whatever count the
// answer has.
inline constexpr size_t kBlockStatusReplyBytes = sizeof(BlockStatusRspMsg) + kMaxExtents * sizeof(ExtentMsg);

// ------------------------------------------------------------------------------------------
// The `rw` word

inline constexpr uint32_t kRwOpBits = 8;
inline constexpr uint32_t kRwOpMask = (1u << kRwOpBits) - 1;
static_assert((kIoFlagsMask & kRwOpMask) == 0, "IO flags must not overlap the op bits");

struct Rw {
  IoOp op = IoOp::read;
  uint32_t flags = 0;  // IoFlag bits
  bool operator==(const Rw&) const = default;
};
// EINVAL: an op we do not know, or flags outside kIoFlagsMask.
Result<uint32_t> pack_rw(IoOp op, uint32_t flags);
// EINVAL: an unknown op in the low bits, or unknown flag bits.
Result<Rw> unpack_rw(uint32_t rw);

// ------------------------------------------------------------------------------------------
// Messages as the code sees them (host-endian, validated)

struct SessInfo {
  uint8_t ver = kProtoVersion;
  bool operator==(const SessInfo&) const = default;
};
struct SessInfoRsp {
  uint8_t ver = kProtoVersion;
  bool operator==(const SessInfoRsp&) const = default;
};
// OPEN flags.
enum OpenFlag : uint8_t {
  // The client held this device before and opens it again: a remap after its session came back
  // (the server restarted or a path returned) or a failover to another server. The server may
  // take the store over from whoever holds it now (an RBD image's exclusive lock: the holder
  // was this client's previous server, dead or cut off, and is fenced).
  kOpenReopen = 1,
};
inline constexpr uint8_t kOpenFlagsMask = kOpenReopen;

struct Open {
  AccessMode mode = AccessMode::ro;
  std::string dev_name;
  uint8_t flags = 0;  // OpenFlag bits
  bool operator==(const Open&) const = default;
};
struct OpenRsp {
  uint32_t device_id = 0;
  DeviceGeometry geo;
  uint64_t size_epoch = 0;  // version 4 (0 before): the session's size epoch of geo.nsectors
  bool operator==(const OpenRsp&) const = default;
};
struct Close {
  uint32_t device_id = 0;
  bool operator==(const Close&) const = default;
};
struct Io {
  uint32_t device_id = 0;
  uint64_t sector = 0;
  IoOp op = IoOp::read;
  uint32_t flags = 0;    // IoFlag bits
  uint32_t bi_size = 0;  // bytes (see IoMsg)
  uint16_t prio = 0;
  bool operator==(const Io&) const = default;
};
struct Watch {
  uint64_t epoch = 0;  // the last WATCH_RSP epoch the client saw, 0 for none
  bool operator==(const Watch&) const = default;
};
struct WatchEntry {
  uint32_t device_id = 0;
  uint64_t nsectors = 0;
  bool operator==(const WatchEntry&) const = default;
};
// The entries as the server has them (all of them: the encoder writes what fits); decoded, the
// ones that came.
struct WatchRsp {
  uint64_t epoch = 0;
  uint32_t total = 0;               // devices the session has open
  std::vector<WatchEntry> entries;  // ascending device ids, at most `total`
  bool operator==(const WatchRsp&) const = default;
};

// What the transport delivered with a message: the request's direction and data length
// (write: the bytes sent; read: the size of the client's buffer).
struct Carrier {
  ibtrs::IoDir dir = ibtrs::IoDir::write;
  size_t data_len = 0;
  bool operator==(const Carrier&) const = default;
};
// How the client sends each request; the server's decoders insist on exactly this, except that
// the read buffers of SESS_INFO and OPEN may be larger than their responses.
inline constexpr Carrier kSessInfoCarrier{ibtrs::IoDir::read, sizeof(SessInfoRspMsg)};
inline constexpr Carrier kOpenCarrier{ibtrs::IoDir::read, sizeof(OpenRspMsg)};
inline constexpr Carrier kCloseCarrier{ibtrs::IoDir::write, 0};
// A WATCH's buffer holds at least the WATCH_RSP header; each kWatchEntryBytes more, one entry.
inline constexpr Carrier kWatchCarrier{ibtrs::IoDir::read, sizeof(WatchRspMsg)};
inline constexpr size_t kWatchEntryBytes = sizeof(WatchEntryMsg);
// The read buffer a WATCH needs for `entries` devices.
constexpr size_t watch_buffer_bytes(size_t entries) { return sizeof(WatchRspMsg) + entries * kWatchEntryBytes; }
Carrier carrier_of(const Io& io);

// ------------------------------------------------------------------------------------------
// Rules shared by encoders and decoders (EINVAL)

// 1..kDevNameMax bytes without NUL or other control characters. Path rules ("..", the search
// path) are the server's, not the wire's.
Status check_dev_name(std::string_view name);
// Block sizes powers of two (logical 512..64 KiB, physical >= logical), max_hw_sectors > 0, the
// size in bytes fits 64 bits, known cache policy bits.
Status check_geometry(const DeviceGeometry& g);
// A known op and flags (NOUNMAP only on WRITE_ZEROES, none on BLOCK_STATUS), bi_size a multiple
// of 512 (0 exactly for FLUSH, > 0 otherwise), and the byte range sector * 512 + bi_size fits 64
// bits.
Status check_io(const Io& io);

// ------------------------------------------------------------------------------------------
// Version negotiation

// Server, on SESS_INFO: the version both sides use from now on. EPROTONOSUPPORT below ours.
Result<uint8_t> negotiate_version(uint8_t client_ver);
// Client, on SESS_INFO_RSP to the version it proposed: EPROTO when the server answers a higher
// version than proposed, EPROTONOSUPPORT when it is below our minimum.
Result<uint8_t> accept_version(uint8_t proposed, uint8_t answered);

// ------------------------------------------------------------------------------------------
// Encoders: write one message at the start of `out` and return its length. ENOBUFS when `out`
// is too small, EINVAL when the message breaks the rules above.

Result<size_t> encode_sess_info(std::span<std::byte> out, const SessInfo& m);
Result<size_t> encode_sess_info_rsp(std::span<std::byte> out, const SessInfoRsp& m);
Result<size_t> encode_open(std::span<std::byte> out, const Open& m);
Result<size_t> encode_open_rsp(std::span<std::byte> out, const OpenRsp& m);
Result<size_t> encode_close(std::span<std::byte> out, const Close& m);
Result<size_t> encode_io(std::span<std::byte> out, const Io& m);
Result<size_t> encode_watch(std::span<std::byte> out, const Watch& m);
// Writes the header and as many entries as `out` holds after it (count says how many; total is
// m.total). EINVAL: epoch 0, more entries than total, ids not ascending, a size past 2^64 bytes.
Result<size_t> encode_watch_rsp(std::span<std::byte> out, const WatchRsp& m);
// The answer to a block_status IO over `range_len` bytes: the extents of a prefix of it.
// EINVAL: no extent or more than kMaxExtents, a length 0 or not a multiple of 512, extents that
// run past range_len, unknown flags.
Result<size_t> encode_block_status_rsp(std::span<std::byte> out, std::span<const Extent> extents,
                                       uint64_t range_len);

// ------------------------------------------------------------------------------------------
// Decoders of peer input

// The type of a message, before decoding it. EBADMSG: shorter than a header, unknown type.
Result<MsgType> peek_type(std::span<const std::byte> msg);

// Server side: a request's user header and its carrier.
Result<SessInfo> decode_sess_info(std::span<const std::byte> usr, Carrier c);
Result<Open> decode_open(std::span<const std::byte> usr, Carrier c);
Result<Close> decode_close(std::span<const std::byte> usr, Carrier c);
Result<Io> decode_io(std::span<const std::byte> usr, Carrier c);
Result<Watch> decode_watch(std::span<const std::byte> usr, Carrier c);
// Any of the five above, by type; responses (and unknown types) are EBADMSG here. A tagged
// struct rather than a std::variant: g++ 12 with ASan warns (falsely) about moving a variant
// that holds a std::string.
struct Request {
  MsgType type = MsgType::sess_info;  // which one member below was decoded
  SessInfo sess_info;
  Open open;
  Close close;
  Io io;
  Watch watch;
};
Result<Request> decode_request(std::span<const std::byte> usr, Carrier c);

// Client side: the read buffer the server answered into (it may be longer than the response).
Result<SessInfoRsp> decode_sess_info_rsp(std::span<const std::byte> buf);
// `ver`: the session's version; below kWatchVersion size_epoch is a reserved field (0).
Result<OpenRsp> decode_open_rsp(std::span<const std::byte> buf, uint8_t ver = kProtoVersion);
// EBADMSG: shorter than its header or than the entries it counts; EINVAL: reserved bytes set,
// epoch 0, count > total, ids not ascending, a size past 2^64 bytes.
Result<WatchRsp> decode_watch_rsp(std::span<const std::byte> buf);
// The answer to a block_status IO over `range_len` bytes, into `out` (nothing allocated).
// EBADMSG: shorter than its header or than the entries it counts, more than kMaxExtents;
// EINVAL: reserved bytes set, no extent, a length 0 or not a multiple of 512, extents that run
// past range_len, unknown flags.
Status decode_block_status_rsp(std::span<const std::byte> buf, uint64_t range_len, ExtentList& out);

}  // namespace ibnbd::proto
