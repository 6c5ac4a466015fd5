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

namespace ibnbd {

using nlohmann::json;

namespace {
json err(int e, const std::string& text) { return control::error(e, text); }
}  // namespace

bool ClientDaemon::path_reports(const std::string& sess, OpenSession& s, const std::string& only,
                                std::vector<control::PathReport>& out) {
  bool found = false;
  for (auto& p : s.s->transport().paths()) {
    if (!only.empty() && p.name != only) continue;
    out.push_back(control::client_path_report(sess, p));
    found = true;
  }
  return found;
}

Result<std::vector<control::PathReport>> ClientDaemon::paths(const std::string& session, const std::string& path) {
  std::lock_guard l(mu_);
  OpenSession* s = find_session(session);
  if (s == nullptr) return errc(ENOENT);
  std::vector<control::PathReport> out;
  if (!path_reports(session, *s, path, out) && !path.empty()) return errc(ENOENT);
  return out;
}

json ClientDaemon::path_stats(const json& req) {
  const std::string n = req.at("session").get<std::string>();
  OpenSession* s = find_session(n);
  if (s == nullptr) return err(ENOENT, "no session " + n);
  const std::string only = req.value("path", "");
  std::vector<control::PathReport> out;
  if (!path_reports(n, *s, only, out) && !only.empty()) return err(ENOENT, "no path " + only + " in session " + n);
  return control::path_stats_answer(out);
}

json ClientDaemon::path_reset_stats(const json& req) {
  const std::string n = req.at("session").get<std::string>();
  OpenSession* s = find_session(n);
  if (s == nullptr) return err(ENOENT, "no session " + n);
  auto group = ibtrs::parse_stats_group(req.value("stats", "all"));
  if (!group)
    return err(EINVAL, "stats: all, rdma, rdma_lat, wc_completion, sg_entries, cpu_migration, reconnects or fence");
  auto st = s->s->transport().reset_stats(req.value("path", ""), *group);
  return st.ok() ? json{{"ok", true}} : err(st.error().value(), "reset stats: " + st.error().message());
}

Result<int32_t> ClientDaemon::max_reconnect_attempts(const std::string& session) {
  std::lock_guard l(mu_);
  OpenSession* s = find_session(session);
  if (s == nullptr) return errc(ENOENT);
  return s->s->transport().max_reconnect_attempts();
}

json ClientDaemon::session_max_reconnect_attempts(const json& req) {
  const std::string n = req.at("session").get<std::string>();
  OpenSession* s = find_session(n);
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
