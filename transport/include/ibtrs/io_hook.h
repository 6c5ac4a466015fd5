// Work of an upper layer driven by the transport's IO threads: e.g. the block server's io_uring,
// whose completions finish requests on the same thread that received them, without a hand-off.
#pragma once

#include <cstddef>

namespace ibtrs {

// Called only on the IO thread it was given to. The thread polls it after its completion queues
// on every pass, flushes it at the end of every pass (work queued while handling a batch of
// requests goes out in one go, e.g. one io_uring_submit), and watches fd() while it sleeps.
// Methods must not block.
class IoThreadHook {
 public:
  virtual ~IoThreadHook() = default;
  virtual int fd() const = 0;   // readable when poll() may find work; -1: nothing to watch
  virtual size_t poll() = 0;    // runs what is ready; returns how much (0 lets the thread sleep)
  virtual void flush() = 0;     // end of a pass
};

}  // namespace ibtrs
