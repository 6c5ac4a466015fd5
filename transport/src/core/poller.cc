#include "core/poller.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <future>
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
}  // namespace

Result<std::unique_ptr<Poller>> Poller::start(std::string name, uint32_t index, bool busy_poll) {
  int epfd = ::epoll_create1(EPOLL_CLOEXEC);
  if (epfd < 0) return errc(errno);
  int evfd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (evfd < 0) {
    int e = errno;
    ::close(epfd);
    return errc(e);
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;  // the wake-up eventfd
  if (::epoll_ctl(epfd, EPOLL_CTL_ADD, evfd, &ev) != 0) {
    int e = errno;
    ::close(epfd);
    ::close(evfd);
    return errc(e);
  }
  std::unique_ptr<Poller> p(new Poller(std::move(name), index, busy_poll, epfd, evfd));
  p->thread_ = std::thread([raw = p.get()] { raw->loop(); });
  return p;
}

Poller::Poller(std::string name, uint32_t index, bool busy_poll, int epfd, int evfd)
    : name_(std::move(name)), index_(index), busy_(busy_poll), epfd_(epfd), evfd_(evfd) {}

Poller::~Poller() {
  stop_.store(true, std::memory_order_seq_cst);
  wake();
  if (thread_.joinable()) thread_.join();
  ::close(epfd_);
  ::close(evfd_);
}

void Poller::wake() {
  if (!sleeping_.load(std::memory_order_seq_cst)) return;
  uint64_t one = 1;
  [[maybe_unused]] ssize_t r = ::write(evfd_, &one, sizeof(one));
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
  ::epoll_ctl(epfd_, EPOLL_CTL_MOD, cq->fd(), &ev);  // ENOENT: detached meanwhile, nothing to do
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
  ::epoll_ctl(epfd_, EPOLL_CTL_ADD, cq->fd(), &ev);
}

void Poller::detach(fabric::CompletionQueue* cq) {
  ::epoll_ctl(epfd_, EPOLL_CTL_DEL, cq->fd(), nullptr);
  std::erase_if(cqs_, [&](const Entry& e) { return e.cq == cq; });
}

void Poller::add_source(PollSource* s) {
  sources_.push_back(s);
  if (s->fd() < 0) return;
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kSourceTag;
  ::epoll_ctl(epfd_, EPOLL_CTL_ADD, s->fd(), &ev);
}

void Poller::remove_source(PollSource* s) {
  if (s->fd() >= 0) ::epoll_ctl(epfd_, EPOLL_CTL_DEL, s->fd(), nullptr);
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

void Poller::sleep_until(Clock::time_point deadline) {
  // Verbs protocol: arm, poll again to close the race, then wait on the fds.
  // CQs lent to a borrower are its to arm and poll (and muted here); one idle long enough is
  // reclaimed by take(), so while any is lent the sleep is short enough to notice.
  const auto now = Clock::now();
  fabric::Completion wcs[kBatch];
  bool got = false;
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
      got = true;
    }
    e.handler->lease.set(CqLease::free);
  }
  if (lent) deadline = std::min(deadline, now + CqLease::kReclaimAfter);
  if (poll_sources() > 0) got = true;
  flush_sources();
  if (got) return;
  sleeping_.store(true, std::memory_order_seq_cst);
  if (pending_.load(std::memory_order_seq_cst) || stop_.load(std::memory_order_seq_cst)) {
    sleeping_.store(false, std::memory_order_seq_cst);
    return;
  }
  auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
  int ms = static_cast<int>(std::clamp<int64_t>(left.count(), 0, kMaxSleep.count()));
  epoll_event evs[16];
  int k = ::epoll_wait(epfd_, evs, 16, ms);
  sleeping_.store(false, std::memory_order_seq_cst);
  for (int i = 0; i < k; ++i) {
    if (evs[i].data.ptr == nullptr) {
      uint64_t v;
      [[maybe_unused]] ssize_t r = ::read(evfd_, &v, sizeof(v));
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
}

void Poller::loop() {
  fabric::Completion wcs[kBatch];
  Clock::time_point next_timer = Clock::now();
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
    if (!sources_.empty()) {
      total += poll_sources();
      flush_sources();
    }
    if (full || busy_) continue;
    // Drained: sleep_until() arms and polls once more before it sleeps, and comes back at once
    // if that finds anything, so a second pass here would only poll an empty CQ once more (on
    // tcp a readv per round trip, measured at QD1).
    (void)total;
    sleep_until(next_timer);
  }
  // Leftover tasks run so that run_sync callers never hang on a stopping poller.
  run_tasks();
}

}  // namespace ibtrs::core
