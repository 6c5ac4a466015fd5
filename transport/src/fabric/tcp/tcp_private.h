// The tcp provider: software RDMA over TCP with verbs semantics (see fabric.h and tcp_wire.h).
// This header holds its private types: the CQ, the connection and the domain, shared by the
// files that implement them, one concern each (as siw splits its provider into cm, cq, qp_tx,
// qp_rx, mem):
//   tcp_cq.cc      the CQ: poll/wait/arm, epoll dispatch, batches (deferred doorbells), owed acks
//   tcp_tx.cc      transmit: post_send, the send queue, flush_tx, acks, control frames
//   tcp_conn.cc    a connection on its poller: the receive glue (tcp_rx.h), post_recv and RNR,
//                  SO_RCVLOWAT, the move to error
//   tcp_cm.cc      connection management: the handshake, connect, listener, accept/reject
//   tcp_domain.cc  the fabric and its one device
//   tcp_rx.cc / tcp_wire.cc  the receive engine and the frame format (in ibtrs_wire, fuzzed)
// What the hot path (post, flush, poll) calls across those files is defined here, in-class or
// inline, as it was in the one file they came from: a split must not add a call to an IO.
//
// Progress model: there is no engine thread. A post writes to the socket directly from the
// posting thread (one sendmsg for a whole batch of work requests); whatever the socket does not
// take is finished by the CQ's poller on EPOLLOUT. The exception is a batch: the thread that
// took two or more completions out of a CQ with poll() and posts to that CQ's connections
// before its next poll()/wait()/arm() on it (an IO thread answering or resubmitting from its
// completion handlers). Those posts ring a deferred doorbell, and that next call sends
// everything the batch posted with one sendmsg per connection instead of one per post (see
// TcpCq::in_owner_batch). Incoming bytes are processed by the poller of the CQ the connection
// is attached to, inside poll()/wait(), which places data and raises completions. That keeps
// the round trip at the socket's own cost: no thread hand-off.
//
// Acknowledgements: every frame header carries how many of the peer's data frames were placed.
// A poller owes an ack after placing frames; it rides on the next frame the connection sends,
// or goes out as an ACK frame at the next poll()/arm()/wait() — so a request/response exchange
// costs no extra frame, and streaming costs one ACK per poll.
#pragma once

#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "base/unique_fd.h"
#include "fabric/mr_table.h"
#include "fabric/tcp/tcp_rx.h"
#include "fabric/tcp/tcp_wire.h"

namespace ibtrs::fabric::tcp {

using Clock = std::chrono::steady_clock;

// epoll events taken per epoll_wait (the CQ's and the listener's).
inline constexpr int kMaxEvents = 64;
// Queue depths above 64 Ki would only hide a mistake; every IBTRS queue is far smaller.
inline constexpr uint32_t kMaxQueueDepth = 1u << 16;

inline int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left.count(), INT32_MAX));
}

// The local or peer address of a socket (tcp_conn.cc).
Address address_of(int fd, bool peer);

// Deferred doorbells need to know whether a post comes from the thread that is working through
// the completions of the connection's CQ. Threads get a never-reused id on their first poll; a
// CQ records the id of the thread whose batch is open (TcpCq::batch_owner_). Constant
// initialisation keeps the read in post_send a plain TLS load.
inline thread_local uint64_t t_thread_id = 0;
inline std::atomic<uint64_t> g_next_thread_id{1};

inline uint64_t this_thread_id() {
  if (t_thread_id == 0) t_thread_id = g_next_thread_id.fetch_add(1, std::memory_order_relaxed);
  return t_thread_id;
}

class TcpConnection;

// Connection ids, never reused in the process: the owner a memory window bound on a connection
// carries, so that only that connection's placements can use it (verbs type 2B).
inline std::atomic<uint64_t> g_next_conn_id{1};

// ---------------------------------------------------------------------------------------------
class TcpCq final : public CompletionQueue {
 public:
  static Result<std::unique_ptr<CompletionQueue>> create(uint32_t capacity, bool busy_poll);
  // epfd_ and evfd_ close with the members: nothing polls a CQ being destroyed.
  ~TcpCq() override = default;

  size_t poll(std::span<Completion> out) override;
  size_t wait(std::span<Completion> out, std::chrono::milliseconds timeout) override;
  int fd() const override { return epfd_.get(); }
  ibtrs::Status arm() override {
    std::lock_guard lock(mu_);
    close_batch();
    flush_acks();
    return {};
  }
  void ack_events() override {}
  bool level_triggered() const override { return true; }

  // Connection side (any thread).
  ibtrs::Status reserve(uint32_t n);
  void unreserve(uint32_t n);
  // After reserve(). Stores the epoll id in *id under mu_ before the socket joins the epoll set:
  // the polling thread may handle the connection (and read its id) before attach() returns.
  void attach(TcpConnection* c, int sock, uint64_t* id);
  void detach(uint64_t id, int sock);
  void wake() {
    wake_pending_.store(true, std::memory_order_release);
    uint64_t one = 1;
    [[maybe_unused]] ssize_t r = ::write(evfd_.get(), &one, sizeof(one));
  }
  void set_events(uint64_t id, int sock, uint32_t events) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = id;
    ::epoll_ctl(epfd_.get(), EPOLL_CTL_MOD, sock, &ev);
  }

  // Poller side (mu_ held).
  void push(const Completion& c) {
    if (count_ == ring_.size()) grow();
    ring_[(head_ + count_) % ring_.size()] = c;
    ++count_;
  }
  [[gnu::always_inline]] void owe_ack(TcpConnection* c) {
    if (std::find(ack_owed_.begin(), ack_owed_.end(), c) == ack_owed_.end()) ack_owed_.push_back(c);
  }

  // Deferred doorbells (any thread, no other lock but the connection's tx_mu_ held).
  // Whether a post from the calling thread may wait for the end of the owner's batch: only the
  // thread that took a batch of completions with poll() and has not called into this CQ since.
  // A thread polling in a loop comes back (polls again, or arms before it sleeps), and that
  // call sends what the batch posted. wait() opens no batch: its callers may well block
  // elsewhere next (as an event-driven test thread does), and nobody else may be relied on
  // either, since the poller may be asleep.
  bool in_owner_batch() const {
    return t_thread_id != 0 && batch_owner_.load(std::memory_order_relaxed) == t_thread_id;
  }
  // Queues `c` for the flush at the end of the batch; the caller marks `c` so this happens once
  // per connection per batch.
  [[gnu::always_inline]] void defer_tx(TcpConnection* c) {
    std::lock_guard lock(defer_mu_);
    deferred_.push_back(c);
  }

 private:
  TcpCq(uint32_t capacity, base::UniqueFd epfd, base::UniqueFd evfd, bool busy)
      : CompletionQueue(capacity), epfd_(std::move(epfd)), evfd_(std::move(evfd)), busy_poll_(busy),
        ring_(capacity) {
    ack_owed_.reserve(16);
    deferred_.reserve(16);
    flushing_.reserve(16);
  }
  size_t drain(std::span<Completion> out);
  void dispatch(const epoll_event* evs, int n);
  void flush_acks();
  // Ends the owner's batch: later posts flush at once again, and the deferred ones go now.
  void close_batch();
  // poll(): opens a batch for the calling thread when it takes completions away (mu_ held).
  // A single completion opens none: its handler's lone post has nothing to share a sendmsg
  // with, and flushing it at once keeps a lone request's latency as it was (at QD1, deferring
  // it measured +4.6 us p50 on loopback, 39.7 against 35.1, because what the handler does
  // after posting - the server wakes its worker thread - then runs before the bytes leave).
  size_t open_batch(size_t n) {
    if (n > 1) batch_owner_.store(this_thread_id(), std::memory_order_relaxed);
    return n;
  }
  void grow();

  base::UniqueFd epfd_;
  base::UniqueFd evfd_;
  bool busy_poll_;
  std::mutex mu_;
  struct Attached {
    uint64_t id;
    TcpConnection* conn;
  };
  std::vector<Attached> conns_;
  uint64_t next_id_ = 1;  // 0 is the eventfd
  uint32_t reserved_ = 0;
  std::vector<Completion> ring_;
  size_t head_ = 0;
  size_t count_ = 0;
  std::vector<TcpConnection*> ack_owed_;
  std::atomic<bool> wake_pending_{false};  // set by wake(), cleared when the eventfd is read
  // The thread whose batch is open (0: none). Written by the polling thread under mu_, read by
  // posters without a lock: a poster compares it with its own id, which only it ever stores.
  std::atomic<uint64_t> batch_owner_{0};
  // Connections with a deferred doorbell. defer_mu_ is a leaf lock (taken under tx_mu_ by
  // posters, under mu_ by the flush), so it adds no lock-order edge between those two.
  std::mutex defer_mu_;
  std::vector<TcpConnection*> deferred_;
  std::vector<TcpConnection*> flushing_;  // mu_: the batch being flushed
};

// ---------------------------------------------------------------------------------------------
class TcpConnection final : public Connection, private RxHooks {
 public:
  TcpConnection(TcpCq& cq, base::UniqueFd sock, const QueueCaps& caps, ConnectionEvents events,
                std::shared_ptr<MrTable> mrs, std::unique_ptr<tls::Session> tls)
      : id_(g_next_conn_id.fetch_add(1, std::memory_order_relaxed)),
        cq_(cq),
        sock_(std::move(sock)),
        tls_(std::move(tls)),
        tls_user_(tls_ != nullptr && !(tls_->kernel_tx() && tls_->kernel_rx())),
        caps_(caps),
        events_(std::move(events)),
        mrs_(std::move(mrs)),
        local_(address_of(sock_.get(), false)),
        peer_(address_of(sock_.get(), true)),
        sq_(caps.max_send_wr),
        sq_sges_(static_cast<size_t>(caps.max_send_wr) * caps.max_send_sge),
        rq_(caps.max_recv_wr),
        rx_(*mrs_, kDefaultStaging, id_) {}

  // Attaching is separate from construction so that nothing can poll a half-built object.
  void attach() { cq_.attach(this, sock_.get(), &cq_id_); }

  ~TcpConnection() override {
    // A doorbell still deferred is not rung: as when verbs destroys a QP, requests that never
    // completed are dropped, and their memory may already be gone (sending would read it).
    if (cq_id_ != 0) cq_.detach(cq_id_, sock_.get());
    cq_.unreserve(caps_.max_send_wr + caps_.max_recv_wr);
    // Closed here, before tls_ and the rest of the members go, as it always was.
    sock_.reset();
  }

  ibtrs::Status post_send(std::span<const SendWr> wrs) override { return post(wrs, false); }
  ibtrs::Status post_send_deferred(std::span<const SendWr> wrs) override { return post(wrs, true); }
  void ring() override {
    std::lock_guard lock(tx_mu_);
    ring_deferred();
  }
  ibtrs::Status post_recv(std::span<const RecvWr> wrs) override;
  Result<uint32_t> bind_mw(MemoryWindow& mw, const MemoryRegion& mr, uint64_t addr, uint64_t len,
                           uint32_t access) override {
    if (state() != ConnState::connected) return errc(ENOTCONN);
    return soft_bind_mw(*mrs_, id_, mw, mr, addr, len, access);
  }
  Result<bool> invalidate_mw(MemoryWindow& mw, uint64_t) override {
    BASE_TRY(soft_invalidate_mw(*mrs_, id_, mw));
    return true;
  }
  void disconnect() override {
    {
      // Requests posted before disconnect() go out before the DISCONNECT frame (which preempts
      // frames not yet started), as they did when every post flushed at once.
      std::lock_guard lock(tx_mu_);
      ring_deferred();
    }
    ConnState expected = ConnState::connected;
    if (state_.compare_exchange_strong(expected, ConnState::error)) {
      local_disconnect_.store(true, std::memory_order_release);
      cq_.wake();
    }
  }
  ConnState state() const override { return state_.load(std::memory_order_acquire); }
  const QueueCaps& caps() const override { return caps_; }
  uint32_t send_queue_free() const override {
    return caps_.max_send_wr - (sq_tail_.load(std::memory_order_acquire) -
                                sq_acked_.load(std::memory_order_acquire));
  }
  const Address& local_address() const override { return local_; }
  const Address& peer_address() const override { return peer_; }
  std::string device_name() const override { return "tcp"; }
  uint8_t port_num() const override { return 1; }
  tls::Info tls() const override {
    if (tls_ == nullptr) return {};
    return tls::Info{true, tls_->kernel_tx(), tls_->kernel_rx(), std::string(tls_->cipher()), tls_->peer_identity()};
  }

  // Poller side, with the CQ lock held.
  [[gnu::always_inline]] inline void on_events(uint32_t events);
  // Whether reading the socket is all this connection needs now (no send waiting for room,
  // not stalled on a RECV, not dead).
  bool can_spin_read() const {
    return !dead_ && rx_enabled_ && lowat_ <= 1 && !epollout_.load(std::memory_order_acquire);
  }
  void on_wakeup();
  [[gnu::always_inline]] inline void send_owed_ack();
  [[gnu::always_inline]] inline void set_lowat();
  // Rings a doorbell deferred by post_send (CQ lock held, any thread polling the CQ).
  void flush_deferred() {
    std::lock_guard lock(tx_mu_);
    ring_deferred();
  }

 private:
  struct TxEntry {
    uint64_t wr_id;
    FrameHeader hdr;
    uint64_t total;  // payload bytes
    uint32_t num_sge;
    Opcode opcode;
    bool signaled;
  };
  enum class Ctrl : uint8_t { none, ack, nak, disconnect };

  // RxHooks (poller).
  ssize_t read(const iovec* iov, int iovcnt) override {
    ssize_t n;
    if (tls_ == nullptr) {
      n = ::readv(sock_.get(), iov, iovcnt);
    } else if (!tls_user_) {
      n = tls_->readv(iov, iovcnt);  // the kernel's record layer: a readv of the socket
    } else {
      std::lock_guard lock(tls_mu_);
      n = tls_->readv(iov, iovcnt);
    }
    return n < 0 ? -errno : n;
  }
  // Transmits like sendmsg(MSG_DONTWAIT): through TLS when the connection has it.
  ssize_t send_iov(const iovec* iov, int iovcnt) {
    if (tls_ == nullptr) {
      msghdr msg{};
      msg.msg_iov = const_cast<iovec*>(iov);
      msg.msg_iovlen = static_cast<size_t>(iovcnt);
      return ::sendmsg(sock_.get(), &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    }
    if (!tls_user_) return tls_->writev(iov, iovcnt);
    std::lock_guard lock(tls_mu_);
    return tls_->writev(iov, iovcnt);
  }
  // Userspace TLS may hold received bytes the socket no longer shows: the CQ is woken so that
  // its owner reads them (the level-triggered promise of TcpCq).
  bool tls_read_pending() {
    if (!tls_user_) return false;
    std::lock_guard lock(tls_mu_);
    return tls_->read_pending();
  }
  // The poller alone advances the head, so it reads the queue without the lock: the tail's
  // release store publishes entries written by post_recv.
  RecvEntry* head_recv() override {
    const uint32_t head = rq_head_.load(std::memory_order_relaxed);
    return head == rq_tail_.load(std::memory_order_acquire) ? nullptr : &rq_[head % rq_.size()];
  }
  bool recv_posted() const {
    return rq_head_.load(std::memory_order_relaxed) != rq_tail_.load(std::memory_order_acquire);
  }
  void complete_recv(WcStatus status, Opcode opcode, uint32_t byte_len, uint32_t imm,
                     bool with_imm) override {
    const uint32_t head = rq_head_.load(std::memory_order_relaxed);
    const uint64_t wr_id = rq_[head % rq_.size()].wr_id;
    // Release: post_recv may reuse the slot once it sees the new head.
    rq_head_.store(head + 1, std::memory_order_release);
    cq_.push(Completion{wr_id, status, opcode, byte_len, imm, with_imm});
  }
  bool on_ack(uint32_t ack) override;

  void on_nak(uint32_t frame, WcStatus status) override {
    failed_frame_ = frame;
    failed_status_ = status;
    has_failed_frame_ = true;
  }

  ibtrs::Status post(std::span<const SendWr> wrs, bool defer);
  void pump();
  // Transmits what can go now; tx_mu_ held.
  void flush_tx();
  // Sends what a deferred doorbell left queued, if anything; tx_mu_ held.
  void ring_deferred() {
    if (!doorbell_deferred_) return;
    doorbell_deferred_ = false;
    if (!epollout_) flush_tx();
  }
  [[gnu::always_inline]] inline void queue_ctrl(Ctrl c, WcStatus nak_status = WcStatus::success);
  void set_epollout(bool on);
  // Moves to error: tells the peer (best effort), flushes every outstanding request, calls
  // on_disconnected once. Poller only.
  void enter_error(std::error_code why, Ctrl tell_peer, WcStatus nak_status = WcStatus::success);

  const uint64_t id_;
  TcpCq& cq_;
  base::UniqueFd sock_;
  // TLS on the stream. With both directions in the kernel it is plain socket IO; with either in
  // userspace the reader (poller) and the writers share one OpenSSL object: tls_mu_, a leaf lock
  // taken inside the CQ lock (reads) and tx_mu_ (writes).
  std::unique_ptr<tls::Session> tls_;
  const bool tls_user_;
  std::mutex tls_mu_;
  uint64_t cq_id_ = 0;
  QueueCaps caps_;
  ConnectionEvents events_;
  std::shared_ptr<MrTable> mrs_;
  Address local_;
  Address peer_;
  std::atomic<ConnState> state_{ConnState::connected};
  std::atomic<bool> local_disconnect_{false};
  std::atomic<bool> tx_failed_{false};
  bool dead_ = false;  // poller: flushed and out of epoll

  // Send queue. Slot counters are the data frame numbers of the stream.
  std::mutex tx_mu_;
  std::vector<TxEntry> sq_;
  std::vector<Sge> sq_sges_;
  std::atomic<uint32_t> sq_acked_{0};  // frames the peer placed; written by the poller
  uint32_t sq_tx_ = 0;                 // next frame to transmit (tx_mu_)
  std::atomic<uint32_t> sq_tail_{0};   // next free slot (tx_mu_)
  size_t tx_off_ = 0;                  // bytes of frame sq_tx_ already sent
  bool doorbell_deferred_ = false;     // posted frames wait for the end of the owner's batch
  std::atomic<bool> epollout_{false};  // written under tx_mu_, read lock-free by the poller
  bool rx_enabled_ = true;             // poller only
  int lowat_ = 1;                      // poller only: the socket's SO_RCVLOWAT
  uint32_t ack_sent_ = 0;              // ack value in the last header we started sending
  Ctrl ctrl_ = Ctrl::none;
  FrameHeader ctrl_hdr_{};
  size_t ctrl_off_ = 0;
  bool tx_closed_ = false;             // a NAK or DISCONNECT went out: no more frames

  // Receive queue.
  std::mutex rq_mu_;  // serializes posters, and posters against the flush in enter_error()
  std::vector<RecvEntry> rq_;
  std::atomic<uint32_t> rq_head_{0};  // advanced by the poller only
  std::atomic<uint32_t> rq_tail_{0};  // advanced by post_recv under rq_mu_
  std::atomic<bool> rnr_{false};

  RxEngine rx_;
  bool has_failed_frame_ = false;
  uint32_t failed_frame_ = 0;
  WcStatus failed_status_ = WcStatus::success;
};

// ----- calls of the hot path between tcp_cq.cc, tcp_tx.cc and tcp_conn.cc ------------------
// When the provider was one file (an anonymous namespace) these had one or two callers each
// and GCC inlined them: a file-local function inlined everywhere leaves no copy behind. Shared
// between files a copy stays, and GCC (-O2) then called them instead (compared per function,
// before and after: poll and dispatch called on_events, pump set_lowat and owe_ack, post
// defer_tx, the ack flush send_owed_ack). Defined here and always inlined, poll, dispatch, wait,
// pump and post make the calls they made before the split. One call remains new: the
// vector::push_back in defer_tx, which GCC keeps out of post as an unlikely branch (it runs
// once per connection per batch of deferred doorbells).

// SO_RCVLOWAT while a payload of at least kLowatFrom is coming in: the rest of it, at most
// kLowatMax (the kernel grows the receive buffer to twice the mark).
inline constexpr uint64_t kLowatFrom = 128 * 1024;
inline constexpr uint64_t kLowatMax = 512 * 1024;

inline void TcpConnection::queue_ctrl(Ctrl c, WcStatus nak_status) {
  if (tx_closed_ || ctrl_off_ > 0) return;  // a control frame is half sent: it goes first
  ctrl_ = c;
  FrameType t = c == Ctrl::ack ? FrameType::ack : c == Ctrl::nak ? FrameType::nak : FrameType::disconnect;
  ctrl_hdr_ = make_header(t);
  ctrl_hdr_.status = static_cast<uint8_t>(nak_status);
}

// In the middle of a large payload the socket wakes us only once much of the rest is there:
// read eagerly, each segment costs a wake-up and a readv here and, over loopback, a window
// update that runs the sender's transmit again. The kernel caps the mark at half the largest
// receive buffer and grows the buffer to hold it; a peer's FIN or an error wakes us anyway.
// Not with TLS (records, not payload bytes, are on the socket). Measured (bench/fio.sh, 1 MiB
// writes QD8, one path, quiet host, A/B twice): the server's system calls per IO 9.5-10.4
// against 10.7-13.1, IOPS 1.04-1.06x (within the runs' noise); 4 KiB unchanged.
inline void TcpConnection::set_lowat() {
  if (tls_ != nullptr) return;
  const uint64_t left = rx_.payload_left();
  const int want = left >= kLowatFrom ? static_cast<int>(std::min<uint64_t>(left, kLowatMax)) : 1;
  if (want == lowat_) return;
  if (::setsockopt(sock_.get(), SOL_SOCKET, SO_RCVLOWAT, &want, sizeof(want)) == 0) lowat_ = want;
}

inline void TcpConnection::send_owed_ack() {
  if (dead_) return;
  std::lock_guard lock(tx_mu_);
  if (rx_.placed() != ack_sent_ && ctrl_ == Ctrl::none) {
    queue_ctrl(Ctrl::ack);
    if (!epollout_) flush_tx();
  }
}

inline void TcpConnection::on_events(uint32_t events) {
  if (dead_) return;
  if (events & EPOLLOUT) {
    std::lock_guard lock(tx_mu_);
    flush_tx();
  }
  if (events & (EPOLLIN | EPOLLERR | EPOLLHUP | EPOLLRDHUP)) pump();
  on_wakeup();
}

// ---------------------------------------------------------------------------------------------
class TcpDomain final : public Domain {
 public:
  // `device`: what makes domains one device (the fabric): they share CQs and accept into
  // each other.
  TcpDomain(const void* device, uint32_t max_keys, bool busy)
      : device_(device), mrs_(std::make_shared<MrTable>(max_keys)), busy_poll_(busy) {}
  std::string device_name() const override { return "tcp"; }
  Result<std::unique_ptr<Domain>> alloc_pd(const PdAttr& attr) override {
    return std::unique_ptr<Domain>(new TcpDomain(device_, attr.max_keys, busy_poll_));
  }
  Result<std::unique_ptr<MemoryRegion>> register_memory(void* addr, size_t length,
                                                        uint32_t access) override {
    return SoftMemoryRegion::create(mrs_, addr, length, access);
  }
  Result<std::unique_ptr<MemoryWindow>> alloc_mw() override {
    return SoftMemoryWindow::create(mrs_);
  }
  Result<std::unique_ptr<CompletionQueue>> create_cq(uint32_t capacity) override {
    return TcpCq::create(capacity, busy_poll_);
  }
  Result<ConnectResult> connect(const ConnectParams& p, std::vector<std::byte>* reject_data) override;

  const void* device() const { return device_; }
  // Builds the connection on an established, handshaken socket (and its TLS session, if any),
  // which it takes.
  Result<std::unique_ptr<Connection>> make_connection(CompletionQueue& cq, base::UniqueFd sock,
                                                      const QueueCaps& caps,
                                                      ConnectionEvents events,
                                                      std::unique_ptr<tls::Session> tls = nullptr);
  ibtrs::Status reserve(CompletionQueue& cq, const QueueCaps& caps) {
    auto* tcq = dynamic_cast<TcpCq*>(&cq);
    if (tcq == nullptr) return errc(EINVAL);
    BASE_TRY(check_caps(caps, kMaxQueueDepth, std::min(kMaxSendSge, kMaxRecvSge)));
    return tcq->reserve(caps.max_send_wr + caps.max_recv_wr);
  }

 private:
  const void* device_;
  std::shared_ptr<MrTable> mrs_;
  bool busy_poll_;
};

// Fabric::listen for `domain`'s fabric (tcp_cm.cc).
Result<std::unique_ptr<Listener>> listen_on(TcpDomain& domain, const Address& local,
                                            const Fabric::ListenOptions& o);

}  // namespace ibtrs::fabric::tcp
