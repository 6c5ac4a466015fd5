#include "core/permits.h"

#include <algorithm>
#include <bit>
#include <cassert>

namespace ibtrs::core {

Result<std::unique_ptr<PermitPool>> PermitPool::create(uint32_t depth) {
  if (depth == 0 || depth > kMaxDepth) return errc(EINVAL);
  return std::unique_ptr<PermitPool>(new PermitPool(depth));
}

PermitPool::PermitPool(uint32_t depth)
    : depth_(depth), words_((depth + 63) / 64), bits_(new std::atomic<uint64_t>[words_]) {
  for (uint32_t w = 0; w < words_; ++w) {
    // Bits past the depth in the last word are permanently taken.
    uint32_t valid = std::min<uint32_t>(64, depth - w * 64);
    bits_[w].store(valid == 64 ? 0 : ~((uint64_t{1} << valid) - 1), std::memory_order_relaxed);
  }
}

bool PermitPool::try_take(uint32_t& id) {
  const uint32_t start = hint_.load(std::memory_order_relaxed) % words_;
  for (uint32_t i = 0; i < words_; ++i) {
    const uint32_t w = (start + i) % words_;
    uint64_t cur = bits_[w].load(std::memory_order_seq_cst);
    while (cur != ~uint64_t{0}) {
      const int bit = std::countr_one(cur);
      if (bits_[w].compare_exchange_weak(cur, cur | (uint64_t{1} << bit), std::memory_order_acquire,
                                         std::memory_order_relaxed)) {
        id = w * 64 + static_cast<uint32_t>(bit);
        used_.fetch_add(1, std::memory_order_relaxed);
        // Next search starts where free bits are likely: here, or the next word once this is full.
        const bool full = (cur | (uint64_t{1} << bit)) == ~uint64_t{0};
        hint_.store(full ? (w + 1) % words_ : w, std::memory_order_relaxed);
        return true;
      }
    }
  }
  return false;
}

bool PermitPool::try_take_run(uint32_t n, uint32_t& first) {
  const uint64_t ones = n == 64 ? ~uint64_t{0} : (uint64_t{1} << n) - 1;
  for (uint32_t w = words_; w-- > 0;) {
    uint64_t cur = bits_[w].load(std::memory_order_seq_cst);
    for (;;) {
      // Bit b of `starts`: bits b..b+n-1 are all free (shifts bring in taken bits from above).
      const uint64_t free = ~cur;
      uint64_t starts = free;
      for (uint32_t len = 1; len < n && starts != 0;) {
        const uint32_t step = std::min(len, n - len);
        starts &= starts >> step;
        len += step;
      }
      if (starts == 0) break;
      const int b = 63 - std::countl_zero(starts);  // the highest: away from single permits
      const uint64_t mask = ones << b;
      if (bits_[w].compare_exchange_weak(cur, cur | mask, std::memory_order_acquire,
                                         std::memory_order_relaxed)) {
        first = w * 64 + static_cast<uint32_t>(b);
        used_.fetch_add(n, std::memory_order_relaxed);
        return true;
      }
    }
  }
  return false;
}

template <typename Take>
Result<uint32_t> PermitPool::wait_for(Take take, bool run, std::chrono::milliseconds timeout) {
  uint32_t id;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::unique_lock lock(mu_);
  if (run) run_waiters_.fetch_add(1, std::memory_order_seq_cst);
  waiters_.fetch_add(1, std::memory_order_seq_cst);
  // Dekker with put(): we publish "waiting" then look at the bits; put() frees a bit then looks
  // at waiters_. All four are seq_cst, so at least one of us sees the other.
  Result<uint32_t> r = errc(ETIMEDOUT);
  for (;;) {
    // Registered as a waiter before looking again: a put() after this look sees waiters_ > 0.
    if (closed_.load(std::memory_order_acquire)) {
      r = errc(ESHUTDOWN);
      break;
    }
    if (take(id)) {
      r = id;
      break;
    }
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
      if (take(id)) r = id;
      break;
    }
  }
  waiters_.fetch_sub(1, std::memory_order_seq_cst);
  if (run) run_waiters_.fetch_sub(1, std::memory_order_seq_cst);
  return r;
}

Result<uint32_t> PermitPool::get(Wait wait, std::chrono::milliseconds timeout) {
  uint32_t id;
  if (closed_.load(std::memory_order_acquire)) return errc(ESHUTDOWN);
  if (try_take(id)) return id;
  if (wait == Wait::no) return errc(EAGAIN);
  return wait_for([this](uint32_t& i) { return try_take(i); }, false, timeout);
}

Result<uint32_t> PermitPool::get_run(uint32_t n, Wait wait, std::chrono::milliseconds timeout) {
  if (n < 2 || n > kMaxRun || n > depth_) return errc(EINVAL);
  uint32_t first;
  if (closed_.load(std::memory_order_acquire)) return errc(ESHUTDOWN);
  if (try_take_run(n, first)) return first;
  if (wait == Wait::no) return errc(EAGAIN);
  return wait_for([this, n](uint32_t& f) { return try_take_run(n, f); }, true, timeout);
}

void PermitPool::release(uint32_t word, uint64_t mask, uint32_t n) {
  const uint64_t prev = bits_[word].fetch_and(~mask, std::memory_order_seq_cst);
  assert((prev & mask) == mask);
  if ((prev & mask) != mask) return;
  used_.fetch_sub(n, std::memory_order_relaxed);
  if (waiters_.load(std::memory_order_seq_cst) > 0) {
    // Taking the lock orders this notify after a waiter's look-then-wait.
    std::lock_guard lock(mu_);
    if (run_waiters_.load(std::memory_order_seq_cst) > 0) cv_.notify_all();
    else cv_.notify_one();
  }
}

void PermitPool::put(uint32_t id) {
  assert(id < depth_);
  if (id >= depth_) return;
  release(id / 64, uint64_t{1} << (id % 64), 1);
}

void PermitPool::put_run(uint32_t first, uint32_t n) {
  assert(n >= 1 && n <= kMaxRun && first % 64 + n <= 64 && first + n <= depth_);
  if (n == 0 || n > kMaxRun || first % 64 + n > 64 || first + n > depth_) return;
  const uint64_t ones = n == 64 ? ~uint64_t{0} : (uint64_t{1} << n) - 1;
  release(first / 64, ones << (first % 64), n);
}

void PermitPool::close() {
  closed_.store(true, std::memory_order_release);
  std::lock_guard lock(mu_);
  cv_.notify_all();
}

}  // namespace ibtrs::core
