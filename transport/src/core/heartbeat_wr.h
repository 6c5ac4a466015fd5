// The work request both sides use for heartbeats (kernel: rtrs_send_hb_ack / hb_work): a
// zero-length WRITE_WITH_IMM on the service connection carrying HB_MSG or HB_ACK.
#pragma once

#include <cstdint>

#include "fabric/fabric.h"
#include "proto/ibtrs_proto.h"

namespace ibtrs::core {

// Any thread that may post to `c` (the caller holds the connection's gate or owns its CQ).
inline Status post_heartbeat(fabric::Connection& c, proto::ImmType type, uint64_t wr_id) {
  fabric::SendWr wr{};
  wr.wr_id = wr_id;
  wr.opcode = fabric::Opcode::write_with_imm;
  wr.imm = proto::make_imm(type, 0);
  return c.post_send(std::span(&wr, 1));
}

}  // namespace ibtrs::core
