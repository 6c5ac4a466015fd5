// A migration-image Volume over an NBD export on a unix socket: how the agent uses a device that
// a client daemon already holds (`ibnbd client device export DEV unix SOCK`). The daemon's
// mapping is what the server counts, so a hypervisor holding a volume rw and the destination
// holding it in migration mode can both run the agent without a third opener, which the access
// rules would refuse.
//
// One connection, fixed newstyle, NBD_OPT_GO, simple replies only (the export's reads come back
// as one block: no structured replies to reassemble). Requests are pipelined; a reader thread
// matches replies to requests by handle and runs their completions.
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "base/unique_fd.h"
#include "base/unix_socket.h"
#include "ibnbd/migrate_volume.h"
#include "ibnbd/nbd_proto.h"

namespace ibnbd::migrate {
namespace {

namespace w = ibnbd::nbd::wire;
using ibtrs::errc;

// The handshake is bounded: a socket that accepts and never answers must not hang the agent.
constexpr int kHandshakeTimeoutMs = 10000;

class HeapBuffer final : public IoBuffer {
 public:
  HeapBuffer(std::byte* p, size_t n) : p_(p), n_(n) {}
  ~HeapBuffer() override { std::free(p_); }
  std::byte* data() const override { return p_; }
  size_t size() const override { return n_; }

 private:
  std::byte* p_;
  size_t n_;
};

Status read_full(int fd, void* p, size_t n, int timeout_ms) {
  auto* b = static_cast<char*>(p);
  while (n > 0) {
    if (timeout_ms >= 0) {
      pollfd pf{fd, POLLIN, 0};
      int r = ::poll(&pf, 1, timeout_ms);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return errc(errno);
      if (r == 0) return errc(ETIMEDOUT);
    }
    ssize_t k = ::recv(fd, b, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return errc(errno);
    if (k == 0) return errc(ECONNRESET);
    b += k;
    n -= static_cast<size_t>(k);
  }
  return {};
}

Status send_full(int fd, iovec* iov, int cnt) {
  while (cnt > 0) {
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = static_cast<size_t>(cnt);
    ssize_t k = ::sendmsg(fd, &m, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return errc(errno);
    auto left = static_cast<size_t>(k);
    while (cnt > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --cnt;
    }
    if (cnt > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return {};
}

int errno_of(uint32_t nbd_err) {
  switch (nbd_err) {
    case w::kEperm: return EPERM;
    case w::kEnomem: return ENOMEM;
    case w::kEinval: return EINVAL;
    case w::kEnospc: return ENOSPC;
    case w::kEoverflow: return EOVERFLOW;
    case w::kEnotsup: return ENOTSUP;
    case w::kEshutdown: return ESHUTDOWN;
    default: return EIO;
  }
}

class NbdVolume final : public Volume {
 public:
  ~NbdVolume() override {
    {
      std::lock_guard lk(send_mu_);
      w::Request r{};
      r.magic.set(w::kRequestMagic);
      r.type.set(w::kCmdDisc);
      iovec v{&r, sizeof r};
      (void)send_full(fd_.get(), &v, 1);
    }
    ::shutdown(fd_.get(), SHUT_RDWR);
    if (reader_.joinable()) reader_.join();
    fd_.reset();  // after the reader, which reads it, has gone
  }

  static Result<std::unique_ptr<Volume>> connect(const std::string& path, const std::string& name) {
    auto c = base::unix_connect(path);
    if (!c) return c.error();
    std::unique_ptr<NbdVolume> v(new NbdVolume(base::UniqueFd(*c)));
    BASE_TRY(v->handshake(name));
    v->reader_ = std::thread([p = v.get()] { p->read_replies(); });
    return std::unique_ptr<Volume>(std::move(v));
  }

  uint64_t size() const override { return size_; }
  // 4 KiB: the image format's own block, and a multiple of any export's minimum block.
  uint32_t block_size() const override { return 4096; }

  Result<std::unique_ptr<IoBuffer>> alloc(size_t bytes) override {
    const size_t n = (bytes + 4095) / 4096 * 4096;
    void* p = std::aligned_alloc(4096, n == 0 ? 4096 : n);
    if (p == nullptr) return errc(ENOMEM);
    return std::unique_ptr<IoBuffer>(new HeapBuffer(static_cast<std::byte*>(p), bytes));
  }

  Status write(const IoBuffer& buf, size_t buf_off, uint64_t off, size_t len, bool fua,
               VolumeDone done) override {
    if (read_only_) return errc(EPERM);
    BASE_TRY(check(buf, buf_off, off, len));
    const uint16_t flags = fua && (tx_flags_ & w::kTxSendFua) ? w::kCmdFlagFua : 0;
    return submit(w::kCmdWrite, flags, off, len, nullptr, buf.data() + buf_off, done);
  }
  Status read(const IoBuffer& buf, size_t buf_off, uint64_t off, size_t len, VolumeDone done) override {
    BASE_TRY(check(buf, buf_off, off, len));
    return submit(w::kCmdRead, 0, off, len, buf.data() + buf_off, nullptr, done);
  }
  Status flush(VolumeDone done) override {
    if (!(tx_flags_ & w::kTxSendFlush)) {
      // An export without FLUSH has nothing to make stable (the spec: writes are durable).
      done.fn(done.ctx, 0);
      return {};
    }
    return submit(w::kCmdFlush, 0, 0, 0, nullptr, nullptr, done);
  }

 private:
  explicit NbdVolume(base::UniqueFd fd) : fd_(std::move(fd)) {}

  struct Pending {
    std::byte* read_into = nullptr;  // READ: where the reply's data goes
    uint32_t len = 0;
    VolumeDone done;
  };

  Status check(const IoBuffer& buf, size_t buf_off, uint64_t off, size_t len) const {
    if (buf_off > buf.size() || len > buf.size() - buf_off || len > (32u << 20) || off > size_ ||
        len > size_ - off)
      return errc(EINVAL);
    return {};
  }

  Status handshake(const std::string& name) {
    w::ServerGreeting g;
    BASE_TRY(read_full(fd_.get(), &g, sizeof g, kHandshakeTimeoutMs));
    if (g.nbd_magic.get() != w::kNbdMagic || g.opt_magic.get() != w::kOptMagic ||
        !(g.flags.get() & w::kFlagFixedNewstyle))
      return errc(EPROTO);
    w::be32 cflags;
    cflags.set(w::kClientFixedNewstyle | ((g.flags.get() & w::kFlagNoZeroes) ? w::kClientNoZeroes : 0));
    // NBD_OPT_GO: name length, name, no information requests.
    w::OptionHdr h;
    h.magic.set(w::kOptMagic);
    h.option.set(w::kOptGo);
    h.length.set(static_cast<uint32_t>(4 + name.size() + 2));
    w::be32 nlen;
    nlen.set(static_cast<uint32_t>(name.size()));
    w::be16 ninfo;
    ninfo.set(0);
    iovec iov[] = {{&cflags, sizeof cflags}, {&h, sizeof h}, {&nlen, sizeof nlen},
                   {const_cast<char*>(name.data()), name.size()}, {&ninfo, sizeof ninfo}};
    BASE_TRY(send_full(fd_.get(), iov, 5));
    bool have_export = false;
    for (int replies = 0; replies < 64; ++replies) {
      w::OptionReplyHdr r;
      BASE_TRY(read_full(fd_.get(), &r, sizeof r, kHandshakeTimeoutMs));
      if (r.magic.get() != w::kRepMagic || r.option.get() != w::kOptGo || r.length.get() > 65536)
        return errc(EPROTO);
      std::string data(r.length.get(), '\0');
      BASE_TRY(read_full(fd_.get(), data.data(), data.size(), kHandshakeTimeoutMs));
      const uint32_t type = r.type.get();
      if (type == w::kRepAck) {
        if (!have_export) return errc(EPROTO);
        return {};
      }
      if (type & 0x80000000u) return errc(type == w::kRepErrUnknown ? ENOENT : EPROTO);
      if (type == w::kRepInfo && data.size() >= sizeof(w::InfoExport)) {
        w::InfoExport e;
        std::memcpy(&e, data.data(), sizeof e);
        if (e.type.get() == w::kInfoExport) {
          size_ = e.size.get();
          tx_flags_ = e.flags.get();
          read_only_ = (tx_flags_ & w::kTxReadOnly) != 0;
          have_export = true;
        }
      }
    }
    return errc(EPROTO);
  }

  Status submit(uint16_t type, uint16_t flags, uint64_t off, size_t len, std::byte* read_into,
                const std::byte* write_from, VolumeDone done) {
    uint64_t handle;
    {
      std::lock_guard lk(mu_);
      if (broken_) return errc(ENOTCONN);
      handle = next_handle_++;
      pending_[handle] = Pending{read_into, static_cast<uint32_t>(len), done};
    }
    w::Request r{};
    r.magic.set(w::kRequestMagic);
    r.flags.set(flags);
    r.type.set(type);
    r.handle.set(handle);
    r.offset.set(off);
    r.length.set(static_cast<uint32_t>(len));
    iovec iov[] = {{&r, sizeof r}, {const_cast<std::byte*>(write_from), write_from ? len : 0}};
    Status s;
    {
      std::lock_guard lk(send_mu_);
      s = send_full(fd_.get(), iov, write_from ? 2 : 1);
    }
    if (s) return {};
    // Not sent whole: the request never runs done unless the reader already failed it (then
    // it has run, and this submit counts as accepted).
    std::lock_guard lk(mu_);
    if (pending_.erase(handle) == 0) return {};
    return s;
  }

  void read_replies() {
    int fail_with = ECONNRESET;
    for (;;) {
      w::SimpleReply rep;
      if (!read_full(fd_.get(), &rep, sizeof rep, -1)) break;
      if (rep.magic.get() != w::kSimpleReplyMagic) {
        fail_with = EPROTO;
        break;
      }
      Pending p;
      {
        std::lock_guard lk(mu_);
        auto it = pending_.find(rep.handle.get());
        if (it == pending_.end()) {
          fail_with = EPROTO;
          break;
        }
        p = it->second;
        pending_.erase(it);
      }
      const uint32_t e = rep.error.get();
      if (e == 0 && p.read_into != nullptr && !read_full(fd_.get(), p.read_into, p.len, -1)) {
        p.done.fn(p.done.ctx, EIO);
        break;
      }
      p.done.fn(p.done.ctx, e == 0 ? 0 : errno_of(e));
    }
    std::map<uint64_t, Pending> left;
    {
      std::lock_guard lk(mu_);
      broken_ = true;
      left.swap(pending_);
    }
    for (auto& [h, p] : left) p.done.fn(p.done.ctx, fail_with);
  }

  base::UniqueFd fd_;
  uint64_t size_ = 0;
  uint16_t tx_flags_ = 0;
  bool read_only_ = false;
  std::mutex send_mu_;  // one request's header and data go out together
  std::mutex mu_;       // pending_, next_handle_, broken_
  std::map<uint64_t, Pending> pending_;
  uint64_t next_handle_ = 1;
  bool broken_ = false;
  std::thread reader_;
};

}  // namespace

Result<std::unique_ptr<Volume>> nbd_volume(const std::string& socket_path, const std::string& export_name) {
  if (export_name.empty() || export_name.size() > 4096) return errc(EINVAL);
  return NbdVolume::connect(socket_path, export_name);
}

}  // namespace ibnbd::migrate
