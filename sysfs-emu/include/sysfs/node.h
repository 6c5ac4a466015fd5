// The attribute tree that sysfs-emu serves, without FUSE (so it is unit-tested as plain objects):
// directories with fixed children, dynamic directories whose entries come from a callback (the
// sessions, paths and devices of a daemon, which come and go), and attribute files with a read
// and a write callback (the kernel's show() and store()).
//
// Contract of the callbacks
//   - They run on the FUSE worker threads (fuse/mount.h), several at once: they must be
//     thread-safe. They may block (a write that reconnects a path returns when it is done, as
//     the kernel's store() does) but must not touch the mounted tree themselves.
//   - ReadFn returns the whole content of the file, produced when a reader opens it and reads
//     from offset 0 (as sysfs fills its page once per read from the start).
//   - WriteFn gets the bytes of one write() call (sysfs: one store() per write, newline
//     included) and returns success or the errno that write() reports, so
//     `echo x > file` fails in the shell with the kernel's error (EINVAL, EEXIST, ENOENT, EBUSY...).
//   - ListFn / MakeFn: the names in a dynamic directory, and the node of one of them (built on
//     each lookup, so it captures the name and asks the daemon again when read).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ibtrs/result.h"

namespace sysfs {

using ibtrs::errc;
using ibtrs::Result;
using ibtrs::Status;

class Node;
using NodePtr = std::shared_ptr<const Node>;

using ReadFn = std::function<Result<std::string>()>;
using WriteFn = std::function<Status(std::string_view data)>;
using ListFn = std::function<Result<std::vector<std::string>>()>;
using MakeFn = std::function<Result<NodePtr>(const std::string& name)>;

class Node {
 public:
  enum class Kind : uint8_t { dir, attr };

  // A directory with fixed children (add()).
  static std::shared_ptr<Node> dir();
  // An attribute file. A missing callback makes the file write-only or read-only: opening it
  // for what it lacks is EACCES (as kernfs refuses it at open, even for root). `mode` is what
  // stat shows: 0644 for read-write, 0444 read-only, 0200 write-only.
  static std::shared_ptr<Node> attr(uint32_t mode, ReadFn read, WriteFn write);
  static std::shared_ptr<Node> read_only(ReadFn read) { return attr(0444, std::move(read), nullptr); }
  // A directory listed by `list`; the child `name` (one that `list` returns) is `make(name)`.
  static std::shared_ptr<Node> dynamic_dir(ListFn list, MakeFn make);

  // Adds a fixed child to a dir(); replaces one of the same name. Not for dynamic dirs. Returns
  // *this to chain. Builders only: not once the tree is served.
  Node& add(const std::string& name, NodePtr child);

  Kind kind() const { return kind_; }
  uint32_t mode() const { return mode_; }
  bool readable() const { return static_cast<bool>(read_); }
  bool writable() const { return static_cast<bool>(write_); }

  // Entry names (ENOTDIR for an attribute; a dynamic directory's callback errors).
  Result<std::vector<std::string>> list() const;
  // One entry: ENOENT, ENOTDIR.
  Result<NodePtr> child(std::string_view name) const;
  // EISDIR for a directory, EACCES without a read / write callback.
  Result<std::string> read() const;
  Status write(std::string_view data) const;

 private:
  Node() = default;
  Kind kind_ = Kind::dir;
  uint32_t mode_ = 0755;
  std::map<std::string, NodePtr, std::less<>> children_;
  ListFn list_;
  MakeFn make_;
  ReadFn read_;
  WriteFn write_;
};

// The node at `path` ("/a/b", "a/b"; "" and "/" are the root). ENOENT, ENOTDIR.
Result<NodePtr> resolve(const NodePtr& root, std::string_view path);

}  // namespace sysfs
