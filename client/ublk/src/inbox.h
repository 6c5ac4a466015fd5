// Inbox: a lock-free, intrusive multi-producer / single-consumer list. Producers (the
// transport's completion threads) push nodes they own for the moment; the consumer (a queue
// thread) takes everything at once. Push is one CAS, take is one exchange: no lock, no
// allocation, and ABA cannot happen because nodes are only ever removed all together.
//
// Wakeup protocol: push() says whether the inbox was empty; only that producer wakes the
// consumer (eventfd write). Any later push finds it non-empty until the consumer has taken the
// lot, and the consumer takes after its wakeup, so no push is left without a pending wakeup,
// and a burst of completions costs one wakeup.
#pragma once

#include <atomic>

namespace ibnbd::ublk {

template <class T, T* T::*Next>
class Inbox {
 public:
  // Any thread. True when the inbox was empty: the caller must wake the consumer.
  bool push(T* n) {
    T* head = head_.load(std::memory_order_relaxed);
    do {
      n->*Next = head;
    } while (!head_.compare_exchange_weak(head, n, std::memory_order_release, std::memory_order_relaxed));
    return head == nullptr;
  }

  // Consumer thread only. Everything pushed so far, oldest first (a singly linked list through
  // Next, nullptr-terminated), or nullptr.
  T* take_all() {
    T* n = head_.exchange(nullptr, std::memory_order_acquire);
    T* fifo = nullptr;
    while (n != nullptr) {  // the stack is newest first: reverse it
      T* next = n->*Next;
      n->*Next = fifo;
      fifo = n;
      n = next;
    }
    return fifo;
  }

  bool empty() const { return head_.load(std::memory_order_acquire) == nullptr; }

 private:
  std::atomic<T*> head_{nullptr};
};

}  // namespace ibnbd::ublk
