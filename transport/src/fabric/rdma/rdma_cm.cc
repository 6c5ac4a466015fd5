// Connection management of the rdma provider: private event channels polled with the caller's
// deadline, address and route resolution, connect(), the listener and the requests it returns
// (accept/reject), with private data encoded by rdma_private_data.h.
#include <arpa/inet.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <rdma/rdma_cma.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <optional>

#include "fabric/held_request.h"
#include "fabric/rdma/rdma_private.h"
#include "fabric/rdma/rdma_private_data.h"
#include "ibtrs/gid.h"

namespace ibtrs::fabric::rdma {
namespace {

// Address resolution is an ARP/ND exchange; a longer wait only delays the error.
constexpr std::chrono::milliseconds kResolveAddrTimeout{2000};
// accept() has no timeout parameter; RTRS's connect timeout bounds the wait for the RTU.
constexpr std::chrono::milliseconds kAcceptTimeout{30000};

// RC retry counts: 7 is "infinite" for RNR, which fabric.h promises (the sender waits for a RECV).
constexpr uint8_t kRetryCount = 7;
constexpr uint8_t kRnrRetryCount = 7;

// Verbs devices cap depths and SGEs per QP themselves (ibv_create_qp fails past them); these are
// the bounds of our own rings.
constexpr uint32_t kMaxQueueDepth = 1u << 16;
constexpr uint32_t kMaxSgePerWr = 32;

int ms_left(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  if (left.count() <= 0) return 0;
  return left.count() > INT_MAX ? INT_MAX : static_cast<int>(left.count());
}

bool valid_ip_address(const Address& a) {
  return a.fabric == FabricKind::rdma && (a.family() == AF_INET || a.family() == AF_INET6);
}

bool is_iwarp(const ibv_context* ctx) {
  return ctx != nullptr && ctx->device->transport_type == IBV_TRANSPORT_IWARP;
}

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

class RdmaConnectRequest final : public HeldConnectRequest {
 public:
  RdmaConnectRequest(RdmaFabric& fabric, RdmaDomain& domain, ChannelPtr channel, IdPtr id,
                     std::span<const std::byte> private_data)
      : HeldConnectRequest(std::vector<std::byte>(private_data.begin(), private_data.end()),
                           to_address(rdma_get_local_addr(id.get())),
                           to_address(rdma_get_peer_addr(id.get()))),
        fabric_(fabric),
        domain_(domain),
        channel_(std::move(channel)),
        id_(std::move(id)) {}
  ~RdmaConnectRequest() override {
    // Neither accepted nor rejected: answer now rather than let the peer's REQ time out. (Member
    // order destroys the id before the channel it reports on.)
    if (id_) rdma_reject(id_.get(), nullptr, 0);
  }

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

}  // namespace

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

Result<ChannelPtr> make_channel() {
  errno = 0;
  ChannelPtr ch(rdma_create_event_channel());
  if (!ch) return errno == ENOENT ? errc(ENODEV) : last_error(ENODEV);
  if (!set_nonblock(ch->fd)) return last_error();
  return ch;
}

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
        result.connection = make_connection(std::move(core));
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
  return make_connection(std::move(core));
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

}  // namespace ibtrs::fabric::rdma
