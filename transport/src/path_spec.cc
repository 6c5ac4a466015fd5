#include "ibtrs/path_spec.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "base/text.h"

namespace ibtrs {

Result<PathSpec> PathSpec::parse(std::string_view text, FabricKind default_fabric, uint16_t port) {
  text = base::trim(text);  // sysfs writes end in a newline
  if (text.empty()) return errc(EINVAL);
  // "src@dst" (the kernel's path names) or "[src,]dst" (its add_path syntax). An IPv6 address
  // contains neither ',' nor '@', so the separators are unambiguous.
  std::string_view src, dst;
  if (auto at = text.find('@'); at != std::string_view::npos) {
    src = text.substr(0, at);
    dst = text.substr(at + 1);
    if (src.empty()) return errc(EINVAL);
  } else if (auto comma = text.find(','); comma != std::string_view::npos) {
    src = text.substr(0, comma);
    dst = text.substr(comma + 1);
    if (src.empty()) return errc(EINVAL);
  } else {
    dst = text;
  }
  if (dst.find_first_of(",@") != std::string_view::npos) return errc(EINVAL);
  auto with_port = [&](std::string_view t) -> Result<Address> {
    const bool kernel_form = t.rfind("ip:", 0) == 0 || t.rfind("gid:", 0) == 0;
    // The kernel's forms carry no port; ours in brackets may ("gid:[GID]:PORT"), and keep it.
    const bool own_port = kernel_form && t.find("]:") != std::string_view::npos;
    auto a = Address::parse(t, default_fabric);
    if (!a) return a.error();
    return kernel_form && !own_port ? a->with_port(port) : *a;
  };
  PathSpec p;
  auto d = with_port(dst);
  if (!d) return d.error();
  p.destination = *d;
  if (!src.empty()) {
    auto s = with_port(src);
    if (!s) return s.error();
    if (s->fabric != p.destination.fabric) return errc(EINVAL);
    if (s->fabric != FabricKind::loopback && s->family() != p.destination.family()) return errc(EINVAL);
    p.source = s->with_port(0);
  }
  return p;
}

namespace {
// The kernel's "ip:<addr>" for rdma (its only fabric); our other fabrics say which they are, so
// an rdma and a tcp path between the same hosts have different names.
std::string side_name(const Address& a) {
  std::string h = a.host_string();
  if (a.fabric == FabricKind::rdma || a.fabric == FabricKind::loopback) return h;
  return std::string(to_string(a.fabric)) + h.substr(h.find(':'));
}
}  // namespace

std::string PathSpec::name() const {
  std::string src;
  if (source) {
    src = side_name(*source);
  } else {
    src = std::string(destination.fabric == FabricKind::rdma ? "ip" : to_string(destination.fabric)) +
          (destination.family() == AF_INET6 ? ":::" : ":0.0.0.0");
    if (destination.fabric == FabricKind::loopback) src = "loopback:";
  }
  std::string dst = side_name(destination);
  // Two paths to one host differ by port: a port other than the default is part of the name.
  if (destination.fabric != FabricKind::loopback && destination.port != kDefaultPort) {
    if (destination.family() == AF_INET6) {
      auto colon = dst.find(':');
      dst = dst.substr(0, colon + 1) + "[" + dst.substr(colon + 1) + "]";
    }
    // Appended piecewise: g++ 12 -O3 warns falsely (-Wrestrict) on "literal" + std::string.
    dst += ':';
    dst += std::to_string(destination.port);
  }
  std::string name = std::move(src);
  name += '@';
  name += dst;
  return name;
}

Uuid16 Uuid16::random() {
  // Straight from the kernel's pool: a generator state kept in the process would be inherited
  // by fork() (fio forks its jobs), and two children would open sessions with one uuid.
  Uuid16 u;
  size_t got = 0;
  while (got < sizeof(u.bytes)) {
    ssize_t n = ::getrandom(u.bytes + got, sizeof(u.bytes) - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (n < 0 && errno != EINTR) {
      // No getrandom (kernels < 3.17): a fresh std::random_device per call, never a state
      // that outlives the call.
      std::random_device rd;
      for (auto& b : u.bytes) b = static_cast<uint8_t>(rd());
      got = sizeof(u.bytes);
    }
  }
  u.bytes[6] = static_cast<uint8_t>((u.bytes[6] & 0x0f) | 0x40);  // version 4
  u.bytes[8] = static_cast<uint8_t>((u.bytes[8] & 0x3f) | 0x80);  // RFC 4122 variant
  return u;
}

std::string Uuid16::to_string() const {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s;
  s.reserve(36);
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) s += '-';
    s += kHex[bytes[i] >> 4];
    s += kHex[bytes[i] & 0xf];
  }
  return s;
}

bool Uuid16::is_nil() const {
  for (uint8_t b : bytes) {
    if (b != 0) return false;
  }
  return true;
}

bool operator==(const Uuid16& a, const Uuid16& b) { return std::memcmp(a.bytes, b.bytes, 16) == 0; }

}  // namespace ibtrs
