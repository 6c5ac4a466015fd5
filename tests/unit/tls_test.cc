// TLS sessions (ibtrs/tls.h) over real loopback TCP socket pairs: PSK and certificate
// handshakes, refusals (unknown identity, wrong key, untrusted certificate, a plaintext peer),
// bytes both ways through the userspace record layer with short writes forced by small socket
// buffers, and the kernel's record layer where this kernel has it.
#include "ibtrs/tls.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace ibtrs::tls {
namespace {

using namespace std::chrono_literals;

struct Pair {
  int a = -1, b = -1;  // a: the client end, b: the server end
  ~Pair() {
    if (a >= 0) ::close(a);
    if (b >= 0) ::close(b);
  }
};

// A connected loopback TCP pair, both ends non-blocking; small buffers force short writes.
Pair tcp_pair(int sndbuf = 0) {
  Pair p;
  int l = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  EXPECT_EQ(::bind(l, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  EXPECT_EQ(::listen(l, 1), 0);
  EXPECT_EQ(::getsockname(l, reinterpret_cast<sockaddr*>(&a), &len), 0);
  p.a = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (sndbuf > 0) {
    ::setsockopt(p.a, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
  }
  EXPECT_EQ(::connect(p.a, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  p.b = ::accept4(l, nullptr, nullptr, SOCK_CLOEXEC);
  if (sndbuf > 0) {
    ::setsockopt(p.b, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
    ::setsockopt(p.b, SOL_SOCKET, SO_RCVBUF, &sndbuf, sizeof(sndbuf));
    ::setsockopt(p.a, SOL_SOCKET, SO_RCVBUF, &sndbuf, sizeof(sndbuf));
  }
  ::close(l);
  for (int fd : {p.a, p.b}) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  return p;
}

std::vector<std::byte> key_of(uint8_t seed, size_t n = 32) {
  std::vector<std::byte> k(n);
  for (size_t i = 0; i < n; ++i) k[i] = static_cast<std::byte>(seed + i * 7);
  return k;
}

std::shared_ptr<Context> psk_client(const std::string& id, std::vector<std::byte> key, bool kernel = true) {
  Config c;
  c.role = Role::client;
  c.psk = Psk{id, std::move(key)};
  c.kernel = kernel;
  auto ctx = Context::create(c);
  EXPECT_TRUE(ctx.ok());
  return ctx.ok() ? *ctx : nullptr;
}

std::shared_ptr<Context> psk_server(bool kernel = true) {
  Config c;
  c.role = Role::server;
  c.kernel = kernel;
  c.psk_lookup = [](std::string_view id) -> std::optional<std::vector<std::byte>> {
    if (id == "host-a") return key_of(1);
    if (id == "host-b") return key_of(2, 48);
    return std::nullopt;
  };
  auto ctx = Context::create(c);
  EXPECT_TRUE(ctx.ok());
  return ctx.ok() ? *ctx : nullptr;
}

struct Outcome {
  Status client, server;
};

// Drives both handshakes in this thread until each ends (or 5 s pass).
Outcome handshake(Session& c, Session& s) {
  Outcome o{errc(EAGAIN), errc(EAGAIN)};
  const auto again = [](const Status& st) { return !st.ok() && st.error() == std::errc::resource_unavailable_try_again; };
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while ((again(o.client) || again(o.server)) && std::chrono::steady_clock::now() < deadline) {
    if (again(o.client)) o.client = c.handshake_step();
    if (again(o.server)) o.server = s.handshake_step();
    ::poll(nullptr, 0, 1);
  }
  return o;
}

// Moves `n` random bytes from `w` to `r` with readv/writev, interleaved, and checks them.
void transfer(Session& w, Session& r, size_t n, uint32_t seed) {
  std::vector<unsigned char> out(n), in(n);
  std::mt19937 rng(seed);
  for (auto& b : out) b = static_cast<unsigned char>(rng());
  size_t sent = 0, got = 0;
  // Generous: under QEMU TCG on a loaded host (the VM rig) userspace AES runs 100x slower.
  const auto deadline = std::chrono::steady_clock::now() + 90s;
  while (got < n && std::chrono::steady_clock::now() < deadline) {
    if (sent < n) {
      // Two segments, as a provider's iovecs would be.
      size_t left = n - sent, first = std::min<size_t>(left, 1 + rng() % 70000);
      iovec iov[2] = {{out.data() + sent, first}, {out.data() + sent + first, std::min<size_t>(left - first, 50000)}};
      ssize_t k = w.writev(iov, 2);
      if (k < 0) {
        ASSERT_TRUE(errno == EAGAIN || errno == EWOULDBLOCK) << std::strerror(errno);
      } else {
        ASSERT_LE(static_cast<size_t>(k), iov[0].iov_len + iov[1].iov_len);
        sent += static_cast<size_t>(k);
      }
    }
    do {
      size_t want = std::min<size_t>(n - got, 1 + rng() % 40000);
      iovec iov{in.data() + got, want};
      ssize_t k = r.readv(&iov, 1);
      if (k < 0) {
        ASSERT_TRUE(errno == EAGAIN || errno == EWOULDBLOCK) << std::strerror(errno);
        break;
      }
      ASSERT_GT(k, 0) << "unexpected end of stream";
      got += static_cast<size_t>(k);
    } while (r.read_pending() && got < n);
  }
  ASSERT_EQ(got, n);
  ASSERT_EQ(sent, n);
  EXPECT_EQ(std::memcmp(in.data(), out.data(), n), 0);
}

// Case: a client offers host-a's PSK to a server that knows host-a; the kernel's record layer
// is off (the userspace one is what a kernel without kTLS gets), buffers are small.
// Expect: both handshakes complete, the server learns the identity, 2 MiB each way arrive
// intact through short writes and retries.
TEST(Tls, PskHandshakeAndBytesBothWaysInUserspace) {
  Pair p = tcp_pair(16384);
  auto c = Session::create(psk_client("host-a", key_of(1), false), p.a);
  auto s = Session::create(psk_server(false), p.b);
  ASSERT_TRUE(c.ok() && s.ok());
  auto o = handshake(**c, **s);
  ASSERT_TRUE(o.client.ok()) << o.client.error().message() << " " << (*c)->last_error();
  ASSERT_TRUE(o.server.ok()) << o.server.error().message() << " " << (*s)->last_error();
  EXPECT_EQ((*s)->peer_identity(), "host-a");
  EXPECT_FALSE((*c)->kernel_tx());
  EXPECT_FALSE((*s)->kernel_rx());
  EXPECT_EQ((*c)->cipher(), "TLS_AES_128_GCM_SHA256");
  transfer(**c, **s, 2 << 20, 1);
  transfer(**s, **c, 2 << 20, 2);
  transfer(**c, **s, 1, 3);
}

// Case: the same with the kernel's record layer asked for.
// Expect: on a kernel with kTLS both directions go to the kernel on both ends and bytes still
// arrive intact; elsewhere the test says why it cannot check that.
TEST(Tls, KernelRecordLayerWhereTheKernelHasIt) {
  if (!kernel_tls_available()) GTEST_SKIP() << "this kernel has no TLS record offload (TCP_ULP \"tls\" refused)";
  Pair p = tcp_pair();
  auto c = Session::create(psk_client("host-b", key_of(2, 48)), p.a);
  auto s = Session::create(psk_server(), p.b);
  ASSERT_TRUE(c.ok() && s.ok());
  auto o = handshake(**c, **s);
  ASSERT_TRUE(o.client.ok() && o.server.ok()) << (*c)->last_error() << " / " << (*s)->last_error();
  EXPECT_TRUE((*c)->kernel_tx() && (*c)->kernel_rx());
  EXPECT_TRUE((*s)->kernel_tx() && (*s)->kernel_rx());
  transfer(**c, **s, 4 << 20, 4);
  transfer(**s, **c, 4 << 20, 5);
}

// Case: the client finishes its handshake first (it does: it speaks last) and writes at once;
// its records reach the server's socket before the server's handshake is done, and so before
// the server's kernel takes the receive direction.
// Expect: the server reads them all, in order, whichever record layer it ends up with.
TEST(Tls, DataThatArrivesBeforeTheServerFinishesIsRead) {
  for (bool kernel : {false, true}) {
    Pair p = tcp_pair();
    auto c = Session::create(psk_client("host-a", key_of(1), kernel), p.a);
    auto s = Session::create(psk_server(kernel), p.b);
    ASSERT_TRUE(c.ok() && s.ok());
    Status cs = errc(EAGAIN), ss = errc(EAGAIN);
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (!cs.ok() && std::chrono::steady_clock::now() < deadline) {
      cs = (*c)->handshake_step();
      if (!cs.ok() && cs.error() != std::errc::resource_unavailable_try_again) break;
      if (!cs.ok()) ss = (*s)->handshake_step();
      ::poll(nullptr, 0, 1);
    }
    ASSERT_TRUE(cs.ok()) << (*c)->last_error();
    ASSERT_FALSE(ss.ok()) << "the server must not be done before the client's Finished";
    std::string msg;
    for (int i = 0; i < 3000; ++i) msg += "record " + std::to_string(i) + ";";
    for (size_t off = 0; off < msg.size();) {
      iovec iov{msg.data() + off, std::min<size_t>(msg.size() - off, 7000)};
      ssize_t w = (*c)->writev(&iov, 1);
      ASSERT_GT(w, 0) << std::strerror(errno);
      off += static_cast<size_t>(w);
    }
    ::poll(nullptr, 0, 50);  // everything is in the server's socket now
    ss = (*s)->handshake(std::chrono::steady_clock::now() + 5s);
    ASSERT_TRUE(ss.ok()) << (*s)->last_error();
    std::string got(msg.size(), '\0');
    size_t have = 0;
    while (have < got.size() && std::chrono::steady_clock::now() < deadline + 5s) {
      iovec iov{got.data() + have, got.size() - have};
      ssize_t r = (*s)->readv(&iov, 1);
      if (r < 0) {
        ASSERT_EQ(errno, EAGAIN) << std::strerror(errno);
        pollfd pf{p.b, POLLIN, 0};
        ::poll(&pf, 1, 100);
        continue;
      }
      ASSERT_GT(r, 0);
      have += static_cast<size_t>(r);
    }
    EXPECT_EQ(have, msg.size()) << "kernel=" << kernel << " server kernel rx=" << (*s)->kernel_rx();
    EXPECT_EQ(got, msg);
  }
}

// Case: a kernel-side writer and a userspace reader, and the reverse: one end asks for the
// kernel, the other does not. Expect: the records are the same on the wire either way.
TEST(Tls, KernelAndUserspaceEndsInteroperate) {
  if (!kernel_tls_available()) GTEST_SKIP() << "this kernel has no TLS record offload (TCP_ULP \"tls\" refused)";
  Pair p = tcp_pair();
  auto c = Session::create(psk_client("host-a", key_of(1), true), p.a);
  auto s = Session::create(psk_server(false), p.b);
  ASSERT_TRUE(c.ok() && s.ok());
  auto o = handshake(**c, **s);
  ASSERT_TRUE(o.client.ok() && o.server.ok());
  transfer(**c, **s, 1 << 20, 6);
  transfer(**s, **c, 1 << 20, 7);
}

// Case: an identity the server does not know; a known identity with the wrong key.
// Expect: both ends fail with EACCES, nothing established.
TEST(Tls, UnknownIdentityAndWrongKeyAreRefused) {
  for (auto [id, key] : {std::pair<std::string, uint8_t>{"host-z", 1}, {"host-a", 9}}) {
    Pair p = tcp_pair();
    auto c = Session::create(psk_client(id, key_of(key)), p.a);
    auto s = Session::create(psk_server(), p.b);
    ASSERT_TRUE(c.ok() && s.ok());
    auto o = handshake(**c, **s);
    EXPECT_EQ(o.server.error(), std::errc::permission_denied) << id << ": " << o.server.error().message()
                                                              << " " << (*s)->last_error();
    EXPECT_EQ(o.client.error(), std::errc::permission_denied) << id << ": " << o.client.error().message()
                                                              << " " << (*c)->last_error();
    EXPECT_FALSE((*s)->established());
  }
}

// Case: a plaintext peer (an NBD greeting, an HTTP request) talks to a TLS server.
// Expect: EPROTO at once, with a reason that says so.
TEST(Tls, PlaintextPeerIsRefusedAsNotTls) {
  for (const char* hello : {"NBDMAGIC\x49\x48\x41\x56\x45\x4F\x50\x54", "GET / HTTP/1.1\r\n\r\n"}) {
    Pair p = tcp_pair();
    ASSERT_GT(::send(p.a, hello, std::strlen(hello), 0), 0);
    auto s = Session::create(psk_server(), p.b);
    ASSERT_TRUE(s.ok());
    auto st = (*s)->handshake(std::chrono::steady_clock::now() + 2s);
    EXPECT_EQ(st.error(), std::errc::protocol_error) << st.error().message();
    EXPECT_NE((*s)->last_error().find("does not speak TLS"), std::string::npos) << (*s)->last_error();
  }
  std::byte tls_hello[] = {std::byte{22}, std::byte{3}, std::byte{1}};
  EXPECT_TRUE(looks_like_tls(tls_hello));
  std::byte nbd[] = {std::byte{'N'}, std::byte{'B'}, std::byte{'D'}};
  EXPECT_FALSE(looks_like_tls(nbd));
}

// Case: a peer that never answers. Expect: the blocking handshake gives up at its deadline.
TEST(Tls, SilentPeerTimesOut) {
  Pair p = tcp_pair();
  auto s = Session::create(psk_server(), p.b);
  ASSERT_TRUE(s.ok());
  auto t0 = std::chrono::steady_clock::now();
  auto st = (*s)->handshake(t0 + 300ms);
  EXPECT_EQ(st.error(), std::errc::timed_out);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
}

// ---- certificates ----

struct TempDir {
  std::string path;
  TempDir() {
    char t[] = "/tmp/ibtrs-tls-test.XXXXXX";
    path = ::mkdtemp(t);
  }
  ~TempDir() { std::system(("rm -rf " + path).c_str()); }
};

EVP_PKEY* ec_key() { return EVP_PKEY_Q_keygen(nullptr, nullptr, "EC", "P-256"); }

X509* make_cert(EVP_PKEY* key, const char* cn, X509* issuer, EVP_PKEY* issuer_key, bool ca,
                const char* ip_san) {
  X509* x = X509_new();
  X509_set_version(x, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(x), ca ? 1 : 2);
  X509_gmtime_adj(X509_getm_notBefore(x), -60);
  X509_gmtime_adj(X509_getm_notAfter(x), 3600);
  X509_set_pubkey(x, key);
  X509_NAME* n = X509_get_subject_name(x);
  X509_NAME_add_entry_by_txt(n, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>(cn), -1, -1, 0);
  X509_set_issuer_name(x, issuer ? X509_get_subject_name(issuer) : n);
  X509V3_CTX v3;
  X509V3_set_ctx_nodb(&v3);
  X509V3_set_ctx(&v3, issuer ? issuer : x, x, nullptr, nullptr, 0);
  auto add = [&](int nid, const char* value) {
    X509_EXTENSION* e = X509V3_EXT_conf_nid(nullptr, &v3, nid, value);
    X509_add_ext(x, e, -1);
    X509_EXTENSION_free(e);
  };
  add(NID_basic_constraints, ca ? "critical,CA:TRUE" : "CA:FALSE");
  if (ip_san != nullptr) add(NID_subject_alt_name, ip_san);
  X509_sign(x, issuer_key ? issuer_key : key, EVP_sha256());
  return x;
}

void write_pem(const std::string& path, X509* cert, EVP_PKEY* key) {
  FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  if (cert) PEM_write_X509(f, cert);
  if (key) PEM_write_PrivateKey(f, key, nullptr, nullptr, 0, nullptr, nullptr);
  std::fclose(f);
}

// Case: a server with a certificate signed by a CA; a client that trusts that CA and expects
// 127.0.0.1; a client that trusts another CA.
// Expect: the first completes and moves bytes, the second is refused with EACCES.
TEST(Tls, CertificatesVerifiedAgainstTheCa) {
  TempDir d;
  EVP_PKEY* ca_key = ec_key();
  X509* ca = make_cert(ca_key, "test-ca", nullptr, nullptr, true, nullptr);
  EVP_PKEY* srv_key = ec_key();
  X509* srv = make_cert(srv_key, "server", ca, ca_key, false, "IP:127.0.0.1");
  EVP_PKEY* other_key = ec_key();
  X509* other = make_cert(other_key, "other-ca", nullptr, nullptr, true, nullptr);
  write_pem(d.path + "/ca.pem", ca, nullptr);
  write_pem(d.path + "/other.pem", other, nullptr);
  write_pem(d.path + "/srv.pem", srv, nullptr);
  write_pem(d.path + "/srv.key", nullptr, srv_key);
  for (X509* x : {ca, srv, other}) X509_free(x);
  for (EVP_PKEY* k : {ca_key, srv_key, other_key}) EVP_PKEY_free(k);

  Config sc;
  sc.role = Role::server;
  sc.cert_file = d.path + "/srv.pem";
  sc.key_file = d.path + "/srv.key";
  auto sctx = Context::create(sc);
  ASSERT_TRUE(sctx.ok());
  for (bool trusted : {true, false}) {
    Config cc;
    cc.role = Role::client;
    cc.ca_file = d.path + (trusted ? "/ca.pem" : "/other.pem");
    cc.server_name = "127.0.0.1";
    auto cctx = Context::create(cc);
    ASSERT_TRUE(cctx.ok());
    Pair p = tcp_pair();
    auto c = Session::create(*cctx, p.a);
    auto s = Session::create(*sctx, p.b);
    ASSERT_TRUE(c.ok() && s.ok());
    auto o = handshake(**c, **s);
    if (trusted) {
      ASSERT_TRUE(o.client.ok()) << (*c)->last_error();
      ASSERT_TRUE(o.server.ok()) << (*s)->last_error();
      EXPECT_NE((*c)->peer_identity().find("CN=server"), std::string::npos);
      transfer(**c, **s, 256 << 10, 8);
    } else {
      EXPECT_EQ(o.client.error(), std::errc::permission_denied) << (*c)->last_error();
      EXPECT_FALSE(o.server.ok());
    }
  }
  Config bad;
  bad.role = Role::server;
  bad.cert_file = d.path + "/srv.pem";
  bad.key_file = d.path + "/missing.key";
  EXPECT_EQ(Context::create(bad).error(), std::errc::invalid_argument);
}

// Case: contexts with no credentials, both modes, short keys, bad identities.
// Expect: EINVAL each.
TEST(Tls, BadConfigurationsAreRefused) {
  Config none;
  EXPECT_EQ(Context::create(none).error(), std::errc::invalid_argument);
  Config short_key;
  short_key.psk = Psk{"h", key_of(1, 16)};
  EXPECT_EQ(Context::create(short_key).error(), std::errc::invalid_argument);
  Config bad_id;
  bad_id.psk = Psk{"with space", key_of(1)};
  EXPECT_EQ(Context::create(bad_id).error(), std::errc::invalid_argument);
  Config both;
  both.psk = Psk{"h", key_of(1)};
  both.ca_file = "/etc/ssl/certs/ca-certificates.crt";
  EXPECT_EQ(Context::create(both).error(), std::errc::invalid_argument);
}

// Case: PSK files in psktool's "identity:hexkey" form.
// Expect: a round trip; a group- or world-readable file EACCES; malformed ones EINVAL; an
// existing file is not overwritten unless asked.
TEST(Tls, PskFiles) {
  TempDir d;
  const std::string f = d.path + "/psk";
  Psk p{"host-a", key_of(5)};
  ASSERT_TRUE(write_psk_file(f, p).ok());
  struct stat st{};
  ASSERT_EQ(::stat(f.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto r = read_psk_file(f);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->identity, "host-a");
  EXPECT_EQ(r->key, p.key);
  EXPECT_EQ(write_psk_file(f, p).error(), std::errc::file_exists);
  ::chmod(f.c_str(), 0644);
  EXPECT_EQ(read_psk_file(f).error(), std::errc::permission_denied);
  for (const char* bad : {"nocolon\n", "id:abc\n", "id:zz00\n", "id:00\n", ":0011\n"}) {
    FILE* fp = std::fopen(f.c_str(), "w");
    std::fputs(bad, fp);
    std::fclose(fp);
    ::chmod(f.c_str(), 0600);
    EXPECT_EQ(read_psk_file(f).error(), std::errc::invalid_argument) << bad;
  }
  EXPECT_EQ(read_psk_file(d.path + "/absent").error(), std::errc::no_such_file_or_directory);
}

}  // namespace
}  // namespace ibtrs::tls
