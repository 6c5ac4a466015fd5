// The loopback provider: an in-process fabric for unit tests of the upper layers. It moves real
// bytes (a WRITE lands in the target region after the same rkey/bounds/access checks as the
// other providers) and keeps verbs semantics, without sockets or threads: a post delivers at
// once, under one process-wide lock, unless a fault rule says otherwise. Delayed frames are
// delivered by the poll()/wait() of a CQ on either end once due, in order per connection.
//
// Endpoints are names: a listener on "loopback:srv:1234" is reached by connecting to the same.
//
// Fault injection (process-wide, for scenario tests):
//   faults().add({.action = FaultAction::drop, .opcode = Opcode::write_with_imm, .count = 3});
// Rules are matched against every send-side work request in post order; the first matching rule
// that still has budget applies.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "fabric/fabric.h"

namespace ibtrs::fabric::loopback {

enum class FaultAction : uint8_t {
  drop,        // the request vanishes; the sender still sees success. Models a loss the
               // transport did not report, which upper-layer timeouts (heartbeats) must catch.
  delay,       // delivered `delay` later (and everything after it on that connection too)
  error,       // the request completes with `status` at the sender; the connection breaks
  disconnect,  // the connection breaks before the request is delivered (it flushes)
  // Delivered now (the bytes are in the receiver's memory, the RECV is taken, the sender's
  // completion is a success), but the receiver's completion shows in its CQ only `delay`
  // later, even if the connection breaks meanwhile: a CQE written that the receiver has not
  // polled yet (a stalled poller). CQ order holds: what completes behind it in the receiver's
  // CQ, the flush of a break included, shows no earlier.
  late_completion,
};

enum class Direction : uint8_t { any, to_server, to_client };

struct FaultRule {
  FaultAction action = FaultAction::drop;
  std::optional<Opcode> opcode;          // only requests with this opcode
  std::string endpoint;                  // only connections to this listener name ("" = any)
  Direction direction = Direction::any;  // only requests travelling this way
  uint32_t skip = 0;                     // let this many matching requests pass first
  uint32_t count = 1;                    // apply to this many matching requests (0 = forever)
  std::chrono::microseconds delay{0};    // for delay and late_completion
  WcStatus status = WcStatus::remote_operation_error;  // for error
  uint64_t min_bytes = 0;                // only requests carrying at least this many bytes
};

class FaultInjector {
 public:
  // Returns an id for remove().
  uint64_t add(FaultRule rule);
  void remove(uint64_t id);
  void clear();
  // How many times rule `id` has been applied.
  uint32_t hits(uint64_t id) const;

  // Provider side: the action for this request, if any (consumes budget).
  std::optional<FaultRule> match(Opcode op, const std::string& endpoint, Direction dir,
                                 uint64_t bytes = 0);

 private:
  struct Entry {
    uint64_t id;
    FaultRule rule;
    uint32_t seen = 0;
    uint32_t applied = 0;
  };
  mutable std::mutex mu_;
  std::vector<Entry> rules_;
  uint64_t next_id_ = 1;
};

// The process-wide injector used by every loopback connection.
FaultInjector& faults();

}  // namespace ibtrs::fabric::loopback
