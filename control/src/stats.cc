#include "control/stats.h"

namespace ibnbd::control {

using nlohmann::json;

json stats_to_json(const ibtrs::PathStatsSnapshot& s) {
  return {{"read_cnt", s.read_cnt},
          {"read_bytes", s.read_bytes},
          {"write_cnt", s.write_cnt},
          {"write_bytes", s.write_bytes},
          {"inflight", s.inflight},
          {"failovered", s.failovered},
          {"reconnects_ok", s.reconnects_ok},
          {"reconnects_failed", s.reconnects_failed},
          {"lat_read", s.lat_read},
          {"lat_write", s.lat_write},
          {"lat_max_read_ns", s.lat_max_read_ns},
          {"lat_max_write_ns", s.lat_max_write_ns},
          {"lat_sum_read_ns", s.lat_sum_read_ns},
          {"lat_sum_write_ns", s.lat_sum_write_ns},
          {"polls", s.polls},
          {"polled_completions", s.polled_completions},
          {"poll_max", s.poll_max},
          {"sg_entries", s.sg_entries},
          {"thread_migrations", s.thread_migrations},
          {"migrated_from", s.migrated_from},
          {"migrated_to", s.migrated_to}};
}

ibtrs::PathStatsSnapshot stats_from_json(const json& j) {
  ibtrs::PathStatsSnapshot s;
  auto u = [&](const char* k, uint64_t& v) {
    if (j.contains(k)) v = j[k].get<uint64_t>();
  };
  auto arr = [&](const char* k, auto& a) {
    if (!j.contains(k)) return;
    const json& v = j[k];
    for (size_t i = 0; i < a.size() && i < v.size(); ++i) a[i] = v[i].get<uint64_t>();
  };
  u("read_cnt", s.read_cnt);
  u("read_bytes", s.read_bytes);
  u("write_cnt", s.write_cnt);
  u("write_bytes", s.write_bytes);
  if (j.contains("inflight")) s.inflight = j["inflight"].get<int64_t>();
  u("failovered", s.failovered);
  u("reconnects_ok", s.reconnects_ok);
  u("reconnects_failed", s.reconnects_failed);
  arr("lat_read", s.lat_read);
  arr("lat_write", s.lat_write);
  u("lat_max_read_ns", s.lat_max_read_ns);
  u("lat_max_write_ns", s.lat_max_write_ns);
  u("lat_sum_read_ns", s.lat_sum_read_ns);
  u("lat_sum_write_ns", s.lat_sum_write_ns);
  u("polls", s.polls);
  u("polled_completions", s.polled_completions);
  u("poll_max", s.poll_max);
  arr("sg_entries", s.sg_entries);
  u("thread_migrations", s.thread_migrations);
  if (j.contains("migrated_from")) s.migrated_from = j["migrated_from"].get<std::vector<uint64_t>>();
  if (j.contains("migrated_to")) s.migrated_to = j["migrated_to"].get<std::vector<uint64_t>>();
  return s;
}

json fence_to_json(const ibtrs::ClientPathInfo::Fence& f) {
  return {{"waited", f.waited},
          {"fenced", f.fenced},
          {"last_rtt_ns", f.last_rtt.count()},
          {"max_rtt_ns", f.max_rtt.count()}};
}

ibtrs::ClientPathInfo::Fence fence_from_json(const json& j) {
  ibtrs::ClientPathInfo::Fence f;
  f.waited = j.value("waited", uint64_t{0});
  f.fenced = j.value("fenced", uint64_t{0});
  f.last_rtt = std::chrono::nanoseconds(j.value("last_rtt_ns", int64_t{0}));
  f.max_rtt = std::chrono::nanoseconds(j.value("max_rtt_ns", int64_t{0}));
  return f;
}

}  // namespace ibnbd::control
