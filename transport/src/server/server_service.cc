// The service connection (worker; heartbeats on the service poller): INFO_REQ / INFO_RSP,
// authentication, PATH_FENCE, heartbeats and the handshake deadline.
#include <bit>
#include <cstring>
#include <string>

#include "base/log.h"
#include "core/heartbeat_wr.h"
#include "server/server_impl.h"

namespace ibtrs::server {

// Worker: every message of a path's service connection (the poller copied it out of its RECV
// slot once): INFO_REQ, then, on a path that authenticates, AUTH_REPLY.
void Impl::handle_info(Path* p, std::vector<std::byte> msg) {
  Session* s = p->s;
  auto type = proto::peek_msg_type(msg);
  if (p->auth.state == AuthState::failed) {
    close_path(p, "message after a refused authentication");
    return;
  }
  if (type.ok() && *type == proto::MsgType::auth_reply) return handle_auth_reply(p, msg);
  if (type.ok() && *type == proto::MsgType::path_fence) return handle_fence(p, msg);
  std::string why;
  auto info = proto::parse_info_req(msg, &why);
  if (!info.ok() || p->state.get() != ServerPathState::connecting || p->accepted != p->cid_num ||
      p->auth.info_seen) {
    protocol_error("session %s: INFO_REQ refused: %s", s->name_.c_str(),
                   info.ok() ? "path not ready (connections missing, already connected or INFO_REQ seen)"
                             : why.c_str());
    close_path(p, "bad INFO_REQ");
    return;
  }
  p->auth.info_seen = true;
  {
    std::lock_guard lock(s->mu);
    if (!s->name_.empty() && s->name_ != info->sessname) {
      // Two clients drew one session uuid (or one lies): joining them would cross their IO.
      protocol_error("session %s: path %s names session '%s': refused", s->name_.c_str(),
                     info->pathname.c_str(), info->sessname.c_str());
      why = "session uuid already used by another session name";
    } else {
      if (s->name_.empty()) s->name_ = info->sessname;
      p->name = info->pathname;
    }
  }
  if (!why.empty()) {
    close_path(p, why.c_str());
    return;
  }
  if (p->auth.wanted) return send_auth_challenge(p);
  // Anonymous (allow_any_host was checked at CON_REQ): only into a session of no host.
  if (!bind_host(p, "")) {
    auth_count.host_mismatch.fetch_add(1, std::memory_order_relaxed);
    BASE_LOG(warn, "session %s: anonymous path %s into a session of host %s: refused",
              s->name_.c_str(), p->name.c_str(), s->host_.c_str());
    close_path(p, "anonymous path of an authenticated session");
    return;
  }
  auth_count.anonymous.fetch_add(1, std::memory_order_relaxed);
  send_info_rsp(p);
}

// Worker: the session's host is `host` from now on, or it was already. False: another host's.
bool Impl::bind_host(Path* p, const std::string& host) {
  Session* s = p->s;
  std::lock_guard lock(s->mu);
  if (s->host_bound) return s->host_ == host;
  s->host_ = host;
  s->host_bound = true;
  return true;
}

// Worker: one AUTH_* message from send area `area` (0: challenge, 1: success / failure) of the
// service connection. Each area carries one message per path incarnation, so it is never
// rewritten while its send is in flight.
Status Impl::post_svc(Path* p, size_t at, std::span<const std::byte> msg, uint32_t tag) {
  Con* svc = p->cons[0].get();
  const size_t off = size_t{kSvcRecvs} * kSvcSlot + proto::info_rsp_size(p->s->qd) + at;
  if (!svc->conn || off + msg.size() > svc->svc_len) return errc(ENOTCONN);
  std::memcpy(svc->svc_buf.get() + off, msg.data(), msg.size());
  Sge sge = svc->svc_mr->sge(off, static_cast<uint32_t>(msg.size()));
  SendWr wr{};
  wr.wr_id = wr_id(kWrSvc, tag);
  wr.opcode = Opcode::send;
  wr.sg_list = std::span(&sge, 1);
  return svc->conn->post_send(std::span(&wr, 1));
}

void Impl::send_auth_challenge(Path* p) {
  PathAuth& a = p->auth;
  auto dh = auth::X25519::generate();
  uint8_t rnd[6];
  if (!dh.ok() || !auth::random_bytes(a.nonce).ok() || !auth::random_bytes(rnd).ok()) {
    close_path(p, "cannot draw an authentication challenge (OpenSSL)");
    return;
  }
  a.tid = static_cast<uint16_t>(rnd[0] | rnd[1] << 8);
  a.seq = uint32_t{rnd[2]} | uint32_t{rnd[3]} << 8 | uint32_t{rnd[4]} << 16 | uint32_t{rnd[5]} << 24;
  if (a.seq == 0) a.seq = 1;  // the wire's "no sequence number"
  a.dh = std::move(*dh);
  proto::AuthChallengeView v;
  v.tid = a.tid;
  v.seqnum = a.seq;
  v.nonce = a.nonce;
  v.dh_public = a.dh->public_key();
  auto m = proto::make_auth_challenge(v);
  if (!m.ok() || !post_svc(p, 0, proto::as_bytes_of(*m)).ok()) close_path(p, "cannot send AUTH_CHALLENGE");
}

void Impl::handle_auth_reply(Path* p, std::span<const std::byte> msg) {
  Session* s = p->s;
  PathAuth& a = p->auth;
  if (!a.wanted || a.state != AuthState::pending || !a.dh)
    return auth_failed(p, EPROTO, auth_count.protocol, "AUTH_REPLY without a challenge");
  std::string why;
  auto r = proto::parse_auth_reply(msg, &why);
  if (!r.ok()) return auth_failed(p, EPROTO, auth_count.protocol, why);
  // A reply to another challenge: a recorded exchange played back (its response would not fit
  // this challenge either).
  if (r->tid != a.tid)
    return auth_failed(p, EACCES, auth_count.bad_response, "AUTH_REPLY of another transaction (replayed?)");
  auto z = a.dh->derive(r->dh_public);
  a.dh.reset();  // one reply per challenge
  if (!z.ok()) return auth_failed(p, EPROTO, auth_count.protocol, "unusable X25519 public value");
  const std::string& host = r->host;
  std::optional<HostKeys> keys;
  if (opts.authenticator != nullptr) keys = opts.authenticator->host_keys(host);
  if (!keys) return auth_failed(p, EACCES, auth_count.unknown_host, "unknown host " + host);
  auth::Transcript t;
  t.tid = a.tid;
  std::memcpy(t.sess_uuid.data(), s->uuid_bytes.data(), 16);
  std::memcpy(t.path_uuid.data(), p->uuid.data(), 16);
  {
    std::lock_guard lock(s->mu);
    t.sessname = s->name_;
    t.pathname = p->name;
  }
  t.host = host;
  bool match = false;
  for (const Secret& k : keys->keys) {
    auto want = auth::response(auth::Role::host, k, *z, a.nonce, a.seq, t);
    if (want.ok() && auth::equal_ct(*want, r->response)) match = true;  // no early exit
  }
  auth::cleanse(a.nonce);
  if (!match) return auth_failed(p, EACCES, auth_count.bad_response, "host " + host + ": wrong key");
  if (r->bidirectional && !keys->server_key)
    return auth_failed(p, EACCES, auth_count.protocol,
                       "host " + host + " asks the server to authenticate, but it has no server key");
  if (!bind_host(p, host))
    return auth_failed(p, EACCES, auth_count.host_mismatch,
                       "host " + host + ": the session belongs to host " + s->host_);
  // A TLS PSK is a host's key too: the path must prove the same host in both. (With
  // certificates the identity is a subject, which names no host of ours.)
  const bool psk_mode = opts.tls.cert_file.empty();
  if (const std::string tls_host = psk_mode ? tls_psk_host(p->tls_identity.value_or("")) : std::string();
      !tls_host.empty() && tls_host != host)
    return auth_failed(p, EACCES, auth_count.host_mismatch,
                       "host " + host + ": its TLS PSK is host " + tls_host + "'s");
  proto::AuthSuccessView ok;
  ok.tid = a.tid;
  if (r->bidirectional) {
    auto r2 = auth::response(auth::Role::server, *keys->server_key, *z, r->challenge2, r->seqnum2, t);
    if (!r2.ok()) return auth_failed(p, EPROTO, auth_count.protocol, "cannot compute the server's response");
    ok.has_response = true;
    ok.response = *r2;
  }
  {
    std::lock_guard lock(s->mu);
    a.state = AuthState::authenticated;
    a.host = host;
    a.bidirectional = r->bidirectional;
  }
  auth_count.authenticated.fetch_add(1, std::memory_order_relaxed);
  BASE_LOG(info, "session %s: path %s authenticated as %s%s", s->name_.c_str(), p->name.c_str(),
            host.c_str(), r->bidirectional ? " (bidirectional)" : "");
  // AUTH_SUCCESS and INFO_RSP leave in this order on one connection.
  if (!post_svc(p, kSvcSlot, proto::as_bytes_of(proto::make_auth_success(ok))).ok()) {
    close_path(p, "cannot send AUTH_SUCCESS");
    return;
  }
  send_info_rsp(p);
}

// Worker: tells the client why (AUTH_FAILURE) and closes the path once the client hung up, or
// after kAuthFailLinger. Nothing of the session was revealed: the chunks' keys go with INFO_RSP.
void Impl::auth_failed(Path* p, int reason, std::atomic<uint64_t>& counter, const std::string& why) {
  Session* s = p->s;
  counter.fetch_add(1, std::memory_order_relaxed);
  const std::string_view name = &counter == &auth_count.unknown_host   ? refusal::kAuthUnknownHost
                                : &counter == &auth_count.bad_response  ? refusal::kAuthBadResponse
                                : &counter == &auth_count.host_mismatch ? refusal::kAuthHostMismatch
                                                                        : refusal::kAuthProtocol;
  refusals.refuse(name, "session " + s->name_ + " path " + p->name + " from " + p->peer.to_string() +
                            ": authentication refused: " + why);
  {
    std::lock_guard lock(s->mu);
    p->auth.state = AuthState::failed;
  }
  p->auth.dh.reset();
  if (!post_svc(p, kSvcSlot, proto::as_bytes_of(proto::make_auth_failure(p->auth.tid, reason))).ok()) {
    close_path(p, "authentication refused");
    return;
  }
  const uint64_t id = p->id;
  p->hb_timer.store(svc_poller->add_timer(core::Clock::now() + kAuthFailLinger, [this, id] {
    worker->post([this, id] {
      if (Path* pp = lookup(id)) close_path(pp, "authentication refused");
    });
  }));
}

// Worker: PATH_FENCE on path p's service connection (docs/protocol.md, "Failover fence"). The
// named path is looked up in p's own session only: a client reaches no other session's paths.
// close_path returns only once the fenced connections' pollers are between batches and their
// CQs detached, so when the answer leaves nothing of that incarnation can start any more.
void Impl::handle_fence(Path* p, std::span<const std::byte> msg) {
  Session* s = p->s;
  std::string why;
  auto f = proto::parse_path_fence(msg, &why);
  if (f.ok() && !s->fence) why = "PATH_FENCE without kConRspFence";
  if (f.ok() && p->state.get() != ServerPathState::connected) why = "PATH_FENCE on a path not connected";
  if (f.ok() && f->path_uuid == p->uuid) why = "PATH_FENCE names the path it came on";
  if (!why.empty()) {
    protocol_error("session %s path %s: %s", s->name_.c_str(), p->name.c_str(), why.c_str());
    close_path(p, "bad PATH_FENCE");
    return;
  }
  Path* target = nullptr;
  {
    std::lock_guard lock(s->mu);
    for (Path* q : s->live)
      if (q->uuid == f->path_uuid) target = q;
  }
  uint16_t status = proto::kFenceNotLive;
  if (target == nullptr) {
    BASE_LOG(info, "session %s: fence of incarnation %u of a path not live here (asked over %s)",
              s->name_.c_str(), f->recon_cnt, p->name.c_str());
  } else if (static_cast<int16_t>(target->recon_cnt - f->recon_cnt) > 0) {
    // A newer incarnation is live: accepting it closed the named one (handle_connect).
    BASE_LOG(info, "session %s: fence of path %s incarnation %u: superseded by %u (asked over %s)",
              s->name_.c_str(), target->name.c_str(), f->recon_cnt, target->recon_cnt,
              p->name.c_str());
  } else {
    const std::string reason = "fenced by the client over path " + p->name + " (incarnation " +
                               std::to_string(target->recon_cnt) + ")";
    close_path(target, reason.c_str());
    status = proto::kFenceClosed;
    fences_closed.fetch_add(1, std::memory_order_relaxed);
  }
  Con* svc = p->cons[0].get();
  if (!svc->conn) return;  // p closed meanwhile: its client asks again elsewhere
  uint32_t busy = svc->fence_busy.load(std::memory_order_acquire);
  uint32_t slot = kFenceSlots;
  for (;;) {
    slot = static_cast<uint32_t>(std::countr_one(busy));
    if (slot >= kFenceSlots) break;
    if (svc->fence_busy.compare_exchange_weak(busy, busy | (1u << slot), std::memory_order_acq_rel)) break;
  }
  if (slot >= kFenceSlots) {
    protocol_error("session %s path %s: %u FENCE_RSP unacknowledged", s->name_.c_str(),
                   p->name.c_str(), kFenceSlots);
    close_path(p, "too many PATH_FENCE");
    return;
  }
  const auto rsp = proto::make_fence_rsp(status, f->path_uuid, f->recon_cnt);
  if (!post_svc(p, 2 * size_t{kSvcSlot} + size_t{slot} * sizeof(rsp), proto::as_bytes_of(rsp), slot + 1).ok()) {
    svc->fence_busy.fetch_and(~(1u << slot), std::memory_order_acq_rel);
    close_path(p, "cannot send FENCE_RSP");
    return;
  }
  fences_answered.fetch_add(1, std::memory_order_relaxed);
}

// Worker: the path is admitted: the chunks' keys go to the client and the path carries IO.
void Impl::send_info_rsp(Path* p) {
  Session* s = p->s;
  Con* svc = p->cons[0].get();
  const size_t off = size_t{kSvcRecvs} * kSvcSlot;
  proto::InfoRspHeader h{};
  h.type.set(static_cast<uint16_t>(proto::MsgType::info_rsp));
  h.sg_cnt.set(s->qd);
  std::byte* out = svc->svc_buf.get() + off;
  std::memcpy(out, &h, sizeof(h));
  for (uint32_t i = 0; i < s->qd; ++i) {
    proto::ChunkDesc d{};
    d.addr.set(reinterpret_cast<uint64_t>(s->chunk(i).data()));
    d.key.set(s->invalidate ? p->chunk_mrs[i]->rkey() : p->chunk_rkey);
    d.len.set(s->chunk_size);
    std::memcpy(out + sizeof(h) + i * sizeof(d), &d, sizeof(d));
  }
  // The upper layer learns of the session before any request of it can arrive (it sets its
  // context there), and after its host is known.
  if (!s->up) {
    s->up = true;
    opts.handler->on_session_up(*s);
  }
  // Open for IO before the client can learn the chunks: its first request may follow at once.
  for (auto& c : p->cons) c->gate.open();
  if (!p->state.change_from(ServerPathState::connecting, ServerPathState::connected).ok()) return;
  if (uint64_t t = p->hs_timer.exchange(0)) svc_poller->cancel_timer(t);
  Sge sge = svc->svc_mr->sge(off, static_cast<uint32_t>(proto::info_rsp_size(s->qd)));
  SendWr wr{};
  wr.wr_id = wr_id(kWrSvc);
  wr.opcode = Opcode::send;
  wr.sg_list = std::span(&sge, 1);
  if (!svc->conn->post_send(std::span(&wr, 1)).ok()) {
    close_path(p, "cannot send INFO_RSP");
    return;
  }
  BASE_LOG(info, "session %s: path %s connected", s->name_.c_str(), p->name.c_str());
  p->announced = true;
  opts.handler->on_path_up(*s, p->info());
  p->hb_timer.store(svc_poller->add_timer(core::Clock::now() + opts.heartbeat.interval,
                                          [this, p] { heartbeat_tick(p); }));
}

// Service poller.
void Impl::heartbeat_tick(Path* p) {
  if (p->state.get() != ServerPathState::connected) return;
  if (p->hb.on_timer(core::Clock::now()) == core::Heartbeat::Action::peer_dead) {
    const uint64_t id = p->id;
    worker->post([this, id] {
      if (Path* pp = lookup(id)) close_path(pp, "heartbeats missed");
    });
    return;
  }
  Con* svc = p->cons[0].get();
  if (svc->gate.enter()) {
    (void)core::post_heartbeat(*svc->conn, proto::ImmType::hb_msg, wr_id(kWrSvc));
    svc->gate.exit();
  }
  p->hb_timer.store(svc_poller->add_timer(core::Clock::now() + opts.heartbeat.interval,
                                          [this, p] { heartbeat_tick(p); }));
}

void Impl::handshake_expired(Path* p) {
  if (p->state.get() != ServerPathState::connecting) return;
  refusals.refuse(refusal::kHandshakeTimeout,
                  "path from " + p->peer.to_string() + ": " + std::to_string(p->accepted) + " of " +
                      std::to_string(p->cid_num) + " connections and no INFO exchange after " +
                      std::to_string(opts.handshake_timeout.count()) + " ms");
  close_path(p, "handshake not finished in time");
}

}  // namespace ibtrs::server
