// The head of a QEMU migration stream (QEMU 7.2 migration/savevm.c): big-endian "QEVM", version
// 3, then QEMU_VM_CONFIGURATION (0x07) with the machine type (u32 length + bytes) and its
// subsections, each QEMU_VM_SUBSECTION (0x05), u8 name length, name, u32 version, fields:
// target-page-bits (u32), capabilities (u32 count, then u8 length + name each), uuid (16 bytes;
// only sent with the validate-uuid capability). A subsection we do not know ends the walk: its
// size cannot be known.
#include <algorithm>
#include <cstring>

#include "ibnbd/migrate_image.h"

namespace ibnbd::migrate {
namespace {

struct Cursor {
  std::span<const std::byte> s;
  size_t at = 0;
  bool ok = true;
  uint32_t u8() {
    if (at + 1 > s.size()) return fail();
    return std::to_integer<uint32_t>(s[at++]);
  }
  uint32_t be32() {
    if (at + 4 > s.size()) return fail();
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v = (v << 8) | std::to_integer<uint32_t>(s[at++]);
    return v;
  }
  std::string_view bytes(size_t n) {
    if (n > s.size() - std::min(at, s.size())) {
      fail();
      return {};
    }
    std::string_view v(reinterpret_cast<const char*>(s.data() + at), n);
    at += n;
    return v;
  }
  uint32_t peek() const { return at < s.size() ? std::to_integer<uint32_t>(s[at]) : 0x100; }
  uint32_t fail() {
    ok = false;
    at = s.size();
    return 0;
  }
};

constexpr uint32_t kQevm = 0x5145564D;
constexpr uint32_t kStreamVersion = 3;
constexpr uint32_t kSectionConfiguration = 0x07;
constexpr uint32_t kSubsection = 0x05;
constexpr size_t kMaxMachineType = 256;  // QEMU's names are short ("pc-i440fx-7.2")

}  // namespace

StreamIdentity parse_stream_identity(std::span<const std::byte> head) {
  StreamIdentity id;
  Cursor c{head};
  if (c.be32() != kQevm || c.be32() != kStreamVersion || !c.ok) return id;
  id.is_qemu_stream = true;
  if (c.u8() != kSectionConfiguration || !c.ok) return id;
  const uint32_t len = c.be32();
  if (!c.ok || len == 0 || len > kMaxMachineType) return id;
  std::string_view mt = c.bytes(len);
  if (!c.ok) return id;
  // Printable ASCII only: the name is shown to admins and stored NUL-terminated.
  if (std::all_of(mt.begin(), mt.end(), [](char ch) { return ch > 0x20 && ch < 0x7f; }))
    id.machine_type = std::string(mt);
  while (c.ok && c.peek() == kSubsection) {
    c.u8();
    std::string_view name = c.bytes(c.u8());
    c.be32();  // version_id
    if (!c.ok) break;
    if (name == "configuration/target-page-bits") {
      c.be32();
    } else if (name == "configuration/capabilities") {
      const uint32_t n = c.be32();
      for (uint32_t i = 0; c.ok && i < n; ++i) c.bytes(c.u8());
    } else if (name == "configuration/uuid") {
      std::string_view u = c.bytes(16);
      if (c.ok) std::memcpy(id.vm_uuid.data(), u.data(), 16);
      break;
    } else {
      break;
    }
  }
  return id;
}

}  // namespace ibnbd::migrate
