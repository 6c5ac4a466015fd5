// UblkControl: ublk control commands as IORING_OP_URING_CMD on /dev/ublk-control. The driver
// refuses control commands in a 64-byte SQE (its payload, ublksrv_ctrl_cmd, is 32 bytes: more
// than the 16 bytes of cmd space a normal SQE has), so the ring uses IORING_SETUP_SQE128.
// liburing 2.3 has no io_uring_prep_uring_cmd: the SQE is filled by hand (devices.md).
#include <fcntl.h>
#include <liburing.h>

#include <cerrno>
#include <cstring>
#include <mutex>

#include "ibnbd/ublk.h"
#include "base/unique_fd.h"

#ifdef IBNBD_UBLK_UPDATE_SIZE
// Only for UBLK_U_CMD_UPDATE_SIZE (Linux 6.16); the rest is ibnbd/ublk_uapi.h's.
#include <linux/ublk_cmd.h>
static_assert(ibnbd::ublk::uapi::kFUpdateSize == UBLK_F_UPDATE_SIZE);
#endif

namespace ibnbd::ublk {

struct UblkControl::Impl {
  base::UniqueFd fd;
  io_uring ring{};
  bool ring_ready = false;
  std::mutex mu;  // one command at a time on the ring

  ~Impl() {
    if (ring_ready) io_uring_queue_exit(&ring);
  }

  // Sends one command and waits for its answer: the CQE's res (>= 0) or its negated errno.
  Result<int> run(uint32_t cmd_op, const uapi::ublksrv_ctrl_cmd& cmd) {
    std::lock_guard l(mu);
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    if (sqe == nullptr) return errc(EBUSY);  // cannot happen: one command at a time
    // The whole 128 bytes: liburing clears nothing, and the driver reads the second half.
    std::memset(static_cast<void*>(sqe), 0, 128);
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->fd = fd.get();
    sqe->cmd_op = cmd_op;
    static_assert(sizeof(cmd) <= 80, "ctrl cmd must fit the SQE128 cmd area");
    std::memcpy(sqe->cmd, &cmd, sizeof(cmd));
    int r = io_uring_submit(&ring);
    if (r < 0) return errc(-r);
    io_uring_cqe* cqe = nullptr;
    do {
      r = io_uring_wait_cqe(&ring, &cqe);
    } while (r == -EINTR);
    if (r < 0) return errc(-r);
    const int res = cqe->res;
    io_uring_cqe_seen(&ring, cqe);
    if (res < 0) return errc(-res);
    return res;
  }

  static uapi::ublksrv_ctrl_cmd header(uint32_t dev_id) {
    uapi::ublksrv_ctrl_cmd c{};
    c.dev_id = dev_id;
    c.queue_id = 0xffff;  // not a queue command
    return c;
  }
  Status simple(uint32_t op, uint32_t dev_id, uint64_t data0 = 0) {
    auto c = header(dev_id);
    c.data[0] = data0;
    auto r = run(op, c);
    if (!r.ok()) return r.error();
    return {};
  }
};

UblkControl::UblkControl(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
UblkControl::~UblkControl() = default;

Result<std::unique_ptr<UblkControl>> UblkControl::open(const std::string& path) {
  auto impl = std::make_unique<Impl>();
  impl->fd.reset(::open(path.c_str(), O_RDWR | O_CLOEXEC));
  if (!impl->fd) return errc(errno == ENOENT ? ENODEV : errno);
  // Four entries: commands go one at a time; the ring is small and cheap.
  int r = io_uring_queue_init(4, &impl->ring, IORING_SETUP_SQE128);
  if (r < 0) return errc(-r);
  impl->ring_ready = true;
  return std::unique_ptr<UblkControl>(new UblkControl(std::move(impl)));
}

Result<uint64_t> UblkControl::get_features() {
  uint64_t features = 0;
  auto c = Impl::header(0);
  c.addr = reinterpret_cast<uintptr_t>(&features);
  c.len = uapi::kFeaturesLen;
  auto r = impl_->run(uapi::kUCmdGetFeatures, c);
  if (!r.ok()) return r.error();
  return features;
}

Result<uapi::ublksrv_ctrl_dev_info> UblkControl::add_dev(const uapi::ublksrv_ctrl_dev_info& want) {
  uapi::ublksrv_ctrl_dev_info info = want;  // IN and OUT
  auto c = Impl::header(want.dev_id);       // the driver checks that both ids agree
  c.addr = reinterpret_cast<uintptr_t>(&info);
  c.len = sizeof(info);
  auto r = impl_->run(uapi::kUCmdAddDev, c);
  if (!r.ok()) return r.error();
  return info;
}

Result<uapi::ublksrv_ctrl_dev_info> UblkControl::get_dev_info(uint32_t dev_id) {
  uapi::ublksrv_ctrl_dev_info info{};
  auto c = Impl::header(dev_id);
  c.addr = reinterpret_cast<uintptr_t>(&info);
  c.len = sizeof(info);
  auto r = impl_->run(uapi::kUCmdGetDevInfo, c);
  if (!r.ok()) return r.error();
  return info;
}

Status UblkControl::set_params(uint32_t dev_id, const uapi::ublk_params& p) {
  uapi::ublk_params copy = p;
  copy.len = sizeof(copy);
  auto c = Impl::header(dev_id);
  c.addr = reinterpret_cast<uintptr_t>(&copy);
  c.len = sizeof(copy);
  auto r = impl_->run(uapi::kUCmdSetParams, c);
  if (!r.ok()) return r.error();
  return {};
}

bool update_size_supported() {
#ifdef IBNBD_UBLK_UPDATE_SIZE
  return true;
#else
  return false;
#endif
}

Status UblkControl::update_size(uint32_t dev_id, uint64_t sectors) {
#ifdef IBNBD_UBLK_UPDATE_SIZE
  return impl_->simple(UBLK_U_CMD_UPDATE_SIZE, dev_id, sectors);
#else
  (void)dev_id;
  (void)sectors;
  return errc(EOPNOTSUPP);
#endif
}

Result<uapi::ublk_params> UblkControl::get_params(uint32_t dev_id) {
  uapi::ublk_params p{};
  p.len = sizeof(p);  // the driver copies min(len, its own) bytes out
  auto c = Impl::header(dev_id);
  c.addr = reinterpret_cast<uintptr_t>(&p);
  c.len = sizeof(p);
  auto r = impl_->run(uapi::kUCmdGetParams, c);
  if (!r.ok()) return r.error();
  return p;
}

Status UblkControl::start_dev(uint32_t dev_id, pid_t daemon) {
  return impl_->simple(uapi::kUCmdStartDev, dev_id, static_cast<uint64_t>(daemon));
}
Status UblkControl::stop_dev(uint32_t dev_id) { return impl_->simple(uapi::kUCmdStopDev, dev_id); }
Status UblkControl::del_dev(uint32_t dev_id) { return impl_->simple(uapi::kUCmdDelDev, dev_id); }
Status UblkControl::start_user_recovery(uint32_t dev_id) {
  return impl_->simple(uapi::kUCmdStartUserRecovery, dev_id);
}
Status UblkControl::end_user_recovery(uint32_t dev_id, pid_t daemon) {
  return impl_->simple(uapi::kUCmdEndUserRecovery, dev_id, static_cast<uint64_t>(daemon));
}

}  // namespace ibnbd::ublk
