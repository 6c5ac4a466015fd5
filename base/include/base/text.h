// Small text helpers: parsing what users write (control files end in a newline), and numbers
// in messages.
#pragma once

#include <cctype>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>

namespace base {

inline std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// "0x1f": addresses and offsets in error messages.
inline std::string hex(uint64_t v) {
  char b[24];
  std::snprintf(b, sizeof(b), "0x%llx", static_cast<unsigned long long>(v));
  return b;
}

// A byte count as admins type it: a number with an optional binary unit (B, K/k/KiB, M/m/MiB,
// G/g/GiB, T/t/TiB). Nothing for other text or a value that overflows 64 bits. The one parser
// of sizes: the daemons' options, the CLI, the migration agent, the soak and the bench tools.
std::optional<uint64_t> parse_size(std::string_view s);

}  // namespace base
