// Public vocabulary of libibtrs shared by the client and server APIs, the control files and the
// CLI: path states, multipath policies, heartbeat and reconnect settings, and the statistics
// data objects. Plain data; the logic behind them lives in the library.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <string>
#include <utility>
#include <vector>

#include "ibtrs/result.h"

namespace ibtrs {

// ---- path states (kernel: enum rtrs_clt_state / rtrs_srv_state) -------------------------------

enum class ClientPathState : uint8_t {
  connecting,      // connections being established, then INFO_REQ/INFO_RSP
  connecting_err,  // establishing failed; the path will be retried or closed
  reconnecting,    // was usable; connections torn down, inflight IO failed over, retry pending
  connected,       // INFO_RSP received: carries IO
  closing,         // being disconnected on request
  closed,          // disconnected; may be reconnected or removed
  dead,            // removed from its session; nothing more happens to it
};

enum class ServerPathState : uint8_t { connecting, connected, closing, closed };

std::string_view to_string(ClientPathState s);
std::string_view to_string(ServerPathState s);

// ---- multipath policy (kernel: mp_policy) -----------------------------------------------------

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

// ---- heartbeats and reconnects ----------------------------------------------------------------

// Kernel defaults: an HB_MSG every 5 s, the path is dead after 5 unanswered.
struct HeartbeatConfig {
  std::chrono::milliseconds interval{5000};
  uint32_t missed_max = 5;
};

// Reconnect schedule of a path (kernel: reconnect_delay_sec, RTRS_RECONNECT_BACKOFF,
// max_reconnect_attempts). Attempt n (from 0) waits delay + n x backoff, capped at max_delay,
// plus a random jitter below `jitter` so that many clients do not return in lockstep.
struct ReconnectConfig {
  std::chrono::milliseconds delay{1000};
  std::chrono::milliseconds backoff{1000};
  std::chrono::milliseconds max_delay{30000};
  std::chrono::milliseconds jitter{500};
  int32_t max_attempts = -1;  // -1 forever, 0 never, else 1..9999
};

// The kernel's sysfs range for max_reconnect_attempts: -1..9999 (EINVAL otherwise; surrounding
// whitespace allowed).
Result<int32_t> parse_max_reconnect_attempts(std::string_view text);

// ---- statistics (kernel: rtrs-clt-stats.c / rtrs-srv-stats.c) ---------------------------------

// Latency buckets: bucket b counts latencies in [2^b, 2^(b+1)) microseconds (bucket 0 also takes
// < 1 us), the last bucket everything from 2^(kLatBuckets-1) us (~67 s) up.
inline constexpr size_t kLatBuckets = 27;
// sg-list length buckets: 0..kSgBuckets-2 entries, then "kSgBuckets-1 or more".
inline constexpr size_t kSgBuckets = 17;

// The counters a reset may target, one per file of the kernel's stats/ directory (writing to a
// file resets its counters; reset_all resets every group).
enum class StatsGroup : uint8_t {
  all,            // reset_all
  rdma,           // read/write counts and bytes, failovered (inflight is a gauge: never reset)
  rdma_lat,       // latency histograms and maxima
  wc_completion,  // polls, polled completions, most completions in one poll
  sg_entries,
  cpu_migration,  // thread_migrations, migrated_from, migrated_to
  reconnects,     // reconnects_ok, reconnects_failed
  fence,          // a client path's ClientPathInfo::Fence (ours: stats/fence); servers have none
};
// "all" | "rdma" | "rdma_lat" | "wc_completion" | "sg_entries" | "cpu_migration" | "reconnects"
// (the kernel's file names; "reset_all" for all) | "fence". EINVAL otherwise.
Result<StatsGroup> parse_stats_group(std::string_view text);
std::string_view to_string(StatsGroup g);

struct PathStatsSnapshot {
  uint64_t read_cnt = 0;
  uint64_t read_bytes = 0;
  uint64_t write_cnt = 0;
  uint64_t write_bytes = 0;
  int64_t inflight = 0;
  uint64_t failovered = 0;         // requests this path handed to another path
  uint64_t reconnects_ok = 0;
  uint64_t reconnects_failed = 0;
  std::array<uint64_t, kLatBuckets> lat_read{};
  std::array<uint64_t, kLatBuckets> lat_write{};
  uint64_t lat_max_read_ns = 0;
  uint64_t lat_max_write_ns = 0;
  // The latencies added up (the histograms' sum: Prometheus' _sum, a mean per interval).
  uint64_t lat_sum_read_ns = 0;
  uint64_t lat_sum_write_ns = 0;
  uint64_t polls = 0;              // CQ polls that returned completions
  uint64_t polled_completions = 0;
  uint64_t poll_max = 0;           // most completions one poll returned
  std::array<uint64_t, kSgBuckets> sg_entries{};
  uint64_t thread_migrations = 0;  // requests completed on another thread than submitted
  std::vector<uint64_t> migrated_from;  // per shard: submitted here, completed elsewhere
  std::vector<uint64_t> migrated_to;    // per shard: completed here, submitted elsewhere

  // Adds another snapshot (a session's totals are the sum of its paths').
  PathStatsSnapshot& operator+=(const PathStatsSnapshot& o);
};

// How an IO thread waited for work (core::Poller; the server's `io_threads` control command).
// Adaptive mode plans a wait after every pass that found CQ completions: it spins (polls its CQs without
// blocking) until the next work or the spin budget, or blocks at once for one of `blocked`'s
// reasons (ibtrs/hybrid_poll.h's BlockReason, by name).
struct IoThreadWaitStats {
  uint32_t thread = 0;
  std::string mode;           // adaptive, block or spin
  uint64_t waits = 0;         // planned (adaptive only)
  uint64_t spins_caught = 0;  // spins that caught the next work: a wake-up saved
  uint64_t spins_missed = 0;  // spins whose budget ran out: blocked after all
  uint64_t spins_preempted = 0;  // spins with an iteration gap beyond the policy's bound
  uint64_t sleeps = 0;        // epoll_waits (any mode)
  std::vector<std::pair<std::string, uint64_t>> blocked;  // waits that blocked at once, by reason
  int64_t expected_gap_ns = 0;  // learned gap from a pass with work to the next work
};

}  // namespace ibtrs
