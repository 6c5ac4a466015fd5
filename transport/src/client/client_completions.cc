// The client's completions (kernel: rtrs_clt_rdma_done, rtrs_clt_rkey_rsp_done; siw_cq.c): what
// the CQ of a connection hands its lease holder (an IO poller, the service poller, or a reaper
// that borrowed it): IO responses, revoked read windows, RKEY_RSP, heartbeats, the service
// connection's messages; and, when the connection breaks, the failover of what it carried.
// Structure in client_impl.h.
#include <algorithm>
#include <cstring>

#include "client/client_impl.h"
#include "base/log.h"
#include "core/heartbeat_wr.h"

namespace ibtrs {

using fabric::Completion;
using fabric::Opcode;
using fabric::Sge;
using fabric::WcStatus;

namespace client {

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
      if (wr_kind(wc.wr_id) == kWrInv && s.geo_set.load(std::memory_order_acquire) &&
          wr_value(wc.wr_id) < s.geo.queue_depth)
        on_inv_done(static_cast<uint32_t>(wr_value(wc.wr_id)), shard);
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
      if (!take_rkey(static_cast<uint32_t>(wr_value(wc.wr_id)), wc.byte_len)) {
        BASE_LOG(warn, "path %s con %u: bad RKEY_RSP", path->name.c_str(), cid);
        why = errc(EPROTO);
      }
    } else if (wc.opcode == Opcode::recv) {
      // The establishment's messages (AUTH_*, INFO_RSP) arrive as SENDs on the service
      // connection, into the RECVs posted for them; after it only FENCE_RSP, into any RECV
      // (when the server offered the fence).
      ++recv_missing;
      const uint64_t part = wr_value(wc.wr_id);
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
      const size_t off = part == kSvcInfoRecv ? 0 : svc_auth_off(s.geo.queue_depth, part - kSvcAuthRecv);
      const size_t n = std::min<size_t>(wc.byte_len, part == kSvcInfoRecv ? info : kSvcSlot);
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
        if (wc.opcode == Opcode::local_inv && wr_kind(wc.wr_id) == kWrInv &&
            wr_value(wc.wr_id) < s.geo.queue_depth) {
          on_inv_done(static_cast<uint32_t>(wr_value(wc.wr_id)), poller->index());
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

}  // namespace client
}  // namespace ibtrs
