// Reading the daemons' answers back into report types, for a daemon known only by its JSON
// (sysfs-emu's trees over a Backend). ListingReader reads a listing ({"columns": [{"name"}...],
// "rows": [[cell...]...]}, command.h) by column name: client_devices.cc and client_sessions.cc
// read the client daemon's listings with it. Columns are found by name, so an answer with fewer
// or more of them, in another order, reads; a missing column leaves the field as it was; a cell
// of the wrong type marks the row bad (the caller answers EINVAL). FieldReader reads one object
// of an answer the same way, field by field (server_reports.cc). Never throws.
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

// A count into `v`, a T (uint8_t ... uint64_t); false for what is no count or does not fit.
template <typename T>
bool count_into(const nlohmann::json& j, T& v) {
  auto n = count(j);
  if (!n || *n > std::numeric_limits<T>::max()) return false;
  v = static_cast<T>(*n);
  return true;
}

// As the CLI shows a value: a string as it is, anything else as its JSON text.
inline std::string shown(const nlohmann::json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

// One object of an answer ({"name": ..., "count": ...}) read field by field into a report:
// a missing field leaves it as it was, a field of the wrong type (or an object that is not one)
// marks it bad (the caller answers EINVAL). Never throws.
class FieldReader {
 public:
  explicit FieldReader(const nlohmann::json& obj) : obj_(obj), bad_(!obj.is_object()) {}
  bool bad() const { return bad_; }
  // A name that identifies the object: a string, and there must be one.
  void name(const char* k, std::string& v) {
    const nlohmann::json* f = field(k);
    if (f != nullptr && f->is_string()) v = f->get<std::string>();
    else bad_ = true;
  }
  void text(const char* k, std::string& v) {
    if (const nlohmann::json* f = field(k)) v = shown(*f);
  }
  template <typename T>
  void number(const char* k, T& v) {
    if (const nlohmann::json* f = field(k); f != nullptr && !count_into(*f, v)) bad_ = true;
  }
  // A signed count (in flight, a time): any JSON integer that fits an int64_t.
  void integer(const char* k, int64_t& v) {
    if (const nlohmann::json* f = field(k)) {
      if (f->is_number_unsigned() && f->get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max())) bad_ = true;
      else if (f->is_number_integer()) v = f->get<int64_t>();
      else bad_ = true;
    }
  }
  void flag(const char* k, bool& v) {
    if (const nlohmann::json* f = field(k)) {
      if (f->is_boolean()) v = f->get<bool>();
      else bad_ = true;
    }
  }
  // The field `k` if the object has it (and is not bad yet).
  const nlohmann::json* field(const char* k) const {
    if (bad_) return nullptr;
    auto it = obj_.find(k);
    return it == obj_.end() ? nullptr : &*it;
  }
  void set_bad() { bad_ = true; }

 private:
  const nlohmann::json& obj_;
  bool bad_;
};

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
      if (const nlohmann::json* c = cell(name); c != nullptr && !count_into(*c, v)) bad_ = true;
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
