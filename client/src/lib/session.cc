// BlockSession: the block protocol's control messages (SESS_INFO, OPEN, CLOSE), map / unmap,
// and the remap after a reconnect (kernel: rnbd_clt_sess, rnbd_clt_map_device,
// rnbd_clt_remap_device, rnbd_clt_link_ev).
#include <algorithm>
#include <cstring>

#include "base/log.h"
#include "lib/client_impl.h"

namespace ibnbd {

using namespace client;

namespace {

// How often a remap that met a transport error is tried again while a path is up, and how
// often the worker looks for IO that waited too long while the session is down.
constexpr auto kRemapRetry = std::chrono::milliseconds(100);
constexpr auto kExpiryTick = std::chrono::milliseconds(50);
// Polling period of the drain waits (the counters are decremented on the IO path, which does
// not signal).
constexpr auto kDrainPoll = std::chrono::milliseconds(1);
// Size notices: how soon a WATCH is posted again after an answer that carried no news (the
// server let go of it: a path went down), after finding no free permit, and the back-off after
// errors (doubling up to its maximum).
constexpr auto kWatchRepost = std::chrono::milliseconds(100);
constexpr auto kWatchNoPermit = std::chrono::milliseconds(10);
constexpr auto kWatchBackoffMin = std::chrono::milliseconds(100);
constexpr auto kWatchBackoffMax = std::chrono::milliseconds(5000);

}  // namespace

// ---------------------------------------------------------------------------------------------
// Control messages

void Session::on_ctl_done(void* ctx, int err) {
  auto* slot = static_cast<CtlSlot*>(ctx);
  Impl* s = slot->s;
  // `counted` and `s` are stable while the slot is busy, and it stays busy until below.
  if (slot->counted) s->inflight.fetch_sub(1, std::memory_order_seq_cst);
  // A permit came back; IO may be waiting for one.
  if (s->q_len.load(std::memory_order_seq_cst) != 0) s->pump();  // as finish_part's
  std::lock_guard l(s->ctl_slot_mu);
  slot->done = true;
  slot->err = err;
  if (slot->abandoned) slot->busy = false;
  s->ctl_cv.notify_all();
}

// Sends one control message and waits for the answer. READ carriers land in a slot of ctl_mem
// and are copied to `rsp`. `carries_id`: the message names a device id (CLOSE), so it counts in
// `inflight` and is only sent while the session is open (see client_impl.h).
Status Session::control(ibtrs::IoDir dir, std::span<const std::byte> usr, std::span<std::byte> rsp,
                        bool carries_id) {
  size_t idx = kCtlSlots;
  {
    std::lock_guard l(ctl_slot_mu);
    for (size_t i = 0; i < kCtlSlots; ++i) {
      if (!ctl_slots[i].busy) {
        idx = i;
        break;
      }
    }
    if (idx == kCtlSlots) return errc(ENOBUFS);  // every slot held by an answer still due
    ctl_slots[idx] = CtlSlot{this, true, false, false, carries_id, 0};
  }
  CtlSlot& slot = ctl_slots[idx];
  auto give_back = [&] {
    std::lock_guard l(ctl_slot_mu);
    slot.busy = false;
  };
  std::byte* buf = ctl_mem->data() + idx * kCtlSlotSize;
  ibtrs::IoSeg seg{buf, static_cast<uint32_t>(kCtlSlotSize), ctl_mem.get()};
  ibtrs::IoRequest req;
  req.dir = dir;
  req.usr = usr;
  if (dir == ibtrs::IoDir::read) req.data = std::span<const ibtrs::IoSeg>(&seg, 1);
  req.done = &Session::on_ctl_done;
  req.ctx = &slot;
  if (carries_id) {
    inflight.fetch_add(1, std::memory_order_seq_cst);
    if (!open.load(std::memory_order_seq_cst)) {
      inflight.fetch_sub(1, std::memory_order_seq_cst);
      give_back();
      return errc(ENOTCONN);
    }
  }
  // Permits may all be taken by IO; wait for one, but not past the control timeout (a
  // PermitWait::yes could wait for ever on a server that holds requests).
  const auto deadline = Clock::now() + opts.control_timeout;
  Status st;
  for (;;) {
    st = ts->request(req, ibtrs::PermitWait::no);
    if (st.ok() || st.error() != errc(EAGAIN) || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(kDrainPoll);
  }
  if (!st.ok()) {
    if (carries_id) inflight.fetch_sub(1, std::memory_order_seq_cst);
    give_back();
    return st.error() == errc(EAGAIN) ? errc(ETIMEDOUT) : st.error();
  }
  // The worker waits here during a remap; it keeps expiring IO and running deferred
  // completions meanwhile, and gives up when the link changes (the remap starts over).
  const bool on_worker = std::this_thread::get_id() == worker.get_id();
  std::unique_lock l(ctl_slot_mu);
  while (!slot.done) {
    const auto now = Clock::now();
    int give_up = now >= deadline ? ETIMEDOUT : 0;
    if (give_up == 0 && on_worker) {
      l.unlock();
      run_deferred();
      expire(now);
      if (link_changed(worker_gen)) give_up = ENOTCONN;
      l.lock();
    }
    if (slot.done) break;
    if (give_up != 0) {
      slot.abandoned = true;  // the slot is freed by the completion, whenever it comes
      return errc(give_up);
    }
    ctl_cv.wait_until(l, std::min(deadline, now + kExpiryTick));
  }
  const int err = slot.err;
  if (err == 0 && !rsp.empty()) std::memcpy(rsp.data(), buf, std::min(rsp.size(), kCtlSlotSize));
  slot.busy = false;
  if (err != 0) return errc(err);
  return {};
}

Result<uint8_t> Session::sess_info() {
  std::byte msg[sizeof(proto::SessInfoMsg)];
  BASE_ASSIGN_OR_RETURN(size_t n, proto::encode_sess_info(msg, proto::SessInfo{proto::kProtoVersion}));
  std::byte rsp[kCtlSlotSize];
  BASE_TRY(control(ibtrs::IoDir::read, std::span(msg, n), rsp, false));
  BASE_ASSIGN_OR_RETURN(auto r, proto::decode_sess_info_rsp(rsp));
  return proto::accept_version(proto::kProtoVersion, r.ver);
}

Result<proto::OpenRsp> Session::open_device(const std::string& name, AccessMode mode, bool reopen) {
  std::byte msg[sizeof(proto::OpenMsg)];
  const uint8_t ver = version.load();
  const uint8_t flags = reopen && ver >= proto::kOpenFlagsVersion ? proto::kOpenReopen : 0;
  BASE_ASSIGN_OR_RETURN(size_t n, proto::encode_open(msg, proto::Open{mode, name, flags}));
  std::byte rsp[kCtlSlotSize];
  BASE_TRY(control(ibtrs::IoDir::read, std::span(msg, n), rsp, false));
  return proto::decode_open_rsp(rsp, ver);
}

Status Session::close_id(uint32_t id) {
  std::byte msg[sizeof(proto::CloseMsg)];
  BASE_ASSIGN_OR_RETURN(size_t n, proto::encode_close(msg, proto::Close{id}));
  return control(ibtrs::IoDir::write, std::span(msg, n), {}, true);
}

void Session::emit(const DeviceEvent& e) {
  if (e.kind == DeviceEvent::Kind::resized) {
    BASE_LOG(info, "ibnbd %s: %s resized by the server: %llu -> %llu bytes", opts.transport.session_name.c_str(),
              e.dev_name.c_str(), static_cast<unsigned long long>(e.old_size),
              static_cast<unsigned long long>(e.new_size));
  } else {
    BASE_LOG(info, "ibnbd %s: %s %s id %u -> %u %s", opts.transport.session_name.c_str(),
              e.dev_name.c_str(), e.kind == DeviceEvent::Kind::remapped ? "remapped" : "remap failed",
              e.old_id, e.new_id, e.error ? e.error.message().c_str() : "");
  }
  if (opts.on_device_event) opts.on_device_event(e);
}

// ---------------------------------------------------------------------------------------------
// Size notices (WATCH, protocol 4)

// open() before the worker starts, then the worker.
Status Session::post_watch() {
  if (!watch_mem) {
    // One transport request carries max_io_size of data at most (4 KiB on a server of 8 KiB
    // chunks and no chunk sets): a buffer for fewer devices then, and partial answers.
    const size_t fit = (ts->max_io_size() - sizeof(proto::WatchRspMsg)) / proto::kWatchEntryBytes;
    watch_entries = static_cast<uint32_t>(std::min<size_t>(watch_entries, fit));
    BASE_ASSIGN_OR_RETURN(watch_mem, ts->alloc_buffer(proto::watch_buffer_bytes(watch_entries)));
  }
  std::byte msg[sizeof(proto::WatchMsg)];
  const uint64_t epoch = watch_epoch.load(std::memory_order_relaxed);
  BASE_ASSIGN_OR_RETURN(size_t n, proto::encode_watch(msg, proto::Watch{epoch}));
  ibtrs::IoSeg seg{watch_mem->data(), static_cast<uint32_t>(proto::watch_buffer_bytes(watch_entries)),
                   watch_mem.get()};
  ibtrs::IoRequest req;
  req.dir = ibtrs::IoDir::read;
  req.usr = std::span(msg, n);
  req.data = std::span<const ibtrs::IoSeg>(&seg, 1);
  req.done = &Session::on_watch_done;
  req.ctx = this;
  {
    std::lock_guard l(st_mu);
    watch_posted = true;  // before the request: its answer may come at once
  }
  watch_sent = epoch;
  // Never waits for a permit: the worker has other duties, and IO may hold them all for a while.
  auto st = ts->request(req, ibtrs::PermitWait::no);
  if (!st.ok()) {
    std::lock_guard l(st_mu);
    watch_posted = false;
  }
  return st;
}

// A transport thread: note it for the worker.
void Session::on_watch_done(void* ctx, int err) {
  auto* s = static_cast<Session*>(ctx);
  {
    std::lock_guard l(s->st_mu);
    s->watch_posted = false;
    s->watch_answered = true;
    s->watch_err = err;
    s->watch_wake = true;
  }
  s->st_cv.notify_all();
}

Clock::time_point Session::watch_step(Clock::time_point now) {
  bool answered = false, posted = false;
  int err = 0;
  {
    std::lock_guard l(st_mu);
    answered = watch_answered;
    posted = watch_posted;
    err = watch_err;
    watch_wake = false;
  }
  if (answered) {
    // After the map, unmap or remap that holds it: the answer's ids are those of the devices
    // as that leaves them. Never blocks the worker (its deferred completions and expiry).
    std::unique_lock cl(ctl_mu, std::try_to_lock);
    if (!cl.owns_lock()) return now + kExpiryTick;
    {
      std::lock_guard l(st_mu);
      watch_answered = false;
    }
    on_watch_answer(err, now);
  }
  if (posted || version.load() < proto::kWatchVersion || closing.load() || !open.load())
    return Clock::time_point::max();  // an answer or the next remap wakes the worker
  if (now < watch_due) return watch_due;
  auto st = post_watch();
  if (st.ok()) return Clock::time_point::max();
  if (st.error() == errc(EAGAIN)) {
    watch_due = now + kWatchNoPermit;
  } else {
    watch_backoff = std::clamp(watch_backoff * 2, std::chrono::milliseconds(kWatchBackoffMin), kWatchBackoffMax);
    watch_due = now + watch_backoff;
    if (std::exchange(watch_logged_err, st.error().value()) != st.error().value())
      BASE_LOG(warn, "ibnbd %s: size notices: posting the WATCH: %s (retried)", opts.transport.session_name.c_str(),
                st.error().message().c_str());
  }
  return watch_due;
}

// Worker, under ctl_mu.
void Session::on_watch_answer(int err, Clock::time_point now) {
  watch_answers.fetch_add(1, std::memory_order_relaxed);
  Result<proto::WatchRsp> rsp = errc(err != 0 ? err : EIO);
  if (err == 0) rsp = proto::decode_watch_rsp(std::span(watch_mem->data(), proto::watch_buffer_bytes(watch_entries)));
  if (!rsp.ok()) {
    // A transport error (no path: posted again after the remap), EPROTO (a restarted server
    // that has not seen our SESS_INFO yet), or a server that answers nonsense: not in a loop.
    const int e = rsp.error().value();
    watch_last_err.store(e, std::memory_order_relaxed);
    watch_backoff = std::clamp(watch_backoff * 2, std::chrono::milliseconds(kWatchBackoffMin), kWatchBackoffMax);
    watch_due = now + watch_backoff;
    if (std::exchange(watch_logged_err, e) != e && !transport_error(e) && e != EPROTO)
      BASE_LOG(warn, "ibnbd %s: size notices: the WATCH failed: %s (retried in %lld ms)",
                opts.transport.session_name.c_str(), rsp.error().message().c_str(),
                static_cast<long long>(watch_backoff.count()));
    return;
  }
  watch_last_err.store(0, std::memory_order_relaxed);
  watch_logged_err = 0;
  watch_backoff = std::chrono::milliseconds(0);
  // The server let go of it without news (a path went down): not at once, so that a server
  // that keeps answering so cannot make us spin.
  watch_due = rsp->epoch == watch_sent ? now + kWatchRepost : now;

  // The mapped devices stay while ctl_mu is held (unmap takes it).
  std::vector<Device*> mapped;
  {
    std::lock_guard l(dev_mu);
    for (auto& [name, dev] : devices) mapped.push_back(dev->impl());
  }
  std::vector<DeviceEvent> events;
  for (Device* d : mapped) {
    if (d->state.load() == DeviceState::closed || rsp->epoch <= d->size_epoch) continue;
    const uint32_t id = d->id.load();
    auto it = std::lower_bound(rsp->entries.begin(), rsp->entries.end(), id,
                               [](const proto::WatchEntry& e, uint32_t v) { return e.device_id < v; });
    if (it == rsp->entries.end() || it->device_id != id) continue;
    d->size_epoch = rsp->epoch;
    const uint64_t lbs = d->lbs.load(std::memory_order_relaxed);
    const uint64_t bytes = it->nsectors * kSectorSize / lbs * lbs;
    const uint64_t old = d->size.load(std::memory_order_relaxed);
    if (bytes == old) continue;
    d->set_size(bytes);
    d->st.resizes.fetch_add(1, std::memory_order_relaxed);
    watch_resizes.fetch_add(1, std::memory_order_relaxed);
    events.push_back(DeviceEvent{DeviceEvent::Kind::resized, d->name, id, id, {}, old, bytes});
  }
  if (rsp->entries.size() < rsp->total) {
    // The buffer held only part of the session's devices: ask again with a larger one and the
    // epoch we had, which the server answers at once. One request carries max_io_size at most;
    // beyond that the rest stays unlisted (logged once) rather than asked for in a loop.
    const size_t fit = (ts->max_io_size() - sizeof(proto::WatchRspMsg)) / proto::kWatchEntryBytes;
    const auto want = static_cast<uint32_t>(std::min<size_t>(rsp->total, fit));
    if (want > watch_entries) {
      watch_entries = want;
      watch_mem.reset();  // allocated anew by the next post
      watch_due = now;
    } else {
      watch_epoch.store(rsp->epoch, std::memory_order_relaxed);
      if (!std::exchange(watch_partial_logged, true))
        BASE_LOG(warn, "ibnbd %s: size notices: the server lists %u devices, one answer holds %zu; the rest learn "
                        "their size at their next remap", opts.transport.session_name.c_str(), rsp->total, fit);
    }
  } else {
    watch_epoch.store(rsp->epoch, std::memory_order_relaxed);
  }
  for (auto& e : events) emit(e);
}

// ---------------------------------------------------------------------------------------------
// Link events and the worker

// Transport control thread. Only notes the state: the remap runs on our worker, because it
// waits for requests whose failover needs the transport's control thread.
void Session::on_transport_event(const ibtrs::SessionEventInfo& e) {
  if (e.event == ibtrs::SessionEvent::disconnected || e.event == ibtrs::SessionEvent::reconnected) {
    {
      std::lock_guard l(st_mu);
      ++link_gen;
      if (e.event == ibtrs::SessionEvent::disconnected) {
        // Before the transport re-sends anything on a new path (it does so after emitting
        // `reconnected`), so every IO answered by a restarted server finds the gate closed.
        open.store(false, std::memory_order_seq_cst);
        link_up = false;
        down_since = Clock::now();
      } else {
        link_up = true;
        remap_due = Clock::now();
      }
    }
    st_cv.notify_all();
  }
  {
    std::lock_guard l(ev_mu);
    for (auto& [id, fn] : listeners) fn(e);
  }
  if (opts.transport.on_event) opts.transport.on_event(e);
}

uint64_t Session::add_listener(std::function<void(const ibtrs::SessionEventInfo&)> fn) {
  std::lock_guard l(ev_mu);
  listeners.emplace_back(next_listener, std::move(fn));
  return next_listener++;
}

void Session::remove_listener(uint64_t id) {
  std::lock_guard l(ev_mu);
  std::erase_if(listeners, [id](const auto& x) { return x.first == id; });
}

void Session::abandon(Device* d, int err) {
  PartList waiting = d->take_waiting();
  {
    std::lock_guard l(q_mu);
    PartList mine = queue.extract([d](Part* p) { return p->req->dev == d; });
    q_len.store(queue.size, std::memory_order_release);
    while (!mine.empty()) waiting.push(mine.pop());
  }
  fail_list(waiting, err);
  // Parked in the transport: only parts (on_part_done) carry a Part; control messages are
  // CtlSlots and stay.
  ts->fail_waiting(
      [d](ibtrs::IoDoneFn fn, void* ctx) {
        return fn == &Session::on_part_done && static_cast<Part*>(ctx)->req->dev == d;
      },
      err);
}

bool Session::link_changed(uint64_t gen) {
  std::lock_guard l(st_mu);
  return link_gen != gen || stop;
}

void Session::run_deferred() {
  std::vector<UserReq*> v;
  {
    std::lock_guard l(st_mu);
    v.swap(deferred);
  }
  for (UserReq* r : v) run_completion(r);
}

void Session::worker_main() {
  std::unique_lock l(st_mu);
  while (!stop) {
    if (!deferred.empty()) {
      l.unlock();
      run_deferred();
      l.lock();
      continue;
    }
    auto now = Clock::now();
    if (!open.load() && link_up && now >= remap_due) {
      const uint64_t gen = link_gen;
      l.unlock();
      const bool done = remap_all(gen);
      l.lock();
      if (!done && link_gen == gen) remap_due = Clock::now() + kRemapRetry;
      continue;
    }
    l.unlock();
    reap_retired();
    const auto next = std::min(expire(now), watch_step(now));
    l.lock();
    // An answer that came after watch_step looked woke nobody: the worker was not waiting yet.
    if (stop || !deferred.empty() || watch_wake) continue;
    auto wake = next;
    if (!open.load()) {
      wake = std::min(wake, now + kExpiryTick);
      if (link_up) wake = std::min(wake, remap_due);
    }
    if (wake == Clock::time_point::max()) {
      st_cv.wait(l);
    } else {
      st_cv.wait_until(l, wake);
    }
  }
}

// Fails parts that waited longer than remap_timeout for the session or a device to come back.
// Returns when the next one would expire.
Clock::time_point Session::expire(Clock::time_point now) {
  Clock::time_point since;
  bool up = false;
  {
    std::lock_guard l(st_mu);
    since = down_since;
    up = link_up;
  }
  const int err = up ? ETIMEDOUT : ENOTCONN;
  const auto limit = opts.remap_timeout;
  Clock::time_point next = Clock::time_point::max();
  PartList dead;
  if (!open.load()) {
    std::lock_guard l(q_mu);
    dead = queue.extract([&](Part* p) { return std::max(p->queued_at, since) + limit <= now; });
    q_len.store(queue.size, std::memory_order_release);
    for (Part* p = queue.head; p != nullptr; p = p->next)
      next = std::min(next, std::max(p->queued_at, since) + limit);
  }
  for (Device* d : device_list()) {
    std::lock_guard l(d->mu);
    PartList old = d->held.extract([&](Part* p) { return p->queued_at + limit <= now; });
    while (!old.empty()) dead.push(old.pop());
    for (Part* p = d->held.head; p != nullptr; p = p->next) next = std::min(next, p->queued_at + limit);
  }
  // What an application sees as EIO then is this configured timeout, not a lost request: said
  // once per batch (the soak's verdict reads it too).
  if (!dead.empty())
    BASE_LOG(warn, "ibnbd %s: %zu IO parts failed (%s): %s for remap_timeout (%lld ms)",
              opts.transport.session_name.c_str(), dead.size, err == ETIMEDOUT ? "ETIMEDOUT" : "ENOTCONN",
              up ? "the remap did not finish" : "no path", static_cast<long long>(limit.count()));
  fail_list(dead, err);
  return next;
}

std::vector<Device*> Session::device_list() {
  std::lock_guard l(dev_mu);
  std::vector<Device*> v;
  v.reserve(devices.size() + retired.size());
  for (auto& [name, d] : devices) v.push_back(d->impl());
  for (auto& d : retired) v.push_back(d->impl());
  return v;
}

void Session::reap_retired() {
  std::lock_guard l(dev_mu);
  std::erase_if(retired, [](const std::shared_ptr<RemoteDevice>& d) {
    return d->impl()->inflight_reqs.load() == 0 && d->impl()->inflight_parts.load() == 0;
  });
}

// Waits until no request with an old device id is on the transport. false: the link changed,
// or the deadline passed (the remap is tried again later).
bool Session::wait_drain(uint64_t gen, Clock::time_point deadline) {
  while (inflight.load(std::memory_order_seq_cst) != 0) {
    if (link_changed(gen) || Clock::now() >= deadline) return false;
    // The worker is busy here: keep its other duties going.
    run_deferred();
    expire(Clock::now());
    std::this_thread::sleep_for(kDrainPoll);
  }
  return true;
}

bool Session::wait_device_drain(Device* d, Clock::time_point deadline) {
  while (d->inflight_parts.load(std::memory_order_seq_cst) != 0) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(kDrainPoll);
  }
  return true;
}

// Worker: the session is back after all paths were down. Returns false to be tried again
// (a transport error, the link changed, the drain took too long).
bool Session::remap_all(uint64_t gen) {
  std::lock_guard cl(ctl_mu);
  worker_gen = gen;
  DeferCompletions defer;  // completions of failed parts run when this returns
  std::vector<Device*> devs;
  {
    std::lock_guard l(dev_mu);
    for (auto& [name, d] : devices)
      if (d->impl()->state.load() != DeviceState::closed) devs.push_back(d->impl());
  }
  // Re-open in the order of the old ids: on a server that kept nothing, they come back the same
  // when nothing was unmapped in between (it hands out the lowest free id).
  std::sort(devs.begin(), devs.end(), [](Device* a, Device* b) { return a->id.load() < b->id.load(); });
  for (Device* d : devs) d->remapping.store(true, std::memory_order_seq_cst);

  auto v = sess_info();
  if (!v.ok()) {
    if (transport_error(v.error().value())) return false;
    // The server no longer speaks our protocol: nothing of this session can work.
    BASE_LOG(error, "ibnbd %s: SESS_INFO after reconnect: %s", opts.transport.session_name.c_str(),
              v.error().message().c_str());
    for (Device* d : devs) {
      close_device(d, v.error().value());
      emit(DeviceEvent{DeviceEvent::Kind::remap_failed, d->name, d->id.load(), d->id.load(), v.error()});
    }
  } else {
    version.store(*v);
    if (!wait_drain(gen, Clock::now() + opts.remap_timeout)) return false;
    for (Device* d : devs) {
      if (link_changed(gen)) return false;
      const uint32_t old = d->id.load();
      auto r = open_device(d->name, d->mode, !d->standby.load());
      if (!r.ok()) {
        if (transport_error(r.error().value())) return false;
        close_device(d, r.error().value());
        emit(DeviceEvent{DeviceEvent::Kind::remap_failed, d->name, old, old, r.error()});
        continue;
      }
      if (holder_of(r->device_id, gen, d) != nullptr) {  // now an alias of another mapping
        close_device(d, EEXIST);
        emit(DeviceEvent{DeviceEvent::Kind::remap_failed, d->name, old, old, errc(EEXIST)});
        continue;
      }
      d->apply(*r, ts->max_io_size());
      d->open_link_gen = gen;
      d->st.remaps.fetch_add(1, std::memory_order_relaxed);
      emit(DeviceEvent{DeviceEvent::Kind::remapped, d->name, old, r->device_id, {}});
      // Its held parts join the session queue (still closed) in their order.
      release_held(d);
    }
  }
  {
    std::lock_guard l(st_mu);
    if (link_gen != gen) return false;
    open.store(true, std::memory_order_seq_cst);
  }
  BASE_LOG(info, "ibnbd %s: remapped %zu devices", opts.transport.session_name.c_str(), devs.size());
  pump();
  return true;
}

// ---------------------------------------------------------------------------------------------
// BlockSession

BlockSession::BlockSession(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BlockSession::~BlockSession() = default;

Result<std::unique_ptr<BlockSession>> BlockSession::open(BlockSessionOptions options) {
  auto impl = std::make_unique<Impl>();
  Impl* s = impl.get();
  impl->opts = std::move(options);
  ibtrs::ClientOptions to = s->opts.transport;
  // Events reach the block layer first (it closes the IO gate before the transport re-sends),
  // then the caller's callback from opts.transport.on_event.
  to.on_event = [s](const ibtrs::SessionEventInfo& e) { s->on_transport_event(e); };
  BASE_ASSIGN_OR_RETURN(impl->ts, ibtrs::ClientSession::open(std::move(to)));
  BASE_ASSIGN_OR_RETURN(impl->ctl_mem, impl->ts->alloc_buffer(Impl::kCtlSlots * Impl::kCtlSlotSize));
  const uint32_t qd = impl->ts->queue_depth();
  impl->parts.grow(qd);
  impl->reqs.grow(qd);
  BASE_ASSIGN_OR_RETURN(uint8_t ver, impl->sess_info());
  impl->version.store(ver);
  // Outstanding when open() returns (a failure is retried by the worker).
  if (ver >= proto::kWatchVersion) (void)impl->post_watch();
  impl->worker = std::thread([s] { s->worker_main(); });
  return std::unique_ptr<BlockSession>(new BlockSession(std::move(impl)));
}

Session::~Impl() {
  closing.store(true, std::memory_order_seq_cst);
  {
    std::lock_guard l(st_mu);
    stop = true;
  }
  st_cv.notify_all();
  if (worker.joinable()) worker.join();
  run_deferred();
  // IO still waiting in the library never went out: it fails here.
  std::vector<Device*> devs = device_list();
  {
    PartList l;
    {
      std::lock_guard g(q_mu);
      l = queue.take();
      q_len.store(0);
    }
    fail_list(l, ESHUTDOWN);
  }
  for (Device* d : devs) fail_list(d->take_waiting(), ESHUTDOWN);
  auto busy_ctl = [this] {
    {
      std::lock_guard l(st_mu);
      if (watch_posted) return true;  // its answer may still land in watch_mem
    }
    std::lock_guard l(ctl_slot_mu);
    return std::any_of(std::begin(ctl_slots), std::end(ctl_slots), [](const CtlSlot& c) { return c.busy; });
  };
  // Registrations must go before the transport session, and requests using them before the
  // registrations: closing the paths completes whatever the transport still has (ENOTCONN).
  if (ts && (outstanding.load() != 0 || busy_ctl())) {
    for (auto& p : ts->paths()) (void)ts->disconnect_path(p.name);
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while ((outstanding.load() != 0 || busy_ctl()) && Clock::now() < deadline) {
      run_deferred();
      std::this_thread::sleep_for(kDrainPoll);
    }
    run_deferred();
    if (outstanding.load() != 0)
      BASE_LOG(error, "ibnbd %s: %llu requests did not complete at close",
                opts.transport.session_name.c_str(),
                static_cast<unsigned long long>(outstanding.load()));
  }
  // Devices the caller still holds outlive us: cut them loose.
  std::vector<std::shared_ptr<RemoteDevice>> alive;
  {
    std::lock_guard l(dev_mu);
    for (auto& w : all_devices)
      if (auto d = w.lock()) alive.push_back(std::move(d));
    devices.clear();
    retired.clear();
  }
  for (auto& d : alive) {
    Device* di = d->impl();
    di->closed_err.store(ESHUTDOWN);
    di->state.store(DeviceState::closed);
    di->bounce.reset();
    di->s = nullptr;
  }
  alive.clear();
  watch_mem.reset();
  ctl_mem.reset();
  ts.reset();
}

Result<std::shared_ptr<RemoteDevice>> BlockSession::map(std::string_view dev_name, AccessMode mode) {
  return impl_->map_device(dev_name, mode, MapAs::plain);
}

Result<std::shared_ptr<RemoteDevice>> Session::map_device(std::string_view dev_name, AccessMode mode, MapAs as) {
  Session* s = this;
  BASE_TRY(proto::check_dev_name(dev_name));
  std::lock_guard cl(s->ctl_mu);
  if (s->closing.load()) return errc(ESHUTDOWN);
  if (auto d = s->find_locked(dev_name)) {
    // A leg belongs to its failover device; a failover device maps a name nobody holds.
    if (as != MapAs::plain || d->impl()->leg.load()) return errc(EEXIST);
    if (d->access_mode() != mode) return errc(EBUSY);
    // Mapped but closed (the server refused its re-open): mapping it again opens it again.
    if (d->impl()->state.load() == DeviceState::closed) BASE_TRY(s->remap_device(d->impl()));
    return d;
  }
  uint64_t gen = 0;
  {
    std::lock_guard l(s->st_mu);
    if (!s->link_up) return errc(ENOTCONN);
    gen = s->link_gen;
  }
  const std::string name(dev_name);
  auto opened = s->open_device(name, mode);
  // A server restarted while the OPEN was in flight answers its replay with EPROTO: the new
  // incarnation has seen no SESS_INFO of this session. Introduce the session again and retry,
  // as the remap of mapped devices does, for at most remap_timeout.
  for (const auto until = Clock::now() + s->opts.remap_timeout;
       !opened.ok() && opened.error().value() == EPROTO && s->link_changed(gen) && Clock::now() < until;) {
    {
      std::lock_guard l(s->st_mu);
      if (s->stop) return errc(ESHUTDOWN);
      if (s->link_up) gen = s->link_gen;
    }
    auto v = s->sess_info();
    if (!v.ok()) {
      if (!transport_error(v.error().value())) return v.error();
      std::this_thread::sleep_for(kRemapRetry);
      continue;
    }
    s->version.store(*v);
    opened = s->open_device(name, mode);
  }
  if (!opened.ok()) return opened.error();
  const proto::OpenRsp rsp = *opened;
  // Another name of a device already mapped (a symlink, "./x", the absolute path): the server
  // gave that device's id back without counting a second open, so nothing is to be closed.
  if (auto other = s->holder_of(rsp.device_id, gen, nullptr)) {
    BASE_LOG(warn, "ibnbd %s: map %s refused (EEXIST): the server's device %u, mapped as %s",
              s->opts.transport.session_name.c_str(), name.c_str(), rsp.device_id,
              other->impl()->name.c_str());
    return errc(EEXIST);
  }
  auto impl = std::make_unique<RemoteDevice::Impl>();
  Device* d = impl.get();
  d->s = s;
  d->name = name;
  d->mode = mode;
  // Before the device is in `devices`, where the next remap finds it.
  d->leg.store(as != MapAs::plain);
  d->standby.store(as == MapAs::standby_leg);
  d->apply(rsp, s->ts->max_io_size());
  d->open_link_gen = gen;
  std::shared_ptr<RemoteDevice> dev(new RemoteDevice(std::move(impl)));
  auto undo = [&](std::error_code ec) -> std::error_code {
    (void)s->close_id(rsp.device_id);
    d->bounce.reset();
    d->s = nullptr;
    return ec;
  };
  // Not even one logical block fits one transport request: no READ/WRITE could be sent.
  if (d->max_rw.load() < rsp.geo.logical_block_size) return undo(errc(EMSGSIZE));
  if (s->opts.bounce_slots != 0) {
    d->slot_size = d->max_rw.load();
    auto b = s->ts->alloc_buffer(size_t{d->slot_size} * s->opts.bounce_slots);
    if (!b.ok()) return undo(b.error());
    d->bounce = std::move(*b);
    d->free_slots.reserve(s->opts.bounce_slots);
    for (uint32_t i = s->opts.bounce_slots; i > 0; --i) d->free_slots.push_back(static_cast<int32_t>(i - 1));
  }
  std::lock_guard l(s->dev_mu);
  s->devices.emplace(name, dev);
  std::erase_if(s->all_devices, [](const std::weak_ptr<RemoteDevice>& w) { return w.expired(); });
  s->all_devices.push_back(dev);
  return dev;
}

Status BlockSession::unmap(std::string_view dev_name, UnmapMode mode) {
  Impl* s = impl_.get();
  std::lock_guard cl(s->ctl_mu);
  DeferCompletions defer;
  s->reap_retired();
  std::shared_ptr<RemoteDevice> dev = find(dev_name);
  if (!dev) return errc(ENOENT);
  Device* d = dev->impl();
  if (d->leg.load()) return errc(EBUSY);  // a failover device's: unmap_failover() unmaps it
  if (mode == UnmapMode::normal && d->inflight_reqs.load() != 0) return errc(EBUSY);
  const bool was_open = d->state.load() != DeviceState::closed;
  if (mode == UnmapMode::force) {
    s->close_device(d, ECANCELED);
    // The server still has some of its IO: let it answer before the CLOSE makes the id
    // unknown (the answers would turn into ENODEV).
    if (!s->wait_device_drain(d, Clock::now() + s->opts.control_timeout))
      BASE_LOG(warn, "ibnbd %s: unmap %s with IO still in flight",
                s->opts.transport.session_name.c_str(), d->name.c_str());
  } else {
    d->closed_err.store(ENODEV);
    d->state.store(DeviceState::closed, std::memory_order_seq_cst);
  }
  {
    std::lock_guard l(s->dev_mu);
    s->devices.erase(d->name);
    if (d->inflight_reqs.load() != 0 || d->inflight_parts.load() != 0) s->retired.push_back(dev);
  }
  bool same_session = false;
  {
    std::lock_guard l(s->st_mu);
    same_session = s->link_up && d->open_link_gen == s->link_gen;
  }
  // A closed device holds no id on the server any more (its re-open failed); and after a
  // reconnect without remap the id belongs to a session that is gone.
  if (!was_open || !same_session) return {};
  return s->close_id(d->id.load());
}

Status BlockSession::remap(std::string_view dev_name) {
  Impl* s = impl_.get();
  std::lock_guard cl(s->ctl_mu);
  std::shared_ptr<RemoteDevice> dev = find(dev_name);
  if (!dev) return errc(ENOENT);
  return s->remap_device(dev->impl());
}

// Control function, under ctl_mu.
Status Session::remap_device(Device* d) {
  DeferCompletions defer;
  uint64_t gen = 0;
  {
    std::lock_guard l(st_mu);
    if (!open.load()) return errc(ENOTCONN);
    gen = link_gen;
  }
  d->remapping.store(true, std::memory_order_seq_cst);
  // The old id must be quiet before it is closed and handed out again.
  if (!wait_device_drain(d, Clock::now() + opts.control_timeout)) {
    release_held(d);
    return errc(ETIMEDOUT);
  }
  const uint32_t old = d->id.load();
  const bool had_id = d->state.load() != DeviceState::closed && d->open_link_gen == gen;
  auto r = open_device(d->name, d->mode, !d->standby.load());
  if (!r.ok()) {
    if (transport_error(r.error().value())) {
      release_held(d);
      return r.error();
    }
    close_device(d, r.error().value());
    emit(DeviceEvent{DeviceEvent::Kind::remap_failed, d->name, old, old, r.error()});
    return r.error();
  }
  // The name now leads to a device mapped under another name (replaced by a link meanwhile):
  // the id is that mapping's; this one closes without a CLOSE.
  if (auto other = holder_of(r->device_id, gen, d)) {
    BASE_LOG(warn, "ibnbd %s: remap %s: now the server's device %u, mapped as %s: closed",
              opts.transport.session_name.c_str(), d->name.c_str(), r->device_id,
              other->impl()->name.c_str());
    if (had_id && old != r->device_id) (void)close_id(old);
    close_device(d, EEXIST);
    emit(DeviceEvent{DeviceEvent::Kind::remap_failed, d->name, old, old, errc(EEXIST)});
    return errc(EEXIST);
  }
  // Force-closed ids stay reserved on the server until we close them.
  if (had_id && r->device_id != old) (void)close_id(old);
  d->apply(*r, ts->max_io_size());
  d->open_link_gen = gen;
  d->closed_err.store(ENODEV);
  d->state.store(DeviceState::open, std::memory_order_seq_cst);
  d->st.remaps.fetch_add(1, std::memory_order_relaxed);
  emit(DeviceEvent{DeviceEvent::Kind::remapped, d->name, old, r->device_id, {}});
  release_held(d);
  return {};
}

std::shared_ptr<RemoteDevice> Session::holder_of(uint32_t id, uint64_t gen, const Device* except) const {
  std::lock_guard l(dev_mu);
  for (auto& [name, dev] : devices) {
    const Device* d = dev->impl();
    if (d != except && d->open_link_gen == gen && d->id.load() == id &&
        d->state.load() != DeviceState::closed)
      return dev;
  }
  return nullptr;
}

std::vector<std::shared_ptr<RemoteDevice>> BlockSession::devices() const {
  std::lock_guard l(impl_->dev_mu);
  std::vector<std::shared_ptr<RemoteDevice>> v;
  for (auto& [name, d] : impl_->devices) v.push_back(d);
  return v;
}

std::shared_ptr<RemoteDevice> BlockSession::find(std::string_view dev_name) const {
  return impl_->find_locked(dev_name);
}

std::shared_ptr<RemoteDevice> Session::find_locked(std::string_view dev_name) const {
  std::lock_guard l(dev_mu);
  auto it = devices.find(dev_name);
  return it == devices.end() ? nullptr : it->second;
}

Result<std::unique_ptr<ibtrs::RegisteredMemory>> BlockSession::alloc_buffer(size_t size) {
  return impl_->ts->alloc_buffer(size);
}
Result<std::unique_ptr<ibtrs::RegisteredMemory>> BlockSession::register_memory(void* addr, size_t size) {
  return impl_->ts->register_memory(addr, size);
}

SessionState BlockSession::state() const {
  std::lock_guard l(impl_->st_mu);
  if (impl_->open.load()) return SessionState::connected;
  return impl_->link_up ? SessionState::remapping : SessionState::disconnected;
}

uint8_t BlockSession::proto_version() const { return impl_->version.load(); }

SizeWatchInfo BlockSession::size_watch() const {
  const Impl& s = *impl_;
  SizeWatchInfo i;
  i.supported = s.version.load() >= proto::kWatchVersion;
  {
    std::lock_guard l(impl_->st_mu);
    i.armed = s.watch_posted;
  }
  i.epoch = s.watch_epoch.load(std::memory_order_relaxed);
  i.answers = s.watch_answers.load(std::memory_order_relaxed);
  i.resizes = s.watch_resizes.load(std::memory_order_relaxed);
  if (const int e = s.watch_last_err.load(std::memory_order_relaxed)) i.last_error = errc(e);
  return i;
}
const std::string& BlockSession::name() const { return impl_->ts->name(); }
void BlockSession::begin_batch() { impl_->ts->begin_batch(); }
void BlockSession::end_batch() { impl_->ts->end_batch(); }

ibtrs::ClientSession& BlockSession::transport() { return *impl_->ts; }
const ibtrs::ClientSession& BlockSession::transport() const { return *impl_->ts; }

std::string_view to_string(SessionState s) {
  switch (s) {
    case SessionState::connected: return "connected";
    case SessionState::disconnected: return "disconnected";
    case SessionState::remapping: return "remapping";
  }
  return "?";
}

}  // namespace ibnbd
