// Reading a listing answer ({"columns": [{"name"}...], "rows": [[cell...]...]}, command.h) back
// into a report type by column name: client_devices.cc and client_sessions.cc read the client
// daemon's listings with it when they know the daemon only by its JSON (sysfs-emu's trees over a
// Backend). Columns are found by name, so an answer with fewer or more of them, in another
// order, reads; a missing column leaves the field as it was; a cell of the wrong type marks the
// row bad (the caller answers EINVAL). Never throws.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace ibnbd::control::detail {

// A count: a JSON integer that is not negative (a daemon writes unsigned ones; a hand-written
// answer may hold signed ones).
inline std::optional<uint64_t> count(const nlohmann::json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return static_cast<uint64_t>(v.get<int64_t>());
  return std::nullopt;
}

// As the CLI shows a value: a string as it is, anything else as its JSON text.
inline std::string shown(const nlohmann::json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

class ListingReader {
 public:
  // False for an answer that is not a listing (no columns or rows arrays, a column without a
  // string name).
  bool open(const nlohmann::json& rsp) {
    if (!rsp.is_object() || !rsp.contains("columns") || !rsp.contains("rows") || !rsp["columns"].is_array() ||
        !rsp["rows"].is_array())
      return false;
    const nlohmann::json& cols = rsp["columns"];
    for (size_t i = 0; i < cols.size(); ++i) {
      if (!cols[i].is_object() || !cols[i].contains("name") || !cols[i]["name"].is_string()) return false;
      at_.emplace(cols[i]["name"].get<std::string>(), i);
    }
    rows_ = &rsp["rows"];
    return true;
  }
  const nlohmann::json& rows() const { return *rows_; }
  bool has(const char* name) const { return at_.count(name) != 0; }

  // One row's cells; bad() once a cell had the wrong type (or the row is not an array).
  class Row {
   public:
    Row(const ListingReader& l, const nlohmann::json& row) : l_(l), row_(row), bad_(!row.is_array()) {}
    bool bad() const { return bad_; }
    void text(const char* name, std::string& v) {
      if (const nlohmann::json* c = cell(name)) v = shown(*c);
    }
    template <typename T>
    void number(const char* name, T& v) {
      if (const nlohmann::json* c = cell(name)) {
        auto n = count(*c);
        if (n && *n <= std::numeric_limits<T>::max()) v = static_cast<T>(*n);
        else bad_ = true;
      }
    }
    // A byte count ({"bytes": N}); nothing for another cell ("-": none) or a missing column.
    std::optional<uint64_t> bytes(const char* name) {
      const nlohmann::json* c = cell(name);
      if (c == nullptr || !c->is_object()) return std::nullopt;
      auto n = c->contains("bytes") ? count((*c)["bytes"]) : std::nullopt;
      if (!n) bad_ = true;
      return n;
    }

   private:
    const nlohmann::json* cell(const char* name) const {
      if (bad_) return nullptr;
      auto it = l_.at_.find(name);
      return it == l_.at_.end() || it->second >= row_.size() ? nullptr : &row_[it->second];
    }
    const ListingReader& l_;
    const nlohmann::json& row_;
    bool bad_;
  };

 private:
  std::map<std::string, size_t, std::less<>> at_;
  const nlohmann::json* rows_ = nullptr;
};

}  // namespace ibnbd::control::detail
