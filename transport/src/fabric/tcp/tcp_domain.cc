// The tcp fabric: one device, whose domain (and the domains alloc_pd() makes from it) shares
// CQs and accepts into the others; its types are in tcp_private.h.
#include <memory>

#include "fabric/providers.h"
#include "fabric/tcp/tcp_private.h"

namespace ibtrs::fabric {
namespace tcp {
namespace {

class TcpFabric final : public Fabric {
 public:
  explicit TcpFabric(const FabricOptions& o) : domain_(this, 0, o.busy_poll) {}
  FabricKind kind() const override { return FabricKind::tcp; }
  Result<Domain*> domain_for(const Address& remote, const Address* source) override {
    // A GID is an RDMA address (Address::parse makes gid: rdma; one built in code may not be).
    if (remote.gid || (source != nullptr && source->gid)) return errc(EAFNOSUPPORT);
    if (remote.fabric != FabricKind::tcp) return errc(EINVAL);
    return static_cast<Domain*>(&domain_);
  }
  using Fabric::listen;
  Result<std::unique_ptr<Listener>> listen(const Address& local, const ListenOptions& o) override {
    return listen_on(domain_, local, o);
  }

 private:
  TcpDomain domain_;
};

}  // namespace
}  // namespace tcp

Result<std::unique_ptr<Fabric>> make_tcp_fabric(const FabricOptions& options) {
  return std::unique_ptr<Fabric>(new tcp::TcpFabric(options));
}

}  // namespace ibtrs::fabric
