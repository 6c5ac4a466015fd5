#include "fabric_harness.h"

#include <future>

namespace ibtrs::fabric::testing {

FabricKind& tested_kind() {
  static FabricKind k = FabricKind::loopback;
  return k;
}

FabricOptions& tested_options() {
  static FabricOptions o;
  return o;
}

TestedTls& tested_tls() {
  static TestedTls t;
  return t;
}

bool enable_tested_tls(bool kernel) {
  auto psk = tls::generate_psk("conformance/run");
  if (!psk) {
    std::fprintf(stderr, "generate_psk: %s\n", psk.error().message().c_str());
    return false;
  }
  TestedTls& t = tested_tls();
  t.psk = *psk;
  tls::Config c;
  c.role = tls::Role::client;
  c.psk = t.psk;
  c.kernel = kernel;
  auto cc = tls::Context::create(c);
  tls::Config sc;
  sc.role = tls::Role::server;
  sc.kernel = kernel;
  sc.psk_lookup = [key = t.psk.key, id = t.psk.identity](std::string_view identity)
      -> std::optional<std::vector<std::byte>> {
    if (identity != id) return std::nullopt;
    return key;
  };
  auto sctx = tls::Context::create(sc);
  if (!cc || !sctx) {
    std::fprintf(stderr, "tls context: %s\n", (!cc ? cc.error() : sctx.error()).message().c_str());
    return false;
  }
  t.client = *cc;
  t.server = *sctx;
  t.on = true;
  return true;
}

Result<Endpoints> endpoints_for(FabricKind kind, const std::string& tag) {
  Endpoints e;
  switch (kind) {
    case FabricKind::loopback: {
      auto a = Address::parse("loopback:" + tag + ":0");
      if (!a) return a.error();
      e.server = *a;
      return e;
    }
    case FabricKind::tcp: {
      auto a = Address::parse("tcp:127.0.0.1:0");
      if (!a) return a.error();
      e.server = *a;
      return e;
    }
    case FabricKind::rdma: {
      // The VM rig (tests/vm) gives two Soft-RoCE devices on a veth pair.
      const char* b = std::getenv("IBTRS_RDMA_ADDR_B");
      const char* a = std::getenv("IBTRS_RDMA_ADDR_A");
      if (b == nullptr || a == nullptr) return errc(ENODEV);
      auto srv = Address::parse(std::string("rdma:") + b + ":0");
      auto src = Address::parse(std::string("rdma:") + a + ":0");
      if (!srv || !src) return errc(EINVAL);
      e.server = *srv;
      e.client_source = *src;
      return e;
    }
  }
  return errc(EINVAL);
}

void FabricTest::SetUp() {
  kind_ = tested_kind();
  auto sf = open_fabric(kind_, tested_options());
  if (!sf && (sf.error() == errc(ENODEV) || sf.error() == errc(ENOTSUP))) {
    GTEST_SKIP() << "fabric " << to_string(kind_) << " unavailable here: " << sf.error().message()
                 << " (the rdma provider runs in the VM rig: tests/vm)";
  }
  ASSERT_TRUE(sf.ok()) << sf.error().message();
  server_fabric_ = std::move(sf).value();
  auto cf = open_fabric(kind_, tested_options());
  ASSERT_TRUE(cf.ok()) << cf.error().message();
  client_fabric_ = std::move(cf).value();

  auto ep = endpoints_for(kind_, ::testing::UnitTest::GetInstance()->current_test_info()->name());
  if (!ep && kind_ == FabricKind::rdma) {
    GTEST_SKIP() << "IBTRS_RDMA_ADDR_A/B not set: no RDMA test network (run through tests/vm)";
  }
  ASSERT_TRUE(ep.ok()) << ep.error().message();
  ep_ = *ep;

  Fabric::ListenOptions lo;
  lo.tls = tested_tls().server;
  lo.tls_required = tested_tls().on;
  auto l = server_fabric_->listen(ep_.server, lo);
  ASSERT_TRUE(l.ok()) << "listen " << ep_.server.to_string() << ": " << l.error().message();
  listener_ = std::move(l).value();

  auto sd = server_fabric_->domain_for(listener_->address());
  ASSERT_TRUE(sd.ok()) << sd.error().message();
  server_domain_ = *sd;
  auto cd = client_fabric_->domain_for(listener_->address(),
                                       ep_.client_source ? &*ep_.client_source : nullptr);
  ASSERT_TRUE(cd.ok()) << cd.error().message();
  client_domain_ = *cd;
  srv_.domain = server_domain_;
  cli_.domain = client_domain_;
  auto scq = server_domain_->create_cq(4096);
  auto ccq = client_domain_->create_cq(4096);
  ASSERT_TRUE(scq.ok() && ccq.ok());
  srv_.cq = std::move(scq).value();
  cli_.cq = std::move(ccq).value();
}

void FabricTest::TearDown() {
  cli_.conn.reset();
  srv_.conn.reset();
  listener_.reset();
}

void FabricTest::connect_pair(Side& client, Side& server, const QueueCaps& caps,
                              std::span<const std::byte> req_pd, std::span<const std::byte> rsp_pd) {
  std::vector<std::byte> rsp(rsp_pd.begin(), rsp_pd.end());
  auto accepted = std::async(std::launch::async, [&, rsp]() -> Result<std::unique_ptr<Connection>> {
    auto req = listener_->get_request(10s);
    if (!req) return req.error();
    server.peer_private.assign((*req)->private_data().begin(), (*req)->private_data().end());
    EXPECT_EQ(&(*req)->domain(), server.domain);
    if (server.accept_pd != nullptr)
      return (*req)->accept(*server.accept_pd, server.queue(), caps, rsp, server.events());
    return (*req)->accept(server.queue(), caps, rsp, server.events());
  });
  ConnectParams p;
  p.remote = listener_->address();
  p.source = ep_.client_source ? &*ep_.client_source : nullptr;
  p.cq = &client.queue();
  p.caps = caps;
  p.private_data = req_pd;
  p.events = client.events();
  p.timeout = 10s;
  with_tested_tls(p);
  auto c = client.domain->connect(p);
  auto s = accepted.get();
  ASSERT_TRUE(c.ok()) << "connect: " << c.error().message();
  ASSERT_TRUE(s.ok()) << "accept: " << s.error().message();
  client.conn = std::move(c->connection);
  client.peer_private = c->private_data;
  server.conn = std::move(s).value();
}

void FabricTest::poll_once(Side& s) {
  Completion wc[64];
  size_t n = s.queue().poll(wc);
  s.done.insert(s.done.end(), wc, wc + n);
}

bool FabricTest::drive(Side& a, Side& b, const std::function<bool()>& pred,
                       std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return pred();
    poll_once(a);
    poll_once(b);
  }
  return true;
}

}  // namespace ibtrs::fabric::testing
