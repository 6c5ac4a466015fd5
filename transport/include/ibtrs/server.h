// libibtrs server: listens for client sessions and hands their requests to the upper layer
// (the kernel's rtrs-srv). Per client session it allocates queue_depth chunks of chunk_size
// bytes, shared by all the session's paths and registered for remote write on each path's device;
// a request arrives in the chunk of its permit and is answered with the permit id and an errno.
//
// Safety: every request is validated before the upper layer sees it (docs/protocol.md,
// "Validation on the server"). A malformed or hostile message closes that path with a logged
// reason; the server never reads or writes outside the session's chunks.
//
// Threading:
//   - ServerHandler callbacks: on_request on the server's IO threads, the session and path
//     callbacks on its control thread. None may block for long or call Server::stop().
//   - ServerRequest::complete(): any thread, exactly once per request, asynchronously.
//   - Server methods: any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ibtrs/address.h"
#include "ibtrs/auth.h"
#include "ibtrs/io_hook.h"
#include "ibtrs/client.h"
#include "ibtrs/path_spec.h"
#include "ibtrs/refusals.h"
#include "ibtrs/result.h"
#include "ibtrs/tls.h"
#include "ibtrs/types.h"

namespace ibtrs {

struct ServerPathInfo {
  std::string name;       // "src@dst" as the client named it in INFO_REQ
  Address local;
  Address peer;
  ServerPathState state;
  std::string hca_name;
  uint8_t hca_port = 0;
  uint16_t recon_cnt = 0;
  uint16_t cid_num = 0;
  PathAuthInfo auth;      // how the path authenticated (ibtrs/auth.h)
  tls::Info tls;          // its service connection's TLS (tcp listeners with ServerOptions::tls)
  PathStatsSnapshot stats;
};

class ServerSession {
 public:
  virtual ~ServerSession() = default;
  virtual const std::string& name() const = 0;
  virtual const Uuid16& uuid() const = 0;
  // The host every path of this session authenticated as ("" for an anonymous session, which
  // only a server with allow_any_host admits). Fixed before on_session_up: a path that
  // authenticates as another host is refused, so the upper layer may decide access by it.
  virtual const std::string& host() const = 0;
  virtual std::vector<ServerPathInfo> paths() const = 0;
  virtual PathStatsSnapshot stats() const = 0;
  // Resets the counters of `group` of one path (ENOENT) or, with an empty name, of all paths.
  virtual Status reset_stats(std::string_view path = {}, StatsGroup group = StatsGroup::all) = 0;
  // Disconnects one path (ENOENT); the client will reconnect it.
  virtual Status disconnect_path(std::string_view path) = 0;

  // The upper layer's state for this session: set in on_session_up (which runs before any
  // request of the session reaches on_request), read on the IO threads.
  std::atomic<void*> context{nullptr};
};

class ServerRequest {
 public:
  IoDir dir() const { return dir_; }
  // The user header: the server's own copy, taken out of the client's chunk once when the
  // request arrived and validated there; the client cannot change it any more. Valid until
  // complete().
  std::span<const std::byte> usr() const { return usr_; }
  // write: the data the client sent; read: where the reply data goes (length = the bytes the
  // client asked for, at most max_io_size). Valid until complete().
  std::span<std::byte> data() const { return data_; }
  ServerSession& session() const { return *session_; }
  uint32_t chunk_id() const { return chunk_id_; }
  // The server IO thread on_request() runs on (0..io_threads-1): the thread whose
  // IoThreadHook, if any, may take the request's work.
  uint32_t io_thread() const { return io_thread_; }

  // Answers the client: err 0 or a positive errno (above 511 sent as EIO). For a read with
  // err == 0 the data must be in data(). Any thread, exactly once.
  virtual void complete(int err) = 0;

 protected:
  ServerRequest() = default;
  ~ServerRequest() = default;
  IoDir dir_ = IoDir::read;
  std::span<const std::byte> usr_;
  std::span<std::byte> data_;
  ServerSession* session_ = nullptr;
  uint32_t chunk_id_ = 0;
  uint32_t io_thread_ = 0;
};

class ServerHandler {
 public:
  virtual ~ServerHandler() = default;
  // A session's first path is connecting and about to carry requests. Set session.context here.
  virtual void on_session_up(ServerSession& session) { (void)session; }
  // The session's last path is gone and every request of it completed; `session` is freed after.
  virtual void on_session_down(ServerSession& session) { (void)session; }
  virtual void on_path_up(ServerSession& session, const ServerPathInfo& path) {
    (void)session;
    (void)path;
  }
  virtual void on_path_down(ServerSession& session, const ServerPathInfo& path) {
    (void)session;
    (void)path;
  }
  // A validated request, on server IO thread req.io_thread(). Complete it, now or later, from
  // any thread.
  virtual void on_request(ServerRequest& req) = 0;
  // Called by Server::start() once per IO thread (0..io_threads-1) before anything is accepted:
  // work to drive on that thread (ibtrs/io_hook.h), or nullptr. The hook must outlive the server.
  virtual IoThreadHook* io_thread_hook(uint32_t thread) {
    (void)thread;
    return nullptr;
  }
};

struct ServerOptions {
  std::vector<Address> listen;            // at least one; port 0 picks a free one
  // Chunks per session (kernel: sess_queue_depth, 512 there). 256: with chunk sets a 1 MiB
  // request takes 9 chunks, so 256 hold 28 of them or 256 small ones, and a session reserves
  // 32 MiB (pinned on rdma) instead of 64.
  uint16_t queue_depth = 256;
  uint32_t chunk_size = 128 * 1024;       // power of two, 8 KiB..16 MiB (kernel: max_chunk_size)
  uint32_t max_hdr_size = 4096;           // user header + IO message; max_io = chunk - this
  // Largest data of one request for clients that take chunk sets (protocol 2.2): above
  // chunk_size - max_hdr_size a request spans consecutive chunks of the session (at most 64,
  // and at most queue_depth), so a 1 MiB IO is one request without larger chunks and without
  // more memory per session. Older clients, and always_invalidate (a key per chunk), get
  // chunk_size - max_hdr_size. 0: chunk_size - max_hdr_size for everyone. Above what
  // min(queue_depth, 64) chunks hold besides a header, it is that.
  uint32_t max_io_size = 1u << 20;
  uint32_t io_threads = 0;                // 0: min(hardware threads, 8)
  HeartbeatConfig heartbeat;
  // The fabric's busy wait (tcp CQ waits); it makes the IO threads spin too.
  bool busy_poll = false;
  // How the IO threads wait for the next request once their CQs are drained: adaptive keeps
  // polling for a learned gap after a pass that found work (a wake-up less per request at low
  // queue depth) and sleeps at once while idle or contended (core/poller.h); block sleeps at
  // once; spin never sleeps (a core per IO thread).
  enum class IoPoll : uint8_t { adaptive, block, spin };
  IoPoll io_poll = IoPoll::adaptive;
  // The kernel's always_invalidate: a chunk's remote key is revoked when a request in it arrives
  // and a new one goes to the client with the response (RKEY_RSP), so a client cannot change a
  // request's write data while the server serves it. Off by default: with a protection domain
  // per session only the session's own client holds its chunk keys, and the header bytes are
  // copied out of the chunk anyway (usr()); what it adds is the client's own payload frozen
  // during the write (docs/security.d/isolation.md). Costs two key flips per IO on the software
  // providers, where the chunk's key comes back as it was (no RKEY_RSP), and a deregistration,
  // a registration and an RKEY_RSP per IO on rdma.
  bool always_invalidate = false;
  // The failover fence (protocol 2.3, docs/protocol.md "Failover fence"): clients of minor 3
  // or later learn (CON_RSP kConRspFence) that they may ask the server to close a broken path
  // (PATH_FENCE) before they resend its writes on another one. false: the server behaves as
  // one of 2.2 here (no flag; a PATH_FENCE is a protocol error), with the lost-write hazard
  // that section describes: for tests of older servers only.
  bool path_fence = true;
  // Keys (memory registrations) one session may hold in its protection domain on a device: its
  // share of the device's key table. The session's chunks take one, each path one (service
  // buffers) and, with always_invalidate, queue_depth more. A path that would exceed it is
  // refused with ENOMEM at connect. Default 8192: 15 paths with always_invalidate at queue
  // depth 512, every path (16) at the default 256. 0: the provider's largest (software
  // providers: 65535).
  uint32_t session_max_keys = 8192;
  ServerHandler* handler = nullptr;       // required; must outlive the server

  // Bounds on what peers can make the server hold (docs/security.d/bounds.md). A connection
  // request past a cap is refused with the CON_RSP errno named here (the client's connect fails
  // with it) and counted in Server::refusals(). Each must be at least 1.
  //
  // Sessions, half-open ones included. At the cap (or the chunk memory cap) a new session first
  // evicts the oldest session that never completed a handshake; with none, it is refused: EUSERS.
  uint32_t max_sessions = 256;
  // Paths (connecting or connected) of one session. The client's own limit is
  // ClientSession::kMaxPaths (16). Past it: EMLINK.
  uint32_t max_paths_per_session = 16;
  // queue_depth x chunk_size of every session, counted until the session is freed: what a
  // session's peer can make the server back with memory by writing its chunks. Default: 256
  // sessions of the default geometry (32 MiB each). Past it: ENOMEM.
  uint64_t max_chunk_memory = uint64_t{8} << 30;
  // A path must reach CONNECTED (all its connections accepted and INFO exchanged) this long
  // after its first connection request, or it is closed; a session left without paths is freed.
  // RTRS's connect timeout, which bounds how long an honest client tries.
  std::chrono::milliseconds handshake_timeout{30000};
  // A connection request that would start a new session while the session it replaces (same
  // uuid, its last path closed) still has requests with the upper layer is held until that
  // predecessor has drained, so that no old copy of a write can land after the new session's
  // writes (docs/protocol.md, "Path incarnations"). Held longer than this it is refused with
  // EAGAIN, which the client retries like any refused connect. Default 5 s: a backend that is
  // merely slow drains well within it, and it stays far under the client's connect timeout
  // (RTRS: 30 s) so that the client hears the answer instead of giving up on its connect. At
  // most handshake_timeout / 2 (start() clamps it): handshake_timeout is what the server
  // assumes of a client's connect timeout. 0: no hold (a new session starts at once, with the
  // lost-write hazard; for tests only). Holds count against max_sessions and
  // max_paths_per_session (docs/security.d/bounds.md).
  std::chrono::milliseconds drain_hold{5000};
  // Responses that do not fit a connection's send queue wait in its backlog. A peer that lets
  // queue_depth of them wait stops being served (no receive is reposted: its further requests
  // stay with it), which bounds the backlog; one that lets it sit this long without
  // acknowledging anything is disconnected.
  std::chrono::milliseconds ack_timeout{30000};

  // Host authentication (ibtrs/auth.h, docs/security.d/auth.md). A client that authenticates
  // proves a secret `authenticator` knows for its host, or is refused with EACCES (unknown host,
  // wrong key, a session of another host). A client that does not authenticate is admitted only
  // with allow_any_host (anonymous: ServerSession::host() is ""), else refused with EACCES at
  // its first connection. start() refuses a server with neither (EINVAL): it would admit nobody.
  const Authenticator* authenticator = nullptr;  // must outlive the server
  bool allow_any_host = false;
  // TLS on the tcp listeners (ibtrs/tls.h): offered (on) or required (a plaintext client is
  // refused: its connect fails with EPROTONOSUPPORT). Certificates when cert_file and key_file
  // are given (and ca_file to require client certificates), else PSKs derived from the host
  // keys of `authenticator` (ibtrs/auth.h, tls_psk_of), which it then needs. With a PSK the
  // host a path proves in DH-HMAC-CHAP must be the host of its TLS identity (EACCES otherwise).
  // rdma listeners are not encrypted.
  tls::Options tls;
};

// What peers hold right now, against ServerOptions' caps.
struct ServerUsage {
  uint32_t sessions = 0;            // live sessions, half-open ones included
  uint32_t handshaking_sessions = 0;  // of those, sessions with no path CONNECTED
  uint32_t paths = 0;               // paths connecting or connected
  uint64_t chunk_memory = 0;        // bytes of chunks reserved, sessions being freed included
  // Of the live sessions' chunk memory, the bytes in RAM now (mincore(2)): chunks are backed
  // lazily, so what the sessions' requests have touched. On rdma registration pins every chunk,
  // so it is all of it.
  uint64_t chunk_resident = 0;
  uint64_t backlog = 0;             // responses waiting for send-queue room, all connections
  // Connection requests held until the session they would replace has drained
  // (ServerOptions::drain_hold).
  uint32_t held_connects = 0;
  // The failover fence since the server started: PATH_FENCE messages answered, and of those
  // the ones that closed a live path (the others found it closed or superseded already).
  uint64_t fences_answered = 0;
  uint64_t fences_closed = 0;
};

// Authentication outcomes since the server started, per path (a refused path counts once; a
// client without credentials counts once per connection it tries).
struct AuthCounters {
  uint64_t authenticated = 0;           // paths that proved their host's secret
  uint64_t anonymous = 0;               // paths admitted without credentials (allow_any_host)
  uint64_t refused_no_credentials = 0;  // connections without kConReqAuth, allow_any_host off
  uint64_t refused_unknown_host = 0;
  uint64_t refused_bad_response = 0;    // wrong key (or a replayed or tampered exchange)
  uint64_t refused_host_mismatch = 0;   // a path of a session that belongs to another host
  uint64_t refused_protocol = 0;        // malformed or out-of-order messages, no server key
};

class Server {
 public:
  // Errors: EINVAL (bad options: geometry, no handler, no address, neither an authenticator
  // nor allow_any_host), EADDRINUSE, ...
  static Result<std::unique_ptr<Server>> start(ServerOptions options);
  // Closes every session (the handler sees path and session downs) and stops. Requests the
  // handler still holds must be completed before this returns.
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // The bound listen addresses (with real ports).
  std::vector<Address> addresses() const;
  // The options in force: as given to start(), with its clamps applied (drain_hold to
  // handshake_timeout / 2, max_io_size to what the largest chunk set holds), so that a daemon
  // shows what the server does rather than what it was asked. Fixed at start(): any thread.
  const ServerOptions& options() const;
  // Names of the live sessions, and one session's paths.
  std::vector<std::string> sessions() const;
  AuthCounters auth_counters() const;
  // Calls `fn` with the session on the server's control thread (do not keep the reference). ENOENT.
  Status with_session(std::string_view name, const std::function<void(ServerSession&)>& fn) const;

  // Peers refused or cut off, by reason (ibtrs/refusals.h). The upper layer counts its own
  // refusals here too, so a daemon shows one list.
  Refusals& refusals() const;
  ServerUsage usage() const;
  // How each IO thread waited for work (ServerOptions::io_poll), by thread. Any thread.
  std::vector<IoThreadWaitStats> io_thread_stats() const;

  struct Impl;

 private:
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ibtrs
