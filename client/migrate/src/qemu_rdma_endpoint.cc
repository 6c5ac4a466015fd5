#include "qemu_rdma_endpoint.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <rdma/rdma_cma.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <map>
#include <optional>
#include <thread>

#include "qemu_rdma_ram.h"

namespace ibnbd::migrate::qrdma {
namespace {

std::error_code fail(int e, std::string* why, std::string msg) {
  if (why != nullptr) *why = std::move(msg);
  return ibtrs::errc(e);
}

std::error_code last_errno(int fallback = EIO) { return ibtrs::errc(errno != 0 ? errno : fallback); }

int ms_left(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<long long>(left, 1000));
}

bool set_nonblock(int fd) {
  const int fl = ::fcntl(fd, F_GETFL);
  return fl >= 0 && ::fcntl(fd, F_SETFL, fl | O_NONBLOCK) == 0;
}

std::string mib(uint64_t b) { return std::to_string((b + (1u << 20) - 1) >> 20) + " MiB"; }

// Work request ids: the kind in the low byte, a slot or tag above it.
constexpr uint64_t kWrRecv = 1, kWrSend = 2, kWrWrite = 3;
uint64_t wr_id(uint64_t kind, uint64_t v) { return kind | (v << 8); }

// The error a failed completion stands for.
int wc_errno(ibv_wc_status s) {
  switch (s) {
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_LOC_PROT_ERR: return EACCES;
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR: return ETIMEDOUT;
    case IBV_WC_WR_FLUSH_ERR: return EPIPE;
    default: return EIO;
  }
}

const char* wr_kind(uint64_t id) {
  switch (id & 0xff) {
    case kWrRecv: return "RECV";
    case kWrSend: return "SEND";
    case kWrWrite: return "RDMA WRITE";
  }
  return "work request";
}

// ---- RAII for the rdma_cm and verbs objects ----
struct ChannelDel {
  void operator()(rdma_event_channel* c) const { rdma_destroy_event_channel(c); }
};
struct IdDel {
  void operator()(rdma_cm_id* id) const {
    if (id->qp != nullptr) rdma_destroy_qp(id);
    rdma_destroy_id(id);
  }
};
struct PdDel {
  void operator()(ibv_pd* p) const { ibv_dealloc_pd(p); }
};
struct CompDel {
  void operator()(ibv_comp_channel* c) const { ibv_destroy_comp_channel(c); }
};
struct CqDel {
  void operator()(ibv_cq* c) const { ibv_destroy_cq(c); }
};
struct MrDel {
  void operator()(ibv_mr* m) const { ibv_dereg_mr(m); }
};
struct AddrInfoDel {
  void operator()(rdma_addrinfo* a) const { rdma_freeaddrinfo(a); }
};
using ChannelPtr = std::unique_ptr<rdma_event_channel, ChannelDel>;
using IdPtr = std::unique_ptr<rdma_cm_id, IdDel>;
using PdPtr = std::unique_ptr<ibv_pd, PdDel>;
using CompPtr = std::unique_ptr<ibv_comp_channel, CompDel>;
using CqPtr = std::unique_ptr<ibv_cq, CqDel>;
using MrPtr = std::unique_ptr<ibv_mr, MrDel>;
using AddrInfoPtr = std::unique_ptr<rdma_addrinfo, AddrInfoDel>;

// Page-aligned anonymous memory (registered buffers).
class Mapping {
 public:
  Mapping() = default;
  static Result<Mapping> make(size_t len) {
    void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return last_errno(ENOMEM);
    Mapping m;
    m.p_ = static_cast<std::byte*>(p);
    m.len_ = len;
    return m;
  }
  Mapping(Mapping&& o) noexcept : p_(std::exchange(o.p_, nullptr)), len_(std::exchange(o.len_, 0)) {}
  Mapping& operator=(Mapping&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
      len_ = std::exchange(o.len_, 0);
    }
    return *this;
  }
  ~Mapping() { reset(); }
  std::byte* data() const { return p_; }
  size_t size() const { return len_; }

 private:
  void reset() {
    if (p_ != nullptr) ::munmap(p_, len_);
    p_ = nullptr;
  }
  std::byte* p_ = nullptr;
  size_t len_ = 0;
};

struct CmEvent {
  rdma_cm_event_type type = RDMA_CM_EVENT_ADDR_ERROR;
  int status = 0;
  rdma_cm_id* id = nullptr;
  std::vector<std::byte> data;
};

// The next event of `ch` (acked at once), or ETIMEDOUT at the deadline.
Status next_event(rdma_event_channel* ch, Clock::time_point deadline, CmEvent& out) {
  for (;;) {
    rdma_cm_event* ev = nullptr;
    errno = 0;
    if (rdma_get_cm_event(ch, &ev) == 0) {
      out.type = ev->event;
      out.status = ev->status;
      out.id = ev->id;
      out.data.clear();
      if (ev->param.conn.private_data != nullptr && ev->param.conn.private_data_len > 0) {
        const auto* p = static_cast<const std::byte*>(ev->param.conn.private_data);
        out.data.assign(p, p + ev->param.conn.private_data_len);
      }
      rdma_ack_cm_event(ev);
      return {};
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return last_errno();
    if (Clock::now() >= deadline) return ibtrs::errc(ETIMEDOUT);
    pollfd pfd{ch->fd, POLLIN, 0};
    (void)::poll(&pfd, 1, ms_left(deadline));
  }
}

Result<ChannelPtr> make_channel(std::string* why) {
  errno = 0;
  ChannelPtr ch(rdma_create_event_channel());
  if (!ch)
    return fail(errno == ENOENT || errno == 0 ? ENODEV : errno, why,
                "no rdma_cm (is rdma_ucm loaded and /dev/infiniband/rdma_cm there?)");
  if (!set_nonblock(ch->fd)) return fail(errno, why, "rdma_cm channel");
  return ch;
}

Result<AddrInfoPtr> resolve(const RdmaAddress& a, bool passive, std::string* why) {
  rdma_addrinfo hints{};
  hints.ai_port_space = RDMA_PS_TCP;
  if (passive) hints.ai_flags = RAI_PASSIVE;
  rdma_addrinfo* res = nullptr;
  const char* host = a.host.empty() ? nullptr : a.host.c_str();
  if (rdma_getaddrinfo(host, a.port.c_str(), &hints, &res) != 0 || res == nullptr)
    return fail(EHOSTUNREACH, why, "cannot resolve " + a.text());
  return AddrInfoPtr(res);
}

// A cut link and a hung peer look the same from here: nothing arrives. The RC transport's own
// retries end a wait sooner only while something of ours is unacknowledged.
std::string timeout_message(Clock::duration waited) {
  const auto ds = std::chrono::duration_cast<std::chrono::milliseconds>(waited).count() / 100;
  return "nothing from the peer in " + std::to_string(ds / 10) + "." + std::to_string(ds % 10) +
         " s (the timeout): the link is down or the peer hangs";
}

std::string memlock_hint() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_MEMLOCK, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return "";
  return " (RLIMIT_MEMLOCK is " + mib(rl.rlim_cur) + ": raise `ulimit -l`)";
}

}  // namespace

// ---- addresses, defaults ----

std::string RdmaAddress::text() const {
  return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + port;
}

Result<RdmaAddress> parse_rdma_address(std::string_view s, std::string* why) {
  RdmaAddress a;
  std::string_view port;
  if (!s.empty() && s.front() == '[') {
    const size_t close = s.find(']');
    if (close == std::string_view::npos || close + 1 >= s.size() || s[close + 1] != ':')
      return fail(EINVAL, why, "'" + std::string(s) + "': [IPV6]:PORT expected");
    a.host = std::string(s.substr(1, close - 1));
    port = s.substr(close + 2);
  } else {
    const size_t colon = s.rfind(':');
    if (colon == std::string_view::npos || s.find(':') != colon)
      return fail(EINVAL, why, "'" + std::string(s) + "': HOST:PORT expected");
    a.host = std::string(s.substr(0, colon));
    port = s.substr(colon + 1);
  }
  unsigned v = 0;
  auto [p, ec] = std::from_chars(port.data(), port.data() + port.size(), v);
  if (a.host.empty() || port.empty() || ec != std::errc() || p != port.data() + port.size() || v > 65535)
    return fail(EINVAL, why, "'" + std::string(s) + "': HOST:PORT with a port 0..65535 expected");
  a.port = std::to_string(v);
  return a;
}

uint64_t default_pin_limit() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_MEMLOCK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) return rl.rlim_cur;
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) / 2;
  return 1ull << 30;
}

// ---- Link ----

struct Link::Res {
  // Declared in creation order; destroyed in reverse: MRs, buffers, the id (and its QP), the CQ,
  // the completion channel, the PD, the event channel.
  ChannelPtr channel;
  PdPtr pd;
  CompPtr comp;
  CqPtr cq;
  IdPtr id;
  Mapping ctl;  // kReady, kData, send: kControlMaxBuffer each
  MrPtr ctl_mr;
  uint32_t max_send = 0;
};

namespace {
struct VerbsMr final : Link::Mr {
  MrPtr mr;
  uint32_t lkey() const override { return mr->lkey; }
  uint32_t rkey() const override { return mr->rkey; }
};
}  // namespace

Link::Link() : res_(std::make_unique<Res>()) {}

Link::~Link() { disconnect(); }

ibv_pd* Link::pd() const { return res_->pd.get(); }

std::span<std::byte> Link::send_buffer() { return {res_->ctl.data() + 2 * kControlMaxBuffer, kControlMaxBuffer}; }

// PD, CQ and QP on res_->id (its verbs context is known: route resolved or a connect request),
// and the control buffers. Sizes as rdma.c's, the send queue sized for the RDMA WRITEs in flight.
Status Link::setup(uint32_t write_slots, std::string* why) {
  Res& r = *res_;
  ibv_context* verbs = r.id->verbs;
  if (verbs == nullptr) return fail(ENODEV, why, "no RDMA device for the address");
  r.pd.reset(ibv_alloc_pd(verbs));
  if (!r.pd) return fail(ENOMEM, why, "ibv_alloc_pd failed");
  r.comp.reset(ibv_create_comp_channel(verbs));
  if (!r.comp || !set_nonblock(r.comp->fd)) return fail(ENOMEM, why, "ibv_create_comp_channel failed");
  r.max_send = write_slots + 4;
  const int cqe = static_cast<int>(r.max_send + 4);
  r.cq.reset(ibv_create_cq(verbs, cqe, nullptr, r.comp.get(), 0));
  if (!r.cq) return fail(ENOMEM, why, "ibv_create_cq failed" + memlock_hint());
  ibv_qp_init_attr qa{};
  qa.cap.max_send_wr = r.max_send;
  qa.cap.max_recv_wr = 3;
  qa.cap.max_send_sge = 1;
  qa.cap.max_recv_sge = 1;
  qa.send_cq = r.cq.get();
  qa.recv_cq = r.cq.get();
  qa.qp_type = IBV_QPT_RC;
  if (rdma_create_qp(r.id.get(), r.pd.get(), &qa) != 0) return fail(errno, why, "rdma_create_qp failed");
  BASE_ASSIGN_OR_RETURN(r.ctl, Mapping::make(3 * kControlMaxBuffer));
  r.ctl_mr.reset(ibv_reg_mr(r.pd.get(), r.ctl.data(), r.ctl.size(), IBV_ACCESS_LOCAL_WRITE));
  if (!r.ctl_mr) return fail(errno, why, "registering the control buffers failed" + memlock_hint());
  if (ibv_req_notify_cq(r.cq.get(), 0) != 0) return fail(errno, why, "ibv_req_notify_cq failed");
  return {};
}

Result<std::unique_ptr<Link>> Link::connect(const RdmaAddress& to, std::span<const std::byte> private_data,
                                            uint32_t write_slots, Clock::time_point deadline,
                                            std::vector<std::byte>* answer, std::string* why) {
  if (private_data.size() > 56) return fail(EINVAL, why, "private data larger than a REQ carries");
  std::unique_ptr<Link> l(new Link());
  Res& r = *l->res_;
  BASE_ASSIGN_OR_RETURN(r.channel, make_channel(why));
  rdma_cm_id* raw = nullptr;
  if (rdma_create_id(r.channel.get(), &raw, nullptr, RDMA_PS_TCP) != 0) return fail(errno, why, "rdma_create_id");
  r.id.reset(raw);
  BASE_ASSIGN_OR_RETURN(AddrInfoPtr ai, resolve(to, false, why));
  CmEvent ev;
  const int resolve_ms = std::max(1, std::min(ms_left(deadline) * 2, 2000));
  if (rdma_resolve_addr(r.id.get(), nullptr, ai->ai_dst_addr, resolve_ms) != 0)
    return fail(errno, why, "rdma_resolve_addr " + to.text());
  BASE_TRY(next_event(r.channel.get(), deadline, ev));
  if (ev.type != RDMA_CM_EVENT_ADDR_RESOLVED)
    return fail(EHOSTUNREACH, why, to.text() + ": address not resolved (" + rdma_event_str(ev.type) + ")");
  if (rdma_resolve_route(r.id.get(), resolve_ms) != 0) return fail(errno, why, "rdma_resolve_route");
  BASE_TRY(next_event(r.channel.get(), deadline, ev));
  if (ev.type != RDMA_CM_EVENT_ROUTE_RESOLVED)
    return fail(EHOSTUNREACH, why, to.text() + ": no route (" + rdma_event_str(ev.type) + ")");
  BASE_TRY(l->setup(write_slots, why));
  BASE_TRY(l->post_recv(kReady));
  rdma_conn_param cp{};
  cp.private_data = private_data.data();
  cp.private_data_len = static_cast<uint8_t>(private_data.size());
  cp.initiator_depth = 2;
  cp.responder_resources = 2;
  cp.retry_count = 5;
  if (rdma_connect(r.id.get(), &cp) != 0) return fail(errno, why, "rdma_connect " + to.text());
  BASE_TRY(next_event(r.channel.get(), deadline, ev));
  if (answer != nullptr) *answer = ev.data;
  if (ev.type == RDMA_CM_EVENT_REJECTED) return fail(ECONNREFUSED, why, to.text() + " refused the connection");
  if (ev.type != RDMA_CM_EVENT_ESTABLISHED)
    return fail(ECONNREFUSED, why, to.text() + ": " + rdma_event_str(ev.type));
  l->connected_ = true;
  return l;
}

Status Link::post_recv(Slot s) {
  ibv_sge sge{};
  sge.addr = reinterpret_cast<uintptr_t>(res_->ctl.data() + static_cast<size_t>(s) * kControlMaxBuffer);
  sge.length = static_cast<uint32_t>(kControlMaxBuffer);
  sge.lkey = res_->ctl_mr->lkey;
  ibv_recv_wr wr{};
  wr.wr_id = wr_id(kWrRecv, static_cast<uint64_t>(s));
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  if (const int e = ibv_post_recv(res_->id->qp, &wr, &bad); e != 0) {
    err_ = "posting a RECV failed";
    return ibtrs::errc(e);
  }
  recv_[s] = RecvSlot{true, false, 0};
  return {};
}

bool Link::recv_done(Slot s) {
  (void)poll_cq();
  return recv_[s].done;
}

Status Link::poll_cq() {
  ibv_wc wc[16];
  for (;;) {
    const int n = ibv_poll_cq(res_->cq.get(), 16, wc);
    if (n < 0) {
      err_ = "ibv_poll_cq failed";
      return ibtrs::errc(EIO);
    }
    for (int i = 0; i < n; ++i) {
      const uint64_t kind = wc[i].wr_id & 0xff, v = wc[i].wr_id >> 8;
      if (kind == kWrWrite) {
        if (writes_in_flight_ > 0) --writes_in_flight_;
        if (wc[i].status == IBV_WC_SUCCESS) writes_done_.push_back(v);
      } else if (kind == kWrSend) {
        send_busy_ = false;
        send_ok_ = wc[i].status == IBV_WC_SUCCESS;
      } else if (kind == kWrRecv && v < 2 && wc[i].status == IBV_WC_SUCCESS) {
        recv_[v].posted = false;
        recv_[v].done = true;
        recv_[v].len = wc[i].byte_len;
      } else if (kind == kWrRecv && v < 2) {
        recv_[v].posted = false;
      }
      if (wc[i].status == IBV_WC_WR_FLUSH_ERR) {
        flushed_ = true;
      } else if (wc[i].status != IBV_WC_SUCCESS && !failed_) {
        failed_ = ibtrs::errc(wc_errno(wc[i].status));
        err_ = std::string(wr_kind(wc[i].wr_id)) + " failed: " + ibv_wc_status_str(wc[i].status);
        // The RC transport's retries ran out (retry_count x the ACK timeout, seconds on rxe):
        // nothing came back, not a refusal.
        if (wc[i].status == IBV_WC_RETRY_EXC_ERR)
          err_ += " (the peer stopped acknowledging: the link is down or the peer is gone)";
      }
    }
    if (n < 16) return {};
  }
}

Status Link::poll_cm() {
  for (;;) {
    rdma_cm_event* ev = nullptr;
    errno = 0;
    if (rdma_get_cm_event(res_->channel.get(), &ev) != 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return {};
      err_ = "rdma_get_cm_event failed";
      return last_errno();
    }
    const rdma_cm_event_type t = ev->event;
    rdma_ack_cm_event(ev);
    if (t == RDMA_CM_EVENT_DISCONNECTED || t == RDMA_CM_EVENT_DEVICE_REMOVAL ||
        t == RDMA_CM_EVENT_TIMEWAIT_EXIT)
      disconnected_ = true;
  }
}

std::string Link::qp_event() {
  ibv_context* verbs = res_->id ? res_->id->verbs : nullptr;
  if (verbs == nullptr || !set_nonblock(verbs->async_fd)) return "";
  std::string what;
  ibv_async_event ev{};
  while (ibv_get_async_event(verbs, &ev) == 0) {
    const bool ours = ev.event_type == IBV_EVENT_QP_ACCESS_ERR || ev.event_type == IBV_EVENT_QP_FATAL ||
                      ev.event_type == IBV_EVENT_QP_REQ_ERR;
    if (ours && what.empty() && ev.element.qp == res_->id->qp)
      what = std::string("the connection failed: ") + ibv_event_type_str(ev.event_type) +
             (ev.event_type == IBV_EVENT_QP_ACCESS_ERR ? " (the peer wrote outside the memory its key covers)" : "");
    ibv_ack_async_event(&ev);
  }
  return what;
}

// Why the connection cannot go on (a failed or flushed work request, a disconnect), as an error.
Status Link::broken() {
  if (std::string e = qp_event(); !e.empty()) {
    err_ = e;
    return ibtrs::errc(EACCES);
  }
  // A flush comes with the DISCONNECTED event of a close (both follow the peer's DREQ); a flush
  // alone is the QP failing, e.g. rxe's answer to a peer's RDMA WRITE outside the memory its key
  // covers (no async event there). The event gets a moment to arrive.
  for (int i = 0; i < 5 && flushed_ && !disconnected_; ++i) {
    pollfd pfd{res_->channel->fd, POLLIN, 0};
    (void)::poll(&pfd, 1, 100);
    BASE_TRY(poll_cm());
  }
  // A work request that failed while the peer went away failed because it went away.
  if (failed_ && !disconnected_) return failed_;
  if (!disconnected_) {
    err_ = "the connection failed without a disconnect: its queue pair went to error (the link failed, or "
           "the peer wrote outside the memory its key covers)";
    return ibtrs::errc(ECONNRESET);
  }
  if (!failed_) err_ = "the peer closed the connection";
  return ibtrs::errc(EPIPE);
}

// Polls until done() holds; every completion and cm event is taken in on the way. A failed
// completion or a disconnect ends the wait with an error unless done() holds by then.
Status Link::wait(Clock::time_point deadline, const std::function<bool()>& done) {
  const auto t0 = Clock::now();
  for (;;) {
    BASE_TRY(poll_cq());
    if (done()) return {};
    BASE_TRY(poll_cm());
    if (disconnected_ || flushed_ || failed_) {
      BASE_TRY(poll_cq());  // what arrived before the disconnect still counts
      if (done()) return {};
      return broken();
    }
    if (Clock::now() >= deadline) {
      err_ = timeout_message(Clock::now() - t0);
      timed_out_ = true;
      return ibtrs::errc(ETIMEDOUT);
    }
    pollfd pfd[2] = {{res_->comp->fd, POLLIN, 0}, {res_->channel->fd, POLLIN, 0}};
    const int n = ::poll(pfd, 2, ms_left(deadline));
    if (n > 0 && (pfd[0].revents & POLLIN)) {
      ibv_cq* cq = nullptr;
      void* ctx = nullptr;
      if (ibv_get_cq_event(res_->comp.get(), &cq, &ctx) == 0) {
        ibv_ack_cq_events(cq, 1);
        (void)ibv_req_notify_cq(cq, 0);  // then poll again: nothing is missed in between
      }
    }
  }
}

Result<std::span<const std::byte>> Link::wait_recv(Slot s, Clock::time_point deadline) {
  if (!recv_[s].posted && !recv_[s].done) {
    BASE_TRY(poll_cm());
    // Flushed (or failed) while something else was awaited; else never posted: a caller's bug.
    if (flushed_ || failed_ || disconnected_) return broken().error();
    return ibtrs::errc(EINVAL);
  }
  BASE_TRY(wait(deadline, [&] { return recv_[s].done; }));
  recv_[s].done = false;
  return std::span<const std::byte>(res_->ctl.data() + static_cast<size_t>(s) * kControlMaxBuffer, recv_[s].len);
}

Status Link::send(size_t n, Clock::time_point deadline) {
  if (n > kControlMaxBuffer || send_busy_) return ibtrs::errc(EINVAL);
  ibv_sge sge{};
  sge.addr = reinterpret_cast<uintptr_t>(send_buffer().data());
  sge.length = static_cast<uint32_t>(n);
  sge.lkey = res_->ctl_mr->lkey;
  ibv_send_wr wr{};
  wr.wr_id = wr_id(kWrSend, 0);
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_send_wr* bad = nullptr;
  if (const int e = ibv_post_send(res_->id->qp, &wr, &bad); e != 0) {
    err_ = "posting a SEND failed";
    return ibtrs::errc(e);
  }
  send_busy_ = true;
  BASE_TRY(wait(deadline, [&] { return !send_busy_; }));
  if (!send_ok_) return broken();
  return {};
}

Result<std::unique_ptr<Link::Mr>> Link::reg(void* addr, size_t len, int access, std::string* why) {
  auto m = std::make_unique<VerbsMr>();
  errno = 0;
  m->mr.reset(ibv_reg_mr(res_->pd.get(), addr, len, access));
  if (!m->mr)
    return fail(errno != 0 ? errno : ENOMEM, why, "registering " + mib(len) + " for RDMA failed: " +
                                                      std::strerror(errno != 0 ? errno : ENOMEM) + memlock_hint());
  return std::unique_ptr<Mr>(std::move(m));
}

Status Link::post_write(std::span<const std::byte> local, uint32_t lkey, uint64_t remote, uint32_t rkey, uint64_t tag) {
  if (writes_in_flight_ + 1 >= res_->max_send) return ibtrs::errc(EAGAIN);
  ibv_sge sge{};
  sge.addr = reinterpret_cast<uintptr_t>(local.data());
  sge.length = static_cast<uint32_t>(local.size());
  sge.lkey = lkey;
  ibv_send_wr wr{};
  wr.wr_id = wr_id(kWrWrite, tag);
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.wr.rdma.remote_addr = remote;
  wr.wr.rdma.rkey = rkey;
  ibv_send_wr* bad = nullptr;
  if (const int e = ibv_post_send(res_->id->qp, &wr, &bad); e != 0) {
    err_ = "posting an RDMA WRITE failed";
    return ibtrs::errc(e);
  }
  ++writes_in_flight_;
  return {};
}

Result<uint64_t> Link::wait_write(Clock::time_point deadline) {
  if (writes_done_.empty() && writes_in_flight_ == 0) return ibtrs::errc(EINVAL);
  BASE_TRY(wait(deadline, [&] { return !writes_done_.empty(); }));
  const uint64_t t = writes_done_.front();
  writes_done_.erase(writes_done_.begin());
  return t;
}

Result<bool> Link::wait_disconnect_or_recv(Slot s, Clock::time_point deadline) {
  Status st = wait(deadline, [&] { return recv_[s].done; });
  if (st.ok()) return false;
  if (st.error().value() == EPIPE) return true;
  return st.error();
}

// A live peer's device acknowledges a SEND within milliseconds; after a whole timeout of silence
// the link is most likely gone, and the ERROR is a courtesy that should not stretch the bound.
Clock::time_point Link::error_deadline() const {
  return Clock::now() + (timed_out_ ? std::chrono::milliseconds(500) : std::chrono::milliseconds(2000));
}

void Link::disconnect() {
  if (res_ && res_->id && connected_ && !disconnect_sent_) {
    rdma_disconnect(res_->id.get());
    disconnect_sent_ = true;
  }
}

// ---- the save side (destination role) ----

namespace {
struct VerbsRegistration final : Registration {
  std::unique_ptr<Link::Mr> mr;
  uint32_t rkey() const override { return mr->rkey(); }
};
}  // namespace

struct SaveEndpoint::Impl final : qstream::PageSource, Registrar {
  EndpointOptions o;
  uint64_t pin_limit = 0;
  ChannelPtr listen_channel;
  IdPtr listen_id;
  uint16_t port = 0;
  std::unique_ptr<Link> link;  // before `ram`: its registrations go first
  Caps caps;
  RamLayout layout;
  std::unique_ptr<RamMirror> ram;
  std::unique_ptr<qstream::InlineRewriter> rw;
  std::vector<std::byte> file;  // the QEMU FILE payload being parsed (the slot is reposted meanwhile)
  EndpointStats stats;
  std::string err;
  bool peer_error = false;

  Clock::time_point deadline() const { return Clock::now() + o.timeout; }

  std::error_code protocol(int e, std::string msg) {
    err = std::move(msg);
    return ibtrs::errc(e);
  }

  // Registrar: chunk and block registrations of the RamMirror.
  Result<std::unique_ptr<Registration>> register_memory(std::byte* addr, size_t len, std::string* why) override {
    auto r = std::make_unique<VerbsRegistration>();
    BASE_ASSIGN_OR_RETURN(r->mr, link->reg(addr, len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, why));
    return std::unique_ptr<Registration>(std::move(r));
  }

  Status accept();
  // READY, then the next message, decoded (and counted).
  Result<ControlMessage> next();
  // The link's reason is kept here: a failed reply inside the registration loop reaches run()
  // through the rewriter, which knows only that its page source stopped.
  Status reply(Result<size_t> encoded) {
    if (!encoded) return protocol(encoded.error().value(), "encoding a reply failed");
    Status s = link->send(*encoded, deadline());
    if (!s && err.empty()) err = link->last_error();
    return s;
  }

  // PageSource
  Status ram_blocks(std::span<const qstream::RamBlock> blocks) override;
  Status changed_pages(const qstream::RamRound& round, qstream::PageWriter& out) override;

  Status run(qstream::ByteSink& out);
};

Status SaveEndpoint::Impl::accept() {
  const auto until = deadline();
  CmEvent ev;
  for (;;) {
    if (Status s = next_event(listen_channel.get(), until, ev); !s)
      return protocol(s.error().value(), s.error().value() == ETIMEDOUT
                                             ? "no source connected within the timeout"
                                             : "waiting for a connection failed");
    if (ev.type == RDMA_CM_EVENT_CONNECT_REQUEST) break;
  }
  IdPtr id(ev.id);
  std::string why;
  auto c = decode_caps(ev.data, &why);
  if (!c) {
    rdma_reject(id.get(), nullptr, 0);
    return protocol(c.error().value(), "refused the source's connection: " + why);
  }
  caps = answer_caps(*c, o.allow_pin_all);
  link.reset(new Link());
  Link::Res& r = *link->res_;
  BASE_ASSIGN_OR_RETURN(r.channel, make_channel(&why));
  // The id moves to a channel of its own (every event of it acked: ours are), so that its
  // disconnect is seen there and the listener can go.
  if (rdma_migrate_id(id.get(), r.channel.get()) != 0) return protocol(errno, "rdma_migrate_id failed");
  r.id = std::move(id);
  if (Status s = link->setup(2, &why); !s) {
    rdma_reject(r.id.get(), nullptr, 0);
    return protocol(s.error().value(), why);
  }
  BASE_TRY(link->post_recv(Link::kReady));
  const auto answer = encode_caps(caps);
  rdma_conn_param cp{};
  cp.private_data = answer.data();
  cp.private_data_len = static_cast<uint8_t>(answer.size());
  cp.responder_resources = 2;
  cp.initiator_depth = 2;
  if (rdma_accept(r.id.get(), &cp) != 0) return protocol(errno, "rdma_accept failed");
  if (Status s = next_event(r.channel.get(), until, ev); !s) return protocol(s.error().value(), "accepting");
  if (ev.type != RDMA_CM_EVENT_ESTABLISHED)
    return protocol(ECONNABORTED, std::string("the connection was not established: ") + rdma_event_str(ev.type));
  link->connected_ = true;
  listen_id.reset();  // one source per save
  listen_channel.reset();
  return {};
}

Result<ControlMessage> SaveEndpoint::Impl::next() {
  if (Status s = link->post_recv(Link::kReady); !s) return protocol(s.error().value(), link->last_error());
  auto n = encode_empty(link->send_buffer(), MsgType::ready);
  if (Status s = reply(n); !s) return s.error();
  auto got = link->wait_recv(Link::kReady, deadline());
  if (!got) return protocol(got.error().value(), link->last_error());
  ++stats.messages;
  std::string why;
  auto m = decode_control(*got, ram && ram->ready() ? &layout : nullptr, &why);
  if (!m) return protocol(m.error().value(), "bad control message: " + why);
  if (m->type == MsgType::error) {
    peer_error = true;
    return protocol(ECONNABORTED, "the source sent ERROR (its migration failed)");
  }
  return m;
}

Status SaveEndpoint::Impl::ram_blocks(std::span<const qstream::RamBlock> blocks) {
  std::vector<RamBlockLayout> bl;
  for (const auto& b : blocks) bl.push_back({b.name, 0, b.length});
  std::string why;
  auto l = RamLayout::packed(std::move(bl), &why);
  if (!l) return protocol(l.error().value(), why);
  layout = std::move(*l);
  ram = std::make_unique<RamMirror>(*this, pin_limit);
  if (Status s = ram->init(layout, rw->parser().page_size(), &why); !s) return protocol(s.error().value(), why);
  return {};
}

// A HOOK: rdma.c's registration loop until REGISTER FINISHED, then the changed pages.
Status SaveEndpoint::Impl::changed_pages(const qstream::RamRound& round, qstream::PageWriter& out) {
  if (!ram || !ram->ready()) return protocol(EPROTO, "a HOOK before the RAM block list");
  std::string why;
  for (bool finished = false; !finished;) {
    BASE_ASSIGN_OR_RETURN(ControlMessage m, next());
    switch (m.type) {
      case MsgType::compress: {
        if (Status s = ram->compress(m.compress, out, &why); !s) return protocol(s.error().value(), why);
        stats.ram_bytes += m.compress.length;
        break;
      }
      case MsgType::register_request: {
        std::vector<RegisterResult> res;
        for (const RegisterRequest& r : m.registers) {
          auto k = ram->register_chunks(r, &why);
          if (!k) return protocol(k.error().value(), why);
          res.push_back({*k, ram->host_addr(r.block)});
        }
        BASE_TRY(reply(encode_register_result(link->send_buffer(), res)));
        break;
      }
      case MsgType::ram_blocks_request: {
        std::vector<uint64_t> addrs;
        for (uint32_t i = 0; i < layout.size(); ++i) addrs.push_back(ram->host_addr(i));
        std::vector<uint32_t> keys;
        if (caps.flags & kCapPinAll) {
          auto k = ram->pin_all(&why);
          if (!k) return protocol(k.error().value(), why);
          keys = std::move(*k);
        }
        BASE_TRY(reply(encode_ram_blocks_result(link->send_buffer(), layout, addrs, keys)));
        break;
      }
      case MsgType::unregister_request: {
        for (const UnregisterRequest& u : m.unregisters)
          if (Status s = ram->unregister_chunk(u, &why); !s) return protocol(s.error().value(), why);
        BASE_TRY(reply(encode_empty(link->send_buffer(), MsgType::unregister_finished)));
        break;
      }
      case MsgType::register_finished:
        finished = true;
        break;
      default:
        return protocol(EPROTO, std::string(to_string(m.type)) + " inside the registration loop");
    }
  }
  ++stats.rounds;
  // QEMU writes no page during the setup round (it only exchanges the RAM blocks); a write that
  // came anyway is found by the next round's report.
  if (round.phase == qstream::RamPhase::setup) return {};
  const uint64_t before = ram->pages_reported();
  BASE_TRY(ram->report(out));
  stats.ram_bytes += (ram->pages_reported() - before) * rw->parser().page_size();
  return {};
}

Status SaveEndpoint::Impl::run(qstream::ByteSink& out) {
  BASE_TRY(accept());
  rw = std::make_unique<qstream::InlineRewriter>(out, *this);
  Status result;
  for (;;) {
    auto m = next();
    if (!m) {
      // The source closes after its last QEMU FILE message: the end, if the RAM section ended.
      if (m.error().value() == EPIPE && !peer_error && rw->parser().ram_complete()) {
        err.clear();
        result = rw->finish();
        if (!result) err = "the stream: " + rw->last_error();
        return result;
      }
      if (m.error().value() == EPIPE) err = "the source closed the connection before the end of its RAM";
      result = m.error();
      break;
    }
    if (m->type != MsgType::qemu_file) {
      result = protocol(EPROTO, std::string(to_string(m->type)) + " where QEMU FILE was due");
      break;
    }
    file.assign(m->file.begin(), m->file.end());
    stats.file_bytes += file.size();
    if (Status s = rw->feed(file); !s) {
      if (err.empty()) err = "the stream: " + rw->last_error();
      result = s;
      break;
    }
  }
  // Our failure (or a bad peer): ERROR first, so QEMU stops at once.
  if (!peer_error && link && !link->disconnected()) {
    if (auto n = encode_empty(link->send_buffer(), MsgType::error); n) (void)link->send(*n, link->error_deadline());
  }
  if (link) link->disconnect();
  return result;
}

SaveEndpoint::SaveEndpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SaveEndpoint::~SaveEndpoint() = default;

Result<std::unique_ptr<SaveEndpoint>> SaveEndpoint::listen(const RdmaAddress& at, const EndpointOptions& o,
                                                           std::string* why) {
  auto impl = std::make_unique<Impl>();
  impl->o = o;
  impl->pin_limit = o.pin_limit != 0 ? o.pin_limit : default_pin_limit();
  BASE_ASSIGN_OR_RETURN(impl->listen_channel, make_channel(why));
  rdma_cm_id* raw = nullptr;
  if (rdma_create_id(impl->listen_channel.get(), &raw, nullptr, RDMA_PS_TCP) != 0)
    return fail(errno, why, "rdma_create_id");
  impl->listen_id.reset(raw);
  BASE_ASSIGN_OR_RETURN(AddrInfoPtr ai, resolve(at, true, why));
  if (rdma_bind_addr(raw, ai->ai_src_addr) != 0) return fail(errno, why, "binding " + at.text());
  if (rdma_listen(raw, 1) != 0) return fail(errno, why, "listening on " + at.text());
  impl->port = ntohs(rdma_get_src_port(raw));
  return std::unique_ptr<SaveEndpoint>(new SaveEndpoint(std::move(impl)));
}

uint16_t SaveEndpoint::port() const { return impl_->port; }
Status SaveEndpoint::run(qstream::ByteSink& out) { return impl_->run(out); }
const std::string& SaveEndpoint::last_error() const { return impl_->err; }
const EndpointStats& SaveEndpoint::stats() const { return impl_->stats; }
bool SaveEndpoint::pinned_all() const { return impl_->ram && impl_->ram->pinned_all(); }
uint64_t SaveEndpoint::pinned_bytes() const { return impl_->ram ? impl_->ram->pinned_bytes() : 0; }

// ---- the restore side (source role) ----

struct RestoreEndpoint::Impl final : qstream::RdmaSink {
  EndpointOptions o;
  std::unique_ptr<Link> link;  // before the MRs below
  Caps asked, granted;
  Mapping staging;             // write_slots x 1 MiB: a run of pages is copied into one, then written
  std::unique_ptr<Link::Mr> staging_mr;
  std::vector<uint32_t> free_slots;
  std::unique_ptr<qstream::RdmaSplitter> split;
  std::vector<std::byte> pending;  // stream bytes not yet sent as QEMU FILE
  size_t pending_head = 0;
  bool ready_expected = true;      // the destination's READY precedes each of our messages
  RamLayout src, dst;              // the stream's blocks (packed) / the destination's offsets
  std::vector<DestBlock> dest;
  uint32_t page_size = 0;
  struct Key {
    uint32_t rkey;
    uint64_t host_addr;
  };
  std::map<std::pair<uint32_t, uint64_t>, Key> registered;  // (block, chunk) -> key
  struct Run {
    bool open = false;
    uint32_t block = 0;
    uint64_t chunk = 0, start = 0, len = 0;
    uint32_t slot = 0;
    std::optional<uint8_t> zero_fill;  // every page a ZERO record with this fill
  } run;
  EndpointStats stats;
  std::string err;
  bool peer_error = false;
  bool closed = false;

  Clock::time_point deadline() const { return Clock::now() + o.timeout; }
  std::error_code protocol(int e, std::string msg) {
    err = std::move(msg);
    return ibtrs::errc(e);
  }
  std::byte* slot_data(uint32_t s) const { return staging.data() + (static_cast<size_t>(s) << kChunkShift); }

  // rdma.c's qemu_rdma_exchange_send: wait for READY, post the response's slot (if one is
  // expected) and READY's again, send, wait for the response.
  // `response` none: no response expected (the result is then an empty message).
  Result<ControlMessage> exchange(Result<size_t> encoded, MsgType response);
  Status send_file(std::span<const std::byte> b) {
    stats.file_bytes += b.size();
    BASE_TRY(exchange(encode_qemu_file(link->send_buffer(), b), MsgType::none));
    return {};
  }
  Status flush_file(bool all);
  Result<uint32_t> take_slot();
  Status flush_run();
  Status drain();

  // RdmaSink
  Status file_bytes(std::span<const std::byte> b) override;
  Status ram_blocks(std::span<const qstream::RamBlock> blocks) override;
  Status round_begin(const qstream::RamRound& r) override;
  Status page(const qstream::PageRecord& p) override;
  Status round_end(const qstream::RamRound& r) override;

  void send_error();
};

Result<ControlMessage> RestoreEndpoint::Impl::exchange(Result<size_t> encoded, MsgType response) {
  const bool want = response != MsgType::none;
  if (!encoded) return protocol(encoded.error().value(), "encoding a message failed");
  std::string why;
  if (ready_expected) {
    auto got = link->wait_recv(Link::kReady, deadline());
    if (!got) return protocol(got.error().value(), link->last_error());
    ++stats.messages;
    auto m = decode_control(*got, nullptr, &why);
    if (!m) return protocol(m.error().value(), "bad control message: " + why);
    if (m->type == MsgType::error) {
      peer_error = true;
      return protocol(ECONNABORTED, "the destination sent ERROR (its migration failed)");
    }
    if (m->type != MsgType::ready)
      return protocol(EPROTO, std::string(to_string(m->type)) + " where READY was due");
  }
  if (want)
    if (Status s = link->post_recv(Link::kData); !s) return protocol(s.error().value(), link->last_error());
  if (Status s = link->post_recv(Link::kReady); !s) return protocol(s.error().value(), link->last_error());
  if (Status s = link->send(*encoded, deadline()); !s) return protocol(s.error().value(), link->last_error());
  ready_expected = true;
  if (!want) return ControlMessage{};
  auto got = link->wait_recv(Link::kData, deadline());
  if (!got) return protocol(got.error().value(), link->last_error());
  ++stats.messages;
  auto m = decode_control(*got, src.size() != 0 ? &src : nullptr, &why);
  if (!m) return protocol(m.error().value(), "bad control message: " + why);
  if (m->type == MsgType::error) {
    peer_error = true;
    return protocol(ECONNABORTED, "the destination sent ERROR (its migration failed)");
  }
  if (m->type != response)
    return protocol(EPROTO, std::string(to_string(m->type)) + " where " + std::string(to_string(response)) + " was due");
  return m;
}

// QEMU FILE messages of kFileIncrement bytes (what QEMU's source sends and its destination's
// QEMUFile buffer holds); `all` sends the remainder too, so that a HOOK ends its message: the
// destination's registration loop reuses the receive buffer the HOOK came in.
Status RestoreEndpoint::Impl::flush_file(bool all) {
  while (pending.size() - pending_head >= kFileIncrement || (all && pending.size() > pending_head)) {
    const size_t n = std::min(kFileIncrement, pending.size() - pending_head);
    BASE_TRY(send_file({pending.data() + pending_head, n}));
    pending_head += n;
  }
  if (pending_head == pending.size()) {
    pending.clear();
    pending_head = 0;
  } else if (pending_head > kFileIncrement) {
    pending.erase(pending.begin(), pending.begin() + static_cast<std::ptrdiff_t>(pending_head));
    pending_head = 0;
  }
  return {};
}

Status RestoreEndpoint::Impl::file_bytes(std::span<const std::byte> b) {
  pending.insert(pending.end(), b.begin(), b.end());
  return flush_file(false);
}

Status RestoreEndpoint::Impl::ram_blocks(std::span<const qstream::RamBlock> blocks) {
  std::vector<RamBlockLayout> bl;
  for (const auto& b : blocks) bl.push_back({b.name, 0, b.length});
  std::string why;
  auto l = RamLayout::packed(std::move(bl), &why);
  if (!l) return protocol(l.error().value(), "the image's RAM blocks: " + why);
  src = std::move(*l);
  page_size = split->parser().page_size();
  return {};
}

Status RestoreEndpoint::Impl::round_begin(const qstream::RamRound& r) {
  BASE_TRY(flush_file(true));  // the round's HOOK is the last byte given
  if (r.phase != qstream::RamPhase::setup) return {};
  if (src.size() == 0) return protocol(EPROTO, "a RAM round before the RAM block list");
  BASE_ASSIGN_OR_RETURN(auto m, exchange(encode_empty(link->send_buffer(), MsgType::ram_blocks_request),
                                          MsgType::ram_blocks_result));
  dest = std::move(m.blocks);  // count and lengths checked against `src` by the decoder
  std::vector<RamBlockLayout> dl;
  for (size_t i = 0; i < dest.size(); ++i) dl.push_back({src.block(i).name, dest[i].offset, dest[i].length});
  std::string why;
  auto l = RamLayout::make(std::move(dl), &why);
  if (!l) return protocol(ERANGE, "RAM BLOCKS RESULT: " + why);
  dst = std::move(*l);
  return {};
}

Result<uint32_t> RestoreEndpoint::Impl::take_slot() {
  while (free_slots.empty()) {
    auto t = link->wait_write(deadline());
    if (!t) return protocol(t.error().value(), link->last_error());
    free_slots.push_back(static_cast<uint32_t>(*t));
  }
  const uint32_t s = free_slots.back();
  free_slots.pop_back();
  return s;
}

Status RestoreEndpoint::Impl::drain() {
  while (link->writes_in_flight() > 0) {
    auto t = link->wait_write(deadline());
    if (!t) return protocol(t.error().value(), link->last_error());
    free_slots.push_back(static_cast<uint32_t>(*t));
  }
  return {};
}

// A run of pages in one chunk, as rdma.c's qemu_rdma_write_one, with one difference: a run of
// ZERO records goes as COMPRESS whether or not the chunk is registered (QEMU's source writes zero
// runs into registered chunks and pinned blocks; its destination takes COMPRESS for any chunk, and
// one message beats a chunk of zeroes on the wire: a pinned 32 MiB guest with 16 MiB of data moved
// 16 MiB instead of 32). Otherwise: RDMA WRITE into the registered chunk or pinned block, REGISTER
// first when the chunk has no key yet.
Status RestoreEndpoint::Impl::flush_run() {
  if (!run.open) return {};
  Run r = run;
  run.open = false;
  std::optional<Key> key;
  if (granted.flags & kCapPinAll) {
    key = Key{dest[r.block].rkey, dest[r.block].host_addr};
  } else if (auto it = registered.find({r.block, r.chunk}); it != registered.end()) {
    key = it->second;
  }
  if (r.zero_fill) {
    free_slots.push_back(r.slot);
    stats.ram_bytes += r.len;
    BASE_TRY(exchange(encode_compress(link->send_buffer(), dst, r.block, r.start, r.len, *r.zero_fill), MsgType::none));
    return {};
  }
  if (!key) {
    const RegisterArg a{r.block, r.start, 0};
    BASE_ASSIGN_OR_RETURN(auto m, exchange(encode_register_request(link->send_buffer(), dst, {&a, 1}),
                                            MsgType::register_result));
    if (m.results.size() != 1)
      return protocol(EPROTO, "REGISTER RESULT with " + std::to_string(m.results.size()) + " entries for one request");
    key = Key{m.results[0].rkey, m.results[0].host_addr};
    registered[{r.block, r.chunk}] = *key;
  }
  // The destination checks the address against the MR of the key: a wrong one fails the write.
  const uint64_t remote = key->host_addr + r.start;
  if (Status s = link->post_write({slot_data(r.slot), r.len}, staging_mr->lkey(), remote, key->rkey, r.slot); !s)
    return protocol(s.error().value(), link->last_error());
  stats.ram_bytes += r.len;
  return {};
}

Status RestoreEndpoint::Impl::page(const qstream::PageRecord& p) {
  if (dst.size() == 0) return protocol(EPROTO, "a page before the RAM blocks were exchanged");
  const uint64_t chunk = p.offset >> kChunkShift;
  if (run.open && (run.block != p.block || run.chunk != chunk || run.start + run.len != p.offset))
    BASE_TRY(flush_run());
  if (!run.open) {
    BASE_ASSIGN_OR_RETURN(uint32_t s, take_slot());
    run = Run{true, p.block, chunk, p.offset, 0, s, p.zero ? std::optional<uint8_t>(p.fill) : std::nullopt};
  } else if (!p.zero || !run.zero_fill || *run.zero_fill != p.fill) {
    run.zero_fill.reset();
  }
  std::byte* at = slot_data(run.slot) + run.len;
  if (p.zero) std::memset(at, p.fill, page_size);
  else std::memcpy(at, p.data.data(), page_size);
  run.len += page_size;
  return {};
}

Status RestoreEndpoint::Impl::round_end(const qstream::RamRound&) {
  BASE_TRY(flush_run());
  BASE_TRY(drain());  // the writes land before REGISTER FINISHED (rdma.c drains the CQ too)
  BASE_TRY(exchange(encode_empty(link->send_buffer(), MsgType::register_finished), MsgType::none));
  ++stats.rounds;
  return {};
}

void RestoreEndpoint::Impl::send_error() {
  if (closed || !link) return;
  closed = true;
  if (!peer_error && !link->disconnected()) {
    // After the destination's READY if one is due (it then surely has a RECV posted), unless
    // the link has already been silent for a whole timeout: no READY comes over a cut link, and
    // waiting for one would stretch the agent's bound by its 5 s.
    if (ready_expected && !link->timed_out())
      (void)link->wait_recv(Link::kReady, Clock::now() + std::chrono::seconds(5));
    if (auto n = encode_empty(link->send_buffer(), MsgType::error); n) (void)link->send(*n, link->error_deadline());
  }
  link->disconnect();
}

RestoreEndpoint::RestoreEndpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RestoreEndpoint::~RestoreEndpoint() { impl_->send_error(); }

Result<std::unique_ptr<RestoreEndpoint>> RestoreEndpoint::connect(const RdmaAddress& to, const EndpointOptions& o,
                                                                  std::string* why) {
  auto impl = std::make_unique<Impl>();
  impl->o = o;
  impl->o.write_slots = std::clamp<uint32_t>(o.write_slots, 1, 64);
  impl->asked = Caps{kVersion, o.pin_all ? kCapPinAll : 0u};
  const auto caps = encode_caps(impl->asked);
  const auto until = Clock::now() + o.timeout;
  std::vector<std::byte> answer;
  // QEMU may still be setting up its listener: a refused connect is tried again (a new id each
  // time: a rejected one cannot connect again).
  for (;;) {
    auto l = Link::connect(to, caps, impl->o.write_slots, until, &answer, why);
    if (l) {
      impl->link = std::move(*l);
      break;
    }
    const int e = l.error().value();
    if ((e != ECONNREFUSED && e != EHOSTUNREACH) || Clock::now() + std::chrono::milliseconds(200) >= until)
      return l.error();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  auto g = check_answer(impl->asked, answer, why);
  if (!g) return g.error();
  impl->granted = *g;
  std::string w;
  BASE_ASSIGN_OR_RETURN(impl->staging, Mapping::make(static_cast<size_t>(impl->o.write_slots) << kChunkShift));
  auto mr = impl->link->reg(impl->staging.data(), impl->staging.size(), IBV_ACCESS_LOCAL_WRITE, why);
  if (!mr) return mr.error();
  impl->staging_mr = std::move(*mr);
  for (uint32_t s = 0; s < impl->o.write_slots; ++s) impl->free_slots.push_back(s);
  Impl* raw = impl.get();
  impl->split = std::make_unique<qstream::RdmaSplitter>(*raw);
  return std::unique_ptr<RestoreEndpoint>(new RestoreEndpoint(std::move(impl)));
}

Status RestoreEndpoint::feed(std::span<const std::byte> b) {
  Impl& i = *impl_;
  if (i.closed) return ibtrs::errc(EPIPE);
  Status s = i.split->feed(b);
  if (!s && i.err.empty()) i.err = "the image's stream: " + i.split->last_error();
  return s;
}

Status RestoreEndpoint::finish() {
  Impl& i = *impl_;
  if (i.closed) return ibtrs::errc(EPIPE);
  Status s = i.split->finish();
  if (!s) {
    if (i.err.empty()) i.err = "the image's stream: " + i.split->last_error();
    return s;
  }
  BASE_TRY(i.flush_file(true));
  // QEMU closes once it has loaded the stream; a READY means it wants more than there is.
  auto d = i.link->wait_disconnect_or_recv(Link::kReady, i.deadline());
  if (!d) return i.protocol(d.error().value(), "waiting for QEMU to finish loading: " + i.link->last_error());
  if (!*d) return i.protocol(EPROTO, "QEMU asked for more of the stream than the image holds");
  i.closed = true;
  i.link->disconnect();
  return {};
}

void RestoreEndpoint::abort() { impl_->send_error(); }
const std::string& RestoreEndpoint::last_error() const { return impl_->err; }
const EndpointStats& RestoreEndpoint::stats() const { return impl_->stats; }
bool RestoreEndpoint::pin_all() const { return (impl_->granted.flags & kCapPinAll) != 0; }

}  // namespace ibnbd::migrate::qrdma
