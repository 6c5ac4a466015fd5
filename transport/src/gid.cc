#include "ibtrs/gid.h"

#include <arpa/inet.h>
#include <dirent.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>

namespace ibtrs {

namespace {

// Bounds of the walk: a hostile or broken sysfs cannot make it unbounded.
constexpr size_t kMaxDevices = 64, kMaxPorts = 32, kMaxGids = 1024;

struct DirCloser {
  void operator()(DIR* d) const { ::closedir(d); }
};

// The numeric (or, with numeric=false, any) entry names of `dir`, at most `limit`.
std::vector<std::string> entries(const std::string& dir, size_t limit, bool numeric) {
  std::vector<std::string> out;
  std::unique_ptr<DIR, DirCloser> d(::opendir(dir.c_str()));
  if (!d) return out;
  while (dirent* e = ::readdir(d.get())) {
    std::string n = e->d_name;
    if (n.empty() || n[0] == '.') continue;
    if (numeric && n.find_first_not_of("0123456789") != std::string::npos) continue;
    out.push_back(std::move(n));
    if (out.size() == limit) break;
  }
  return out;
}

// The first line of a sysfs file ("" if unreadable).
std::string first_line(const std::string& path) {
  std::ifstream f(path);
  std::string l;
  std::getline(f, l);
  return l;
}

bool parse_gid(const std::string& text, Gid& g) {
  in6_addr a{};
  if (::inet_pton(AF_INET6, text.c_str(), &a) != 1) return false;
  std::memcpy(g.data(), a.s6_addr, 16);
  return true;
}

uint32_t number(const std::string& s) {
  uint32_t v = 0;
  std::from_chars(s.data(), s.data() + s.size(), v);
  return v;
}

bool is_link_local(const Gid& g) { return g[0] == 0xfe && (g[1] & 0xc0) == 0x80; }

}  // namespace

std::vector<GidEntry> read_gid_tables(const std::string& root) {
  std::vector<GidEntry> out;
  for (const std::string& dev : entries(root, kMaxDevices, false)) {
    const std::string ports = root + "/" + dev + "/ports";
    for (const std::string& p : entries(ports, kMaxPorts, true)) {
      const std::string pdir = ports + "/" + p;
      const bool ib = first_line(pdir + "/link_layer") == "InfiniBand";
      for (const std::string& i : entries(pdir + "/gids", kMaxGids, true)) {
        GidEntry e;
        // An unused entry reads as all zeroes (or fails to read, on newer kernels).
        if (!parse_gid(first_line(pdir + "/gids/" + i), e.gid) || e.gid == Gid{}) continue;
        e.device = dev;
        e.port = number(p);
        e.index = number(i);
        e.type = first_line(pdir + "/gid_attrs/types/" + i);
        e.infiniband = ib;
        out.push_back(std::move(e));
      }
    }
  }
  return out;
}

Gid gid_of(const Address& a) {
  Gid g{};
  if (a.family() == AF_INET) {
    g[10] = g[11] = 0xff;
    std::memcpy(&g[12], &reinterpret_cast<const sockaddr_in*>(&a.sa)->sin_addr, 4);
  } else if (a.family() == AF_INET6) {
    std::memcpy(g.data(), &reinterpret_cast<const sockaddr_in6*>(&a.sa)->sin6_addr, 16);
  }
  return g;
}

std::string gid_string(const Gid& g) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x", g[0], g[1],
                g[2], g[3], g[4], g[5], g[6], g[7], g[8], g[9], g[10], g[11], g[12], g[13], g[14], g[15]);
  return buf;
}

Result<Address> resolve_gid_address(const Address& a, bool source, const std::vector<GidEntry>& tables,
                                    std::string* why) {
  if (!a.gid) return a;
  auto fail = [why](int e, std::string text) -> std::error_code {
    if (why != nullptr) *why = std::move(text);
    return errc(e);
  };
  const Gid g = gid_of(a);
  const std::string name = "gid:" + gid_string(g);
  if (a.fabric != FabricKind::rdma) return fail(EAFNOSUPPORT, name + ": a GID is an RDMA address (tcp paths take ip:)");
  const GidEntry* local = nullptr;
  for (const GidEntry& e : tables) {
    if (e.gid != g) continue;
    // RoCE v2 (routable, what rdma_cm uses by default) before v1 for the same address.
    if (local == nullptr || e.type == "RoCE v2") local = &e;
  }
  if (source && local == nullptr)
    return fail(ENODEV, name + ": no local RDMA port has this GID (see ibv_devinfo -v, or /sys/class/infiniband/*/ports/*/gids/)");
  if (local != nullptr && local->infiniband)
    return fail(EAFNOSUPPORT, name + ": a GID of an InfiniBand port (" + local->device + " port " +
                                  std::to_string(local->port) + "): AF_IB is not supported; give the port's IPoIB address as ip:");
  if (is_link_local(g)) {
    bool any_ib = false;
    for (const GidEntry& e : tables) any_ib = any_ib || e.infiniband;
    std::string where;
    if (local != nullptr)
      where = " (" + local->device + " port " + std::to_string(local->port) + " index " + std::to_string(local->index) +
              (local->type.empty() ? "" : ", " + local->type) + ")";
    return fail(EADDRNOTAVAIL, name + ": a link-local GID" + where +
                                   " has no IP form rdma_cm can route on RoCE (give a GID of an IPv4 or global IPv6 address)" +
                                   (any_ib ? "; on InfiniBand it needs AF_IB, not supported: give the IPoIB address as ip:" : ""));
  }
  Address out = a;
  out.gid = false;  // its IP form: the sockaddr already holds it (Address::parse)
  return out;
}

Result<Address> resolve_gid_address(const Address& a, bool source, std::string* why) {
  if (!a.gid) return a;
  return resolve_gid_address(a, source, read_gid_tables(), why);
}

Status check_gid_path(const PathSpec& p, std::string* why) {
  if (!p.destination.gid && !(p.source && p.source->gid)) return {};
  const auto tables = read_gid_tables();
  if (p.source) BASE_TRY(resolve_gid_address(*p.source, true, tables, why));
  BASE_TRY(resolve_gid_address(p.destination, false, tables, why));
  return {};
}

}  // namespace ibtrs
