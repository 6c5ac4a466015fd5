#include "control/client_devices.h"

#include <cerrno>

#include "control/command.h"
#include "listing_reader.h"

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
  detail::ListingReader l;
  if (!l.open(rsp)) return errc(EINVAL);
  std::vector<DeviceReport> out;
  for (const json& row : l.rows()) {
    detail::ListingReader::Row c(l, row);
    DeviceReport d;
    c.text("device", d.device);
    c.text("session", d.session);
    c.text("access_mode", d.access_mode);
    d.size = c.bytes("size").value_or(0);
    c.text("state", d.state);
    c.number("device_id", d.device_id);
    d.rx_bytes = c.bytes("rx_bytes").value_or(0);
    d.tx_bytes = c.bytes("tx_bytes").value_or(0);
    c.number("inflights", d.inflight);
    c.number("errors", d.errors);
    c.number("remaps", d.remaps);
    c.text("nbd", d.nbd);
    c.text("ublk", d.ublk);
    c.text("standby", d.standby);
    c.text("standby_state", d.standby_state);
    c.number("failovers", d.failovers);
    if (l.has("ublk_requests")) {
      DeviceReport::Detail x;
      c.number("ublk_requests", x.ublk_requests);
      c.number("ublk_reaped", x.ublk_reaped);
      c.number("ublk_wakeups", x.ublk_wakeups);
      c.number("resizes", x.resizes);
      x.ublk_size = c.bytes("ublk_size");
      c.number("last_failover_ms", x.last_failover_ms);
      c.number("resent", x.resent);
      c.number("lost_flushes", x.lost_flushes);
      d.detail = x;
    }
    if (c.bad()) return errc(EINVAL);
    out.push_back(std::move(d));
  }
  return out;
}

}  // namespace ibnbd::control
