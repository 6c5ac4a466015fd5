#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>

#include "ibtrs/address.h"
#include "ibtrs/gid.h"

namespace ibtrs {
namespace {

TEST(Address, ParsesTcpIpv4WithPort) {
  auto a = Address::parse("tcp:127.0.0.1:4321");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->fabric, FabricKind::tcp);
  EXPECT_EQ(a->port, 4321);
  EXPECT_EQ(a->family(), AF_INET);
  EXPECT_EQ(a->to_string(), "tcp:127.0.0.1:4321");
  EXPECT_EQ(a->host_string(), "ip:127.0.0.1");
}

TEST(Address, DefaultPortIsTheKernelsRtrsPort) {
  auto a = Address::parse("rdma:198.18.0.2");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->port, 1234);
  EXPECT_EQ(a->to_string(), "rdma:198.18.0.2:1234");
}

TEST(Address, ParsesBracketedIpv6) {
  auto a = Address::parse("tcp:[::1]:99");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->family(), AF_INET6);
  EXPECT_EQ(a->to_string(), "tcp:[::1]:99");
  auto b = Address::parse("tcp:[fe80::1]");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->port, 1234);
}

TEST(Address, KernelIpAndGidFormsMapToTheDefaultFabric) {
  auto a = Address::parse("ip:10.0.0.1", FabricKind::rdma);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->fabric, FabricKind::rdma);
  auto v6 = Address::parse("ip:fe80::1:2", FabricKind::tcp);
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->family(), AF_INET6);
  // A RoCE GID of an IPv4 host is the IPv4-mapped IPv6 address.
  auto g = Address::parse("gid:0000:0000:0000:0000:0000:ffff:c612:0001", FabricKind::rdma);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->family(), AF_INET);
  EXPECT_EQ(g->host_string(), "ip:198.18.0.1");
}

TEST(Address, LoopbackNames) {
  auto a = Address::parse("loopback:srv-1:7");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->name, "srv-1");
  EXPECT_EQ(a->port, 7);
  EXPECT_EQ(a->to_string(), "loopback:srv-1:7");
}

TEST(Address, RejectsMalformedInput) {
  for (const char* bad : {"", "tcp", "tcp:", "udp:1.2.3.4", "tcp:1.2.3.4:", "tcp:1.2.3.4:65536",
                          "tcp:1.2.3.4:-1", "tcp:1.2.3.4:12x", "tcp:::1", "tcp:[::1",
                          "tcp:[::1]x", "tcp:example.com", "tcp:1.2.3", "ip:", "gid:1.2.3.4",
                          "loopback:", "loopback:a/b", "tcp:[::1]:", "ip:999.1.1.1"}) {
    EXPECT_FALSE(Address::parse(bad).ok()) << bad;
  }
}

TEST(Address, WithPortChangesTheSocketAddressToo) {
  auto a = Address::parse("tcp:127.0.0.1:1");
  ASSERT_TRUE(a.ok());
  Address b = a->with_port(555);
  EXPECT_EQ(b.port, 555);
  EXPECT_EQ(ntohs(reinterpret_cast<const sockaddr_in*>(&b.sa)->sin_port), 555);
}

// ---- gid: addresses (ibtrs/gid.h) ----

// A fake /sys/class/infiniband: DEV/ports/PORT/{link_layer, gids/I, gid_attrs/types/I}.
struct FakeIbSysfs {
  std::string root;
  FakeIbSysfs() {
    char tmpl[] = "/tmp/ibtrs-gid-test.XXXXXX";
    root = ::mkdtemp(tmpl);
  }
  ~FakeIbSysfs() { std::filesystem::remove_all(root); }
  void gid(const std::string& dev, int port, const char* link_layer, int index, const std::string& gid,
           const std::string& type) {
    const std::filesystem::path p = std::filesystem::path(root) / dev / "ports" / std::to_string(port);
    std::filesystem::create_directories(p / "gids");
    std::filesystem::create_directories(p / "gid_attrs" / "types");
    std::ofstream(p / "link_layer") << link_layer << "\n";
    std::ofstream(p / "gids" / std::to_string(index)) << gid << "\n";
    std::ofstream(p / "gid_attrs" / "types" / std::to_string(index)) << type << "\n";
  }
};

constexpr const char* kV4A = "0000:0000:0000:0000:0000:ffff:c612:0001";  // 198.18.0.1
constexpr const char* kV4B = "0000:0000:0000:0000:0000:ffff:c612:0002";  // 198.18.0.2
constexpr const char* kLinkLocal = "fe80:0000:0000:0000:b0c1:23ff:fe45:6789";

TEST(Gid, TablesReadFromSysfsSkipEmptyEntries) {
  FakeIbSysfs fs;
  fs.gid("rxe0", 1, "Ethernet", 0, kLinkLocal, "IB/RoCE v1");
  fs.gid("rxe0", 1, "Ethernet", 1, kLinkLocal, "RoCE v2");
  fs.gid("rxe0", 1, "Ethernet", 2, kV4A, "IB/RoCE v1");
  fs.gid("rxe0", 1, "Ethernet", 3, kV4A, "RoCE v2");
  fs.gid("rxe0", 1, "Ethernet", 4, "0000:0000:0000:0000:0000:0000:0000:0000", "");
  auto t = read_gid_tables(fs.root);
  ASSERT_EQ(t.size(), 4u) << "the all-zero entry is unused";
  EXPECT_EQ(read_gid_tables(fs.root + "/none").size(), 0u) << "no RDMA devices: no GIDs";
  int v2 = 0;
  for (auto& e : t) {
    EXPECT_EQ(e.device, "rxe0");
    EXPECT_EQ(e.port, 1u);
    EXPECT_FALSE(e.infiniband);
    if (e.index == 3) {
      EXPECT_EQ(gid_string(e.gid), kV4A);
      EXPECT_EQ(e.type, "RoCE v2");
      ++v2;
    }
  }
  EXPECT_EQ(v2, 1);
}

TEST(Gid, GidFormsMeanRdmaAndKeepTheirGid) {
  // Case: gid: with tcp as the default fabric (the daemons' default). Expect: rdma (a GID is an
  // RDMA address), marked as a GID; ip: keeps the default.
  auto g = Address::parse(std::string("gid:") + kV4A, FabricKind::tcp);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->fabric, FabricKind::rdma);
  EXPECT_TRUE(g->gid);
  EXPECT_EQ(gid_string(gid_of(*g)), kV4A);
  EXPECT_FALSE(Address::parse("ip:198.18.0.1", FabricKind::tcp)->gid);
  EXPECT_EQ(Address::parse("ip:198.18.0.1", FabricKind::tcp)->fabric, FabricKind::tcp);
  EXPECT_TRUE(Address::parse("gid:fe80::1", FabricKind::loopback).ok()) << "tests' in-process fabric";
  // Case: a path of gid: forms, the destination with a port in brackets. Expect: that port kept
  // (the kernel's forms without one take the given port), the GID form in its text.
  auto p = PathSpec::parse(std::string("gid:") + kV4A + "@gid:[::ffff:198.18.0.2]:4000");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->destination.to_string(), "gid:[::ffff:198.18.0.2]:4000");
  EXPECT_EQ(p->name(), "ip:198.18.0.1@ip:198.18.0.2:4000");
  EXPECT_EQ(PathSpec::parse("gid:::ffff:198.18.0.2", FabricKind::tcp, 99)->destination.port, 99);
}

TEST(Gid, RoceGidsResolveToTheirIpForm) {
  FakeIbSysfs fs;
  fs.gid("rxe0", 1, "Ethernet", 0, kLinkLocal, "IB/RoCE v1");
  fs.gid("rxe0", 1, "Ethernet", 1, kV4A, "RoCE v2");
  const auto t = read_gid_tables(fs.root);
  std::string why;
  // Case: a source GID of a local RoCE port, and a peer's GID. Expect: their IPv4 forms, no
  // longer marked as GIDs (rdma_cm takes them as AF_INET).
  auto src = resolve_gid_address(*Address::parse(std::string("gid:") + kV4A), true, t, &why);
  ASSERT_TRUE(src.ok()) << why;
  EXPECT_FALSE(src->gid);
  EXPECT_EQ(src->family(), AF_INET);
  EXPECT_EQ(src->host_string(), "ip:198.18.0.1");
  auto dst = resolve_gid_address(Address::parse(std::string("gid:") + kV4B)->with_port(4000), false, t, &why);
  ASSERT_TRUE(dst.ok()) << why;
  EXPECT_EQ(dst->to_string(), "rdma:198.18.0.2:4000");
  auto v6 = resolve_gid_address(*Address::parse("gid:2001:db8::7"), false, t, &why);
  ASSERT_TRUE(v6.ok()) << why;
  EXPECT_EQ(v6->to_string(), "rdma:[2001:db8::7]:1234");
  // Case: ip: and rdma: forms. Expect: untouched, whatever the tables say.
  auto ip = Address::parse("rdma:10.0.0.9");
  EXPECT_EQ(resolve_gid_address(*ip, true, {}, &why)->to_string(), "rdma:10.0.0.9:1234");
}

TEST(Gid, GidsWithoutAnIpFormOrALocalPortAreRefusedWithTheReason) {
  FakeIbSysfs fs;
  fs.gid("rxe0", 1, "Ethernet", 0, kLinkLocal, "IB/RoCE v1");
  fs.gid("rxe0", 1, "Ethernet", 1, kV4A, "RoCE v2");
  fs.gid("mlx5_0", 1, "InfiniBand", 0, "fe80:0000:0000:0000:0002:c903:0001:0001", "IB/RoCE v1");
  const auto t = read_gid_tables(fs.root);
  std::string why;
  // Case: a source GID no local port has. Expect: ENODEV naming the GID.
  auto r = resolve_gid_address(*Address::parse(std::string("gid:") + kV4B), true, t, &why);
  EXPECT_EQ(r.error(), std::errc::no_such_device);
  EXPECT_NE(why.find(std::string("gid:") + kV4B + ": no local RDMA port has this GID"), std::string::npos) << why;
  // Case: the RoCE port's default (link-local, MAC-derived) GID. Expect: EADDRNOTAVAIL naming
  // the port and entry: it is no IP address of the netdev.
  r = resolve_gid_address(*Address::parse(std::string("gid:") + kLinkLocal), true, t, &why);
  EXPECT_EQ(r.error(), std::errc::address_not_available);
  EXPECT_NE(why.find("link-local GID (rxe0 port 1 index 0, IB/RoCE v1) has no IP form"), std::string::npos) << why;
  r = resolve_gid_address(*Address::parse("gid:fe80::1"), false, t, &why);
  EXPECT_EQ(r.error(), std::errc::address_not_available) << "a peer's link-local GID too";
  // Case: a GID of an InfiniBand port. Expect: EAFNOSUPPORT (AF_IB), pointing to IPoIB.
  r = resolve_gid_address(*Address::parse("gid:fe80::2:c903:1:1"), true, t, &why);
  EXPECT_EQ(r.error(), std::errc::address_family_not_supported);
  EXPECT_NE(why.find("InfiniBand port (mlx5_0 port 1): AF_IB is not supported"), std::string::npos) << why;
  // Case: a GID on the tcp fabric (an address built in code). Expect: EAFNOSUPPORT, "RDMA".
  Address tcp = *Address::parse("tcp:198.18.0.1");
  tcp.gid = true;
  r = resolve_gid_address(tcp, false, t, &why);
  EXPECT_EQ(r.error(), std::errc::address_family_not_supported);
  EXPECT_NE(why.find("a GID is an RDMA address"), std::string::npos) << why;
}

}  // namespace
}  // namespace ibtrs
