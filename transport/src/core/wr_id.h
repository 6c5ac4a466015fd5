// What the client and the server of a session both put into their work requests (kernel: the
// part of rtrs-pri.h that rtrs-clt.c and rtrs-srv.c share): the wr_id encoding and the sizes of
// a connection's queues and service slots. Private to the transport.
//
// A wr_id never leaves the process: the fabric hands it back in the completion of the work
// request that carried it. Its low 3 bits say what completed (WrKind), the rest is a value of
// that kind (a permit, a chunk, a RECV slot).
#pragma once

#include <cstdint>

#include "proto/ibtrs_proto.h"

namespace ibtrs::core {

enum WrKind : uint64_t {
  kWrIo = 1,       // an IO request (client: its permit) or its response (server: its chunk)
  kWrSvc = 2,      // a SEND or a heartbeat on the service connection
  kWrRecv = 3,     // a RECV (client: the slot it fills, when it has one)
  kWrInv = 4,      // client: a LOCAL_INV revoking a read window (the permit)
  kWrSvcRecv = 5,  // server: a RECV on the service connection (its slot)
};
inline constexpr uint64_t kWrKindMask = 7;

constexpr uint64_t wr_id(WrKind k, uint64_t v = 0) { return v << 3 | k; }
constexpr WrKind wr_kind(uint64_t id) { return static_cast<WrKind>(id & kWrKindMask); }
constexpr uint64_t wr_value(uint64_t id) { return id >> 3; }

// The service connection (cid 0): its RECVs take the establishment's messages (AUTH_*, INFO_*),
// heartbeats, and later the failover fence's messages.
inline constexpr uint32_t kSvcRecvs = 16;
inline constexpr uint32_t kSvcSends = 16;
// Bytes of a service RECV slot for any message but INFO_RSP (which grows with the queue depth).
inline constexpr uint32_t kSvcSlot = 512;
static_assert(sizeof(proto::InfoReq) <= kSvcSlot && sizeof(proto::AuthChallenge) <= kSvcSlot &&
                  sizeof(proto::AuthReply) <= kSvcSlot && sizeof(proto::AuthSuccess) <= kSvcSlot &&
                  sizeof(proto::AuthFailure) <= kSvcSlot && sizeof(proto::PathFence) <= kSvcSlot &&
                  sizeof(proto::FenceRsp) <= kSvcSlot,
              "every service message but INFO_RSP fits a service RECV slot");

// IO connections: one send in this many is signalled; the others complete silently, and the
// send queue is sized with this much slack for them.
inline constexpr uint32_t kSignalEvery = 16;
// RECVs reposted together.
inline constexpr uint32_t kRepostBatch = 16;

}  // namespace ibtrs::core
