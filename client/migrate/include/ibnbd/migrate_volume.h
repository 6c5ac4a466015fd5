// A migration-image Volume over a mapped IBNBD device: chunks go straight from registered ring
// buffers to the server over every path of the session (failover included).
#pragma once

#include <memory>
#include <string>

#include "ibnbd/client.h"
#include "ibnbd/migrate_image.h"

namespace ibnbd::migrate {

// `session` must outlive the volume and every buffer it allocated. Writes to a device mapped ro
// fail with EPERM (from the library), so a read-only mapping serves list, verify and restore.
Result<std::unique_ptr<Volume>> device_volume(BlockSession& session, std::shared_ptr<RemoteDevice> dev);

// A volume over an NBD export on the unix socket `socket_path` (export `export_name`), e.g. a
// client daemon's export of a device it maps (`ibnbd client device export DEV unix SOCK`): the
// agent then works through the daemon's mapping and its access mode instead of opening one of
// its own. A read-only export refuses writes with EPERM. ENOENT: no such export; EPROTO: not an
// NBD server that speaks fixed newstyle with NBD_OPT_GO; ETIMEDOUT: no answer within 10 s.
Result<std::unique_ptr<Volume>> nbd_volume(const std::string& socket_path, const std::string& export_name);

}  // namespace ibnbd::migrate
