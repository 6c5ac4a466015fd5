// The process's fabric instances, opened on first use and kept for the life of the process, so
// that every session and server of the process shares one rdma_cm channel and device list, and
// a client and a server in one process (tests, tools) share the loopback world.
#pragma once

#include "fabric/fabric.h"
#include "ibtrs/result.h"

namespace ibtrs::core {

// Thread-safe. ENOTSUP / ENODEV as open_fabric().
Result<fabric::Fabric*> shared_fabric(FabricKind kind, bool busy_poll);

}  // namespace ibtrs::core
