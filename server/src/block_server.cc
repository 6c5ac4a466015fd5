#include "ibnbd/server.h"

#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "control_queue.h"
#include "base/worker.h"
#include "proto/access.h"
#include "proto/ibnbd_proto.h"

namespace ibnbd {

using ibtrs::IoDir;
using ibtrs::ServerRequest;
using ibtrs::ServerSession;

namespace server {
namespace {

// A device name as asked, with empty and "." components dropped (what resolve_export's
// rel_path is for a name that resolves).
std::string lexical_name(std::string_view n) {
  std::string out;
  while (!n.empty()) {
    const size_t slash = n.find('/');
    const std::string_view c = n.substr(0, slash);
    n = slash == std::string_view::npos ? std::string_view{} : n.substr(slash + 1);
    if (c.empty() || c == ".") continue;
    if (!out.empty()) out += '/';
    out += c;
  }
  return out;
}

// "ibnbd-server: WHAT WHO: WHY" on stderr (the daemon's log).
void log_warn(const std::string& what, const std::string& who, const std::string& why) {
  std::fprintf(stderr, "ibnbd-server: %s %s: %s\n", what.c_str(), who.c_str(), why.c_str());
}

struct Counters {
  std::atomic<uint64_t> read_ops{0}, read_bytes{0}, write_ops{0}, write_bytes{0};
  std::atomic<uint64_t> flush_ops{0}, discard_ops{0}, write_zeroes_ops{0}, status_ops{0}, errors{0};
  std::atomic<int64_t> inflight{0};

  void done(IoOp op, uint32_t bytes, int err) {
    constexpr auto r = std::memory_order_relaxed;
    if (err != 0) errors.fetch_add(1, r);
    switch (op) {
      case IoOp::read: read_ops.fetch_add(1, r); read_bytes.fetch_add(err ? 0 : bytes, r); break;
      case IoOp::write: write_ops.fetch_add(1, r); write_bytes.fetch_add(err ? 0 : bytes, r); break;
      case IoOp::flush: flush_ops.fetch_add(1, r); break;
      case IoOp::discard:
      case IoOp::secure_erase: discard_ops.fetch_add(1, r); break;
      case IoOp::write_zeroes: write_zeroes_ops.fetch_add(1, r); break;
      case IoOp::block_status: status_ops.fetch_add(1, r); break;
    }
  }
  BlockStats snapshot() const {
    constexpr auto r = std::memory_order_relaxed;
    BlockStats s;
    s.read_ops = read_ops.load(r);
    s.read_bytes = read_bytes.load(r);
    s.write_ops = write_ops.load(r);
    s.write_bytes = write_bytes.load(r);
    s.flush_ops = flush_ops.load(r);
    s.discard_ops = discard_ops.load(r);
    s.write_zeroes_ops = write_zeroes_ops.load(r);
    s.status_ops = status_ops.load(r);
    s.errors = errors.load(r);
    s.inflight = inflight.load(r);
    return s;
  }
};

// One exported device, shared by every session that holds it open. It is its store (FileId),
// whatever name each session opened it by; `name` is its first opening's resolved path.
struct Device {
  FileId id;
  std::string name;
  std::unique_ptr<Backend> backend;
  Counters stats;
  bool size_error_logged = false;  // the size check's first failure was logged (control thread)
};

// A device id of a session as the IO threads see it. Written by the control thread only.
struct Slot {
  std::atomic<Device*> dev{nullptr};
  std::atomic<uint8_t> mode{0};
};

// What the engine's callback needs to answer one request; one per chunk of the session (a chunk
// carries one request at a time), so the IO path allocates nothing.
struct IoCtx {
  struct SrvSession* sess = nullptr;
  ServerRequest* req = nullptr;
  Device* dev = nullptr;
  IoOp op = IoOp::read;
  uint32_t bytes = 0;
};

// A session of the block layer on the server (the kernel's rnbd_srv_session), over one transport
// session (ts: rtrs_srv_sess).
struct SrvSession {
  proto::SessionId id = 0;
  ServerSession* ts = nullptr;
  std::string name;
  std::string host;  // authenticated by the transport before the session came up
  std::atomic<uint8_t> version{0};
  std::unique_ptr<Slot[]> slots;
  std::unique_ptr<IoCtx[]> ctxs;
  uint32_t nctx = 0;
  Counters stats;
  std::atomic<bool> ctl_refusal_logged{false};  // the first EAGAIN of its control queue was logged
  // Size notices (protocol 4), control thread only: the session's size epoch (a new value from
  // the server's counter whenever a device it holds changes size), and its held WATCH with the
  // epoch the client said it saw. At most one WATCH is held per session; a second is EBUSY.
  uint64_t size_epoch = 0;
  ServerRequest* watch = nullptr;
  uint64_t watch_seen = 0;
  std::chrono::steady_clock::time_point watch_since{};
  // Paths of the session gone so far (on_path_down, before it lets go of the WATCH). A WATCH that
  // waited in the control queue while one went may have come on it: it is answered, not held.
  std::atomic<uint64_t> path_downs{0};
  // Its last path went: no path joins it any more, and a WATCH that reaches on_request now (a
  // copy the transport deferred behind the old one starts after its path closed) is answered.
  std::atomic<bool> paths_gone{false};
};

// A control request decoded on its IO thread, waiting for the control thread: the request to
// answer and the message as a value (the chunk it came in is never read again).
struct ControlReq {
  ServerRequest* r = nullptr;
  proto::Request msg;
  uint64_t path_downs = 0;  // SrvSession::path_downs when it arrived
};

// Control requests (OPEN, CLOSE, WATCH) one session may have waiting; more are refused with
// EAGAIN. An honest client sends OPEN and CLOSE one at a time (BlockSession serializes map, unmap
// and remap) beside its one WATCH.
constexpr size_t kMaxControlPerSession = 16;

// How long a WATCH is held at most: then it is answered (with no news) and the client posts it
// again. It bounds a WATCH held for a path that is gone while its session lives on (a copy the
// transport deferred behind the old one and started after the path closed; a copy re-sent on
// another path then waits behind it): notices are late by this at most, never lost.
constexpr auto kWatchHoldMax = std::chrono::seconds(60);

// The largest user header the server copies out of a chunk: OPEN (264 bytes) with room for a
// longer SESS_INFO from a newer client (its tail is ignored). Longer ones are EBADMSG.
constexpr size_t kMaxRequestMsg = 512;
static_assert(sizeof(proto::OpenMsg) <= kMaxRequestMsg && sizeof(proto::IoMsg) <= kMaxRequestMsg);

// A read-side section of one IO thread: from before it reads a session's slot until the request
// counted itself in flight on the device it found. `seq` is odd inside. quiesce() waits only for
// sections that are running, which take a few instructions; it never waits for the thread's
// loop. Both sides use seq_cst (the entry here, the slot load, the slot clear and quiesce's
// read), so either the reader sees the cleared slot or quiesce sees the reader inside.
class LookupSection {
 public:
  explicit LookupSection(std::atomic<uint64_t>& seq)
      : seq_(seq), v_(seq.fetch_add(1, std::memory_order_seq_cst) + 1) {}
  ~LookupSection() { seq_.store(v_ + 1, std::memory_order_release); }
  LookupSection(const LookupSection&) = delete;
  LookupSection& operator=(const LookupSection&) = delete;

 private:
  std::atomic<uint64_t>& seq_;
  uint64_t v_;
};

}  // namespace

// One IO thread's io_uring, driven by that thread (ibtrs::IoThreadHook).
struct EngineHook final : ibtrs::IoThreadHook {
  std::unique_ptr<IoEngine> engine;
  // Requests the ring had no room for (EAGAIN): retried as completions free slots.
  std::deque<std::pair<ServerRequest*, ibnbd::BackendRequest>> overflow;
  // LookupSection of this thread; its own cache line (written twice per IO, read by quiesce).
  alignas(64) std::atomic<uint64_t> lookups{0};

  int fd() const override { return engine->event_fd(); }
  size_t poll() override {
    size_t n = engine->run_completions();
    while (!overflow.empty()) {
      auto& [req, io] = overflow.front();
      auto st = engine->submit(io);
      if (!st.ok() && st.error() == std::errc::resource_unavailable_try_again) break;
      if (!st.ok()) {
        auto* ctx = static_cast<IoCtx*>(io.ctx);
        io.done(ctx, st.error().value());
      }
      overflow.pop_front();
      ++n;
    }
    return n;
  }
  void flush() override { (void)engine->kick(); }
};

}  // namespace server

using namespace server;

struct BlockServer::Impl final : ibtrs::ServerHandler {
  BlockServerOptions opts;
  std::vector<std::unique_ptr<EngineHook>> hooks;  // per IO thread
  std::unique_ptr<ibtrs::Server> transport;
  base::Worker control;

  // Control thread only.
  proto::OpenTable table;
  // The RBD cluster connection, made at the first RBD open (declared before the devices: their
  // images go first). After a failure, opens within kRbdRetry get the same error at once: each
  // try may hold the control thread for the whole connect timeout.
  static constexpr auto kRbdRetry = std::chrono::seconds(5);
  std::unique_ptr<RbdCluster> rbd_cluster;
  std::error_code rbd_connect_error;
  std::chrono::steady_clock::time_point rbd_retry_at{};
  std::map<FileId, std::unique_ptr<Device>> devices;
  proto::SessionId next_session = 1;
  // Size epochs: one counter for every session, started from the wall clock so that a restarted
  // server's epochs differ from (and normally exceed) those its clients saw from the previous
  // one; a client's WATCH with an epoch of another incarnation is answered at once.
  uint64_t epoch_gen = 0;
  bool stopping = false;  // ~BlockServer: WATCHes are answered, not held

  // OPEN and CLOSE waiting for the control thread, per session, served round robin; at most one
  // serve_control() task is posted at a time (ctl_serving), so admin commands posted meanwhile
  // wait for one request, not for a whole flood.
  std::mutex ctl_mu;
  FairQueue<SrvSession*, ControlReq> ctl_queue{kMaxControlPerSession};
  bool ctl_serving = false;

  // Sessions by name, for listings and admin lookups (the IO path never takes it).
  mutable std::mutex mu;
  std::map<proto::SessionId, SrvSession*> sessions;

  // Hosts: their secrets for the transport (a thread-safe table it reads on its control
  // thread), their grants for OPEN (acl_mu: the control thread checks, admin commands change).
  ibtrs::KeyTable keys;
  mutable std::mutex acl_mu;
  proto::ExportAcl acl;
  std::map<std::string, HostConfig, std::less<>> host_cfg;  // as configured, for listings
  std::atomic<uint64_t> acl_eacces{0}, acl_eperm{0};

  explicit Impl(BlockServerOptions o) : opts(std::move(o)), table(opts.max_devices_per_session - 1) {
    timespec ts{};
    ::clock_gettime(CLOCK_REALTIME, &ts);
    epoch_gen = static_cast<uint64_t>(ts.tv_sec) * 1000000000u + static_cast<uint64_t>(ts.tv_nsec);
  }

  Status set_host(HostConfig h, bool keep_access) {
    if (!ibtrs::valid_host_id(h.host) || h.keys.empty()) return errc(EINVAL);
    std::lock_guard l(acl_mu);
    if (keep_access) {
      if (auto it = host_cfg.find(h.host); it != host_cfg.end()) h.access = it->second.access;
    }
    std::vector<proto::AclRule> rules;
    for (const auto& r : h.access) rules.push_back(proto::AclRule{r.devices, r.mode});
    for (const auto& r : rules) BASE_TRY(proto::check_acl_rule(r));
    BASE_TRY(keys.set(h.host, ibtrs::HostKeys{h.keys, h.server_key}));
    (void)acl.set_host(h.host, std::move(rules));
    host_cfg[h.host] = std::move(h);
    return {};
  }

  // May the session's host open `rel` (its path under the search root) in `mode`? `shown` names
  // it in the log when it is not `rel` itself.
  Status check_access(const SrvSession& s, const std::string& rel, AccessMode mode, const std::string& shown = {}) {
    Status st;
    {
      std::lock_guard l(acl_mu);
      st = acl.check(s.host, rel, mode);
    }
    if (st.ok()) return st;
    (st.error().value() == EPERM ? acl_eperm : acl_eacces).fetch_add(1, std::memory_order_relaxed);
    log_warn("OPEN refused:", shown.empty() ? rel : shown,
             "host '" + (s.host.empty() ? std::string("(anonymous)") : s.host) + "' of session " + s.name +
                 (st.error().value() == EPERM ? " may not open it " + std::string(to_string(mode))
                                              : " may not open it"));
    return st;
  }

  // ---- transport callbacks ----
  ibtrs::IoThreadHook* io_thread_hook(uint32_t thread) override {
    if (thread >= hooks.size()) hooks.resize(thread + 1);
    // Memory-backed files (tmpfs) are read and written on the IO thread itself: io_uring would
    // hand each such request to a worker thread. EngineHook::poll() runs the callbacks in the
    // same pass (the hook contract), so no wake-up is needed.
    EngineOptions eo;
    eo.queue_depth = opts.engine_queue_depth;
    eo.sync_memory_files = true;
    auto e = IoEngine::create(eo);
    if (!e.ok()) {
      log_warn("io_uring for IO thread", std::to_string(thread), e.error().message());
      return nullptr;
    }
    hooks[thread] = std::make_unique<EngineHook>();
    hooks[thread]->engine = std::move(*e);
    return hooks[thread].get();
  }

  void on_session_up(ServerSession& ts) override {
    auto* s = new SrvSession;
    s->ts = &ts;
    s->name = ts.name();
    s->host = ts.host();
    s->slots = std::make_unique<Slot[]>(opts.max_devices_per_session);
    s->nctx = opts.transport.queue_depth;
    s->ctxs = std::make_unique<IoCtx[]>(s->nctx);
    s->id = control.call([this, s] {
      s->size_epoch = ++epoch_gen;
      return next_session++;
    });
    {
      std::lock_guard l(mu);
      sessions[s->id] = s;
    }
    ts.context.store(s, std::memory_order_release);
  }

  // The session's last path went away: its opens are released now, not when its last request
  // completes (on_session_down), so a client that reconnects and re-opens is not refused by its
  // own previous incarnation still holding the rw slot. Its IO from now on gets ENODEV, which
  // the client answers with a remap.
  //
  // Any path going down lets go of the session's WATCH: the transport re-sends a request of a
  // lost path on another one into the same chunk, where it waits until the old copy completes
  // (docs/protocol.md, "Failover and the server's chunk rules"). The answer (the current
  // snapshot) is lost with the path or reaches the client, which posts again either way; the
  // session is not freed before it completes (on_session_down's call() runs after this post).
  void on_path_down(ServerSession& ts, const ibtrs::ServerPathInfo&) override {
    auto* s = static_cast<SrvSession*>(ts.context.load(std::memory_order_acquire));
    if (s == nullptr) return;
    // Every request that came on the path reached on_request before this (the transport closed
    // the path's connections first), so a WATCH still queued sees the count move.
    s->path_downs.fetch_add(1, std::memory_order_acq_rel);
    const bool last = ts.paths().empty();
    if (last) s->paths_gone.store(true, std::memory_order_release);
    control.post([this, s] { answer_watch(*s, true); });
    if (!last) return;
    control.post([this, s] { release_all(*s); });  // on_session_down's call() runs after it
  }

  void release_all(SrvSession& s) {
    bool published = false;
    for (uint32_t i = 0; i < opts.max_devices_per_session; ++i)
      published |= s.slots[i].dev.exchange(nullptr, std::memory_order_seq_cst) != nullptr;
    if (published) quiesce();
    for (auto& r : table.end_session(s.id)) {
      if (r.last_holder) close_device(r.file);
    }
  }

  void on_session_down(ServerSession& ts) override {
    auto* s = static_cast<SrvSession*>(ts.context.load(std::memory_order_acquire));
    if (s == nullptr) return;
    {
      std::lock_guard l(mu);
      sessions.erase(s->id);
    }
    // Every request of the session has completed (the transport's promise), so no IO thread
    // holds any of its slots.
    control.call([this, s] {
      release_all(*s);
      return 0;
    });
    ts.context.store(nullptr, std::memory_order_release);
    delete s;
  }

  void on_request(ServerRequest& r) override {
    auto* s = static_cast<SrvSession*>(r.session().context.load(std::memory_order_acquire));
    if (s == nullptr) return r.complete(ESHUTDOWN);
    // The message lies in the session's chunk, which the client may still write (it holds the
    // chunk's key). It is copied out once, here, and decoded from the copy; only the decoded
    // value goes on (to the engine or the control thread). Nothing after this reads r.usr().
    const auto usr = r.usr();
    if (usr.size() > kMaxRequestMsg) return r.complete(EBADMSG);
    std::array<std::byte, kMaxRequestMsg> copy;
    std::memcpy(copy.data(), usr.data(), usr.size());
    const std::span<const std::byte> msg(copy.data(), usr.size());
    const proto::Carrier carrier{r.dir(), r.data().size()};
    auto type = proto::peek_type(msg);
    if (!type.ok()) return r.complete(EBADMSG);
    if (*type == proto::MsgType::io) {  // the IO path: no Request (with its strings) built
      auto io = proto::decode_io(msg, carrier);
      if (!io.ok()) return r.complete(io.error().value());
      return submit_io(*s, r, *io);
    }
    auto m = proto::decode_request(msg, carrier);
    if (!m.ok()) return r.complete(m.error().value());
    switch (m->type) {
      case proto::MsgType::sess_info: {
        auto v = proto::negotiate_version(m->sess_info.ver);
        if (!v.ok()) return r.complete(v.error().value());
        auto n = proto::encode_sess_info_rsp(r.data(), proto::SessInfoRsp{*v});
        if (!n.ok()) return r.complete(n.error().value());
        s->version.store(*v, std::memory_order_relaxed);
        return r.complete(0);
      }
      case proto::MsgType::open:
      case proto::MsgType::close:
      case proto::MsgType::watch:
        return queue_control(*s, r, std::move(*m));
      default:
        return r.complete(EBADMSG);
    }
  }

  // IO thread: hands a decoded OPEN or CLOSE to the control thread, or refuses it with EAGAIN
  // when the session already has kMaxControlPerSession waiting.
  void queue_control(SrvSession& s, ServerRequest& r, proto::Request&& m) {
    bool post = false;
    bool queued = false;
    {
      std::lock_guard l(ctl_mu);
      queued = ctl_queue.push(&s, ControlReq{&r, std::move(m), s.path_downs.load(std::memory_order_acquire)});
      if (queued) post = !std::exchange(ctl_serving, true);
    }
    if (post) control.post([this] { serve_control(); });
    if (queued) return;
    if (!s.ctl_refusal_logged.exchange(true, std::memory_order_relaxed))
      log_warn("control requests of session", s.name,
               "more than " + std::to_string(kMaxControlPerSession) +
                   " waiting; refusing the excess with EAGAIN (logged once per session)");
    r.complete(EAGAIN);
  }

  // Control thread: one request of the session whose turn it is, then the next turn is posted
  // behind whatever else was posted meanwhile (admin commands, session ends).
  void serve_control() {
    std::optional<std::pair<SrvSession*, ControlReq>> next;
    {
      std::lock_guard l(ctl_mu);
      next = ctl_queue.pop();
      if (!next) {
        ctl_serving = false;
        return;
      }
    }
    control_request(*next->first, next->second);
    bool more = false;
    {
      std::lock_guard l(ctl_mu);
      more = !ctl_queue.empty();
      if (!more) ctl_serving = false;
    }
    if (more) control.post([this] { serve_control(); });
  }

  // ---- IO path (the request's IO thread) ----
  void submit_io(SrvSession& s, ServerRequest& r, const proto::Io& io) {
    // No version check: before SESS_INFO no device is open, so such IO gets ENODEV below like
    // any unknown id. It is what a restarted server (or one that dropped the session's last
    // path) receives first -- the client's transport re-sends its requests in flight before the
    // client's SESS_INFO -- and ENODEV is the answer the client remaps and retries on.
    if (io.device_id >= opts.max_devices_per_session || r.chunk_id() >= s.nctx)
      return r.complete(ENODEV);
    EngineHook* h = r.io_thread() < hooks.size() ? hooks[r.io_thread()].get() : nullptr;
    if (h == nullptr) return r.complete(EIO);
    IoCtx& c = s.ctxs[r.chunk_id()];
    Device* d = nullptr;
    int refused = 0;
    {
      LookupSection section(h->lookups);
      Slot& slot = s.slots[io.device_id];
      d = slot.dev.load(std::memory_order_seq_cst);
      const auto mode = static_cast<AccessMode>(slot.mode.load(std::memory_order_relaxed));
      if (d == nullptr) {
        refused = ENODEV;
      } else if (auto allowed = proto::check_op_allowed(mode, io.op); !allowed.ok()) {
        refused = allowed.error().value();
      } else {
        d->stats.inflight.fetch_add(1, std::memory_order_relaxed);
      }
    }
    if (refused != 0) return r.complete(refused);
    c.sess = &s;
    c.req = &r;
    c.dev = d;
    c.op = io.op;
    c.bytes = io.bi_size;
    s.stats.inflight.fetch_add(1, std::memory_order_relaxed);
    ibnbd::BackendRequest q;
    q.backend = d->backend.get();
    q.op = io.op;
    q.flags = io.flags;
    q.offset = io.sector * kSectorSize;
    q.len = io.bi_size;
    // READ data, WRITE data, or the room for a BLOCK_STATUS answer: the client's buffer.
    if (io.op == IoOp::read || io.op == IoOp::write || io.op == IoOp::block_status) q.buf = r.data();
    q.done = &Impl::io_done;
    q.ctx = &c;
    auto st = h->engine->submit(q);
    if (st.ok()) return;
    if (st.error() == std::errc::resource_unavailable_try_again) {
      h->overflow.emplace_back(&r, q);
      return;
    }
    io_done(&c, st.error().value());
  }

  static void io_done(void* ctx, int err) {
    auto* c = static_cast<IoCtx*>(ctx);
    c->dev->stats.done(c->op, c->bytes, err);
    c->sess->stats.done(c->op, c->bytes, err);
    // Release: close_device's acquire load of 0 must see every use of the device's backend by
    // this request (submission read its fd) before it deletes the device (TSan found the
    // relaxed decrement).
    c->dev->stats.inflight.fetch_sub(1, std::memory_order_release);
    c->sess->stats.inflight.fetch_sub(1, std::memory_order_release);
    c->req->complete(err);
  }

  // ---- control thread ----
  void control_request(SrvSession& s, const ControlReq& c) {
    ServerRequest& r = *c.r;
    const proto::Request& m = c.msg;
    if (m.type == proto::MsgType::open) {
      auto rsp = open_device(s, m.open);
      if (!rsp.ok()) return r.complete(rsp.error().value());
      auto n = proto::encode_open_rsp(r.data(), *rsp);
      return r.complete(n.ok() ? 0 : n.error().value());
    }
    if (m.type == proto::MsgType::watch) return arm_watch(s, r, m.watch, c.path_downs);
    r.complete(close_id(s, m.close.device_id).error().value());
  }

  // ---- size notices (control thread) ----

  // WATCH: held until the session's epoch differs from what the client saw (at once when it
  // does already). EPROTO before a SESS_INFO that agreed on version 4 (the transport re-sends a
  // WATCH to a restarted server before the client introduces itself again); EBUSY when the
  // session has one held: a client holds one chunk and one permit for this, not more.
  // `path_downs`: the session's count when it arrived; a path lost since may have been its own,
  // whose copy the transport re-sends into this chunk: answered now, that copy is served.
  void arm_watch(SrvSession& s, ServerRequest& r, const proto::Watch& m, uint64_t path_downs) {
    if (s.version.load(std::memory_order_relaxed) < proto::kWatchVersion) return r.complete(EPROTO);
    if (s.watch != nullptr) return r.complete(EBUSY);
    s.watch = &r;
    s.watch_seen = m.epoch;
    s.watch_since = std::chrono::steady_clock::now();
    answer_watch(s, stopping || s.paths_gone.load(std::memory_order_acquire) ||
                        s.path_downs.load(std::memory_order_acquire) != path_downs);
  }

  // Answers the session's held WATCH with its epoch and the size of every device it has open:
  // when the epoch differs from what the client saw, or always with `release` (a path went
  // down, the server stops). Devices beyond what the client's buffer holds are counted, not
  // listed (count < total): the client asks again with a larger buffer.
  void answer_watch(SrvSession& s, bool release) {
    if (s.watch == nullptr || (!release && s.watch_seen == s.size_epoch)) return;
    ServerRequest* r = std::exchange(s.watch, nullptr);
    proto::WatchRsp rsp;
    rsp.epoch = s.size_epoch;
    for (const auto& o : table.devices_of(s.id)) {  // by id, ascending
      if (o.force_closed) continue;
      auto it = devices.find(o.file);
      if (it == devices.end()) continue;
      rsp.entries.push_back(proto::WatchEntry{o.device_id, it->second->backend->size() / kSectorSize});
    }
    rsp.total = static_cast<uint32_t>(rsp.entries.size());
    auto n = proto::encode_watch_rsp(r->data(), rsp);
    r->complete(n.ok() ? 0 : n.error().value());
  }

  // Re-reads a device's size; when it changed, every session that holds it gets a new epoch and
  // its WATCH answered. The backend's size (what IO is checked against) is the new one first.
  void check_size(Device& d) {
    const uint64_t old = d.backend->size();
    auto now = d.backend->refresh_size();
    if (!now.ok()) {
      if (!std::exchange(d.size_error_logged, true))
        log_warn("size of", d.name, now.error().message() + " (logged once; it keeps the size it had)");
      return;
    }
    d.size_error_logged = false;
    if (*now != old) size_changed(d, old, *now);
  }

  void size_changed(Device& d, uint64_t old, uint64_t now) {
    size_t notified = 0;
    for (const auto& h : table.holders(d.id)) {
      SrvSession* s = nullptr;
      {
        std::lock_guard l(mu);
        if (auto it = sessions.find(h.session); it != sessions.end()) s = it->second;
      }
      if (s == nullptr) continue;
      s->size_epoch = ++epoch_gen;
      if (s->watch != nullptr && s->watch_seen != s->size_epoch) ++notified;
      answer_watch(*s, false);
    }
    std::fprintf(stderr, "ibnbd-server: %s: size %llu -> %llu bytes (%zu session(s) notified)\n", d.name.c_str(),
                 static_cast<unsigned long long>(old), static_cast<unsigned long long>(now), notified);
  }

  // The periodic check (base::Worker::every, BlockServerOptions::size_check_interval): a
  // stat or an ioctl per open device (an image: librbd's cached size, kept current by its
  // header watch, which also calls on_size_notice at once); WATCHes held kWatchHoldMax are let
  // go of.
  void check_sizes() {
    for (auto& [id, d] : devices) check_size(*d);
    const auto old = std::chrono::steady_clock::now() - kWatchHoldMax;
    std::vector<SrvSession*> live;
    {
      std::lock_guard l(mu);
      for (auto& [sid, s] : sessions) live.push_back(s);
    }
    // Listed sessions stay until on_session_down's call() on this thread.
    for (SrvSession* s : live)
      if (s->watch != nullptr && s->watch_since < old) answer_watch(*s, true);
  }

  void on_size_notice(const FileId& id) {
    if (auto it = devices.find(id); it != devices.end()) check_size(*it->second);
  }

  // What an OPEN names, found and checked: the store's identity, its name for listings, and
  // either the backend already opened (an RBD image: its identity is known only then) or how to
  // open it.
  struct Located {
    FileId id;
    std::string name;
    std::unique_ptr<Backend> opened;
    std::optional<ExportTarget> target;
  };

  Result<proto::OpenRsp> open_device(SrvSession& s, const proto::Open& m) {
    if (s.version.load(std::memory_order_relaxed) == 0) return errc(EPROTO);
    auto loc = is_rbd_name(m.dev_name) ? locate_rbd(s, m) : locate_file(s, m);
    if (!loc.ok()) return loc.error();
    // The device is the store the name leads to: an alias of an open device (a symlink, "./x",
    // "/root/x", an image opened again) is that device, under the name it already has.
    std::string name = loc->name;
    Device* dev = nullptr;
    if (auto it = devices.find(loc->id); it != devices.end()) {
      dev = it->second.get();
      name = dev->name;
      if (dev->backend->read_only() && m.mode != AccessMode::ro) return errc(EROFS);
      // Held open by others since before a resize (a grown file, `rbd resize`) that the size
      // check has not seen yet: the OPEN answers with the size the store has now, and the
      // other holders are told. IO in flight keeps its range checks against either size.
      check_size(*dev);
    }
    auto grant = table.open(s.id, loc->id, name, m.mode);
    if (!grant.ok()) return grant.error();
    if (dev == nullptr) {
      std::unique_ptr<Backend> backend = std::move(loc->opened);
      if (!backend) {
        auto b = open_file(*loc->target, m.mode);
        if (!b.ok()) {
          (void)table.close(s.id, grant->device_id);
          log_warn("OPEN", name, b.error().message());
          return b.error();
        }
        backend = std::move(*b);
      }
      auto d = std::make_unique<Device>();
      d->id = loc->id;
      d->name = name;
      d->backend = std::move(backend);
      dev = d.get();
      devices.emplace(loc->id, std::move(d));
      // An image tells of its resizes at once (librbd's header watch, on librbd's thread: handed
      // to this thread by id, so a notice for a device closed meanwhile finds nothing).
      if (dev->backend->kind() == Backend::Kind::rbd) {
        auto st = dev->backend->watch_size([this, id = loc->id] { control.post([this, id] { on_size_notice(id); }); });
        if (!st.ok() && st.error() != std::errc::operation_not_supported)
          log_warn("rbd update watch of", name, st.error().message() + " (its size is polled instead)");
      }
    }
    if (grant->device_id >= opts.max_devices_per_session) {
      (void)release(s.id, grant->device_id);
      return errc(ENOSPC);
    }
    // A client writing again to a device it held before takes it over from whoever holds it
    // now (its previous server: the lock would otherwise wait out that server's watch). Not in
    // migration mode, where two holders are the point.
    if ((m.flags & proto::kOpenReopen) && m.mode == AccessMode::rw) {
      auto fenced = dev->backend->take_over();
      if (!fenced.ok()) {
        log_warn("OPEN", name, "taking it over: " + fenced.error().message());
      } else if (!fenced->empty()) {
        log_warn("OPEN", name, "re-opened by session " + s.name + ": took the exclusive lock over from " + *fenced +
                                   " (fenced: blocklisted)");
      }
    }
    Slot& slot = s.slots[grant->device_id];
    slot.mode.store(static_cast<uint8_t>(m.mode), std::memory_order_relaxed);
    slot.dev.store(dev, std::memory_order_release);
    proto::OpenRsp rsp;
    rsp.device_id = grant->device_id;
    rsp.geo = dev->backend->geometry();
    // The epoch this size belongs to: a WATCH_RSP with a higher one is newer for this device.
    if (s.version.load(std::memory_order_relaxed) >= proto::kWatchVersion) rsp.size_epoch = s.size_epoch;
    return rsp;
  }

  Result<Located> locate_file(SrvSession& s, const proto::Open& m) {
    std::string why;
    auto target = resolve_export(opts.dev_search_path, s.name, m.dev_name, &why);
    // The grants first, on the resolved name -- or, when it did not resolve, on the name as
    // asked (lexically cleaned): a host learns nothing of what exists where it may not look.
    BASE_TRY(check_access(s, target.ok() ? target->rel_path : lexical_name(m.dev_name), m.mode));
    // And on the file it leads to: a symlink in a directory the host may open from (its own)
    // into one it may not (another host's) opens nothing there.
    if (target.ok() && target->real_path != target->rel_path)
      BASE_TRY(check_access(s, target->real_path, m.mode, target->rel_path + " -> " + target->real_path));
    if (!target.ok()) {
      log_warn("OPEN refused:", m.dev_name, why.empty() ? target.error().message() : why);
      return target.error();
    }
    if (opts.read_only && m.mode != AccessMode::ro) return errc(EROFS);
    Located l;
    l.id = target->id;
    l.name = target->root_path + "/" + target->rel_path;
    l.target = std::move(*target);
    return l;
  }

  Result<std::unique_ptr<Backend>> open_file(const ExportTarget& target, AccessMode mode) {
    OpenOptions oo;
    oo.read_only = opts.read_only;
    oo.direct = opts.direct_io;
    auto b = Backend::open(target, oo);
    if (!b.ok() && !opts.read_only && mode == AccessMode::ro &&
        (b.error() == std::errc::permission_denied || b.error() == std::errc::read_only_file_system)) {
      oo.read_only = true;  // a store we may only read still serves ro opens
      b = Backend::open(target, oo);
    }
    return b;
  }

  // "rbd:POOL/IMAGE[@SNAP]": the grants on the name as asked (cleaned of nothing: it is not a
  // path), then the server's RBD configuration, then the image itself.
  Result<Located> locate_rbd(SrvSession& s, const proto::Open& m) {
    std::string why;
    auto name = parse_rbd_name(m.dev_name, &why);
    BASE_TRY(check_access(s, name.ok() ? name->text() : std::string(m.dev_name), m.mode));
    if (!name.ok()) {
      log_warn("OPEN refused:", m.dev_name, why);
      return name.error();
    }
    const std::string shown = name->text();
    if (!opts.rbd) {
      log_warn("OPEN refused:", shown, "this server exports no RBD images (no \"rbd\" in its configuration)");
      return errc(EOPNOTSUPP);
    }
    const RbdConfig& rc = *opts.rbd;
    if (!rc.pools.empty() && std::find(rc.pools.begin(), rc.pools.end(), name->pool) == rc.pools.end()) {
      log_warn("OPEN refused:", shown, "pool " + name->pool + " is not among the configured rbd pools");
      return errc(EACCES);
    }
    if ((opts.read_only || !name->snap.empty()) && m.mode != AccessMode::ro) {
      log_warn("OPEN refused:", shown, !name->snap.empty() ? "snapshots are read-only" : "the server is read-only");
      return errc(EROFS);
    }
    auto ns = rbd_namespace(rc.namespace_template, s.name);
    if (!ns.ok()) {
      log_warn("OPEN refused:", shown, "session name '" + s.name + "' cannot be a RADOS namespace");
      return ns.error();
    }
    auto* cluster = rbd_connect();
    if (cluster == nullptr) return rbd_connect_error;
    OpenOptions oo;
    oo.read_only = opts.read_only || !name->snap.empty();
    auto b = cluster->open(*name, *ns, oo, &why);
    if (!b.ok() && !oo.read_only && m.mode == AccessMode::ro &&
        (b.error() == std::errc::permission_denied || b.error() == std::errc::operation_not_permitted)) {
      oo.read_only = true;  // caps that allow reads only still serve ro opens
      b = cluster->open(*name, *ns, oo, &why);
    }
    if (!b.ok()) {
      log_warn("OPEN", shown, why);
      return b.error();
    }
    Located l;
    l.id = (*b)->id();
    l.name = ns->empty() ? shown : shown + " (namespace " + *ns + ")";
    l.opened = std::move(*b);
    return l;
  }

  RbdCluster* rbd_connect() {
    if (rbd_cluster) return rbd_cluster.get();
    const auto now = std::chrono::steady_clock::now();
    if (rbd_connect_error && now < rbd_retry_at) return nullptr;
    std::string why;
    auto c = RbdCluster::connect(*opts.rbd, &why);
    if (!c.ok()) {
      rbd_connect_error = c.error();
      rbd_retry_at = now + kRbdRetry;
      log_warn("rbd:", "cluster", why);
      return nullptr;
    }
    rbd_cluster = std::move(*c);
    std::fprintf(stderr, "ibnbd-server: rbd: connected to cluster %s as client.%s\n", rbd_cluster->fsid().c_str(),
                 opts.rbd->client_id.c_str());
    return rbd_cluster.get();
  }

  // Frees a session's id; the device goes when its last holder does.
  Status release(proto::SessionId sid, uint32_t id) {
    auto r = table.close(sid, id);
    if (!r.ok()) return r.error();
    if (r->last_holder) close_device(r->file);
    return {};
  }

  // CLOSE. An id the session does not have (never opened, closed already, out of range) is
  // ENODEV at once, the answer IO to it gets: nothing of it is visible to the IO threads, so
  // there is nothing to wait for, and a flood of such CLOSEs costs a map lookup each.
  Status close_id(SrvSession& s, uint32_t id) {
    if (id >= opts.max_devices_per_session || !table.has_id(s.id, id)) return errc(ENODEV);
    unpublish(s.slots[id]);
    return release(s.id, id);
  }

  // Takes a slot away from the IO threads; when it was visible, waits until no lookup that may
  // have seen it is still running.
  void unpublish(Slot& slot) {
    if (slot.dev.exchange(nullptr, std::memory_order_seq_cst) != nullptr) quiesce();
  }

  // Waits until every IO thread has left the LookupSection it was in, if any: a request that saw
  // a slot before it was cleared has by then counted itself in flight on the device. Sections
  // are a few instructions long, so this takes microseconds (waiting for two loop passes of
  // every IO thread, as before, took ~0.1 s per idle thread).
  void quiesce() {
    for (auto& h : hooks) {
      if (!h) continue;
      const uint64_t v = h->lookups.load(std::memory_order_seq_cst);
      if ((v & 1) == 0) continue;
      while (h->lookups.load(std::memory_order_acquire) == v) std::this_thread::yield();
    }
  }

  void close_device(const FileId& id) {
    auto it = devices.find(id);
    if (it == devices.end()) return;
    Device* d = it->second.get();
    quiesce();
    while (d->stats.inflight.load(std::memory_order_acquire) > 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (auto st = d->backend->sync(); !st.ok()) log_warn("closing", d->name, "sync: " + st.error().message());
    devices.erase(it);
  }

  SrvSession* find_session(std::string_view name) const {
    std::lock_guard l(mu);
    for (auto& [id, s] : sessions)
      if (s->name == name) return s;
    return nullptr;
  }
};

// ---- public API ----

BlockServer::BlockServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

BlockServer::~BlockServer() {
  // WATCHes held now are let go of as their paths close; one that reaches the control thread
  // after that is answered at once.
  impl_->control.call([im = impl_.get()] {
    im->stopping = true;
    return 0;
  });
  // Closes every path and waits until each request was answered; the IO threads (and with them
  // the engines' completions) run until then.
  impl_->transport.reset();
  impl_->control.call([im = impl_.get()] {
    std::vector<FileId> ids;
    for (auto& [id, d] : im->devices) ids.push_back(id);
    for (auto& id : ids) im->close_device(id);
    return 0;
  });
  impl_->control.stop();
}

Result<std::unique_ptr<BlockServer>> BlockServer::start(BlockServerOptions o) {
  if (o.dev_search_path.empty() || o.dev_search_path[0] != '/' || o.max_devices_per_session == 0 ||
      o.engine_queue_depth == 0)
    return errc(EINVAL);
  auto impl = std::make_unique<Impl>(std::move(o));
  impl->opts.transport.handler = impl.get();
  impl->opts.transport.authenticator = &impl->keys;
  impl->opts.transport.allow_any_host = impl->opts.allow_any_host;
  impl->acl.set_allow_any_host(impl->opts.allow_any_host);
  for (auto& h : impl->opts.hosts) {
    if (impl->host_cfg.count(h.host) != 0) return errc(EINVAL);  // listed twice
    BASE_TRY(impl->set_host(h, false));
  }
  auto srv = ibtrs::Server::start(impl->opts.transport);
  if (!srv.ok()) return srv.error();
  impl->transport = std::move(*srv);
  for (auto& h : impl->hooks) {
    if (!h) return errc(ENOSYS);  // an IO thread without io_uring could not serve anything
  }
  if (impl->opts.size_check_interval.count() > 0)
    impl->control.every(impl->opts.size_check_interval, [im = impl.get()] { im->check_sizes(); });
  return std::unique_ptr<BlockServer>(new BlockServer(std::move(impl)));
}

std::vector<ibtrs::Address> BlockServer::addresses() const { return impl_->transport->addresses(); }
const BlockServerOptions& BlockServer::options() const { return impl_->opts; }
const ibtrs::ServerOptions& BlockServer::transport_options() const { return impl_->transport->options(); }
ibtrs::Refusals& BlockServer::refusals() const { return impl_->transport->refusals(); }
ibtrs::ServerUsage BlockServer::usage() const { return impl_->transport->usage(); }
std::vector<ibtrs::IoThreadWaitStats> BlockServer::io_thread_stats() const {
  return impl_->transport->io_thread_stats();
}

std::vector<BlockSessionInfo> BlockServer::sessions() const {
  std::vector<std::pair<proto::SessionId, SrvSession*>> live;
  {
    std::lock_guard l(impl_->mu);
    live.assign(impl_->sessions.begin(), impl_->sessions.end());
  }
  std::vector<BlockSessionInfo> out;
  impl_->control.call([&] {
    for (auto& [id, s] : live) {
      BlockSessionInfo i;
      i.name = s->name;
      i.host = s->host;
      i.version = s->version.load();
      i.stats = s->stats.snapshot();
      i.size_epoch = s->size_epoch;
      i.watching = s->watch != nullptr;
      for (auto& o : impl_->table.devices_of(id))
        i.devices.push_back(SessionOpenInfo{o.device_id, o.dev, o.mode, o.force_closed});
      out.push_back(std::move(i));
    }
    return 0;
  });
  for (auto& i : out) {
    (void)impl_->transport->with_session(i.name, [&](ibtrs::ServerSession& ts) { i.paths = ts.paths(); });
  }
  return out;
}

std::vector<ExportedDeviceInfo> BlockServer::devices() const {
  std::map<proto::SessionId, std::string> names;
  {
    std::lock_guard l(impl_->mu);
    for (auto& [id, s] : impl_->sessions) names[id] = s->name;
  }
  return impl_->control.call([&] {
    std::vector<ExportedDeviceInfo> out;
    for (auto& [id, d] : impl_->devices) {
      ExportedDeviceInfo i;
      i.name = d->name;
      switch (d->backend->kind()) {
        case Backend::Kind::file: i.kind = "file"; break;
        case Backend::Kind::block_device: i.kind = "block_device"; break;
        case Backend::Kind::rbd: i.kind = "rbd"; break;
      }
      i.size = d->backend->size();
      i.direct = d->backend->direct();
      i.read_only = d->backend->read_only();
      i.stats = d->stats.snapshot();
      for (auto& h : impl_->table.holders(id)) {
        DeviceHolderInfo hi;
        hi.session = names.count(h.session) ? names[h.session] : std::to_string(h.session);
        hi.mode = h.mode;
        for (auto& o : impl_->table.devices_of(h.session))
          if (o.file == id && !o.force_closed) hi.device_id = o.device_id;
        i.holders.push_back(std::move(hi));
      }
      out.push_back(std::move(i));
    }
    return out;
  });
}

Status BlockServer::force_close(std::string_view device, std::string_view session) {
  SrvSession* s = impl_->find_session(session);
  if (s == nullptr) return errc(ENOENT);
  return impl_->control.call([&]() -> Status {
    uint32_t id = UINT32_MAX;
    FileId file;
    for (auto& o : impl_->table.devices_of(s->id)) {
      if (o.dev == device && !o.force_closed) {
        id = o.device_id;
        file = o.file;
      }
    }
    if (id == UINT32_MAX) return errc(ENOENT);
    if (id < impl_->opts.max_devices_per_session) impl_->unpublish(s->slots[id]);
    auto r = impl_->table.force_close(file, s->id);
    if (!r.ok()) return r.error();
    if (r->last_holder) impl_->close_device(r->file);
    return {};
  });
}

Status BlockServer::disconnect_path(std::string_view session, std::string_view path) {
  Status st = errc(ENOENT);
  auto found = impl_->transport->with_session(session, [&](ibtrs::ServerSession& ts) {
    st = ts.disconnect_path(path);
  });
  return found.ok() ? st : found;
}

Status BlockServer::set_host(HostConfig h, bool keep_access) { return impl_->set_host(std::move(h), keep_access); }

Status BlockServer::remove_host(std::string_view host) {
  std::lock_guard l(impl_->acl_mu);
  auto it = impl_->host_cfg.find(host);
  if (it == impl_->host_cfg.end()) return errc(ENOENT);
  (void)impl_->keys.remove(host);
  (void)impl_->acl.remove_host(host);
  impl_->host_cfg.erase(it);
  return {};
}

std::vector<HostInfo> BlockServer::hosts() const {
  std::map<std::string, uint32_t> live;
  {
    std::lock_guard l(impl_->mu);
    for (auto& [id, s] : impl_->sessions) ++live[s->host];
  }
  std::lock_guard l(impl_->acl_mu);
  std::vector<HostInfo> out;
  for (const auto& [name, h] : impl_->host_cfg) {
    HostInfo i;
    i.host = name;
    for (const auto& k : h.keys) i.key_fingerprints.push_back(k.fingerprint());
    if (h.server_key) i.server_key_fingerprint = h.server_key->fingerprint();
    i.access = h.access;
    i.sessions = live.count(name) ? live[name] : 0;
    out.push_back(std::move(i));
  }
  return out;
}

AuthStats BlockServer::auth_stats() const {
  AuthStats a;
  a.transport = impl_->transport->auth_counters();
  a.open_refused_eacces = impl_->acl_eacces.load(std::memory_order_relaxed);
  a.open_refused_eperm = impl_->acl_eperm.load(std::memory_order_relaxed);
  a.allow_any_host = impl_->opts.allow_any_host;
  return a;
}

Status BlockServer::reset_path_stats(std::string_view session, std::string_view path,
                                     ibtrs::StatsGroup group) {
  Status st = errc(ENOENT);
  auto found = impl_->transport->with_session(session, [&](ibtrs::ServerSession& ts) {
    st = ts.reset_stats(path, group);
  });
  return found.ok() ? st : found;
}

}  // namespace ibnbd
