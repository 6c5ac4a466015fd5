#include "sysfs/format.h"

#include <algorithm>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>

namespace sysfs {

namespace {

// One formatted line (every line of these files is short).
__attribute__((format(printf, 1, 2))) std::string fmt(const char* f, ...) {
  char buf[256];
  va_list ap;
  va_start(ap, f);
  const int n = std::vsnprintf(buf, sizeof(buf), f, ap);
  va_end(ap);
  return std::string(buf, n < 0 ? 0 : std::min<size_t>(static_cast<size_t>(n), sizeof(buf) - 1));
}

// Latency rows: row i ("2^i ms", i = 0..16) covers microsecond buckets below 2^(i+10) us
// (1.024 ms x 2^i); the histogram has kLatBuckets power-of-two microsecond buckets.
constexpr size_t kLatRows = 17;
static_assert(ibtrs::kLatBuckets == kLatRows + 10, "rows 0..16 take buckets 0..25, the last row 26");

}  // namespace

std::string format_client_rdma(const PathStatsSnapshot& s) {
  return fmt("%" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRId64 " %" PRIu64 "\n", s.read_cnt,
             s.read_bytes, s.write_cnt, s.write_bytes, s.inflight, s.failovered);
}

std::string format_server_rdma(const PathStatsSnapshot& s) {
  return fmt("%" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRId64 "\n", s.read_cnt, s.read_bytes,
             s.write_cnt, s.write_bytes, s.inflight);
}

std::string format_rdma_lat(const PathStatsSnapshot& s) {
  std::string out;
  size_t b = 0;
  for (size_t row = 0; row < kLatRows; ++row) {
    uint64_t r = 0, w = 0;
    for (; b < row + 10; ++b) {  // buckets [2^b, 2^(b+1)) us with 2^(b+1) <= 2^(row+10)
      r += s.lat_read[b];
      w += s.lat_write[b];
    }
    out += fmt("%u ms: %" PRIu64 " %" PRIu64 "\n", 1u << row, r, w);
  }
  uint64_t r = 0, w = 0;
  for (; b < ibtrs::kLatBuckets; ++b) {
    r += s.lat_read[b];
    w += s.lat_write[b];
  }
  out += fmt(">= %u ms: %" PRIu64 " %" PRIu64 "\n", 1u << (kLatRows - 1), r, w);
  out += fmt("maximum ms: %" PRIu64 " %" PRIu64 "\n", s.lat_max_read_ns / 1000000, s.lat_max_write_ns / 1000000);
  return out;
}

std::string format_client_wc_completion(const PathStatsSnapshot& s) {
  return fmt("%" PRIu64 " %" PRIu64 "\n", s.poll_max, s.polls ? s.polled_completions / s.polls : 0);
}

std::string format_server_wc_completion(const PathStatsSnapshot& s) {
  return fmt("%" PRIu64 " %" PRIu64 " %" PRIu64 "\n", s.poll_max, s.polled_completions, s.polls);
}

std::string format_sg_entries(const PathStatsSnapshot& s) {
  std::string out = "n\\thread: count\n";
  uint64_t total = 0;
  for (size_t i = 0; i < ibtrs::kSgBuckets; ++i) {
    total += s.sg_entries[i];
    if (i + 1 == ibtrs::kSgBuckets) out += fmt("%zu+: %" PRIu64 "\n", i, s.sg_entries[i]);
    else out += fmt("%zu: %" PRIu64 "\n", i, s.sg_entries[i]);
  }
  out += fmt("total: %" PRIu64 "\n", total);
  return out;
}

std::string format_cpu_migration(const PathStatsSnapshot& s) {
  const size_t n = std::max(s.migrated_from.size(), s.migrated_to.size());
  std::string head = "    ", from = "from:", to = "to  :";
  for (size_t i = 0; i < n; ++i) {
    const std::string label = fmt("CPU%zu", i);
    const int w = static_cast<int>(label.size());
    head += " " + label;
    from += fmt(" %*" PRIu64, w, i < s.migrated_from.size() ? s.migrated_from[i] : 0);
    to += fmt(" %*" PRIu64, w, i < s.migrated_to.size() ? s.migrated_to[i] : 0);
  }
  return head + "\n" + from + "\n" + to + "\n";
}

std::string format_reconnects(const PathStatsSnapshot& s) {
  return fmt("%" PRIu64 " %" PRIu64 "\n", s.reconnects_ok, s.reconnects_failed);
}

std::string format_fence(const ibtrs::ClientPathInfo::Fence& f) {
  return fmt("%" PRIu64 " %" PRIu64 " %" PRId64 " %" PRId64 "\n", f.waited, f.fenced,
             static_cast<int64_t>(f.last_rtt.count()), static_cast<int64_t>(f.max_rtt.count()));
}

std::string format_policy(ibtrs::MpPolicy p) {
  switch (p) {
    case ibtrs::MpPolicy::round_robin: return "round-robin (RR: 0)\n";
    case ibtrs::MpPolicy::min_inflight: return "min-inflight (MI: 1)\n";
    case ibtrs::MpPolicy::min_latency: return "min-latency (ML: 2)\n";
  }
  return "?\n";
}

}  // namespace sysfs
