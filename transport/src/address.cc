#include "ibtrs/address.h"

#include <arpa/inet.h>

#include <cctype>
#include <charconv>
#include <cstring>

namespace ibtrs {

std::string_view to_string(FabricKind k) {
  switch (k) {
    case FabricKind::tcp: return "tcp";
    case FabricKind::rdma: return "rdma";
    case FabricKind::loopback: return "loopback";
  }
  return "?";
}

Result<FabricKind> parse_fabric_kind(std::string_view name) {
  if (name == "tcp") return FabricKind::tcp;
  if (name == "rdma") return FabricKind::rdma;
  if (name == "loopback") return FabricKind::loopback;
  return errc(EINVAL);
}

namespace {

Result<uint16_t> parse_port(std::string_view s) {
  unsigned v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc{} || p != s.data() + s.size() || v > 65535) return errc(EINVAL);
  return static_cast<uint16_t>(v);
}

// Fills `out` from a numeric IPv4 or IPv6 host (no brackets). IPv4-mapped IPv6 (::ffff:a.b.c.d,
// the RoCE GID form of an IPv4 host) becomes plain IPv4.
bool parse_host(std::string_view host, uint16_t port, sockaddr_storage& out) {
  if (host.empty() || host.size() >= INET6_ADDRSTRLEN + 16) return false;
  char buf[INET6_ADDRSTRLEN + 16];
  std::memcpy(buf, host.data(), host.size());
  buf[host.size()] = '\0';
  std::memset(&out, 0, sizeof(out));
  in_addr v4{};
  if (inet_pton(AF_INET, buf, &v4) == 1) {
    auto* sin = reinterpret_cast<sockaddr_in*>(&out);
    sin->sin_family = AF_INET;
    sin->sin_port = htons(port);
    sin->sin_addr = v4;
    return true;
  }
  in6_addr v6{};
  if (inet_pton(AF_INET6, buf, &v6) == 1) {
    if (IN6_IS_ADDR_V4MAPPED(&v6)) {
      auto* sin = reinterpret_cast<sockaddr_in*>(&out);
      sin->sin_family = AF_INET;
      sin->sin_port = htons(port);
      std::memcpy(&sin->sin_addr, &v6.s6_addr[12], 4);
      return true;
    }
    auto* sin6 = reinterpret_cast<sockaddr_in6*>(&out);
    sin6->sin6_family = AF_INET6;
    sin6->sin6_port = htons(port);
    sin6->sin6_addr = v6;
    return true;
  }
  return false;
}

// Splits "HOST[:PORT]" where HOST is IPv4 or "[IPv6]".
Result<Address> parse_host_port(FabricKind kind, std::string_view rest) {
  Address a;
  a.fabric = kind;
  std::string_view host = rest;
  std::string_view port;
  if (!rest.empty() && rest.front() == '[') {
    auto close = rest.find(']');
    if (close == std::string_view::npos) return errc(EINVAL);
    host = rest.substr(1, close - 1);
    auto after = rest.substr(close + 1);
    if (!after.empty()) {
      if (after.front() != ':') return errc(EINVAL);
      port = after.substr(1);
      if (port.empty()) return errc(EINVAL);
    }
  } else {
    auto colon = rest.find(':');
    if (colon != std::string_view::npos) {
      if (rest.find(':', colon + 1) != std::string_view::npos) return errc(EINVAL);  // bare IPv6
      host = rest.substr(0, colon);
      port = rest.substr(colon + 1);
      if (port.empty()) return errc(EINVAL);
    }
  }
  if (!port.empty()) {
    auto p = parse_port(port);
    if (!p) return p.error();
    a.port = *p;
  }
  if (!parse_host(host, a.port, a.sa)) return errc(EINVAL);
  return a;
}

}  // namespace

Result<Address> Address::parse(std::string_view text, FabricKind default_fabric) {
  auto colon = text.find(':');
  if (colon == std::string_view::npos) return errc(EINVAL);
  std::string_view scheme = text.substr(0, colon);
  std::string_view rest = text.substr(colon + 1);
  if (rest.empty()) return errc(EINVAL);

  if (scheme == "ip" || scheme == "gid") {
    const bool gid = scheme == "gid";
    // A GID means RDMA, whatever the default (the in-process fabric of tests aside).
    const FabricKind kind = gid && default_fabric != FabricKind::loopback ? FabricKind::rdma : default_fabric;
    // The kernel's forms carry no port; a bracketed IPv6 may, as an extension.
    if (rest.front() == '[') {
      if (gid && rest.find(':') == std::string_view::npos) return errc(EINVAL);
      auto a = parse_host_port(kind, rest);
      if (a) a->gid = gid;
      return a;
    }
    Address a;
    a.fabric = kind;
    a.gid = gid;
    if (gid && rest.find(':') == std::string_view::npos) return errc(EINVAL);
    if (!parse_host(rest, a.port, a.sa)) return errc(EINVAL);
    if (default_fabric == FabricKind::loopback) {
      a.name = std::string(rest);
    }
    return a;
  }
  auto kind = parse_fabric_kind(scheme);
  if (!kind) return kind.error();
  if (*kind == FabricKind::loopback) {
    Address a;
    a.fabric = FabricKind::loopback;
    auto pc = rest.rfind(':');
    std::string_view name = rest;
    if (pc != std::string_view::npos) {
      auto p = parse_port(rest.substr(pc + 1));
      if (!p) return p.error();
      a.port = *p;
      name = rest.substr(0, pc);
    }
    if (name.empty() || name.size() > 64) return errc(EINVAL);
    for (char c : name) {
      if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.'))
        return errc(EINVAL);
    }
    a.name = std::string(name);
    return a;
  }
  return parse_host_port(*kind, rest);
}

Address Address::with_port(uint16_t p) const {
  Address a = *this;
  a.port = p;
  if (a.sa.ss_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6*>(&a.sa)->sin6_port = htons(p);
  } else if (a.sa.ss_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(&a.sa)->sin_port = htons(p);
  }
  return a;
}

socklen_t Address::sockaddr_len() const {
  return sa.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
}

std::string Address::host_string() const {
  if (fabric == FabricKind::loopback) return "loopback:" + name;
  char buf[INET6_ADDRSTRLEN] = {};
  if (sa.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&sa)->sin6_addr, buf, sizeof(buf));
  } else {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&sa)->sin_addr, buf, sizeof(buf));
  }
  return std::string("ip:") + buf;
}

std::string Address::to_string() const {
  const bool gid_form = gid && fabric == FabricKind::rdma;
  std::string out(gid_form ? std::string_view("gid") : ibtrs::to_string(fabric));
  out += ':';
  if (fabric == FabricKind::loopback) {
    out += name;
  } else {
    char buf[INET6_ADDRSTRLEN] = {};
    if (sa.ss_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&sa)->sin6_addr, buf, sizeof(buf));
      out += '[';
      out += buf;
      out += ']';
    } else if (gid_form) {  // the GID form of an IPv4 host
      inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&sa)->sin_addr, buf, sizeof(buf));
      out += "[::ffff:";
      out += buf;
      out += ']';
    } else {
      inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&sa)->sin_addr, buf, sizeof(buf));
      out += buf;
    }
  }
  out += ':';
  out += std::to_string(port);
  return out;
}

}  // namespace ibtrs
