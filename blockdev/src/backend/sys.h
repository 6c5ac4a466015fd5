// Thin wrappers over the system calls the backends need and glibc 2.36 does not wrap (openat2),
// plus the sysfs queue limits of a block device.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>

#include "ibnbd/types.h"
#include "base/unique_fd.h"

namespace ibnbd::backend {

// The resolve flags every export open uses: nothing outside `dirfd`, no /proc magic links.
inline constexpr uint64_t kResolveExport = 0x08 /* RESOLVE_BENEATH */ | 0x02 /* NO_MAGICLINKS */;

// openat2(2) by syscall number. Retries EAGAIN (RESOLVE_BENEATH refuses a walk that raced with a
// rename; openat2(2) says to retry) and EINTR a few times. ENOSYS when the kernel lacks it.
Result<base::UniqueFd> openat2_beneath(int dirfd, const std::string& rel, int flags, uint64_t resolve);

// A block device's queue limits from /sys/dev/block/MAJ:MIN/queue (or the parent's for a
// partition). Missing files read as nullopt.
struct QueueLimits {
  std::optional<uint64_t> discard_max_bytes;
  std::optional<uint64_t> discard_granularity;
  std::optional<uint64_t> write_zeroes_max_bytes;
  std::optional<uint64_t> max_hw_sectors_kb;
  std::optional<uint64_t> max_segments;
  std::optional<uint64_t> discard_alignment;  // of the partition itself
  std::optional<bool> write_back_cache;       // queue/write_cache: "write back"
  std::optional<bool> fua;
};
QueueLimits read_queue_limits(dev_t rdev);

}  // namespace ibnbd::backend
