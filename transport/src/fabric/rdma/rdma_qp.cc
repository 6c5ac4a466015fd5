// A connection's RC queue pair (ConnCore): made on its cm id and attached to its CQ, moved to
// the fabric's event channel once established, posting sends, receives and memory window binds
// through its rings, the move to error (DREQ, flush, on_disconnected queued) and teardown; and
// the Connection that fronts it.
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <cerrno>

#include "fabric/rdma/rdma_private.h"

namespace ibtrs::fabric::rdma {
namespace {

// Inline sends skip the DMA read of small payloads; rxe and most HCAs support 64 bytes.
constexpr uint32_t kWantInline = 64;

class RdmaConnection final : public Connection {
 public:
  explicit RdmaConnection(std::shared_ptr<ConnCore> core) : core_(std::move(core)) {}
  ~RdmaConnection() override { core_->destroy(); }

  ibtrs::Status post_send(std::span<const SendWr> wrs) override { return core_->post_send(wrs); }
  ibtrs::Status post_recv(std::span<const RecvWr> wrs) override { return core_->post_recv(wrs); }
  Result<uint32_t> bind_mw(MemoryWindow& mw, const MemoryRegion& mr, uint64_t addr, uint64_t len,
                           uint32_t access) override {
    return core_->bind_mw(mw, mr, addr, len, access);
  }
  Result<bool> invalidate_mw(MemoryWindow& mw, uint64_t wr_id) override {
    return core_->invalidate_mw(mw, wr_id);
  }
  void disconnect() override { core_->to_error(ConnState::closed, ECONNABORTED); }
  ConnState state() const override { return core_->state(); }
  const QueueCaps& caps() const override { return core_->caps(); }
  uint32_t send_queue_free() const override { return core_->send_queue_free(); }
  const Address& local_address() const override { return core_->local_address(); }
  const Address& peer_address() const override { return core_->peer_address(); }
  std::string device_name() const override { return core_->device_name(); }
  uint8_t port_num() const override { return core_->port_num(); }

 private:
  std::shared_ptr<ConnCore> core_;
};

}  // namespace

ibtrs::Status ConnCore::init(IdPtr id) {
  BASE_TRY(cq_.reserve(caps_));
  ibv_qp_init_attr attr{};
  attr.send_cq = cq_.cq();
  attr.recv_cq = cq_.cq();
  attr.qp_type = IBV_QPT_RC;
  attr.sq_sig_all = 0;
  auto set_caps = [&](uint32_t inline_bytes) {
    attr.cap.max_send_wr = caps_.max_send_wr;
    attr.cap.max_recv_wr = caps_.max_recv_wr;
    attr.cap.max_send_sge = caps_.max_send_sge;
    attr.cap.max_recv_sge = caps_.max_recv_sge;
    attr.cap.max_inline_data = inline_bytes;
  };
  set_caps(kWantInline);
  if (rdma_create_qp(id.get(), domain_.pd(), &attr) != 0) {
    set_caps(0);  // the device may not do inline data at all
    if (rdma_create_qp(id.get(), domain_.pd(), &attr) != 0) {
      auto err = last_error(ENOMEM);
      cq_.unreserve(caps_);
      return err;
    }
  }
  id_ = id.release();
  qp_ = id_->qp;
  qp_num_ = qp_->qp_num;
  max_inline_ = attr.cap.max_inline_data;
  cq_.add_qp(qp_num_, this);
  cq_attached_ = true;

  local_ = to_address(rdma_get_local_addr(id_));
  peer_ = to_address(rdma_get_peer_addr(id_));
  device_name_ = ibv_get_device_name(id_->verbs->device);
  port_num_ = id_->port_num;

  send_ring_.resize(caps_.max_send_wr);
  send_wrs_.resize(caps_.max_send_wr);
  send_sges_.resize(size_t{caps_.max_send_wr} * caps_.max_send_sge);
  recv_ring_.resize(caps_.max_recv_wr);
  recv_wrs_.resize(caps_.max_recv_wr);
  recv_sges_.resize(size_t{caps_.max_recv_wr} * caps_.max_recv_sge);

  fabric_.register_core(shared_from_this());
  registered_ = true;
  return {};
}

ibtrs::Status ConnCore::migrate(rdma_event_channel* channel) {
  std::lock_guard lk(cm_mu_);
  if (rdma_migrate_id(id_, channel) != 0) return last_error();
  cm_ready_ = true;
  // An error seen while the id was still on its setup channel could not send the DREQ.
  if (state() != ConnState::connected) send_disconnect_locked();
  return {};
}

void ConnCore::send_disconnect_locked() {
  if (!cm_ready_ || disconnect_sent_) return;
  disconnect_sent_ = true;
  // Sends a DREQ, or the DREP when the peer's DREQ came first; the kernel's DREP/DREQ timeout
  // then produces our DISCONNECTED event.
  rdma_disconnect(id_);
}

void ConnCore::to_error(ConnState to, int cause) {
  ConnState expected = ConnState::connected;
  if (!state_.compare_exchange_strong(expected, to, std::memory_order_acq_rel)) return;
  cause_.store(cause, std::memory_order_release);
  {
    std::lock_guard lk(cm_mu_);
    send_disconnect_locked();
  }
  // rdma_disconnect already does this on IB; iWARP only drains to SQD there, and before
  // migrate() nothing did. ERR is what makes every outstanding request flush.
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_ERR;
  ibv_modify_qp(qp_, &attr, IBV_QP_STATE);
  fabric_.queue_notification(shared_from_this());
}

void ConnCore::comm_established() {
  std::lock_guard lk(cm_mu_);
  rdma_notify(id_, IBV_EVENT_COMM_EST);
}

void ConnCore::destroy() {
  if (registered_) fabric_.unregister_core(this);
  if (cq_attached_) cq_.detach(qp_num_, caps_);
  if (id_ == nullptr) return;
  // A disconnect that could not go out (setup failed before migrate()) is implied by destroying
  // the id: the kernel CM sends the DREQ or REJ itself.
  to_error(ConnState::closed, ECONNABORTED);
  rdma_destroy_qp(id_);
  rdma_destroy_id(id_);
  id_ = nullptr;
  qp_ = nullptr;
}

ibtrs::Status ConnCore::post_send(std::span<const SendWr> wrs) {
  if (state() != ConnState::connected) return errc(ENOTCONN);
  if (wrs.empty()) return {};
  if (wrs.size() > caps_.max_send_wr) return errc(ENOMEM);  // can never fit: the queue is full
  BASE_TRY(check_send_batch(wrs, caps_));

  std::lock_guard lk(send_mu_);
  if (state() != ConnState::connected) return errc(ENOTCONN);
  uint64_t posted = sq_posted_.load(std::memory_order_relaxed);
  uint64_t used = posted - sq_completed_.load(std::memory_order_acquire);
  if (caps_.max_send_wr - used < wrs.size()) return errc(ENOMEM);

  size_t sge_at = 0;
  for (size_t i = 0; i < wrs.size(); ++i) {
    const SendWr& in = wrs[i];
    uint64_t seq = posted + i;
    send_ring_[seq % caps_.max_send_wr] = SendSlot{in.wr_id, in.opcode};
    ibv_send_wr& wr = send_wrs_[i];
    wr = ibv_send_wr{};
    wr.wr_id = seq;
    wr.next = i + 1 < wrs.size() ? &send_wrs_[i + 1] : nullptr;
    wr.sg_list = in.sg_list.empty() ? nullptr : &send_sges_[sge_at];
    wr.num_sge = static_cast<int>(in.sg_list.size());
    uint64_t total = 0;
    for (const Sge& s : in.sg_list) {
      send_sges_[sge_at++] = ibv_sge{s.addr, s.length, s.lkey};
      total += s.length;
    }
    switch (in.opcode) {
      case Opcode::send:
        wr.opcode = IBV_WR_SEND;
        break;
      case Opcode::write_with_imm:
        wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
        wr.imm_data = htonl(in.imm);
        wr.wr.rdma.remote_addr = in.remote_addr;
        wr.wr.rdma.rkey = in.rkey;
        break;
      default:
        wr.opcode = IBV_WR_RDMA_WRITE;
        wr.wr.rdma.remote_addr = in.remote_addr;
        wr.wr.rdma.rkey = in.rkey;
        break;
    }
    if (in.signaled) wr.send_flags |= IBV_SEND_SIGNALED;
    if (total > 0 && total <= max_inline_ && domain_.covers(in.sg_list)) {
      wr.send_flags |= IBV_SEND_INLINE;
    }
  }

  ibv_send_wr* bad = nullptr;
  int rc = ibv_post_send(qp_, send_wrs_.data(), &bad);
  if (rc != 0) {
    // Requests before `bad` are on the queue and will complete; they keep their slots.
    size_t accepted = bad != nullptr ? static_cast<size_t>(bad - send_wrs_.data()) : 0;
    sq_posted_.store(posted + accepted, std::memory_order_release);
    return errc(rc);
  }
  sq_posted_.store(posted + wrs.size(), std::memory_order_release);
  return {};
}

ibtrs::Status ConnCore::post_local(ibv_send_wr& wr, uint64_t user_wr_id) {
  std::lock_guard lk(send_mu_);
  if (state() != ConnState::connected) return errc(ENOTCONN);
  const uint64_t posted = sq_posted_.load(std::memory_order_relaxed);
  if (posted - sq_completed_.load(std::memory_order_acquire) >= caps_.max_send_wr)
    return errc(ENOMEM);
  // Completes (when signalled, or in error) as local_inv with the caller's wr_id; an
  // unsignalled bind is retired by a later completion like any unsignalled request.
  send_ring_[posted % caps_.max_send_wr] = SendSlot{user_wr_id, Opcode::local_inv};
  wr.wr_id = posted;
  wr.next = nullptr;
  ibv_send_wr* bad = nullptr;
  if (int rc = ibv_post_send(qp_, &wr, &bad); rc != 0) return errc(rc);
  sq_posted_.store(posted + 1, std::memory_order_release);
  return {};
}

inline Result<uint32_t> ConnCore::bind_mw(MemoryWindow& mw_base, const MemoryRegion& mr_base,
                                          uint64_t addr, uint64_t len, uint32_t access) {
  auto* mw = dynamic_cast<RdmaMw*>(&mw_base);
  auto* mr = dynamic_cast<const RdmaMr*>(&mr_base);
  if (mw == nullptr || mr == nullptr || &mw->domain() != &domain_ || &mr->domain() != &domain_ ||
      mr->mr() == nullptr || mw->mw() == nullptr || mw->state == RdmaMw::State::bound)
    return errc(EINVAL);
  constexpr uint32_t kRemote = kRemoteWrite | kRemoteRead;
  if (len == 0 || access == 0 || (access & ~kRemote) != 0 || (mr->access() & kMwBind) == 0)
    return errc(EINVAL);
  const uint64_t base = mr->remote_addr();
  if (addr < base || addr - base > mr->length() || len > mr->length() - (addr - base))
    return errc(EINVAL);
  const uint32_t key = mw->next_key();
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_BIND_MW;
  wr.bind_mw.mw = mw->mw();
  wr.bind_mw.rkey = key;
  wr.bind_mw.bind_info.mr = mr->mr();
  wr.bind_mw.bind_info.addr = addr;
  wr.bind_mw.bind_info.length = len;
  wr.bind_mw.bind_info.mw_access_flags =
      ((access & kRemoteWrite) ? IBV_ACCESS_REMOTE_WRITE : 0) |
      ((access & kRemoteRead) ? IBV_ACCESS_REMOTE_READ : 0);
  BASE_TRY(post_local(wr, 0));
  // For type 2 windows the consumer keeps ibv_mw::rkey current: the next bind names the window
  // by it (rxe refuses a bind whose window key is not the current one).
  mw->mw()->rkey = key;
  mw->bound(this, key);
  return key;
}

inline Result<bool> ConnCore::invalidate_mw(MemoryWindow& mw_base, uint64_t wr_id) {
  auto* mw = dynamic_cast<RdmaMw*>(&mw_base);
  if (mw == nullptr || &mw->domain() != &domain_ || mw->bound_on() != this) return errc(EINVAL);
  if (mw->state == RdmaMw::State::unbound) return true;
  if (state() == ConnState::connected) {
    // A LOCAL_INV already on its way answers for this call too.
    if (mw->state == RdmaMw::State::invalidating) return false;
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_LOCAL_INV;
    wr.invalidate_rkey = mw->rkey();
    wr.send_flags = IBV_SEND_SIGNALED;
    auto st = post_local(wr, wr_id);
    if (st.ok()) {
      mw->state = RdmaMw::State::invalidating;
      return false;
    }
    if (st.error() != errc(ENOTCONN)) return st.error();
  }
  // No LOCAL_INV can run on this queue pair any more: deallocating the window revokes it.
  BASE_TRY(mw->replace());
  return true;
}

inline ibtrs::Status ConnCore::post_recv(std::span<const RecvWr> wrs) {
  if (state() != ConnState::connected) return errc(ENOTCONN);
  if (wrs.empty()) return {};
  if (wrs.size() > caps_.max_recv_wr) return errc(ENOMEM);
  BASE_TRY(check_recv_batch(wrs, caps_));

  std::lock_guard lk(recv_mu_);
  if (state() != ConnState::connected) return errc(ENOTCONN);
  uint64_t posted = rq_posted_.load(std::memory_order_relaxed);
  uint64_t used = posted - rq_completed_.load(std::memory_order_acquire);
  if (caps_.max_recv_wr - used < wrs.size()) return errc(ENOMEM);

  size_t sge_at = 0;
  for (size_t i = 0; i < wrs.size(); ++i) {
    const RecvWr& in = wrs[i];
    uint64_t seq = posted + i;
    recv_ring_[seq % caps_.max_recv_wr] = in.wr_id;
    ibv_recv_wr& wr = recv_wrs_[i];
    wr = ibv_recv_wr{};
    wr.wr_id = seq | kRecvTag;
    wr.next = i + 1 < wrs.size() ? &recv_wrs_[i + 1] : nullptr;
    wr.sg_list = in.sg_list.empty() ? nullptr : &recv_sges_[sge_at];
    wr.num_sge = static_cast<int>(in.sg_list.size());
    for (const Sge& s : in.sg_list) recv_sges_[sge_at++] = ibv_sge{s.addr, s.length, s.lkey};
  }

  ibv_recv_wr* bad = nullptr;
  int rc = ibv_post_recv(qp_, recv_wrs_.data(), &bad);
  if (rc != 0) {
    size_t accepted = bad != nullptr ? static_cast<size_t>(bad - recv_wrs_.data()) : 0;
    rq_posted_.store(posted + accepted, std::memory_order_release);
    return errc(rc);
  }
  rq_posted_.store(posted + wrs.size(), std::memory_order_release);
  return {};
}

std::unique_ptr<Connection> make_connection(std::shared_ptr<ConnCore> core) {
  return std::make_unique<RdmaConnection>(std::move(core));
}

}  // namespace ibtrs::fabric::rdma
