// The tcp provider's completion queue: an epoll set of its connections' sockets and an eventfd,
// a ring of completions, the owner's batches (deferred doorbells) and the acks owed at their
// ends. Polling is where incoming bytes are processed (see tcp_private.h).
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "fabric/tcp/tcp_private.h"

namespace ibtrs::fabric::tcp {

Result<std::unique_ptr<CompletionQueue>> TcpCq::create(uint32_t capacity, bool busy_poll) {
  if (capacity == 0 || capacity > (1u << 22)) return errc(EINVAL);
  base::UniqueFd ep(::epoll_create1(EPOLL_CLOEXEC));
  if (!ep) return errc(errno);
  base::UniqueFd ev(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!ev) return errc(errno);
  epoll_event e{};
  e.events = EPOLLIN;
  e.data.u64 = 0;
  ::epoll_ctl(ep.get(), EPOLL_CTL_ADD, ev.get(), &e);
  return std::unique_ptr<CompletionQueue>(new TcpCq(capacity, std::move(ep), std::move(ev), busy_poll));
}

ibtrs::Status TcpCq::reserve(uint32_t n) {
  std::lock_guard lock(mu_);
  if (n > capacity() - reserved_) return errc(ENOSPC);
  reserved_ += n;
  return {};
}

void TcpCq::unreserve(uint32_t n) {
  std::lock_guard lock(mu_);
  reserved_ -= n;
}

void TcpCq::attach(TcpConnection* c, int sock, uint64_t* id_out) {
  std::lock_guard lock(mu_);
  uint64_t id = next_id_++;
  *id_out = id;
  conns_.push_back({id, c});
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.u64 = id;
  ::epoll_ctl(epfd_.get(), EPOLL_CTL_ADD, sock, &ev);
}

void TcpCq::detach(uint64_t id, int sock) {
  std::lock_guard lock(mu_);
  epoll_event ev{};
  ::epoll_ctl(epfd_.get(), EPOLL_CTL_DEL, sock, &ev);
  for (size_t i = 0; i < conns_.size(); ++i) {
    if (conns_[i].id == id) {
      TcpConnection* c = conns_[i].conn;
      conns_.erase(conns_.begin() + static_cast<ptrdiff_t>(i));
      ack_owed_.erase(std::remove(ack_owed_.begin(), ack_owed_.end(), c), ack_owed_.end());
      std::lock_guard dlock(defer_mu_);
      deferred_.erase(std::remove(deferred_.begin(), deferred_.end(), c), deferred_.end());
      break;
    }
  }
}

void TcpCq::grow() {
  // Only reachable when the owner lets completions pile up beyond the CQ size (an overrun in
  // verbs); we keep them rather than lose them.
  std::vector<Completion> bigger(ring_.size() * 2);
  for (size_t i = 0; i < count_; ++i) bigger[i] = ring_[(head_ + i) % ring_.size()];
  ring_.swap(bigger);
  head_ = 0;
}

size_t TcpCq::drain(std::span<Completion> out) {
  size_t n = std::min(out.size(), count_);
  for (size_t i = 0; i < n; ++i) {
    out[i] = ring_[head_];
    head_ = (head_ + 1) % ring_.size();
  }
  count_ -= n;
  return n;
}

void TcpCq::close_batch() {
  batch_owner_.store(0, std::memory_order_relaxed);
  {
    std::lock_guard lock(defer_mu_);
    if (deferred_.empty()) return;
    deferred_.swap(flushing_);
  }
  // mu_ is held, so no connection on the list can be detached (destroyed) meanwhile.
  for (TcpConnection* c : flushing_) c->flush_deferred();
  flushing_.clear();
}

void TcpCq::flush_acks() {
  // Sending an ack never adds to the list (only the rx path does), so plain iteration is safe.
  for (size_t i = 0; i < ack_owed_.size(); ++i) ack_owed_[i]->send_owed_ack();
  ack_owed_.clear();
}

void TcpCq::dispatch(const epoll_event* evs, int n) {
  for (int i = 0; i < n; ++i) {
    uint64_t id = evs[i].data.u64;
    if (id == 0) {
      wake_pending_.store(false, std::memory_order_release);
      uint64_t v;
      [[maybe_unused]] ssize_t r = ::read(evfd_.get(), &v, sizeof(v));
      // on_wakeup() may run rx (pump) but never attaches or detaches, so conns_ is stable here.
      for (size_t k = 0; k < conns_.size(); ++k) conns_[k].conn->on_wakeup();
      continue;
    }
    for (const Attached& a : conns_) {
      if (a.id == id) {
        a.conn->on_events(evs[i].events);
        break;
      }
    }
  }
}

size_t TcpCq::poll(std::span<Completion> out) {
  std::lock_guard lock(mu_);
  // The previous batch's posts go first: their headers carry the acks we owe.
  close_batch();
  size_t n = drain(out);
  if (n == out.size()) return open_batch(n);
  // Acks owed since the previous poll go out now unless a frame already carried them.
  flush_acks();
  // A CQ with one connection (an IBTRS IO thread on a one-path session) reads its socket
  // directly: one system call per poll instead of epoll_wait + readv, busy-polled or not (an
  // empty socket costs a readv instead of an epoll_wait; the owner sleeps on the epoll fd as
  // before). Anything else that needs attention - a wakeup, a send waiting for room, a stall
  // on RECVs - goes through epoll.
  if (conns_.size() == 1 && !wake_pending_.load(std::memory_order_acquire) &&
      conns_[0].conn->can_spin_read()) {
    conns_[0].conn->on_events(EPOLLIN);
    return open_batch(n + drain(out.subspan(n)));
  }
  epoll_event evs[kMaxEvents];
  int k = ::epoll_wait(epfd_.get(), evs, kMaxEvents, 0);
  if (k > 0) dispatch(evs, k);
  return open_batch(n + drain(out.subspan(n)));
}

size_t TcpCq::wait(std::span<Completion> out, std::chrono::milliseconds timeout) {
  {
    // Completions already queued are returned at once; otherwise owed acks go out and we block
    // in epoll_wait straight away (a non-blocking look first would only add a system call to
    // every round trip).
    std::lock_guard lock(mu_);
    close_batch();
    size_t n = drain(out);
    if (n > 0) return n;
    flush_acks();
  }
  auto deadline = Clock::now() + timeout;
  epoll_event evs[kMaxEvents];
  for (;;) {
    int ms = busy_poll_ ? 0 : remaining_ms(deadline);
    int k = ::epoll_wait(epfd_.get(), evs, kMaxEvents, ms);
    if (k > 0) {
      // Dispatch under the lock; ids of connections detached meanwhile are simply not found.
      std::lock_guard lock(mu_);
      dispatch(evs, k);
      size_t n = drain(out);
      if (n > 0) return n;
      flush_acks();
    }
    if (Clock::now() >= deadline) return 0;
  }
}

}  // namespace ibtrs::fabric::tcp
