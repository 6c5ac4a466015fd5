// Multipath policies (kernel: rtrs_clt's mp_policy): which path carries the next request.
// A pure choice over a snapshot of the paths, so each policy is tested on its own and the
// session only supplies the numbers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include "ibtrs/result.h"
#include "ibtrs/types.h"

namespace ibtrs::core {

using ibtrs::MpPolicy;

struct PathLoad {
  bool usable = false;      // CONNECTED and not excluded
  uint32_t inflight = 0;    // requests in flight on the path
  uint64_t latency_ns = 0;  // last heartbeat round trip (0 = not measured yet)
};

// Chooses the index of a usable path, or nothing when none is usable. `cursor` is the caller's
// round-robin position (one per IO thread); it advances past the chosen path. `skip` excludes
// one index (the path a failed-over request comes from), unless it is the only usable one.
// Ties go to the path after the cursor, so equal paths share the load.
//
// `stick` is the path the caller posted to last and how far its inflight may exceed the least
// loaded path's for min-inflight to stay there (round-robin and min-latency ignore it). Within
// a submission batch the bound is kBatchStickiness: a batch split over two paths costs a send
// and a receive stream per path on both sides (loopback, 4 KiB randread QD32, two paths: 0.151
// sendmsg per IO in fio against 0.064 with one; kept whole, 0.063), while the first request of
// every batch still goes to the least loaded path, so equal paths share the load batch by
// batch, and rate-limited links, where a batch is the completion or two that arrived, still
// balance per request (two paths 1.95-2.00x one at 100 mbit, bench/multipath-netns.sh). 32: a
// QD32 batch stays whole (16 still split it). Between batches the bound is 0: a tie stays on
// the last path instead of rotating, so QD1 keeps to one connection.
inline constexpr uint32_t kBatchStickiness = 32;
struct Stick {
  size_t path = 0;
  uint32_t bound = 0;
};
std::optional<size_t> choose_path(MpPolicy policy, std::span<const PathLoad> paths, size_t& cursor,
                                  std::optional<size_t> skip = std::nullopt,
                                  std::optional<Stick> stick = std::nullopt);

}  // namespace ibtrs::core
