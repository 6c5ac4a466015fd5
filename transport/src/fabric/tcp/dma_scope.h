// The tcp provider stands in for an HCA: the bytes a peer RDMA-writes into registered memory
// land there from this provider's receive path, and, as with a real HCA's DMA, what orders them
// against the local CPU is the protocol (a chunk is written only after its previous response
// reached the peer and the peer reused it), a chain that passes through the kernel's sockets,
// where ThreadSanitizer cannot follow. Under TSan, DmaScope keeps those placements out of the
// calling thread's recorded accesses, as TSan never sees an HCA's; everything else the thread
// does stays checked. Without TSan it is empty.
#pragma once

#if defined(__SANITIZE_THREAD__)
#define IBTRS_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define IBTRS_TSAN 1
#endif
#endif

#ifdef IBTRS_TSAN
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
#endif

namespace ibtrs::fabric::tcp {

class DmaScope {
 public:
#ifdef IBTRS_TSAN
  DmaScope() { __tsan_ignore_thread_begin(); }
  ~DmaScope() { __tsan_ignore_thread_end(); }
#else
  DmaScope() {}  // user-provided: a scope object, not an unused variable
#endif
  DmaScope(const DmaScope&) = delete;
  DmaScope& operator=(const DmaScope&) = delete;
};

}  // namespace ibtrs::fabric::tcp
