// The client's IO path (kernel: rtrs_clt_req, rtrs_clt_read_req, rtrs_clt_write_req; siw_qp_tx.c):
// a request from submit() through its post on a path (the policy's choice, its chunk set, its
// read windows, the thread's submission batch) to finish(), which runs its callback. Any
// thread. Structure in client_impl.h.
#include <algorithm>
#include <cstring>

#include "client/client_impl.h"
#include "base/log.h"

namespace ibtrs {

using fabric::Opcode;
using fabric::SendWr;
using fabric::Sge;

namespace client {

// The thread's part in the IO path (client_impl.h).
thread_local constinit const Session* tl_session = nullptr;
thread_local constinit uint32_t tl_poller = 0;
thread_local constinit size_t tl_finished = 0;
thread_local constinit Plug tl_plug;

namespace {

// The submitting thread's stats shard and IO connection: a session's own IO thread uses its own
// connection (a completion callback that resubmits stays local); other threads are spread over
// the connections and count in the last shard ("user threads").
struct ThreadSlot {
  uint32_t ci;
  uint32_t shard;
};
std::atomic<uint32_t> g_thread_seq{0};
thread_local uint32_t tl_seq = g_thread_seq.fetch_add(1, std::memory_order_relaxed);
thread_local size_t tl_cursor = 0;
thread_local uint32_t tl_spread = 0;
// The path this thread posted to last, and in which session (compared, never dereferenced):
// min-inflight breaks ties towards it (core::Stick).
thread_local const void* tl_last_path = nullptr;
thread_local const void* tl_last_session = nullptr;
// Data size from which a user thread's requests are spread over the IO connections.
constexpr uint64_t kSpreadBytes = 64 * 1024;

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

}  // namespace

uint32_t thread_ci(const Session& s) { return thread_slot(s).ci; }

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

}  // namespace client
}  // namespace ibtrs
