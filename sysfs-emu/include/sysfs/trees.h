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
#pragma once

#include <functional>

#include <nlohmann/json.hpp>

#include "sysfs/node.h"

namespace sysfs {

using Backend = std::function<nlohmann::json(const nlohmann::json& request)>;
// Log contract: called on a FUSE worker thread when a write fails, with one line naming the
// command and the daemon's reason ("sysfs: device_map: ublk: ublk_drv not loaded ..."): the
// writer sees only the errno. Empty: nothing is logged.
using Log = std::function<void(const std::string& line)>;

// ibnbd-client's root: ibtrs-client/<session>/..., ibnbd-client/ctl/{map_device, devices/...}.
NodePtr client_tree(Backend backend, Log log = {});
// ibnbd-server's root: ibtrs-server/<session>/paths/..., ibnbd-server/ctl/devices/...
NodePtr server_tree(Backend backend, Log log = {});

}  // namespace sysfs
