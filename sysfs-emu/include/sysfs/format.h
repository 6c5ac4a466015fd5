// The kernel's formats of the ibtrs stats and settings files (seed 004 and
// Documentation/ABI/testing/sysfs-class-rtrs-*), from the statistics data objects. Pure
// functions; each returns the file's whole content, ending in a newline.
#pragma once

#include <string>

#include "ibtrs/client.h"
#include "ibtrs/types.h"

namespace sysfs {

using ibtrs::PathStatsSnapshot;

// Client stats/rdma: "<read-count> <read-bytes> <write-count> <write-bytes> <inflight> <failovered>"
std::string format_client_rdma(const PathStatsSnapshot& s);
// Server stats/rdma: "<read-count> <read-bytes> <write-count> <write-bytes> <inflight>"
std::string format_server_rdma(const PathStatsSnapshot& s);
// stats/rdma_lat: one line per power of two "<N> ms: <reads> <writes>" for N = 1..65536, then
// ">= 65536 ms: ..." and "maximum ms: <max read> <max write>". The histogram behind it has
// power-of-two microsecond buckets; a row "N ms" counts the requests below N x 1.024 ms not
// counted in an earlier row (the rows are binary milliseconds, so each is whole buckets).
std::string format_rdma_lat(const PathStatsSnapshot& s);
// Client stats/wc_completion: "<max per poll> <average per poll>"
std::string format_client_wc_completion(const PathStatsSnapshot& s);
// Server stats/wc_completion: "<max per poll> <total completions> <polls>"
std::string format_server_wc_completion(const PathStatsSnapshot& s);
// stats/sg_entries: a header "n\thread: count", a row per sg-list length "<n>: <count>" (the last
// row "<kSgBuckets-1>+" takes longer lists), then "total: <count>". Not per CPU: the counters
// are per path.
std::string format_sg_entries(const PathStatsSnapshot& s);
// stats/cpu_migration: a header of the IO threads ("CPU0 CPU1 ..." - our IO threads play the
// kernel's CPUs; the last one is the control thread), then "from:" (submitted on that thread,
// completed on another) and "to  :" (completed there, submitted elsewhere).
std::string format_cpu_migration(const PathStatsSnapshot& s);
// stats/reconnects: "<successful> <failed>"
std::string format_reconnects(const PathStatsSnapshot& s);
// Client stats/fence (ours, not in the kernel: docs/protocol.md, "Failover fence"):
// "<waited> <fenced> <last rtt ns> <max rtt ns>": requests that waited for a fence of the path,
// its incarnations confirmed fenced, the last and the longest round trip from the first waiting
// request to the confirmation.
std::string format_fence(const ibtrs::ClientPathInfo::Fence& f);
// mp_policy: "round-robin (RR: 0)", "min-inflight (MI: 1)", "min-latency (ML: 2)"
std::string format_policy(ibtrs::MpPolicy p);

}  // namespace sysfs
