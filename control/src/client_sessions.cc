#include "control/client_sessions.h"

#include <sys/socket.h>

#include <cerrno>
#include <limits>

#include "control/command.h"
#include "control/stats.h"
#include "ibtrs/tls.h"
#include "listing_reader.h"

namespace ibnbd::control {

using nlohmann::json;

namespace {

// session_list's columns in their order ("right": numbers).
constexpr std::pair<const char*, bool> kSessionColumns[] = {
    {"sessname", false}, {"path_cnt", true},  {"act_path_cnt", true}, {"state", false},
    {"path_uu", false},  {"mp", false},       {"rx_bytes", true},     {"tx_bytes", true},
    {"inflights", true}, {"reconnects", true}, {"devices", true}};

// path_list's columns in their order. The last three are the failover fence
// (docs/protocol.md): requests that waited for one, incarnations fenced, the last one's round
// trip.
constexpr std::pair<const char*, bool> kPathColumns[] = {
    {"sessname", false},      {"pathname", false},     {"src_addr", false},   {"dst_addr", false},
    {"hca_name", false},      {"hca_port", true},      {"state", false},      {"auth", false},
    {"host", false},          {"tls", false},          {"rx_bytes", true},    {"tx_bytes", true},
    {"inflights", true},      {"reconnects", true},    {"cur_latency_ns", true}, {"last_error", false},
    {"fence_waited", true},   {"fenced", true},        {"fence_rtt_us", true}};

template <size_t N>
json columns_of(const std::pair<const char*, bool> (&cols)[N]) {
  json out = json::array();
  for (auto [name, right] : cols) out.push_back(column(name, right));
  return out;
}

// "authenticated", "authenticated+server" (bidirectional), "none", "pending", "failed".
std::string auth_word(const PathReport& p) { return p.auth + (p.auth_bidirectional ? "+server" : ""); }

}  // namespace

json session_listing(const std::vector<SessionReport>& sessions) {
  json rows = json::array();
  for (const SessionReport& s : sessions)
    rows.push_back(json::array({s.name, s.path_cnt, s.act_path_cnt, s.state, s.path_uu, s.mp, bytes_cell(s.rx_bytes),
                                bytes_cell(s.tx_bytes), s.inflight, s.reconnects, s.devices}));
  return {{"ok", true}, {"columns", columns_of(kSessionColumns)}, {"rows", std::move(rows)}};
}

Result<std::vector<SessionReport>> sessions_from_listing(const json& rsp) {
  detail::ListingReader l;
  if (!l.open(rsp)) return errc(EINVAL);
  std::vector<SessionReport> out;
  for (const json& row : l.rows()) {
    detail::ListingReader::Row c(l, row);
    SessionReport s;
    c.text("sessname", s.name);
    c.number("path_cnt", s.path_cnt);
    c.number("act_path_cnt", s.act_path_cnt);
    c.text("state", s.state);
    c.text("path_uu", s.path_uu);
    c.text("mp", s.mp);
    s.rx_bytes = c.bytes("rx_bytes").value_or(0);
    s.tx_bytes = c.bytes("tx_bytes").value_or(0);
    c.number("inflights", s.inflight);
    c.number("reconnects", s.reconnects);
    c.number("devices", s.devices);
    if (c.bad()) return errc(EINVAL);
    out.push_back(std::move(s));
  }
  return out;
}

PathReport client_path_report(const std::string& session, const ibtrs::ClientPathInfo& p) {
  const ibtrs::Address& dst = p.spec.destination;
  PathReport r;
  r.session = session;
  r.name = p.name;
  r.state = std::string(ibtrs::to_string(p.state));
  r.fabric = std::string(ibtrs::to_string(p.fabric));
  r.hca_name = p.hca_name;
  r.hca_port = p.hca_port;
  r.src_addr = p.spec.source ? p.spec.source->to_string() : "";
  r.dst_addr = dst.to_string();
  r.src_host = p.spec.source ? p.spec.source->host_string() : (dst.family() == AF_INET6 ? "ip:::" : "ip:0.0.0.0");
  r.dst_host = dst.host_string();
  r.dst_port = dst.port;
  r.latency = p.latency;
  r.auth = std::string(ibtrs::to_string(p.auth.state));
  r.auth_host = p.auth.host;
  r.auth_bidirectional = p.auth.bidirectional;
  r.auth_method = p.auth.method;
  r.tls = ibtrs::tls::describe(p.tls);
  r.last_error = p.last_error ? p.last_error.message() : "";
  r.inflight = p.inflight;
  r.stats = p.stats;
  r.fence = p.fence;
  return r;
}

json path_listing(const std::vector<PathReport>& paths) {
  json rows = json::array();
  for (const PathReport& p : paths)
    rows.push_back(json::array({p.session, p.name, p.src_addr, p.dst_addr, p.hca_name, p.hca_port, p.state,
                                auth_word(p), p.auth_host, p.tls, bytes_cell(p.stats.read_bytes),
                                bytes_cell(p.stats.write_bytes), p.inflight, p.stats.reconnects_ok,
                                p.latency ? static_cast<int64_t>(p.latency->count()) : -1, p.last_error,
                                p.fence.waited, p.fence.fenced,
                                std::chrono::duration_cast<std::chrono::microseconds>(p.fence.last_rtt).count()}));
  return {{"ok", true}, {"columns", columns_of(kPathColumns)}, {"rows", std::move(rows)}};
}

json path_stats_answer(const std::vector<PathReport>& paths) {
  json out = json::array();
  for (const PathReport& p : paths)
    out.push_back({{"name", p.name},
                   {"state", p.state},
                   {"fabric", p.fabric},
                   {"hca_name", p.hca_name},
                   {"hca_port", p.hca_port},
                   {"src_host", p.src_host},
                   {"dst_host", p.dst_host},
                   {"dst_port", p.dst_port},
                   {"cur_latency_ns", p.latency ? p.latency->count() : 0},
                   {"auth", p.auth},
                   {"auth_host", p.auth_host},
                   {"auth_bidirectional", p.auth_bidirectional},
                   {"auth_method", p.auth_method},
                   {"tls", p.tls},
                   {"last_error", p.last_error},
                   {"inflight", p.inflight},
                   {"stats", stats_to_json(p.stats)},
                   {"fence", fence_to_json(p.fence)}});
  return {{"ok", true}, {"paths", std::move(out)}};
}

Result<std::vector<PathReport>> paths_from_stats(const json& rsp) {
  if (!rsp.is_object() || !rsp.contains("paths") || !rsp["paths"].is_array()) return errc(EINVAL);
  std::vector<PathReport> out;
  try {
    for (const json& e : rsp["paths"]) {
      if (!e.is_object()) return errc(EINVAL);
      bool bad = false;
      PathReport p;
      auto text = [&](const char* k, std::string& v) {
        if (e.contains(k)) v = detail::shown(e[k]);
      };
      auto number = [&]<typename T>(const char* k, T& v) {
        if (!e.contains(k)) return;
        auto n = detail::count(e[k]);
        if (n && *n <= std::numeric_limits<T>::max()) v = static_cast<T>(*n);
        else bad = true;
      };
      text("name", p.name);
      text("state", p.state);
      text("fabric", p.fabric);
      text("hca_name", p.hca_name);
      number("hca_port", p.hca_port);
      text("src_addr", p.src_addr);
      text("dst_addr", p.dst_addr);
      text("src_host", p.src_host);
      text("dst_host", p.dst_host);
      number("dst_port", p.dst_port);
      if (e.contains("cur_latency_ns")) {
        const json& v = e["cur_latency_ns"];
        if (!v.is_number_integer()) return errc(EINVAL);
        p.latency = std::chrono::nanoseconds(v.get<int64_t>());
      }
      text("auth", p.auth);
      text("auth_host", p.auth_host);
      if (e.contains("auth_bidirectional")) {
        if (!e["auth_bidirectional"].is_boolean()) return errc(EINVAL);
        p.auth_bidirectional = e["auth_bidirectional"].get<bool>();
      }
      text("auth_method", p.auth_method);
      text("tls", p.tls);
      text("last_error", p.last_error);
      number("inflight", p.inflight);
      // The codecs throw on wrong types (caught below).
      if (e.contains("stats")) p.stats = stats_from_json(e["stats"]);
      if (e.contains("fence")) p.fence = fence_from_json(e["fence"]);
      if (bad) return errc(EINVAL);
      out.push_back(std::move(p));
    }
  } catch (const json::exception&) {
    return errc(EINVAL);
  }
  return out;
}

}  // namespace ibnbd::control
