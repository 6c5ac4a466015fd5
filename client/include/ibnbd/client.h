// libibnbd-client: block devices of an IBNBD server over one IBTRS session (the kernel's
// rnbd-clt without the gendisk). A BlockSession negotiates the block protocol (SESS_INFO) on an
// ibtrs::ClientSession; map() opens a remote device by name and access mode and returns a
// RemoteDevice with its geometry and asynchronous read / write / flush / discard / write-zeroes
// / secure-erase. The wire is docs/protocol.md, "IBNBD block protocol"; client/README.md
// describes this library for humans.
//
// Requests
//   - Offsets and lengths are bytes; both must be multiples of the device's logical block size,
//     and the range must lie inside the device. A request that breaks a rule, or that the
//     access mode or the geometry does not allow, is refused before anything is sent: the call
//     returns the errno and the callback never runs.
//   - A request larger than what one transport request carries (min(max_io_size of the session,
//     max_hw_sectors of the device) for READ/WRITE, max_discard_sectors for DISCARD and
//     SECURE_ERASE, max_write_zeroes_sectors for WRITE_ZEROES) is split into parts sent
//     concurrently. The callback runs once, after every part has completed, with 0 or the first
//     part's error. A failed split WRITE may have changed any of its blocks (as a failed write of
//     a disk may).
//   - Zero copy: read() and write() take data segments inside memory registered through this
//     session (alloc_buffer / register_memory). read_copy() and write_copy() take any memory and
//     copy through a per-device pool of registered bounce buffers (BlockSessionOptions::
//     bounce_slots); for callers whose buffers are not theirs to register (an NBD socket
//     buffer). The caller's memory must stay valid until the callback in both cases.
//   - Submitting never blocks: parts that find no free transport permit (queue_depth of the
//     session) or no bounce buffer wait in the library and go out as others complete.
//
// Reconnect and remap (kernel: rnbd_clt_remap / RTRS_CLT_LINK_EV_RECONNECTED)
//   When the last path of the session goes down, IO submitted from then on waits in the
//   library. When a path is back, the session sends SESS_INFO again, waits until every request
//   sent with the old device ids has come back, then re-OPENs every mapped device (its id may
//   change; geometry is taken anew) and sends the waiting IO with the new ids. A request the
//   server answers with ENODEV while a remap is pending or after one (the server restarted and
//   no longer knows the id) waits for the remap and is sent once more, once. IO waits for a
//   remap at most BlockSessionOptions::remap_timeout, then fails with ETIMEDOUT (a path is up
//   but the remap did not finish) or ENOTCONN (no path came back). A device whose re-OPEN the
//   server refuses turns `closed`: its waiting IO fails with that errno.
//
// Guarantee: every request whose submit call returned 0 completes exactly once. A WRITE (or
// any other op) that completes with 0 was carried out by the server (and a FUA write is stable
// there); otherwise the callback says an errno. Nothing is dropped silently: a request that the
// transport re-sends after a path or server failure is either answered by the server or failed
// with ENOTCONN / ETIMEDOUT / ECONNABORTED. Old device ids never reach another device: no
// device is re-opened while a request carrying an old id is still in flight.
//
// An ENODEV that arrives while the session stayed up and no remap was under way (the admin
// force-closed the device on the server) is returned to the caller, not retried: re-opening on
// our own would undo the admin's force_close. remap() re-opens on request.
//
// Size notices (protocol 4; NVMe's Asynchronous Event Request, librbd's update watch)
//   A session that speaks 4 keeps one WATCH outstanding (it holds one transport permit, so IO
//   has queue_depth - 1): posted when the session opens and again after every remap, answered
//   by the server when a device the session holds changes size (an RBD image resized, a file or
//   block device grown or shrunk). The answer sets each device's size (size_bytes(),
//   geometry().nsectors: what requests are checked against from then on) and emits
//   DeviceEvent::resized; the WATCH is then posted again. An error answer is retried with a
//   back-off, after the next remap when the session is down. A lost answer costs nothing: the
//   WATCH carries the last epoch seen, and a server whose epoch differs answers it at once.
//   Requests in flight when a device shrinks keep their range: the server fails those past the
//   new end with EIO. A session of version 2 or 3 learns a size only from OPEN (remap()).
//
// Threading
//   - RemoteDevice IO functions, stats and accessors: any thread, concurrently; never block.
//     They may be called from a completion callback.
//   - Completion callbacks run on the transport's threads (its IO threads; its control thread
//     when it fails a request that waited for a path), on the session's own control thread
//     (requests failed in the library: timeouts, a part that failed while the request was being
//     submitted or while a control function ran), or on the thread destroying the session.
//     Never inside the submitting call. They must not block and must not call the control
//     functions below.
//   - Control functions (BlockSession::map, unmap, remap, alloc_buffer, register_memory) may be
//     called from any thread except a callback (completion, session event or device event);
//     they are serialized with each other and with the automatic remap, and return when done.
//   - Accessors of BlockSession (devices, find, state, version, transport): any thread.
//   - The BlockSession must outlive every registration made through it, and must not be
//     destroyed while another thread calls into it or its devices. Devices the caller still
//     holds afterwards refuse everything with ESHUTDOWN.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "ibnbd/types.h"
#include "ibtrs/client.h"

namespace ibnbd {

// Completion of a block request: err is 0 or a positive errno.
using IoDoneFn = void (*)(void* ctx, int err);
struct IoDone {
  IoDoneFn fn = nullptr;
  void* ctx = nullptr;
};

// Kernel rnbd-clt device states, minus the ones of the gendisk (init, unmapped).
enum class DeviceState : uint8_t {
  open,       // IO goes out
  remapping,  // the session or this device is being re-opened: IO waits
  closed,     // unmapped, or the server refused the re-open: IO is refused (ENODEV)
};
std::string_view to_string(DeviceState s);

enum class SessionState : uint8_t {
  connected,     // a path is up and every device is remapped
  disconnected,  // no path is up: IO waits
  remapping,     // a path is back; SESS_INFO and re-OPENs are under way: IO waits
};
std::string_view to_string(SessionState s);

enum class UnmapMode : uint8_t {
  normal,  // EBUSY while a request of the device is outstanding
  force,   // refuse new IO at once; fail the IO still waiting in the library (ECANCELED); wait
           // (at most control_timeout) for the IO the server has; then CLOSE
};

// What happened to a mapped device, for the daemon's log and sysfs (the kernel prints these).
struct DeviceEvent {
  enum class Kind : uint8_t {
    remapped,      // re-opened after a reconnect or remap(): old_id -> new_id
    remap_failed,  // the server refused the re-open (error); the device is closed
    resized,       // the server's notice of a new size: old_size -> new_size (bytes)
  };
  Kind kind = Kind::remapped;
  std::string dev_name;
  uint32_t old_id = 0;
  uint32_t new_id = 0;
  std::error_code error;
  uint64_t old_size = 0;  // resized only
  uint64_t new_size = 0;
};

struct DeviceStats {
  uint64_t reads = 0;          // user requests, by op
  uint64_t writes = 0;
  uint64_t flushes = 0;
  uint64_t discards = 0;       // DISCARD and SECURE_ERASE
  uint64_t write_zeroes = 0;
  uint64_t block_status = 0;   // BLOCK_STATUS questions (no data read)
  uint64_t read_bytes = 0;
  uint64_t write_bytes = 0;
  uint64_t parts_sent = 0;     // transport requests (a split request counts each part)
  uint64_t errors = 0;         // user requests completed with an error
  uint64_t enodev_retries = 0; // parts re-sent after an ENODEV and a remap
  uint64_t remaps = 0;         // successful re-opens
  uint64_t resizes = 0;        // new sizes from the server's notices (WATCH)
  uint32_t inflight = 0;       // user requests submitted and not yet completed
};

// A session's size notices (see "Size notices" above).
struct SizeWatchInfo {
  bool supported = false;  // the session speaks version 4
  bool armed = false;      // its WATCH is outstanding
  uint64_t epoch = 0;      // the server's size epoch it saw last (0: none yet)
  uint64_t answers = 0;    // WATCH answers, errors included
  uint64_t resizes = 0;    // device sizes changed by them
  std::error_code last_error;  // of the last answer that failed (cleared by a good one)
};

struct BlockSessionOptions {
  // The IBTRS session: name, paths, policy, io_threads, heartbeat, reconnect, connect and
  // pending timeouts, busy_poll, on_event. All pass through; on_event sees every transport
  // event (on the transport's control thread) after the block layer has taken note of it.
  ibtrs::ClientOptions transport;
  // How long IO waits in the library for a reconnect and remap (then ETIMEDOUT or ENOTCONN).
  std::chrono::milliseconds remap_timeout{30000};
  // How long SESS_INFO, OPEN and CLOSE wait for the server's answer (then ETIMEDOUT).
  std::chrono::milliseconds control_timeout{30000};
  // Registered bounce buffers per device for read_copy / write_copy, each the size of one
  // transport request of the device. 0: those calls fail with EOPNOTSUPP.
  uint32_t bounce_slots = 8;
  // Device events; run on the thread that remapped (the session's control thread after a
  // reconnect, the caller of remap() or of the map() that re-opened a closed device), resizes on
  // the session's control thread. Must not block or call control functions.
  std::function<void(const DeviceEvent&)> on_device_event;
};

class BlockSession;
struct FailoverInfo;
namespace client {
struct Failover;
}

// A mapped remote device. Obtained from BlockSession::map(); shared with the session, which
// keeps it until unmap. Or a failover device from map_failover() (below): the same calls,
// served by one of two sessions.
class RemoteDevice {
 public:
  ~RemoteDevice();
  RemoteDevice(const RemoteDevice&) = delete;
  RemoteDevice& operator=(const RemoteDevice&) = delete;

  const std::string& name() const;
  AccessMode access_mode() const;
  // From the last OPEN_RSP (a remap may change it).
  DeviceGeometry geometry() const;
  uint64_t size_bytes() const;
  uint32_t device_id() const;  // the server's id in this session (a remap may change it)
  DeviceState state() const;
  DeviceStats stats() const;
  // Largest READ/WRITE sent as one transport request; larger ones are split.
  uint32_t max_part_bytes() const;

  // Errors returned (nothing sent, callback not run): EINVAL (no callback; offset or length
  // not a multiple of the logical block size, length 0, past the end of the device; a segment
  // outside its registration or without one; more than 15 segments smaller than a block in a
  // row, which no transport request can carry), EPERM (the access mode forbids
  // the op, as the server would say), EOPNOTSUPP (the device does not support the op), ENODEV
  // (the device is closed), ESHUTDOWN (the session is closing or gone).

  // Reads `segs` (in order) from `offset`. Length: the sum of the segments.
  Status read(uint64_t offset, std::span<const ibtrs::IoSeg> segs, IoDone done, uint16_t prio = 0);
  // Writes; flags: kIoFua (each part is stable when it completes), kIoPreflush (sent on the
  // first part: what completed before is stable first), kIoSync; anything else is EINVAL.
  Status write(uint64_t offset, std::span<const ibtrs::IoSeg> segs, uint32_t flags, IoDone done,
               uint16_t prio = 0);
  Status flush(IoDone done);
  Status discard(uint64_t offset, uint64_t len, IoDone done);
  // no_unmap: the range must stay allocated (NOUNMAP).
  Status write_zeroes(uint64_t offset, uint64_t len, bool no_unmap, IoDone done);
  Status secure_erase(uint64_t offset, uint64_t len, IoDone done);
  // Where the data of [offset, offset + len) lies (protocol 5; NBD's base:allocation, NVMe's
  // Get LBA Status): `out` receives 1..kMaxExtents extents, in order from `offset` without
  // gaps, covering a prefix of the range (of at most 4 GiB - 64 KiB): ask again from where they
  // end. Flags kExtentHole | kExtentZero for a hole of a sparse file or image, 0 for data (a
  // block device is all data). A session below version 5 (or one a remap took to an older
  // server) is answered by the library: one extent of the whole (cut) range, data. The answer
  // travels in a bounce buffer: EOPNOTSUPP without them. A server's answer that breaks the
  // protocol's rules fails the request with EPROTO. `out` must stay valid until the callback;
  // it is only written before it runs. Allowed in every access mode (as READ).
  Status block_status(uint64_t offset, uint64_t len, ExtentList& out, IoDone done);
  // Copying variants for unregistered memory (see the top of this file). EOPNOTSUPP without
  // bounce buffers.
  Status read_copy(uint64_t offset, std::span<std::byte> out, IoDone done, uint16_t prio = 0);
  Status write_copy(uint64_t offset, std::span<const std::byte> data, uint32_t flags, IoDone done,
                    uint16_t prio = 0);

  // The submission batch of this device's session (BlockSession::begin_batch, same rules), for
  // callers that hold only the device. A failover device batches on its active session.
  void begin_batch();
  void end_batch();

  // Memory for read() / write() of this device: registered with its session (as
  // BlockSession::alloc_buffer / register_memory), or, for a failover device, with both of its
  // sessions (ibtrs::ClientSession::share_memory), so that its requests can move to the other.
  // Frontends that serve either kind take their buffers from here. The device's sessions must
  // outlive the memory. Errors: the sessions' (ESHUTDOWN once the session is gone).
  Result<std::unique_ptr<ibtrs::RegisteredMemory>> alloc_buffer(size_t size);
  Result<std::unique_ptr<ibtrs::RegisteredMemory>> register_memory(void* addr, size_t size);

  // The failover state of a failover device; nullopt for a device of one session.
  std::optional<FailoverInfo> failover() const;

  struct Impl;
  Impl* impl() const { return impl_.get(); }  // null for a failover device
  client::Failover* failover_impl() const { return fo_.get(); }

 private:
  friend class BlockSession;
  friend struct client::Failover;
  explicit RemoteDevice(std::unique_ptr<Impl> impl);
  explicit RemoteDevice(std::unique_ptr<client::Failover> fo);
  std::unique_ptr<Impl> impl_;
  std::unique_ptr<client::Failover> fo_;
};

class BlockSession {
 public:
  // Opens the IBTRS session and negotiates the block protocol version. Errors: those of
  // ibtrs::ClientSession::open (EINVAL, ECONNREFUSED, ...), EPROTO / EPROTONOSUPPORT (version),
  // ETIMEDOUT (no SESS_INFO answer within control_timeout), the server's errno.
  static Result<std::unique_ptr<BlockSession>> open(BlockSessionOptions options);
  // Fails the IO still waiting in the library (ESHUTDOWN), closes the transport session (what
  // the server holds is released with it; no CLOSE is sent). Not from a callback.
  ~BlockSession();
  BlockSession(const BlockSession&) = delete;
  BlockSession& operator=(const BlockSession&) = delete;

  // OPENs `dev_name` (1..254 bytes, no control characters; the server resolves it) in `mode`.
  // The same name mapped again in the same mode returns the existing device (re-opened first
  // if a failed remap left it closed, as remap() does); in another mode, EBUSY (unmap first: a
  // mode change is CLOSE then OPEN, as on the server). Another name the server resolves to a
  // device already mapped (a symlink, "./x", the absolute path) is EEXIST, and the mapping
  // stays as it was: one device, one mapping. Errors: EINVAL,
  // the server's errno (ENOENT, EBUSY from the access rules, ...), EMSGSIZE (a logical block
  // larger than one transport request), ENOTCONN / ETIMEDOUT (no answer), ESHUTDOWN.
  Result<std::shared_ptr<RemoteDevice>> map(std::string_view dev_name, AccessMode mode);
  // CLOSEs and forgets the device; it turns `closed` for whoever still holds it. ENOENT (not
  // mapped), EBUSY (normal mode with requests outstanding). The device is unmapped locally
  // even when the CLOSE fails (its errno is returned; the server releases the device when the
  // session ends), and no CLOSE is sent while the session is down (the server's session is
  // gone with the paths).
  Status unmap(std::string_view dev_name, UnmapMode mode = UnmapMode::normal);
  // Re-OPENs one device now (kernel: remap_device): after the server force-closed it, or to
  // bring back a device that a failed remap left closed. Waits for the device's IO in flight
  // first and holds new IO meanwhile; CLOSEs the old id when the server gave a new one in the
  // same session. ENOENT (not mapped), ENOTCONN (the session is down: it remaps by itself when
  // a path returns), the server's errno (the device is then closed).
  Status remap(std::string_view dev_name);

  std::vector<std::shared_ptr<RemoteDevice>> devices() const;  // mapped, by name
  std::shared_ptr<RemoteDevice> find(std::string_view dev_name) const;

  // Registered memory for read() / write() (ibtrs::ClientSession passthroughs).
  Result<std::unique_ptr<ibtrs::RegisteredMemory>> alloc_buffer(size_t size);
  Result<std::unique_ptr<ibtrs::RegisteredMemory>> register_memory(void* addr, size_t size);

  // A submission batch of the calling thread (ibtrs::ClientSession::begin_batch has the
  // rules): the parts of the requests this thread submits to the devices of this session until
  // end_batch() may go to the wire together then (one system call per connection on tcp).
  // Never from a completion callback; nothing in between may block or wait for a completion.
  void begin_batch();
  void end_batch();

  SessionState state() const;
  uint8_t proto_version() const;  // negotiated by SESS_INFO
  SizeWatchInfo size_watch() const;
  const std::string& name() const;
  // The transport session, for statistics and path control (add_path, disconnect_path, ...;
  // its threading rules apply).
  ibtrs::ClientSession& transport();
  const ibtrs::ClientSession& transport() const;

  struct Impl;
  Impl* impl() const { return impl_.get(); }

 private:
  explicit BlockSession(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ---- Gateway failover (docs/architecture.md, "Gateway failover") -----------------------------
//
// Two servers that export one store (gateways of one Ceph RBD image) and a device mapped
// through both: a session to each, the device opened on both in the same mode. IO goes to the
// active one; the standby is open and idle (its OPEN carries no REOPEN, so its server takes
// nothing over). dm-multipath's failover policy with two priority groups, or an ANA group with
// one optimized and one non-optimized path, in the block protocol's words.
//
// Failover. When the active session loses its last path (SessionEvent::disconnected: a path
// broke, or its heartbeats stopped for heartbeat.interval x missed_max), or a request on it
// fails with a transport error (ENOTCONN, ECONNABORTED, ECONNRESET, ETIMEDOUT, ESHUTDOWN) or
// because the active device was closed (its re-open refused), the failover device
//   1. holds new IO (it waits here, in order);
//   2. takes back its requests that wait on the active side without being on any wire (in the
//      library, or in the transport for a path: ibtrs::ClientSession::fail_waiting); requests
//      still on a live connection are left to complete, and come back here if they fail so;
//   3. re-opens the device on the standby with REOPEN: the standby's server takes it over
//      (for an RBD image, breaks the exclusive lock, fencing the dead gateway);
//   4. makes the standby active and sends the requests taken back, then the held ones, in the
//      order they came. The old active becomes the standby: when its session comes back, the
//      device is re-opened there without REOPEN. There is no automatic failback.
// A WRITE sent twice (once to the dead server, once to the new one) is allowed at block level;
// the dead server is fenced before the first resubmitted request reaches the new one. IO waits
// at most `remap_timeout` for a usable server, then fails with ENOTCONN (no session has a path)
// or ETIMEDOUT. A missing standby (its OPEN refused at map time, or its device closed since)
// makes this a device of one session until remap_failover() brings it back.
//
// Flush. A device whose cache is volatile (DeviceGeometry::cache_policy has kCacheWriteBack:
// librbd's cache in write-back mode) may lose, with its server, writes that completed there
// since the last completed flush. A flush promises them stable: the first FLUSH (or PREFLUSH
// write) that completes after a failover that may have lost such writes fails with EIO, once,
// as a disk that lost its cache would (a filesystem sees it and does not trust its journal).
// FUA writes are stable when they complete, and are not counted.
//
// Threading: the IO calls and accessors of RemoteDevice, as for any device. map_failover,
// unmap_failover, remap_failover and switch_failover are control functions of both sessions.
// The failover device has a thread of its own (the switch runs there). Both sessions must
// outlive the mapping: unmap it before closing either.

struct FailoverEvent {
  enum class Kind : uint8_t {
    failed_over,     // IO moved from session `from` to `to`: `pause`, `resent` requests
    standby_lost,    // the standby is not usable (its session is down, or its device closed)
    standby_back,    // the standby is usable again
    cache_lost,      // the old active's volatile cache may have held completed writes
  };
  Kind kind = Kind::failed_over;
  std::string dev_name;
  std::string from, to;  // session names
  std::chrono::milliseconds pause{0};
  uint64_t resent = 0;
  std::error_code error;
};

struct FailoverOptions {
  // How long IO waits in the failover device for a usable server (then ENOTCONN or
  // ETIMEDOUT).
  std::chrono::milliseconds remap_timeout{30000};
  // On the failover device's thread; must not block or call control functions.
  std::function<void(const FailoverEvent&)> on_event;
};

struct FailoverInfo {
  std::string active;              // the active session's name
  std::string standby;             // the standby session's name
  bool switching = false;          // a failover is under way: IO waits
  bool standby_ready = false;      // the standby is open and its session connected
  std::error_code standby_error;   // why it is not (its OPEN refused, its session down, ...)
  uint64_t failovers = 0;
  uint64_t resent = 0;             // requests sent again after a failover
  std::chrono::milliseconds last_pause{0};  // the last failover: trigger to IO flowing again
  uint64_t lost_flushes = 0;       // flushes failed with EIO after a lossy failover
};

// Maps `dev_name` through `active` (OPEN) and `standby` (OPEN without REOPEN), two sessions to
// two servers exporting the same store, in `mode`. The standby's refusal does not fail the map:
// the device works on the active and failover() says why the standby is missing. Errors: EINVAL
// (one session twice, a bad name), EEXIST (either session has the name mapped already), the
// active's map errors (map()), EMSGSIZE.
Result<std::shared_ptr<RemoteDevice>> map_failover(BlockSession& active, BlockSession& standby,
                                                   std::string_view dev_name, AccessMode mode,
                                                   FailoverOptions options = {});
// Unmaps both sides (BlockSession::unmap's modes and errors). EINVAL: not a failover device;
// ENOENT: unmapped already.
Status unmap_failover(RemoteDevice& dev, UnmapMode mode = UnmapMode::normal);
// Re-opens what is missing or closed now: the standby (without REOPEN), the active (with).
// EINVAL, ENOENT; the first side's error (the other is tried all the same).
Status remap_failover(RemoteDevice& dev);
// An administrative failover: the standby becomes active now (the active's cache is flushed
// first when its session is up). Returns when IO flows on the new active. EINVAL, ENOENT,
// ENOTCONN (the standby is not usable), ETIMEDOUT (remap_timeout passed), the take-over's error.
Status switch_failover(RemoteDevice& dev);

}  // namespace ibnbd
