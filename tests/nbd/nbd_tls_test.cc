// The NBD server's STARTTLS (spec "NBD_OPT_STARTTLS", "Security considerations"): FORCEDTLS
// refusals before the upgrade, the upgrade and the transmission phase through TLS, plaintext
// injected after STARTTLS, wrong credentials, the optional mode, and libnbd's own clients
// (nbdinfo, nbdcopy) with a PSK file, as they talk to nbdkit --tls=require.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "ibtrs/tls.h"
#include "nbd_client.h"
#include "ram_export.h"

namespace ibnbd::nbd::test {
namespace {

using namespace wire;
using namespace std::chrono_literals;
namespace tls = ibtrs::tls;

constexpr uint64_t kSize = 8 << 20;

std::vector<std::byte> key_of(uint8_t seed) {
  std::vector<std::byte> k(32);
  for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<std::byte>(seed * 31 + i);
  return k;
}

std::shared_ptr<tls::Context> server_ctx() {
  tls::Config c;
  c.role = tls::Role::server;
  c.psk_lookup = [](std::string_view id) -> std::optional<std::vector<std::byte>> {
    if (id == "alice") return key_of(1);
    return std::nullopt;
  };
  return *tls::Context::create(c);
}

std::shared_ptr<tls::Context> client_ctx(const std::string& id, uint8_t key) {
  tls::Config c;
  c.role = tls::Role::client;
  c.psk = tls::Psk{id, key_of(key)};
  return *tls::Context::create(c);
}

// Blocking NBD over an established TLS session (the test's side of the socket).
struct TlsWire {
  std::unique_ptr<tls::Session> s;
  int fd;
  bool send(const Bytes& b) {
    size_t off = 0;
    while (off < b.size()) {
      iovec iov{const_cast<unsigned char*>(b.data()) + off, b.size() - off};
      ssize_t n = s->writev(&iov, 1);
      if (n < 0 && errno == EAGAIN) {
        pollfd p{fd, POLLOUT, 0};
        ::poll(&p, 1, 1000);
        continue;
      }
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
    return true;
  }
  std::optional<Bytes> recv(size_t n) {
    Bytes b(n);
    size_t off = 0;
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (off < n && std::chrono::steady_clock::now() < deadline) {
      iovec iov{b.data() + off, n - off};
      ssize_t r = s->readv(&iov, 1);
      if (r < 0 && errno == EAGAIN) {
        pollfd p{fd, POLLIN, 0};
        ::poll(&p, 1, 100);
        continue;
      }
      if (r <= 0) return std::nullopt;
      off += static_cast<size_t>(r);
    }
    if (off < n) return std::nullopt;
    return b;
  }
  bool option(uint32_t opt, const Bytes& data) {
    Bytes b;
    put64(b, kOptMagic);
    put32(b, opt);
    put32(b, static_cast<uint32_t>(data.size()));
    b.insert(b.end(), data.begin(), data.end());
    return send(b);
  }
  // Option replies up to the final one; returns its type.
  uint32_t final_reply() {
    for (;;) {
      auto h = recv(20);
      if (!h) return 0;
      const uint32_t type = get32(h->data() + 12), len = get32(h->data() + 16);
      if (len > 0 && !recv(len)) return 0;
      if (type == kRepAck || (type & 0x80000000u)) return type;
    }
  }
};

class NbdTls : public ::testing::Test {
 protected:
  void start(bool required) {
    ram_ = std::make_shared<RamExport>(kSize, true);
    // TLS decrypts WRITE payloads into the request memory and encrypts READ data from it.
    ram_->lend(1 << 20);
    NbdServerOptions o;
    o.exports = {{"disk", ram_}};
    o.listen = {*ListenSpec::parse_tcp("127.0.0.1:0")};
    o.tls = server_ctx();
    o.tls_required = required;
    o.handshake_timeout = 3000ms;
    o.log = [](const std::string& m) { std::fprintf(stderr, "%s\n", m.c_str()); };
    auto s = NbdServer::start(std::move(o));
    ASSERT_TRUE(s.ok()) << s.error().message();
    srv_ = std::move(*s);
    port_ = srv_->listening()[0].port;
  }
  void TearDown() override {
    if (ram_) ram_->release(false);
    if (srv_) srv_->stop();
  }
  std::unique_ptr<Client> connect() {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port_);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    auto c = std::make_unique<Client>(fd);
    EXPECT_GE(c->handshake(), 0);
    return c;
  }
  // STARTTLS on a negotiating connection, then the TLS handshake with `ctx`.
  Result<TlsWire> upgrade(Client& c, std::shared_ptr<tls::Context> ctx) {
    EXPECT_TRUE(c.option(kOptStartTls, {}));
    auto r = c.opt_reply();
    if (!r || r->type != kRepAck) return ibtrs::errc(EPROTO);
    ::fcntl(c.fd(), F_SETFL, ::fcntl(c.fd(), F_GETFL) | O_NONBLOCK);
    auto s = tls::Session::create(std::move(ctx), c.fd());
    if (!s.ok()) return s.error();
    auto st = (*s)->handshake(std::chrono::steady_clock::now() + 5s);
    if (!st.ok()) return st.error();
    return TlsWire{std::move(*s), c.fd()};
  }

  std::shared_ptr<RamExport> ram_;
  std::unique_ptr<NbdServer> srv_;
  uint16_t port_ = 0;
};

// Case: a TLS-only server; a client asks for LIST, INFO and GO in plaintext.
// Expect: NBD_REP_ERR_TLS_REQD for each, nothing about the export revealed; EXPORT_NAME in
// plaintext drops the connection.
TEST_F(NbdTls, ForcedTlsRefusesEverythingBeforeTheUpgrade) {
  start(true);
  auto c = connect();
  ASSERT_TRUE(c->option(kOptList, {}));
  EXPECT_EQ(c->opt_replies().back().type, kRepErrTlsReqd);
  ASSERT_TRUE(c->option(kOptGo, Client::info_data("disk", {})));
  EXPECT_EQ(c->opt_replies().back().type, kRepErrTlsReqd);
  ASSERT_TRUE(c->option(kOptStructuredReply, {}));
  EXPECT_EQ(c->opt_replies().back().type, kRepErrTlsReqd);
  auto d = connect();
  ASSERT_TRUE(d->option(kOptExportName, Bytes{'d', 'i', 's', 'k'}));
  EXPECT_TRUE(d->closed());
}

// Case: STARTTLS with the right PSK, then GO, a WRITE and a READ through TLS.
// Expect: the upgrade is counted, the export answers, the bytes round-trip; a second STARTTLS
// inside TLS is NBD_REP_ERR_INVALID.
TEST_F(NbdTls, UpgradeThenTransmissionThroughTls) {
  start(true);
  auto c = connect();
  auto w = upgrade(*c, client_ctx("alice", 1));
  ASSERT_TRUE(w.ok()) << w.error().message();
  ASSERT_TRUE(w->option(kOptStartTls, {}));
  EXPECT_EQ(w->final_reply(), kRepErrInvalid);
  ASSERT_TRUE(w->option(kOptGo, Client::info_data("disk", {})));
  ASSERT_EQ(w->final_reply(), kRepAck);
  Bytes data(65536);
  std::mt19937 g(7);
  for (auto& b : data) b = static_cast<unsigned char>(g());
  Bytes req;
  put32(req, kRequestMagic);
  put16(req, 0);
  put16(req, kCmdWrite);
  put64(req, 1);
  put64(req, 4096);
  put32(req, static_cast<uint32_t>(data.size()));
  req.insert(req.end(), data.begin(), data.end());
  ASSERT_TRUE(w->send(req));
  auto rep = w->recv(16);
  ASSERT_TRUE(rep);
  EXPECT_EQ(get32(rep->data() + 4), 0u);
  Bytes rd;
  put32(rd, kRequestMagic);
  put16(rd, 0);
  put16(rd, kCmdRead);
  put64(rd, 2);
  put64(rd, 4096);
  put32(rd, static_cast<uint32_t>(data.size()));
  ASSERT_TRUE(w->send(rd));
  auto hdr = w->recv(16);
  ASSERT_TRUE(hdr);
  EXPECT_EQ(get32(hdr->data() + 4), 0u);
  auto back = w->recv(data.size());
  ASSERT_TRUE(back);
  EXPECT_EQ(*back, data);
  EXPECT_EQ(srv_->stats().tls_upgrades, 1u);
  EXPECT_EQ(ram_->in_memory.load(), 2) << "both went through the export's request memory";
}

// Case: the client sends STARTTLS and, in the same write, plaintext that would be read as the
// first options of the protected session (a man in the middle injecting commands).
// Expect: the connection is dropped; nothing is answered after the ACK.
TEST_F(NbdTls, PlaintextAfterStartTlsIsRefused) {
  start(true);
  auto c = connect();
  Bytes b;
  put64(b, kOptMagic);
  put32(b, kOptStartTls);
  put32(b, 0);
  put64(b, kOptMagic);
  put32(b, kOptList);
  put32(b, 0);
  ASSERT_TRUE(c->send(b));
  auto ack = c->opt_reply();
  ASSERT_TRUE(ack);
  EXPECT_EQ(ack->type, kRepAck);
  EXPECT_TRUE(c->closed());
  EXPECT_EQ(srv_->stats().tls_upgrades, 0u);
}

// Case: an unknown identity, and the right identity with the wrong key; then an honest client.
// Expect: both handshakes fail with EACCES and are counted; the server still serves the third.
TEST_F(NbdTls, WrongCredentialsAreRefusedAndTheServerGoesOn) {
  start(true);
  for (auto [id, key] : {std::pair<std::string, uint8_t>{"mallory", 1}, {"alice", 2}}) {
    auto c = connect();
    auto w = upgrade(*c, client_ctx(id, key));
    EXPECT_EQ(w.error(), std::errc::permission_denied) << id;
  }
  // The client learns of the failure from the server's alert, which the server sends before
  // its loop counts the failure: wait (bounded) for the count rather than race it.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (srv_->stats().tls_failures < 2 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(srv_->stats().tls_failures, 2u);
  auto c = connect();
  auto w = upgrade(*c, client_ctx("alice", 1));
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(w->option(kOptGo, Client::info_data("disk", {})));
  EXPECT_EQ(w->final_reply(), kRepAck);
}

// Case: TLS offered but not required. Expect: a plaintext client is served; STARTTLS works too.
TEST_F(NbdTls, OptionalTlsServesBoth) {
  start(false);
  auto c = connect();
  ASSERT_TRUE(c->option(kOptGo, Client::info_data("disk", {})));
  EXPECT_EQ(c->opt_replies().back().type, kRepAck);
  auto d = connect();
  auto w = upgrade(*d, client_ctx("alice", 1));
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(w->option(kOptGo, Client::info_data("disk", {})));
  EXPECT_EQ(w->final_reply(), kRepAck);
}

// Case: a TLS-only server without credentials, and a client-role context. Expect: EINVAL.
TEST(NbdTlsConfig, BadTlsOptionsAreRefused) {
  auto ram = std::make_shared<RamExport>(1 << 20, false);
  NbdServerOptions o;
  o.exports = {{"d", ram}};
  o.tls_required = true;
  EXPECT_EQ(NbdServer::start(o).error(), std::errc::invalid_argument);
  o.tls = client_ctx("alice", 1);
  EXPECT_EQ(NbdServer::start(o).error(), std::errc::invalid_argument);
}

// ---- libnbd's clients ----

int run(const std::string& cmd) {
  int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

bool have(const char* tool) { return run(std::string("command -v ") + tool + " >/dev/null 2>&1") == 0; }

// Case: nbdinfo and nbdcopy (GnuTLS inside libnbd) with a psktool-format key file, against the
// TLS-only server; the same tools without TLS, and with a wrong key.
// Expect: nbdinfo sees the export over TLS; 8 MiB copied in and back out byte-equal; the
// plaintext and wrong-key attempts fail.
TEST_F(NbdTls, LibnbdClientsWithAPskFile) {
  if (!have("nbdinfo") || !have("nbdcopy")) GTEST_SKIP() << "nbdinfo/nbdcopy not installed (libnbd-bin)";
  start(true);
  char dir_tmpl[] = "/tmp/nbd-tls-test.XXXXXX";
  const std::string dir = ::mkdtemp(dir_tmpl);
  ASSERT_TRUE(tls::write_psk_file(dir + "/good.psk", tls::Psk{"alice", key_of(1)}).ok());
  ASSERT_TRUE(tls::write_psk_file(dir + "/bad.psk", tls::Psk{"alice", key_of(3)}).ok());
  const std::string host = "127.0.0.1:" + std::to_string(port_);
  const std::string uri = "'nbds://alice@" + host + "/disk?tls-psk-file=" + dir + "/good.psk'";
  EXPECT_EQ(run("nbdinfo --size " + uri + " > " + dir + "/size 2>" + dir + "/err"), 0)
      << std::ifstream(dir + "/err").rdbuf();
  std::ifstream size_in(dir + "/size");
  uint64_t size = 0;
  size_in >> size;
  EXPECT_EQ(size, kSize);
  ASSERT_EQ(run("head -c " + std::to_string(kSize) + " /dev/urandom > " + dir + "/in"), 0);
  EXPECT_EQ(run("nbdcopy " + dir + "/in " + uri + " 2>" + dir + "/err"), 0) << std::ifstream(dir + "/err").rdbuf();
  EXPECT_EQ(run("nbdcopy " + uri + " " + dir + "/out 2>" + dir + "/err"), 0) << std::ifstream(dir + "/err").rdbuf();
  EXPECT_EQ(run("cmp " + dir + "/in " + dir + "/out"), 0);
  EXPECT_NE(run("nbdinfo --size nbd://" + host + "/disk >/dev/null 2>&1"), 0) << "plaintext must be refused";
  EXPECT_NE(run("nbdinfo --size 'nbds://alice@" + host + "/disk?tls-psk-file=" + dir + "/bad.psk' >/dev/null 2>&1"), 0)
      << "a wrong key must be refused";
  EXPECT_GE(srv_->stats().tls_upgrades, 3u);
  run("rm -rf " + dir);
}

}  // namespace
}  // namespace ibnbd::nbd::test
