// ListenSpec: parsing and printing of the addresses an NBD server listens on.
#include <arpa/inet.h>

#include <charconv>

#include "ibnbd/nbd_server.h"

namespace ibnbd::nbd {

ListenSpec ListenSpec::unix_socket(std::string path, mode_t mode, std::optional<gid_t> group) {
  ListenSpec l;
  l.kind = Kind::unix_socket;
  l.path = std::move(path);
  l.mode = mode;
  l.group = group;
  return l;
}

Result<ListenSpec> ListenSpec::parse_tcp(std::string_view s) {
  ListenSpec l;
  l.kind = Kind::tcp;
  std::string_view host = "127.0.0.1", port = s;
  if (!s.empty() && s.front() == '[') {
    const size_t close = s.find(']');
    if (close == std::string_view::npos || close + 1 >= s.size() || s[close + 1] != ':')
      return ibtrs::errc(EINVAL);
    host = s.substr(1, close - 1);
    port = s.substr(close + 2);
  } else if (const size_t colon = s.rfind(':'); colon != std::string_view::npos) {
    if (s.find(':') != colon) return ibtrs::errc(EINVAL);  // bare IPv6 needs brackets
    if (colon > 0) host = s.substr(0, colon);
    port = s.substr(colon + 1);
  }
  if (host == "localhost") host = "127.0.0.1";
  unsigned v = 0;
  auto [p, ec] = std::from_chars(port.data(), port.data() + port.size(), v);
  if (port.empty() || ec != std::errc() || p != port.data() + port.size() || v > 65535)
    return ibtrs::errc(EINVAL);
  l.port = static_cast<uint16_t>(v);
  l.host = std::string(host);
  in_addr a4{};
  in6_addr a6{};
  if (inet_pton(AF_INET, l.host.c_str(), &a4) != 1 && inet_pton(AF_INET6, l.host.c_str(), &a6) != 1)
    return ibtrs::errc(EINVAL);  // numeric only: no resolver in a daemon's control path
  return l;
}

bool ListenSpec::is_local() const {
  if (kind == Kind::unix_socket) return true;
  in_addr a4{};
  if (inet_pton(AF_INET, host.c_str(), &a4) == 1) return (ntohl(a4.s_addr) >> 24) == 127;
  in6_addr a6{};
  return inet_pton(AF_INET6, host.c_str(), &a6) == 1 && IN6_IS_ADDR_LOOPBACK(&a6);
}

std::string ListenSpec::to_string() const {
  if (kind == Kind::unix_socket) return "unix:" + path;
  const bool v6 = host.find(':') != std::string::npos;
  return "tcp:" + (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

}  // namespace ibnbd::nbd
