#include "base/text.h"

#include <charconv>
#include <climits>

namespace base {

std::optional<uint64_t> parse_size(std::string_view s) {
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p == s.data()) return std::nullopt;
  const std::string_view unit(p, static_cast<size_t>(s.data() + s.size() - p));
  int shift;
  if (unit.empty() || unit == "B") shift = 0;
  else if (unit == "K" || unit == "k" || unit == "KiB") shift = 10;
  else if (unit == "M" || unit == "m" || unit == "MiB") shift = 20;
  else if (unit == "G" || unit == "g" || unit == "GiB") shift = 30;
  else if (unit == "T" || unit == "t" || unit == "TiB") shift = 40;
  else return std::nullopt;
  if (shift != 0 && v > (UINT64_MAX >> shift)) return std::nullopt;
  return v << shift;
}

}  // namespace base
