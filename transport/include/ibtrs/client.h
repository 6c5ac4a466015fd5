// libibtrs client: a session of one or more paths to one server, carrying read and write
// requests (the kernel's rtrs-clt). See docs/protocol.md for the wire and docs/architecture.md
// for how the pieces map to the kernel.
//
// A request holds a permit (one of the session's queue_depth) for its life; permit i always uses
// server chunk i. A write sends [data][user header] into the chunk in one RDMA write with
// immediate; a read sends the user header and descriptors of the caller's buffer, and the
// server writes the data there. Requests larger than max_io_size() are refused (EMSGSIZE): the
// upper layer splits.
//
// Data lives in registered memory (register_memory / alloc_buffer): each IoSeg names its
// registration, so the IO path never looks memory up and never copies it.
//
// Failover: when a path breaks (fabric error, heartbeat loss, disconnect), its inflight requests
// are re-sent on another CONNECTED path with the same permit, invisibly to the caller; the broken
// path reconnects after a delay with backoff. Completion callbacks run exactly once.
//
// Threading:
//   - request(), free_permits() and the accessors: any thread, concurrently.
//   - Completion callbacks run on the session's IO threads; they may call request() (the
//     request's permit is already released when the callback runs) but must not block or call
//     the control functions below.
//   - Control functions (add_path, remove_path, disconnect_path, reconnect_path, set_policy,
//     set_max_reconnect_attempts) may be called from any thread except a completion callback or
//     event callback; each returns when done. They are serialized.
//   - Event callbacks (ClientOptions::on_event) run on the session's control thread.
//   - With a CompletionReaper (below), the completions of the reaping thread's own requests run
//     on that thread, inside reap(), under the same rules as on an IO thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "ibtrs/address.h"
#include "ibtrs/auth.h"
#include "ibtrs/tls.h"
#include "ibtrs/path_spec.h"
#include "ibtrs/result.h"
#include "ibtrs/types.h"

namespace ibtrs {

class ClientSession;
class CompletionReaper;

// Memory registered with every path of a session (and with paths added later). Deregisters on
// destruction; it must outlive every request that uses it, and the session must outlive it.
class RegisteredMemory {
 public:
  ~RegisteredMemory();
  RegisteredMemory(const RegisteredMemory&) = delete;
  RegisteredMemory& operator=(const RegisteredMemory&) = delete;

  std::byte* data() const { return static_cast<std::byte*>(addr_); }
  size_t size() const { return size_; }

  struct Impl;
  Impl* impl() const { return impl_; }

 private:
  friend class ClientSession;
  RegisteredMemory(void* addr, size_t size, Impl* impl) : addr_(addr), size_(size), impl_(impl) {}
  void* addr_;
  size_t size_;
  Impl* impl_;
};

// A piece of a request's data: `len` bytes at `addr`, inside `mem`.
struct IoSeg {
  void* addr = nullptr;
  uint32_t len = 0;
  const RegisteredMemory* mem = nullptr;
};

enum class IoDir : uint8_t { read, write };
enum class PermitWait : uint8_t { no, yes };

// Completion of a request: err is 0 or a positive errno (the server's, or ENOTCONN / ETIMEDOUT /
// ECONNABORTED from the client when no path could carry it).
using IoDoneFn = void (*)(void* ctx, int err);

struct IoRequest {
  IoDir dir = IoDir::read;
  std::span<const std::byte> usr;  // user header, copied when the request is submitted
  // write: the data (0..max_segments(); none: the header is the whole request);
  // read: where it lands (1..max_segments())
  std::span<const IoSeg> data;
  IoDoneFn done = nullptr;
  void* ctx = nullptr;
};

enum class SessionEvent : uint8_t {
  path_up,       // a path became CONNECTED (first connect or reconnect)
  path_down,     // a CONNECTED path broke or was disconnected
  disconnected,  // the last CONNECTED path went down: requests wait for one to come back
  reconnected,   // a path came back after `disconnected`
};
std::string_view to_string(SessionEvent e);

struct SessionEventInfo {
  SessionEvent event;
  std::string path;       // the path's name (src@dst)
  std::error_code reason; // why a path went down
};

struct ClientOptions {
  std::string session_name;       // printable ASCII, 1..63 bytes; names the session on the server
  std::vector<PathSpec> paths;    // at least one
  uint32_t io_threads = 0;        // IO connections per path (0: min(hardware threads, 8))
  MpPolicy policy = MpPolicy::min_inflight;
  HeartbeatConfig heartbeat;
  ReconnectConfig reconnect;
  std::chrono::milliseconds connect_timeout{30000};  // per path establishment (RTRS: 30 s)
  // How long a request waits for a CONNECTED path when none is (then it fails with ENOTCONN).
  std::chrono::milliseconds pending_timeout{30000};
  bool busy_poll = false;         // IO threads spin instead of sleeping (latency for CPU)
  std::function<void(const SessionEventInfo&)> on_event;
  // Host authentication (ibtrs/auth.h): with a key every path proves it (DH-HMAC-CHAP) before
  // the server reveals anything, and with a server key the client checks the server too.
  // Without one the client is anonymous, which only a server with allow_any_host admits. A
  // path the server refuses (or that fails to prove the server) fails with EACCES and is not
  // retried on its own: it stays CLOSED until reconnect_path() (a new key needs a new session).
  ClientAuth auth;
  // TLS on the tcp paths (ibtrs/tls.h): every tcp connection of the session runs TLS 1.3 before
  // anything else, with a PSK derived from `auth`'s key (which it then needs) or with
  // certificates. A server that requires TLS refuses a session without it (EPROTONOSUPPORT); a
  // server that refuses our credentials fails the path with EACCES. rdma paths are unaffected.
  tls::Options tls;
};

struct ClientPathInfo {
  std::string name;         // "src@dst"
  PathSpec spec;
  ClientPathState state;
  FabricKind fabric;
  std::string hca_name;     // device ("rxe0"; "tcp" for the software fabric)
  uint8_t hca_port = 0;
  uint16_t recon_cnt = 0;
  std::optional<std::chrono::nanoseconds> latency;  // last heartbeat round trip
  uint32_t inflight = 0;
  PathAuthInfo auth;          // how the path authenticated, in its last establishment
  tls::Info tls;              // its service connection's TLS (tcp with ClientOptions::tls)
  std::error_code last_error; // why the path last failed or went down (EACCES: refused)
  PathStatsSnapshot stats;
  // The failover fence (docs/protocol.md, "Failover fence"): requests failed over from a broken
  // incarnation of this path wait until the server confirms it closed that incarnation.
  struct Fence {
    uint64_t waited = 0;   // requests of this path that waited for a fence (reads too)
    uint64_t fenced = 0;   // incarnations confirmed fenced (FENCE_RSP or the path's reconnect)
    std::chrono::nanoseconds last_rtt{0};  // from the first waiting request to the confirmation
    std::chrono::nanoseconds max_rtt{0};
  } fence;
};

class ClientSession {
 public:
  // Connects every path of `options`; succeeds when at least one path is CONNECTED (the others
  // keep reconnecting, except those refused with EACCES). Errors: EINVAL (bad options: a key
  // without a valid host id), the first path's connect error when none connects (ECONNREFUSED,
  // ETIMEDOUT, EPROTO for a server that speaks another version, EACCES when the server refused
  // the host or its key, or the server failed to prove the server key, ...).
  static Result<std::unique_ptr<ClientSession>> open(ClientOptions options);
  // Closes every path. Requests still in flight complete with ECONNABORTED first.
  ~ClientSession();
  ClientSession(const ClientSession&) = delete;
  ClientSession& operator=(const ClientSession&) = delete;

  // Submits a request. Errors (the callback is then not called): EINVAL (no callback, a read
  // without data,
  // too many segments, a segment outside its registration, user header too long), EMSGSIZE
  // (data longer than max_io_size()), EAGAIN (no permit and PermitWait::no), ENOTCONN (no path
  // is CONNECTED and none is coming back; or it waited pending_timeout for a permit, and
  // chunks were then kept for failover fences not yet confirmed: docs/protocol.md, "Failover
  // fence"), ESHUTDOWN (the session is closing).
  Status request(const IoRequest& req, PermitWait wait = PermitWait::yes);

  // A submission batch of the calling thread (the block layer's plug): requests this thread
  // submits to this session from begin_batch() to end_batch() may be held back and handed to
  // the wire together at end_batch() — on the tcp provider one system call per connection
  // instead of one per request. Not from a completion or event callback (an IO thread tearing
  // its connection down waits for end_batch(): it would wait for itself). Between the two
  // calls the thread must not block, wait for a completion or call control functions, and
  // end_batch() must follow soon. Batches of the same session nest (the outermost end sends);
  // a begin_batch() of another session while one is open is ignored (its requests go out at
  // once), as is an end_batch() without its begin.
  void begin_batch();
  void end_batch();

  // Caller-reaped completions (io_uring's IOPOLL, the kernel's blk_poll): a thread that submits
  // requests and then waits for them makes a reaper, and its reap() polls the connections that
  // thread's requests go to (one per path) and runs their completions on the thread itself,
  // instead of an IO thread receiving them and handing them over: one thread wake-up less per
  // round trip. See CompletionReaper for the rules. From the thread that will reap (its
  // requests and its reaper share the IO connection index the session gives that thread); not
  // from a callback. Errors: EBUSY (another reaper has this thread's connection index: a
  // thread sharing it with another reaper gains nothing), ESHUTDOWN, EMFILE/ENFILE (eventfd).
  Result<std::unique_ptr<CompletionReaper>> make_reaper();

  // Registers caller memory (local write + remote write) on every path's device.
  Result<std::unique_ptr<RegisteredMemory>> register_memory(void* addr, size_t size);
  // Allocates page-aligned memory and registers it; freed with the handle.
  Result<std::unique_ptr<RegisteredMemory>> alloc_buffer(size_t size);
  // Registers `mem`, made by another session of this process, with this session too, so that
  // this session's requests may carry its segments (a block device that sends the same buffers
  // to a standby server through a session of its own). The share is deregistered with `mem`,
  // which must not outlive this session either. A segment of memory this session neither made
  // nor shares is EINVAL at request(). Errors: EINVAL (`mem` is this session's), EEXIST
  // (shared with this session already), ENOSPC (shared with 3 sessions already), the
  // registration's errors. Not concurrently with the destruction of `mem`.
  Status share_memory(const RegisteredMemory& mem);

  // Fails now, with `err`, the requests that wait for a CONNECTED path (none is) and for
  // which `which(done, ctx)` holds (as given in their IoRequest), instead of at
  // pending_timeout: for an upper layer that sends them to another server. Their connections
  // are gone, so nothing of them reaches their buffers afterwards and nothing more of them is
  // sent; but a write whose copy reached the server before its path broke (one waiting for
  // its failover fence) may still land there later, with its own bytes (docs/protocol.md,
  // "Failover fence"). Requests on a CONNECTED path are not touched. Their callbacks run on the session's control thread before
  // this returns; `which` runs there too, under the session's lock of parked requests (it must
  // not call into the session). A control function.
  void fail_waiting(std::function<bool(IoDoneFn, void*)> which, int err);

  // Geometry, fixed when the first path connects.
  uint32_t queue_depth() const;
  uint32_t max_io_size() const;      // data bytes per request
  uint32_t max_usr_len(IoDir dir, size_t segments) const;  // user header bytes per request
  static constexpr uint32_t kMaxSegments = 15;  // data segments per request
  uint32_t free_permits() const;

  const std::string& name() const;
  const Uuid16& uuid() const;

  // Path control; each returns when done. Names are PathSpec::name() ("src@dst").
  // add_path: EEXIST (same name), ENOSPC (kMaxPaths), or the connect error (the path is removed;
  // EACCES when authentication failed).
  static constexpr size_t kMaxPaths = 16;
  Status add_path(const PathSpec& spec);
  // Fails over the path's requests, closes it and forgets it. ENOENT; EBUSY for the last path.
  Status remove_path(std::string_view name);
  // Closes the path (its requests fail over); it stays CLOSED until reconnect_path(). ENOENT.
  Status disconnect_path(std::string_view name);
  // Closes the path if needed and connects it again; returns when CONNECTED or failed. ENOENT.
  Status reconnect_path(std::string_view name);

  Status set_policy(MpPolicy policy);
  MpPolicy policy() const;
  Status set_max_reconnect_attempts(int32_t attempts);  // -1..9999, else EINVAL
  int32_t max_reconnect_attempts() const;

  std::vector<ClientPathInfo> paths() const;
  PathStatsSnapshot stats() const;  // sum over the paths
  // Resets the counters of `group` of one path (ENOENT) or, with an empty name, of all paths;
  // `all` and `fence` reset ClientPathInfo::fence too.
  Status reset_stats(std::string_view path = {}, StatsGroup group = StatsGroup::all);

  struct Impl;

 private:
  explicit ClientSession(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The reaping side of a thread's requests (ClientSession::make_reaper).
//
// While the thread is inside reap(), it holds the completion queues of its IO connection on
// every path: it polls them (on the tcp provider it reads the sockets itself; on rdma it polls
// the CQ) and runs the completion callbacks of whatever completed there, its own requests and
// any other request that happened to be posted to those connections. Between calls the queues
// stay lent (so that the next call takes them back with no system call), muted for the IO
// thread; an IO thread takes a queue back when it stays unpolled for ~10 ms
// (core::CqLease::kReclaimAfter), so a thread that stops reaping with requests in flight only
// delays them, and nothing is lost. Requests that complete elsewhere (large ones spread over
// the connections, failed-over ones, requests that waited for a path, failures) still run on
// IO threads or the control thread: a callback there may call wake() to end a blocking reap().
// Connection teardown (a broken path, heartbeat loss, disconnect_path, remove_path) wakes a
// blocking reap() and takes the queue back, and failover runs as in thread mode.
//
// The reaping thread should not wait for a permit (PermitWait::yes) when its own unreaped
// requests may hold them all: their completions then run only when the IO thread takes the
// connection back, ~10 ms later.
//
// Threading: reap() from one thread at a time, the one that made the reaper (other threads'
// requests do not go to its connections); never from a completion or event callback, nor
// inside a submission batch (EDEADLK). wake() from any thread. Destroy the reaper before its
// session, or after the session (then it only frees itself); not while its reap() runs.
// A session destroyed while its thread is inside reap() makes that reap() return ESHUTDOWN at
// once, and waits for it; the requests in flight then fail with ECONNABORTED on the session's
// threads, as in thread mode.
class CompletionReaper {
 public:
  ~CompletionReaper();
  CompletionReaper(const CompletionReaper&) = delete;
  CompletionReaper& operator=(const CompletionReaper&) = delete;

  // Polls the thread's connections and runs what completed there. With `wait` > 0 and nothing
  // completed, blocks on the connections' completion fds for up to `wait` (or until wake(), a
  // teardown or the session's close); microseconds::max() waits with no timeout (and no timer
  // to arm and cancel), except that a wait is cut to 1 ms when the IO thread was in a pass over
  // one of the connections (their completions then run there). Returns the number of request callbacks that ran on this thread during
  // the call (0: the wait expired or was cut short). Errors: ESHUTDOWN (the session is closing
  // or gone), EDEADLK (called inside a submission batch).
  Result<size_t> reap(std::chrono::microseconds wait);
  // Ends a blocking reap() (now, or the next one if none runs: it then returns at once).
  void wake();

  // For a thread that waits in its own poll/epoll set (an event loop that also serves
  // sockets) instead of inside reap(): a file descriptor that becomes readable (POLLIN) when a
  // connection this reaper holds has completions, or may have them (spurious wake-ups are
  // allowed). The thread waits for it with its own fds and, when it is readable, calls
  // reap(0us), which consumes what made it readable and arms the connections again, so that
  // the next completion makes it readable again.
  // It covers the connections this reaper borrowed and still holds (lent between calls). One
  // left unreaped for CqLease::kReclaimAfter goes back to its IO thread, and one that broke is
  // replaced by one not borrowed yet; the completions there run on the IO threads as usual. A
  // completion of the caller's that runs on another thread is thus the sign to call reap(0us),
  // which borrows them again. wake() does not make the fd readable.
  // Made on the first call, which gives back the connections held so far so that the set
  // starts complete: an epoll fd owned by the reaper (never close it), valid until the reaper
  // is destroyed. From the reaping thread, outside reap(). Errors: EMFILE/ENFILE.
  Result<int> fd();

  struct Impl;

 private:
  friend class ClientSession;
  explicit CompletionReaper(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ibtrs
