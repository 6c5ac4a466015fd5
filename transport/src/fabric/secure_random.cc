#include "fabric/secure_random.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/random.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "base/unique_fd.h"

namespace ibtrs {
namespace {

constexpr size_t kBlockWords = 128;

std::atomic<uint64_t> g_fork_gen{1};

void on_fork_child() { g_fork_gen.fetch_add(1, std::memory_order_relaxed); }

// Registered once per process, before the first block is drawn.
bool register_fork_handler() {
  return ::pthread_atfork(nullptr, nullptr, on_fork_child) == 0;
}

void fill(void* out, size_t len) {
  auto* p = static_cast<unsigned char*>(out);
  size_t got = 0;
  while (got < len) {
    ssize_t n = ::getrandom(p + got, len - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    // No getrandom (ENOSYS, kernels < 3.17): the same pool through its device.
    base::UniqueFd fd(::open("/dev/urandom", O_RDONLY | O_CLOEXEC));  // closes after the loop
    if (!fd) std::abort();
    while (got < len) {
      ssize_t r = ::read(fd.get(), p + got, len - got);
      if (r > 0) {
        got += static_cast<size_t>(r);
      } else if (r < 0 && errno == EINTR) {
        continue;
      } else {
        std::abort();
      }
    }
  }
}

struct Block {
  uint32_t words[kBlockWords];
  size_t next = kBlockWords;
  uint64_t gen = 0;
};
thread_local Block t_block;

}  // namespace

uint32_t secure_random_u32() {
  static const bool registered = register_fork_handler();
  (void)registered;
  Block& b = t_block;
  const uint64_t gen = g_fork_gen.load(std::memory_order_relaxed);
  if (b.next == kBlockWords || b.gen != gen) {
    fill(b.words, sizeof(b.words));
    b.next = 0;
    b.gen = gen;
  }
  uint32_t v = b.words[b.next];
  b.words[b.next++] = 0;  // a drawn word is not left behind in memory
  return v;
}

}  // namespace ibtrs
