#include <gtest/gtest.h>

#include <thread>

#include "session_harness.h"

namespace ibtrs::test {
namespace {

TEST(SessionSmoke, WriteThenReadBackOverTcp) {
  RamVolume vol(8 << 20);
  ServerOptions so;
  so.listen.push_back(*Address::parse("tcp:127.0.0.1:0"));
  so.queue_depth = 64;
  so.io_threads = 2;
  so.handler = &vol;
  so.allow_any_host = true;  // the transport's IO; authentication: auth_test.cc
  auto srv = Server::start(so);
  ASSERT_TRUE(srv.ok()) << srv.error().message();
  Address a = (*srv)->addresses()[0];
  ClientOptions co;
  co.session_name = "smoke";
  co.paths.push_back(PathSpec{std::nullopt, a});
  co.io_threads = 2;
  auto cs = ClientSession::open(co);
  ASSERT_TRUE(cs.ok()) << cs.error().message();
  auto& s = **cs;
  auto buf = s.alloc_buffer(1 << 20);
  ASSERT_TRUE(buf.ok());
  auto* b = (*buf)->data();
  for (int i = 0; i < 65536; ++i) b[i] = std::byte(i * 7);
  EXPECT_EQ(sync_io(s, IoDir::write, **buf, b, 65536, 4096), 0);
  std::memset(b, 0, 65536);
  EXPECT_EQ(sync_io(s, IoDir::read, **buf, b, 65536, 4096), 0);
  for (int i = 0; i < 65536; ++i) ASSERT_EQ(b[i], std::byte(i * 7)) << i;
}

}  // namespace
}  // namespace ibtrs::test
