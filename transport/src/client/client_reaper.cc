// Caller-reaped completions (ClientSession::make_reaper; kernel: rnbd's poll queues,
// rtrs_clt_rdma_cq_direct on IB_POLL_DIRECT CQs): a user thread borrows the CQ of its IO
// connection on every path through the CQ's lease and does what the IO poller would do with it.
// Structure in client_impl.h.
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "client/client_impl.h"

namespace ibtrs {

using client::Con;
using client::Path;
using fabric::Completion;

namespace client {

void Session::give_back(Con* c) {
  (void)c->cq->arm();
  // Armed: anything completing from here on signals the fd. What completed before is ours.
  Completion wcs[32];
  for (size_t n; (n = c->cq->poll(std::span(wcs, 32))) > 0;) {
    c->on_completions(std::span(wcs, n));
    if (n < 32) break;
  }
  c->poller->set_muted(c->cq.get(), false);
  c->lease.set(core::CqLease::free);
}

void ReapPort::wake() const {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t r = ::write(evfd.get(), &one, sizeof(one));
}

}  // namespace client

// ------------------------------------------------------------------------------------------
// Caller-reaped completions

struct CompletionReaper::Impl {
  client::Session* s = nullptr;
  std::shared_ptr<client::ReapPort> port;
  // The CQs held during one reap() (one per path at most; masks of their indices are uint32_t).
  static_assert(ClientSession::kMaxPaths <= 32);
  Con* held[ClientSession::kMaxPaths];
  uint32_t nheld = 0;
  // CQs of connected paths that borrow() left to the poller (it was in a pass over them): their
  // completions run there and raise no event of ours, so a wait must not be endless.
  uint32_t missed = 0;
  // fd(): an epoll set over the fds of the CQs this reaper holds, lent or lent_idle. A CQ joins
  // when it is borrowed from the poller and leaves when it is given back; one the poller
  // reclaims from lent_idle stays in the set (we are not told), which only costs a spurious
  // wake-up and a re-borrow, and leaves by itself when the CQ is destroyed (closing an fd takes
  // it out of every epoll set). -1 until fd() is called: the set costs nothing before.
  base::UniqueFd epfd;

  void watch(Con* c) {
    if (!epfd) return;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = c;
    ::epoll_ctl(epfd.get(), EPOLL_CTL_ADD, c->cq->fd(), &ev);  // EEXIST: still there from before
  }
  void give_back(Con* c) {
    if (epfd) ::epoll_ctl(epfd.get(), EPOLL_CTL_DEL, c->cq->fd(), nullptr);
    s->give_back(c);
  }

  // Takes this reaper's CQ of every CONNECTED path: from its idle lease without a system call,
  // or from the poller (then mutes it there). The poller holds a CQ only for one pass over it
  // (or a teardown task): waited for briefly, then left to it this time (its completions run
  // there, and the caller's wake() ends our wait).
  void borrow() {
    nheld = 0;
    missed = 0;
    const uint32_t n = s->npaths_hint.load(std::memory_order_acquire);
    for (uint32_t i = 0; i < n; ++i) {
      Path* pa = s->paths[i].load(std::memory_order_acquire);
      if (pa == nullptr) continue;
      Con* c = pa->io_con(port->ci);
      for (int spin = 0; spin < 256 && c->lease.state() == core::CqLease::poller; ++spin)
        __builtin_ia32_pause();
      if (c->lease.take(core::CqLease::lent_idle, core::CqLease::lent)) {
        // The gate is closed from teardown until the next incarnation is up: such a CQ goes
        // back (teardown seizes it); the CQ object itself stays valid while we hold the lease.
        if (!c->gate.is_open()) {
          give_back(c);
          continue;
        }
      } else if (c->lease.take(core::CqLease::free, core::CqLease::lent)) {
        // Checked before touching c->cq: with the gate closed the worker may be replacing it.
        if (!c->gate.is_open()) {
          c->lease.set(core::CqLease::free);
          continue;
        }
        c->poller->set_muted(c->cq.get(), true);
        watch(c);
      } else {
        ++missed;
        continue;
      }
      held[nheld++] = c;
    }
  }

  // `only`: a mask of held[] indices to poll (a level-triggered CQ whose fd was not readable has
  // nothing: its poll would be a readv that finds nothing).
  size_t poll_held(uint32_t only = ~0u) {
    Completion wcs[32];
    size_t total = 0;
    for (uint32_t i = 0; i < nheld; ++i) {
      if ((only >> i & 1u) == 0) continue;
      Con* c = held[i];
      for (size_t n; (n = c->cq->poll(std::span(wcs, 32))) > 0;) {
        c->on_completions(std::span(wcs, n));
        total += n;
        if (n < 32) break;
      }
    }
    return total;
  }

  // Idle leases for the next call, or back to the pollers when the connection is going away
  // or the session is closing.
  void release() {
    const bool closing = port->closed.load(std::memory_order_acquire);
    const int64_t now = core::Clock::now().time_since_epoch().count();
    for (uint32_t i = 0; i < nheld; ++i) {
      Con* c = held[i];
      if (closing || !c->gate.is_open()) {
        give_back(c);
        continue;
      }
      // Sends what callbacks posted in a batch of ours and acks owed (tcp), and asks for an
      // event (rdma), so that the poller, should it reclaim the CQ, misses nothing.
      (void)c->cq->arm();
      // The caller waits on fd() next, not inside reap(): what completed between the last poll
      // and arm() raised no event, so it is looked for now (the verbs protocol's second poll).
      // A level-triggered CQ's fd says so by itself.
      if (epfd && !c->cq->level_triggered()) {
        Completion wcs[32];
        for (size_t n; (n = c->cq->poll(std::span(wcs, 32))) > 0;) {
          c->on_completions(std::span(wcs, n));
          (void)c->cq->arm();
        }
      }
      c->lease.idle(now);
    }
    nheld = 0;
  }

  bool must_return() const {
    if (port->closed.load(std::memory_order_acquire)) return true;
    for (uint32_t i = 0; i < nheld; ++i) {
      if (!held[i]->gate.is_open()) return true;
    }
    return false;
  }

  // Blocks on the held CQs' fds and the wake-up eventfd; `forever`: with no timer (arming and
  // cancelling one is a cost of every blocking wait, a VM exit each where the guest's timer
  // is emulated). Returns the mask of held[] indices whose fd was readable.
  uint32_t block(std::chrono::microseconds wait, bool forever) {
    pollfd pfds[ClientSession::kMaxPaths + 1];
    uint32_t n = 0;
    for (uint32_t i = 0; i < nheld; ++i) pfds[n++] = pollfd{held[i]->cq->fd(), POLLIN, 0};
    pfds[n++] = pollfd{port->evfd.get(), POLLIN, 0};
    const auto us = wait.count();
    timespec ts{static_cast<time_t>(us / 1000000), static_cast<long>(us % 1000000) * 1000};
    if (::ppoll(pfds, n, forever ? nullptr : &ts, nullptr) <= 0) return 0;
    if (pfds[n - 1].revents != 0) {
      uint64_t v;
      [[maybe_unused]] ssize_t r = ::read(port->evfd.get(), &v, sizeof(v));
    }
    uint32_t ready = 0;
    for (uint32_t i = 0; i < nheld; ++i) {
      if (pfds[i].revents == 0) continue;
      held[i]->cq->ack_events();
      ready |= 1u << i;
    }
    return ready;
  }
};

CompletionReaper::CompletionReaper(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CompletionReaper::~CompletionReaper() {
  client::ReapPort& port = *impl_->port;
  if (port.closed.load(std::memory_order_acquire)) return;  // the session closes or is gone
  client::Session* s = impl_->s;
  std::lock_guard lock(s->reap_mu);
  if (port.closed.load(std::memory_order_acquire)) return;
  for (auto& slot : s->paths) {
    Path* pa = slot.load(std::memory_order_acquire);
    if (pa == nullptr) continue;
    Con* c = pa->io_con(port.ci);
    if (c->lease.take(core::CqLease::lent_idle, core::CqLease::lent)) s->give_back(c);
  }
  s->reapers[port.ci].reset();
}

namespace {
// How long reap() waits at most while a CQ it could not borrow is the poller's (the poller
// holds a CQ for one pass over it: microseconds, longer under a sanitizer or a loaded host).
constexpr std::chrono::microseconds kMissedCqWait{1000};
}  // namespace

Result<size_t> CompletionReaper::reap(std::chrono::microseconds wait) {
  if (client::tl_plug.depth > 0) return errc(EDEADLK);
  Impl& m = *impl_;
  client::ReapPort& port = *m.port;
  port.inside.fetch_add(1, std::memory_order_seq_cst);
  if (port.closed.load(std::memory_order_seq_cst)) {
    port.inside.fetch_sub(1, std::memory_order_seq_cst);
    return errc(ESHUTDOWN);
  }
  // on_completions marks this thread as the IO thread of the connection for the callbacks it
  // runs (a resubmission stays on it); outside reap() the thread is a user thread again.
  const client::Session* saved_session = client::tl_session;
  const uint32_t saved_poller = client::tl_poller;
  const size_t finished0 = client::tl_finished;
  m.borrow();
  // Level-triggered CQs (tcp) are waited on straight away: their fd says whether a poll would
  // find anything, and each poll that finds nothing is a readv (at QD1 that was 1.7 of 4.6
  // system calls per IO).
  bool level = true;
  for (uint32_t i = 0; i < m.nheld; ++i) level = level && m.held[i]->cq->level_triggered();
  const bool block = wait.count() > 0;
  // A CQ left to the poller this time is not in our wait: a wait without end would end only on
  // wake(), so it is cut to a tick and the caller looks again (borrowing the CQ then).
  if (m.missed > 0 && wait > kMissedCqWait) wait = kMissedCqWait;
  const bool forever = wait == std::chrono::microseconds::max();
  // Waited on through fd(): the events that made it readable are consumed here (a verbs
  // completion channel stays readable until they are read).
  if (m.epfd && !block) {
    for (uint32_t i = 0; i < m.nheld; ++i)
      if (!m.held[i]->cq->level_triggered()) m.held[i]->cq->ack_events();
  }
  size_t got = block && level ? 0 : m.poll_held();
  if (got == 0 && block) {
    const auto deadline = forever ? core::Clock::time_point::max() : core::Clock::now() + wait;
    while (!m.must_return()) {
      // Verbs protocol: arm, poll again to close the race, then wait for the fds.
      for (uint32_t i = 0; i < m.nheld; ++i) (void)m.held[i]->cq->arm();
      if (!level && (got = m.poll_held()) > 0) break;
      auto left = wait;
      if (!forever) {
        left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - core::Clock::now());
        if (left.count() <= 0) break;
      }
      const uint32_t ready = m.block(left, forever);
      // Woken: by a completion fd, wake(), a teardown or the close; any of them ends the call
      // once the CQs have been looked at (a wake-up is the caller's to interpret). With two
      // paths a completion on one would otherwise cost a readv on the other too; release()
      // still arms every held CQ, which sends what each owes.
      got = m.poll_held(level ? ready : ~0u);
      break;
    }
  }
  m.release();
  client::tl_session = saved_session;
  client::tl_poller = saved_poller;
  const size_t ran = client::tl_finished - finished0;
  port.inside.fetch_sub(1, std::memory_order_seq_cst);
  (void)got;
  return ran;
}

void CompletionReaper::wake() { impl_->port->wake(); }

Result<int> CompletionReaper::fd() {
  Impl& m = *impl_;
  if (m.epfd) return m.epfd.get();  // the caller borrows it: it lives as long as the reaper
  base::UniqueFd fd(::epoll_create1(EPOLL_CLOEXEC));
  if (!fd) return errc(errno);
  // CQs held lent_idle from earlier calls never joined the set: back to their pollers, to be
  // borrowed (and watched) by the next reap().
  client::ReapPort& port = *m.port;
  if (!port.closed.load(std::memory_order_acquire)) {
    std::lock_guard lock(m.s->reap_mu);
    if (!port.closed.load(std::memory_order_acquire)) {
      for (auto& slot : m.s->paths) {
        Path* pa = slot.load(std::memory_order_acquire);
        if (pa == nullptr) continue;
        Con* c = pa->io_con(port.ci);
        if (c->lease.take(core::CqLease::lent_idle, core::CqLease::lent)) m.s->give_back(c);
      }
    }
  }
  m.epfd = std::move(fd);
  return m.epfd.get();
}

Result<std::unique_ptr<CompletionReaper>> ClientSession::make_reaper() {
  Impl* s = impl_.get();
  if (s->closing.load(std::memory_order_acquire)) return errc(ESHUTDOWN);
  const uint32_t ci = client::thread_ci(*s);
  auto port = std::make_shared<client::ReapPort>();
  port->ci = ci;
  port->evfd.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!port->evfd) return errc(errno);
  auto impl = std::make_unique<CompletionReaper::Impl>();
  impl->s = s;
  impl->port = port;
  {
    std::lock_guard lock(s->reap_mu);
    if (s->reapers[ci]) return errc(EBUSY);
    s->reapers[ci] = std::move(port);
  }
  return std::unique_ptr<CompletionReaper>(new CompletionReaper(std::move(impl)));
}

}  // namespace ibtrs
