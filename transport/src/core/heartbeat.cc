#include "core/heartbeat.h"

#include <algorithm>
#include <charconv>

#include "base/text.h"

namespace ibtrs::core {

namespace {
int64_t ns_of(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}
}  // namespace

Heartbeat::Action Heartbeat::on_timer(Clock::time_point now) {
  // Checked before counting this round: missed_max unanswered heartbeats, then one more
  // interval of silence, make the peer dead (5 x 5 s -> ~30 s, as the kernel).
  if (missed_.load(std::memory_order_relaxed) >= cfg_.missed_max) return Action::peer_dead;
  missed_.fetch_add(1, std::memory_order_relaxed);
  // An ACK cannot name its HB_MSG, so while one is unanswered the round trip is measured from
  // it: a slow path then reads slow, never as fast as the gap between two heartbeats.
  int64_t none = -1;
  last_sent_ns_.compare_exchange_strong(none, ns_of(now), std::memory_order_relaxed);
  return Action::send_hb;
}

void Heartbeat::on_ack(Clock::time_point now) {
  on_imm();
  const int64_t sent = last_sent_ns_.exchange(-1, std::memory_order_relaxed);
  const int64_t rtt = ns_of(now) - sent;
  if (sent >= 0 && rtt >= 0) latency_ns_.store(rtt, std::memory_order_relaxed);
}

std::optional<std::chrono::nanoseconds> Heartbeat::latency() const {
  const int64_t l = latency_ns_.load(std::memory_order_relaxed);
  if (l < 0) return std::nullopt;
  return std::chrono::nanoseconds(l);
}

std::optional<std::chrono::milliseconds> ReconnectSchedule::next_delay() {
  if (cfg_.max_attempts >= 0 && attempts_ >= static_cast<uint32_t>(cfg_.max_attempts))
    return std::nullopt;
  auto d = cfg_.delay + cfg_.backoff * attempts_;
  d = std::min(d, cfg_.max_delay);
  if (cfg_.jitter.count() > 0) {
    d += std::chrono::milliseconds(static_cast<int64_t>(rng_() % static_cast<uint64_t>(cfg_.jitter.count())));
  }
  ++attempts_;
  return d;
}

}  // namespace ibtrs::core
