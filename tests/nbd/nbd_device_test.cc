// The NBD server over the device export (DeviceExport: request memory registered with the
// session, the loop reaping its own transport connections) and a real BlockSession against a
// FakeBlockServer (tests/client), over the fabric picked with --fabric=loopback|tcp. NBD clients
// are the raw test client over socketpairs. The session has no bounce buffers, so every READ
// and WRITE that succeeds went through the registered request memory (the copy path would fail
// with EOPNOTSUPP).
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <random>
#include <thread>

#include "fake_block_server.h"
#include "ibnbd/client.h"
#include "ibnbd/nbd_device_export.h"
#include "ibnbd/nbd_server.h"
#include "nbd_client.h"

namespace ibnbd::nbd::test {
namespace {

using namespace std::chrono_literals;
using namespace wire;
using ibnbd::test::FakeBlockServer;

ibtrs::FabricKind g_kind = ibtrs::FabricKind::loopback;

constexpr uint32_t kChunk = 128 * 1024;
constexpr uint64_t kVolSize = 16 << 20;

ibtrs::Address listen_addr(const std::string& tag) {
  return *ibtrs::Address::parse(g_kind == ibtrs::FabricKind::loopback ? "loopback:" + tag + ":0"
                                                                      : "tcp:127.0.0.1:0");
}

bool wait_for(const std::function<bool()>& pred, std::chrono::milliseconds limit = 5s) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() >= end) return false;
    std::this_thread::sleep_for(2ms);
  }
  return true;
}

Bytes pattern(size_t n, unsigned seed) {
  Bytes b(n);
  std::mt19937 g(seed);
  for (auto& c : b) c = static_cast<unsigned char>(g());
  return b;
}

class NbdDevice : public ::testing::Test {
 protected:
  void SetUp() override { srv_.add_device("vol0", kVolSize); }
  void TearDown() override {
    if (nbd_) nbd_->stop();
    nbd_.reset();
    export_.reset();
    dev_.reset();
    session_.reset();
    if (server_) {
      (void)wait_for([&] { return server_->sessions().empty(); });
      (void)server_->with_session("", [](ibtrs::ServerSession&) {});
    }
    srv_.drop_held(ECONNABORTED);
    server_.reset();
  }

  // A server with `paths` listeners, a session with a path to each (no bounce buffers), vol0
  // mapped rw, and an NBD server over its device export.
  void up(size_t paths, DeviceExportOptions eo = {}, NbdServerOptions no = {}) {
    ibtrs::ServerOptions so;
    so.queue_depth = 64;
    so.chunk_size = kChunk;
    so.io_threads = 2;
    so.handler = &srv_;
    so.allow_any_host = true;
    so.heartbeat = ibtrs::HeartbeatConfig{100ms, 5};
    for (size_t i = 0; i < paths; ++i) so.listen.push_back(listen_addr("n" + std::to_string(i)));
    auto s = ibtrs::Server::start(so);
    ASSERT_TRUE(s.ok()) << s.error().message();
    server_ = std::move(*s);
    BlockSessionOptions o;
    o.transport.session_name = "nbd";
    for (auto& a : server_->addresses()) o.transport.paths.push_back(ibtrs::PathSpec{std::nullopt, a});
    o.transport.io_threads = 2;
    o.transport.policy = ibtrs::MpPolicy::round_robin;
    o.transport.heartbeat = ibtrs::HeartbeatConfig{100ms, 5};
    o.transport.reconnect = ibtrs::ReconnectConfig{50ms, 50ms, 500ms, 10ms, -1};
    o.bounce_slots = 0;
    auto bs = BlockSession::open(std::move(o));
    ASSERT_TRUE(bs.ok()) << bs.error().message();
    session_ = std::move(*bs);
    auto d = session_->map("vol0", AccessMode::rw);
    ASSERT_TRUE(d.ok()) << d.error().message();
    dev_ = *d;
    auto e = DeviceExport::create(dev_, *session_, eo);
    ASSERT_TRUE(e.ok()) << e.error().message();
    export_ = *e;
    no.exports = {{"vol0", export_}};
    auto n = NbdServer::start(std::move(no));
    ASSERT_TRUE(n.ok()) << n.error().message();
    nbd_ = std::move(*n);
  }

  std::unique_ptr<Client> client(bool structured = false) {
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    EXPECT_TRUE(nbd_->serve_fd(sv[0]).ok());
    auto c = std::make_unique<Client>(sv[1]);
    EXPECT_NE(c->go(structured, false, "vol0"), 0);
    return c;
  }

  // Sends `n` requests from a thread (make(i) gives type, offset, length, data) and reads the
  // replies here. Returns the replies by handle (nullopt: missing).
  struct Req {
    uint16_t type;
    uint64_t off;
    uint32_t len;
    const Bytes* data;
  };
  std::vector<std::optional<Reply>> batch(Client& c, size_t n, const std::function<Req(size_t)>& make) {
    std::vector<Req> rs;
    for (size_t i = 0; i < n; ++i) rs.push_back(make(i));
    std::thread sender([&] {
      for (size_t i = 0; i < n; ++i) {
        const Req& r = rs[i];
        EXPECT_TRUE(c.request(r.type, 0, i, r.off, r.len, r.type == kCmdWrite ? *r.data : Bytes{}));
      }
    });
    std::vector<std::optional<Reply>> out(n);
    for (size_t k = 0; k < n; ++k) {
      // The data length of a simple READ reply is not in the reply: peek at the handle first.
      auto m = c.recv(16, 10000);
      if (!m) break;
      const uint64_t h = get64(m->data() + 8);
      if (h >= n) break;
      Reply r;
      r.error = get32(m->data() + 4);
      r.handle = h;
      if (r.error == 0 && rs[h].type == kCmdRead) {
        auto d = c.recv(rs[h].len, 10000);
        if (!d) break;
        r.payload = *d;
      }
      EXPECT_FALSE(out[h].has_value()) << "two replies to " << h;
      out[h] = r;
    }
    sender.join();
    return out;
  }

  FakeBlockServer srv_;
  std::unique_ptr<ibtrs::Server> server_;
  std::unique_ptr<BlockSession> session_;
  std::shared_ptr<RemoteDevice> dev_;
  std::shared_ptr<DeviceExport> export_;
  std::unique_ptr<NbdServer> nbd_;
};

// Case: WRITEs of 4 KiB, 64 KiB, 1 MiB and 3 MiB (split into transport parts, spread over the
// connections), 16 in flight, each a different pattern, then READs of the same ranges; both
// with simple replies, on one path. Expect: every request succeeds (the session has no bounce
// buffers: the data went through the registered request memory), the server's volume holds
// exactly what was written, and the READs return it.
TEST_F(NbdDevice, WritesAndReadsGoThroughRegisteredMemoryIntact) {
  up(1);
  auto c = client();
  struct R {
    uint64_t off;
    uint32_t len;
    Bytes data;
  };
  std::vector<R> rs;
  uint64_t off = 0;
  unsigned seed = 1;
  for (int round = 0; round < 4; ++round) {
    for (uint32_t len : {4096u, 65536u, 1u << 20, 3u << 20}) {
      if (off + len > kVolSize) off = 0;
      if (round == 3 && len == (3u << 20)) continue;
      rs.push_back({off, len, pattern(len, seed++)});
      off += len;
    }
  }
  // Distinct ranges while in flight: batches of at most 16 that do not overlap.
  for (size_t from = 0; from < rs.size(); from += 4) {
    const size_t n = std::min<size_t>(4, rs.size() - from);
    auto w = batch(*c, n, [&](size_t i) { return Req{kCmdWrite, rs[from + i].off, rs[from + i].len, &rs[from + i].data}; });
    for (size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(w[i]) << "write " << from + i;
      EXPECT_EQ(w[i]->error, 0u);
    }
    for (size_t i = 0; i < n; ++i) {
      auto b = srv_.bytes("vol0", rs[from + i].off, rs[from + i].len);
      EXPECT_EQ(std::memcmp(b.data(), rs[from + i].data.data(), rs[from + i].len), 0) << "server bytes of " << from + i;
    }
    auto r = batch(*c, n, [&](size_t i) { return Req{kCmdRead, rs[from + i].off, rs[from + i].len, nullptr}; });
    for (size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(r[i]) << "read " << from + i;
      EXPECT_EQ(r[i]->error, 0u);
      EXPECT_EQ(r[i]->payload, rs[from + i].data) << "read back " << from + i;
    }
  }
  // Many small ones at depth 32.
  std::vector<Bytes> small;
  for (unsigned i = 0; i < 64; ++i) small.push_back(pattern(4096, 1000 + i));
  auto w = batch(*c, 64, [&](size_t i) { return Req{kCmdWrite, 8192 * i, 4096, &small[i]}; });
  for (auto& x : w) {
    ASSERT_TRUE(x);
    EXPECT_EQ(x->error, 0u);
  }
  auto r = batch(*c, 64, [&](size_t i) { return Req{kCmdRead, 8192 * i, 4096, nullptr}; });
  for (size_t i = 0; i < 64; ++i) {
    ASSERT_TRUE(r[i]);
    EXPECT_EQ(r[i]->payload, small[i]) << i;
  }
  EXPECT_EQ(nbd_->stats().errors, 0u);
  EXPECT_EQ(dev_->stats().errors, 0u);
}

// Case: 256 KiB of request memory, the server holding every IO, and 32 WRITEs of 64 KiB (2 MiB)
// sent at once; then the server lets IO through. Expect: no more than 4 WRITEs reach the
// server while the memory is full (the others wait in the socket), none is lost: all 32 succeed
// and the volume holds each one's pattern.
TEST_F(NbdDevice, RequestMemoryExhaustedRequestsWaitNothingLost) {
  DeviceExportOptions eo;
  eo.request_memory = 256 << 10;
  up(1, eo);
  auto c = client();
  std::vector<Bytes> data;
  for (unsigned i = 0; i < 32; ++i) data.push_back(pattern(65536, 2000 + i));
  srv_.hold_io(true);
  std::vector<std::optional<Reply>> w;
  std::thread t([&] { w = batch(*c, 32, [&](size_t i) { return Req{kCmdWrite, 65536 * i, 65536, &data[i]}; }); });
  ASSERT_TRUE(wait_for([&] { return srv_.held() == 4; }));
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(srv_.held(), 4u) << "no more than the request memory holds";
  EXPECT_GE(nbd_->stats().memory_waits, 1u);
  srv_.hold_io(false);
  srv_.release_held();
  t.join();
  ASSERT_EQ(w.size(), 32u);
  for (size_t i = 0; i < 32; ++i) {
    ASSERT_TRUE(w[i]) << i;
    EXPECT_EQ(w[i]->error, 0u) << i;
    auto b = srv_.bytes("vol0", 65536 * i, 65536);
    EXPECT_EQ(std::memcmp(b.data(), data[i].data(), 65536), 0) << "block " << i;
  }
}

// Case: two paths; an NBD client writes and reads back patterns in batches of 16 while the
// server cuts one path and it comes back. Expect: every NBD request succeeds (the transport
// fails the cut path's requests over; their completions reach the loop through the hand-off,
// and the loop takes the new connection back afterwards), and every READ returns what was
// written.
TEST_F(NbdDevice, APathCutDuringNbdIoLosesNothing) {
  up(2);
  auto c = client(true);
  std::atomic<bool> cut{false};
  std::thread cutter([&] {
    std::this_thread::sleep_for(150ms);
    ASSERT_TRUE(server_
                    ->with_session("nbd",
                                   [](ibtrs::ServerSession& s) {
                                     EXPECT_TRUE(s.disconnect_path(s.paths()[0].name).ok());
                                   })
                    .ok());
    cut.store(true);
  });
  const auto t0 = std::chrono::steady_clock::now();
  unsigned seed = 5000, batches = 0;
  while (batches < 8 || !cut.load() || std::chrono::steady_clock::now() - t0 < 600ms) {
    ASSERT_LT(std::chrono::steady_clock::now() - t0, 20s);
    std::vector<Bytes> d;
    for (unsigned i = 0; i < 16; ++i) d.push_back(pattern(16384, seed++));
    const uint64_t base = (batches % 8) * 16 * 16384;
    auto w = batch(*c, 16, [&](size_t i) { return Req{kCmdWrite, base + 16384 * i, 16384, &d[i]}; });
    for (size_t i = 0; i < 16; ++i) {
      ASSERT_TRUE(w[i]) << "batch " << batches << " write " << i;
      ASSERT_EQ(w[i]->error, 0u) << "batch " << batches << " write " << i;
    }
    // Structured READ replies: one OFFSET_DATA chunk each.
    for (size_t i = 0; i < 16; ++i) ASSERT_TRUE(c->request(kCmdRead, 0, i, base + 16384 * i, 16384));
    std::vector<int> seen(16);
    for (size_t k = 0; k < 16; ++k) {
      auto r = c->reply();
      ASSERT_TRUE(r) << "batch " << batches << " read " << k;
      ASSERT_LT(r->handle, 16u);
      ++seen[r->handle];
      ASSERT_EQ(r->error, 0u);
      ASSERT_EQ(r->payload.size(), 8u + 16384);
      EXPECT_EQ(std::memcmp(r->payload.data() + 8, d[r->handle].data(), 16384), 0)
          << "batch " << batches << " read " << r->handle;
    }
    for (int n : seen) EXPECT_EQ(n, 1);
    ++batches;
  }
  cutter.join();
  auto ps = session_->transport().paths();
  EXPECT_GT(ps[0].stats.failovered + ps[1].stats.failovered + ps[0].recon_cnt + ps[1].recon_cnt, 0u)
      << "the cut happened under IO";
  EXPECT_EQ(nbd_->stats().errors, 0u);
}

// Case: hostile clients against 256 KiB of request memory (stall_timeout 300 ms): one sends a
// WRITE header of 256 KiB and a little payload and stops; another claims a 4 GiB WRITE; a good
// client's READ then waits for memory. Expect: the 4 GiB WRITE is refused and closed, the
// stalled writer is dropped, the good client's READ is answered, and a WRITE whose client
// disconnects mid-payload changes nothing on the volume.
TEST_F(NbdDevice, HostileClientsCannotPinTheRequestMemory) {
  DeviceExportOptions eo;
  eo.request_memory = 256 << 10;
  NbdServerOptions no;
  no.stall_timeout = 300ms;
  up(1, eo, no);
  srv_.fill("vol0", 0, 1 << 20, std::byte{0x11});
  auto huge = client();
  ASSERT_TRUE(huge->request(kCmdWrite, 0, 1, 0, 0xffffffffu));
  auto hr = huge->reply();
  ASSERT_TRUE(hr);
  EXPECT_EQ(hr->error, kEinval);
  EXPECT_TRUE(huge->closed());
  auto stall = client();
  Bytes part = pattern(1000, 3);
  Bytes hdr;
  put32(hdr, kRequestMagic);
  put16(hdr, 0);
  put16(hdr, kCmdWrite);
  put64(hdr, 1);
  put64(hdr, 0);
  put32(hdr, 256 << 10);
  hdr.insert(hdr.end(), part.begin(), part.end());
  ASSERT_TRUE(stall->send(hdr));
  auto good = client();
  ASSERT_TRUE(good->request(kCmdRead, 0, 7, 4096, 4096));
  auto r = good->reply(4096);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->error, 0u);
  EXPECT_EQ(r->payload, Bytes(4096, 0x11));
  EXPECT_TRUE(stall->closed());
  EXPECT_EQ(nbd_->stats().stalls, 1u);
  // Disconnect mid-payload: the memory comes back at once, and nothing was written.
  auto gone = client();
  ASSERT_TRUE(gone->send(hdr));
  ASSERT_TRUE(good->request(kCmdRead, 0, 8, 0, 4096));
  ASSERT_TRUE(wait_for([&] { return nbd_->stats().memory_waits >= 2; }));
  gone.reset();
  auto r2 = good->reply(4096);
  ASSERT_TRUE(r2);
  EXPECT_EQ(r2->error, 0u);
  EXPECT_EQ(r2->payload, Bytes(4096, 0x11));
  EXPECT_EQ(nbd_->stats().stalls, 1u);
  auto b = srv_.bytes("vol0", 0, 256 << 10);
  for (auto x : b) ASSERT_EQ(x, std::byte{0x11}) << "an unfinished WRITE reached the volume";
}

}  // namespace
}  // namespace ibnbd::nbd::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--fabric=tcp") {
      ibnbd::nbd::test::g_kind = ibtrs::FabricKind::tcp;
    } else if (a != "--fabric=loopback") {
      fprintf(stderr, "usage: %s [gtest flags] [--fabric=loopback|tcp]\n", argv[0]);
      return 2;
    }
  }
  return RUN_ALL_TESTS();
}
