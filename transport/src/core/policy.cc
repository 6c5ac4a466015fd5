#include "core/policy.h"

#include <limits>


namespace ibtrs::core {

std::optional<size_t> choose_path(MpPolicy policy, std::span<const PathLoad> paths, size_t& cursor,
                                  std::optional<size_t> skip, std::optional<Stick> stick) {
  const size_t n = paths.size();
  if (n == 0) return std::nullopt;
  size_t usable = 0;
  for (size_t i = 0; i < n; ++i) usable += paths[i].usable ? 1 : 0;
  if (usable == 0) return std::nullopt;
  // A failed-over request avoids its old path unless nothing else is left.
  auto eligible = [&](size_t i) {
    return paths[i].usable && !(skip && *skip == i && usable > 1);
  };
  std::optional<size_t> best;
  uint64_t best_key = std::numeric_limits<uint64_t>::max();
  // Walk from the cursor so that ties rotate among equal paths.
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (cursor + k) % n;
    if (!eligible(i)) continue;
    uint64_t key = 0;
    switch (policy) {
      case MpPolicy::round_robin: key = 0; break;
      case MpPolicy::min_inflight: key = paths[i].inflight; break;
      case MpPolicy::min_latency:
        // Unmeasured paths sort last: a path proves itself before it gets the traffic.
        key = paths[i].latency_ns == 0 ? std::numeric_limits<uint64_t>::max() - 1 : paths[i].latency_ns;
        break;
    }
    if (!best || key < best_key) {
      best = i;
      best_key = key;
      if (policy == MpPolicy::round_robin) break;
    }
  }
  // Stay on the last path unless it ran ahead of the least loaded one by more than the bound.
  if (best && policy == MpPolicy::min_inflight && stick && stick->path < n && eligible(stick->path) &&
      paths[stick->path].inflight <= best_key + stick->bound) {
    best = stick->path;
  }
  if (best) cursor = (*best + 1) % n;
  return best;
}

}  // namespace ibtrs::core
