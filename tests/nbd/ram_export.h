// A RAM export for the NBD server's tests: the data in memory, completions inline or from a
// worker thread (held and released in any order, to force out-of-order replies), an error
// injector, and counters of what the server asked for.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include <sys/eventfd.h>
#include <unistd.h>

#include "ibnbd/nbd_server.h"

namespace ibnbd::nbd::test {

class RamExport final : public Export {
 public:
  // async: completions run on a worker thread (as the client library's run on transport
  // threads); otherwise inside the submitting call.
  RamExport(uint64_t size, bool async) : data_(size), async_(async) {
    info_.size = size;
    info_.can_trim = info_.can_write_zeroes = info_.fast_zero = true;
    info_.multi_conn = true;
    info_.description = "ram";
    if (async_) worker_ = std::thread([this] { work(); });
  }
  ~RamExport() override {
    {
      std::lock_guard l(mu_);
      held_ = false;
      quit_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
    if (efd_ >= 0) ::close(efd_);
  }

  // Lends `bytes` of request memory to the server (call before it starts): READ / WRITE data
  // inside it and outside it are counted.
  void lend(size_t bytes) { mem_.resize(bytes); }
  std::span<std::byte> request_memory() override { return {mem_.data(), mem_.size()}; }
  std::atomic<int> in_memory{0}, outside_memory{0};

  // Polled completions (async exports): attach_loop() gives an eventfd, and the worker's
  // completions wait on a list that poll_loop() runs on the loop thread -- except every
  // `remote_every`-th (0: none), which runs on the worker as before.
  void polled(int remote_every = 0) {
    polled_ = true;
    remote_every_ = remote_every;
  }
  int attach_loop() override {
    if (!polled_) return -1;
    loop_ = std::this_thread::get_id();
    efd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    return efd_;
  }
  void poll_loop() override {
    if (efd_ < 0) return;
    uint64_t v;
    [[maybe_unused]] ssize_t r = ::read(efd_, &v, sizeof(v));
    std::vector<std::pair<Done, int>> ready;
    {
      std::lock_guard l(mu_);
      ready.swap(ready_);
    }
    for (auto [d, e] : ready) {
      if (std::this_thread::get_id() != loop_) ++off_loop;
      ++polled_done;
      d.fn(d.ctx, e);
    }
  }
  void detach_loop() override { ++detached; }
  std::atomic<int> polled_done{0}, off_loop{0}, detached{0};

  ExportInfo info() const override {
    std::lock_guard l(mu_);
    return info_;
  }
  void set_info(const ExportInfo& i) {
    std::scoped_lock l(mu_, data_mu_);
    info_ = i;
    data_.resize(i.size);
  }

  Status read(uint64_t off, std::span<std::byte> out, Done d) override {
    count(out.data(), out.size());
    if (int e = take_fail()) return ibtrs::errc(e);
    return run([=, this] {
      std::memcpy(out.data(), data_.data() + off, out.size());
      return 0;
    }, d);
  }
  Status write(uint64_t off, std::span<const std::byte> in, bool fua, Done d) override {
    count(in.data(), in.size());
    if (int e = take_fail()) return ibtrs::errc(e);
    if (fua) ++fua_writes;
    return run([=, this] {
      std::memcpy(data_.data() + off, in.data(), in.size());
      return 0;
    }, d);
  }
  Status flush(Done d) override {
    ++flushes;
    return run([] { return 0; }, d);
  }
  Status trim(uint64_t off, uint64_t len, Done d) override {
    ++trims;
    return run([=, this] {
      std::fill_n(data_.data() + off, len, std::byte{0});
      return 0;
    }, d);
  }
  Status write_zeroes(uint64_t off, uint64_t len, bool no_hole, Done d) override {
    ++zeroes;
    if (no_hole) ++no_hole_zeroes;
    return run([=, this] {
      std::fill_n(data_.data() + off, len, std::byte{0});
      return 0;
    }, d);
  }

  // BLOCK_STATUS from `layout` (extents from offset 0 over the whole device; set before the
  // server starts); empty: the default answer (all data). The last question asked is kept.
  std::vector<Extent> layout;
  std::atomic<uint64_t> status_offset{0}, status_len{0};
  Status block_status(uint64_t off, uint64_t len, ExtentList& out, Done d) override {
    if (layout.empty()) return Export::block_status(off, len, out, d);
    status_offset = off;
    status_len = len;
    return run([=, this, &out] {
      out.count = 0;
      uint64_t pos = 0;
      for (const Extent& e : layout) {
        const uint64_t from = std::max(pos, off), to = std::min(pos + e.length, off + len);
        if (from < to && out.count < kMaxExtents) out.e[out.count++] = Extent{to - from, e.flags};
        pos += e.length;
      }
      return 0;
    }, d);
  }

  // The next submitted op returns `e` (0: off); async_error: the next op completes with it.
  void fail_next(int e) { fail_.store(e); }
  void fail_next_completion(int e) { fail_done_.store(e); }
  // Hold async completions until release() (reverse: newest first).
  void hold() {
    std::lock_guard l(mu_);
    held_ = true;
  }
  void release(bool reverse) {
    {
      std::lock_guard l(mu_);
      held_ = false;
      if (reverse) std::reverse(queue_.begin(), queue_.end());
    }
    cv_.notify_all();
  }
  size_t queued() const {
    std::lock_guard l(mu_);
    return queue_.size();
  }
  // The data as it is now (under the lock the ops take, so TSan sees the order).
  std::vector<std::byte> snapshot() const {
    std::lock_guard l(data_mu_);
    return data_;
  }
  void fill(std::byte b) {
    std::lock_guard l(data_mu_);
    std::fill(data_.begin(), data_.end(), b);
  }

  std::atomic<int> flushes{0}, trims{0}, zeroes{0}, no_hole_zeroes{0}, fua_writes{0};

 private:
  int take_fail() { return fail_.exchange(0); }
  void count(const std::byte* p, size_t n) {
    const bool in = !mem_.empty() && p >= mem_.data() && p + n <= mem_.data() + mem_.size();
    ++(in ? in_memory : outside_memory);
  }
  Status run(std::function<int()> op, Done d) {
    if (!async_) {
      int e = locked(op);
      if (int f = fail_done_.exchange(0)) e = f;
      d.fn(d.ctx, e);
      return {};
    }
    {
      std::lock_guard l(mu_);
      queue_.push_back({std::move(op), d});
    }
    cv_.notify_all();
    return {};
  }
  int locked(const std::function<int()>& op) {
    std::lock_guard l(data_mu_);
    return op();
  }
  void work() {
    std::unique_lock l(mu_);
    for (;;) {
      cv_.wait(l, [&] { return quit_ || (!held_ && !queue_.empty()); });
      if (queue_.empty() && quit_) return;
      auto [op, d] = std::move(queue_.front());
      queue_.pop_front();
      l.unlock();
      int e = locked(op);
      if (int f = fail_done_.exchange(0)) e = f;
      if (polled_ && (remote_every_ == 0 || ++nth_ % remote_every_ != 0)) {
        l.lock();
        ready_.emplace_back(d, e);
        const uint64_t one = 1;
        [[maybe_unused]] ssize_t r = ::write(efd_, &one, sizeof(one));
        continue;
      }
      d.fn(d.ctx, e);
      l.lock();
    }
  }

  mutable std::mutex mu_;
  mutable std::mutex data_mu_;
  std::condition_variable cv_;
  ExportInfo info_;
  std::vector<std::byte> data_;
  bool async_;
  bool held_ = false, quit_ = false;
  std::deque<std::pair<std::function<int()>, Done>> queue_;
  std::atomic<int> fail_{0}, fail_done_{0};
  std::vector<std::byte> mem_;
  bool polled_ = false;
  int remote_every_ = 0, nth_ = 0;
  int efd_ = -1;
  std::thread::id loop_;
  std::vector<std::pair<Done, int>> ready_;  // under mu_
  std::thread worker_;
};

}  // namespace ibnbd::nbd::test
