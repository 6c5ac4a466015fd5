#include "core/fabrics.h"

#include <map>
#include <memory>
#include <mutex>
#include <utility>

namespace ibtrs::core {

Result<fabric::Fabric*> shared_fabric(FabricKind kind, bool busy_poll) {
  static std::mutex mu;
  // Never destroyed: sessions may be torn down from static destructors of other objects, and a
  // fabric must outlive everything created from it.
  static auto* fabrics = new std::map<std::pair<FabricKind, bool>, std::unique_ptr<fabric::Fabric>>;
  std::lock_guard lock(mu);
  auto key = std::make_pair(kind, busy_poll);
  auto it = fabrics->find(key);
  if (it != fabrics->end()) return it->second.get();
  fabric::FabricOptions o;
  o.busy_poll = busy_poll;
  BASE_ASSIGN_OR_RETURN(auto f, fabric::open_fabric(kind, o));
  auto* raw = f.get();
  fabrics->emplace(key, std::move(f));
  return raw;
}

}  // namespace ibtrs::core
