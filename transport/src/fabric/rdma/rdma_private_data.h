// How the rdma provider carries connection private data with its exact length. Private to
// rdma_fabric.cc; header-only so the encoding is testable without an RDMA device.
//
// The problem: on IB and RoCE the CM messages have fixed-size private data fields and no length
// (IBTA CM REQ 92 bytes, of which rdma_cm's own cma_hdr takes 36; REP 196; REJ 148), so the
// kernel reports the whole field: a 10-byte connect payload arrives as 56 bytes, zero-padded
// (cma_ib_req_handler sets private_data_len = IB_CM_REQ_PRIVATE_DATA_SIZE - offset). iWARP's MPA
// frames carry the length and rdma_cm reports it exactly.
//
// REQ (connect): the 56 bytes are the user's limit (kMaxPrivateData), and 56 bytes cannot hold
// every string of 0..56 bytes plus its length, so the length cannot ride inside the payload
// without lowering the user's limit. It rides instead in two REQ fields that rdma_cm hands to the
// passive side untouched and that configure nothing: responder_resources and initiator_depth.
// The QP's RDMA READ/atomic depths come from the REP (the passive side's accept parameters,
// cm_rep_handler), not from the REQ, so the REQ values are only hints; IBTRS issues no RDMA READ
// anyway. Each field carries 3 bits (len >> 3, len & 7), so both stay <= 7, below every device's
// max_qp_rd_atom / max_qp_init_rd_atom that librdmacm checks them against (ucma_valid_param).
// The IB CM reports the REQ's fields from the responder's point of view (cm_format_req_event
// swaps them), so the passive side reads initiator_depth as the high bits.
//
// REP (accept) and REJ (reject): the fields have 196 and 148 bytes, so a 4-byte header in front
// of the user's data costs the user nothing; its magic also tells a consumer reject from one the
// CM generated itself (no listener: IB_CM_REJ_INVALID_SERVICE_ID, zero data).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>

#include "fabric/fabric.h"

namespace ibtrs::fabric::rdma_pd {

// The user bytes an IB CM REQ has room for once rdma_cm's cma_hdr is in: 92 - 36.
inline constexpr size_t kReqRoom = 56;
static_assert(kMaxPrivateData <= kReqRoom, "connect private data must fit the IB CM REQ");

struct ReqLength {
  uint8_t responder_resources;
  uint8_t initiator_depth;
};

constexpr ReqLength encode_req_length(size_t len) {
  return ReqLength{static_cast<uint8_t>(len >> 3), static_cast<uint8_t>(len & 7)};
}

// `event_*` are the CONNECT_REQUEST event's param.conn fields, `reported` its private_data_len.
// nullopt when the fields do not hold our encoding (a peer that is not this provider).
constexpr std::optional<size_t> decode_req_length(uint8_t event_responder_resources,
                                                  uint8_t event_initiator_depth, size_t reported) {
  if (event_responder_resources > 7 || event_initiator_depth > 7) return std::nullopt;
  size_t len = (static_cast<size_t>(event_initiator_depth) << 3) | event_responder_resources;
  if (len > kMaxPrivateData || len > reported) return std::nullopt;
  return len;
}

// Header in front of accept and reject private data.
inline constexpr uint8_t kMagic0 = 'I';
inline constexpr uint8_t kMagic1 = 'B';
inline constexpr uint8_t kVersion = 1;
inline constexpr size_t kHeaderSize = 4;  // magic0, magic1, version, length
inline constexpr size_t kReplyMax = kHeaderSize + kMaxPrivateData;
// IB_CM_REJ_PRIVATE_DATA_SIZE (148) is the smaller of REP and REJ; iWARP allows 512.
static_assert(kReplyMax <= 148, "accept/reject private data must fit the IB CM REJ");

// Writes header + data into `out` (kReplyMax bytes); returns the length to send.
inline size_t encode_reply(std::span<const std::byte> data, std::byte (&out)[kReplyMax]) {
  out[0] = std::byte{kMagic0};
  out[1] = std::byte{kMagic1};
  out[2] = std::byte{kVersion};
  out[3] = std::byte{static_cast<uint8_t>(data.size())};
  if (!data.empty()) std::memcpy(out + kHeaderSize, data.data(), data.size());
  return kHeaderSize + data.size();
}

// The user's data inside a received reply, or nullopt when it carries no header of ours.
inline std::optional<std::span<const std::byte>> decode_reply(std::span<const std::byte> in) {
  if (in.size() < kHeaderSize || in[0] != std::byte{kMagic0} || in[1] != std::byte{kMagic1} ||
      in[2] != std::byte{kVersion}) {
    return std::nullopt;
  }
  size_t len = static_cast<size_t>(in[3]);
  if (len > kMaxPrivateData || kHeaderSize + len > in.size()) return std::nullopt;
  return in.subspan(kHeaderSize, len);
}

}  // namespace ibtrs::fabric::rdma_pd
