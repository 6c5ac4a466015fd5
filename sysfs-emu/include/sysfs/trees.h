// The four trees of the kernel's IBTRS/IBNBD sysfs, as node trees over a daemon's command set
// (the JSON requests its control socket serves, answered by ClientDaemon::handle or
// ibnbd::server_command). Nothing here decides anything: a read asks the daemon and formats the
// answer in the kernel's format (sysfs/format.h), a write parses the kernel's syntax
// (sysfs/parse.h) and sends one command, returning its errno. The layout is
// sysfs-emu/README.md.
//
// Backend contract: called on the FUSE worker threads, possibly several at once; returns the
// daemon's answer ({"ok": true, ...} or {"ok": false, "errno": N, "error": "..."}); must not
// throw (the daemons' handlers do not). An answer of the wrong shape reads as EIO.
//
// A daemon in the same process binds its typed commands (ClientBinding, ServerBinding): the
// tree then reads its structs, not the JSON it would write for the CLI (issue 18); the Backend
// carries the writes. Over a Backend alone the same commands are read from their JSON answers
// (control/client_devices.h, client_sessions.h and server_reports.h read them back), and every
// file reads the same bytes either way.
#pragma once

#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "control/client_devices.h"
#include "control/client_sessions.h"
#include "control/server_reports.h"
#include "sysfs/node.h"

namespace sysfs {

using Backend = std::function<nlohmann::json(const nlohmann::json& request)>;
// Log contract: called on a FUSE worker thread when a write fails, with one line naming the
// command and the daemon's reason ("sysfs: device_map: ublk: ublk_drv not loaded ..."): the
// writer sees only the errno. Empty: nothing is logged.
using Log = std::function<void(const std::string& line)>;

// The client daemon's commands the client tree reads typed, each with the Backend contract's
// threading and errnos; an empty one is read from the Backend's JSON answer.
struct ClientBinding {
  Backend backend;  // every other command
  // device_show: the mapped device `name`, or ENOENT (ClientDaemon::device).
  std::function<ibnbd::Result<ibnbd::control::DeviceReport>(const std::string& name)> device;
  Log log;
  // device_list: every mapped device (ClientDaemon::devices).
  std::function<ibnbd::Result<std::vector<ibnbd::control::DeviceReport>>()> devices;
  // session_list, and session_show of `name` (ENOENT) (ClientDaemon::sessions, session).
  std::function<ibnbd::Result<std::vector<ibnbd::control::SessionReport>>()> sessions;
  std::function<ibnbd::Result<ibnbd::control::SessionReport>(const std::string& name)> session;
  // path_stats: the path `path` of `session`, or every path of it with path "" (ENOENT: no such
  // session or path) (ClientDaemon::paths).
  std::function<ibnbd::Result<std::vector<ibnbd::control::PathReport>>(const std::string& session, const std::string& path)>
      paths;
  // session_max_reconnect_attempts without a value: the session's setting, or ENOENT
  // (ClientDaemon::max_reconnect_attempts). Its write stays a command on the backend.
  std::function<ibnbd::Result<int32_t>(const std::string& session)> max_reconnect_attempts;
};

// The server daemon's commands the server tree reads typed, as ClientBinding.
struct ServerBinding {
  Backend backend;  // every other command
  Log log;
  // sessions: the sessions' names.
  std::function<ibnbd::Result<std::vector<std::string>>()> sessions;
  // path_stats: as ClientBinding::paths, the server's paths (ibnbd::server_paths).
  decltype(ClientBinding::paths) paths;
  // devices: every exported device with its holders (ibnbd::server_devices).
  std::function<ibnbd::Result<std::vector<ibnbd::control::ExportedDeviceReport>>()> devices;
  // refusals: every reason the server counts, with its count (ibnbd::server_refusals).
  std::function<ibnbd::Result<std::vector<ibnbd::control::RefusalReport>>()> refusals;
};

// ibnbd-client's root: ibtrs-client/<session>/..., ibnbd-client/ctl/{map_device, devices/...}.
NodePtr client_tree(ClientBinding binding);
NodePtr client_tree(Backend backend, Log log = {});
// ibnbd-server's root: ibtrs-server/<session>/paths/..., ibnbd-server/ctl/devices/...
NodePtr server_tree(ServerBinding binding);
NodePtr server_tree(Backend backend, Log log = {});

}  // namespace sysfs
