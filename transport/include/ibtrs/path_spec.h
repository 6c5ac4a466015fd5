// A path as users write it: the kernel's add_path / map_device syntax.
//   "[src,]dst"  or  "src@dst"  where each address is ip:<ipv4|ipv6>, gid:<gid>, or one of our
//   fabric forms tcp:/rdma:/loopback: (address.h). The kernel's forms take the default fabric.
// A path's name, as sysfs shows it, is "src@dst": the kernel's "ip:198.18.0.1@ip:198.18.0.2" for
// rdma, "tcp:..." for tcp, and ":PORT" after the destination when it is not the default port (two
// paths to one host may differ by port only).
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "ibtrs/address.h"
#include "ibtrs/result.h"

namespace ibtrs {

struct PathSpec {
  std::optional<Address> source;
  Address destination;

  // EINVAL for malformed text, for a source and destination on different fabrics, and for a
  // source and destination of different IP families.
  static Result<PathSpec> parse(std::string_view text, FabricKind default_fabric = FabricKind::tcp,
                                uint16_t port = kDefaultPort);
  // "src@dst" as the kernel names path directories; the source is "ip:0.0.0.0"-style when unset.
  std::string name() const;
};

// A 16-byte random identifier (RFC 4122 version 4) for sessions and paths.
struct Uuid16 {
  uint8_t bytes[16] = {};
  static Uuid16 random();
  std::string to_string() const;  // 8-4-4-4-12 lowercase hex
  bool is_nil() const;
  friend bool operator==(const Uuid16& a, const Uuid16& b);
};

}  // namespace ibtrs
