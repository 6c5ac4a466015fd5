#include "server_commands.h"

#include <algorithm>
#include <cerrno>
#include <string>

#include "control/command.h"
#include "control/stats.h"

namespace ibnbd {
namespace {

using nlohmann::json;

json path_json(const ibtrs::ServerPathInfo& p) {
  return {{"name", p.name},
          {"auth", std::string(ibtrs::to_string(p.auth.state))},
          {"auth_host", p.auth.host},
          {"auth_bidirectional", p.auth.bidirectional},
          {"auth_method", p.auth.method},
          {"tls", ibtrs::tls::describe(p.tls)},
          {"src_addr", p.peer.to_string()},
          {"dst_addr", p.local.to_string()},
          {"state", std::string(ibtrs::to_string(p.state))},
          {"hca_name", p.hca_name},
          {"hca_port", p.hca_port},
          {"read_cnt", p.stats.read_cnt},
          {"read_bytes", p.stats.read_bytes},
          {"write_cnt", p.stats.write_cnt},
          {"write_bytes", p.stats.write_bytes},
          {"inflight", p.stats.inflight}};
}

json handle(BlockServer& srv, const json& req) {
  const std::string cmd = req.at("cmd").get<std::string>();
  auto status = [](const ibtrs::Status& st, const std::string& what) { return control::answer(st, what); };
  auto arg = [&](const char* k) { return control::string_arg(req, k); };
  if (cmd == "sessions") {
    json out = json::array();
    for (auto& s : srv.sessions()) {
      json paths = json::array();
      for (auto& p : s.paths) paths.push_back(path_json(p));
      json devs = json::array();
      for (auto& d : s.devices)
        devs.push_back({{"device_id", d.device_id}, {"device", d.device},
                        {"access_mode", std::string(to_string(d.mode))}, {"force_closed", d.force_closed}});
      out.push_back({{"name", s.name}, {"host", s.host}, {"version", s.version}, {"watching", s.watching},
                     {"size_epoch", s.size_epoch}, {"paths", paths}, {"devices", devs},
                     {"stats", control::block_stats_to_json(s.stats)}});
    }
    return {{"ok", true}, {"sessions", out}};
  }
  // devices and refusals: the typed reports sysfs-emu reads, written as JSON (one source, so
  // the socket and the files cannot tell two stories).
  if (cmd == "devices") return control::devices_answer(server_devices(srv));
  if (cmd == "force_close")
    return status(srv.force_close(arg("device"), arg("session")),
                  "session '" + arg("session") + "' holding device '" + arg("device") + "'");
  if (cmd == "disconnect_path")
    return status(srv.disconnect_path(arg("session"), arg("path")),
                  "path '" + arg("path") + "' of session '" + arg("session") + "'");
  if (cmd == "reset_stats") {
    auto group = ibtrs::parse_stats_group(req.value("stats", "all"));
    // The server's paths have no fence counters (those are the client's; the server counts its
    // answers in `limits`).
    if (!group || *group == ibtrs::StatsGroup::fence)
      return control::error(EINVAL, "stats: all, rdma, rdma_lat, wc_completion, sg_entries, cpu_migration or reconnects");
    return status(srv.reset_path_stats(arg("session"), req.value("path", ""), *group),
                  "session '" + arg("session") + "'");
  }
  if (cmd == "host_add") {
    std::string why;
    auto h = host_from_json(req, &why);
    if (!h.ok()) return control::error(h.error().value(), why);
    const auto hosts = srv.hosts();
    const bool known = std::any_of(hosts.begin(), hosts.end(), [&](const HostInfo& i) { return i.host == h->host; });
    const std::string name = h->host;
    auto st = srv.set_host(std::move(*h), !req.contains("access"));
    if (!st.ok()) return control::error(st.error().value(), "host " + name + ": " + st.error().message());
    return {{"ok", true}, {"host", name}, {"replaced", known},
            {"message", std::string(known ? "replaced" : "added") + " host " + name +
                            ": paths that authenticate from now on use its new keys"}};
  }
  if (cmd == "host_remove") return status(srv.remove_host(arg("host")), "host '" + arg("host") + "'");
  if (cmd == "host_list") {
    json out = json::array();
    for (auto& h : srv.hosts()) {
      json rules = json::array();
      for (auto& r : h.access) rules.push_back({{"devices", r.devices}, {"mode", std::string(to_string(r.mode))}});
      out.push_back({{"host", h.host}, {"keys", h.key_fingerprints}, {"server_key", h.server_key_fingerprint},
                     {"access", rules}, {"sessions", h.sessions}});
    }
    return {{"ok", true}, {"hosts", out}, {"allow_any_host", srv.auth_stats().allow_any_host}};
  }
  if (cmd == "auth_stats") {
    const AuthStats a = srv.auth_stats();
    const auto& t = a.transport;
    return {{"ok", true},
            {"allow_any_host", a.allow_any_host},
            {"authenticated", t.authenticated},
            {"anonymous", t.anonymous},
            {"refused_no_credentials", t.refused_no_credentials},
            {"refused_unknown_host", t.refused_unknown_host},
            {"refused_bad_response", t.refused_bad_response},
            {"refused_host_mismatch", t.refused_host_mismatch},
            {"refused_protocol", t.refused_protocol},
            {"open_refused_eacces", a.open_refused_eacces},
            {"open_refused_eperm", a.open_refused_eperm}};
  }
  if (cmd == "path_stats") {
    const std::string sess = arg("session");
    const std::string only = req.value("path", "");
    for (auto& s : srv.sessions()) {
      if (s.name != sess) continue;
      json out = json::array();
      for (auto& p : s.paths) {
        if (!only.empty() && p.name != only) continue;
        json j = path_json(p);
        j["fabric"] = std::string(ibtrs::to_string(p.local.fabric));
        // The kernel's src_addr/dst_addr files show the host only ("ip:10.0.0.1").
        j["src_host"] = p.peer.host_string();
        j["dst_host"] = p.local.host_string();
        j["dst_port"] = p.local.port;
        j["stats"] = control::stats_to_json(p.stats);
        out.push_back(std::move(j));
      }
      if (!only.empty() && out.empty()) return control::error(ENOENT, "no path " + only + " in session " + sess);
      return {{"ok", true}, {"paths", out}};
    }
    return control::error(ENOENT, "no session " + sess);
  }
  if (cmd == "refusals") return control::refusals_answer(server_refusals(srv));
  if (cmd == "reset_refusals") {
    srv.refusals().reset();
    return {{"ok", true}};
  }
  if (cmd == "io_threads") {
    // How each IO thread waited for work (--poll): spins that caught the next request saved
    // it a wake-up; misses and blocks by reason say why it did not spin.
    json out = json::array();
    for (const ibtrs::IoThreadWaitStats& w : srv.io_thread_stats()) {
      json blocked = json::object();
      for (auto& [reason, n] : w.blocked) blocked[reason] = n;
      out.push_back({{"thread", w.thread}, {"mode", w.mode}, {"waits", w.waits},
                     {"spins_caught", w.spins_caught}, {"spins_missed", w.spins_missed},
                     {"spins_preempted", w.spins_preempted}, {"sleeps", w.sleeps},
                     {"blocked", blocked}, {"expected_gap_ns", w.expected_gap_ns}});
    }
    return {{"ok", true}, {"io_threads", out}};
  }
  if (cmd == "limits") {
    const ibtrs::ServerOptions& t = srv.transport_options();
    const ibtrs::ServerUsage u = srv.usage();
    return {{"ok", true},
            {"limits", {{"max_sessions", t.max_sessions},
                        {"max_paths_per_session", t.max_paths_per_session},
                        {"max_chunk_memory", t.max_chunk_memory},
                        {"handshake_timeout_ms", t.handshake_timeout.count()},
                        {"ack_timeout_ms", t.ack_timeout.count()},
                        {"drain_hold_ms", t.drain_hold.count()}}},
            {"usage", {{"sessions", u.sessions},
                       {"handshaking_sessions", u.handshaking_sessions},
                       {"paths", u.paths},
                       {"chunk_memory", u.chunk_memory},
                       {"chunk_resident", u.chunk_resident},
                       {"backlog", u.backlog},
                       {"held_connects", u.held_connects},
                       {"fences_answered", u.fences_answered},
                       {"fences_closed", u.fences_closed}}}};
  }
  return control::error(EINVAL, "unknown command '" + cmd + "'");
}

}  // namespace

Result<HostConfig> host_from_json(const json& j, std::string* why) {
  auto bad = [&](int e, std::string reason) -> std::error_code {
    if (why != nullptr) *why = std::move(reason);
    return ibtrs::errc(e);
  };
  if (!j.is_object()) return bad(EINVAL, "a host is a JSON object");
  for (auto& [k, v] : j.items()) {
    if (k != "cmd" && k != "host" && k != "key" && k != "key_file" && k != "server_key" &&
        k != "server_key_file" && k != "access")
      return bad(EINVAL, "host: unknown setting '" + k + "'");
    if (k != "access" && !v.is_string()) return bad(EINVAL, "host: " + k + " must be a string");
  }
  HostConfig h;
  h.host = j.value("host", "");
  std::optional<ibtrs::Secret> key, server_key;
  if (j.contains("key_file")) {
    std::string r;
    auto f = ibtrs::load_key_file(j["key_file"].get<std::string>(), &r);
    if (!f.ok()) return bad(f.error().value(), r);
    if (!f->host.empty() && !h.host.empty() && f->host != h.host)
      return bad(EINVAL, j["key_file"].get<std::string>() + " is the key of host " + f->host + ", not " + h.host);
    if (h.host.empty()) h.host = f->host;
    key = f->key;
    server_key = f->server_key;
  }
  for (const char* k : {"key", "server_key"}) {
    if (!j.contains(k)) continue;
    auto s = ibtrs::Secret::parse(j[k].get<std::string>());
    if (!s.ok()) return bad(s.error().value(), std::string(k) + ": expected DHHC-1:<hh>:<base64>:");
    (std::string(k) == "key" ? key : server_key) = std::move(*s);
  }
  if (j.contains("server_key_file")) {
    std::string r;
    auto f = ibtrs::load_key_file(j["server_key_file"].get<std::string>(), &r);
    if (!f.ok()) return bad(f.error().value(), r);
    server_key = f->key;
  }
  if (!ibtrs::valid_host_id(h.host)) return bad(EINVAL, "host: a host id (printable, no spaces, 1..223 bytes)");
  if (!key) return bad(EINVAL, "host " + h.host + ": no key (key_file or key)");
  h.keys.push_back(std::move(*key));
  h.server_key = std::move(server_key);
  if (j.contains("access")) {
    if (!j["access"].is_array()) return bad(EINVAL, "access: a list of {\"devices\", \"mode\"}");
    for (auto& r : j["access"]) {
      if (!r.is_object() || !r.contains("devices") || !r["devices"].is_string())
        return bad(EINVAL, "access: each entry needs \"devices\"");
      auto m = parse_access_mode(r.value("mode", "ro"));
      if (!m) return bad(EINVAL, "access: mode is ro, rw or migration");
      h.access.push_back(AccessRule{r["devices"].get<std::string>(), *m});
    }
  }
  return h;
}

json server_command(BlockServer& srv, const json& req) {
  try {
    return handle(srv, req);
  } catch (const std::exception& e) {
    return control::error(EINVAL, e.what());
  }
}

}  // namespace ibnbd
