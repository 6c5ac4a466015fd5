// Migration images (client/migrate, docs/migration-image.md) on a RAM volume whose requests
// complete on another thread, as the transport's do, and which can fail, delay and corrupt.
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "base/pattern.h"
#include "crc32c.h"
#include "ibnbd/migrate_image.h"
#include "image_format.h"

namespace ibnbd::migrate {
namespace {

using Bytes = std::vector<std::byte>;
constexpr uint64_t MiB = 1ull << 20;

class HeapBuffer final : public IoBuffer {
 public:
  explicit HeapBuffer(size_t n) : b_(n) {}
  std::byte* data() const override { return const_cast<std::byte*>(b_.data()); }
  size_t size() const override { return b_.size(); }

 private:
  Bytes b_;
};

// The fake volume. Requests are queued and carried out on a completion thread; faults:
// fail_after (the n-th write and all later ones fail with EIO), fail_at (writes touching an
// offset fail), hold (completions wait until released).
class RamVolume final : public Volume {
 public:
  struct Op {
    char kind;  // 'w', 'r', 'f'
    uint64_t off = 0;
    uint64_t len = 0;
    bool fua = false;
  };

  explicit RamVolume(uint64_t size) : data_(size), worker_([this] { run(); }) {}
  ~RamVolume() override {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
      held_ = false;
    }
    cv_.notify_all();
    worker_.join();
  }

  uint64_t size() const override { return data_.size(); }
  uint32_t block_size() const override { return 512; }
  Result<std::unique_ptr<IoBuffer>> alloc(size_t bytes) override {
    return std::unique_ptr<IoBuffer>(new HeapBuffer(bytes));
  }
  Status write(const IoBuffer& b, size_t bo, uint64_t off, size_t len, bool fua, VolumeDone d) override {
    return queue({'w', off, len, fua}, b.data() + bo, d);
  }
  Status read(const IoBuffer& b, size_t bo, uint64_t off, size_t len, VolumeDone d) override {
    return queue({'r', off, len, false}, b.data() + bo, d);
  }
  Status flush(VolumeDone d) override { return queue({'f'}, nullptr, d); }

  // Test controls.
  void fail_writes_after(int64_t n) { std::lock_guard lk(mu_); fail_after_ = n; }
  void fail_writes_at(uint64_t off) { std::lock_guard lk(mu_); fail_at_ = off; }
  void hold(bool on) {
    { std::lock_guard lk(mu_); held_ = on; }
    cv_.notify_all();
  }
  size_t queued() { std::lock_guard lk(mu_); return q_.size(); }
  std::vector<Op> log() { std::lock_guard lk(mu_); return log_; }
  void clear_log() { std::lock_guard lk(mu_); log_.clear(); }
  uint32_t max_writes_queued() { std::lock_guard lk(mu_); return max_w_; }
  std::byte* raw(uint64_t off) { return data_.data() + off; }

 private:
  struct Req {
    Op op;
    std::byte* p;
    VolumeDone d;
  };
  Status queue(Op op, std::byte* p, VolumeDone d) {
    if (op.kind != 'f' && (op.off % 512 || op.len % 512 || op.off + op.len > data_.size()))
      return ibtrs::errc(EINVAL);
    std::lock_guard lk(mu_);
    q_.push_back({op, p, d});
    uint32_t w = 0;
    for (auto& r : q_) w += r.op.kind == 'w';
    max_w_ = std::max(max_w_, w);
    cv_.notify_all();
    return {};
  }
  void run() {
    std::unique_lock lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return stop_ || (!held_ && !q_.empty()); });
      if (q_.empty() && stop_) return;
      if (q_.empty()) continue;
      Req r = q_.front();
      q_.pop_front();
      int e = 0;
      if (r.op.kind == 'w') {
        ++writes_;
        if ((fail_after_ >= 0 && writes_ > fail_after_) ||
            (fail_at_ != UINT64_MAX && fail_at_ >= r.op.off && fail_at_ < r.op.off + r.op.len))
          e = EIO;
        else
          std::memcpy(data_.data() + r.op.off, r.p, r.op.len);
      } else if (r.op.kind == 'r') {
        std::memcpy(r.p, data_.data() + r.op.off, r.op.len);
      }
      if (e == 0) log_.push_back(r.op);
      lk.unlock();
      r.d.fn(r.d.ctx, e);
      lk.lock();
    }
  }

  Bytes data_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Req> q_;
  std::vector<Op> log_;
  bool stop_ = false;
  bool held_ = false;
  int64_t fail_after_ = -1;
  int64_t writes_ = 0;
  uint64_t fail_at_ = UINT64_MAX;
  uint32_t max_w_ = 0;
  std::thread worker_;
};

// Data no chunk of which is all zeros (the writer elides those), the same for the same seed.
Bytes random_bytes(size_t n, uint32_t seed) {
  Bytes b(n);
  base::Pattern(seed).fill(b, 0);
  return b;
}

// A stream with zero runs that cover whole chunks (elided) and a short tail.
Bytes stream_with_holes(size_t n, uint32_t seed) {
  Bytes b = random_bytes(n, seed);
  if (n > 3 * MiB) std::memset(b.data() + MiB, 0, 2 * MiB);
  return b;
}

// Feeds `data` into `stream` in uneven pieces, as reads from a pipe arrive.
void feed(ImageWriter& w, uint32_t stream, const Bytes& data, size_t piece = 65536 + 4096 + 17) {
  size_t at = 0;
  while (at < data.size()) {
    auto span = w.buffer(stream);
    ASSERT_TRUE(span) << span.error().message();
    const size_t n = std::min({span->size(), piece, data.size() - at});
    std::memcpy(span->data(), data.data() + at, n);
    ASSERT_TRUE(w.produced(stream, n));
    at += n;
  }
}

Bytes read_stream(ImageReader& r, uint32_t s) {
  auto sr = r.stream(s, {4});
  EXPECT_TRUE(sr);
  Bytes out;
  for (;;) {
    auto p = (*sr)->next();
    EXPECT_TRUE(p) << (*sr)->last_error();
    if (!p || p->empty()) break;
    out.insert(out.end(), p->begin(), p->end());
  }
  return out;
}

class ImageTest : public ::testing::Test {
 protected:
  void SetUp() override { vol_ = std::make_unique<RamVolume>(64 * MiB); }
  std::unique_ptr<ImageStore> store() {
    auto s = ImageStore::open(*vol_);
    EXPECT_TRUE(s) << s.error().message();
    return s ? std::move(*s) : nullptr;
  }
  std::unique_ptr<RamVolume> vol_;
};

// Case: one stream of 5.5 MiB with two all-zero chunks. Action: save, list, restore, verify.
// Expect: the same bytes back; 4 chunks stored, 2 elided; the image COMMITTED.
TEST_F(ImageTest, RoundTripElidesZeroChunks) {
  auto st = store();
  const Bytes data = stream_with_holes(5 * MiB + MiB / 2, 1);
  {
    auto w = st->create({.name = "vm1"});
    ASSERT_TRUE(w) << st->last_error();
    feed(**w, 0, data);
    ASSERT_TRUE((*w)->commit()) << (*w)->last_error();
    EXPECT_EQ((*w)->progress().bytes, data.size());
  }
  auto l = st->list();
  ASSERT_TRUE(l);
  ASSERT_EQ(l->size(), 1u);
  EXPECT_EQ((*l)[0].state, ImageState::committed);
  EXPECT_EQ((*l)[0].stored_chunks, 4u);
  EXPECT_EQ((*l)[0].zero_chunks, 2u);
  EXPECT_EQ((*l)[0].total_bytes(), data.size());
  EXPECT_LE((*l)[0].extent_length, 8 * MiB);  // shrunk to what it used
  auto r = st->open_image("vm1");
  ASSERT_TRUE(r) << st->last_error();
  EXPECT_EQ(read_stream(**r, 0), data);
  EXPECT_TRUE((*r)->verify());
}

// Case: multifd, a main stream and two channels produced interleaved. Expect: each stream
// back on its own, byte for byte.
TEST_F(ImageTest, MultifdStreamsStayApart) {
  auto st = store();
  std::vector<Bytes> s = {random_bytes(3 * MiB + 5, 2), random_bytes(2 * MiB, 3), random_bytes(100, 4)};
  auto w = st->create({.name = "mf", .streams = 3});
  ASSERT_TRUE(w);
  std::vector<std::thread> producers;
  for (uint32_t i = 0; i < 3; ++i) producers.emplace_back([&, i] { feed(**w, i, s[i], 300000); });
  for (auto& t : producers) t.join();
  ASSERT_TRUE((*w)->commit());
  auto r = st->open_image("mf");
  ASSERT_TRUE(r);
  ASSERT_EQ((*r)->info().streams.size(), 3u);
  for (uint32_t i = 0; i < 3; ++i) EXPECT_EQ(read_stream(**r, i), s[i]) << "stream " << i;
}

// Case: the main stream starts like QEMU's (QEVM, version 3, configuration with machine type and
// the uuid subsection). Expect: machine type and uuid in the image's info.
TEST_F(ImageTest, IdentityFromTheStream) {
  Bytes head;
  auto put = [&](std::initializer_list<int> v) { for (int x : v) head.push_back(std::byte(x)); };
  auto put_str = [&](std::string_view s) { for (char c : s) head.push_back(std::byte(c)); };
  put({'Q', 'E', 'V', 'M', 0, 0, 0, 3, 0x07, 0, 0, 0, 13});
  put_str("pc-i440fx-7.2");
  put({0x05, 30});
  put_str("configuration/target-page-bits");
  put({0, 0, 0, 1, 0, 0, 0, 12, 0x05, 26});
  put_str("configuration/capabilities");
  put({0, 0, 0, 1, 0, 0, 0, 1, 9});
  put_str("x-ignore-");
  put({0x05, 18});
  put_str("configuration/uuid");
  put({0, 0, 0, 1});
  for (int i = 0; i < 16; ++i) put({0xA0 + i});
  auto id = parse_stream_identity(head);
  EXPECT_TRUE(id.is_qemu_stream);
  EXPECT_EQ(id.machine_type, "pc-i440fx-7.2");
  EXPECT_EQ(id.vm_uuid[0], 0xA0);
  EXPECT_EQ(id.vm_uuid[15], 0xAF);
  // Truncated anywhere: no crash, never more than what was there.
  for (size_t n = 0; n < head.size(); ++n) {
    auto p = parse_stream_identity(std::span(head.data(), n));
    if (n < 8) {
      EXPECT_FALSE(p.is_qemu_stream);
    }
    if (n < 13 + 13) {
      EXPECT_EQ(p.machine_type, "");
    }
  }
  Bytes data = head;
  Bytes rest = random_bytes(MiB, 5);
  data.insert(data.end(), rest.begin(), rest.end());
  auto st = store();
  auto w = st->create({.name = "id"});
  ASSERT_TRUE(w);
  feed(**w, 0, data);
  ASSERT_TRUE((*w)->commit());
  auto l = st->list();
  ASSERT_TRUE(l);
  EXPECT_EQ((*l)[0].machine_type, "pc-i440fx-7.2");
  EXPECT_EQ((*l)[0].vm_uuid[3], 0xA3);
}

// Case: one byte of a stored chunk flipped on the volume. Expect: the reader refuses that piece
// (EILSEQ) before handing it out, naming the stream, piece and offset; verify says the same.
TEST_F(ImageTest, CorruptChunkIsNamed) {
  auto st = store();
  const Bytes data = random_bytes(3 * MiB, 6);
  auto w = st->create({.name = "c"});
  ASSERT_TRUE(w);
  feed(**w, 0, data);
  ASSERT_TRUE((*w)->commit());
  const uint64_t chunk1 = (*st->list())[0].extent_start + MiB + MiB;  // data_offset + 1 chunk
  *vol_->raw(chunk1 + 777) ^= std::byte{1};
  auto r = st->open_image("c");
  ASSERT_TRUE(r);
  auto sr = (*r)->stream(0);
  ASSERT_TRUE(sr);
  auto p0 = (*sr)->next();
  ASSERT_TRUE(p0);
  EXPECT_EQ(p0->size(), MiB);
  auto p1 = (*sr)->next();
  ASSERT_FALSE(p1);
  EXPECT_EQ(p1.error().value(), EILSEQ);
  EXPECT_NE((*sr)->last_error().find("piece 1 at volume offset " + std::to_string(chunk1)), std::string::npos)
      << (*sr)->last_error();
  auto v = (*r)->verify();
  ASSERT_FALSE(v);
  EXPECT_EQ(v.error().value(), EILSEQ);
  EXPECT_NE((*r)->last_error().find("piece 1"), std::string::npos);
}

// Case: a save that never commits (the agent died). Expect: PARTIAL in the list, refused for
// restore (EBUSY), its name taken (EEXIST) until deleted; deleting frees the space.
TEST_F(ImageTest, PartialImageIsRefusedUntilDeleted) {
  auto st = store();
  {
    auto w = st->create({.name = "p"});
    ASSERT_TRUE(w);
    feed(**w, 0, random_bytes(2 * MiB, 7));
  }
  auto l = st->list();
  ASSERT_TRUE(l);
  ASSERT_EQ(l->size(), 1u);
  EXPECT_EQ((*l)[0].state, ImageState::partial);
  EXPECT_EQ((*l)[0].problem, "");
  auto r = st->open_image("p");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().value(), EBUSY);
  auto again = st->create({.name = "p"});
  ASSERT_FALSE(again);
  EXPECT_EQ(again.error().value(), EEXIST);
  ASSERT_TRUE(st->remove("p"));
  EXPECT_EQ(st->list()->size(), 0u);
  EXPECT_EQ(st->remove("p").error().value(), ENOENT);
  // A fresh store sees the same (nothing cached).
  EXPECT_EQ(store()->list()->size(), 0u);
}

// Case: the volume fails writes in the middle of a save. Expect: the error comes back from the
// writer (no commit), the image stays PARTIAL.
TEST_F(ImageTest, WriteErrorLeavesPartial) {
  auto st = store();
  auto w = st->create({.name = "e", .ring_chunks = 4});
  ASSERT_TRUE(w);
  vol_->fail_writes_after(0);
  const Bytes data = random_bytes(8 * MiB, 8);
  Status last;
  size_t at = 0;
  while (at < data.size()) {
    auto span = (*w)->buffer(0);
    if (!span) {
      last = span.error();
      break;
    }
    const size_t n = std::min(span->size(), data.size() - at);
    std::memcpy(span->data(), data.data() + at, n);
    if (last = (*w)->produced(0, n); !last) break;
    at += n;
  }
  if (last) last = (*w)->commit();
  ASSERT_FALSE(last);
  EXPECT_EQ(last.error().value(), EIO);
  w->reset();
  vol_->fail_writes_after(-1);
  EXPECT_EQ((*st->list())[0].state, ImageState::partial);
}

// Case: the header, then its mirror, damaged. Expect: the mirror serves while the primary is
// bad; with both bad the image is listed with the problem and refused (EILSEQ).
TEST_F(ImageTest, HeaderMirror) {
  auto st = store();
  const Bytes data = random_bytes(MiB + 5, 9);
  auto w = st->create({.name = "h"});
  ASSERT_TRUE(w);
  feed(**w, 0, data);
  ASSERT_TRUE((*w)->commit());
  const auto info = (*st->list())[0];
  *vol_->raw(info.extent_start + 100) ^= std::byte{0x40};
  auto r = st->open_image("h");
  ASSERT_TRUE(r) << st->last_error();
  EXPECT_EQ(read_stream(**r, 0), data);
  *vol_->raw(info.extent_start + info.extent_length - 4096 + 100) ^= std::byte{0x40};
  auto bad = st->open_image("h");
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().value(), EILSEQ);
  auto l = st->list();
  ASSERT_TRUE(l);
  EXPECT_NE((*l)[0].problem.find("bad CRC"), std::string::npos) << (*l)[0].problem;
}

// Case: the directory's primary copy damaged, then both. Expect: the mirror serves; with both
// damaged the store refuses to open (EILSEQ) instead of formatting over it. A volume that was
// never formatted opens empty.
TEST_F(ImageTest, DirectoryMirrorAndRefusal) {
  EXPECT_EQ(store()->list()->size(), 0u);
  {
    auto st = store();
    auto w = st->create({.name = "d"});
    ASSERT_TRUE(w);
    feed(**w, 0, random_bytes(MiB, 10));
    ASSERT_TRUE((*w)->commit());
  }
  *vol_->raw(200) ^= std::byte{1};
  auto st = store();
  ASSERT_TRUE(st);
  EXPECT_EQ(st->list()->size(), 1u);
  *vol_->raw(64 * MiB - 4096 + 200) ^= std::byte{1};
  auto s2 = ImageStore::open(*vol_);
  ASSERT_FALSE(s2);
  EXPECT_EQ(s2.error().value(), EILSEQ);
}

// Case: a hostile directory (valid CRC, overlapping extents). Expect: EILSEQ, nothing used.
TEST_F(ImageTest, OverlappingExtentsAreRefused) {
  fmt::DirView d;
  d.generation = 1;
  d.volume_size = vol_->size();
  d.slots[0] = {"a", 2 * MiB, 4 * MiB, fmt::kSlotCommitted};
  d.slots[1] = {"b", 4 * MiB, 4 * MiB, fmt::kSlotCommitted};
  fmt::Directory raw;
  fmt::encode(d, raw);
  std::memcpy(vol_->raw(0), &raw, sizeof raw);
  std::memcpy(vol_->raw(vol_->size() - 4096), &raw, sizeof raw);
  auto s = ImageStore::open(*vol_);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error().value(), EILSEQ);
  d.slots[1] = {"a", 8 * MiB, 4 * MiB, fmt::kSlotCommitted};  // same name twice
  fmt::encode(d, raw);
  EXPECT_EQ(fmt::decode(raw, vol_->size()).error().value(), EILSEQ);
  d.slots[1] = {"../x", 8 * MiB, 4 * MiB, fmt::kSlotCommitted};
  fmt::encode(d, raw);
  EXPECT_EQ(fmt::decode(raw, vol_->size()).error().value(), EILSEQ);
  d.slots[1] = {"b", 8 * MiB, 128 * MiB, fmt::kSlotCommitted};  // past the volume's end
  fmt::encode(d, raw);
  EXPECT_EQ(fmt::decode(raw, vol_->size()).error().value(), EILSEQ);
}

// Case: several images on one volume, then no room. Expect: each in its own extent; a save that
// outgrows the free space fails with ENOSPC; after a delete the space is reused.
TEST_F(ImageTest, SeveralImagesAndNoSpace) {
  auto st = store();
  for (const char* n : {"one", "two"}) {
    auto w = st->create({.name = n, .max_bytes = 8 * MiB});
    ASSERT_TRUE(w);
    feed(**w, 0, random_bytes(6 * MiB, 11));
    ASSERT_TRUE((*w)->commit());
  }
  auto big = st->create({.name = "big"});
  ASSERT_TRUE(big);
  Status s;
  const Bytes chunk = random_bytes(MiB, 12);
  for (int i = 0; i < 100 && s; ++i) {
    auto span = (*big)->buffer(0);
    if (!span) {
      s = span.error();
      break;
    }
    std::memcpy(span->data(), chunk.data(), span->size());
    s = (*big)->produced(0, span->size());
  }
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error().value(), ENOSPC);
  big->reset();
  ASSERT_TRUE(st->remove("big"));
  ASSERT_TRUE(st->remove("one"));
  auto w = st->create({.name = "three"});
  ASSERT_TRUE(w);
  feed(**w, 0, random_bytes(20 * MiB, 13));
  ASSERT_TRUE((*w)->commit());
  auto l = st->list();
  ASSERT_EQ(l->size(), 2u);
  auto r = st->open_image("two");
  ASSERT_TRUE(r);
  EXPECT_EQ(read_stream(**r, 0), random_bytes(6 * MiB, 11));
}

// Case: the commit's order on the volume. Expect: data and index, then the mirror header, then
// a flush, then the primary header with FUA, then the directory copies with FUA.
TEST_F(ImageTest, CommitOrder) {
  auto st = store();
  auto w = st->create({.name = "o"});
  ASSERT_TRUE(w);
  feed(**w, 0, random_bytes(3 * MiB, 14));
  vol_->clear_log();
  ASSERT_TRUE((*w)->commit());
  const auto info = (*st->list())[0];
  auto log = vol_->log();
  // Positions in the log of the first flush and the primary header write.
  size_t flush = log.size(), primary = log.size(), dir = log.size();
  for (size_t i = 0; i < log.size(); ++i) {
    if (log[i].kind == 'f' && flush == log.size()) flush = i;
    if (log[i].kind == 'w' && log[i].off == info.extent_start && primary == log.size()) primary = i;
    if (log[i].kind == 'w' && log[i].off == 0 && dir == log.size()) dir = i;
  }
  ASSERT_LT(flush, log.size());
  ASSERT_LT(primary, log.size());
  ASSERT_LT(dir, log.size());
  EXPECT_LT(flush, primary);
  EXPECT_TRUE(log[primary].fua);
  EXPECT_LT(primary, dir);
  EXPECT_TRUE(log[dir].fua);
  for (size_t i = 0; i < flush; ++i) {
    EXPECT_EQ(log[i].kind, 'w');
    EXPECT_GT(log[i].off, info.extent_start) << "only data, index and the mirror before the flush";
  }
}

// Case: the agent dies after the header was committed but before the directory caught up
// (simulated: directory writes fail). Expect: the image restores anyway, and the next
// directory update records it as COMMITTED with its shrunk extent.
TEST_F(ImageTest, CommittedHeaderWinsOverStaleDirectory) {
  auto st = store();
  const Bytes data = random_bytes(2 * MiB + 3, 15);
  auto w = st->create({.name = "x"});
  ASSERT_TRUE(w);
  feed(**w, 0, data);
  vol_->fail_writes_at(0);
  ASSERT_FALSE((*w)->commit());
  vol_->fail_writes_at(UINT64_MAX);
  w->reset();
  auto st2 = store();
  auto l = st2->list();
  ASSERT_TRUE(l);
  EXPECT_EQ((*l)[0].state, ImageState::committed);
  auto r = st2->open_image("x");
  ASSERT_TRUE(r) << st2->last_error();
  EXPECT_EQ(read_stream(**r, 0), data);
  auto w2 = st2->create({.name = "y", .max_bytes = 2 * MiB});  // writes the directory
  ASSERT_TRUE(w2);
  fmt::Directory raw;
  std::memcpy(&raw, vol_->raw(0), sizeof raw);
  auto d = fmt::decode(raw, vol_->size());
  ASSERT_TRUE(d);
  EXPECT_EQ(d->slots[0].state, fmt::kSlotCommitted);
  EXPECT_EQ(d->slots[0].length, (*l)[0].extent_length);
}

// Case: completions held back while a producer writes. Expect: buffer() blocks once the ring is
// full (never more writes queued than ring buffers), and goes on when they complete.
TEST_F(ImageTest, BackPressure) {
  auto st = store();
  auto w = st->create({.name = "bp", .ring_chunks = 3});
  ASSERT_TRUE(w);
  vol_->hold(true);
  std::atomic<bool> finished{false};
  const Bytes data = random_bytes(10 * MiB, 16);
  std::thread producer([&] {
    feed(**w, 0, data);
    finished = true;
  });
  for (int i = 0; i < 50 && vol_->queued() < 3; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(finished.load());
  EXPECT_EQ(vol_->queued(), 3u);
  vol_->hold(false);
  producer.join();
  ASSERT_TRUE((*w)->commit());
  EXPECT_LE(vol_->max_writes_queued(), 3u);
  auto r = st->open_image("bp");
  ASSERT_TRUE(r);
  EXPECT_EQ(read_stream(**r, 0), data);
}

// Case: CRC32C known answers (RFC 3720 B.4) and continuation.
TEST(Crc32c, KnownAnswers) {
  Bytes zeros(32, std::byte{0}), ones(32, std::byte{0xFF}), inc(32);
  for (int i = 0; i < 32; ++i) inc[i] = std::byte(i);
  EXPECT_EQ(crc32c(zeros), 0x8A9136AAu);
  EXPECT_EQ(crc32c(ones), 0x62A8AB43u);
  EXPECT_EQ(crc32c(inc), 0x46DD794Eu);
  const std::string s = "123456789";
  EXPECT_EQ(crc32c(std::as_bytes(std::span(s))), 0xE3069283u);
  EXPECT_EQ(crc32c(std::as_bytes(std::span(s).subspan(4)), crc32c(std::as_bytes(std::span(s).first(4)))),
            0xE3069283u);
}

// Case: the three-lane path (24 KiB and 768-byte rounds joined by the shift tables) against a
// bit-at-a-time reference, at lengths around every round boundary, from unaligned starts, and
// continued across a split. A wrong shift table or lane order changes every such value.
TEST(Crc32c, LanesMatchBitwiseReference) {
  auto reference = [](std::span<const std::byte> d) {
    uint32_t c = 0xFFFFFFFFu;
    for (std::byte b : d) {
      c ^= std::to_integer<uint32_t>(b);
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    }
    return ~c;
  };
  Bytes data((1 << 20) + 64);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (auto& b : data) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = std::byte(x);
  }
  for (size_t len : {size_t{0}, size_t{1}, size_t{7}, size_t{767}, size_t{768}, size_t{769}, size_t{24575},
                     size_t{24576}, size_t{24577}, size_t{24576 + 768 + 5}, size_t{1} << 20}) {
    for (size_t start : {size_t{0}, size_t{3}}) {
      const auto d = std::span<const std::byte>(data).subspan(start, len);
      EXPECT_EQ(crc32c(d), reference(d)) << "len " << len << " start " << start;
      const size_t cut = len / 3;
      EXPECT_EQ(crc32c(d.subspan(cut), crc32c(d.first(cut))), reference(d)) << "len " << len << " split";
    }
  }
}

}  // namespace
}  // namespace ibnbd::migrate
