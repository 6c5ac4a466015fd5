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

namespace ibtrs::core {

enum class MpPolicy : uint8_t {
  round_robin = 0,   // each IO thread cycles through the usable paths
  min_inflight = 1,  // the path with the fewest requests in flight (kernel default)
  min_latency = 2,   // the path with the lowest heartbeat round trip
};

// Accepts the kernel's spellings: "round-robin" | "min-inflight" | "min-latency", their short
// forms "rr" | "mi" | "ml", and "0" | "1" | "2" (surrounding whitespace and a newline allowed, as
// written to a sysfs file). EINVAL otherwise.
Result<MpPolicy> parse_mp_policy(std::string_view text);
std::string_view to_string(MpPolicy p);

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
