// The block server's control thread: OPEN and CLOSE (they touch the filesystem), admin actions and
// session ends run here one at a time, so the open table needs no lock.
#pragma once

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
  // Runs what is queued, then ends the thread.
  void stop() {
    {
      std::lock_guard l(mu_);
      stopping_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void loop() {
    std::unique_lock l(mu_);
    for (;;) {
      cv_.wait(l, [&] { return stopping_ || !q_.empty(); });
      if (q_.empty()) return;
      auto t = std::move(q_.front());
      q_.pop_front();
      l.unlock();
      t();
      l.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace ibnbd::server
