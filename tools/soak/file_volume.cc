#include "file_volume.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "base/unique_fd.h"

namespace ibnbd::soak {
namespace {

using ibtrs::errc;
using ibtrs::Result;
using ibtrs::Status;

class AlignedBuffer final : public migrate::IoBuffer {
 public:
  AlignedBuffer(std::byte* p, size_t n) : p_(p), n_(n) {}
  ~AlignedBuffer() override { std::free(p_); }
  std::byte* data() const override { return p_; }
  size_t size() const override { return n_; }

 private:
  std::byte* p_;
  size_t n_;
};

class FileVolume final : public migrate::Volume {
 public:
  FileVolume(base::UniqueFd fd, uint64_t size, uint32_t logical, unsigned threads)
      : fd_(std::move(fd)), size_(size), logical_(logical) {
    for (unsigned i = 0; i < threads; ++i) workers_.emplace_back([this] { run(); });
  }
  ~FileVolume() override {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    fd_.reset();  // once no worker can use it
  }

  uint64_t size() const override { return size_; }
  uint32_t block_size() const override { return logical_; }
  Result<std::unique_ptr<migrate::IoBuffer>> alloc(size_t bytes) override {
    const size_t n = (bytes + 4095) / 4096 * 4096;
    void* p = std::aligned_alloc(4096, n == 0 ? 4096 : n);
    if (p == nullptr) return errc(ENOMEM);
    return std::unique_ptr<migrate::IoBuffer>(new AlignedBuffer(static_cast<std::byte*>(p), bytes));
  }
  Status write(const migrate::IoBuffer& buf, size_t buf_off, uint64_t off, size_t len, bool fua,
               migrate::VolumeDone done) override {
    BASE_TRY(check(buf, buf_off, off, len));
    return queue(Op{Op::write, fua, buf.data() + buf_off, off, len, done});
  }
  Status read(const migrate::IoBuffer& buf, size_t buf_off, uint64_t off, size_t len,
              migrate::VolumeDone done) override {
    BASE_TRY(check(buf, buf_off, off, len));
    return queue(Op{Op::read, false, buf.data() + buf_off, off, len, done});
  }
  Status flush(migrate::VolumeDone done) override { return queue(Op{Op::flush, false, nullptr, 0, 0, done}); }

 private:
  struct Op {
    enum Kind { read, write, flush } kind;
    bool fua;
    std::byte* p;
    uint64_t off;
    size_t len;
    migrate::VolumeDone done;
  };

  Status check(const migrate::IoBuffer& buf, size_t buf_off, uint64_t off, size_t len) const {
    if (buf_off > buf.size() || len > buf.size() - buf_off || len == 0 || off > size_ || len > size_ - off ||
        off % logical_ != 0 || len % logical_ != 0)
      return errc(EINVAL);
    return {};
  }
  Status queue(Op op) {
    {
      std::lock_guard lk(mu_);
      if (stop_) return errc(ESHUTDOWN);
      q_.push_back(op);
    }
    cv_.notify_one();
    return {};
  }
  void run() {
    for (;;) {
      Op op;
      {
        std::unique_lock lk(mu_);
        cv_.wait(lk, [this] { return stop_ || !q_.empty(); });
        if (q_.empty()) return;
        op = q_.front();
        q_.pop_front();
      }
      op.done.fn(op.done.ctx, execute(op));
    }
  }
  int execute(const Op& op) const {
    if (op.kind == Op::flush) return ::fdatasync(fd_.get()) == 0 ? 0 : errno;
    size_t done = 0;
    while (done < op.len) {
      iovec v{op.p + done, op.len - done};
      const auto at = static_cast<off_t>(op.off + done);
      ssize_t n = op.kind == Op::read ? ::preadv2(fd_.get(), &v, 1, at, 0)
                                      : ::pwritev2(fd_.get(), &v, 1, at, op.fua ? RWF_DSYNC : 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return errno;
      if (n == 0) return EIO;  // end of the device inside the range: never zeros
      done += static_cast<size_t>(n);
    }
    return 0;
  }

  base::UniqueFd fd_;
  uint64_t size_;
  uint32_t logical_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> q_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

ibtrs::Result<std::unique_ptr<migrate::Volume>> file_volume(const std::string& path, unsigned threads,
                                                            uint32_t* logical_block) {
  base::UniqueFd fd(::open(path.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC));
  if (!fd) return errc(errno);
  struct stat st {};
  uint64_t size = 0;
  uint32_t logical = 512;
  if (::fstat(fd.get(), &st) != 0) return errc(errno);
  if (S_ISBLK(st.st_mode)) {
    int ss = 0;
    if (::ioctl(fd.get(), BLKGETSIZE64, &size) != 0 || ::ioctl(fd.get(), BLKSSZGET, &ss) != 0)
      return errc(errno);
    logical = static_cast<uint32_t>(ss);
  } else {
    size = static_cast<uint64_t>(st.st_size);
  }
  size -= size % 4096;
  if (size == 0) return errc(EINVAL);
  if (logical_block != nullptr) *logical_block = logical;
  return std::unique_ptr<migrate::Volume>(new FileVolume(std::move(fd), size, logical, threads == 0 ? 4 : threads));
}

}  // namespace ibnbd::soak
