// DeviceExport: a RemoteDevice of the IBNBD client library as an NBD export.
//
// Data goes through the device's bounce buffers (read_copy / write_copy): the NBD server's
// buffers are its own, not memory registered with the session. FUA writes are FUA on the wire
// (kIoFua); a FLUSH is the device's flush, which the server turns into an fdatasync of the
// file (or a flush of the block device).
#pragma once

#include <memory>

#include "ibnbd/client.h"
#include "ibnbd/nbd_server.h"

namespace ibnbd::nbd {

class DeviceExport final : public Export {
 public:
  // The device must have bounce buffers (BlockSessionOptions::bounce_slots > 0).
  explicit DeviceExport(std::shared_ptr<RemoteDevice> dev) : dev_(std::move(dev)) {}

  // From the device's current geometry: size, logical block size as the minimum block,
  // max(physical block, 4 KiB) as the preferred one, 32 MiB as the largest payload (the library
  // splits it); read-only for an ro mapping; trim and write-zeroes when the server supports
  // them. Multi-conn: yes (see the .cc).
  ExportInfo info() const override;
  Status read(uint64_t offset, std::span<std::byte> out, Done done) override;
  Status write(uint64_t offset, std::span<const std::byte> data, bool fua, Done done) override;
  Status flush(Done done) override;
  Status trim(uint64_t offset, uint64_t len, Done done) override;
  Status write_zeroes(uint64_t offset, uint64_t len, bool no_hole, Done done) override;
  void begin_batch() override { dev_->begin_batch(); }
  void end_batch() override { dev_->end_batch(); }

  const std::shared_ptr<RemoteDevice>& device() const { return dev_; }

 private:
  std::shared_ptr<RemoteDevice> dev_;
};

}  // namespace ibnbd::nbd
