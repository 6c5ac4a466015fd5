// FUSE glue: libfuse3's high-level (path-based) API, driven by our own worker threads so that
// stopping is deterministic (an eventfd wakes every worker; libfuse's own loop would sit in
// read() until the next request).
#define FUSE_USE_VERSION 31
#include "sysfs/mount.h"

#include <fcntl.h>
#include <fuse.h>
#include <fuse_lowlevel.h>
#include <poll.h>
#include <spawn.h>
#include <sys/eventfd.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>

namespace sysfs {

namespace {

// sysfs shows every attribute as one page; readers (cat) read until EOF regardless.
constexpr off_t kAttrSize = 4096;
// The kernel passes at most a page minus one to store(); a longer write is not a control
// command.
constexpr size_t kMaxWrite = 4096;

struct OpenFile {
  NodePtr node;
  std::mutex mu;
  std::optional<std::string> content;  // produced by the read at offset 0
};

Mount* self() { return static_cast<Mount*>(fuse_get_context()->private_data); }

time_t g_mount_time = 0;

// Every callback: errors as -errno; an exception from a binding (a malformed daemon answer) is
// EIO, never a crash of the daemon.
template <typename F>
int guarded(F&& f) {
  try {
    return f();
  } catch (...) {
    return -EIO;
  }
}

Result<NodePtr> lookup(const char* path) { return resolve(self()->root(), path); }

int to_ret(std::error_code ec) { return -(ec.value() > 0 ? ec.value() : EIO); }

void* op_init(fuse_conn_info* conn, fuse_config* cfg) {
  (void)conn;
  cfg->entry_timeout = 0;
  cfg->attr_timeout = 0;
  cfg->negative_timeout = 0;
  cfg->direct_io = 1;
  cfg->kernel_cache = 0;
  cfg->use_ino = 0;
  return fuse_get_context()->private_data;
}

void fill_stat(const Node& n, struct stat* st) {
  std::memset(st, 0, sizeof(*st));
  if (n.kind() == Node::Kind::dir) {
    st->st_mode = S_IFDIR | 0755;
    st->st_nlink = 2;
  } else {
    st->st_mode = S_IFREG | n.mode();
    st->st_nlink = 1;
    st->st_size = kAttrSize;
  }
  st->st_uid = ::getuid();
  st->st_gid = ::getgid();
  st->st_atime = st->st_mtime = st->st_ctime = g_mount_time;
}

int op_getattr(const char* path, struct stat* st, fuse_file_info* fi) {
  (void)fi;
  return guarded([&] {
    auto n = lookup(path);
    if (!n) return to_ret(n.error());
    fill_stat(**n, st);
    return 0;
  });
}

int op_readdir(const char* path, void* buf, fuse_fill_dir_t filler, off_t off, fuse_file_info* fi,
               fuse_readdir_flags flags) {
  (void)off;
  (void)fi;
  (void)flags;
  return guarded([&] {
    auto n = lookup(path);
    if (!n) return to_ret(n.error());
    auto names = (*n)->list();
    if (!names) return to_ret(names.error());
    filler(buf, ".", nullptr, 0, static_cast<fuse_fill_dir_flags>(0));
    filler(buf, "..", nullptr, 0, static_cast<fuse_fill_dir_flags>(0));
    for (auto& name : *names) filler(buf, name.c_str(), nullptr, 0, static_cast<fuse_fill_dir_flags>(0));
    return 0;
  });
}

int op_open(const char* path, fuse_file_info* fi) {
  return guarded([&] {
    auto n = lookup(path);
    if (!n) return to_ret(n.error());
    const Node& node = **n;
    if (node.kind() == Node::Kind::dir) return -EISDIR;
    const int acc = fi->flags & O_ACCMODE;
    // kernfs refuses at open what the attribute lacks, even to root (who passes the mode bits).
    if ((acc == O_RDONLY || acc == O_RDWR) && !node.readable()) return -EACCES;
    if ((acc == O_WRONLY || acc == O_RDWR) && !node.writable()) return -EACCES;
    auto* f = new OpenFile{*n, {}, {}};
    fi->fh = reinterpret_cast<uint64_t>(f);
    fi->direct_io = 1;
    fi->keep_cache = 0;
    return 0;
  });
}

int op_read(const char* path, char* buf, size_t size, off_t off, fuse_file_info* fi) {
  (void)path;
  return guarded([&] {
    auto* f = reinterpret_cast<OpenFile*>(fi->fh);
    std::lock_guard l(f->mu);
    if (off == 0 || !f->content) {
      auto c = f->node->read();
      if (!c) return to_ret(c.error());
      f->content = std::move(*c);
    }
    const std::string& c = *f->content;
    if (off < 0 || static_cast<size_t>(off) >= c.size()) return 0;
    const size_t n = std::min(size, c.size() - static_cast<size_t>(off));
    std::memcpy(buf, c.data() + off, n);
    return static_cast<int>(n);
  });
}

int op_write(const char* path, const char* buf, size_t size, off_t off, fuse_file_info* fi) {
  (void)path;
  (void)off;  // sysfs ignores the offset of a store
  return guarded([&] {
    if (size > kMaxWrite) return -EINVAL;
    auto* f = reinterpret_cast<OpenFile*>(fi->fh);
    auto st = f->node->write(std::string_view(buf, size));
    if (!st.ok()) return to_ret(st.error());
    return static_cast<int>(size);
  });
}

// `echo x > file` opens with O_TRUNC: nothing to truncate, as on sysfs.
int op_truncate(const char* path, off_t size, fuse_file_info* fi) {
  (void)size;
  (void)fi;
  return guarded([&] {
    auto n = lookup(path);
    if (!n) return to_ret(n.error());
    if ((*n)->kind() == Node::Kind::dir) return -EISDIR;
    return (*n)->writable() ? 0 : -EACCES;
  });
}

int op_release(const char* path, fuse_file_info* fi) {
  (void)path;
  delete reinterpret_cast<OpenFile*>(fi->fh);
  return 0;
}

bool allow_other_allowed() {
  if (::geteuid() == 0) return true;
  std::ifstream in("/etc/fuse.conf");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("user_allow_other", 0) == 0) return true;
  return false;
}

std::optional<std::string> find_in_path(const char* prog) {
  const char* p = std::getenv("PATH");
  std::string path = p ? p : "/usr/bin:/bin";
  size_t b = 0;
  while (b <= path.size()) {
    const size_t e = std::min(path.find(':', b), path.size());
    std::string cand = path.substr(b, e - b) + "/" + prog;
    if (::access(cand.c_str(), X_OK) == 0) return cand;
    b = e + 1;
  }
  return std::nullopt;
}

// fusermount3 -uz DIR: detaches a mount whose daemon is gone.
bool lazy_unmount(const std::string& dir) {
  if (auto prog = find_in_path("fusermount3")) {
    const char* argv[] = {prog->c_str(), "-u", "-z", "--", dir.c_str(), nullptr};
    pid_t pid = 0;
    if (::posix_spawn(&pid, prog->c_str(), nullptr, nullptr, const_cast<char* const*>(argv), environ) == 0) {
      int status = 0;
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return true;
    }
  }
  return ::geteuid() == 0 && ::umount2(dir.c_str(), MNT_DETACH) == 0;
}

// A stale mount is cleaned; a live one (another daemon serves it) is EBUSY.
Status prepare_dir(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    if (errno == ENOTCONN) {
      if (!lazy_unmount(dir)) return errc(EBUSY);
      if (::stat(dir.c_str(), &st) != 0) return errc(errno);
    } else if (errno != ENOENT) {
      return errc(errno);
    }
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return ec;
  struct stat parent {};
  if (::stat(dir.c_str(), &st) != 0 || ::stat((dir + "/..").c_str(), &parent) != 0) return errc(errno);
  if (!S_ISDIR(st.st_mode)) return errc(ENOTDIR);
  if (st.st_dev != parent.st_dev) return errc(EBUSY);  // something is mounted there and alive
  return {};
}

}  // namespace

std::string fuse_unavailable_reason() {
  if (::access("/dev/fuse", R_OK | W_OK) != 0) return std::string("/dev/fuse: ") + std::strerror(errno);
  if (!find_in_path("fusermount3")) return "fusermount3 is not on PATH (Debian: apt-get install fuse3)";
  return "";
}

Result<std::unique_ptr<Mount>> mount_for_daemon(NodePtr root, const std::string& dir, const std::string& who) {
  if (auto why = fuse_unavailable_reason(); !why.empty()) {
    std::fprintf(stderr, "%s: sysfs tree at %s is off: %s\n", who.c_str(), dir.c_str(), why.c_str());
    return std::unique_ptr<Mount>();
  }
  MountOptions o;
  o.fsname = who;
  auto m = Mount::create(std::move(root), dir, o);
  if (m) std::fprintf(stderr, "%s: sysfs tree mounted at %s\n", who.c_str(), (*m)->dir().c_str());
  return m;
}

Mount::Mount(NodePtr root, std::string dir) : root_(std::move(root)), dir_(std::move(dir)) {}

Result<std::unique_ptr<Mount>> Mount::create(NodePtr root, const std::string& dir, MountOptions o) {
  if (::access("/dev/fuse", R_OK | W_OK) != 0) return errc(ENODEV);
  if (dir.empty() || o.threads == 0) return errc(EINVAL);
  BASE_TRY(prepare_dir(dir));
  std::unique_ptr<Mount> m(new Mount(std::move(root), std::filesystem::absolute(dir).lexically_normal().string()));
  if (g_mount_time == 0) g_mount_time = std::time(nullptr);

  static const fuse_operations ops = [] {
    fuse_operations x{};
    x.init = op_init;
    x.getattr = op_getattr;
    x.readdir = op_readdir;
    x.open = op_open;
    x.read = op_read;
    x.write = op_write;
    x.truncate = op_truncate;
    x.release = op_release;
    return x;
  }();
  std::string opts = "default_permissions,fsname=" + o.fsname + ",subtype=ibnbd";
  if (allow_other_allowed()) opts += ",allow_other";
  std::string prog = "ibnbd-sysfs", dash_o = "-o";
  char* argv[] = {prog.data(), dash_o.data(), opts.data(), nullptr};
  fuse_args args = FUSE_ARGS_INIT(3, argv);
  m->fuse_ = fuse_new(&args, &ops, sizeof(ops), m.get());
  fuse_opt_free_args(&args);
  if (m->fuse_ == nullptr) return errc(EINVAL);
  if (fuse_mount(m->fuse_, m->dir_.c_str()) != 0) {
    const int e = errno ? errno : EIO;
    fuse_destroy(m->fuse_);
    m->fuse_ = nullptr;
    return errc(e);
  }
  // Non-blocking: several workers wake for one request; the losers see EAGAIN and poll again.
  const int fd = fuse_session_fd(fuse_get_session(m->fuse_));
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  m->stop_fd_.reset(::eventfd(0, EFD_CLOEXEC));
  if (!m->stop_fd_) return errc(errno);  // the destructor unmounts
  for (unsigned i = 0; i < o.threads; ++i) m->threads_.emplace_back([p = m.get()] { p->worker(); });
  return m;
}

void Mount::worker() {
  fuse_session* se = fuse_get_session(fuse_);
  const int fd = fuse_session_fd(se);
  fuse_buf buf{};
  while (!stop_.load() && !fuse_session_exited(se)) {
    pollfd p[2] = {{fd, POLLIN, 0}, {stop_fd_.get(), POLLIN, 0}};
    if (::poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (p[1].revents != 0) break;
    if ((p[0].revents & (POLLERR | POLLHUP | POLLNVAL)) != 0) break;  // unmounted from outside
    const int n = fuse_session_receive_buf(se, &buf);
    if (n == -EAGAIN || n == -EINTR || n == 0) continue;
    if (n < 0) break;
    fuse_session_process_buf(se, &buf);
  }
  std::free(buf.mem);
}

Mount::~Mount() {
  stop_.store(true);
  if (stop_fd_) {
    const uint64_t one = 1;
    (void)!::write(stop_fd_.get(), &one, sizeof(one));  // stays readable: wakes every worker
  }
  for (auto& t : threads_) t.join();
  if (fuse_ != nullptr) {
    fuse_unmount(fuse_);  // closes the channel first: requests still queued get ENOTCONN
    fuse_destroy(fuse_);
  }
  stop_fd_.reset();  // last, as before: the workers poll it until they are joined
}

}  // namespace sysfs
