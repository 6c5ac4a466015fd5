#include "image_format.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "crc32c.h"

namespace ibnbd::migrate::fmt {
namespace {

std::error_code err(int e) { return {e, std::generic_category()}; }

template <typename T>
uint32_t struct_crc(const T& s) {
  T copy = s;
  copy.crc.set(0);
  return crc32c(std::as_bytes(std::span(&copy, 1)));
}

bool has_magic(const char (&m)[8], std::string_view want) { return std::memcmp(m, want.data(), 8) == 0; }

bool zero_padded(const char* p, size_t cap) {
  const char* nul = static_cast<const char*>(std::memchr(p, 0, cap));
  if (nul == nullptr) return false;  // must be NUL-terminated within the field
  return std::all_of(nul, p + cap, [](char c) { return c == 0; });
}

}  // namespace

bool valid_name(std::string_view name) {
  if (name.empty() || name.size() > 63 || name == "." || name == "..") return false;
  return std::none_of(name.begin(), name.end(), [](char c) {
    return c == '/' || static_cast<unsigned char>(c) < 0x20 || c == 0x7f;
  });
}

std::string fixed_string(const char* p, size_t cap) {
  return std::string(p, strnlen(p, cap));
}

void set_fixed_string(char* p, size_t cap, std::string_view s) {
  std::memset(p, 0, cap);
  std::memcpy(p, s.data(), std::min(s.size(), cap - 1));
}

void encode(const DirView& d, Directory& out) {
  std::memset(&out, 0, sizeof out);
  std::memcpy(out.magic, kDirMagic.data(), 8);
  out.version.set(kVersion);
  out.slot_count.set(kSlots);
  out.generation.set(d.generation);
  out.volume_size.set(d.volume_size);
  for (uint32_t i = 0; i < kSlots; ++i) {
    const auto& e = d.slots[i];
    if (e.state == kSlotFree) continue;
    set_fixed_string(out.slots[i].name, sizeof out.slots[i].name, e.name);
    out.slots[i].start.set(e.start);
    out.slots[i].length.set(e.length);
    out.slots[i].state.set(e.state);
  }
  out.crc.set(struct_crc(out));
}

Result<DirView> decode(const Directory& in, uint64_t volume_size) {
  if (!has_magic(in.magic, kDirMagic)) return err(EBADMSG);
  if (in.version.get() != kVersion) return err(EPROTONOSUPPORT);
  if (struct_crc(in) != in.crc.get() || in.slot_count.get() != kSlots) return err(EILSEQ);
  DirView d;
  d.generation = in.generation.get();
  d.volume_size = in.volume_size.get();
  // Extents lie between the directory's first MiB and the mirror in the last block.
  const uint64_t usable_end = volume_size < kBlock ? 0 : volume_size - kBlock;
  for (uint32_t i = 0; i < kSlots; ++i) {
    const Slot& s = in.slots[i];
    auto& e = d.slots[i];
    e.state = s.state.get();
    if (e.state == kSlotFree) continue;
    if (e.state != kSlotPartial && e.state != kSlotCommitted) return err(EILSEQ);
    if (!zero_padded(s.name, sizeof s.name)) return err(EILSEQ);
    e.name = fixed_string(s.name, sizeof s.name);
    e.start = s.start.get();
    e.length = s.length.get();
    if (!valid_name(e.name) || e.start % kExtentAlign != 0 || e.length % kExtentAlign != 0 ||
        e.start < kExtentAlign || e.length < 2 * kExtentAlign || e.start > usable_end ||
        e.length > usable_end - e.start)
      return err(EILSEQ);
  }
  // No two extents overlap and no two images share a name.
  for (uint32_t i = 0; i < kSlots; ++i) {
    for (uint32_t j = i + 1; j < kSlots; ++j) {
      const auto &a = d.slots[i], &b = d.slots[j];
      if (a.state == kSlotFree || b.state == kSlotFree) continue;
      if (a.name == b.name || (a.start < b.start + b.length && b.start < a.start + a.length))
        return err(EILSEQ);
    }
  }
  return d;
}

void seal(Header& h) {
  std::memcpy(h.magic, kImgMagic.data(), 8);
  h.version.set(kVersion);
  h.crc.set(struct_crc(h));
}

Status check(const Header& h, uint64_t slot_length) {
  const uint64_t extent_length = h.extent_length.get();
  if (!has_magic(h.magic, kImgMagic)) return err(EBADMSG);
  if (h.version.get() != kVersion) return err(EPROTONOSUPPORT);
  if (struct_crc(h) != h.crc.get()) return err(EILSEQ);
  const uint32_t state = h.state.get();
  const uint32_t cs = h.chunk_size.get();
  const uint32_t ns = h.stream_count.get();
  if ((state != static_cast<uint32_t>(ImageState::partial) &&
       state != static_cast<uint32_t>(ImageState::committed)) ||
      cs < kMinChunk || cs > kMaxChunk || (cs & (cs - 1)) != 0 || ns == 0 || ns > kMaxStreams ||
      !zero_padded(h.machine_type, sizeof h.machine_type) || !zero_padded(h.name, sizeof h.name) ||
      extent_length > slot_length || extent_length % kExtentAlign != 0 ||
      extent_length < 2 * kExtentAlign || h.data_offset.get() != kExtentAlign)
    return err(EILSEQ);
  if (state == static_cast<uint32_t>(ImageState::partial)) return {};
  // A committed header describes data, index and mirror inside the extent.
  const uint64_t stored = h.stored_chunks.get();
  const uint64_t entries = h.index_entries.get();
  const uint64_t index_off = h.index_offset.get();
  if (extent_length < kExtentAlign + kBlock || stored > (extent_length - kExtentAlign) / cs ||
      index_off < kExtentAlign + stored * cs || index_off % kBlock != 0 ||
      entries > (extent_length - kBlock) / sizeof(IndexEntry) ||
      index_off > extent_length - kBlock - entries * sizeof(IndexEntry))
    return err(EILSEQ);
  uint64_t next_entry = 0;
  for (uint32_t s = 0; s < ns; ++s) {
    const StreamDesc& d = h.streams[s];
    const uint64_t len = d.length.get(), chunks = d.chunks.get();
    // Pieces are full chunks except the last one: exactly ceil(length / chunk_size) of them.
    if (d.first_entry.get() != next_entry || chunks != (len + cs - 1) / cs || chunks > entries - next_entry)
      return err(EILSEQ);
    next_entry += chunks;
  }
  if (next_entry != entries) return err(EILSEQ);
  return {};
}

}  // namespace ibnbd::migrate::fmt
