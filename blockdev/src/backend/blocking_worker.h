// BlockingWorker: one helper thread that runs the block-device ioctls io_uring cannot carry
// (BLKDISCARD, BLKSECDISCARD: io_uring of 6.1 has no discard op for block devices, and the ioctl
// blocks for as long as the device takes), and BLOCK_STATUS (backend/extents.h: lseek
// SEEK_DATA / SEEK_HOLE waits for the filesystem's metadata, rbd_diff_iterate2 for the cluster). Results are collected under a lock and announced on the
// engine's eventfd, so the owning thread picks them up in run_completions() like CQEs.
//
// Threading: start(), post(), take_done() and the destructor on the engine's owning thread; the
// ioctls run on the helper thread. Capacity is the engine's queue depth, reserved up front: post()
// never allocates.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "ibnbd/backend.h"
#include "ibnbd/types.h"

namespace ibnbd::backend {

class BlockingWorker {
 public:
  struct Job {
    int fd;
    unsigned long request;  // BLKDISCARD or BLKSECDISCARD; unused for BLOCK_STATUS
    uint64_t offset;
    uint64_t len;
    uint64_t tag;  // handed back with the result
    // BLOCK_STATUS of this backend when set: its answer is written into out[0..out_len).
    Backend* status_of = nullptr;
    std::byte* out = nullptr;
    size_t out_len = 0;
  };
  struct Done {
    uint64_t tag;
    int res;  // 0 or -errno, as a CQE
  };

  BlockingWorker(uint32_t capacity, int event_fd);
  // Finishes the ioctl running now; jobs not started are dropped (the engine is going away).
  ~BlockingWorker();
  BlockingWorker(const BlockingWorker&) = delete;
  BlockingWorker& operator=(const BlockingWorker&) = delete;

  // Starts the thread once; EAGAIN when the system refuses a thread.
  Status start();
  bool started() const { return thread_.joinable(); }
  void post(const Job& j);
  // Swaps the finished results into `out` (cleared first; keeps both buffers' capacity).
  void take_done(std::vector<Done>& out);

 private:
  void loop();

  const int event_fd_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Job> jobs_;   // guarded by mu_
  std::vector<Done> done_;  // guarded by mu_
  bool stop_ = false;       // guarded by mu_
  std::thread thread_;
};

}  // namespace ibnbd::backend
