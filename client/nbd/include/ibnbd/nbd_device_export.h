// DeviceExport: a RemoteDevice of the IBNBD client library as an NBD export.
//
// Data path. Made with create() and the device's session, the export lends the NBD server
// request memory registered for the device (RemoteDevice::alloc_buffer: with its session, or
// both sessions of a failover device) (Export::request_memory): WRITE payloads are
// received into it and sent from it by the transport, READ data is written into it by the
// server's RDMA (or the tcp provider's placement) and sent to the NBD client from it, so no
// byte is copied on this side. Data the server did not take from it (an export made with the
// plain constructor, or without request memory) goes through the device's bounce buffers
// (read_copy / write_copy), which then must exist (BlockSessionOptions::bounce_slots > 0).
//
// Completions. With reaping on, the NBD loop thread polls the transport connections its own
// requests go to (ibtrs::CompletionReaper::fd in the loop's epoll set): a 4 KiB round trip
// wakes that one thread, with no hand-off from a transport IO thread. Completions that run
// elsewhere (parts of large requests spread over the connections, failed-over requests, a
// connection the IO thread took back after 10 ms without a poll, a loop thread that shares its
// connection index with another reaper: EBUSY at attach, logged once) come back through the
// server's hand-off as before.
//
// FUA writes are FUA on the wire (kIoFua); a FLUSH is the device's flush, which the server
// turns into an fdatasync of the file (or a flush of the block device).
#pragma once

#include <memory>

#include "ibnbd/client.h"
#include "ibnbd/nbd_server.h"

namespace ibnbd::nbd {

struct DeviceExportOptions {
  // Bytes of registered request memory; the NBD server needs the largest payload (32 MiB) in
  // it, or larger requests fall back to the copy path. 0: none (the copy path for all).
  size_t request_memory = 32u << 20;
  // The NBD loop reaps its own completions (see the top of this file).
  bool reap = true;
};

class DeviceExport final : public Export {
 public:
  // The copy path only, completions from the transport's threads (the device must have bounce
  // buffers).
  explicit DeviceExport(std::shared_ptr<RemoteDevice> dev) : dev_(std::move(dev)) {}
  // With the device's session (a failover device's active one: its reaper; completions of the
  // other come through the hand-off): request memory (RemoteDevice::alloc_buffer; its errors)
  // and reaping per `o`. The session must outlive the export: stop the NbdServer that serves it
  // (the last owner besides the caller) before the session goes. From a thread that may call
  // the session's control functions.
  static Result<std::shared_ptr<DeviceExport>> create(std::shared_ptr<RemoteDevice> dev,
                                                      BlockSession& session,
                                                      DeviceExportOptions o = {});
  ~DeviceExport() override;

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
  // RemoteDevice::block_status: the server's holes (all data from a server before protocol 5).
  Status block_status(uint64_t offset, uint64_t len, ExtentList& out, Done done) override;
  void begin_batch() override { dev_->begin_batch(); }
  void end_batch() override { dev_->end_batch(); }
  std::span<std::byte> request_memory() override;
  int attach_loop() override;
  void poll_loop() override;
  void detach_loop() override;

  const std::shared_ptr<RemoteDevice>& device() const { return dev_; }

 private:
  // [p, p + len) lies in the request memory (else: the copy path).
  bool registered(const std::byte* p, size_t len) const;

  std::shared_ptr<RemoteDevice> dev_;
  BlockSession* session_ = nullptr;
  bool reap_ = false;
  std::unique_ptr<ibtrs::RegisteredMemory> mem_;
  std::unique_ptr<ibtrs::CompletionReaper> reaper_;  // the loop's, between attach and detach
};

}  // namespace ibnbd::nbd
