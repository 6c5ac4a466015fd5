#include "backend/blocking_worker.h"

#include "backend/extents.h"

#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

namespace ibnbd::backend {

BlockingWorker::BlockingWorker(uint32_t capacity, int event_fd) : event_fd_(event_fd) {
  jobs_.reserve(capacity);
  done_.reserve(capacity);
}

BlockingWorker::~BlockingWorker() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

Status BlockingWorker::start() {
  if (thread_.joinable()) return {};
  // std::thread reports a refused clone by throwing; this is the edge where it stops.
  try {
    thread_ = std::thread([this] { loop(); });
  } catch (const std::system_error&) {
    return errc(EAGAIN);
  }
  return {};
}

void BlockingWorker::post(const Job& j) {
  {
    std::lock_guard lk(mu_);
    jobs_.push_back(j);  // within the reserved capacity: one job per engine slot at most
  }
  cv_.notify_one();
}

void BlockingWorker::take_done(std::vector<Done>& out) {
  out.clear();
  std::lock_guard lk(mu_);
  out.swap(done_);
}

void BlockingWorker::loop() {
  std::vector<Job> batch;
  batch.reserve(jobs_.capacity());
  std::unique_lock lk(mu_);
  for (;;) {
    cv_.wait(lk, [this] { return stop_ || !jobs_.empty(); });
    if (stop_) return;
    batch.swap(jobs_);
    lk.unlock();
    for (const Job& j : batch) {
      int res = 0;
      if (j.status_of != nullptr) {
        res = block_status(*j.status_of, j.offset, j.len, std::span(j.out, j.out_len));
      } else {
        uint64_t range[2] = {j.offset, j.len};
        res = ::ioctl(j.fd, j.request, range) == 0 ? 0 : -errno;
      }
      {
        std::lock_guard g(mu_);
        done_.push_back({j.tag, res});
      }
      // Wakes the owning thread's epoll (or wait()) exactly as a CQE would.
      uint64_t one = 1;
      [[maybe_unused]] ssize_t n = ::write(event_fd_, &one, sizeof(one));
    }
    batch.clear();
    lk.lock();
  }
}

}  // namespace ibnbd::backend
