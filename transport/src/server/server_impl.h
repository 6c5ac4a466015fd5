// Private to the server: the sessions, their paths, connections and requests, and the server's
// state (kernel: rtrs-srv.h). One .cc per concern:
//   server_io.cc       the IO path (poller threads, and ServerRequest::complete from anywhere):
//                      requests arriving, chunk hand-over and deferral, responses, key restore,
//                      the send backlog; the connections' completions
//   server_connect.cc  establishment (worker): connection requests, sessions made and evicted,
//                      connections accepted, requests held behind a draining predecessor; the
//                      listeners' accept thread
//   server_service.cc  the service connection (worker, service poller): INFO, authentication,
//                      PATH_FENCE, heartbeats, the handshake deadline
//   server_session.cc  the sessions' control functions and teardown: closing paths, detaching
//                      and freeing sessions
//   server.cc          the public Server: start, stop and its accessors
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
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "auth/chap.h"
#include "core/con_base.h"
#include "core/heartbeat.h"
#include "core/path_state.h"
#include "core/poller.h"
#include "core/stats.h"
#include "core/wr_id.h"
#include "base/worker.h"
#include "fabric/fabric.h"
#include "ibtrs/refusals.h"
#include "ibtrs/server.h"
#include "proto/ibtrs_proto.h"

namespace ibtrs::server {

using fabric::Completion;
using fabric::Opcode;
using fabric::SendWr;
using fabric::Sge;
using fabric::WcStatus;

using core::kRepostBatch;
using core::kSignalEvery;
using core::kSvcRecvs;
using core::kSvcSends;
using core::kSvcSlot;
using core::kWrIo;
using core::kWrRecv;
using core::kWrSvc;
using core::kWrSvcRecv;
using core::wr_id;
using core::wr_kind;
using core::wr_value;

// A path refused by authentication: the AUTH_FAILURE goes out, then the server waits this long
// for the client to hang up before it closes the path itself.
inline constexpr auto kAuthFailLinger = std::chrono::seconds(1);
inline constexpr uint16_t kMaxCidNum = 129;   // 128 IO connections + service
// FENCE_RSP send slots per service connection, each busy from its post until its send
// completes. An honest client has at most one fence per other path of the session unanswered
// (ClientSession::kMaxPaths - 1), so a client that leaves more answers unacknowledged than
// this is refused.
inline constexpr uint32_t kFenceSlots = 16;
static_assert(kFenceSlots <= 32, "one bit per slot in Con::fence_busy");

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(core::Clock::now().time_since_epoch())
      .count();
}

struct Impl;
struct Session;
struct Path;

// path, cid, poller, cq, conn, gate, failed, down, sig, recv_missing: core::ConBase.
struct Con final : core::ConBase<Path> {
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

}  // namespace ibtrs::server
