// The system's run queue, as the adaptive waits (hybrid_poll.h) sample it to tell a contended
// host: the fio engine's getevents and the transport's IO pollers. Header only: the engine
// includes it without linking the transport's internals.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdio>

namespace ibtrs::core {

// How often a waiter samples the run queue: a contended host is judged on the EWMA of these.
inline constexpr std::chrono::milliseconds kRunqueueSampleEvery{10};

// /proc/loadavg's fourth field is "runnable/threads"; the runnable count includes the reading
// thread. `fd`: /proc/loadavg opened by the caller (a pread per sample, no open). -1 when it
// cannot be read.
inline int runnable_now(int fd) {
  char buf[128];
  const ssize_t n = fd >= 0 ? ::pread(fd, buf, sizeof buf - 1, 0) : -1;
  if (n <= 0) return -1;
  buf[n] = '\0';
  int r = -1, total = 0;
  double a, b, c;
  if (std::sscanf(buf, "%lf %lf %lf %d/%d", &a, &b, &c, &r, &total) != 5) return -1;
  return r;
}

}  // namespace ibtrs::core
