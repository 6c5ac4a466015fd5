// Private to the client: the session, its paths and connections (kernel: rtrs-clt.h).
//
// Files (one per concern, as rtrs-clt.c and siw split theirs):
//   client_io.cc           the IO path: submit, post on a path, read windows, finish
//   client_completions.cc  a connection's completions and its failover when it breaks
//   client_failover.cc     requests waiting for a path: parked, or held for a failover fence
//   client_connect.cc      a path's establishment: connections, INFO / AUTH handshake, teardown
//   client_path.cc         a path's life: open, up, failed, heartbeats, reconnect, close
//   client_mem.cc          protection domains, IUs, read windows, user registrations
//   client_reaper.cc       caller-reaped completions (CompletionReaper)
//   client_session.cc      the public API: open, close, batches, path control, statistics
// What the server shares (wr_id encoding, queue and slot sizes) is in core/wr_id.h.
//
// Threads of a session (io_threads = N):
//   IO pollers 0..N-1  own the CQ of connection cid = i + 1 of every path; complete requests,
//                      fail over the requests of a connection that broke
//   service poller     owns the CQs of the service connections (cid 0): INFO_RSP, heartbeats,
//                      timers (heartbeat ticks, reconnect delays, pending-request deadlines)
//   worker             path establishment and teardown, user control operations, events
//   reapers            user threads with a CompletionReaper: while one reaps, it holds the CQ
//                      of IO connection cid = ci + 1 of every path (its ci) through the CQ's
//                      lease (core::CqLease), and does what that IO poller would do with it
//
// Lifetimes: a path and its connection objects (ClientCon) live until the session is destroyed;
// a removed path is kept as a dead shell, so the IO path may hold a raw pointer to either without
// reference counting. What changes per incarnation (the fabric connection and CQ) is guarded by
// the connection's gate.
//
// Isolation: the session has its own protection domain per device; its connections, its IUs
// and the user's registrations live there, so no other session's server can reach them. User
// memory is registered without remote access: a read gives the server a memory window per
// segment, bound on the connection the read is posted on with a fresh key, and revoked when the
// response arrives, before the caller's callback runs (docs/protocol.md, "Read invalidation").
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "base/unique_fd.h"
#include "core/con_base.h"
#include "core/heartbeat.h"
#include "core/path_state.h"
#include "core/permits.h"
#include "core/poller.h"
#include "core/policy.h"
#include "core/stats.h"
#include "base/worker.h"
#include "core/wr_id.h"
#include "fabric/fabric.h"
#include "ibtrs/client.h"
#include "proto/ibtrs_proto.h"

namespace ibtrs {

inline constexpr size_t kMaxDomains = 8;  // devices one session spans (rdma ports + tcp)

namespace client {
struct Session;
}

struct RegisteredMemory::Impl {
  client::Session* session = nullptr;
  void* addr = nullptr;
  size_t size = 0;
  bool owned = false;  // alloc_buffer: free the memory with the handle
  // Per domain slot of the session (its protection domain on one device); set before any path
  // on that device carries IO.
  std::array<std::atomic<fabric::MemoryRegion*>, kMaxDomains> mrs{};
  std::vector<std::unique_ptr<fabric::MemoryRegion>> keep;  // owners of mrs (under mem_mu)
  // The same memory registered with other sessions (ClientSession::share_memory): each a
  // registration of its own session, owned by this one and freed with it. Set once by CAS;
  // the IO path of those sessions reads them (Session::region_of).
  static constexpr size_t kMaxShares = 3;
  std::array<std::atomic<Impl*>, kMaxShares> shares{};
};

namespace client {

struct Session;
struct Path;

// Work request ids and the sizes shared with the server (core/wr_id.h).
using core::kRepostBatch;
using core::kSignalEvery;
using core::kSvcRecvs;
using core::kSvcSends;
using core::kSvcSlot;
using core::kWrInv;
using core::kWrIo;
using core::kWrRecv;
using core::kWrSvc;
using core::wr_id;
using core::wr_kind;
using core::wr_value;

// The service connection's buffer: [INFO_RSP][AUTH slot 1][AUTH slot 2][INFO_REQ][AUTH_REPLY]
// [a PATH_FENCE slot per path], the AUTH slots kSvcSlot bytes each. RECVs that take a message
// say which part in their wr_id value: 1 INFO_RSP, 2 and 3 the AUTH slots (the server's
// AUTH_CHALLENGE and AUTH_SUCCESS / AUTH_FAILURE come before INFO_RSP).
inline constexpr uint64_t kSvcInfoRecv = 1;
inline constexpr uint64_t kSvcAuthRecv = 2;  // and 3
// After the establishment (kConRspFence): RECVs with a FENCE_RSP slot, value kSvcFenceRecv + slot.
inline constexpr uint64_t kSvcFenceRecv = 4;
// Where the parts lie, by the session's queue depth (INFO_RSP grows with it): AUTH slot `k`
// (0, 1), INFO_REQ, AUTH_REPLY, the PATH_FENCE slot of path slot `path_slot`; the buffer's size
// is svc_fence_off(qd, ClientSession::kMaxPaths).
inline size_t svc_auth_off(uint16_t qd, uint64_t k) { return proto::info_rsp_size(qd) + k * kSvcSlot; }
inline size_t svc_info_req_off(uint16_t qd) { return svc_auth_off(qd, 2); }
inline size_t svc_auth_reply_off(uint16_t qd) { return svc_info_req_off(qd) + sizeof(proto::InfoReq); }
inline size_t svc_fence_off(uint16_t qd, uint32_t path_slot) {
  return svc_auth_reply_off(qd) + sizeof(proto::AuthReply) + size_t{path_slot} * sizeof(proto::PathFence);
}
inline constexpr std::chrono::milliseconds kTick{100};  // pending-request deadlines

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(core::Clock::now().time_since_epoch())
      .count();
}

// One fabric connection of a path and the CQ it completes on. The fields marked "lease holder"
// belong to whoever holds the CQ's lease: its poller, or a reaper that borrowed it.
// path, cid, poller, cq, conn, gate, failed, down, sig, recv_missing: core::ConBase.
struct Con final : core::ConBase<Path> {
  uint32_t recv_depth = 0;
  // Service connection: one registered buffer for INFO_RSP (first RECV) and INFO_REQ.
  std::unique_ptr<std::byte[]> svc_buf;
  size_t svc_len = 0;
  std::unique_ptr<fabric::MemoryRegion> svc_mr;
  // IO connection of a session whose server re-keys chunks per IO (kConRspInvalidatePerIo):
  // every RECV gets a slot for an RKEY_RSP. RECVs complete in the order they were posted, so
  // slots are handed out round-robin and each is free again when its RECV completes.
  std::unique_ptr<proto::RkeyRsp[]> rkeys;
  std::unique_ptr<fabric::MemoryRegion> rkeys_mr;
  uint32_t rkeys_next = 0;  // lease holder (worker before the connection is attached)
  // Service connection of a server with kConRspFence: every RECV after the establishment's
  // gets a FENCE_RSP slot, handed out round-robin like `rkeys`.
  std::unique_ptr<proto::FenceRsp[]> fence_rsps;
  std::unique_ptr<fabric::MemoryRegion> fence_mr;

  void on_completions(std::span<fabric::Completion> wcs) override;
  // Lease holder: the connection is broken; disconnect, take what completed, fail over the rest.
  void go_down(std::error_code why);
  // Lease holder: the response of permit `p` arrived here. Finishes the request once its read
  // windows are revoked (at once, or when their LOCAL_INVs complete: on_inv_done).
  void on_io_rsp(uint32_t p, int err, uint32_t shard);
  void on_inv_done(uint32_t p, uint32_t shard);
  void repost_recvs();
  // The next RECV to post; `sge` backs its scatter list.
  fabric::RecvWr next_recv(fabric::Sge& sge);
  // Service connection: SENDs `msg` from its buffer at `off` (a place no other message in flight
  // uses). ENOTCONN when the connection is gone.
  Status send_svc(size_t off, std::span<const std::byte> msg);
  // An RKEY_RSP arrived in RECV slot `slot`: the chunk's new key on this path. False: malformed.
  bool take_rkey(uint32_t slot, uint32_t len);
};

struct ChunkRemote {
  uint64_t addr = 0;
  std::atomic<uint32_t> key{0};
};

struct Path {
  Session* s = nullptr;
  uint32_t slot = 0;
  PathSpec spec;
  std::string name;
  proto::Uuid uuid{};
  core::ClientPathStateMachine state{ClientPathState::connecting};
  std::atomic<uint64_t> gen{0};       // incarnation: bumped on every establishment
  std::atomic<uint16_t> recon_cnt{0};  // changed by the worker, read by paths()
  fabric::Domain* domain = nullptr;   // worker
  uint32_t dom = 0;                   // domain slot
  std::vector<std::unique_ptr<Con>> cons;  // [0] service, [1..N] IO; fixed for the path's life
  std::unique_ptr<ChunkRemote[]> chunks;   // per permit: where its chunk is on this path
  std::atomic<uint32_t> inflight{0};
  core::Heartbeat hb;
  core::ReconnectSchedule sched;
  core::PathStats stats;
  std::atomic<uint64_t> hb_timer{0};
  std::atomic<uint64_t> reconnect_timer{0};
  mutable std::mutex meta_mu;  // hca_name, hca_port, last_error: worker writes, paths() reads
  std::string hca_name;
  uint8_t hca_port = 0;
  std::error_code last_error;

  // The failover fence of this path's broken incarnations (ClientPathInfo::Fence).
  std::atomic<uint64_t> fence_waited{0}, fences_done{0}, fence_rtt_last_ns{0}, fence_rtt_max_ns{0};

  PathAuthInfo auth;  // under meta_mu
  tls::Info tls;      // under meta_mu: the service connection's, as established

  // Service messages (AUTH_*, INFO_RSP) handed from the service poller to the worker during
  // establishment, each copied once out of its RECV buffer.
  std::mutex info_mu;
  std::condition_variable info_cv;
  std::deque<std::vector<std::byte>> svc_msgs;

  Path(Session* sess, uint32_t slot, PathSpec spec, uint32_t io_threads);
  Con* io_con(uint32_t ci) const { return cons[1 + ci].get(); }
  bool usable() const { return state.get() == ClientPathState::connected; }
};

// One request slot per permit (kernel: rtrs_clt_io_req).
struct Req {
  std::atomic<Con*> con{nullptr};  // the connection it is posted on; claimed by CAS to finish
  IoDir dir = IoDir::read;
  IoDoneFn done = nullptr;
  void* ctx = nullptr;
  uint16_t usr_len = 0;
  uint8_t nseg = 0;
  uint32_t data_len = 0;
  // The request's chunk set (docs/protocol.md, "Chunk sets"): permits first..first+nchunks-1,
  // all held by it. The request lives in the slot the immediate names: the last of them for a
  // write (its message follows the data), `first` for a read. One chunk: first is the slot.
  uint32_t first = 0;
  uint32_t nchunks = 1;
  IoSeg segs[ClientSession::kMaxSegments];
  // Each segment's registration in this session (its own, or a share of another session's).
  const RegisteredMemory::Impl* regs[ClientSession::kMaxSegments] = {};
  int64_t start_ns = 0;
  uint32_t submit_shard = 0;
  uint32_t ci = 0;                 // IO connection index (same on every path)
  Path* path = nullptr;            // path of the current post (inflight accounting)
  int64_t pending_deadline_ns = 0;
  // Read windows of the current post: one per segment, bound on win_con (the connection the
  // read went to) in domain slot win_dom. Touched only by the request's current owner: the
  // poster, then the lease holder of win_con.
  uint8_t nwin = 0;
  uint32_t win_dom = 0;
  Con* win_con = nullptr;
  fabric::MemoryWindow* wins[ClientSession::kMaxSegments] = {};
  // The response arrived and LOCAL_INVs of its windows are on their way (rdma): the connection
  // that completes them, how many are left, and the response's errno.
  std::atomic<Con*> inv_con{nullptr};
  uint32_t inv_left = 0;
  int rsp_err = 0;
};

// A reaper's side that the session can reach (ClientSession::make_reaper): shared, so that a
// reaper may outlive its session and still know it is gone.
struct ReapPort {
  uint32_t ci = 0;     // the IO connection index it borrows on every path
  base::UniqueFd evfd;  // wake(): ends a blocking reap()
  std::atomic<bool> closed{false};    // the session is closing: reap() returns ESHUTDOWN
  std::atomic<uint32_t> inside{0};    // threads inside reap() (the session's close waits)
  ReapPort() = default;
  ReapPort(const ReapPort&) = delete;
  ReapPort& operator=(const ReapPort&) = delete;
  void wake() const;
};

struct Geometry {
  uint16_t queue_depth = 0;
  uint32_t chunk_size = 0;
  uint32_t max_hdr_size = 0;
  uint32_t max_io_size = 0;
  uint32_t flags = 0;
  proto::ImmLayout layout;
};

struct Session {
  ClientOptions opts;
  // TLS of the tcp paths (opts.tls), made once at open; null when off.
  std::shared_ptr<tls::Context> tls_ctx;
  uint32_t nio = 1;  // IO threads = IO connections per path
  Uuid16 uuid;
  proto::Uuid uuid_bytes{};

  std::vector<std::unique_ptr<core::Poller>> io_pollers;
  std::unique_ptr<core::Poller> svc_poller;
  std::unique_ptr<base::Worker> worker;

  // Geometry and what depends on it: set once, by the first path to connect (worker), before
  // any request can be submitted.
  std::atomic<bool> geo_set{false};
  Geometry geo;
  std::unique_ptr<core::PermitPool> permits;
  std::unique_ptr<Req[]> reqs;
  std::byte* iu = nullptr;  // queue_depth x max_hdr_size: user header + IO message per permit
  size_t iu_len = 0;

  // Domains and registrations (mem_mu for changes; the IO path reads the atomics, and the rest
  // of a slot only through a path on it, which the worker opens after setting the slot up).
  // A slot is one device (the fabric's domain for it) and the session's own protection domain
  // there, which holds everything the session registers on that device.
  std::mutex mem_mu;
  std::array<std::atomic<fabric::Domain*>, kMaxDomains> devices{};
  std::array<std::unique_ptr<fabric::Domain>, kMaxDomains> pds;
  std::array<std::unique_ptr<fabric::MemoryRegion>, kMaxDomains> iu_mrs;
  std::array<std::atomic<uint32_t>, kMaxDomains> iu_lkey{};
  std::vector<RegisteredMemory::Impl*> regions;
  // Read windows per slot, where the device has them (else user memory is registered for
  // remote write, as before windows): queue_depth x kMaxSegments, the first of each permit made
  // with the slot, the others on first use.
  std::array<bool, kMaxDomains> use_windows{};
  std::array<std::unique_ptr<std::unique_ptr<fabric::MemoryWindow>[]>, kMaxDomains> wins;

  // Paths: slots read by the IO path; changed by the worker.
  std::array<std::atomic<Path*>, ClientSession::kMaxPaths> paths{};
  std::vector<std::unique_ptr<Path>> all_paths;  // owners, incl. removed shells (worker)
  std::atomic<uint32_t> npaths_hint{0};          // slots in use are below this

  std::atomic<MpPolicy> policy{MpPolicy::min_inflight};
  std::atomic<int32_t> max_reconnect_attempts{-1};
  std::atomic<bool> closing{false};
  // Written once when the session closes: a connect in progress on the worker gives up at once
  // instead of waiting out connect_timeout (ConnectParams::cancel_fd).
  base::UniqueFd cancel_fd;
  std::atomic<uint32_t> connected_paths{0};
  bool was_disconnected = false;  // worker

  std::mutex pend_mu;
  std::deque<uint32_t> pending;  // permits waiting for a path

  // Requests failed over from a broken incarnation of a path, waiting until the server confirms
  // that incarnation fenced (docs/protocol.md, "Failover fence"): one entry per incarnation,
  // however many requests. They count as parked (pending_timeout applies).
  struct Fence {
    Path* path = nullptr;        // the broken path
    uint16_t recon = 0;          // its broken incarnation
    std::vector<uint32_t> reqs;  // permits of the waiting requests
    // Permits of requests that failed while they waited (pending_timeout, fail_waiting, no path
    // left): their callbacks ran, but their chunks stay unused until the fence is confirmed. An
    // old copy polled late at the server parses its chunk at its old offset: it must find its
    // own bytes there, not a newer request's, which it would take for a message.
    std::vector<uint32_t> kept;
    uint32_t failing = 0;        // taken out of `reqs`, callbacks running: they go into `kept`
    int64_t since_ns = 0;        // the first request's failover
    Path* carrier = nullptr;     // the path PATH_FENCE went over (nullptr: not sent yet)
    uint64_t carrier_gen = 0;    // the carrier's incarnation then
  };
  std::mutex fence_mu;
  std::vector<Fence> fences;                // (fence_mu)
  std::atomic<uint32_t> fence_waiting{0};   // requests in the fences' `reqs`
  std::atomic<uint32_t> fence_kept{0};      // permits in the fences' `kept`, or failing into it

  // Reapers by IO connection index (reap_mu; the control path only).
  std::mutex reap_mu;
  std::array<std::shared_ptr<ReapPort>, 64> reapers;
  std::atomic<uint64_t> tick_timer{0};

  ~Session();

  // ---- IO path (any thread) ----
  Status submit(const IoRequest& r, PermitWait wait);
  // Posts request `p` on a usable path other than `skip` when possible. False: no path took it.
  bool post(uint32_t p, Path* skip);
  // Completes request `p` (its callback, once) and returns its permits, unless `keep_permits`:
  // then its chunks stay taken (Fence::kept) and the caller hands them back later.
  void finish(uint32_t p, int err, uint32_t shard, bool keep_permits = false);
  void park(uint32_t p);
  bool fence_on() const { return (geo.flags & proto::kConRspFence) != 0; }
  // Lease holder of a connection of `path` that broke in incarnation `recon`: write `p` waits
  // for the fence of that incarnation (the first one has the service poller send PATH_FENCE).
  void fence_wait(uint32_t p, Path* path, uint16_t recon);
  bool any_path_may_return() const;
  // The registration of `m` that this session's requests use: `m` itself when it was made
  // here, else its share with this session; null when it has none (EINVAL at submit).
  const RegisteredMemory::Impl* region_of(const RegisteredMemory* m) const {
    const RegisteredMemory::Impl* i = m->impl();
    if (i->session == this) return i;
    for (auto& sh : i->shares) {
      const RegisteredMemory::Impl* o = sh.load(std::memory_order_acquire);
      if (o != nullptr && o->session == this) return o;
    }
    return nullptr;
  }

  // ---- worker ----
  Status open_paths();
  Result<Path*> new_path(const PathSpec& spec);
  Status establish(Path* path);
  // The next service message of the establishment, or ETIMEDOUT (deadline), ECONNRESET (the
  // service connection broke), ECANCELED (the session closes).
  Result<std::vector<std::byte>> next_svc_msg(Path* path, core::Clock::time_point deadline);
  // DH-HMAC-CHAP on the service connection after INFO_REQ (docs/protocol.md, "Authentication").
  Status authenticate(Path* path, core::Clock::time_point deadline);
  // Leaves a path the server refused (EACCES) CLOSED instead of scheduling a reconnect.
  void refused(Path* path, std::error_code why);
  Status connect_con(Path* path, Con* con, std::span<const std::byte> pd);
  Status set_geometry(const proto::ConRsp& rsp);
  // The slot of device `d`, set up on first use: the session's protection domain there and
  // the user's registrations in it.
  Result<uint32_t> domain_slot(fabric::Domain* d);
  // Once the geometry is known: the IUs and the first read window of each permit in `slot`.
  Status slot_io_setup(uint32_t slot);
  // Access of user registrations in `slot`.
  uint32_t user_access(uint32_t slot) const;
  // ---- read windows (the request's owner) ----
  // Binds a window over each read segment of permit `p` on `c` (of slot `dom`); fills `keys`.
  Status bind_windows(uint32_t p, Con* c, uint32_t dom, uint32_t* keys);
  // Revokes the windows of permit `p`'s last post: 0 when done, else how many LOCAL_INVs are
  // on their way (wr_id kWrInv) on its connection.
  uint32_t revoke_windows(uint32_t p);
  // Revokes them at once for a read that was not posted after all (under c's gate): should
  // the revocation be asynchronous, the connection is broken first, since the request moves on.
  void release_windows_now(uint32_t p, Con* c);
  void teardown(Path* path);
  // Gives a borrowed CQ back to its poller: arms it, takes what completed meanwhile, unmutes it.
  // The caller holds the lease (lent).
  void give_back(Con* c);
  void path_failed(Path* path, uint64_t gen, std::error_code why);
  void schedule_reconnect(Path* path);
  void reconnect_attempt(Path* path);
  void on_path_up(Path* path);
  void on_path_down(Path* path, std::error_code why);
  void run_pending(bool fail_all, int err);
  // Fails the parked and fence-waiting requests past their deadline (pending_timeout) with
  // ENOTCONN and logs how many. Any thread but an IO poller: the ticker calls it on the service
  // poller. Returns how many it failed.
  size_t expire_parked();
  // Fails the parked and fence-waiting requests for which `which(permit)` holds with `err`.
  // Any thread but an IO poller (the callbacks run here). Returns how many.
  size_t fail_parked_if(const std::function<bool(uint32_t)>& which, int err);
  // Sends PATH_FENCE for every fence not on its way over a connected path. Any thread: the
  // fence does not wait behind the worker, which may sit in a connect for connect_timeout.
  void fence_kick();
  // Fences of `path` up to incarnation `upto` (inclusive or not) are confirmed: their requests
  // are posted (or parked). Any thread.
  void fence_release(Path* path, uint16_t upto, bool inclusive);
  // A FENCE_RSP arrived (service poller).
  void fence_answered(const proto::FenceView& v);
  // Fails the requests waiting for a fence for which `which(permit)` holds with `err`; their
  // permits stay with the fence until it is confirmed (Fence::kept). Any thread but an IO
  // poller (the callbacks run here). Returns how many it failed.
  size_t fail_fenced(const std::function<bool(uint32_t)>& which, int err);
  // A kept request's chunks go back to the pool once its fence is confirmed. Any thread.
  void give_back_kept(uint32_t p) {
    fence_kept.fetch_sub(1, std::memory_order_acq_rel);
    permits->put_run(reqs[p].first, reqs[p].nchunks);
  }
  // Fails the parked requests for which `which(done, ctx)` holds with `err` (ClientSession::
  // fail_waiting).
  void fail_parked(const std::function<bool(IoDoneFn, void*)>& which, int err);
  void emit(SessionEvent e, const Path* path, std::error_code why);
  Path* find(std::string_view name) const;
  Status close_path(Path* path, ClientPathState final_state);
  void start_heartbeat(Path* path);
  void heartbeat_tick(Path* path, uint64_t gen);
};

// ------------------------------------------------------------------------------------------
// The calling thread's part in the IO path, defined in client_io.cc. constinit: an access from
// another file calls no initialisation wrapper; hidden: bound inside the module, as they were
// when they were one file's (the fio engine is a shared object).

[[gnu::visibility("hidden")]] extern thread_local constinit const Session* tl_session;
[[gnu::visibility("hidden")]] extern thread_local constinit uint32_t tl_poller;
// Request callbacks run by this thread (CompletionReaper::reap counts its own).
[[gnu::visibility("hidden")]] extern thread_local constinit size_t tl_finished;

// The IO connection index of the calling thread in `s` (client_io.cc, thread_slot()).
uint32_t thread_ci(const Session& s);

// The calling thread's open submission batch (ClientSession::begin_batch): the connections it
// posted to with the doorbell held. Each holds one more entry of its gate, so it cannot be torn
// down before end_batch() rings it. A foreign thread posts to one connection per path, so the
// list is short; past it, posts ring at once.
struct Plug {
  const Session* s = nullptr;
  uint32_t depth = 0;
  uint32_t n = 0;
  Con* cons[ClientSession::kMaxPaths] = {};
  // The path the batch posted to last (compared, never dereferenced): min-inflight keeps the
  // batch on it (core::kBatchStickiness).
  const void* last_path = nullptr;
};
[[gnu::visibility("hidden")]] extern thread_local constinit Plug tl_plug;

// Rings the connections the batch holds and lets them go; the batch itself stays open.
inline void flush_plug(Plug& pl) {
  for (uint32_t i = 0; i < pl.n; ++i) {
    pl.cons[i]->conn->ring();
    pl.cons[i]->gate.exit();
  }
  pl.n = 0;
}

}  // namespace client

struct ClientSession::Impl final : client::Session {};

}  // namespace ibtrs
