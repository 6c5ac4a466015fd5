// RemoteDevice: validation before anything is sent, and the cut into parts (kernel:
// rnbd_clt_dev, rnbd_client_xfer_request; the block layer's split and limit checks).
#include <algorithm>
#include <cstring>

#include "lib/client_impl.h"
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

Status Device::submit(IoOp op, uint64_t offset, uint64_t len, std::span<const ibtrs::IoSeg> segs,
                      std::byte* copy_buf, uint32_t flags, IoDone done, uint16_t prio) {
  if (done.fn == nullptr) return errc(EINVAL);
  Session* sess = s;
  if (sess == nullptr || sess->closing.load(std::memory_order_acquire)) return errc(ESHUTDOWN);
  if (state.load(std::memory_order_acquire) == DeviceState::closed) return errc(ENODEV);
  // The server's own rule, so that we refuse exactly what it would (EPERM).
  IBTRS_TRY(proto::check_op_allowed(mode, op));
  if ((flags & ~allowed_flags(op)) != 0) return errc(EINVAL);

  const bool bounced = copy_buf != nullptr;
  const bool data = op == IoOp::read || op == IoOp::write;
  uint32_t max_part = 0;
  switch (op) {
    case IoOp::read:
    case IoOp::write:
      if (bounced) {
        if (bounce == nullptr) return errc(EOPNOTSUPP);
        max_part = std::min(max_rw.load(std::memory_order_relaxed), slot_size);
      } else {
        IBTRS_ASSIGN_OR_RETURN(len, check_segs(segs));
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
      IBTRS_ASSIGN_OR_RETURN(nparts, count_parts(segs, max_part, block));
    } else {
      nparts = range_parts(len, max_part);
    }
  }
  if (nparts > UINT32_MAX) return errc(EINVAL);

  DeferCompletions defer;
  UserReq* r = sess->reqs.get();
  r->dev = this;
  r->done = done;
  r->dir = op == IoOp::read ? ibtrs::IoDir::read : ibtrs::IoDir::write;
  r->bounce = bounced;
  r->err.store(0, std::memory_order_relaxed);
  // All parts are counted before the first goes out, so none can complete the request early.
  r->left.store(static_cast<uint32_t>(nparts), std::memory_order_release);
  inflight_reqs.fetch_add(1, std::memory_order_acq_rel);
  sess->outstanding.fetch_add(1, std::memory_order_acq_rel);
  switch (op) {
    case IoOp::read:
      st.reads.fetch_add(1, std::memory_order_relaxed);
      st.read_bytes.fetch_add(len, std::memory_order_relaxed);
      break;
    case IoOp::write:
      st.writes.fetch_add(1, std::memory_order_relaxed);
      st.write_bytes.fetch_add(len, std::memory_order_relaxed);
      break;
    case IoOp::flush: st.flushes.fetch_add(1, std::memory_order_relaxed); break;
    case IoOp::discard:
    case IoOp::secure_erase: st.discards.fetch_add(1, std::memory_order_relaxed); break;
    case IoOp::write_zeroes: st.write_zeroes.fetch_add(1, std::memory_order_relaxed); break;
  }

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
}

// ---------------------------------------------------------------------------------------------
// Public face

RemoteDevice::RemoteDevice(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RemoteDevice::~RemoteDevice() = default;

const std::string& RemoteDevice::name() const { return impl_->name; }
AccessMode RemoteDevice::access_mode() const { return impl_->mode; }
DeviceGeometry RemoteDevice::geometry() const {
  std::lock_guard l(impl_->mu);
  return impl_->geo;
}
uint64_t RemoteDevice::size_bytes() const { return impl_->size.load(std::memory_order_relaxed); }
uint32_t RemoteDevice::device_id() const { return impl_->id.load(std::memory_order_acquire); }
uint32_t RemoteDevice::max_part_bytes() const { return impl_->max_rw.load(std::memory_order_relaxed); }

DeviceState RemoteDevice::state() const {
  const DeviceState st = impl_->state.load(std::memory_order_acquire);
  if (st == DeviceState::closed) return st;
  const Session* s = impl_->s;
  if (impl_->remapping.load() || (s != nullptr && !s->open.load())) return DeviceState::remapping;
  return DeviceState::open;
}

DeviceStats RemoteDevice::stats() const {
  const Stats& s = impl_->st;
  DeviceStats o;
  o.reads = s.reads.load(std::memory_order_relaxed);
  o.writes = s.writes.load(std::memory_order_relaxed);
  o.flushes = s.flushes.load(std::memory_order_relaxed);
  o.discards = s.discards.load(std::memory_order_relaxed);
  o.write_zeroes = s.write_zeroes.load(std::memory_order_relaxed);
  o.read_bytes = s.read_bytes.load(std::memory_order_relaxed);
  o.write_bytes = s.write_bytes.load(std::memory_order_relaxed);
  o.parts_sent = s.parts_sent.load(std::memory_order_relaxed);
  o.errors = s.errors.load(std::memory_order_relaxed);
  o.enodev_retries = s.enodev_retries.load(std::memory_order_relaxed);
  o.remaps = s.remaps.load(std::memory_order_relaxed);
  o.inflight = impl_->inflight_reqs.load(std::memory_order_relaxed);
  return o;
}

Status RemoteDevice::read(uint64_t offset, std::span<const ibtrs::IoSeg> segs, IoDone done,
                          uint16_t prio) {
  return impl_->submit(IoOp::read, offset, 0, segs, nullptr, 0, done, prio);
}
Status RemoteDevice::write(uint64_t offset, std::span<const ibtrs::IoSeg> segs, uint32_t flags,
                           IoDone done, uint16_t prio) {
  return impl_->submit(IoOp::write, offset, 0, segs, nullptr, flags, done, prio);
}
Status RemoteDevice::flush(IoDone done) {
  return impl_->submit(IoOp::flush, 0, 0, {}, nullptr, 0, done, 0);
}
Status RemoteDevice::discard(uint64_t offset, uint64_t len, IoDone done) {
  return impl_->submit(IoOp::discard, offset, len, {}, nullptr, 0, done, 0);
}
Status RemoteDevice::write_zeroes(uint64_t offset, uint64_t len, bool no_unmap, IoDone done) {
  return impl_->submit(IoOp::write_zeroes, offset, len, {}, nullptr, no_unmap ? uint32_t{kIoNoUnmap} : 0u,
                       done, 0);
}
Status RemoteDevice::secure_erase(uint64_t offset, uint64_t len, IoDone done) {
  return impl_->submit(IoOp::secure_erase, offset, len, {}, nullptr, 0, done, 0);
}
Status RemoteDevice::read_copy(uint64_t offset, std::span<std::byte> out, IoDone done,
                               uint16_t prio) {
  if (out.empty()) return errc(EINVAL);
  return impl_->submit(IoOp::read, offset, out.size(), {}, out.data(), 0, done, prio);
}
Status RemoteDevice::write_copy(uint64_t offset, std::span<const std::byte> data, uint32_t flags,
                                IoDone done, uint16_t prio) {
  if (data.empty()) return errc(EINVAL);
  // The bytes are only read (copied into a bounce slot); the part keeps one pointer type.
  return impl_->submit(IoOp::write, offset, data.size(), {}, const_cast<std::byte*>(data.data()),
                       flags, done, prio);
}

void RemoteDevice::begin_batch() {
  if (Session* s = impl_->s) s->ts->begin_batch();
}
void RemoteDevice::end_batch() {
  if (Session* s = impl_->s) s->ts->end_batch();
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
