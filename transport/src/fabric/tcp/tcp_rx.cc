#include "fabric/tcp/tcp_rx.h"

#include "fabric/tcp/dma_scope.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace ibtrs::fabric::tcp {

RxEngine::RxEngine(const MrTable& mrs, size_t staging_bytes, uint64_t conn)
    : mrs_(mrs),
      conn_(conn),
      stage_(new std::byte[std::max(staging_bytes, 2 * sizeof(FrameHeader))]),
      stage_cap_(std::max(staging_bytes, 2 * sizeof(FrameHeader))) {}

RxResult RxEngine::fail(WcStatus nak, int err) {
  nak_status_ = nak;
  error_ = errc(err);
  state_ = State::ended;
  return RxResult::failed;
}

RxResult RxEngine::pump(RxHooks& hooks, unsigned max_reads) {
  RxResult out = RxResult::idle;
  if (state_ == State::ended) return RxResult::peer_closed;
  for (unsigned i = 0; i < max_reads; ++i) {
    if (process_staged(hooks, out) == Step::stop) return out;

    // Staging now holds only part of a header (state header) or nothing (state payload).
    iovec iov[kMaxRecvSge + 1];
    int cnt = 0;
    size_t want = 0;
    if (state_ == State::payload && remaining_ > 0) {
      cnt = payload_iov(iov, kMaxRecvSge);
      if (cnt == 0) {
        return hdr_.type == static_cast<uint8_t>(FrameType::send)
                   ? fail(WcStatus::remote_operation_error, EFAULT)
                   : fail(WcStatus::remote_access_error, EFAULT);
      }
      for (int k = 0; k < cnt; ++k) want += iov[k].iov_len;
    }
    const int held = cnt;  // refs_[0, held) pin the payload targets during the read
    if (s_begin_ > 0) {
      std::memmove(stage_.get(), stage_.get() + s_begin_, staged());
      s_end_ -= s_begin_;
      s_begin_ = 0;
    }
    size_t room = stage_cap_ - s_end_;
    if (want >= kDefaultStaging) room = std::min(room, kStagingBesideLargePayload);
    iov[cnt].iov_base = stage_.get() + s_end_;
    iov[cnt].iov_len = room;
    want += iov[cnt].iov_len;
    ++cnt;

    ssize_t n;
    {
      DmaScope dma;  // the read lands in registered memory, as an HCA's DMA would
      n = hooks.read(iov, cnt);
    }
    for (int k = 0; k < held; ++k) refs_[k].reset();
    if (n == -EAGAIN || n == -EWOULDBLOCK || n == -EINTR) return RxResult::idle;
    if (n <= 0) {
      error_ = errc(n == 0 ? ECONNRESET : static_cast<int>(-n));
      state_ = State::ended;
      return RxResult::peer_closed;
    }
    size_t got = static_cast<size_t>(n);
    if (state_ == State::payload && remaining_ > 0) {
      uint64_t in_place = std::min<uint64_t>(got, remaining_);
      payload_bytes_ += in_place;
      advance_payload(in_place);
      got -= in_place;
    }
    s_end_ += got;
    if (static_cast<size_t>(n) < want) {
      // A short read means the socket is drained: process and let epoll tell us about more,
      // rather than spend a syscall on EAGAIN.
      if (process_staged(hooks, out) == Step::stop) return out;
      return RxResult::idle;
    }
  }
  if (process_staged(hooks, out) == Step::stop) return out;
  return RxResult::more;
}

RxEngine::Step RxEngine::process_staged(RxHooks& hooks, RxResult& out) {
  Step step = run_staged(hooks, out);
  // The header's hold never outlives this pass: a frame may now wait for the socket or for a
  // RECV indefinitely, and a held region cannot be deregistered.
  if (frame_ref_) frame_ref_.reset();
  return step;
}

RxEngine::Step RxEngine::run_staged(RxHooks& hooks, RxResult& out) {
  for (;;) {
    switch (state_) {
      case State::ended:
        out = RxResult::peer_closed;
        return Step::stop;
      case State::header: {
        if (staged() < sizeof(FrameHeader)) return Step::go_on;
        std::memcpy(&hdr_, stage_.get() + s_begin_, sizeof(FrameHeader));
        s_begin_ += sizeof(FrameHeader);
        if (on_header(hooks, out) == Step::stop) return Step::stop;
        break;
      }
      case State::need_recv:
        if (bind_recv(hooks, out) == Step::stop) return Step::stop;
        break;
      case State::payload: {
        if (remaining_ > 0 && staged() > 0) {
          size_t n = static_cast<size_t>(std::min<uint64_t>(staged(), remaining_));
          if (!place_from_staging(n)) {
            out = hdr_.type == static_cast<uint8_t>(FrameType::send)
                      ? fail(WcStatus::remote_operation_error, EFAULT)
                      : fail(WcStatus::remote_access_error, EFAULT);
            return Step::stop;
          }
        }
        if (remaining_ > 0) return Step::go_on;
        finish_frame(hooks);
        break;
      }
    }
  }
}

RxEngine::Step RxEngine::on_header(RxHooks& hooks, RxResult& out) {
  if (!header_is_valid(hdr_)) {
    out = fail(WcStatus::remote_invalid_request, EPROTO);
    return Step::stop;
  }
  if (!hooks.on_ack(hdr_.ack.get())) {
    out = fail(WcStatus::remote_invalid_request, EPROTO);
    return Step::stop;
  }
  const auto type = static_cast<FrameType>(hdr_.type);
  const uint64_t len = hdr_.length.get();
  switch (type) {
    case FrameType::ack:
      return Step::go_on;
    case FrameType::nak:
      hooks.on_nak(hdr_.ack.get(), static_cast<WcStatus>(hdr_.status));
      state_ = State::ended;
      error_ = errc(ECONNABORTED);
      out = RxResult::nak;
      return Step::stop;
    case FrameType::disconnect:
      state_ = State::ended;
      error_ = errc(ECONNRESET);
      out = RxResult::peer_closed;
      return Step::stop;
    case FrameType::connect_req:
    case FrameType::connect_rsp:
      out = fail(WcStatus::remote_invalid_request, EPROTO);
      return Step::stop;
    case FrameType::write:
    case FrameType::write_imm: {
      nsegs_ = 0;
      if (len > 0) {
        // A zero-length write touches no memory, so (as in verbs) its rkey is not checked:
        // IBTRS heartbeats are exactly that.
        // The check's hold is kept for the rest of this pass, so that a payload already
        // staged behind its header is placed without acquiring the region a second time.
        MrTable::Fault fault = MrTable::Fault::none;
        frame_ref_ = mrs_.acquire(hdr_.rkey.get(), hdr_.remote_addr.get(), len, kRemoteWrite,
                                  &fault, conn_);
        if (!frame_ref_) {
          out = fail(WcStatus::remote_access_error,
                     fault == MrTable::Fault::out_of_bounds ? EFAULT : EACCES);
          return Step::stop;
        }
        segs_[0] = Segment{hdr_.rkey.get(), hdr_.remote_addr.get(), len};
        nsegs_ = 1;
      }
      need_access_ = kRemoteWrite;
      seg_idx_ = 0;
      seg_off_ = 0;
      remaining_ = len;
      state_ = type == FrameType::write_imm ? State::need_recv : State::payload;
      return Step::go_on;
    }
    case FrameType::send:
      remaining_ = len;
      state_ = State::need_recv;
      return Step::go_on;
  }
  out = fail(WcStatus::remote_invalid_request, EPROTO);
  return Step::stop;
}

RxEngine::Step RxEngine::bind_recv(RxHooks& hooks, RxResult& out) {
  RecvEntry* r = hooks.head_recv();
  if (r == nullptr) {
    out = RxResult::rnr;
    return Step::stop;
  }
  if (static_cast<FrameType>(hdr_.type) == FrameType::send) {
    const uint64_t len = hdr_.length.get();
    uint64_t total = 0;
    for (uint32_t i = 0; i < r->num_sge; ++i) total += r->sge[i].length;
    if (total < len) {
      hooks.complete_recv(WcStatus::local_length_error, Opcode::recv, 0, 0, false);
      out = fail(WcStatus::remote_invalid_request, EMSGSIZE);
      return Step::stop;
    }
    nsegs_ = 0;
    uint64_t left = len;
    for (uint32_t i = 0; i < r->num_sge && left > 0; ++i) {
      uint64_t take = std::min<uint64_t>(left, r->sge[i].length);
      if (take == 0) continue;
      if (!mrs_.check(r->sge[i].lkey, r->sge[i].addr, take, kLocalWrite)) {
        hooks.complete_recv(WcStatus::local_protection_error, Opcode::recv, 0, 0, false);
        out = fail(WcStatus::remote_operation_error, EFAULT);
        return Step::stop;
      }
      segs_[nsegs_++] = Segment{r->sge[i].lkey, r->sge[i].addr, take};
      left -= take;
    }
    need_access_ = kLocalWrite;
    seg_idx_ = 0;
    seg_off_ = 0;
  }
  state_ = State::payload;
  return Step::go_on;
}

void RxEngine::finish_frame(RxHooks& hooks) {
  if (frame_ref_) frame_ref_.reset();  // the next frame's placement must not use it
  const auto type = static_cast<FrameType>(hdr_.type);
  // Count the frame before completing the RECV, so that an upper layer reacting to the
  // completion by sending already acknowledges this frame.
  placed_.store(placed_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  if (hdr_.flags & kFlagAckRequested) ack_requested_ = true;
  if (type == FrameType::send) {
    hooks.complete_recv(WcStatus::success, Opcode::recv, hdr_.length.get(), 0, false);
  } else if (type == FrameType::write_imm) {
    hooks.complete_recv(WcStatus::success, Opcode::recv_rdma_with_imm, hdr_.length.get(),
                        hdr_.imm.get(), true);
  }
  state_ = State::header;
}

bool RxEngine::place_from_staging(size_t n) {
  const std::byte* src = stage_.get() + s_begin_;
  size_t left = n;
  while (left > 0) {
    const Segment& sg = segs_[seg_idx_];
    uint64_t chunk = std::min<uint64_t>(left, sg.len - seg_off_);
    if (frame_ref_) {
      // A WRITE whose header was checked in this pass: its one segment is the held window.
      DmaScope dma;  // into registered memory, as an HCA's DMA would
      std::memcpy(frame_ref_.ptr() + seg_off_, src, chunk);
    } else {
      MrTable::Ref ref =
          mrs_.acquire(sg.key, sg.addr + seg_off_, chunk, need_access_, nullptr, conn_);
      if (!ref) return false;
      DmaScope dma;
      std::memcpy(ref.ptr(), src, chunk);
    }
    src += chunk;
    left -= chunk;
    advance_payload(chunk);
  }
  s_begin_ += n;
  staged_copy_bytes_ += n;
  payload_bytes_ += n;
  return true;
}

int RxEngine::payload_iov(iovec* iov, int max) {
  int cnt = 0;
  uint32_t idx = seg_idx_;
  uint64_t off = seg_off_;
  while (idx < nsegs_ && cnt < max) {
    const Segment& sg = segs_[idx];
    uint64_t len = sg.len - off;
    refs_[cnt] = mrs_.acquire(sg.key, sg.addr + off, len, need_access_, nullptr, conn_);
    if (!refs_[cnt]) {
      for (auto& r : refs_) r.reset();
      return 0;
    }
    iov[cnt].iov_base = refs_[cnt].ptr();
    iov[cnt].iov_len = static_cast<size_t>(len);
    ++cnt;
    ++idx;
    off = 0;
  }
  return cnt;
}

void RxEngine::advance_payload(uint64_t n) {
  remaining_ -= n;
  while (n > 0) {
    uint64_t in_seg = segs_[seg_idx_].len - seg_off_;
    if (n < in_seg) {
      seg_off_ += n;
      return;
    }
    n -= in_seg;
    ++seg_idx_;
    seg_off_ = 0;
  }
}

}  // namespace ibtrs::fabric::tcp
