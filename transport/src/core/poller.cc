#include "core/poller.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <future>
#include <utility>
#include <thread>

namespace ibtrs::core {

namespace {
constexpr size_t kBatch = 32;  // completions per poll() call
// An idle poller still wakes this often, so timers added without a wake-up are never late by
// more than this (they always wake it, but the bound keeps a lost wake-up harmless).
constexpr auto kMaxSleep = std::chrono::milliseconds(100);
// epoll tag of a PollSource's fd (CQs are tagged by their pointer, the wake-up eventfd by 0):
// nothing to acknowledge, the source's own poll() consumes its fd.
constexpr uint64_t kSourceTag = 1;

int64_t steady_ns(Poller::Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// The statistics have one writer, the poller thread: a plain add, no locked instruction.
void bump(std::atomic<uint64_t>& c) { c.store(c.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed); }

}  // namespace

const char* to_string(PollMode m) {
  switch (m) {
    case PollMode::block: return "block";
    case PollMode::spin: return "spin";
    case PollMode::adaptive: return "adaptive";
  }
  return "?";
}

Result<std::unique_ptr<Poller>> Poller::start(std::string name, uint32_t index, PollMode mode) {
  base::UniqueFd epfd(::epoll_create1(EPOLL_CLOEXEC));
  if (!epfd) return errc(errno);
  base::UniqueFd evfd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!evfd) return errc(errno);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;  // the wake-up eventfd
  if (::epoll_ctl(epfd.get(), EPOLL_CTL_ADD, evfd.get(), &ev) != 0) return errc(errno);
  std::unique_ptr<Poller> p(new Poller(std::move(name), index, mode, std::move(epfd), std::move(evfd)));
  // Without its files the policy still backs off on preempted and missed spins.
  if (mode == PollMode::adaptive) p->load_ = std::make_unique<CpuLoadSampler>();
  p->thread_ = std::thread([raw = p.get()] { raw->loop(); });
  return p;
}

Poller::Poller(std::string name, uint32_t index, PollMode mode, base::UniqueFd epfd,
               base::UniqueFd evfd)
    : name_(std::move(name)), index_(index), mode_(mode), epfd_(std::move(epfd)),
      evfd_(std::move(evfd)) {}

Poller::~Poller() {
  stop_.store(true, std::memory_order_seq_cst);
  wake();
  if (thread_.joinable()) thread_.join();
  // epfd_ and evfd_ close with the members, after the thread that waits on them has ended.
}

IoThreadWaitStats Poller::wait_stats() const {
  IoThreadWaitStats w;
  w.thread = index_;
  w.mode = to_string(mode_);
  w.waits = st_waits_.load(std::memory_order_relaxed);
  w.spins_caught = st_caught_.load(std::memory_order_relaxed);
  w.spins_missed = st_missed_.load(std::memory_order_relaxed);
  w.spins_preempted = st_preempted_.load(std::memory_order_relaxed);
  w.sleeps = st_sleeps_.load(std::memory_order_relaxed);
  for (int r = 1; r < kBlockReasons; ++r)
    w.blocked.emplace_back(kBlockReasonNames[r], st_blocked_[r].load(std::memory_order_relaxed));
  w.expected_gap_ns = st_expected_.load(std::memory_order_relaxed);
  return w;
}

void Poller::wake() {
  if (!sleeping_.load(std::memory_order_seq_cst)) return;
  uint64_t one = 1;
  [[maybe_unused]] ssize_t r = ::write(evfd_.get(), &one, sizeof(one));
}

void Poller::post(Task t) {
  {
    std::lock_guard lock(mu_);
    tasks_.push_back(std::move(t));
  }
  pending_.store(true, std::memory_order_seq_cst);
  wake();
}

void Poller::run_sync(const Task& t) {
  if (on_thread()) {
    t();
    return;
  }
  std::promise<void> done;
  post([&] {
    t();
    done.set_value();
  });
  done.get_future().wait();
}

uint64_t Poller::add_timer(Clock::time_point when, Task t) {
  uint64_t id;
  {
    std::lock_guard lock(mu_);
    id = next_timer_++;
    timers_.push_back(Timer{when, id, std::move(t)});
  }
  pending_.store(true, std::memory_order_seq_cst);
  wake();
  return id;
}

void Poller::cancel_timer(uint64_t id) {
  std::lock_guard lock(mu_);
  auto it = std::find_if(timers_.begin(), timers_.end(), [&](const Timer& t) { return t.id == id; });
  if (it != timers_.end()) timers_.erase(it);
}

void Poller::set_muted(fabric::CompletionQueue* cq, bool muted) {
  epoll_event ev{};
  ev.events = muted ? 0u : static_cast<uint32_t>(EPOLLIN);
  ev.data.ptr = cq;
  ::epoll_ctl(epfd_.get(), EPOLL_CTL_MOD, cq->fd(), &ev);  // ENOENT: detached meanwhile, nothing to do
}

bool Poller::take(const Entry& e, Clock::time_point now) {
  CqLease& l = e.handler->lease;
  if (l.take(CqLease::free, CqLease::poller)) return true;
  if (l.state() != CqLease::lent_idle) return false;
  const auto idle_ns = now.time_since_epoch().count() - l.idle_since_ns();
  if (idle_ns < std::chrono::nanoseconds(CqLease::kReclaimAfter).count() ||
      !l.take(CqLease::lent_idle, CqLease::poller))
    return false;
  set_muted(e.cq, false);  // ours again: its completions wake us
  return true;
}

void Poller::seize(fabric::CompletionQueue* cq, CqHandler* handler) {
  CqLease& l = handler->lease;
  for (;;) {
    if (l.take(CqLease::free, CqLease::poller)) return;
    if (l.take(CqLease::lent_idle, CqLease::poller)) {
      set_muted(cq, false);
      return;
    }
    // poller: only this thread takes that, and not while a task runs; lent: the borrower was
    // told to give it back and does so as soon as its wait returns.
    std::this_thread::yield();
  }
}

void Poller::attach(fabric::CompletionQueue* cq, CqHandler* handler) {
  cqs_.push_back(Entry{cq, handler});
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = cq;
  ::epoll_ctl(epfd_.get(), EPOLL_CTL_ADD, cq->fd(), &ev);
}

void Poller::detach(fabric::CompletionQueue* cq) {
  ::epoll_ctl(epfd_.get(), EPOLL_CTL_DEL, cq->fd(), nullptr);
  std::erase_if(cqs_, [&](const Entry& e) { return e.cq == cq; });
}

void Poller::add_source(PollSource* s) {
  sources_.push_back(s);
  if (s->fd() < 0) return;
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kSourceTag;
  ::epoll_ctl(epfd_.get(), EPOLL_CTL_ADD, s->fd(), &ev);
}

void Poller::remove_source(PollSource* s) {
  if (s->fd() >= 0) ::epoll_ctl(epfd_.get(), EPOLL_CTL_DEL, s->fd(), nullptr);
  std::erase(sources_, s);
}

size_t Poller::poll_sources() {
  size_t n = 0;
  for (PollSource* s : sources_) n += s->poll();
  return n;
}

void Poller::flush_sources() {
  for (PollSource* s : sources_) s->flush();
}

void Poller::run_tasks() {
  std::vector<Task> tasks;
  {
    std::lock_guard lock(mu_);
    tasks.swap(tasks_);
  }
  for (auto& t : tasks) t();
}

Poller::Clock::time_point Poller::run_timers() {
  const auto now = Clock::now();
  for (;;) {
    Task due;
    Clock::time_point next = now + kMaxSleep;
    {
      std::lock_guard lock(mu_);
      auto it = std::min_element(timers_.begin(), timers_.end(),
                                 [](const Timer& a, const Timer& b) { return a.when < b.when; });
      if (it == timers_.end()) return next;
      if (it->when > now) return std::min(next, it->when);
      due = std::move(it->task);
      timers_.erase(it);
    }
    due();
  }
}

size_t Poller::sleep_until(Clock::time_point deadline) {
  // Verbs protocol: arm, poll again to close the race, then wait on the fds.
  // CQs lent to a borrower are its to arm and poll (and muted here); one idle long enough is
  // reclaimed by take(), so while any is lent the sleep is short enough to notice.
  const auto now = Clock::now();
  fabric::Completion wcs[kBatch];
  size_t got = 0;
  bool lent = false;
  for (auto& e : cqs_) {
    if (!take(e, now)) {
      lent = true;
      continue;
    }
    (void)e.cq->arm();
    size_t n = e.cq->poll(std::span(wcs, kBatch));
    if (n > 0) {
      e.handler->on_completions(std::span(wcs, n));
      got += n;
    }
    e.handler->lease.set(CqLease::free);
  }
  if (lent) deadline = std::min(deadline, now + CqLease::kReclaimAfter);
  const size_t src = poll_sources();
  flush_sources();
  if (got + src > 0) return got;
  sleeping_.store(true, std::memory_order_seq_cst);
  if (pending_.load(std::memory_order_seq_cst) || stop_.load(std::memory_order_seq_cst)) {
    sleeping_.store(false, std::memory_order_seq_cst);
    return 0;
  }
  bump(st_sleeps_);
  auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
  int ms = static_cast<int>(std::clamp<int64_t>(left.count(), 0, kMaxSleep.count()));
  epoll_event evs[16];
  int k = ::epoll_wait(epfd_.get(), evs, 16, ms);
  sleeping_.store(false, std::memory_order_seq_cst);
  for (int i = 0; i < k; ++i) {
    if (evs[i].data.ptr == nullptr) {
      uint64_t v;
      [[maybe_unused]] ssize_t r = ::read(evfd_.get(), &v, sizeof(v));
      continue;
    }
    if (evs[i].data.u64 == kSourceTag) continue;
    // A CQ lent since the wait returned is acked by its borrower.
    auto* cq = static_cast<fabric::CompletionQueue*>(evs[i].data.ptr);
    for (auto& e : cqs_) {
      if (e.cq != cq) continue;
      if (e.handler->lease.take(CqLease::free, CqLease::poller)) {
        cq->ack_events();
        e.handler->lease.set(CqLease::free);
      }
      break;
    }
  }
  return 0;
}

void Poller::end_wait(Clock::time_point t) {
  if (!waiting_) {
    cycle_start_ = t;
    cycle_n_ = 0;
    return;
  }
  waiting_ = false;
  WaitOutcome o;
  o.end = spinning_ ? WaitEnd::spun : WaitEnd::blocked;
  o.wait_ns = steady_ns(t) - steady_ns(wait_start_);
  o.preempted = preempted_;
  // Time per completion of the cycle, from busy periods only: an idle gap says nothing of what
  // spinning costs.
  if (cycle_n_ > 0 && o.wait_ns <= 2 * HybridPollConfig::server().max_spin_ns)
    o.cost_ns = (steady_ns(t) - steady_ns(cycle_start_)) / static_cast<int64_t>(cycle_n_);
  if (plan_.hybrid()) bump(spinning_ ? st_caught_ : st_missed_);
  if (preempted_) bump(st_preempted_);
  spinning_ = false;
  policy_.record(plan_, o, steady_ns(t));
  st_expected_.store(policy_.expected_ns(), std::memory_order_relaxed);
  cycle_start_ = t;
  cycle_n_ = 0;
}

void Poller::begin_wait(Clock::time_point now) {
  load_->maybe_sample(steady_ns(now), policy_);
  plan_ = policy_.plan(steady_ns(now));
  waiting_ = true;
  wait_start_ = now;
  preempted_ = false;
  spinning_ = plan_.hybrid();
  if (spinning_) {
    spin_end_ = now + std::chrono::nanoseconds(plan_.spin_ns);
    last_spin_ = now;
  }
  bump(st_waits_);
  bump(st_blocked_[static_cast<int>(policy_.last_reason())]);
}

void Poller::loop() {
  fabric::Completion wcs[kBatch];
  Clock::time_point next_timer = Clock::now();
  const bool adaptive = mode_ == PollMode::adaptive;
  const int64_t preempt_gap_ns = HybridPollConfig::server().preempt_gap_ns;
  size_t carried = 0;  // work sleep_until()'s last look found (it handled it)
  while (!stop_.load(std::memory_order_relaxed)) {
    if (pending_.exchange(false, std::memory_order_seq_cst)) {
      run_tasks();
      next_timer = Clock::now();  // a timer may have been added: look again
    }
    if (Clock::now() >= next_timer) next_timer = run_timers();
    size_t total = 0;
    bool full = false;  // a CQ filled the batch: more may be queued behind it
    const auto now = Clock::now();
    for (size_t i = 0; i < cqs_.size(); ++i) {
      auto& e = cqs_[i];
      if (!take(e, now)) continue;  // lent to a borrower
      size_t n = e.cq->poll(std::span(wcs, kBatch));
      if (n > 0) {
        e.handler->on_completions(std::span(wcs, n));
        total += n;
        full = full || n == kBatch;
      }
      e.handler->lease.set(CqLease::free);
    }
    const size_t cq_total = total;
    if (!sources_.empty()) {
      total += poll_sources();
      flush_sources();
    }
    if (adaptive) {
      // A wait begins after a pass that found completions on the CQs (a request, at QD1) and
      // ends with the next pass that does, whether it spun or slept meanwhile. The sources'
      // work (the backend's IO completions) neither ends nor starts one: it falls inside the
      // gap, which a spin covers whole, and counting it would mix its short gaps with the
      // requests' long ones (each catch of an IO completion would hide a request's miss).
      const size_t found = cq_total + std::exchange(carried, 0);
      if (found > 0) {
        end_wait(now);
        cycle_n_ += found;
        if (!full) begin_wait(Clock::now());
      }
      if (spinning_ && !full) {
        const auto t = Clock::now();
        if (t - last_spin_ > std::chrono::nanoseconds(preempt_gap_ns)) preempted_ = true;
        last_spin_ = t;
        if (t < spin_end_) continue;  // poll again: the next request is expected soon
        spinning_ = false;            // the budget ran out: the wait ends blocked
      }
    }
    if (full || mode_ == PollMode::spin) continue;
    // Drained: sleep_until() arms and polls once more before it sleeps, and comes back at once
    // if that finds anything, so a second pass here would only poll an empty CQ once more (on
    // tcp a readv per round trip, measured at QD1).
    carried = sleep_until(next_timer);
  }
  // Leftover tasks run so that run_sync callers never hang on a stopping poller.
  run_tasks();
}

}  // namespace ibtrs::core
