// The block server's control thread: OPEN and CLOSE (they touch the filesystem), admin actions and
// session ends run here one at a time, so the open table needs no lock. It also runs one
// periodic task (every()): the server's size check of its open devices.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <type_traits>

namespace ibnbd::server {

class ControlThread {
 public:
  ControlThread() : thread_([this] { loop(); }) {}
  ~ControlThread() { stop(); }
  ControlThread(const ControlThread&) = delete;
  ControlThread& operator=(const ControlThread&) = delete;

  // Any thread. Tasks posted after stop() are dropped.
  void post(std::function<void()> t) {
    {
      std::lock_guard l(mu_);
      if (stopping_) return;
      q_.push_back(std::move(t));
    }
    cv_.notify_one();
  }
  // Runs `f` on the control thread and returns its result (inline when already on it).
  template <typename F>
  auto call(F&& f) -> std::invoke_result_t<F> {
    if (std::this_thread::get_id() == thread_.get_id()) return f();
    std::packaged_task<std::invoke_result_t<F>()> task(std::forward<F>(f));
    auto fut = task.get_future();
    post([&task] { task(); });
    return fut.get();
  }
  // Runs `f` on the thread every `period` (the first time one period from now), between tasks:
  // a stream of tasks delays it by one task at most. Once; before stop().
  void every(std::chrono::milliseconds period, std::function<void()> f) {
    {
      std::lock_guard l(mu_);
      tick_period_ = period;
      tick_ = std::move(f);
      next_tick_ = Clock::now() + period;
    }
    cv_.notify_one();
  }
  // Runs what is queued, then ends the thread (the periodic task no more).
  void stop() {
    {
      std::lock_guard l(mu_);
      stopping_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  using Clock = std::chrono::steady_clock;

  void loop() {
    std::unique_lock l(mu_);
    for (;;) {
      if (tick_ && !stopping_ && Clock::now() >= next_tick_) {
        next_tick_ = Clock::now() + tick_period_;
        l.unlock();
        tick_();  // set once and never changed: safe to call without the lock
        l.lock();
        continue;
      }
      if (!q_.empty()) {
        auto t = std::move(q_.front());
        q_.pop_front();
        l.unlock();
        t();
        l.lock();
        continue;
      }
      if (stopping_) return;
      // Woken by post(), every() and stop(); whatever woke it is looked at above.
      if (tick_) {
        cv_.wait_until(l, next_tick_);
      } else {
        cv_.wait(l);
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  bool stopping_ = false;
  std::function<void()> tick_;
  std::chrono::milliseconds tick_period_{0};
  Clock::time_point next_tick_{};
  std::thread thread_;
};

}  // namespace ibnbd::server
