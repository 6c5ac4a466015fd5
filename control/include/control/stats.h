// The JSON form of a path's statistics (ibtrs::PathStatsSnapshot) in the daemons' control
// answers: both daemons' `path_stats` commands write it, and sysfs-emu reads it back to print the
// kernel's stats files. One codec, so a field cannot mean one thing on the socket and another in
// the files.
#pragma once

#include <nlohmann/json.hpp>

#include "ibtrs/client.h"
#include "ibtrs/types.h"

namespace ibnbd::control {

nlohmann::json stats_to_json(const ibtrs::PathStatsSnapshot& s);
// The inverse; missing fields read as 0. Throws nlohmann::json exceptions on wrong types (callers
// are at the JSON edge and map them to EINVAL).
ibtrs::PathStatsSnapshot stats_from_json(const nlohmann::json& j);

// A client path's failover-fence counters (ibtrs::ClientPathInfo::Fence; docs/protocol.md,
// "Failover fence"): the client daemon's `path_stats` writes them as "fence", sysfs-emu's
// stats/fence reads them back. Missing fields read as 0; throws as stats_from_json.
nlohmann::json fence_to_json(const ibtrs::ClientPathInfo::Fence& f);
ibtrs::ClientPathInfo::Fence fence_from_json(const nlohmann::json& j);

}  // namespace ibnbd::control
