// The ibnbd-server daemon's admin commands as JSON request -> JSON answer (see
// server/README.md and client/README.md, "Control socket"): what the control socket serves to
// the `ibnbd server ...` CLI and what the sysfs tree (sysfs-emu) calls, so both share one set of
// commands and errnos.
//
//   sessions | devices | force_close {device, session} | disconnect_path {session, path}
//   reset_stats {session, path?, stats?: all|rdma|rdma_lat|wc_completion|...}
//   path_stats {session, path?}: every counter of the paths (control_stats.h) and their identity
//   refusals: [{reason, count, last, last_unix_ms}], every peer refused or cut off by reason
//     (ibtrs/refusals.h) | reset_refusals
//   limits: {limits: the transport's caps and timeouts, usage: what peers hold now}
//
// Threading: any thread (BlockServer's functions are); never throws (malformed requests get
// EINVAL answers).
#pragma once

#include <nlohmann/json.hpp>

#include "ibnbd/server.h"

namespace ibnbd {

nlohmann::json server_command(BlockServer& srv, const nlohmann::json& req);

}  // namespace ibnbd
