#include "core/stats.h"

#include <algorithm>
#include <bit>

namespace ibtrs::core {

namespace {

// Single writer per shard: a relaxed load + store is enough and costs no locked instruction.
template <typename T, typename V>
void bump(std::atomic<T>& a, V by) {
  a.store(a.load(std::memory_order_relaxed) + static_cast<T>(by), std::memory_order_relaxed);
}

template <typename T>
void raise_to(std::atomic<T>& a, T v) {
  if (v > a.load(std::memory_order_relaxed)) a.store(v, std::memory_order_relaxed);
}

// Submissions come from any user thread mapped to the shard, so they add atomically.
template <typename T, typename V>
void add(std::atomic<T>& a, V by) {
  a.fetch_add(static_cast<T>(by), std::memory_order_relaxed);
}

uint64_t get(const std::atomic<uint64_t>& a) { return a.load(std::memory_order_relaxed); }

}  // namespace

size_t latency_bucket(uint64_t ns) {
  const uint64_t us = ns / 1000;
  if (us < 2) return 0;
  return std::min<size_t>(static_cast<size_t>(std::bit_width(us)) - 1, kLatBuckets - 1);
}

PathStats::PathStats(uint32_t shards) {
  shards_.reserve(std::max<uint32_t>(shards, 1));
  for (uint32_t i = 0; i < std::max<uint32_t>(shards, 1); ++i) {
    auto s = std::make_unique<Shard>();
    s->migrated_from_by = std::vector<std::atomic<uint64_t>>(std::max<uint32_t>(shards, 1));
    shards_.push_back(std::move(s));
  }
  baseline_.migrated_from.assign(shards_.size(), 0);
  baseline_.migrated_to.assign(shards_.size(), 0);
}

void PathStats::on_submit(uint32_t shard, bool write, uint64_t bytes, uint32_t sg_entries) {
  Shard& s = *shards_[shard % shards_.size()];
  if (write) {
    add(s.write_cnt, 1);
    add(s.write_bytes, bytes);
  } else {
    add(s.read_cnt, 1);
    add(s.read_bytes, bytes);
  }
  add(s.submitted, 1);
  add(s.sg[std::min<size_t>(sg_entries, kSgBuckets - 1)], 1);
}

void PathStats::on_complete(uint32_t shard, bool write, uint64_t latency_ns, uint32_t submit_shard) {
  Shard& s = *shards_[shard % shards_.size()];
  bump(s.completed, 1);
  bump((write ? s.lat_write : s.lat_read)[latency_bucket(latency_ns)], 1);
  raise_to(write ? s.lat_max_write : s.lat_max_read, latency_ns);
  bump(write ? s.lat_sum_write : s.lat_sum_read, latency_ns);
  submit_shard %= static_cast<uint32_t>(shards_.size());
  if (submit_shard != shard % shards_.size()) {
    bump(s.migrated_to, 1);
    bump(s.migrated_from_by[submit_shard], 1);
  }
}

void PathStats::on_poll(uint32_t shard, uint32_t completions) {
  if (completions == 0) return;
  Shard& s = *shards_[shard % shards_.size()];
  bump(s.polls, 1);
  bump(s.polled, completions);
  raise_to(s.poll_max, uint64_t{completions});
}

// A failed-over request leaves this path: it counts as failovered and no longer in flight here.
void PathStats::on_failover(uint32_t shard) {
  Shard& s = *shards_[shard % shards_.size()];
  add(s.failovered, 1);
  add(s.completed, 1);
}

void PathStats::on_unposted(uint32_t shard) {
  add(shards_[shard % shards_.size()]->submitted, -1);
}

void PathStats::on_reconnect(bool ok) {
  Shard& s = *shards_.back();
  bump(ok ? s.reconnects_ok : s.reconnects_failed, 1);
}

PathStatsSnapshot PathStats::raw() const {
  PathStatsSnapshot r;
  r.migrated_from.assign(shards_.size(), 0);
  r.migrated_to.assign(shards_.size(), 0);
  // inflight: every shard's completions before any shard's submissions (a request is counted
  // submitted before it can complete, often on another shard), so a reader running beside
  // the IO never sees a negative gauge.
  for (const auto& s : shards_) r.inflight -= s->completed.load(std::memory_order_acquire);
  for (const auto& s : shards_) r.inflight += s->submitted.load(std::memory_order_acquire);
  for (size_t i = 0; i < shards_.size(); ++i) {
    const Shard& s = *shards_[i];
    r.read_cnt += get(s.read_cnt);
    r.read_bytes += get(s.read_bytes);
    r.write_cnt += get(s.write_cnt);
    r.write_bytes += get(s.write_bytes);
    r.failovered += get(s.failovered);
    r.reconnects_ok += get(s.reconnects_ok);
    r.reconnects_failed += get(s.reconnects_failed);
    for (size_t b = 0; b < kLatBuckets; ++b) {
      r.lat_read[b] += get(s.lat_read[b]);
      r.lat_write[b] += get(s.lat_write[b]);
    }
    r.lat_max_read_ns = std::max(r.lat_max_read_ns, get(s.lat_max_read));
    r.lat_max_write_ns = std::max(r.lat_max_write_ns, get(s.lat_max_write));
    r.lat_sum_read_ns += get(s.lat_sum_read);
    r.lat_sum_write_ns += get(s.lat_sum_write);
    r.polls += get(s.polls);
    r.polled_completions += get(s.polled);
    r.poll_max = std::max(r.poll_max, get(s.poll_max));
    for (size_t b = 0; b < kSgBuckets; ++b) r.sg_entries[b] += get(s.sg[b]);
    r.thread_migrations += get(s.migrated_to);
    r.migrated_to[i] = get(s.migrated_to);
    for (size_t from = 0; from < shards_.size(); ++from) r.migrated_from[from] += get(s.migrated_from_by[from]);
  }
  return r;
}

PathStatsSnapshot PathStats::snapshot() const {
  PathStatsSnapshot r = raw();
  std::lock_guard lock(baseline_mu_);
  const PathStatsSnapshot& b = baseline_;
  r.read_cnt -= b.read_cnt;
  r.read_bytes -= b.read_bytes;
  r.write_cnt -= b.write_cnt;
  r.write_bytes -= b.write_bytes;
  r.failovered -= b.failovered;
  r.reconnects_ok -= b.reconnects_ok;
  r.reconnects_failed -= b.reconnects_failed;
  for (size_t i = 0; i < kLatBuckets; ++i) {
    r.lat_read[i] -= b.lat_read[i];
    r.lat_write[i] -= b.lat_write[i];
  }
  r.lat_sum_read_ns -= b.lat_sum_read_ns;
  r.lat_sum_write_ns -= b.lat_sum_write_ns;
  r.polls -= b.polls;
  r.polled_completions -= b.polled_completions;
  for (size_t i = 0; i < kSgBuckets; ++i) r.sg_entries[i] -= b.sg_entries[i];
  r.thread_migrations -= b.thread_migrations;
  for (size_t i = 0; i < r.migrated_to.size(); ++i) {
    r.migrated_to[i] -= b.migrated_to[i];
    r.migrated_from[i] -= b.migrated_from[i];
  }
  return r;
}

void PathStats::reset(StatsGroup group) {
  std::lock_guard lock(baseline_mu_);
  const PathStatsSnapshot now = raw();
  PathStatsSnapshot& b = baseline_;
  const bool all = group == StatsGroup::all;
  // Only the group's fields of the baseline move, so the other files keep counting.
  if (all || group == StatsGroup::rdma) {
    b.read_cnt = now.read_cnt;
    b.read_bytes = now.read_bytes;
    b.write_cnt = now.write_cnt;
    b.write_bytes = now.write_bytes;
    b.failovered = now.failovered;
  }
  if (all || group == StatsGroup::reconnects) {
    b.reconnects_ok = now.reconnects_ok;
    b.reconnects_failed = now.reconnects_failed;
  }
  if (all || group == StatsGroup::rdma_lat) {
    b.lat_read = now.lat_read;
    b.lat_write = now.lat_write;
    b.lat_sum_read_ns = now.lat_sum_read_ns;
    b.lat_sum_write_ns = now.lat_sum_write_ns;
  }
  if (all || group == StatsGroup::wc_completion) {
    b.polls = now.polls;
    b.polled_completions = now.polled_completions;
  }
  if (all || group == StatsGroup::sg_entries) b.sg_entries = now.sg_entries;
  if (all || group == StatsGroup::cpu_migration) {
    b.thread_migrations = now.thread_migrations;
    b.migrated_from = now.migrated_from;
    b.migrated_to = now.migrated_to;
  }
  // Maxima cannot be subtracted; zeroing them races only with a writer raising one, which then
  // stores a value seen after the reset began: harmless.
  for (auto& s : shards_) {
    if (all || group == StatsGroup::rdma_lat) {
      s->lat_max_read.store(0, std::memory_order_relaxed);
      s->lat_max_write.store(0, std::memory_order_relaxed);
    }
    if (all || group == StatsGroup::wc_completion) s->poll_max.store(0, std::memory_order_relaxed);
  }
}

}  // namespace ibtrs::core
