// IBTRS wire protocol: every message and bit layout of the session layer, and nothing else.
// (Kernel counterpart: drivers/infiniband/ulp/rtrs/rtrs-pri.h.) docs/protocol.md describes the
// same for humans; every struct below proves its size.
//
// Where a message travels:
//   CON_REQ / CON_RSP     private data of connect / accept / reject (<= 56 bytes, fabric limit)
//   INFO_REQ / INFO_RSP   SEND / RECV on the service connection (connection 0 of a path)
//   AUTH_*                SEND / RECV on the service connection, between INFO_REQ and INFO_RSP
//                         when the client authenticates (CON_REQ flag kConReqAuth)
//   IO requests           one WRITE_WITH_IMM into the server chunk of the request's permit:
//                           write: [data][user header][WriteMsg]
//                           read:  [user header][ReadMsg + descriptors]
//                         the immediate says which chunk and where in it the message is
//   IO responses          WRITE_WITH_IMM (read: after writing the data into the client's buffer);
//                         the immediate carries the permit id and errno
//   heartbeats            zero-length WRITE_WITH_IMM with HB_MSG / HB_ACK immediates
//
// Decoders validate peer input and return an error with a reason; they never assert on it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "base/le.h"
#include "ibtrs/result.h"

namespace ibtrs::proto {

using base::le16;
using base::le32;
using base::le64;

inline constexpr uint16_t kMagic = 0x1BBD;       // RTRS's magic
inline constexpr uint8_t kVersionMajor = 2;      // only the major must match (kernel rule)
// 2.1: host authentication (AUTH_*); 2.2: chunk sets (kConRspChunkSets); 2.3: the failover
// fence (PATH_FENCE / FENCE_RSP, kConRspFence)
inline constexpr uint8_t kVersionMinor = 3;
inline constexpr uint16_t kVersion = (kVersionMajor << 8) | kVersionMinor;
inline constexpr uint16_t version_major(uint16_t v) { return v >> 8; }
inline constexpr uint16_t version_minor(uint16_t v) { return v & 0xff; }
// The first minor version whose clients take kConRspChunkSets (older ones refuse the bit).
inline constexpr uint8_t kMinorChunkSets = 2;
// The first minor version whose clients take kConRspFence (older ones refuse unknown bits).
inline constexpr uint8_t kMinorFence = 3;

// Server defaults (kernel: rtrs-srv module parameters).
inline constexpr uint32_t kDefaultChunkSize = 128 * 1024;  // max_chunk_size, power of two
inline constexpr uint32_t kMinChunkSize = 8 * 1024;
inline constexpr uint32_t kMaxChunkSize = 16u << 20;       // bounded by the immediate (below)
inline constexpr uint16_t kDefaultQueueDepth = 256;        // sess_queue_depth (512 in the kernel)
inline constexpr uint32_t kMaxHdrSize = 4096;              // user header + IO message
inline constexpr size_t kNameMax = 64;                     // session and path names on the wire

using Uuid = std::array<uint8_t, 16>;

// ------------------------------------------------------------------------------------------
// Connection establishment (private data)

// CON_REQ flags
inline constexpr uint16_t kConReqFirstConn = 1u << 0;  // first connection of a new path
// The client authenticates the path (DH-HMAC-CHAP after INFO_REQ). A server that requires
// authentication refuses a CON_REQ without it with EACCES, so a client that cannot
// authenticate (or an older one) learns why at once; every connection of a path carries the
// same value. (Minor version 1.)
inline constexpr uint16_t kConReqAuth = 1u << 1;

struct ConReq {
  le16 magic;          // kMagic
  le16 version;        // kVersion
  le16 cid;            // connection id in the path: 0 = service connection, 1..cid_num-1 IO
  le16 cid_num;        // connections in the path (IO connections + 1)
  le16 recon_cnt;      // reconnect counter of the path: tells a reconnect from a stale path
  le16 flags;          // kConReqFirstConn, kConReqAuth
  le32 reserved0;      // 0
  uint8_t sess_uuid[16];  // session identity (random per client session)
  uint8_t path_uuid[16];  // path identity (random per path, kept across reconnects)
  uint8_t reserved1[8];   // 0
};
BASE_WIRE_STRUCT(ConReq, 56);

// CON_RSP flags
inline constexpr uint32_t kConRspInvalidatePerIo = 1u << 0;  // chunk keys change per IO (rdma)
// Chunk sets (2.2): a request may span up to kMaxSetChunks consecutive chunks, so max_io_size
// may exceed chunk_size - max_hdr_size (docs/protocol.md, "Chunk sets"). The chunks are one
// contiguous range under one key per path. Sent only to a client whose CON_REQ has minor
// version >= kMinorChunkSets, and never with kConRspInvalidatePerIo (a key per chunk).
inline constexpr uint32_t kConRspChunkSets = 1u << 1;
// The failover fence (2.3): the server answers PATH_FENCE on a path's service connection
// (docs/protocol.md, "Failover fence"). Sent only to a client whose CON_REQ has minor version
// >= kMinorFence. Without it a client fails writes over at once, as before.
inline constexpr uint32_t kConRspFence = 1u << 2;
inline constexpr uint32_t kConRspKnownFlags = kConRspInvalidatePerIo | kConRspChunkSets | kConRspFence;
// The most chunks one request may span: a client takes a set's permits from one 64-bit word
// of its permit bitmap at once.
inline constexpr uint32_t kMaxSetChunks = 64;
// The chunks a request's extent (write: data + user header + WriteMsg; read: max_hdr_size +
// data) takes.
inline constexpr uint32_t set_chunks(uint64_t extent, uint32_t chunk_size) {
  return static_cast<uint32_t>((extent + chunk_size - 1) / chunk_size);
}

struct ConRsp {
  le16 magic;          // kMagic
  le16 version;        // kVersion
  le16 errno_;         // 0 on accept; positive errno on reject
  le16 queue_depth;    // chunks (= client permits) of the session
  le32 max_io_size;    // largest data part of one request (chunk size - max_hdr_size, more
                       // with kConRspChunkSets)
  le32 max_hdr_size;   // largest user header + IO message
  le32 flags;          // kConRspInvalidatePerIo, kConRspChunkSets
  le32 chunk_size;     // bytes per chunk (power of two)
  uint8_t reserved[32];  // 0
};
BASE_WIRE_STRUCT(ConRsp, 56);

// ------------------------------------------------------------------------------------------
// Service messages (SEND/RECV on connection 0)

enum class MsgType : uint16_t {
  info_req = 1,
  info_rsp = 2,
  write = 3,     // trailer of a write request in a chunk
  read = 4,      // trailer of a read request in a chunk
  rkey_rsp = 5,  // new chunk key after per-IO invalidation
  auth_challenge = 6,  // server -> client: DH-HMAC-CHAP challenge
  auth_reply = 7,      // client -> server: the host's response (and its challenge back)
  auth_success = 8,    // server -> client: accepted (with the server's response)
  auth_failure = 9,    // server -> client: refused; the server closes the path
  path_fence = 10,     // client -> server: close an incarnation of another path of the session
  fence_rsp = 11,      // server -> client: nothing of that incarnation runs any more
};

// The type of a service message (INFO_*, AUTH_*), or EPROTO when it is shorter than a type.
Result<MsgType> peek_msg_type(std::span<const std::byte> msg);

struct InfoReq {
  le16 type;                 // MsgType::info_req
  le16 reserved0;            // 0
  uint8_t sessname[kNameMax];  // session name, NUL padded
  uint8_t pathname[kNameMax];  // "src@dst" of the path, NUL padded
  uint8_t reserved1[12];     // 0
};
BASE_WIRE_STRUCT(InfoReq, 144);

// One server chunk as the client sees it.
struct ChunkDesc {
  le64 addr;   // remote address of the chunk
  le32 key;    // rkey to write it with
  le32 len;    // chunk size
};
BASE_WIRE_STRUCT(ChunkDesc, 16);

struct InfoRspHeader {
  le16 type;       // MsgType::info_rsp
  le16 sg_cnt;     // number of ChunkDesc that follow (= queue depth)
  le32 reserved;   // 0
};
BASE_WIRE_STRUCT(InfoRspHeader, 8);

inline constexpr size_t info_rsp_size(uint16_t chunks) {
  return sizeof(InfoRspHeader) + size_t{chunks} * sizeof(ChunkDesc);
}

// ------------------------------------------------------------------------------------------
// Authentication (DH-HMAC-CHAP, NVMe TP 8006; the computations in auth/chap.h)
//
// After INFO_REQ of a path whose CON_REQ had kConReqAuth, the server answers AUTH_CHALLENGE
// instead of INFO_RSP; the client answers AUTH_REPLY; the server sends AUTH_SUCCESS and then
// INFO_RSP, or AUTH_FAILURE and closes the path. The largest, AUTH_REPLY (336 bytes), fits the
// server's service RECV slots (512 bytes).

inline constexpr uint8_t kAuthHashSha256 = 1;   // TP 8006 HashID of HMAC-SHA-256
inline constexpr uint8_t kAuthDhX25519 = 0x20;  // ours: TP 8006 numbers FFDHE groups only (1..5)
inline constexpr size_t kAuthValueLen = 32;     // nonces, responses, X25519 public values
inline constexpr size_t kAuthHostField = 224;   // host id (1..223 bytes) + NUL padding

struct AuthChallenge {
  le16 type;                          // MsgType::auth_challenge
  le16 tid;                           // transaction id: random per exchange
  le32 seqnum;                        // S1: random, non-zero
  uint8_t hash_id;                    // kAuthHashSha256
  uint8_t dh_group;                   // kAuthDhX25519
  le16 reserved0;                     // 0
  uint8_t nonce[kAuthValueLen];       // C1
  uint8_t dh_public[kAuthValueLen];   // the server's ephemeral X25519 public value
  uint8_t reserved1[4];               // 0
};
BASE_WIRE_STRUCT(AuthChallenge, 80);

// AUTH_REPLY flags
inline constexpr uint16_t kAuthReplyBidirectional = 1u << 0;  // challenge2 / seqnum2 are valid

struct AuthReply {
  le16 type;                          // MsgType::auth_reply
  le16 tid;                           // the challenge's
  le16 flags;                         // kAuthReplyBidirectional
  uint8_t hash_id;                    // the challenge's
  uint8_t dh_group;                   // the challenge's
  le32 seqnum2;                       // S2 for the server's response; 0 unless bidirectional
  uint8_t dh_public[kAuthValueLen];   // the client's ephemeral X25519 public value
  uint8_t response[kAuthValueLen];    // R1
  uint8_t challenge2[kAuthValueLen];  // C2; zeros unless bidirectional
  uint8_t host[kAuthHostField];       // host id, NUL padded
  uint8_t reserved[4];                // 0
};
BASE_WIRE_STRUCT(AuthReply, 336);

// AUTH_SUCCESS flags
inline constexpr uint16_t kAuthSuccessResponse = 1u << 0;  // response holds R2

struct AuthSuccess {
  le16 type;                          // MsgType::auth_success
  le16 tid;
  le16 flags;                         // kAuthSuccessResponse
  le16 reserved0;                     // 0
  uint8_t response[kAuthValueLen];    // R2; zeros without kAuthSuccessResponse
};
BASE_WIRE_STRUCT(AuthSuccess, 40);

struct AuthFailure {
  le16 type;                          // MsgType::auth_failure
  le16 tid;                           // the challenge's, or 0 before one
  le16 reason;                        // errno: EACCES (not authenticated), EPROTO (bad message)
  le16 reserved0;                     // 0
};
BASE_WIRE_STRUCT(AuthFailure, 8);

// Checked copies of the messages (the views own their bytes: nothing refers back to a buffer
// the peer may still write).
struct AuthChallengeView {
  uint16_t tid = 0;
  uint32_t seqnum = 0;
  std::array<uint8_t, kAuthValueLen> nonce{};
  std::array<uint8_t, kAuthValueLen> dh_public{};
};
struct AuthReplyView {
  uint16_t tid = 0;
  bool bidirectional = false;
  uint32_t seqnum2 = 0;
  std::array<uint8_t, kAuthValueLen> dh_public{};
  std::array<uint8_t, kAuthValueLen> response{};
  std::array<uint8_t, kAuthValueLen> challenge2{};
  std::string host;
};
struct AuthSuccessView {
  uint16_t tid = 0;
  bool has_response = false;
  std::array<uint8_t, kAuthValueLen> response{};
};
struct AuthFailureView {
  uint16_t tid = 0;
  uint16_t reason = 0;
};

// ------------------------------------------------------------------------------------------
// Failover fence (2.3, kConRspFence; docs/protocol.md, "Failover fence")
//
// A write failed over from a broken connection of path Y may still sit, landed but not yet
// polled, at the server on Y. The client resends it only after PATH_FENCE {Y, recon_cnt} over
// the service connection of another connected path is answered by FENCE_RSP: by then the
// server has closed that incarnation of Y (or it was closed already), so its old copy either
// started before the answer or never runs. Both messages are one exact size; the server looks
// the path up in the carrier's session only.

struct PathFence {
  le16 type;              // MsgType::path_fence
  le16 reserved0;         // 0
  uint8_t path_uuid[16];  // the path to fence (its CON_REQ path_uuid)
  le16 recon_cnt;         // the broken incarnation: it and every older one are fenced
  le16 reserved1;         // 0
  uint8_t reserved2[8];   // 0
};
BASE_WIRE_STRUCT(PathFence, 32);

// FENCE_RSP status: both mean "fenced"; the difference is for statistics and logs.
inline constexpr uint16_t kFenceClosed = 0;   // the named incarnation was live: closed now
inline constexpr uint16_t kFenceNotLive = 1;  // unknown here, closed already, or superseded

struct FenceRsp {
  le16 type;              // MsgType::fence_rsp
  le16 status;            // kFenceClosed, kFenceNotLive
  uint8_t path_uuid[16];  // the PATH_FENCE's
  le16 recon_cnt;         // the PATH_FENCE's
  le16 reserved0;         // 0
  uint8_t reserved1[8];   // 0
};
BASE_WIRE_STRUCT(FenceRsp, 32);

struct FenceView {
  Uuid path_uuid{};
  uint16_t recon_cnt = 0;
  uint16_t status = 0;  // FENCE_RSP only
};

// ------------------------------------------------------------------------------------------
// IO messages, written at the end of a request in its chunk

struct WriteMsg {
  le16 type;       // MsgType::write
  le16 usr_len;    // user header bytes, just before this message
  le32 data_len;   // data bytes, at the start of the chunk
};
BASE_WIRE_STRUCT(WriteMsg, 8);

// ReadMsg flags
// The descriptors' keys are single-use: the client revokes them when the response arrives (a
// window per descriptor), so the server must not write them after its response. Set on every
// read by this client (docs/protocol.md, "Read invalidation").
inline constexpr uint16_t kReadNeedInvalidate = 1u << 0;

// Where the server writes read data: the client's registered buffer, in up to kMaxReadDescs
// pieces.
struct BufDesc {
  le64 addr;   // client address
  le32 key;    // client rkey
  le32 len;    // bytes
};
BASE_WIRE_STRUCT(BufDesc, 16);

inline constexpr uint16_t kMaxReadDescs = 64;

struct ReadMsgHeader {
  le16 type;       // MsgType::read
  le16 usr_len;    // user header bytes, just before this message
  le16 flags;      // kReadNeedInvalidate
  le16 sg_cnt;     // BufDesc entries that follow, 1..kMaxReadDescs
};
BASE_WIRE_STRUCT(ReadMsgHeader, 8);

struct RkeyRsp {
  le16 type;       // MsgType::rkey_rsp
  le16 buf_id;     // chunk whose key changed
  le32 rkey;       // its new key
};
BASE_WIRE_STRUCT(RkeyRsp, 8);

// ------------------------------------------------------------------------------------------
// Immediates (32 bits; the rdma fabric carries them big-endian like the kernel)
//
//   [31..28] type   [27..0] payload
//   IO_REQ   payload = chunk id << offset_bits | offset of the IO message in the chunk
//   IO_RSP   payload = (errno & 0x1ff) << 19 | permit id (19 bits)
//   HB_MSG / HB_ACK  payload 0

enum class ImmType : uint8_t {
  io_req = 0,
  io_rsp = 1,
  io_rsp_w_inv = 2,
  hb_msg = 8,
  hb_ack = 9,
};

inline constexpr uint32_t kImmPayloadBits = 28;
inline constexpr uint32_t kImmPayloadMask = (1u << kImmPayloadBits) - 1;
inline constexpr uint32_t kRspIdBits = 19;
inline constexpr uint32_t kRspErrnoBits = 9;
static_assert(kRspIdBits + kRspErrnoBits == kImmPayloadBits);

// How a session splits IO_REQ payloads: chunk-id bits for its queue depth, the rest offset.
struct ImmLayout {
  uint32_t id_bits = 0;
  uint32_t offset_bits = 0;
};
// EINVAL when queue_depth is 0 or the chunk size does not fit the offset bits left over
// (e.g. 512 chunks leave 19 bits: chunks up to 512 KiB).
Result<ImmLayout> imm_layout(uint32_t queue_depth, uint32_t chunk_size);

inline constexpr uint32_t make_imm(ImmType t, uint32_t payload) {
  return (static_cast<uint32_t>(t) << kImmPayloadBits) | (payload & kImmPayloadMask);
}
inline constexpr ImmType imm_type(uint32_t imm) { return static_cast<ImmType>(imm >> kImmPayloadBits); }
inline constexpr uint32_t imm_payload(uint32_t imm) { return imm & kImmPayloadMask; }

// EINVAL when chunk_id or offset does not fit its field.
Result<uint32_t> encode_io_req_imm(const ImmLayout& l, uint32_t chunk_id, uint32_t offset);
struct IoReqImm {
  uint32_t chunk_id;
  uint32_t offset;
};
IoReqImm decode_io_req_imm(const ImmLayout& l, uint32_t imm);

// EINVAL when the permit id does not fit 19 bits. errno is clamped to 9 bits (0..511).
Result<uint32_t> encode_io_rsp_imm(uint32_t permit_id, int err, bool with_invalidate = false);
struct IoRspImm {
  uint32_t permit_id;
  int err;  // positive errno, 0 on success
};
IoRspImm decode_io_rsp_imm(uint32_t imm);

// ------------------------------------------------------------------------------------------
// Decoders of peer input. Each returns EPROTO (or EINVAL for bad parameters) and sets `why`.

// Server side of connection establishment.
Result<ConReq> parse_con_req(std::span<const std::byte> pd, std::string* why);
// Client side. A reject (errno != 0) decodes fine; the caller looks at errno_.
Result<ConRsp> parse_con_rsp(std::span<const std::byte> pd, std::string* why);

struct InfoReqView {
  std::string sessname;
  std::string pathname;
};
Result<InfoReqView> parse_info_req(std::span<const std::byte> msg, std::string* why);
// `expect_chunks` is the queue depth of the CON_RSP; every chunk must have `chunk_size` bytes.
Result<std::span<const ChunkDesc>> parse_info_rsp(std::span<const std::byte> msg,
                                                  uint16_t expect_chunks, uint32_t chunk_size,
                                                  std::string* why);

// Authentication messages: exact size, known type, reserved bytes zero, our algorithms.
// Challenge: non-zero seqnum. Reply: a valid host id (ibtrs/auth.h), challenge2 and seqnum2
// non-zero exactly when bidirectional. Success: response zero unless flagged.
Result<AuthChallengeView> parse_auth_challenge(std::span<const std::byte> msg, std::string* why);
Result<AuthReplyView> parse_auth_reply(std::span<const std::byte> msg, std::string* why);
Result<AuthSuccessView> parse_auth_success(std::span<const std::byte> msg, std::string* why);
Result<AuthFailureView> parse_auth_failure(std::span<const std::byte> msg, std::string* why);

// Fence messages: exact size, their type, reserved bytes zero, a non-nil path uuid; FENCE_RSP
// a known status.
Result<FenceView> parse_path_fence(std::span<const std::byte> msg, std::string* why);
Result<FenceView> parse_fence_rsp(std::span<const std::byte> msg, std::string* why);

// A request found in a chunk: the chunk's bytes, the immediate's offset of the IO message.
struct WriteReq {
  std::span<const std::byte> data;  // in the chunk
  std::span<const std::byte> usr;   // in the copy
};
struct ReadReq {
  std::span<const std::byte> data;  // where the server puts the data (in the chunks; set only
                                    // by the chunk-set parser)
  std::span<const std::byte> usr;   // in the copy
  uint16_t flags;
  std::span<const BufDesc> descs;   // in the copy
  uint64_t total_len;  // sum of the descriptors' lengths
};
enum class IoKind : uint8_t { write, read };
struct IoReq {
  IoKind kind;
  WriteReq write;
  ReadReq read;
};
// Takes an IO request out of `chunk` (the whole chunk, which the client can rewrite at any
// time) at the immediate's `offset`: its header bytes - the IO message, the user header and the
// read descriptors - are copied into `copy` (at least max_hdr_size bytes, server memory) once,
// each byte read once, and only the copy is validated against the session limits and returned.
// The write payload is the one part left in the chunk (write.data): the server hands it on as
// the client's data. EINVAL when `copy` is smaller than max_hdr_size.
Result<IoReq> parse_io_req(std::span<const std::byte> chunk, uint32_t offset,
                           uint32_t max_hdr_size, std::span<std::byte> copy, std::string* why);

// The same over a session's chunks with chunk sets (kConRspChunkSets): `chunks` is every chunk
// of the session (queue depth x chunk_size bytes), `lead` the chunk the immediate names and
// `offset` the immediate's offset in it. A write's data starts at the start of a chunk and may
// begin up to kMaxSetChunks - 1 chunks before the lead; a read's data area (max_hdr_size past
// the lead's start) may run into the chunks after it. Data longer than `max_io_size`, or that
// leaves the session's chunks, is refused. With `max_io_size` = chunk_size - max_hdr_size and
// lead's chunk alone this is the single-chunk rule above.
struct SetGeometry {
  uint32_t chunk_size = 0;
  uint32_t max_hdr_size = 0;
  uint32_t max_io_size = 0;
};
Result<IoReq> parse_io_req(std::span<const std::byte> chunks, const SetGeometry& g, uint32_t lead,
                           uint32_t offset, std::span<std::byte> copy, std::string* why);

// Builders (our own output).
ConReq make_con_req(uint16_t cid, uint16_t cid_num, uint16_t recon_cnt, bool first_conn,
                    const Uuid& sess, const Uuid& path, bool auth = false);
// `max_io_size` 0: chunk_size - max_hdr_size (the only value without kConRspChunkSets).
ConRsp make_con_rsp(int err, uint16_t queue_depth, uint32_t chunk_size, uint32_t max_hdr_size,
                    uint32_t flags, uint32_t max_io_size = 0);
// EINVAL when a name does not fit kNameMax - 1 bytes.
Result<InfoReq> make_info_req(std::string_view sessname, std::string_view pathname);

// EINVAL for what the parsers would refuse (a zero seqnum, a bad host id, ...).
Result<AuthChallenge> make_auth_challenge(const AuthChallengeView& v);
Result<AuthReply> make_auth_reply(const AuthReplyView& v);
AuthSuccess make_auth_success(const AuthSuccessView& v);
AuthFailure make_auth_failure(uint16_t tid, int reason);
PathFence make_path_fence(const Uuid& path, uint16_t recon_cnt);
FenceRsp make_fence_rsp(uint16_t status, const Uuid& path, uint16_t recon_cnt);

template <typename T>
std::span<const std::byte> as_bytes_of(const T& v) {
  return std::span<const std::byte>(reinterpret_cast<const std::byte*>(&v), sizeof(T));
}

}  // namespace ibtrs::proto
