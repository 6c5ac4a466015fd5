// The IBTRS server (kernel: rtrs-srv.c).
//
// The public Server: start, stop and the accessors; the rest is in the files server_impl.h lists.
#include "ibtrs/server.h"

#include <algorithm>
#include <thread>

#include "core/fabrics.h"
#include "server/server_impl.h"

namespace ibtrs {

using namespace std::chrono_literals;

namespace server {

// The server-role TLS context of ServerOptions::tls: certificates when given, else PSKs looked
// up through the authenticator. EINVAL: neither, or unreadable PEM files.
Result<std::shared_ptr<tls::Context>> make_tls_context(const ServerOptions& o) {
  tls::Config c;
  c.role = tls::Role::server;
  c.kernel = o.tls.kernel;
  if (!o.tls.cert_file.empty() || !o.tls.key_file.empty()) {
    c.cert_file = o.tls.cert_file;
    c.key_file = o.tls.key_file;
    c.ca_file = o.tls.ca_file;
  } else {
    const Authenticator* a = o.authenticator;
    if (a == nullptr || !o.tls.ca_file.empty()) return errc(EINVAL);
    c.psk_lookup = [a](std::string_view identity) { return tls_psk_lookup(*a, identity); };
  }
  return tls::Context::create(std::move(c));
}

// How the IO pollers wait (Server::start, which is outside this namespace).
core::PollMode io_poll_mode(const ServerOptions& o) {
  if (o.busy_poll) return core::PollMode::spin;
  switch (o.io_poll) {
    case ServerOptions::IoPoll::block: return core::PollMode::block;
    case ServerOptions::IoPoll::spin: return core::PollMode::spin;
    case ServerOptions::IoPoll::adaptive: break;
  }
  return core::PollMode::adaptive;
}

}  // namespace server

// ------------------------------------------------------------------------------------------

struct Server::Impl final : server::Impl {};

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Server::~Server() {
  Impl* im = impl_.get();
  im->stopping.store(true);
  if (im->acceptor.joinable()) im->acceptor.join();
  // Close every path; wait for the upper layer to complete what it holds.
  im->worker->call([im] {
    std::vector<server::Path*> all;
    {
      std::lock_guard lock(im->mu);
      for (auto& [id, s] : im->sessions) {
        std::lock_guard sl(s->mu);
        all.insert(all.end(), s->live.begin(), s->live.end());
      }
    }
    for (auto* p : all) im->close_path(p, "server stopping");
    return 0;
  });
  for (;;) {
    bool empty = im->worker->call([im] {
      im->reap();
      im->run_held();  // stopping: every held request is answered
      return im->dying.empty() && im->held.empty();
    });
    if (empty) break;
    std::this_thread::sleep_for(5ms);
  }
  im->worker->stop();
  for (auto [i, h] : im->hooks) {
    core::Poller* p = im->io_pollers[i].get();
    p->run_sync([p, h = h] { p->remove_source(h); });
  }
  im->io_pollers.clear();
  im->svc_poller.reset();
  im->listeners.clear();
}

Result<std::unique_ptr<Server>> Server::start(ServerOptions o) {
  if (o.handler == nullptr || o.listen.empty() || o.queue_depth == 0 ||
      o.chunk_size < proto::kMinChunkSize || o.chunk_size > proto::kMaxChunkSize ||
      (o.chunk_size & (o.chunk_size - 1)) != 0 || o.max_hdr_size < 64 ||
      o.max_hdr_size >= o.chunk_size || o.heartbeat.interval.count() <= 0 ||
      o.heartbeat.missed_max == 0 || o.max_sessions == 0 || o.max_paths_per_session == 0 ||
      o.max_chunk_memory < uint64_t{o.queue_depth} * o.chunk_size ||
      o.handshake_timeout.count() <= 0 || o.ack_timeout.count() <= 0 || o.drain_hold.count() < 0 ||
      (o.authenticator == nullptr && !o.allow_any_host))
    return errc(EINVAL);
  BASE_TRY(proto::imm_layout(o.queue_depth, o.chunk_size));
  // A held client must hear the answer before its connect gives up (ServerOptions::drain_hold).
  o.drain_hold = std::min(o.drain_hold, o.handshake_timeout / 2);
  // What the largest set (min(queue depth, 64) chunks) holds besides its header, at most.
  o.max_io_size = static_cast<uint32_t>(std::min<uint64_t>(
      o.max_io_size,
      uint64_t{std::min<uint32_t>(o.queue_depth, proto::kMaxSetChunks)} * o.chunk_size - o.max_hdr_size));
  auto impl = std::make_unique<Impl>();
  impl->opts = std::move(o);
  namespace r = refusal;
  impl->refusals.declare({r::kSessionLimit, r::kPathLimit, r::kChunkMemoryLimit,
                          r::kBadConnectRequest, r::kNoResources, r::kProtocolError,
                          r::kHandshakeTimeout, r::kHandshakeEvicted, r::kAckTimeout,
                          r::kListenTimeout, r::kListenOverflow, r::kListenInvalid, r::kListenError,
                          r::kAuthNoCredentials, r::kAuthUnknownHost, r::kAuthBadResponse,
                          r::kAuthHostMismatch, r::kAuthProtocol, r::kListenPlaintext,
                          r::kListenTlsFailed, r::kDrainHoldTimeout, r::kDrainHoldLimit});
  const uint32_t hw = std::max(1u, std::thread::hardware_concurrency());
  impl->nio = impl->opts.io_threads ? impl->opts.io_threads : std::min(hw, 8u);
  fabric::Fabric::ListenOptions lo;
  if (impl->opts.tls.mode != tls::Options::Mode::off) {
    BASE_ASSIGN_OR_RETURN(lo.tls, server::make_tls_context(impl->opts));
    lo.tls_required = impl->opts.tls.mode == tls::Options::Mode::required;
  }
  for (const Address& a : impl->opts.listen) {
    BASE_ASSIGN_OR_RETURN(auto* fab, core::shared_fabric(a.fabric, impl->opts.busy_poll));
    // TLS is the tcp fabric's: other listeners ignore it (rdma is not encrypted).
    BASE_ASSIGN_OR_RETURN(auto l, fab->listen(a, a.fabric == FabricKind::tcp ? lo : fabric::Fabric::ListenOptions{}));
    impl->listeners.push_back(std::move(l));
  }
  for (uint32_t i = 0; i < impl->nio; ++i) {
    BASE_ASSIGN_OR_RETURN(auto p, core::Poller::start("ibtrs-s-io" + std::to_string(i), i,
                                                       server::io_poll_mode(impl->opts)));
    impl->io_pollers.push_back(std::move(p));
  }
  BASE_ASSIGN_OR_RETURN(impl->svc_poller, core::Poller::start("ibtrs-s-svc", impl->nio, core::PollMode::block));
  for (uint32_t i = 0; i < impl->nio; ++i) {
    if (IoThreadHook* h = impl->opts.handler->io_thread_hook(i)) {
      core::Poller* p = impl->io_pollers[i].get();
      p->run_sync([p, h] { p->add_source(h); });
      impl->hooks.emplace_back(i, h);
    }
  }
  impl->worker = std::make_unique<base::Worker>();
  Impl* raw = impl.get();
  impl->acceptor = std::thread([raw] { raw->accept_loop(); });
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

std::vector<Address> Server::addresses() const {
  std::vector<Address> out;
  for (auto& l : impl_->listeners) out.push_back(l->address());
  return out;
}

AuthCounters Server::auth_counters() const {
  const auto& c = impl_->auth_count;
  constexpr auto r = std::memory_order_relaxed;
  AuthCounters a;
  a.authenticated = c.authenticated.load(r);
  a.anonymous = c.anonymous.load(r);
  a.refused_no_credentials = c.no_credentials.load(r);
  a.refused_unknown_host = c.unknown_host.load(r);
  a.refused_bad_response = c.bad_response.load(r);
  a.refused_host_mismatch = c.host_mismatch.load(r);
  a.refused_protocol = c.protocol.load(r);
  return a;
}

std::vector<std::string> Server::sessions() const {
  std::lock_guard lock(impl_->mu);
  std::vector<std::string> out;
  for (auto& [id, s] : impl_->sessions) {
    std::lock_guard sl(s->mu);
    if (!s->name_.empty()) out.push_back(s->name_);
  }
  return out;
}

Refusals& Server::refusals() const { return impl_->refusals; }

const ServerOptions& Server::options() const { return impl_->opts; }

std::vector<IoThreadWaitStats> Server::io_thread_stats() const {
  std::vector<IoThreadWaitStats> out;
  // The pollers live from start() to ~Server(): no lock needed to read them.
  for (auto& p : impl_->io_pollers) out.push_back(p->wait_stats());
  return out;
}

ServerUsage Server::usage() const {
  ServerUsage u;
  u.chunk_memory = impl_->chunk_memory.load();
  u.fences_answered = impl_->fences_answered.load(std::memory_order_relaxed);
  u.fences_closed = impl_->fences_closed.load(std::memory_order_relaxed);
  u.held_connects = impl_->held_count.load(std::memory_order_relaxed);
  std::lock_guard lock(impl_->mu);
  u.sessions = static_cast<uint32_t>(impl_->sessions.size());
  for (auto& [id, s] : impl_->sessions) {
    std::lock_guard sl(s->mu);
    bool connected = false;
    for (server::Path* p : s->live) {
      ++u.paths;
      connected |= p->state.get() == ServerPathState::connected;
      for (auto& c : p->cons) u.backlog += c->bl_size.load(std::memory_order_relaxed);
    }
    if (!connected) ++u.handshaking_sessions;
    u.chunk_resident += s->resident_chunk_bytes();
  }
  return u;
}

Status Server::with_session(std::string_view name,
                            const std::function<void(ServerSession&)>& fn) const {
  // On the worker, which alone frees sessions: `fn` may use control functions of the session.
  Impl* im = impl_.get();
  return im->worker->call([im, name, &fn]() -> Status {
    server::Session* found = nullptr;
    {
      std::lock_guard lock(im->mu);
      for (auto& [id, s] : im->sessions) {
        std::lock_guard sl(s->mu);
        if (s->name_ == name) found = s.get();
      }
    }
    if (found == nullptr) return errc(ENOENT);
    fn(*found);
    return {};
  });
}

}  // namespace ibtrs
