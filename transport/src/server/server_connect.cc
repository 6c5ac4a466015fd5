// Establishment (worker): connection requests (refused, held behind a draining predecessor, or
// accepted into a session and path), sessions made and evicted; and the listeners' accept thread
// that hands the requests to the worker.
#include <poll.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <string>

#include "base/log.h"
#include "server/server_impl.h"

namespace ibtrs::server {

using namespace std::chrono_literals;

void Impl::reject(fabric::ConnectRequest& req, int err, std::string_view reason,
                  const std::string& why) {
  refusals.refuse(reason, "connection from " + req.peer_address().to_string() + ": " + why +
                              " (" + std::strerror(err) + ")");
  answer_refused(req, err);
}

void Impl::answer_refused(fabric::ConnectRequest& req, int err) {
  auto rsp = proto::make_con_rsp(err, 0, 0, 0, 0);
  (void)req.reject(proto::as_bytes_of(rsp));
}

void Impl::protocol_error(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  refusals.refuse(refusal::kProtocolError, buf);
}

bool Impl::evict_half_open(const char* why) {
  Session* oldest = nullptr;
  {
    std::lock_guard lock(mu);
    for (auto& [id, s] : sessions) {
      if (s->up || s->dying) continue;
      if (oldest == nullptr || s->created < oldest->created) oldest = s.get();
    }
  }
  if (oldest == nullptr) return false;
  std::vector<Path*> paths;
  std::string peer;
  {
    std::lock_guard lock(oldest->mu);
    paths = oldest->live;
  }
  if (!paths.empty()) peer = paths.front()->peer.to_string();
  refusals.refuse(refusal::kHandshakeEvicted,
                  "half-open session from " + peer + " closed to make room: " + why);
  // Its last path takes it to the reaper, which frees it at once: it never had a request.
  if (paths.empty()) detach_session_if_empty(oldest);
  for (Path* p : paths) close_path(p, "evicted while handshaking");
  return true;
}

Result<Session*> Impl::session_for(const proto::ConReq& cr, std::string_view* reason) {
  proto::Uuid id;
  std::memcpy(id.data(), cr.sess_uuid, 16);
  {
    std::lock_guard lock(mu);
    auto it = sessions.find(id);
    if (it != sessions.end()) return it->second.get();
  }
  const size_t chunk_bytes = size_t{opts.queue_depth} * opts.chunk_size;
  // Room for it, first at the expense of sessions that never completed a handshake: a peer
  // that holds sessions half-open cannot keep an honest client out, it only pushes out its
  // own oldest.
  for (;;) {
    size_t n;
    {
      std::lock_guard lock(mu);
      n = sessions.size();
    }
    const bool too_many = n >= opts.max_sessions;
    const bool too_big = chunk_memory.load() + chunk_bytes > opts.max_chunk_memory;
    if (!too_many && !too_big) break;
    if (evict_half_open(too_many ? "session limit reached" : "chunk memory limit reached")) continue;
    *reason = too_many ? refusal::kSessionLimit : refusal::kChunkMemoryLimit;
    return errc(too_many ? EUSERS : ENOMEM);
  }
  *reason = refusal::kChunkMemoryLimit;
  auto s = std::make_unique<Session>();
  s->created = core::Clock::now();
  s->srv = this;
  s->uuid_bytes = id;
  std::memcpy(s->uuid_.bytes, cr.sess_uuid, 16);
  s->qd = opts.queue_depth;
  s->chunk_size = opts.chunk_size;
  s->max_hdr = opts.max_hdr_size;
  BASE_ASSIGN_OR_RETURN(s->layout, proto::imm_layout(s->qd, s->chunk_size));
  s->invalidate = opts.always_invalidate;
  // Chunk sets for a client that knows them (a 2.1 client refuses the CON_RSP flag), and only
  // with one key over all chunks.
  s->max_io = s->chunk_size - s->max_hdr;
  if (opts.max_io_size > s->max_io && !s->invalidate &&
      proto::version_minor(cr.version.get()) >= proto::kMinorChunkSets) {
    s->max_io = opts.max_io_size;
    s->sets = true;
  }
  s->fence = opts.path_fence && proto::version_minor(cr.version.get()) >= proto::kMinorFence;
  s->chunks_len = chunk_bytes;
  if (s->invalidate) s->chunks_len += (sizeof(proto::RkeyRsp) * s->qd + 4095) & ~size_t{4095};
  // Lazily backed: a session costs only what its requests touch.
  void* m = ::mmap(nullptr, s->chunks_len, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return errc(ENOMEM);
  s->chunks = static_cast<std::byte*>(m);
  if (s->invalidate) s->rkey_msgs = reinterpret_cast<proto::RkeyRsp*>(s->chunks + chunk_bytes);
  // Never registered: no peer can write the copies. Lazily backed like the chunks.
  s->copies_len = size_t{s->qd} * s->max_hdr;
  void* cm = ::mmap(nullptr, s->copies_len, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (cm == MAP_FAILED) return errc(ENOMEM);
  s->copies = static_cast<std::byte*>(cm);
  s->reqs = std::make_unique<Req[]>(s->qd);
  for (uint32_t i = 0; i < s->qd; ++i) {
    s->reqs[i].s = s.get();
    s->reqs[i].chunk_id_ = i;
    s->reqs[i].session_ = s.get();
    s->reqs[i].copy = {s->copies + size_t{i} * s->max_hdr, s->max_hdr};
  }
  chunk_memory.fetch_add(chunk_bytes);
  Session* raw = s.get();
  std::lock_guard lock(mu);
  sessions.emplace(id, std::move(s));
  return raw;
}

void Impl::handle_connect(std::unique_ptr<fabric::ConnectRequest> owned) {
  fabric::ConnectRequest& req = *owned;
  std::string why;
  auto cr = proto::parse_con_req(req.private_data(), &why);
  if (!cr.ok()) return reject(req, cr.error().value(), refusal::kBadConnectRequest, why);
  const uint16_t cid = cr->cid.get();
  const uint16_t cid_num = cr->cid_num.get();
  if (cid_num > kMaxCidNum)
    return reject(req, EINVAL, refusal::kBadConnectRequest, "too many connections per path");
  const bool auth_wanted = (cr->flags.get() & proto::kConReqAuth) != 0;
  if (!auth_wanted && !opts.allow_any_host) {
    // Before any session exists: a client without credentials costs nothing here.
    auth_count.no_credentials.fetch_add(1, std::memory_order_relaxed);
    return reject(req, EACCES, refusal::kAuthNoCredentials,
                  "the client does not authenticate and allow_any_host is off");
  }
  proto::Uuid sess_id;
  std::memcpy(sess_id.data(), cr->sess_uuid, 16);
  // A new session under the uuid of one that still drains would let the client's resent and
  // newer writes run while old copies are with the upper layer: they wait for it to drain.
  if (Session* pred = draining(sess_id)) return hold(std::move(owned), sess_id, pred);
  std::string_view reason;
  auto sr = session_for(*cr, &reason);
  if (!sr.ok()) return reject(req, sr.error().value(), reason, "no room for a new session");
  Session* s = *sr;

  Path* p = nullptr;
  {
    std::lock_guard lock(s->mu);
    for (Path* q : s->live)
      if (std::memcmp(q->uuid.data(), cr->path_uuid, 16) == 0) p = q;
  }
  const uint16_t rc = cr->recon_cnt.get();
  if (p != nullptr) {
    // Reconnect counters tell a new incarnation of the path from a stale one.
    if (static_cast<int16_t>(rc - p->recon_cnt) > 0) {
      close_path(p, "the client reconnected it");
      p = nullptr;
      // That may have been the session's last path: then the new incarnation starts a new one,
      // once the old session drained.
      if (Session* pred = draining(sess_id)) return hold(std::move(owned), sess_id, pred);
      sr = session_for(*cr, &reason);
      if (!sr.ok()) return reject(req, sr.error().value(), reason, "no room for a new session");
      s = *sr;
    } else if (rc != p->recon_cnt) {
      return reject(req, ESTALE, refusal::kBadConnectRequest,
                    "connection of an older incarnation of the path");
    } else if (p->state.get() != ServerPathState::connecting || p->cid_num != cid_num ||
               p->cons[cid]->conn != nullptr) {
      return reject(req, EEXIST, refusal::kBadConnectRequest, "connection already established");
    } else if (p->auth.wanted != auth_wanted) {
      return reject(req, EINVAL, refusal::kBadConnectRequest,
                    "connections of one path disagree on authentication");
    }
  }
  if (p == nullptr) {
    size_t paths;
    {
      std::lock_guard lock(s->mu);
      paths = s->live.size();
    }
    if (paths >= opts.max_paths_per_session)
      return reject(req, EMLINK, refusal::kPathLimit,
                    "session already has " + std::to_string(paths) + " paths");
    auto np = std::make_unique<Path>(s, opts.heartbeat, nio + 1);
    np->recon_cnt = rc;
    np->cid_num = cid_num;
    np->auth.wanted = auth_wanted;
    np->auth.state = auth_wanted ? AuthState::pending : AuthState::none;
    std::memcpy(np->uuid.data(), cr->path_uuid, 16);
    np->local = req.local_address();
    np->peer = req.peer_address();
    for (uint16_t i = 0; i < cid_num; ++i) {
      auto c = std::make_unique<Con>();
      c->path = np.get();
      c->cid = i;
      c->poller = i == 0 ? svc_poller.get() : io_pollers[(i - 1) % nio].get();
      np->cons.push_back(std::move(c));
    }
    p = np.get();
    p->id = next_path_id++;
    path_ids.emplace(p->id, p);
    {
      std::lock_guard lock(s->mu);
      s->all.push_back(std::move(np));
      s->live.push_back(p);
    }
    const uint64_t id = p->id;
    p->hs_timer.store(svc_poller->add_timer(core::Clock::now() + opts.handshake_timeout, [this, id] {
      worker->post([this, id] {
        if (Path* pp = lookup(id)) handshake_expired(pp);
      });
    }));
  }
  auto st = accept_con(s, p, *cr, req);
  if (!st.ok()) {
    BASE_LOG(warn, "session %s: accepting connection %u failed: %s", s->name_.c_str(), cid,
              st.error().message().c_str());
    close_path(p, "accept failed");
  }
}

Status Impl::accept_con(Session* s, Path* p, const proto::ConReq& cr, fabric::ConnectRequest& req) {
  const uint16_t cid = cr.cid.get();
  fabric::Domain& dev = req.domain();
  if (p->device != nullptr && p->device != &dev) {
    reject(req, EINVAL, refusal::kBadConnectRequest, "connections of one path on different devices");
    return errc(EINVAL);
  }
  p->device = &dev;
  // Every connection of a path carries the same TLS identity (none, or the same host's PSK or
  // certificate): the service connection's authentication then speaks for all of them.
  const std::string tls_id = req.tls_identity();
  if (p->tls_identity && *p->tls_identity != tls_id) {
    reject(req, EACCES, refusal::kAuthHostMismatch, "connections of one path with different TLS identities");
    return errc(EACCES);
  }
  p->tls_identity = tls_id;
  auto pd_it = s->pds.find(&dev);
  if (pd_it == s->pds.end()) {
    auto pd = dev.alloc_pd(fabric::PdAttr{opts.session_max_keys});
    if (!pd.ok()) {
      reject(req, ENOMEM, refusal::kNoResources, "cannot allocate the session's protection domain");
      return pd.error();
    }
    pd_it = s->pds.emplace(&dev, std::move(*pd)).first;
  }
  fabric::Domain& d = *pd_it->second;
  p->domain = &d;
  auto it = s->mrs.find(&dev);
  if (it == s->mrs.end()) {
    // With always_invalidate the session-wide region is only the server's own (local) view.
    const uint32_t access = fabric::kLocalWrite | (s->invalidate ? 0u : uint32_t{fabric::kRemoteWrite});
    auto mr = d.register_memory(s->chunks, s->chunks_len, access);
    if (!mr.ok()) {
      reject(req, ENOMEM, refusal::kNoResources, "cannot register the session's chunks");
      return mr.error();
    }
    it = s->mrs.emplace(&dev, std::move(*mr)).first;
  }
  p->chunk_lkey = it->second->lkey();
  p->chunk_rkey = it->second->rkey();
  if (s->invalidate && p->chunk_mrs.empty()) {
    p->chunk_mrs.resize(s->qd);
    for (uint32_t i = 0; i < s->qd; ++i) {
      auto mr = d.register_memory(s->chunk(i).data(), s->chunk_size,
                                  fabric::kLocalWrite | fabric::kRemoteWrite);
      if (!mr.ok()) {
        p->chunk_mrs.clear();
        reject(req, ENOMEM, refusal::kNoResources, "cannot register the session's chunks one by one");
        return mr.error();
      }
      p->chunk_mrs[i] = std::move(*mr);
    }
  }

  Con* c = p->cons[cid].get();
  fabric::QueueCaps caps;
  if (cid == 0) {
    caps.max_send_wr = kSvcSends;
    caps.max_recv_wr = kSvcRecvs;
    caps.max_send_sge = 1;
    caps.max_recv_sge = 1;
  } else {
    caps.max_send_wr = (s->invalidate ? 3u : 2u) * s->qd + kSignalEvery + 16;
    caps.max_recv_wr = s->qd + kRepostBatch + 16;
    caps.max_send_sge = 1;
    caps.max_recv_sge = 1;
  }
  auto cq = dev.create_cq(caps.max_send_wr + caps.max_recv_wr);
  if (!cq.ok()) {
    reject(req, ENOMEM, refusal::kNoResources, "cannot create a completion queue");
    return cq.error();
  }
  c->cq = std::move(*cq);
  c->poller->run_sync([c] { c->poller->attach(c->cq.get(), c); });
  if (cid == 0) {
    // RECV slots, INFO_RSP, two send areas for the AUTH_* messages, the FENCE_RSP slots.
    c->svc_len = size_t{kSvcRecvs} * kSvcSlot + proto::info_rsp_size(s->qd) + 2 * size_t{kSvcSlot} +
                 kFenceSlots * sizeof(proto::FenceRsp);
    c->svc_buf = std::make_unique<std::byte[]>(c->svc_len);
    auto mr = d.register_memory(c->svc_buf.get(), c->svc_len, fabric::kLocalWrite);
    if (!mr.ok()) {
      reject(req, ENOMEM, refusal::kNoResources, "cannot register service buffers");
      return mr.error();
    }
    c->svc_mr = std::move(*mr);
  }
  fabric::ConnectionEvents ev;
  ev.on_disconnected = [c](std::error_code) { c->failed.store(true, std::memory_order_release); };
  auto rsp = proto::make_con_rsp(0, s->qd, s->chunk_size, s->max_hdr,
                                 (s->invalidate ? proto::kConRspInvalidatePerIo : 0) |
                                     (s->sets ? proto::kConRspChunkSets : 0) |
                                     (s->fence ? proto::kConRspFence : 0),
                                 s->max_io);
  BASE_ASSIGN_OR_RETURN(c->conn,
                         req.accept(d, *c->cq, caps, proto::as_bytes_of(rsp), std::move(ev)));
  std::vector<fabric::RecvWr> rw(caps.max_recv_wr);
  std::vector<Sge> sg(caps.max_recv_wr);
  for (uint32_t i = 0; i < caps.max_recv_wr; ++i) {
    if (cid == 0) {
      sg[i] = c->svc_mr->sge(size_t{i} * kSvcSlot, kSvcSlot);
      rw[i] = fabric::RecvWr{wr_id(kWrSvcRecv, i), std::span(&sg[i], 1)};
    } else {
      rw[i] = fabric::RecvWr{wr_id(kWrRecv), {}};
    }
  }
  BASE_TRY(c->conn->post_recv(rw));
  ++p->accepted;
  return {};
}

Session* Impl::draining(const proto::Uuid& id) const {
  if (opts.drain_hold.count() <= 0) return nullptr;
  for (const auto& s : dying)
    if (s->uuid_bytes == id) return s.get();
  return nullptr;
}

void Impl::hold(std::unique_ptr<fabric::ConnectRequest> req, const proto::Uuid& id, Session* pred) {
  const int64_t inflight = pred->inflight.load(std::memory_order_acquire) & ~Session::kDetached;
  const std::string what = "session " + pred->name_ + " is still draining (" + std::to_string(inflight) +
                           " requests with the upper layer)";
  // Each held request keeps its peer's socket or CM id: as many as there may be sessions,
  // and as many per uuid as a session may have paths.
  const size_t same = static_cast<size_t>(
      std::count_if(held.begin(), held.end(), [&](const HeldConnect& h) { return h.sess == id; }));
  if (held.size() >= opts.max_sessions || same >= opts.max_paths_per_session)
    return reject(*req, EAGAIN, refusal::kDrainHoldLimit,
                  what + "; " + std::to_string(same) + " requests of it and " +
                      std::to_string(held.size()) + " in all held already");
  if (!std::exchange(pred->hold_logged, true))
    BASE_LOG(info, "connection from %s held: %s", req->peer_address().to_string().c_str(), what.c_str());
  held.push_back(HeldConnect{std::move(req), id, core::Clock::now() + opts.drain_hold});
  held_count.store(static_cast<uint32_t>(held.size()), std::memory_order_relaxed);
  arm_held_timer();
}

void Impl::run_held() {
  const auto now = core::Clock::now();
  std::vector<std::unique_ptr<fabric::ConnectRequest>> go;
  for (auto it = held.begin(); it != held.end();) {
    if (stopping.load()) {
      answer_refused(*it->req, EAGAIN);  // not counted: the server goes, not the peer's fault
    } else if (draining(it->sess) == nullptr) {
      go.push_back(std::move(it->req));
    } else if (now >= it->deadline) {
      reject(*it->req, EAGAIN, refusal::kDrainHoldTimeout,
             "the session it would replace still drains after " +
                 std::to_string(opts.drain_hold.count()) + " ms");
    } else {
      ++it;
      continue;
    }
    it = held.erase(it);
  }
  held_count.store(static_cast<uint32_t>(held.size()), std::memory_order_relaxed);
  // In arrival order; each may hold again (a reconnect that closes its session's last path).
  for (auto& r : go) handle_connect(std::move(r));
  arm_held_timer();
}

void Impl::arm_held_timer() {
  if (held.empty()) {
    if (held_timer != 0) svc_poller->cancel_timer(std::exchange(held_timer, 0));
    held_timer_at = {};
    return;
  }
  // Every hold lasts drain_hold from its arrival and `held` is in arrival order: the front's
  // deadline is the first.
  const core::Clock::time_point first = held.front().deadline;
  if (held_timer != 0 && held_timer_at <= first) return;  // due before the first deadline anyway
  if (held_timer != 0) svc_poller->cancel_timer(held_timer);
  held_timer_at = first;
  held_timer = svc_poller->add_timer(first, [this, first] {
    worker->post([this, first] {
      if (held_timer_at == first) {
        held_timer = 0;
        held_timer_at = {};
      }
      run_held();
    });
  });
}

void Impl::count_listener_drops(size_t i) {
  const fabric::Listener::Drops now = listeners[i]->drops();
  fabric::Listener::Drops& seen = drops_seen[i];
  const std::string where = "listener " + listeners[i]->address().to_string() + ": ";
  refusals.refuse(refusal::kListenTimeout,
                  where + "sockets dropped without a connection request within " +
                      std::to_string(fabric::Listener::kHandshakeTimeout.count()) + " ms",
                  now.timed_out - seen.timed_out);
  refusals.refuse(refusal::kListenOverflow,
                  where + "oldest pending sockets dropped for newer ones (listen backlog full)",
                  now.overflow - seen.overflow);
  refusals.refuse(refusal::kListenInvalid,
                  where + "sockets dropped for a malformed or unfinished connection request",
                  now.invalid - seen.invalid);
  refusals.refuse(refusal::kListenPlaintext, where + "peers without TLS refused (TLS required)",
                  now.plaintext - seen.plaintext);
  refusals.refuse(refusal::kListenTlsFailed,
                  where + "TLS handshakes failed (credentials refused, or not TLS 1.3)",
                  now.tls_failed - seen.tls_failed);
  seen = now;
}

void Impl::accept_loop() {
  std::vector<pollfd> fds;
  for (auto& l : listeners) fds.push_back(pollfd{l->fd(), POLLIN, 0});
  drops_seen.assign(listeners.size(), {});
  while (!stopping.load()) {
    int k = ::poll(fds.data(), fds.size(), 100);
    if (k <= 0) continue;
    for (size_t i = 0; i < fds.size(); ++i) {
      if ((fds[i].revents & POLLIN) == 0) continue;
      auto r = listeners[i]->get_request(0ms);
      count_listener_drops(i);
      if (!r.ok()) {
        if (r.error() != errc(ETIMEDOUT))
          refusals.refuse(refusal::kListenError, "listener " + listeners[i]->address().to_string() +
                                                     ": " + r.error().message());
        continue;
      }
      // The worker owns the request from here: it may hold it unanswered (handle_connect).
      worker->call([this, &r] {
        handle_connect(std::move(*r));
        return 0;
      });
    }
  }
}

}  // namespace ibtrs::server
