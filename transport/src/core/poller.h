// A poller thread: the owner of a set of completion queues (the kernel's per-CPU IO context).
// It polls its CQs in batches and hands completions to each CQ's handler, runs timers and tasks
// posted from other threads, and sleeps on the CQs' fds (armed, verbs-style) when idle, or spins
// when busy-polling, or (PollMode::adaptive) spins for a learned while after a pass that found
// work and then sleeps (core/hybrid_poll.h). The software fabrics progress only while their CQ
// is polled, so a CQ with live connections must stay attached to a running poller.
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

#include "base/unique_fd.h"
#include "ibtrs/hybrid_poll.h"
#include "ibtrs/cpu_load.h"
#include "fabric/fabric.h"
#include "ibtrs/io_hook.h"
#include "ibtrs/result.h"
#include "ibtrs/types.h"

namespace ibtrs::core {

// Who polls a CQ right now. A CQ belongs to its poller, but a thread that waits for its own
// requests may borrow it (the client's CompletionReaper: io_uring's IOPOLL, the kernel's
// blk_poll), so that their completions run on that thread and the poller is not woken for them:
// one thread wake-up less per round trip. Exactly one holder polls, arms, acks and handles the
// CQ at a time, so the handler's state needs no lock; the state word hands it over.
//
//   free       nobody; the poller takes it for each pass over its CQs (and gives it back)
//   poller     the poller (or a task on the poller thread) is polling it
//   lent       a borrower is polling it (or waiting on its fd); the poller skips it, and its fd
//              is muted in the poller's epoll set so that its completions do not wake the poller
//   lent_idle  the borrower returned from its wait and will come back; still muted. The poller
//              takes it back (unmutes and polls it) when it stays idle for kReclaimAfter, so a
//              borrower that stops polling delays its completions by that much, and no more
//
// Transitions: free <-> poller (poller), free -> lent (borrower, then mute), lent <-> lent_idle
// (borrower), lent -> free (borrower, after unmuting), lent_idle -> poller (poller: reclaim,
// then unmute).
class CqLease {
 public:
  enum State : uint8_t { free = 0, poller = 1, lent = 2, lent_idle = 3 };
  static constexpr std::chrono::milliseconds kReclaimAfter{10};

  State state() const { return static_cast<State>(state_.load(std::memory_order_acquire)); }
  bool take(State from, State to) {
    uint8_t f = from;
    return state_.compare_exchange_strong(f, to, std::memory_order_acq_rel,
                                          std::memory_order_relaxed);
  }
  void set(State to) { state_.store(to, std::memory_order_release); }
  // Borrower: lent -> lent_idle, stamped for the poller's reclaim.
  void idle(int64_t now_ns) {
    idle_since_ns_.store(now_ns, std::memory_order_relaxed);
    state_.store(lent_idle, std::memory_order_release);
  }
  int64_t idle_since_ns() const { return idle_since_ns_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint8_t> state_{free};
  std::atomic<int64_t> idle_since_ns_{0};
};

class CqHandler {
 public:
  virtual ~CqHandler() = default;
  // A batch of completions polled from the handler's CQ (by the lease's holder).
  virtual void on_completions(std::span<fabric::Completion> wcs) = 0;
  CqLease lease;
};

// Extra work an owner drives from the poller loop (ibtrs/io_hook.h has the contract).
using PollSource = ibtrs::IoThreadHook;

// How a poller waits once its CQs are drained.
//   block     sleeps at once (armed CQs, epoll): a wake-up per request that finds it asleep
//   spin      never sleeps: a core at idle, and the CPU of the other threads on a loaded host
//   adaptive  after a pass that found CQ completions, keeps polling for a learned gap (a
//             server's next request: an EWMA of the gap between passes that found CQ
//             completions, a bit past it, within 100 us), then sleeps; sleeps at once while the
//             expected gap is beyond that (idle clients), while the CPU is contended, while
//             spins keep missing or do not pay (HybridPoll, server config)
enum class PollMode : uint8_t { block, spin, adaptive };
const char* to_string(PollMode m);

class Poller {
 public:
  using Clock = std::chrono::steady_clock;
  using Task = std::function<void()>;

  // `index` identifies the poller to its owner (the stats shard of its completions).
  static Result<std::unique_ptr<Poller>> start(std::string name, uint32_t index, PollMode mode);
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

  // Mutes (or unmutes) `cq`'s fd in this poller's epoll set: a borrower of the CQ (CqLease)
  // does so, so that the CQ's completions wake the borrower and not the poller. Any thread;
  // the caller holds the CQ's lease. A CQ no longer attached is ignored.
  void set_muted(fabric::CompletionQueue* cq, bool muted);
  // Poller thread (a task): waits until the CQ's lease is the poller's (a borrower that is
  // waiting must have been told to give it back), reclaiming it from an idle borrower at once.
  // The task releases it with handler->lease.set(CqLease::free) when done.
  void seize(fabric::CompletionQueue* cq, CqHandler* handler);

  // Poller thread only.
  void attach(fabric::CompletionQueue* cq, CqHandler* handler);
  void detach(fabric::CompletionQueue* cq);
  void add_source(PollSource* s);
  void remove_source(PollSource* s);

  // How this poller waited so far (any thread; the counters are relaxed, each one exact).
  IoThreadWaitStats wait_stats() const;

  bool on_thread() const { return std::this_thread::get_id() == thread_.get_id(); }
  uint32_t index() const { return index_; }
  const std::string& name() const { return name_; }

 private:
  Poller(std::string name, uint32_t index, PollMode mode, base::UniqueFd epfd, base::UniqueFd evfd);
  void loop();
  void run_tasks();
  Clock::time_point run_timers();
  // Returns the CQ completions its last look before sleeping found (it returns at once when
  // that finds anything, source work included); 0 when it slept.
  size_t sleep_until(Clock::time_point deadline);
  // Adaptive mode (poller thread): work found by the pass that started at `t` ends the wait in
  // progress; a wait begins after each pass that found work.
  void end_wait(Clock::time_point t);
  void begin_wait(Clock::time_point now);
  void wake();
  struct Entry {
    fabric::CompletionQueue* cq;
    CqHandler* handler;
  };
  // The lease of `e` for one pass, reclaiming it from a borrower idle for kReclaimAfter.
  bool take(const Entry& e, Clock::time_point now);
  struct Timer {
    Clock::time_point when;
    uint64_t id;
    Task task;
  };

  const std::string name_;
  const uint32_t index_;
  const PollMode mode_;
  const base::UniqueFd epfd_;
  const base::UniqueFd evfd_;
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

  // Adaptive mode, poller thread only.
  HybridPoll policy_{HybridPollConfig::server()};
  WaitPlan plan_;
  bool waiting_ = false;   // a wait planned after a pass with work is in progress
  bool spinning_ = false;  // ... and it spins until spin_end_
  bool preempted_ = false;
  Clock::time_point wait_start_{};
  Clock::time_point spin_end_{};
  Clock::time_point last_spin_{};  // the previous spin iteration (preemption)
  Clock::time_point cycle_start_{};  // the end of the previous wait (time per completion)
  size_t cycle_n_ = 0;               // completions since then
  std::unique_ptr<CpuLoadSampler> load_;  // the run queue and CPU pressure (adaptive mode)
  // Statistics (written by the poller thread, read by wait_stats()).
  std::atomic<uint64_t> st_waits_{0}, st_caught_{0}, st_missed_{0}, st_preempted_{0}, st_sleeps_{0};
  std::atomic<uint64_t> st_blocked_[kBlockReasons] = {};
  std::atomic<int64_t> st_expected_{0};
};

}  // namespace ibtrs::core
