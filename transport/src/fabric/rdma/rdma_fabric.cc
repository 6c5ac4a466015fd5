// The rdma provider: RC queue pairs over rdma-core (librdmacm + libibverbs).
//
// Threads and channels.
//   - Setup runs on the caller's thread over a private rdma_event_channel per id (connect, each
//     received request), polled with the caller's deadline. Once ESTABLISHED is acked the id is
//     migrated (rdma_migrate_id) to the fabric's channel. A private channel means no other
//     thread reads events of a half-established id, which rdma_migrate_id forbids while it runs,
//     and accept() never competes with get_request() for the listener's channel.
//   - One cm event thread per fabric reads the fabric channel (DISCONNECTED, DEVICE_REMOVAL,
//     ADDR_CHANGE, TIMEWAIT_EXIT of established ids), the async event fd of every device in use
//     (QP fatal errors, COMM_EST) and a queue of pending on_disconnected notifications. It is the
//     only thread that runs ConnectionEvents::on_disconnected. librdmacm opens one ibv_context
//     per device per process, so fabrics in one process share async fds: QPs are looked up in a
//     process-wide table and whichever fabric's thread reads the event dispatches it.
//
// Teardown (where rdma_cm code usually deadlocks): rdma_destroy_id blocks until every event of the
// id that was read from its channel is acked, ibv_destroy_qp likewise for async events. The event
// thread therefore never blocks between reading an event and acking it: it looks the id up under
// the fabric mutex (counting the connection as being dispatched), acks, and only then acts. A
// connection being destroyed first unregisters itself under that mutex and waits until no thread
// is dispatching it; after that no thread touches its id or QP, and destroying them can only wait
// for acks that come without any lock the destroyer holds. Looking up before acking also closes
// the window in which a freed id's address could be reused by a new connection while a stale
// event still names it.
//
// Protection domains and windows. Every Domain is one ibv_pd: the device's default one (made on
// first use of the device, alongside its async-event fd) and those of alloc_pd(). CQs belong to
// the device (ibv_cq has no PD), so any domain's connections may share them. Memory windows are
// verbs type 2 (ibv_alloc_mw, IBV_WR_BIND_MW, IBV_WR_LOCAL_INV): a bind and a revocation are
// work requests on the connection's send queue, in its ring like any other. The key of a bind
// is the window's index with a fresh random low byte (the 8 key bits verbs lets the consumer
// choose).
//
// Completions. The wr_id given to verbs is not the user's: it is a per-connection sequence
// number (bit 63 set for receives), and the user's wr_id and opcode sit in a ring indexed by it.
// That gives exact send-queue accounting under selective signalling (a completion for sequence s
// retires every earlier unsignalled request), tells send from receive completions in error (verbs
// leaves wc.opcode undefined then) and reports write_with_imm for a WRITE_WITH_IMM's send
// completion, where verbs says IBV_WC_RDMA_WRITE for both writes. Completions of a connection
// already destroyed are dropped: their wr_id can no longer be translated.
#include <arpa/inet.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <rdma/rdma_cma.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <unordered_map>

#include "fabric/secure_random.h"
#include "fabric/providers.h"
#include "fabric/rdma/rdma_private_data.h"
#include "ibtrs/gid.h"

namespace ibtrs::fabric {
namespace {

using Clock = std::chrono::steady_clock;

// Address resolution is an ARP/ND exchange; a longer wait only delays the error.
constexpr std::chrono::milliseconds kResolveAddrTimeout{2000};
// accept() has no timeout parameter; RTRS's connect timeout bounds the wait for the RTU.
constexpr std::chrono::milliseconds kAcceptTimeout{30000};
// Inline sends skip the DMA read of small payloads; rxe and most HCAs support 64 bytes.
constexpr uint32_t kWantInline = 64;
// RC retry counts: 7 is "infinite" for RNR, which fabric.h promises (the sender waits for a RECV).
constexpr uint8_t kRetryCount = 7;
constexpr uint8_t kRnrRetryCount = 7;
// Completions moved per ibv_poll_cq call (ibv_wc is 48 bytes: this stays on the stack).
constexpr int kPollBatch = 32;
// wr_id tag of receive requests; send requests carry their plain sequence number.
constexpr uint64_t kRecvTag = 1ull << 63;

std::error_code last_error(int fallback = EIO) { return errc(errno != 0 ? errno : fallback); }

int ms_left(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  if (left.count() <= 0) return 0;
  return left.count() > INT_MAX ? INT_MAX : static_cast<int>(left.count());
}

bool set_nonblock(int fd) {
  int flags = fcntl(fd, F_GETFL);
  return flags >= 0 && fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0;
}

Address to_address(const sockaddr* sa) {
  Address a;
  a.fabric = FabricKind::rdma;
  if (sa == nullptr) return a;
  if (sa->sa_family == AF_INET) {
    sockaddr_in sin;
    std::memcpy(&sin, sa, sizeof(sin));
    std::memcpy(&a.sa, &sin, sizeof(sin));
    a.port = ntohs(sin.sin_port);
  } else if (sa->sa_family == AF_INET6) {
    sockaddr_in6 sin6;
    std::memcpy(&sin6, sa, sizeof(sin6));
    std::memcpy(&a.sa, &sin6, sizeof(sin6));
    a.port = ntohs(sin6.sin6_port);
  }
  return a;
}

bool valid_ip_address(const Address& a) {
  return a.fabric == FabricKind::rdma && (a.family() == AF_INET || a.family() == AF_INET6);
}

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

bool is_iwarp(const ibv_context* ctx) {
  return ctx != nullptr && ctx->device->transport_type == IBV_TRANSPORT_IWARP;
}

struct ChannelDeleter {
  void operator()(rdma_event_channel* ch) const { rdma_destroy_event_channel(ch); }
};
using ChannelPtr = std::unique_ptr<rdma_event_channel, ChannelDeleter>;

Result<ChannelPtr> make_channel() {
  errno = 0;
  ChannelPtr ch(rdma_create_event_channel());
  if (!ch) return errno == ENOENT ? errc(ENODEV) : last_error(ENODEV);
  if (!set_nonblock(ch->fd)) return last_error();
  return ch;
}

// An id that is not (yet) owned by a connection. Destroying it blocks until its events are
// acked; every path here acks an event right after copying it.
struct IdDeleter {
  void operator()(rdma_cm_id* id) const {
    if (id->qp != nullptr) rdma_destroy_qp(id);
    rdma_destroy_id(id);
  }
};
using IdPtr = std::unique_ptr<rdma_cm_id, IdDeleter>;

// The parts of an rdma_cm_event that outlive its ack.
struct CmEvent {
  rdma_cm_event_type type = RDMA_CM_EVENT_ADDR_ERROR;
  int status = 0;
  rdma_cm_id* id = nullptr;
  uint8_t responder_resources = 0;
  uint8_t initiator_depth = 0;
  uint8_t private_data_len = 0;
  std::byte private_data[UINT8_MAX];  // rdma_conn_param::private_data_len is a uint8_t

  std::span<const std::byte> data() const { return {private_data, private_data_len}; }
};

void copy_event(const rdma_cm_event& ev, CmEvent& out) {
  out.type = ev.event;
  out.status = ev.status;
  out.id = ev.id;
  out.responder_resources = ev.param.conn.responder_resources;
  out.initiator_depth = ev.param.conn.initiator_depth;
  out.private_data_len = 0;
  if (ev.param.conn.private_data != nullptr) {
    out.private_data_len = ev.param.conn.private_data_len;  // a uint8_t: always fits
    std::memcpy(out.private_data, ev.param.conn.private_data, out.private_data_len);
  }
}

// Waits for the next event on a private (setup) channel and acks it. ETIMEDOUT past `deadline`,
// ECANCELED once `cancel_fd` (if any) is readable.
ibtrs::Status next_event(rdma_event_channel* ch, Clock::time_point deadline, CmEvent& out,
                         int cancel_fd = -1) {
  for (;;) {
    rdma_cm_event* ev = nullptr;
    if (rdma_get_cm_event(ch, &ev) == 0) {
      copy_event(*ev, out);
      rdma_ack_cm_event(ev);
      return {};
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return last_error();
    int left = ms_left(deadline);
    if (left == 0) return errc(ETIMEDOUT);
    pollfd pfd[2] = {{ch->fd, POLLIN, 0}, {cancel_fd, POLLIN, 0}};
    if (::poll(pfd, cancel_fd >= 0 ? 2 : 1, left) > 0 && cancel_fd >= 0 && (pfd[1].revents & POLLIN))
      return errc(ECANCELED);
  }
}

// Address/route resolution failures as connect() reports them.
std::error_code resolve_error(const CmEvent& ev) {
  int e = ev.status < 0 ? -ev.status : ev.status;
  if (e == ENETUNREACH || e == ENODEV || e == EADDRNOTAVAIL) return errc(ENETUNREACH);
  return errc(EHOSTUNREACH);
}

class RdmaFabric;
class RdmaDomain;
class RdmaCq;

// ---------------------------------------------------------------------------------------------
// Connection state shared by the Connection object, the CQ's qp table and the cm event thread.
// Owned by shared_ptr so a queued notification never dangles; its verbs/cm resources are
// released by destroy(), called once by the owner.

struct SendSlot {
  uint64_t wr_id;
  Opcode opcode;
};

class ConnCore : public std::enable_shared_from_this<ConnCore> {
 public:
  ConnCore(RdmaFabric& fabric, RdmaDomain& domain, RdmaCq& cq, const QueueCaps& caps,
           ConnectionEvents events)
      : fabric_(fabric), domain_(domain), cq_(cq), caps_(caps), events_(std::move(events)) {}

  // Creates the QP on `id` (which this core then owns), attaches it to the CQ and registers it
  // with the fabric. The id stays on its setup channel until migrate().
  ibtrs::Status init(IdPtr id);

  // Moves the id from its setup channel to the fabric's, where the event thread sees its
  // disconnects. Every event read from the setup channel must be acked (rdma_migrate_id waits).
  ibtrs::Status migrate(rdma_event_channel* channel);
  // Releases everything; afterwards no thread refers to the id or the QP.
  void destroy();

  // Leaves the connected state once: QP to error (everything outstanding flushes), DREQ/DREP to
  // the peer, on_disconnected queued for the event thread.
  void to_error(ConnState to, int cause);
  // IBV_EVENT_COMM_EST: data arrived before the RTU; the CM must be told (rdma_notify).
  void comm_established();

  ibtrs::Status post_send(std::span<const SendWr> wrs);
  ibtrs::Status post_recv(std::span<const RecvWr> wrs);
  Result<uint32_t> bind_mw(MemoryWindow& mw, const MemoryRegion& mr, uint64_t addr, uint64_t len,
                           uint32_t access);
  Result<bool> invalidate_mw(MemoryWindow& mw, uint64_t wr_id);
  // Translate one work completion of this QP; false when it is stale.
  bool complete(const ibv_wc& wc, Completion& out);

  uint32_t send_queue_free() const {
    uint64_t used = sq_posted_.load(std::memory_order_acquire) -
                    sq_completed_.load(std::memory_order_acquire);
    return used >= caps_.max_send_wr ? 0 : caps_.max_send_wr - static_cast<uint32_t>(used);
  }

  ConnState state() const { return state_.load(std::memory_order_acquire); }
  int cause() const { return cause_.load(std::memory_order_acquire); }
  const QueueCaps& caps() const { return caps_; }
  const ConnectionEvents& events() const { return events_; }
  rdma_cm_id* id() const { return id_; }
  uint32_t qp_num() const { return qp_num_; }
  ibv_context* context() const;
  const Address& local_address() const { return local_; }
  const Address& peer_address() const { return peer_; }
  const std::string& device_name() const { return device_name_; }
  uint8_t port_num() const { return port_num_; }

  RdmaFabric& fabric() const { return fabric_; }

  // Guarded by the owning fabric's mutex: unregistered, and how many threads are acting on an
  // event for this connection right now.
  bool detached = false;
  int dispatching = 0;

 private:
  void send_disconnect_locked();
  // Posts one local work request (a bind or a LOCAL_INV) through the send ring.
  ibtrs::Status post_local(ibv_send_wr& wr, uint64_t user_wr_id);

  RdmaFabric& fabric_;
  RdmaDomain& domain_;
  RdmaCq& cq_;
  QueueCaps caps_;
  ConnectionEvents events_;
  rdma_cm_id* id_ = nullptr;
  ibv_qp* qp_ = nullptr;
  uint32_t qp_num_ = 0;
  uint32_t max_inline_ = 0;
  bool cq_attached_ = false;
  bool registered_ = false;
  Address local_;
  Address peer_;
  std::string device_name_;
  uint8_t port_num_ = 0;

  std::atomic<ConnState> state_{ConnState::connected};
  std::atomic<int> cause_{0};

  // cm_mu_ orders rdma_disconnect/rdma_notify against rdma_migrate_id, which rewrites
  // id->channel, and makes the disconnect go out once.
  std::mutex cm_mu_;
  bool cm_ready_ = false;
  bool disconnect_sent_ = false;

  // Send queue: ring of posted requests, indexed by sequence number % max_send_wr. The scratch
  // arrays let a batch go to ibv_post_send in one call without allocating.
  std::mutex send_mu_;
  std::vector<SendSlot> send_ring_;
  std::atomic<uint64_t> sq_posted_{0};
  std::atomic<uint64_t> sq_completed_{0};
  std::vector<ibv_send_wr> send_wrs_;
  std::vector<ibv_sge> send_sges_;

  std::mutex recv_mu_;
  std::vector<uint64_t> recv_ring_;
  std::atomic<uint64_t> rq_posted_{0};
  std::atomic<uint64_t> rq_completed_{0};
  std::vector<ibv_recv_wr> recv_wrs_;
  std::vector<ibv_sge> recv_sges_;
};

// ---------------------------------------------------------------------------------------------

class RdmaMr final : public MemoryRegion {
 public:
  RdmaMr(RdmaDomain& domain, ibv_mr* mr, uint32_t access);
  ~RdmaMr() override;
  ibtrs::Status revoke() override;
  Result<uint32_t> restore() override;
  Result<uint32_t> rekey() override;

  ibv_mr* mr() const { return mr_; }
  RdmaDomain& domain() const { return domain_; }

 private:
  void release();
  RdmaDomain& domain_;
  ibv_mr* mr_;  // null while revoked
};

class RdmaMw final : public MemoryWindow {
 public:
  RdmaMw(RdmaDomain& domain, ibv_mw* mw) : domain_(domain), mw_(mw) {}
  ~RdmaMw() override;

  RdmaDomain& domain() const { return domain_; }
  ibv_mw* mw() const { return mw_; }
  // The next key: the window's index with a fresh random key byte.
  uint32_t next_key() const {
    uint32_t key = secure_random_u32() & 0xff;
    if (key == (rkey_ & 0xff)) key ^= 1;
    return (mw_->rkey & ~0xffu) | key;
  }
  void bound(const ConnCore* on, uint32_t key) {
    bound_on_ = on;
    rkey_ = key;
    state = State::bound;
  }
  // unbound; bound; invalidating: a LOCAL_INV is posted. A window may be bound when unbound or
  // invalidating: a bind on the queue pair of the LOCAL_INV runs after it (send queue order).
  enum class State : uint8_t { unbound, bound, invalidating };
  State state = State::unbound;
  const ConnCore* bound_on() const { return bound_on_; }
  // Swaps in a fresh ibv_mw: what unbinds a window whose connection can no longer run a
  // LOCAL_INV (deallocating a bound type 2 window revokes it).
  ibtrs::Status replace();

 private:
  RdmaDomain& domain_;
  ibv_mw* mw_;
  const ConnCore* bound_on_ = nullptr;  // the connection of the current or last binding
};

class RdmaDomain final : public Domain {
 public:
  RdmaDomain(RdmaFabric& fabric, ibv_context* ctx, ibv_pd* pd, uint32_t max_keys)
      : fabric_(fabric), ctx_(ctx), pd_(pd), max_keys_(max_keys == 0 ? UINT32_MAX : max_keys) {}
  ~RdmaDomain() override { ibv_dealloc_pd(pd_); }

  std::string device_name() const override { return ibv_get_device_name(ctx_->device); }
  Result<std::unique_ptr<Domain>> alloc_pd(const PdAttr& attr) override;
  Result<std::unique_ptr<MemoryRegion>> register_memory(void* addr, size_t length,
                                                        uint32_t access) override;
  Result<std::unique_ptr<MemoryWindow>> alloc_mw() override;
  uint32_t mw_send_slots() const override { return 1; }
  Result<std::unique_ptr<CompletionQueue>> create_cq(uint32_t capacity) override;
  Result<ConnectResult> connect(const ConnectParams& params,
                                std::vector<std::byte>* reject_data) override;

  RdmaFabric& fabric() { return fabric_; }
  ibv_context* context() const { return ctx_; }
  ibv_pd* pd() const { return pd_; }

  // Whether every SGE lies inside a live region of this domain. Inline sends are copied by the
  // CPU and never checked against their lkey, so the provider checks before sending inline and
  // leaves anything else to the HCA (local_protection_error).
  bool covers(std::span<const Sge> sges) const;
  void track(const ibv_mr* mr);
  void untrack(const ibv_mr* mr);
  // Counts a key (region or window) against max_keys: ENOMEM when the domain is full.
  ibtrs::Status take_key() {
    uint32_t n = keys_.load(std::memory_order_relaxed);
    do {
      if (n >= max_keys_) return errc(ENOMEM);
    } while (!keys_.compare_exchange_weak(n, n + 1, std::memory_order_relaxed));
    return {};
  }
  void put_key() { keys_.fetch_sub(1, std::memory_order_relaxed); }
  // ibv_reg_mr with our access bits.
  Result<ibv_mr*> reg(void* addr, size_t length, uint32_t access);

 private:
  struct Range {
    uint64_t addr;
    uint64_t length;
  };
  RdmaFabric& fabric_;
  ibv_context* ctx_;
  ibv_pd* pd_;
  const uint32_t max_keys_;
  std::atomic<uint32_t> keys_{0};
  mutable std::shared_mutex mr_mu_;
  std::unordered_map<uint32_t, Range> mrs_;  // by lkey
};

class RdmaCq final : public CompletionQueue {
 public:
  RdmaCq(ibv_context* ctx, ibv_comp_channel* channel, ibv_cq* cq, uint32_t capacity)
      : CompletionQueue(capacity), ctx_(ctx), channel_(channel), cq_(cq) {}
  ~RdmaCq() override {
    ack_events();  // ibv_destroy_cq waits until every event read from the channel is acked
    ibv_destroy_cq(cq_);
    ibv_destroy_comp_channel(channel_);
  }

  size_t poll(std::span<Completion> out) override;
  int fd() const override { return channel_->fd; }
  ibtrs::Status arm() override {
    int rc = ibv_req_notify_cq(cq_, 0);
    return rc == 0 ? ibtrs::Status{} : ibtrs::Status{errc(rc)};
  }
  void ack_events() override {
    unsigned n = 0;
    ibv_cq* ev_cq = nullptr;
    void* ev_ctx = nullptr;
    while (ibv_get_cq_event(channel_, &ev_cq, &ev_ctx) == 0) ++n;
    if (n > 0) ibv_ack_cq_events(cq_, n);
  }

  // The device: connections of every domain on it may use this CQ.
  ibv_context* context() const { return ctx_; }
  ibv_cq* cq() const { return cq_; }

  void detach(uint32_t qp_num, const QueueCaps& caps) {
    std::lock_guard lk(mu_);
    reserved_ -= uint64_t{caps.max_send_wr} + caps.max_recv_wr;
    qps_.erase(qp_num);
    last_qp_ = UINT32_MAX;
    last_core_ = nullptr;
  }
  // Reserves room for a QP's queues before the QP exists: a CQ overrun is a fatal verbs error,
  // and at most one completion per outstanding work request can be queued.
  ibtrs::Status reserve(const QueueCaps& caps) {
    uint64_t need = uint64_t{caps.max_send_wr} + caps.max_recv_wr;
    std::lock_guard lk(mu_);
    if (reserved_ + need > capacity()) return errc(ENOSPC);
    reserved_ += need;
    return {};
  }
  void unreserve(const QueueCaps& caps) {
    std::lock_guard lk(mu_);
    reserved_ -= uint64_t{caps.max_send_wr} + caps.max_recv_wr;
  }
  void add_qp(uint32_t qp_num, ConnCore* core) {
    std::lock_guard lk(mu_);
    qps_[qp_num] = core;
    last_qp_ = UINT32_MAX;
  }

 private:
  ibv_context* ctx_;
  ibv_comp_channel* channel_;
  ibv_cq* cq_;
  // Held across a whole poll(): detach() takes it, so a core found in qps_ stays alive until poll
  // returns. Only the CQ owner polls; connection setup and teardown are the only other takers.
  std::mutex mu_;
  uint64_t reserved_ = 0;
  std::unordered_map<uint32_t, ConnCore*> qps_;
  uint32_t last_qp_ = UINT32_MAX;
  ConnCore* last_core_ = nullptr;
};

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

class RdmaConnectRequest final : public ConnectRequest {
 public:
  RdmaConnectRequest(RdmaFabric& fabric, RdmaDomain& domain, ChannelPtr channel, IdPtr id,
                     std::span<const std::byte> private_data)
      : fabric_(fabric),
        domain_(domain),
        channel_(std::move(channel)),
        id_(std::move(id)),
        private_data_(private_data.begin(), private_data.end()),
        local_(to_address(rdma_get_local_addr(id_.get()))),
        peer_(to_address(rdma_get_peer_addr(id_.get()))) {}
  ~RdmaConnectRequest() override {
    // Neither accepted nor rejected: answer now rather than let the peer's REQ time out. (Member
    // order destroys the id before the channel it reports on.)
    if (id_) rdma_reject(id_.get(), nullptr, 0);
  }

  std::span<const std::byte> private_data() const override { return private_data_; }
  const Address& peer_address() const override { return peer_; }
  const Address& local_address() const override { return local_; }
  Domain& domain() override;
  using ConnectRequest::accept;
  Result<std::unique_ptr<Connection>> accept(Domain& pd, CompletionQueue& cq,
                                             const QueueCaps& caps,
                                             std::span<const std::byte> private_data,
                                             ConnectionEvents events) override;
  ibtrs::Status reject(std::span<const std::byte> private_data) override;

 private:
  RdmaFabric& fabric_;
  RdmaDomain& domain_;
  ChannelPtr channel_;
  IdPtr id_;
  std::vector<std::byte> private_data_;
  Address local_;
  Address peer_;
};

class RdmaListener final : public Listener {
 public:
  RdmaListener(RdmaFabric& fabric, ChannelPtr channel, IdPtr id)
      : fabric_(fabric),
        channel_(std::move(channel)),
        id_(std::move(id)),
        address_(to_address(rdma_get_local_addr(id_.get()))) {}
  // Destroying the listen id (before its channel: member order) also destroys the ids of
  // requests still queued there; the kernel CM answers them with a REJ.
  ~RdmaListener() override = default;

  Result<std::unique_ptr<ConnectRequest>> get_request(std::chrono::milliseconds timeout) override;
  int fd() const override { return channel_->fd; }
  const Address& address() const override { return address_; }

 private:
  RdmaFabric& fabric_;
  ChannelPtr channel_;
  IdPtr id_;
  Address address_;
};

// ---------------------------------------------------------------------------------------------

class RdmaFabric final : public Fabric {
 public:
  RdmaFabric(ibv_context** devices, ChannelPtr channel, int wake_fd)
      : devices_(devices), channel_(std::move(channel)), wake_fd_(wake_fd) {
    thread_ = std::thread([this] { run(); });
  }
  ~RdmaFabric() override {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    wake();
    thread_.join();
    domains_.clear();
    channel_.reset();
    ::close(wake_fd_);
    rdma_free_devices(devices_);
  }

  FabricKind kind() const override { return FabricKind::rdma; }
  Result<Domain*> domain_for(const Address& remote, const Address* source) override;
  using Fabric::listen;
  Result<std::unique_ptr<Listener>> listen(const Address& local, const ListenOptions& o) override;

  rdma_event_channel* channel() const { return channel_.get(); }
  // The domain of a device, created on first use.
  Result<RdmaDomain*> domain_for_context(ibv_context* ctx);

  void register_core(const std::shared_ptr<ConnCore>& core);
  // After this returns no event thread runs or will run anything for `core`.
  void unregister_core(ConnCore* core);
  // Counts a thread as acting on `core` unless it is unregistered.
  bool begin_dispatch(ConnCore* core) {
    std::lock_guard lk(mu_);
    return begin_dispatch_locked(core);
  }
  void end_dispatch(ConnCore* core) {
    {
      std::lock_guard lk(mu_);
      --core->dispatching;
    }
    idle_.notify_all();
  }
  void queue_notification(std::shared_ptr<ConnCore> core) {
    {
      std::lock_guard lk(mu_);
      if (core->detached) return;
      notifications_.push_back(std::move(core));
    }
    wake();
  }

 private:
  void wake() {
    uint64_t one = 1;
    ssize_t n = ::write(wake_fd_, &one, sizeof(one));
    (void)n;  // the counter saturating still leaves the fd readable
  }
  void run();
  void handle_cm_events();
  void handle_async_events(ibv_context* ctx);
  void deliver(const std::shared_ptr<ConnCore>& core);
  bool begin_dispatch_locked(ConnCore* core) {
    if (core->detached) return false;
    ++core->dispatching;
    return true;
  }

  ibv_context** devices_;  // rdma_get_devices: keeps librdmacm's device contexts open
  ChannelPtr channel_;
  int wake_fd_;
  std::thread thread_;

  std::mutex mu_;
  std::condition_variable idle_;
  bool stop_ = false;
  std::map<ibv_context*, std::unique_ptr<RdmaDomain>> domains_;
  uint64_t domains_gen_ = 0;
  std::unordered_map<rdma_cm_id*, std::shared_ptr<ConnCore>> cores_;
  std::deque<std::shared_ptr<ConnCore>> notifications_;
};

// QPs by (device context, qp_num), for async events; see the file comment.
struct AsyncQpTable {
  std::mutex mu;  // taken before a fabric's mutex, never after
  std::map<std::pair<ibv_context*, uint32_t>, ConnCore*> qps;
};
AsyncQpTable& async_qps() {
  static AsyncQpTable table;
  return table;
}

// ---------------------------------------------------------------------------------------------
// ConnCore

ibv_context* ConnCore::context() const { return domain_.context(); }

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

Result<uint32_t> ConnCore::bind_mw(MemoryWindow& mw_base, const MemoryRegion& mr_base,
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

Result<bool> ConnCore::invalidate_mw(MemoryWindow& mw_base, uint64_t wr_id) {
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

ibtrs::Status ConnCore::post_recv(std::span<const RecvWr> wrs) {
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

bool ConnCore::complete(const ibv_wc& wc, Completion& out) {
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

// ---------------------------------------------------------------------------------------------
// RdmaMr / RdmaDomain

RdmaMr::RdmaMr(RdmaDomain& domain, ibv_mr* mr, uint32_t access)
    : MemoryRegion(mr->addr, mr->length, mr->lkey, mr->rkey, access), domain_(domain), mr_(mr) {
  domain_.track(mr_);
}

RdmaMr::~RdmaMr() {
  release();
  domain_.put_key();
}

void RdmaMr::release() {
  if (mr_ == nullptr) return;
  domain_.untrack(mr_);
  ibv_dereg_mr(mr_);
  mr_ = nullptr;
  set_keys(0, 0);
}

ibtrs::Status RdmaMr::revoke() {
  release();
  return {};
}

Result<uint32_t> RdmaMr::restore() {
  // A revoked region was deregistered: it comes back registered, with the HCA's new keys.
  if (mr_ != nullptr) return mr_->rkey;
  return rekey();
}

Result<uint32_t> RdmaMr::rekey() {
  // ibv_rereg_mr keeps the keys on Soft-RoCE (and may elsewhere): a new registration is what
  // gives new ones.
  release();
  BASE_ASSIGN_OR_RETURN(mr_, domain_.reg(addr(), length(), access()));
  domain_.track(mr_);
  set_keys(mr_->lkey, mr_->rkey);
  return mr_->rkey;
}

RdmaMw::~RdmaMw() {
  if (mw_ != nullptr) ibv_dealloc_mw(mw_);
  domain_.put_key();
}

ibtrs::Status RdmaMw::replace() {
  if (mw_ != nullptr) ibv_dealloc_mw(mw_);
  state = State::unbound;
  errno = 0;
  mw_ = ibv_alloc_mw(domain_.pd(), IBV_MW_TYPE_2);
  if (mw_ == nullptr) return last_error(ENOMEM);
  return {};
}

bool RdmaDomain::covers(std::span<const Sge> sges) const {
  std::shared_lock lk(mr_mu_);
  for (const Sge& s : sges) {
    auto it = mrs_.find(s.lkey);
    if (it == mrs_.end()) return false;
    const Range& r = it->second;
    if (s.addr < r.addr || s.addr - r.addr > r.length || s.length > r.length - (s.addr - r.addr)) {
      return false;
    }
  }
  return true;
}

void RdmaDomain::track(const ibv_mr* mr) {
  std::lock_guard lk(mr_mu_);
  mrs_[mr->lkey] = Range{reinterpret_cast<uint64_t>(mr->addr), mr->length};
}

void RdmaDomain::untrack(const ibv_mr* mr) {
  std::lock_guard lk(mr_mu_);
  mrs_.erase(mr->lkey);
}

Result<ibv_mr*> RdmaDomain::reg(void* addr, size_t length, uint32_t access) {
  int flags = 0;
  // Verbs refuses REMOTE_WRITE without LOCAL_WRITE: the HCA writes the memory either way.
  if (access & (kLocalWrite | kRemoteWrite)) flags |= IBV_ACCESS_LOCAL_WRITE;
  if (access & kRemoteWrite) flags |= IBV_ACCESS_REMOTE_WRITE;
  if (access & kRemoteRead) flags |= IBV_ACCESS_REMOTE_READ;
  if (access & kMwBind) flags |= IBV_ACCESS_MW_BIND;
  errno = 0;
  ibv_mr* mr = ibv_reg_mr(pd_, addr, length, flags);
  if (mr == nullptr) return errno == EFAULT ? errc(EINVAL) : last_error(ENOMEM);
  return mr;
}

Result<std::unique_ptr<MemoryRegion>> RdmaDomain::register_memory(void* addr, size_t length,
                                                                  uint32_t access) {
  constexpr uint32_t kKnown = kLocalWrite | kRemoteWrite | kRemoteRead | kMwBind;
  if (addr == nullptr || length == 0 || (access & ~kKnown) != 0) return errc(EINVAL);
  BASE_TRY(take_key());
  auto mr = reg(addr, length, access);
  if (!mr) {
    put_key();
    return mr.error();
  }
  return std::unique_ptr<MemoryRegion>(new RdmaMr(*this, *mr, access));
}

Result<std::unique_ptr<MemoryWindow>> RdmaDomain::alloc_mw() {
  BASE_TRY(take_key());
  errno = 0;
  ibv_mw* mw = ibv_alloc_mw(pd_, IBV_MW_TYPE_2);
  if (mw == nullptr) {
    put_key();
    if (errno == EOPNOTSUPP || errno == ENOSYS || errno == EINVAL || errno == 0)
      return errc(ENOTSUP);
    return last_error(ENOMEM);
  }
  return std::unique_ptr<MemoryWindow>(new RdmaMw(*this, mw));
}

Result<std::unique_ptr<Domain>> RdmaDomain::alloc_pd(const PdAttr& attr) {
  errno = 0;
  ibv_pd* pd = ibv_alloc_pd(ctx_);
  if (pd == nullptr) return last_error(ENOMEM);
  return std::unique_ptr<Domain>(new RdmaDomain(fabric_, ctx_, pd, attr.max_keys));
}

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

// Verbs devices cap depths and SGEs per QP themselves (ibv_create_qp fails past them); these are
// the bounds of our own rings.
constexpr uint32_t kMaxQueueDepth = 1u << 16;
constexpr uint32_t kMaxSgePerWr = 32;

Result<ConnectResult> RdmaDomain::connect(const ConnectParams& params,
                                          std::vector<std::byte>* reject_data) {
  if (reject_data != nullptr) reject_data->clear();
  if (params.tls) return errc(EPROTONOSUPPORT);
  auto* cq = dynamic_cast<RdmaCq*>(params.cq);
  if (cq == nullptr || cq->context() != ctx_) return errc(EINVAL);
  if (params.private_data.size() > kMaxPrivateData) return errc(EINVAL);
  if (!valid_ip_address(params.remote)) return errc(EINVAL);
  if (params.source != nullptr && !valid_ip_address(*params.source)) return errc(EINVAL);
  BASE_TRY(check_caps(params.caps, kMaxQueueDepth, kMaxSgePerWr));
  // gid: addresses: their IP form, checked against the GID tables (ibtrs/gid.h).
  BASE_ASSIGN_OR_RETURN(const Address remote, resolve_gid_address(params.remote, false));
  std::optional<Address> source;
  if (params.source != nullptr) {
    BASE_ASSIGN_OR_RETURN(Address s, resolve_gid_address(*params.source, true));
    source = s;
  }

  const auto deadline = Clock::now() + params.timeout;
  BASE_ASSIGN_OR_RETURN(ChannelPtr channel, make_channel());
  rdma_cm_id* raw = nullptr;
  if (rdma_create_id(channel.get(), &raw, nullptr, RDMA_PS_TCP) != 0) return last_error();
  IdPtr id(raw);

  sockaddr_storage dst = remote.sa;
  sockaddr_storage src{};
  if (source) src = source->sa;
  int resolve_ms = static_cast<int>(std::min<int64_t>(kResolveAddrTimeout.count(),
                                                      std::max(ms_left(deadline), 1)));
  if (rdma_resolve_addr(id.get(), source ? reinterpret_cast<sockaddr*>(&src) : nullptr,
                        reinterpret_cast<sockaddr*>(&dst), resolve_ms) != 0) {
    return errno == ENODEV ? errc(ENETUNREACH) : last_error();
  }
  CmEvent ev;
  BASE_TRY(next_event(channel.get(), deadline, ev, params.cancel_fd));
  if (ev.type != RDMA_CM_EVENT_ADDR_RESOLVED) return resolve_error(ev);
  // The CQ (and the memory the caller registered) live on this domain's device.
  if (id->verbs != ctx_) return errc(EINVAL);

  if (rdma_resolve_route(id.get(), std::max(ms_left(deadline), 1)) != 0) return last_error();
  BASE_TRY(next_event(channel.get(), deadline, ev, params.cancel_fd));
  if (ev.type != RDMA_CM_EVENT_ROUTE_RESOLVED) {
    return ms_left(deadline) == 0 ? errc(ETIMEDOUT) : resolve_error(ev);
  }

  auto core = std::make_shared<ConnCore>(fabric_, *this, *cq, params.caps, params.events);
  BASE_TRY(core->init(std::move(id)));
  // Past this point the core owns the id; failure paths destroy() it.
  auto fail = [&](std::error_code ec) -> Result<ConnectResult> {
    core->destroy();
    return ec;
  };

  rdma_conn_param param{};
  param.private_data = params.private_data.empty() ? nullptr : params.private_data.data();
  param.private_data_len = static_cast<uint8_t>(params.private_data.size());
  if (is_iwarp(ctx_)) {
    // MPA reports the exact length; IRD/ORD there are real negotiation inputs.
    param.responder_resources = 1;
    param.initiator_depth = 1;
  } else {
    auto len = rdma_pd::encode_req_length(params.private_data.size());
    param.responder_resources = len.responder_resources;
    param.initiator_depth = len.initiator_depth;
  }
  param.retry_count = kRetryCount;
  param.rnr_retry_count = kRnrRetryCount;
  if (rdma_connect(core->id(), &param) != 0) return fail(last_error());

  for (;;) {
    auto st = next_event(channel.get(), deadline, ev, params.cancel_fd);
    if (!st.ok()) return fail(st.error());
    switch (ev.type) {
      case RDMA_CM_EVENT_ESTABLISHED: {
        ConnectResult result;
        auto data = rdma_pd::decode_reply(ev.data());
        if (data) result.private_data.assign(data->begin(), data->end());
        auto st_migrate = core->migrate(fabric_.channel());
        if (!st_migrate.ok()) return fail(st_migrate.error());
        result.connection = std::make_unique<RdmaConnection>(std::move(core));
        return result;
      }
      case RDMA_CM_EVENT_REJECTED: {
        auto data = rdma_pd::decode_reply(ev.data());
        if (data && reject_data != nullptr) reject_data->assign(data->begin(), data->end());
        return fail(errc(ECONNREFUSED));
      }
      case RDMA_CM_EVENT_UNREACHABLE:
        return fail(errc(ev.status == -ETIMEDOUT ? ETIMEDOUT : EHOSTUNREACH));
      case RDMA_CM_EVENT_CONNECT_ERROR:
        return fail(errc(ECONNREFUSED));
      case RDMA_CM_EVENT_DEVICE_REMOVAL:
        return fail(errc(ENODEV));
      case RDMA_CM_EVENT_DISCONNECTED:
        return fail(errc(ECONNRESET));
      default:
        break;  // ADDR_CHANGE and the like: keep waiting
    }
  }
}

// ---------------------------------------------------------------------------------------------
// RdmaCq

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

// ---------------------------------------------------------------------------------------------
// RdmaConnectRequest / RdmaListener

Domain& RdmaConnectRequest::domain() { return domain_; }

Result<std::unique_ptr<Connection>> RdmaConnectRequest::accept(
    Domain& pd_base, CompletionQueue& cq_base, const QueueCaps& caps,
    std::span<const std::byte> private_data, ConnectionEvents events) {
  if (!id_) return errc(EINVAL);  // already accepted or rejected
  auto* pd = dynamic_cast<RdmaDomain*>(&pd_base);
  auto* cq = dynamic_cast<RdmaCq*>(&cq_base);
  // The queue pair is created in `pd`, on the device the request arrived on.
  if (pd == nullptr || pd->context() != domain_.context() || cq == nullptr ||
      cq->context() != domain_.context())
    return errc(EINVAL);
  if (private_data.size() > kMaxPrivateData) return errc(EINVAL);
  BASE_TRY(check_caps(caps, kMaxQueueDepth, kMaxSgePerWr));

  auto core = std::make_shared<ConnCore>(fabric_, *pd, *cq, caps, std::move(events));
  BASE_TRY(core->init(std::move(id_)));
  auto fail = [&](std::error_code ec) -> Result<std::unique_ptr<Connection>> {
    core->destroy();
    return ec;
  };

  std::byte reply[rdma_pd::kReplyMax];
  rdma_conn_param param{};
  param.private_data = reply;
  param.private_data_len = static_cast<uint8_t>(rdma_pd::encode_reply(private_data, reply));
  // No RDMA READ is used; these become the peer's QP depths through the REP.
  param.responder_resources = 1;
  param.initiator_depth = 1;
  param.retry_count = kRetryCount;
  param.rnr_retry_count = kRnrRetryCount;
  if (rdma_accept(core->id(), &param) != 0) return fail(last_error());

  const auto deadline = Clock::now() + kAcceptTimeout;
  CmEvent ev;
  for (;;) {
    auto st = next_event(channel_.get(), deadline, ev);
    if (!st.ok()) return fail(st.error());
    if (ev.type == RDMA_CM_EVENT_ESTABLISHED) break;
    if (ev.type == RDMA_CM_EVENT_DEVICE_REMOVAL) return fail(errc(ENODEV));
    if (ev.type == RDMA_CM_EVENT_REJECTED || ev.type == RDMA_CM_EVENT_CONNECT_ERROR ||
        ev.type == RDMA_CM_EVENT_UNREACHABLE || ev.type == RDMA_CM_EVENT_DISCONNECTED) {
      return fail(errc(ECONNABORTED));
    }
  }
  auto migrated = core->migrate(fabric_.channel());
  if (!migrated.ok()) return fail(migrated.error());
  return std::unique_ptr<Connection>(new RdmaConnection(std::move(core)));
}

ibtrs::Status RdmaConnectRequest::reject(std::span<const std::byte> private_data) {
  if (!id_) return errc(EINVAL);
  if (private_data.size() > kMaxPrivateData) return errc(EINVAL);
  std::byte reply[rdma_pd::kReplyMax];
  auto len = static_cast<uint8_t>(rdma_pd::encode_reply(private_data, reply));
  if (rdma_reject(id_.get(), reply, len) != 0) return last_error();
  id_.reset();
  return {};
}

Result<std::unique_ptr<ConnectRequest>> RdmaListener::get_request(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    rdma_cm_event* ev = nullptr;
    if (rdma_get_cm_event(channel_.get(), &ev) != 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return last_error();
      int left = ms_left(deadline);
      if (left == 0) return errc(ETIMEDOUT);
      pollfd pfd{channel_->fd, POLLIN, 0};
      ::poll(&pfd, 1, left);
      continue;
    }
    if (ev->event != RDMA_CM_EVENT_CONNECT_REQUEST) {
      // Only the listen id reports here (request ids move to their own channel at once).
      bool removed = ev->event == RDMA_CM_EVENT_DEVICE_REMOVAL;
      rdma_ack_cm_event(ev);
      if (removed) return errc(ENODEV);
      continue;
    }
    CmEvent req;
    copy_event(*ev, req);
    rdma_ack_cm_event(ev);
    IdPtr child(req.id);

    size_t len = req.private_data_len;
    if (!is_iwarp(child->verbs)) {
      auto exact = rdma_pd::decode_req_length(req.responder_resources, req.initiator_depth, len);
      if (exact) len = *exact;
    }
    len = std::min(len, kMaxPrivateData);

    auto domain = fabric_.domain_for_context(child->verbs);
    // On failure destroying `child` answers the REQ: the kernel CM sends a REJ.
    if (!domain) continue;
    auto channel = make_channel();
    if (!channel) continue;
    // Nobody reads the listener's channel during the migration: this is the one get_request().
    if (rdma_migrate_id(child.get(), channel->get()) != 0) continue;
    return std::unique_ptr<ConnectRequest>(new RdmaConnectRequest(
        fabric_, **domain, std::move(*channel), std::move(child), req.data().first(len)));
  }
}

// ---------------------------------------------------------------------------------------------
// RdmaFabric

Result<RdmaDomain*> RdmaFabric::domain_for_context(ibv_context* ctx) {
  if (ctx == nullptr) return errc(ENODEV);
  std::lock_guard lk(mu_);
  auto it = domains_.find(ctx);
  if (it != domains_.end()) return it->second.get();
  ibv_pd* pd = ibv_alloc_pd(ctx);
  if (pd == nullptr) return last_error(ENOMEM);
  // The event thread reads async events without blocking; nobody else reads this fd.
  set_nonblock(ctx->async_fd);
  auto* d = new RdmaDomain(*this, ctx, pd, 0);
  domains_.emplace(ctx, std::unique_ptr<RdmaDomain>(d));
  ++domains_gen_;
  wake();
  return d;
}

void RdmaFabric::register_core(const std::shared_ptr<ConnCore>& core) {
  {
    std::lock_guard lk(mu_);
    cores_[core->id()] = core;
  }
  auto& table = async_qps();
  std::lock_guard lk(table.mu);
  table.qps[{core->context(), core->qp_num()}] = core.get();
}

void RdmaFabric::unregister_core(ConnCore* core) {
  {
    auto& table = async_qps();
    std::lock_guard lk(table.mu);
    table.qps.erase({core->context(), core->qp_num()});
  }
  std::unique_lock lk(mu_);
  core->detached = true;
  cores_.erase(core->id());
  idle_.wait(lk, [&] { return core->dispatching == 0; });
}

Result<Domain*> RdmaFabric::domain_for(const Address& remote_in, const Address* source_in) {
  if (!valid_ip_address(remote_in)) return errc(EINVAL);
  if (source_in != nullptr && !valid_ip_address(*source_in)) return errc(EINVAL);
  // gid: addresses: their IP form (ibtrs/gid.h); the same check connect() makes.
  BASE_ASSIGN_OR_RETURN(const Address remote, resolve_gid_address(remote_in, false));
  std::optional<Address> source_ip;
  if (source_in != nullptr) {
    BASE_ASSIGN_OR_RETURN(Address s, resolve_gid_address(*source_in, true));
    source_ip = s;
  }
  const Address* source = source_ip ? &*source_ip : nullptr;
  BASE_ASSIGN_OR_RETURN(ChannelPtr channel, make_channel());
  rdma_cm_id* raw = nullptr;
  if (rdma_create_id(channel.get(), &raw, nullptr, RDMA_PS_TCP) != 0) return last_error();
  IdPtr id(raw);
  if (source == nullptr) {
    // An address of this host (a listener's, typically): its own device serves it. Routing
    // could send locally generated traffic to it through another device (a host that talks to
    // itself over two ports), but requests to it arrive on the device that owns it.
    sockaddr_storage local = remote.with_port(0).sa;
    if (rdma_bind_addr(id.get(), reinterpret_cast<sockaddr*>(&local)) == 0 && id->verbs != nullptr) {
      BASE_ASSIGN_OR_RETURN(RdmaDomain * owner, domain_for_context(id->verbs));
      return static_cast<Domain*>(owner);
    }
    id.reset();
    if (rdma_create_id(channel.get(), &raw, nullptr, RDMA_PS_TCP) != 0) return last_error();
    id.reset(raw);
  }
  sockaddr_storage dst = remote.sa;
  sockaddr_storage src{};
  if (source != nullptr) src = source->sa;
  if (rdma_resolve_addr(id.get(), source != nullptr ? reinterpret_cast<sockaddr*>(&src) : nullptr,
                        reinterpret_cast<sockaddr*>(&dst),
                        static_cast<int>(kResolveAddrTimeout.count())) != 0) {
    return errno == ENODEV ? errc(ENETUNREACH) : last_error();
  }
  CmEvent ev;
  // The kernel reports ADDR_ERROR at its own timeout; the margin covers scheduling.
  BASE_TRY(next_event(channel.get(), Clock::now() + 2 * kResolveAddrTimeout, ev));
  if (ev.type != RDMA_CM_EVENT_ADDR_RESOLVED) return resolve_error(ev);
  BASE_ASSIGN_OR_RETURN(RdmaDomain * d, domain_for_context(id->verbs));
  return static_cast<Domain*>(d);
}

Result<std::unique_ptr<Listener>> RdmaFabric::listen(const Address& local, const ListenOptions& o) {
  // RDMA has no TLS: its traffic is not encrypted (as NVMe/RDMA's is not).
  if (o.tls || o.tls_required) return errc(EPROTONOSUPPORT);
  const int backlog = o.backlog;
  if (!valid_ip_address(local) || backlog <= 0) return errc(EINVAL);
  BASE_ASSIGN_OR_RETURN(const Address bind_to, resolve_gid_address(local, true));
  BASE_ASSIGN_OR_RETURN(ChannelPtr channel, make_channel());
  rdma_cm_id* raw = nullptr;
  if (rdma_create_id(channel.get(), &raw, nullptr, RDMA_PS_TCP) != 0) return last_error();
  IdPtr id(raw);
  sockaddr_storage addr = bind_to.sa;
  if (rdma_bind_addr(id.get(), reinterpret_cast<sockaddr*>(&addr)) != 0) return last_error();
  if (rdma_listen(id.get(), backlog) != 0) return last_error();
  return std::unique_ptr<Listener>(new RdmaListener(*this, std::move(channel), std::move(id)));
}

void RdmaFabric::run() {
  std::vector<pollfd> fds;
  std::vector<ibv_context*> fd_ctx;  // parallel to fds[2..]
  uint64_t seen_gen = UINT64_MAX;
  for (;;) {
    std::deque<std::shared_ptr<ConnCore>> pending;
    {
      std::lock_guard lk(mu_);
      if (stop_) return;
      if (seen_gen != domains_gen_) {
        seen_gen = domains_gen_;
        fds.assign({pollfd{wake_fd_, POLLIN, 0}, pollfd{channel_->fd, POLLIN, 0}});
        fd_ctx.clear();
        for (auto& [ctx, domain] : domains_) {
          fds.push_back(pollfd{ctx->async_fd, POLLIN, 0});
          fd_ctx.push_back(ctx);
        }
      }
      pending.swap(notifications_);
    }
    for (auto& core : pending) deliver(core);
    pending.clear();  // the last reference to a destroyed connection's core may go here

    for (auto& p : fds) p.revents = 0;
    if (::poll(fds.data(), fds.size(), -1) < 0) continue;
    if (fds[0].revents & POLLIN) {
      uint64_t v;
      ssize_t r = ::read(wake_fd_, &v, sizeof(v));
      (void)r;
    }
    if (fds[1].revents & POLLIN) handle_cm_events();
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents & POLLIN) {
        handle_async_events(fd_ctx[i - 2]);
      } else if (fds[i].revents & (POLLERR | POLLHUP | POLLNVAL)) {
        fds[i].fd = -1;  // a removed device stays readable-with-error: stop polling it
      }
    }
  }
}

void RdmaFabric::handle_cm_events() {
  for (;;) {
    rdma_cm_event* ev = nullptr;
    if (rdma_get_cm_event(channel_.get(), &ev) != 0) return;
    rdma_cm_event_type type = ev->event;
    int status = ev->status;
    std::shared_ptr<ConnCore> core;
    {
      std::lock_guard lk(mu_);
      auto it = cores_.find(ev->id);
      if (it != cores_.end() && begin_dispatch_locked(it->second.get())) core = it->second;
    }
    rdma_ack_cm_event(ev);  // rdma_destroy_id of this id waits for it; nothing above blocks
    if (!core) continue;
    switch (type) {
      case RDMA_CM_EVENT_DISCONNECTED:
        // status -ETIMEDOUT: our DREQ went unanswered (the peer is gone).
        core->to_error(ConnState::error, status == -ETIMEDOUT ? ETIMEDOUT : ECONNRESET);
        break;
      case RDMA_CM_EVENT_DEVICE_REMOVAL:
        core->to_error(ConnState::error, ENODEV);
        break;
      case RDMA_CM_EVENT_ADDR_CHANGE:
        // The address the connection was made to/from is gone; as RTRS does, treat it as reset.
        core->to_error(ConnState::error, ECONNRESET);
        break;
      default:
        break;  // TIMEWAIT_EXIT: the QP could be reused now; ours is destroyed instead
    }
    end_dispatch(core.get());
  }
}

void RdmaFabric::handle_async_events(ibv_context* ctx) {
  for (;;) {
    ibv_async_event ae;
    if (ibv_get_async_event(ctx, &ae) != 0) return;
    ibv_event_type type = ae.event_type;
    bool qp_event = type == IBV_EVENT_COMM_EST || type == IBV_EVENT_QP_FATAL ||
                    type == IBV_EVENT_QP_REQ_ERR || type == IBV_EVENT_QP_ACCESS_ERR ||
                    type == IBV_EVENT_SQ_DRAINED || type == IBV_EVENT_PATH_MIG ||
                    type == IBV_EVENT_PATH_MIG_ERR || type == IBV_EVENT_QP_LAST_WQE_REACHED;
    std::vector<std::shared_ptr<ConnCore>> targets;
    {
      // Looked up before the ack: ibv_destroy_qp waits for it, so the QP cannot go away now.
      auto& table = async_qps();
      std::lock_guard lk(table.mu);
      for (auto& [key, core] : table.qps) {
        if (key.first != ctx) continue;
        bool hit = qp_event ? key.second == ae.element.qp->qp_num : type == IBV_EVENT_DEVICE_FATAL;
        if (hit && core->fabric().begin_dispatch(core)) targets.push_back(core->shared_from_this());
      }
    }
    ibv_ack_async_event(&ae);
    for (auto& core : targets) {
      switch (type) {
        case IBV_EVENT_COMM_EST: core->comm_established(); break;
        case IBV_EVENT_QP_FATAL:
        case IBV_EVENT_QP_REQ_ERR:
        case IBV_EVENT_QP_ACCESS_ERR: core->to_error(ConnState::error, EIO); break;
        case IBV_EVENT_DEVICE_FATAL: core->to_error(ConnState::error, ENODEV); break;
        default: break;
      }
      core->fabric().end_dispatch(core.get());
    }
  }
}

void RdmaFabric::deliver(const std::shared_ptr<ConnCore>& core) {
  {
    std::lock_guard lk(mu_);
    if (!begin_dispatch_locked(core.get())) return;
  }
  if (core->events().on_disconnected) core->events().on_disconnected(errc(core->cause()));
  end_dispatch(core.get());
}

}  // namespace

Result<std::unique_ptr<Fabric>> make_rdma_fabric(const FabricOptions& /*options*/) {
  int num = 0;
  ibv_device** list = ibv_get_device_list(&num);
  if (list == nullptr) return errc(ENODEV);
  ibv_free_device_list(list);
  if (num == 0) return errc(ENODEV);

  BASE_ASSIGN_OR_RETURN(ChannelPtr channel, make_channel());
  int count = 0;
  ibv_context** devices = rdma_get_devices(&count);
  if (devices == nullptr) return errc(ENODEV);
  if (count == 0) {
    rdma_free_devices(devices);
    return errc(ENODEV);
  }
  int wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd < 0) {
    auto err = last_error();
    rdma_free_devices(devices);
    return err;
  }
  return std::unique_ptr<Fabric>(new RdmaFabric(devices, std::move(channel), wake_fd));
}

}  // namespace ibtrs::fabric
