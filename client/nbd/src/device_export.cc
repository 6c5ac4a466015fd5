#include "ibnbd/nbd_device_export.h"

#include <algorithm>

namespace ibnbd::nbd {

namespace {
IoDone io_done(Done d) { return IoDone{d.fn, d.ctx}; }
}  // namespace

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
  return dev_->read_copy(offset, out, io_done(done));
}

Status DeviceExport::write(uint64_t offset, std::span<const std::byte> data, bool fua, Done done) {
  return dev_->write_copy(offset, data, fua ? uint32_t{kIoFua} : 0u, io_done(done));
}

Status DeviceExport::flush(Done done) { return dev_->flush(io_done(done)); }

Status DeviceExport::trim(uint64_t offset, uint64_t len, Done done) {
  return dev_->discard(offset, len, io_done(done));
}

Status DeviceExport::write_zeroes(uint64_t offset, uint64_t len, bool no_hole, Done done) {
  return dev_->write_zeroes(offset, len, no_hole, io_done(done));
}

}  // namespace ibnbd::nbd
