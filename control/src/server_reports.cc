#include "control/server_reports.h"

#include <cerrno>

#include "listing_reader.h"

namespace ibnbd::control {

using nlohmann::json;

json block_stats_to_json(const BlockStats& s) {
  return {{"read_ops", s.read_ops}, {"read_bytes", s.read_bytes}, {"write_ops", s.write_ops},
          {"write_bytes", s.write_bytes}, {"flush_ops", s.flush_ops}, {"discard_ops", s.discard_ops},
          {"write_zeroes_ops", s.write_zeroes_ops}, {"status_ops", s.status_ops}, {"errors", s.errors},
          {"inflight", s.inflight}};
}

json devices_answer(const std::vector<ExportedDeviceReport>& devices) {
  json out = json::array();
  for (const ExportedDeviceReport& d : devices) {
    json holders = json::array();
    for (const HolderReport& h : d.holders)
      holders.push_back({{"session", h.session}, {"device_id", h.device_id}, {"access_mode", h.access_mode}});
    out.push_back({{"name", d.name}, {"kind", d.kind}, {"size", d.size}, {"direct", d.direct},
                   {"read_only", d.read_only}, {"sessions", std::move(holders)},
                   {"stats", block_stats_to_json(d.stats)}});
  }
  return {{"ok", true}, {"devices", std::move(out)}};
}

namespace {

// The field `key` of an answer, or null when it has none (or is no object).
const json* field_of(const json& rsp, const char* key) {
  if (!rsp.is_object()) return nullptr;
  auto it = rsp.find(key);
  return it == rsp.end() ? nullptr : &*it;
}

// The reports of the array `arr`, each of its objects read by read(FieldReader&, Report&).
// EINVAL for no array, or an object read bad.
template <typename Report, typename Read>
Result<std::vector<Report>> read_objects(const json* arr, Read read) {
  if (arr == nullptr || !arr->is_array()) return errc(EINVAL);
  std::vector<Report> out;
  for (const json& e : *arr) {
    detail::FieldReader f(e);
    Report r;
    read(f, r);
    if (f.bad()) return errc(EINVAL);
    out.push_back(std::move(r));
  }
  return out;
}

// block_stats_to_json's inverse of `j`; a field of the wrong type marks `outer` bad.
void read_block_stats(const json& j, BlockStats& s, detail::FieldReader& outer) {
  detail::FieldReader f(j);
  f.number("read_ops", s.read_ops);
  f.number("read_bytes", s.read_bytes);
  f.number("write_ops", s.write_ops);
  f.number("write_bytes", s.write_bytes);
  f.number("flush_ops", s.flush_ops);
  f.number("discard_ops", s.discard_ops);
  f.number("write_zeroes_ops", s.write_zeroes_ops);
  f.number("status_ops", s.status_ops);
  f.number("errors", s.errors);
  f.integer("inflight", s.inflight);
  if (f.bad()) outer.set_bad();
}

}  // namespace

Result<std::vector<ExportedDeviceReport>> devices_from_answer(const json& rsp) {
  return read_objects<ExportedDeviceReport>(field_of(rsp, "devices"), [](detail::FieldReader& f, ExportedDeviceReport& d) {
    f.name("name", d.name);
    f.text("kind", d.kind);
    f.number("size", d.size);
    f.flag("direct", d.direct);
    f.flag("read_only", d.read_only);
    if (const json* hs = f.field("sessions")) {
      auto holders = read_objects<HolderReport>(hs, [](detail::FieldReader& g, HolderReport& h) {
        g.name("session", h.session);
        g.number("device_id", h.device_id);
        g.text("access_mode", h.access_mode);
      });
      if (holders) d.holders = std::move(*holders);
      else f.set_bad();
    }
    if (const json* st = f.field("stats")) read_block_stats(*st, d.stats, f);
  });
}

json refusals_answer(const std::vector<RefusalReport>& refusals) {
  json out = json::array();
  for (const RefusalReport& r : refusals)
    out.push_back({{"reason", r.reason}, {"count", r.count}, {"last", r.last}, {"last_unix_ms", r.last_unix_ms}});
  return {{"ok", true}, {"refusals", std::move(out)}};
}

Result<std::vector<RefusalReport>> refusals_from_answer(const json& rsp) {
  return read_objects<RefusalReport>(field_of(rsp, "refusals"), [](detail::FieldReader& f, RefusalReport& r) {
    f.name("reason", r.reason);
    f.number("count", r.count);
    f.text("last", r.last);
    f.integer("last_unix_ms", r.last_unix_ms);
  });
}

}  // namespace ibnbd::control
