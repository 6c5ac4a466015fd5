// A node tree (sysfs/node.h) served as a FUSE filesystem (libfuse3, high-level API) by worker
// threads of its own. RAII: the tree is mounted for the life of the Mount.
//
// How it behaves like sysfs
//   - Attribute files show size 4096 and are opened direct_io: every read goes to the callback,
//     nothing is cached; the content is produced by the read at offset 0 and served from the open
//     file after that (a reader sees one consistent snapshot).
//   - Every write() is one store(): its bytes go to the write callback, and write() returns when
//     the callback has (blocking actions included) with its errno. O_TRUNC is accepted.
//   - Entries are never cached by the kernel (entry, attribute and negative timeouts 0), so
//     sessions, paths and devices appear and disappear as the daemon's state changes.
//   - Mounted with default_permissions (the modes are enforced by the kernel) and allow_other
//     when allowed (root, or user_allow_other in /etc/fuse.conf).
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/unique_fd.h"
#include "sysfs/node.h"

struct fuse;

namespace sysfs {

struct MountOptions {
  std::string fsname = "ibnbd-sysfs";  // the source column of /proc/mounts
  // FUSE worker threads. A blocking write (reconnect, map_device) holds one for its duration;
  // the others keep serving reads.
  unsigned threads = 4;
};

// Why FUSE cannot be used on this machine (no /dev/fuse, no fusermount3 on PATH), or "".
std::string fuse_unavailable_reason();

class Mount {
 public:
  // Mounts `root` at `dir` (created, with its parents, when missing). A stale FUSE mount left
  // there by a daemon that died (ENOTCONN) is lazily unmounted first (fusermount3 -uz); a live
  // mount there is EBUSY. Errors: ENODEV (no /dev/fuse), EBUSY, what mkdir and mount return
  // (EIO when libfuse does not say).
  // Call from a thread that ignores or blocks the signals the daemon waits for: the workers
  // inherit its signal mask.
  static Result<std::unique_ptr<Mount>> create(NodePtr root, const std::string& dir,
                                               MountOptions options = {});
  // Stops the workers (waits for the callbacks running), then unmounts (lazily: a process that
  // still holds a file open gets ENOTCONN). No stale mount is left behind.
  ~Mount();
  Mount(const Mount&) = delete;
  Mount& operator=(const Mount&) = delete;

  const std::string& dir() const { return dir_; }
  const NodePtr& root() const { return root_; }

 private:
  Mount(NodePtr root, std::string dir);
  void worker();

  NodePtr root_;
  std::string dir_;
  struct fuse* fuse_ = nullptr;
  base::UniqueFd stop_fd_;  // an eventfd: readable once ~Mount began
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

// For the daemons' --sysfs-dir: mounts `root` at `dir`. When FUSE is missing on this machine
// it says so once on stderr ("<who>: sysfs tree at DIR is off: <why>") and returns nullptr, and
// the daemon runs on without its tree; any other failure is returned.
Result<std::unique_ptr<Mount>> mount_for_daemon(NodePtr root, const std::string& dir, const std::string& who);

}  // namespace sysfs
