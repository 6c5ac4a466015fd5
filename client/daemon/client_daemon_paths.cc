// ClientDaemon commands over a session's paths and settings that the sysfs files need and the
// CLI can use too (client/README.md, "Control socket"):
//   path_stats {session, path?}         every counter of the paths (control/stats.h),
//                                       the failover fence's, and what the kernel's path files show
//   path_reset_stats {session, path?, stats?: all|rdma|rdma_lat|wc_completion|sg_entries|
//                     cpu_migration|reconnects|fence}
//   session_max_reconnect_attempts {session, value?: -1..9999}   reads, or sets then reads
// Kept in their own file so the daemon's main command file stays as it is for other work.
#include "client_daemon.h"
#include "control/command.h"
#include "control/stats.h"

namespace ibnbd {

using nlohmann::json;

namespace {
json err(int e, const std::string& text) { return control::error(e, text); }
}  // namespace

json ClientDaemon::path_stats(const json& req) {
  const std::string n = req.at("session").get<std::string>();
  Sess* s = find_session(n);
  if (s == nullptr) return err(ENOENT, "no session " + n);
  const std::string only = req.value("path", "");
  json out = json::array();
  for (auto& p : s->s->transport().paths()) {
    if (!only.empty() && p.name != only) continue;
    const ibtrs::Address& dst = p.spec.destination;
    out.push_back({{"name", p.name},
                   {"state", std::string(ibtrs::to_string(p.state))},
                   {"fabric", std::string(ibtrs::to_string(p.fabric))},
                   {"hca_name", p.hca_name},
                   {"hca_port", p.hca_port},
                   // The kernel's src_addr/dst_addr files show the host only ("ip:10.0.0.1");
                   // an unset source is the wildcard address of the destination's family.
                   {"src_host", p.spec.source ? p.spec.source->host_string()
                                              : (dst.family() == AF_INET6 ? "ip:::" : "ip:0.0.0.0")},
                   {"dst_host", dst.host_string()},
                   {"dst_port", dst.port},
                   {"cur_latency_ns", p.latency ? p.latency->count() : 0},
                   {"auth", std::string(ibtrs::to_string(p.auth.state))},
                   {"auth_host", p.auth.host},
                   {"auth_bidirectional", p.auth.bidirectional},
                   {"auth_method", p.auth.method},
                   {"tls", ibtrs::tls::describe(p.tls)},
                   {"last_error", p.last_error ? p.last_error.message() : ""},
                   {"inflight", p.inflight},
                   {"stats", control::stats_to_json(p.stats)},
                   {"fence", control::fence_to_json(p.fence)}});
  }
  if (!only.empty() && out.empty()) return err(ENOENT, "no path " + only + " in session " + n);
  return {{"ok", true}, {"paths", out}};
}

json ClientDaemon::path_reset_stats(const json& req) {
  const std::string n = req.at("session").get<std::string>();
  Sess* s = find_session(n);
  if (s == nullptr) return err(ENOENT, "no session " + n);
  auto group = ibtrs::parse_stats_group(req.value("stats", "all"));
  if (!group)
    return err(EINVAL, "stats: all, rdma, rdma_lat, wc_completion, sg_entries, cpu_migration, reconnects or fence");
  auto st = s->s->transport().reset_stats(req.value("path", ""), *group);
  return st.ok() ? json{{"ok", true}} : err(st.error().value(), "reset stats: " + st.error().message());
}

json ClientDaemon::max_reconnect_attempts(const json& req) {
  const std::string n = req.at("session").get<std::string>();
  Sess* s = find_session(n);
  if (s == nullptr) return err(ENOENT, "no session " + n);
  auto& t = s->s->transport();
  if (req.contains("value")) {
    const json& v = req["value"];
    auto a = v.is_string() ? ibtrs::parse_max_reconnect_attempts(v.get<std::string>())
                           : ibtrs::parse_max_reconnect_attempts(std::to_string(v.get<int64_t>()));
    if (!a) return err(EINVAL, "max_reconnect_attempts: -1..9999");
    auto st = t.set_max_reconnect_attempts(*a);
    if (!st.ok()) return err(st.error().value(), "max_reconnect_attempts: " + st.error().message());
  }
  return {{"ok", true}, {"max_reconnect_attempts", t.max_reconnect_attempts()}};
}

}  // namespace ibnbd
