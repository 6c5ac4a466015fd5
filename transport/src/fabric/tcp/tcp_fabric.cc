// The tcp provider: software RDMA over TCP with verbs semantics (see fabric.h and tcp_wire.h).
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
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "fabric/mr_table.h"
#include "fabric/providers.h"
#include "fabric/tcp/tcp_rx.h"
#include "fabric/tcp/tcp_wire.h"

namespace ibtrs::fabric {
namespace tcp {
namespace {

using Clock = std::chrono::steady_clock;

// Reads per connection per poll: bounds how long one busy connection holds the poller.
constexpr unsigned kReadsPerEvent = 8;
// Frames per sendmsg; IOV_MAX is 1024 and each frame takes 1 + SGE iovecs.
constexpr size_t kMaxTxIov = 1024;
// Bytes per sendmsg. One call per 1 MiB frame copies the whole frame under the socket lock
// while the receiver waits for it; 256 KiB pieces keep both sides streaming. Measured on
// loopback, 1 MiB writes (bench/fabric.sh): unbounded ~5.2 GiB/s, 512 KiB ~6.4-7.5,
// 256 KiB ~6.5-6.8, 128 KiB ~4.0.
constexpr size_t kMaxTxBytes = 256 * 1024;
// SO_RCVLOWAT while a payload of at least kLowatFrom is coming in: the rest of it, at most
// kLowatMax (the kernel grows the receive buffer to twice the mark).
constexpr uint64_t kLowatFrom = 128 * 1024;
constexpr uint64_t kLowatMax = 512 * 1024;
constexpr int kMaxEvents = 64;
// How long a listener waits for a connected socket's CONNECT_REQ before dropping it, and how
// long accept/reject may take to send the 96-byte response (it fits an empty socket at once).
constexpr std::chrono::milliseconds kHandshakeTimeout = Listener::kHandshakeTimeout;
// How long a listener stops accepting after the process ran out of file descriptors (or
// memory): the kernel keeps the connection queued, and retrying at once would spin.
constexpr std::chrono::milliseconds kAcceptPause{100};

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left.count(), INT32_MAX));
}

// Waits for `events` on `fd`: 0 past `deadline`, -ECANCELED when `cancel_fd` (if any) is
// readable, -errno on failure, else > 0.
int wait_fd(int fd, short events, Clock::time_point deadline, int cancel_fd) {
  for (;;) {
    pollfd pfd[2] = {{fd, events, 0}, {cancel_fd, POLLIN, 0}};
    int r = ::poll(pfd, cancel_fd >= 0 ? 2 : 1, remaining_ms(deadline));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return -errno;
    if (r > 0 && cancel_fd >= 0 && (pfd[1].revents & POLLIN)) return -ECANCELED;
    return r;
  }
}

// Blocking-with-deadline helpers for the handshake (the only blocking socket use). With a TLS
// session the bytes go through it (its record layer, in the kernel or in userspace).
ibtrs::Status io_all(int fd, void* buf, size_t len, bool sending, Clock::time_point deadline,
                     int cancel_fd = -1, tls::Session* tls = nullptr) {
  auto* p = static_cast<char*>(buf);
  while (len > 0) {
    ssize_t n;
    if (tls != nullptr) {
      iovec iov{p, len};
      n = sending ? tls->writev(&iov, 1) : tls->readv(&iov, 1);
    } else {
      n = sending ? ::send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT) : ::recv(fd, p, len, MSG_DONTWAIT);
    }
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return errc(ECONNRESET);
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return errc(errno);
    if (remaining_ms(deadline) == 0) return errc(ETIMEDOUT);
    int r = wait_fd(fd, static_cast<short>(sending ? POLLOUT : POLLIN), deadline, cancel_fd);
    if (r < 0) return errc(-r);
    if (r == 0) return errc(ETIMEDOUT);
  }
  return {};
}

struct HandshakeFrame {
  FrameHeader hdr;
  ConnectBody body;
};
BASE_WIRE_STRUCT(HandshakeFrame, 96);

HandshakeFrame make_handshake(FrameType type, uint8_t verdict, std::span<const std::byte> pd) {
  HandshakeFrame f;
  std::memset(&f, 0, sizeof(f));
  f.hdr = make_header(type, sizeof(ConnectBody));
  f.body.magic.set(kMagic);
  f.body.version.set(kVersion);
  f.body.private_len = static_cast<uint8_t>(pd.size());
  f.body.verdict = verdict;
  if (!pd.empty()) std::memcpy(f.body.private_data, pd.data(), pd.size());
  return f;
}

bool handshake_valid(const HandshakeFrame& f, FrameType want) {
  return header_is_valid(f.hdr) && static_cast<FrameType>(f.hdr.type) == want &&
         f.hdr.ack.get() == 0 && f.body.magic.get() == kMagic &&
         f.body.version.get() == kVersion && f.body.private_len <= kMaxPrivateData &&
         f.body.verdict <= (want == FrameType::connect_rsp ? kVerdictTlsRequired : kVerdictReject);
}

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

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Queue depths above 64 Ki would only hide a mistake; every IBTRS queue is far smaller.
constexpr uint32_t kMaxQueueDepth = 1u << 16;

// Deferred doorbells need to know whether a post comes from the thread that is working through
// the completions of the connection's CQ. Threads get a never-reused id on their first poll; a
// CQ records the id of the thread whose batch is open (TcpCq::batch_owner_). Constant
// initialisation keeps the read in post_send a plain TLS load.
thread_local uint64_t t_thread_id = 0;
std::atomic<uint64_t> g_next_thread_id{1};

uint64_t this_thread_id() {
  if (t_thread_id == 0) t_thread_id = g_next_thread_id.fetch_add(1, std::memory_order_relaxed);
  return t_thread_id;
}

class TcpConnection;

// Connection ids, never reused in the process: the owner a memory window bound on a connection
// carries, so that only that connection's placements can use it (verbs type 2B).
std::atomic<uint64_t> g_next_conn_id{1};

// ---------------------------------------------------------------------------------------------
class TcpCq final : public CompletionQueue {
 public:
  static Result<std::unique_ptr<CompletionQueue>> create(uint32_t capacity, bool busy_poll);
  ~TcpCq() override {
    ::close(epfd_);
    ::close(evfd_);
  }

  size_t poll(std::span<Completion> out) override;
  size_t wait(std::span<Completion> out, std::chrono::milliseconds timeout) override;
  int fd() const override { return epfd_; }
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
    [[maybe_unused]] ssize_t r = ::write(evfd_, &one, sizeof(one));
  }
  void set_events(uint64_t id, int sock, uint32_t events) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = id;
    ::epoll_ctl(epfd_, EPOLL_CTL_MOD, sock, &ev);
  }

  // Poller side (mu_ held).
  void push(const Completion& c) {
    if (count_ == ring_.size()) grow();
    ring_[(head_ + count_) % ring_.size()] = c;
    ++count_;
  }
  void owe_ack(TcpConnection* c) {
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
  void defer_tx(TcpConnection* c) {
    std::lock_guard lock(defer_mu_);
    deferred_.push_back(c);
  }

 private:
  TcpCq(uint32_t capacity, int epfd, int evfd, bool busy)
      : CompletionQueue(capacity), epfd_(epfd), evfd_(evfd), busy_poll_(busy), ring_(capacity) {
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

  int epfd_;
  int evfd_;
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
  TcpConnection(TcpCq& cq, int sock, const QueueCaps& caps, ConnectionEvents events,
                std::shared_ptr<MrTable> mrs, std::unique_ptr<tls::Session> tls)
      : id_(g_next_conn_id.fetch_add(1, std::memory_order_relaxed)),
        cq_(cq),
        sock_(sock),
        tls_(std::move(tls)),
        tls_user_(tls_ != nullptr && !(tls_->kernel_tx() && tls_->kernel_rx())),
        caps_(caps),
        events_(std::move(events)),
        mrs_(std::move(mrs)),
        local_(address_of(sock, false)),
        peer_(address_of(sock, true)),
        sq_(caps.max_send_wr),
        sq_sges_(static_cast<size_t>(caps.max_send_wr) * caps.max_send_sge),
        rq_(caps.max_recv_wr),
        rx_(*mrs_, kDefaultStaging, id_) {}

  // Attaching is separate from construction so that nothing can poll a half-built object.
  void attach() { cq_.attach(this, sock_, &cq_id_); }

  ~TcpConnection() override {
    // A doorbell still deferred is not rung: as when verbs destroys a QP, requests that never
    // completed are dropped, and their memory may already be gone (sending would read it).
    if (cq_id_ != 0) cq_.detach(cq_id_, sock_);
    cq_.unreserve(caps_.max_send_wr + caps_.max_recv_wr);
    ::close(sock_);
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
  void on_events(uint32_t events);
  // Whether reading the socket is all this connection needs now (no send waiting for room,
  // not stalled on a RECV, not dead).
  bool can_spin_read() const {
    return !dead_ && rx_enabled_ && lowat_ <= 1 && !epollout_.load(std::memory_order_acquire);
  }
  void on_wakeup();
  void send_owed_ack();
  void set_lowat();
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
      n = ::readv(sock_, iov, iovcnt);
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
      return ::sendmsg(sock_, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
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
  void queue_ctrl(Ctrl c, WcStatus nak_status = WcStatus::success);
  void set_epollout(bool on);
  // Moves to error: tells the peer (best effort), flushes every outstanding request, calls
  // on_disconnected once. Poller only.
  void enter_error(std::error_code why, Ctrl tell_peer, WcStatus nak_status = WcStatus::success);

  const uint64_t id_;
  TcpCq& cq_;
  int sock_;
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

// ----- TcpConnection -------------------------------------------------------------------------

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
  cq_.set_events(cq_id_, sock_,
                 (rx_enabled_ ? EPOLLIN | EPOLLRDHUP : 0u) | (on ? EPOLLOUT : 0u));
}

void TcpConnection::queue_ctrl(Ctrl c, WcStatus nak_status) {
  if (tx_closed_ || ctrl_off_ > 0) return;  // a control frame is half sent: it goes first
  ctrl_ = c;
  FrameType t = c == Ctrl::ack ? FrameType::ack : c == Ctrl::nak ? FrameType::nak : FrameType::disconnect;
  ctrl_hdr_ = make_header(t);
  ctrl_hdr_.status = static_cast<uint8_t>(nak_status);
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

// In the middle of a large payload the socket wakes us only once much of the rest is there:
// read eagerly, each segment costs a wake-up and a readv here and, over loopback, a window
// update that runs the sender's transmit again. The kernel caps the mark at half the largest
// receive buffer and grows the buffer to hold it; a peer's FIN or an error wakes us anyway.
// Not with TLS (records, not payload bytes, are on the socket). Measured (bench/fio.sh, 1 MiB
// writes QD8, one path, quiet host, A/B twice): the server's system calls per IO 9.5-10.4
// against 10.7-13.1, IOPS 1.04-1.06x (within the runs' noise); 4 KiB unchanged.
void TcpConnection::set_lowat() {
  if (tls_ != nullptr) return;
  const uint64_t left = rx_.payload_left();
  const int want = left >= kLowatFrom ? static_cast<int>(std::min<uint64_t>(left, kLowatMax)) : 1;
  if (want == lowat_) return;
  if (::setsockopt(sock_, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof(want)) == 0) lowat_ = want;
}

void TcpConnection::send_owed_ack() {
  if (dead_) return;
  std::lock_guard lock(tx_mu_);
  if (rx_.placed() != ack_sent_ && ctrl_ == Ctrl::none) {
    queue_ctrl(Ctrl::ack);
    if (!epollout_) flush_tx();
  }
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
        cq_.set_events(cq_id_, sock_, epollout_ ? EPOLLOUT : 0u);
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

void TcpConnection::on_events(uint32_t events) {
  if (dead_) return;
  if (events & EPOLLOUT) {
    std::lock_guard lock(tx_mu_);
    flush_tx();
  }
  if (events & (EPOLLIN | EPOLLERR | EPOLLHUP | EPOLLRDHUP)) pump();
  on_wakeup();
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
        cq_.set_events(cq_id_, sock_, EPOLLIN | EPOLLRDHUP | (epollout_ ? EPOLLOUT : 0u));
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
  ::shutdown(sock_, SHUT_WR);
  epoll_event ev{};
  ::epoll_ctl(cq_.fd(), EPOLL_CTL_DEL, sock_, &ev);
  if (events_.on_disconnected) events_.on_disconnected(why);
}

// ----- TcpCq ---------------------------------------------------------------------------------

Result<std::unique_ptr<CompletionQueue>> TcpCq::create(uint32_t capacity, bool busy_poll) {
  if (capacity == 0 || capacity > (1u << 22)) return errc(EINVAL);
  int ep = ::epoll_create1(EPOLL_CLOEXEC);
  if (ep < 0) return errc(errno);
  int ev = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (ev < 0) {
    int e = errno;
    ::close(ep);
    return errc(e);
  }
  epoll_event e{};
  e.events = EPOLLIN;
  e.data.u64 = 0;
  ::epoll_ctl(ep, EPOLL_CTL_ADD, ev, &e);
  return std::unique_ptr<CompletionQueue>(new TcpCq(capacity, ep, ev, busy_poll));
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
  ::epoll_ctl(epfd_, EPOLL_CTL_ADD, sock, &ev);
}

void TcpCq::detach(uint64_t id, int sock) {
  std::lock_guard lock(mu_);
  epoll_event ev{};
  ::epoll_ctl(epfd_, EPOLL_CTL_DEL, sock, &ev);
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
      [[maybe_unused]] ssize_t r = ::read(evfd_, &v, sizeof(v));
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
  int k = ::epoll_wait(epfd_, evs, kMaxEvents, 0);
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
    int k = ::epoll_wait(epfd_, evs, kMaxEvents, ms);
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

// ----- handshake objects ---------------------------------------------------------------------

class TcpDomain;

class TcpConnectRequest final : public ConnectRequest {
 public:
  TcpConnectRequest(TcpDomain& d, int sock, std::vector<std::byte> pd, std::unique_ptr<tls::Session> tls)
      : domain_(d), sock_(sock), pd_(std::move(pd)), local_(address_of(sock, false)),
        peer_(address_of(sock, true)), tls_(std::move(tls)) {}
  ~TcpConnectRequest() override {
    tls_.reset();
    if (sock_ >= 0) ::close(sock_);
  }
  std::string tls_identity() const override { return tls_ != nullptr ? tls_->peer_identity() : std::string(); }
  std::span<const std::byte> private_data() const override { return pd_; }
  const Address& peer_address() const override { return peer_; }
  const Address& local_address() const override { return local_; }
  Domain& domain() override;
  using ConnectRequest::accept;
  Result<std::unique_ptr<Connection>> accept(Domain& pd, CompletionQueue& cq,
                                             const QueueCaps& caps,
                                             std::span<const std::byte> private_data,
                                             ConnectionEvents events) override;
  ibtrs::Status reject(std::span<const std::byte> private_data) override {
    if (sock_ < 0) return errc(EINVAL);
    if (private_data.size() > kMaxPrivateData) return errc(EINVAL);
    HandshakeFrame f = make_handshake(FrameType::connect_rsp, kVerdictReject, private_data);
    auto st = io_all(sock_, &f, sizeof(f), true, Clock::now() + kHandshakeTimeout, -1, tls_.get());
    tls_.reset();
    ::close(sock_);
    sock_ = -1;
    return st;
  }

 private:
  TcpDomain& domain_;
  int sock_;
  std::vector<std::byte> pd_;
  Address local_;
  Address peer_;
  std::unique_ptr<tls::Session> tls_;
};

// The listener reads the handshakes of new sockets without blocking: fd() is an epoll set of
// the listening socket, every socket whose CONNECT_REQ is incomplete (each with its deadline)
// and a timerfd armed for the earliest deadline, so a waiter wakes when there is something to
// return or to expire (fabric.h, Listener).
class TcpListener final : public Listener {
 public:
  static Result<std::unique_ptr<Listener>> create(TcpDomain& d, int sock, size_t max_pending,
                                                  std::shared_ptr<tls::Context> tls, bool tls_required);
  ~TcpListener() override;
  Result<std::unique_ptr<ConnectRequest>> get_request(std::chrono::milliseconds timeout) override;
  int fd() const override { return epfd_; }
  const Address& address() const override { return addr_; }
  Drops drops() const override {
    return {timed_out_.load(std::memory_order_relaxed), overflow_.load(std::memory_order_relaxed),
            invalid_.load(std::memory_order_relaxed), plaintext_.load(std::memory_order_relaxed),
            tls_failed_.load(std::memory_order_relaxed)};
  }

 private:
  // epoll ids: the listening socket, the timer, then one per pending socket in arrival order.
  enum : uint64_t { kListenId = 0, kTimerId = 1, kFirstPendingId = 2 };
  struct Pending {
    int sock;
    Clock::time_point deadline;
    // first: telling TLS from plaintext by the first bytes; tls: its handshake; frame: the
    // CONNECT_REQ (through TLS when the peer started it).
    enum class Stage : uint8_t { first, tls, frame } stage = Stage::first;
    std::unique_ptr<tls::Session> tls;
    size_t got = 0;
    HandshakeFrame frame;
  };
  using PendingMap = std::map<uint64_t, Pending>;

  TcpListener(TcpDomain& d, int sock, int epfd, int tfd, size_t max_pending,
              std::shared_ptr<tls::Context> tls, bool tls_required)
      : domain_(d), sock_(sock), epfd_(epfd), tfd_(tfd), addr_(address_of(sock, false)),
        max_pending_(max_pending), tls_(std::move(tls)), tls_required_(tls_required) {}
  // The stage of pending socket `it` that decides between TLS and plaintext. False: not yet
  // decided (or dropped: `it` is then gone).
  bool classify(PendingMap::iterator it);
  // One step of its TLS handshake. False: not done (or dropped).
  bool tls_step(PendingMap::iterator it);
  void watch(int sock, uint64_t id, uint32_t events);
  // Takes every socket the kernel queued. A resource error pauses accepting (kAcceptPause) and
  // is returned.
  ibtrs::Status accept_new(Clock::time_point now);
  // Reads what pending socket `id` sent: its request once the frame is complete and valid.
  std::unique_ptr<ConnectRequest> read_pending(uint64_t id);
  void drop(PendingMap::iterator it, std::atomic<uint64_t>& counter);
  void expire(Clock::time_point now);
  // The timer for the earliest deadline (or the end of an accept pause); disarmed when none.
  void arm_timer();
  void watch_listen_socket(bool on);

  TcpDomain& domain_;
  int sock_;
  int epfd_;
  int tfd_;
  Address addr_;
  size_t max_pending_;
  uint64_t next_id_ = kFirstPendingId;
  PendingMap pending_;  // by id: arrival order, which is also deadline order
  std::optional<Clock::time_point> accept_paused_until_;
  std::shared_ptr<tls::Context> tls_;
  bool tls_required_;
  std::atomic<uint64_t> timed_out_{0}, overflow_{0}, invalid_{0}, plaintext_{0}, tls_failed_{0};
};

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
  // Builds the connection on an established, handshaken socket (and its TLS session, if any).
  // Takes the socket on success.
  Result<std::unique_ptr<Connection>> make_connection(CompletionQueue& cq, int sock,
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

Domain& TcpConnectRequest::domain() { return domain_; }

Result<std::unique_ptr<Connection>> TcpConnectRequest::accept(
    Domain& pd_base, CompletionQueue& cq, const QueueCaps& caps,
    std::span<const std::byte> private_data, ConnectionEvents events) {
  auto* pd = dynamic_cast<TcpDomain*>(&pd_base);
  if (sock_ < 0 || private_data.size() > kMaxPrivateData || pd == nullptr ||
      pd->device() != domain_.device())
    return errc(EINVAL);
  BASE_TRY(pd->reserve(cq, caps));
  // The response goes out before the connection is attached: the client sends nothing before
  // it has read the response, and its frames wait in the socket until we attach.
  HandshakeFrame f = make_handshake(FrameType::connect_rsp, kVerdictAccept, private_data);
  auto st = io_all(sock_, &f, sizeof(f), true, Clock::now() + kHandshakeTimeout, -1, tls_.get());
  if (!st) {
    static_cast<TcpCq&>(cq).unreserve(caps.max_send_wr + caps.max_recv_wr);
    return st.error();
  }
  // The connection is the domain's: its peer's writes are checked against pd's keys only.
  auto conn = pd->make_connection(cq, sock_, caps, std::move(events), std::move(tls_));
  sock_ = -1;
  return conn;
}

Result<std::unique_ptr<Connection>> TcpDomain::make_connection(CompletionQueue& cq, int sock,
                                                               const QueueCaps& caps,
                                                               ConnectionEvents events,
                                                               std::unique_ptr<tls::Session> tls) {
  set_nodelay(sock);
  auto c = std::make_unique<TcpConnection>(static_cast<TcpCq&>(cq), sock, caps, std::move(events),
                                           mrs_, std::move(tls));
  c->attach();
  return std::unique_ptr<Connection>(std::move(c));
}

Result<ConnectResult> TcpDomain::connect(const ConnectParams& p, std::vector<std::byte>* reject_data) {
  if (p.cq == nullptr || p.private_data.size() > kMaxPrivateData ||
      p.remote.fabric != FabricKind::tcp || (p.tls && p.tls->role() != tls::Role::client))
    return errc(EINVAL);
  BASE_TRY(reserve(*p.cq, p.caps));
  const uint32_t reserved = p.caps.max_send_wr + p.caps.max_recv_wr;
  auto fail = [&](int e) -> Result<ConnectResult> {
    static_cast<TcpCq*>(p.cq)->unreserve(reserved);
    return errc(e);
  };
  const auto deadline = Clock::now() + p.timeout;
  int sock = ::socket(p.remote.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (sock < 0) return fail(errno);
  auto close_fail = [&](int e) {
    ::close(sock);
    return fail(e);
  };
  if (p.source != nullptr) {
    Address src = p.source->with_port(0);
    if (::bind(sock, src.sockaddr_ptr(), src.sockaddr_len()) != 0) return close_fail(errno);
  }
  if (::connect(sock, p.remote.sockaddr_ptr(), p.remote.sockaddr_len()) != 0) {
    if (errno != EINPROGRESS) return close_fail(errno);
    int r = wait_fd(sock, POLLOUT, deadline, p.cancel_fd);
    if (r == 0) return close_fail(ETIMEDOUT);
    if (r < 0) return close_fail(-r);
    int err = 0;
    socklen_t len = sizeof(err);
    ::getsockopt(sock, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) return close_fail(err);
  }
  set_nodelay(sock);
  std::unique_ptr<tls::Session> session;
  if (p.tls) {
    // TLS first: the provider's own handshake, and everything after it, goes through it.
    auto ts = tls::Session::create(p.tls, sock);
    if (!ts.ok()) return close_fail(ts.error().value());
    session = std::move(*ts);
    if (auto st = session->handshake(deadline, p.cancel_fd); !st) {
      session.reset();
      return close_fail(st.error().value());
    }
  }
  // Closing the socket ends the session first (it does not own the socket).
  auto tls_fail = [&](int e) {
    session.reset();
    return close_fail(e);
  };
  HandshakeFrame req = make_handshake(FrameType::connect_req, 0, p.private_data);
  if (auto st = io_all(sock, &req, sizeof(req), true, deadline, p.cancel_fd, session.get()); !st)
    return tls_fail(st.error().value());
  HandshakeFrame rsp;
  if (auto st = io_all(sock, &rsp, sizeof(rsp), false, deadline, p.cancel_fd, session.get()); !st)
    return tls_fail(st.error().value());
  if (!handshake_valid(rsp, FrameType::connect_rsp)) return tls_fail(EPROTO);
  std::vector<std::byte> pd(reinterpret_cast<const std::byte*>(rsp.body.private_data),
                            reinterpret_cast<const std::byte*>(rsp.body.private_data) +
                                rsp.body.private_len);
  if (rsp.body.verdict == kVerdictTlsRequired) return tls_fail(EPROTONOSUPPORT);
  if (rsp.body.verdict != kVerdictAccept) {
    if (reject_data != nullptr) *reject_data = std::move(pd);
    return tls_fail(ECONNREFUSED);
  }
  auto c = make_connection(*p.cq, sock, p.caps, p.events, std::move(session));
  return ConnectResult{std::move(c).value(), std::move(pd)};
}

Result<std::unique_ptr<Listener>> TcpListener::create(TcpDomain& d, int sock, size_t max_pending,
                                                      std::shared_ptr<tls::Context> tls, bool tls_required) {
  int ep = ::epoll_create1(EPOLL_CLOEXEC);
  if (ep < 0) return errc(errno);
  int tfd = ::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  if (tfd < 0) {
    int e = errno;
    ::close(ep);
    return errc(e);
  }
  // From here the listener owns the three fds.
  std::unique_ptr<TcpListener> l(new TcpListener(d, sock, ep, tfd, max_pending, std::move(tls), tls_required));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kListenId;
  if (::epoll_ctl(ep, EPOLL_CTL_ADD, sock, &ev) != 0) return errc(errno);
  ev.data.u64 = kTimerId;
  if (::epoll_ctl(ep, EPOLL_CTL_ADD, tfd, &ev) != 0) return errc(errno);
  return std::unique_ptr<Listener>(std::move(l));
}

TcpListener::~TcpListener() {
  for (auto& [id, p] : pending_) {
    p.tls.reset();
    ::close(p.sock);
  }
  ::close(tfd_);
  ::close(epfd_);
  ::close(sock_);
}

void TcpListener::drop(PendingMap::iterator it, std::atomic<uint64_t>& counter) {
  // Closing removes the socket from the epoll set.
  it->second.tls.reset();
  ::close(it->second.sock);
  pending_.erase(it);
  counter.fetch_add(1, std::memory_order_relaxed);
}

void TcpListener::expire(Clock::time_point now) {
  while (!pending_.empty() && pending_.begin()->second.deadline <= now)
    drop(pending_.begin(), timed_out_);
  if (accept_paused_until_ && *accept_paused_until_ <= now) {
    accept_paused_until_.reset();
    watch_listen_socket(true);
  }
}

void TcpListener::watch_listen_socket(bool on) {
  epoll_event ev{};
  ev.events = on ? EPOLLIN : 0u;
  ev.data.u64 = kListenId;
  ::epoll_ctl(epfd_, EPOLL_CTL_MOD, sock_, &ev);
}

void TcpListener::arm_timer() {
  std::optional<Clock::time_point> next = accept_paused_until_;
  if (!pending_.empty() && (!next || pending_.begin()->second.deadline < *next))
    next = pending_.begin()->second.deadline;
  itimerspec its{};
  if (next) {
    // steady_clock is CLOCK_MONOTONIC on Linux; an absolute time already past fires at once.
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(next->time_since_epoch()).count();
    its.it_value.tv_sec = static_cast<time_t>(std::max<int64_t>(ns, 1) / 1000000000);
    its.it_value.tv_nsec = static_cast<long>(std::max<int64_t>(ns, 1) % 1000000000);
  }
  // Setting the timer also clears an expiry not read yet.
  ::timerfd_settime(tfd_, TFD_TIMER_ABSTIME, &its, nullptr);
}

ibtrs::Status TcpListener::accept_new(Clock::time_point now) {
  for (;;) {
    int s = ::accept4(sock_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (s < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return {};
      const int e = errno;
      if (e == EMFILE || e == ENFILE || e == ENOBUFS || e == ENOMEM) {
        // Out of descriptors or memory: the kernel keeps the connection queued and would report
        // the socket readable again at once. Pause instead of spinning.
        accept_paused_until_ = now + kAcceptPause;
        watch_listen_socket(false);
      }
      return errc(e);
    }
    if (pending_.size() >= max_pending_) drop(pending_.begin(), overflow_);
    const uint64_t id = next_id_++;
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.u64 = id;
    if (::epoll_ctl(epfd_, EPOLL_CTL_ADD, s, &ev) != 0) {
      ::close(s);
      continue;
    }
    Pending& p = pending_[id];
    p.sock = s;
    p.deadline = now + kHandshakeTimeout;
  }
}

void TcpListener::watch(int sock, uint64_t id, uint32_t events) {
  epoll_event ev{};
  ev.events = events | EPOLLRDHUP;
  ev.data.u64 = id;
  ::epoll_ctl(epfd_, EPOLL_CTL_MOD, sock, &ev);
}

bool TcpListener::classify(PendingMap::iterator it) {
  Pending& p = it->second;
  // A TLS ClientHello starts with a handshake record header; our CONNECT_REQ with its frame
  // type (1). Three bytes tell them apart without consuming anything.
  std::byte first[3];
  ssize_t n = ::recv(p.sock, first, sizeof(first), MSG_PEEK | MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
  if (n <= 0) {
    drop(it, invalid_);
    return false;
  }
  if (static_cast<size_t>(n) < sizeof(first) && static_cast<uint8_t>(first[0]) == 22) return false;  // wait
  if (tls_ != nullptr && tls::looks_like_tls(std::span(first, static_cast<size_t>(n)))) {
    auto ts = tls::Session::create(tls_, p.sock);
    if (!ts.ok()) {
      drop(it, tls_failed_);
      return false;
    }
    p.tls = std::move(*ts);
    p.stage = Pending::Stage::tls;
    return true;
  }
  if (tls_required_) {
    // Said in plaintext, best effort (the socket is new: 96 bytes fit its buffer): the peer's
    // connect fails with EPROTONOSUPPORT instead of a bare reset.
    // What it sent is read first: a socket closed with unread bytes resets the connection,
    // and the reset may overtake the answer.
    std::byte sink[512];
    while (::recv(p.sock, sink, sizeof(sink), MSG_DONTWAIT) > 0) {
    }
    HandshakeFrame f = make_handshake(FrameType::connect_rsp, kVerdictTlsRequired, {});
    [[maybe_unused]] ssize_t w = ::send(p.sock, &f, sizeof(f), MSG_NOSIGNAL | MSG_DONTWAIT);
    drop(it, plaintext_);
    return false;
  }
  p.stage = Pending::Stage::frame;
  return true;
}

bool TcpListener::tls_step(PendingMap::iterator it) {
  Pending& p = it->second;
  auto st = p.tls->handshake_step();
  if (st.ok()) {
    watch(p.sock, it->first, EPOLLIN);
    p.stage = Pending::Stage::frame;
    return true;
  }
  if (st.error() == std::errc::resource_unavailable_try_again) {
    watch(p.sock, it->first, p.tls->want() == POLLOUT ? EPOLLOUT : EPOLLIN);
    return false;
  }
  drop(it, tls_failed_);
  return false;
}

std::unique_ptr<ConnectRequest> TcpListener::read_pending(uint64_t id) {
  auto it = pending_.find(id);
  if (it == pending_.end()) return nullptr;  // dropped in this pass
  Pending& p = it->second;
  if (p.stage == Pending::Stage::first && !classify(it)) return nullptr;
  if (p.stage == Pending::Stage::tls && !tls_step(it)) return nullptr;
  // Exactly the frame: the peer sends nothing more before it has read our response.
  for (;;) {
    ssize_t n;
    if (p.tls != nullptr) {
      iovec iov{reinterpret_cast<char*>(&p.frame) + p.got, sizeof(p.frame) - p.got};
      n = p.tls->readv(&iov, 1);
    } else {
      n = ::recv(p.sock, reinterpret_cast<char*>(&p.frame) + p.got, sizeof(p.frame) - p.got, MSG_DONTWAIT);
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return nullptr;
    if (n <= 0) {
      drop(it, invalid_);
      return nullptr;
    }
    p.got += static_cast<size_t>(n);
    if (p.got == sizeof(p.frame)) break;
  }
  if (!handshake_valid(p.frame, FrameType::connect_req)) {
    drop(it, invalid_);
    return nullptr;
  }
  const int s = p.sock;
  std::vector<std::byte> pd(reinterpret_cast<const std::byte*>(p.frame.body.private_data),
                            reinterpret_cast<const std::byte*>(p.frame.body.private_data) +
                                p.frame.body.private_len);
  epoll_event ev{};
  ::epoll_ctl(epfd_, EPOLL_CTL_DEL, s, &ev);
  auto session = std::move(p.tls);
  pending_.erase(it);
  return std::make_unique<TcpConnectRequest>(domain_, s, std::move(pd), std::move(session));
}

Result<std::unique_ptr<ConnectRequest>> TcpListener::get_request(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    const auto now = Clock::now();
    expire(now);
    epoll_event evs[kMaxEvents];
    int n = ::epoll_wait(epfd_, evs, kMaxEvents, 0);
    if (n < 0 && errno != EINTR) return errc(errno);
    std::unique_ptr<ConnectRequest> ready;
    ibtrs::Status failed;
    // The set is level-triggered: what this pass leaves (after a request was found) shows again.
    for (int i = 0; i < n && ready == nullptr; ++i) {
      const uint64_t id = evs[i].data.u64;
      if (id == kListenId) {
        if (auto st = accept_new(now); !st) failed = st;
      } else if (id == kTimerId) {
        uint64_t ticks;
        [[maybe_unused]] ssize_t r = ::read(tfd_, &ticks, sizeof(ticks));
      } else {
        ready = read_pending(id);
      }
    }
    arm_timer();
    if (ready != nullptr) return ready;
    if (!failed) return failed.error();
    const int ms = remaining_ms(deadline);
    if (ms == 0) return errc(ETIMEDOUT);
    // Anything to do: a new socket, bytes from a pending one, or the timer.
    pollfd pfd{epfd_, POLLIN, 0};
    if (::poll(&pfd, 1, ms) < 0 && errno != EINTR) return errc(errno);
  }
}

class TcpFabric final : public Fabric {
 public:
  explicit TcpFabric(const FabricOptions& o) : domain_(this, 0, o.busy_poll) {}
  FabricKind kind() const override { return FabricKind::tcp; }
  Result<Domain*> domain_for(const Address& remote, const Address* source) override {
    // A GID is an RDMA address (Address::parse makes gid: rdma; one built in code may not be).
    if (remote.gid || (source != nullptr && source->gid)) return errc(EAFNOSUPPORT);
    if (remote.fabric != FabricKind::tcp) return errc(EINVAL);
    return static_cast<Domain*>(&domain_);
  }
  using Fabric::listen;
  Result<std::unique_ptr<Listener>> listen(const Address& local, const ListenOptions& o) override {
    const int backlog = o.backlog;
    if (local.gid) return errc(EAFNOSUPPORT);
    if (local.fabric != FabricKind::tcp || backlog <= 0 || (o.tls_required && !o.tls) ||
        (o.tls && o.tls->role() != tls::Role::server))
      return errc(EINVAL);
    int s = ::socket(local.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (s < 0) return errc(errno);
    int one = 1;
    ::setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(s, local.sockaddr_ptr(), local.sockaddr_len()) != 0 || ::listen(s, backlog) != 0) {
      int e = errno;
      ::close(s);
      return errc(e);
    }
    return TcpListener::create(domain_, s, static_cast<size_t>(backlog), o.tls, o.tls_required);
  }

 private:
  TcpDomain domain_;
};

}  // namespace
}  // namespace tcp

Result<std::unique_ptr<Fabric>> make_tcp_fabric(const FabricOptions& options) {
  return std::unique_ptr<Fabric>(new tcp::TcpFabric(options));
}

}  // namespace ibtrs::fabric
