// The gate in front of a connection's send queue (the kernel guards the same with the path
// state and RCU). Submitters enter() before posting and exit() after; closing the gate refuses new
// entries and waits for the ones inside to leave, after which nobody posts to the connection and
// it may be torn down. One atomic add per enter and per exit; no lock.
// Thread-safety: all methods from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>

namespace ibtrs::core {

class ConGate {
 public:
  // True when inside; then exit() must follow.
  bool enter() {
    const uint32_t v = word_.fetch_add(1, std::memory_order_acquire);
    if ((v & kOpen) == 0) {
      word_.fetch_sub(1, std::memory_order_release);
      return false;
    }
    return true;
  }
  void exit() { word_.fetch_sub(1, std::memory_order_release); }

  void open() { word_.fetch_or(kOpen, std::memory_order_release); }
  bool is_open() const { return (word_.load(std::memory_order_acquire) & kOpen) != 0; }
  // Refuses new entries and waits (briefly: posting never blocks) for those inside.
  void close_and_wait() {
    word_.fetch_and(~kOpen, std::memory_order_acq_rel);
    while ((word_.load(std::memory_order_acquire) & ~kOpen) != 0) std::this_thread::yield();
  }

 private:
  static constexpr uint32_t kOpen = 1u << 31;
  std::atomic<uint32_t> word_{0};
};

}  // namespace ibtrs::core
