// ibnbd-log-replay's reader and replay (tools/soak/log_writes.h) over dm-log-writes logs built
// in memory the way the kernel lays them out: listing, replay to an index and to a mark,
// incremental replay, discards, --drop, and the refusal of every kind of bad log or range
// (with the target left as it was).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "log_writes.h"

namespace ibnbd::soak::logwrites {
namespace {

using Bytes = std::vector<std::byte>;

// A log as drivers/md/dm-log-writes.c writes it: the super in block 0, each entry's header in a
// block of its own (a mark's name after it), each write's data in the blocks after.
class LogBuilder {
 public:
  explicit LogBuilder(uint32_t ss = 512) : ss_(ss), log_(ss) {}

  uint64_t write(uint64_t sector, const Bytes& data, uint64_t flags = 0) {
    EXPECT_EQ(data.size() % ss_, 0u);
    const uint64_t i = header(sector, data.size() / ss_, flags, "");
    log_.insert(log_.end(), data.begin(), data.end());
    return i;
  }
  uint64_t flush() { return header(0, 0, kFlush, ""); }
  uint64_t discard(uint64_t sector, uint64_t n) { return header(sector, n, kDiscard, ""); }
  uint64_t mark(const std::string& name) { return header(0, 0, kMark, name); }

  // The log with the super saying `entries` (default: all of them).
  Bytes bytes(std::optional<uint64_t> count = std::nullopt, uint64_t magic = kMagic, uint64_t version = kVersion) const {
    Bytes out = log_;
    WireSuper sb{};
    sb.magic.set(magic);
    sb.version.set(version);
    sb.nr_entries.set(count.value_or(n_));
    sb.sectorsize.set(ss_);
    std::memset(sb.padding, 0xa5, sizeof sb.padding);  // the kernel's stack garbage
    std::memcpy(out.data(), &sb, sizeof sb);
    return out;
  }
  // The byte offset of entry i's header (to damage it).
  size_t header_offset(uint64_t i) const { return offsets_.at(i); }
  uint32_t ss() const { return ss_; }

  uint64_t header(uint64_t sector, uint64_t nr, uint64_t flags, const std::string& name, uint64_t data_len = 0) {
    offsets_.push_back(log_.size());
    Bytes block(ss_);
    WireEntry e{};
    e.sector.set(sector);
    e.nr_sectors.set(nr);
    e.flags.set(flags);
    e.data_len.set(name.empty() ? data_len : name.size());
    std::memcpy(block.data(), &e, sizeof e);
    std::memcpy(block.data() + sizeof e, name.data(), name.size());
    log_.insert(log_.end(), block.begin(), block.end());
    return n_++;
  }

 private:
  uint32_t ss_;
  Bytes log_;
  uint64_t n_ = 0;
  std::vector<size_t> offsets_;
};

class MemSource final : public Source {
 public:
  explicit MemSource(Bytes b) : b_(std::move(b)) {}
  uint64_t size() const override { return b_.size(); }
  ibtrs::Status read_at(uint64_t off, std::span<std::byte> out) override {
    // The reader promises to stay inside size(): hold it to that.
    EXPECT_LE(off + out.size(), b_.size());
    if (off + out.size() > b_.size()) return ibtrs::errc(EIO);
    std::memcpy(out.data(), b_.data() + off, out.size());
    return {};
  }
  Bytes b_;
};

class MemSink final : public Sink {
 public:
  explicit MemSink(size_t n, std::byte fill = std::byte{0}) : b(n, fill) {}
  uint64_t size() const override { return b.size(); }
  ibtrs::Status write_at(uint64_t off, std::span<const std::byte> data) override {
    EXPECT_LE(off + data.size(), b.size());
    if (off + data.size() > b.size()) return ibtrs::errc(EIO);
    std::memcpy(b.data() + off, data.data(), data.size());
    ++writes;
    return {};
  }
  ibtrs::Status discard(uint64_t off, uint64_t len) override {
    EXPECT_LE(off + len, b.size());
    if (off + len > b.size()) return ibtrs::errc(EIO);
    std::memset(b.data() + off, 0, len);
    return {};
  }
  ibtrs::Status sync() override { return {}; }
  Bytes b;
  int writes = 0;
};

Bytes filled(size_t n, int v) { return Bytes(n, std::byte(v)); }

Point at(uint64_t i) { return Point{i, ""}; }
Point mark(const std::string& m) { return Point{std::nullopt, m}; }

ReplayOptions to(Point p, std::optional<Point> after = std::nullopt, std::optional<uint64_t> drop = std::nullopt) {
  ReplayOptions o;
  o.to = std::move(p);
  o.start_after = std::move(after);
  o.drop = drop;
  return o;
}

std::vector<Entry> entries(const Bytes& log, std::string* why) {
  MemSource src(log);
  std::vector<Entry> out;
  auto s = for_each(src, [&](const Entry& e) -> ibtrs::Status { out.push_back(e); return {}; }, why);
  if (!s) out.clear();
  return out;
}

// Block b of a 512-byte-block target.
Bytes block_of(const MemSink& t, uint64_t b, uint64_t n = 1) {
  return Bytes(t.b.begin() + static_cast<long>(b * 512), t.b.begin() + static_cast<long>((b + n) * 512));
}

// A small history: a mkfs-like write, a flush, a mark, two writes, a FUA, a discard, a mark.
struct Sample {
  LogBuilder l;
  uint64_t w0, f1, m_mkfs, w3, w4, fua5, d6, m_end;
  Sample() {
    w0 = l.write(0, filled(1024, 1));           // blocks 0-1
    f1 = l.flush();
    m_mkfs = l.mark("mkfs");
    w3 = l.write(4, filled(512, 3));            // block 4
    w4 = l.write(0, filled(512, 4));            // block 0 again
    fua5 = l.write(8, filled(1536, 5), kFua | kMetadata);  // blocks 8-10
    d6 = l.discard(1, 1);                        // block 1
    m_end = l.mark("d1");
  }
};

TEST(LogReplay, ListsEveryEntryWithItsFlagsRangeAndMark) {
  // Case: the sample log, walked.
  // Expect: 8 entries in order with their sectors, lengths, flags and mark names; the flush
  // points are the FLUSH, the FUA and the two marks.
  Sample s;
  std::string why;
  auto es = entries(s.l.bytes(), &why);
  ASSERT_EQ(es.size(), 8u) << why;
  EXPECT_EQ(es[0].sector, 0u);
  EXPECT_EQ(es[0].nr_sectors, 2u);
  EXPECT_EQ(flag_names(es[0].flags), "WRITE");
  EXPECT_EQ(flag_names(es[1].flags), "WRITE|FLUSH");
  EXPECT_EQ(flag_names(es[2].flags), "MARK");
  EXPECT_EQ(es[2].mark, "mkfs");
  EXPECT_EQ(flag_names(es[5].flags), "WRITE|FUA|META");
  EXPECT_EQ(es[5].sector, 8u);
  EXPECT_EQ(es[5].nr_sectors, 3u);
  EXPECT_EQ(flag_names(es[6].flags), "DISCARD");
  EXPECT_EQ(es[7].mark, "d1");
  std::vector<uint64_t> points;
  for (const auto& e : es)
    if (is_flush_point(e)) points.push_back(e.index);
  EXPECT_EQ(points, (std::vector<uint64_t>{s.f1, s.m_mkfs, s.fua5, s.m_end}));
  // Each header follows the previous entry's data.
  EXPECT_EQ(es[1].data_offset, es[0].data_offset + 1024 + 512);
}

TEST(LogReplay, ReplaysToAnIndexAndToAMark) {
  // Case: replay to entry 3 (the write after the mkfs mark), and to mark:d1.
  // Expect: exactly the entries up to it on the target; the untouched blocks keep their fill.
  Sample s;
  std::string why;
  MemSource src(s.l.bytes());
  MemSink t(16 * 512, std::byte{0xee});
  auto st = replay(src, t, to(at(s.w3)), &why);
  ASSERT_TRUE(st.ok()) << why;
  EXPECT_EQ(st->first, 0u);
  EXPECT_EQ(st->last, s.w3);
  EXPECT_EQ(st->writes, 2u);
  EXPECT_EQ(st->bytes, 1536u);
  EXPECT_EQ(block_of(t, 0, 2), filled(1024, 1));
  EXPECT_EQ(block_of(t, 4), filled(512, 3));
  EXPECT_EQ(block_of(t, 8), filled(512, 0xee));

  MemSink t2(16 * 512, std::byte{0xee});
  st = replay(src, t2, to(mark("d1")), &why);
  ASSERT_TRUE(st.ok()) << why;
  EXPECT_EQ(st->last, s.m_end);
  EXPECT_EQ(st->discards, 1u);
  EXPECT_EQ(block_of(t2, 0), filled(512, 4));   // rewritten after the mark
  EXPECT_EQ(block_of(t2, 1), filled(512, 0));   // discarded: zeroes
  EXPECT_EQ(block_of(t2, 8, 3), filled(1536, 5));
  EXPECT_EQ(block_of(t2, 12), filled(512, 0xee));
}

TEST(LogReplay, IncrementalReplayEqualsOneShot) {
  // Case: replay to mark:mkfs, then from there to entry 4, then from entry 4 to mark:d1;
  // against one replay from the start to mark:d1.
  // Expect: the same bytes; each step applies only its own entries.
  Sample s;
  std::string why;
  MemSource src(s.l.bytes());
  MemSink whole(16 * 512), steps(16 * 512);
  ASSERT_TRUE(replay(src, whole, to(mark("d1")), &why).ok()) << why;
  auto a = replay(src, steps, to(mark("mkfs")), &why);
  ASSERT_TRUE(a.ok()) << why;
  EXPECT_EQ(a->writes, 1u);
  auto b = replay(src, steps, to(at(s.w4), mark("mkfs")), &why);
  ASSERT_TRUE(b.ok()) << why;
  EXPECT_EQ(b->first, s.w3);
  EXPECT_EQ(b->writes, 2u);
  auto c = replay(src, steps, to(mark("d1"), at(s.w4)), &why);
  ASSERT_TRUE(c.ok()) << why;
  EXPECT_EQ(c->first, s.fua5);
  EXPECT_EQ(c->writes, 1u);
  EXPECT_EQ(c->discards, 1u);
  EXPECT_EQ(steps.b, whole.b);
}

TEST(LogReplay, MarksResolveToTheFirstOfTheirName) {
  // Case: two marks named "x", data between them.
  // Expect: mark:x is the first; an index reaches the second.
  LogBuilder l;
  l.mark("x");
  l.write(0, filled(512, 7));
  const uint64_t second = l.mark("x");
  MemSource src(l.bytes());
  std::string why;
  MemSink t(4 * 512);
  auto st = replay(src, t, to(mark("x")), &why);
  ASSERT_TRUE(st.ok()) << why;
  EXPECT_EQ(st->last, 0u);
  EXPECT_EQ(t.writes, 0);
  st = replay(src, t, to(at(second), mark("x")), &why);
  ASSERT_TRUE(st.ok()) << why;
  EXPECT_EQ(block_of(t, 0), filled(512, 7));
}

TEST(LogReplay, DropLeavesOutExactlyOneEntry) {
  // Case: replay to mark:d1 dropping the FUA write (entry 5).
  // Expect: its blocks keep the target's old bytes; everything else as in a full replay.
  Sample s;
  std::string why;
  MemSource src(s.l.bytes());
  MemSink t(16 * 512, std::byte{0xee});
  auto st = replay(src, t, to(mark("d1"), std::nullopt, s.fua5), &why);
  ASSERT_TRUE(st.ok()) << why;
  EXPECT_EQ(st->dropped, 1u);
  EXPECT_EQ(block_of(t, 8, 3), filled(1536, 0xee));
  EXPECT_EQ(block_of(t, 0), filled(512, 4));
}

TEST(LogReplay, LargeWritesGoInPieces) {
  // Case: a 3 MiB write (more than the 1 MiB piece the replay reads at once).
  // Expect: all of it on the target, in more than one write.
  LogBuilder l;
  Bytes big(3u << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = std::byte(i * 7 + i / 512);
  l.write(2, big);
  MemSource src(l.bytes());
  MemSink t((3u << 20) + 4096);
  std::string why;
  ASSERT_TRUE(replay(src, t, to(at(0)), &why).ok()) << why;
  EXPECT_GE(t.writes, 3);
  EXPECT_EQ(Bytes(t.b.begin() + 1024, t.b.begin() + 1024 + static_cast<long>(big.size())), big);
}

TEST(LogReplay, FourKiBSectors) {
  // Case: a log of a 4 KiB-block device: sectors count 4 KiB blocks.
  // Expect: the write lands at sector * 4096.
  LogBuilder l(4096);
  l.write(3, filled(8192, 9));
  l.mark("m");
  MemSource src(l.bytes());
  MemSink t(8 * 4096);
  std::string why;
  ASSERT_TRUE(replay(src, t, to(mark("m")), &why).ok()) << why;
  EXPECT_EQ(Bytes(t.b.begin() + 3 * 4096, t.b.begin() + 5 * 4096), filled(8192, 9));
  EXPECT_EQ(Bytes(t.b.begin(), t.b.begin() + 3 * 4096), filled(3 * 4096, 0));
}

TEST(LogReplay, BadRangesAreRefusedBeforeAnyWrite) {
  // Case: points not in the log, replay-to before or at start-after, --drop outside the range,
  // a target too small for an entry of the range.
  // Expect: an error naming the point or entry; the target not written.
  Sample s;
  MemSource src(s.l.bytes());
  struct Case {
    const char* name;
    ReplayOptions o;
    size_t target;
    const char* says;
  } cases[] = {
      {"to not in the log", to(mark("nope")), 16 * 512, "no such entry"},
      {"to past the end", to(at(99)), 16 * 512, "no such entry"},
      {"start-after not in the log", to(mark("d1"), mark("nope")), 16 * 512, "start-after mark:nope"},
      {"to before start-after", to(at(s.w3), mark("d1")), 16 * 512, "is not after"},
      {"to at start-after", to(mark("mkfs"), mark("mkfs")), 16 * 512, "is not after"},
      {"drop before the range", to(mark("d1"), mark("mkfs"), s.w0), 16 * 512, "outside"},
      {"drop after the range", to(at(s.w3), std::nullopt, s.fua5), 16 * 512, "outside"},
      {"target too small", to(mark("d1")), 10 * 512, "past the target"},
  };
  for (const auto& c : cases) {
    MemSink t(c.target, std::byte{0xee});
    std::string why;
    auto st = replay(src, t, c.o, &why);
    EXPECT_FALSE(st.ok()) << c.name;
    EXPECT_NE(why.find(c.says), std::string::npos) << c.name << ": " << why;
    EXPECT_EQ(t.writes, 0) << c.name;
    EXPECT_EQ(t.b, Bytes(c.target, std::byte{0xee})) << c.name;
  }
}

// Overwrites the 8 bytes of field `field` (0 sector, 1 nr_sectors, 2 flags, 3 data_len) of
// entry i's header.
void set_field(Bytes& log, const LogBuilder& l, uint64_t i, int field, uint64_t v) {
  le64 x{};
  x.set(v);
  std::memcpy(log.data() + l.header_offset(i) + 8 * field, &x, sizeof x);
}

TEST(LogReplay, EveryCorruptLogIsRefused) {
  // Case: one damage per log: the super's magic, version, sectorsize (too small, too large,
  // not a power of two), nr_entries beyond what the log holds (and 2^64-1), a log shorter than
  // its super, a header cut off, data cut off, unknown flags, a MARK with sectors or other
  // flags, a mark name longer than its block or with a NUL, inline data on a write, a DISCARD
  // with FUA, a sector range that overflows 64 bits.
  // Expect: list and replay both refuse it with a message naming the field; nothing written,
  // no read outside the log (MemSource checks), no allocation sized by a field.
  Sample s;
  const LogBuilder& l = s.l;
  const Bytes good = l.bytes();
  auto super_ss = [&](uint32_t ss) {
    Bytes b = good;
    le32 x{};
    x.set(ss);
    std::memcpy(b.data() + 24, &x, sizeof x);
    return b;
  };
  auto with = [&](uint64_t i, int field, uint64_t v) {
    Bytes b = good;
    set_field(b, l, i, field, v);
    return b;
  };
  Bytes long_mark = good, nul_mark = good, cut_header = good, cut_data = good;
  set_field(long_mark, l, s.m_mkfs, 3, 512 - 32 + 1);
  long_mark[l.header_offset(s.m_mkfs) + 32 + 1] = std::byte{0};  // "m\0fs"
  set_field(nul_mark, l, s.m_mkfs, 3, 4);
  nul_mark[l.header_offset(s.m_mkfs) + 32 + 1] = std::byte{0};
  cut_header.resize(l.header_offset(s.m_end) + 100);
  cut_data.resize(l.header_offset(s.fua5) + 512 + 1000);
  struct Case {
    const char* name;
    Bytes log;
    const char* says;
  } cases[] = {
      {"magic", l.bytes(std::nullopt, kMagic + 1), "bad magic"},
      {"version", l.bytes(std::nullopt, kMagic, 2), "version 2"},
      {"sectorsize 256", super_ss(256), "sectorsize 256"},
      {"sectorsize 128 KiB", super_ss(128u << 10), "sectorsize 131072"},
      {"sectorsize 1000", super_ss(1000), "sectorsize 1000"},
      {"nr_entries too many", l.bytes(1000), "hold at most"},
      {"nr_entries 2^64-1", l.bytes(~0ull), "hold at most"},
      {"shorter than the super", Bytes(good.begin(), good.begin() + 20), "shorter than its super"},
      {"super block cut", Bytes(good.begin(), good.begin() + 300), "shorter than its super"},
      {"header cut", cut_header, "truncated log"},
      {"data cut", cut_data, "truncated log"},
      {"unknown flag", with(s.w3, 2, 1u << 5), "unknown flags"},
      {"mark with sectors", with(s.m_mkfs, 1, 4), "a MARK with"},
      {"mark with flush", with(s.m_mkfs, 2, kMark | kFlush), "a MARK with"},
      {"mark name too long", long_mark, "does not fit"},
      {"mark name with NUL", nul_mark, "NUL"},
      {"inline data", with(s.w3, 3, 512), "inline data"},
      {"discard with FUA", with(s.d6, 2, kDiscard | kFua), "DISCARD with"},
      {"sector overflow", with(s.w3, 0, ~0ull - 1), "overflow"},
      {"byte offset overflow", with(s.d6, 0, (~0ull / 512) + 1), "overflow"},
      {"data length overflow", with(s.w3, 1, ~0ull / 256), "overflow"},
  };
  for (const auto& c : cases) {
    std::string why;
    auto es = entries(c.log, &why);
    EXPECT_TRUE(es.empty()) << c.name;
    EXPECT_NE(why.find(c.says), std::string::npos) << c.name << " (list): " << why;
    MemSource src(c.log);
    MemSink t(16 * 512, std::byte{0xee});
    why.clear();
    auto st = replay(src, t, to(mark("d1")), &why);
    EXPECT_FALSE(st.ok()) << c.name;
    EXPECT_NE(why.find(c.says), std::string::npos) << c.name << " (replay): " << why;
    EXPECT_EQ(t.writes, 0) << c.name;
  }
  // The undamaged log passes both.
  std::string why;
  EXPECT_EQ(entries(good, &why).size(), 8u) << why;
}

TEST(LogReplay, ShortSuperCountStopsTheWalk) {
  // Case: the super counts 3 entries (the kernel rewrites it only at FUA and MARK entries: a
  // log taken from a live device lags).
  // Expect: 3 entries listed; a point after them is not found.
  Sample s;
  const Bytes log = s.l.bytes(3);
  std::string why;
  EXPECT_EQ(entries(log, &why).size(), 3u) << why;
  MemSource src(log);
  MemSink t(16 * 512);
  EXPECT_FALSE(replay(src, t, to(mark("d1")), &why).ok());
  EXPECT_NE(why.find("no such entry"), std::string::npos) << why;
  EXPECT_TRUE(replay(src, t, to(mark("mkfs")), &why).ok()) << why;
}

TEST(LogReplay, PointsParse) {
  // Expect: an index or mark:NAME; nothing else.
  auto p = parse_point("17");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->index, 17u);
  p = parse_point("mark:d12");
  ASSERT_TRUE(p.ok());
  EXPECT_FALSE(p->index.has_value());
  EXPECT_EQ(p->mark, "d12");
  for (const char* bad : {"", "mark:", "-1", "1x", "x", "18446744073709551616", " 3"})
    EXPECT_FALSE(parse_point(bad).ok()) << bad;
}

TEST(LogReplay, PrintableEscapesMarkNames) {
  EXPECT_EQ(printable("d12"), "d12");
  EXPECT_EQ(printable("a b\\\n\xff"), "a\\x20b\\x5c\\x0a\\xff");
}

TEST(LogReplay, FileTargetDiscardPunchesAHole) {
  // Case: a file target holding ones; a log discarding blocks 2-3 and writing block 5.
  // Expect: blocks 2-3 read zeroes, block 5 the data, the rest still ones; the file's size kept.
  LogBuilder l;
  l.discard(2, 2);
  l.write(5, filled(512, 5));
  char lpath[] = "/tmp/log-replay-test-log.XXXXXX";
  char tpath[] = "/tmp/log-replay-test-target.XXXXXX";
  const int lfd = ::mkstemp(lpath), tfd = ::mkstemp(tpath);
  ASSERT_GE(lfd, 0);
  ASSERT_GE(tfd, 0);
  const Bytes log = l.bytes();
  ASSERT_EQ(::write(lfd, log.data(), log.size()), static_cast<ssize_t>(log.size()));
  const Bytes ones = filled(8 * 512, 1);
  ASSERT_EQ(::write(tfd, ones.data(), ones.size()), static_cast<ssize_t>(ones.size()));
  ::close(lfd);
  ::close(tfd);
  {
    auto src = open_source(lpath);
    auto sink = open_sink(tpath);
    ASSERT_TRUE(src.ok() && sink.ok());
    std::string why;
    auto st = replay(**src, **sink, to(at(1)), &why);
    ASSERT_TRUE(st.ok()) << why;
  }
  Bytes got(8 * 512 + 1);
  const int fd = ::open(tpath, O_RDONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::read(fd, got.data(), got.size()), 8 * 512);
  ::close(fd);
  got.resize(8 * 512);
  Bytes want = ones;
  std::memset(want.data() + 2 * 512, 0, 1024);
  std::memset(want.data() + 5 * 512, 5, 512);
  EXPECT_EQ(got, want);
  ::unlink(lpath);
  ::unlink(tpath);
  EXPECT_FALSE(open_sink(tpath).ok());  // a target must exist: no replay into a new empty file
}

}  // namespace
}  // namespace ibnbd::soak::logwrites
