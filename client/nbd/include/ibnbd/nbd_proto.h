// NBD wire format (NetworkBlockDevice/nbd doc/proto.md; "the spec" below): every message this
// server reads or writes, as big-endian wire structs that prove their size. Only this file
// knows the layout; the handshake and the transmission code speak the host-endian values.
//
// Everything on the wire is network byte order ("0xdeadbeef is used for literal hex numbers
// (which are always sent in network byte order)", spec "Conventions").
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "base/le.h"  // big-endian wire integers and BASE_WIRE_STRUCT, the size / layout proof

namespace ibnbd::nbd::wire {

// NBD is network byte order (IBTRS's ibtrs::Le is little-endian).
using base::be16;
using base::be32;
using base::be64;

// ---- magics ----
inline constexpr uint64_t kNbdMagic = 0x4e42444d41474943ull;   // "NBDMAGIC" (INIT_PASSWD)
inline constexpr uint64_t kOptMagic = 0x49484156454f5054ull;   // "IHAVEOPT"
inline constexpr uint64_t kRepMagic = 0x0003e889045565a9ull;   // option replies
inline constexpr uint32_t kRequestMagic = 0x25609513u;
inline constexpr uint32_t kSimpleReplyMagic = 0x67446698u;
inline constexpr uint32_t kStructuredReplyMagic = 0x668e33efu;

// ---- handshake flags (16 bits, server) and client flags (32 bits) ----
inline constexpr uint16_t kFlagFixedNewstyle = 1u << 0;
inline constexpr uint16_t kFlagNoZeroes = 1u << 1;
inline constexpr uint32_t kClientFixedNewstyle = 1u << 0;
inline constexpr uint32_t kClientNoZeroes = 1u << 1;
inline constexpr uint32_t kClientKnownFlags = kClientFixedNewstyle | kClientNoZeroes;

// ---- transmission flags (16 bits) ----
inline constexpr uint16_t kTxHasFlags = 1u << 0;
inline constexpr uint16_t kTxReadOnly = 1u << 1;
inline constexpr uint16_t kTxSendFlush = 1u << 2;
inline constexpr uint16_t kTxSendFua = 1u << 3;
inline constexpr uint16_t kTxRotational = 1u << 4;
inline constexpr uint16_t kTxSendTrim = 1u << 5;
inline constexpr uint16_t kTxSendWriteZeroes = 1u << 6;
inline constexpr uint16_t kTxSendDf = 1u << 7;
inline constexpr uint16_t kTxCanMultiConn = 1u << 8;
inline constexpr uint16_t kTxSendCache = 1u << 10;
inline constexpr uint16_t kTxSendFastZero = 1u << 11;

// ---- options ----
enum Opt : uint32_t {
  kOptExportName = 1,
  kOptAbort = 2,
  kOptList = 3,
  kOptStartTls = 5,
  kOptInfo = 6,
  kOptGo = 7,
  kOptStructuredReply = 8,
  kOptListMetaContext = 9,
  kOptSetMetaContext = 10,
};

// ---- option reply types; errors have bit 31 set ----
enum Rep : uint32_t {
  kRepAck = 1,
  kRepServer = 2,
  kRepInfo = 3,
  kRepMetaContext = 4,
  kRepErrUnsup = 0x80000001u,
  kRepErrPolicy = 0x80000002u,
  kRepErrInvalid = 0x80000003u,
  kRepErrPlatform = 0x80000004u,
  kRepErrTlsReqd = 0x80000005u,
  kRepErrUnknown = 0x80000006u,
  kRepErrShutdown = 0x80000007u,
  kRepErrBlockSizeReqd = 0x80000008u,
  kRepErrTooBig = 0x80000009u,
};

// ---- NBD_REP_INFO types ----
enum Info : uint16_t {
  kInfoExport = 0,
  kInfoName = 1,
  kInfoDescription = 2,
  kInfoBlockSize = 3,
};

// ---- commands and command flags ----
enum Cmd : uint16_t {
  kCmdRead = 0,
  kCmdWrite = 1,
  kCmdDisc = 2,
  kCmdFlush = 3,
  kCmdTrim = 4,
  kCmdCache = 5,
  kCmdWriteZeroes = 6,
  kCmdBlockStatus = 7,
};
inline constexpr uint16_t kCmdFlagFua = 1u << 0;
inline constexpr uint16_t kCmdFlagNoHole = 1u << 1;
inline constexpr uint16_t kCmdFlagDf = 1u << 2;
inline constexpr uint16_t kCmdFlagReqOne = 1u << 3;
inline constexpr uint16_t kCmdFlagFastZero = 1u << 4;

// ---- structured reply chunk types and flags ----
inline constexpr uint16_t kReplyFlagDone = 1u << 0;
enum ReplyType : uint16_t {
  kReplyNone = 0,
  kReplyOffsetData = 1,
  kReplyOffsetHole = 2,
  kReplyBlockStatus = 5,
  kReplyError = 0x8001,
  kReplyErrorOffset = 0x8002,
};

// ---- base:allocation: this server's id for it (any non-zero id; LIST answers 0) and flags ----
inline constexpr uint32_t kBaseAllocationId = 1;
inline constexpr uint32_t kStateHole = 1u << 0;
inline constexpr uint32_t kStateZero = 1u << 1;

// ---- error values (spec "Error values": only these may be sent) ----
enum Err : uint32_t {
  kEperm = 1,
  kEio = 5,
  kEnomem = 12,
  kEinval = 22,
  kEnospc = 28,
  kEoverflow = 75,
  kEnotsup = 95,
  kEshutdown = 108,
};

// ------------------------------------------------------------------------------------------
// Wire structs

// S: the first message of the newstyle handshake.
struct ServerGreeting {
  be64 nbd_magic;  // kNbdMagic
  be64 opt_magic;  // kOptMagic
  be16 flags;      // handshake flags
};
BASE_WIRE_STRUCT(ServerGreeting, 18);

// C: one option ("IHAVEOPT", option, length, then length bytes of data).
struct OptionHdr {
  be64 magic;   // kOptMagic
  be32 option;  // Opt
  be32 length;  // of the data that follows
};
BASE_WIRE_STRUCT(OptionHdr, 16);

// S: one reply to an option (fixed newstyle), then length bytes of data.
struct OptionReplyHdr {
  be64 magic;   // kRepMagic
  be32 option;  // the option replied to
  be32 type;    // Rep
  be32 length;  // of the data that follows
};
BASE_WIRE_STRUCT(OptionReplyHdr, 20);

// S: the answer to NBD_OPT_EXPORT_NAME (then 124 zero bytes unless NO_ZEROES was agreed).
struct ExportNameReply {
  be64 size;
  be16 flags;  // transmission flags
};
BASE_WIRE_STRUCT(ExportNameReply, 10);
inline constexpr size_t kExportNameZeroes = 124;

// NBD_REP_INFO payloads.
struct InfoExport {
  be16 type;  // kInfoExport
  be64 size;
  be16 flags;  // transmission flags
};
BASE_WIRE_STRUCT(InfoExport, 12);
struct InfoBlockSize {
  be16 type;  // kInfoBlockSize
  be32 minimum;
  be32 preferred;
  be32 maximum;
};
BASE_WIRE_STRUCT(InfoBlockSize, 14);

// C: a transmission request (then `length` bytes of data for NBD_CMD_WRITE).
struct Request {
  be32 magic;  // kRequestMagic
  be16 flags;  // command flags
  be16 type;   // Cmd
  be64 handle;
  be64 offset;
  be32 length;
};
BASE_WIRE_STRUCT(Request, 28);

// S: a simple reply (then the data of a successful READ).
struct SimpleReply {
  be32 magic;  // kSimpleReplyMagic
  be32 error;  // Err or 0
  be64 handle;
};
BASE_WIRE_STRUCT(SimpleReply, 16);

// S: a structured reply chunk header (then `length` bytes of payload).
struct ChunkHdr {
  be32 magic;  // kStructuredReplyMagic
  be16 flags;  // kReplyFlagDone on the last chunk
  be16 type;   // ReplyType
  be64 handle;
  be32 length;
};
BASE_WIRE_STRUCT(ChunkHdr, 20);

// NBD_REPLY_TYPE_OFFSET_DATA: header plus the offset, then the data.
struct OffsetDataChunk {
  ChunkHdr hdr;
  be64 offset;
};
BASE_WIRE_STRUCT(OffsetDataChunk, 28);

// NBD_REPLY_TYPE_ERROR: header, error, message length; the message follows.
struct ErrorChunk {
  ChunkHdr hdr;
  be32 error;
  be16 msg_len;
};
BASE_WIRE_STRUCT(ErrorChunk, 26);

// NBD_REPLY_TYPE_BLOCK_STATUS: header plus the context id, then the descriptors.
struct BlockStatusHdr {
  ChunkHdr hdr;
  be32 context_id;
};
BASE_WIRE_STRUCT(BlockStatusHdr, 24);
struct BlockDescriptor {
  be32 length;  // of the extent
  be32 status;  // kStateHole / kStateZero
};
BASE_WIRE_STRUCT(BlockDescriptor, 8);

}  // namespace ibnbd::nbd::wire
