#include "ibnbd/types.h"

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

}  // namespace ibnbd
