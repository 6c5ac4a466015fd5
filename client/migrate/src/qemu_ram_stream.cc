#include "base/text.h"
#include "qemu_ram_stream.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>

#include "qemu_rdma_wire.h"

namespace ibnbd::migrate::qstream {

// A stream's block list must fit one RAM BLOCKS RESULT.
static_assert(kMaxRamBlocks == qrdma::kMaxRamBlocks);
namespace {

// savevm.c section types.
constexpr uint8_t kSecEof = 0x00;
constexpr uint8_t kSecStart = 0x01;
constexpr uint8_t kSecPart = 0x02;
constexpr uint8_t kSecEnd = 0x03;
constexpr uint8_t kSecFull = 0x04;
constexpr uint8_t kSubsection = 0x05;
constexpr uint8_t kVmDescription = 0x06;
constexpr uint8_t kConfiguration = 0x07;
constexpr uint8_t kCommand = 0x08;
constexpr uint8_t kFooter = 0x7e;

constexpr uint32_t kQevm = 0x5145564D;
constexpr uint32_t kFileVersion = 3;
constexpr uint32_t kRamVersion = 4;           // ram_load refuses anything else
constexpr uint32_t kMaxMachineType = 256;      // QEMU's names are short ("pc-i440fx-7.2")
constexpr uint32_t kMaxCapabilities = 64;      // 7.2 has 22 migration capabilities

// MIG_CMD_* (savevm.c) and the lengths QEMU checks for the two we pass through.
constexpr uint16_t kCmdOpenReturnPath = 1;     // len 0
constexpr uint16_t kCmdPing = 2;               // len 4
constexpr uint16_t kCmdMax = 10;

const char* command_name(uint16_t c) {
  static const char* const names[] = {"INVALID",           "OPEN_RETURN_PATH",    "PING",
                                      "POSTCOPY_ADVISE",   "POSTCOPY_LISTEN",     "POSTCOPY_RUN",
                                      "POSTCOPY_RAM_DISCARD", "PACKAGED",         "ENABLE_COLO",
                                      "POSTCOPY_RESUME",   "RECV_BITMAP"};
  return c <= kCmdMax ? names[c] : "unknown";
}

uint32_t be32(std::span<const std::byte> s, size_t at = 0) {
  uint32_t v = 0;
  for (size_t i = 0; i < 4; ++i) v = (v << 8) | std::to_integer<uint32_t>(s[at + i]);
  return v;
}
uint64_t be64(std::span<const std::byte> s, size_t at = 0) {
  uint64_t v = 0;
  for (size_t i = 0; i < 8; ++i) v = (v << 8) | std::to_integer<uint64_t>(s[at + i]);
  return v;
}
void put_be64(std::vector<std::byte>& out, uint64_t v) {
  for (int i = 7; i >= 0; --i) out.push_back(static_cast<std::byte>(v >> (8 * i)));
}
std::string_view text(std::span<const std::byte> s) {
  return {reinterpret_cast<const char*>(s.data()), s.size()};
}
// Names from a stream go into messages: printable ASCII only.
std::string printable(std::span<const std::byte> s) {
  std::string r;
  for (std::byte b : s.first(std::min<size_t>(s.size(), 64))) {
    const char c = static_cast<char>(b);
    r += (c >= 0x20 && c < 0x7f) ? c : '?';
  }
  return r;
}
using base::hex;

}  // namespace

std::string_view to_string(RamPhase p) {
  switch (p) {
    case RamPhase::setup: return "setup";
    case RamPhase::iterate: return "iterate";
    case RamPhase::complete: return "complete";
  }
  return "?";
}

// ---- parser ----

struct RamStreamParser::Impl {
  // One state per field; `want` bytes make the field's token.
  enum class St {
    magic, version, sec_type, config_len, config_name, sub_len, sub_name, sub_page_bits,
    sub_cap_count, sub_cap_len, sub_cap_name, sub_uuid, cmd_head, skip, start_head, start_name,
    full_head, full_name, part_id, footer, ram_header, mem_len, mem_name, page_name_len,
    page_name, page_data, zero_fill, passthrough,
  };

  StreamEvents& ev;
  uint32_t page_bits;
  St st = St::magic;
  size_t want = 4;
  std::vector<std::byte> tok;   // the current field when it arrives in pieces (<= 64 KiB)
  uint64_t fed = 0;             // bytes accepted by feed()
  uint64_t pos = 0;             // stream offset of the current field
  std::error_code err;
  std::string last_error;

  // Section walk.
  bool any_section = false;     // CONFIGURATION must come first
  bool in_config = false;       // a SUBSECTION may follow
  std::optional<uint32_t> footer_for;  // a SECTION_FOOTER for this id may follow
  uint64_t skip_left = 0;
  uint32_t caps_left = 0;
  uint32_t pending_id = 0;      // section id of a START / FULL header being read
  std::string machine_type;

  // RAM.
  bool ram_started = false;
  bool ram_complete = false;
  uint32_t ram_id = 0;
  RamRound round;
  bool expect_mem_size = false;
  uint64_t mem_left = 0;
  std::vector<RamBlock> blocks;
  int64_t last_block = -1;      // for CONTINUE
  uint32_t rec_block = 0;
  uint64_t rec_offset = 0;
  bool rec_zero = false;

  Impl(StreamEvents& e, StreamOptions o) : ev(e), page_bits(o.page_bits) {}

  uint64_t page_size() const { return uint64_t{1} << page_bits; }

  Status bad(int e, const std::string& msg) {
    err = ibtrs::errc(e);
    last_error = msg + " (stream byte " + std::to_string(pos) + ")";
    return err;
  }
  Status call(Status s) {
    if (!s.ok() && !err) {
      err = s.error();
      last_error = "stopped by the consumer at stream byte " + std::to_string(pos) + ": " + s.error().message();
    }
    return s;
  }
  void next(St s, size_t n) {
    st = s;
    want = n;
  }
  Status to_sec_type() {
    next(St::sec_type, 1);
    return {};
  }
  // Another configuration subsection may follow.
  Status end_subsection() {
    in_config = true;
    return to_sec_type();
  }
  Status to_passthrough() {
    st = St::passthrough;
    return {};
  }

  Status feed(std::span<const std::byte> in) {
    if (err) return err;
    fed += in.size();
    while (!in.empty()) {
      if (st == St::passthrough) {
        pos += in.size();
        return call(ev.bytes(in));
      }
      if (st == St::skip) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(skip_left, in.size()));
        BASE_TRY(call(ev.bytes(in.first(n))));
        pos += n;
        in = in.subspan(n);
        skip_left -= n;
        if (skip_left == 0) next(St::sec_type, 1);
        continue;
      }
      std::span<const std::byte> field;
      if (tok.empty() && in.size() >= want) {
        field = in.first(want);  // the whole field is here: no copy
        in = in.subspan(want);
      } else {
        const size_t n = std::min(want - tok.size(), in.size());
        tok.insert(tok.end(), in.begin(), in.begin() + static_cast<ptrdiff_t>(n));
        in = in.subspan(n);
        if (tok.size() < want) break;
        field = tok;
      }
      const size_t n = field.size();
      Status s = step(field);
      tok.clear();
      if (!s.ok()) return err ? err : s.error();
      pos += n;
    }
    return {};
  }

  Status finish() {
    if (err) return err;
    if (st == St::passthrough) return {};
    return bad(EBADMSG, tok.empty() ? "stream ended before the end of RAM" : "stream ended inside a field");
  }

  Status emit(std::span<const std::byte> f) { return call(ev.bytes(f)); }

  // One complete field.
  Status step(std::span<const std::byte> f) {
    switch (st) {
      case St::magic:
        if (be32(f) != kQevm) return bad(EBADMSG, "not a QEMU migration stream (no QEVM magic)");
        BASE_TRY(emit(f));
        next(St::version, 4);
        return {};
      case St::version:
        if (be32(f) != kFileVersion)
          return bad(EBADMSG, "stream version " + std::to_string(be32(f)) + " (QEMU 7.2 writes 3)");
        BASE_TRY(emit(f));
        return to_sec_type();
      case St::sec_type:
        return section(std::to_integer<uint8_t>(f[0]), f);
      case St::config_len: {
        const uint32_t n = be32(f);
        if (n == 0 || n > kMaxMachineType)
          return bad(EBADMSG, "machine type of " + std::to_string(n) + " bytes");
        BASE_TRY(emit(f));
        next(St::config_name, n);
        return {};
      }
      case St::config_name:
        machine_type = printable(f);
        BASE_TRY(emit(f));
        in_config = true;
        return to_sec_type();
      case St::sub_len: {
        const uint8_t n = std::to_integer<uint8_t>(f[0]);
        if (n == 0) return bad(EBADMSG, "configuration subsection without a name");
        BASE_TRY(emit(f));
        next(St::sub_name, n + 4u);  // name, be32 version_id
        return {};
      }
      case St::sub_name: {
        const std::string_view name = text(f.first(f.size() - 4));
        BASE_TRY(emit(f));
        if (name == "configuration/target-page-bits") {
          next(St::sub_page_bits, 4);
        } else if (name == "configuration/capabilities") {
          next(St::sub_cap_count, 4);
        } else if (name == "configuration/uuid") {
          next(St::sub_uuid, 16);
        } else {
          return bad(EOPNOTSUPP, "configuration subsection '" + printable(f.first(f.size() - 4)) +
                                     "' unknown: its size cannot be known");
        }
        return {};
      }
      case St::sub_page_bits: {
        const uint32_t bits = be32(f);
        if (bits < kMinPageBits || bits > kMaxPageBits)
          return bad(EOPNOTSUPP, "target page bits " + std::to_string(bits) + " (10..16 handled)");
        page_bits = bits;
        BASE_TRY(emit(f));
        return end_subsection();
      }
      case St::sub_cap_count:
        caps_left = be32(f);
        if (caps_left > kMaxCapabilities)
          return bad(EBADMSG, std::to_string(caps_left) + " capabilities in the configuration");
        BASE_TRY(emit(f));
        if (caps_left == 0) return end_subsection();
        next(St::sub_cap_len, 1);
        return {};
      case St::sub_cap_len: {
        const uint8_t n = std::to_integer<uint8_t>(f[0]);
        if (n == 0) return bad(EBADMSG, "empty capability name");
        BASE_TRY(emit(f));
        next(St::sub_cap_name, n);
        return {};
      }
      case St::sub_cap_name:
        // x-ignore-shared adds a field to every block of the RAM list and leaves shared blocks
        // out of RDMA's block table: neither rewriter can keep both sides in step.
        if (text(f) == "x-ignore-shared")
          return bad(EOPNOTSUPP, "capability x-ignore-shared is not supported");
        BASE_TRY(emit(f));
        if (--caps_left == 0) return end_subsection();
        next(St::sub_cap_len, 1);
        return {};
      case St::sub_uuid:
        BASE_TRY(emit(f));
        return end_subsection();
      case St::cmd_head: {
        const uint16_t cmd = static_cast<uint16_t>(be32(f) >> 16);
        const uint16_t len = static_cast<uint16_t>(be32(f) & 0xffff);
        if (cmd == 0 || cmd > kCmdMax) return bad(EBADMSG, "unknown command " + std::to_string(cmd));
        if (cmd != kCmdOpenReturnPath && cmd != kCmdPing)
          return bad(EOPNOTSUPP, std::string("command ") + command_name(cmd) +
                                     " is not supported (postcopy, COLO: precopy streams only)");
        if (len != (cmd == kCmdPing ? 4 : 0))
          return bad(EBADMSG, std::string("command ") + command_name(cmd) + " of length " + std::to_string(len));
        BASE_TRY(emit(f));
        skip_left = len;
        if (len == 0) return to_sec_type();
        st = St::skip;
        return {};
      }
      case St::start_head:
      case St::full_head: {
        pending_id = be32(f);
        const uint8_t n = std::to_integer<uint8_t>(f[4]);
        if (n == 0) return bad(EBADMSG, "section without a name");
        BASE_TRY(emit(f));
        next(st == St::start_head ? St::start_name : St::full_name, n + 8u);  // idstr, instance, version
        return {};
      }
      case St::start_name: {
        const auto name = f.first(f.size() - 8);
        const uint32_t version = be32(f, f.size() - 4);
        if (text(name) != "ram")
          return bad(EOPNOTSUPP, "iterable section '" + printable(name) +
                                     "' is not supported (only RAM: no block migration, dirty bitmaps, VFIO)");
        if (ram_started) return bad(EBADMSG, "a second START section for RAM");
        if (version != kRamVersion)
          return bad(EOPNOTSUPP, "RAM section version " + std::to_string(version) + " (QEMU 7.2 writes 4)");
        BASE_TRY(emit(f));
        ram_started = true;
        ram_id = pending_id;
        round = {RamPhase::setup, 0};
        expect_mem_size = true;
        next(St::ram_header, 8);
        return {};
      }
      case St::full_name:
        return bad(EOPNOTSUPP, "device section '" + printable(f.first(f.size() - 8)) +
                                   "' before the end of RAM: its end cannot be found");
      case St::part_id: {
        const uint32_t id = be32(f);
        if (!ram_started || id != ram_id)
          return bad(EBADMSG, "PART / END of section " + std::to_string(id) + ", which is not RAM's");
        BASE_TRY(emit(f));
        ++round.index;
        BASE_TRY(call(ev.round_begin(round)));
        next(St::ram_header, 8);
        return {};
      }
      case St::footer: {
        if (be32(f) != *footer_for)
          return bad(EBADMSG, "footer of section " + std::to_string(be32(f)) + " after section " +
                                  std::to_string(*footer_for));
        footer_for.reset();
        BASE_TRY(emit(f));
        if (ram_complete) return to_passthrough();
        return to_sec_type();
      }
      case St::ram_header:
        return ram_header(f);
      case St::mem_len: {
        const uint8_t n = std::to_integer<uint8_t>(f[0]);
        if (n == 0) return bad(EBADMSG, "RAM block without a name");
        BASE_TRY(emit(f));
        next(St::mem_name, n + 8u);  // idstr, be64 used_length
        return {};
      }
      case St::mem_name:
        return mem_entry(f);
      case St::page_name_len: {
        const uint8_t n = std::to_integer<uint8_t>(f[0]);
        if (n == 0) return bad(EBADMSG, "page record with an empty block name");
        next(St::page_name, n);
        return {};
      }
      case St::page_name: {
        const std::string_view name = text(f);
        auto it = std::find_if(blocks.begin(), blocks.end(), [&](const RamBlock& b) { return b.name == name; });
        if (it == blocks.end()) return bad(EBADMSG, "page of unknown RAM block '" + printable(f) + "'");
        last_block = it - blocks.begin();
        return page_body();
      }
      case St::page_data: {
        PageRecord p{rec_block, rec_offset, false, 0, f};
        BASE_TRY(call(ev.page(p)));
        next(St::ram_header, 8);
        return {};
      }
      case St::zero_fill: {
        PageRecord p{rec_block, rec_offset, true, std::to_integer<uint8_t>(f[0]), {}};
        BASE_TRY(call(ev.page(p)));
        next(St::ram_header, 8);
        return {};
      }
      case St::skip:
      case St::passthrough:
        break;
    }
    return bad(EBADMSG, "parser state");  // unreachable: feed() handles both without step()
  }

  Status section(uint8_t type, std::span<const std::byte> f) {
    const bool config_ok = !any_section;
    const bool sub_ok = in_config;
    const std::optional<uint32_t> foot = footer_for;
    in_config = false;
    footer_for.reset();
    any_section = true;
    if (type == kFooter && foot) {
      footer_for = foot;
      BASE_TRY(emit(f));
      next(St::footer, 4);
      return {};
    }
    if (ram_complete) {
      // After RAM's END: devices, EOF and the description, byte for byte.
      BASE_TRY(emit(f));
      return to_passthrough();
    }
    switch (type) {
      case kConfiguration:
        if (!config_ok) return bad(EBADMSG, "configuration section after other sections");
        BASE_TRY(emit(f));
        next(St::config_len, 4);
        return {};
      case kSubsection:
        if (!sub_ok) return bad(EBADMSG, "subsection outside the configuration");
        BASE_TRY(emit(f));
        next(St::sub_len, 1);
        return {};
      case kCommand:
        BASE_TRY(emit(f));
        next(St::cmd_head, 4);
        return {};
      case kSecStart:
        BASE_TRY(emit(f));
        next(St::start_head, 5);
        return {};
      case kSecFull:
        BASE_TRY(emit(f));
        next(St::full_head, 5);
        return {};
      case kSecPart:
      case kSecEnd:
        if (!ram_started) return bad(EBADMSG, "PART / END section before any START");
        round.phase = type == kSecEnd ? RamPhase::complete : RamPhase::iterate;
        BASE_TRY(emit(f));
        next(St::part_id, 4);
        return {};
      case kSecEof:
        BASE_TRY(emit(f));
        return to_passthrough();
      case kVmDescription:
        return bad(EBADMSG, "VM description before the EOF section");
      default:
        return bad(EBADMSG, "unknown section type " + hex(type));
    }
  }

  Status ram_header(std::span<const std::byte> f) {
    const uint64_t v = be64(f);
    const uint64_t flags = v & (page_size() - 1);
    const uint64_t addr = v & ~(page_size() - 1);
    if (expect_mem_size && flags != kFlagMemSize)
      return bad(EBADMSG, "the RAM section does not start with its block list (flags " + hex(flags) + ")");
    if (flags & kFlagXbzrle) return bad(EOPNOTSUPP, "XBZRLE page: disable the xbzrle capability");
    if (flags & kFlagCompressPage) return bad(EOPNOTSUPP, "compressed page: disable the compress capability");
    if (flags & kFlagMultifdFlush) return bad(EOPNOTSUPP, "multifd flush record (QEMU >= 8.0 multifd)");
    switch (flags) {
      case kFlagMemSize:
        if (!expect_mem_size) return bad(EBADMSG, "a second RAM block list");
        if (addr == 0) return bad(EBADMSG, "RAM block list of 0 bytes");
        expect_mem_size = false;
        mem_left = addr;
        BASE_TRY(emit(f));
        next(St::mem_len, 1);
        return {};
      case kFlagEos:
        if (addr != 0) return bad(EBADMSG, "EOS record with an address");
        BASE_TRY(call(ev.round_end(round)));
        BASE_TRY(emit(f));
        footer_for = ram_id;
        if (round.phase == RamPhase::complete) ram_complete = true;
        return to_sec_type();
      case kFlagHook:
        if (addr != 0) return bad(EBADMSG, "HOOK record with an address");
        BASE_TRY(call(ev.hook(round)));
        next(St::ram_header, 8);
        return {};
      default:
        break;
    }
    const uint64_t kind = flags & ~kFlagContinue;
    if (kind != kFlagPage && kind != kFlagZero)
      return bad(EBADMSG, "unknown combination of RAM flags " + hex(flags));
    rec_zero = kind == kFlagZero;
    rec_offset = addr;
    if (flags & kFlagContinue) {
      if (last_block < 0) return bad(EBADMSG, "CONTINUE page record without a previous block");
      return page_body();
    }
    next(St::page_name_len, 1);
    return {};
  }

  // The block of the current page record is known (last_block).
  Status page_body() {
    rec_block = static_cast<uint32_t>(last_block);
    if (rec_offset >= blocks[rec_block].length)
      return bad(EBADMSG, "page at " + hex(rec_offset) + " past the end of RAM block '" + blocks[rec_block].name + "'");
    if (rec_zero) {
      next(St::zero_fill, 1);
    } else {
      next(St::page_data, static_cast<size_t>(page_size()));
    }
    return {};
  }

  Status mem_entry(std::span<const std::byte> f) {
    const auto name = f.first(f.size() - 8);
    const uint64_t length = be64(f, f.size() - 8);
    if (blocks.size() == kMaxRamBlocks) return bad(EBADMSG, "more than 4096 RAM blocks");
    if (length == 0 || length % page_size() != 0 || length > mem_left)
      return bad(EBADMSG, "RAM block '" + printable(name) + "' of " + std::to_string(length) + " bytes (" +
                              std::to_string(mem_left) + " left of the list's total, pages of " +
                              std::to_string(page_size()) + ")");
    if (std::any_of(blocks.begin(), blocks.end(), [&](const RamBlock& b) { return b.name == text(name); }))
      return bad(EBADMSG, "RAM block '" + printable(name) + "' listed twice");
    blocks.push_back({std::string(text(name)), length});
    BASE_TRY(emit(f));
    mem_left -= length;
    if (mem_left > 0) {
      next(St::mem_len, 1);
      return {};
    }
    BASE_TRY(call(ev.ram_blocks(blocks)));
    BASE_TRY(call(ev.round_begin(round)));
    next(St::ram_header, 8);
    return {};
  }
};

RamStreamParser::RamStreamParser(StreamEvents& ev, StreamOptions o) : impl_(std::make_unique<Impl>(ev, o)) {}
RamStreamParser::~RamStreamParser() = default;
Status RamStreamParser::feed(std::span<const std::byte> in) { return impl_->feed(in); }
Status RamStreamParser::finish() { return impl_->finish(); }
const std::string& RamStreamParser::last_error() const { return impl_->last_error; }
uint64_t RamStreamParser::consumed() const { return impl_->fed; }
uint32_t RamStreamParser::page_size() const { return static_cast<uint32_t>(impl_->page_size()); }
const std::string& RamStreamParser::machine_type() const { return impl_->machine_type; }
const std::vector<RamBlock>& RamStreamParser::blocks() const { return impl_->blocks; }
bool RamStreamParser::ram_complete() const { return impl_->ram_complete; }

// ---- records ----

RecordWriter::RecordWriter(std::span<const RamBlock> blocks, uint32_t page_size)
    : blocks_(blocks), page_size_(page_size) {}

Status RecordWriter::header(std::vector<std::byte>& out, uint32_t block, uint64_t offset, uint64_t flags) {
  if (block >= blocks_.size() || offset >= blocks_[block].length || offset % page_size_ != 0)
    return ibtrs::errc(EINVAL);
  const bool same = last_block_ == static_cast<int64_t>(block);
  put_be64(out, offset | flags | (same ? kFlagContinue : 0));
  if (!same) {
    const std::string& n = blocks_[block].name;
    out.push_back(static_cast<std::byte>(n.size()));
    const auto* p = reinterpret_cast<const std::byte*>(n.data());
    out.insert(out.end(), p, p + n.size());
    last_block_ = block;
  }
  return {};
}

Status RecordWriter::page(std::vector<std::byte>& out, uint32_t block, uint64_t offset,
                          std::span<const std::byte> data) {
  if (data.size() != page_size_) return ibtrs::errc(EINVAL);
  BASE_TRY(header(out, block, offset, kFlagPage));
  out.insert(out.end(), data.begin(), data.end());
  return {};
}

Status RecordWriter::zero(std::vector<std::byte>& out, uint32_t block, uint64_t offset, uint8_t fill) {
  BASE_TRY(header(out, block, offset, kFlagZero));
  out.push_back(static_cast<std::byte>(fill));
  return {};
}

void RecordWriter::hook(std::vector<std::byte>& out) { put_be64(out, kFlagHook); }
void RecordWriter::eos(std::vector<std::byte>& out) { put_be64(out, kFlagEos); }

// ---- save direction ----

struct InlineRewriter::Impl final : StreamEvents, PageWriter {
  static constexpr size_t kFlushAt = 256 * 1024;  // output gathered before a sink write

  ByteSink& out;
  PageSource& src;
  RamStreamParser parser;
  std::vector<std::byte> buf;
  std::optional<RecordWriter> rec;
  uint64_t hooks = 0;
  uint64_t pages = 0;
  std::string last_error;

  Impl(ByteSink& o, PageSource& s, StreamOptions opt) : out(o), src(s), parser(*this, opt) {}

  Status flush() {
    if (buf.empty()) return {};
    Status s = out.write(buf);
    buf.clear();
    return s;
  }
  Status maybe_flush() { return buf.size() >= kFlushAt ? flush() : Status{}; }

  Status bytes(std::span<const std::byte> b) override {
    if (b.size() >= kFlushAt) {
      BASE_TRY(flush());
      return out.write(b);
    }
    buf.insert(buf.end(), b.begin(), b.end());
    return maybe_flush();
  }
  Status ram_blocks(std::span<const RamBlock> blocks) override {
    rec.emplace(blocks, parser.page_size());
    return src.ram_blocks(blocks);
  }
  Status round_begin(const RamRound&) override { return {}; }
  Status round_end(const RamRound&) override { return {}; }
  // Pages inline in the input (QEMU's RDMA source sends them so during postcopy only, which the
  // parser refuses, but they are valid): written again with our CONTINUE bookkeeping.
  Status page(const PageRecord& p) override {
    return p.zero ? zero(p.block, p.offset, p.fill) : data(p.block, p.offset, p.data);
  }
  Status hook(const RamRound& r) override {
    ++hooks;
    return src.changed_pages(r, *this);
  }
  Status data(uint32_t block, uint64_t offset, std::span<const std::byte> page) override {
    Status s = rec ? rec->page(buf, block, offset, page) : ibtrs::errc(EINVAL);
    if (!s.ok()) return refused(block, offset, page.size());
    ++pages;
    return maybe_flush();
  }
  Status zero(uint32_t block, uint64_t offset, uint8_t fill) override {
    Status s = rec ? rec->zero(buf, block, offset, fill) : ibtrs::errc(EINVAL);
    if (!s.ok()) return refused(block, offset, 0);
    ++pages;
    return maybe_flush();
  }
  Status refused(uint32_t block, uint64_t offset, size_t size) {
    last_error = "page of block " + std::to_string(block) + " at offset " + std::to_string(offset) +
                 (size ? " (" + std::to_string(size) + " bytes)" : std::string()) +
                 " does not fit the stream's RAM blocks (" + std::to_string(parser.blocks().size()) +
                 ", pages of " + std::to_string(parser.page_size()) + " bytes)";
    return ibtrs::errc(EINVAL);
  }

  Status note(Status s) {
    if (!s.ok() && last_error.empty()) last_error = parser.last_error();
    return s;
  }
};

InlineRewriter::InlineRewriter(ByteSink& out, PageSource& pages, StreamOptions o)
    : impl_(std::make_unique<Impl>(out, pages, o)) {}
InlineRewriter::~InlineRewriter() = default;
Status InlineRewriter::feed(std::span<const std::byte> in) { return impl_->note(impl_->parser.feed(in)); }
Status InlineRewriter::finish() {
  BASE_TRY(impl_->note(impl_->parser.finish()));
  return impl_->note(impl_->flush());
}
const std::string& InlineRewriter::last_error() const { return impl_->last_error; }
const RamStreamParser& InlineRewriter::parser() const { return impl_->parser; }
uint64_t InlineRewriter::hooks() const { return impl_->hooks; }
uint64_t InlineRewriter::pages_written() const { return impl_->pages; }

// ---- restore direction ----

struct RdmaSplitter::Impl final : StreamEvents {
  RdmaSink& sink;
  RamStreamParser parser;
  std::string last_error;

  Impl(RdmaSink& s, StreamOptions o) : sink(s), parser(*this, o) {}

  Status bytes(std::span<const std::byte> b) override { return sink.file_bytes(b); }
  Status ram_blocks(std::span<const RamBlock> blocks) override { return sink.ram_blocks(blocks); }
  Status round_begin(const RamRound& r) override {
    std::vector<std::byte> h;
    RecordWriter::hook(h);
    BASE_TRY(sink.file_bytes(h));
    return sink.round_begin(r);
  }
  Status page(const PageRecord& p) override { return sink.page(p); }
  Status hook(const RamRound&) override {
    last_error = "the stream already carries RDMA HOOK records (it is not an ordinary stream)";
    return ibtrs::errc(EOPNOTSUPP);
  }
  Status round_end(const RamRound& r) override { return sink.round_end(r); }

  Status note(Status s) {
    if (!s.ok() && last_error.empty()) last_error = parser.last_error();
    return s;
  }
};

RdmaSplitter::RdmaSplitter(RdmaSink& sink, StreamOptions o) : impl_(std::make_unique<Impl>(sink, o)) {}
RdmaSplitter::~RdmaSplitter() = default;
Status RdmaSplitter::feed(std::span<const std::byte> in) { return impl_->note(impl_->parser.feed(in)); }
Status RdmaSplitter::finish() { return impl_->note(impl_->parser.finish()); }
const std::string& RdmaSplitter::last_error() const { return impl_->last_error; }
const RamStreamParser& RdmaSplitter::parser() const { return impl_->parser; }

}  // namespace ibnbd::migrate::qstream
