// The rdma provider's completion queues: one ibv_cq with its completion channel per CQ, shared
// by the connections of every domain on the device, and the translation of each work completion
// back to the user's wr_id and opcode (see rdma_private.h, Completions).
#include <arpa/inet.h>
#include <infiniband/verbs.h>

#include <algorithm>
#include <cerrno>
#include <climits>

#include "fabric/rdma/rdma_private.h"

namespace ibtrs::fabric::rdma {
namespace {

// Completions moved per ibv_poll_cq call (ibv_wc is 48 bytes: this stays on the stack).
constexpr int kPollBatch = 32;

WcStatus to_status(ibv_wc_status s) {
  switch (s) {
    case IBV_WC_SUCCESS: return WcStatus::success;
    case IBV_WC_WR_FLUSH_ERR: return WcStatus::flush_error;
    case IBV_WC_LOC_LEN_ERR: return WcStatus::local_length_error;
    case IBV_WC_LOC_PROT_ERR: return WcStatus::local_protection_error;
    case IBV_WC_REM_ACCESS_ERR: return WcStatus::remote_access_error;
    case IBV_WC_REM_INV_REQ_ERR: return WcStatus::remote_invalid_request;
    case IBV_WC_REM_OP_ERR: return WcStatus::remote_operation_error;
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR: return WcStatus::retry_exceeded;
    default: return WcStatus::fatal_error;
  }
}

}  // namespace

Result<std::unique_ptr<CompletionQueue>> RdmaDomain::create_cq(uint32_t capacity) {
  if (capacity == 0 || capacity > INT_MAX) return errc(EINVAL);
  ibv_comp_channel* channel = ibv_create_comp_channel(ctx_);
  if (channel == nullptr) return last_error(ENOMEM);
  if (!set_nonblock(channel->fd)) {
    auto err = last_error();
    ibv_destroy_comp_channel(channel);
    return err;
  }
  ibv_cq* cq = ibv_create_cq(ctx_, static_cast<int>(capacity), nullptr, channel, 0);
  if (cq == nullptr) {
    auto err = last_error(ENOMEM);
    ibv_destroy_comp_channel(channel);
    return err;
  }
  return std::unique_ptr<CompletionQueue>(new RdmaCq(ctx_, channel, cq, capacity));
}

inline bool ConnCore::complete(const ibv_wc& wc, Completion& out) {
  out = Completion{};
  out.status = to_status(wc.status);
  if (wc.wr_id & kRecvTag) {
    uint64_t seq = wc.wr_id & ~kRecvTag;
    std::lock_guard lk(recv_mu_);
    // Receives complete in posting order; anything else is not ours.
    if (seq != rq_completed_.load(std::memory_order_relaxed) ||
        seq >= rq_posted_.load(std::memory_order_relaxed)) {
      return false;
    }
    out.wr_id = recv_ring_[seq % caps_.max_recv_wr];
    rq_completed_.store(seq + 1, std::memory_order_release);
    out.opcode = wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM ? Opcode::recv_rdma_with_imm : Opcode::recv;
    if (out.status == WcStatus::success) {
      out.byte_len = wc.byte_len;
      out.with_imm = (wc.wc_flags & IBV_WC_WITH_IMM) != 0;
      if (out.with_imm) out.imm = ntohl(wc.imm_data);
    }
  } else {
    uint64_t seq = wc.wr_id;
    std::lock_guard lk(send_mu_);
    // A completion for `seq` retires it and every earlier, unsignalled request.
    if (seq < sq_completed_.load(std::memory_order_relaxed) ||
        seq >= sq_posted_.load(std::memory_order_relaxed)) {
      return false;
    }
    const SendSlot& slot = send_ring_[seq % caps_.max_send_wr];
    out.wr_id = slot.wr_id;
    out.opcode = slot.opcode;
    sq_completed_.store(seq + 1, std::memory_order_release);
  }
  return true;
}

size_t RdmaCq::poll(std::span<Completion> out) {
  size_t n = 0;
  ibv_wc wc[kPollBatch];
  ConnCore* failed[kPollBatch];
  std::lock_guard lk(mu_);
  while (n < out.size()) {
    int want = static_cast<int>(std::min<size_t>(kPollBatch, out.size() - n));
    int got = ibv_poll_cq(cq_, want, wc);
    if (got <= 0) break;
    int nfailed = 0;
    for (int i = 0; i < got; ++i) {
      ConnCore* core = last_core_;
      if (wc[i].qp_num != last_qp_) {
        auto it = qps_.find(wc[i].qp_num);
        core = it == qps_.end() ? nullptr : it->second;
        last_qp_ = wc[i].qp_num;
        last_core_ = core;
      }
      if (core == nullptr || !core->complete(wc[i], out[n])) continue;
      ++n;
      // The QP is in error (verbs moved it there, or it flushes because it was moved); make the
      // connection say so and tell the peer.
      if (wc[i].status != IBV_WC_SUCCESS && core->state() == ConnState::connected) {
        failed[nfailed++] = core;
      }
    }
    for (int i = 0; i < nfailed; ++i) failed[i]->to_error(ConnState::error, EIO);
    if (got < want) break;
  }
  return n;
}

}  // namespace ibtrs::fabric::rdma
