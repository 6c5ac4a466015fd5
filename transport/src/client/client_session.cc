// The client session's public API (kernel: rtrs_clt_open, rtrs_clt_close, rtrs_clt_query, the
// sysfs controls of rtrs-clt-sysfs.c): open and close, batches, path control, policy and
// statistics. The work happens elsewhere: client_io.cc (requests), client_path.cc and
// client_connect.cc (paths), client_mem.cc (registrations), client_reaper.cc (reapers).
// Structure in client_impl.h.
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "client/client_impl.h"
#include "base/log.h"

namespace ibtrs {
namespace client {

// The client-role TLS context of ClientOptions::tls: certificates when a CA is given, else the
// PSK of the host key. EINVAL: PSK mode without a host key, unreadable PEM files.
Result<std::shared_ptr<tls::Context>> make_tls_context(const ClientOptions& o) {
  tls::Config c;
  c.role = tls::Role::client;
  c.kernel = o.tls.kernel;
  if (!o.tls.ca_file.empty()) {
    c.ca_file = o.tls.ca_file;
    c.server_name = o.tls.server_name;
    c.cert_file = o.tls.cert_file;
    c.key_file = o.tls.key_file;
  } else {
    if (!o.auth.enabled() || !o.tls.cert_file.empty() || !o.tls.key_file.empty()) return errc(EINVAL);
    BASE_ASSIGN_OR_RETURN(auto psk, tls_psk_of(o.auth.host_id, *o.auth.key));
    c.psk = std::move(psk);
  }
  return tls::Context::create(std::move(c));
}

namespace {

bool printable_name(std::string_view n) {
  if (n.empty() || n.size() >= proto::kNameMax) return false;
  return std::all_of(n.begin(), n.end(), [](char c) { return c > ' ' && c < 0x7f; });
}

}  // namespace

Session::~Session() {
  closing.store(true);
  {
    // Reapers stop borrowing, and one inside reap() returns; CQs they hold lent_idle are
    // seized by the teardown below.
    std::lock_guard lock(reap_mu);
    for (auto& port : reapers) {
      if (!port) continue;
      port->closed.store(true, std::memory_order_seq_cst);
      port->wake();
    }
  }
  for (auto& port : reapers) {
    while (port && port->inside.load(std::memory_order_seq_cst) != 0) std::this_thread::yield();
  }
  if (cancel_fd) {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t r = ::write(cancel_fd.get(), &one, sizeof(one));
  }
  for (auto& p : all_paths) {
    std::lock_guard lock(p->info_mu);
    p->info_cv.notify_all();
  }
  if (permits) permits->close();
  if (worker) {
    worker->call([this] {
      for (auto& p : all_paths) {
        if (uint64_t t = p->reconnect_timer.exchange(0)) svc_poller->cancel_timer(t);
        p->gen.fetch_add(1);
        (void)p->state.change(ClientPathState::closing);
        teardown(p.get());
        (void)p->state.change(ClientPathState::closed);
      }
      run_pending(true, ECONNABORTED);
      return 0;
    });
    worker->stop();
  }
  if (svc_poller) {
    svc_poller->run_sync([] {});  // a running tick has re-armed by now, or saw `closing`
    if (uint64_t t = tick_timer.load()) svc_poller->cancel_timer(t);
  }
  io_pollers.clear();
  svc_poller.reset();
  {
    // Every connection is gone; what lived in the session's domains goes before them.
    std::lock_guard lock(mem_mu);
    for (auto& mr : iu_mrs) mr.reset();
    for (auto& w : wins) w.reset();
  }
  if (iu != nullptr) ::munmap(iu, iu_len);
  cancel_fd.reset();  // last, as it always was (the worker that connects with it has stopped)
}

}  // namespace client

// ------------------------------------------------------------------------------------------
// Public API

std::string_view to_string(SessionEvent e) {
  switch (e) {
    case SessionEvent::path_up: return "path_up";
    case SessionEvent::path_down: return "path_down";
    case SessionEvent::disconnected: return "disconnected";
    case SessionEvent::reconnected: return "reconnected";
  }
  return "?";
}

ClientSession::ClientSession(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ClientSession::~ClientSession() = default;

Result<std::unique_ptr<ClientSession>> ClientSession::open(ClientOptions options) {
  if (!client::printable_name(options.session_name) || options.paths.empty() ||
      options.paths.size() > kMaxPaths || options.heartbeat.interval.count() <= 0 ||
      options.heartbeat.missed_max == 0)
    return errc(EINVAL);
  if (options.auth.enabled() && (!valid_host_id(options.auth.host_id) || options.auth.key->empty() ||
                                 (options.auth.server_key && options.auth.server_key->empty())))
    return errc(EINVAL);
  auto impl = std::make_unique<Impl>();
  impl->opts = std::move(options);
  if (impl->opts.tls.mode != tls::Options::Mode::off) {
    BASE_ASSIGN_OR_RETURN(impl->tls_ctx, client::make_tls_context(impl->opts));
  }
  const uint32_t hw = std::max(1u, std::thread::hardware_concurrency());
  impl->nio = impl->opts.io_threads ? impl->opts.io_threads : std::min(hw, 8u);
  if (impl->nio > 64) return errc(EINVAL);
  impl->max_reconnect_attempts.store(impl->opts.reconnect.max_attempts);
  impl->policy.store(impl->opts.policy);
  impl->uuid = Uuid16::random();
  std::memcpy(impl->uuid_bytes.data(), impl->uuid.bytes, 16);
  for (uint32_t i = 0; i < impl->nio; ++i) {
    BASE_ASSIGN_OR_RETURN(auto p, core::Poller::start("ibtrs-c-io" + std::to_string(i), i,
                                                       impl->opts.busy_poll ? core::PollMode::spin : core::PollMode::block));
    impl->io_pollers.push_back(std::move(p));
  }
  BASE_ASSIGN_OR_RETURN(impl->svc_poller, core::Poller::start("ibtrs-c-svc", impl->nio, core::PollMode::block));
  impl->cancel_fd.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!impl->cancel_fd) return errc(errno);
  impl->worker = std::make_unique<base::Worker>();
  Impl* s = impl.get();
  BASE_TRY(s->worker->call([s] { return s->open_paths(); }));
  // A periodic tick for parked requests' deadlines.
  struct Ticker {
    static void arm(Impl* s) {
      s->tick_timer = s->svc_poller->add_timer(core::Clock::now() + client::kTick, [s] {
        bool any;
        {
          std::lock_guard lock(s->pend_mu);
          // Fences with only kept chunks too: run_pending asks for them again (fence_kick).
          any = !s->pending.empty() || s->fence_waiting.load(std::memory_order_acquire) != 0 ||
                s->fence_kept.load(std::memory_order_acquire) != 0;
        }
        if (any) {
          // Deadlines here, not behind the worker: it may sit in a connect for up to
          // connect_timeout (a server holding it while the session's predecessor drains).
          s->expire_parked();
          s->worker->post([s] { s->run_pending(false, 0); });
        }
        if (!s->closing.load()) arm(s);
      });
    }
  };
  Ticker::arm(s);
  return std::unique_ptr<ClientSession>(new ClientSession(std::move(impl)));
}

Status ClientSession::request(const IoRequest& req, PermitWait wait) { return impl_->submit(req, wait); }

void ClientSession::begin_batch() {
  client::Plug& pl = client::tl_plug;
  if (pl.depth > 0 && pl.s != impl_.get()) return;  // another session's batch is open
  if (pl.depth == 0) pl.last_path = nullptr;
  pl.s = impl_.get();
  ++pl.depth;
}

void ClientSession::end_batch() {
  client::Plug& pl = client::tl_plug;
  if (pl.s != impl_.get() || pl.depth == 0 || --pl.depth > 0) return;
  client::flush_plug(pl);
  pl.s = nullptr;
  pl.last_path = nullptr;
}

void ClientSession::fail_waiting(std::function<bool(IoDoneFn, void*)> which, int err) {
  Impl* s = impl_.get();
  (void)s->worker->call([s, &which, err] {
    s->fail_parked(which, err);
    return Status{};
  });
}

uint32_t ClientSession::queue_depth() const { return impl_->geo.queue_depth; }
uint32_t ClientSession::max_io_size() const { return impl_->geo.max_io_size; }
uint32_t ClientSession::max_usr_len(IoDir dir, size_t segments) const {
  const size_t msg = dir == IoDir::write
                         ? sizeof(proto::WriteMsg)
                         : sizeof(proto::ReadMsgHeader) + segments * sizeof(proto::BufDesc);
  return impl_->geo.max_hdr_size > msg ? static_cast<uint32_t>(impl_->geo.max_hdr_size - msg) : 0;
}
uint32_t ClientSession::free_permits() const {
  return impl_->permits->depth() - impl_->permits->in_use();
}
const std::string& ClientSession::name() const { return impl_->opts.session_name; }
const Uuid16& ClientSession::uuid() const { return impl_->uuid; }

Status ClientSession::add_path(const PathSpec& spec) {
  Impl* s = impl_.get();
  return s->worker->call([s, &spec]() -> Status {
    BASE_ASSIGN_OR_RETURN(client::Path * p, s->new_path(spec));
    auto st = s->establish(p);
    if (st.ok()) {
      s->on_path_up(p);
      return {};
    }
    s->teardown(p);
    (void)p->state.change(ClientPathState::connecting_err);
    (void)p->state.change(ClientPathState::closing);
    (void)p->state.change(ClientPathState::closed);
    (void)p->state.change(ClientPathState::dead);
    s->paths[p->slot].store(nullptr, std::memory_order_release);
    return st;
  });
}

Status ClientSession::remove_path(std::string_view name) {
  Impl* s = impl_.get();
  return s->worker->call([s, name]() -> Status {
    client::Path* p = s->find(name);
    if (p == nullptr) return errc(ENOENT);
    size_t others = 0;
    for (auto& slot : s->paths) {
      auto* q = slot.load();
      if (q != nullptr && q != p) ++others;
    }
    if (others == 0) return errc(EBUSY);
    return s->close_path(p, ClientPathState::dead);
  });
}

Status ClientSession::disconnect_path(std::string_view name) {
  Impl* s = impl_.get();
  return s->worker->call([s, name]() -> Status {
    client::Path* p = s->find(name);
    if (p == nullptr) return errc(ENOENT);
    return s->close_path(p, ClientPathState::closed);
  });
}

Status ClientSession::reconnect_path(std::string_view name) {
  Impl* s = impl_.get();
  return s->worker->call([s, name]() -> Status {
    client::Path* p = s->find(name);
    if (p == nullptr) return errc(ENOENT);
    if (p->state.get() != ClientPathState::closed) BASE_TRY(s->close_path(p, ClientPathState::closed));
    BASE_TRY(p->state.change(ClientPathState::reconnecting));
    BASE_TRY(p->state.change(ClientPathState::connecting));
    ++p->recon_cnt;
    p->sched.reset();
    auto st = s->establish(p);
    if (st.ok()) {
      p->stats.on_reconnect(true);
      s->on_path_up(p);
      return {};
    }
    p->stats.on_reconnect(false);
    {
      std::lock_guard meta_lock(p->meta_mu);
      p->last_error = st.error();
    }
    s->teardown(p);
    (void)p->state.change(ClientPathState::connecting_err);
    (void)p->state.change(ClientPathState::reconnecting);
    s->schedule_reconnect(p);
    return st;
  });
}

Status ClientSession::set_policy(MpPolicy policy) {
  impl_->policy.store(policy);
  return {};
}
MpPolicy ClientSession::policy() const { return impl_->policy.load(); }

Status ClientSession::set_max_reconnect_attempts(int32_t attempts) {
  if (attempts < -1 || attempts > 9999) return errc(EINVAL);
  impl_->max_reconnect_attempts.store(attempts);
  Impl* s = impl_.get();
  return s->worker->call([s, attempts]() -> Status {
    s->opts.reconnect.max_attempts = attempts;
    for (auto& p : s->all_paths) {
      p->sched = core::ReconnectSchedule(s->opts.reconnect);
    }
    return {};
  });
}
int32_t ClientSession::max_reconnect_attempts() const { return impl_->max_reconnect_attempts.load(); }

std::vector<ClientPathInfo> ClientSession::paths() const {
  std::vector<ClientPathInfo> out;
  for (auto& slot : impl_->paths) {
    client::Path* p = slot.load(std::memory_order_acquire);
    if (p == nullptr) continue;
    ClientPathInfo i;
    i.name = p->name;
    i.spec = p->spec;
    i.state = p->state.get();
    i.fabric = p->spec.destination.fabric;
    {
      std::lock_guard lock(p->meta_mu);
      i.hca_name = p->hca_name;
      i.hca_port = p->hca_port;
      i.auth = p->auth;
      i.tls = p->tls;
      i.last_error = p->last_error;
    }
    i.recon_cnt = p->recon_cnt;
    i.latency = p->hb.latency();
    i.inflight = p->inflight.load();
    i.stats = p->stats.snapshot();
    i.fence.waited = p->fence_waited.load(std::memory_order_relaxed);
    i.fence.fenced = p->fences_done.load(std::memory_order_relaxed);
    i.fence.last_rtt = std::chrono::nanoseconds(p->fence_rtt_last_ns.load(std::memory_order_relaxed));
    i.fence.max_rtt = std::chrono::nanoseconds(p->fence_rtt_max_ns.load(std::memory_order_relaxed));
    out.push_back(std::move(i));
  }
  return out;
}

PathStatsSnapshot ClientSession::stats() const {
  PathStatsSnapshot total;
  for (auto& slot : impl_->paths) {
    client::Path* p = slot.load(std::memory_order_acquire);
    if (p != nullptr) total += p->stats.snapshot();
  }
  return total;
}

Status ClientSession::reset_stats(std::string_view path, StatsGroup group) {
  bool found = path.empty();
  for (auto& slot : impl_->paths) {
    client::Path* p = slot.load(std::memory_order_acquire);
    if (p == nullptr || (!path.empty() && p->name != path)) continue;
    p->stats.reset(group);
    if (group == StatsGroup::all || group == StatsGroup::fence) {
      p->fence_waited.store(0, std::memory_order_relaxed);
      p->fences_done.store(0, std::memory_order_relaxed);
      p->fence_rtt_last_ns.store(0, std::memory_order_relaxed);
      p->fence_rtt_max_ns.store(0, std::memory_order_relaxed);
    }
    found = true;
  }
  return found ? Status{} : Status{errc(ENOENT)};
}

}  // namespace ibtrs
