#include "server_commands.h"

#include <cerrno>
#include <string>

#include "control_socket.h"
#include "control_stats.h"

namespace ibnbd {
namespace {

using nlohmann::json;

json stats_json(const BlockStats& s) {
  return {{"read_ops", s.read_ops}, {"read_bytes", s.read_bytes}, {"write_ops", s.write_ops},
          {"write_bytes", s.write_bytes}, {"flush_ops", s.flush_ops}, {"discard_ops", s.discard_ops},
          {"write_zeroes_ops", s.write_zeroes_ops}, {"errors", s.errors}, {"inflight", s.inflight}};
}

json path_json(const ibtrs::ServerPathInfo& p) {
  return {{"name", p.name},
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
  auto status = [](ibtrs::Status st, const std::string& what) {
    if (st.ok()) return json{{"ok", true}};
    return ControlSocket::error(st.error().value(), what + ": " + st.error().message());
  };
  auto arg = [&](const char* k) -> std::string {
    if (!req.contains(k) || !req[k].is_string()) throw std::invalid_argument(std::string("missing \"") + k + "\"");
    return req[k].get<std::string>();
  };
  if (cmd == "sessions") {
    json out = json::array();
    for (auto& s : srv.sessions()) {
      json paths = json::array();
      for (auto& p : s.paths) paths.push_back(path_json(p));
      json devs = json::array();
      for (auto& d : s.devices)
        devs.push_back({{"device_id", d.device_id}, {"device", d.device},
                        {"access_mode", std::string(to_string(d.mode))}, {"force_closed", d.force_closed}});
      out.push_back({{"name", s.name}, {"version", s.version}, {"paths", paths}, {"devices", devs},
                     {"stats", stats_json(s.stats)}});
    }
    return {{"ok", true}, {"sessions", out}};
  }
  if (cmd == "devices") {
    json out = json::array();
    for (auto& d : srv.devices()) {
      json holders = json::array();
      for (auto& h : d.holders)
        holders.push_back({{"session", h.session}, {"device_id", h.device_id},
                           {"access_mode", std::string(to_string(h.mode))}});
      out.push_back({{"name", d.name}, {"kind", d.kind}, {"size", d.size}, {"direct", d.direct},
                     {"read_only", d.read_only}, {"sessions", holders}, {"stats", stats_json(d.stats)}});
    }
    return {{"ok", true}, {"devices", out}};
  }
  if (cmd == "force_close")
    return status(srv.force_close(arg("device"), arg("session")),
                  "session '" + arg("session") + "' holding device '" + arg("device") + "'");
  if (cmd == "disconnect_path")
    return status(srv.disconnect_path(arg("session"), arg("path")),
                  "path '" + arg("path") + "' of session '" + arg("session") + "'");
  if (cmd == "reset_stats") {
    auto group = ibtrs::parse_stats_group(req.value("stats", "all"));
    if (!group) return ControlSocket::error(EINVAL, "stats: all, rdma, rdma_lat, wc_completion, sg_entries, cpu_migration or reconnects");
    return status(srv.reset_path_stats(arg("session"), req.value("path", ""), *group),
                  "session '" + arg("session") + "'");
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
        j["stats"] = stats_to_json(p.stats);
        out.push_back(std::move(j));
      }
      if (!only.empty() && out.empty()) return ControlSocket::error(ENOENT, "no path " + only + " in session " + sess);
      return {{"ok", true}, {"paths", out}};
    }
    return ControlSocket::error(ENOENT, "no session " + sess);
  }
  if (cmd == "refusals") {
    json out = json::array();
    for (auto& r : srv.refusals().snapshot())
      out.push_back({{"reason", r.reason}, {"count", r.count}, {"last", r.last},
                     {"last_unix_ms", r.last_unix_ms}});
    return {{"ok", true}, {"refusals", out}};
  }
  if (cmd == "reset_refusals") {
    srv.refusals().reset();
    return {{"ok", true}};
  }
  if (cmd == "limits") {
    const ibtrs::ServerOptions& t = srv.options().transport;
    const ibtrs::ServerUsage u = srv.usage();
    return {{"ok", true},
            {"limits", {{"max_sessions", t.max_sessions},
                        {"max_paths_per_session", t.max_paths_per_session},
                        {"max_chunk_memory", t.max_chunk_memory},
                        {"handshake_timeout_ms", t.handshake_timeout.count()},
                        {"ack_timeout_ms", t.ack_timeout.count()}}},
            {"usage", {{"sessions", u.sessions},
                       {"handshaking_sessions", u.handshaking_sessions},
                       {"paths", u.paths},
                       {"chunk_memory", u.chunk_memory},
                       {"backlog", u.backlog}}}};
  }
  return ControlSocket::error(EINVAL, "unknown command '" + cmd + "'");
}

}  // namespace

json server_command(BlockServer& srv, const json& req) {
  try {
    return handle(srv, req);
  } catch (const std::exception& e) {
    return ControlSocket::error(EINVAL, e.what());
  }
}

}  // namespace ibnbd
