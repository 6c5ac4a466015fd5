// Wire format of the tcp provider: software RDMA over one TCP stream per connection.
// The only place this layout lives; docs/fabric.md describes it for humans.
//
// A stream is a sequence of frames, each a 32-byte FrameHeader and `length` payload bytes.
// The first frame in each direction is the handshake (CONNECT_REQ, then CONNECT_RSP), whose
// payload is a ConnectBody. After it come data frames (SEND, WRITE, WRITE_IMM), which the peer
// counts from 0, and control frames (ACK, NAK, DISCONNECT). Every header carries `ack`: how many
// of the peer's data frames this side has placed, which is how a sender learns that its work
// requests completed (RC acknowledgement semantics). A receiver sends a standalone ACK only for
// frames flagged kFlagAckRequested (the sender flags signalled requests and those that fill half
// its send queue); otherwise acks ride on whatever it sends next.
#pragma once

#include <cstddef>
#include <cstdint>

#include "base/le.h"
#include "fabric/fabric.h"

namespace ibtrs::fabric::tcp {

using base::le16;
using base::le32;
using base::le64;

inline constexpr uint32_t kMagic = 0x46544249;  // "IBTF" in little-endian bytes
inline constexpr uint16_t kVersion = 1;
// Verbs allows messages up to 2^31 bytes; so do we.
inline constexpr uint32_t kMaxPayload = 1u << 31;

enum class FrameType : uint8_t {
  connect_req = 1,  // client -> server: ConnectBody with the connect private data
  connect_rsp = 2,  // server -> client: ConnectBody, verdict accept/reject + private data
  send = 3,         // payload scattered into the peer's next posted RECV
  write = 4,        // payload placed at (rkey, remote_addr)
  write_imm = 5,    // as write, then consumes a RECV and raises `imm`
  ack = 6,          // no payload; only the ack field matters
  nak = 7,          // the peer's data frame number `ack` failed with `status`; stream ends
  disconnect = 8,   // orderly disconnect; stream ends
};

// FrameHeader::flags
inline constexpr uint8_t kFlagAckRequested = 1u << 0;  // data frames: acknowledge promptly
inline constexpr uint8_t kKnownFlags = kFlagAckRequested;

struct FrameHeader {
  uint8_t type;         // FrameType
  uint8_t status;       // nak: fabric::WcStatus of the failed frame; 0 otherwise
  uint8_t flags;        // data frames: kFlagAckRequested; 0 otherwise
  uint8_t reserved0;    // 0
  le32 length;          // payload bytes after the header (data and connect frames), else 0
  le32 ack;             // cumulative count of the peer's data frames placed here (mod 2^32)
  le32 imm;             // write_imm: the immediate, host order value; 0 otherwise
  le64 remote_addr;     // write, write_imm: target address inside the region of rkey; else 0
  le32 rkey;            // write, write_imm: target region key; else 0
  le32 reserved1;       // 0
};
BASE_WIRE_STRUCT(FrameHeader, 32);

struct ConnectBody {
  le32 magic;                          // kMagic
  le16 version;                        // kVersion; a server refuses other major versions
  uint8_t private_len;                 // valid bytes of private_data, <= kMaxPrivateData
  uint8_t verdict;                     // connect_rsp: kVerdict*; connect_req: 0
  uint8_t private_data[kMaxPrivateData];  // the user's private data, zero padded
};
BASE_WIRE_STRUCT(ConnectBody, 64);

// CONNECT_RSP verdicts. kVerdictTlsRequired goes in plaintext to a peer that did not start TLS
// on a listener that requires it (its connect fails with EPROTONOSUPPORT).
inline constexpr uint8_t kVerdictReject = 0;
inline constexpr uint8_t kVerdictAccept = 1;
inline constexpr uint8_t kVerdictTlsRequired = 2;

inline bool is_data_frame(FrameType t) {
  return t == FrameType::send || t == FrameType::write || t == FrameType::write_imm;
}

// Syntactic checks of a header from the peer (peer input is validated, never asserted):
// known type, reserved fields zero, fields that the type does not use zero, length in range.
// Semantic checks (rkey, bounds, RECV space, ack range) happen where the state is known.
bool header_is_valid(const FrameHeader& h);

FrameHeader make_header(FrameType type, uint32_t length = 0);

}  // namespace ibtrs::fabric::tcp
