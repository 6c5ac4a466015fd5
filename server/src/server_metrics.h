// ibnbd-server's Prometheus metrics (server/README.md, "Metrics"): what its stats commands show
// (server_commands.h: sessions, devices, path_stats, auth_stats, refusals, limits, io_threads)
// as control::metrics::Exposition families. Reads the same snapshots those commands read, so a scrape
// costs the IO path nothing more than `ibnbd server session list` does.
//
// Threading: any thread (BlockServer's accessors are).
#pragma once

#include <string>

#include "ibnbd/server.h"

namespace ibnbd {

// The whole scrape's text.
std::string server_metrics(const BlockServer& srv);

}  // namespace ibnbd
