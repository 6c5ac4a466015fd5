#include "control/command.h"

#include <cstring>
#include <stdexcept>

namespace ibnbd::control {

using nlohmann::json;

json error(int err, const std::string& text) {
  return {{"ok", false}, {"errno", err}, {"error", text.empty() ? std::strerror(err) : text}};
}

json error(std::error_code ec, const std::string& what) { return error(ec.value(), what + ": " + ec.message()); }

json answer(const Status& st, const std::string& what) {
  if (st.ok()) return json{{"ok", true}};
  return error(st.error(), what);
}

std::string string_arg(const json& req, const char* key) {
  if (!req.contains(key) || !req[key].is_string()) throw std::invalid_argument(std::string("missing \"") + key + "\"");
  return req[key].get<std::string>();
}

json column(const char* name, bool right) { return json{{"name", name}, {"right", right}}; }

json bytes_cell(uint64_t v) { return json{{"bytes", v}}; }

Listing listing_from_json(const json& rsp) {
  auto as_text = [](const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); };
  Listing l;
  for (auto& col : rsp["columns"])
    l.columns.push_back(Column{col.contains("name") ? as_text(col["name"]) : "", col.value("right", false)});
  for (auto& row : rsp["rows"]) {
    std::vector<Cell> r;
    for (size_t i = 0; i < l.columns.size() && i < row.size(); ++i) {
      const json& v = row[i];
      if (v.is_object() && v.contains("bytes")) r.push_back(Bytes{v["bytes"].get<uint64_t>()});
      else if (v.is_number()) r.push_back(v.get<int64_t>());
      else if (v.is_array()) r.push_back(v.get<std::vector<std::string>>());
      else r.push_back(as_text(v));
    }
    l.rows.push_back(std::move(r));
  }
  return l;
}

}  // namespace ibnbd::control
