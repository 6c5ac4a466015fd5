#include <gtest/gtest.h>

#include "ibtrs/address.h"

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

}  // namespace
}  // namespace ibtrs
