// Backend: opening a regular file or block device for export and learning its geometry.
#include "ibnbd/backend.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <linux/magic.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <memory>

#include "backend/rbd_image.h"
#include "backend/sys.h"

namespace ibnbd {

namespace {

// DISCARD / WRITE_ZEROES ranges ride in the 32-bit bi_size of an IO message (rnbd-proto.h), so
// one request covers at most 4 GiB - 1; advertise that, kept a multiple of 4 KiB.
constexpr uint32_t kMaxRangeSectors = (UINT32_MAX / kSectorSize) & ~7u;
// A file has no hardware limit; the server clamps to the transport's max_io_size anyway.
constexpr uint32_t kFileMaxHwSectors = 64 * 1024;  // 32 MiB
// The block layer's default segment limit (BLK_MAX_SEGMENTS) for stores without a queue.
constexpr uint16_t kFileMaxSegments = 128;

uint64_t round_down(uint64_t v, uint64_t a) { return v - v % a; }

// O_DIRECT in the file's flags, or off.
Status set_direct(int fd, bool on) {
  int fl = ::fcntl(fd, F_GETFL);
  if (fl < 0) return errc(errno);
  fl = on ? (fl | O_DIRECT) : (fl & ~O_DIRECT);
  if (::fcntl(fd, F_SETFL, fl) != 0) return errc(errno);
  return {};
}

struct DirectAlign {
  uint32_t io = 0;  // 0: O_DIRECT not usable on this file
  uint32_t mem = 0;
};

// The O_DIRECT alignment of a regular file: statx(STATX_DIOALIGN) (Linux >= 6.1) when the
// filesystem reports it, else the filesystem block size, checked by one aligned read.
DirectAlign file_direct_align(int fd, const struct stat& st) {
  struct statx sx {};
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN))
    return {sx.stx_dio_offset_align, sx.stx_dio_mem_align};  // both 0: no O_DIRECT here
  // tmpfs accepts O_DIRECT (Linux >= 6.6) but still goes through the page cache: treat as
  // buffered so the geometry does not promise an alignment that buys nothing.
  struct statfs sf {};
  if (::fstatfs(fd, &sf) == 0 && sf.f_type == TMPFS_MAGIC) return {};
  const uint32_t a = std::max<uint32_t>(kSectorSize, static_cast<uint32_t>(st.st_blksize));
  if (static_cast<uint64_t>(st.st_size) >= a) {
    void* p = std::aligned_alloc(a, a);
    if (!p) return {};
    ssize_t n = ::pread(fd, p, a, 0);
    std::free(p);
    if (n < 0) return {};  // EINVAL: the filesystem accepted the flag but not the IO
  }
  return {a, a};
}

}  // namespace

FileId file_id_of(const struct stat& st) {
  if (S_ISBLK(st.st_mode)) return FileId{true, static_cast<uint64_t>(st.st_rdev), 0, {}};
  return FileId{false, static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino), {}};
}

Backend::Backend() = default;
Backend::~Backend() = default;

Result<std::unique_ptr<Backend>> Backend::open(const ExportTarget& t, const OpenOptions& o) {
  BASE_ASSIGN_OR_RETURN(auto b, open_fd(t.root.get(), t.rel_path, true, o, t.root_path + "/" + t.rel_path));
  // The server counted holders against t.id: serving another store under that key would let
  // the rules judge one file and the IO reach another.
  if (b->id() != t.id) return errc(ESTALE);
  return b;
}

Result<std::unique_ptr<Backend>> Backend::open_path(const std::string& path, const OpenOptions& o) {
  return open_fd(AT_FDCWD, path, false, o, path);
}

Result<std::unique_ptr<Backend>> Backend::open_fd(int dirfd, const std::string& path, bool beneath,
                                                  const OpenOptions& o, std::string name) {
  // O_NONBLOCK only for the open itself: a FIFO swapped in must not hang us; it is cleared below
  // because io_uring turns O_NONBLOCK files into -EAGAIN completions instead of waiting.
  // O_EXCL without O_CREAT claims a block device and is ignored for files (open(2)).
  int flags = (o.read_only ? O_RDONLY : O_RDWR) | O_NONBLOCK | (o.exclusive ? O_EXCL : 0);
  base::UniqueFd fd;
  if (beneath) {
    BASE_ASSIGN_OR_RETURN(fd,
                           backend::openat2_beneath(dirfd, path, flags, backend::kResolveExport));
  } else {
    int f = ::openat(dirfd, path.c_str(), flags | O_CLOEXEC);
    if (f < 0) return errc(errno);
    fd.reset(f);
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return errc(errno);
  if (S_ISDIR(st.st_mode)) return errc(EISDIR);
  if (!S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode)) return errc(ENOTBLK);
  int fl = ::fcntl(fd.get(), F_GETFL);
  if (fl < 0 || ::fcntl(fd.get(), F_SETFL, fl & ~O_NONBLOCK) != 0) return errc(errno);

  std::unique_ptr<Backend> b(new Backend());
  b->fd_ = std::move(fd);
  b->name_ = std::move(name);
  b->id_ = file_id_of(st);
  b->kind_ = S_ISBLK(st.st_mode) ? Kind::block_device : Kind::file;
  b->read_only_ = o.read_only;
  BASE_TRY(b->probe(o));
  return b;
}

// O_DIRECT, alignment, size, limits and the discard / write-zeroes abilities of the opened fd.
Status Backend::probe(const OpenOptions& o) {
  const int fd = fd_.get();
  struct stat st {};
  if (::fstat(fd, &st) != 0) return errc(errno);
  bool want_direct = o.direct != DirectIo::off;
  if (want_direct) {
    Status s = set_direct(fd, true);  // EINVAL: the filesystem has no direct IO
    if (!s.ok() && o.direct == DirectIo::require) return s;
    want_direct = s.ok();
  }
  DeviceGeometry& g = geo_;
  uint64_t bytes = 0;
  if (kind_ == Kind::block_device) {
    int lbs = 0;
    unsigned int pbs = 0;
    if (::ioctl(fd, BLKSSZGET, &lbs) != 0 || ::ioctl(fd, BLKPBSZGET, &pbs) != 0 ||
        ::ioctl(fd, BLKGETSIZE64, &bytes) != 0)
      return errc(errno);
    g.logical_block_size = static_cast<uint32_t>(lbs);
    g.physical_block_size = std::max<uint32_t>(pbs, g.logical_block_size);
    direct_ = want_direct;
    if (direct_) {
      io_align_ = g.logical_block_size;
      struct statx sx {};
      mem_align_ = (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 &&
                    (sx.stx_mask & STATX_DIOALIGN) && sx.stx_dio_mem_align)
                       ? sx.stx_dio_mem_align
                       : g.logical_block_size;
    }
    const backend::QueueLimits q = backend::read_queue_limits(st.st_rdev);
    g.max_hw_sectors = static_cast<uint32_t>(q.max_hw_sectors_kb.value_or(512) * 2);
    g.max_segments = static_cast<uint16_t>(
        std::min<uint64_t>(q.max_segments.value_or(kFileMaxSegments), 0xffff));
    if (!read_only_) {
      const uint64_t dmax = q.discard_max_bytes.value_or(0) / kSectorSize;
      can_discard_ = dmax > 0;
      g.max_discard_sectors = static_cast<uint32_t>(std::min<uint64_t>(dmax, kMaxRangeSectors));
      g.discard_granularity = static_cast<uint32_t>(q.discard_granularity.value_or(0));
      g.discard_alignment = static_cast<uint32_t>(q.discard_alignment.value_or(0));
      // fallocate(ZERO_RANGE) on a block device writes zeros when the device cannot
      // (blkdev_issue_zeroout without NOFALLBACK): always available.
      can_write_zeroes_ = true;
      g.max_write_zeroes_sectors = kMaxRangeSectors;
    }
    g.cache_policy = kCacheFua;
    if (!direct_ || q.write_back_cache.value_or(true)) g.cache_policy |= kCacheWriteBack;
  } else {
    DirectAlign a;
    if (want_direct) a = file_direct_align(fd, st);
    if (want_direct && a.io == 0) {
      if (o.direct == DirectIo::require) return errc(EINVAL);
      BASE_TRY(set_direct(fd, false));
    }
    direct_ = a.io != 0;
    if (!direct_) {
      struct statfs sf {};
      memory_backed_ = ::fstatfs(fd, &sf) == 0 && (sf.f_type == TMPFS_MAGIC || sf.f_type == RAMFS_MAGIC);
    }
    if (direct_) {
      io_align_ = a.io;
      mem_align_ = std::max<uint32_t>(a.mem, 1);
    }
    bytes = static_cast<uint64_t>(st.st_size);
    const uint32_t fs_block = std::max<uint32_t>(static_cast<uint32_t>(st.st_blksize), kSectorSize);
    g.logical_block_size = direct_ ? std::max<uint32_t>(io_align_, kSectorSize) : kSectorSize;
    g.physical_block_size = std::max(g.logical_block_size, fs_block);
    g.max_hw_sectors = kFileMaxHwSectors;
    g.max_segments = kFileMaxSegments;
    if (!read_only_) {
      // Punching a block past the end changes nothing (KEEP_SIZE) but tells whether the
      // filesystem can punch at all. Write-zeroes falls back to punch + allocate, so it needs it
      // too (ZERO_RANGE cannot be probed without allocating blocks).
      const off_t past_end = static_cast<off_t>((static_cast<uint64_t>(st.st_size) + fs_block - 1) /
                                                fs_block * fs_block);
      if (::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, past_end, fs_block) == 0) {
        can_discard_ = can_write_zeroes_ = true;
        g.max_discard_sectors = g.max_write_zeroes_sectors = kMaxRangeSectors;
        g.discard_granularity = fs_block;
      }
    }
    // Buffered: the page cache; direct: the filesystem's metadata and the disk cache below.
    g.cache_policy = kCacheFua | kCacheWriteBack;
  }
  g.secure_discard = false;  // no queue limit tells; BLKSECDISCARD answers EOPNOTSUPP if absent
  size_.store(round_down(bytes, g.logical_block_size), std::memory_order_release);
  return {};
}

DeviceGeometry Backend::geometry() const {
  DeviceGeometry g = geo_;
  g.nsectors = size() / kSectorSize;
  return g;
}

Result<uint64_t> Backend::refresh_size() {
  uint64_t bytes = 0;
  if (kind_ == Kind::rbd) {
    if (int rc = backend::rbd_size(*rbd_, &bytes); rc < 0) return errc(-rc);
  } else if (kind_ == Kind::block_device) {
    if (::ioctl(fd_.get(), BLKGETSIZE64, &bytes) != 0) return errc(errno);
  } else {
    struct stat st {};
    if (::fstat(fd_.get(), &st) != 0) return errc(errno);
    bytes = static_cast<uint64_t>(st.st_size);
  }
  const uint64_t s = round_down(bytes, geo_.logical_block_size);
  size_.store(s, std::memory_order_release);
  return s;
}

Status Backend::watch_size(std::function<void()> on_change) {
  if (kind_ != Kind::rbd || !on_change) return errc(EOPNOTSUPP);
  if (rbd_->on_update) return errc(EBUSY);  // once: a running watch may be calling it
  rbd_->on_update = std::move(on_change);
  if (const int rc = backend::rbd_watch(*rbd_); rc < 0) {
    rbd_->on_update = nullptr;  // no watch was made: nothing calls it
    return errc(-rc);
  }
  return {};
}

Result<std::string> Backend::take_over() {
  std::string fenced;
  if (kind_ != Kind::rbd || read_only_) return fenced;
  if (const int rc = backend::rbd_take_over(*rbd_, &fenced); rc < 0) return errc(-rc);
  return fenced;
}

Status Backend::sync() {
  if (read_only_) return {};
  if (kind_ == Kind::rbd) {
    const int rc = backend::rbd_sync(*rbd_);
    return rc < 0 ? Status(errc(-rc)) : Status{};
  }
  return ::fdatasync(fd_.get()) == 0 ? Status{} : Status(errc(errno));
}

}  // namespace ibnbd
