// Permits (kernel: rtrs_permit / the session's tag bitmap): queue_depth of them per session;
// holding permit i is the right to use server chunk i for one request.
//
// get() is lock-free while permits are free (find a zero bit, CAS it); only a caller that has
// to wait touches the mutex and condition variable, and put() takes it only when someone waits.
// Thread-safety: all methods from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "ibtrs/result.h"

namespace ibtrs::core {

class PermitPool {
 public:
  static constexpr uint32_t kMaxDepth = 65535;

  // EINVAL when depth is 0 or above kMaxDepth.
  static Result<std::unique_ptr<PermitPool>> create(uint32_t depth);

  enum class Wait : uint8_t { no, yes };
  // A free permit id (0..depth-1). Errors: EAGAIN (no permit and Wait::no), ETIMEDOUT,
  // ESHUTDOWN (the pool was closed; also wakes every waiter).
  Result<uint32_t> get(Wait wait, std::chrono::milliseconds timeout = std::chrono::hours(24 * 365));
  // `n` consecutive free permits (2..kMaxRun), the first one's id: a chunk set for one request
  // (docs/protocol.md, "Chunk sets"). Taken from one 64-bit word of the bitmap in one
  // compare-and-swap, searched from the top, while get() packs single permits from the bottom.
  // Errors as get(), and EINVAL for `n` out of range or above the depth.
  static constexpr uint32_t kMaxRun = 64;
  Result<uint32_t> get_run(uint32_t n, Wait wait,
                           std::chrono::milliseconds timeout = std::chrono::hours(24 * 365));
  // Returns a permit. Putting one that is not held is a programming error (asserted in debug,
  // ignored in release).
  void put(uint32_t id);
  // Returns the run of `n` permits from `first` that get_run() gave.
  void put_run(uint32_t first, uint32_t n);
  // Refuses further get() calls and wakes waiters; put() still works.
  void close();

  uint32_t depth() const { return depth_; }
  uint32_t in_use() const { return used_.load(std::memory_order_relaxed); }

 private:
  explicit PermitPool(uint32_t depth);
  bool try_take(uint32_t& id);
  bool try_take_run(uint32_t n, uint32_t& first);
  template <typename Take>
  Result<uint32_t> wait_for(Take take, bool run, std::chrono::milliseconds timeout);
  void release(uint32_t word, uint64_t mask, uint32_t n);

  const uint32_t depth_;
  const uint32_t words_;
  std::unique_ptr<std::atomic<uint64_t>[]> bits_;  // 1 = taken
  std::atomic<uint32_t> hint_{0};                  // word to start looking at
  std::atomic<uint32_t> used_{0};
  std::atomic<uint32_t> waiters_{0};
  // Of those, waiters for a run: a put() then wakes every waiter, since the one notify_one()
  // would pick may be a run that still does not fit while a single permit would.
  std::atomic<uint32_t> run_waiters_{0};
  std::atomic<bool> closed_{false};
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace ibtrs::core
