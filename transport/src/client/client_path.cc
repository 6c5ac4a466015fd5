// A path's life (kernel: rtrs_clt_path_up, rtrs_clt_reconnect_work, rtrs_clt_close_conns, the
// heartbeat of rtrs.c), on the worker unless said: opened with the session or added, up, failed
// (a broken connection, missed heartbeats), reconnected on its schedule, closed or removed.
// Structure in client_impl.h.
#include <cstring>

#include "client/client_impl.h"
#include "base/log.h"
#include "core/heartbeat_wr.h"

namespace ibtrs {
namespace client {

// Refusals that the same credentials and settings meet again on every retry: the server refused
// our host or key (EACCES), or requires TLS we do not speak (EPROTONOSUPPORT).
bool refused_for_good(std::error_code e) {
  return e == std::errc::permission_denied || e == std::errc::protocol_not_supported;
}

namespace {

std::string errstr(std::error_code ec) { return ec ? ec.message() : "ok"; }

}  // namespace

// ------------------------------------------------------------------------------------------
// Path

Path::Path(Session* sess, uint32_t slot_, PathSpec spec_, uint32_t io_threads)
    : s(sess),
      slot(slot_),
      spec(std::move(spec_)),
      name(spec.name()),
      hb(sess->opts.heartbeat),
      sched(sess->opts.reconnect),
      stats(io_threads + 1) {
  Uuid16 u = Uuid16::random();
  std::memcpy(uuid.data(), u.bytes, 16);
  for (uint32_t cid = 0; cid <= io_threads; ++cid) {
    auto c = std::make_unique<Con>();
    c->path = this;
    c->cid = static_cast<uint16_t>(cid);
    c->poller = cid == 0 ? sess->svc_poller.get() : sess->io_pollers[cid - 1].get();
    cons.push_back(std::move(c));
  }
}

void Session::refused(Path* path, std::error_code why) {
  (void)path->state.change(ClientPathState::closing);
  (void)path->state.change(ClientPathState::closed);
  BASE_LOG(warn, "path %s: %s: closed, not retried (reconnect it once the credentials are fixed)",
            path->name.c_str(), errstr(why).c_str());
  if (!any_path_may_return()) run_pending(true, why.value());
}

void Session::emit(SessionEvent e, const Path* path, std::error_code why) {
  BASE_LOG(info, "session %s: %s %s %s", opts.session_name.c_str(),
            std::string(to_string(e)).c_str(), path ? path->name.c_str() : "",
            why ? why.message().c_str() : "");
  if (opts.on_event) opts.on_event(SessionEventInfo{e, path ? path->name : std::string(), why});
}

void Session::on_path_up(Path* path) {
  // The server accepted this incarnation, and closed the older ones first (a reconnect closes
  // the stale path before it is answered): their fences are confirmed.
  fence_release(path, path->recon_cnt.load(std::memory_order_acquire), false);
  start_heartbeat(path);
  connected_paths.fetch_add(1, std::memory_order_acq_rel);
  emit(SessionEvent::path_up, path, {});
  if (was_disconnected) {
    was_disconnected = false;
    emit(SessionEvent::reconnected, path, {});
  }
  run_pending(false, 0);
}

void Session::on_path_down(Path* path, std::error_code why) {
  emit(SessionEvent::path_down, path, why);
  if (connected_paths.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    was_disconnected = true;
    emit(SessionEvent::disconnected, path, why);
  }
}

void Session::start_heartbeat(Path* path) {
  const uint64_t gen = path->gen.load(std::memory_order_acquire);
  path->hb_timer.store(svc_poller->add_timer(core::Clock::now() + opts.heartbeat.interval,
                                             [this, path, gen] { heartbeat_tick(path, gen); }));
}

// Service poller.
void Session::heartbeat_tick(Path* path, uint64_t gen) {
  if (path->gen.load(std::memory_order_acquire) != gen || !path->usable()) return;
  if (path->hb.on_timer(core::Clock::now()) == core::Heartbeat::Action::peer_dead) {
    BASE_LOG(warn, "path %s: %u heartbeats missed", path->name.c_str(), path->hb.missed());
    worker->post([this, path, gen] { path_failed(path, gen, errc(ETIMEDOUT)); });
    return;
  }
  Con* svc = path->cons[0].get();
  if (svc->gate.enter()) {
    (void)core::post_heartbeat(*svc->conn, proto::ImmType::hb_msg, wr_id(kWrSvc));
    svc->gate.exit();
  }
  path->hb_timer.store(svc_poller->add_timer(core::Clock::now() + opts.heartbeat.interval,
                                             [this, path, gen] { heartbeat_tick(path, gen); }));
}

// Worker: a connection of a CONNECTED path broke, or its heartbeats stopped.
void Session::path_failed(Path* path, uint64_t gen, std::error_code why) {
  if (path->gen.load(std::memory_order_acquire) != gen) return;
  if (!path->state.change_from(ClientPathState::connected, ClientPathState::reconnecting).ok())
    return;
  BASE_LOG(warn, "path %s: down (%s), reconnecting", path->name.c_str(), errstr(why).c_str());
  {
    std::lock_guard meta_lock(path->meta_mu);
    path->last_error = why;
  }
  teardown(path);
  on_path_down(path, why);
  fence_kick();  // a fence that went over this path goes again over another
  schedule_reconnect(path);
}

void Session::schedule_reconnect(Path* path) {
  if (closing.load()) return;
  auto delay = path->sched.next_delay();
  if (!delay) {
    // Attempts used up: the path rests CLOSED until a user reconnects it.
    (void)path->state.change(ClientPathState::closing);
    (void)path->state.change(ClientPathState::closed);
    BASE_LOG(warn, "path %s: reconnect attempts exhausted, closed", path->name.c_str());
    if (!any_path_may_return()) run_pending(true, ENOTCONN);
    return;
  }
  const uint64_t gen = path->gen.load();
  path->reconnect_timer.store(svc_poller->add_timer(core::Clock::now() + *delay, [this, path, gen] {
    worker->post([this, path, gen] {
      if (path->gen.load() == gen) reconnect_attempt(path);
    });
  }));
}

void Session::reconnect_attempt(Path* path) {
  if (closing.load()) return;
  if (!path->state.change_from(ClientPathState::reconnecting, ClientPathState::connecting).ok())
    return;
  ++path->recon_cnt;
  auto st = establish(path);
  if (st.ok()) {
    path->sched.reset();
    path->stats.on_reconnect(true);
    BASE_LOG(info, "path %s: reconnected", path->name.c_str());
    on_path_up(path);
    return;
  }
  path->stats.on_reconnect(false);
  {
    std::lock_guard meta_lock(path->meta_mu);
    path->last_error = st.error();
  }
  BASE_LOG(info, "path %s: reconnect failed: %s", path->name.c_str(), errstr(st.error()).c_str());
  teardown(path);
  (void)path->state.change(ClientPathState::connecting_err);
  if (refused_for_good(st.error())) return refused(path, st.error());
  (void)path->state.change(ClientPathState::reconnecting);
  schedule_reconnect(path);
}

Result<Path*> Session::new_path(const PathSpec& spec) {
  const std::string name = spec.name();
  if (find(name) != nullptr) return errc(EEXIST);
  uint32_t slot = ClientSession::kMaxPaths;
  for (uint32_t i = 0; i < ClientSession::kMaxPaths; ++i) {
    if (paths[i].load() == nullptr) {
      slot = i;
      break;
    }
  }
  if (slot == ClientSession::kMaxPaths) return errc(ENOSPC);
  auto p = std::make_unique<Path>(this, slot, spec, nio);
  Path* raw = p.get();
  all_paths.push_back(std::move(p));
  paths[slot].store(raw, std::memory_order_release);
  if (npaths_hint.load() < slot + 1) npaths_hint.store(slot + 1, std::memory_order_release);
  return raw;
}

Path* Session::find(std::string_view name) const {
  for (auto& slot : paths) {
    Path* p = slot.load(std::memory_order_acquire);
    if (p != nullptr && p->name == name) return p;
  }
  return nullptr;
}

// Worker: closes a path on request; it ends CLOSED (disconnect) or DEAD (remove).
Status Session::close_path(Path* path, ClientPathState final_state) {
  const auto prev = path->state.get();
  if (uint64_t t = path->reconnect_timer.exchange(0)) svc_poller->cancel_timer(t);
  path->gen.fetch_add(1);  // stale reconnect timers and failure reports find another generation
  if (prev != ClientPathState::closed) {
    if (!path->state.change(ClientPathState::closing).ok()) return errc(EBUSY);
    teardown(path);
    (void)path->state.change(ClientPathState::closed);
    if (prev == ClientPathState::connected) on_path_down(path, errc(ESHUTDOWN));
  }
  if (final_state == ClientPathState::dead) {
    (void)path->state.change(ClientPathState::dead);
    paths[path->slot].store(nullptr, std::memory_order_release);
  }
  if (!any_path_may_return()) run_pending(true, ENOTCONN);
  return {};
}

Status Session::open_paths() {
  std::error_code first_err;
  std::vector<Path*> failed;
  for (const auto& spec : opts.paths) {
    BASE_ASSIGN_OR_RETURN(Path * p, new_path(spec));
    auto st = establish(p);
    if (st.ok()) {
      on_path_up(p);
    } else {
      if (!first_err) first_err = st.error();
      BASE_LOG(warn, "path %s: %s", p->name.c_str(), errstr(st.error()).c_str());
      {
        std::lock_guard meta_lock(p->meta_mu);
        p->last_error = st.error();
      }
      teardown(p);
      (void)p->state.change(ClientPathState::connecting_err);
      failed.push_back(p);
    }
  }
  if (connected_paths.load() == 0) return first_err ? first_err : errc(ENOTCONN);
  // The session is up; paths that did not connect keep trying in the background, except those
  // the server refused: retrying the same credentials cannot help.
  for (Path* p : failed) {
    std::error_code e;
    {
      std::lock_guard meta_lock(p->meta_mu);
      e = p->last_error;
    }
    if (refused_for_good(e)) {
      refused(p, e);
      continue;
    }
    (void)p->state.change(ClientPathState::reconnecting);
    schedule_reconnect(p);
  }
  return {};
}

}  // namespace client
}  // namespace ibtrs
