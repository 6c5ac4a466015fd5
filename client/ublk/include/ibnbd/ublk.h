// libibnbd-ublk: a mapped RemoteDevice as a kernel block device /dev/ublkbN through the ublk
// driver (ublk_drv, Linux >= 6.0; the flags used here need 6.12's uAPI, ibnbd/ublk_uapi.h).
//
//   UblkControl  the control ring on /dev/ublk-control (one io_uring with 128-byte SQEs):
//                ADD_DEV, SET_PARAMS, START_DEV, STOP_DEV, DEL_DEV, GET_DEV_INFO, GET_FEATURES,
//                START/END_USER_RECOVERY.
//   UblkDevice   one served device: /dev/ublkcN opened, one queue per client IO thread, each
//                with its own thread and io_uring (the driver wants every command of a queue
//                from one task), FETCH_REQ on every tag, COMMIT_AND_FETCH_REQ with the result.
//
// The IO path, per request: the driver copies WRITE data into the tag's buffer (READ data out
// of it after the commit), so the buffer is the IoSeg of RemoteDevice::read / write: all tags of
// a queue share ONE region registered through RemoteDevice::alloc_buffer (with both sessions of
// a failover device), nothing is copied on our side. Each queue thread reaps its own transport connection (ibtrs::CompletionReaper, its
// fd polled in the queue's ring): a completion runs on the queue thread and queues its commit
// at once, one wake-up per batch of completions. Completions that run on the transport's
// threads anyway (after the connection went back to its IO thread, large requests spread over
// the connections, failover, UblkOptions::reap off) are pushed on a lock-free intrusive list
// (one node per tag, no allocation) and the queue thread is woken through an eventfd that its
// ring reads. Either way every completion of a wake-up is committed in one io_uring_enter.
//
// Operations: READ, WRITE (FUA -> kIoFua), FLUSH, DISCARD, WRITE_ZEROES (NOUNMAP -> no_unmap).
// WRITE_SAME and zone operations get EOPNOTSUPP. A request the kernel should never send (longer
// than the tag's buffer, past the end) gets EIO, never a crash.
//
// Recovery: devices are created with UBLK_F_USER_RECOVERY | UBLK_F_USER_RECOVERY_REISSUE. When
// the process dies the kernel keeps /dev/ublkbN, quiesces it and holds its requests (those that
// were with the dead daemon are re-issued later, not failed); UblkDevice::recover() in a new
// process takes it back (START_USER_RECOVERY, queues, END_USER_RECOVERY). Only a destroyed
// UblkDevice (or stop()) removes the kernel device: a crash leaves it for recovery.
//
// Size: the device's size at create() (its geometry then); a resize the server announces
// (DeviceEvent::resized) reaches /dev/ublkbN through update_size(), which needs
// UBLK_U_CMD_UPDATE_SIZE (Linux 6.16) in <linux/ublk_cmd.h> at build time and in the running
// kernel: without it the block device keeps its size until it is unmapped and mapped again.
//
// Threading: the factories, stop() and the destructor from any one thread at a time, never from
// a completion callback of the RemoteDevice; update_size() from any thread, not concurrently
// with stop(); accessors and stats() from any thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "ibnbd/client.h"
#include "ibnbd/ublk_uapi.h"

namespace ibnbd::ublk {

// The control device. Commands are serialized (one ring, one command at a time). Errors are the
// driver's (negated CQE res) unless said otherwise.
class UblkControl {
 public:
  // ENODEV when `path` does not exist (ublk_drv is not loaded), EACCES, ...; or io_uring's
  // errors (EINVAL: the kernel has no SQE128).
  static Result<std::unique_ptr<UblkControl>> open(const std::string& path = "/dev/ublk-control");
  ~UblkControl();
  UblkControl(const UblkControl&) = delete;
  UblkControl& operator=(const UblkControl&) = delete;

  Result<uint64_t> get_features();  // uapi::kF* bits this kernel supports
  // UBLK_U_CMD_UPDATE_SIZE: the device's capacity in 512-byte sectors. EOPNOTSUPP when this
  // build's <linux/ublk_cmd.h> has no such command (update_size_supported()).
  Status update_size(uint32_t dev_id, uint64_t sectors);
  // GET_PARAMS: what the kernel holds of the device (its size among them).
  Result<uapi::ublk_params> get_params(uint32_t dev_id);
  // `want.dev_id` ~0u lets the kernel choose. Answers what the kernel made of it (dev_id, queues
  // clamped to the CPUs, max_io_buf_bytes page-rounded, flags).
  Result<uapi::ublksrv_ctrl_dev_info> add_dev(const uapi::ublksrv_ctrl_dev_info& want);
  Result<uapi::ublksrv_ctrl_dev_info> get_dev_info(uint32_t dev_id);  // ENODEV: no such device
  Status set_params(uint32_t dev_id, const uapi::ublk_params& p);
  // Returns once every queue has fetched all its tags (the gendisk is added then).
  Status start_dev(uint32_t dev_id, pid_t daemon);
  // Removes the gendisk (waits for IO in flight: the queues must still serve).
  Status stop_dev(uint32_t dev_id);
  // Frees the device; waits until /dev/ublkcN is closed by everyone.
  Status del_dev(uint32_t dev_id);
  // EBUSY until the dead daemon's /dev/ublkcN is released and the device is QUIESCED.
  Status start_user_recovery(uint32_t dev_id);
  // Returns once every queue has fetched all its tags again; then the device is LIVE.
  Status end_user_recovery(uint32_t dev_id, pid_t daemon);

  struct Impl;

 private:
  explicit UblkControl(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct UblkOptions {
  // Queues (one thread + one io_uring each): one per IO thread of the client session. The
  // kernel clamps this to the number of CPUs.
  uint16_t nr_queues = 1;
  uint16_t queue_depth = 128;  // tags per queue, 1..4096
  // Largest request (and each tag's buffer): memory per queue = depth x this.
  uint32_t max_io_bytes = 512u << 10;
  std::string control_path = "/dev/ublk-control";
  std::string dev_dir = "/dev";  // where /dev/ublkcN and /dev/ublkbN appear (devtmpfs)
  // How long recover() waits for the kernel to notice the dead daemon (state LIVE -> QUIESCED,
  // START_USER_RECOVERY's EBUSY), and create()/recover() for /dev/ublkcN to appear.
  std::chrono::milliseconds wait_timeout{20000};
  // Each queue thread reaps its own transport connection (see the top of this file). Off: every
  // completion comes from the transport's IO threads through the inbox and an eventfd (three
  // wake-ups per request instead of one; for comparison, or if reaping misbehaves). A queue
  // whose reaper cannot be made (ClientSession::make_reaper's EBUSY: another queue of this
  // process reaps the same connection index of that session) runs that way too.
  bool reap = true;
  // Diagnostics (queue thread trouble, refused requests), any thread. May be empty.
  std::function<void(const std::string&)> log;
};

struct UblkStats {
  uint64_t requests = 0;  // served, all queues
  uint64_t errors = 0;    // committed with an error
  uint64_t wakeups = 0;   // eventfd wakeups of the queue threads (completions via the inbox)
  uint64_t reaps = 0;     // reap() calls of the queue threads (after a poll wake-up or the inbox)
  uint64_t reaped = 0;    // completions committed on the queue thread itself (no inbox)
};

// Whether this build can resize a ublk device (UBLK_U_CMD_UPDATE_SIZE in <linux/ublk_cmd.h> when
// it was compiled; the running kernel may still lack it).
bool update_size_supported();

class UblkDevice {
 public:
  // Adds /dev/ublkbN for `dev` (the geometry, access mode and cache policy of its last OPEN) and
  // serves it. IO buffers are registered through `dev` (RemoteDevice::alloc_buffer); the queues
  // reap `session`'s connections (a failover device's active one at the time). The device's
  // sessions must outlive the result.
  // Errors: those of UblkControl (ENODEV: ublk_drv not loaded), EOPNOTSUPP (the kernel lacks
  // USER_RECOVERY_REISSUE), EINVAL (options, or a geometry ublk cannot express), ETIMEDOUT
  // (/dev/ublkcN did not appear), alloc_buffer's. Nothing is left behind on failure.
  static Result<std::unique_ptr<UblkDevice>> create(std::shared_ptr<RemoteDevice> dev,
                                                    BlockSession& session, const UblkOptions& o);
  // Takes back device `dev_id` that a dead process served (queues, depth and buffer size are
  // the kernel's record of it; SET_PARAMS is not sent). Waits (o.wait_timeout) while the kernel
  // still sees it LIVE. Errors: ENOENT (no such ublk device), EINVAL (it was created without
  // USER_RECOVERY, or is DEAD: stopped, not recoverable), ETIMEDOUT (still LIVE, or EBUSY,
  // after o.wait_timeout), and create()'s. The caller vouches that `dev` is the volume the
  // device served (the daemon's state record says so). On failure the kernel device is left
  // quiesced, for another try.
  static Result<std::unique_ptr<UblkDevice>> recover(uint32_t dev_id, std::shared_ptr<RemoteDevice> dev,
                                                     BlockSession& session, const UblkOptions& o);
  // stop() unless done.
  ~UblkDevice();
  UblkDevice(const UblkDevice&) = delete;
  UblkDevice& operator=(const UblkDevice&) = delete;

  // STOP_DEV (the block device goes away once its IO is done), then the queue threads end, the
  // character device is closed and DEL_DEV frees the device. The first error is returned; the
  // device is not served afterwards either way. Idempotent.
  Status stop();

  uint32_t dev_id() const;
  std::string block_path() const;  // /dev/ublkbN
  std::string char_path() const;   // /dev/ublkcN
  uint16_t nr_queues() const;
  uint16_t queue_depth() const;
  bool recovered() const;  // made by recover()
  UblkStats stats() const;
  // The size /dev/ublkbN has (bytes): the device's at create(), the kernel's at recover() (0
  // when it could not be read), then what update_size() set.
  uint64_t size() const;
  // Gives /dev/ublkbN a new size (bytes, a multiple of its logical block size): the server said
  // the volume grew or shrank. EOPNOTSUPP without UBLK_U_CMD_UPDATE_SIZE in this build or the
  // kernel; EINVAL for a size that is not whole blocks; the driver's errno.
  Status update_size(uint64_t bytes);

  struct Impl;

 private:
  explicit UblkDevice(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ibnbd::ublk
