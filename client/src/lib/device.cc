// RemoteDevice: validation before anything is sent, and the cut into parts (kernel:
// rnbd_clt_dev, rnbd_client_xfer_request; the block layer's split and limit checks).
#include <algorithm>
#include <cstring>

#include <thread>

#include "base/log.h"
#include "lib/client_impl.h"
#include "lib/failover.h"
#include "proto/access.h"

namespace ibnbd {

using namespace client;

namespace {

// Flags each op may carry (the codec refuses NOUNMAP elsewhere; the rest we decide here).
uint32_t allowed_flags(IoOp op) {
  switch (op) {
    case IoOp::write: return kIoFua | kIoPreflush | kIoSync;
    case IoOp::write_zeroes: return kIoNoUnmap;
    default: return 0;
  }
}

// Data segments: each inside its registration (the transport would refuse the part otherwise,
// after earlier parts went out). Returns their total length.
Result<uint64_t> check_segs(std::span<const ibtrs::IoSeg> segs) {
  uint64_t total = 0;
  for (const ibtrs::IoSeg& sg : segs) {
    if (sg.len == 0) continue;
    if (sg.mem == nullptr || sg.addr == nullptr) return errc(EINVAL);
    const auto* a = static_cast<const std::byte*>(sg.addr);
    const std::byte* base = sg.mem->data();
    if (a < base || sg.len > sg.mem->size() || a - base > static_cast<ptrdiff_t>(sg.mem->size() - sg.len))
      return errc(EINVAL);
    total += sg.len;
  }
  return total;
}

}  // namespace

Result<Device::Cut> Device::check(IoOp op, uint64_t offset, uint64_t& len, std::span<const ibtrs::IoSeg> segs,
                                  bool bounced, uint32_t flags) const {
  // The server's own rule, so that we refuse exactly what it would (EPERM).
  BASE_TRY(proto::check_op_allowed(mode, op));
  if ((flags & ~allowed_flags(op)) != 0) return errc(EINVAL);
  const bool data = op == IoOp::read || op == IoOp::write;
  uint32_t max_part = 0;
  switch (op) {
    case IoOp::read:
    case IoOp::write:
      if (bounced) {
        if (bounce == nullptr) return errc(EOPNOTSUPP);
        max_part = std::min(max_rw.load(std::memory_order_relaxed), slot_size);
      } else {
        BASE_ASSIGN_OR_RETURN(len, check_segs(segs));
        max_part = max_rw.load(std::memory_order_relaxed);
      }
      break;
    case IoOp::flush:
      break;
    case IoOp::discard:
      max_part = max_discard.load(std::memory_order_relaxed);
      break;
    case IoOp::secure_erase:
      if (!secure.load(std::memory_order_relaxed)) return errc(EOPNOTSUPP);
      max_part = max_discard.load(std::memory_order_relaxed);
      break;
    case IoOp::write_zeroes:
      max_part = max_wz.load(std::memory_order_relaxed);
      break;
    case IoOp::block_status:
      // The answer lands in a bounce slot; the range is one part, cut to what the answer's
      // 32-bit lengths can say (it covers a prefix anyway: the caller asks again).
      if (!bounced || bounce == nullptr || slot_size < proto::kBlockStatusReplyBytes) return errc(EOPNOTSUPP);
      max_part = UINT32_MAX / proto::kMaxLogicalBlockSize * proto::kMaxLogicalBlockSize;  // a multiple of any block
      break;
  }
  uint64_t nparts = 1;
  if (op != IoOp::flush) {
    if (max_part == 0) return errc(EOPNOTSUPP);
    const uint32_t block = lbs.load(std::memory_order_relaxed);
    const uint64_t dev_size = size.load(std::memory_order_relaxed);
    if (len == 0 || offset % block != 0 || len % block != 0 || offset > dev_size ||
        len > dev_size - offset)
      return errc(EINVAL);
    if (data && !bounced) {
      BASE_ASSIGN_OR_RETURN(nparts, count_parts(segs, max_part, block));
    } else if (op == IoOp::block_status) {
      nparts = 1;
    } else {
      nparts = range_parts(len, max_part);
    }
  }
  if (nparts > UINT32_MAX) return errc(EINVAL);
  return Cut{nparts, max_part};
}

Status Device::submit(IoOp op, uint64_t offset, uint64_t len, std::span<const ibtrs::IoSeg> segs,
                      std::byte* copy_buf, uint32_t flags, IoDone done, uint16_t prio) {
  if (done.fn == nullptr) return errc(EINVAL);
  Session* sess = s;
  if (sess == nullptr || sess->closing.load(std::memory_order_acquire)) return errc(ESHUTDOWN);
  if (state.load(std::memory_order_acquire) == DeviceState::closed) return errc(ENODEV);
  const bool bounced = copy_buf != nullptr;
  const bool data = op == IoOp::read || op == IoOp::write;
  // One load of the limits for the check and the cut (a remap may change them meanwhile).
  BASE_ASSIGN_OR_RETURN(const Cut cut, check(op, offset, len, segs, bounced, flags));
  const uint64_t nparts = cut.nparts;
  const uint32_t max_part = cut.max_part;

  DeferCompletions defer;
  UserReq* r = sess->reqs.get();
  r->dev = this;
  r->done = done;
  r->dir = op == IoOp::read || op == IoOp::block_status ? ibtrs::IoDir::read : ibtrs::IoDir::write;
  r->bounce = bounced;
  r->err.store(0, std::memory_order_relaxed);
  // All parts are counted before the first goes out, so none can complete the request early.
  r->left.store(static_cast<uint32_t>(nparts), std::memory_order_release);
  inflight_reqs.fetch_add(1, std::memory_order_acq_rel);
  sess->outstanding.fetch_add(1, std::memory_order_acq_rel);
  st.count(op, len);

  SegSplitter split(segs, max_part, lbs.load(std::memory_order_relaxed));
  uint64_t pos = 0;
  for (uint64_t i = 0; i < nparts; ++i) {
    Part* p = sess->parts.get();
    p->req = r;
    p->retried = false;
    p->slot = -1;
    p->user = nullptr;
    p->nseg = 0;
    p->queued_at = Clock::time_point{};
    uint32_t plen = 0;
    if (data && !bounced) {
      // Cannot fail: count_parts ran the same cut over the same segments.
      plen = split.next(p->segs, p->nseg).value();
    } else if (op != IoOp::flush) {
      plen = static_cast<uint32_t>(std::min<uint64_t>(max_part, len - pos));
    }
    if (bounced) p->user = copy_buf + pos;
    // PREFLUSH once, before the data of the first part: it is about what completed before this
    // request, not about its parts. FUA and SYNC are about each part's data.
    const uint32_t pflags = i == 0 ? flags : flags & ~uint32_t{kIoPreflush};
    p->io = proto::Io{0, (offset + pos) / kSectorSize, op, pflags, plen, prio};
    pos += plen;
    sess->advance(p);
  }
  return {};
}

void Device::apply(const proto::OpenRsp& rsp, uint32_t max_io_size) {
  std::lock_guard l(mu);
  geo = rsp.geo;
  const uint32_t block = geo.logical_block_size;
  size.store(geo.nsectors * kSectorSize, std::memory_order_relaxed);
  lbs.store(block, std::memory_order_relaxed);
  max_rw.store(part_limit(std::min<uint64_t>(max_io_size, uint64_t{geo.max_hw_sectors} * kSectorSize), block),
               std::memory_order_relaxed);
  const uint32_t disc = part_limit(uint64_t{geo.max_discard_sectors} * kSectorSize, block);
  max_discard.store(disc, std::memory_order_relaxed);
  max_wz.store(part_limit(uint64_t{geo.max_write_zeroes_sectors} * kSectorSize, block),
               std::memory_order_relaxed);
  secure.store(geo.secure_discard && disc != 0, std::memory_order_relaxed);
  id.store(rsp.device_id, std::memory_order_release);
  gen.fetch_add(1, std::memory_order_acq_rel);
  size_epoch = rsp.size_epoch;
}

void Device::set_size(uint64_t bytes) {
  std::lock_guard l(mu);
  geo.nsectors = bytes / kSectorSize;
  size.store(bytes, std::memory_order_relaxed);
}

// ---------------------------------------------------------------------------------------------
// Public face

RemoteDevice::RemoteDevice(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RemoteDevice::RemoteDevice(std::unique_ptr<client::Failover> fo) : fo_(std::move(fo)) {}

RemoteDevice::~RemoteDevice() {
  if (!fo_) return;
  // A failover device dropped while mapped is unmapped (force); its requests still out call
  // back into it, so it lives until they are done. Should they never be (a session destroyed
  // first, against the rules), it is left allocated rather than freed under them.
  if (!fo_->closed.load()) (void)fo_->unmap(UnmapMode::force);
  const auto until = Clock::now() + std::chrono::seconds(60);
  while (fo_->outstanding.load() != 0 && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (fo_->outstanding.load() != 0) {
    BASE_LOG(error, "ibnbd %s: failover device destroyed with %llu requests out: left allocated", fo_->name.c_str(),
              static_cast<unsigned long long>(fo_->outstanding.load()));
    (void)fo_.release();
  }
}

const std::string& RemoteDevice::name() const { return fo_ ? fo_->name : impl_->name; }
AccessMode RemoteDevice::access_mode() const { return fo_ ? fo_->mode : impl_->mode; }

namespace {
// The device serving a failover device's IO now.
const Device* active_of(const client::Failover& f) {
  return f.legs[f.active.load(std::memory_order_acquire)].dp.load(std::memory_order_acquire);
}
}  // namespace

DeviceGeometry RemoteDevice::geometry() const {
  const Device* d = fo_ ? active_of(*fo_) : impl_.get();
  std::lock_guard l(d->mu);
  return d->geo;
}
uint64_t RemoteDevice::size_bytes() const {
  return (fo_ ? active_of(*fo_) : impl_.get())->size.load(std::memory_order_relaxed);
}
uint32_t RemoteDevice::device_id() const {
  return (fo_ ? active_of(*fo_) : impl_.get())->id.load(std::memory_order_acquire);
}
uint32_t RemoteDevice::max_part_bytes() const {
  if (!fo_) return impl_->max_rw.load(std::memory_order_relaxed);
  // Frontends size their buffers by it: what both legs take in one request.
  uint32_t m = UINT32_MAX;
  for (const auto& g : fo_->legs)
    if (const Device* d = g.dp.load(std::memory_order_acquire)) m = std::min(m, d->max_rw.load(std::memory_order_relaxed));
  return m;
}

namespace {
DeviceState state_of(const Device& d) {
  const DeviceState st = d.state.load(std::memory_order_acquire);
  if (st == DeviceState::closed) return st;
  const Session* s = d.s;
  if (d.remapping.load() || (s != nullptr && !s->open.load())) return DeviceState::remapping;
  return DeviceState::open;
}
}  // namespace

DeviceState RemoteDevice::state() const {
  if (!fo_) return state_of(*impl_);
  if (fo_->closed.load()) return DeviceState::closed;
  if (!fo_->open.load()) return DeviceState::remapping;
  return state_of(*active_of(*fo_));
}

DeviceStats RemoteDevice::stats() const {
  const Stats& s = fo_ ? fo_->counts : impl_->st;
  DeviceStats o;
  o.reads = s.reads.load(std::memory_order_relaxed);
  o.writes = s.writes.load(std::memory_order_relaxed);
  o.flushes = s.flushes.load(std::memory_order_relaxed);
  o.discards = s.discards.load(std::memory_order_relaxed);
  o.write_zeroes = s.write_zeroes.load(std::memory_order_relaxed);
  o.block_status = s.block_status.load(std::memory_order_relaxed);
  o.read_bytes = s.read_bytes.load(std::memory_order_relaxed);
  o.write_bytes = s.write_bytes.load(std::memory_order_relaxed);
  o.errors = s.errors.load(std::memory_order_relaxed);
  if (!fo_) {
    o.parts_sent = s.parts_sent.load(std::memory_order_relaxed);
    o.enodev_retries = s.enodev_retries.load(std::memory_order_relaxed);
    o.remaps = s.remaps.load(std::memory_order_relaxed);
    o.resizes = s.resizes.load(std::memory_order_relaxed);
    o.inflight = impl_->inflight_reqs.load(std::memory_order_relaxed);
    return o;
  }
  // Transport requests and re-opens happen on the legs.
  for (const auto& g : fo_->legs) {
    const Device* d = g.dp.load(std::memory_order_acquire);
    if (d == nullptr) continue;
    o.parts_sent += d->st.parts_sent.load(std::memory_order_relaxed);
    o.enodev_retries += d->st.enodev_retries.load(std::memory_order_relaxed);
    o.remaps += d->st.remaps.load(std::memory_order_relaxed);
  }
  // Both legs hear of one resize: the active one's count is the device's.
  if (const Device* a = active_of(*fo_)) o.resizes = a->st.resizes.load(std::memory_order_relaxed);
  o.inflight = static_cast<uint32_t>(fo_->outstanding.load(std::memory_order_relaxed));
  return o;
}

std::optional<FailoverInfo> RemoteDevice::failover() const {
  if (!fo_) return std::nullopt;
  return fo_->info();
}

// One entry point for both kinds of device.
#define IBNBD_SUBMIT(op, offset, len, segs, copy, flags, done, prio)              \
  (fo_ ? fo_->submit(op, offset, len, segs, copy, flags, done, prio)             \
       : impl_->submit(op, offset, len, segs, copy, flags, done, prio))

Status RemoteDevice::read(uint64_t offset, std::span<const ibtrs::IoSeg> segs, IoDone done,
                          uint16_t prio) {
  return IBNBD_SUBMIT(IoOp::read, offset, 0, segs, nullptr, 0, done, prio);
}
Status RemoteDevice::write(uint64_t offset, std::span<const ibtrs::IoSeg> segs, uint32_t flags,
                           IoDone done, uint16_t prio) {
  return IBNBD_SUBMIT(IoOp::write, offset, 0, segs, nullptr, flags, done, prio);
}
Status RemoteDevice::flush(IoDone done) {
  return IBNBD_SUBMIT(IoOp::flush, 0, 0, {}, nullptr, 0, done, 0);
}
Status RemoteDevice::discard(uint64_t offset, uint64_t len, IoDone done) {
  return IBNBD_SUBMIT(IoOp::discard, offset, len, {}, nullptr, 0, done, 0);
}
Status RemoteDevice::write_zeroes(uint64_t offset, uint64_t len, bool no_unmap, IoDone done) {
  return IBNBD_SUBMIT(IoOp::write_zeroes, offset, len, {}, nullptr, no_unmap ? uint32_t{kIoNoUnmap} : 0u, done, 0);
}
Status RemoteDevice::secure_erase(uint64_t offset, uint64_t len, IoDone done) {
  return IBNBD_SUBMIT(IoOp::secure_erase, offset, len, {}, nullptr, 0, done, 0);
}
Status RemoteDevice::block_status(uint64_t offset, uint64_t len, ExtentList& out, IoDone done) {
  out.count = 0;
  return IBNBD_SUBMIT(IoOp::block_status, offset, len, {}, reinterpret_cast<std::byte*>(&out), 0, done, 0);
}
Status RemoteDevice::read_copy(uint64_t offset, std::span<std::byte> out, IoDone done,
                               uint16_t prio) {
  if (out.empty()) return errc(EINVAL);
  return IBNBD_SUBMIT(IoOp::read, offset, out.size(), {}, out.data(), 0, done, prio);
}
Status RemoteDevice::write_copy(uint64_t offset, std::span<const std::byte> data, uint32_t flags,
                                IoDone done, uint16_t prio) {
  if (data.empty()) return errc(EINVAL);
  // The bytes are only read (copied into a bounce slot); the part keeps one pointer type.
  return IBNBD_SUBMIT(IoOp::write, offset, data.size(), {}, const_cast<std::byte*>(data.data()), flags, done,
                      prio);
}
#undef IBNBD_SUBMIT

namespace {
// A failover device's batch lives on the session that was active when it began: the thread
// must end that one, whatever the device switched to meanwhile. One per thread (a batch of
// another failover device inside it is not held back: its requests go out at once).
struct FoBatch {
  const client::Failover* f = nullptr;
  ibtrs::ClientSession* ts = nullptr;
  int depth = 0;
};
thread_local FoBatch tl_fo_batch;
}  // namespace

void RemoteDevice::begin_batch() {
  if (fo_) {
    FoBatch& b = tl_fo_batch;
    if (b.f != nullptr && b.f != fo_.get()) return;
    if (b.depth++ == 0) {
      b.f = fo_.get();
      const Device* d = active_of(*fo_);
      b.ts = d != nullptr && d->s != nullptr ? d->s->ts.get() : nullptr;
      if (b.ts != nullptr) b.ts->begin_batch();
    }
    return;
  }
  if (Session* s = impl_->s) s->ts->begin_batch();
}
void RemoteDevice::end_batch() {
  if (fo_) {
    FoBatch& b = tl_fo_batch;
    if (b.f != fo_.get() || b.depth == 0) return;
    if (--b.depth == 0) {
      if (b.ts != nullptr) b.ts->end_batch();
      b = FoBatch{};
    }
    return;
  }
  if (Session* s = impl_->s) s->ts->end_batch();
}

Result<std::unique_ptr<ibtrs::RegisteredMemory>> RemoteDevice::alloc_buffer(size_t size) {
  if (!fo_) {
    Session* s = impl_->s;
    if (s == nullptr) return errc(ESHUTDOWN);
    return s->ts->alloc_buffer(size);
  }
  // Made by the first leg's session, shared with the other's: both may carry it.
  BASE_ASSIGN_OR_RETURN(auto m, fo_->legs[0].s->alloc_buffer(size));
  BASE_TRY(fo_->legs[1].s->transport().share_memory(*m));
  return m;
}

Result<std::unique_ptr<ibtrs::RegisteredMemory>> RemoteDevice::register_memory(void* addr, size_t size) {
  if (!fo_) {
    Session* s = impl_->s;
    if (s == nullptr) return errc(ESHUTDOWN);
    return s->ts->register_memory(addr, size);
  }
  BASE_ASSIGN_OR_RETURN(auto m, fo_->legs[0].s->register_memory(addr, size));
  BASE_TRY(fo_->legs[1].s->transport().share_memory(*m));
  return m;
}

std::string_view to_string(DeviceState s) {
  switch (s) {
    case DeviceState::open: return "open";
    case DeviceState::remapping: return "remapping";
    case DeviceState::closed: return "closed";
  }
  return "?";
}

}  // namespace ibnbd
