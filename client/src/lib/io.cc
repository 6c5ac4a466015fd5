// The IO path of a session: parts through their waits to the transport and back (kernel:
// rnbd_queue_rq, rnbd_softirq_done_fn). Runs on the submitting threads and the transport's IO
// threads; nothing here blocks.
#include <cstring>

#include "base/log.h"
#include "lib/client_impl.h"

namespace ibnbd {

using namespace client;

// A part leaves the transport: the counters a remap or a forced unmap waits on.
void Session::left_transport(Device* d) {
  d->inflight_parts.fetch_sub(1, std::memory_order_seq_cst);
  inflight.fetch_sub(1, std::memory_order_seq_cst);
}

// Bounce stage, then the device and session stages.
void Session::advance(Part* p) {
  UserReq* r = p->req;
  if (r->bounce) {
    Device* d = r->dev;
    if (p->slot < 0 && !d->take_slot(p)) return;  // waits for a slot; release_slot resumes it
    std::byte* b = d->slot_addr(p->slot);
    if (r->dir == ibtrs::IoDir::write) std::memcpy(b, p->user, p->io.bi_size);
    // A BLOCK_STATUS's buffer is its answer, whatever the range (proto::carrier_of).
    const uint32_t blen = p->io.op == IoOp::block_status ? uint32_t{proto::kBlockStatusReplyBytes} : p->io.bi_size;
    p->segs[0] = ibtrs::IoSeg{b, blen, d->bounce.get()};
    p->nseg = 1;
  }
  send_or_queue(p);
}

void Session::send_or_queue(Part* p) {
  for (;;) {
    // Behind parts that already wait, so a stream of new requests cannot starve them.
    const int r = q_len.load(std::memory_order_acquire) != 0 ? kWaitSession : try_send(p);
    if (r == 0) return;
    if (r == kWaitSession) {
      {
        std::lock_guard l(q_mu);
        if (p->queued_at == Clock::time_point{}) p->queued_at = Clock::now();
        queue.push(p);
        // seq_cst, as the completion's load of q_len and the permit pool's release and take:
        // either that completion sees the part counted, or our pump below sees its permit.
        q_len.fetch_add(1, std::memory_order_seq_cst);
      }
      // A permit may have come back between our try and the push: its completion saw an empty
      // queue, so pump now.
      pump();
      return;
    }
    if (r == kWaitDevice) {
      if (hold(p)) return;
      continue;  // the remap finished meanwhile
    }
    finish_part(p, r == kAnsweredHere ? 0 : r);
    return;
  }
}

int Session::try_send(Part* p) {
  Device* d = p->req->dev;
  if (closing.load(std::memory_order_acquire)) return ESHUTDOWN;
  if (d->state.load(std::memory_order_acquire) == DeviceState::closed)
    return d->closed_err.load(std::memory_order_relaxed);
  inflight.fetch_add(1, std::memory_order_seq_cst);
  d->inflight_parts.fetch_add(1, std::memory_order_seq_cst);
  if (!open.load(std::memory_order_seq_cst)) {
    left_transport(d);
    return kWaitSession;
  }
  if (d->remapping.load(std::memory_order_seq_cst)) {
    left_transport(d);
    return kWaitDevice;
  }
  if (p->io.op == IoOp::block_status && version.load(std::memory_order_relaxed) < proto::kBlockStatusVersion) {
    // A server before protocol 5 cannot say where holes are; "all data" is always true (as
    // NBD's spec says of status 0). Asked again after every remap: the server may change.
    left_transport(d);
    auto* out = reinterpret_cast<ExtentList*>(p->user);
    out->count = 1;
    out->e[0] = Extent{p->io.bi_size, 0};
    return kAnsweredHere;
  }
  p->dev_gen = d->gen.load(std::memory_order_acquire);
  p->io.device_id = d->id.load(std::memory_order_acquire);
  auto n = proto::encode_io(p->usr, p->io);
  if (!n.ok()) {  // validation let through what the codec refuses: our bug, not the caller's
    left_transport(d);
    BASE_LOG(error, "ibnbd %s: cannot encode IO: %s", d->name.c_str(), n.error().message().c_str());
    return n.error().value();
  }
  ibtrs::IoRequest req;
  req.dir = p->req->dir;
  req.usr = std::span<const std::byte>(p->usr, *n);
  req.data = std::span<const ibtrs::IoSeg>(p->segs, p->nseg);
  req.done = &Session::on_part_done;
  req.ctx = p;
  // A wait after this one (an ENODEV retry) is timed from its own start. Set before the
  // request: once sent, the part belongs to its completion.
  p->queued_at = Clock::time_point{};
  // Never wait for a permit here: the caller may be a completion callback or an event loop.
  auto st = ts->request(req, ibtrs::PermitWait::no);
  if (!st.ok()) {
    left_transport(d);
    const int e = st.error().value();
    return e == EAGAIN ? kWaitSession : e;
  }
  d->st.parts_sent.fetch_add(1, std::memory_order_relaxed);
  return 0;
}

bool Session::hold(Part* p) {
  Device* d = p->req->dev;
  std::lock_guard l(d->mu);
  if (!d->remapping.load(std::memory_order_seq_cst)) return false;
  if (p->queued_at == Clock::time_point{}) p->queued_at = Clock::now();
  d->held.push(p);
  return true;
}

void Session::pump() {
  std::unique_lock l(q_mu);
  while (!queue.empty() && open.load(std::memory_order_seq_cst)) {
    // Off the queue before it is sent: once sent, it may complete (and be recycled, its link
    // reused) on another thread before try_send returns. It stays counted in q_len until it
    // left for good: a permit freed after try_send found none is seen by its completion,
    // which then pumps (it waits for q_mu and finds the part back at the front). Uncounted,
    // that completion saw an empty queue and nothing sent the part until the next IO came or
    // went: a request that waited for ever on a quiet device.
    Part* p = queue.pop();
    const int r = try_send(p);
    if (r == kWaitSession) {  // no permit: back to the front; the next completion pumps again
      if (auto hook = g_pump_found_no_permit.load(std::memory_order_relaxed)) hook();
      queue.push_front(p);
      break;
    }
    q_len.fetch_sub(1, std::memory_order_release);
    if (r == 0) continue;
    l.unlock();
    if (r == kWaitDevice) {
      if (!hold(p)) send_or_queue(p);
    } else {
      finish_part(p, r == kAnsweredHere ? 0 : r);
    }
    l.lock();
  }
}

// Transport IO thread (or the thread of a session closing).
void Session::on_part_done(void* ctx, int err) {
  auto* p = static_cast<Part*>(ctx);
  UserReq* r = p->req;
  Device* d = r->dev;
  Session* s = d->s;
  if (err == ENODEV && !p->retried &&
      d->state.load(std::memory_order_acquire) != DeviceState::closed) {
    // The server does not know the id. After a remap (the part went out before it) or while
    // one is pending, that is the restart the remap is for: send once more with the new id.
    // Otherwise the device was taken away while the session stayed up: say so.
    bool now = false;
    bool wait = false;
    {
      std::lock_guard l(d->mu);
      now = d->gen.load(std::memory_order_acquire) != p->dev_gen;
      wait = !now && (d->remapping.load() || !s->open.load());
      if (wait) {
        p->retried = true;
        if (p->queued_at == Clock::time_point{}) p->queued_at = Clock::now();
        // Parked before the counters drop: the remap that waits for them finds it here.
        d->held.push(p);
      }
    }
    if (now || wait) {
      d->st.enodev_retries.fetch_add(1, std::memory_order_relaxed);
      s->left_transport(d);
      if (now) {
        p->retried = true;
        s->send_or_queue(p);
      }
      return;
    }
  }
  s->left_transport(d);
  if (err == 0 && p->slot >= 0 && p->io.op == IoOp::block_status) {
    // Decoded straight from the slot into the caller's list; a server's answer that breaks
    // the rules fails the request rather than reaching the caller.
    const std::span<const std::byte> ans(d->slot_addr(p->slot), proto::kBlockStatusReplyBytes);
    auto st = proto::decode_block_status_rsp(ans, p->io.bi_size, *reinterpret_cast<ExtentList*>(p->user));
    if (!st.ok()) {
      BASE_LOG(error, "ibnbd %s: bad BLOCK_STATUS answer: %s", d->name.c_str(), st.error().message().c_str());
      err = EPROTO;
    }
  } else if (err == 0 && p->slot >= 0 && r->dir == ibtrs::IoDir::read) {
    std::memcpy(p->user, d->slot_addr(p->slot), p->io.bi_size);
  }
  s->finish_part(p, err);
}

void Session::finish_part(Part* p, int err) {
  UserReq* r = p->req;
  Device* d = r->dev;
  if (err != 0) {
    int zero = 0;
    r->err.compare_exchange_strong(zero, err, std::memory_order_acq_rel);
  }
  Part* next_owner = p->slot >= 0 ? d->release_slot(p) : nullptr;
  parts.put(p);
  if (next_owner != nullptr) advance(next_owner);
  // The permit of this part is free again (the transport releases it before calling back).
  if (q_len.load(std::memory_order_seq_cst) != 0) pump();
  if (r->left.fetch_sub(1, std::memory_order_acq_rel) == 1) complete_req(r);
}

void Session::complete_req(UserReq* r) {
  if (tl_defer_completions > 0) {
    {
      std::lock_guard l(st_mu);
      deferred.push_back(r);
    }
    st_cv.notify_all();
    return;
  }
  run_completion(r);
}

// Runs the caller's callback. Everything of ours is released first: once the callback runs,
// the caller may unmap the device or close the session.
void Session::run_completion(UserReq* r) {
  const IoDone done = r->done;
  const int err = r->err.load(std::memory_order_acquire);
  Device* d = r->dev;
  if (err != 0) d->st.errors.fetch_add(1, std::memory_order_relaxed);
  reqs.put(r);
  d->inflight_reqs.fetch_sub(1, std::memory_order_acq_rel);
  outstanding.fetch_sub(1, std::memory_order_acq_rel);
  done.fn(done.ctx, err);
}

// The device is open again (or was never really closed): its held parts go out.
void Session::release_held(Device* d) {
  PartList l;
  {
    std::lock_guard g(d->mu);
    d->remapping.store(false, std::memory_order_seq_cst);
    l = d->held.take();
  }
  while (!l.empty()) send_or_queue(l.pop());
}

void Session::fail_list(PartList l, int err) {
  while (!l.empty()) finish_part(l.pop(), err);
}

// The device turns closed: new IO is refused, and every part of it still waiting in the
// library fails with `err`. Parts on the transport finish as the server answers.
void Session::close_device(Device* d, int err) {
  d->closed_err.store(err, std::memory_order_relaxed);
  d->state.store(DeviceState::closed, std::memory_order_seq_cst);
  PartList waiting = d->take_waiting();
  {
    std::lock_guard l(q_mu);
    PartList mine = queue.extract([d](Part* p) { return p->req->dev == d; });
    q_len.store(queue.size, std::memory_order_release);
    while (!mine.empty()) waiting.push(mine.pop());
  }
  d->remapping.store(false, std::memory_order_seq_cst);
  fail_list(waiting, err);
}

// ---------------------------------------------------------------------------------------------
// Bounce slots

bool Device::take_slot(Part* p) {
  std::lock_guard l(bounce_mu);
  if (free_slots.empty() || !bounce_wait.empty()) {
    bounce_wait.push(p);
    return false;
  }
  p->slot = free_slots.back();
  free_slots.pop_back();
  return true;
}

// Returns the slot, or hands it to the first part waiting for one (returned: the caller
// advances it).
Part* Device::release_slot(Part* p) {
  std::lock_guard l(bounce_mu);
  const int32_t slot = std::exchange(p->slot, -1);
  if (!bounce_wait.empty()) {
    Part* w = bounce_wait.pop();
    w->slot = slot;
    return w;
  }
  free_slots.push_back(slot);
  return nullptr;
}

PartList Device::take_waiting() {
  PartList out;
  {
    std::lock_guard l(mu);
    out = held.take();
  }
  std::lock_guard l(bounce_mu);
  while (!bounce_wait.empty()) out.push(bounce_wait.pop());
  return out;
}

}  // namespace ibnbd
