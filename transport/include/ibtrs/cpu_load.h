// What the adaptive waits (ibtrs/hybrid_poll.h) sample to tell whether their spins cost another
// task a CPU: the fio engine's getevents and the transport's IO pollers. Header only: the engine
// includes it without linking the transport's internals.
#pragma once

#include "ibtrs/hybrid_poll.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "base/unique_fd.h"

namespace ibtrs {

// How often a waiter samples the run queue and the CPU pressure: a contended host is judged on
// these samples.
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

// /proc/pressure/cpu's first line is "some avg10=.. avg60=.. avg300=.. total=US": microseconds
// in which some runnable task waited for a CPU, since boot (PSI, Linux 4.20; absent when the
// kernel is built without it or booted with psi=0). -1 when it cannot be read.
inline int64_t cpu_pressure_us(int fd) {
  char buf[256];
  const ssize_t n = fd >= 0 ? ::pread(fd, buf, sizeof buf - 1, 0) : -1;
  if (n <= 0) return -1;
  buf[n] = '\0';
  if (std::strncmp(buf, "some ", 5) != 0) return -1;
  const char* t = std::strstr(buf, "total=");
  const char* nl = std::strchr(buf, '\n');
  if (t == nullptr || (nl != nullptr && t > nl)) return -1;
  return std::strtoll(t + 6, nullptr, 10);
}

// Feeds a HybridPoll what the host says every kRunqueueSampleEvery: the other runnable tasks
// (observe_runnable) and the share of the interval in which some task waited for a CPU
// (observe_pressure). The owning waiter's thread only; either file may be missing, and then
// that signal is simply not fed.
class CpuLoadSampler {
 public:
  // runqueue / pressure: whether to read /proc/loadavg / /proc/pressure/cpu at all.
  explicit CpuLoadSampler(bool runqueue = true, bool pressure = true) {
    if (runqueue) loadavg_fd_.reset(::open("/proc/loadavg", O_RDONLY | O_CLOEXEC));
    if (pressure) pressure_fd_.reset(::open("/proc/pressure/cpu", O_RDONLY | O_CLOEXEC));
    const unsigned n = std::thread::hardware_concurrency();
    cpus_ = n > 0 ? n : 1;
  }
  CpuLoadSampler(const CpuLoadSampler&) = delete;
  CpuLoadSampler& operator=(const CpuLoadSampler&) = delete;

  // Before a wait is planned, at `now_ns` (monotonic): samples when the interval has passed.
  void maybe_sample(int64_t now_ns, HybridPoll& policy) {
    if (now_ns - at_ns_ < kEveryNs) return;
    if (int r = runnable_now(loadavg_fd_.get()); r >= 1) policy.observe_runnable(r - 1, cpus_);
    const int64_t p = cpu_pressure_us(pressure_fd_.get());
    if (p >= 0 && pressure_us_ >= 0 && at_ns_ > 0 && p >= pressure_us_) {
      const double stall = static_cast<double>(p - pressure_us_) * 1000.0 /
                           static_cast<double>(now_ns - at_ns_);
      policy.observe_pressure(stall, now_ns);
    }
    pressure_us_ = p;
    at_ns_ = now_ns;
  }

  uint32_t cpus() const { return cpus_; }

 private:
  static constexpr int64_t kEveryNs = std::chrono::nanoseconds(kRunqueueSampleEvery).count();
  base::UniqueFd loadavg_fd_;   // -1: not read
  base::UniqueFd pressure_fd_;  // -1: not read
  uint32_t cpus_ = 1;
  int64_t at_ns_ = 0;         // the last sample
  int64_t pressure_us_ = -1;  // PSI total then
};

}  // namespace ibtrs
