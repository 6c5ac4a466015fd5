// ibnbd-soak-fs: a FUSE passthrough of one directory whose requests can be made to fail or wait
// (issue 17's backend faults without a fault-injecting mode in the server). The server exports
// a file through the mount; the kernel hands every read and write of it here (direct_io: no
// page cache on this side), where it reaches the real file with pread / pwrite, so ENOSPC from
// a full filesystem below comes back as the kernel would give it, and the faults are ours:
//
//   ibnbd-soak-fs BACKING_DIR MOUNTPOINT [--pidfile FILE]
//   echo "eio OFFSET LENGTH" > MOUNTPOINT/.soak-ctl   reads and writes overlapping the byte range
//                                                   of any file fail with EIO
//   echo "slow MICROSECONDS" > MOUNTPOINT/.soak-ctl   every read, write and fsync waits first
//   echo "lose OFFSET LENGTH" > ...   writes overlapping the range succeed and are dropped
//   echo "tear OFFSET LENGTH" > ...   writes overlapping the range succeed with their last 64
//                                     bytes not written (a torn sector)
//   echo clear > MOUNTPOINT/.soak-ctl                 no fault
// lose and tear are a device that lies: they exist to show that the checker catches one
// (tests/soak/soak_selftest.sh), never as a fault of a soak.
//   cat MOUNTPOINT/.soak-ctl                          the faults on, and the requests they hit
//
// Test equipment only: it serves whoever can reach the mount (root's, without allow_other) and
// is unmounted by SIGTERM / SIGINT (fuse_main's handlers) or `fusermount3 -u`.
#define FUSE_USE_VERSION 31
#include <dirent.h>
#include <fcntl.h>
#include <fuse.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "base/unique_fd.h"

namespace {

constexpr const char* kCtl = "/.soak-ctl";
constexpr uint64_t kCtlFh = ~uint64_t{0};

int g_dir = -1;  // the backing directory
std::atomic<uint64_t> g_eio_off{0}, g_eio_len{0};
std::atomic<uint64_t> g_lie_off{0}, g_lie_len{0};
std::atomic<int> g_lie{0};  // 1: lose, 2: tear
std::atomic<uint32_t> g_slow_us{0};
std::atomic<uint64_t> g_eio_hits{0}, g_slowed{0};

// Names of the backing directory only: "/name" without another slash.
const char* rel(const char* path) { return path[0] == '/' && path[1] != '\0' ? path + 1 : "."; }

int fault(off_t off, size_t len) {
  const uint32_t us = g_slow_us.load(std::memory_order_relaxed);
  if (us != 0) {
    g_slowed.fetch_add(1, std::memory_order_relaxed);
    ::usleep(us);
  }
  const uint64_t eo = g_eio_off.load(), el = g_eio_len.load();
  if (el != 0 && static_cast<uint64_t>(off) < eo + el && eo < static_cast<uint64_t>(off) + len) {
    g_eio_hits.fetch_add(1, std::memory_order_relaxed);
    return -EIO;
  }
  return 0;
}

int fs_getattr(const char* path, struct stat* st, fuse_file_info*) {
  if (std::strcmp(path, kCtl) == 0) {
    std::memset(st, 0, sizeof *st);
    st->st_mode = S_IFREG | 0600;
    st->st_nlink = 1;
    st->st_size = 4096;
    return 0;
  }
  return ::fstatat(g_dir, rel(path), st, AT_SYMLINK_NOFOLLOW) == 0 ? 0 : -errno;
}

int fs_readdir(const char* path, void* buf, fuse_fill_dir_t fill, off_t, fuse_file_info*, fuse_readdir_flags) {
  if (std::strcmp(path, "/") != 0) return -ENOTDIR;
  base::UniqueFd fd(::openat(g_dir, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) return -errno;
  DIR* d = ::fdopendir(fd.get());
  if (d == nullptr) return -errno;
  (void)fd.release();  // the DIR owns it now: closedir closes it
  while (dirent* e = ::readdir(d)) fill(buf, e->d_name, nullptr, 0, static_cast<fuse_fill_dir_flags>(0));
  ::closedir(d);
  fill(buf, kCtl + 1, nullptr, 0, static_cast<fuse_fill_dir_flags>(0));
  return 0;
}

int fs_open(const char* path, fuse_file_info* fi) {
  fi->direct_io = 1;  // every request comes here: no page cache between the server and the faults
  if (std::strcmp(path, kCtl) == 0) {
    fi->fh = kCtlFh;
    return 0;
  }
  const int fd = ::openat(g_dir, rel(path), (fi->flags & (O_ACCMODE | O_SYNC | O_DSYNC)) | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return -errno;
  // Raw: FUSE keeps the descriptor in the file handle until fs_release closes it.
  fi->fh = static_cast<uint64_t>(fd);
  return 0;
}

int fs_release(const char*, fuse_file_info* fi) {
  if (fi->fh != kCtlFh) ::close(static_cast<int>(fi->fh));
  return 0;
}

int fs_read(const char*, char* buf, size_t size, off_t off, fuse_file_info* fi) {
  if (fi->fh == kCtlFh) {
    char text[256];
    const int n = std::snprintf(text, sizeof text, "eio %" PRIu64 " %" PRIu64 "\nslow %u\neio_hits %" PRIu64 "\nslowed %" PRIu64 "\n",
                                g_eio_off.load(), g_eio_len.load(), g_slow_us.load(), g_eio_hits.load(), g_slowed.load());
    if (off >= n) return 0;
    const size_t k = std::min(size, static_cast<size_t>(n - off));
    std::memcpy(buf, text + off, k);
    return static_cast<int>(k);
  }
  if (int e = fault(off, size); e != 0) return e;
  size_t done = 0;
  while (done < size) {
    const ssize_t r = ::pread(static_cast<int>(fi->fh), buf + done, size - done, off + static_cast<off_t>(done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return -errno;
    if (r == 0) break;
    done += static_cast<size_t>(r);
  }
  return static_cast<int>(done);
}

int ctl(const char* buf, size_t size) {
  std::string cmd(buf, size);
  while (!cmd.empty() && (cmd.back() == '\n' || cmd.back() == ' ')) cmd.pop_back();
  unsigned long long a = 0, b = 0;
  if (cmd == "clear") {
    g_eio_len.store(0);
    g_slow_us.store(0);
    g_lie.store(0);
  } else if (std::sscanf(cmd.c_str(), "lose %llu %llu", &a, &b) == 2 ||
             std::sscanf(cmd.c_str(), "tear %llu %llu", &a, &b) == 2) {
    g_lie.store(0);
    g_lie_off.store(a);
    g_lie_len.store(b);
    g_lie.store(cmd[0] == 'l' ? 1 : 2);
  } else if (std::sscanf(cmd.c_str(), "eio %llu %llu", &a, &b) == 2) {
    g_eio_len.store(0);
    g_eio_off.store(a);
    g_eio_len.store(b);
  } else if (std::sscanf(cmd.c_str(), "slow %llu", &a) == 1 && a <= 10000000) {
    g_slow_us.store(static_cast<uint32_t>(a));
  } else {
    return -EINVAL;
  }
  return static_cast<int>(size);
}

int fs_write(const char*, const char* buf, size_t size, off_t off, fuse_file_info* fi) {
  if (fi->fh == kCtlFh) return ctl(buf, size);
  if (int e = fault(off, size); e != 0) return e;
  const int lie = g_lie.load();
  const uint64_t lo = g_lie_off.load(), ll = g_lie_len.load();
  if (lie != 0 && static_cast<uint64_t>(off) < lo + ll && lo < static_cast<uint64_t>(off) + size) {
    if (lie == 1 || size <= 64) return static_cast<int>(size);
    const ssize_t r = ::pwrite(static_cast<int>(fi->fh), buf, size - 64, off);
    return r < 0 ? -errno : static_cast<int>(size);
  }
  size_t done = 0;
  while (done < size) {
    const ssize_t r = ::pwrite(static_cast<int>(fi->fh), buf + done, size - done, off + static_cast<off_t>(done));
    if (r < 0 && errno == EINTR) continue;
    // The error even after a part was written: a short write would reach the server's client as
    // EIO, where the filesystem said ENOSPC (what part of a failed write landed is unknown to it
    // anyway).
    if (r < 0) return -errno;
    done += static_cast<size_t>(r);
  }
  return static_cast<int>(done);
}

int fs_fsync(const char*, int datasync, fuse_file_info* fi) {
  if (fi->fh == kCtlFh) return 0;
  if (const uint32_t us = g_slow_us.load(); us != 0) ::usleep(us);
  const int fd = static_cast<int>(fi->fh);
  return (datasync ? ::fdatasync(fd) : ::fsync(fd)) == 0 ? 0 : -errno;
}

int fs_fallocate(const char*, int mode, off_t off, off_t len, fuse_file_info* fi) {
  if (fi->fh == kCtlFh) return -EOPNOTSUPP;
  return ::fallocate(static_cast<int>(fi->fh), mode, off, len) == 0 ? 0 : -errno;
}

int fs_truncate(const char* path, off_t size, fuse_file_info* fi) {
  if (std::strcmp(path, kCtl) == 0) return 0;  // `echo ... >` truncates first
  if (fi != nullptr) return ::ftruncate(static_cast<int>(fi->fh), size) == 0 ? 0 : -errno;
  base::UniqueFd fd(::openat(g_dir, rel(path), O_WRONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!fd) return -errno;
  return ::ftruncate(fd.get(), size) == 0 ? 0 : -errno;
}

int fs_statfs(const char*, struct statvfs* st) { return ::fstatvfs(g_dir, st) == 0 ? 0 : -errno; }

void* fs_init(fuse_conn_info* conn, fuse_config* cfg) {
  conn->max_write = 1u << 20;  // the kernel caps it at its max_pages: fewer, larger requests
  cfg->direct_io = 1;
  cfg->use_ino = 1;
  cfg->attr_timeout = 0;
  cfg->entry_timeout = 0;
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 && !(argc == 5 && std::strcmp(argv[3], "--pidfile") == 0)) {
    std::fprintf(stderr, "usage: ibnbd-soak-fs BACKING_DIR MOUNTPOINT [--pidfile FILE]\n");
    return 2;
  }
  g_dir = ::open(argv[1], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (g_dir < 0) {
    std::fprintf(stderr, "ibnbd-soak-fs: %s: %s\n", argv[1], std::strerror(errno));
    return 1;
  }
  if (argc == 5) {
    FILE* f = std::fopen(argv[4], "w");
    if (f == nullptr) return 1;
    std::fprintf(f, "%d\n", ::getpid());
    std::fclose(f);
  }
  fuse_operations ops{};
  ops.getattr = fs_getattr;
  ops.readdir = fs_readdir;
  ops.open = fs_open;
  ops.release = fs_release;
  ops.read = fs_read;
  ops.write = fs_write;
  ops.fsync = fs_fsync;
  ops.fallocate = fs_fallocate;
  ops.truncate = fs_truncate;
  ops.statfs = fs_statfs;
  ops.init = fs_init;
  // Foreground, multithreaded; the mount is root's alone (no allow_other).
  std::vector<char*> fargs{argv[0], argv[2], const_cast<char*>("-f"), const_cast<char*>("-o"),
                           const_cast<char*>("fsname=ibnbd-soak-fs")};
  return fuse_main(static_cast<int>(fargs.size()), fargs.data(), &ops, nullptr);
}
