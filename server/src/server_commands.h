// The ibnbd-server daemon's admin commands as JSON request -> JSON answer (see
// server/README.md and client/README.md, "Control socket"): what the control socket serves to
// the `ibnbd server ...` CLI and what the sysfs tree (sysfs-emu) calls, so both share one set of
// commands and errnos.
//
//   sessions | devices | force_close {device, session} | disconnect_path {session, path}
//   reset_stats {session, path?, stats?: all|rdma|rdma_lat|wc_completion|...}
//   path_stats {session, path?}: every counter of the paths (control/stats.h) and their identity
//   refusals: [{reason, count, last, last_unix_ms}], every peer refused or cut off by reason
//     (ibtrs/refusals.h) | reset_refusals
//   limits: {limits: the transport's caps and timeouts, usage: what peers hold now}
//   host_add {host?, key_file? | key?, server_key_file? | server_key?, access?: [{devices, mode}]}
//            adds or replaces a host (key rotation: without "access" a known host keeps its rules)
//   host_remove {host} | host_list | auth_stats
//
// Threading: any thread (BlockServer's functions are); never throws (malformed requests get
// EINVAL answers).
#pragma once

#include <nlohmann/json.hpp>

#include "control/client_sessions.h"
#include "control/server_reports.h"
#include "ibnbd/server.h"

namespace ibnbd {

nlohmann::json server_command(BlockServer& srv, const nlohmann::json& req);

// The answers typed (server_reports.cc; sysfs-emu's server tree binds them). Any thread.
// path_stats's paths (control/client_sessions.h): the path `path` of session `session`, or with
// path "" every path of it. ENOENT: no such session, or no such path in it.
Result<std::vector<control::PathReport>> server_paths(BlockServer& srv, const std::string& session,
                                                     const std::string& path);
// devices' exported devices with their holders, and refusals' reasons with their counts
// (control/server_reports.h): server_command writes its answers from these.
std::vector<control::ExportedDeviceReport> server_devices(BlockServer& srv);
std::vector<control::RefusalReport> server_refusals(BlockServer& srv);

// One host of the daemon's config file or of host_add: {"host", "key_file" | "key",
// "server_key_file" | "server_key", "access": [{"devices", "mode"}]}. A key file (ibtrs/auth.h)
// gives the key and server key, and the host id when "host" is left out (else they must agree).
// Errors carry a one-line reason in `why`: EINVAL (syntax), EPERM (a key file others may read),
// EBADMSG (a secret's CRC), what reading a file says.
Result<HostConfig> host_from_json(const nlohmann::json& j, std::string* why);

}  // namespace ibnbd
