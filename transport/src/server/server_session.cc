// The sessions' control functions (any thread, through the worker) and teardown (worker):
// closing a path, detaching a session that has none left, freeing it once drained.
#include <unistd.h>  // first: a libc header defines __GLIBC__
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <string>

#include "base/log.h"
#include "server/server_impl.h"

namespace ibtrs::server {

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

}  // namespace ibtrs::server
