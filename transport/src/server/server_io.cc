// The IO path (poller threads, and complete() from anywhere): a request's chunk from its arrival
// to its response, and the connections' completions that drive it. Kept in one file so the
// compiler sees the whole path, as it did in one server.cc.
#include <algorithm>
#include <string>
#include <thread>

#include "base/log.h"
#include "core/heartbeat_wr.h"
#include "server/server_impl.h"

namespace ibtrs::server {

using namespace std::chrono_literals;

void Session::request_arrived(Con* c, uint32_t id, uint32_t offset) {
  Req& r = reqs[id];
  uint32_t st = r.state.load(std::memory_order_acquire);
  for (;;) {
    if (st == Req::kIdle) {
      if (r.state.compare_exchange_weak(st, Req::kBusy, std::memory_order_acq_rel)) {
        r.start(c, offset);
        return;
      }
    } else if (st == Req::kBusy) {
      // The chunk is still being served: a request failed over from another path while the old
      // copy is still with the upper layer. It runs when the old one completes. Counted before
      // the deferral is visible: the hand-off's request_done may follow at once.
      if (r.state.compare_exchange_weak(st, Req::kLocked, std::memory_order_acq_rel)) {
        r.deferred_con = c;
        r.deferred_offset = offset;
        inflight.fetch_add(1, std::memory_order_acq_rel);
        r.state.store(Req::kDeferred, std::memory_order_release);
        return;
      }
    } else if (st == Req::kDeferred) {
      if (r.state.compare_exchange_weak(st, Req::kLocked, std::memory_order_acq_rel)) {
        // A third copy while one waits. The waiting copy's connection closed (a broken path,
        // or one the client fenced before it sent this copy): that copy would be dropped at its
        // turn anyway, and this newer one, failed over twice, takes its place, with its count.
        // The old copy being served still runs first. While the waiting copy's connection is
        // live no honest client sends another: a protocol error.
        const bool waiting_live = r.deferred_con->gate.is_open();
        if (!waiting_live) {
          r.deferred_con = c;
          r.deferred_offset = offset;
        }
        r.state.store(Req::kDeferred, std::memory_order_release);
        if (!waiting_live) return;
        break;
      }
    } else {
      // kLocked: another thread is between two stores of a few instructions.
      std::this_thread::yield();
      st = r.state.load(std::memory_order_acquire);
    }
  }
  srv->protocol_error("session %s path %s: third request on busy chunk %u while the second waits",
                      name_.c_str(), c->path->name.c_str(), id);
  c->failed.store(true);
}

void Req::start(Con* c, uint32_t offset) {
  Session& ss = *s;
  if (ss.invalidate) {
    // Revoke the client's key before reading anything of the request: from here on its bytes
    // are the server's until the response hands out a new key.
    if (!c->gate.enter()) {
      give_up_chunk();
      return;
    }
    (void)c->path->chunk_mrs[chunk_id_]->revoke();
    c->gate.exit();
  }
  std::string why;
  const proto::SetGeometry g{ss.chunk_size, ss.max_hdr, ss.max_io};
  auto io = proto::parse_io_req(std::span<const std::byte>(ss.chunks, size_t{ss.qd} * ss.chunk_size), g,
                                chunk_id_, offset, copy, &why);
  if (!io.ok()) {
    ss.srv->protocol_error("session %s path %s: request in chunk %u refused: %s", ss.name_.c_str(),
                           c->path->name.c_str(), chunk_id_, why.c_str());
    c->failed.store(true);  // closes the path (the poller sees it after this batch)
    give_up_chunk();
    return;
  }
  con = c;
  start_ns = now_ns();
  shard = c->poller->index();
  io_thread_ = shard;
  // The parser's spans lie in the session's chunks (write: the data may start in a chunk before
  // this one; read: the data area may run into the chunks after it): the same bytes, writable.
  auto in_chunks = [&ss](std::span<const std::byte> d) {
    return std::span<std::byte>(ss.chunks + (d.data() - ss.chunks), d.size());
  };
  if (io->kind == proto::IoKind::write) {
    dir_ = IoDir::write;
    usr_ = io->write.usr;
    data_ = in_chunks(io->write.data);
    descs = {};
  } else {
    dir_ = IoDir::read;
    usr_ = io->read.usr;
    descs = io->read.descs;
    data_ = in_chunks(io->read.data);
  }
  bytes = data_.size();
  ss.inflight.fetch_add(1, std::memory_order_acq_rel);
  c->path->stats.on_submit(shard, dir_ == IoDir::write, bytes,
                           dir_ == IoDir::read ? static_cast<uint32_t>(descs.size()) : 1);
  ss.srv->opts.handler->on_request(*this);
}

void Req::complete(int err) {
  Session& ss = *s;
  Con* c = con;
  Path* p = c->path;
  p->stats.on_complete(shard, dir_ == IoDir::write,
                       static_cast<uint64_t>(std::max<int64_t>(0, now_ns() - start_ns)), shard);
  SendWr wrs[proto::kMaxReadDescs + 2];
  Sge sges[proto::kMaxReadDescs];
  size_t n = 0;
  if (dir_ == IoDir::read && err == 0) {
    uint64_t off = 0;
    for (size_t i = 0; i < descs.size(); ++i) {
      const uint32_t len = descs[i].len.get();
      sges[i] = Sge{reinterpret_cast<uint64_t>(data_.data() + off), len, p->chunk_lkey};
      SendWr& w = wrs[n++];
      w = SendWr{};
      w.wr_id = wr_id(kWrIo, chunk_id_);
      w.opcode = Opcode::write;
      w.sg_list = std::span(&sges[i], 1);
      w.remote_addr = descs[i].addr.get();
      w.rkey = descs[i].key.get();
      w.signaled = false;
      off += len;
    }
  }
  const size_t rkey_at = n;  // always_invalidate: the RKEY_RSP goes here, before the response
  if (ss.invalidate) ++n;
  SendWr& rsp = wrs[n++];
  rsp = SendWr{};
  rsp.wr_id = wr_id(kWrIo, chunk_id_);
  rsp.opcode = Opcode::write_with_imm;
  auto imm = proto::encode_io_rsp_imm(chunk_id_, err);
  const uint32_t plain_imm = imm.ok() ? *imm : 0;
  rsp.imm = plain_imm;
  if (ss.invalidate) rsp.imm = proto::make_imm(proto::ImmType::io_rsp_w_inv, proto::imm_payload(rsp.imm));
  rsp.signaled = c->sig.fetch_add(1, std::memory_order_relaxed) % kSignalEvery == 0;

  // Free the chunk before answering: the client reuses it only after the response, which the
  // connection delivers after the data writes have read it.
  uint32_t next_off = 0;
  Con* const next = release_chunk(&next_off);
  if (c->gate.enter()) {
    // Near a full send queue the response is signalled whatever its turn: should the next one
    // not fit, this completion is what retries it.
    if (c->conn->send_queue_free() < 2 * n + kSignalEvery) rsp.signaled = true;
    Sge rkey_sge;
    bool changed = true;
    if (!ss.invalidate || restore_key(c, wrs[rkey_at], rkey_sge, &changed)) {
      if (!changed) {
        // The client's key is valid again as it is: no RKEY_RSP, a plain response.
        wrs[rkey_at] = wrs[n - 1];
        wrs[rkey_at].imm = plain_imm;
        --n;
      }
      c->post_or_backlog(std::span(wrs, n));
    }
    c->gate.exit();
  }
  if (next != nullptr) hand_chunk(next, next_off);
  ss.request_done();
}

Con* Req::release_chunk(uint32_t* next_offset) {
  uint32_t st = kBusy;
  for (;;) {
    if (st == kBusy) {
      if (state.compare_exchange_weak(st, kIdle, std::memory_order_acq_rel)) return nullptr;
    } else if (st == kDeferred) {
      if (state.compare_exchange_weak(st, kLocked, std::memory_order_acq_rel)) {
        Con* next = deferred_con;
        *next_offset = deferred_offset;
        state.store(kBusy, std::memory_order_release);  // the deferred copy's now
        return next;
      }
    } else if (st == kLocked) {
      // A copy is being deferred (or replacing a deferred one): a few instructions.
      std::this_thread::yield();
      st = state.load(std::memory_order_acquire);
    } else {
      return nullptr;  // idle: only the chunk's holder releases it, so never
    }
  }
}

void Req::give_up_chunk() {
  uint32_t next_off = 0;
  if (Con* next = release_chunk(&next_off)) hand_chunk(next, next_off);
}

void Req::hand_chunk(Con* next, uint32_t offset) {
  Req* self = this;
  next->poller->post([self, next, offset] {
    self->run_deferred(next, offset);
    self->s->request_done();  // the deferral's own count
  });
}

void Req::run_deferred(Con* c, uint32_t offset) {
  // A copy that arrived on a connection closed since (a broken one, or a path fenced by
  // PATH_FENCE) never starts: its client fails it over, and after a fence the resent copy may
  // already have run, with newer writes after it. close_path closes the gate before it waits
  // for this poller, so a copy that saw it open has started by then.
  if (c->gate.is_open()) {
    start(c, offset);
    return;
  }
  // Another copy deferred behind this one meanwhile takes its turn, on its connection's poller.
  give_up_chunk();
}

bool Req::restore_key(Con* c, SendWr& wr, Sge& sge, bool* changed) {
  Session& ss = *s;
  Path* p = c->path;
  fabric::MemoryRegion& mr = *p->chunk_mrs[chunk_id_];
  // The key the client holds: still the region's on the software providers, where revoke()
  // keeps it; 0 on rdma, where it deregistered the region.
  const uint32_t before = mr.rkey();
  auto key = mr.restore();
  if (!key.ok()) {
    // Without a key the client cannot use the chunk on this path: let it fail over.
    BASE_LOG(warn, "session %s path %s: cannot re-key chunk %u: %s", ss.name_.c_str(),
              p->name.c_str(), chunk_id_, key.error().message().c_str());
    c->failed.store(true, std::memory_order_release);
    c->conn->disconnect();
    return false;
  }
  *changed = *key != before;
  if (!*changed) return true;
  proto::RkeyRsp& m = ss.rkey_msgs[chunk_id_];
  m.type.set(static_cast<uint16_t>(proto::MsgType::rkey_rsp));
  m.buf_id.set(static_cast<uint16_t>(chunk_id_));
  m.rkey.set(*key);
  sge = Sge{reinterpret_cast<uint64_t>(&m), sizeof(m), p->chunk_lkey};
  wr = SendWr{};
  wr.wr_id = wr_id(kWrIo, chunk_id_);
  wr.opcode = Opcode::send;
  wr.sg_list = std::span(&sge, 1);
  wr.signaled = false;
  return true;
}

void Session::request_done() {
  // Read before the decrement: the last one lets the worker's reap free this session.
  Impl* im = srv;
  if (inflight.fetch_sub(1, std::memory_order_acq_rel) == (kDetached | 1) && im != nullptr)
    im->worker->post([im] { im->reap(); });
}

void Con::post_or_backlog(std::span<const SendWr> wrs) {
  if (has_backlog.load(std::memory_order_acquire) || !conn->post_send(wrs).ok()) {
    if (conn->state() != fabric::ConnState::connected) return;  // the client fails it over
    std::lock_guard lock(bl_mu);
    // Keep a private copy: the request slot may be reused before the queue drains.
    std::vector<Sge> sg;
    for (const auto& w : wrs) sg.insert(sg.end(), w.sg_list.begin(), w.sg_list.end());
    backlog_sges.push_back(std::move(sg));
    std::vector<SendWr> copy(wrs.begin(), wrs.end());
    size_t k = 0;
    for (auto& w : copy) {
      w.sg_list = std::span(backlog_sges.back().data() + k, w.sg_list.size());
      k += w.sg_list.size();
    }
    if (backlog.empty()) bl_progress_ns = now_ns();
    backlog.push_back(std::move(copy));
    bl_size.store(static_cast<uint32_t>(backlog.size()), std::memory_order_release);
    has_backlog.store(true, std::memory_order_release);
    arm_backlog_timer();
  }
}

void Con::retry_backlog() {
  std::lock_guard lock(bl_mu);
  size_t moved = 0;
  while (!backlog.empty()) {
    // Signalled: its completion is what retries the rest, so what stays here never waits
    // behind unsignalled requests only.
    backlog.front().back().signaled = true;
    if (!conn->post_send(backlog.front()).ok()) break;
    backlog.pop_front();
    backlog_sges.pop_front();
    ++moved;
  }
  if (moved > 0) bl_progress_ns = now_ns();
  bl_size.store(static_cast<uint32_t>(backlog.size()), std::memory_order_release);
  if (backlog.empty()) has_backlog.store(false, std::memory_order_release);
}

void Con::arm_backlog_timer() {
  if (bl_timer != 0) return;
  // Often enough that a response left without a signalled send ahead of it waits little; the
  // timer runs only while responses wait.
  Con* self = this;
  bl_timer = poller->add_timer(core::Clock::now() + 5ms, [self] { self->check_backlog(); });
}

void Con::check_backlog() {
  {
    std::lock_guard lock(bl_mu);
    bl_timer = 0;
  }
  if (down || !gate.enter()) return;
  retry_backlog();
  const int64_t limit = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            path->s->srv->opts.ack_timeout).count();
  bool stalled = false;
  {
    std::lock_guard lock(bl_mu);
    if (!backlog.empty()) {
      stalled = now_ns() - bl_progress_ns > limit;
      if (!stalled) arm_backlog_timer();
    }
  }
  if (stalled) {
    cut_off(refusal::kAckTimeout, std::to_string(bl_size.load()) + " responses waited " +
                                      std::to_string(limit / 1000000) +
                                      " ms for the peer's acknowledgements");
  }
  gate.exit();
  if (!stalled) repost_recvs();
}

void Con::clear_backlog() {
  std::lock_guard lock(bl_mu);
  // Swapped out rather than cleared: a deque keeps its blocks.
  std::deque<std::vector<SendWr>>().swap(backlog);
  std::deque<std::vector<Sge>>().swap(backlog_sges);
  bl_size.store(0, std::memory_order_release);
  has_backlog.store(false, std::memory_order_release);
}

void Con::repost_recvs() {
  if (down || cid == 0 || bl_size.load(std::memory_order_acquire) >= path->s->qd) return;
  while (recv_missing >= kRepostBatch) {
    fabric::RecvWr rw[64];
    uint32_t n = std::min<uint32_t>(recv_missing, 64);
    for (uint32_t i = 0; i < n; ++i) rw[i] = fabric::RecvWr{wr_id(kWrRecv), {}};
    if (!conn->post_recv(std::span(rw, n)).ok()) return;
    recv_missing -= n;
  }
}

void Con::cut_off(std::string_view reason, const std::string& what) {
  if (failed.exchange(true, std::memory_order_acq_rel)) return;  // going down already
  Session& s = *path->s;
  s.srv->refusals.refuse(reason, "session " + s.name_ + " path " + path->name + " connection " +
                                     std::to_string(cid) + ": " + what);
  conn->disconnect();
}

void Con::on_completions(std::span<Completion> wcs) {
  Path* p = path;
  Session& s = *p->s;
  Impl& srv = *s.srv;
  p->stats.on_poll(poller->index(), static_cast<uint32_t>(wcs.size()));
  bool broken = false;
  uint32_t svc_slots[kSvcRecvs];
  uint32_t nsvc = 0;
  for (const Completion& wc : wcs) {
    if (down) break;
    if (wc.status != WcStatus::success) {
      if (wc.status != WcStatus::flush_error)
        BASE_LOG(warn, "session %s path %s con %u: %s", s.name_.c_str(), p->name.c_str(), cid,
                  std::string(fabric::to_string(wc.status)).c_str());
      broken = true;
      continue;
    }
    if (wc.opcode == Opcode::recv_rdma_with_imm) {
      if (cid == 0) svc_slots[nsvc++] = static_cast<uint32_t>(wr_value(wc.wr_id));
      else ++recv_missing;
      if (p->hb.missed() != 0) p->hb.on_imm();
      const uint32_t imm = wc.imm;
      switch (proto::imm_type(imm)) {
        case proto::ImmType::io_req: {
          const ServerPathState st = p->state.get();
          if (cid == 0 || st == ServerPathState::connecting) {
            srv.protocol_error("session %s path %s: IO request on %s", s.name_.c_str(),
                               p->name.c_str(), cid == 0 ? "the service connection" : "a path not connected");
            broken = true;
            break;
          }
          if (st != ServerPathState::connected) {
            // Closing (a fence, a broken connection, the admin): close_path set the state
            // before it waits for this poller, so completions polled in between go with the
            // path, unserved. The server's own teardown, not the peer's error: not a refusal.
            broken = true;
            break;
          }
          auto io = proto::decode_io_req_imm(s.layout, imm);
          if (io.chunk_id >= s.qd) {
            srv.protocol_error("session %s path %s: chunk id %u out of range", s.name_.c_str(),
                               p->name.c_str(), io.chunk_id);
            broken = true;
            break;
          }
          s.request_arrived(this, io.chunk_id, io.offset);
          break;
        }
        case proto::ImmType::hb_msg: {
          if (cid != 0) break;
          (void)core::post_heartbeat(*conn, proto::ImmType::hb_ack, wr_id(kWrSvc));
          break;
        }
        case proto::ImmType::hb_ack:
          p->hb.on_ack(core::Clock::now());
          break;
        default:
          srv.protocol_error("session %s path %s: unexpected immediate 0x%08x", s.name_.c_str(),
                             p->name.c_str(), imm);
          broken = true;
      }
    } else if (wc.opcode == Opcode::send && cid == 0 && wr_kind(wc.wr_id) == kWrSvc &&
               wr_value(wc.wr_id) != 0 && wr_value(wc.wr_id) <= kFenceSlots) {
      // A FENCE_RSP is with the client: its slot may take the next answer.
      fence_busy.fetch_and(~(1u << (wr_value(wc.wr_id) - 1)), std::memory_order_acq_rel);
    } else if (wc.opcode == Opcode::recv) {
      if (cid != 0) {
        srv.protocol_error("session %s path %s: message on an IO connection", s.name_.c_str(),
                           p->name.c_str());
        broken = true;
        continue;
      }
      const uint32_t slot = static_cast<uint32_t>(wr_value(wc.wr_id));
      svc_slots[nsvc++] = slot;
      const std::byte* b = svc_buf.get() + size_t{slot} * kSvcSlot;
      std::vector<std::byte> msg(b, b + std::min<uint32_t>(wc.byte_len, kSvcSlot));
      Impl* im = &srv;
      const uint64_t id = p->id;
      srv.worker->post([im, id, m = std::move(msg)]() mutable {
        if (Path* pp = im->lookup(id)) im->handle_info(pp, std::move(m));
      });
    }
  }
  if (broken || failed.load(std::memory_order_acquire)) {
    go_down();
    return;
  }
  if (down) return;
  // The backlog first: whether the peer may send more depends on what is left of it.
  if (has_backlog.load(std::memory_order_acquire) && gate.enter()) {
    retry_backlog();
    gate.exit();
  }
  // Repost what was consumed.
  if (cid == 0 && nsvc > 0) {
    fabric::RecvWr rw[kSvcRecvs];
    Sge sg[kSvcRecvs];
    for (uint32_t i = 0; i < nsvc; ++i) {
      sg[i] = svc_mr->sge(size_t{svc_slots[i]} * kSvcSlot, kSvcSlot);
      rw[i] = fabric::RecvWr{wr_id(kWrSvcRecv, svc_slots[i]), std::span(&sg[i], 1)};
    }
    (void)conn->post_recv(std::span(rw, nsvc));
  } else {
    repost_recvs();
  }
}

void Con::go_down() {
  if (down) return;
  down = true;
  failed.store(true);
  gate.close_and_wait();
  if (conn) conn->disconnect();
  clear_backlog();
  Impl* im = path->s->srv;
  const uint64_t id = path->id;
  im->worker->post([im, id] {
    if (Path* p = im->lookup(id)) im->close_path(p, "connection broken");
  });
}

}  // namespace ibtrs::server
