// A control thread with a task queue: path establishment, teardown and user control operations
// run here one at a time, so they never race with each other and may block (connect, drain)
// without stalling an IO thread.
// Thread-safety: post() and call() from any thread; call() must not be used from the worker
// itself (it would wait for itself: it runs the task inline instead).
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

namespace ibtrs::core {

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

  bool on_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

  // Runs what is queued, then stops. Idempotent.
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
  void loop() {
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      auto t = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      t();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace ibtrs::core
