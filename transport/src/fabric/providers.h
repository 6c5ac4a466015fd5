// Provider factories behind open_fabric(). Each provider lives in its own directory.
#pragma once

#include <memory>

#include "fabric/fabric.h"

namespace ibtrs::fabric {

Result<std::unique_ptr<Fabric>> make_tcp_fabric(const FabricOptions& options);
Result<std::unique_ptr<Fabric>> make_loopback_fabric(const FabricOptions& options);
#ifdef IBTRS_HAVE_RDMA
Result<std::unique_ptr<Fabric>> make_rdma_fabric(const FabricOptions& options);
#endif

}  // namespace ibtrs::fabric
