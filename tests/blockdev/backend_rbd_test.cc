// The IoEngine's RBD path without a cluster: a Backend of kind rbd over a fake image
// (backend::RbdFake) that keeps the bytes in memory and completes every stage from threads of its
// own, in an order it chooses, the way librbd's callbacks arrive. What the engine must do with
// them: hand each completion to its owner thread (through the lock-free list and the eventfd),
// run a request's stages in order (PREFLUSH, the operation, FUA's flush), stop at the first
// failure, refuse what librbd refuses at once without a callback, and never free itself while a
// stage is out. The real librbd is tests/rbd/rbd_gateway.sh; this file runs under TSan too.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/rbd_image.h"
#include "ibnbd/backend.h"

namespace ibnbd {
namespace {

using backend::RbdAio;
using backend::RbdStage;
using namespace std::chrono_literals;

// An image in memory. Each started stage is queued; `threads` workers take them (in random order
// when `shuffle`), apply them, and call the completion. Faults: fail the next stage of a kind
// with an errno, report short reads, hold every completion until release().
class FakeImage final : public backend::RbdFake {
 public:
  explicit FakeImage(uint64_t bytes, int threads = 2) : data_(bytes) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this, i] { work(i); });
  }
  ~FakeImage() override {
    {
      std::lock_guard l(mu_);
      stop_ = true;
      held_ = false;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  int start(RbdStage st, uint64_t off, uint64_t len, const iovec* iov, int niov, bool nounmap, RbdAio* aio) override {
    std::lock_guard l(mu_);
    if (refuse_next_ != 0) return -std::exchange(refuse_next_, 0);
    Op op{st, off, len, {}, nounmap, aio};
    op.iov.assign(iov, iov + niov);
    queue_.push_back(std::move(op));
    log_.push_back(st);
    cv_.notify_one();
    return 0;
  }
  int size(uint64_t* bytes) override {
    *bytes = data_.size();
    return 0;
  }
  int sync() override {
    syncs_.fetch_add(1);
    return 0;
  }

  void fail_next(RbdStage st, int err) {
    std::lock_guard l(mu_);
    fail_[static_cast<int>(st)] = err;
  }
  void refuse_next(int err) {
    std::lock_guard l(mu_);
    refuse_next_ = err;
  }
  void short_reads(bool on) { short_reads_.store(on); }
  void shuffle(bool on) { shuffle_.store(on); }
  void hold() {
    std::lock_guard l(mu_);
    held_ = true;
  }
  void release() {
    {
      std::lock_guard l(mu_);
      held_ = false;
    }
    cv_.notify_all();
  }
  std::vector<RbdStage> log() {
    std::lock_guard l(mu_);
    return log_;
  }
  void clear_log() {
    std::lock_guard l(mu_);
    log_.clear();
  }
  size_t queued() {
    std::lock_guard l(mu_);
    return queue_.size();
  }
  std::vector<std::byte>& data() { return data_; }  // only while nothing is in flight
  std::atomic<uint64_t> syncs_{0};
  std::atomic<uint64_t> completions_{0};
  std::atomic<bool> last_nounmap_{false};

 private:
  struct Op {
    RbdStage st;
    uint64_t off, len;
    std::vector<iovec> iov;
    bool nounmap;
    RbdAio* aio;
  };

  void work(int seed) {
    std::mt19937 rng(static_cast<uint32_t>(seed) + 1);
    std::unique_lock l(mu_);
    for (;;) {
      cv_.wait(l, [&] { return stop_ || (!held_ && !queue_.empty()); });
      if (queue_.empty()) {
        if (stop_) return;
        continue;
      }
      size_t pick = 0;
      if (shuffle_.load()) pick = std::uniform_int_distribution<size_t>(0, queue_.size() - 1)(rng);
      Op op = std::move(queue_[pick]);
      queue_.erase(queue_.begin() + static_cast<std::ptrdiff_t>(pick));
      const int fail = std::exchange(fail_[static_cast<int>(op.st)], 0);
      l.unlock();
      const int64_t res = fail != 0 ? -fail : apply(op);
      completions_.fetch_add(1);
      op.aio->fn(op.aio, res);  // as librbd's callback: on this thread, last touch of op.aio
      l.lock();
    }
  }

  // Ranges never overlap between requests in flight in these tests (as a block layer's never
  // do for writes), so the memory needs no lock beyond the engine's own ordering.
  int64_t apply(const Op& op) {
    switch (op.st) {
      case RbdStage::read: {
        uint64_t at = op.off;
        for (const iovec& v : op.iov) {
          std::memcpy(v.iov_base, data_.data() + at, v.iov_len);
          at += v.iov_len;
        }
        const int64_t n = static_cast<int64_t>(at - op.off);
        return short_reads_.load() ? n - 512 : n;
      }
      case RbdStage::write: {
        uint64_t at = op.off;
        for (const iovec& v : op.iov) {
          std::memcpy(data_.data() + at, v.iov_base, v.iov_len);
          at += v.iov_len;
        }
        return static_cast<int64_t>(at - op.off);
      }
      case RbdStage::discard:
      case RbdStage::write_zeroes:
        last_nounmap_.store(op.nounmap);
        std::memset(data_.data() + op.off, 0, op.len);
        return 0;
      case RbdStage::flush:
        return 0;
    }
    return -EINVAL;
  }

  std::vector<std::byte> data_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  std::vector<RbdStage> log_;
  int fail_[5] = {};
  int refuse_next_ = 0;
  bool held_ = false;
  bool stop_ = false;
  std::atomic<bool> short_reads_{false};
  std::atomic<bool> shuffle_{false};
  std::vector<std::thread> workers_;
};

struct Done {
  int err = -1;
  int calls = 0;
  std::thread::id on;
  static void fn(void* ctx, int err) {
    auto* d = static_cast<Done*>(ctx);
    d->err = err;
    ++d->calls;
    d->on = std::this_thread::get_id();
  }
};

class RbdEngine : public ::testing::Test {
 protected:
  static constexpr uint64_t kSize = 8 << 20;
  void SetUp() override {
    fake_ = std::make_unique<FakeImage>(kSize);
    be_ = backend::RbdAccess::make_fake(fake_.get(), kSize, false);
    EngineOptions o;
    o.queue_depth = 128;
    auto e = IoEngine::create(o);
    ASSERT_TRUE(e.ok()) << e.error().message();
    engine_ = std::move(*e);
  }
  void TearDown() override {
    engine_.reset();  // before the fake: it may still have completions to deliver
    be_.reset();
    fake_.reset();
  }
  // Runs the engine until `d` was called back (10 s at most).
  bool wait_for(const Done& d) {
    const auto until = std::chrono::steady_clock::now() + 10s;
    while (d.calls == 0 && std::chrono::steady_clock::now() < until) engine_->wait(100ms);
    return d.calls == 1;
  }
  Status submit(IoOp op, uint64_t off, std::span<std::byte> buf, Done& d, uint32_t flags = 0, uint32_t len = 0) {
    BackendRequest r;
    r.backend = be_.get();
    r.op = op;
    r.flags = flags;
    r.offset = off;
    r.len = buf.empty() ? len : static_cast<uint32_t>(buf.size());
    r.buf = buf;
    r.done = &Done::fn;
    r.ctx = &d;
    auto st = engine_->submit(r);
    if (st.ok()) (void)engine_->kick();
    return st;
  }
  int run(IoOp op, uint64_t off, std::span<std::byte> buf, uint32_t flags = 0, uint32_t len = 0) {
    Done d;
    auto st = submit(op, off, buf, d, flags, len);
    if (!st.ok()) return -st.error().value();
    EXPECT_TRUE(wait_for(d));
    EXPECT_EQ(d.on, std::this_thread::get_id()) << "callbacks run on the engine's owner thread";
    return d.err;
  }
  static std::vector<std::byte> pattern(size_t n, uint8_t seed) {
    std::vector<std::byte> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = std::byte(static_cast<uint8_t>(i * 131 + seed));
    return v;
  }

  std::unique_ptr<FakeImage> fake_;
  std::unique_ptr<Backend> be_;
  std::unique_ptr<IoEngine> engine_;
};

// Case: a write then a read of 64 KiB, each completed on a fake librbd thread.
// Expect: both succeed, called back on the test's thread (the engine's owner), bytes equal.
TEST_F(RbdEngine, WriteAndReadCompleteOnTheOwnerThread) {
  EXPECT_EQ(be_->kind(), Backend::Kind::rbd);
  auto w = pattern(65536, 7);
  ASSERT_EQ(run(IoOp::write, 1 << 20, w), 0);
  std::vector<std::byte> r(65536);
  ASSERT_EQ(run(IoOp::read, 1 << 20, r), 0);
  EXPECT_EQ(r, w);
  EXPECT_EQ(engine_->in_flight(), 0u);
}

// Case: a write with PREFLUSH and FUA; a write-zeroes with FUA; a plain FLUSH.
// Expect: the stages in order, one at a time: flush, write, flush; zeroes, flush; flush.
TEST_F(RbdEngine, PreflushAndFuaBecomeFlushesAroundTheOperation) {
  auto w = pattern(4096, 1);
  ASSERT_EQ(run(IoOp::write, 0, w, kIoPreflush | kIoFua), 0);
  EXPECT_EQ(fake_->log(), (std::vector<RbdStage>{RbdStage::flush, RbdStage::write, RbdStage::flush}));
  fake_->clear_log();
  ASSERT_EQ(run(IoOp::write_zeroes, 0, {}, kIoFua, 4096), 0);
  EXPECT_EQ(fake_->log(), (std::vector<RbdStage>{RbdStage::write_zeroes, RbdStage::flush}));
  fake_->clear_log();
  ASSERT_EQ(run(IoOp::flush, 0, {}), 0);
  EXPECT_EQ(fake_->log(), (std::vector<RbdStage>{RbdStage::flush}));
}

// Case: discard and write-zeroes (with and without NOUNMAP) over written data.
// Expect: the ranges read back as zeros; NOUNMAP reaches librbd (thick-provisioned zeros);
// secure erase is refused at submit (EOPNOTSUPP) without a callback.
TEST_F(RbdEngine, DiscardWriteZeroesAndSecureErase) {
  auto w = pattern(3 * 65536, 3);
  ASSERT_EQ(run(IoOp::write, 0, w), 0);
  ASSERT_EQ(run(IoOp::discard, 0, {}, 0, 65536), 0);
  ASSERT_EQ(run(IoOp::write_zeroes, 65536, {}, kIoNoUnmap, 65536), 0);
  EXPECT_TRUE(fake_->last_nounmap_.load());
  ASSERT_EQ(run(IoOp::write_zeroes, 2 * 65536, {}, 0, 4096), 0);
  EXPECT_FALSE(fake_->last_nounmap_.load());
  std::vector<std::byte> r(3 * 65536);
  ASSERT_EQ(run(IoOp::read, 0, r), 0);
  EXPECT_TRUE(std::all_of(r.begin(), r.begin() + 2 * 65536 + 4096, [](std::byte b) { return b == std::byte{0}; }));
  EXPECT_TRUE(std::equal(r.begin() + 2 * 65536 + 4096, r.end(), w.begin() + 2 * 65536 + 4096));
  EXPECT_EQ(run(IoOp::secure_erase, 0, {}, 0, 4096), -EOPNOTSUPP);
}

// Case: librbd fails a stage: the write of a PREFLUSH|FUA write; then the preflush of another.
// Expect: the first ends with that errno after flush + write, no FUA flush after it; the
// second ends at its preflush, its write never started.
TEST_F(RbdEngine, AFailedStageEndsTheRequest) {
  auto w = pattern(4096, 5);
  fake_->fail_next(RbdStage::write, EIO);
  EXPECT_EQ(run(IoOp::write, 0, w, kIoPreflush | kIoFua), EIO);
  EXPECT_EQ(fake_->log(), (std::vector<RbdStage>{RbdStage::flush, RbdStage::write}));
  fake_->clear_log();
  fake_->fail_next(RbdStage::flush, ESHUTDOWN);  // e.g. this gateway was blocklisted
  EXPECT_EQ(run(IoOp::write, 0, w, kIoPreflush), ESHUTDOWN);
  EXPECT_EQ(fake_->log(), (std::vector<RbdStage>{RbdStage::flush}));
}

// Case: a read that librbd completes short (the image shrank under it).
// Expect: EIO, never a partial buffer as success.
TEST_F(RbdEngine, AShortReadIsEio) {
  fake_->short_reads(true);
  std::vector<std::byte> r(8192);
  EXPECT_EQ(run(IoOp::read, 0, r), EIO);
}

// Case: librbd refuses a stage at once (its aio call returns an error).
// Expect: submit() returns that errno, no callback ever, the slot is free again.
TEST_F(RbdEngine, AnImmediateRefusalHasNoCallback) {
  fake_->refuse_next(EINVAL);
  auto w = pattern(4096, 9);
  Done d;
  auto st = submit(IoOp::write, 0, w, d);
  EXPECT_EQ(st.error(), errc(EINVAL));
  EXPECT_EQ(engine_->in_flight(), 0u);
  engine_->wait(50ms);
  EXPECT_EQ(d.calls, 0);
  EXPECT_EQ(run(IoOp::write, 0, w), 0) << "the next request goes through";
}

// Case: a read-only image (a snapshot), and requests outside the image.
// Expect: writes, discards and write-zeroes refused with EROFS at submit; past the end EIO.
TEST_F(RbdEngine, ReadOnlyAndOutOfRangeAreRefusedAtSubmit) {
  auto ro = backend::RbdAccess::make_fake(fake_.get(), kSize, true);
  std::vector<std::byte> b(4096);
  for (IoOp op : {IoOp::write, IoOp::discard, IoOp::write_zeroes}) {
    BackendRequest r;
    r.backend = ro.get();
    r.op = op;
    r.len = 4096;
    if (op == IoOp::write) r.buf = b;
    Done d;
    r.done = &Done::fn;
    r.ctx = &d;
    EXPECT_EQ(engine_->submit(r).error(), errc(EROFS)) << static_cast<int>(op);
  }
  EXPECT_EQ(run(IoOp::read, kSize - 2048, b), -EIO);
}

// Case: 128 writes of 16 KiB in flight at once (the queue depth), completed by two threads in
// random order, then read back the same way.
// Expect: every request called back exactly once with 0, every byte where it belongs.
TEST_F(RbdEngine, AFullQueueCompletedOutOfOrder) {
  fake_->shuffle(true);
  constexpr int kN = 128;
  constexpr uint32_t kLen = 16384;
  std::vector<std::vector<std::byte>> w(kN), r(kN, std::vector<std::byte>(kLen));
  std::vector<Done> d(kN);
  fake_->hold();  // everything queued before the first completion
  for (int i = 0; i < kN; ++i) {
    w[i] = pattern(kLen, static_cast<uint8_t>(i));
    ASSERT_TRUE(submit(IoOp::write, uint64_t{kLen} * i, w[i], d[i]).ok()) << i;
  }
  Done extra;
  EXPECT_EQ(submit(IoOp::write, 0, w[0], extra).error(), errc(EAGAIN)) << "the queue depth";
  fake_->release();
  auto all_done = [&](std::vector<Done>& v) {
    const auto until = std::chrono::steady_clock::now() + 20s;
    while (std::chrono::steady_clock::now() < until &&
           !std::all_of(v.begin(), v.end(), [](const Done& x) { return x.calls > 0; }))
      engine_->wait(100ms);
    return std::all_of(v.begin(), v.end(), [](const Done& x) { return x.calls == 1 && x.err == 0; });
  };
  ASSERT_TRUE(all_done(d));
  std::vector<Done> rd(kN);
  for (int i = 0; i < kN; ++i) ASSERT_TRUE(submit(IoOp::read, uint64_t{kLen} * i, r[i], rd[i]).ok());
  ASSERT_TRUE(all_done(rd));
  for (int i = 0; i < kN; ++i) EXPECT_EQ(r[i], w[i]) << i;
  EXPECT_EQ(engine_->in_flight(), 0u);
}

// Case: the engine is destroyed while librbd still holds 16 stages (the fake releases them
// 100 ms later from its threads).
// Expect: the destructor waits for them (the buffers stay valid until then), runs no
// callback, and nothing touches the engine afterwards (ASan / TSan would say).
TEST_F(RbdEngine, DestroyWaitsForStagesInFlight) {
  fake_->hold();
  std::vector<std::vector<std::byte>> bufs(16, std::vector<std::byte>(4096));
  std::vector<Done> d(16);
  for (int i = 0; i < 16; ++i) ASSERT_TRUE(submit(IoOp::read, 4096u * i, bufs[i], d[i]).ok());
  std::thread releaser([this] {
    std::this_thread::sleep_for(100ms);
    fake_->release();
  });
  const auto t0 = std::chrono::steady_clock::now();
  engine_.reset();
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 90ms) << "it waited for the stages";
  releaser.join();
  EXPECT_EQ(fake_->completions_.load(), 16u);
  for (auto& x : d) EXPECT_EQ(x.calls, 0);
}

// Case: the eventfd: with nothing in flight the owner sleeps on it; a completion from a librbd
// thread makes it readable.
// Expect: readable once the fake completes; run_completions() then calls back.
TEST_F(RbdEngine, CompletionsWakeTheEventfd) {
  fake_->hold();
  auto w = pattern(4096, 2);
  Done d;
  ASSERT_TRUE(submit(IoOp::write, 0, w, d).ok());
  (void)engine_->run_completions();  // takes whatever signalled before
  pollfd p{engine_->event_fd(), POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 50), 0) << "nothing finished yet";
  fake_->release();
  EXPECT_EQ(::poll(&p, 1, 5000), 1);
  const auto until = std::chrono::steady_clock::now() + 5s;
  while (d.calls == 0 && std::chrono::steady_clock::now() < until) (void)engine_->run_completions();
  EXPECT_EQ(d.calls, 1);
  EXPECT_EQ(d.err, 0);
}

// Case: Backend::sync() and refresh_size() of an image.
// Expect: they reach the image (rbd_flush, rbd_get_size); take_over of a fake fences nobody.
TEST_F(RbdEngine, SyncSizeAndTakeOver) {
  EXPECT_TRUE(be_->sync().ok());
  EXPECT_EQ(fake_->syncs_.load(), 1u);
  auto s = be_->refresh_size();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, kSize);
  auto t = be_->take_over();
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(*t, "");
}

// Case: Backend::watch_size of a fake image (no librbd behind it) and with no callback.
// Expect: EOPNOTSUPP both times (the server polls such a store's size instead), and the callback
// is never called.
TEST_F(RbdEngine, WatchSizeOfAFakeIsNotSupported) {
  bool called = false;
  EXPECT_EQ(be_->watch_size([&] { called = true; }).error(), errc(EOPNOTSUPP));
  EXPECT_EQ(be_->watch_size(nullptr).error(), errc(EOPNOTSUPP));
  EXPECT_TRUE(be_->refresh_size().ok());
  EXPECT_FALSE(called);
}

}  // namespace
}  // namespace ibnbd
