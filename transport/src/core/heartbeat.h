// Heartbeats and reconnect timing of a path, as pure logic over a caller-supplied clock, so the
// path code only schedules timers and tests run on a manual clock.
//
// Heartbeat (kernel: rtrs_send_hb_ack / hb_work): every `interval` the path's timer calls
// on_timer(). If `missed_max` heartbeats in a row went unanswered the path is dead; otherwise an
// HB_MSG goes out. Any immediate received on the path (IO or heartbeat) proves the peer alive and
// resets the count; the HB_MSG -> HB_ACK round trip is the path's latency (min-latency policy,
// cur_latency). Defaults 5 s x 5: a silent peer is detected after about 30 s.
//
// Thread-safety: on_timer() from the path's timer thread; on_imm()/on_ack() from any IO thread;
// readers anywhere.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <random>
#include <string_view>

#include "ibtrs/result.h"
#include "ibtrs/types.h"

namespace ibtrs::core {

using Clock = std::chrono::steady_clock;

using ibtrs::HeartbeatConfig;
using ibtrs::ReconnectConfig;

class Heartbeat {
 public:
  explicit Heartbeat(HeartbeatConfig c) : cfg_(c) {}

  enum class Action : uint8_t { send_hb, peer_dead };
  Action on_timer(Clock::time_point now);
  // Any immediate from the peer.
  void on_imm() { missed_.store(0, std::memory_order_relaxed); }
  // An HB_ACK: also records the round trip of the last HB_MSG.
  void on_ack(Clock::time_point now);

  uint32_t missed() const { return missed_.load(std::memory_order_relaxed); }
  // Last measured heartbeat round trip; nothing before the first ACK.
  std::optional<std::chrono::nanoseconds> latency() const;
  const HeartbeatConfig& config() const { return cfg_; }

 private:
  HeartbeatConfig cfg_;
  std::atomic<uint32_t> missed_{0};
  std::atomic<int64_t> last_sent_ns_{-1};  // oldest unanswered HB_MSG; -1 when none
  std::atomic<int64_t> latency_ns_{-1};
};

// Reconnect timing of a path after ReconnectConfig (ibtrs/types.h).
class ReconnectSchedule {
 public:
  explicit ReconnectSchedule(ReconnectConfig c, uint64_t seed = std::random_device{}())
      : cfg_(c), rng_(seed) {}

  // The wait before the next attempt, or nothing once the attempts are used up (the path goes
  // to CLOSED and stays there until a user asks to reconnect it).
  std::optional<std::chrono::milliseconds> next_delay();
  // A reconnect succeeded: the next failure starts again from the first delay.
  void reset() { attempts_ = 0; }
  uint32_t attempts() const { return attempts_; }

 private:
  ReconnectConfig cfg_;
  std::mt19937_64 rng_;
  uint32_t attempts_ = 0;
};

}  // namespace ibtrs::core
