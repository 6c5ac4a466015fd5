// What a connection of a path is on both sides of a session (kernel: struct rtrs_con in
// rtrs-pri.h, which rtrs_clt_con and rtrs_srv_con embed first): its path, its place in the path,
// the poller that owns its completions, the fabric objects, the gate in front of its send queue
// and the state the poller keeps for it. Private to the transport.
//
// client::Con and server::Con derive from it and add their own; the fields stay plain members of
// the derived object (no indirection, no virtual beyond CqHandler's), so the IO path reads them
// as before. PathT is the side's own path type.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "core/con_gate.h"
#include "core/poller.h"
#include "fabric/fabric.h"

namespace ibtrs::core {

template <class PathT>
struct ConBase : CqHandler {
  PathT* path = nullptr;
  uint16_t cid = 0;  // 0: the service connection
  Poller* poller = nullptr;
  std::unique_ptr<fabric::CompletionQueue> cq;
  std::unique_ptr<fabric::Connection> conn;
  ConGate gate;
  std::atomic<bool> failed{false};  // the fabric reported a break (event or error completion)
  // Poller thread (client: the lease holder): the connection went down and its failover is
  // done for this incarnation.
  bool down = false;
  std::atomic<uint32_t> sig{0};  // selective signalling counter (kSignalEvery)
  uint32_t recv_missing = 0;     // poller (client: lease holder): consumed RECVs not yet reposted
};

}  // namespace ibtrs::core
