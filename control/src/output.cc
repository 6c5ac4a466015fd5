#include "control/output.h"

#include <algorithm>
#include <cstdio>

namespace ibnbd::control {

std::optional<Format> parse_format(std::string_view s) {
  if (s == "table" || s == "term") return Format::table;
  if (s == "json") return Format::json;
  if (s == "csv") return Format::csv;
  return std::nullopt;
}

std::optional<Unit> parse_unit(std::string_view s) {
  static constexpr std::pair<std::string_view, Unit> kUnits[] = {
      {"B", Unit::B}, {"K", Unit::K}, {"M", Unit::M}, {"G", Unit::G},
      {"T", Unit::T}, {"P", Unit::P}, {"E", Unit::E}, {"auto", Unit::automatic}};
  for (auto [n, u] : kUnits)
    if (s == n) return u;
  return std::nullopt;
}

std::string format_bytes(uint64_t v, Unit u, bool exact) {
  static constexpr const char* kSuffix[] = {"B", "K", "M", "G", "T", "P", "E"};
  int shift;
  if (u == Unit::automatic) {
    shift = 0;
    while (shift < 6 && (v >> (10 * (shift + 1))) != 0) ++shift;
  } else {
    shift = static_cast<int>(u);
  }
  if (shift == 0) return std::to_string(v) + "B";
  const double d = static_cast<double>(v) / static_cast<double>(uint64_t{1} << (10 * shift));
  char buf[64];
  if (exact) {
    // v / 2^(10 * shift) is a binary fraction a double holds exactly (v < 2^53): 17 significant
    // digits print it to the byte.
    std::snprintf(buf, sizeof(buf), "%.17g%s", d, kSuffix[shift]);
  } else if (v != 0 && d < 1) {
    std::snprintf(buf, sizeof(buf), "%.2g%s", d, kSuffix[shift]);  // not "0.0G" for 64 MiB
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f%s", d, kSuffix[shift]);
  }
  return buf;
}

namespace {

std::string text(const Cell& c, Unit u, bool exact) {
  switch (c.kind) {
    case Cell::Kind::text: return c.s;
    case Cell::Kind::number: return std::to_string(c.i);
    case Cell::Kind::bytes: return format_bytes(c.u, u, exact);
    case Cell::Kind::list: {
      std::string out;
      for (auto& i : c.items) out += (out.empty() ? "" : " ") + i;
      return out;
    }
  }
  return {};
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"') out += '"';
    out += ch;
  }
  return out + "\"";
}

}  // namespace

bool is_field_spec(std::string_view s) {
  if (s.empty()) return false;
  return s == "all" || s.find(',') != std::string_view::npos || s[0] == '+' || s[0] == '-';
}

std::optional<Listing> select_fields(const Listing& l, std::string_view spec, std::string* why) {
  if (spec.empty() || spec == "all") return l;
  std::vector<std::string_view> tokens;
  for (size_t pos = 0; pos <= spec.size();) {
    const size_t end = std::min(spec.find(',', pos), spec.size());
    if (end > pos) tokens.push_back(spec.substr(pos, end - pos));
    pos = end + 1;
  }
  const bool adjust = std::any_of(tokens.begin(), tokens.end(), [](std::string_view t) { return t[0] == '+' || t[0] == '-'; });
  auto index = [&](std::string_view name) -> std::optional<size_t> {
    for (size_t i = 0; i < l.columns.size(); ++i)
      if (l.columns[i].name == name) return i;
    return std::nullopt;
  };
  std::vector<size_t> keep;
  if (adjust)
    for (size_t i = 0; i < l.columns.size(); ++i) keep.push_back(i);
  std::string unknown;
  for (std::string_view t : tokens) {
    const bool minus = t[0] == '-';
    if (t[0] == '+' || t[0] == '-') t.remove_prefix(1);
    auto i = t == "all" ? std::nullopt : index(t);
    if (!i) {
      unknown += (unknown.empty() ? "" : ", ") + std::string(t);
      continue;
    }
    std::erase(keep, *i);
    if (!minus) {
      if (adjust) keep.insert(std::lower_bound(keep.begin(), keep.end(), *i), *i);  // default order
      else keep.push_back(*i);                                                      // the asked order
    }
  }
  if (!unknown.empty()) {
    if (why) {
      *why = "unknown field " + unknown + " (fields:";
      for (auto& c : l.columns) *why += " " + c.name;
      *why += ")";
    }
    return std::nullopt;
  }
  Listing out;
  for (size_t i : keep) out.columns.push_back(l.columns[i]);
  for (auto& row : l.rows) {
    std::vector<Cell> r;
    for (size_t i : keep)
      if (i < row.size()) r.push_back(row[i]);
    out.rows.push_back(std::move(r));
  }
  return out;
}

std::string render(const Listing& l, const OutputOptions& o) {
  std::string out;
  if (o.format == Format::json) {
    nlohmann::json arr = nlohmann::json::array();
    for (auto& row : l.rows) {
      nlohmann::json obj = nlohmann::json::object();
      for (size_t i = 0; i < l.columns.size() && i < row.size(); ++i) {
        const Cell& c = row[i];
        auto& field = obj[l.columns[i].name];
        switch (c.kind) {
          case Cell::Kind::text: field = c.s; break;
          case Cell::Kind::number: field = c.i; break;
          case Cell::Kind::bytes: field = c.u; break;
          case Cell::Kind::list: field = c.items; break;
        }
      }
      arr.push_back(std::move(obj));
    }
    return arr.dump(2) + "\n";
  }
  std::vector<std::vector<std::string>> cells;
  for (auto& row : l.rows) {
    std::vector<std::string> r;
    for (auto& c : row) r.push_back(text(c, o.unit, o.format == Format::csv));
    cells.push_back(std::move(r));
  }
  if (o.format == Format::csv) {
    auto line = [&](const std::vector<std::string>& v) {
      for (size_t i = 0; i < v.size(); ++i) {
        if (i) out += ',';
        out += csv_field(v[i]);
      }
      out += "\n";
    };
    if (o.headers) {
      std::vector<std::string> h;
      for (auto& c : l.columns) h.push_back(c.name);
      line(h);
    }
    for (auto& r : cells) line(r);
    return out;
  }
  std::vector<size_t> w(l.columns.size(), 0);
  for (size_t i = 0; i < l.columns.size(); ++i) {
    if (o.headers) w[i] = l.columns[i].name.size();
    for (auto& r : cells)
      if (i < r.size()) w[i] = std::max(w[i], r[i].size());
  }
  auto line = [&](const std::vector<std::string>& v) {
    std::string s;
    for (size_t i = 0; i < l.columns.size(); ++i) {
      const std::string& t = i < v.size() ? v[i] : std::string();
      const std::string pad(w[i] - std::min(w[i], t.size()), ' ');
      if (i) s += "  ";
      s += l.columns[i].right ? pad + t : t + (i + 1 < l.columns.size() ? pad : "");
    }
    out += s + "\n";
  };
  if (o.headers) {
    std::vector<std::string> h;
    for (auto& c : l.columns) h.push_back(c.name);
    line(h);
  }
  for (auto& r : cells) line(r);
  return out;
}

}  // namespace ibnbd::control
