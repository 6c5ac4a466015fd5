// The NBD server's event loop: listeners, connections, socket IO, and the handoff of export
// completions from whatever thread they run on back to the loop.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/unix_socket.h"
#include "server_impl.h"

namespace ibnbd::nbd {

namespace {

using ibtrs::errc;

// epoll user data: connection ids count up from 1; listeners have the top bit, polled exports
// the next one; 0 is the eventfd.
constexpr uint64_t kListenerTag = 1ull << 63;
constexpr uint64_t kPolledTag = 1ull << 62;

// The server whose loop runs on this thread: completions that run here need no hand-off.
thread_local NbdServer::Impl* tl_loop = nullptr;

Result<int> listen_tcp(ListenSpec& l) {
  sockaddr_storage ss{};
  socklen_t len = 0;
  const bool v6 = l.host.find(':') != std::string::npos;
  if (v6) {
    auto* s6 = reinterpret_cast<sockaddr_in6*>(&ss);
    s6->sin6_family = AF_INET6;
    s6->sin6_port = htons(l.port);
    if (inet_pton(AF_INET6, l.host.c_str(), &s6->sin6_addr) != 1) return errc(EINVAL);
    len = sizeof(*s6);
  } else {
    auto* s4 = reinterpret_cast<sockaddr_in*>(&ss);
    s4->sin_family = AF_INET;
    s4->sin_port = htons(l.port);
    if (inet_pton(AF_INET, l.host.c_str(), &s4->sin_addr) != 1) return errc(EINVAL);
    len = sizeof(*s4);
  }
  base::UniqueFd fd(::socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd) return errc(errno);
  const int one = 1;
  (void)::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (v6) (void)::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&ss), len) != 0 || ::listen(fd.get(), 128) != 0) return errc(errno);
  len = sizeof(ss);
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len) == 0)
    l.port = ntohs(v6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                      : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return fd.release();  // the caller's, as unix_listen's is
}

std::string peer_name(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = "?";
  if (ss.ss_family == AF_INET) {
    auto* s = reinterpret_cast<sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &s->sin_addr, host, sizeof(host));
    return std::string(host) + ":" + std::to_string(ntohs(s->sin_port));
  }
  if (ss.ss_family == AF_INET6) {
    auto* s = reinterpret_cast<sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &s->sin6_addr, host, sizeof(host));
    return "[" + std::string(host) + "]:" + std::to_string(ntohs(s->sin6_port));
  }
  return "unix";
}

bool valid_info(const ExportInfo& i) {
  auto pow2 = [](uint32_t v) { return v != 0 && (v & (v - 1)) == 0; };
  return pow2(i.min_block) && i.min_block <= (64u << 10) && pow2(i.preferred_block) &&
         i.preferred_block >= i.min_block && i.max_payload >= i.min_block &&
         i.max_payload % i.min_block == 0 && i.size % i.min_block == 0;
}

}  // namespace

uint32_t to_nbd_error(int err) {
  switch (err) {
    case 0: return 0;
    case EPERM: case EROFS: case EACCES: return wire::kEperm;
    case ENOMEM: return wire::kEnomem;
    case EINVAL: return wire::kEinval;
    case ENOSPC: case EDQUOT: case EFBIG: return wire::kEnospc;  // spec: "SHOULD map"
    case EOVERFLOW: return wire::kEoverflow;
    case EOPNOTSUPP: return wire::kEnotsup;
    case ESHUTDOWN: return wire::kEshutdown;
    default: return wire::kEio;  // ENOTCONN, ETIMEDOUT, ENODEV, ...: the device failed the IO
  }
}

// ---- NbdServer ----

Result<std::unique_ptr<NbdServer>> NbdServer::start(NbdServerOptions options) {
  if (options.exports.empty() || options.max_requests == 0 || options.max_connections == 0)
    return errc(EINVAL);
  if ((options.tls_required && !options.tls) ||
      (options.tls && options.tls->role() != ibtrs::tls::Role::server))
    return errc(EINVAL);
  for (auto& [name, e] : options.exports) {
    if (!e || name.size() > kMaxString || !valid_info(e->info())) return errc(EINVAL);
  }
  auto impl = std::make_unique<Impl>();
  impl->opts = std::move(options);
  for (auto& [name, e] : impl->opts.exports) {
    if (impl->pools.count(e.get())) continue;  // one export under several names
    const std::span<std::byte> mem = e->request_memory();
    if (mem.size() >= PagePool::kPage) impl->pools[e.get()].init(mem);
  }
  impl->epfd.reset(::epoll_create1(EPOLL_CLOEXEC));
  impl->evfd.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!impl->epfd || !impl->evfd) return errc(errno);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;
  if (::epoll_ctl(impl->epfd.get(), EPOLL_CTL_ADD, impl->evfd.get(), &ev) != 0) return errc(errno);
  for (ListenSpec l : impl->opts.listen) {
    auto fd = l.kind == ListenSpec::Kind::unix_socket ? base::unix_listen(l.path, 128, true, base::UnixSocketAccess{l.mode, l.group})
                                                      : listen_tcp(l);
    if (!fd.ok()) return fd.error();  // ~Impl closes and unlinks what was bound
    impl->listen_fds.emplace_back(*fd);
    impl->bound.push_back(l);
    ev.events = EPOLLIN;
    ev.data.u64 = kListenerTag | (impl->listen_fds.size() - 1);
    if (::epoll_ctl(impl->epfd.get(), EPOLL_CTL_ADD, *fd, &ev) != 0) return errc(errno);
  }
  Impl* p = impl.get();
  impl->thread = std::thread([p] { p->run(); });
  return std::unique_ptr<NbdServer>(new NbdServer(std::move(impl)));
}

NbdServer::NbdServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NbdServer::~NbdServer() { stop(); }

Status NbdServer::serve_fd(int raw) {
  base::UniqueFd fd(raw);  // ours from here on, served or closed
  {
    std::lock_guard l(impl_->done_mu);
    if (!impl_->stopping.load()) impl_->adopt.push_back(std::move(fd));
  }
  if (fd) return errc(ESHUTDOWN);  // closes it
  impl_->wake();
  return {};
}

void NbdServer::stop() {
  std::lock_guard l(impl_->stop_mu);
  if (impl_->stopped) return;
  impl_->stopped = true;
  {
    std::lock_guard d(impl_->done_mu);
    impl_->stopping.store(true);
  }
  impl_->wake();
  if (impl_->thread.joinable()) impl_->thread.join();
}

const std::vector<ListenSpec>& NbdServer::listening() const { return impl_->bound; }

NbdServerStats NbdServer::stats() const {
  const auto& c = impl_->stats;
  NbdServerStats s;
  s.accepted = c.accepted.load();
  s.refused = c.refused.load();
  s.connections = c.connections.load();
  s.requests = c.requests.load();
  s.errors = c.errors.load();
  s.protocol_errors = c.protocol_errors.load();
  s.tls_upgrades = c.tls_upgrades.load();
  s.tls_failures = c.tls_failures.load();
  s.read_bytes = c.read_bytes.load();
  s.write_bytes = c.write_bytes.load();
  s.memory_waits = c.memory_waits.load();
  s.stalls = c.stalls.load();
  return s;
}

// ---- Impl ----

NbdServer::Impl::~Impl() {
  for (size_t i = 0; i < listen_fds.size(); ++i) {
    if (!listen_fds[i]) continue;
    listen_fds[i].reset();  // before the unlink: no connection lands on a name being removed
    if (bound[i].kind == ListenSpec::Kind::unix_socket) ::unlink(bound[i].path.c_str());
  }
  adopt.clear();
  evfd.reset();
  epfd.reset();
}

void NbdServer::Impl::log(const std::string& m) const {
  if (opts.log) opts.log(m);
}

void NbdServer::Impl::wake() {
  const uint64_t one = 1;
  ssize_t n = ::write(evfd.get(), &one, sizeof(one));
  (void)n;  // EAGAIN: the counter is already non-zero, the loop will wake anyway
}

// Runs on any thread, possibly inside the export call that submitted the slot.
void NbdServer::Impl::on_done(void* ctx, int err) {
  auto* s = static_cast<Slot*>(ctx);
  Impl* self = s->conn->srv;
  s->err = err;
  s->done_next = nullptr;
  if (tl_loop == self) {
    // On the loop (inline, or reaped by Export::poll_loop): completed once the call that ran
    // it returns, without a lock or a wake-up.
    if (self->local_tail) self->local_tail->done_next = s;
    else self->local_head = s;
    self->local_tail = s;
    return;
  }
  bool signal = false;
  {
    std::lock_guard l(self->done_mu);
    if (self->done_tail) self->done_tail->done_next = s;
    else self->done_head = s;
    self->done_tail = s;
    if (!self->signalled) signal = self->signalled = true;
  }
  if (signal) self->wake();
}

void NbdServer::Impl::run() {
  tl_loop = this;
  // Exports that let the loop poll their completions, in the same epoll set as the sockets.
  for (auto& [name, e] : opts.exports) {
    if (std::find(polled.begin(), polled.end(), e.get()) != polled.end()) continue;
    const int fd = e->attach_loop();
    if (fd < 0) continue;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kPolledTag | polled.size();
    polled.push_back(e.get());
    if (::epoll_ctl(epfd.get(), EPOLL_CTL_ADD, fd, &ev) != 0) log(std::string("nbd: export polling: epoll: ") + std::strerror(errno));
  }
  epoll_event evs[64];
  bool stop_done = false;
  std::vector<uint64_t> ids;
  for (;;) {
    if (stop_done && conns.empty()) break;
    bool resume = false;  // request memory came back during the last resume: waiters go again
    for (auto& [e, pool] : pools) resume = resume || pool.resume;
    const int timeout = !rx_ready.empty() || local_head != nullptr || resume ? 0 : conns.empty() ? -1 : 500;
    const int n = ::epoll_wait(epfd.get(), evs, 64, timeout);
    if (n < 0 && errno != EINTR) break;
    bool poll = false;
    for (int i = 0; i < std::max(n, 0); ++i) {
      const uint64_t tag = evs[i].data.u64;
      if (tag == 0) {
        uint64_t v;
        ssize_t r = ::read(evfd.get(), &v, sizeof(v));
        (void)r;
        std::vector<base::UniqueFd> fds;
        {
          std::lock_guard l(done_mu);
          fds.swap(adopt);
        }
        for (base::UniqueFd& fd : fds) {
          const int raw = fd.get();
          add_conn(std::move(fd), peer_name(raw));
        }
        drain_completions();
        // A completion from another thread: the exports' polling may have lost hold of what
        // it polls (Export::poll_loop takes it back).
        poll = poll || remote_seen;
      } else if (tag & kListenerTag) {
        const int lfd = listen_fds[tag & ~kListenerTag].get();
        for (;;) {
          base::UniqueFd fd(::accept4(lfd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
          if (!fd) break;  // EAGAIN, or a transient error (EMFILE, ECONNABORTED)
          const int raw = fd.get();
          add_conn(std::move(fd), peer_name(raw));
        }
      } else if (tag & kPolledTag) {
        poll = true;
      } else if (auto it = conns.find(tag); it != conns.end()) {
        on_event(*it->second, evs[i].events);
      }
    }
    if (poll) poll_exports();
    // What completed on this thread meanwhile (reaped, or inline in a submission).
    if (local_head != nullptr) {
      Slot* l = local_head;
      local_head = local_tail = nullptr;
      run_completions(l);
    }
    if (!rx_ready.empty()) {
      ids.swap(rx_ready);
      rx_ready.clear();
      for (uint64_t id : ids) {
        if (auto it = conns.find(id); it != conns.end()) on_event(*it->second, EPOLLIN);
      }
    }
    resume_waiters();
    if (stopping.load() && !stop_done) {
      // Stop: no new connections; every connection stops reading and is freed once its
      // requests in flight are done (spec "Terminating the transmission phase": a server
      // shutting down SHOULD wait for inflight requests first).
      stop_done = true;
      for (size_t i = 0; i < listen_fds.size(); ++i) {
        ::epoll_ctl(epfd.get(), EPOLL_CTL_DEL, listen_fds[i].get(), nullptr);
        listen_fds[i].reset();
        if (bound[i].kind == ListenSpec::Kind::unix_socket) ::unlink(bound[i].path.c_str());
      }
      ids.clear();
      for (auto& [id, c] : conns) ids.push_back(id);
      for (uint64_t id : ids) {
        Conn& c = *conns[id];
        c.rx_closed = true;
        ::shutdown(c.fd.get(), SHUT_RD);
        if (c.rx_slot) {  // a WRITE whose payload will never arrive
          release(c, *c.rx_slot);
          c.rx_slot = nullptr;
        }
        c.last_io = Clock::now();  // the drain of its replies is timed from here
        update(c);
      }
    }
    // Handshake deadlines.
    const auto now = Clock::now();
    ids.clear();
    for (auto& [id, c] : conns)
      if (c->phase != Conn::Phase::transmission && !c->rx_closed && now >= c->deadline) ids.push_back(id);
    for (uint64_t id : ids) {
      Conn& c = *conns[id];
      fail(c, "handshake timeout", false);
      update(c);
    }
    check_stalls(now);
  }
  for (Export* e : polled) e->detach_loop();
  polled.clear();
  tl_loop = nullptr;
}

// Runs what the exports' polling finds (their completions land on the local list).
void NbdServer::Impl::poll_exports() {
  for (Export* e : polled) e->poll_loop();
}

// Connections waiting for request memory, after some came back: each parses again, oldest
// first; those that still find no room queue again.
void NbdServer::Impl::resume_waiters() {
  for (auto& [e, pool] : pools) {
    if (!pool.resume) continue;
    pool.resume = false;
    std::vector<uint64_t> w;
    w.swap(pool.waiters);
    for (size_t i = 0; i < w.size(); ++i) {
      auto it = conns.find(w[i]);
      if (it == conns.end() || !it->second->mem_wait) continue;
      Conn& c = *it->second;
      c.mem_wait = false;
      c.paused = false;
      c.resuming = true;
      pump(c);
      c.resuming = false;
      update(c);
    }
  }
}

// A connection that holds request memory and moves no byte while others wait for that memory
// (or while the server stops) is dropped: its slots give the memory back as their requests end.
void NbdServer::Impl::check_stalls(Clock::time_point now) {
  const bool stop = stopping.load();
  bool waiting = false;
  for (auto& [e, pool] : pools) waiting = waiting || !pool.waiters.empty();
  if (!waiting && !stop) return;
  const auto limit = stop ? std::min(opts.stall_timeout, std::chrono::milliseconds(kStopDrain)) : opts.stall_timeout;
  std::vector<uint64_t> ids;
  for (auto& [id, c] : conns) {
    if (c->tx_dead || (c->rx_slot == nullptr && c->out_head == nullptr)) continue;
    if (!stop && c->lent_bytes == 0) continue;
    if (now - c->last_io >= limit) ids.push_back(id);
  }
  for (uint64_t id : ids) {
    Conn& c = *conns[id];
    stats.stalls.fetch_add(1, std::memory_order_relaxed);
    fail(c, stop ? "replies not read while the server stops" : "no progress while holding request memory others wait for", false);
    update(c);
  }
}

void NbdServer::Impl::add_conn(base::UniqueFd fd, std::string peer) {
  if (stopping.load() || conns.size() >= opts.max_connections) {
    stats.refused.fetch_add(1, std::memory_order_relaxed);
    log("nbd: refusing a connection from " + peer + (stopping.load() ? " (stopping)" : " (too many connections)"));
    return;  // fd closes
  }
  const int fl = ::fcntl(fd.get(), F_GETFL);
  if (fl >= 0) ::fcntl(fd.get(), F_SETFL, fl | O_NONBLOCK);
  const int one = 1;
  (void)::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // fails on unix: fine
  auto c = std::make_unique<Conn>();
  c->srv = this;
  c->id = next_id++;
  c->fd = std::move(fd);
  c->peer = std::move(peer);
  c->in.resize(kInBufSize);
  c->last_io = Clock::now();
  c->deadline = c->last_io + opts.handshake_timeout;
  Conn& ref = *c;
  conns.emplace(c->id, std::move(c));
  stats.accepted.fetch_add(1, std::memory_order_relaxed);
  stats.connections.fetch_add(1, std::memory_order_relaxed);
  epoll_event ev{};
  ev.events = 0;
  ev.data.u64 = ref.id;
  if (::epoll_ctl(epfd.get(), EPOLL_CTL_ADD, ref.fd.get(), &ev) != 0) {
    fail(ref, std::string("epoll: ") + std::strerror(errno), false);
  } else {
    ref.registered = true;
    greet(ref);
    flush_out(ref);
  }
  update(ref);
}

void NbdServer::Impl::on_event(Conn& c, uint32_t ev) {
  if (c.tls != nullptr && !c.tls->established() && !c.rx_closed) {
    tls_handshake(c);
    if (!c.tls_on()) {
      update(c);
      return;
    }
    // The client may have spoken already: bytes that reached the socket before the kernel took
    // the record layer need not make it readable again.
    ev |= EPOLLIN;
  }
  if (ev & EPOLLIN) on_readable(c);
  if ((ev & EPOLLOUT) && !c.tx_dead) flush_out(c);
  if ((ev & (EPOLLERR | EPOLLHUP)) && !c.tx_dead) {
    // The peer is gone both ways: nothing more can be read or sent.
    c.rx_closed = true;
    tx_gone(c);
    if (c.rx_slot) {
      release(c, *c.rx_slot);
      c.rx_slot = nullptr;
    }
  }
  pump(c);
  update(c);
}

// Parses what is buffered, and sends what that produced, until neither makes progress (a reply
// sent frees a slot, which lets a waiting request header be parsed).
void NbdServer::Impl::pump(Conn& c) {
  for (int round = 0; round < 16; ++round) {
    c.resumed = false;
    parse(c);
    flush_out(c);
    if (!c.resumed) break;
  }
}

void NbdServer::Impl::parse(Conn& c) {
  // The requests parsed here are submitted as one batch of the export (Export::begin_batch).
  struct Batch {
    Export* exp = nullptr;
    void open(Export* e) {
      if (exp == nullptr && e != nullptr) (exp = e)->begin_batch();
    }
    ~Batch() {
      if (exp != nullptr) exp->end_batch();
    }
    Batch() = default;
    Batch(const Batch&) = delete;
    Batch& operator=(const Batch&) = delete;
  } batch;
  while (!c.rx_closed) {
    if (c.phase == Conn::Phase::transmission) {
      batch.open(c.exp);
      if (c.rx_slot) {
        receive_payload(c);
        if (c.rx_slot) return;
        continue;
      }
      if (!parse_request(c)) return;
    } else if (c.starttls || (c.tls != nullptr && !c.tls->established()) || !parse_handshake(c)) {
      return;  // nothing is parsed between STARTTLS and the end of the TLS handshake
    }
  }
}

void NbdServer::Impl::on_readable(Conn& c) {
  // A bounded number of reads per wakeup keeps one busy client from starving the others.
  // A read that returns less than it asked for found the socket empty: parsing what it brought
  // is the last step, and epoll (level-triggered) says when more arrives, instead of a read
  // that fails with EAGAIN (one system call per request at queue depth 1).
  bool drained = false;
  for (int round = 0; round < 16 && !c.rx_closed; ++round) {
    parse(c);
    flush_out(c);
    if (drained || c.rx_closed || c.paused || (c.tls != nullptr && !c.tls->established())) return;
    ssize_t n;
    size_t want;
    if (c.rx_slot && c.in_beg == c.in_end) {
      // A WRITE payload goes straight into its slot, without the input buffer.
      std::byte* dst = c.rx_slot->data + c.rx_got;
      want = c.rx_slot->length - c.rx_got;
      n = c.recv_into(dst, want);
      if (n > 0) {
        c.rx_got += static_cast<size_t>(n);
        c.last_io = Clock::now();
        drained = static_cast<size_t>(n) < want;
        continue;
      }
    } else {
      if (c.in_beg == c.in_end) c.in_beg = c.in_end = 0;
      if (c.in_end == c.in.size() && c.in_beg > 0) {  // compact: the partial message to the front
        std::memmove(c.in.data(), c.in.data() + c.in_beg, c.in_end - c.in_beg);
        c.in_end -= c.in_beg;
        c.in_beg = 0;
      }
      if (c.in_end == c.in.size()) return;  // cannot happen: one message fits the buffer
      want = c.in.size() - c.in_end;
      n = c.recv_into(c.in.data() + c.in_end, want);
      if (n > 0) {
        c.in_end += static_cast<size_t>(n);
        c.last_io = Clock::now();
        drained = static_cast<size_t>(n) < want;
        continue;
      }
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    // EOF or a socket error: the client went away (a hard disconnect, or after NBD_CMD_DISC).
    // Requests in flight still complete; their replies go out if the socket still takes them.
    if (c.phase != Conn::Phase::transmission || c.rx_slot || c.in_beg != c.in_end) {
      if (c.phase != Conn::Phase::transmission)
        log("nbd: " + c.peer + " left during the handshake");
      else if (c.rx_slot || c.in_beg != c.in_end)
        log("nbd: " + c.peer + " closed in the middle of a request");
    }
    c.rx_closed = true;
    if (n < 0) tx_gone(c);
    if (c.rx_slot) {
      release(c, *c.rx_slot);
      c.rx_slot = nullptr;
    }
    return;
  }
}

void NbdServer::Impl::flush_out(Conn& c) {
  while (!c.tx_dead) {
    iovec iov[64];
    int n = 0;
    size_t hs_left = c.hs_out.size() - c.hs_sent;
    if (hs_left > 0) iov[n++] = {c.hs_out.data() + c.hs_sent, hs_left};
    for (Slot* s = c.out_head; s != nullptr && n < 63; s = s->next) {
      size_t off = s->sent;
      if (off < s->hdr_len) {
        iov[n++] = {s->hdr + off, s->hdr_len - off};
        off = s->hdr_len;
      }
      if (s->data_len > 0) iov[n++] = {s->data + (off - s->hdr_len), s->data_len - (off - s->hdr_len)};
    }
    if (n == 0) {
      if (!c.hs_out.empty()) {
        c.hs_out.clear();
        c.hs_sent = 0;
      }
      if (c.starttls) start_tls(c);
      return;
    }
    ssize_t w = c.send_iov(iov, n);
    if (w < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
      c.rx_closed = true;  // EPIPE, ECONNRESET: the client is gone
      tx_gone(c);
      if (c.rx_slot) {
        release(c, *c.rx_slot);
        c.rx_slot = nullptr;
      }
      return;
    }
    size_t left = static_cast<size_t>(w);
    if (left > 0) c.last_io = Clock::now();
    const size_t hs = std::min(left, hs_left);
    c.hs_sent += hs;
    left -= hs;
    while (left > 0 && c.out_head != nullptr) {
      Slot* s = c.out_head;
      const size_t step = std::min(left, s->hdr_len + s->data_len - s->sent);
      s->sent += step;
      left -= step;
      if (s->sent == s->hdr_len + s->data_len) {
        c.out_head = s->next;
        if (c.out_head == nullptr) c.out_tail = nullptr;
        release(c, *s);
      }
    }
  }
}

void NbdServer::Impl::fail(Conn& c, const std::string& why, bool protocol_error) {
  if (protocol_error) stats.protocol_errors.fetch_add(1, std::memory_order_relaxed);
  log("nbd: dropping " + c.peer + ": " + why);
  c.rx_closed = true;
  tx_gone(c);
  ::shutdown(c.fd.get(), SHUT_RDWR);
  if (c.rx_slot) {
    release(c, *c.rx_slot);
    c.rx_slot = nullptr;
  }
}

void NbdServer::Impl::tx_gone(Conn& c) {
  if (c.tx_dead) return;
  c.tx_dead = true;
  // Nobody will read these replies: their slots (and request memory) go back now, or the
  // connection, which is freed once no slot is taken, would live on with them.
  while (Slot* s = c.out_head) {
    c.out_head = s->next;
    release(c, *s);
  }
  c.out_tail = nullptr;
}

void NbdServer::Impl::update(Conn& c) {
  const bool out_pending = c.hs_sent < c.hs_out.size() || c.out_head != nullptr;
  if (c.rx_closed && c.inflight == 0 && (c.tx_dead || !out_pending || stopping.load())) {
    if (c.registered) ::epoll_ctl(epfd.get(), EPOLL_CTL_DEL, c.fd.get(), nullptr);
    c.fd.reset();
    stats.connections.fetch_sub(1, std::memory_order_relaxed);
    conns.erase(c.id);  // frees c
    return;
  }
  if (!c.registered) return;
  uint32_t want = 0;
  if (c.tx_dead) {
    // Only waiting for completions (they come through the eventfd): a socket that reports
    // only HUP/ERR from now on must not wake the loop, so it leaves the epoll set.
    ::epoll_ctl(epfd.get(), EPOLL_CTL_DEL, c.fd.get(), nullptr);
    c.registered = false;
    return;
  }
  if (c.tls != nullptr && !c.tls->established()) {
    want = c.tls->want() == POLLOUT ? EPOLLOUT : EPOLLIN;
  } else {
    if (!c.rx_closed && !c.paused) want |= EPOLLIN;
    if (out_pending) want |= EPOLLOUT;
    if ((want & EPOLLIN) && c.tls_on() && c.tls->read_pending()) rx_ready.push_back(c.id);
  }
  if (want == c.events) return;
  epoll_event ev{};
  ev.events = want;
  ev.data.u64 = c.id;
  ::epoll_ctl(epfd.get(), EPOLL_CTL_MOD, c.fd.get(), &ev);
  c.events = want;
}

ssize_t Conn::recv_into(void* dst, size_t len) {
  if (tls != nullptr) {
    iovec iov{dst, len};
    return tls->readv(&iov, 1);
  }
  return ::recv(fd.get(), dst, len, 0);
}

ssize_t Conn::send_iov(const iovec* iov, int n) {
  if (tls != nullptr) return tls->writev(iov, n);
  msghdr m{};
  m.msg_iov = const_cast<iovec*>(iov);
  m.msg_iovlen = static_cast<size_t>(n);
  return ::sendmsg(fd.get(), &m, MSG_NOSIGNAL);
}

// The STARTTLS ACK has left in plaintext: from here every byte is TLS.
void NbdServer::Impl::start_tls(Conn& c) {
  c.starttls = false;
  // A client must wait for the ACK before it speaks TLS; plaintext it sent after STARTTLS
  // would be an attacker's injection into the protected session (CVE-2011-0411 style).
  if (c.in_beg != c.in_end) {
    fail(c, "plaintext after NBD_OPT_STARTTLS", true);
    return;
  }
  c.in_beg = c.in_end = 0;
  auto s = ibtrs::tls::Session::create(opts.tls, c.fd.get());
  if (!s.ok()) {
    fail(c, "TLS: " + s.error().message(), false);
    return;
  }
  c.tls = std::move(*s);
  tls_handshake(c);
}

void NbdServer::Impl::tls_handshake(Conn& c) {
  auto st = c.tls->handshake_step();
  if (st.ok()) {
    stats.tls_upgrades.fetch_add(1, std::memory_order_relaxed);
    log("nbd: " + c.peer + " upgraded to TLS (" + std::string(c.tls->cipher()) +
        (c.tls->kernel_tx() && c.tls->kernel_rx() ? ", kernel record layer" : ", userspace record layer") +
        (c.tls->peer_identity().empty() ? "" : ", peer " + c.tls->peer_identity()) + ")");
    return;
  }
  if (st.error() == std::errc::resource_unavailable_try_again) return;
  stats.tls_failures.fetch_add(1, std::memory_order_relaxed);
  fail(c, "TLS handshake: " + st.error().message() +
              (c.tls->last_error().empty() ? "" : " (" + c.tls->last_error() + ")"), false);
}

void NbdServer::Impl::drain_completions() {
  Slot* s;
  {
    std::lock_guard l(done_mu);
    s = done_head;
    done_head = done_tail = nullptr;
    signalled = false;
  }
  remote_seen = s != nullptr;
  run_completions(s);
}

void NbdServer::Impl::run_completions(Slot* s) {
  touched.clear();
  while (s != nullptr) {
    Slot* next = s->done_next;
    Conn& c = *s->conn;
    complete(c, *s);
    if (touched.empty() || touched.back() != c.id) touched.push_back(c.id);
    s = next;
  }
  std::sort(touched.begin(), touched.end());
  touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
  for (uint64_t id : touched) {
    auto it = conns.find(id);
    if (it == conns.end()) continue;
    pump(*it->second);
    update(*it->second);
  }
}

}  // namespace ibnbd::nbd
