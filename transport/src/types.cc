#include "ibtrs/types.h"

#include <algorithm>
#include <charconv>

#include "base/text.h"

namespace ibtrs {

std::string_view to_string(ClientPathState s) {
  switch (s) {
    case ClientPathState::connecting: return "connecting";
    case ClientPathState::connecting_err: return "connecting_err";
    case ClientPathState::reconnecting: return "reconnecting";
    case ClientPathState::connected: return "connected";
    case ClientPathState::closing: return "closing";
    case ClientPathState::closed: return "closed";
    case ClientPathState::dead: return "dead";
  }
  return "?";
}

std::string_view to_string(ServerPathState s) {
  switch (s) {
    case ServerPathState::connecting: return "connecting";
    case ServerPathState::connected: return "connected";
    case ServerPathState::closing: return "closing";
    case ServerPathState::closed: return "closed";
  }
  return "?";
}

Result<MpPolicy> parse_mp_policy(std::string_view t) {
  t = base::trim(t);
  if (t == "round-robin" || t == "rr" || t == "0") return MpPolicy::round_robin;
  if (t == "min-inflight" || t == "mi" || t == "1") return MpPolicy::min_inflight;
  if (t == "min-latency" || t == "ml" || t == "2") return MpPolicy::min_latency;
  return errc(EINVAL);
}

std::string_view to_string(MpPolicy p) {
  switch (p) {
    case MpPolicy::round_robin: return "round-robin";
    case MpPolicy::min_inflight: return "min-inflight";
    case MpPolicy::min_latency: return "min-latency";
  }
  return "?";
}

Result<int32_t> parse_max_reconnect_attempts(std::string_view t) {
  t = base::trim(t);
  int32_t v = 0;
  auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (t.empty() || ec != std::errc{} || p != t.data() + t.size() || v < -1 || v > 9999)
    return errc(EINVAL);
  return v;
}

Result<StatsGroup> parse_stats_group(std::string_view t) {
  t = base::trim(t);
  for (auto g : {StatsGroup::all, StatsGroup::rdma, StatsGroup::rdma_lat, StatsGroup::wc_completion,
                 StatsGroup::sg_entries, StatsGroup::cpu_migration, StatsGroup::reconnects, StatsGroup::fence})
    if (t == to_string(g)) return g;
  if (t == "reset_all") return StatsGroup::all;
  return errc(EINVAL);
}

std::string_view to_string(StatsGroup g) {
  switch (g) {
    case StatsGroup::all: return "all";
    case StatsGroup::rdma: return "rdma";
    case StatsGroup::rdma_lat: return "rdma_lat";
    case StatsGroup::wc_completion: return "wc_completion";
    case StatsGroup::sg_entries: return "sg_entries";
    case StatsGroup::cpu_migration: return "cpu_migration";
    case StatsGroup::reconnects: return "reconnects";
    case StatsGroup::fence: return "fence";
  }
  return "?";
}

PathStatsSnapshot& PathStatsSnapshot::operator+=(const PathStatsSnapshot& o) {
  read_cnt += o.read_cnt;
  read_bytes += o.read_bytes;
  write_cnt += o.write_cnt;
  write_bytes += o.write_bytes;
  inflight += o.inflight;
  failovered += o.failovered;
  reconnects_ok += o.reconnects_ok;
  reconnects_failed += o.reconnects_failed;
  for (size_t i = 0; i < kLatBuckets; ++i) {
    lat_read[i] += o.lat_read[i];
    lat_write[i] += o.lat_write[i];
  }
  lat_max_read_ns = std::max(lat_max_read_ns, o.lat_max_read_ns);
  lat_max_write_ns = std::max(lat_max_write_ns, o.lat_max_write_ns);
  lat_sum_read_ns += o.lat_sum_read_ns;
  lat_sum_write_ns += o.lat_sum_write_ns;
  polls += o.polls;
  polled_completions += o.polled_completions;
  poll_max = std::max(poll_max, o.poll_max);
  for (size_t i = 0; i < kSgBuckets; ++i) sg_entries[i] += o.sg_entries[i];
  thread_migrations += o.thread_migrations;
  // Per-shard vectors add element-wise over the common length (sessions' paths share a shape).
  if (migrated_from.size() < o.migrated_from.size()) migrated_from.resize(o.migrated_from.size());
  if (migrated_to.size() < o.migrated_to.size()) migrated_to.resize(o.migrated_to.size());
  for (size_t i = 0; i < o.migrated_from.size(); ++i) migrated_from[i] += o.migrated_from[i];
  for (size_t i = 0; i < o.migrated_to.size(); ++i) migrated_to[i] += o.migrated_to[i];
  return *this;
}

}  // namespace ibtrs
