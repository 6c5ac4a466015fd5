// The streaming parser of QEMU 7.2 migration streams and the RDMA rewriters
// (client/migrate/src/qemu_ram_stream.h): streams built by hand, fed whole, byte by byte and in
// random pieces; and a real stream captured from QEMU (qemu-system-x86_64, when installed),
// rewritten with HOOKs inserted and removed and loaded back by QEMU with its RAM equal.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <thread>

#include "qemu_ram_stream.h"

extern char** environ;

namespace ibnbd::migrate::qstream {
namespace {

using Bytes = std::vector<std::byte>;
constexpr uint64_t MiB = 1ull << 20;
constexpr uint32_t kPage = 4096;

// ---- streams by hand ----

struct StreamBuilder {
  Bytes b;
  std::vector<RamBlock> blocks;
  std::optional<RecordWriter> rec;
  uint32_t page = kPage;

  void u8(uint8_t v) { b.push_back(static_cast<std::byte>(v)); }
  void be16(uint16_t v) {
    u8(static_cast<uint8_t>(v >> 8));
    u8(static_cast<uint8_t>(v & 0xff));
  }
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
  void raw(std::string_view s) {
    for (char c : s) u8(static_cast<uint8_t>(c));
  }
  // "QEVM", 3, configuration with the machine type; subsections are up to the caller.
  StreamBuilder& head(std::string_view machine = "pc-i440fx-7.2") {
    raw("QEVM");
    be32(3);
    u8(0x07);
    be32(static_cast<uint32_t>(machine.size()));
    raw(machine);
    return *this;
  }
  StreamBuilder& subsection(std::string_view name, uint32_t version = 1) {
    u8(0x05);
    str8(name);
    be32(version);
    return *this;
  }
  StreamBuilder& section_header(uint8_t type, uint32_t id, std::string_view name, uint32_t version) {
    u8(type);
    be32(id);
    str8(name);
    be32(0);
    be32(version);
    return *this;
  }
  // START of "ram" with its block list (no EOS).
  StreamBuilder& start_ram(std::vector<RamBlock> bl, uint32_t id = 2) {
    section_header(0x01, id, "ram", 4);
    uint64_t total = 0;
    for (auto& x : bl) total += x.length;
    be64(total | kFlagMemSize);
    for (auto& x : bl) {
      str8(x.name);
      be64(x.length);
    }
    blocks = std::move(bl);
    rec.emplace(blocks, page);
    return *this;
  }
  StreamBuilder& part(uint32_t id = 2) {
    u8(0x02);
    be32(id);
    return *this;
  }
  StreamBuilder& end(uint32_t id = 2) {
    u8(0x03);
    be32(id);
    return *this;
  }
  StreamBuilder& footer(uint32_t id = 2) {
    u8(0x7e);
    be32(id);
    return *this;
  }
  StreamBuilder& eos() {
    RecordWriter::eos(b);
    return *this;
  }
  StreamBuilder& hook() {
    RecordWriter::hook(b);
    return *this;
  }
  StreamBuilder& page_of(uint32_t block, uint64_t off, uint8_t seed) {
    Bytes d(page);
    for (size_t i = 0; i < d.size(); ++i) d[i] = static_cast<std::byte>(seed + i * 7);
    EXPECT_TRUE(rec->page(b, block, off, d).ok());
    return *this;
  }
  StreamBuilder& zero(uint32_t block, uint64_t off, uint8_t fill = 0) {
    EXPECT_TRUE(rec->zero(b, block, off, fill).ok());
    return *this;
  }
  // A non-iterable device section, its data full of bytes that look like section markers.
  StreamBuilder& device(uint32_t id, std::string_view name) {
    section_header(0x04, id, name, 1);
    for (uint8_t v : {0x7e, 0x00, 0x00, 0x00, 0x02, 0x00, 0x03, 0x04, 0x05, 0x08}) u8(v);
    return footer(id);
  }
  StreamBuilder& tail() {
    u8(0x00);  // EOF
    u8(0x06);  // VMDESCRIPTION
    const std::string json = R"({"page_size": 4096, "devices": []})";
    be32(static_cast<uint32_t>(json.size()));
    raw(json);
    return *this;
  }
};

const std::vector<RamBlock> kBlocks = {{"pc.ram", 4 * MiB}, {"/rom@etc/acpi/tables", 128 * 1024}};

// An ordinary stream: setup, two rounds of pages (CONTINUE, a named switch, ZERO with a fill),
// an empty complete round, devices, EOF, description.
Bytes ordinary_stream() {
  StreamBuilder s;
  s.head().start_ram(kBlocks).eos().footer();
  s.part().page_of(0, 0, 1).page_of(0, 4096, 2).zero(1, 8192).page_of(0, 3 * MiB, 3).eos().footer();
  s.part().zero(0, 4096, 0x5a).page_of(1, 0, 4).eos().footer();
  s.end().eos().footer();
  s.device(3, "timer").device(4, "cpu_common").tail();
  return s.b;
}

// The same stream as QEMU's RDMA source sends it: a HOOK at the start of every round, no pages.
Bytes hooked_stream() {
  StreamBuilder s;
  s.head().start_ram(kBlocks).hook().eos().footer();
  s.part().hook().eos().footer();
  s.part().hook().eos().footer();
  s.end().hook().eos().footer();
  s.device(3, "timer").device(4, "cpu_common").tail();
  return s.b;
}

// Everything a parser reports, as text (pages by checksum) plus the verbatim bytes.
struct Recorder final : StreamEvents {
  std::vector<std::string> log;
  Bytes verbatim;
  std::vector<PageRecord> pages;
  std::vector<Bytes> page_data;
  std::error_code fail_on_hook;

  Status bytes(std::span<const std::byte> b) override {
    verbatim.insert(verbatim.end(), b.begin(), b.end());
    return {};
  }
  Status ram_blocks(std::span<const RamBlock> bl) override {
    std::string s = "blocks";
    for (auto& x : bl) s += " " + x.name + ":" + std::to_string(x.length);
    log.push_back(s);
    return {};
  }
  Status round_begin(const RamRound& r) override {
    log.push_back("begin " + std::string(to_string(r.phase)) + " " + std::to_string(r.index));
    return {};
  }
  Status page(const PageRecord& p) override {
    uint32_t sum = 0;
    for (std::byte x : p.data) sum = sum * 31 + std::to_integer<uint32_t>(x);
    log.push_back("page " + std::to_string(p.block) + " " + std::to_string(p.offset) +
                  (p.zero ? " zero " + std::to_string(p.fill) : " data " + std::to_string(sum)));
    pages.push_back(p);
    page_data.emplace_back(p.data.begin(), p.data.end());
    return {};
  }
  Status hook(const RamRound& r) override {
    log.push_back("hook " + std::to_string(r.index));
    if (fail_on_hook) return fail_on_hook;
    return {};
  }
  Status round_end(const RamRound& r) override {
    log.push_back("end " + std::to_string(r.index));
    return {};
  }
};

// Feeds `s` in pieces of `piece` bytes (0: random 1..4096), then finishes.
Status feed_all(RamStreamParser& p, std::span<const std::byte> s, size_t piece, uint32_t seed = 1) {
  std::mt19937 rng(seed);
  size_t at = 0;
  while (at < s.size()) {
    const size_t n = std::min(s.size() - at, piece ? piece : 1 + rng() % 4096);
    BASE_TRY(p.feed(s.subspan(at, n)));
    at += n;
  }
  return p.finish();
}

// Case: an ordinary stream fed whole, one byte at a time and in random pieces. Expect: the same
// events every time, in stream order; pages with their block, offset and bytes (CONTINUE
// resolved, the ZERO fill kept); everything but page records passed on verbatim.
TEST(QemuRamStream, ParsesInAnyPieces) {
  const Bytes s = ordinary_stream();
  Recorder whole;
  RamStreamParser p1(whole);
  ASSERT_TRUE(feed_all(p1, s, s.size()).ok()) << p1.last_error();
  EXPECT_EQ(whole.log, (std::vector<std::string>{
                           "blocks pc.ram:4194304 /rom@etc/acpi/tables:131072", "begin setup 0", "end 0",
                           "begin iterate 1", whole.log[4], whole.log[5], "page 1 8192 zero 0", whole.log[7],
                           "end 1", "begin iterate 2", "page 0 4096 zero 90", whole.log[11], "end 2",
                           "begin complete 3", "end 3"}));
  EXPECT_EQ(whole.log[4].rfind("page 0 0 data", 0), 0u);
  EXPECT_EQ(whole.log[7].rfind("page 0 3145728 data", 0), 0u);
  EXPECT_EQ(whole.log[11].rfind("page 1 0 data", 0), 0u);
  EXPECT_EQ(whole.page_data[0][1], static_cast<std::byte>(1 + 7));
  EXPECT_TRUE(p1.ram_complete());
  EXPECT_EQ(p1.machine_type(), "pc-i440fx-7.2");
  EXPECT_EQ(p1.consumed(), s.size());

  // The hooked stream is the ordinary one without its page records and with HOOKs: what is
  // verbatim in both must be the same bytes.
  Recorder hooked;
  RamStreamParser ph(hooked);
  ASSERT_TRUE(feed_all(ph, hooked_stream(), 0).ok()) << ph.last_error();
  EXPECT_EQ(whole.verbatim, hooked.verbatim);

  for (size_t piece : {size_t{1}, size_t{0}}) {
    Recorder r;
    RamStreamParser p(r);
    ASSERT_TRUE(feed_all(p, s, piece, 7).ok()) << p.last_error();
    EXPECT_EQ(r.log, whole.log) << "pieces of " << piece;
    EXPECT_EQ(r.verbatim, whole.verbatim);
  }
}

// Case: a ram section of QEMU's RDMA source. Expect: a hook event per round, no pages.
TEST(QemuRamStream, HooksAreReported) {
  Recorder r;
  RamStreamParser p(r);
  ASSERT_TRUE(feed_all(p, hooked_stream(), 3).ok()) << p.last_error();
  EXPECT_EQ(r.log, (std::vector<std::string>{"blocks pc.ram:4194304 /rom@etc/acpi/tables:131072",
                                             "begin setup 0", "hook 0", "end 0", "begin iterate 1", "hook 1",
                                             "end 1", "begin iterate 2", "hook 2", "end 2", "begin complete 3",
                                             "hook 3", "end 3"}));
}

// Case: the configuration carries target-page-bits 13 (8 KiB pages), capabilities and a uuid;
// the RAM START has no footer (old machine types). Expect: pages of 8 KiB are read.
TEST(QemuRamStream, ConfigurationSubsectionsAndPageBits) {
  StreamBuilder s;
  s.page = 8192;
  s.head().subsection("configuration/target-page-bits");
  s.be32(13);
  s.subsection("configuration/capabilities");
  s.be32(2);
  s.str8("events");
  s.str8("validate-uuid");
  s.subsection("configuration/uuid");
  for (int i = 0; i < 16; ++i) s.u8(static_cast<uint8_t>(i));
  s.start_ram({{"pc.ram", 64 * 1024}}).eos();
  s.end().page_of(0, 8192, 9).eos().footer().device(3, "timer").tail();
  Recorder r;
  RamStreamParser p(r);
  ASSERT_TRUE(feed_all(p, s.b, 1).ok()) << p.last_error();
  EXPECT_EQ(p.page_size(), 8192u);
  ASSERT_EQ(r.pages.size(), 1u);
  EXPECT_EQ(r.pages[0].offset, 8192u);
  EXPECT_EQ(r.page_data[0].size(), 8192u);
}

// Case: the same stream's configuration without a target-page-bits subsection, and a caller that
// says the target's pages are 8 KiB. Expect: 8 KiB pages (the option is the fallback).
TEST(QemuRamStream, PageBitsOption) {
  StreamBuilder s;
  s.page = 8192;
  s.head().start_ram({{"pc.ram", 64 * 1024}}).eos().footer().end().page_of(0, 0, 1).eos().footer().tail();
  Recorder r;
  RamStreamParser p(r, {13});
  ASSERT_TRUE(feed_all(p, s.b, 0).ok()) << p.last_error();
  EXPECT_EQ(r.page_data.at(0).size(), 8192u);
}

// Returns the parser's verdict on a stream and its reason.
std::pair<std::error_code, std::string> verdict(const Bytes& s, size_t piece = 0) {
  Recorder r;
  RamStreamParser p(r);
  Status st = feed_all(p, s, piece);
  return {st.error(), p.last_error()};
}

// Case: features the rewriters cannot carry. Expect: EOPNOTSUPP naming each: XBZRLE,
// compressed pages, QEMU 8's multifd flush, a postcopy command, block migration's section,
// x-ignore-shared, an unknown configuration subsection, a device section before RAM's END.
TEST(QemuRamStream, UnsupportedFeaturesAreRefused) {
  auto with_record = [](uint64_t header) {
    StreamBuilder s;
    s.head().start_ram(kBlocks).eos().footer().part();
    s.be64(header);
    s.str8("pc.ram");
    s.b.resize(s.b.size() + 4096);
    return s.b;
  };
  struct Case {
    Bytes stream;
    std::string says;
  };
  std::vector<Case> cases;
  cases.push_back({with_record(kFlagXbzrle), "XBZRLE"});
  cases.push_back({with_record(kFlagCompressPage), "compress"});
  cases.push_back({with_record(kFlagMultifdFlush), "multifd"});
  {
    StreamBuilder s;
    s.head().u8(0x08);
    s.be16(3);  // POSTCOPY_ADVISE
    s.be16(16);
    s.b.resize(s.b.size() + 16);
    cases.push_back({s.b, "POSTCOPY_ADVISE"});
  }
  {
    StreamBuilder s;
    s.head().start_ram(kBlocks).eos().footer().section_header(0x01, 3, "block", 1);
    cases.push_back({s.b, "'block'"});
  }
  {
    StreamBuilder s;
    s.head().subsection("configuration/capabilities");
    s.be32(1);
    s.str8("x-ignore-shared");
    cases.push_back({s.b, "x-ignore-shared"});
  }
  {
    StreamBuilder s;
    s.head().subsection("configuration/frobnicate");
    cases.push_back({s.b, "frobnicate"});
  }
  {
    StreamBuilder s;
    s.head().start_ram(kBlocks).eos().footer().device(3, "timer");
    cases.push_back({s.b, "'timer' before the end of RAM"});
  }
  for (const Case& c : cases) {
    for (size_t piece : {size_t{1}, size_t{0}}) {
      auto [ec, why] = verdict(c.stream, piece);
      EXPECT_EQ(ec, ibtrs::errc(EOPNOTSUPP)) << c.says << ": " << why;
      EXPECT_NE(why.find(c.says), std::string::npos) << why;
    }
  }
}

// Case: malformed streams. Expect: EBADMSG with a reason, never a crash.
TEST(QemuRamStream, MalformedStreamsAreRefused) {
  struct Case {
    Bytes stream;
    std::string says;
  };
  std::vector<Case> cases;
  auto ram = [] {
    StreamBuilder s;
    s.head().start_ram(kBlocks).eos().footer().part();
    return s;
  };
  {
    Bytes b = ordinary_stream();
    b[0] = std::byte{'X'};
    cases.push_back({b, "QEVM"});
  }
  {
    StreamBuilder s;
    s.raw("QEVM");
    s.be32(2);
    cases.push_back({s.b, "version 2"});
  }
  {
    StreamBuilder s = ram();
    s.be64(kFlagPage);
    s.str8("nosuch");
    cases.push_back({s.b, "unknown RAM block 'nosuch'"});
  }
  {
    StreamBuilder s = ram();
    s.be64(kFlagZero | kFlagContinue);
    s.u8(0);
    cases.push_back({s.b, "CONTINUE"});
  }
  {
    StreamBuilder s = ram();
    s.be64(4 * MiB | kFlagZero);
    s.str8("pc.ram");
    s.u8(0);
    cases.push_back({s.b, "past the end"});
  }
  {
    StreamBuilder s;
    s.head().section_header(0x01, 2, "ram", 4);
    s.be64(8192 | kFlagMemSize);
    s.str8("a");
    s.be64(4096);
    s.str8("a");
    s.be64(4096);
    cases.push_back({s.b, "listed twice"});
  }
  {
    StreamBuilder s;
    s.head().section_header(0x01, 2, "ram", 4);
    s.be64(4096 | kFlagMemSize);
    s.str8("a");
    s.be64(8192);
    cases.push_back({s.b, "left of the list"});
  }
  {
    StreamBuilder s;
    s.head().section_header(0x01, 2, "ram", 4);
    s.be64(kFlagEos);
    cases.push_back({s.b, "does not start with its block list"});
  }
  {
    StreamBuilder s = ram();
    s.be64(4096 | kFlagEos);
    cases.push_back({s.b, "EOS record with an address"});
  }
  {
    StreamBuilder s = ram();
    s.be64(kFlagFull);
    cases.push_back({s.b, "unknown combination of RAM flags 0x1"});
  }
  {
    StreamBuilder s = ram();
    s.be64(kFlagHook | kFlagEos);
    cases.push_back({s.b, "0x90"});
  }
  {
    StreamBuilder s;
    s.head().start_ram(kBlocks).eos().footer(9);
    cases.push_back({s.b, "footer of section 9"});
  }
  {
    StreamBuilder s;
    s.head().start_ram(kBlocks).eos().footer().u8(0x02);
    s.be32(5);
    cases.push_back({s.b, "not RAM's"});
  }
  {
    StreamBuilder s;
    s.head().u8(0x09);
    cases.push_back({s.b, "unknown section type 0x9"});
  }
  {
    Bytes b = ordinary_stream();
    b.resize(b.size() / 2);
    cases.push_back({b, "stream ended"});
  }
  for (const Case& c : cases) {
    for (size_t piece : {size_t{1}, size_t{0}}) {
      auto [ec, why] = verdict(c.stream, piece);
      EXPECT_EQ(ec, ibtrs::errc(EBADMSG)) << c.says << ": " << why;
      EXPECT_NE(why.find(c.says), std::string::npos) << why;
    }
  }
}

// Case: a consumer fails at a HOOK. Expect: the parser stops with that error and keeps it.
TEST(QemuRamStream, ConsumerErrorStopsTheParser) {
  Recorder r;
  r.fail_on_hook = ibtrs::errc(EIO);
  RamStreamParser p(r);
  const Bytes s = hooked_stream();
  EXPECT_EQ(p.feed(s).error(), ibtrs::errc(EIO));
  EXPECT_EQ(p.feed(s).error(), ibtrs::errc(EIO));
  EXPECT_EQ(p.finish().error(), ibtrs::errc(EIO));
  EXPECT_NE(p.last_error().find("consumer"), std::string::npos) << p.last_error();
}

// ---- rewriters ----

struct VecSink final : ByteSink {
  Bytes out;
  Status write(std::span<const std::byte> b) override {
    out.insert(out.end(), b.begin(), b.end());
    return {};
  }
};

// Pages by round, as an RDMA destination would have collected them.
struct Page {
  uint32_t block;
  uint64_t offset;
  bool zero;
  uint8_t fill;
  Bytes data;
};
using Rounds = std::map<uint64_t, std::vector<Page>>;

struct RoundSource final : PageSource {
  Rounds rounds;
  std::vector<std::string> log;
  Status ram_blocks(std::span<const RamBlock> bl) override {
    log.push_back("blocks " + std::to_string(bl.size()));
    return {};
  }
  Status changed_pages(const RamRound& r, PageWriter& out) override {
    log.push_back("hook " + std::to_string(r.index));
    for (const Page& p : rounds[r.index]) {
      BASE_TRY(p.zero ? out.zero(p.block, p.offset, p.fill) : out.data(p.block, p.offset, p.data));
    }
    return {};
  }
};

// The restore side: what an RDMA source would send as QEMU FILE, and the pages per round.
struct SplitSink final : RdmaSink {
  Bytes file;
  Rounds rounds;
  std::vector<std::string> log;
  std::optional<uint64_t> open;
  Status file_bytes(std::span<const std::byte> b) override {
    file.insert(file.end(), b.begin(), b.end());
    return {};
  }
  Status ram_blocks(std::span<const RamBlock> bl) override {
    log.push_back("blocks " + std::to_string(bl.size()));
    return {};
  }
  Status round_begin(const RamRound& r) override {
    EXPECT_FALSE(open.has_value());
    open = r.index;
    log.push_back("begin " + std::to_string(r.index));
    return {};
  }
  Status page(const PageRecord& p) override {
    EXPECT_TRUE(open.has_value()) << "a page outside a round";
    rounds[*open].push_back({p.block, p.offset, p.zero, p.fill, Bytes(p.data.begin(), p.data.end())});
    return {};
  }
  Status round_end(const RamRound& r) override {
    EXPECT_EQ(open, r.index);
    open.reset();
    log.push_back("end " + std::to_string(r.index));
    return {};
  }
};

// Case: the restore direction on the ordinary stream. Expect: the QEMU FILE bytes are exactly
// the stream QEMU's RDMA source sends (a HOOK opening every round, no pages); each round's
// pages come between its begin and end, after the HOOK went out.
TEST(QemuRamStream, SplitterMakesTheRdmaSourceStream) {
  SplitSink sink;
  RdmaSplitter sp(sink);
  const Bytes s = ordinary_stream();
  for (size_t at = 0; at < s.size(); ++at) ASSERT_TRUE(sp.feed(std::span(s).subspan(at, 1)).ok()) << sp.last_error();
  ASSERT_TRUE(sp.finish().ok()) << sp.last_error();
  EXPECT_EQ(sink.file, hooked_stream());
  EXPECT_EQ(sink.log, (std::vector<std::string>{"blocks 2", "begin 0", "end 0", "begin 1", "end 1", "begin 2",
                                                "end 2", "begin 3", "end 3"}));
  EXPECT_EQ(sink.rounds[1].size(), 4u);
  EXPECT_EQ(sink.rounds[2].size(), 2u);
  EXPECT_TRUE(sink.rounds[2][0].zero);
  EXPECT_EQ(sink.rounds[2][0].fill, 0x5a);

  // A stream that already has HOOKs is not an ordinary stream.
  SplitSink again;
  RdmaSplitter sp2(again);
  EXPECT_EQ(sp2.feed(hooked_stream()).error(), ibtrs::errc(EOPNOTSUPP));
  EXPECT_NE(sp2.last_error().find("HOOK"), std::string::npos) << sp2.last_error();
}

// Case: the save direction: the hooked stream and, at each HOOK, the pages the splitter took
// from the ordinary stream. Expect: the ordinary stream again, byte for byte (CONTINUE where the
// block repeats, across sections as QEMU does); the source learns the blocks before the first
// HOOK.
TEST(QemuRamStream, InlineRewriterRestoresTheOrdinaryStream) {
  SplitSink split;
  RdmaSplitter sp(split);
  ASSERT_TRUE(sp.feed(ordinary_stream()).ok());
  ASSERT_TRUE(sp.finish().ok());

  RoundSource src;
  src.rounds = split.rounds;
  VecSink out;
  InlineRewriter rw(out, src);
  const Bytes h = hooked_stream();
  std::mt19937 rng(3);
  for (size_t at = 0; at < h.size();) {
    const size_t n = std::min<size_t>(h.size() - at, 1 + rng() % 64);
    ASSERT_TRUE(rw.feed(std::span(h).subspan(at, n)).ok()) << rw.last_error();
    at += n;
  }
  ASSERT_TRUE(rw.finish().ok()) << rw.last_error();
  EXPECT_EQ(out.out, ordinary_stream());
  EXPECT_EQ(rw.hooks(), 4u);
  EXPECT_EQ(rw.pages_written(), 6u);
  EXPECT_EQ(src.log, (std::vector<std::string>{"blocks 2", "hook 0", "hook 1", "hook 2", "hook 3"}));
}

// Case: an ordinary stream through the save rewriter (no HOOKs: a source that sent pages
// inline). Expect: unchanged, byte for byte.
TEST(QemuRamStream, InlineRewriterPassesOrdinaryStreams) {
  RoundSource src;
  VecSink out;
  InlineRewriter rw(out, src);
  const Bytes s = ordinary_stream();
  ASSERT_TRUE(rw.feed(s).ok()) << rw.last_error();
  ASSERT_TRUE(rw.finish().ok());
  EXPECT_EQ(out.out, s);
}

// Case: a page source that reports a page outside the stream's blocks, unaligned, or of the
// wrong size. Expect: EINVAL, the rewriter says which page, nothing of it is written.
TEST(QemuRamStream, InlineRewriterRefusesBadPages) {
  for (Page bad : {Page{2, 0, true, 0, {}}, Page{0, 4 * MiB, true, 0, {}}, Page{0, 100, true, 0, {}},
                   Page{0, 0, false, 0, Bytes(100)}}) {
    RoundSource src;
    src.rounds[1].push_back(bad);
    VecSink out;
    InlineRewriter rw(out, src);
    EXPECT_EQ(rw.feed(hooked_stream()).error(), ibtrs::errc(EINVAL));
    EXPECT_NE(rw.last_error().find("does not fit"), std::string::npos) << rw.last_error();
  }
}

// ---- a real stream from QEMU 7.2 ----

std::optional<std::string> find_in_path(const std::string& exe) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return std::nullopt;
  std::string p = path;
  size_t at = 0;
  while (at <= p.size()) {
    const size_t colon = std::min(p.find(':', at), p.size());
    const std::string cand = p.substr(at, colon - at) + "/" + exe;
    if (::access(cand.c_str(), X_OK) == 0) return cand;
    at = colon + 1;
  }
  return std::nullopt;
}

// A QEMU process (killed on destruction) and its QMP socket.
class Qemu {
 public:
  ~Qemu() {
    if (fd_ >= 0) ::close(fd_);
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      for (int i = 0; i < 100; ++i) {
        if (::waitpid(pid_, nullptr, WNOHANG) == pid_) return;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }

  // Starts `argv` with QMP on `qmp`; empty string on success, else why.
  std::string start(const std::vector<std::string>& argv, const std::string& qmp, const std::string& log) {
    std::vector<char*> a;
    for (const auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
    a.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    const int rc = posix_spawn(&pid_, a[0], &fa, nullptr, a.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) {
      pid_ = -1;
      return "posix_spawn: " + std::string(std::strerror(rc));
    }
    for (int i = 0; i < 200; ++i) {
      fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_un sa{};
      sa.sun_family = AF_UNIX;
      std::snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", qmp.c_str());
      if (::connect(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0) break;
      ::close(fd_);
      fd_ = -1;
      if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        return "QEMU exited at start (see " + log + ")";
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (fd_ < 0) return "no QMP socket";
    timeval tv{30, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    if (!read_msg()) return "no QMP greeting";
    return cmd("qmp_capabilities").is_null() ? "qmp_capabilities failed" : "";
  }

  // The command's "return" (null on error, with the error kept in last).
  nlohmann::json cmd(const std::string& name, nlohmann::json args = nlohmann::json::object()) {
    const std::string line = nlohmann::json{{"execute", name}, {"arguments", args}}.dump() + "\n";
    if (::write(fd_, line.data(), line.size()) != static_cast<ssize_t>(line.size())) return nullptr;
    while (auto m = read_msg()) {
      if (m->contains("event")) continue;
      last = *m;
      return m->contains("return") ? (*m)["return"] : nlohmann::json(nullptr);
    }
    return nullptr;
  }

  // Polls query-migrate until the migration left setup / active.
  std::string wait_migration() {
    for (int i = 0; i < 1200; ++i) {
      auto r = cmd("query-migrate");
      if (r.is_null()) return "query-migrate failed";
      const std::string st = r.value("status", "none");
      if (st != "setup" && st != "active" && st != "none" && st != "device") return st;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return "timeout";
  }

  nlohmann::json last;

 private:
  std::optional<nlohmann::json> read_msg() {
    for (;;) {
      const size_t nl = buf_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        auto j = nlohmann::json::parse(line, nullptr, false);
        if (j.is_discarded()) return std::nullopt;
        return j;
      }
      char b[4096];
      const ssize_t n = ::read(fd_, b, sizeof(b));
      if (n <= 0) return std::nullopt;
      buf_.append(b, static_cast<size_t>(n));
    }
  }

  pid_t pid_ = -1;
  int fd_ = -1;
  std::string buf_;
};

Bytes read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  Bytes b(s.size());
  std::memcpy(b.data(), s.data(), s.size());
  return b;
}

void write_file(const std::string& path, std::span<const std::byte> b) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

struct TempDir {
  std::string path;
  TempDir() {
    std::string t = (std::filesystem::temp_directory_path() / "qemu-ram-stream.XXXXXX").string();
    if (::mkdtemp(t.data()) != nullptr) path = t;
  }
  ~TempDir() {
    if (!path.empty()) std::filesystem::remove_all(path);
  }
};

// Case: a stopped 32 MiB pc guest with 4 MiB of random data loaded at 1 MiB, saved by QEMU 7.2
// with `migrate exec:cat > FILE` (bandwidth capped so RAM comes in several rounds). Expect: the
// stream parses to the end (fed in random pieces); its pages rebuild guest RAM above 1 MiB as
// pmemsave shows it; split into the RDMA source's stream (HOOKs, no pages) and pages, then
// inlined again, it is the same stream byte for byte; and QEMU loads that rewritten stream
// (`-incoming exec:cat FILE`) with RAM equal to the source's, and runs.
TEST(QemuRamStream, RealQemuStreamRoundTrip) {
  const auto qemu = find_in_path("qemu-system-x86_64");
  if (!qemu) GTEST_SKIP() << "qemu-system-x86_64 is not in PATH";
  TempDir dir;
  ASSERT_FALSE(dir.path.empty());
  const std::string d = dir.path;
  constexpr uint64_t kGuest = 32 * MiB;
  constexpr uint64_t kPattern = 4 * MiB;
  Bytes pattern(kPattern);
  std::mt19937_64 rng(42);
  for (auto& x : pattern) x = static_cast<std::byte>(rng());
  write_file(d + "/pat.bin", pattern);
  // The destination loads other bytes at the same place: equal RAM there proves the stream did it.
  Bytes other(kPattern);
  for (auto& x : other) x = static_cast<std::byte>(rng());
  write_file(d + "/other.bin", other);
  auto argv = [&](const std::string& name, const std::string& pat) {
    return std::vector<std::string>{*qemu, "-machine", "pc", "-accel", "tcg", "-m", "32", "-display", "none",
                                    "-nodefaults", "-nic", "none", "-serial", "none", "-S", "-qmp",
                                    "unix:" + d + "/" + name + ".qmp,server=on,wait=off", "-device",
                                    "loader,file=" + d + "/" + pat + ",addr=0x100000"};
  };

  Bytes src_mem;
  {
    Qemu src;
    const std::string why = src.start(argv("src", "pat.bin"), d + "/src.qmp", d + "/src.log");
    if (!why.empty()) GTEST_SKIP() << "QEMU does not start here: " << why;
    ASSERT_FALSE(src.cmd("pmemsave", {{"val", 0}, {"size", kGuest}, {"filename", d + "/src.mem"}}).is_null()) << src.last.dump();
    ASSERT_FALSE(src.cmd("migrate-set-parameters", {{"max-bandwidth", 8 * MiB}}).is_null()) << src.last.dump();
    // QEMU does not wait for the exec: child: the file is complete when it has been renamed.
    ASSERT_FALSE(src.cmd("migrate", {{"uri", "exec:cat > " + d + "/stream.part && mv " + d + "/stream.part " + d +
                                                 "/stream.bin"}})
                     .is_null())
        << src.last.dump();
    ASSERT_EQ(src.wait_migration(), "completed");
    for (int i = 0; i < 600 && !std::filesystem::exists(d + "/stream.bin"); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    src_mem = read_file(d + "/src.mem");
  }
  ASSERT_EQ(src_mem.size(), kGuest);
  const Bytes stream = read_file(d + "/stream.bin");

  // Parse: pages rebuild pc.ram.
  Recorder rec;
  RamStreamParser p(rec);
  ASSERT_TRUE(feed_all(p, stream, 0, 11).ok()) << p.last_error();
  EXPECT_EQ(p.machine_type().rfind("pc-i440fx-", 0), 0u) << p.machine_type();
  ASSERT_FALSE(p.blocks().empty());
  EXPECT_EQ(p.blocks()[0].name, "pc.ram");
  EXPECT_EQ(p.blocks()[0].length, kGuest);
  Bytes ram(kGuest);
  for (size_t i = 0; i < rec.pages.size(); ++i) {
    const PageRecord& pg = rec.pages[i];
    if (pg.block != 0) continue;
    if (pg.zero) {
      std::memset(ram.data() + pg.offset, pg.fill, kPage);
    } else {
      std::memcpy(ram.data() + pg.offset, rec.page_data[i].data(), kPage);
    }
  }
  EXPECT_TRUE(std::equal(ram.begin() + MiB, ram.end(), src_mem.begin() + MiB)) << "pc.ram above 1 MiB";
  EXPECT_TRUE(std::equal(pattern.begin(), pattern.end(), ram.begin() + MiB)) << "the loaded pattern";
  const size_t rounds = std::count_if(rec.log.begin(), rec.log.end(), [](auto& s) { return s.rfind("end ", 0) == 0; });
  EXPECT_GE(rounds, 3u) << "setup, at least one iteration, complete";

  // Split into the RDMA source's stream + pages; inline again.
  SplitSink split;
  RdmaSplitter sp(split);
  ASSERT_TRUE(sp.feed(stream).ok()) << sp.last_error();
  ASSERT_TRUE(sp.finish().ok()) << sp.last_error();
  Recorder hooked;
  RamStreamParser ph(hooked);
  ASSERT_TRUE(feed_all(ph, split.file, 1).ok()) << ph.last_error();
  EXPECT_TRUE(hooked.pages.empty());
  EXPECT_EQ(static_cast<size_t>(std::count_if(hooked.log.begin(), hooked.log.end(),
                                              [](auto& s) { return s.rfind("hook ", 0) == 0; })),
            rounds);

  RoundSource src;
  src.rounds = split.rounds;
  VecSink out;
  InlineRewriter rw(out, src);
  ASSERT_TRUE(rw.feed(split.file).ok()) << rw.last_error();
  ASSERT_TRUE(rw.finish().ok()) << rw.last_error();
  EXPECT_TRUE(out.out == stream) << "the round trip changed the stream";
  write_file(d + "/rewritten.bin", out.out);

  // QEMU loads the rewritten stream.
  Qemu dst;
  auto dargv = argv("dst", "other.bin");
  dargv.push_back("-incoming");
  dargv.push_back("exec:cat " + d + "/rewritten.bin");
  ASSERT_EQ(dst.start(dargv, d + "/dst.qmp", d + "/dst.log"), "");
  ASSERT_EQ(dst.wait_migration(), "completed");
  ASSERT_FALSE(dst.cmd("pmemsave", {{"val", 0}, {"size", kGuest}, {"filename", d + "/dst.mem"}}).is_null()) << dst.last.dump();
  EXPECT_TRUE(read_file(d + "/dst.mem") == src_mem) << "destination RAM differs";
  ASSERT_FALSE(dst.cmd("cont").is_null()) << dst.last.dump();
  EXPECT_EQ(dst.cmd("query-status").value("running", false), true);
}

}  // namespace
}  // namespace ibnbd::migrate::qstream
