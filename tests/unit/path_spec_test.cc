#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <set>

#include "ibtrs/path_spec.h"

namespace ibtrs {
namespace {

TEST(PathSpec, KernelAddPathSyntax) {
  auto p = PathSpec::parse("ip:198.18.0.1,ip:198.18.0.2\n", FabricKind::rdma);
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE(p->source.has_value());
  EXPECT_EQ(p->destination.fabric, FabricKind::rdma);
  EXPECT_EQ(p->destination.port, kDefaultPort);
  EXPECT_EQ(p->source->port, 0) << "a source binds any port";
  EXPECT_EQ(p->name(), "ip:198.18.0.1@ip:198.18.0.2");
}

TEST(PathSpec, DestinationOnlyAndPathNames) {
  auto p = PathSpec::parse("ip:10.0.0.5", FabricKind::tcp, 7777);
  ASSERT_TRUE(p.ok());
  EXPECT_FALSE(p->source.has_value());
  EXPECT_EQ(p->destination.port, 7777);
  EXPECT_EQ(p->name(), "tcp:0.0.0.0@tcp:10.0.0.5:7777")
      << "a tcp path says so, and a port other than the default is part of the name";
  auto at = PathSpec::parse("ip:1.2.3.4@ip:5.6.7.8", FabricKind::rdma);
  ASSERT_TRUE(at.ok());
  EXPECT_EQ(at->name(), "ip:1.2.3.4@ip:5.6.7.8") << "the kernel's names for rdma paths";
  auto tcp = PathSpec::parse("tcp:1.2.3.4@tcp:5.6.7.8:1234");
  ASSERT_TRUE(tcp.ok());
  EXPECT_EQ(tcp->name(), "tcp:1.2.3.4@tcp:5.6.7.8");
}

TEST(PathSpec, OurFabricFormsKeepTheirPorts) {
  auto p = PathSpec::parse("tcp:127.0.0.1:4000", FabricKind::rdma, 9);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->destination.fabric, FabricKind::tcp);
  EXPECT_EQ(p->destination.port, 4000);
  auto v6 = PathSpec::parse("ip:fe80::1,ip:fe80::2");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->destination.family(), AF_INET6);
}

TEST(PathSpec, RejectsMalformedOrMismatchedPaths) {
  for (const char* bad : {"", ",ip:1.2.3.4", "@ip:1.2.3.4", "ip:1.2.3.4,", "ip:1.2.3.4@",
                          "ip:1.1.1.1,ip:2.2.2.2,ip:3.3.3.3", "ip:1.1.1.1@ip:2.2.2.2@ip:3.3.3.3",
                          "tcp:1.2.3.4:1,rdma:5.6.7.8:1", "ip:1.2.3.4,ip:fe80::1", "nonsense"}) {
    EXPECT_FALSE(PathSpec::parse(bad).ok()) << bad;
  }
}

TEST(Uuid16, RandomVersion4AndFormatted) {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    Uuid16 u = Uuid16::random();
    EXPECT_FALSE(u.is_nil());
    std::string s = u.to_string();
    ASSERT_EQ(s.size(), 36u);
    EXPECT_EQ(s[14], '4') << s;
    EXPECT_TRUE(s[19] == '8' || s[19] == '9' || s[19] == 'a' || s[19] == 'b') << s;
    EXPECT_TRUE(seen.insert(s).second);
  }
  EXPECT_TRUE(Uuid16{}.is_nil());
}

// Case: a process draws a uuid, then forks (as fio forks its jobs after a probe). Expect: parent
// and child draw different uuids next — no generator state is inherited.
TEST(Uuid16, ForkedProcessesDrawDifferentUuids) {
  (void)Uuid16::random();
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    Uuid16 u = Uuid16::random();
    ssize_t w = ::write(fds[1], u.bytes, sizeof(u.bytes));
    ::_exit(w == static_cast<ssize_t>(sizeof(u.bytes)) ? 0 : 1);
  }
  Uuid16 mine = Uuid16::random();
  Uuid16 child;
  ASSERT_EQ(::read(fds[0], child.bytes, sizeof(child.bytes)), static_cast<ssize_t>(sizeof(child.bytes)));
  int st = 0;
  ::waitpid(pid, &st, 0);
  ::close(fds[0]);
  ::close(fds[1]);
  EXPECT_NE(mine.to_string(), child.to_string());
}

}  // namespace
}  // namespace ibtrs
