// The rdma provider: RC queue pairs over rdma-core (librdmacm + libibverbs).
// This header holds its private types, shared by the files that implement them one concern each
// (as siw splits its provider into cm, cq, qp, mem):
//   rdma_qp.cc      a connection's queue pair: setup on its cm id, posting, memory window binds,
//                   the move to error, teardown; the Connection over it
//   rdma_cq.cc      completion queues and the translation of work completions
//   rdma_mem.cc     protection domains, memory regions and windows
//   rdma_cm.cc      connection management: address resolution, connect, listen, accept/reject
//   rdma_fabric.cc  the fabric: its devices, the cm/async event thread, on_disconnected
//   rdma_private_data.h  how private data keeps its length (header-only, unit-tested)
// What the IO path (post, poll) calls across those files is defined here, in-class or inline.
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
#pragma once

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "base/unique_fd.h"
#include "fabric/secure_random.h"
#include "fabric/fabric.h"

namespace ibtrs::fabric::rdma {

using Clock = std::chrono::steady_clock;

// wr_id tag of receive requests; send requests carry their plain sequence number.
constexpr uint64_t kRecvTag = 1ull << 63;

inline std::error_code last_error(int fallback = EIO) { return errc(errno != 0 ? errno : fallback); }

// Sets O_NONBLOCK on `fd` (rdma_cm.cc).
bool set_nonblock(int fd);
// An Address of the cm id's sockaddr (rdma_cm.cc).
Address to_address(const sockaddr* sa);

struct ChannelDeleter {
  void operator()(rdma_event_channel* ch) const { rdma_destroy_event_channel(ch); }
};
using ChannelPtr = std::unique_ptr<rdma_event_channel, ChannelDeleter>;
// A private, non-blocking event channel (rdma_cm.cc).
Result<ChannelPtr> make_channel();

// An id that is not (yet) owned by a connection. Destroying it blocks until its events are
// acked; every path here acks an event right after copying it.
struct IdDeleter {
  void operator()(rdma_cm_id* id) const {
    if (id->qp != nullptr) rdma_destroy_qp(id);
    rdma_destroy_id(id);
  }
};
using IdPtr = std::unique_ptr<rdma_cm_id, IdDeleter>;

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
  // These four are defined in the file of their one caller (RdmaConnection in rdma_qp.cc,
  // RdmaCq::poll in rdma_cq.cc) and always inlined there. When the provider was one file
  // (an anonymous namespace) GCC inlined them, as functions with one caller that leave no copy
  // behind; shared between files a copy stays, and GCC (-O2) then called them instead
  // (compared per function, before and after the split). Inlined, an IO's post and poll make
  // the calls they made before.
  [[gnu::always_inline]] inline ibtrs::Status post_recv(std::span<const RecvWr> wrs);
  [[gnu::always_inline]] inline Result<uint32_t> bind_mw(MemoryWindow& mw, const MemoryRegion& mr,
                                                         uint64_t addr, uint64_t len,
                                                         uint32_t access);
  [[gnu::always_inline]] inline Result<bool> invalidate_mw(MemoryWindow& mw, uint64_t wr_id);
  // Translate one work completion of this QP; false when it is stale.
  [[gnu::always_inline]] inline bool complete(const ibv_wc& wc, Completion& out);

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
  // leaves anything else to the HCA (local_protection_error). Below, always inlined into
  // ConnCore::post_send (rdma_qp.cc), as it was when the provider was one file.
  [[gnu::always_inline]] inline bool covers(std::span<const Sge> sges) const;
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

inline ibv_context* ConnCore::context() const { return domain_.context(); }

inline bool RdmaDomain::covers(std::span<const Sge> sges) const {
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

// The Connection of an established core (rdma_qp.cc).
std::unique_ptr<Connection> make_connection(std::shared_ptr<ConnCore> core);

// ---------------------------------------------------------------------------------------------

class RdmaFabric final : public Fabric {
 public:
  RdmaFabric(ibv_context** devices, ChannelPtr channel, base::UniqueFd wake_fd)
      : devices_(devices), channel_(std::move(channel)), wake_fd_(std::move(wake_fd)) {
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
    wake_fd_.reset();  // after the event thread and the channel, before the devices
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
    ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));
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
  base::UniqueFd wake_fd_;
  std::thread thread_;

  std::mutex mu_;
  std::condition_variable idle_;
  bool stop_ = false;
  std::map<ibv_context*, std::unique_ptr<RdmaDomain>> domains_;
  uint64_t domains_gen_ = 0;
  std::unordered_map<rdma_cm_id*, std::shared_ptr<ConnCore>> cores_;
  std::deque<std::shared_ptr<ConnCore>> notifications_;
};

}  // namespace ibtrs::fabric::rdma
