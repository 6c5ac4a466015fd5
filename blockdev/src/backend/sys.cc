#include "backend/sys.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <fstream>

namespace ibnbd::backend {

Result<base::UniqueFd> openat2_beneath(int dirfd, const std::string& rel, int flags, uint64_t resolve) {
  open_how how{};
  how.flags = static_cast<uint64_t>(flags) | O_CLOEXEC;
  how.resolve = resolve;
  // A handful of retries: EAGAIN only comes from a concurrent rename during the walk.
  for (int attempt = 0;; ++attempt) {
    long fd = ::syscall(SYS_openat2, dirfd, rel.c_str(), &how, sizeof(how));
    if (fd >= 0) return base::UniqueFd(static_cast<int>(fd));
    int e = errno;
    if ((e == EAGAIN || e == EINTR) && attempt < 8) continue;
    return errc(e);
  }
}

namespace {

std::optional<std::string> read_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  return line;
}

std::optional<uint64_t> read_u64(const std::string& path) {
  auto line = read_line(path);
  if (!line) return std::nullopt;
  unsigned long long v = 0;
  if (std::sscanf(line->c_str(), "%llu", &v) != 1) return std::nullopt;
  return static_cast<uint64_t>(v);
}

}  // namespace

QueueLimits read_queue_limits(dev_t rdev) {
  const std::string dev =
      "/sys/dev/block/" + std::to_string(major(rdev)) + ":" + std::to_string(minor(rdev));
  // A partition has no queue/ of its own: its disk's is one level up.
  std::string q = dev + "/queue/";
  if (::access(q.c_str(), F_OK) != 0) q = dev + "/../queue/";
  QueueLimits l;
  l.discard_max_bytes = read_u64(q + "discard_max_bytes");
  l.discard_granularity = read_u64(q + "discard_granularity");
  l.write_zeroes_max_bytes = read_u64(q + "write_zeroes_max_bytes");
  l.max_hw_sectors_kb = read_u64(q + "max_hw_sectors_kb");
  l.max_segments = read_u64(q + "max_segments");
  l.discard_alignment = read_u64(dev + "/discard_alignment");
  if (auto wc = read_line(q + "write_cache")) l.write_back_cache = (*wc == "write back");
  if (auto f = read_u64(q + "fua")) l.fua = (*f != 0);
  return l;
}

}  // namespace ibnbd::backend
