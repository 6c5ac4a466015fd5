// A tcp-provider connection on its CQ's poller: what socket events do (transmit, the receive
// engine of tcp_rx.h), receive queue posting and the "receiver not ready" stall, SO_RCVLOWAT
// under large payloads, and the move to error that flushes every outstanding request.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

#include "fabric/tcp/tcp_private.h"

namespace ibtrs::fabric::tcp {
namespace {

// Reads per connection per poll: bounds how long one busy connection holds the poller.
constexpr unsigned kReadsPerEvent = 8;

}  // namespace

Address address_of(int fd, bool peer) {
  Address a;
  a.fabric = FabricKind::tcp;
  socklen_t len = sizeof(a.sa);
  if (peer) {
    ::getpeername(fd, reinterpret_cast<sockaddr*>(&a.sa), &len);
  } else {
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a.sa), &len);
  }
  a.port = a.sa.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&a.sa)->sin6_port)
                                      : ntohs(reinterpret_cast<sockaddr_in*>(&a.sa)->sin_port);
  return a;
}

ibtrs::Status TcpConnection::post_recv(std::span<const RecvWr> wrs) {
  if (state() != ConnState::connected) return errc(ENOTCONN);
  BASE_TRY(check_recv_batch(wrs, caps_));
  for (const RecvWr& wr : wrs) {
    for (const Sge& s : wr.sg_list) {
      if (s.length > 0 && !mrs_->check(s.lkey, s.addr, s.length, kLocalWrite)) return errc(EINVAL);
    }
  }
  {
    std::lock_guard lock(rq_mu_);
    // Checked again under the lock: enter_error() marks the state before it flushes under this
    // lock, so a RECV either lands before the flush (and is flushed) or is refused.
    if (state() != ConnState::connected) return errc(ENOTCONN);
    uint32_t tail = rq_tail_.load(std::memory_order_relaxed);
    if (wrs.size() > rq_.size() - (tail - rq_head_.load(std::memory_order_acquire))) return errc(ENOMEM);
    for (const RecvWr& wr : wrs) {
      RecvEntry& e = rq_[tail % rq_.size()];
      e.wr_id = wr.wr_id;
      e.num_sge = static_cast<uint32_t>(wr.sg_list.size());
      std::copy(wr.sg_list.begin(), wr.sg_list.end(), e.sge);
      ++tail;
    }
    rq_tail_.store(tail, std::memory_order_release);
  }
  // A poller stalled on "receiver not ready" resumes once it sees a RECV.
  if (rnr_.load(std::memory_order_acquire)) cq_.wake();
  return {};
}

void TcpConnection::pump() {
  RxResult r = rx_.pump(*this, kReadsPerEvent);
  switch (r) {
    case RxResult::idle:
      set_lowat();
      break;
    case RxResult::more:
      break;
    case RxResult::rnr: {
      rnr_.store(true, std::memory_order_release);
      if (recv_posted()) {  // a RECV raced in between: go on
        rnr_.store(false, std::memory_order_release);
        cq_.wake();
      } else {
        // Stop reading until post_recv() wakes us; the peer's sender waits (infinite RNR retry).
        std::lock_guard lock(tx_mu_);
        rx_enabled_ = false;
        cq_.set_events(cq_id_, sock_.get(), epollout_ ? EPOLLOUT : 0u);
      }
      break;
    }
    case RxResult::peer_closed:
      enter_error(rx_.error(), Ctrl::none);
      return;
    case RxResult::nak:
      enter_error(errc(ECONNABORTED), Ctrl::none);
      return;
    case RxResult::failed:
      enter_error(rx_.error(), Ctrl::nak, rx_.nak_status());
      return;
  }
  if (rx_.take_ack_request()) cq_.owe_ack(this);
  if (rx_enabled_ && tls_read_pending()) cq_.wake();
}

void TcpConnection::on_wakeup() {
  if (dead_) return;
  if (local_disconnect_.load(std::memory_order_acquire)) {
    enter_error(errc(ECONNABORTED), Ctrl::disconnect);
    return;
  }
  if (tx_failed_.load(std::memory_order_acquire)) {
    enter_error(errc(EPIPE), Ctrl::none);
    return;
  }
  if (rnr_.load(std::memory_order_acquire)) {
    if (recv_posted()) {
      rnr_.store(false, std::memory_order_release);
      {
        std::lock_guard lock(tx_mu_);
        rx_enabled_ = true;
        cq_.set_events(cq_id_, sock_.get(), EPOLLIN | EPOLLRDHUP | (epollout_ ? EPOLLOUT : 0u));
      }
      pump();
    }
  }
  if (!dead_ && rx_enabled_ && tls_read_pending()) pump();
}

void TcpConnection::enter_error(std::error_code why, Ctrl tell_peer, WcStatus nak_status) {
  if (dead_) return;
  dead_ = true;
  state_.store(ConnState::error, std::memory_order_release);
  {
    std::lock_guard lock(tx_mu_);
    if (tell_peer != Ctrl::none) {
      queue_ctrl(tell_peer, nak_status);
      flush_tx();  // best effort: the socket may be full or gone
    }
    tx_closed_ = true;
    // Every request not yet acknowledged completes now: the NAKed one with the peer's status,
    // the rest with flush_error, signalled or not (fabric.h).
    const uint32_t tail = sq_tail_.load(std::memory_order_relaxed);
    for (uint32_t f = sq_acked_.load(std::memory_order_relaxed); f != tail; ++f) {
      const TxEntry& e = sq_[f % sq_.size()];
      WcStatus st = (has_failed_frame_ && f == failed_frame_) ? failed_status_ : WcStatus::flush_error;
      cq_.push(Completion{e.wr_id, st, e.opcode, 0, 0, false});
    }
    sq_acked_.store(tail, std::memory_order_release);
    sq_tx_ = tail;
    tx_off_ = 0;
  }
  {
    std::lock_guard lock(rq_mu_);
    uint32_t head = rq_head_.load(std::memory_order_relaxed);
    for (const uint32_t tail = rq_tail_.load(std::memory_order_acquire); head != tail; ++head) {
      cq_.push(Completion{rq_[head % rq_.size()].wr_id, WcStatus::flush_error, Opcode::recv, 0,
                          0, false});
    }
    rq_head_.store(head, std::memory_order_release);
  }
  ::shutdown(sock_.get(), SHUT_WR);
  epoll_event ev{};
  ::epoll_ctl(cq_.fd(), EPOLL_CTL_DEL, sock_.get(), &ev);
  if (events_.on_disconnected) events_.on_disconnected(why);
}

}  // namespace ibtrs::fabric::tcp
