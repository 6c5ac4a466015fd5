// Connection management of the tcp provider: the 96-byte CONNECT_REQ/CONNECT_RSP handshake
// (after TLS, when the connection has it), connect(), the listener that reads handshakes of new
// sockets without blocking, and accept/reject of the requests it returns.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
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
#include <optional>
#include <vector>

#include "fabric/held_request.h"
#include "fabric/tcp/tcp_private.h"

namespace ibtrs::fabric::tcp {
namespace {

// How long a listener waits for a connected socket's CONNECT_REQ before dropping it, and how
// long accept/reject may take to send the 96-byte response (it fits an empty socket at once).
constexpr std::chrono::milliseconds kHandshakeTimeout = Listener::kHandshakeTimeout;
// How long a listener stops accepting after the process ran out of file descriptors (or
// memory): the kernel keeps the connection queued, and retrying at once would spin.
constexpr std::chrono::milliseconds kAcceptPause{100};

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

// The private data a valid handshake frame carries (handshake_valid() bounds private_len).
std::vector<std::byte> private_data_of(const HandshakeFrame& f) {
  const auto* pd = reinterpret_cast<const std::byte*>(f.body.private_data);
  return std::vector<std::byte>(pd, pd + f.body.private_len);
}

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

class TcpConnectRequest final : public HeldConnectRequest {
 public:
  TcpConnectRequest(TcpDomain& d, base::UniqueFd sock, std::vector<std::byte> pd,
                    std::unique_ptr<tls::Session> tls)
      : HeldConnectRequest(std::move(pd), address_of(sock.get(), false), address_of(sock.get(), true)),
        domain_(d), sock_(std::move(sock)), tls_(std::move(tls)) {}
  ~TcpConnectRequest() override {
    // The session ends before its socket closes (it does not own the socket).
    tls_.reset();
    sock_.reset();
  }
  std::string tls_identity() const override { return tls_ != nullptr ? tls_->peer_identity() : std::string(); }
  Domain& domain() override;
  using ConnectRequest::accept;
  Result<std::unique_ptr<Connection>> accept(Domain& pd, CompletionQueue& cq,
                                             const QueueCaps& caps,
                                             std::span<const std::byte> private_data,
                                             ConnectionEvents events) override;
  ibtrs::Status reject(std::span<const std::byte> private_data) override {
    if (!sock_) return errc(EINVAL);
    if (private_data.size() > kMaxPrivateData) return errc(EINVAL);
    HandshakeFrame f = make_handshake(FrameType::connect_rsp, kVerdictReject, private_data);
    auto st = io_all(sock_.get(), &f, sizeof(f), true, Clock::now() + kHandshakeTimeout, -1, tls_.get());
    tls_.reset();
    sock_.reset();
    return st;
  }

 private:
  TcpDomain& domain_;
  base::UniqueFd sock_;  // -1: handed to the connection, or rejected
  std::unique_ptr<tls::Session> tls_;
};

// The listener reads the handshakes of new sockets without blocking: fd() is an epoll set of
// the listening socket, every socket whose CONNECT_REQ is incomplete (each with its deadline)
// and a timerfd armed for the earliest deadline, so a waiter wakes when there is something to
// return or to expire (fabric.h, Listener).
class TcpListener final : public Listener {
 public:
  static Result<std::unique_ptr<Listener>> create(TcpDomain& d, base::UniqueFd sock, size_t max_pending,
                                                  std::shared_ptr<tls::Context> tls, bool tls_required);
  ~TcpListener() override;
  Result<std::unique_ptr<ConnectRequest>> get_request(std::chrono::milliseconds timeout) override;
  int fd() const override { return epfd_.get(); }
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
    base::UniqueFd sock;  // declared before tls: the session goes first
    Clock::time_point deadline;
    // first: telling TLS from plaintext by the first bytes; tls: its handshake; frame: the
    // CONNECT_REQ (through TLS when the peer started it).
    enum class Stage : uint8_t { first, tls, frame } stage = Stage::first;
    std::unique_ptr<tls::Session> tls;
    size_t got = 0;
    HandshakeFrame frame;
  };
  using PendingMap = std::map<uint64_t, Pending>;

  TcpListener(TcpDomain& d, base::UniqueFd sock, base::UniqueFd epfd, base::UniqueFd tfd,
              size_t max_pending, std::shared_ptr<tls::Context> tls, bool tls_required)
      : domain_(d), sock_(std::move(sock)), epfd_(std::move(epfd)), tfd_(std::move(tfd)),
        addr_(address_of(sock_.get(), false)),
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
  // Closed by the destructor in reverse order (the timer, the epoll set, then the socket).
  base::UniqueFd sock_;
  base::UniqueFd epfd_;
  base::UniqueFd tfd_;
  Address addr_;
  size_t max_pending_;
  uint64_t next_id_ = kFirstPendingId;
  PendingMap pending_;  // by id: arrival order, which is also deadline order
  std::optional<Clock::time_point> accept_paused_until_;
  std::shared_ptr<tls::Context> tls_;
  bool tls_required_;
  std::atomic<uint64_t> timed_out_{0}, overflow_{0}, invalid_{0}, plaintext_{0}, tls_failed_{0};
};

}  // namespace

Domain& TcpConnectRequest::domain() { return domain_; }

Result<std::unique_ptr<Connection>> TcpConnectRequest::accept(
    Domain& pd_base, CompletionQueue& cq, const QueueCaps& caps,
    std::span<const std::byte> private_data, ConnectionEvents events) {
  auto* pd = dynamic_cast<TcpDomain*>(&pd_base);
  if (!sock_ || private_data.size() > kMaxPrivateData || pd == nullptr ||
      pd->device() != domain_.device())
    return errc(EINVAL);
  BASE_TRY(pd->reserve(cq, caps));
  // The response goes out before the connection is attached: the client sends nothing before
  // it has read the response, and its frames wait in the socket until we attach.
  HandshakeFrame f = make_handshake(FrameType::connect_rsp, kVerdictAccept, private_data);
  auto st = io_all(sock_.get(), &f, sizeof(f), true, Clock::now() + kHandshakeTimeout, -1, tls_.get());
  if (!st) {
    static_cast<TcpCq&>(cq).unreserve(caps.max_send_wr + caps.max_recv_wr);
    return st.error();
  }
  // The connection is the domain's: its peer's writes are checked against pd's keys only.
  return pd->make_connection(cq, std::move(sock_), caps, std::move(events), std::move(tls_));
}

Result<std::unique_ptr<Connection>> TcpDomain::make_connection(CompletionQueue& cq, base::UniqueFd sock,
                                                               const QueueCaps& caps,
                                                               ConnectionEvents events,
                                                               std::unique_ptr<tls::Session> tls) {
  set_nodelay(sock.get());
  auto c = std::make_unique<TcpConnection>(static_cast<TcpCq&>(cq), std::move(sock), caps, std::move(events),
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
  base::UniqueFd sock(::socket(p.remote.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!sock) return fail(errno);
  auto close_fail = [&](int e) {
    sock.reset();
    return fail(e);
  };
  if (p.source != nullptr) {
    Address src = p.source->with_port(0);
    if (::bind(sock.get(), src.sockaddr_ptr(), src.sockaddr_len()) != 0) return close_fail(errno);
  }
  if (::connect(sock.get(), p.remote.sockaddr_ptr(), p.remote.sockaddr_len()) != 0) {
    if (errno != EINPROGRESS) return close_fail(errno);
    int r = wait_fd(sock.get(), POLLOUT, deadline, p.cancel_fd);
    if (r == 0) return close_fail(ETIMEDOUT);
    if (r < 0) return close_fail(-r);
    int err = 0;
    socklen_t len = sizeof(err);
    ::getsockopt(sock.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) return close_fail(err);
  }
  set_nodelay(sock.get());
  std::unique_ptr<tls::Session> session;
  if (p.tls) {
    // TLS first: the provider's own handshake, and everything after it, goes through it.
    auto ts = tls::Session::create(p.tls, sock.get());
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
  if (auto st = io_all(sock.get(), &req, sizeof(req), true, deadline, p.cancel_fd, session.get()); !st)
    return tls_fail(st.error().value());
  HandshakeFrame rsp;
  if (auto st = io_all(sock.get(), &rsp, sizeof(rsp), false, deadline, p.cancel_fd, session.get()); !st)
    return tls_fail(st.error().value());
  if (!handshake_valid(rsp, FrameType::connect_rsp)) return tls_fail(EPROTO);
  std::vector<std::byte> pd = private_data_of(rsp);
  if (rsp.body.verdict == kVerdictTlsRequired) return tls_fail(EPROTONOSUPPORT);
  if (rsp.body.verdict != kVerdictAccept) {
    if (reject_data != nullptr) *reject_data = std::move(pd);
    return tls_fail(ECONNREFUSED);
  }
  auto c = make_connection(*p.cq, std::move(sock), p.caps, p.events, std::move(session));
  return ConnectResult{std::move(c).value(), std::move(pd)};
}

Result<std::unique_ptr<Listener>> TcpListener::create(TcpDomain& d, base::UniqueFd sock, size_t max_pending,
                                                      std::shared_ptr<tls::Context> tls, bool tls_required) {
  base::UniqueFd ep(::epoll_create1(EPOLL_CLOEXEC));
  if (!ep) return errc(errno);
  base::UniqueFd tfd(::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC));
  if (!tfd) return errc(errno);
  // From here the listener owns the three fds.
  std::unique_ptr<TcpListener> l(new TcpListener(d, std::move(sock), std::move(ep), std::move(tfd),
                                                 max_pending, std::move(tls), tls_required));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kListenId;
  if (::epoll_ctl(l->epfd_.get(), EPOLL_CTL_ADD, l->sock_.get(), &ev) != 0) return errc(errno);
  ev.data.u64 = kTimerId;
  if (::epoll_ctl(l->epfd_.get(), EPOLL_CTL_ADD, l->tfd_.get(), &ev) != 0) return errc(errno);
  return std::unique_ptr<Listener>(std::move(l));
}

TcpListener::~TcpListener() {
  // The pending sockets first (each after its session: Pending's member order), then the
  // members: tfd_, epfd_, sock_.
  pending_.clear();
}

void TcpListener::drop(PendingMap::iterator it, std::atomic<uint64_t>& counter) {
  // Closing removes the socket from the epoll set.
  it->second.tls.reset();
  it->second.sock.reset();
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
  ::epoll_ctl(epfd_.get(), EPOLL_CTL_MOD, sock_.get(), &ev);
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
  ::timerfd_settime(tfd_.get(), TFD_TIMER_ABSTIME, &its, nullptr);
}

ibtrs::Status TcpListener::accept_new(Clock::time_point now) {
  for (;;) {
    base::UniqueFd s(::accept4(sock_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!s) {
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
    if (::epoll_ctl(epfd_.get(), EPOLL_CTL_ADD, s.get(), &ev) != 0) continue;  // s closes
    Pending& p = pending_[id];
    p.sock = std::move(s);
    p.deadline = now + kHandshakeTimeout;
  }
}

void TcpListener::watch(int sock, uint64_t id, uint32_t events) {
  epoll_event ev{};
  ev.events = events | EPOLLRDHUP;
  ev.data.u64 = id;
  ::epoll_ctl(epfd_.get(), EPOLL_CTL_MOD, sock, &ev);
}

bool TcpListener::classify(PendingMap::iterator it) {
  Pending& p = it->second;
  // A TLS ClientHello starts with a handshake record header; our CONNECT_REQ with its frame
  // type (1). Three bytes tell them apart without consuming anything.
  std::byte first[3];
  ssize_t n = ::recv(p.sock.get(), first, sizeof(first), MSG_PEEK | MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
  if (n <= 0) {
    drop(it, invalid_);
    return false;
  }
  if (static_cast<size_t>(n) < sizeof(first) && static_cast<uint8_t>(first[0]) == 22) return false;  // wait
  if (tls_ != nullptr && tls::looks_like_tls(std::span(first, static_cast<size_t>(n)))) {
    auto ts = tls::Session::create(tls_, p.sock.get());
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
    while (::recv(p.sock.get(), sink, sizeof(sink), MSG_DONTWAIT) > 0) {
    }
    HandshakeFrame f = make_handshake(FrameType::connect_rsp, kVerdictTlsRequired, {});
    [[maybe_unused]] ssize_t w = ::send(p.sock.get(), &f, sizeof(f), MSG_NOSIGNAL | MSG_DONTWAIT);
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
    watch(p.sock.get(), it->first, EPOLLIN);
    p.stage = Pending::Stage::frame;
    return true;
  }
  if (st.error() == std::errc::resource_unavailable_try_again) {
    watch(p.sock.get(), it->first, p.tls->want() == POLLOUT ? EPOLLOUT : EPOLLIN);
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
      n = ::recv(p.sock.get(), reinterpret_cast<char*>(&p.frame) + p.got, sizeof(p.frame) - p.got, MSG_DONTWAIT);
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
  base::UniqueFd s = std::move(p.sock);
  std::vector<std::byte> pd = private_data_of(p.frame);
  epoll_event ev{};
  ::epoll_ctl(epfd_.get(), EPOLL_CTL_DEL, s.get(), &ev);
  auto session = std::move(p.tls);
  pending_.erase(it);
  return std::make_unique<TcpConnectRequest>(domain_, std::move(s), std::move(pd), std::move(session));
}

Result<std::unique_ptr<ConnectRequest>> TcpListener::get_request(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    const auto now = Clock::now();
    expire(now);
    epoll_event evs[kMaxEvents];
    int n = ::epoll_wait(epfd_.get(), evs, kMaxEvents, 0);
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
        [[maybe_unused]] ssize_t r = ::read(tfd_.get(), &ticks, sizeof(ticks));
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
    pollfd pfd{epfd_.get(), POLLIN, 0};
    if (::poll(&pfd, 1, ms) < 0 && errno != EINTR) return errc(errno);
  }
}

Result<std::unique_ptr<Listener>> listen_on(TcpDomain& domain, const Address& local,
                                            const Fabric::ListenOptions& o) {
  const int backlog = o.backlog;
  if (local.gid) return errc(EAFNOSUPPORT);
  if (local.fabric != FabricKind::tcp || backlog <= 0 || (o.tls_required && !o.tls) ||
      (o.tls && o.tls->role() != tls::Role::server))
    return errc(EINVAL);
  base::UniqueFd s(::socket(local.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!s) return errc(errno);
  int one = 1;
  ::setsockopt(s.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(s.get(), local.sockaddr_ptr(), local.sockaddr_len()) != 0 || ::listen(s.get(), backlog) != 0)
    return errc(errno);
  return TcpListener::create(domain, std::move(s), static_cast<size_t>(backlog), o.tls, o.tls_required);
}

}  // namespace ibtrs::fabric::tcp
