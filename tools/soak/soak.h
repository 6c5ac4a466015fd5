// ibnbd-soak: a seeded workload against a volume, a history checker (history.h) and faults on a
// seeded schedule (issue 17, docs/reliability.md). tools/soak/README.md is the user's guide.
//
// Threads: the driver thread (run()) owns the History, submits every request and handles every
// completion; completions are handed to it by the volume's threads through a lock-free list
// and an eventfd. The fault thread runs the schedule: it calls the hook (an external command)
// or, for a target of the client library, the session's own path and policy control, and posts
// each fault's start and end to the driver, which attributes IO pauses and errors to them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ibnbd::soak {

enum class FaultKind : uint8_t {
  path_cut,     // a path's link down for a while (netns: the client side's veth)
  link_flap,    // a path's link down and up several times
  server_kill,  // kill -9 of the server, restart after a while
  server_stop,  // SIGSTOP of the server past the heartbeat timeout, then SIGCONT
  client_kill,  // kill -9 of the client daemon (NBD target), restart, map, export
  enospc,       // the backend's filesystem full (writes into holes fail with ENOSPC)
  eio,          // a range of the backend fails every request with EIO
  slow,         // every backend request delayed
  policy,       // the multipath policy changed
  path_remove,  // a path removed from the session, added back later
  netem,        // a path's link impaired (tc netem): delay and jitter, loss, duplication, reordering
};
inline constexpr FaultKind kAllFaults[] = {
    FaultKind::path_cut, FaultKind::link_flap, FaultKind::server_kill, FaultKind::server_stop,
    FaultKind::client_kill, FaultKind::enospc, FaultKind::eio, FaultKind::slow, FaultKind::policy,
    FaultKind::path_remove, FaultKind::netem};
inline constexpr size_t kFaultKinds = std::size(kAllFaults);
std::string_view to_string(FaultKind k);
std::optional<FaultKind> parse_fault(std::string_view s);

// One planned fault. Times in ms from the start of the run.
struct FaultPlan {
  FaultKind kind = FaultKind::path_cut;
  uint64_t at_ms = 0;
  uint32_t dur_ms = 0;          // how long the fault lasts (0: instant)
  std::string arg;              // path label, policy name, delay in us
  uint64_t eio_block = 0;       // eio: the first block and the count of the failing range
  uint32_t eio_blocks = 0;
  std::vector<std::pair<uint32_t, uint32_t>> flaps;  // link_flap: (down ms, up ms) each
  std::string netem;            // netem: the qdisc's parameters, as `tc qdisc ... netem` takes them
};

// What a run needs to plan its faults.
struct ScheduleConfig {
  uint64_t seed = 0;
  uint64_t duration_ms = 60000;
  uint64_t warmup_ms = 3000;     // no fault before
  uint64_t tail_ms = 5000;       // no fault may end later than duration - tail
  uint32_t gap_min_ms = 3000;    // between the end of one fault and the start of the next
  uint32_t gap_max_ms = 8000;
  uint32_t max_faults = 0;       // 0: as many as fit
  uint32_t hb_timeout_ms = 1000; // server_stop lasts longer than this
  std::vector<FaultKind> kinds;
  std::vector<std::string> path_labels{"A", "B"};
  uint64_t eio_first = 0, eio_last = 0;  // blocks the eio range may cover: [first, last)
};

// The plan of a run: a pure function of the configuration (the same seed, the same faults in
// the same order with the same arguments). Every kind appears once before any appears twice
// (a shuffled bag), so a short run covers each of them.
std::vector<FaultPlan> make_schedule(const ScheduleConfig& c);
std::string describe(const FaultPlan& p);

// xoshiro256** seeded through splitmix64: the same sequence for a seed on every platform (the
// standard distributions are not).
class Rng {
 public:
  explicit Rng(uint64_t seed);
  uint64_t next();
  uint64_t below(uint64_t n) { return n == 0 ? 0 : next() % n; }
  uint64_t range(uint64_t lo, uint64_t hi) { return lo + below(hi - lo + 1); }  // [lo, hi]

 private:
  uint64_t s_[4];
};

}  // namespace ibnbd::soak
