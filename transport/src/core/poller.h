// A poller thread: the owner of a set of completion queues (the kernel's per-CPU IO context).
// It polls its CQs in batches and hands completions to each CQ's handler, runs timers and tasks
// posted from other threads, and sleeps on the CQs' fds (armed, verbs-style) when idle, or spins
// when busy-polling. The software fabrics progress only while their CQ is polled, so a CQ with
// live connections must stay attached to a running poller.
//
// Threading: post(), run_sync(), add_timer(), cancel_timer() from any thread. Handlers, tasks
// and timers run on the poller thread and must not block. attach()/detach() only on the poller
// thread (use run_sync from elsewhere).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "fabric/fabric.h"
#include "ibtrs/io_hook.h"
#include "ibtrs/result.h"

namespace ibtrs::core {

class CqHandler {
 public:
  virtual ~CqHandler() = default;
  // A batch of completions polled from the handler's CQ.
  virtual void on_completions(std::span<fabric::Completion> wcs) = 0;
};

// Extra work an owner drives from the poller loop (ibtrs/io_hook.h has the contract).
using PollSource = ibtrs::IoThreadHook;

class Poller {
 public:
  using Clock = std::chrono::steady_clock;
  using Task = std::function<void()>;

  // `index` identifies the poller to its owner (the stats shard of its completions).
  static Result<std::unique_ptr<Poller>> start(std::string name, uint32_t index, bool busy_poll);
  // Stops the thread. Every CQ must be detached by then.
  ~Poller();
  Poller(const Poller&) = delete;
  Poller& operator=(const Poller&) = delete;

  void post(Task t);
  // Runs `t` on the poller thread and returns when it ran (inline when called on it).
  void run_sync(const Task& t);

  // Calls `t` on the poller thread at `when` (or soon after). Returns an id for cancel_timer().
  uint64_t add_timer(Clock::time_point when, Task t);
  void cancel_timer(uint64_t id);

  // Poller thread only.
  void attach(fabric::CompletionQueue* cq, CqHandler* handler);
  void detach(fabric::CompletionQueue* cq);
  void add_source(PollSource* s);
  void remove_source(PollSource* s);

  bool on_thread() const { return std::this_thread::get_id() == thread_.get_id(); }
  uint32_t index() const { return index_; }
  const std::string& name() const { return name_; }

 private:
  Poller(std::string name, uint32_t index, bool busy_poll, int epfd, int evfd);
  void loop();
  void run_tasks();
  Clock::time_point run_timers();
  void sleep_until(Clock::time_point deadline);
  void wake();

  struct Entry {
    fabric::CompletionQueue* cq;
    CqHandler* handler;
  };
  struct Timer {
    Clock::time_point when;
    uint64_t id;
    Task task;
  };

  const std::string name_;
  const uint32_t index_;
  const bool busy_;
  const int epfd_;
  const int evfd_;
  std::vector<Entry> cqs_;  // poller thread only
  std::vector<PollSource*> sources_;  // poller thread only
  size_t poll_sources();
  void flush_sources();
  std::mutex mu_;           // tasks and timers
  std::vector<Task> tasks_;
  std::vector<Timer> timers_;  // a heap on `when`
  uint64_t next_timer_ = 1;
  std::atomic<bool> pending_{false};  // tasks or a new earliest timer
  std::atomic<bool> sleeping_{false};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace ibtrs::core
