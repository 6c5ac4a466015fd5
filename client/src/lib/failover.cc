// Failover devices: one device over two sessions to two servers of one store (client.h,
// "Gateway failover"; lib/failover.h has the state and its rules). Kernel counterparts:
// dm-multipath's failover path selector (requests of a failed path requeued onto the next
// priority group), NVMe's ANA failover (nvme_failover_req), rnbd's remap on each leg.
#include "lib/failover.h"

#include <algorithm>
#include <cstring>

#include "base/log.h"

namespace ibnbd {

using namespace client;

namespace client {

namespace {

// How often the worker looks at the legs while something waits (a usable leg, requests left on
// a leg whose session is down), and while nothing does.
constexpr auto kBusyTick = std::chrono::milliseconds(20);
constexpr auto kIdleTick = std::chrono::seconds(1);
// A request sent this many times fails with its last error instead of going round again (two
// legs failing each other's requests back and forth).
constexpr uint32_t kMaxSends = 8;
constexpr auto kMapRetry = std::chrono::seconds(1);

// Moves the requests of `l` for which pred holds into `out`, keeping the order of both.
template <typename Pred>
void extract(FoList& l, FoList& out, Pred pred) {
  FoList keep;
  while (!l.empty()) {
    FoReq* r = l.pop();
    (pred(r) ? out : keep).push(r);
  }
  l = keep;
}

// A FLUSH, or a WRITE with PREFLUSH: completing makes what completed before it stable.
bool flushes(const FoReq& r) { return r.op == IoOp::flush || (r.op == IoOp::write && (r.flags & kIoPreflush)); }

bool volatile_cache(const Device* d) {
  if (d == nullptr) return false;
  std::lock_guard l(d->mu);
  return (d->geo.cache_policy & kCacheWriteBack) != 0;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// IO path

Status Failover::submit(IoOp op, uint64_t offset, uint64_t len, std::span<const ibtrs::IoSeg> segs,
                        std::byte* copy, uint32_t flags, IoDone done, uint16_t prio) {
  if (done.fn == nullptr) return errc(EINVAL);
  if (closed.load(std::memory_order_acquire)) return errc(ENODEV);
  // Checked now against the active leg's geometry (both legs serve one store), so that a
  // request refused is refused by this call even when it has to wait for a failover.
  const Device* ad = legs[active.load(std::memory_order_acquire)].dp.load(std::memory_order_acquire);
  if (ad == nullptr) return errc(ENODEV);
  uint64_t n = len;
  BASE_TRY(ad->check(op, offset, n, segs, copy != nullptr, flags));

  FoReq* r = reqs.get();
  r->f = this;
  r->op = op;
  r->offset = offset;
  r->len = len;
  r->flags = flags;
  r->prio = prio;
  r->done = done;
  r->copy = copy;
  r->segs.assign(segs.begin(), segs.end());  // allocates only beyond the longest list seen
  r->sends = 0;
  r->seq = next_seq.fetch_add(1, std::memory_order_relaxed);
  r->since = Clock::time_point{};
  r->epoch = flushes(*r) ? writes_done.load(std::memory_order_acquire) : 0;
  outstanding.fetch_add(1, std::memory_order_acq_rel);
  counts.count(op, n);

  for (;;) {
    if (open.load(std::memory_order_seq_cst)) {
      const uint8_t a = active.load(std::memory_order_seq_cst);
      legs[a].out.fetch_add(1, std::memory_order_seq_cst);
      if (open.load(std::memory_order_seq_cst) && active.load(std::memory_order_seq_cst) == a) {
        auto sent = send(r, a);
        if (sent.ok()) return {};
        legs[a].out.fetch_sub(1, std::memory_order_seq_cst);
        const int e = sent.error().value();
        if (e != ENODEV && e != ESHUTDOWN) {
          // The leg refused the request itself (its geometry changed under us): nothing sent.
          outstanding.fetch_sub(1, std::memory_order_acq_rel);
          reqs.put(r);
          return sent.error();
        }
        // The active leg is closed or its session gone: wait here for the other one.
        if (requeue(r, true)) return {};
        outstanding.fetch_sub(1, std::memory_order_acq_rel);  // unmapped meanwhile
        reqs.put(r);
        return errc(ENODEV);
      }
      legs[a].out.fetch_sub(1, std::memory_order_seq_cst);
    }
    std::lock_guard l(mu);
    if (closed.load(std::memory_order_seq_cst)) {  // unmapped meanwhile: nothing was sent
      outstanding.fetch_sub(1, std::memory_order_acq_rel);
      reqs.put(r);
      return errc(ENODEV);
    }
    if (open.load(std::memory_order_seq_cst)) continue;  // the switch finished meanwhile
    r->since = Clock::now();
    waiting.push(r);
    return {};
  }
}

Status Failover::send(FoReq* r, uint8_t a) {
  Device* d = legs[a].dp.load(std::memory_order_acquire);
  if (d == nullptr) return errc(ENODEV);
  r->leg = a;
  ++r->sends;
  return d->submit(r->op, r->offset, r->len, std::span<const ibtrs::IoSeg>(r->segs), r->copy, r->flags,
                   IoDone{&Failover::on_leg_done, r}, r->prio);
}

// A leg's completion (its transport's threads, its session's worker, or ours after abandon).
void Failover::on_leg_done(void* ctx, int err) {
  auto* r = static_cast<FoReq*>(ctx);
  Failover* f = r->f;
  const uint8_t leg = r->leg;
  Leg& l = f->legs[leg];
  const bool from_active = leg == f->active.load(std::memory_order_acquire);
  if (err != 0 && !f->closed.load(std::memory_order_acquire) && r->sends < kMaxSends) {
    const Device* d = l.dp.load(std::memory_order_acquire);
    const bool leg_closed = d != nullptr && d->state.load(std::memory_order_acquire) == DeviceState::closed;
    if ((leg_error(err) || leg_closed) && f->requeue(r, from_active)) {
      l.out.fetch_sub(1, std::memory_order_seq_cst);  // last: the request is on a list now
      return;
    }
  }
  if (err == 0 && r->op == IoOp::write && !(r->flags & kIoFua)) {
    if (from_active) {
      f->writes_done.fetch_add(1, std::memory_order_acq_rel);
    } else if (volatile_cache(l.dp.load(std::memory_order_acquire))) {
      // Completed on the old active after the switch: in a cache nobody will flush.
      f->cache_lost.store(true, std::memory_order_release);
    }
  }
  if (err == 0 && flushes(*r) && from_active) {
    if (f->cache_lost.exchange(false, std::memory_order_acq_rel)) {
      // It promises stable what the old active's cache may have lost (client.h, "Flush").
      err = EIO;
      f->lost_flushes.fetch_add(1, std::memory_order_relaxed);
      BASE_LOG(warn, "ibnbd %s: flush failed (EIO): writes completed on the previous active server "
                "since its last flush may be lost with its cache", f->name.c_str());
    } else {
      uint64_t cur = f->durable.load(std::memory_order_acquire);
      while (cur < r->epoch && !f->durable.compare_exchange_weak(cur, r->epoch, std::memory_order_acq_rel)) {
      }
    }
  }
  l.out.fetch_sub(1, std::memory_order_seq_cst);
  f->finish(r, err);
}

bool Failover::requeue(FoReq* r, bool from_active) {
  std::lock_guard l(mu);
  // unmap sets `closed`, then takes the lists under `mu`: a request is on a list it takes, or
  // sees `closed` here.
  if (closed.load(std::memory_order_seq_cst)) return false;
  if (r->since == Clock::time_point{}) r->since = Clock::now();
  retry.push(r);
  if (from_active && open.load(std::memory_order_seq_cst) && !want) {
    want = true;
    trigger_at = Clock::now();
  }
  cv.notify_all();
  return true;
}

// Everything of ours is released before the callback: once it runs, the caller may unmap the
// device and destroy it.
void Failover::finish(FoReq* r, int err) {
  const IoDone done = r->done;
  if (err != 0) counts.errors.fetch_add(1, std::memory_order_relaxed);
  reqs.put(r);
  outstanding.fetch_sub(1, std::memory_order_acq_rel);
  done.fn(done.ctx, err);
}

// Worker: sends a request taken back (or held) on the active leg.
void Failover::resend(FoReq* r) {
  const uint8_t a = active.load(std::memory_order_seq_cst);
  legs[a].out.fetch_add(1, std::memory_order_seq_cst);
  auto sent = send(r, a);
  if (sent.ok()) return;
  legs[a].out.fetch_sub(1, std::memory_order_seq_cst);
  const int e = sent.error().value();
  if ((e == ENODEV || e == ESHUTDOWN) && r->sends < kMaxSends && requeue(r, true)) return;
  finish(r, e);
}

void Failover::resend_all(FoList a, FoList b) {
  // Taken back in the order the old leg failed them, which need not be the order they came:
  // the new leg gets them in that order (a flush after the writes submitted before it).
  order.clear();
  while (!a.empty()) order.push_back(a.pop());
  while (!b.empty()) order.push_back(b.pop());
  std::sort(order.begin(), order.end(), [](const FoReq* x, const FoReq* y) { return x->seq < y->seq; });
  for (FoReq* r : order) resend(r);
  order.clear();
}

// ---------------------------------------------------------------------------------------------
// Worker

void Failover::on_session_event(uint8_t leg, const ibtrs::SessionEventInfo& e) {
  if (e.event != ibtrs::SessionEvent::disconnected && e.event != ibtrs::SessionEvent::reconnected) return;
  const bool down = e.event == ibtrs::SessionEvent::disconnected;
  legs[leg].down.store(down, std::memory_order_release);
  std::lock_guard l(mu);
  if (down && leg == active.load() && open.load() && !closed.load() && !want) {
    want = true;
    trigger_at = Clock::now();
  }
  cv.notify_all();
}

void Failover::emit(const FailoverEvent& e) {
  if (opts.on_event) opts.on_event(e);
}

void Failover::run() {
  std::unique_lock l(mu);
  while (!stop) {
    if (want) {
      want = false;
      l.unlock();
      fail_over();
      l.lock();
      continue;
    }
    if (open.load() && (!retry.empty() || !waiting.empty())) {
      // Stragglers of an old active that failed after the switch; sent in their order.
      FoList a = retry.take();
      FoList b = waiting.take();
      l.unlock();
      resend_all(a, b);
      l.lock();
      continue;
    }
    l.unlock();
    bool busy = false;
    {
      std::lock_guard c(ctl_mu);
      // A leg whose session is down keeps requests of ours that wait there for a path (one
      // raced the switch): take them back for the active leg.
      for (uint8_t i = 0; i < 2; ++i) {
        Leg& g = legs[i];
        Device* d = g.dp.load();
        if (i == active.load() || d == nullptr || g.out.load() == 0) continue;
        busy = true;
        if (g.down.load()) g.s->impl()->abandon(d, ENOTCONN);
      }
      watch_standby();
    }
    l.lock();
    if (stop || want) continue;
    cv.wait_for(l, busy ? kBusyTick : kIdleTick);
  }
}

// Worker, under ctl_mu: events for the log when the standby turns usable or not. A missing
// standby whose session came back after a transport error is mapped again.
void Failover::watch_standby() {
  const uint8_t sb = active.load() ^ 1;
  Leg& g = legs[sb];
  bool ready = false;
  std::error_code why;
  if (g.s->state() != SessionState::connected) {
    why = errc(ENOTCONN);
  } else if (g.dp.load() == nullptr) {
    std::error_code missing;
    {
      std::lock_guard l(mu);
      missing = g.error;
    }
    if (missing && transport_error(missing.value())) ready = usable(sb);
    why = missing;
  } else if (g.dp.load()->state.load() == DeviceState::closed) {
    why = errc(g.dp.load()->closed_err.load());
  } else {
    ready = true;
  }
  if (ready == standby_was_ready) return;
  standby_was_ready = ready;
  {
    std::lock_guard l(mu);
    if (!ready && !g.error) g.error = why;
    if (ready) g.error = {};
  }
  BASE_LOG(warn, "ibnbd %s: standby %s %s%s", name.c_str(), g.s->name().c_str(),
            ready ? "ready" : "not ready: ", ready ? "" : why.message().c_str());
  emit(FailoverEvent{ready ? FailoverEvent::Kind::standby_back : FailoverEvent::Kind::standby_lost, name,
                     legs[sb ^ 1].s->name(), g.s->name(), {}, 0, why});
}

// Under ctl_mu: leg `i` can take the device over now (its session is up and its device open);
// a missing leg is mapped first.
bool Failover::usable(uint8_t i) {
  Leg& g = legs[i];
  auto fail = [&](std::error_code e) {
    std::lock_guard l(mu);
    g.error = e;
    return false;
  };
  if (g.s->state() != SessionState::connected) return fail(errc(ENOTCONN));
  if (g.dp.load() == nullptr) {
    // Not an OPEN per look: a server that refuses it is asked again once a second at most.
    const auto now = Clock::now();
    if (now < g.next_map) return false;
    g.next_map = now + kMapRetry;
    auto m = g.s->impl()->map_device(name, mode, i == active.load() ? MapAs::active_leg : MapAs::standby_leg);
    if (!m.ok()) return fail(m.error());
    g.dev = *m;
    g.dp.store((*m)->impl(), std::memory_order_release);
  }
  const Device* d = g.dp.load();
  if (d->state.load() == DeviceState::closed) return fail(errc(d->closed_err.load()));
  return true;
}

// Under ctl_mu: the leg's server takes the device over (OPEN with REOPEN: for an RBD image it
// breaks the exclusive lock of the old active gateway, which fences it).
Status Failover::take_over(uint8_t i) {
  Leg& g = legs[i];
  Device* d = g.dp.load();
  d->standby.store(false);
  auto r = g.s->remap(name);
  if (!r.ok()) {
    d->standby.store(true);
    std::lock_guard l(mu);
    g.error = r.error();
  }
  return r;
}

void Failover::expire(Clock::time_point now) {
  FoList dead;
  {
    std::lock_guard l(mu);
    auto old = [&](FoReq* r) { return r->since + opts.remap_timeout <= now; };
    extract(retry, dead, old);
    extract(waiting, dead, old);
  }
  if (dead.empty()) return;
  const bool any_up = legs[0].s->state() != SessionState::disconnected || legs[1].s->state() != SessionState::disconnected;
  const int err = any_up ? ETIMEDOUT : ENOTCONN;
  while (!dead.empty()) finish(dead.pop(), err);
}

// Worker: the switch (client.h, "Failover"; steps 1..4).
void Failover::fail_over() {
  bool by_admin = false;
  Clock::time_point t0;
  {
    std::lock_guard l(mu);
    by_admin = manual;
    t0 = trigger_at;
  }
  const uint8_t from = active.load();
  const uint8_t other = from ^ 1;
  auto answer_admin = [&](int e) {
    std::lock_guard l(mu);
    manual = false;
    manual_result = e;
    cv.notify_all();
  };
  if (by_admin) {
    std::lock_guard c(ctl_mu);
    if (!usable(other)) {
      std::error_code why;
      {
        std::lock_guard l(mu);
        why = legs[other].error;
      }
      return answer_admin(why && !transport_error(why.value()) ? why.value() : ENOTCONN);
    }
  }
  if (by_admin) {
    BASE_LOG(warn, "ibnbd %s: switch requested: from session %s to %s", name.c_str(),
              legs[from].s->name().c_str(), legs[other].s->name().c_str());
  } else {
    BASE_LOG(warn, "ibnbd %s: active server lost: session %s %s, failing over", name.c_str(),
              legs[from].s->name().c_str(), legs[from].down.load() ? "down" : "failing requests");
  }
  // 1. New IO waits here.
  open.store(false, std::memory_order_seq_cst);
  {
    std::lock_guard c(ctl_mu);
    Leg& a = legs[from];
    if (Device* d = a.dp.load()) {
      // Its re-open after a reconnect must take nothing over: it is the standby from now on.
      d->standby.store(true);
      // 2. What waits there without being on a wire comes back (as ENOTCONN, to `retry`).
      a.s->impl()->abandon(d, ENOTCONN);
      if (by_admin && a.s->state() == SessionState::connected && d->state.load() != DeviceState::closed &&
          volatile_cache(d)) {
        // The old active's cache goes to the store before the new one fences it.
        struct Wait {
          std::mutex m;
          std::condition_variable c;
          int err = -1;
          static void cb(void* x, int e) {
            auto* w = static_cast<Wait*>(x);
            std::lock_guard l(w->m);
            w->err = e;
            w->c.notify_all();
          }
        };
        auto w = std::make_shared<Wait>();
        // The callback may come after we gave up: it owns a reference then.
        struct Keep {
          std::shared_ptr<Wait> w;
          static void cb(void* x, int e) {
            std::unique_ptr<Keep> k(static_cast<Keep*>(x));
            Wait::cb(k->w.get(), e);
          }
        };
        auto* k = new Keep{w};
        if (d->submit(IoOp::flush, 0, 0, {}, nullptr, 0, IoDone{&Keep::cb, k}, 0).ok()) {
          std::unique_lock l(w->m);
          if (w->c.wait_for(l, opts.remap_timeout, [&] { return w->err >= 0; }) && w->err == 0)
            durable.store(writes_done.load());
        } else {
          delete k;
        }
      }
    }
  }
  // 3. A usable leg takes the device over: the other one, or (not for the admin) the old
  // active itself once its session is back.
  for (;;) {
    {
      std::lock_guard l(mu);
      if (stop) {
        manual = false;
        manual_result = ECANCELED;
        cv.notify_all();
        return;
      }
    }
    const uint8_t cands[2] = {other, from};
    const int tries = by_admin ? 1 : 2;
    bool both_refused = true;
    for (int k = 0; k < tries; ++k) {
      const uint8_t to = cands[k];
      Status took;
      {
        std::lock_guard c(ctl_mu);
        if (!usable(to)) {
          std::lock_guard l(mu);
          if (!legs[to].error || transport_error(legs[to].error.value())) both_refused = false;
          continue;
        }
        took = take_over(to);
      }
      if (took.ok()) return switch_to(to, from, t0, by_admin);
      if (transport_error(took.error().value())) both_refused = false;
      BASE_LOG(warn, "ibnbd %s: session %s cannot take the device over: %s", name.c_str(),
                legs[to].s->name().c_str(), took.error().message().c_str());
    }
    if (by_admin) {
      // The old active stays; its device is the active one again.
      if (Device* d = legs[from].dp.load()) d->standby.store(false);
      std::error_code why;
      {
        std::lock_guard l(mu);
        why = legs[other].error;
        open.store(true, std::memory_order_seq_cst);
        cv.notify_all();
      }
      return answer_admin(why ? why.value() : ENOTCONN);
    }
    if (both_refused) {
      // Neither server will open the device (both refused it, with their sessions up): the
      // requests fail with the active side's answer, as a device of one session's would.
      std::error_code why;
      FoList dead;
      {
        std::lock_guard l(mu);
        why = legs[from].error ? legs[from].error : legs[other].error;
        dead = retry.take();
        FoList w = waiting.take();
        while (!w.empty()) dead.push(w.pop());
      }
      BASE_LOG(error, "ibnbd %s: no server can open the device: %s", name.c_str(), why.message().c_str());
      while (!dead.empty()) finish(dead.pop(), why ? why.value() : ENODEV);
      if (Device* d = legs[from].dp.load()) d->standby.store(false);
      open.store(true, std::memory_order_seq_cst);  // new IO meets the closed leg: ENODEV
      return;
    }
    // None now: wait for one, failing what waited longer than remap_timeout. A request that
    // raced the gate onto the old leg after step 2 comes back meanwhile.
    {
      std::lock_guard c(ctl_mu);
      Leg& a = legs[from];
      if (Device* d = a.dp.load(); d != nullptr && a.out.load() != 0 && a.down.load())
        a.s->impl()->abandon(d, ENOTCONN);
    }
    expire(Clock::now());
    std::unique_lock l(mu);
    cv.wait_for(l, kBusyTick, [&] { return stop; });
  }
}

// Worker: step 4, once `to` took the device over.
void Failover::switch_to(uint8_t to, uint8_t from, Clock::time_point t0, bool by_admin) {
  if (to != from) {
    Device* od = legs[from].dp.load();
    const uint64_t done = writes_done.load();
    if (volatile_cache(od) && done > durable.load()) {
      cache_lost.store(true);
      BASE_LOG(warn, "ibnbd %s: %llu writes completed on %s since its last flush may be lost with its cache: "
                "the next flush fails with EIO", name.c_str(),
                static_cast<unsigned long long>(done - durable.load()), legs[from].s->name().c_str());
      emit(FailoverEvent{FailoverEvent::Kind::cache_lost, name, legs[from].s->name(), legs[to].s->name(), {},
                         done - durable.load(), {}});
    }
    durable.store(done);
  }
  active.store(to, std::memory_order_seq_cst);
  // The requests taken back, then those held, in their order, on the new active; the gate
  // opens once none is left (later ones race nothing older).
  uint64_t n = 0;
  for (;;) {
    FoList a, b;
    {
      std::lock_guard l(mu);
      if (retry.empty() && waiting.empty()) {
        open.store(true, std::memory_order_seq_cst);
        cv.notify_all();
        break;
      }
      a = retry.take();
      b = waiting.take();
    }
    n += a.size + b.size;
    resend_all(a, b);
  }
  const auto pause = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  if (to != from) {
    failovers.fetch_add(1);
    resent.fetch_add(n);
    last_pause_ms.store(pause.count());
  }
  {
    std::lock_guard l(mu);
    standby_was_ready = false;  // the old active: down, or at least not known ready yet
  }
  BASE_LOG(warn, "ibnbd %s: %s session %s after %lld ms (%llu requests sent again)", name.c_str(),
            to != from ? "failed over to" : "resumed on", legs[to].s->name().c_str(),
            static_cast<long long>(pause.count()), static_cast<unsigned long long>(n));
  if (to != from)
    emit(FailoverEvent{FailoverEvent::Kind::failed_over, name, legs[from].s->name(), legs[to].s->name(), pause, n, {}});
  if (by_admin) {
    std::lock_guard l(mu);
    manual = false;
    manual_result = 0;
    cv.notify_all();
  }
}

// ---------------------------------------------------------------------------------------------
// Control

void Failover::detach() {
  for (auto& g : legs) {
    if (g.listener != 0) g.s->impl()->remove_listener(g.listener);
    g.listener = 0;
  }
  {
    std::lock_guard l(mu);
    stop = true;
    cv.notify_all();
  }
  if (worker.joinable()) worker.join();
}

Status Failover::unmap(UnmapMode how) {
  if (closed.load()) return errc(ENOENT);
  if (how == UnmapMode::normal && outstanding.load() != 0) return errc(EBUSY);
  closed.store(true, std::memory_order_seq_cst);  // new IO: ENODEV
  detach();
  std::lock_guard c(ctl_mu);
  FoList dead;
  {
    std::lock_guard l(mu);
    dead = retry.take();
    FoList w = waiting.take();
    while (!w.empty()) dead.push(w.pop());
  }
  while (!dead.empty()) finish(dead.pop(), ECANCELED);
  Status first;
  for (auto& g : legs) {
    Device* d = g.dp.load();
    if (d == nullptr) continue;
    d->leg.store(false);
    auto r = g.s->unmap(name, how);
    if (!r.ok() && r.error() != errc(ENOENT) && first.ok()) first = r;
  }
  return first;
}

Status Failover::remap() {
  std::lock_guard c(ctl_mu);
  if (closed.load()) return errc(ENOENT);
  Status first;
  const uint8_t a = active.load();
  for (uint8_t i : {a, static_cast<uint8_t>(a ^ 1)}) {
    Leg& g = legs[i];
    Status r;
    if (g.dp.load() == nullptr) {
      auto m = g.s->impl()->map_device(name, mode, i == a ? MapAs::active_leg : MapAs::standby_leg);
      if (m.ok()) {
        g.dev = *m;
        g.dp.store((*m)->impl(), std::memory_order_release);
      } else {
        r = m.error();
      }
    } else if (g.dp.load()->state.load() == DeviceState::closed) {
      g.dp.load()->standby.store(i != a);
      r = g.s->remap(name);
    }
    {
      std::lock_guard l(mu);
      g.error = r.ok() ? std::error_code{} : r.error();
    }
    if (!r.ok() && first.ok()) first = r;
  }
  std::lock_guard l(mu);
  cv.notify_all();
  return first;
}

Status Failover::switch_now() {
  if (closed.load()) return errc(ENOENT);
  std::unique_lock l(mu);
  if (!open.load() || want || manual) return errc(EBUSY);  // a failover is under way
  manual = true;
  manual_result = -1;
  want = true;
  trigger_at = Clock::now();
  cv.notify_all();
  // The flush of the old active and the take-over: each bounded by the sessions' timeouts.
  const auto deadline = Clock::now() + 2 * opts.remap_timeout;
  if (!cv.wait_until(l, deadline, [&] { return manual_result >= 0 || stop; })) return errc(ETIMEDOUT);
  if (manual_result < 0) return errc(ECANCELED);
  return manual_result == 0 ? Status{} : errc(manual_result);
}

FailoverInfo Failover::info() const {
  FailoverInfo i;
  const uint8_t a = active.load();
  const Leg& sb = legs[a ^ 1];
  i.active = legs[a].s->name();
  i.standby = sb.s->name();
  i.switching = !open.load();
  const Device* d = sb.dp.load();
  i.standby_ready = d != nullptr && d->state.load() != DeviceState::closed &&
                    sb.s->state() == SessionState::connected;
  {
    std::lock_guard l(mu);
    i.standby_error = sb.error;
  }
  if (!i.standby_ready && !i.standby_error) {
    i.standby_error = sb.s->state() != SessionState::connected ? errc(ENOTCONN)
                      : d == nullptr                           ? errc(ENODEV)
                                                               : errc(d->closed_err.load());
  }
  if (i.standby_ready) i.standby_error = {};
  i.failovers = failovers.load();
  i.resent = resent.load();
  i.last_pause = std::chrono::milliseconds(last_pause_ms.load());
  i.lost_flushes = lost_flushes.load();
  return i;
}

Failover::~Failover() {
  if (!closed.load()) (void)unmap(UnmapMode::force);
  detach();
}

}  // namespace client

// ---------------------------------------------------------------------------------------------
// Public face

Result<std::shared_ptr<RemoteDevice>> map_failover(BlockSession& active, BlockSession& standby,
                                                   std::string_view dev_name, AccessMode mode,
                                                   FailoverOptions options) {
  if (&active == &standby) return errc(EINVAL);
  BASE_TRY(proto::check_dev_name(dev_name));
  if (active.find(dev_name) != nullptr || standby.find(dev_name) != nullptr) return errc(EEXIST);
  auto f = std::make_unique<Failover>();
  f->name = std::string(dev_name);
  f->mode = mode;
  f->opts = std::move(options);
  f->legs[0].s = &active;
  f->legs[1].s = &standby;
  BASE_ASSIGN_OR_RETURN(auto a, active.impl()->map_device(dev_name, mode, MapAs::active_leg));
  f->legs[0].dev = a;
  f->legs[0].dp.store(a->impl());
  // A plain OPEN: the standby's server opens the device and takes nothing over.
  auto b = standby.impl()->map_device(dev_name, mode, MapAs::standby_leg);
  if (b.ok()) {
    f->legs[1].dev = *b;
    f->legs[1].dp.store((*b)->impl());
  } else {
    f->legs[1].error = b.error();
    f->standby_was_ready = false;
    BASE_LOG(warn, "ibnbd %s: standby session %s refused the device: %s; serving from %s alone",
              f->name.c_str(), standby.name().c_str(), b.error().message().c_str(), active.name().c_str());
  }
  Failover* raw = f.get();
  for (uint8_t i = 0; i < 2; ++i) {
    f->legs[i].down.store(f->legs[i].s->state() == SessionState::disconnected);
    f->legs[i].listener = f->legs[i].s->impl()->add_listener(
        [raw, i](const ibtrs::SessionEventInfo& e) { raw->on_session_event(i, e); });
  }
  f->worker = std::thread([raw] { raw->run(); });
  return Failover::wrap(std::move(f));
}

Status unmap_failover(RemoteDevice& dev, UnmapMode mode) {
  Failover* f = dev.failover_impl();
  if (f == nullptr) return errc(EINVAL);
  return f->unmap(mode);
}

Status remap_failover(RemoteDevice& dev) {
  Failover* f = dev.failover_impl();
  if (f == nullptr) return errc(EINVAL);
  return f->remap();
}

Status switch_failover(RemoteDevice& dev) {
  Failover* f = dev.failover_impl();
  if (f == nullptr) return errc(EINVAL);
  return f->switch_now();
}

}  // namespace ibnbd
