#include "fabric/tcp/tcp_wire.h"

#include <cstring>

namespace ibtrs::fabric::tcp {

bool header_is_valid(const FrameHeader& h) {
  if (h.reserved0 != 0 || h.reserved1.get() != 0) return false;
  const auto type = static_cast<FrameType>(h.type);
  if ((h.flags & ~kKnownFlags) != 0 || (h.flags != 0 && !is_data_frame(type))) return false;
  const uint32_t len = h.length.get();
  const bool has_target = h.rkey.get() != 0 || h.remote_addr.get() != 0;
  switch (type) {
    case FrameType::connect_req:
    case FrameType::connect_rsp:
      return h.status == 0 && len == sizeof(ConnectBody) && h.imm.get() == 0 && !has_target;
    case FrameType::send:
      return h.status == 0 && len <= kMaxPayload && h.imm.get() == 0 && !has_target;
    case FrameType::write:
      return h.status == 0 && len <= kMaxPayload && h.imm.get() == 0;
    case FrameType::write_imm:
      return h.status == 0 && len <= kMaxPayload;
    case FrameType::ack:
    case FrameType::disconnect:
      return h.status == 0 && len == 0 && h.imm.get() == 0 && !has_target;
    case FrameType::nak:
      return h.status > static_cast<uint8_t>(WcStatus::success) &&
             h.status <= static_cast<uint8_t>(WcStatus::fatal_error) && len == 0 &&
             h.imm.get() == 0 && !has_target;
  }
  return false;
}

FrameHeader make_header(FrameType type, uint32_t length) {
  FrameHeader h;
  std::memset(&h, 0, sizeof(h));
  h.type = static_cast<uint8_t>(type);
  h.length.set(length);
  return h;
}

}  // namespace ibtrs::fabric::tcp
