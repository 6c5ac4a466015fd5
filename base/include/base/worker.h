// A control thread with a task queue: the tasks run here one at a time, so they never race with
// each other and may block (connect, drain, open a file) without stalling an IO thread. Users:
// the IBTRS client session (path establishment, teardown, user control operations), the IBTRS
// server (session teardown) and the block server (OPEN/CLOSE, admin actions, the periodic size
// check through every()).
// Thread-safety: post(), call() and every() from any thread; call() on the worker itself runs
// the task inline (it would otherwise wait for itself). Tasks posted after stop() are dropped.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

namespace base {

class Worker {
 public:
  Worker() : thread_([this] { loop(); }) {}
  ~Worker() { stop(); }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void post(std::function<void()> t) {
    {
      std::lock_guard lock(mu_);
      if (stopping_) return;
      tasks_.push_back(std::move(t));
    }
    cv_.notify_one();
  }

  // Runs `fn` on the worker and returns its result.
  template <typename Fn>
  auto call(Fn fn) -> decltype(fn()) {
    using R = decltype(fn());
    if (on_thread()) return fn();
    std::packaged_task<R()> task(std::move(fn));
    auto fut = task.get_future();
    {
      std::lock_guard lock(mu_);
      tasks_.push_back([&task] { task(); });
    }
    cv_.notify_one();
    return fut.get();
  }

  // Runs `f` on the worker every `period` (the first time one period from now), between tasks:
  // a stream of tasks delays it by one task at most. Once; before stop().
  void every(std::chrono::milliseconds period, std::function<void()> f) {
    {
      std::lock_guard lock(mu_);
      tick_period_ = period;
      tick_ = std::move(f);
      next_tick_ = Clock::now() + period;
    }
    cv_.notify_one();
  }

  bool on_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

  // Runs what is queued, then stops (the periodic task no more). Idempotent.
  void stop() {
    {
      std::lock_guard lock(mu_);
      if (stopping_ && !thread_.joinable()) return;
      stopping_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable() && !on_thread()) thread_.join();
  }

 private:
  using Clock = std::chrono::steady_clock;

  void loop() {
    std::unique_lock lock(mu_);
    for (;;) {
      if (tick_ && !stopping_ && Clock::now() >= next_tick_) {
        next_tick_ = Clock::now() + tick_period_;
        lock.unlock();
        tick_();  // set once and never changed: safe to call without the lock
        lock.lock();
        continue;
      }
      if (!tasks_.empty()) {
        auto t = std::move(tasks_.front());
        tasks_.pop_front();
        lock.unlock();
        t();
        lock.lock();
        continue;
      }
      if (stopping_) return;
      // Woken by post(), every() and stop(); whatever woke it is looked at above.
      if (tick_) {
        cv_.wait_until(lock, next_tick_);
      } else {
        cv_.wait(lock);
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::function<void()> tick_;
  std::chrono::milliseconds tick_period_{0};
  Clock::time_point next_tick_{};
  std::thread thread_;
};

}  // namespace base
