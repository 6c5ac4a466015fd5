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
std::optional<size_t> choose_path(MpPolicy policy, std::span<const PathLoad> paths, size_t& cursor,
                                  std::optional<size_t> skip = std::nullopt);

}  // namespace ibtrs::core
