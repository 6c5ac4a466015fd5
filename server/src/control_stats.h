// The JSON form of a path's statistics (ibtrs::PathStatsSnapshot) in the daemons' control
// answers: both daemons' `path_stats` commands write it, and sysfs-emu reads it back to print the
// kernel's stats files. One codec, so a field cannot mean one thing on the socket and another in
// the files.
#pragma once

#include <nlohmann/json.hpp>

#include "ibtrs/types.h"

namespace ibnbd {

nlohmann::json stats_to_json(const ibtrs::PathStatsSnapshot& s);
// The inverse; missing fields read as 0. Throws nlohmann::json exceptions on wrong types (callers
// are at the JSON edge and map them to EINVAL).
ibtrs::PathStatsSnapshot stats_from_json(const nlohmann::json& j);

}  // namespace ibnbd
