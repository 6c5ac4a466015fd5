#include "qemu_stream_target.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <span>
#include <string>

#include "qemu_ram_stream.h"

namespace ibnbd::fuzz {
namespace {

using namespace ibnbd::migrate::qstream;
using Bytes = std::vector<std::byte>;

struct Hash {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  void add(std::span<const std::byte> b) {
    for (std::byte x : b) h = (h ^ std::to_integer<uint64_t>(x)) * 1099511628211ull;
  }
  void add(uint64_t v) {
    std::byte b[8];
    std::memcpy(b, &v, 8);
    add(b);
  }
};

struct PageCopy {
  uint32_t block;
  uint64_t offset;
  bool zero;
  uint8_t fill;
  Bytes data;
  bool operator==(const PageCopy&) const = default;
};

// Digests every event; keeps the pages; checks each against the blocks it was given.
struct Digest final : StreamEvents {
  Hash h;
  std::vector<RamBlock> blocks;
  std::vector<PageCopy> pages;
  uint32_t page_size = 0;
  const RamStreamParser* parser = nullptr;

  Status bytes(std::span<const std::byte> b) override {
    h.add(b);  // piece boundaries differ between feeds; only the bytes count
    return {};
  }
  Status ram_blocks(std::span<const RamBlock> bl) override {
    h.add(1);
    blocks.assign(bl.begin(), bl.end());
    page_size = parser->page_size();
    return {};
  }
  Status round_begin(const RamRound& r) override {
    h.add(2);
    h.add(r.index);
    return {};
  }
  Status page(const PageRecord& p) override {
    if (p.block >= blocks.size() || p.offset >= blocks[p.block].length || p.offset % page_size != 0) std::abort();
    if (p.zero ? !p.data.empty() : p.data.size() != page_size) std::abort();
    h.add(3);
    h.add(p.block);
    h.add(p.offset);
    h.add(p.fill);
    h.add(p.data);
    pages.push_back({p.block, p.offset, p.zero, p.fill, Bytes(p.data.begin(), p.data.end())});
    return {};
  }
  Status hook(const RamRound& r) override {
    h.add(4);
    h.add(r.index);
    return {};
  }
  Status round_end(const RamRound& r) override {
    h.add(5);
    h.add(r.index);
    return {};
  }
};

struct Run {
  uint64_t digest = 0;
  std::error_code err;
  std::vector<PageCopy> pages;
};

Run parse(std::span<const std::byte> s, StreamOptions o, uint32_t piece_seed) {
  Digest d;
  RamStreamParser p(d, o);
  d.parser = &p;
  uint32_t x = piece_seed | 1;
  size_t at = 0;
  Status st;
  while (at < s.size() && st.ok()) {
    size_t n = s.size() - at;
    if (piece_seed != 0) {
      x = x * 1103515245u + 12345u;
      n = std::min<size_t>(n, 1 + (x >> 16) % 97);
    }
    st = p.feed(s.subspan(at, n));
    at += n;
  }
  if (st.ok()) st = p.finish();
  if (!st.ok() && p.last_error().empty()) std::abort();  // every refusal says why
  return {d.h.h, st.error(), std::move(d.pages)};
}

struct CollectSink final : RdmaSink {
  Bytes file;
  std::map<uint64_t, std::vector<PageCopy>> rounds;
  uint64_t open = ~0ull;
  Status file_bytes(std::span<const std::byte> b) override {
    file.insert(file.end(), b.begin(), b.end());
    return {};
  }
  Status ram_blocks(std::span<const RamBlock>) override { return {}; }
  Status round_begin(const RamRound& r) override {
    if (open != ~0ull) std::abort();  // rounds do not nest
    open = r.index;
    return {};
  }
  Status page(const PageRecord& p) override {
    if (open == ~0ull) std::abort();  // pages only inside a round
    rounds[open].push_back({p.block, p.offset, p.zero, p.fill, Bytes(p.data.begin(), p.data.end())});
    return {};
  }
  Status round_end(const RamRound& r) override {
    if (open != r.index) std::abort();
    open = ~0ull;
    return {};
  }
};

struct GiveBack final : PageSource {
  std::map<uint64_t, std::vector<PageCopy>> rounds;
  Status ram_blocks(std::span<const RamBlock>) override { return {}; }
  Status changed_pages(const RamRound& r, PageWriter& out) override {
    for (const PageCopy& p : rounds[r.index]) BASE_TRY(p.zero ? out.zero(p.block, p.offset, p.fill) : out.data(p.block, p.offset, p.data));
    return {};
  }
};

struct VecSink final : ByteSink {
  Bytes out;
  Status write(std::span<const std::byte> b) override {
    out.insert(out.end(), b.begin(), b.end());
    return {};
  }
};

// ---- seeds ----

struct B {
  Bytes b;
  void u8(uint8_t v) { b.push_back(static_cast<std::byte>(v)); }
  void be32(uint32_t v) {
    for (int i = 3; i >= 0; --i) u8(static_cast<uint8_t>(v >> (8 * i)));
  }
  void be64(uint64_t v) {
    for (int i = 7; i >= 0; --i) u8(static_cast<uint8_t>(v >> (8 * i)));
  }
  void str8(std::string_view s) {
    u8(static_cast<uint8_t>(s.size()));
    for (char c : s) u8(static_cast<uint8_t>(c));
  }
  void head() {
    for (char c : std::string_view("QEVM")) u8(static_cast<uint8_t>(c));
    be32(3);
    u8(0x07);
    be32(3);
    for (char c : std::string_view("pc7")) u8(static_cast<uint8_t>(c));
  }
  void start(uint64_t ram) {
    u8(0x01);
    be32(2);
    str8("ram");
    be32(0);
    be32(4);
    be64((ram + 8192) | kFlagMemSize);
    str8("pc.ram");
    be64(ram);
    str8("rom");
    be64(8192);
  }
  void sec(uint8_t t) {
    u8(t);
    be32(2);
  }
  void footer() {
    u8(0x7e);
    be32(2);
  }
  void tail() {
    u8(0x04);
    be32(3);
    str8("timer");
    be32(0);
    be32(1);
    for (uint8_t v : {0x7e, 0x00, 0x05, 0x08}) u8(v);
    u8(0x7e);
    be32(3);
    u8(0x00);
  }
};

}  // namespace

// Input: [options: bit 0 = 8 KiB pages when the stream does not say; bits 1..7 = piece seed]
//        [stream bytes].
int qemu_stream_one_input(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const StreamOptions o{(data[0] & 1) ? 13u : 12u};
  std::span<const std::byte> s(reinterpret_cast<const std::byte*>(data + 1), size - 1);
  const Run whole = parse(s, o, 0);
  const Run pieces = parse(s, o, data[0] >> 1 | 0x100);
  if (whole.digest != pieces.digest || whole.err != pieces.err) std::abort();

  // Restore split, then save rewrite with the split's pages: the same pages in the same order.
  CollectSink split;
  RdmaSplitter sp(split, o);
  if (!sp.feed(s).ok() || !sp.finish().ok()) return 0;
  if (split.open != ~0ull) std::abort();
  GiveBack give;
  give.rounds = split.rounds;
  VecSink out;
  InlineRewriter rw(out, give, o);
  if (!rw.feed(split.file).ok() || !rw.finish().ok()) std::abort();
  const Run back = parse(out.out, o, 0);
  if (back.err || back.pages != whole.pages) std::abort();
  return 0;
}

std::vector<std::vector<uint8_t>> qemu_stream_seeds() {
  std::vector<std::vector<uint8_t>> seeds;
  auto add = [&](uint8_t opt, const B& b) {
    std::vector<uint8_t> s{opt};
    const auto* p = reinterpret_cast<const uint8_t*>(b.b.data());
    s.insert(s.end(), p, p + b.b.size());
    seeds.push_back(s);
  };
  {
    // Ordinary: pages, CONTINUE, ZERO with a fill, device section, EOF.
    B b;
    b.head();
    b.start(64 * 1024);
    b.be64(kFlagEos);
    b.footer();
    b.sec(0x02);
    b.be64(kFlagPage);
    b.str8("pc.ram");
    for (int i = 0; i < 4096; ++i) b.u8(static_cast<uint8_t>(i * 13));
    b.be64(4096 | kFlagZero | kFlagContinue);
    b.u8(0x5a);
    b.be64(kFlagZero);
    b.str8("rom");
    b.u8(0);
    b.be64(kFlagEos);
    b.footer();
    b.sec(0x03);
    b.be64(kFlagEos);
    b.footer();
    b.tail();
    add(0x00, b);
  }
  {
    // Hooked, as QEMU's RDMA source sends it.
    B b;
    b.head();
    b.start(64 * 1024);
    b.be64(kFlagHook);
    b.be64(kFlagEos);
    b.footer();
    b.sec(0x02);
    b.be64(kFlagHook);
    b.be64(kFlagEos);
    b.footer();
    b.sec(0x03);
    b.be64(kFlagHook);
    b.be64(kFlagEos);
    b.footer();
    b.tail();
    add(0x2a, b);
  }
  {
    // Configuration subsections (8 KiB pages, capabilities, uuid), a PING command.
    B b;
    b.head();
    b.u8(0x05);
    b.str8("configuration/target-page-bits");
    b.be32(1);
    b.be32(13);
    b.u8(0x05);
    b.str8("configuration/capabilities");
    b.be32(1);
    b.be32(1);
    b.str8("events");
    b.u8(0x05);
    b.str8("configuration/uuid");
    b.be32(1);
    for (int i = 0; i < 16; ++i) b.u8(static_cast<uint8_t>(i));
    b.u8(0x08);
    b.be32(2u << 16 | 4);
    b.be32(7);
    b.start(64 * 1024);
    b.be64(kFlagEos);
    b.sec(0x03);
    b.be64(8192 | kFlagZero);
    b.str8("pc.ram");
    b.u8(0);
    b.be64(kFlagEos);
    b.tail();
    add(0x55, b);
  }
  return seeds;
}

}  // namespace ibnbd::fuzz
