// A migration-image Volume over a mapped IBNBD device: chunks go straight from registered ring
// buffers to the server over every path of the session (failover included).
#pragma once

#include <memory>

#include "ibnbd/client.h"
#include "ibnbd/migrate_image.h"

namespace ibnbd::migrate {

// `session` must outlive the volume and every buffer it allocated. Writes to a device mapped ro
// fail with EPERM (from the library), so a read-only mapping serves list, verify and restore.
Result<std::unique_ptr<Volume>> device_volume(BlockSession& session, std::shared_ptr<RemoteDevice> dev);

}  // namespace ibnbd::migrate
