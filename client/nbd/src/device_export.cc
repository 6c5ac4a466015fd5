#include "ibnbd/nbd_device_export.h"

#include <algorithm>
#include <chrono>

#include "base/log.h"

namespace ibnbd::nbd {

namespace {
IoDone io_done(Done d) { return IoDone{d.fn, d.ctx}; }
}  // namespace

Result<std::shared_ptr<DeviceExport>> DeviceExport::create(std::shared_ptr<RemoteDevice> dev,
                                                           BlockSession& session,
                                                           DeviceExportOptions o) {
  if (!dev) return ibtrs::errc(EINVAL);
  auto e = std::make_shared<DeviceExport>(std::move(dev));
  e->session_ = &session;
  e->reap_ = o.reap;
  if (o.request_memory > 0) {
    // Through the device: a failover device's memory is registered with both its sessions.
    auto m = e->dev_->alloc_buffer(o.request_memory);
    if (!m.ok()) return m.error();
    e->mem_ = std::move(*m);
  }
  return e;
}

// The reaper and the registration go before the session (create's contract); the server has
// detached (no reap() runs) and no request of ours is in flight once it stopped.
DeviceExport::~DeviceExport() = default;

bool DeviceExport::registered(const std::byte* p, size_t len) const {
  if (!mem_) return false;
  const std::byte* base = mem_->data();
  return p >= base && len <= mem_->size() && static_cast<size_t>(p - base) <= mem_->size() - len;
}

std::span<std::byte> DeviceExport::request_memory() {
  if (!mem_) return {};
  return {mem_->data(), mem_->size()};
}

int DeviceExport::attach_loop() {
  if (!reap_ || session_ == nullptr) return -1;
  auto r = session_->transport().make_reaper();
  if (!r.ok()) {
    // EBUSY: another thread of this process reaps this loop's connection index; the hand-off
    // carries the completions then.
    BASE_LOG(info, "nbd export of %s: completions from the transport's threads (reaper: %s)",
              dev_->name().c_str(), r.error().message().c_str());
    return -1;
  }
  auto fd = (*r)->fd();
  if (!fd.ok()) {
    BASE_LOG(warn, "nbd export of %s: reaper fd: %s", dev_->name().c_str(), fd.error().message().c_str());
    return -1;
  }
  reaper_ = std::move(*r);
  // Borrows the connections now, so that the first completions already come here.
  (void)reaper_->reap(std::chrono::microseconds(0));
  return *fd;
}

void DeviceExport::poll_loop() {
  // ESHUTDOWN (the session is closing): its requests fail on the session's threads.
  if (reaper_) (void)reaper_->reap(std::chrono::microseconds(0));
}

void DeviceExport::detach_loop() { reaper_.reset(); }

ExportInfo DeviceExport::info() const {
  const DeviceGeometry g = dev_->geometry();
  const uint32_t lbs = std::max<uint32_t>(g.logical_block_size, 1);
  ExportInfo i;
  i.size = dev_->size_bytes() / lbs * lbs;
  i.min_block = lbs;
  i.preferred_block = std::max<uint32_t>({g.physical_block_size, 4096u, lbs});
  i.max_payload = std::max<uint32_t>((32u << 20) / lbs * lbs, lbs);
  i.read_only = dev_->access_mode() == AccessMode::ro;
  i.can_trim = g.max_discard_sectors > 0;
  i.can_write_zeroes = g.max_write_zeroes_sectors > 0;
  // The client cannot tell whether the server zeroes by deallocating (a file: fast) or by
  // writing zeroes (a block device without WRITE_ZEROES: blkdev_issue_zeroout falls back), so
  // FAST_ZERO requests are refused with ENOTSUP and the NBD client zeroes the slow way.
  i.fast_zero = false;
  // CAN_MULTI_CONN: every connection of every client goes through this one RemoteDevice, this
  // side keeps no cache, and a FLUSH is the server's fdatasync of the whole file (blkdev flush
  // for a block device), so a FLUSH on one connection makes the writes of all connections
  // stable, and a completed write is visible to reads on any connection -- what the spec asks
  // of NBD_FLAG_CAN_MULTI_CONN.
  i.multi_conn = true;
  i.description = "ibnbd " + dev_->name();
  return i;
}

Status DeviceExport::read(uint64_t offset, std::span<std::byte> out, Done done) {
  if (registered(out.data(), out.size())) {
    const ibtrs::IoSeg seg{out.data(), static_cast<uint32_t>(out.size()), mem_.get()};
    return dev_->read(offset, std::span(&seg, 1), io_done(done));
  }
  return dev_->read_copy(offset, out, io_done(done));
}

Status DeviceExport::write(uint64_t offset, std::span<const std::byte> data, bool fua, Done done) {
  const uint32_t flags = fua ? uint32_t{kIoFua} : 0u;
  if (registered(data.data(), data.size())) {
    // The transport only reads the segment; IoSeg names it without const.
    const ibtrs::IoSeg seg{const_cast<std::byte*>(data.data()), static_cast<uint32_t>(data.size()), mem_.get()};
    return dev_->write(offset, std::span(&seg, 1), flags, io_done(done));
  }
  return dev_->write_copy(offset, data, flags, io_done(done));
}

Status DeviceExport::flush(Done done) { return dev_->flush(io_done(done)); }

Status DeviceExport::trim(uint64_t offset, uint64_t len, Done done) {
  return dev_->discard(offset, len, io_done(done));
}

Status DeviceExport::write_zeroes(uint64_t offset, uint64_t len, bool no_hole, Done done) {
  return dev_->write_zeroes(offset, len, no_hole, io_done(done));
}

Status DeviceExport::block_status(uint64_t offset, uint64_t len, ExtentList& out, Done done) {
  return dev_->block_status(offset, len, out, io_done(done));
}

}  // namespace ibnbd::nbd
