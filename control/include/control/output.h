// Listings of the `ibnbd` CLI and the migration agent: rows of named fields rendered as an aligned
// table, JSON or CSV, with byte counts in the unit the user asked for (the `rnbd` tool's output
// options). A daemon's listing answer becomes one with command.h's listing_from_json.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace ibnbd::control {

enum class Format : uint8_t { table, json, csv };
std::optional<Format> parse_format(std::string_view s);

// Byte counts: "auto" picks the largest binary unit that keeps a value >= 1.
enum class Unit : uint8_t { B, K, M, G, T, P, E, automatic };
std::optional<Unit> parse_unit(std::string_view s);
// One decimal for people ("1.5K"; two significant digits below one unit: "0.062G"); `exact`
// (csv: read by programs) prints the value to the byte ("0.0625G").
std::string format_bytes(uint64_t v, Unit u, bool exact = false);

struct Bytes {
  uint64_t v = 0;
};
// A text, a number or a byte count. (Not a std::variant: g++ 12 warns falsely about moving one
// that holds a std::string.)
struct Cell {
  enum class Kind : uint8_t { text, number, bytes, list };
  Cell(std::string t) : kind(Kind::text), s(std::move(t)) {}  // NOLINT: implicit by design
  Cell(const char* t) : kind(Kind::text), s(t) {}             // NOLINT
  Cell(int64_t n) : kind(Kind::number), i(n) {}               // NOLINT
  Cell(Bytes b) : kind(Kind::bytes), u(b.v) {}                // NOLINT
  // Several values (an export's URIs): a JSON array, space-separated in a table or csv.
  Cell(std::vector<std::string> l) : kind(Kind::list), items(std::move(l)) {}  // NOLINT
  Kind kind;
  std::string s;
  std::vector<std::string> items;
  int64_t i = 0;
  uint64_t u = 0;
};

struct Column {
  std::string name;
  bool right = false;  // numbers align right
};

struct Listing {
  std::vector<Column> columns;
  std::vector<std::vector<Cell>> rows;
};

struct OutputOptions {
  Format format = Format::table;
  Unit unit = Unit::automatic;
  bool headers = true;
  std::string fields;  // a field selection (select_fields); empty: every column
};

// The rnbd tool's field selection: "a,b" shows exactly those columns in that order; "+a" /
// "-b" adjust the default set (every column); "all" is every column. True for a spec that is
// one, whatever the listing ("all", a comma, a leading + or -): how a command line tells it
// from a name. Unknown fields: std::nullopt and *why names them and the listing's fields.
bool is_field_spec(std::string_view s);
std::optional<Listing> select_fields(const Listing& l, std::string_view spec, std::string* why);

// JSON keeps raw byte counts (numbers), whatever the unit.
std::string render(const Listing& l, const OutputOptions& o);

}  // namespace ibnbd::control
