// Fabric addresses. Text forms (parse() accepts, to_string() prints the canonical one):
//   tcp:HOST[:PORT]        software RDMA over TCP          tcp:127.0.0.1:1234, tcp:[::1]:1234
//   rdma:HOST[:PORT]       rdma-core (RoCE / IB / iWARP)   rdma:198.18.0.1
//   loopback:NAME[:PORT]   in-process fabric for tests     loopback:srv
//   ip:IPV4 | ip:IPV6      the kernel's sysfs syntax; fabric = the configured default
//   gid:GID                the kernel's sysfs syntax; always rdma (loopback in tests). A GID is an
//                          IPv6-form address (RoCE GIDs of IPv4 hosts are ::ffff:a.b.c.d and map
//                          back to that IPv4 address); ibtrs/gid.h checks it against the GID
//                          tables and gives rdma_cm its IP form. gid:[GID]:PORT carries a port.
// HOST is numeric (IPv4, or IPv6 in brackets): the project never resolves names, so an address
// cannot silently reach a host it did not name. PORT defaults to 1234, the kernel's RTRS port.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "ibtrs/result.h"

namespace ibtrs {

inline constexpr uint16_t kDefaultPort = 1234;

enum class FabricKind : uint8_t { tcp, rdma, loopback };

std::string_view to_string(FabricKind k);
Result<FabricKind> parse_fabric_kind(std::string_view name);

struct Address {
  FabricKind fabric = FabricKind::tcp;
  // For tcp/rdma: a numeric IPv4/IPv6 socket address including the port. Unused for loopback.
  sockaddr_storage sa{};
  // For loopback: the in-process endpoint name.
  std::string name;
  uint16_t port = kDefaultPort;
  // Written as gid: (sa holds the GID's IPv6 form, or IPv4 for ::ffff:a.b.c.d): resolved by
  // resolve_gid_address (ibtrs/gid.h) before rdma_cm sees it; the tcp fabric refuses it.
  bool gid = false;

  // `default_fabric` is what "ip:" forms map to.
  static Result<Address> parse(std::string_view text, FabricKind default_fabric = FabricKind::tcp);

  // Canonical text, e.g. "tcp:127.0.0.1:1234", "rdma:[fe80::1]:1234", "loopback:srv:1234",
  // "gid:[::ffff:198.18.0.1]:1234".
  std::string to_string() const;
  // Host part only, as the kernel's sysfs prints it in src_addr/dst_addr: "ip:127.0.0.1".
  std::string host_string() const;

  // The same address with another port.
  Address with_port(uint16_t p) const;

  const sockaddr* sockaddr_ptr() const { return reinterpret_cast<const sockaddr*>(&sa); }
  socklen_t sockaddr_len() const;
  int family() const { return sa.ss_family; }

  friend bool operator==(const Address& a, const Address& b) { return a.to_string() == b.to_string(); }
};

}  // namespace ibtrs
