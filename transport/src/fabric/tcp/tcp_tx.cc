// Transmit side of a tcp-provider connection: posting to the send queue, doorbells (at once,
// deferred to the end of the CQ owner's batch, or to ring()), the one sendmsg per flush, acks on
// data headers or in ACK frames, and the control frames (NAK, DISCONNECT).
#include <sys/epoll.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>

#include "fabric/tcp/tcp_private.h"

namespace ibtrs::fabric::tcp {
namespace {

// Frames per sendmsg; IOV_MAX is 1024 and each frame takes 1 + SGE iovecs.
constexpr size_t kMaxTxIov = 1024;
// Bytes per sendmsg. One call per 1 MiB frame copies the whole frame under the socket lock
// while the receiver waits for it; 256 KiB pieces keep both sides streaming. Measured on
// loopback, 1 MiB writes (bench/fabric.sh): unbounded ~5.2 GiB/s, 512 KiB ~6.4-7.5,
// 256 KiB ~6.5-6.8, 128 KiB ~4.0.
constexpr size_t kMaxTxBytes = 256 * 1024;

}  // namespace

ibtrs::Status TcpConnection::post(std::span<const SendWr> wrs, bool defer) {
  if (state() != ConnState::connected) return errc(ENOTCONN);
  BASE_TRY(check_send_batch(wrs, caps_));
  for (const SendWr& wr : wrs) {
    for (const Sge& s : wr.sg_list) {
      // A gather list outside registered memory would make sendmsg read arbitrary memory;
      // verbs reports it as a local protection error, we refuse the post.
      if (s.length > 0 && !mrs_->check(s.lkey, s.addr, s.length, 0)) return errc(EINVAL);
    }
  }
  std::lock_guard lock(tx_mu_);
  if (state() != ConnState::connected || tx_closed_) return errc(ENOTCONN);
  uint32_t tail = sq_tail_.load(std::memory_order_relaxed);
  uint32_t used = tail - sq_acked_.load(std::memory_order_acquire);
  if (wrs.size() > caps_.max_send_wr - used) return errc(ENOMEM);
  for (const SendWr& wr : wrs) {
    size_t slot = tail % sq_.size();
    TxEntry& e = sq_[slot];
    uint64_t total = 0;
    Sge* sges = &sq_sges_[slot * caps_.max_send_sge];
    for (size_t i = 0; i < wr.sg_list.size(); ++i) {
      sges[i] = wr.sg_list[i];
      total += wr.sg_list[i].length;
    }
    e.wr_id = wr.wr_id;
    e.num_sge = static_cast<uint32_t>(wr.sg_list.size());
    e.total = total;
    e.opcode = wr.opcode;
    e.signaled = wr.signaled;
    FrameType type = wr.opcode == Opcode::send    ? FrameType::send
                     : wr.opcode == Opcode::write ? FrameType::write
                                                  : FrameType::write_imm;
    e.hdr = make_header(type, static_cast<uint32_t>(total));
    if (type != FrameType::send) {
      e.hdr.remote_addr.set(wr.remote_addr);
      e.hdr.rkey.set(wr.rkey);
    }
    if (type == FrameType::write_imm) e.hdr.imm.set(wr.imm);
    // Ask for a prompt ack when someone waits for this completion, or when the send queue is
    // half full and its slots must come back.
    if (wr.signaled || 2 * (tail + 1 - sq_acked_.load(std::memory_order_relaxed)) >= caps_.max_send_wr)
      e.hdr.flags = kFlagAckRequested;
    ++tail;
  }
  sq_tail_.store(tail, std::memory_order_release);
  // EPOLLOUT pending: the poller sends once the socket has room, as for any post.
  if (epollout_) return {};
  if (defer) {
    // post_send_deferred: the poster's ring() sends it. Not on the CQ's list: the owner's
    // poll would then take tx_mu_ against the poster for nothing. Should the owner's batch post
    // here meanwhile, it finds the doorbell deferred and its frame leaves with the ring().
    doorbell_deferred_ = true;
    return {};
  }
  if (cq_.in_owner_batch()) {
    // The CQ's owner posting from its completion handlers: its next poll()/wait()/arm() sends
    // the whole batch with one sendmsg, where flushing here would cost one per post.
    if (!doorbell_deferred_) {
      doorbell_deferred_ = true;
      cq_.defer_tx(this);
    }
    return {};
  }
  flush_tx();
  return {};
}

bool TcpConnection::on_ack(uint32_t ack) {
  // Every frame header carries an ack, and most repeat the previous one (a response's data
  // WRITE and its WRITE_IMM carry the same value): no news needs no lock. Only the poller
  // stores sq_acked_, so this thread's relaxed load is exact, and a repeated value is always
  // in range.
  if (ack == sq_acked_.load(std::memory_order_relaxed)) return true;
  std::lock_guard lock(tx_mu_);
  uint32_t acked = sq_acked_.load(std::memory_order_relaxed);
  // The peer can only acknowledge frames we finished sending.
  if (ack - acked > sq_tx_ - acked) return false;
  for (uint32_t f = acked; f != ack; ++f) {
    const TxEntry& e = sq_[f % sq_.size()];
    if (e.signaled) {
      Opcode op = e.opcode;
      cq_.push(Completion{e.wr_id, WcStatus::success, op, static_cast<uint32_t>(e.total), 0, false});
    }
  }
  sq_acked_.store(ack, std::memory_order_release);
  return true;
}

void TcpConnection::set_epollout(bool on) {
  if (epollout_.load(std::memory_order_relaxed) == on) return;
  epollout_.store(on, std::memory_order_release);
  cq_.set_events(cq_id_, sock_.get(),
                 (rx_enabled_ ? EPOLLIN | EPOLLRDHUP : 0u) | (on ? EPOLLOUT : 0u));
}

void TcpConnection::flush_tx() {
  iovec iov[kMaxTxIov];
  for (;;) {
    if (tx_closed_) return;
    int cnt = 0;
    size_t bytes = 0;
    uint32_t ack = rx_.placed();
    bool ack_in_batch = false;
    bool ctrl_in_batch = false;
    const uint32_t tail = sq_tail_.load(std::memory_order_relaxed);
    // A half-sent control frame finishes first; then data; a NAK/DISCONNECT preempts data
    // that has not started (those requests are flushed anyway); an ACK goes only when no data
    // header can carry it.
    bool ctrl_first = ctrl_ != Ctrl::none && (ctrl_off_ > 0 || (ctrl_ != Ctrl::ack && tx_off_ == 0));
    if (!ctrl_first) {
      uint32_t f = sq_tx_;
      size_t off = tx_off_;
      while (f != tail && bytes < kMaxTxBytes &&
             cnt + 1 + static_cast<int>(caps_.max_send_sge) <= static_cast<int>(kMaxTxIov)) {
        TxEntry& e = sq_[f % sq_.size()];
        if (off == 0) {
          e.hdr.ack.set(ack);
          ack_in_batch = true;
        }
        // Skip what was already sent of this frame.
        size_t skip = off;
        auto add = [&](void* base, size_t len) {
          if (skip >= len) {
            skip -= len;
            return;
          }
          if (bytes >= kMaxTxBytes) return;
          size_t take = std::min(len - skip, kMaxTxBytes - bytes);
          iov[cnt].iov_base = static_cast<char*>(base) + skip;
          iov[cnt].iov_len = take;
          bytes += take;
          skip = 0;
          ++cnt;
        };
        add(&e.hdr, sizeof(FrameHeader));
        const Sge* sges = &sq_sges_[(f % sq_.size()) * caps_.max_send_sge];
        for (uint32_t i = 0; i < e.num_sge; ++i) {
          if (sges[i].length > 0) add(reinterpret_cast<void*>(sges[i].addr), sges[i].length);
        }
        off = 0;
        ++f;
      }
    }
    if (cnt == 0 && ctrl_ != Ctrl::none) {
      if (ctrl_off_ == 0) ctrl_hdr_.ack.set(ack);
      iov[0].iov_base = reinterpret_cast<char*>(&ctrl_hdr_) + ctrl_off_;
      iov[0].iov_len = sizeof(FrameHeader) - ctrl_off_;
      bytes = iov[0].iov_len;
      cnt = 1;
      ctrl_in_batch = true;
      ack_in_batch = ctrl_off_ == 0;
    }
    if (cnt == 0) {
      set_epollout(false);
      return;
    }
    ssize_t n = send_iov(iov, cnt);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        set_epollout(true);
        return;
      }
      // The stream is broken; the poller flushes everything.
      tx_failed_.store(true, std::memory_order_release);
      tx_closed_ = true;
      cq_.wake();
      return;
    }
    if (ack_in_batch) {
      ack_sent_ = ack;
      // A data header carried the ack: a queued ACK frame that has not started is redundant.
      if (!ctrl_in_batch && ctrl_ == Ctrl::ack && ctrl_off_ == 0) ctrl_ = Ctrl::none;
    }
    size_t sent = static_cast<size_t>(n);
    if (ctrl_in_batch) {
      ctrl_off_ += sent;
      if (ctrl_off_ == sizeof(FrameHeader)) {
        if (ctrl_ != Ctrl::ack) tx_closed_ = true;
        ctrl_ = Ctrl::none;
        ctrl_off_ = 0;
      }
    } else {
      while (sent > 0) {
        TxEntry& e = sq_[sq_tx_ % sq_.size()];
        size_t frame = sizeof(FrameHeader) + e.total - tx_off_;
        if (sent < frame) {
          tx_off_ += sent;
          sent = 0;
        } else {
          sent -= frame;
          tx_off_ = 0;
          ++sq_tx_;
        }
      }
    }
    if (static_cast<size_t>(n) < bytes) {
      set_epollout(true);
      return;
    }
  }
}

}  // namespace ibtrs::fabric::tcp
