// ibtrs-load's workload: the --qd slots the client keeps in flight and the Load that runs them
// from their completions (ibtrs_load_workload.cc). Only ibtrs_load_client.cc drives it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "ibtrs_load.h"

namespace ibtrs_load {

class Load;

// One of the --qd requests kept in flight. A slot has at most one request in flight, and the
// library orders a request's completion before the next request of the slot, so everything but
// the counters read by the interval printer belongs to whichever thread runs the slot now.
struct alignas(64) Slot {
  Load* load = nullptr;
  std::byte* buf = nullptr;
  ibtrs::IoSeg seg;
  std::array<std::byte, sizeof(LoadHdr)> hdr{};
  uint64_t block = 0;
  ibtrs::IoDir dir = ibtrs::IoDir::read;
  uint32_t gen = 0;
  int64_t start_ns = 0;
  uint64_t rng = 0;
  std::atomic<uint64_t> ops{0};
  std::atomic<uint64_t> bytes{0};
  LatHist lat;
};

class Load {
 public:
  Load(const ClientConfig& c, ibtrs::ClientSession& s, const ibtrs::RegisteredMemory& mem);

  // Starts the slots; from then on they run themselves from their completions.
  void start();

  // Ends the run early (a signal): slots retire at their next completion.
  void stop();

  // Main thread: waits up to `timeout` for the run to end, resubmitting requests a completion
  // could not (no permit). True when every slot retired.
  bool wait(std::chrono::milliseconds timeout);

  int64_t start_ns() const { return start_ns_; }
  int64_t deadline_ns() const { return deadline_ns_; }
  uint64_t ops() const {
    uint64_t n = 0;
    for (const auto& s : slots_) n += s->ops.load(std::memory_order_relaxed);
    return n;
  }
  uint64_t bytes() const {
    uint64_t n = 0;
    for (const auto& s : slots_) n += s->bytes.load(std::memory_order_relaxed);
    return n;
  }
  uint64_t inflight() const { return active_.load(); }
  // Only once every slot retired.
  LatHist latency() const {
    LatHist h;
    for (const auto& s : slots_) h.merge(s->lat);
    return h;
  }
  int64_t end_ns() const { return last_done_ns_.load(); }
  uint64_t errors() const { return errors_.load(); }
  uint64_t verify_errors() const { return verify_errors_.load(); }
  uint64_t max_pause_ns() const { return max_pause_ns_.load(); }

 private:
  // The IO path (ibtrs_load_workload.cc): inline, as when they were defined in the class, so the
  // completion-to-resubmit chain compiles as it did in one file.
  static inline void on_done(void* ctx, int err);

  inline void complete(Slot& s, int err);

  // Every completion moves the "last completion" mark forward; the biggest step is the longest
  // time the caller saw nothing complete. Completions on several threads race, so the mark only
  // ever moves forward.
  inline void note_completion(int64_t now);

  inline void verify(Slot& s);

  inline void error(int err, const char* what);

  inline bool claim_io(int64_t now);

  inline uint64_t pick_block(Slot& s);

  inline ibtrs::IoDir pick_dir(Slot& s);

  inline void submit(Slot& s, bool from_callback);

  inline void retire();
  inline void wake();

  const ClientConfig& c_;
  ibtrs::ClientSession& s_;
  const uint64_t nblocks_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::unique_ptr<std::atomic<uint8_t>[]> busy_;
  std::unique_ptr<std::atomic<uint32_t>[]> gen_;
  std::atomic<uint64_t> cursor_{0};
  std::atomic<uint64_t> issued_{0};
  std::atomic<bool> stopping_{false};
  std::atomic<uint32_t> active_{0};
  std::atomic<uint64_t> errors_{0};
  std::atomic<uint64_t> verify_errors_{0};
  std::atomic<int64_t> last_done_ns_{0};
  std::atomic<uint64_t> max_pause_ns_{0};
  int64_t start_ns_ = 0;
  int64_t deadline_ns_ = INT64_MAX;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Slot*> parked_;
};

}  // namespace ibtrs_load
