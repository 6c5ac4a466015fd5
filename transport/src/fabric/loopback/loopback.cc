#include "fabric/loopback/loopback.h"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>

#include "base/unique_fd.h"
#include "fabric/mr_table.h"
#include "fabric/providers.h"

namespace ibtrs::fabric {
namespace loopback {

// ----- fault injector -------------------------------------------------------------------------

uint64_t FaultInjector::add(FaultRule rule) {
  std::lock_guard lock(mu_);
  uint64_t id = next_id_++;
  rules_.push_back(Entry{id, std::move(rule)});
  return id;
}

void FaultInjector::remove(uint64_t id) {
  std::lock_guard lock(mu_);
  std::erase_if(rules_, [id](const Entry& e) { return e.id == id; });
}

void FaultInjector::clear() {
  std::lock_guard lock(mu_);
  rules_.clear();
}

uint32_t FaultInjector::hits(uint64_t id) const {
  std::lock_guard lock(mu_);
  for (const Entry& e : rules_) {
    if (e.id == id) return e.applied;
  }
  return 0;
}

std::optional<FaultRule> FaultInjector::match(Opcode op, const std::string& endpoint, Direction dir,
                                             uint64_t bytes) {
  std::lock_guard lock(mu_);
  for (Entry& e : rules_) {
    const FaultRule& r = e.rule;
    if (r.opcode && *r.opcode != op) continue;
    if (bytes < r.min_bytes) continue;
    if (!r.endpoint.empty() && r.endpoint != endpoint) continue;
    if (r.direction != Direction::any && r.direction != dir) continue;
    if (r.count != 0 && e.applied >= r.count) continue;
    if (e.seen++ < r.skip) continue;
    ++e.applied;
    return r;
  }
  return std::nullopt;
}

FaultInjector& faults() {
  static FaultInjector injector;
  return injector;
}

namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kMaxSge = 32;

class LbCq;
class LbConnection;
class LbDomain;
class LbListener;

// Everything below is guarded by this one lock: the loopback fabric is for tests, and one lock
// makes every interleaving a sequence of whole operations.
std::mutex& world_mu() {
  static std::mutex mu;
  return mu;
}
std::map<std::string, LbListener*>& listeners() {
  static std::map<std::string, LbListener*> m;
  return m;
}
std::string endpoint_key(const Address& a) { return a.name + ":" + std::to_string(a.port); }

// Callbacks collected under the lock and run after it is released.
using Deferred = std::vector<std::function<void()>>;
void run(Deferred& d) {
  for (auto& f : d) f();
  d.clear();
}

struct Frame {
  uint64_t wr_id = 0;
  Opcode op = Opcode::send;
  bool signaled = true;
  bool drop = false;
  WcStatus fail = WcStatus::success;  // set by an error fault
  Clock::duration late{0};            // late_completion: the receiver's CQE shows this much later
  Sge sges[kMaxSge];
  uint32_t nsge = 0;
  uint64_t total = 0;
  uint64_t remote_addr = 0;
  uint32_t rkey = 0;
  uint32_t imm = 0;
  Clock::time_point due{};
};

struct Recv {
  uint64_t wr_id = 0;
  Sge sges[kMaxSge];
  uint32_t nsge = 0;
};

// The CQ's fd is an epoll set of an eventfd (a completion is there now) and a timerfd (a delayed
// frame falls due then), so a poller sleeping on fd() wakes when a delay fault ends, as it would
// when a late packet arrives on a real fabric.
class LbCq final : public CompletionQueue {
 public:
  static Result<std::unique_ptr<CompletionQueue>> create(uint32_t capacity) {
    if (capacity == 0) return errc(EINVAL);
    std::unique_ptr<LbCq> cq(new LbCq(capacity));
    cq->fd_.reset(::epoll_create1(EPOLL_CLOEXEC));
    cq->efd_.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    cq->tfd_.reset(::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC));
    if (!cq->fd_ || !cq->efd_ || !cq->tfd_) return errc(errno);
    for (int f : {cq->efd_.get(), cq->tfd_.get()}) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      if (::epoll_ctl(cq->fd_.get(), EPOLL_CTL_ADD, f, &ev) != 0) return errc(errno);
    }
    return std::unique_ptr<CompletionQueue>(std::move(cq));
  }
  // fd_, efd_ and tfd_ close with the members: nothing polls a CQ being destroyed.
  ~LbCq() override = default;

  size_t poll(std::span<Completion> out) override;
  size_t wait(std::span<Completion> out, std::chrono::milliseconds timeout) override;
  int fd() const override { return fd_.get(); }
  ibtrs::Status arm() override { return {}; }
  void ack_events() override {
    uint64_t v;
    [[maybe_unused]] ssize_t r = ::read(efd_.get(), &v, sizeof(v));
    r = ::read(tfd_.get(), &v, sizeof(v));
  }

  // World lock held. A completion shows at `at` (late_completion), and never before the ones
  // ahead of it: a CQ is polled in order.
  void push(const Completion& c, Clock::time_point at = {}) {
    if (!ring_.empty()) at = std::max(at, ring_.back().at);
    ring_.push_back(Entry{c, at});
    if (at > Clock::now()) {
      wake_at(at);
    } else {
      signal();
    }
  }
  void signal() {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t r = ::write(efd_.get(), &one, sizeof(one));
  }
  // Makes fd() readable at `t` unless it already will be earlier. World lock held.
  void wake_at(Clock::time_point t) {
    if (timer_armed_ && timer_at_ <= t) return;
    set_timer(t);
  }
  ibtrs::Status reserve(uint32_t n) {
    if (n > capacity() - reserved_) return errc(ENOSPC);
    reserved_ += n;
    return {};
  }
  void unreserve(uint32_t n) { reserved_ -= n; }
  std::vector<LbConnection*> conns;

 private:
  explicit LbCq(uint32_t capacity) : CompletionQueue(capacity) {}
  // nullopt disarms. CLOCK_MONOTONIC is steady_clock's clock on Linux.
  void set_timer(std::optional<Clock::time_point> t) {
    itimerspec its{};
    if (t) {
      auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(t->time_since_epoch()).count();
      if (ns <= 0) ns = 1;  // a zero it_value would disarm
      its.it_value.tv_sec = static_cast<time_t>(ns / 1'000'000'000);
      its.it_value.tv_nsec = static_cast<long>(ns % 1'000'000'000);
    }
    [[maybe_unused]] int r = ::timerfd_settime(tfd_.get(), TFD_TIMER_ABSTIME, &its, nullptr);
    timer_armed_ = t.has_value();
    if (t) timer_at_ = *t;
  }
  // After delivering: the timer follows the earliest frame still waiting. World lock held.
  void rearm_for_pending(Clock::time_point now);

  base::UniqueFd fd_;   // the epoll set of efd_ and tfd_
  base::UniqueFd efd_;
  base::UniqueFd tfd_;
  bool timer_armed_ = false;
  Clock::time_point timer_at_{};
  uint32_t reserved_ = 0;
  struct Entry {
    Completion c;
    Clock::time_point at;  // shows from then on
  };
  std::deque<Entry> ring_;
  friend class LbConnection;
  // When the first completion not yet shown falls due; nullopt: none is held back.
  std::optional<Clock::time_point> held_until(Clock::time_point now) const {
    if (ring_.empty() || ring_.front().at <= now) return std::nullopt;
    return ring_.front().at;
  }
  size_t drain(std::span<Completion> out, Clock::time_point now) {
    size_t n = 0;
    while (n < out.size() && !ring_.empty() && ring_.front().at <= now) {
      out[n++] = ring_.front().c;
      ring_.pop_front();
    }
    return n;
  }
};

// Connection ids, never reused: the owner a memory window bound on a connection carries.
std::atomic<uint64_t> g_next_conn_id{1};

class LbConnection final : public Connection {
 public:
  LbConnection(LbCq& cq, std::shared_ptr<MrTable> mrs, const QueueCaps& caps,
               ConnectionEvents events, Address local, Address peer, std::string endpoint,
               bool server_side)
      : id_(g_next_conn_id.fetch_add(1, std::memory_order_relaxed)), cq_(cq), mrs_(std::move(mrs)), caps_(caps), events_(std::move(events)),
        local_(std::move(local)), peer_addr_(std::move(peer)), endpoint_(std::move(endpoint)),
        server_side_(server_side) {
    cq_.conns.push_back(this);
  }
  ~LbConnection() override {
    std::lock_guard lock(world_mu());
    if (peer_ != nullptr) break_link(errc(ECONNRESET));
    std::erase(cq_.conns, this);
    cq_.unreserve(caps_.max_send_wr + caps_.max_recv_wr);
  }

  ibtrs::Status post_send(std::span<const SendWr> wrs) override;
  ibtrs::Status post_recv(std::span<const RecvWr> wrs) override;
  Result<uint32_t> bind_mw(MemoryWindow& mw, const MemoryRegion& mr, uint64_t addr, uint64_t len,
                           uint32_t access) override {
    std::lock_guard lock(world_mu());
    if (state_ != ConnState::connected) return errc(ENOTCONN);
    return soft_bind_mw(*mrs_, id_, mw, mr, addr, len, access);
  }
  Result<bool> invalidate_mw(MemoryWindow& mw, uint64_t) override {
    BASE_TRY(soft_invalidate_mw(*mrs_, id_, mw));
    return true;
  }
  void disconnect() override {
    std::lock_guard lock(world_mu());
    if (state_ == ConnState::connected) break_link(errc(ECONNABORTED));
  }
  ConnState state() const override {
    std::lock_guard lock(world_mu());
    return state_;
  }
  const QueueCaps& caps() const override { return caps_; }
  uint32_t send_queue_free() const override {
    std::lock_guard lock(world_mu());
    return caps_.max_send_wr - static_cast<uint32_t>(outq_.size());
  }
  const Address& local_address() const override { return local_; }
  const Address& peer_address() const override { return peer_addr_; }
  std::string device_name() const override { return "loopback"; }
  uint8_t port_num() const override { return 1; }

  // World lock held.
  static void link(LbConnection& a, LbConnection& b) {
    a.peer_ = &b;
    b.peer_ = &a;
  }
  void deliver(Clock::time_point now);
  void settle(Deferred& deferred);
  std::optional<Clock::time_point> next_due() const {
    if (outq_.empty() || peer_ == nullptr) return std::nullopt;
    return outq_.front().due;
  }
  LbConnection* peer() const { return peer_; }

 private:
  // Both ends go to error; each flushes at its CQ's next poll.
  void break_link(std::error_code why) {
    LbConnection* p = peer_;
    mark_error(why);
    if (p != nullptr) p->mark_error(why);
  }
  void mark_error(std::error_code why) {
    if (state_ == ConnState::connected) {
      state_ = ConnState::error;
      why_ = why;
      pending_flush_ = true;
    }
    peer_ = nullptr;
    cq_.signal();
  }
  void complete_send(const Frame& f, WcStatus st) {
    if (f.signaled || st != WcStatus::success)
      cq_.push(Completion{f.wr_id, st, f.op, static_cast<uint32_t>(f.total), 0, false});
  }
  // Copies the frame's gathered bytes into the peer's destination segments, looked up in the
  // peer's table for the peer connection `dst_conn`.
  bool copy_out(const Frame& f, const MrTable& dst_table, uint64_t dst_conn, const Sge* dst,
                uint32_t ndst, uint32_t access);

  const uint64_t id_;
  LbCq& cq_;
  std::shared_ptr<MrTable> mrs_;
  QueueCaps caps_;
  ConnectionEvents events_;
  Address local_;
  Address peer_addr_;
  std::string endpoint_;
  bool server_side_;
  LbConnection* peer_ = nullptr;
  ConnState state_ = ConnState::connected;
  std::error_code why_;
  bool pending_flush_ = false;
  std::deque<Frame> outq_;  // posted, not yet delivered (or waiting for the peer's RECV)
  std::deque<Recv> rq_;
  friend class LbCq;
};

ibtrs::Status LbConnection::post_send(std::span<const SendWr> wrs) {
  Deferred none;
  std::lock_guard lock(world_mu());
  if (state_ != ConnState::connected) return errc(ENOTCONN);
  if (wrs.size() > caps_.max_send_wr - outq_.size()) return errc(ENOMEM);
  BASE_TRY(check_send_batch(wrs, caps_));
  for (const SendWr& wr : wrs) {
    for (const Sge& s : wr.sg_list) {
      if (s.length > 0 && !mrs_->check(s.lkey, s.addr, s.length, 0)) return errc(EINVAL);
    }
  }
  const auto now = Clock::now();
  const Direction dir = server_side_ ? Direction::to_client : Direction::to_server;
  for (const SendWr& wr : wrs) {
    Frame f;
    f.wr_id = wr.wr_id;
    f.op = wr.opcode;
    f.signaled = wr.signaled;
    f.nsge = static_cast<uint32_t>(wr.sg_list.size());
    std::copy(wr.sg_list.begin(), wr.sg_list.end(), f.sges);
    for (const Sge& s : wr.sg_list) f.total += s.length;
    f.remote_addr = wr.remote_addr;
    f.rkey = wr.rkey;
    f.imm = wr.imm;
    f.due = outq_.empty() ? now : std::max(now, outq_.back().due);
    if (auto rule = faults().match(wr.opcode, endpoint_, dir, f.total)) {
      switch (rule->action) {
        case FaultAction::drop: f.drop = true; break;
        case FaultAction::delay: f.due += rule->delay; break;
        case FaultAction::late_completion: f.late = rule->delay; break;
        case FaultAction::error: f.fail = rule->status; break;
        case FaultAction::disconnect:
          outq_.push_back(f);
          break_link(errc(ECONNRESET));
          return {};
      }
    }
    outq_.push_back(f);
    if (f.fail != WcStatus::success) {
      break_link(errc(EIO));
      return {};
    }
  }
  deliver(now);
  if (auto d = next_due(); d && *d > now) {
    cq_.wake_at(*d);
    if (peer_ != nullptr) peer_->cq_.wake_at(*d);
  }
  return {};
}

ibtrs::Status LbConnection::post_recv(std::span<const RecvWr> wrs) {
  std::lock_guard lock(world_mu());
  if (state_ != ConnState::connected) return errc(ENOTCONN);
  if (wrs.size() > caps_.max_recv_wr - rq_.size()) return errc(ENOMEM);
  BASE_TRY(check_recv_batch(wrs, caps_));
  for (const RecvWr& wr : wrs) {
    for (const Sge& s : wr.sg_list) {
      if (s.length > 0 && !mrs_->check(s.lkey, s.addr, s.length, kLocalWrite)) return errc(EINVAL);
    }
  }
  for (const RecvWr& wr : wrs) {
    Recv r;
    r.wr_id = wr.wr_id;
    r.nsge = static_cast<uint32_t>(wr.sg_list.size());
    std::copy(wr.sg_list.begin(), wr.sg_list.end(), r.sges);
    rq_.push_back(r);
  }
  // Frames of the peer waiting for a RECV (RNR) go now.
  if (peer_ != nullptr) peer_->deliver(Clock::now());
  return {};
}

bool LbConnection::copy_out(const Frame& f, const MrTable& dst_table, uint64_t dst_conn,
                            const Sge* dst, uint32_t ndst, uint32_t access) {
  uint32_t si = 0, di = 0;
  uint64_t soff = 0, doff = 0;
  uint64_t left = f.total;
  while (left > 0) {
    while (f.sges[si].length == soff) { ++si; soff = 0; }
    while (dst[di].length == doff) { ++di; doff = 0; }
    if (di >= ndst) return false;
    uint64_t n = std::min({left, f.sges[si].length - soff, dst[di].length - doff});
    MrTable::Ref src = mrs_->acquire(f.sges[si].lkey, f.sges[si].addr + soff, n, 0, nullptr);
    MrTable::Ref to =
        dst_table.acquire(dst[di].lkey, dst[di].addr + doff, n, access, nullptr, dst_conn);
    if (!src || !to) return false;
    std::memcpy(to.ptr(), src.ptr(), n);
    soff += n;
    doff += n;
    left -= n;
  }
  return true;
}

void LbConnection::deliver(Clock::time_point now) {
  while (!outq_.empty() && peer_ != nullptr && outq_.front().due <= now) {
    Frame& f = outq_.front();
    LbConnection& p = *peer_;
    if (f.drop) {
      complete_send(f, WcStatus::success);
      outq_.pop_front();
      continue;
    }
    const bool needs_recv = f.op != Opcode::write;
    if (needs_recv && p.rq_.empty()) return;  // receiver not ready: wait (infinite RNR retry)
    if (f.op == Opcode::send) {
      Recv& r = p.rq_.front();
      uint64_t room = 0;
      for (uint32_t i = 0; i < r.nsge; ++i) room += r.sges[i].length;
      if (room < f.total) {
        p.cq_.push(Completion{r.wr_id, WcStatus::local_length_error, Opcode::recv, 0, 0, false});
        p.rq_.pop_front();
        f.fail = WcStatus::remote_invalid_request;
        break_link(errc(EMSGSIZE));
        return;
      }
      if (!copy_out(f, *p.mrs_, p.id_, r.sges, r.nsge, kLocalWrite)) {
        p.cq_.push(Completion{r.wr_id, WcStatus::local_protection_error, Opcode::recv, 0, 0, false});
        p.rq_.pop_front();
        f.fail = WcStatus::remote_operation_error;
        break_link(errc(EFAULT));
        return;
      }
      p.cq_.push(Completion{r.wr_id, WcStatus::success, Opcode::recv,
                            static_cast<uint32_t>(f.total), 0, false},
                 f.late.count() > 0 ? now + f.late : Clock::time_point{});
      p.rq_.pop_front();
    } else {
      if (f.total > 0) {
        // Whole window checked before a byte moves, in the table of the receiving connection's
        // domain and for that connection (windows); zero-length writes touch no memory.
        if (!p.mrs_->acquire(f.rkey, f.remote_addr, f.total, kRemoteWrite, nullptr, p.id_)) {
          f.fail = WcStatus::remote_access_error;
          break_link(errc(EACCES));
          return;
        }
        Sge target{f.remote_addr, static_cast<uint32_t>(f.total), f.rkey};
        if (f.total > UINT32_MAX || !copy_out(f, *p.mrs_, p.id_, &target, 1, kRemoteWrite)) {
          f.fail = WcStatus::remote_access_error;
          break_link(errc(EACCES));
          return;
        }
      }
      if (f.op == Opcode::write_with_imm) {
        Recv& r = p.rq_.front();
        p.cq_.push(Completion{r.wr_id, WcStatus::success, Opcode::recv_rdma_with_imm,
                              static_cast<uint32_t>(f.total), f.imm, true},
                   f.late.count() > 0 ? now + f.late : Clock::time_point{});
        p.rq_.pop_front();
      }
    }
    complete_send(f, WcStatus::success);
    outq_.pop_front();
  }
}

void LbConnection::settle(Deferred& deferred) {
  if (!pending_flush_) return;
  pending_flush_ = false;
  for (const Frame& f : outq_) {
    WcStatus st = f.fail != WcStatus::success ? f.fail : WcStatus::flush_error;
    cq_.push(Completion{f.wr_id, st, f.op, 0, 0, false});
  }
  outq_.clear();
  for (const Recv& r : rq_) cq_.push(Completion{r.wr_id, WcStatus::flush_error, Opcode::recv, 0, 0, false});
  rq_.clear();
  if (events_.on_disconnected) {
    auto cb = events_.on_disconnected;
    auto why = why_;
    deferred.push_back([cb, why] { cb(why); });
  }
}

size_t LbCq::poll(std::span<Completion> out) {
  Deferred deferred;
  size_t n;
  {
    std::lock_guard lock(world_mu());
    const auto now = Clock::now();
    for (LbConnection* c : conns) {
      c->deliver(now);
      if (c->peer() != nullptr) c->peer()->deliver(now);
    }
    for (LbConnection* c : conns) c->settle(deferred);
    rearm_for_pending(now);
    n = drain(out, now);
  }
  run(deferred);
  return n;
}

void LbCq::rearm_for_pending(Clock::time_point now) {
  std::optional<Clock::time_point> next = held_until(now);
  auto consider = [&](const LbConnection* c) {
    if (c == nullptr) return;
    if (auto d = c->next_due(); d && (!next || *d < *next)) next = d;
  };
  for (const LbConnection* c : conns) {
    consider(c);
    consider(c->peer());
  }
  if (next || timer_armed_) set_timer(next);
}

size_t LbCq::wait(std::span<Completion> out, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    size_t n = poll(out);
    if (n > 0) return n;
    auto now = Clock::now();
    if (now >= deadline) return 0;
    auto until = deadline;
    {
      std::lock_guard lock(world_mu());
      if (auto h = held_until(now)) until = std::min(until, *h);
      for (LbConnection* c : conns) {
        if (auto d = c->next_due()) until = std::min(until, *d);
        if (c->peer() != nullptr) {
          if (auto d = c->peer()->next_due()) until = std::min(until, *d);
        }
      }
    }
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(until - now).count() + 1;
    pollfd pfd{fd_.get(), POLLIN, 0};
    if (::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(ms, INT32_MAX))) > 0) ack_events();
  }
}

// ----- connection management -------------------------------------------------------------------

// Shared by the connecting thread and the listener side, which may outlive each other.
struct PendingConnect {
  LbCq* cq = nullptr;
  QueueCaps caps;
  ConnectionEvents events;
  std::shared_ptr<MrTable> client_mrs;
  Address client_addr;
  std::vector<std::byte> pd;
  bool done = false;
  int error = 0;
  std::vector<std::byte> reply;
  std::unique_ptr<Connection> client_conn;
  std::condition_variable cv;
};

class LbListener final : public Listener {
 public:
  LbListener(LbDomain& d, Address addr, base::UniqueFd efd)
      : domain_(d), addr_(std::move(addr)), efd_(std::move(efd)) {}
  ~LbListener() override {
    std::lock_guard lock(world_mu());
    listeners().erase(endpoint_key(addr_));
    for (auto& p : queue_) {
      p->done = true;
      p->error = ECONNREFUSED;
      p->cv.notify_all();
    }
    efd_.reset();  // under the world lock, as it always was
  }
  Result<std::unique_ptr<ConnectRequest>> get_request(std::chrono::milliseconds timeout) override;
  int fd() const override { return efd_.get(); }
  const Address& address() const override { return addr_; }

  // World lock held.
  void enqueue(std::shared_ptr<PendingConnect> p) {
    queue_.push_back(std::move(p));
    cv_.notify_all();
    uint64_t one = 1;
    [[maybe_unused]] ssize_t r = ::write(efd_.get(), &one, sizeof(one));
  }
  void withdraw(const std::shared_ptr<PendingConnect>& p) {
    std::erase(queue_, p);
    if (queue_.empty()) drain_fd();
  }
  // World lock held: fd() goes quiet (nothing waits any more).
  void drain_fd() {
    uint64_t v;
    [[maybe_unused]] ssize_t r = ::read(efd_.get(), &v, sizeof(v));
  }
  LbDomain& domain() { return domain_; }

 private:
  LbDomain& domain_;
  Address addr_;
  base::UniqueFd efd_;
  std::deque<std::shared_ptr<PendingConnect>> queue_;
  std::condition_variable cv_;
};

class LbDomain final : public Domain {
 public:
  // `device`: what makes domains one device (the fabric).
  LbDomain(const void* device, uint32_t max_keys)
      : device_(device), mrs_(std::make_shared<MrTable>(max_keys)) {}
  std::string device_name() const override { return "loopback"; }
  Result<std::unique_ptr<Domain>> alloc_pd(const PdAttr& attr) override {
    return std::unique_ptr<Domain>(new LbDomain(device_, attr.max_keys));
  }
  Result<std::unique_ptr<MemoryRegion>> register_memory(void* addr, size_t length,
                                                        uint32_t access) override {
    return SoftMemoryRegion::create(mrs_, addr, length, access);
  }
  Result<std::unique_ptr<MemoryWindow>> alloc_mw() override {
    return SoftMemoryWindow::create(mrs_);
  }
  const void* device() const { return device_; }
  Result<std::unique_ptr<CompletionQueue>> create_cq(uint32_t capacity) override {
    return LbCq::create(capacity);
  }
  Result<ConnectResult> connect(const ConnectParams& p, std::vector<std::byte>* reject_data) override;
  const std::shared_ptr<MrTable>& mrs() const { return mrs_; }
  uint64_t next_client_id() { return ++clients_; }

 private:
  const void* device_;
  std::shared_ptr<MrTable> mrs_;
  std::atomic<uint64_t> clients_{0};
};

class LbConnectRequest final : public ConnectRequest {
 public:
  LbConnectRequest(LbListener& l, std::shared_ptr<PendingConnect> p) : listener_(l), p_(std::move(p)) {}
  ~LbConnectRequest() override {
    std::lock_guard lock(world_mu());
    resolve(ECONNRESET);
  }
  std::span<const std::byte> private_data() const override { return p_->pd; }
  const Address& peer_address() const override { return p_->client_addr; }
  const Address& local_address() const override { return listener_.address(); }
  Domain& domain() override;

  using ConnectRequest::accept;
  Result<std::unique_ptr<Connection>> accept(Domain& pd, CompletionQueue& cq,
                                             const QueueCaps& caps,
                                             std::span<const std::byte> private_data,
                                             ConnectionEvents events) override {
    auto* lpd = dynamic_cast<LbDomain*>(&pd);
    if (private_data.size() > kMaxPrivateData || lpd == nullptr || !same_device(*lpd))
      return errc(EINVAL);
    BASE_TRY(check_caps(caps, UINT32_MAX, kMaxSge));
    auto* scq = dynamic_cast<LbCq*>(&cq);
    if (scq == nullptr) return errc(EINVAL);
    std::lock_guard lock(world_mu());
    if (p_ == nullptr || p_->done) return errc(ECONNRESET);
    LbCq* ccq = p_->cq;
    BASE_TRY(scq->reserve(caps.max_send_wr + caps.max_recv_wr));
    if (auto st = ccq->reserve(p_->caps.max_send_wr + p_->caps.max_recv_wr); !st) {
      scq->unreserve(caps.max_send_wr + caps.max_recv_wr);
      resolve(ENOSPC);
      return errc(ECONNRESET);
    }
    const std::string ep = listener_.address().name;
    auto server = std::make_unique<LbConnection>(*scq, lpd->mrs(), caps,
                                                 std::move(events), listener_.address(),
                                                 p_->client_addr, ep, true);
    auto client = std::make_unique<LbConnection>(*ccq, p_->client_mrs, p_->caps, p_->events,
                                                 p_->client_addr, listener_.address(), ep, false);
    LbConnection::link(*server, *client);
    p_->reply.assign(private_data.begin(), private_data.end());
    p_->client_conn = std::move(client);
    resolve(0);
    return std::unique_ptr<Connection>(std::move(server));
  }
  ibtrs::Status reject(std::span<const std::byte> private_data) override {
    if (private_data.size() > kMaxPrivateData) return errc(EINVAL);
    std::lock_guard lock(world_mu());
    if (p_ == nullptr || p_->done) return errc(ECONNRESET);
    p_->reply.assign(private_data.begin(), private_data.end());
    resolve(ECONNREFUSED);
    return {};
  }

 private:
  // World lock held.
  void resolve(int error) {
    if (p_ == nullptr) return;
    if (!p_->done) {
      p_->done = true;
      p_->error = error;
      p_->cv.notify_all();
    }
    p_.reset();
  }
  bool same_device(const LbDomain& d) const { return d.device() == listener_.domain().device(); }
  LbListener& listener_;
  std::shared_ptr<PendingConnect> p_;
};

Domain& LbConnectRequest::domain() { return listener_.domain(); }

Result<std::unique_ptr<ConnectRequest>> LbListener::get_request(std::chrono::milliseconds timeout) {
  std::unique_lock lock(world_mu());
  if (!cv_.wait_for(lock, timeout, [&] { return !queue_.empty(); })) return errc(ETIMEDOUT);
  auto p = queue_.front();
  queue_.pop_front();
  // fd() stays readable while requests wait: a read takes the whole count, so only the last
  // request's may (several peers connecting at once were otherwise left queued, unseen, until
  // the next one came).
  if (queue_.empty()) drain_fd();
  return std::unique_ptr<ConnectRequest>(new LbConnectRequest(*this, p));
}

Result<ConnectResult> LbDomain::connect(const ConnectParams& p, std::vector<std::byte>* reject_data) {
  if (p.tls) return errc(EPROTONOSUPPORT);
  if (p.cq == nullptr || dynamic_cast<LbCq*>(p.cq) == nullptr ||
      p.private_data.size() > kMaxPrivateData || p.remote.fabric != FabricKind::loopback)
    return errc(EINVAL);
  BASE_TRY(check_caps(p.caps, UINT32_MAX, kMaxSge));
  auto shared = std::make_shared<PendingConnect>();
  PendingConnect& pc = *shared;
  pc.cq = static_cast<LbCq*>(p.cq);
  pc.caps = p.caps;
  pc.events = p.events;
  pc.client_mrs = mrs_;
  pc.pd.assign(p.private_data.begin(), p.private_data.end());
  pc.client_addr.fabric = FabricKind::loopback;
  pc.client_addr.name = p.source != nullptr ? p.source->name : "client-" + std::to_string(next_client_id());
  pc.client_addr.port = 0;
  std::unique_lock lock(world_mu());
  auto it = listeners().find(endpoint_key(p.remote));
  if (it == listeners().end()) return errc(ECONNREFUSED);
  LbListener* l = it->second;
  l->enqueue(shared);
  if (!pc.cv.wait_for(lock, p.timeout, [&] { return pc.done; })) {
    // Taken or not, a late accept() must find it settled.
    l->withdraw(shared);
    pc.done = true;
    pc.error = ETIMEDOUT;
    return errc(ETIMEDOUT);
  }
  if (pc.error != 0) {
    if (pc.error == ECONNREFUSED && reject_data != nullptr) *reject_data = pc.reply;
    return errc(pc.error);
  }
  return ConnectResult{std::move(pc.client_conn), std::move(pc.reply)};
}

class LbFabric final : public Fabric {
 public:
  LbFabric() : domain_(this, 0) {}
  FabricKind kind() const override { return FabricKind::loopback; }
  Result<Domain*> domain_for(const Address& remote, const Address*) override {
    if (remote.fabric != FabricKind::loopback) return errc(EINVAL);
    return static_cast<Domain*>(&domain_);
  }
  using Fabric::listen;
  Result<std::unique_ptr<Listener>> listen(const Address& local, const ListenOptions& o) override {
    if (o.tls || o.tls_required) return errc(EPROTONOSUPPORT);
    if (local.fabric != FabricKind::loopback || local.name.empty()) return errc(EINVAL);
    base::UniqueFd efd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!efd) return errc(errno);
    std::lock_guard lock(world_mu());
    Address a = local;
    if (a.port == 0) {
      // Pick a free port, as the kernel would.
      for (uint16_t port = 20000; port < 65535; ++port) {
        a.port = port;
        if (listeners().count(endpoint_key(a)) == 0) break;
      }
    }
    if (listeners().count(endpoint_key(a)) != 0) return errc(EADDRINUSE);  // efd closes
    auto l = std::make_unique<LbListener>(domain_, a, std::move(efd));
    listeners()[endpoint_key(a)] = l.get();
    return std::unique_ptr<Listener>(std::move(l));
  }

 private:
  LbDomain domain_;
};

}  // namespace
}  // namespace loopback

Result<std::unique_ptr<Fabric>> make_loopback_fabric(const FabricOptions&) {
  return std::unique_ptr<Fabric>(new loopback::LbFabric());
}

}  // namespace ibtrs::fabric
