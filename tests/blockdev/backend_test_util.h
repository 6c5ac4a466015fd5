// Helpers of the backend tests: scratch directories on chosen filesystems, aligned buffers,
// reproducible byte patterns and a synchronous wrapper around the IO engine.
#pragma once

#include <fcntl.h>
#include <ftw.h>
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "base/pattern.h"
#include "ibnbd/backend.h"

namespace ibnbd::test {

// A directory removed with everything in it at scope exit.
class TempDir {
 public:
  static std::optional<TempDir> make(const std::string& base) {
    std::string tmpl = base + "/ibnbd-backend-XXXXXX";
    if (!::mkdtemp(tmpl.data())) return std::nullopt;
    return TempDir(std::move(tmpl));
  }
  TempDir(TempDir&& o) noexcept : path_(std::move(o.path_)) { o.path_.clear(); }
  TempDir& operator=(TempDir&& o) noexcept {
    if (this != &o) {
      remove_all();
      path_ = std::move(o.path_);
      o.path_.clear();
    }
    return *this;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() { remove_all(); }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  explicit TempDir(std::string p) : path_(std::move(p)) {}
  void remove_all() {
    if (path_.empty()) return;
    ::nftw(
        path_.c_str(),
        [](const char* p, const struct stat*, int, FTW*) {
          (void)::remove(p);  // best effort: a leftover scratch file is not a test failure
          return 0;
        },
        16, FTW_DEPTH | FTW_PHYS);
  }
  std::string path_;
};

inline bool is_tmpfs(const std::string& dir) {
  struct statfs sf {};
  return ::statfs(dir.c_str(), &sf) == 0 && sf.f_type == TMPFS_MAGIC;
}

// A directory whose filesystem takes O_DIRECT for real (statx reports an alignment), or empty.
inline std::string find_direct_io_dir() {
  for (const char* d : {"/var/tmp", "/tmp", "/work"}) {
    if (is_tmpfs(d)) continue;
    std::string f = std::string(d) + "/.ibnbd-odirect-probe-" + std::to_string(::getpid());
    int fd = ::open(f.c_str(), O_CREAT | O_RDWR | O_DIRECT | O_CLOEXEC, 0600);
    if (fd < 0) continue;
    struct statx sx {};
    bool ok = ::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 &&
              (sx.stx_mask & STATX_DIOALIGN) && sx.stx_dio_offset_align != 0;
    ::close(fd);
    ::unlink(f.c_str());
    if (ok) return d;
  }
  return {};
}

// Creates (or resizes) a sparse file of `size` bytes.
inline bool make_file(const std::string& path, uint64_t size) {
  int fd = ::open(path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  bool ok = ::ftruncate(fd, static_cast<off_t>(size)) == 0;
  ::close(fd);
  return ok;
}

inline uint64_t st_blocks(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_blocks) : ~0ull;
}

// Page-aligned memory (O_DIRECT wants the buffer aligned; the transport's chunks are).
struct AlignedBuf {
  explicit AlignedBuf(size_t n)
      : size(n), p(static_cast<std::byte*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096))) {
    std::memset(p.get(), 0, size);
  }
  std::span<std::byte> span() { return {p.get(), size}; }
  std::span<std::byte> sub(size_t off, size_t n) { return {p.get() + off, n}; }
  std::byte* data() { return p.get(); }
  struct Free {
    void operator()(std::byte* b) const { std::free(b); }
  };
  size_t size;
  std::unique_ptr<std::byte, Free> p;
};

// The test pattern (base/pattern.h): the byte at device offset `off` of pattern `seed` is a
// function of both, so any range can be checked without keeping what was written.
inline std::byte pattern_byte(uint64_t seed, uint64_t off) { return base::Pattern(seed).byte(off); }
inline void fill_pattern(std::span<std::byte> b, uint64_t seed, uint64_t dev_off) {
  base::fill_pattern(b, seed, dev_off);
}
// Index of the first byte that differs from the pattern, or -1.
inline int64_t check_pattern(std::span<const std::byte> b, uint64_t seed, uint64_t dev_off) {
  return base::check_pattern(b, seed, dev_off);
}
inline bool all_zero(std::span<const std::byte> b) {
  for (std::byte x : b)
    if (x != std::byte{0}) return false;
  return true;
}

// `b` holds the device from offset 0, written with pattern `seed`, then some ranges zeroed
// (discard, write-zeroes): expects zeros in each {offset, length} of `zeroed` (ascending) and the
// pattern everywhere else.
inline void expect_zeroed_ranges(std::span<const std::byte> b, uint64_t seed,
                                 std::initializer_list<std::pair<uint64_t, uint64_t>> zeroed) {
  uint64_t at = 0;
  for (auto [off, len] : zeroed) {
    EXPECT_EQ(check_pattern(b.subspan(at, off - at), seed, at), -1) << "data before " << off;
    EXPECT_TRUE(all_zero(b.subspan(off, len))) << "zeros at " << off << " + " << len;
    at = off + len;
  }
  EXPECT_EQ(check_pattern(b.subspan(at), seed, at), -1) << "data after " << at;
}

// A scratch file in a fresh directory, the backend under test (opened on the file itself or on
// a device built over it) and an engine. The helpers return "" or why the test cannot run.
struct Rig {
  std::optional<TempDir> dir;
  std::string path;  // the scratch file
  std::unique_ptr<Backend> be;
  std::unique_ptr<IoEngine> eng;

  std::string make_file_in(const std::string& base, uint64_t size) {
    dir = TempDir::make(base);
    if (!dir) return "cannot create a directory in " + base;
    path = *dir / "disk.img";
    return make_file(path, size) ? "" : "cannot create " + path;
  }
  std::string open(const std::string& dev, const OpenOptions& o, uint32_t depth) {
    auto b = Backend::open_path(dev, o);
    if (!b) return "open " + dev + ": " + b.error().message();
    be = std::move(*b);
    auto e = IoEngine::create({depth});
    if (!e) return "io_uring: " + e.error().message();
    eng = std::move(*e);
    return {};
  }
};

// Runs one request to its callback. Returns the submit error, or the completion's errno.
inline int run_io(IoEngine& e, BackendRequest r) {
  struct Box {
    bool done = false;
    int err = -1;
  } box;
  r.done = [](void* ctx, int err) {
    auto* b = static_cast<Box*>(ctx);
    b->done = true;
    b->err = err;
  };
  r.ctx = &box;
  if (Status s = e.submit(r); !s.ok()) return s.error().value();
  if (!e.kick().ok()) return -1;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!box.done && std::chrono::steady_clock::now() < deadline)
    (void)e.wait(std::chrono::milliseconds(100));
  return box.done ? box.err : -2;  // -2: timed out (the test fails on it)
}

inline BackendRequest rw(Backend& b, IoOp op, uint64_t off, std::span<std::byte> buf,
                    uint32_t flags = 0) {
  BackendRequest r;
  r.backend = &b;
  r.op = op;
  r.flags = flags;
  r.offset = off;
  r.len = static_cast<uint32_t>(buf.size());
  r.buf = buf;
  return r;
}
inline BackendRequest range_op(Backend& b, IoOp op, uint64_t off, uint32_t len, uint32_t flags = 0) {
  BackendRequest r;
  r.backend = &b;
  r.op = op;
  r.flags = flags;
  r.offset = off;
  r.len = len;
  return r;
}

}  // namespace ibnbd::test
