#include "ibnbd/types.h"

#include <charconv>
#include <cstdint>

#include "base/text.h"

namespace ibnbd {

std::optional<AccessMode> parse_access_mode(std::string_view s) {
  // Control files and map options end in a newline; the words are the kernel's.
  s = base::trim(s);
  if (s == "ro") return AccessMode::ro;
  if (s == "rw") return AccessMode::rw;
  if (s == "migration") return AccessMode::migration;
  return std::nullopt;
}

std::string_view to_string(AccessMode m) {
  switch (m) {
    case AccessMode::ro: return "ro";
    case AccessMode::rw: return "rw";
    case AccessMode::migration: return "migration";
  }
  return "?";
}

std::string_view to_string(IoOp op) {
  switch (op) {
    case IoOp::read: return "read";
    case IoOp::write: return "write";
    case IoOp::flush: return "flush";
    case IoOp::discard: return "discard";
    case IoOp::secure_erase: return "secure_erase";
    case IoOp::write_zeroes: return "write_zeroes";
    case IoOp::block_status: return "block_status";
  }
  return "?";
}

std::optional<uint64_t> parse_size(std::string_view s) {
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p == s.data()) return std::nullopt;
  const std::string_view unit(p, static_cast<size_t>(s.data() + s.size() - p));
  int shift;
  if (unit.empty() || unit == "B") shift = 0;
  else if (unit == "K" || unit == "k" || unit == "KiB") shift = 10;
  else if (unit == "M" || unit == "MiB") shift = 20;
  else if (unit == "G" || unit == "GiB") shift = 30;
  else if (unit == "T" || unit == "TiB") shift = 40;
  else return std::nullopt;
  if (shift != 0 && v > (UINT64_MAX >> shift)) return std::nullopt;
  return v << shift;
}

}  // namespace ibnbd
