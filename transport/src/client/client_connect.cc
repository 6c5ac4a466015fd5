// A path's establishment (kernel: init_conns, create_con, create_cm, rtrs_send_path_info of
// rtrs-clt.c; siw_cm.c), on the worker: the connections and the geometry their
// CON_RSP gives, the INFO_REQ / INFO_RSP handshake with the authentication between them, and
// the teardown of an incarnation. Structure in client_impl.h; wire in proto/ibtrs_proto.h.
#include <sys/mman.h>

#include <cstring>

#include "auth/chap.h"
#include "client/client_impl.h"
#include "base/log.h"
#include "core/fabrics.h"

namespace ibtrs {

using fabric::Opcode;
using fabric::SendWr;
using fabric::Sge;

namespace client {

Status Session::set_geometry(const proto::ConRsp& rsp) {
  const uint16_t qd = rsp.queue_depth.get();
  const uint32_t chunk = rsp.chunk_size.get();
  const uint32_t hdr = rsp.max_hdr_size.get();
  if (geo_set.load(std::memory_order_acquire)) {
    // Every path of a session talks to the same server session: same chunks.
    if (qd != geo.queue_depth || chunk != geo.chunk_size || hdr != geo.max_hdr_size ||
        rsp.flags.get() != geo.flags) {
      BASE_LOG(warn, "session %s: server geometry changed (queue depth %u, chunk %u)",
                opts.session_name.c_str(), qd, chunk);
      return errc(EPROTO);
    }
    return {};
  }
  BASE_ASSIGN_OR_RETURN(auto layout, proto::imm_layout(qd, chunk));
  BASE_ASSIGN_OR_RETURN(permits, core::PermitPool::create(qd));
  geo.queue_depth = qd;
  geo.chunk_size = chunk;
  geo.max_hdr_size = hdr;
  geo.max_io_size = rsp.max_io_size.get();
  geo.flags = rsp.flags.get();
  geo.layout = layout;
  reqs = std::make_unique<Req[]>(qd);
  iu_len = (size_t{qd} * hdr + 4095) & ~size_t{4095};
  void* m = ::mmap(nullptr, iu_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return errc(ENOMEM);
  iu = static_cast<std::byte*>(m);
  geo_set.store(true, std::memory_order_release);
  return {};
}

Status Session::connect_con(Path* path, Con* con, std::span<const std::byte> pd) {
  fabric::QueueCaps caps;
  if (con->cid == 0) {
    caps.max_send_wr = kSvcSends;
    caps.max_recv_wr = kSvcRecvs;
    caps.max_send_sge = 1;
    caps.max_recv_sge = 1;
  } else {
    caps.max_send_wr = geo.queue_depth + kSignalEvery + 16;
    // Where a window bind and a LOCAL_INV take a send-queue slot (rdma), every permit may hold
    // a bind and a LOCAL_INV per segment besides its request.
    const uint32_t mw_slots = use_windows[path->dom] ? path->domain->mw_send_slots() : 0;
    caps.max_send_wr += mw_slots * 2u * ClientSession::kMaxSegments * geo.queue_depth;
    // With per-IO invalidation a response is two messages (RKEY_RSP, then IO_RSP_W_INV).
    const bool inv = (geo.flags & proto::kConRspInvalidatePerIo) != 0;
    caps.max_recv_wr = geo.queue_depth * (inv ? 2u : 1u) + kRepostBatch + 16;
    caps.max_send_sge = ClientSession::kMaxSegments + 1;
    caps.max_recv_sge = 1;
  }
  BASE_ASSIGN_OR_RETURN(con->cq, path->domain->create_cq(caps.max_send_wr + caps.max_recv_wr));
  con->failed.store(false);
  con->down = false;
  con->recv_missing = 0;
  con->recv_depth = caps.max_recv_wr;
  Con* c = con;
  con->poller->run_sync([c] { c->poller->attach(c->cq.get(), c); });

  fabric::ConnectParams params;
  params.remote = path->spec.destination;
  params.source = path->spec.source ? &*path->spec.source : nullptr;
  params.cq = con->cq.get();
  params.caps = caps;
  params.private_data = pd;
  params.timeout = opts.connect_timeout;
  params.cancel_fd = cancel_fd.get();  // borrowed: the session closes it
  if (params.remote.fabric == FabricKind::tcp) params.tls = tls_ctx;
  params.events.on_disconnected = [c](std::error_code) {
    c->failed.store(true, std::memory_order_release);
  };
  std::vector<std::byte> reject;
  auto r = path->domain->connect(params, &reject);
  if (!r.ok()) {
    if (r.error() == std::errc::connection_refused && !reject.empty()) {
      std::string why;
      auto rsp = proto::parse_con_rsp(reject, &why);
      if (rsp.ok() && rsp->errno_.get() != 0) {
        BASE_LOG(warn, "path %s: server refused connection %u: %s", path->name.c_str(), con->cid,
                  std::strerror(rsp->errno_.get()));
        return errc(rsp->errno_.get());
      }
    }
    return r.error();
  }
  con->conn = std::move(r->connection);
  std::string why;
  auto rsp = proto::parse_con_rsp(r->private_data, &why);
  if (!rsp.ok()) {
    BASE_LOG(warn, "path %s: bad CON_RSP: %s", path->name.c_str(), why.c_str());
    return rsp.error();
  }
  if (rsp->errno_.get() != 0) return errc(rsp->errno_.get());
  BASE_TRY(set_geometry(*rsp));

  // RECVs before anything can arrive. The service connection's first RECV takes INFO_RSP.
  if (con->cid != 0 && (geo.flags & proto::kConRspInvalidatePerIo) != 0) {
    if (!con->rkeys) con->rkeys = std::make_unique<proto::RkeyRsp[]>(con->recv_depth);
    BASE_ASSIGN_OR_RETURN(con->rkeys_mr, path->domain->register_memory(
                                              con->rkeys.get(), sizeof(proto::RkeyRsp) * con->recv_depth,
                                              fabric::kLocalWrite));
  }
  con->rkeys_next = 0;
  if (con->cid == 0 && (geo.flags & proto::kConRspFence) != 0) {
    if (!con->fence_rsps) con->fence_rsps = std::make_unique<proto::FenceRsp[]>(con->recv_depth);
    BASE_ASSIGN_OR_RETURN(con->fence_mr, path->domain->register_memory(
                                              con->fence_rsps.get(), sizeof(proto::FenceRsp) * con->recv_depth,
                                              fabric::kLocalWrite));
  }
  std::vector<fabric::RecvWr> recvs(caps.max_recv_wr);
  std::vector<Sge> recv_sges(caps.max_recv_wr);
  Sge svc_sges[3]{};
  for (uint32_t i = 0; i < caps.max_recv_wr; ++i) recvs[i] = con->next_recv(recv_sges[i]);
  if (con->cid == 0) {
    const size_t info = proto::info_rsp_size(geo.queue_depth);
    con->svc_len = svc_fence_off(geo.queue_depth, ClientSession::kMaxPaths);
    con->svc_buf = std::make_unique<std::byte[]>(con->svc_len);
    BASE_ASSIGN_OR_RETURN(con->svc_mr, path->domain->register_memory(
                                            con->svc_buf.get(), con->svc_len, fabric::kLocalWrite));
    // RECVs complete in the order they are posted: the AUTH slots first when authenticating.
    uint32_t k = 0;
    if (opts.auth.enabled()) {
      for (; k < 2; ++k) {
        svc_sges[k] = con->svc_mr->sge(svc_auth_off(geo.queue_depth, k), kSvcSlot);
        recvs[k] = fabric::RecvWr{wr_id(kWrRecv, kSvcAuthRecv + k), std::span(&svc_sges[k], 1)};
      }
    }
    svc_sges[k] = con->svc_mr->sge(0, static_cast<uint32_t>(info));
    recvs[k] = fabric::RecvWr{wr_id(kWrRecv, kSvcInfoRecv), std::span(&svc_sges[k], 1)};
  }
  BASE_TRY(con->conn->post_recv(recvs));
  return {};
}

Status Session::establish(Path* path) {
  path->gen.fetch_add(1, std::memory_order_acq_rel);
  {
    std::lock_guard lock(path->info_mu);
    path->svc_msgs.clear();
  }
  {
    std::lock_guard lock(path->meta_mu);
    path->auth = PathAuthInfo{};
    if (opts.auth.enabled()) path->auth.state = AuthState::pending;
  }
  BASE_ASSIGN_OR_RETURN(auto* fab, core::shared_fabric(path->spec.destination.fabric, opts.busy_poll));
  BASE_ASSIGN_OR_RETURN(auto* device,
                         fab->domain_for(path->spec.destination,
                                         path->spec.source ? &*path->spec.source : nullptr));
  // The path's connections and everything they use live in the session's domain there.
  BASE_ASSIGN_OR_RETURN(path->dom, domain_slot(device));
  path->domain = pds[path->dom].get();
  const uint16_t cid_num = static_cast<uint16_t>(nio + 1);
  for (uint16_t cid = 0; cid < cid_num; ++cid) {
    auto req = proto::make_con_req(cid, cid_num, path->recon_cnt, cid == 0, uuid_bytes, path->uuid,
                                   opts.auth.enabled());
    BASE_TRY(connect_con(path, path->cons[cid].get(), proto::as_bytes_of(req)));
    if (cid == 0) {
      // The geometry is known from the first CON_RSP: IO connections are sized by it, and the
      // domain needs the IUs and the read windows.
      BASE_TRY(slot_io_setup(path->dom));
      path->chunks = std::make_unique<client::ChunkRemote[]>(geo.queue_depth);
    }
  }

  // INFO_REQ, [the authentication], INFO_RSP on the service connection.
  Con* svc = path->cons[0].get();
  BASE_ASSIGN_OR_RETURN(auto info, proto::make_info_req(opts.session_name, path->name));
  BASE_TRY(svc->send_svc(svc_info_req_off(geo.queue_depth), proto::as_bytes_of(info)));
  const auto deadline = core::Clock::now() + opts.connect_timeout;
  if (opts.auth.enabled()) BASE_TRY(authenticate(path, deadline));
  BASE_ASSIGN_OR_RETURN(std::vector<std::byte> rsp, next_svc_msg(path, deadline));
  std::string why;
  auto descs = proto::parse_info_rsp(rsp, geo.queue_depth, geo.chunk_size, &why);
  if (!descs.ok()) {
    BASE_LOG(warn, "path %s: bad INFO_RSP: %s", path->name.c_str(), why.c_str());
    return descs.error();
  }
  for (uint32_t i = 0; i < geo.queue_depth; ++i) {
    path->chunks[i].addr = (*descs)[i].addr.get();
    path->chunks[i].key.store((*descs)[i].key.get(), std::memory_order_relaxed);
  }
  if ((geo.flags & proto::kConRspChunkSets) != 0) {
    // A set is written with the first chunk's address and key: the server promised one range
    // under one key.
    for (uint32_t i = 1; i < geo.queue_depth; ++i) {
      if (path->chunks[i].addr != path->chunks[0].addr + uint64_t{i} * geo.chunk_size ||
          path->chunks[i].key.load(std::memory_order_relaxed) !=
              path->chunks[0].key.load(std::memory_order_relaxed)) {
        BASE_LOG(warn, "path %s: bad INFO_RSP: chunk sets over chunks that are not one range",
                  path->name.c_str());
        return errc(EPROTO);
      }
    }
  }
  {
    std::lock_guard lock(path->meta_mu);
    path->hca_name = svc->conn->device_name();
    path->tls = svc->conn->tls();
    path->hca_port = svc->conn->port_num();
  }
  for (auto& c : path->cons) c->gate.open();
  BASE_TRY(path->state.change_from(ClientPathState::connecting, ClientPathState::connected));
  return {};
}

Result<std::vector<std::byte>> Session::next_svc_msg(Path* path, core::Clock::time_point deadline) {
  Con* svc = path->cons[0].get();
  std::unique_lock lock(path->info_mu);
  if (!path->info_cv.wait_until(lock, deadline, [&] {
        return !path->svc_msgs.empty() || svc->failed.load(std::memory_order_acquire) ||
               closing.load(std::memory_order_acquire);
      }))
    return errc(ETIMEDOUT);
  if (path->svc_msgs.empty()) return errc(closing.load() ? ECANCELED : ECONNRESET);
  std::vector<std::byte> m = std::move(path->svc_msgs.front());
  path->svc_msgs.pop_front();
  return m;
}

Status Con::send_svc(size_t off, std::span<const std::byte> msg) {
  if (!conn || off + msg.size() > svc_len) return errc(ENOTCONN);
  std::memcpy(svc_buf.get() + off, msg.data(), msg.size());
  Sge sge = svc_mr->sge(off, static_cast<uint32_t>(msg.size()));
  SendWr wr{};
  wr.wr_id = wr_id(kWrSvc);
  wr.opcode = Opcode::send;
  wr.sg_list = std::span(&sge, 1);
  return conn->post_send(std::span(&wr, 1));
}

Status Session::authenticate(Path* path, core::Clock::time_point deadline) {
  Con* svc = path->cons[0].get();
  const ClientAuth& a = opts.auth;
  auto fail = [&](int err, const std::string& why) -> Status {
    BASE_LOG(warn, "path %s: authentication as %s failed: %s", path->name.c_str(), a.host_id.c_str(),
              why.c_str());
    std::lock_guard lock(path->meta_mu);
    path->auth.state = AuthState::failed;
    return errc(err);
  };
  // The server's AUTH_FAILURE, if `m` is one: EACCES when it refused the host or its key.
  auto refusal = [&](std::span<const std::byte> m) -> std::optional<Status> {
    auto t = proto::peek_msg_type(m);
    if (!t.ok() || *t != proto::MsgType::auth_failure) return std::nullopt;
    std::string why;
    auto f = proto::parse_auth_failure(m, &why);
    if (!f.ok()) return fail(EPROTO, why);
    return fail(f->reason == EACCES ? EACCES : EPROTO,
                std::string("the server refused: ") + std::strerror(f->reason));
  };
  std::string why;
  BASE_ASSIGN_OR_RETURN(std::vector<std::byte> m, next_svc_msg(path, deadline));
  if (auto r = refusal(m)) return *r;
  auto c = proto::parse_auth_challenge(m, &why);
  if (!c.ok()) return fail(c.error().value(), why);
  auto dh = auth::X25519::generate();
  if (!dh.ok()) return fail(EIO, "cannot draw an X25519 key (OpenSSL)");
  auto z = dh->derive(c->dh_public);
  if (!z.ok()) return fail(EPROTO, "unusable X25519 public value from the server");
  auth::Transcript t;
  t.tid = c->tid;
  std::memcpy(t.sess_uuid.data(), uuid_bytes.data(), 16);
  std::memcpy(t.path_uuid.data(), path->uuid.data(), 16);
  t.sessname = opts.session_name;
  t.pathname = path->name;
  t.host = a.host_id;
  proto::AuthReplyView v;
  v.tid = c->tid;
  v.host = a.host_id;
  v.dh_public = dh->public_key();
  auto r1 = auth::response(auth::Role::host, *a.key, *z, c->nonce, c->seqnum, t);
  if (!r1.ok()) return fail(EIO, "cannot compute the response (OpenSSL)");
  v.response = *r1;
  if (a.server_key) {
    uint8_t s2[4];
    if (!auth::random_bytes(v.challenge2).ok() || !auth::random_bytes(s2).ok())
      return fail(EIO, "cannot draw a challenge (OpenSSL)");
    v.bidirectional = true;
    v.challenge2[0] |= 1;  // never all zeros: the wire's "no challenge"
    v.seqnum2 = (uint32_t{s2[0]} | uint32_t{s2[1]} << 8 | uint32_t{s2[2]} << 16 | uint32_t{s2[3]} << 24) | 1;
  }
  auto reply = proto::make_auth_reply(v);
  if (!reply.ok()) return fail(EINVAL, "host id unusable on the wire");
  BASE_TRY(svc->send_svc(svc_auth_reply_off(geo.queue_depth), proto::as_bytes_of(*reply)));

  BASE_ASSIGN_OR_RETURN(std::vector<std::byte> m2, next_svc_msg(path, deadline));
  if (auto r = refusal(m2)) return *r;
  auto ok = proto::parse_auth_success(m2, &why);
  if (!ok.ok()) return fail(ok.error().value(), why);
  if (ok->tid != c->tid) return fail(EPROTO, "AUTH_SUCCESS of another transaction");
  if (a.server_key) {
    // The server proves the server key before the client uses anything it says.
    if (!ok->has_response) return fail(EACCES, "the server did not answer our challenge");
    auto r2 = auth::response(auth::Role::server, *a.server_key, *z, v.challenge2, v.seqnum2, t);
    if (!r2.ok() || !auth::equal_ct(*r2, ok->response))
      return fail(EACCES, "the server does not know the server key: not the server we trust");
  } else if (ok->has_response) {
    return fail(EPROTO, "AUTH_SUCCESS answers a challenge we did not send");
  }
  std::lock_guard lock(path->meta_mu);
  path->auth.state = AuthState::authenticated;
  path->auth.host = a.host_id;
  path->auth.bidirectional = a.server_key.has_value();
  path->auth.method = "dhchap-sha256-x25519";
  return {};
}

// Closes every connection of the path: failover happens on each connection's poller (between
// its polls, so nothing is being placed), then the connections and CQs go.
void Session::teardown(Path* path) {
  if (uint64_t t = path->hb_timer.exchange(0)) svc_poller->cancel_timer(t);
  for (auto& c : path->cons) {
    Con* con = c.get();
    con->gate.close_and_wait();
    // A reaper blocked on this CQ wakes, finds the gate closed and gives the CQ back, which
    // seize() waits for.
    if (con->cid != 0) {
      std::lock_guard lock(reap_mu);
      if (auto& port = reapers[con->cid - 1u]) port->wake();
    }
    if (con->cq) {
      con->poller->run_sync([con] {
        con->poller->seize(con->cq.get(), con);
        con->go_down(errc(ECONNABORTED));
        con->poller->detach(con->cq.get());
        con->lease.set(core::CqLease::free);
      });
    }
  }
  for (auto& c : path->cons) {
    c->conn.reset();
    c->cq.reset();
    c->svc_mr.reset();
    c->rkeys_mr.reset();
    c->fence_mr.reset();
    c->svc_buf.reset();
  }
}

}  // namespace client
}  // namespace ibtrs
