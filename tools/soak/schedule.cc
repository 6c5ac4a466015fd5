#include <algorithm>

#include "base/pattern.h"
#include "soak.h"

namespace ibnbd::soak {

std::string_view to_string(FaultKind k) {
  switch (k) {
    case FaultKind::path_cut: return "path-cut";
    case FaultKind::link_flap: return "link-flap";
    case FaultKind::server_kill: return "server-kill";
    case FaultKind::server_stop: return "server-stop";
    case FaultKind::client_kill: return "client-kill";
    case FaultKind::enospc: return "enospc";
    case FaultKind::eio: return "eio";
    case FaultKind::slow: return "slow";
    case FaultKind::policy: return "policy";
    case FaultKind::path_remove: return "path-remove";
    case FaultKind::netem: return "netem";
  }
  return "?";
}

std::optional<FaultKind> parse_fault(std::string_view s) {
  for (FaultKind k : kAllFaults)
    if (to_string(k) == s) return k;
  return std::nullopt;
}

Rng::Rng(uint64_t seed) {
  uint64_t x = seed;
  for (auto& w : s_) w = base::splitmix64(x);
}

uint64_t Rng::next() {
  const auto rotl = [](uint64_t v, int k) { return (v << k) | (v >> (64 - k)); };
  const uint64_t r = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return r;
}

std::vector<FaultPlan> make_schedule(const ScheduleConfig& c) {
  std::vector<FaultPlan> out;
  if (c.kinds.empty() || c.duration_ms <= c.warmup_ms + c.tail_ms) return out;
  // Its own stream: the plan does not depend on the workload's draws.
  Rng r(c.seed ^ 0x5ca1ab1e0ddba11ull);
  std::vector<FaultKind> bag;
  uint64_t t = c.warmup_ms;
  const uint64_t end = c.duration_ms - c.tail_ms;
  static constexpr const char* kPolicies[] = {"round-robin", "min-inflight", "min-latency"};
  while (c.max_faults == 0 || out.size() < c.max_faults) {
    if (bag.empty()) {
      bag = c.kinds;
      for (size_t i = bag.size(); i > 1; --i) std::swap(bag[i - 1], bag[r.below(i)]);
    }
    FaultPlan p;
    p.kind = bag.back();
    p.at_ms = t;
    const std::string label = c.path_labels.empty() ? "A" : c.path_labels[r.below(c.path_labels.size())];
    switch (p.kind) {
      case FaultKind::path_cut:
        p.dur_ms = static_cast<uint32_t>(r.range(1000, 4000));
        p.arg = label;
        break;
      case FaultKind::link_flap: {
        p.arg = label;
        const auto n = r.range(3, 6);
        for (uint64_t i = 0; i < n; ++i) {
          const auto down = static_cast<uint32_t>(r.range(100, 800));
          const auto up = static_cast<uint32_t>(r.range(200, 1000));
          p.flaps.emplace_back(down, up);
          p.dur_ms += down + up;
        }
        break;
      }
      case FaultKind::server_kill:
        p.dur_ms = static_cast<uint32_t>(r.range(200, 2000));
        break;
      case FaultKind::server_stop:
        p.dur_ms = c.hb_timeout_ms + static_cast<uint32_t>(r.range(300, 2000));
        break;
      case FaultKind::client_kill:
        p.dur_ms = static_cast<uint32_t>(r.range(200, 1000));
        break;
      case FaultKind::enospc:
        p.dur_ms = static_cast<uint32_t>(r.range(1000, 3000));
        break;
      case FaultKind::eio: {
        p.dur_ms = static_cast<uint32_t>(r.range(1000, 3000));
        const uint64_t span = c.eio_last > c.eio_first ? c.eio_last - c.eio_first : 0;
        p.eio_blocks = static_cast<uint32_t>(std::min<uint64_t>(span, r.range(1, 64)));
        p.eio_block = c.eio_first + r.below(span - p.eio_blocks + 1);
        break;
      }
      case FaultKind::slow:
        p.dur_ms = static_cast<uint32_t>(r.range(2000, 4000));
        p.arg = std::to_string(r.range(2, 20) * 1000);  // us per backend request
        break;
      case FaultKind::policy:
        p.arg = kPolicies[r.below(std::size(kPolicies))];
        break;
      case FaultKind::path_remove:
        p.dur_ms = static_cast<uint32_t>(r.range(1000, 3000));
        p.arg = label;
        break;
      case FaultKind::netem: {
        // A bad link, not a dead one: up to 20 ms of delay with jitter, 5 % loss, 2 % duplicates
        // and a quarter of the packets reordered (netem reorders only delayed packets). Enough
        // loss to cost TCP retransmission timeouts (200 ms and up) and, now and then, the
        // heartbeats of a path; the IO must come through on some path, whole and unrepeated.
        p.dur_ms = static_cast<uint32_t>(r.range(2000, 6000));
        p.arg = label;
        const uint64_t delay = r.range(1, 20), jitter = r.range(0, delay / 2);
        const uint64_t loss = r.range(0, 50), dup = r.range(0, 20), reorder = r.range(0, 25);
        const auto tenths = [](uint64_t v) { return std::to_string(v / 10) + "." + std::to_string(v % 10) + "%"; };
        p.netem = "delay " + std::to_string(delay) + "ms " + std::to_string(jitter) + "ms loss " + tenths(loss) +
                  " duplicate " + tenths(dup) + " reorder " + std::to_string(reorder) + "%";
        break;
      }
    }
    if (t + p.dur_ms > end) break;
    bag.pop_back();
    t += p.dur_ms + r.range(c.gap_min_ms, std::max(c.gap_min_ms, c.gap_max_ms));
    out.push_back(std::move(p));
  }
  return out;
}

std::string describe(const FaultPlan& p) {
  std::string s = "t=" + std::to_string(p.at_ms / 1000) + "." + std::to_string(p.at_ms % 1000 / 100) + "s " +
                  std::string(to_string(p.kind));
  if (!p.arg.empty()) s += " " + p.arg;
  if (p.kind == FaultKind::eio)
    s += " blocks " + std::to_string(p.eio_block) + "+" + std::to_string(p.eio_blocks);
  if (p.kind == FaultKind::link_flap) s += " x" + std::to_string(p.flaps.size());
  if (p.kind == FaultKind::netem) s += " (" + p.netem + ")";
  if (p.dur_ms != 0) s += " for " + std::to_string(p.dur_ms) + " ms";
  return s;
}

}  // namespace ibnbd::soak
