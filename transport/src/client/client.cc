// The IBTRS client session (kernel: rtrs-clt.c). Structure in client_impl.h; wire in
// proto/ibtrs_proto.h.
#include <sys/eventfd.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "auth/chap.h"
#include "client/client_impl.h"
#include "base/log.h"
#include "core/fabrics.h"
#include "core/heartbeat_wr.h"

namespace ibtrs {

using namespace std::chrono_literals;
using client::Con;
using client::Path;
using client::Req;
using client::Session;
using fabric::Completion;
using fabric::Opcode;
using fabric::SendWr;
using fabric::Sge;
using fabric::WcStatus;

struct ClientSession::Impl final : client::Session {};

namespace client {

// Refusals that the same credentials and settings meet again on every retry: the server refused
// our host or key (EACCES), or requires TLS we do not speak (EPROTONOSUPPORT).
bool refused_for_good(std::error_code e) {
  return e == std::errc::permission_denied || e == std::errc::protocol_not_supported;
}

// The client-role TLS context of ClientOptions::tls: certificates when a CA is given, else the
// PSK of the host key. EINVAL: PSK mode without a host key, unreadable PEM files.
Result<std::shared_ptr<tls::Context>> make_tls_context(const ClientOptions& o) {
  tls::Config c;
  c.role = tls::Role::client;
  c.kernel = o.tls.kernel;
  if (!o.tls.ca_file.empty()) {
    c.ca_file = o.tls.ca_file;
    c.server_name = o.tls.server_name;
    c.cert_file = o.tls.cert_file;
    c.key_file = o.tls.key_file;
  } else {
    if (!o.auth.enabled() || !o.tls.cert_file.empty() || !o.tls.key_file.empty()) return errc(EINVAL);
    BASE_ASSIGN_OR_RETURN(auto psk, tls_psk_of(o.auth.host_id, *o.auth.key));
    c.psk = std::move(psk);
  }
  return tls::Context::create(std::move(c));
}

namespace {

// Work request ids: the low 3 bits say what completed.
enum WrKind : uint64_t { kWrIo = 1, kWrSvc = 2, kWrRecv = 3, kWrInv = 4 };
constexpr uint64_t wr_id(WrKind k, uint64_t v = 0) { return v << 3 | k; }

constexpr uint32_t kSvcRecvs = 16;      // service connection: AUTH_*, INFO_RSP + heartbeats
// The service connection's buffer: [INFO_RSP][AUTH slot 1][AUTH slot 2][INFO_REQ][AUTH_REPLY].
// RECVs that take a message say which part in their wr_id value: 1 INFO_RSP, 2 and 3 the AUTH
// slots (the server's AUTH_CHALLENGE and AUTH_SUCCESS / AUTH_FAILURE come before INFO_RSP).
constexpr uint32_t kAuthSlot = 512;
constexpr uint64_t kSvcInfoRecv = 1;
constexpr uint64_t kSvcAuthRecv = 2;  // and 3
// After the establishment (kConRspFence): RECVs with a FENCE_RSP slot, value kSvcFenceRecv + slot.
constexpr uint64_t kSvcFenceRecv = 4;
constexpr uint32_t kSvcSends = 16;
constexpr uint32_t kSignalEvery = 16;   // IO sends: one in this many is signalled
constexpr uint32_t kRepostBatch = 16;   // RECVs reposted together
constexpr auto kTick = 100ms;           // pending-request deadlines

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(core::Clock::now().time_since_epoch())
      .count();
}

// The submitting thread's stats shard and IO connection: a session's own IO thread uses its own
// connection (a completion callback that resubmits stays local); other threads are spread over
// the connections and count in the last shard ("user threads").
struct ThreadSlot {
  uint32_t ci;
  uint32_t shard;
};
thread_local const Session* tl_session = nullptr;
thread_local uint32_t tl_poller = 0;
std::atomic<uint32_t> g_thread_seq{0};
thread_local uint32_t tl_seq = g_thread_seq.fetch_add(1, std::memory_order_relaxed);
thread_local size_t tl_cursor = 0;
// Request callbacks run by this thread (CompletionReaper::reap counts its own).
thread_local size_t tl_finished = 0;
thread_local uint32_t tl_spread = 0;
// The path this thread posted to last, and in which session (compared, never dereferenced):
// min-inflight breaks ties towards it (core::Stick).
thread_local const void* tl_last_path = nullptr;
thread_local const void* tl_last_session = nullptr;
// Data size from which a user thread's requests are spread over the IO connections.
constexpr uint64_t kSpreadBytes = 64 * 1024;

// The calling thread's open submission batch (ClientSession::begin_batch): the connections it
// posted to with the doorbell held. Each holds one more entry of its gate, so it cannot be torn
// down before end_batch() rings it. A foreign thread posts to one connection per path, so the
// list is short; past it, posts ring at once.
struct Plug {
  const Session* s = nullptr;
  uint32_t depth = 0;
  uint32_t n = 0;
  Con* cons[ClientSession::kMaxPaths];
  // The path the batch posted to last (compared, never dereferenced): min-inflight keeps the
  // batch on it (core::kBatchStickiness).
  const void* last_path = nullptr;
};
thread_local Plug tl_plug;

// Rings the connections the batch holds and lets them go; the batch itself stays open.
void flush_plug(Plug& pl) {
  for (uint32_t i = 0; i < pl.n; ++i) {
    pl.cons[i]->conn->ring();
    pl.cons[i]->gate.exit();
  }
  pl.n = 0;
}

// Whether a post to `c` (whose gate the caller is inside) may wait for end_batch().
bool plug_con(const Session& s, Con* c) {
  Plug& pl = tl_plug;
  if (pl.s != &s) return false;
  if (std::find(pl.cons, pl.cons + pl.n, c) != pl.cons + pl.n) return true;
  if (pl.n == ClientSession::kMaxPaths || !c->gate.enter()) return false;
  pl.cons[pl.n++] = c;
  return true;
}

ThreadSlot thread_slot(const Session& s) {
  if (tl_session == &s) return {tl_poller, tl_poller};
  return {tl_seq % s.nio, s.nio};
}

bool printable_name(std::string_view n) {
  if (n.empty() || n.size() >= proto::kNameMax) return false;
  return std::all_of(n.begin(), n.end(), [](char c) { return c > ' ' && c < 0x7f; });
}

std::string errstr(std::error_code ec) { return ec ? ec.message() : "ok"; }

}  // namespace

// ------------------------------------------------------------------------------------------
// Path

Path::Path(Session* sess, uint32_t slot_, PathSpec spec_, uint32_t io_threads)
    : s(sess),
      slot(slot_),
      spec(std::move(spec_)),
      name(spec.name()),
      hb(sess->opts.heartbeat),
      sched(sess->opts.reconnect),
      stats(io_threads + 1) {
  Uuid16 u = Uuid16::random();
  std::memcpy(uuid.data(), u.bytes, 16);
  for (uint32_t cid = 0; cid <= io_threads; ++cid) {
    auto c = std::make_unique<Con>();
    c->path = this;
    c->cid = static_cast<uint16_t>(cid);
    c->poller = cid == 0 ? sess->svc_poller.get() : sess->io_pollers[cid - 1].get();
    cons.push_back(std::move(c));
  }
}

// ------------------------------------------------------------------------------------------
// Connection completions (poller thread)

fabric::RecvWr Con::next_recv(Sge& sge) {
  if (fence_rsps) {
    const uint32_t slot = rkeys_next;
    rkeys_next = (rkeys_next + 1) % recv_depth;
    sge = fence_mr->sge(size_t{slot} * sizeof(proto::FenceRsp), sizeof(proto::FenceRsp));
    return fabric::RecvWr{wr_id(kWrRecv, kSvcFenceRecv + slot), std::span(&sge, 1)};
  }
  if (!rkeys) return fabric::RecvWr{wr_id(kWrRecv), {}};
  const uint32_t slot = rkeys_next;
  rkeys_next = (rkeys_next + 1) % recv_depth;
  sge = rkeys_mr->sge(size_t{slot} * sizeof(proto::RkeyRsp), sizeof(proto::RkeyRsp));
  return fabric::RecvWr{wr_id(kWrRecv, slot), std::span(&sge, 1)};
}

void Con::repost_recvs() {
  if (recv_missing < kRepostBatch && !(recv_missing > 0 && cid == 0)) return;
  fabric::RecvWr wrs[64];
  Sge sges[64];
  uint32_t n = std::min<uint32_t>(recv_missing, 64);
  const uint32_t slot0 = rkeys_next;
  for (uint32_t i = 0; i < n; ++i) wrs[i] = next_recv(sges[i]);
  if (conn && conn->post_recv(std::span(wrs, n)).ok()) {
    recv_missing -= n;
  } else {
    rkeys_next = slot0;
  }
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

bool Con::take_rkey(uint32_t slot, uint32_t len) {
  Session& s = *path->s;
  if (!rkeys || slot >= recv_depth || len < sizeof(proto::RkeyRsp)) return false;
  // What the server wrote is copied out once and only the copy is looked at.
  proto::RkeyRsp m;
  std::memcpy(&m, &rkeys[slot], sizeof(m));
  const uint16_t id = m.buf_id.get();
  if (m.type.get() != static_cast<uint16_t>(proto::MsgType::rkey_rsp) || id >= s.geo.queue_depth)
    return false;
  path->chunks[id].key.store(m.rkey.get(), std::memory_order_relaxed);
  return true;
}

void Con::on_completions(std::span<Completion> wcs) {
  Session& s = *path->s;
  const uint32_t shard = poller->index();
  tl_session = &s;
  tl_poller = shard;
  path->stats.on_poll(shard, static_cast<uint32_t>(wcs.size()));
  std::error_code why;
  for (const Completion& wc : wcs) {
    if (wc.status != WcStatus::success) {
      if (!why) why = errc(wc.status == WcStatus::flush_error ? ECONNRESET : EIO);
      if (wc.status != WcStatus::flush_error)
        BASE_LOG(warn, "path %s con %u: %s", path->name.c_str(), cid,
                  std::string(fabric::to_string(wc.status)).c_str());
      continue;
    }
    if (down) continue;  // leftovers of a torn-down incarnation
    if (wc.opcode == Opcode::local_inv) {
      // A read's window revoked (rdma): the last one lets its callback run.
      if ((wc.wr_id & 7) == kWrInv && s.geo_set.load(std::memory_order_acquire) &&
          (wc.wr_id >> 3) < s.geo.queue_depth)
        on_inv_done(static_cast<uint32_t>(wc.wr_id >> 3), shard);
      continue;
    }
    if (wc.opcode == Opcode::recv_rdma_with_imm) {
      ++recv_missing;
      const uint32_t imm = wc.imm;
      if (path->hb.missed() != 0) path->hb.on_imm();
      switch (proto::imm_type(imm)) {
        case proto::ImmType::io_rsp:
        case proto::ImmType::io_rsp_w_inv: {
          auto rsp = proto::decode_io_rsp_imm(imm);
          if (cid == 0 || !s.geo_set.load(std::memory_order_acquire) ||
              rsp.permit_id >= s.geo.queue_depth) {
            BASE_LOG(warn, "path %s con %u: IO_RSP for permit %u refused", path->name.c_str(), cid,
                      rsp.permit_id);
            why = errc(EPROTO);
            break;
          }
          on_io_rsp(rsp.permit_id, rsp.err, shard);
          break;
        }
        case proto::ImmType::hb_msg: {
          if (conn) (void)core::post_heartbeat(*conn, proto::ImmType::hb_ack, wr_id(kWrSvc));
          break;
        }
        case proto::ImmType::hb_ack:
          path->hb.on_ack(core::Clock::now());
          break;
        default:
          BASE_LOG(warn, "path %s con %u: unexpected immediate 0x%08x", path->name.c_str(), cid, imm);
          why = errc(EPROTO);
      }
    } else if (wc.opcode == Opcode::recv && cid != 0) {
      // RKEY_RSP: sent just before the IO_RSP_W_INV of the same chunk, so the permit is reused
      // only with the new key.
      ++recv_missing;
      if (!take_rkey(static_cast<uint32_t>(wc.wr_id >> 3), wc.byte_len)) {
        BASE_LOG(warn, "path %s con %u: bad RKEY_RSP", path->name.c_str(), cid);
        why = errc(EPROTO);
      }
    } else if (wc.opcode == Opcode::recv) {
      // The establishment's messages (AUTH_*, INFO_RSP) arrive as SENDs on the service
      // connection, into the RECVs posted for them; after it only FENCE_RSP, into any RECV
      // (when the server offered the fence).
      ++recv_missing;
      const uint64_t part = wc.wr_id >> 3;
      if (part >= kSvcFenceRecv && fence_rsps && part - kSvcFenceRecv < recv_depth) {
        // Copied out once; only the copy is looked at.
        proto::FenceRsp m{};
        const size_t n = std::min<size_t>(wc.byte_len, sizeof(m));
        std::memcpy(&m, &fence_rsps[part - kSvcFenceRecv], n);
        std::string bad;
        auto v = proto::parse_fence_rsp(std::span(reinterpret_cast<const std::byte*>(&m), n), &bad);
        if (!v.ok()) {
          BASE_LOG(warn, "path %s: bad FENCE_RSP: %s", path->name.c_str(), bad.c_str());
          why = errc(EPROTO);
          continue;
        }
        s.fence_answered(*v);
        continue;
      }
      if (svc_buf == nullptr || part < kSvcInfoRecv || part > kSvcAuthRecv + 1) {
        BASE_LOG(warn, "path %s con %u: unexpected message", path->name.c_str(), cid);
        why = errc(EPROTO);
        continue;
      }
      const size_t info = proto::info_rsp_size(s.geo.queue_depth);
      const size_t off = part == kSvcInfoRecv ? 0 : info + (part - kSvcAuthRecv) * kAuthSlot;
      const size_t n = std::min<size_t>(wc.byte_len, part == kSvcInfoRecv ? info : kAuthSlot);
      std::lock_guard lock(path->info_mu);
      path->svc_msgs.emplace_back(svc_buf.get() + off, svc_buf.get() + off + n);
      path->info_cv.notify_all();
    }
  }
  if (failed.load(std::memory_order_acquire) && !why) why = errc(ECONNRESET);
  if (why && !down) {
    go_down(why);
    return;
  }
  if (!down) repost_recvs();
}

void Con::go_down(std::error_code why) {
  if (down) return;
  down = true;
  failed.store(true, std::memory_order_release);
  if (cid == 0) {
    // An establishment waiting for INFO_RSP learns the service connection is gone.
    std::lock_guard lock(path->info_mu);
    path->info_cv.notify_all();
  }
  Session& s = *path->s;
  gate.close_and_wait();
  if (conn) conn->disconnect();
  // What completed before the break is real: take it. Then nothing more can be placed.
  if (cq) {
    Completion wcs[32];
    down = false;  // let the drain complete responses
    for (size_t n; (n = cq->poll(std::span(wcs, 32))) > 0;) {
      for (size_t i = 0; i < n; ++i) {
        const Completion& wc = wcs[i];
        if (wc.status != WcStatus::success || cid == 0 || !s.geo_set.load()) continue;
        if (wc.opcode == Opcode::local_inv && (wc.wr_id & 7) == kWrInv &&
            (wc.wr_id >> 3) < s.geo.queue_depth) {
          on_inv_done(static_cast<uint32_t>(wc.wr_id >> 3), poller->index());
          continue;
        }
        if (wc.opcode != Opcode::recv_rdma_with_imm) continue;
        auto t = proto::imm_type(wc.imm);
        if (t != proto::ImmType::io_rsp && t != proto::ImmType::io_rsp_w_inv) continue;
        auto rsp = proto::decode_io_rsp_imm(wc.imm);
        if (rsp.permit_id >= s.geo.queue_depth) continue;
        // The connection is down: the windows are revoked on return.
        on_io_rsp(rsp.permit_id, rsp.err, poller->index());
      }
    }
    down = true;
  }
  if (cid != 0 && s.geo_set.load(std::memory_order_acquire)) {
    for (uint32_t p = 0; p < s.geo.queue_depth; ++p) {
      Req& r = s.reqs[p];
      Con* inv = this;
      if (r.inv_con.load(std::memory_order_acquire) == this &&
          r.inv_con.compare_exchange_strong(inv, nullptr, std::memory_order_acq_rel)) {
        // Answered, its LOCAL_INVs cut short by the break: revoked now (the connection is
        // down, so on return), then the caller learns the answer.
        (void)s.revoke_windows(p);
        s.finish(p, r.rsp_err, poller->index());
        continue;
      }
      Con* expected = this;
      if (r.con.load(std::memory_order_acquire) != this ||
          !r.con.compare_exchange_strong(expected, nullptr, std::memory_order_acq_rel))
        continue;
      // Whatever happens to the request next, the server of this connection can no longer
      // write its buffers.
      if (r.nwin > 0) (void)s.revoke_windows(p);
      path->inflight.fetch_sub(1, std::memory_order_relaxed);
      path->stats.on_failover(poller->index());
      if (s.closing.load(std::memory_order_acquire)) {
        s.finish(p, ECONNABORTED, poller->index());
      } else if (s.fence_on()) {
        // Its bytes may have landed at the server and wait there, unpolled, for a poller of
        // this incarnation: resent elsewhere at once, the old copy could run after the new
        // one and after newer writes to the same blocks. It waits for the fence. A read too:
        // its windows are revoked, but its old copy, polled late, parses the chunk at its old
        // offset after a newer request reused it -- a write whose data the server would take
        // for a message.
        s.fence_wait(p, path, path->recon_cnt.load(std::memory_order_acquire));
      } else if (!s.post(p, path)) {
        s.park(p);
      }
    }
  }
  // Tell the worker once per incarnation; it tears the whole path down.
  const uint64_t gen = path->gen.load(std::memory_order_acquire);
  Path* p = path;
  s.worker->post([&s, p, gen, why] { s.path_failed(p, gen, why); });
}

void Con::on_io_rsp(uint32_t p, int err, uint32_t shard) {
  Session& s = *path->s;
  Req& r = s.reqs[p];
  Con* expected = this;
  // A response of an incarnation we already failed over from finds the request gone.
  if (!r.con.compare_exchange_strong(expected, nullptr, std::memory_order_acq_rel)) return;
  if (r.nwin > 0) {
    // The read's data is in: close its windows before the caller sees it.
    if (const uint32_t left = s.revoke_windows(p); left > 0) {
      r.rsp_err = err;
      r.inv_left = left;
      r.inv_con.store(this, std::memory_order_release);
      return;
    }
  }
  s.finish(p, err, shard);
}

void Con::on_inv_done(uint32_t p, uint32_t shard) {
  Session& s = *path->s;
  Req& r = s.reqs[p];
  if (r.inv_con.load(std::memory_order_acquire) != this || --r.inv_left > 0) return;
  r.nwin = 0;
  r.inv_con.store(nullptr, std::memory_order_relaxed);
  s.finish(p, r.rsp_err, shard);
}

// ------------------------------------------------------------------------------------------
// Read windows

Status Session::bind_windows(uint32_t p, Con* c, uint32_t dom, uint32_t* keys) {
  Req& q = reqs[p];
  q.win_con = c;
  q.win_dom = dom;
  q.nwin = 0;
  std::unique_ptr<fabric::MemoryWindow>* table =
      wins[dom].get() + size_t{p} * ClientSession::kMaxSegments;
  for (uint32_t i = 0; i < q.nseg; ++i) {
    if (!table[i]) {
      // Beyond a permit's first window: made on first use, kept for the session's life.
      BASE_ASSIGN_OR_RETURN(table[i], pds[dom]->alloc_mw());
    }
    auto* mr = q.regs[i]->mrs[dom].load(std::memory_order_acquire);
    if (mr == nullptr) return errc(EINVAL);
    BASE_ASSIGN_OR_RETURN(keys[i], c->conn->bind_mw(*table[i], *mr,
                                                     reinterpret_cast<uint64_t>(q.segs[i].addr),
                                                     q.segs[i].len, fabric::kRemoteWrite));
    q.wins[q.nwin++] = table[i].get();
  }
  return {};
}

uint32_t Session::revoke_windows(uint32_t p) {
  Req& q = reqs[p];
  uint32_t left = 0;
  for (uint32_t i = 0; i < q.nwin; ++i) {
    auto r = q.win_con->conn->invalidate_mw(*q.wins[i], wr_id(kWrInv, p));
    if (!r.ok()) {
      BASE_LOG(warn, "session %s: revoking a read window of permit %u: %s",
                opts.session_name.c_str(), p, r.error().message().c_str());
      continue;
    }
    if (!*r) ++left;
  }
  if (left == 0) q.nwin = 0;
  return left;
}

void Session::release_windows_now(uint32_t p, Con* c) {
  if (reqs[p].nwin == 0 || revoke_windows(p) == 0) return;
  BASE_LOG(warn, "path %s: read windows of an unposted request still bound: disconnecting",
            c->path->name.c_str());
  c->conn->disconnect();
  (void)revoke_windows(p);
}

// ------------------------------------------------------------------------------------------
// IO path

bool Session::any_path_may_return() const {
  const uint32_t n = npaths_hint.load(std::memory_order_acquire);
  for (uint32_t i = 0; i < n; ++i) {
    Path* p = paths[i].load(std::memory_order_acquire);
    if (p == nullptr) continue;
    auto st = p->state.get();
    if (st == ClientPathState::connected || st == ClientPathState::connecting ||
        st == ClientPathState::connecting_err || st == ClientPathState::reconnecting)
      return true;
  }
  return false;
}

Status Session::submit(const IoRequest& r, PermitWait wait) {
  if (closing.load(std::memory_order_acquire)) return errc(ESHUTDOWN);
  // A write may carry only its user header (the block layer's FLUSH, DISCARD, CLOSE, ...); a
  // read needs somewhere to land.
  if (r.done == nullptr || (r.data.empty() && r.dir == IoDir::read) ||
      r.data.size() > ClientSession::kMaxSegments)
    return errc(EINVAL);
  uint64_t total = 0;
  const RegisteredMemory::Impl* regs[ClientSession::kMaxSegments];
  for (size_t i = 0; i < r.data.size(); ++i) {
    const IoSeg& sg = r.data[i];
    if (sg.mem == nullptr || sg.len == 0) return errc(EINVAL);
    auto* base = sg.mem->data();
    auto* a = static_cast<std::byte*>(sg.addr);
    if (a < base || a + sg.len > base + sg.mem->size()) return errc(EINVAL);
    // Memory of another session is registered in that session's protection domains: usable
    // here only through a share with this session.
    regs[i] = region_of(sg.mem);
    if (regs[i] == nullptr) return errc(EINVAL);
    total += sg.len;
  }
  const size_t msg = r.dir == IoDir::write
                         ? sizeof(proto::WriteMsg)
                         : sizeof(proto::ReadMsgHeader) + r.data.size() * sizeof(proto::BufDesc);
  if (r.usr.size() + msg > geo.max_hdr_size) return errc(EINVAL);
  if (total > geo.max_io_size) return errc(EMSGSIZE);

  // The chunks the request takes: one, or with chunk sets as many as its extent needs.
  const uint64_t extent = r.dir == IoDir::write ? total + r.usr.size() + msg : geo.max_hdr_size + total;
  const uint32_t n = extent <= geo.chunk_size ? 1 : proto::set_chunks(extent, geo.chunk_size);
  // No path can carry it: refused before it waits for a permit, which (kept for a fence) may
  // come back only with a path.
  if (connected_paths.load(std::memory_order_acquire) == 0 && !any_path_may_return()) return errc(ENOTCONN);
  // Permits kept for unconfirmed fences come back only once a path is up and the server
  // answers: a wait for a permit that lasts pending_timeout and ends with chunks so kept fails
  // as a parked request would (ENOTCONN); otherwise it goes on. (Looked at when each wait ends,
  // not when it begins: chunks may be kept while it waits.)
  const auto step = std::max(opts.pending_timeout, std::chrono::milliseconds(kTick));
  auto take = [this, n, step](core::PermitPool::Wait w) {
    for (;;) {
      auto got = n == 1 ? permits->get(w, step) : permits->get_run(n, w, step);
      if (got.ok() || got.error() != std::errc::timed_out) return got;
      if (fence_kept.load(std::memory_order_acquire) != 0) return Result<uint32_t>(errc(ENOTCONN));
    }
  };
  auto permit = take(wait == PermitWait::yes && tl_plug.n == 0 ? core::PermitPool::Wait::yes
                                                               : core::PermitPool::Wait::no);
  if (!permit.ok() && wait == PermitWait::yes && tl_plug.n > 0) {
    // About to sleep for a permit with requests held in this thread's batch: they go to the
    // wire first (the block layer flushes its plug before a task sleeps). Held back, they could
    // be the very requests whose completions would free a permit, and nothing would.
    flush_plug(tl_plug);
    permit = take(core::PermitPool::Wait::yes);
  }
  if (!permit.ok()) return permit.error();
  const uint32_t first = *permit;
  const uint32_t p = r.dir == IoDir::write ? first + n - 1 : first;
  Req& q = reqs[p];
  q.first = first;
  q.nchunks = n;
  const ThreadSlot ts = thread_slot(*this);
  q.dir = r.dir;
  q.done = r.done;
  q.ctx = r.ctx;
  q.usr_len = static_cast<uint16_t>(r.usr.size());
  q.nseg = static_cast<uint8_t>(r.data.size());
  q.data_len = static_cast<uint32_t>(total);
  std::copy(r.data.begin(), r.data.end(), q.segs);
  std::copy(regs, regs + r.data.size(), q.regs);
  q.start_ns = now_ns();
  q.submit_shard = ts.shard;
  q.ci = ts.ci;
  // A large read from a user thread goes to the next IO connection in turn: on one connection
  // every copy of a stream of them (the server's read and send, our receive) is serialized on
  // one IO thread of each side. A large write stays on the thread's connection, as small
  // requests do (a submission batch shares one sendmsg): the poster sends its data itself and
  // the server's copy into the page cache runs off its IO thread (io_uring's worker), so
  // spreading bought no copy in parallel, while the completions of the other connection came
  // through an IO thread instead of the caller's own reap (1 MiB write QD8, tcp, A/B in one
  // run, 4 rounds, load 6-7: fio 6.5-7.0 system calls per IO against 7.8-8.6, CPU per IO of
  // fio + server 862-1106 us against 977-1290, IOPS 0.75-1.03x).
  if (tl_session != this && total >= kSpreadBytes && nio > 1 && q.dir == IoDir::read) q.ci = tl_spread++ % nio;
  if (!r.usr.empty()) std::memcpy(iu + size_t{p} * geo.max_hdr_size, r.usr.data(), r.usr.size());
  if (post(p, nullptr)) return {};
  if (any_path_may_return()) {
    park(p);
    return {};
  }
  q.done = nullptr;
  permits->put_run(q.first, q.nchunks);
  return errc(ENOTCONN);
}

bool Session::post(uint32_t p, Path* skip) {
  Req& q = reqs[p];
  const MpPolicy pol = policy.load(std::memory_order_relaxed);
  Path* tried[ClientSession::kMaxPaths];
  size_t ntried = 0;
  for (size_t attempt = 0; attempt < ClientSession::kMaxPaths; ++attempt) {
    // Snapshot the loads of the usable paths and let the policy choose.
    core::PathLoad loads[ClientSession::kMaxPaths];
    Path* by_idx[ClientSession::kMaxPaths];
    const uint32_t n = npaths_hint.load(std::memory_order_acquire);
    std::optional<size_t> skip_idx;
    std::optional<core::Stick> stick;
    for (uint32_t i = 0; i < n; ++i) {
      Path* pa = paths[i].load(std::memory_order_acquire);
      by_idx[i] = pa;
      loads[i] = {};
      if (pa == nullptr || !pa->usable()) continue;
      if (std::find(tried, tried + ntried, pa) != tried + ntried) continue;
      loads[i].usable = true;
      loads[i].inflight = pa->inflight.load(std::memory_order_relaxed);
      auto lat = pa->hb.latency();
      loads[i].latency_ns = lat ? static_cast<uint64_t>(lat->count()) : 0;
      if (pa == skip) skip_idx = i;
      if (tl_plug.s == this && pa == tl_plug.last_path) {
        stick = core::Stick{i, core::kBatchStickiness};
      } else if (!stick && tl_last_session == this && pa == tl_last_path) {
        stick = core::Stick{i, 0};
      }
    }
    auto idx = core::choose_path(pol, std::span(loads, n), tl_cursor, skip_idx, stick);
    if (!idx) return false;
    Path* pa = by_idx[*idx];
    tried[ntried++] = pa;
    Con* c = pa->io_con(q.ci);
    if (!c->gate.enter()) continue;

    // Build the request for this path: chunk key and local keys are per path / device.
    const uint32_t dom = pa->dom;
    Sge sges[ClientSession::kMaxSegments + 1];
    std::byte* u = iu + size_t{p} * geo.max_hdr_size;
    uint32_t offset;
    uint32_t nsge;
    uint32_t iu_bytes;
    if (q.dir == IoDir::write) {
      for (uint32_t i = 0; i < q.nseg; ++i) {
        auto* mr = q.regs[i]->mrs[dom].load(std::memory_order_acquire);
        sges[i] = Sge{reinterpret_cast<uint64_t>(q.segs[i].addr), q.segs[i].len, mr ? mr->lkey() : 0};
      }
      proto::WriteMsg m{};
      m.type.set(static_cast<uint16_t>(proto::MsgType::write));
      m.usr_len.set(q.usr_len);
      m.data_len.set(q.data_len);
      std::memcpy(u + q.usr_len, &m, sizeof(m));
      iu_bytes = q.usr_len + static_cast<uint32_t>(sizeof(m));
      // The message lies in the set's last chunk (this permit's), the data from the first.
      offset = q.data_len + q.usr_len - (q.nchunks - 1) * geo.chunk_size;
      nsge = q.nseg;
    } else {
      // The server writes the data through a window per segment, opened here for this read
      // on this connection and closed when its response arrives.
      uint32_t keys[ClientSession::kMaxSegments];
      const bool windowed = use_windows[dom];
      if (windowed) {
        if (auto st = bind_windows(p, c, dom, keys); !st.ok()) {
          BASE_LOG(warn, "path %s: cannot open read windows: %s", pa->name.c_str(),
                    st.error().message().c_str());
          release_windows_now(p, c);
          c->gate.exit();
          continue;
        }
      } else {
        for (uint32_t i = 0; i < q.nseg; ++i) {
          auto* mr = q.regs[i]->mrs[dom].load(std::memory_order_acquire);
          keys[i] = mr ? mr->rkey() : 0;
        }
      }
      proto::ReadMsgHeader h{};
      h.type.set(static_cast<uint16_t>(proto::MsgType::read));
      h.usr_len.set(q.usr_len);
      h.flags.set(windowed ? proto::kReadNeedInvalidate : 0);
      h.sg_cnt.set(q.nseg);
      std::memcpy(u + q.usr_len, &h, sizeof(h));
      auto* d = u + q.usr_len + sizeof(h);
      for (uint32_t i = 0; i < q.nseg; ++i) {
        proto::BufDesc bd{};
        bd.addr.set(reinterpret_cast<uint64_t>(q.segs[i].addr));
        bd.key.set(keys[i]);
        bd.len.set(q.segs[i].len);
        std::memcpy(d + i * sizeof(bd), &bd, sizeof(bd));
      }
      iu_bytes = q.usr_len + static_cast<uint32_t>(sizeof(h) + q.nseg * sizeof(proto::BufDesc));
      offset = q.usr_len;
      nsge = 0;
    }
    sges[nsge++] = Sge{reinterpret_cast<uint64_t>(u), iu_bytes,
                       iu_lkey[dom].load(std::memory_order_relaxed)};
    auto imm = proto::encode_io_req_imm(geo.layout, p, offset);
    SendWr wr{};
    wr.wr_id = wr_id(kWrIo, p);
    wr.opcode = Opcode::write_with_imm;
    wr.sg_list = std::span(sges, nsge);
    wr.remote_addr = pa->chunks[q.first].addr;
    wr.rkey = pa->chunks[q.first].key.load(std::memory_order_relaxed);
    wr.imm = imm.ok() ? *imm : 0;
    wr.signaled = c->sig.fetch_add(1, std::memory_order_relaxed) % kSignalEvery == 0;

    q.path = pa;
    pa->inflight.fetch_add(1, std::memory_order_relaxed);
    // Counted before the post: once posted the request may complete at once on another thread
    // (and its slot be reused), and a reader of the stats must never see it completed but not
    // submitted (an inflight of -1: seen by a test under ASan, the poster preempted between
    // the post and the count).
    const uint32_t sub_shard = q.submit_shard;
    pa->stats.on_submit(sub_shard, q.dir == IoDir::write, q.data_len, q.nseg);
    q.con.store(c, std::memory_order_release);
    const bool plugged = plug_con(*this, c);
    auto st = plugged ? c->conn->post_send_deferred(std::span(&wr, 1)) : c->conn->post_send(std::span(&wr, 1));
    if (st.ok()) {
      if (plugged) tl_plug.last_path = pa;
      tl_last_path = pa;
      tl_last_session = this;
      c->gate.exit();
      return true;
    }
    // Not posted (the connection broke or its queue is full): take the request back unless the
    // connection's failover already did (and counted it out of this path).
    Con* expected = c;
    if (!q.con.compare_exchange_strong(expected, nullptr, std::memory_order_acq_rel)) {
      c->gate.exit();
      return true;
    }
    release_windows_now(p, c);
    c->gate.exit();
    pa->inflight.fetch_sub(1, std::memory_order_relaxed);
    pa->stats.on_unposted(sub_shard);
  }
  return false;
}

void Session::finish(uint32_t p, int err, uint32_t shard, bool keep_permits) {
  Req& q = reqs[p];
  if (q.path != nullptr) {
    q.path->inflight.fetch_sub(1, std::memory_order_relaxed);
    q.path->stats.on_complete(shard, q.dir == IoDir::write,
                              static_cast<uint64_t>(std::max<int64_t>(0, now_ns() - q.start_ns)),
                              q.submit_shard);
    q.path = nullptr;
  }
  IoDoneFn fn = q.done;
  void* ctx = q.ctx;
  q.done = nullptr;
  ++tl_finished;
  // The permits go back before the callback, so the callback may submit again.
  if (!keep_permits) permits->put_run(q.first, q.nchunks);
  if (fn != nullptr) fn(ctx, err);
}

// A request no path could take waits for one (or for its deadline).
void Session::park(uint32_t p) {
  reqs[p].path = nullptr;
  reqs[p].pending_deadline_ns =
      now_ns() + std::chrono::duration_cast<std::chrono::nanoseconds>(opts.pending_timeout).count();
  std::lock_guard lock(pend_mu);
  pending.push_back(p);
}

void Session::fence_wait(uint32_t p, Path* path, uint16_t recon) {
  Req& q = reqs[p];
  q.path = nullptr;
  q.pending_deadline_ns =
      now_ns() + std::chrono::duration_cast<std::chrono::nanoseconds>(opts.pending_timeout).count();
  bool fresh = false;
  {
    std::lock_guard lock(fence_mu);
    auto it = std::find_if(fences.begin(), fences.end(),
                           [&](const Fence& f) { return f.path == path && f.recon == recon; });
    if (it == fences.end()) {
      Fence f;
      f.path = path;
      f.recon = recon;
      f.since_ns = now_ns();
      fences.push_back(std::move(f));
      it = fences.end() - 1;
      fresh = true;
    }
    it->reqs.push_back(p);
    fence_waiting.fetch_add(1, std::memory_order_acq_rel);
  }
  path->fence_waited.fetch_add(1, std::memory_order_relaxed);
  // Not the worker's: it may sit in a connect for up to connect_timeout.
  if (fresh) svc_poller->post([this] { fence_kick(); });
}

// Any thread (the service poller, the worker).
void Session::fence_kick() {
  if (!geo_set.load(std::memory_order_acquire) || !fence_on()) return;
  std::lock_guard lock(fence_mu);
  for (Fence& f : fences) {
    if (f.carrier != nullptr && f.carrier->usable() &&
        f.carrier->gen.load(std::memory_order_acquire) == f.carrier_gen)
      continue;  // on its way
    f.carrier = nullptr;
    const uint32_t n = npaths_hint.load(std::memory_order_acquire);
    for (uint32_t i = 0; i < n && f.carrier == nullptr; ++i) {
      Path* pa = paths[i].load(std::memory_order_acquire);
      if (pa == nullptr || pa == f.path || !pa->usable()) continue;
      Con* svc = pa->cons[0].get();
      if (!svc->gate.enter()) continue;
      // One send slot per fenced path: one fence of a path is unanswered at a time (a newer
      // incarnation of it is fenced only after it connected, which confirmed the older).
      const size_t off = proto::info_rsp_size(geo.queue_depth) + 2 * kAuthSlot +
                         sizeof(proto::InfoReq) + sizeof(proto::AuthReply) +
                         size_t{f.path->slot} * sizeof(proto::PathFence);
      const auto m = proto::make_path_fence(f.path->uuid, f.recon);
      if (svc->send_svc(off, proto::as_bytes_of(m)).ok()) {
        f.carrier = pa;
        f.carrier_gen = pa->gen.load(std::memory_order_acquire);
        BASE_LOG(info, "path %s: fencing incarnation %u (%zu requests wait) over path %s",
                  f.path->name.c_str(), f.recon, f.reqs.size(), pa->name.c_str());
      }
      svc->gate.exit();
    }
  }
}

// Any thread.
void Session::fence_release(Path* path, uint16_t upto, bool inclusive) {
  std::vector<Fence> done;
  {
    std::lock_guard lock(fence_mu);
    for (auto it = fences.begin(); it != fences.end();) {
      const int16_t age = static_cast<int16_t>(it->recon - upto);
      if (it->path == path && (age < 0 || (inclusive && age == 0))) {
        done.push_back(std::move(*it));
        it = fences.erase(it);
      } else {
        ++it;
      }
    }
  }
  const int64_t now = now_ns();
  for (Fence& f : done) {
    const auto rtt = static_cast<uint64_t>(std::max<int64_t>(0, now - f.since_ns));
    path->fences_done.fetch_add(1, std::memory_order_relaxed);
    path->fence_rtt_last_ns.store(rtt, std::memory_order_relaxed);
    if (rtt > path->fence_rtt_max_ns.load(std::memory_order_relaxed))
      path->fence_rtt_max_ns.store(rtt, std::memory_order_relaxed);
    BASE_LOG(info, "path %s: incarnation %u fenced after %llu us: %zu requests resent, %zu chunks "
              "of failed ones free again",
              path->name.c_str(), f.recon, static_cast<unsigned long long>(rtt / 1000), f.reqs.size(),
              f.kept.size());
    for (uint32_t p : f.reqs) {
      fence_waiting.fetch_sub(1, std::memory_order_acq_rel);
      if (!post(p, nullptr)) {
        // Parked as it is: its deadline runs from its failover.
        std::lock_guard lock(pend_mu);
        pending.push_back(p);
      }
    }
    for (uint32_t p : f.kept) give_back_kept(p);
    // Requests of this fence still failing (fail_fenced) find it gone and free their own.
  }
}

// Any thread but an IO poller.
size_t Session::fail_fenced(const std::function<bool(uint32_t)>& which, int err) {
  struct Taken {
    Path* path;
    uint16_t recon;
    uint32_t p;
  };
  std::vector<Taken> taken;
  {
    std::lock_guard lock(fence_mu);
    for (Fence& f : fences) {
      std::erase_if(f.reqs, [&](uint32_t p) {
        if (!which(p)) return false;
        taken.push_back({f.path, f.recon, p});
        ++f.failing;
        return true;
      });
    }
    fence_waiting.fetch_sub(static_cast<uint32_t>(taken.size()), std::memory_order_acq_rel);
    // Kept from now on as far as a submitter can tell: its callback may submit at once.
    fence_kept.fetch_add(static_cast<uint32_t>(taken.size()), std::memory_order_acq_rel);
  }
  // The callbacks run outside the lock (they may submit); meanwhile the requests are in no
  // list, so a confirmation of their fence cannot hand out their permits under them.
  for (const Taken& t : taken) finish(t.p, err, nio, true);
  std::vector<uint32_t> confirmed;
  {
    std::lock_guard lock(fence_mu);
    for (const Taken& t : taken) {
      // At most one fence per incarnation is listed; one with `failing` is still ours.
      auto it = std::find_if(fences.begin(), fences.end(), [&](const Fence& f) {
        return f.path == t.path && f.recon == t.recon && f.failing > 0;
      });
      if (it == fences.end()) {
        confirmed.push_back(t.p);  // confirmed while the callback ran
        continue;
      }
      --it->failing;
      it->kept.push_back(t.p);
    }
  }
  for (uint32_t p : confirmed) give_back_kept(p);
  return taken.size();
}

// Service poller. An answer to no fence of ours (a repeated one, or a server's invention)
// releases nothing. A fence whose requests all failed meanwhile is still listed: its answer
// frees their chunks.
void Session::fence_answered(const proto::FenceView& v) {
  Path* fenced = nullptr;
  {
    std::lock_guard lock(fence_mu);
    for (const Fence& f : fences)
      if (f.path->uuid == v.path_uuid) fenced = f.path;
  }
  if (fenced != nullptr) fence_release(fenced, v.recon_cnt, true);
}

// Worker: resubmits parked requests, fails the expired ones (or all with `fail_all`).
void Session::run_pending(bool fail_all, int err) {
  if (fail_all) {
    fail_parked_if([](uint32_t) { return true; }, err);
    return;
  }
  expire_parked();
  fence_kick();
  std::deque<uint32_t> todo;
  {
    std::lock_guard lock(pend_mu);
    todo.swap(pending);
  }
  for (uint32_t p : todo) {
    if (!post(p, nullptr)) {
      std::lock_guard lock(pend_mu);
      pending.push_back(p);
    }
  }
}

size_t Session::expire_parked() {
  const int64_t now = now_ns();
  const size_t expired = fail_parked_if([&](uint32_t p) { return now >= reqs[p].pending_deadline_ns; }, ENOTCONN);
  // An operator (and the soak's verdict) must be able to tell the configured timeout from a
  // lost request: one line per batch that failed because no path came back in time.
  if (expired != 0)
    BASE_LOG(warn, "session %s: %zu requests failed (ENOTCONN): no path for pending_timeout (%lld ms)",
              opts.session_name.c_str(), expired, static_cast<long long>(opts.pending_timeout.count()));
  return expired;
}

size_t Session::fail_parked_if(const std::function<bool(uint32_t)>& which, int err) {
  // Requests waiting for a fence first: their permits stay kept.
  size_t n = fail_fenced(which, err);
  std::vector<uint32_t> todo;
  {
    std::lock_guard lock(pend_mu);
    std::erase_if(pending, [&](uint32_t p) {
      if (!which(p)) return false;
      todo.push_back(p);
      return true;
    });
  }
  for (uint32_t p : todo) finish(p, err, nio);
  return n + todo.size();
}

// Worker.
void Session::fail_parked(const std::function<bool(IoDoneFn, void*)>& which, int err) {
  fail_parked_if([&](uint32_t p) { return which(reqs[p].done, reqs[p].ctx); }, err);
}

// ------------------------------------------------------------------------------------------
// Establishment (worker)

uint32_t Session::user_access(uint32_t slot) const {
  // With windows the user's memory is never remotely writable through its own key.
  return fabric::kLocalWrite | (use_windows[slot] ? fabric::kMwBind : fabric::kRemoteWrite);
}

Result<uint32_t> Session::domain_slot(fabric::Domain* d) {
  std::lock_guard lock(mem_mu);
  for (uint32_t i = 0; i < kMaxDomains; ++i) {
    if (devices[i].load() == d) return i;
  }
  uint32_t slot = kMaxDomains;
  for (uint32_t i = 0; i < kMaxDomains; ++i) {
    if (devices[i].load() == nullptr) {
      slot = i;
      break;
    }
  }
  if (slot == kMaxDomains) return errc(ENOSPC);
  // The session's own protection domain on the device: no other session's server reaches it.
  BASE_ASSIGN_OR_RETURN(auto pd, d->alloc_pd(fabric::PdAttr{}));
  {
    auto probe = pd->alloc_mw();
    use_windows[slot] = probe.ok();
    if (!probe.ok()) {
      BASE_LOG(warn, "session %s: device %s has no memory windows (%s): read buffers stay "
                "remotely writable while registered", opts.session_name.c_str(),
                d->device_name().c_str(), probe.error().message().c_str());
    }
  }
  // Everything a request may point at must be registered in the domain before a path on it
  // carries IO: every user registration now, the permit IUs once the geometry is known.
  std::vector<std::unique_ptr<fabric::MemoryRegion>> regs;
  for (auto* r : regions) {
    BASE_ASSIGN_OR_RETURN(auto mr, pd->register_memory(r->addr, r->size, user_access(slot)));
    regs.push_back(std::move(mr));
  }
  for (size_t i = 0; i < regions.size(); ++i) {
    regions[i]->mrs[slot].store(regs[i].get(), std::memory_order_release);
    regions[i]->keep.push_back(std::move(regs[i]));
  }
  pds[slot] = std::move(pd);
  devices[slot].store(d, std::memory_order_release);
  return slot;
}

Status Session::slot_io_setup(uint32_t slot) {
  std::lock_guard lock(mem_mu);
  fabric::Domain& pd = *pds[slot];
  if (!iu_mrs[slot]) {
    BASE_ASSIGN_OR_RETURN(auto iu_mr, pd.register_memory(iu, iu_len, fabric::kLocalWrite));
    iu_lkey[slot].store(iu_mr->lkey(), std::memory_order_release);
    iu_mrs[slot] = std::move(iu_mr);
  }
  if (use_windows[slot] && !wins[slot]) {
    // A permit's first window is made here, so that one-segment reads allocate nothing.
    const size_t n = size_t{geo.queue_depth} * ClientSession::kMaxSegments;
    auto table = std::make_unique<std::unique_ptr<fabric::MemoryWindow>[]>(n);
    for (uint32_t p = 0; p < geo.queue_depth; ++p) {
      BASE_ASSIGN_OR_RETURN(table[size_t{p} * ClientSession::kMaxSegments], pd.alloc_mw());
    }
    wins[slot] = std::move(table);
  }
  return {};
}

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
  params.cancel_fd = cancel_fd;
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
    // ... then a PATH_FENCE send slot per path of the session.
    con->svc_len = info + 2 * kAuthSlot + sizeof(proto::InfoReq) + sizeof(proto::AuthReply) +
                   ClientSession::kMaxPaths * sizeof(proto::PathFence);
    con->svc_buf = std::make_unique<std::byte[]>(con->svc_len);
    BASE_ASSIGN_OR_RETURN(con->svc_mr, path->domain->register_memory(
                                            con->svc_buf.get(), con->svc_len, fabric::kLocalWrite));
    // RECVs complete in the order they are posted: the AUTH slots first when authenticating.
    uint32_t k = 0;
    if (opts.auth.enabled()) {
      for (; k < 2; ++k) {
        svc_sges[k] = con->svc_mr->sge(info + k * kAuthSlot, kAuthSlot);
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
  BASE_TRY(svc->send_svc(proto::info_rsp_size(geo.queue_depth) + 2 * kAuthSlot, proto::as_bytes_of(info)));
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
  BASE_TRY(svc->send_svc(proto::info_rsp_size(geo.queue_depth) + 2 * kAuthSlot + sizeof(proto::InfoReq),
                          proto::as_bytes_of(*reply)));

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

void Session::refused(Path* path, std::error_code why) {
  (void)path->state.change(ClientPathState::closing);
  (void)path->state.change(ClientPathState::closed);
  BASE_LOG(warn, "path %s: %s: closed, not retried (reconnect it once the credentials are fixed)",
            path->name.c_str(), errstr(why).c_str());
  if (!any_path_may_return()) run_pending(true, why.value());
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

void Session::emit(SessionEvent e, const Path* path, std::error_code why) {
  BASE_LOG(info, "session %s: %s %s %s", opts.session_name.c_str(),
            std::string(to_string(e)).c_str(), path ? path->name.c_str() : "",
            why ? why.message().c_str() : "");
  if (opts.on_event) opts.on_event(SessionEventInfo{e, path ? path->name : std::string(), why});
}

void Session::on_path_up(Path* path) {
  // The server accepted this incarnation, and closed the older ones first (a reconnect closes
  // the stale path before it is answered): their fences are confirmed.
  fence_release(path, path->recon_cnt.load(std::memory_order_acquire), false);
  start_heartbeat(path);
  connected_paths.fetch_add(1, std::memory_order_acq_rel);
  emit(SessionEvent::path_up, path, {});
  if (was_disconnected) {
    was_disconnected = false;
    emit(SessionEvent::reconnected, path, {});
  }
  run_pending(false, 0);
}

void Session::on_path_down(Path* path, std::error_code why) {
  emit(SessionEvent::path_down, path, why);
  if (connected_paths.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    was_disconnected = true;
    emit(SessionEvent::disconnected, path, why);
  }
}

void Session::start_heartbeat(Path* path) {
  const uint64_t gen = path->gen.load(std::memory_order_acquire);
  path->hb_timer.store(svc_poller->add_timer(core::Clock::now() + opts.heartbeat.interval,
                                             [this, path, gen] { heartbeat_tick(path, gen); }));
}

// Service poller.
void Session::heartbeat_tick(Path* path, uint64_t gen) {
  if (path->gen.load(std::memory_order_acquire) != gen || !path->usable()) return;
  if (path->hb.on_timer(core::Clock::now()) == core::Heartbeat::Action::peer_dead) {
    BASE_LOG(warn, "path %s: %u heartbeats missed", path->name.c_str(), path->hb.missed());
    worker->post([this, path, gen] { path_failed(path, gen, errc(ETIMEDOUT)); });
    return;
  }
  Con* svc = path->cons[0].get();
  if (svc->gate.enter()) {
    (void)core::post_heartbeat(*svc->conn, proto::ImmType::hb_msg, wr_id(kWrSvc));
    svc->gate.exit();
  }
  path->hb_timer.store(svc_poller->add_timer(core::Clock::now() + opts.heartbeat.interval,
                                             [this, path, gen] { heartbeat_tick(path, gen); }));
}

// Worker: a connection of a CONNECTED path broke, or its heartbeats stopped.
void Session::path_failed(Path* path, uint64_t gen, std::error_code why) {
  if (path->gen.load(std::memory_order_acquire) != gen) return;
  if (!path->state.change_from(ClientPathState::connected, ClientPathState::reconnecting).ok())
    return;
  BASE_LOG(warn, "path %s: down (%s), reconnecting", path->name.c_str(), errstr(why).c_str());
  {
    std::lock_guard meta_lock(path->meta_mu);
    path->last_error = why;
  }
  teardown(path);
  on_path_down(path, why);
  fence_kick();  // a fence that went over this path goes again over another
  schedule_reconnect(path);
}

void Session::schedule_reconnect(Path* path) {
  if (closing.load()) return;
  auto delay = path->sched.next_delay();
  if (!delay) {
    // Attempts used up: the path rests CLOSED until a user reconnects it.
    (void)path->state.change(ClientPathState::closing);
    (void)path->state.change(ClientPathState::closed);
    BASE_LOG(warn, "path %s: reconnect attempts exhausted, closed", path->name.c_str());
    if (!any_path_may_return()) run_pending(true, ENOTCONN);
    return;
  }
  const uint64_t gen = path->gen.load();
  path->reconnect_timer.store(svc_poller->add_timer(core::Clock::now() + *delay, [this, path, gen] {
    worker->post([this, path, gen] {
      if (path->gen.load() == gen) reconnect_attempt(path);
    });
  }));
}

void Session::reconnect_attempt(Path* path) {
  if (closing.load()) return;
  if (!path->state.change_from(ClientPathState::reconnecting, ClientPathState::connecting).ok())
    return;
  ++path->recon_cnt;
  auto st = establish(path);
  if (st.ok()) {
    path->sched.reset();
    path->stats.on_reconnect(true);
    BASE_LOG(info, "path %s: reconnected", path->name.c_str());
    on_path_up(path);
    return;
  }
  path->stats.on_reconnect(false);
  {
    std::lock_guard meta_lock(path->meta_mu);
    path->last_error = st.error();
  }
  BASE_LOG(info, "path %s: reconnect failed: %s", path->name.c_str(), errstr(st.error()).c_str());
  teardown(path);
  (void)path->state.change(ClientPathState::connecting_err);
  if (refused_for_good(st.error())) return refused(path, st.error());
  (void)path->state.change(ClientPathState::reconnecting);
  schedule_reconnect(path);
}

Result<Path*> Session::new_path(const PathSpec& spec) {
  const std::string name = spec.name();
  if (find(name) != nullptr) return errc(EEXIST);
  uint32_t slot = ClientSession::kMaxPaths;
  for (uint32_t i = 0; i < ClientSession::kMaxPaths; ++i) {
    if (paths[i].load() == nullptr) {
      slot = i;
      break;
    }
  }
  if (slot == ClientSession::kMaxPaths) return errc(ENOSPC);
  auto p = std::make_unique<Path>(this, slot, spec, nio);
  Path* raw = p.get();
  all_paths.push_back(std::move(p));
  paths[slot].store(raw, std::memory_order_release);
  if (npaths_hint.load() < slot + 1) npaths_hint.store(slot + 1, std::memory_order_release);
  return raw;
}

Path* Session::find(std::string_view name) const {
  for (auto& slot : paths) {
    Path* p = slot.load(std::memory_order_acquire);
    if (p != nullptr && p->name == name) return p;
  }
  return nullptr;
}

// Worker: closes a path on request; it ends CLOSED (disconnect) or DEAD (remove).
Status Session::close_path(Path* path, ClientPathState final_state) {
  const auto prev = path->state.get();
  if (uint64_t t = path->reconnect_timer.exchange(0)) svc_poller->cancel_timer(t);
  path->gen.fetch_add(1);  // stale reconnect timers and failure reports find another generation
  if (prev != ClientPathState::closed) {
    if (!path->state.change(ClientPathState::closing).ok()) return errc(EBUSY);
    teardown(path);
    (void)path->state.change(ClientPathState::closed);
    if (prev == ClientPathState::connected) on_path_down(path, errc(ESHUTDOWN));
  }
  if (final_state == ClientPathState::dead) {
    (void)path->state.change(ClientPathState::dead);
    paths[path->slot].store(nullptr, std::memory_order_release);
  }
  if (!any_path_may_return()) run_pending(true, ENOTCONN);
  return {};
}

Status Session::open_paths() {
  std::error_code first_err;
  std::vector<Path*> failed;
  for (const auto& spec : opts.paths) {
    BASE_ASSIGN_OR_RETURN(Path * p, new_path(spec));
    auto st = establish(p);
    if (st.ok()) {
      on_path_up(p);
    } else {
      if (!first_err) first_err = st.error();
      BASE_LOG(warn, "path %s: %s", p->name.c_str(), errstr(st.error()).c_str());
      {
        std::lock_guard meta_lock(p->meta_mu);
        p->last_error = st.error();
      }
      teardown(p);
      (void)p->state.change(ClientPathState::connecting_err);
      failed.push_back(p);
    }
  }
  if (connected_paths.load() == 0) return first_err ? first_err : errc(ENOTCONN);
  // The session is up; paths that did not connect keep trying in the background, except those
  // the server refused: retrying the same credentials cannot help.
  for (Path* p : failed) {
    std::error_code e;
    {
      std::lock_guard meta_lock(p->meta_mu);
      e = p->last_error;
    }
    if (refused_for_good(e)) {
      refused(p, e);
      continue;
    }
    (void)p->state.change(ClientPathState::reconnecting);
    schedule_reconnect(p);
  }
  return {};
}

void Session::give_back(Con* c) {
  (void)c->cq->arm();
  // Armed: anything completing from here on signals the fd. What completed before is ours.
  Completion wcs[32];
  for (size_t n; (n = c->cq->poll(std::span(wcs, 32))) > 0;) {
    c->on_completions(std::span(wcs, n));
    if (n < 32) break;
  }
  c->poller->set_muted(c->cq.get(), false);
  c->lease.set(core::CqLease::free);
}

ReapPort::~ReapPort() {
  if (evfd >= 0) ::close(evfd);
}

void ReapPort::wake() const {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t r = ::write(evfd, &one, sizeof(one));
}

Session::~Session() {
  closing.store(true);
  {
    // Reapers stop borrowing, and one inside reap() returns; CQs they hold lent_idle are
    // seized by the teardown below.
    std::lock_guard lock(reap_mu);
    for (auto& port : reapers) {
      if (!port) continue;
      port->closed.store(true, std::memory_order_seq_cst);
      port->wake();
    }
  }
  for (auto& port : reapers) {
    while (port && port->inside.load(std::memory_order_seq_cst) != 0) std::this_thread::yield();
  }
  if (cancel_fd >= 0) {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t r = ::write(cancel_fd, &one, sizeof(one));
  }
  for (auto& p : all_paths) {
    std::lock_guard lock(p->info_mu);
    p->info_cv.notify_all();
  }
  if (permits) permits->close();
  if (worker) {
    worker->call([this] {
      for (auto& p : all_paths) {
        if (uint64_t t = p->reconnect_timer.exchange(0)) svc_poller->cancel_timer(t);
        p->gen.fetch_add(1);
        (void)p->state.change(ClientPathState::closing);
        teardown(p.get());
        (void)p->state.change(ClientPathState::closed);
      }
      run_pending(true, ECONNABORTED);
      return 0;
    });
    worker->stop();
  }
  if (svc_poller) {
    svc_poller->run_sync([] {});  // a running tick has re-armed by now, or saw `closing`
    if (uint64_t t = tick_timer.load()) svc_poller->cancel_timer(t);
  }
  io_pollers.clear();
  svc_poller.reset();
  {
    // Every connection is gone; what lived in the session's domains goes before them.
    std::lock_guard lock(mem_mu);
    for (auto& mr : iu_mrs) mr.reset();
    for (auto& w : wins) w.reset();
  }
  if (iu != nullptr) ::munmap(iu, iu_len);
  if (cancel_fd >= 0) ::close(cancel_fd);
}

}  // namespace client

// ------------------------------------------------------------------------------------------
// Public API

std::string_view to_string(SessionEvent e) {
  switch (e) {
    case SessionEvent::path_up: return "path_up";
    case SessionEvent::path_down: return "path_down";
    case SessionEvent::disconnected: return "disconnected";
    case SessionEvent::reconnected: return "reconnected";
  }
  return "?";
}

RegisteredMemory::~RegisteredMemory() {
  for (auto& sh : impl_->shares) {
    Impl* o = sh.load(std::memory_order_acquire);
    if (o == nullptr) continue;
    {
      std::lock_guard lock(o->session->mem_mu);
      std::erase(o->session->regions, o);
    }
    delete o;
  }
  client::Session* s = impl_->session;
  {
    std::lock_guard lock(s->mem_mu);
    std::erase(s->regions, impl_);
  }
  const bool owned = impl_->owned;
  delete impl_;  // deregisters from every device
  if (owned) ::munmap(addr_, (size_ + 4095) & ~size_t{4095});
}

ClientSession::ClientSession(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ClientSession::~ClientSession() = default;

Result<std::unique_ptr<ClientSession>> ClientSession::open(ClientOptions options) {
  if (!client::printable_name(options.session_name) || options.paths.empty() ||
      options.paths.size() > kMaxPaths || options.heartbeat.interval.count() <= 0 ||
      options.heartbeat.missed_max == 0)
    return errc(EINVAL);
  if (options.auth.enabled() && (!valid_host_id(options.auth.host_id) || options.auth.key->empty() ||
                                 (options.auth.server_key && options.auth.server_key->empty())))
    return errc(EINVAL);
  auto impl = std::make_unique<Impl>();
  impl->opts = std::move(options);
  if (impl->opts.tls.mode != tls::Options::Mode::off) {
    BASE_ASSIGN_OR_RETURN(impl->tls_ctx, client::make_tls_context(impl->opts));
  }
  const uint32_t hw = std::max(1u, std::thread::hardware_concurrency());
  impl->nio = impl->opts.io_threads ? impl->opts.io_threads : std::min(hw, 8u);
  if (impl->nio > 64) return errc(EINVAL);
  impl->max_reconnect_attempts.store(impl->opts.reconnect.max_attempts);
  impl->policy.store(impl->opts.policy);
  impl->uuid = Uuid16::random();
  std::memcpy(impl->uuid_bytes.data(), impl->uuid.bytes, 16);
  for (uint32_t i = 0; i < impl->nio; ++i) {
    BASE_ASSIGN_OR_RETURN(auto p, core::Poller::start("ibtrs-c-io" + std::to_string(i), i,
                                                       impl->opts.busy_poll ? core::PollMode::spin : core::PollMode::block));
    impl->io_pollers.push_back(std::move(p));
  }
  BASE_ASSIGN_OR_RETURN(impl->svc_poller, core::Poller::start("ibtrs-c-svc", impl->nio, core::PollMode::block));
  impl->cancel_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (impl->cancel_fd < 0) return errc(errno);
  impl->worker = std::make_unique<base::Worker>();
  Impl* s = impl.get();
  BASE_TRY(s->worker->call([s] { return s->open_paths(); }));
  // A periodic tick for parked requests' deadlines.
  struct Ticker {
    static void arm(Impl* s) {
      s->tick_timer = s->svc_poller->add_timer(core::Clock::now() + client::kTick, [s] {
        bool any;
        {
          std::lock_guard lock(s->pend_mu);
          // Fences with only kept chunks too: run_pending asks for them again (fence_kick).
          any = !s->pending.empty() || s->fence_waiting.load(std::memory_order_acquire) != 0 ||
                s->fence_kept.load(std::memory_order_acquire) != 0;
        }
        if (any) {
          // Deadlines here, not behind the worker: it may sit in a connect for up to
          // connect_timeout (a server holding it while the session's predecessor drains).
          s->expire_parked();
          s->worker->post([s] { s->run_pending(false, 0); });
        }
        if (!s->closing.load()) arm(s);
      });
    }
  };
  Ticker::arm(s);
  return std::unique_ptr<ClientSession>(new ClientSession(std::move(impl)));
}

Status ClientSession::request(const IoRequest& req, PermitWait wait) { return impl_->submit(req, wait); }

void ClientSession::begin_batch() {
  client::Plug& pl = client::tl_plug;
  if (pl.depth > 0 && pl.s != impl_.get()) return;  // another session's batch is open
  if (pl.depth == 0) pl.last_path = nullptr;
  pl.s = impl_.get();
  ++pl.depth;
}

void ClientSession::end_batch() {
  client::Plug& pl = client::tl_plug;
  if (pl.s != impl_.get() || pl.depth == 0 || --pl.depth > 0) return;
  client::flush_plug(pl);
  pl.s = nullptr;
  pl.last_path = nullptr;
}

// ------------------------------------------------------------------------------------------
// Caller-reaped completions

struct CompletionReaper::Impl {
  client::Session* s = nullptr;
  std::shared_ptr<client::ReapPort> port;
  // The CQs held during one reap() (one per path at most; masks of their indices are uint32_t).
  static_assert(ClientSession::kMaxPaths <= 32);
  Con* held[ClientSession::kMaxPaths];
  uint32_t nheld = 0;
  // CQs of connected paths that borrow() left to the poller (it was in a pass over them): their
  // completions run there and raise no event of ours, so a wait must not be endless.
  uint32_t missed = 0;
  // fd(): an epoll set over the fds of the CQs this reaper holds, lent or lent_idle. A CQ joins
  // when it is borrowed from the poller and leaves when it is given back; one the poller
  // reclaims from lent_idle stays in the set (we are not told), which only costs a spurious
  // wake-up and a re-borrow, and leaves by itself when the CQ is destroyed (closing an fd takes
  // it out of every epoll set). -1 until fd() is called: the set costs nothing before.
  int epfd = -1;

  ~Impl() {
    if (epfd >= 0) ::close(epfd);
  }

  void watch(Con* c) {
    if (epfd < 0) return;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = c;
    ::epoll_ctl(epfd, EPOLL_CTL_ADD, c->cq->fd(), &ev);  // EEXIST: still there from before
  }
  void give_back(Con* c) {
    if (epfd >= 0) ::epoll_ctl(epfd, EPOLL_CTL_DEL, c->cq->fd(), nullptr);
    s->give_back(c);
  }

  // Takes this reaper's CQ of every CONNECTED path: from its idle lease without a system call,
  // or from the poller (then mutes it there). The poller holds a CQ only for one pass over it
  // (or a teardown task): waited for briefly, then left to it this time (its completions run
  // there, and the caller's wake() ends our wait).
  void borrow() {
    nheld = 0;
    missed = 0;
    const uint32_t n = s->npaths_hint.load(std::memory_order_acquire);
    for (uint32_t i = 0; i < n; ++i) {
      Path* pa = s->paths[i].load(std::memory_order_acquire);
      if (pa == nullptr) continue;
      Con* c = pa->io_con(port->ci);
      for (int spin = 0; spin < 256 && c->lease.state() == core::CqLease::poller; ++spin)
        __builtin_ia32_pause();
      if (c->lease.take(core::CqLease::lent_idle, core::CqLease::lent)) {
        // The gate is closed from teardown until the next incarnation is up: such a CQ goes
        // back (teardown seizes it); the CQ object itself stays valid while we hold the lease.
        if (!c->gate.is_open()) {
          give_back(c);
          continue;
        }
      } else if (c->lease.take(core::CqLease::free, core::CqLease::lent)) {
        // Checked before touching c->cq: with the gate closed the worker may be replacing it.
        if (!c->gate.is_open()) {
          c->lease.set(core::CqLease::free);
          continue;
        }
        c->poller->set_muted(c->cq.get(), true);
        watch(c);
      } else {
        ++missed;
        continue;
      }
      held[nheld++] = c;
    }
  }

  // `only`: a mask of held[] indices to poll (a level-triggered CQ whose fd was not readable has
  // nothing: its poll would be a readv that finds nothing).
  size_t poll_held(uint32_t only = ~0u) {
    Completion wcs[32];
    size_t total = 0;
    for (uint32_t i = 0; i < nheld; ++i) {
      if ((only >> i & 1u) == 0) continue;
      Con* c = held[i];
      for (size_t n; (n = c->cq->poll(std::span(wcs, 32))) > 0;) {
        c->on_completions(std::span(wcs, n));
        total += n;
        if (n < 32) break;
      }
    }
    return total;
  }

  // Idle leases for the next call, or back to the pollers when the connection is going away
  // or the session is closing.
  void release() {
    const bool closing = port->closed.load(std::memory_order_acquire);
    const int64_t now = core::Clock::now().time_since_epoch().count();
    for (uint32_t i = 0; i < nheld; ++i) {
      Con* c = held[i];
      if (closing || !c->gate.is_open()) {
        give_back(c);
        continue;
      }
      // Sends what callbacks posted in a batch of ours and acks owed (tcp), and asks for an
      // event (rdma), so that the poller, should it reclaim the CQ, misses nothing.
      (void)c->cq->arm();
      // The caller waits on fd() next, not inside reap(): what completed between the last poll
      // and arm() raised no event, so it is looked for now (the verbs protocol's second poll).
      // A level-triggered CQ's fd says so by itself.
      if (epfd >= 0 && !c->cq->level_triggered()) {
        Completion wcs[32];
        for (size_t n; (n = c->cq->poll(std::span(wcs, 32))) > 0;) {
          c->on_completions(std::span(wcs, n));
          (void)c->cq->arm();
        }
      }
      c->lease.idle(now);
    }
    nheld = 0;
  }

  bool must_return() const {
    if (port->closed.load(std::memory_order_acquire)) return true;
    for (uint32_t i = 0; i < nheld; ++i) {
      if (!held[i]->gate.is_open()) return true;
    }
    return false;
  }

  // Blocks on the held CQs' fds and the wake-up eventfd; `forever`: with no timer (arming and
  // cancelling one is a cost of every blocking wait, a VM exit each where the guest's timer
  // is emulated). Returns the mask of held[] indices whose fd was readable.
  uint32_t block(std::chrono::microseconds wait, bool forever) {
    pollfd pfds[ClientSession::kMaxPaths + 1];
    uint32_t n = 0;
    for (uint32_t i = 0; i < nheld; ++i) pfds[n++] = pollfd{held[i]->cq->fd(), POLLIN, 0};
    pfds[n++] = pollfd{port->evfd, POLLIN, 0};
    const auto us = wait.count();
    timespec ts{static_cast<time_t>(us / 1000000), static_cast<long>(us % 1000000) * 1000};
    if (::ppoll(pfds, n, forever ? nullptr : &ts, nullptr) <= 0) return 0;
    if (pfds[n - 1].revents != 0) {
      uint64_t v;
      [[maybe_unused]] ssize_t r = ::read(port->evfd, &v, sizeof(v));
    }
    uint32_t ready = 0;
    for (uint32_t i = 0; i < nheld; ++i) {
      if (pfds[i].revents == 0) continue;
      held[i]->cq->ack_events();
      ready |= 1u << i;
    }
    return ready;
  }
};

CompletionReaper::CompletionReaper(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CompletionReaper::~CompletionReaper() {
  client::ReapPort& port = *impl_->port;
  if (port.closed.load(std::memory_order_acquire)) return;  // the session closes or is gone
  client::Session* s = impl_->s;
  std::lock_guard lock(s->reap_mu);
  if (port.closed.load(std::memory_order_acquire)) return;
  for (auto& slot : s->paths) {
    Path* pa = slot.load(std::memory_order_acquire);
    if (pa == nullptr) continue;
    Con* c = pa->io_con(port.ci);
    if (c->lease.take(core::CqLease::lent_idle, core::CqLease::lent)) s->give_back(c);
  }
  s->reapers[port.ci].reset();
}

namespace {
// How long reap() waits at most while a CQ it could not borrow is the poller's (the poller
// holds a CQ for one pass over it: microseconds, longer under a sanitizer or a loaded host).
constexpr std::chrono::microseconds kMissedCqWait{1000};
}  // namespace

Result<size_t> CompletionReaper::reap(std::chrono::microseconds wait) {
  if (client::tl_plug.depth > 0) return errc(EDEADLK);
  Impl& m = *impl_;
  client::ReapPort& port = *m.port;
  port.inside.fetch_add(1, std::memory_order_seq_cst);
  if (port.closed.load(std::memory_order_seq_cst)) {
    port.inside.fetch_sub(1, std::memory_order_seq_cst);
    return errc(ESHUTDOWN);
  }
  // on_completions marks this thread as the IO thread of the connection for the callbacks it
  // runs (a resubmission stays on it); outside reap() the thread is a user thread again.
  const client::Session* saved_session = client::tl_session;
  const uint32_t saved_poller = client::tl_poller;
  const size_t finished0 = client::tl_finished;
  m.borrow();
  // Level-triggered CQs (tcp) are waited on straight away: their fd says whether a poll would
  // find anything, and each poll that finds nothing is a readv (at QD1 that was 1.7 of 4.6
  // system calls per IO).
  bool level = true;
  for (uint32_t i = 0; i < m.nheld; ++i) level = level && m.held[i]->cq->level_triggered();
  const bool block = wait.count() > 0;
  // A CQ left to the poller this time is not in our wait: a wait without end would end only on
  // wake(), so it is cut to a tick and the caller looks again (borrowing the CQ then).
  if (m.missed > 0 && wait > kMissedCqWait) wait = kMissedCqWait;
  const bool forever = wait == std::chrono::microseconds::max();
  // Waited on through fd(): the events that made it readable are consumed here (a verbs
  // completion channel stays readable until they are read).
  if (m.epfd >= 0 && !block) {
    for (uint32_t i = 0; i < m.nheld; ++i)
      if (!m.held[i]->cq->level_triggered()) m.held[i]->cq->ack_events();
  }
  size_t got = block && level ? 0 : m.poll_held();
  if (got == 0 && block) {
    const auto deadline = forever ? core::Clock::time_point::max() : core::Clock::now() + wait;
    while (!m.must_return()) {
      // Verbs protocol: arm, poll again to close the race, then wait for the fds.
      for (uint32_t i = 0; i < m.nheld; ++i) (void)m.held[i]->cq->arm();
      if (!level && (got = m.poll_held()) > 0) break;
      auto left = wait;
      if (!forever) {
        left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - core::Clock::now());
        if (left.count() <= 0) break;
      }
      const uint32_t ready = m.block(left, forever);
      // Woken: by a completion fd, wake(), a teardown or the close; any of them ends the call
      // once the CQs have been looked at (a wake-up is the caller's to interpret). With two
      // paths a completion on one would otherwise cost a readv on the other too; release()
      // still arms every held CQ, which sends what each owes.
      got = m.poll_held(level ? ready : ~0u);
      break;
    }
  }
  m.release();
  client::tl_session = saved_session;
  client::tl_poller = saved_poller;
  const size_t ran = client::tl_finished - finished0;
  port.inside.fetch_sub(1, std::memory_order_seq_cst);
  (void)got;
  return ran;
}

void CompletionReaper::wake() { impl_->port->wake(); }

Result<int> CompletionReaper::fd() {
  Impl& m = *impl_;
  if (m.epfd >= 0) return m.epfd;
  const int fd = ::epoll_create1(EPOLL_CLOEXEC);
  if (fd < 0) return errc(errno);
  // CQs held lent_idle from earlier calls never joined the set: back to their pollers, to be
  // borrowed (and watched) by the next reap().
  client::ReapPort& port = *m.port;
  if (!port.closed.load(std::memory_order_acquire)) {
    std::lock_guard lock(m.s->reap_mu);
    if (!port.closed.load(std::memory_order_acquire)) {
      for (auto& slot : m.s->paths) {
        Path* pa = slot.load(std::memory_order_acquire);
        if (pa == nullptr) continue;
        Con* c = pa->io_con(port.ci);
        if (c->lease.take(core::CqLease::lent_idle, core::CqLease::lent)) m.s->give_back(c);
      }
    }
  }
  m.epfd = fd;
  return fd;
}

Result<std::unique_ptr<CompletionReaper>> ClientSession::make_reaper() {
  Impl* s = impl_.get();
  if (s->closing.load(std::memory_order_acquire)) return errc(ESHUTDOWN);
  const uint32_t ci = client::thread_slot(*s).ci;
  auto port = std::make_shared<client::ReapPort>();
  port->ci = ci;
  port->evfd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (port->evfd < 0) return errc(errno);
  auto impl = std::make_unique<CompletionReaper::Impl>();
  impl->s = s;
  impl->port = port;
  {
    std::lock_guard lock(s->reap_mu);
    if (s->reapers[ci]) return errc(EBUSY);
    s->reapers[ci] = std::move(port);
  }
  return std::unique_ptr<CompletionReaper>(new CompletionReaper(std::move(impl)));
}

Result<std::unique_ptr<RegisteredMemory>> ClientSession::register_memory(void* addr, size_t size) {
  if (addr == nullptr || size == 0) return errc(EINVAL);
  auto mi = std::make_unique<RegisteredMemory::Impl>();
  mi->session = impl_.get();
  mi->addr = addr;
  mi->size = size;
  std::lock_guard lock(impl_->mem_mu);
  for (uint32_t i = 0; i < kMaxDomains; ++i) {
    if (impl_->devices[i].load() == nullptr) continue;
    BASE_ASSIGN_OR_RETURN(auto mr,
                           impl_->pds[i]->register_memory(addr, size, impl_->user_access(i)));
    mi->mrs[i].store(mr.get(), std::memory_order_release);
    mi->keep.push_back(std::move(mr));
  }
  impl_->regions.push_back(mi.get());
  auto* raw = mi.release();
  std::unique_ptr<RegisteredMemory> h(new RegisteredMemory(addr, size, raw));
  return h;
}

Status ClientSession::share_memory(const RegisteredMemory& mem) {
  RegisteredMemory::Impl* owner = mem.impl();
  if (owner->session == impl_.get()) return errc(EINVAL);
  for (auto& sh : owner->shares) {
    const RegisteredMemory::Impl* o = sh.load(std::memory_order_acquire);
    if (o != nullptr && o->session == impl_.get()) return errc(EEXIST);
  }
  auto mi = std::make_unique<RegisteredMemory::Impl>();
  mi->session = impl_.get();
  mi->addr = owner->addr;
  mi->size = owner->size;
  std::lock_guard lock(impl_->mem_mu);
  for (uint32_t i = 0; i < kMaxDomains; ++i) {
    if (impl_->devices[i].load() == nullptr) continue;
    BASE_ASSIGN_OR_RETURN(auto mr, impl_->pds[i]->register_memory(owner->addr, owner->size,
                                                                   impl_->user_access(i)));
    mi->mrs[i].store(mr.get(), std::memory_order_release);
    mi->keep.push_back(std::move(mr));
  }
  for (auto& sh : owner->shares) {
    RegisteredMemory::Impl* expected = nullptr;
    if (sh.compare_exchange_strong(expected, mi.get(), std::memory_order_acq_rel)) {
      impl_->regions.push_back(mi.release());
      return {};
    }
  }
  return errc(ENOSPC);
}

void ClientSession::fail_waiting(std::function<bool(IoDoneFn, void*)> which, int err) {
  Impl* s = impl_.get();
  (void)s->worker->call([s, &which, err] {
    s->fail_parked(which, err);
    return Status{};
  });
}

Result<std::unique_ptr<RegisteredMemory>> ClientSession::alloc_buffer(size_t size) {
  if (size == 0) return errc(EINVAL);
  const size_t len = (size + 4095) & ~size_t{4095};
  void* m = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return errc(ENOMEM);
  auto r = register_memory(m, size);
  if (!r.ok()) {
    ::munmap(m, len);
    return r.error();
  }
  (*r)->impl()->owned = true;
  return r;
}

uint32_t ClientSession::queue_depth() const { return impl_->geo.queue_depth; }
uint32_t ClientSession::max_io_size() const { return impl_->geo.max_io_size; }
uint32_t ClientSession::max_usr_len(IoDir dir, size_t segments) const {
  const size_t msg = dir == IoDir::write
                         ? sizeof(proto::WriteMsg)
                         : sizeof(proto::ReadMsgHeader) + segments * sizeof(proto::BufDesc);
  return impl_->geo.max_hdr_size > msg ? static_cast<uint32_t>(impl_->geo.max_hdr_size - msg) : 0;
}
uint32_t ClientSession::free_permits() const {
  return impl_->permits->depth() - impl_->permits->in_use();
}
const std::string& ClientSession::name() const { return impl_->opts.session_name; }
const Uuid16& ClientSession::uuid() const { return impl_->uuid; }

Status ClientSession::add_path(const PathSpec& spec) {
  Impl* s = impl_.get();
  return s->worker->call([s, &spec]() -> Status {
    BASE_ASSIGN_OR_RETURN(client::Path * p, s->new_path(spec));
    auto st = s->establish(p);
    if (st.ok()) {
      s->on_path_up(p);
      return {};
    }
    s->teardown(p);
    (void)p->state.change(ClientPathState::connecting_err);
    (void)p->state.change(ClientPathState::closing);
    (void)p->state.change(ClientPathState::closed);
    (void)p->state.change(ClientPathState::dead);
    s->paths[p->slot].store(nullptr, std::memory_order_release);
    return st;
  });
}

Status ClientSession::remove_path(std::string_view name) {
  Impl* s = impl_.get();
  return s->worker->call([s, name]() -> Status {
    client::Path* p = s->find(name);
    if (p == nullptr) return errc(ENOENT);
    size_t others = 0;
    for (auto& slot : s->paths) {
      auto* q = slot.load();
      if (q != nullptr && q != p) ++others;
    }
    if (others == 0) return errc(EBUSY);
    return s->close_path(p, ClientPathState::dead);
  });
}

Status ClientSession::disconnect_path(std::string_view name) {
  Impl* s = impl_.get();
  return s->worker->call([s, name]() -> Status {
    client::Path* p = s->find(name);
    if (p == nullptr) return errc(ENOENT);
    return s->close_path(p, ClientPathState::closed);
  });
}

Status ClientSession::reconnect_path(std::string_view name) {
  Impl* s = impl_.get();
  return s->worker->call([s, name]() -> Status {
    client::Path* p = s->find(name);
    if (p == nullptr) return errc(ENOENT);
    if (p->state.get() != ClientPathState::closed) BASE_TRY(s->close_path(p, ClientPathState::closed));
    BASE_TRY(p->state.change(ClientPathState::reconnecting));
    BASE_TRY(p->state.change(ClientPathState::connecting));
    ++p->recon_cnt;
    p->sched.reset();
    auto st = s->establish(p);
    if (st.ok()) {
      p->stats.on_reconnect(true);
      s->on_path_up(p);
      return {};
    }
    p->stats.on_reconnect(false);
    {
      std::lock_guard meta_lock(p->meta_mu);
      p->last_error = st.error();
    }
    s->teardown(p);
    (void)p->state.change(ClientPathState::connecting_err);
    (void)p->state.change(ClientPathState::reconnecting);
    s->schedule_reconnect(p);
    return st;
  });
}

Status ClientSession::set_policy(MpPolicy policy) {
  impl_->policy.store(policy);
  return {};
}
MpPolicy ClientSession::policy() const { return impl_->policy.load(); }

Status ClientSession::set_max_reconnect_attempts(int32_t attempts) {
  if (attempts < -1 || attempts > 9999) return errc(EINVAL);
  impl_->max_reconnect_attempts.store(attempts);
  Impl* s = impl_.get();
  return s->worker->call([s, attempts]() -> Status {
    s->opts.reconnect.max_attempts = attempts;
    for (auto& p : s->all_paths) {
      p->sched = core::ReconnectSchedule(s->opts.reconnect);
    }
    return {};
  });
}
int32_t ClientSession::max_reconnect_attempts() const { return impl_->max_reconnect_attempts.load(); }

std::vector<ClientPathInfo> ClientSession::paths() const {
  std::vector<ClientPathInfo> out;
  for (auto& slot : impl_->paths) {
    client::Path* p = slot.load(std::memory_order_acquire);
    if (p == nullptr) continue;
    ClientPathInfo i;
    i.name = p->name;
    i.spec = p->spec;
    i.state = p->state.get();
    i.fabric = p->spec.destination.fabric;
    {
      std::lock_guard lock(p->meta_mu);
      i.hca_name = p->hca_name;
      i.hca_port = p->hca_port;
      i.auth = p->auth;
      i.tls = p->tls;
      i.last_error = p->last_error;
    }
    i.recon_cnt = p->recon_cnt;
    i.latency = p->hb.latency();
    i.inflight = p->inflight.load();
    i.stats = p->stats.snapshot();
    i.fence.waited = p->fence_waited.load(std::memory_order_relaxed);
    i.fence.fenced = p->fences_done.load(std::memory_order_relaxed);
    i.fence.last_rtt = std::chrono::nanoseconds(p->fence_rtt_last_ns.load(std::memory_order_relaxed));
    i.fence.max_rtt = std::chrono::nanoseconds(p->fence_rtt_max_ns.load(std::memory_order_relaxed));
    out.push_back(std::move(i));
  }
  return out;
}

PathStatsSnapshot ClientSession::stats() const {
  PathStatsSnapshot total;
  for (auto& slot : impl_->paths) {
    client::Path* p = slot.load(std::memory_order_acquire);
    if (p != nullptr) total += p->stats.snapshot();
  }
  return total;
}

Status ClientSession::reset_stats(std::string_view path, StatsGroup group) {
  bool found = path.empty();
  for (auto& slot : impl_->paths) {
    client::Path* p = slot.load(std::memory_order_acquire);
    if (p == nullptr || (!path.empty() && p->name != path)) continue;
    p->stats.reset(group);
    if (group == StatsGroup::all || group == StatsGroup::fence) {
      p->fence_waited.store(0, std::memory_order_relaxed);
      p->fences_done.store(0, std::memory_order_relaxed);
      p->fence_rtt_last_ns.store(0, std::memory_order_relaxed);
      p->fence_rtt_max_ns.store(0, std::memory_order_relaxed);
    }
    found = true;
  }
  return found ? Status{} : Status{errc(ENOENT)};
}

}  // namespace ibtrs
