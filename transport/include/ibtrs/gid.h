// gid: path addresses (the kernel's sysfs syntax) and how rdma_cm reaches them.
//
// The kernel's RTRS turns "gid:GID" into an AF_IB sockaddr_ib (rtrs_str_gid_to_sockaddr), which
// rdma_cm resolves on InfiniBand ports only. On RoCE a GID is an IP address of the port's netdev
// in GID form (the GID table is filled from the netdev's addresses: ::ffff:a.b.c.d for IPv4,
// the IPv6 address itself), and a destination GID is the peer's address in that form. So here:
//   - a source GID must be in a local GID table (/sys/class/infiniband/<dev>/ports/<p>/gids/<i>);
//     on an Ethernet (RoCE) port it stands for its IP form;
//   - a destination GID stands for its IP form (IPv4-mapped -> IPv4; a global IPv6 -> itself);
//   - refused with the reason: a GID no local port has (ENODEV), a GID with no IP form such as a
//     link-local (fe80::/10) default GID derived from the MAC (EADDRNOTAVAIL), a GID of an
//     InfiniBand port (EAFNOSUPPORT: AF_IB needs listeners of its own on the server; use the
//     port's IPoIB address with ip:).
// Called by the rdma fabric before rdma_resolve_addr, and by the client daemon when a path is
// given (to answer with the reason); any thread. Reads sysfs; holds no state.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "ibtrs/address.h"
#include "ibtrs/path_spec.h"
#include "ibtrs/result.h"

namespace ibtrs {

inline constexpr const char* kInfinibandSysfs = "/sys/class/infiniband";

using Gid = std::array<uint8_t, 16>;

// One entry of a port's GID table.
struct GidEntry {
  std::string device;      // "rxe0", "mlx5_0"
  uint32_t port = 0;       // 1-based, as sysfs numbers them
  uint32_t index = 0;      // the GID index (gids/<index>)
  Gid gid{};
  std::string type;        // gid_attrs/types/<index>: "IB/RoCE v1", "RoCE v2" ("" where absent)
  bool infiniband = false;  // ports/<p>/link_layer is "InfiniBand" (else Ethernet: RoCE)
};

// Every non-zero GID of every port under `root` (a missing root: none). Bounded: at most 64
// devices x 32 ports x 1024 entries are read.
std::vector<GidEntry> read_gid_tables(const std::string& root = kInfinibandSysfs);

// The GID an address written as gid: names (its 16 bytes; an IPv4 address as ::ffff:a.b.c.d).
Gid gid_of(const Address& a);
// "0000:0000:...": the sysfs text of a GID.
std::string gid_string(const Gid& g);

// The address rdma_cm is given for `a`: `a` itself unless it was written as gid:, else its IP
// form after the checks above (`source`: the local side, looked up in `tables`). `why` names
// the cause of an error.
Result<Address> resolve_gid_address(const Address& a, bool source, const std::vector<GidEntry>& tables,
                                    std::string* why = nullptr);
// The same with the host's GID tables, read only when `a` is a GID.
Result<Address> resolve_gid_address(const Address& a, bool source, std::string* why = nullptr);

// Both sides of a path (the source as local), with the host's tables: what connecting will
// check, early, for an answer that names the cause (the daemon's path and map commands).
Status check_gid_path(const PathSpec& p, std::string* why);

}  // namespace ibtrs
