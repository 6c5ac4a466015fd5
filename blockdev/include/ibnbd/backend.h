// The IBNBD server's storage backends (the kernel's rnbd-srv-dev): which devices a client may
// open (resolve_export), an opened device with its geometry (Backend), and the asynchronous IO
// engine over io_uring that moves a request's data straight between the transport chunk and the
// store (IoEngine). The server daemon is the only user.
//
// Threading:
//   - resolve_export(), Backend::open*(): any thread; they block on the filesystem (control
//     thread work, never an IO thread's hot path).
//   - Backend: geometry(), size(), refresh_size() and the accessors from any thread (the size is
//     atomic; everything else is fixed at open). watch_size() once, from the thread that owns the
//     Backend. A Backend must outlive every request naming it.
//   - IoEngine: one engine per server IO thread, used by that thread only ("the owning thread"):
//     submit(), kick(), run_completions(), wait(), drain(), in_flight(). It may be created on
//     another thread and handed over before first use. event_fd() from any thread (it does not
//     change). Completion callbacks run on the owning thread inside run_completions()/drain().
#pragma once

#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "ibnbd/types.h"
#include "base/unique_fd.h"

namespace ibnbd {

class RbdCluster;
namespace backend {
struct RbdImage;       // an open librbd image (backend/rbd_image.h)
struct RbdAccess;      // how the rbd code fills a Backend of kind rbd (rbd_image.h)
}

// ---------------------------------------------------------------------------------------------
// Export resolution: dev_search_path + dev_name -> a device under the search root.
//
// The kernel joins dev_search_path, "/" and dev_name and refuses ".." (rnbd-srv.c,
// rnbd_srv_get_full_path). We also keep symlinks from leading out: the final open goes through
// openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS) relative to the opened search root, so no
// component, symlink target, or rename race can reach outside it.
//
// Errors (positive errno, what the client sees):
//   EINVAL        bad session name (empty, '/', "..", NUL) while the template uses %SESSNAME%;
//                 search path not absolute; dev_name empty, with a NUL, naming the root itself,
//                 or with a ".." component
//   ENAMETOOLONG  dev_name or the joined path longer than PATH_MAX - 1
//   EXDEV         an absolute dev_name outside the search root, or a symlink whose target leaves
//                 it (absolute symlinks always do: RESOLVE_BENEATH judges them as escapes even when
//                 they point inside; use relative links)
//   ELOOP         a "magic" /proc link, or a symlink loop
//   ENOENT        no such device, or no such search root (e.g. no per-session directory)
//   ENOTDIR       the search root or an inner component is not a directory
//   EACCES/EPERM  the filesystem refused
//   EISDIR        dev_name is a directory
//   ENOTBLK       dev_name is neither a regular file nor a block device
//   ENOSYS        the kernel has no openat2 (< 5.6): we refuse rather than resolve unsafely
inline constexpr std::string_view kSessNamePlaceholder = "%SESSNAME%";

struct ExportTarget {
  enum class Kind : uint8_t { file, block_device, rbd };  // rbd: RbdCluster::open (rbd.h)
  base::UniqueFd root;          // the search root, O_PATH | O_DIRECTORY
  std::string root_path;  // the search path with %SESSNAME% substituted (for logs)
  std::string rel_path;   // dev_name as a clean relative path under root ("a/b.img")
  // Where the name leads under root, symlinks resolved ("c/d.img" for a link a/b.img ->
  // ../c/d.img; rel_path when no symlink is on the way): access rules hold for both.
  std::string real_path;
  Kind kind = Kind::file;
  // What the name led to when it was resolved: the server's key of the device (every alias of
  // one store resolves to the same id). Backend::open() refuses (ESTALE) when the store it
  // opens is not this one any more.
  FileId id;
};

// The identity of a store from its stat: (st_dev, st_ino) of a regular file, st_rdev of a block
// device (types.h, FileId).
FileId file_id_of(const struct stat& st);

// `why`, when given, receives a one-line reason for a refusal (for the daemon's log; the client
// only gets the errno).
Result<ExportTarget> resolve_export(std::string_view search_path_template,
                                    std::string_view session_name, std::string_view dev_name,
                                    std::string* why = nullptr);

// ---------------------------------------------------------------------------------------------
// Backend: one device opened for export.

enum class DirectIo : uint8_t {
  prefer,   // O_DIRECT where the store allows it, else buffered (the default)
  off,      // buffered: the page cache in between
  require,  // O_DIRECT or EINVAL
};

struct OpenOptions {
  bool read_only = false;  // AccessMode::ro: the device is opened O_RDONLY, writes get EROFS
  DirectIo direct = DirectIo::prefer;
  // Block devices only: O_EXCL, so a mounted or otherwise claimed device is refused with EBUSY.
  bool exclusive = false;
};

class Backend {
 public:
  using Kind = ExportTarget::Kind;

  // Opens what resolve_export() found (again beneath its root: a swap in between cannot escape).
  // ESTALE when the name leads to another store than the one resolved (replaced in between).
  static Result<std::unique_ptr<Backend>> open(const ExportTarget& target, const OpenOptions& o);
  // Opens a path the caller trusts (tools, tests): no search-path checks.
  static Result<std::unique_ptr<Backend>> open_path(const std::string& path, const OpenOptions& o);

  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;
  ~Backend();

  int fd() const { return fd_.get(); }  // -1 for an RBD image
  Kind kind() const { return kind_; }
  backend::RbdImage* rbd() const { return rbd_.get(); }  // the image of Kind::rbd, else null
  bool read_only() const { return read_only_; }
  bool direct() const { return direct_; }
  // What submit() requires of offsets and lengths (io_align) and of buffer addresses and segment
  // lengths (mem_align): the O_DIRECT alignment, 1 when buffered.
  uint32_t io_align() const { return io_align_; }
  uint32_t mem_align() const { return mem_align_; }
  // Exported size in bytes: the store's size rounded down to the logical block size (a tail
  // shorter than a block is not exported).
  uint64_t size() const { return size_.load(std::memory_order_acquire); }
  DeviceGeometry geometry() const;
  const std::string& name() const { return name_; }
  FileId id() const { return id_; }  // of the store opened (fstat of fd())

  // What the store can do beyond read/write/flush.
  bool can_discard() const { return can_discard_; }
  bool can_write_zeroes() const { return can_write_zeroes_; }
  // A buffered regular file on a filesystem that lives in memory (tmpfs, ramfs): its reads and
  // writes are copies to and from the page cache that never wait for a device. io_uring cannot
  // start them without blocking (no FMODE_NOWAIT) and hands each to a worker thread.
  bool memory_backed() const { return memory_backed_; }

  // Re-reads the store's size (st_size / BLKGETSIZE64 / rbd_get_size, which for an image is
  // librbd's view: current once its header watch told it) and returns the new exported size,
  // which IO is checked against from then on. IO racing with a shrink fails with EIO (range
  // check or short read). Blocks briefly (an image may refresh its header from the cluster):
  // the server's control thread, never the IO path.
  Result<uint64_t> refresh_size();
  // Calls `on_change` when the store's size may have changed: an RBD image's header update
  // (rbd_update_watch; librbd also calls it for other header changes, so the callee re-reads
  // with refresh_size()). It runs on a librbd thread and must hand off without blocking; it is
  // never called after the Backend is destroyed (rbd_update_unwatch comes first). EOPNOTSUPP
  // for files and block devices (their size is polled with refresh_size()) and for images
  // opened read-only, which librbd does not watch (their size stays what it was at open until
  // re-opened); librbd's errno otherwise.
  Status watch_size(std::function<void()> on_change);
  // Makes every completed write durable (fdatasync; rbd_flush for an image). Blocks: for a
  // device's last close on the control thread, not the IO path.
  Status sync();
  // Takes the store over from another client that holds it (a client re-opening a device it
  // held before: the holder is its previous server, dead or cut off). An RBD image's exclusive
  // lock held by another librbd client is broken, which blocklists that client: fenced, its
  // writes fail from then on. Returns who was fenced ("" when nobody: no lock, ours already, a
  // file or block device). Blocks on the cluster: control thread.
  Result<std::string> take_over();

  // Learnt by the engine when the filesystem turns out to lack FALLOC_FL_ZERO_RANGE (tmpfs):
  // later write-zeroes go straight to the punch + allocate fallback. Any thread.
  bool zero_range_unsupported() const { return no_zero_range_.load(std::memory_order_relaxed); }
  void note_zero_range_unsupported() { no_zero_range_.store(true, std::memory_order_relaxed); }

 private:
  friend class RbdCluster;
  friend struct backend::RbdAccess;
  Backend();
  static Result<std::unique_ptr<Backend>> open_fd(int dirfd, const std::string& path, bool beneath,
                                                  const OpenOptions& o, std::string name);
  Status probe(const OpenOptions& o);

  base::UniqueFd fd_;
  std::unique_ptr<backend::RbdImage> rbd_;
  std::string name_;
  FileId id_;
  Kind kind_ = Kind::file;
  bool read_only_ = false;
  bool direct_ = false;
  bool can_discard_ = false;
  bool can_write_zeroes_ = false;
  bool memory_backed_ = false;
  uint32_t io_align_ = 1;
  uint32_t mem_align_ = 1;
  DeviceGeometry geo_;  // everything but nsectors, fixed at open
  std::atomic<uint64_t> size_{0};
  std::atomic<bool> no_zero_range_{false};
};

// ---------------------------------------------------------------------------------------------
// IoEngine: asynchronous IO over one io_uring.
//
// What each operation becomes (files | block devices):
//   READ          IORING_OP_READ / READV (several segments); a read reaching end of file fails
//                 with EIO, never returns zeros or a partial buffer
//   WRITE         IORING_OP_WRITE / WRITEV; FUA -> RWF_DSYNC on the same write
//   PREFLUSH      an IORING_OP_FSYNC(DATASYNC) linked (IOSQE_IO_LINK) before the operation
//   FLUSH         IORING_OP_FSYNC with IORING_FSYNC_DATASYNC (fdatasync)
//   DISCARD       FALLOCATE(PUNCH_HOLE | KEEP_SIZE) | BLKDISCARD on the engine's helper thread
//   WRITE_ZEROES  NOUNMAP: FALLOCATE(ZERO_RANGE | KEEP_SIZE), or where the filesystem lacks it
//                 (tmpfs) PUNCH_HOLE then a plain allocate, linked; without NOUNMAP:
//                 FALLOCATE(PUNCH_HOLE | KEEP_SIZE) — the kernel loop driver's choice
//                 (drivers/block/loop.c, lo_fallocate). Block devices take the same fallocate
//                 modes (blkdev_fallocate: ZERO_RANGE = zeroout, PUNCH_HOLE = zeroout that unmaps).
//   SECURE_ERASE  EOPNOTSUPP | BLKSECDISCARD on the helper thread
//   BLOCK_STATUS  the helper thread writes the wire answer (proto::BLOCK_STATUS_RSP, at most
//                 kMaxExtents extents over a prefix of the range) into `buf`: files by
//                 lseek(SEEK_DATA / SEEK_HOLE), holes reading as zeros | all data; RBD images by
//                 rbd_diff_iterate2 over at most 256 MiB per answer. lseek may wait for the
//                 filesystem's metadata like a read: never on the owning thread.
//   FUA on discard / write-zeroes: an fdatasync linked after the fallocate or ioctl.
//
// BLKDISCARD / BLKSECDISCARD: io_uring of 6.1 has no discard for block devices and the ioctls
// block for as long as the device takes (seconds for large ranges), so they run on one helper
// thread per engine, started at the first such request; its completion comes back through the
// engine's eventfd like any other.
//
// Short reads and writes are resubmitted for the remainder; a round that moves no byte fails the
// request with EIO (end of file under a read: the store shrank under us).
//
// Queue depth is fixed at creation: it bounds the requests in flight (submitted and not yet
// called back). submit() beyond it fails with EAGAIN and the caller retries after
// run_completions() freed a slot — the server holds at most queue_depth chunks per session, so it
// sizes the engine to make this rare. No allocation per request: slots are preallocated.

// Completion of one request: err is 0 or a positive errno.
using IoDoneFn = void (*)(void* ctx, int err);

inline constexpr uint32_t kMaxIoSegments = 16;  // iovecs per request (the chunk is one)

struct BackendRequest {
  Backend* backend = nullptr;  // must outlive the request
  IoOp op = IoOp::read;
  uint32_t flags = 0;   // IoFlag bits; SYNC is a hint and ignored
  uint64_t offset = 0;  // bytes
  uint32_t len = 0;     // bytes; READ/WRITE: the sum of the segments
  // READ/WRITE: the caller's memory (the transport chunk) — the kernel reads or writes it
  // directly, no copy. BLOCK_STATUS: `buf` of at least proto::kBlockStatusReplyBytes receives
  // the answer. Either one buffer or up to kMaxIoSegments segments (the iovec array is
  // copied; the memory it points to must stay valid until the callback).
  std::span<std::byte> buf;
  std::span<const iovec> iov;
  IoDoneFn done = nullptr;
  void* ctx = nullptr;
};

struct EngineOptions {
  uint32_t queue_depth = 128;  // requests in flight, 1..4096
  // READ and WRITE (alone or with FUA) of at most 64 KiB on a memory-backed file
  // (Backend::memory_backed: tmpfs, ramfs) are carried out inside submit() with preadv2 / pwritev2 instead of io_uring, which
  // can only hand them to its worker threads: a thread switch and a wake-up per request for a
  // page-cache copy (measured: randread 4 KiB QD32 through the server, see docs/benchmarks.md).
  // Their callbacks run at the next run_completions() and event_fd() is NOT signalled for them:
  // the owner must call run_completions() after it submitted and before it sleeps on event_fd()
  // (an IoThreadHook does: its poll() follows every pass of the IO thread), or ready() tells.
  bool sync_memory_files = false;
};

// What the running kernel's io_uring offers (io_uring_get_probe at creation).
struct EngineCaps {
  bool op_read_write = false;  // IORING_OP_READ/WRITE (5.6); else READV/WRITEV with one segment
  bool op_fallocate = false;   // IORING_OP_FALLOCATE (5.6); else DISCARD/WRITE_ZEROES: EOPNOTSUPP
  bool submit_all = false;     // IORING_SETUP_SUBMIT_ALL (5.18)
};

class IoEngine {
 public:
  // Errors: EINVAL (queue depth), ENOSYS / EPERM (no io_uring, or disabled by sysctl), ENOMEM.
  static Result<std::unique_ptr<IoEngine>> create(const EngineOptions& o);
  // Waits for what is still in flight in the kernel (the buffers stay in use until then) without
  // calling its callbacks; drain() first to get them.
  ~IoEngine();
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  // Queues one request; it starts at the next kick(). On error no callback will come:
  //   EAGAIN      queue_depth requests in flight
  //   EINVAL      no backend/callback, unknown op or flag, segments that do not add up to len,
  //               a BLOCK_STATUS with flags, no answer buffer, or a range off 512 bytes,
  //               more than kMaxIoSegments, or an offset/length/address off the backend's
  //               O_DIRECT alignment
  //   EIO         the range ends beyond the exported size (the kernel's bio_check_eod)
  //   EROFS       WRITE, DISCARD, WRITE_ZEROES or SECURE_ERASE on a read-only backend
  //   EOPNOTSUPP  DISCARD / WRITE_ZEROES / SECURE_ERASE the store (or this kernel's ring) lacks
  Status submit(const BackendRequest& r);
  // Hands everything queued since the last kick to the kernel in one io_uring_submit. On error
  // (EBUSY, EAGAIN, EINTR) the requests stay queued for the next kick.
  Status kick();
  // Calls back every finished request, resubmits short transfers and kicks what the callbacks or
  // resubmissions queued. Never blocks. Returns the number of callbacks made. Callbacks may
  // submit(); they must not call run_completions(), wait() or drain(), nor destroy the engine.
  uint32_t run_completions();
  // Blocks until a completion may be ready (the eventfd is readable) or `timeout` passes, then
  // runs completions. For threads without their own epoll loop (tests, tools).
  uint32_t wait(std::chrono::milliseconds timeout);
  // Runs completions until nothing is in flight.
  void drain();

  // Readable when completions may be waiting: put it in the owning thread's epoll set
  // (level-triggered; run_completions() consumes it). Not for requests done inside submit()
  // (EngineOptions::sync_memory_files): see ready().
  int event_fd() const;
  // Requests finished inside submit() whose callbacks wait for run_completions().
  bool ready() const;
  uint32_t in_flight() const;
  uint32_t queue_depth() const;
  const EngineCaps& caps() const;

  struct Impl;

 private:
  explicit IoEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ibnbd
