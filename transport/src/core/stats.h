// Per-path statistics (kernel: rtrs-clt-stats.c), as data objects that the control files and the
// CLI render later: read/write counts and bytes, inflight, failovered, reconnects, latency
// histogram, completions per poll, sg-list sizes, requests completed on another thread.
//
// The IO path must not share cache lines between IO threads, so counters live in one shard per
// IO thread (plus one for the control/service thread). Completion-side counters are written only
// by the shard's poller thread (relaxed load + store, no read-modify-write); submissions and
// failovers come from any thread mapped to the shard and add atomically. snapshot() sums. reset() records a
// baseline that snapshot() subtracts, so it never races with the writers. inflight is a gauge
// and is not reset.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "ibtrs/types.h"

namespace ibtrs::core {

using ibtrs::kLatBuckets;
using ibtrs::kSgBuckets;
using ibtrs::PathStatsSnapshot;
using ibtrs::StatsGroup;

size_t latency_bucket(uint64_t ns);

class PathStats {
 public:
  // `shards`: IO threads + 1. Shard indexes are 0..shards-1; each is written by one thread.
  explicit PathStats(uint32_t shards);
  PathStats(const PathStats&) = delete;
  PathStats& operator=(const PathStats&) = delete;

  uint32_t shards() const { return static_cast<uint32_t>(shards_.size()); }

  // IO path, on the thread that owns `shard`.
  void on_submit(uint32_t shard, bool write, uint64_t bytes, uint32_t sg_entries);
  void on_complete(uint32_t shard, bool write, uint64_t latency_ns, uint32_t submit_shard);
  void on_poll(uint32_t shard, uint32_t completions);
  // A request moved off this path: counted as failovered and no longer inflight here.
  void on_failover(uint32_t shard);
  // A request counted by on_submit whose post failed and which the submitter took back: no
  // longer inflight here (its counts and bytes stay: handed to this path, not sent).
  void on_unposted(uint32_t shard);
  // Control thread (the last shard).
  void on_reconnect(bool ok);

  PathStatsSnapshot snapshot() const;
  // The counters of `group` start again from zero (inflight excepted). Any thread.
  void reset(StatsGroup group = StatsGroup::all);

 private:
  struct alignas(64) Shard {
    std::atomic<uint64_t> read_cnt{0}, read_bytes{0}, write_cnt{0}, write_bytes{0};
    std::atomic<int64_t> submitted{0}, completed{0};
    std::atomic<uint64_t> failovered{0}, reconnects_ok{0}, reconnects_failed{0};
    std::array<std::atomic<uint64_t>, kLatBuckets> lat_read{}, lat_write{};
    std::atomic<uint64_t> lat_max_read{0}, lat_max_write{0};
    std::atomic<uint64_t> lat_sum_read{0}, lat_sum_write{0};
    std::atomic<uint64_t> polls{0}, polled{0}, poll_max{0};
    std::array<std::atomic<uint64_t>, kSgBuckets> sg{};
    std::atomic<uint64_t> migrated_to{0};
    std::vector<std::atomic<uint64_t>> migrated_from_by;  // [submit shard] completed here
  };
  PathStatsSnapshot raw() const;

  std::vector<std::unique_ptr<Shard>> shards_;
  mutable std::mutex baseline_mu_;  // control plane only: reset() and snapshot()
  PathStatsSnapshot baseline_;
};

}  // namespace ibtrs::core
