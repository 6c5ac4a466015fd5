// A connection request as the tcp and rdma providers hold it (fabric.h, ConnectRequest): the
// peer's private data and the two addresses, copied out when the request arrives, so the
// accessors answer after the provider's own handle (socket, cm id) is handed to the connection
// or closed by accept / reject. The provider adds domain(), accept() and reject().
// Private to the fabric layer.
#pragma once

#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include "fabric/fabric.h"

namespace ibtrs::fabric {

class HeldConnectRequest : public ConnectRequest {
 public:
  std::span<const std::byte> private_data() const final { return private_data_; }
  const Address& peer_address() const final { return peer_; }
  const Address& local_address() const final { return local_; }

 protected:
  // `private_data`: what the peer sent, already checked by the provider's framing (at most
  // kMaxPrivateData bytes).
  HeldConnectRequest(std::vector<std::byte> private_data, Address local, Address peer)
      : private_data_(std::move(private_data)), local_(std::move(local)), peer_(std::move(peer)) {}

 private:
  std::vector<std::byte> private_data_;
  Address local_;
  Address peer_;
};

}  // namespace ibtrs::fabric
