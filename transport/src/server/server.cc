// The IBTRS server (kernel: rtrs-srv.c).
//
// Threads: an accept thread hands connection requests to the worker; the worker builds and tears
// down sessions and paths (one at a time, may block); IO pollers own the IO connections' CQs and
// hand validated requests to the upper layer; the service poller owns the service connections
// (INFO_REQ, heartbeats) and the timers.
//
// Lifetimes: a session lives while it has a path or a request the upper layer has not completed;
// its path and connection objects live as long as it does (a closed path stays as a shell), so
// a completion from any thread reaches valid memory and finds the connection's gate closed.
//
// Isolation: every session has its own protection domain per device (fabric.h), holding its
// chunks, its service buffers and (always_invalidate) its per-chunk regions, and its paths'
// connections are accepted into it: a key of one session is nothing on another's connections.
// A request's header bytes are copied out of the chunk once, into the request's own buffer,
// and only that copy is validated and used (ServerRequest::usr() points at it).
#include "ibtrs/server.h"

#include <poll.h>
#include <sys/mman.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <bit>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "auth/chap.h"
#include "base/log.h"
#include "core/con_gate.h"
#include "core/fabrics.h"
#include "core/heartbeat_wr.h"
#include "core/heartbeat.h"
#include "core/path_state.h"
#include "core/poller.h"
#include "core/stats.h"
#include "base/worker.h"
#include "fabric/fabric.h"
#include "proto/ibtrs_proto.h"

namespace ibtrs {

using namespace std::chrono_literals;
using fabric::Completion;
using fabric::Opcode;
using fabric::SendWr;
using fabric::Sge;
using fabric::WcStatus;

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
namespace {

enum WrKind : uint64_t { kWrIo = 1, kWrSvc = 2, kWrRecv = 3, kWrSvcRecv = 4 };
constexpr uint64_t wr_id(WrKind k, uint64_t v = 0) { return v << 3 | k; }

constexpr uint32_t kSvcRecvs = 16;
constexpr uint32_t kSvcSlot = 512;     // bytes per service RECV: AUTH_REPLY is 336, INFO_REQ 144
// A path refused by authentication: the AUTH_FAILURE goes out, then the server waits this long
// for the client to hang up before it closes the path itself.
constexpr auto kAuthFailLinger = std::chrono::seconds(1);
constexpr uint32_t kSvcSends = 16;
constexpr uint32_t kSignalEvery = 16;
constexpr uint32_t kRepostBatch = 16;
constexpr uint16_t kMaxCidNum = 129;   // 128 IO connections + service
// FENCE_RSP send slots per service connection, each busy from its post until its send
// completes. An honest client has at most one fence per other path of the session unanswered
// (ClientSession::kMaxPaths - 1), so a client that leaves more answers unacknowledged than
// this is refused.
constexpr uint32_t kFenceSlots = 16;
static_assert(kFenceSlots <= 32, "one bit per slot in Con::fence_busy");

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(core::Clock::now().time_since_epoch())
      .count();
}

}  // namespace

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

struct Impl;
struct Session;
struct Path;

struct Con final : core::CqHandler {
  Path* path = nullptr;
  uint16_t cid = 0;
  core::Poller* poller = nullptr;
  std::unique_ptr<fabric::CompletionQueue> cq;
  std::unique_ptr<fabric::Connection> conn;
  core::ConGate gate;
  std::atomic<bool> failed{false};
  bool down = false;  // poller thread
  std::atomic<uint32_t> sig{0};
  uint32_t recv_missing = 0;
  // Service connection: kSvcRecvs RECV slots, then the INFO_RSP being sent.
  std::unique_ptr<std::byte[]> svc_buf;
  size_t svc_len = 0;
  std::unique_ptr<fabric::MemoryRegion> svc_mr;
  // Responses that did not fit the send queue, retried when sends complete and by a timer
  // (check_backlog), in case no signalled send is left to complete. Bounded by the peer's
  // credit: an honest client has at most queue_depth requests in flight, and a response waits
  // here only until it is posted, so at queue_depth waiting responses the connection stops
  // taking requests: its RECVs are not reposted, and the peer's next requests stay on its side.
  // After the last repost (under queue_depth waiting) at most the RECVs still posted
  // (max_recv_wr) bring requests, and at most 2 x queue_depth are with the upper layer, so the
  // backlog never holds more than 3 x queue_depth + max_recv_wr responses. A peer that leaves it
  // without progress for ack_timeout is disconnected; its memory goes with the connection.
  std::mutex bl_mu;
  std::deque<std::vector<SendWr>> backlog;
  std::deque<std::vector<Sge>> backlog_sges;
  std::atomic<bool> has_backlog{false};
  std::atomic<uint32_t> bl_size{0};  // backlog.size(), for readers without the lock
  int64_t bl_progress_ns = 0;        // bl_mu: when the backlog started or last moved
  uint64_t bl_timer = 0;             // bl_mu: check_backlog's timer on `poller` (0: none)
  // Service connection: FENCE_RSP slots whose send has not completed (bit i: slot i). Set by
  // the worker when it posts an answer, cleared by the poller when the send completes.
  std::atomic<uint32_t> fence_busy{0};

  void on_completions(std::span<Completion> wcs) override;
  void go_down();
  void post_or_backlog(std::span<const SendWr> wrs);
  void retry_backlog();
  // Poller thread (timer): retries the backlog, disconnects a peer past ack_timeout, resumes
  // receiving once the backlog is under the credit again.
  void check_backlog();
  void arm_backlog_timer();  // bl_mu held
  void clear_backlog();
  // Poller thread: reposts consumed IO RECVs unless the backlog holds the peer's credit.
  void repost_recvs();
  // Counts a refusal of this connection's peer and disconnects it (under the gate).
  void cut_off(std::string_view reason, const std::string& what);
};

// Authentication of one path incarnation (worker; the listing fields under the session's mu).
struct PathAuth {
  bool wanted = false;      // CON_REQ had kConReqAuth
  bool info_seen = false;   // INFO_REQ arrived: a second one is a protocol error
  AuthState state = AuthState::none;
  std::string host;
  bool bidirectional = false;
  // The open exchange: what the challenge sent.
  uint16_t tid = 0;
  uint32_t seq = 0;
  auth::Nonce nonce{};
  std::optional<auth::X25519> dh;
};

struct Path {
  Session* s = nullptr;
  uint64_t id = 0;  // registry key: tasks name a path by id, so a freed one is never touched
  proto::Uuid uuid{};
  uint16_t recon_cnt = 0;
  uint16_t cid_num = 0;
  uint16_t accepted = 0;
  core::ServerPathStateMachine state{ServerPathState::connecting};
  std::vector<std::unique_ptr<Con>> cons;
  std::string name;
  Address local, peer;
  fabric::Domain* device = nullptr;  // the device's domain the connections arrived on
  fabric::Domain* domain = nullptr;  // the session's protection domain on that device
  // The identity the path's connections proved with TLS (all the same; "" without TLS).
  std::optional<std::string> tls_identity;
  uint32_t chunk_lkey = 0, chunk_rkey = 0;
  // always_invalidate: one remotely writable region per chunk, in the session's domain on this
  // path's device. Its key is revoked when a request in the chunk starts and a new one issued
  // when it completes (MemoryRegion::rekey: a key flip on the software providers); both under
  // a connection's gate, so a closed path's regions are never touched.
  std::vector<std::unique_ptr<fabric::MemoryRegion>> chunk_mrs;
  core::Heartbeat hb;
  core::PathStats stats;
  std::atomic<uint64_t> hb_timer{0};
  std::atomic<uint64_t> hs_timer{0};  // handshake deadline (svc poller), until CONNECTED
  bool announced = false;  // on_path_up was called (worker)
  PathAuth auth;
  // hb_timer is the path's one service timer: heartbeats once connected, before that the
  // linger after a refused authentication (close_path cancels either).

  Path(Session* sess, const HeartbeatConfig& hbc, uint32_t shards) : s(sess), hb(hbc), stats(shards) {}
  ServerPathInfo info() const;
};

struct Req final : ServerRequest {
  // The chunk's one protocol (request_arrived, release_chunk): idle; being served; being served
  // with one copy deferred behind it (deferred_con / deferred_offset); locked: a thread holds
  // the deferral fields for a few instructions (reads them to hand the chunk over, or writes
  // them), and every other thread that needs them waits until it is done. Only the holder of
  // the lock touches the deferral fields, so they need no atomics of their own.
  static constexpr uint32_t kIdle = 0, kBusy = 1, kDeferred = 2, kLocked = 3;
  Session* s = nullptr;
  Con* con = nullptr;  // the connection the request came on: the response goes back there
  std::atomic<uint32_t> state{kIdle};
  Con* deferred_con = nullptr;  // under kLocked
  uint32_t deferred_offset = 0;
  // The request's header bytes (user header, read descriptors), copied out of the chunk once
  // when it starts: max_hdr bytes of the session's copy area, server memory no peer can write.
  std::span<std::byte> copy;
  std::span<const proto::BufDesc> descs;  // read: in `copy`
  int64_t start_ns = 0;
  uint32_t shard = 0;
  uint64_t bytes = 0;

  void complete(int err) override;
  void start(Con* c, uint32_t offset);
  // Poller of c: a copy deferred behind a busy chunk gets its turn (or is dropped when its
  // connection closed meanwhile).
  void run_deferred(Con* c, uint32_t offset);
  // The chunk served: idle again (nullptr), or the copy deferred behind it, returned with its
  // offset, holds it now and must be handed it (hand_chunk: run on its connection's poller).
  Con* release_chunk(uint32_t* next_offset);
  void hand_chunk(Con* next, uint32_t offset);
  // The holder of the chunk lets go of it without serving (its connection closed, a refused
  // message): release_chunk, and the copy deferred behind it, if any, takes its turn.
  void give_up_chunk();
  // always_invalidate, under the connection's gate: makes the chunk reachable on the path again.
  // Where that takes a new key (rdma), fills `wr` with the RKEY_RSP SEND that carries it and
  // sets `*changed`; where the revoked key itself comes back (software providers) the client's
  // key is right as it is. False: the path is failed.
  bool restore_key(Con* c, SendWr& wr, Sge& sge, bool* changed);
  using ServerRequest::chunk_id_;
  using ServerRequest::data_;
  using ServerRequest::dir_;
  using ServerRequest::session_;
  using ServerRequest::usr_;
  using ServerRequest::io_thread_;
};

struct Session final : ServerSession {
  Impl* srv = nullptr;
  std::string name_;
  std::string host_;        // bound by the first admitted path (under mu); host() reads it
  bool host_bound = false;  // (under mu)
  Uuid16 uuid_;
  proto::Uuid uuid_bytes{};
  uint16_t qd = 0;
  uint32_t chunk_size = 0;
  uint32_t max_hdr = 0;
  // Data bytes per request: chunk_size - max_hdr, or more with chunk sets (a client of 2.2 or
  // later and ServerOptions::max_io_size), fixed by the session's first connection request.
  uint32_t max_io = 0;
  bool sets = false;
  // The client learns of PATH_FENCE (kConRspFence): ServerOptions::path_fence and a client of
  // 2.3 or later, fixed by the session's first connection request like `sets`.
  bool fence = false;
  proto::ImmLayout layout;
  std::byte* chunks = nullptr;
  size_t chunks_len = 0;            // the chunks, then (always_invalidate) the RKEY_RSP slots
  bool invalidate = false;          // always_invalidate
  proto::RkeyRsp* rkey_msgs = nullptr;  // per chunk: the RKEY_RSP its next response sends
  std::byte* copies = nullptr;      // qd x max_hdr: each request's copy of its header bytes
  size_t copies_len = 0;
  std::unique_ptr<Req[]> reqs;
  // Worker. By the device's domain: the session's protection domain there, and its chunks
  // registered in it. Destroyed after every path's connections and regions (~Session).
  std::map<fabric::Domain*, std::unique_ptr<fabric::Domain>> pds;
  std::map<fabric::Domain*, std::unique_ptr<fabric::MemoryRegion>> mrs;

  mutable std::mutex mu;  // paths lists and name
  std::vector<Path*> live;
  std::vector<std::unique_ptr<Path>> all;
  // Requests the upper layer holds (+ deferred ones), plus kDetached once the session has no
  // path left. One word, so the request that takes a detached session to zero and the worker
  // that detaches a session with nothing in flight agree on who reaps it — and a live session's
  // last request costs no hand-off to the worker.
  static constexpr int64_t kDetached = int64_t{1} << 62;
  std::atomic<int64_t> inflight{0};
  bool up = false;     // on_session_up called (worker)
  bool dying = false;  // no path left (worker)
  bool hold_logged = false;  // a connection request was held behind it (worker)
  core::Clock::time_point created;  // the oldest half-open session is evicted first

  ~Session() override {
    mrs.clear();
    pds.clear();
    if (chunks != nullptr) ::munmap(chunks, chunks_len);
    if (copies != nullptr) ::munmap(copies, copies_len);
  }
  const std::string& name() const override { return name_; }
  const Uuid16& uuid() const override { return uuid_; }
  const std::string& host() const override { return host_; }
  std::vector<ServerPathInfo> paths() const override;
  PathStatsSnapshot stats() const override;
  Status reset_stats(std::string_view path, StatsGroup group) override;
  Status disconnect_path(std::string_view path) override;

  // Bytes of the chunks in RAM (mincore over the mapping). Control path only: a page vector of
  // chunks_len / 4 KiB bytes.
  uint64_t resident_chunk_bytes() const {
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    const size_t len = size_t{qd} * chunk_size;
    std::vector<unsigned char> v((len + page - 1) / page);
    if (chunks == nullptr || ::mincore(chunks, len, v.data()) != 0) return 0;
    uint64_t n = 0;
    for (unsigned char b : v) n += b & 1;
    return n * page;
  }
  std::span<std::byte> chunk(uint32_t id) const {
    return {chunks + size_t{id} * chunk_size, chunk_size};
  }
  void request_arrived(Con* c, uint32_t chunk_id, uint32_t offset);
  void request_done();
};

// A connection request that would start a session while its predecessor of the same uuid still
// drains (Impl::handle_connect): held, unanswered, until that one is freed or `deadline`.
struct HeldConnect {
  std::unique_ptr<fabric::ConnectRequest> req;
  proto::Uuid sess{};
  core::Clock::time_point deadline;
};

struct Impl {
  ServerOptions opts;
  uint32_t nio = 1;
  std::vector<std::unique_ptr<fabric::Listener>> listeners;
  std::vector<std::unique_ptr<core::Poller>> io_pollers;
  std::vector<std::pair<uint32_t, IoThreadHook*>> hooks;  // the handler's, per IO thread
  std::unique_ptr<core::Poller> svc_poller;
  std::unique_ptr<base::Worker> worker;
  std::thread acceptor;
  std::atomic<bool> stopping{false};

  mutable std::mutex mu;  // sessions
  std::map<proto::Uuid, std::unique_ptr<Session>> sessions;
  std::vector<std::unique_ptr<Session>> dying;  // worker: waiting for their requests
  // Worker: connection requests held behind a draining predecessor, oldest first. At most
  // max_sessions, and max_paths_per_session per uuid (an honest client sends one per path).
  std::deque<HeldConnect> held;
  std::atomic<uint32_t> held_count{0};  // held.size(), for usage()
  core::Clock::time_point held_timer_at{};  // worker: when the svc poller re-checks `held` ({}: not armed)
  uint64_t held_timer = 0;
  std::map<uint64_t, Path*> path_ids;           // worker: every path of every session not freed
  uint64_t next_path_id = 1;
  Refusals refusals;
  // Chunk bytes of every session not freed (max_chunk_memory). Written by the worker.
  std::atomic<uint64_t> chunk_memory{0};
  std::vector<fabric::Listener::Drops> drops_seen;  // accept thread: drops already counted

  std::atomic<uint64_t> fences_answered{0}, fences_closed{0};  // ServerUsage
  // Authentication outcomes (AuthCounters): refusals counted here, where they happen.
  struct {
    std::atomic<uint64_t> authenticated{0}, anonymous{0}, no_credentials{0}, unknown_host{0},
        bad_response{0}, host_mismatch{0}, protocol{0};
  } auth_count;

  // Worker: the path if it still exists. Tasks posted by pollers and timers may outlive a path's
  // session; they look it up here first.
  Path* lookup(uint64_t id) const {
    auto it = path_ids.find(id);
    return it == path_ids.end() ? nullptr : it->second;
  }

  void accept_loop();
  void handle_connect(std::unique_ptr<fabric::ConnectRequest> req);
  // Worker: the session of uuid `id` that has lost its last path but not yet drained its
  // requests (nullptr: none, or drain_hold is 0).
  Session* draining(const proto::Uuid& id) const;
  // Worker: holds `req` behind `pred`, or refuses it (EAGAIN) when the holds are at their caps.
  void hold(std::unique_ptr<fabric::ConnectRequest> req, const proto::Uuid& id, Session* pred);
  // Worker: hands held requests whose predecessor is gone to handle_connect, refuses those past
  // their deadline (EAGAIN), and arms the timer for the next deadline.
  void run_held();
  void arm_held_timer();
  Status accept_con(Session* s, Path* p, const proto::ConReq& cr, fabric::ConnectRequest& req);
  void handle_info(Path* p, std::vector<std::byte> msg);
  void send_info_rsp(Path* p);
  void send_auth_challenge(Path* p);
  void handle_auth_reply(Path* p, std::span<const std::byte> msg);
  void handle_fence(Path* p, std::span<const std::byte> msg);
  void auth_failed(Path* p, int reason, std::atomic<uint64_t>& counter, const std::string& why);
  // Worker: sends msg from the service connection's send areas, `at` bytes after INFO_RSP (AUTH_*
  // at 0 and kSvcSlot, FENCE_RSP slots from 2 x kSvcSlot); `tag` goes into the wr_id.
  Status post_svc(Path* p, size_t at, std::span<const std::byte> msg, uint32_t tag = 0);
  bool bind_host(Path* p, const std::string& host);
  void close_path(Path* p, const char* why);
  void reap();
  void heartbeat_tick(Path* p);
  // The session of `cr`, made if new. A new one must fit max_sessions and max_chunk_memory,
  // evicting half-open sessions to make room; else the CON_RSP errno and the reason.
  Result<Session*> session_for(const proto::ConReq& cr, std::string_view* reason);
  // Closes the oldest session that never reached CONNECTED. False when there is none.
  bool evict_half_open(const char* why);
  void handshake_expired(Path* p);
  void count_listener_drops(size_t i);
  // A peer broke the protocol (its path is closed by the caller): counted and logged as a
  // refusal (protocol_error). Any thread.
  [[gnu::format(printf, 2, 3)]] void protocol_error(const char* fmt, ...);
  void reject(fabric::ConnectRequest& req, int err, std::string_view reason, const std::string& why);
  // Sends the refusing CON_RSP only (reject() counts the refusal first).
  void answer_refused(fabric::ConnectRequest& req, int err);
  void detach_session_if_empty(Session* s);
};

// ------------------------------------------------------------------------------------------

ServerPathInfo Path::info() const {
  ServerPathInfo i;
  i.name = name;
  i.local = local;
  i.peer = peer;
  i.state = state.get();
  if (!cons.empty() && cons[0]->conn) {
    i.hca_name = cons[0]->conn->device_name();
    i.hca_port = cons[0]->conn->port_num();
    i.tls = cons[0]->conn->tls();
  }
  i.recon_cnt = recon_cnt;
  i.cid_num = cid_num;
  i.auth.state = auth.state;
  i.auth.host = auth.host;
  i.auth.bidirectional = auth.bidirectional;
  if (auth.state == AuthState::authenticated) i.auth.method = "dhchap-sha256-x25519";
  i.stats = stats.snapshot();
  return i;
}

std::vector<ServerPathInfo> Session::paths() const {
  std::lock_guard lock(mu);
  std::vector<ServerPathInfo> out;
  for (Path* p : live) out.push_back(p->info());
  return out;
}

PathStatsSnapshot Session::stats() const {
  std::lock_guard lock(mu);
  PathStatsSnapshot t;
  for (auto& p : all) t += p->stats.snapshot();
  return t;
}

Status Session::reset_stats(std::string_view path, StatsGroup group) {
  std::lock_guard lock(mu);
  bool found = path.empty();
  for (Path* p : live) {
    if (!path.empty() && p->name != path) continue;
    p->stats.reset(group);
    found = true;
  }
  return found ? Status{} : Status{errc(ENOENT)};
}

Status Session::disconnect_path(std::string_view path) {
  Path* target = nullptr;
  {
    std::lock_guard lock(mu);
    for (Path* p : live)
      if (p->name == path) target = p;
  }
  if (target == nullptr) return errc(ENOENT);
  Impl* im = srv;
  im->worker->call([im, target] {
    im->close_path(target, "disconnected by the server");
    return 0;
  });
  return {};
}

// ------------------------------------------------------------------------------------------
// IO (poller threads, and complete() from anywhere)

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
      if (cid == 0) svc_slots[nsvc++] = static_cast<uint32_t>(wc.wr_id >> 3);
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
    } else if (wc.opcode == Opcode::send && cid == 0 && (wc.wr_id & 7) == kWrSvc &&
               (wc.wr_id >> 3) != 0 && (wc.wr_id >> 3) <= kFenceSlots) {
      // A FENCE_RSP is with the client: its slot may take the next answer.
      fence_busy.fetch_and(~(1u << ((wc.wr_id >> 3) - 1)), std::memory_order_acq_rel);
    } else if (wc.opcode == Opcode::recv) {
      if (cid != 0) {
        srv.protocol_error("session %s path %s: message on an IO connection", s.name_.c_str(),
                           p->name.c_str());
        broken = true;
        continue;
      }
      const uint32_t slot = static_cast<uint32_t>(wc.wr_id >> 3);
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

// ------------------------------------------------------------------------------------------
// Control (worker)

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

void Impl::close_path(Path* p, const char* why) {
  const auto prev = p->state.get();
  if (!p->state.change(ServerPathState::closing).ok()) return;  // already closing or closed
  Session* s = p->s;
  BASE_LOG(info, "session %s: closing path %s (%s): %s", s->name_.c_str(), p->name.c_str(),
            std::string(to_string(prev)).c_str(), why);
  if (uint64_t t = p->hb_timer.exchange(0)) svc_poller->cancel_timer(t);
  if (uint64_t t = p->hs_timer.exchange(0)) svc_poller->cancel_timer(t);
  for (auto& c : p->cons) {
    Con* con = c.get();
    con->gate.close_and_wait();
    if (con->cq) {
      con->poller->run_sync([con] {
        con->down = true;
        if (con->conn) con->conn->disconnect();
        con->poller->detach(con->cq.get());
        // Timers run on this thread: none is running, and none is armed after this.
        std::lock_guard lock(con->bl_mu);
        if (con->bl_timer != 0) con->poller->cancel_timer(std::exchange(con->bl_timer, 0));
      });
    }
  }
  // The service poller ran a task above (or runs this one): a heartbeat tick that was running
  // during the first cancel has finished, and may have armed another.
  svc_poller->run_sync([] {});
  if (uint64_t t = p->hb_timer.exchange(0)) svc_poller->cancel_timer(t);
  for (auto& c : p->cons) {
    c->conn.reset();
    c->cq.reset();
    c->svc_mr.reset();
    c->svc_buf.reset();
    c->clear_backlog();
  }
  p->chunk_mrs.clear();
  (void)p->state.change(ServerPathState::closed);
  {
    std::lock_guard lock(s->mu);
    std::erase(s->live, p);
  }
  if (p->announced) opts.handler->on_path_down(*s, p->info());
  detach_session_if_empty(s);
}

void Impl::detach_session_if_empty(Session* s) {
  {
    std::lock_guard lock(s->mu);
    if (!s->live.empty() || s->dying) return;
    s->dying = true;
  }
  std::unique_ptr<Session> owned;
  {
    std::lock_guard lock(mu);
    auto it = sessions.find(s->uuid_bytes);
    if (it != sessions.end() && it->second.get() == s) {
      owned = std::move(it->second);
      sessions.erase(it);
    }
  }
  if (owned) dying.push_back(std::move(owned));
  // From here the request that brings the count to zero asks for the reap; if none is in
  // flight, reap() below finds it at zero.
  s->inflight.fetch_or(Session::kDetached, std::memory_order_acq_rel);
  reap();
}

// Frees sessions without paths once the upper layer completed their requests.
void Impl::reap() {
  bool freed = false;
  for (auto it = dying.begin(); it != dying.end();) {
    Session* s = it->get();
    if ((s->inflight.load(std::memory_order_acquire) & ~Session::kDetached) != 0) {
      ++it;
      continue;
    }
    if (s->up) opts.handler->on_session_down(*s);
    for (auto& p : s->all) path_ids.erase(p->id);
    chunk_memory.fetch_sub(size_t{s->qd} * s->chunk_size);
    it = dying.erase(it);
    freed = true;
  }
  // A request held behind a session freed here goes on now. Posted, not called: reap runs
  // inside close_path, which may be inside handle_connect.
  if (freed && !held.empty()) worker->post([this] { run_held(); });
#if defined(__GLIBC__)
  // What a session's connections allocated (their backlogs above all) goes back to the system,
  // not only to malloc's arenas: a peer's burst must not stay in the daemon's RSS.
  if (freed) ::malloc_trim(0);
#endif
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
