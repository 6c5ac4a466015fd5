// Requests that lost their connection or found no path (kernel: rtrs_clt_failover_req, which
// resends at once; here a request may have to wait): parked until a path takes it or its
// pending_timeout ends, or held for the failover fence of the incarnation it was posted on
// (docs/protocol.md, "Failover fence"). Structure in client_impl.h.
#include <algorithm>

#include "client/client_impl.h"
#include "base/log.h"

namespace ibtrs {
namespace client {

// A request no path could take waits for one (or for its deadline).
void Session::park(uint32_t p) {
  reqs[p].path = nullptr;
  reqs[p].pending_deadline_ns =
      now_ns() + std::chrono::duration_cast<std::chrono::nanoseconds>(opts.pending_timeout).count();
  std::lock_guard lock(pend_mu);
  pending.push_back(p);
}

void Session::fence_wait(uint32_t p, Path* path, uint16_t recon) {
  Req& q = reqs[p];
  q.path = nullptr;
  q.pending_deadline_ns =
      now_ns() + std::chrono::duration_cast<std::chrono::nanoseconds>(opts.pending_timeout).count();
  bool fresh = false;
  {
    std::lock_guard lock(fence_mu);
    auto it = std::find_if(fences.begin(), fences.end(),
                           [&](const Fence& f) { return f.path == path && f.recon == recon; });
    if (it == fences.end()) {
      Fence f;
      f.path = path;
      f.recon = recon;
      f.since_ns = now_ns();
      fences.push_back(std::move(f));
      it = fences.end() - 1;
      fresh = true;
    }
    it->reqs.push_back(p);
    fence_waiting.fetch_add(1, std::memory_order_acq_rel);
  }
  path->fence_waited.fetch_add(1, std::memory_order_relaxed);
  // Not the worker's: it may sit in a connect for up to connect_timeout.
  if (fresh) svc_poller->post([this] { fence_kick(); });
}

// Any thread (the service poller, the worker).
void Session::fence_kick() {
  if (!geo_set.load(std::memory_order_acquire) || !fence_on()) return;
  std::lock_guard lock(fence_mu);
  for (Fence& f : fences) {
    if (f.carrier != nullptr && f.carrier->usable() &&
        f.carrier->gen.load(std::memory_order_acquire) == f.carrier_gen)
      continue;  // on its way
    f.carrier = nullptr;
    const uint32_t n = npaths_hint.load(std::memory_order_acquire);
    for (uint32_t i = 0; i < n && f.carrier == nullptr; ++i) {
      Path* pa = paths[i].load(std::memory_order_acquire);
      if (pa == nullptr || pa == f.path || !pa->usable()) continue;
      Con* svc = pa->cons[0].get();
      if (!svc->gate.enter()) continue;
      // One send slot per fenced path: one fence of a path is unanswered at a time (a newer
      // incarnation of it is fenced only after it connected, which confirmed the older).
      const size_t off = svc_fence_off(geo.queue_depth, f.path->slot);
      const auto m = proto::make_path_fence(f.path->uuid, f.recon);
      if (svc->send_svc(off, proto::as_bytes_of(m)).ok()) {
        f.carrier = pa;
        f.carrier_gen = pa->gen.load(std::memory_order_acquire);
        BASE_LOG(info, "path %s: fencing incarnation %u (%zu requests wait) over path %s",
                  f.path->name.c_str(), f.recon, f.reqs.size(), pa->name.c_str());
      }
      svc->gate.exit();
    }
  }
}

// Any thread.
void Session::fence_release(Path* path, uint16_t upto, bool inclusive) {
  std::vector<Fence> done;
  {
    std::lock_guard lock(fence_mu);
    for (auto it = fences.begin(); it != fences.end();) {
      const int16_t age = static_cast<int16_t>(it->recon - upto);
      if (it->path == path && (age < 0 || (inclusive && age == 0))) {
        done.push_back(std::move(*it));
        it = fences.erase(it);
      } else {
        ++it;
      }
    }
  }
  const int64_t now = now_ns();
  for (Fence& f : done) {
    const auto rtt = static_cast<uint64_t>(std::max<int64_t>(0, now - f.since_ns));
    path->fences_done.fetch_add(1, std::memory_order_relaxed);
    path->fence_rtt_last_ns.store(rtt, std::memory_order_relaxed);
    if (rtt > path->fence_rtt_max_ns.load(std::memory_order_relaxed))
      path->fence_rtt_max_ns.store(rtt, std::memory_order_relaxed);
    BASE_LOG(info, "path %s: incarnation %u fenced after %llu us: %zu requests resent, %zu chunks "
              "of failed ones free again",
              path->name.c_str(), f.recon, static_cast<unsigned long long>(rtt / 1000), f.reqs.size(),
              f.kept.size());
    for (uint32_t p : f.reqs) {
      fence_waiting.fetch_sub(1, std::memory_order_acq_rel);
      if (!post(p, nullptr)) {
        // Parked as it is: its deadline runs from its failover.
        std::lock_guard lock(pend_mu);
        pending.push_back(p);
      }
    }
    for (uint32_t p : f.kept) give_back_kept(p);
    // Requests of this fence still failing (fail_fenced) find it gone and free their own.
  }
}

// Any thread but an IO poller.
size_t Session::fail_fenced(const std::function<bool(uint32_t)>& which, int err) {
  struct Taken {
    Path* path;
    uint16_t recon;
    uint32_t p;
  };
  std::vector<Taken> taken;
  {
    std::lock_guard lock(fence_mu);
    for (Fence& f : fences) {
      std::erase_if(f.reqs, [&](uint32_t p) {
        if (!which(p)) return false;
        taken.push_back({f.path, f.recon, p});
        ++f.failing;
        return true;
      });
    }
    fence_waiting.fetch_sub(static_cast<uint32_t>(taken.size()), std::memory_order_acq_rel);
    // Kept from now on as far as a submitter can tell: its callback may submit at once.
    fence_kept.fetch_add(static_cast<uint32_t>(taken.size()), std::memory_order_acq_rel);
  }
  // The callbacks run outside the lock (they may submit); meanwhile the requests are in no
  // list, so a confirmation of their fence cannot hand out their permits under them.
  for (const Taken& t : taken) finish(t.p, err, nio, true);
  std::vector<uint32_t> confirmed;
  {
    std::lock_guard lock(fence_mu);
    for (const Taken& t : taken) {
      // At most one fence per incarnation is listed; one with `failing` is still ours.
      auto it = std::find_if(fences.begin(), fences.end(), [&](const Fence& f) {
        return f.path == t.path && f.recon == t.recon && f.failing > 0;
      });
      if (it == fences.end()) {
        confirmed.push_back(t.p);  // confirmed while the callback ran
        continue;
      }
      --it->failing;
      it->kept.push_back(t.p);
    }
  }
  for (uint32_t p : confirmed) give_back_kept(p);
  return taken.size();
}

// Service poller. An answer to no fence of ours (a repeated one, or a server's invention)
// releases nothing. A fence whose requests all failed meanwhile is still listed: its answer
// frees their chunks.
void Session::fence_answered(const proto::FenceView& v) {
  Path* fenced = nullptr;
  {
    std::lock_guard lock(fence_mu);
    for (const Fence& f : fences)
      if (f.path->uuid == v.path_uuid) fenced = f.path;
  }
  if (fenced != nullptr) fence_release(fenced, v.recon_cnt, true);
}

// Worker: resubmits parked requests, fails the expired ones (or all with `fail_all`).
void Session::run_pending(bool fail_all, int err) {
  if (fail_all) {
    fail_parked_if([](uint32_t) { return true; }, err);
    return;
  }
  expire_parked();
  fence_kick();
  std::deque<uint32_t> todo;
  {
    std::lock_guard lock(pend_mu);
    todo.swap(pending);
  }
  for (uint32_t p : todo) {
    if (!post(p, nullptr)) {
      std::lock_guard lock(pend_mu);
      pending.push_back(p);
    }
  }
}

size_t Session::expire_parked() {
  const int64_t now = now_ns();
  const size_t expired = fail_parked_if([&](uint32_t p) { return now >= reqs[p].pending_deadline_ns; }, ENOTCONN);
  // An operator (and the soak's verdict) must be able to tell the configured timeout from a
  // lost request: one line per batch that failed because no path came back in time.
  if (expired != 0)
    BASE_LOG(warn, "session %s: %zu requests failed (ENOTCONN): no path for pending_timeout (%lld ms)",
              opts.session_name.c_str(), expired, static_cast<long long>(opts.pending_timeout.count()));
  return expired;
}

size_t Session::fail_parked_if(const std::function<bool(uint32_t)>& which, int err) {
  // Requests waiting for a fence first: their permits stay kept.
  size_t n = fail_fenced(which, err);
  std::vector<uint32_t> todo;
  {
    std::lock_guard lock(pend_mu);
    std::erase_if(pending, [&](uint32_t p) {
      if (!which(p)) return false;
      todo.push_back(p);
      return true;
    });
  }
  for (uint32_t p : todo) finish(p, err, nio);
  return n + todo.size();
}

// Worker.
void Session::fail_parked(const std::function<bool(IoDoneFn, void*)>& which, int err) {
  fail_parked_if([&](uint32_t p) { return which(reqs[p].done, reqs[p].ctx); }, err);
}

}  // namespace client
}  // namespace ibtrs
