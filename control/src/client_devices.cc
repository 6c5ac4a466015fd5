#include "control/client_devices.h"

#include <cerrno>
#include <map>
#include <optional>

#include "control/command.h"

namespace ibnbd::control {

using nlohmann::json;

namespace {

// The list's columns in their order ("right": numbers), then device_show's.
constexpr std::pair<const char*, bool> kListColumns[] = {
    {"device", false},   {"session", false},    {"access_mode", false}, {"size", true},
    {"state", false},    {"device_id", true},   {"rx_bytes", true},     {"tx_bytes", true},
    {"inflights", true}, {"errors", true},      {"remaps", true},       {"nbd", false},
    {"ublk", false},     {"standby", false},    {"standby_state", false}, {"failovers", true}};
constexpr const char* kDetailColumns[] = {"ublk_requests", "ublk_reaped", "ublk_wakeups", "resizes",
                                          "ublk_size",     "last_failover_ms", "resent", "lost_flushes"};

// A count: a JSON integer that is not negative (a daemon writes unsigned ones; a hand-written
// answer may hold signed ones).
std::optional<uint64_t> count(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return static_cast<uint64_t>(v.get<int64_t>());
  return std::nullopt;
}

}  // namespace

json device_listing(const std::vector<DeviceReport>& devices, bool detail) {
  json rows = json::array();
  for (const DeviceReport& d : devices) {
    json row = json::array({d.device, d.session, d.access_mode, bytes_cell(d.size), d.state, d.device_id,
                            bytes_cell(d.rx_bytes), bytes_cell(d.tx_bytes), d.inflight, d.errors, d.remaps, d.nbd,
                            d.ublk, d.standby, d.standby_state, d.failovers});
    if (detail) {
      const DeviceReport::Detail x = d.detail.value_or(DeviceReport::Detail{});
      for (uint64_t v : {x.ublk_requests, x.ublk_reaped, x.ublk_wakeups, x.resizes}) row.push_back(v);
      row.push_back(x.ublk_size ? bytes_cell(*x.ublk_size) : json("-"));
      for (uint64_t v : {x.last_failover_ms, x.resent, x.lost_flushes}) row.push_back(v);
    }
    rows.push_back(std::move(row));
  }
  json cols = json::array();
  for (auto [name, right] : kListColumns) cols.push_back(column(name, right));
  if (detail)
    for (const char* c : kDetailColumns) cols.push_back(column(c, true));
  return {{"ok", true}, {"columns", std::move(cols)}, {"rows", std::move(rows)}};
}

Result<std::vector<DeviceReport>> devices_from_listing(const json& rsp) {
  if (!rsp.is_object() || !rsp.contains("columns") || !rsp.contains("rows") || !rsp["columns"].is_array() ||
      !rsp["rows"].is_array())
    return errc(EINVAL);
  std::map<std::string, size_t, std::less<>> at;
  const json& cols = rsp["columns"];
  for (size_t i = 0; i < cols.size(); ++i) {
    if (!cols[i].is_object() || !cols[i].contains("name") || !cols[i]["name"].is_string()) return errc(EINVAL);
    at.emplace(cols[i]["name"].get<std::string>(), i);
  }
  std::vector<DeviceReport> out;
  for (const json& row : rsp["rows"]) {
    if (!row.is_array()) return errc(EINVAL);
    bool bad = false;
    auto cell = [&](const char* name) -> const json* {
      auto it = at.find(name);
      return it == at.end() || it->second >= row.size() ? nullptr : &row[it->second];
    };
    // As the CLI shows a cell: a string as it is, anything else as its JSON text.
    auto text = [&](const char* name, std::string& v) {
      if (const json* c = cell(name)) v = c->is_string() ? c->get<std::string>() : c->dump();
    };
    auto number = [&](const char* name, uint64_t& v) {
      if (const json* c = cell(name)) {
        auto n = count(*c);
        if (n) v = *n;
        else bad = true;
      }
    };
    // A byte count ({"bytes": N}); nothing for another cell ("-": none).
    auto bytes = [&](const char* name) -> std::optional<uint64_t> {
      const json* c = cell(name);
      if (c == nullptr || !c->is_object()) return std::nullopt;
      auto n = c->contains("bytes") ? count((*c)["bytes"]) : std::nullopt;
      if (!n) bad = true;
      return n;
    };
    DeviceReport d;
    text("device", d.device);
    text("session", d.session);
    text("access_mode", d.access_mode);
    d.size = bytes("size").value_or(0);
    text("state", d.state);
    number("device_id", d.device_id);
    d.rx_bytes = bytes("rx_bytes").value_or(0);
    d.tx_bytes = bytes("tx_bytes").value_or(0);
    number("inflights", d.inflight);
    number("errors", d.errors);
    number("remaps", d.remaps);
    text("nbd", d.nbd);
    text("ublk", d.ublk);
    text("standby", d.standby);
    text("standby_state", d.standby_state);
    number("failovers", d.failovers);
    if (at.count("ublk_requests")) {
      DeviceReport::Detail x;
      number("ublk_requests", x.ublk_requests);
      number("ublk_reaped", x.ublk_reaped);
      number("ublk_wakeups", x.ublk_wakeups);
      number("resizes", x.resizes);
      x.ublk_size = bytes("ublk_size");
      number("last_failover_ms", x.last_failover_ms);
      number("resent", x.resent);
      number("lost_flushes", x.lost_flushes);
      d.detail = x;
    }
    if (bad) return errc(EINVAL);
    out.push_back(std::move(d));
  }
  return out;
}

}  // namespace ibnbd::control
