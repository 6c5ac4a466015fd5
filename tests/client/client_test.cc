// Client library scenarios: a FakeBlockServer (real codec, real access rules, RAM volumes) and
// BlockSessions in one process, over the fabric picked with --fabric=loopback|tcp. Fault
// injection needs loopback; those cases skip elsewhere. Every case moves real bytes and checks
// them on the server and back at the client.
#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <future>
#include <optional>
#include <random>
#include <thread>

#include "fabric/loopback/loopback.h"
#include "fake_block_server.h"
#include "ibnbd/client.h"
#include "lib/client_impl.h"

namespace ibnbd::test {
namespace {

using namespace std::chrono_literals;
namespace lb = ibtrs::fabric::loopback;
using ibtrs::IoSeg;

ibtrs::FabricKind g_kind = ibtrs::FabricKind::loopback;

constexpr uint32_t kChunk = 128 * 1024;
// What one transport request carries: the server below offers no chunk sets (max_io_size 0),
// so the split is exercised at one chunk per part (chunk sets: tests/session, tests/integration).
constexpr uint32_t kMaxIo = kChunk - 4096;
constexpr uint64_t kVolSize = 16 << 20;

ibtrs::Address listen_addr(const std::string& tag) {
  return *ibtrs::Address::parse(g_kind == ibtrs::FabricKind::loopback ? "loopback:" + tag + ":0"
                                                                      : "tcp:127.0.0.1:0");
}

// One completion, and how many times it came.
struct Done {
  std::mutex mu;
  std::condition_variable cv;
  int calls = 0;
  int err = -1;
  static void cb(void* ctx, int err) {
    auto* d = static_cast<Done*>(ctx);
    std::lock_guard l(d->mu);
    ++d->calls;
    d->err = err;
    d->cv.notify_all();
  }
  IoDone io() { return IoDone{&Done::cb, this}; }
  int wait(std::chrono::milliseconds t = 20s) {
    std::unique_lock l(mu);
    if (!cv.wait_for(l, t, [&] { return calls > 0; })) return -ETIMEDOUT;
    return err;
  }
  bool done() {
    std::lock_guard l(mu);
    return calls > 0;
  }
};

// Submits and waits: the callback's errno, or minus the errno the submit call returned.
int sync(const std::function<Status(IoDone)>& submit) {
  Done d;
  auto st = submit(d.io());
  if (!st.ok()) return -st.error().value();
  const int e = d.wait();
  EXPECT_EQ(d.calls, 1);
  return e;
}

bool wait_until(const std::function<bool()>& pred, std::chrono::milliseconds t = 20s) {
  const auto end = std::chrono::steady_clock::now() + t;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(2ms);
  }
  return pred();
}

void pattern(std::byte* p, size_t len, uint32_t seed) {
  for (size_t i = 0; i < len; ++i) p[i] = std::byte((i * 131 + seed * 7 + (i >> 9)) & 0xff);
}

class Client : public ::testing::Test {
 protected:
  void SetUp() override {
    lb::faults().clear();
    srv_.add_device("vol0", kVolSize);
    srv_.add_device("vol1", 8 << 20);
    DeviceGeometry plain = FakeBlockServer::default_geometry();
    plain.max_discard_sectors = 0;
    plain.max_write_zeroes_sectors = 0;
    plain.secure_discard = false;
    srv_.add_device("plain", 4 << 20, plain);
    DeviceGeometry big = FakeBlockServer::default_geometry();
    big.logical_block_size = 4096;
    big.physical_block_size = 4096;
    srv_.add_device("vol4k", 4 << 20, big);
    srv_.add_alias("link-to-vol1", "vol1");  // as a symlink in the server's export directory
  }
  void TearDown() override {
    bufs_.clear();
    sessions_.clear();
    if (server_) {
      // Held requests are completed only once the server has closed the sessions' paths: a
      // completion racing the close's reap touches the freed session (server.cc,
      // Session::request_done reads `srv` after its last decrement). with_session runs on the
      // server's control thread, after the close.
      (void)wait_until([&] { return server_->sessions().empty(); }, 5s);
      (void)server_->with_session("", [](ibtrs::ServerSession&) {});
    }
    srv_.drop_held(ECONNABORTED);
    lb::faults().clear();
    server_.reset();
  }

  void start_server(size_t listeners = 2, uint16_t qd = 64) {
    ibtrs::ServerOptions so;
    so.queue_depth = qd;
    so.chunk_size = kChunk;
    so.max_io_size = 0;
    so.io_threads = 2;
    so.handler = &srv_;
    so.allow_any_host = true;  // the block client over a fake server; authentication is the transport's
    so.heartbeat = ibtrs::HeartbeatConfig{100ms, 5};
    for (size_t i = 0; i < listeners; ++i) so.listen.push_back(listen_addr("b" + std::to_string(i)));
    auto s = ibtrs::Server::start(so);
    ASSERT_TRUE(s.ok()) << s.error().message();
    server_ = std::move(*s);
    addrs_ = server_->addresses();
  }

  BlockSessionOptions options(size_t npaths = 1, const std::string& name = "sess") {
    BlockSessionOptions o;
    o.transport.session_name = name;
    for (size_t i = 0; i < npaths; ++i) o.transport.paths.push_back(ibtrs::PathSpec{std::nullopt, addrs_[i]});
    o.transport.io_threads = 2;
    o.transport.heartbeat = ibtrs::HeartbeatConfig{100ms, 5};
    o.transport.reconnect = ibtrs::ReconnectConfig{50ms, 50ms, 500ms, 10ms, -1};
    o.on_device_event = [this](const DeviceEvent& e) {
      std::lock_guard l(ev_mu_);
      dev_events_.push_back(e);
    };
    return o;
  }

  struct Rig {
    BlockSession* s = nullptr;
    std::shared_ptr<RemoteDevice> d;        // vol0, rw
    ibtrs::RegisteredMemory* m = nullptr;  // 1 MiB
  };
  // How most cases start: a server with `listeners`, a session with a path to each (options
  // changed by `tweak`), vol0 mapped rw, a registered buffer.
  Rig up(size_t listeners = 1, const std::function<void(BlockSessionOptions&)>& tweak = {}) {
    Rig r;
    start_server(listeners);
    if (server_ == nullptr) return r;
    auto o = options(listeners);
    if (tweak) tweak(o);
    r.s = open(std::move(o));
    if (r.s == nullptr) return r;
    r.d = map(*r.s, "vol0");
    r.m = buffer(*r.s, 1 << 20);
    return r;
  }

  BlockSession* open(BlockSessionOptions o) {
    auto s = BlockSession::open(std::move(o));
    EXPECT_TRUE(s.ok()) << s.error().message();
    if (!s.ok()) return nullptr;
    sessions_.push_back(std::move(*s));
    return sessions_.back().get();
  }

  // A registered buffer of `size` bytes of session `s` (freed before the session).
  ibtrs::RegisteredMemory* buffer(BlockSession& s, size_t size) {
    auto b = s.alloc_buffer(size);
    EXPECT_TRUE(b.ok());
    bufs_.push_back(std::move(*b));
    return bufs_.back().get();
  }

  std::shared_ptr<RemoteDevice> map(BlockSession& s, const std::string& dev, AccessMode m = AccessMode::rw) {
    auto d = s.map(dev, m);
    EXPECT_TRUE(d.ok()) << dev << ": " << d.error().message();
    return d.ok() ? *d : nullptr;
  }

  // One server that answers protocol `version`, a session to it and vol0 mapped rw (nulls on
  // failure, with the reason reported).
  std::pair<BlockSession*, std::shared_ptr<RemoteDevice>> open_at_version(uint8_t version) {
    start_server(1);
    srv_.answer_version(version);
    BlockSession* s = open(options());
    EXPECT_NE(s, nullptr);
    return {s, s != nullptr ? map(*s, "vol0") : nullptr};
  }

  static int write(RemoteDevice& d, uint64_t off, ibtrs::RegisteredMemory& m, size_t boff, uint32_t len,
                   uint32_t flags = 0) {
    IoSeg seg{m.data() + boff, len, &m};
    return sync([&](IoDone done) { return d.write(off, std::span(&seg, 1), flags, done); });
  }
  static int read(RemoteDevice& d, uint64_t off, ibtrs::RegisteredMemory& m, size_t boff, uint32_t len) {
    IoSeg seg{m.data() + boff, len, &m};
    return sync([&](IoDone done) { return d.read(off, std::span(&seg, 1), done); });
  }

  bool same(const std::string& dev, uint64_t off, const std::byte* p, size_t len) {
    auto b = srv_.bytes(dev, off, len);
    return std::memcmp(b.data(), p, len) == 0;
  }

  // The server drops every path of the session (as a restarting server would).
  void server_disconnects(const std::string& sess) {
    ASSERT_TRUE(server_
                    ->with_session(sess,
                                   [](ibtrs::ServerSession& s) {
                                     for (auto& p : s.paths()) EXPECT_TRUE(s.disconnect_path(p.name).ok());
                                   })
                    .ok());
  }

  std::vector<IoRecord> ios_of(const std::string& dev, size_t from = 0) {
    std::vector<IoRecord> out;
    auto all = srv_.ios();
    for (size_t i = from; i < all.size(); ++i)
      if (all[i].dev == dev) out.push_back(all[i]);
    return out;
  }

  size_t count_events(DeviceEvent::Kind k) {
    std::lock_guard l(ev_mu_);
    return static_cast<size_t>(std::count_if(dev_events_.begin(), dev_events_.end(),
                                             [&](const DeviceEvent& e) { return e.kind == k; }));
  }

  FakeBlockServer srv_;
  std::unique_ptr<ibtrs::Server> server_;
  std::vector<ibtrs::Address> addrs_;
  std::vector<std::unique_ptr<BlockSession>> sessions_;
  std::vector<std::unique_ptr<ibtrs::RegisteredMemory>> bufs_;  // go before their sessions
  std::mutex ev_mu_;
  std::vector<DeviceEvent> dev_events_;
};

// ---------------------------------------------------------------------------------------------

// Case: map a device rw, again rw, again ro, and names that do not resolve.
// Expect: the geometry of the server's OPEN_RSP; the same device for the same name and mode;
// EBUSY for another mode (nothing sent); the server's ENOENT; EINVAL for a bad name.
TEST_F(Client, MapOpensTheDeviceWithItsGeometry) {
  start_server(1);
  BlockSession* s = open(options());
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->proto_version(), proto::kProtoVersion);
  EXPECT_EQ(s->state(), SessionState::connected);
  auto d = map(*s, "vol0");
  ASSERT_NE(d, nullptr);
  DeviceGeometry g = FakeBlockServer::default_geometry();
  g.nsectors = kVolSize / 512;
  EXPECT_EQ(d->geometry(), g);
  EXPECT_EQ(d->name(), "vol0");
  EXPECT_EQ(d->access_mode(), AccessMode::rw);
  EXPECT_EQ(d->state(), DeviceState::open);
  EXPECT_EQ(d->size_bytes(), kVolSize);
  EXPECT_EQ(d->max_part_bytes(), kMaxIo) << "min(max_io_size, max_hw_sectors * 512)";
  const uint64_t opens = srv_.opens_.load();
  auto again = s->map("vol0", AccessMode::rw);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->get(), d.get()) << "the same device, not a second OPEN";
  EXPECT_EQ(s->map("vol0", AccessMode::ro).error(), errc(EBUSY));
  EXPECT_EQ(srv_.opens_.load(), opens);
  EXPECT_EQ(s->map("nope", AccessMode::ro).error(), errc(ENOENT));
  EXPECT_EQ(s->map("", AccessMode::ro).error(), errc(EINVAL));
  EXPECT_EQ(s->map(std::string("a\nb"), AccessMode::ro).error(), errc(EINVAL));
  auto d1 = map(*s, "vol1", AccessMode::ro);
  ASSERT_NE(d1, nullptr);
  EXPECT_NE(d1->device_id(), d->device_id());
  auto list = s->devices();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0]->name(), "vol0");
  EXPECT_EQ(list[1]->name(), "vol1");
  EXPECT_EQ(s->find("vol1").get(), d1.get());
  EXPECT_EQ(s->find("vol2"), nullptr);
}

// Case: every op once, with bytes checked on the server and read back.
// Expect: writes land, reads return them, DISCARD / WRITE_ZEROES / SECURE_ERASE read back as
// zeroes, FLUSH succeeds; the statistics count each request.
TEST_F(Client, EveryOpRoundTripsWithRealBytes) {
  auto [s, d, m] = up();
  ASSERT_TRUE(d && m);
  pattern(m->data(), 65536, 1);
  ASSERT_EQ(write(*d, 4096, *m, 0, 65536), 0);
  EXPECT_TRUE(same("vol0", 4096, m->data(), 65536));
  std::memset(m->data() + 65536, 0, 65536);
  ASSERT_EQ(read(*d, 4096, *m, 65536, 65536), 0);
  EXPECT_EQ(std::memcmp(m->data(), m->data() + 65536, 65536), 0);
  ASSERT_EQ(write(*d, 4096, *m, 0, 512, kIoFua), 0);
  ASSERT_EQ(sync([&](IoDone done) { return d->flush(done); }), 0);
  ASSERT_EQ(sync([&](IoDone done) { return d->discard(8192, 8192, done); }), 0);
  ASSERT_EQ(sync([&](IoDone done) { return d->write_zeroes(16384, 4096, true, done); }), 0);
  ASSERT_EQ(sync([&](IoDone done) { return d->secure_erase(32768, 4096, done); }), 0);
  std::vector<std::byte> zero(8192);
  EXPECT_TRUE(same("vol0", 8192, zero.data(), 8192));
  EXPECT_TRUE(same("vol0", 16384, zero.data(), 4096));
  EXPECT_TRUE(same("vol0", 32768, zero.data(), 4096));
  EXPECT_TRUE(same("vol0", 4096, m->data(), 4096)) << "outside the ranges nothing changed";
  ASSERT_EQ(read(*d, 0, *m, 0, 65536), 0);
  EXPECT_EQ(std::memcmp(m->data() + 8192, zero.data(), 8192), 0);
  auto st = d->stats();
  EXPECT_EQ(st.writes, 2u);
  EXPECT_EQ(st.reads, 2u);
  EXPECT_EQ(st.flushes, 1u);
  EXPECT_EQ(st.discards, 2u);
  EXPECT_EQ(st.write_zeroes, 1u);
  EXPECT_EQ(st.write_bytes, 65536u + 512);
  EXPECT_EQ(st.errors, 0u);
  EXPECT_EQ(st.inflight, 0u);
  EXPECT_EQ(st.parts_sent, 8u);
}

// Case: four sessions open vol0: rw, rw, ro, migration, migration.
// Expect: the server's access rules: one rw writer, readers always, migration while fewer
// than two writers; an ro device refuses writes here with the server's EPERM, nothing sent.
TEST_F(Client, AccessModesFollowTheServersRules) {
  start_server(1);
  BlockSession* a = open(options(1, "sa"));
  BlockSession* b = open(options(1, "sb"));
  BlockSession* c = open(options(1, "sc"));
  BlockSession* e = open(options(1, "se"));
  ASSERT_TRUE(a && b && c && e);
  auto da = map(*a, "vol0", AccessMode::rw);
  ASSERT_NE(da, nullptr);
  EXPECT_EQ(b->map("vol0", AccessMode::rw).error(), errc(EBUSY)) << "one rw writer";
  auto db = map(*b, "vol0", AccessMode::ro);
  ASSERT_NE(db, nullptr);
  auto dc = map(*c, "vol0", AccessMode::migration);
  ASSERT_NE(dc, nullptr) << "a second writer for a migration";
  EXPECT_EQ(e->map("vol0", AccessMode::migration).error(), errc(EBUSY)) << "not a third";
  auto* mb = buffer(*b, 65536);
  auto* ma = buffer(*a, 65536);
  pattern(ma->data(), 4096, 9);
  ASSERT_EQ(write(*da, 0, *ma, 0, 4096), 0);
  const size_t before = srv_.io_count();
  EXPECT_EQ(write(*db, 0, *mb, 0, 4096), -EPERM);
  EXPECT_EQ(sync([&](IoDone done) { return db->discard(0, 4096, done); }), -EPERM);
  EXPECT_EQ(sync([&](IoDone done) { return db->write_zeroes(0, 4096, false, done); }), -EPERM);
  EXPECT_EQ(sync([&](IoDone done) { return db->secure_erase(0, 4096, done); }), -EPERM);
  EXPECT_EQ(srv_.io_count(), before) << "refused before anything was sent";
  ASSERT_EQ(read(*db, 0, *mb, 0, 4096), 0) << "readers read";
  EXPECT_EQ(std::memcmp(mb->data(), ma->data(), 4096), 0);
  EXPECT_EQ(sync([&](IoDone done) { return db->flush(done); }), 0) << "ro may flush";
  EXPECT_EQ(srv_.holders("vol0").size(), 3u);
}

// Case: a 1 MiB write and read through a server whose chunk is 128 KiB; then the same bytes
// as 37 uneven segments.
// Expect: 9 transport requests of at most 126976 bytes at consecutive sectors each way, and the
// bytes intact on the server and back.
TEST_F(Client, LargeRequestsAreSplitAndReassembled) {
  auto [s, d, m] = up();
  ASSERT_TRUE(d && m);
  m = buffer(*s, 4 << 20);
  constexpr uint32_t kLen = 1 << 20;
  constexpr uint64_t kOff = 512 * 3;
  pattern(m->data(), kLen, 3);
  const size_t from = srv_.io_count();
  ASSERT_EQ(write(*d, kOff, *m, 0, kLen), 0);
  auto parts = ios_of("vol0", from);
  ASSERT_EQ(parts.size(), 9u);
  std::sort(parts.begin(), parts.end(), [](auto& x, auto& y) { return x.io.sector < y.io.sector; });
  uint64_t sector = kOff / 512;
  for (auto& p : parts) {
    EXPECT_EQ(p.io.op, IoOp::write);
    EXPECT_EQ(p.io.sector, sector);
    EXPECT_LE(p.io.bi_size, kMaxIo);
    sector += p.io.bi_size / 512;
  }
  EXPECT_EQ(sector, (kOff + kLen) / 512);
  EXPECT_TRUE(same("vol0", kOff, m->data(), kLen));
  ASSERT_EQ(read(*d, kOff, *m, kLen, kLen), 0);
  EXPECT_EQ(std::memcmp(m->data(), m->data() + kLen, kLen), 0);
  // Uneven segments spread over the buffer, read back in one request.
  std::vector<IoSeg> segs;
  std::mt19937 rng(7);
  size_t left = kLen;
  size_t pos = 2 * kLen;
  while (left > 0) {
    size_t len = std::min<size_t>(left, 1000 + rng() % 60000);
    if (left - len < 512 && left - len != 0) len = left;  // keep the tail a whole block
    segs.push_back(IoSeg{m->data() + pos, static_cast<uint32_t>(len), m});
    pos += len + 64;  // gaps between segments
    left -= len;
  }
  EXPECT_GT(segs.size(), 15u);
  ASSERT_EQ(sync([&](IoDone done) { return d->read(kOff, segs, done); }), 0);
  size_t at = 0;
  for (auto& sg : segs) {
    ASSERT_EQ(std::memcmp(sg.addr, m->data() + at, sg.len), 0) << "segment at " << at;
    at += sg.len;
  }
  // And written from uneven segments to another place.
  for (auto& sg : segs) pattern(static_cast<std::byte*>(sg.addr), sg.len, uint32_t(sg.len));
  ASSERT_EQ(sync([&](IoDone done) { return d->write(8 << 20, segs, 0, done); }), 0);
  at = 0;
  for (auto& sg : segs) {
    ASSERT_TRUE(same("vol0", (8 << 20) + at, static_cast<std::byte*>(sg.addr), sg.len));
    at += sg.len;
  }
}

// Case: the 4th of 9 parts of a 1 MiB write fails on the server (EIO).
// Expect: one callback, with EIO, after every part came back; the other parts landed.
TEST_F(Client, AFailingMiddlePartFailsTheRequestOnce) {
  auto [s, d, m] = up();
  ASSERT_TRUE(d && m);
  pattern(m->data(), 1 << 20, 5);
  const uint64_t bad = 3 * (kMaxIo / 512);
  srv_.set_io_fault([bad](const proto::Io& io) { return io.sector == bad ? EIO : 0; });
  Done done;
  IoSeg seg{m->data(), 1 << 20, m};
  ASSERT_TRUE(d->write(0, std::span(&seg, 1), 0, done.io()).ok());
  EXPECT_EQ(done.wait(), EIO);
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(done.calls, 1) << "once, for the whole request";
  EXPECT_EQ(ios_of("vol0").size(), 9u) << "every part went out";
  EXPECT_TRUE(same("vol0", 0, m->data(), 3 * kMaxIo)) << "parts before landed";
  EXPECT_TRUE(same("vol0", 4 * kMaxIo, m->data() + 4 * kMaxIo, (1 << 20) - 4 * kMaxIo)) << "and after";
  EXPECT_EQ(d->stats().errors, 1u);
  srv_.set_io_fault(nullptr);
  EXPECT_EQ(write(*d, 0, *m, 0, 1 << 20), 0);
}

// Case: requests that break the rules of the device or of the call.
// Expect: each refused with its errno by the call itself, no callback, nothing at the server,
// every permit free.
TEST_F(Client, BadRequestsAreRefusedBeforeAnythingIsSent) {
  auto [s, d, m] = up();
  ASSERT_TRUE(d && m);
  auto plain = map(*s, "plain");
  auto d4k = map(*s, "vol4k");
  ASSERT_TRUE(plain && d4k);
  std::vector<std::byte> unregistered(8192);
  const size_t before = srv_.io_count();
  EXPECT_EQ(write(*d, 100, *m, 0, 512), -EINVAL) << "unaligned offset";
  EXPECT_EQ(write(*d, 0, *m, 0, 1000), -EINVAL) << "unaligned length";
  EXPECT_EQ(write(*d, 0, *m, 0, 0), -EINVAL) << "nothing to write";
  EXPECT_EQ(write(*d, kVolSize - 512, *m, 0, 1024), -EINVAL) << "past the end";
  EXPECT_EQ(write(*d, kVolSize, *m, 0, 512), -EINVAL) << "at the end";
  EXPECT_EQ(sync([&](IoDone done) { return d->discard(UINT64_MAX - 511, 1024, done); }), -EINVAL)
      << "a range that wraps";
  EXPECT_EQ(sync([&](IoDone done) { return d->discard(0, 0, done); }), -EINVAL);
  EXPECT_EQ(write(*d, 0, *m, 0, 512, kIoNoUnmap), -EINVAL) << "NOUNMAP is for write-zeroes";
  EXPECT_EQ(write(*d, 0, *m, 0, 512, 1u << 20), -EINVAL) << "unknown flag";
  IoSeg outside{m->data() + m->size() - 512, 1024, m};
  EXPECT_EQ(sync([&](IoDone done) { return d->write(0, std::span(&outside, 1), 0, done); }), -EINVAL)
      << "a segment past its registration";
  IoSeg foreign{unregistered.data(), 512, m};
  EXPECT_EQ(sync([&](IoDone done) { return d->read(0, std::span(&foreign, 1), done); }), -EINVAL)
      << "a segment outside its registration";
  IoSeg unnamed{m->data(), 512, nullptr};
  EXPECT_EQ(sync([&](IoDone done) { return d->read(0, std::span(&unnamed, 1), done); }), -EINVAL)
      << "a segment without registration";
  std::vector<IoSeg> tiny(32, IoSeg{m->data(), 16, m});
  EXPECT_EQ(sync([&](IoDone done) { return d->write(0, tiny, 0, done); }), -EINVAL)
      << "15 segments that do not hold a block";
  IoSeg seg{m->data(), 512, m};
  EXPECT_EQ(d->write(0, std::span(&seg, 1), 0, IoDone{}).error(), errc(EINVAL)) << "no callback";
  EXPECT_EQ(sync([&](IoDone done) { return plain->discard(0, 4096, done); }), -EOPNOTSUPP);
  EXPECT_EQ(sync([&](IoDone done) { return plain->write_zeroes(0, 4096, false, done); }), -EOPNOTSUPP);
  EXPECT_EQ(sync([&](IoDone done) { return plain->secure_erase(0, 4096, done); }), -EOPNOTSUPP);
  EXPECT_EQ(write(*d4k, 512, *m, 0, 4096), -EINVAL) << "4 KiB blocks";
  EXPECT_EQ(write(*d4k, 0, *m, 0, 512), -EINVAL);
  EXPECT_EQ(srv_.io_count(), before) << "nothing reached the server";
  EXPECT_TRUE(wait_until([&] { return s->size_watch().armed; }));
  EXPECT_EQ(s->transport().free_permits(), s->transport().queue_depth() - 1) << "all but the WATCH's";
  EXPECT_EQ(d->stats().inflight, 0u);
  EXPECT_EQ(write(*d4k, 4096, *m, 0, 8192), 0) << "what the rules allow still works";
}

// Case: a FUA | PREFLUSH | SYNC write of three parts, a flush, a NOUNMAP write-zeroes and a
// prioritized read. Expect: the server sees PREFLUSH on the first part only, FUA and SYNC on
// each, FLUSH with no range, NOUNMAP, and the prio.
TEST_F(Client, FlagsArriveAsSent) {
  auto [s, d, m] = up();
  ASSERT_TRUE(d && m);
  const size_t from = srv_.io_count();
  ASSERT_EQ(write(*d, 0, *m, 0, 3 * kMaxIo, kIoFua | kIoPreflush | kIoSync), 0);
  ASSERT_EQ(sync([&](IoDone done) { return d->flush(done); }), 0);
  ASSERT_EQ(sync([&](IoDone done) { return d->write_zeroes(0, 4096, true, done); }), 0);
  IoSeg seg{m->data(), 4096, m};
  ASSERT_EQ(sync([&](IoDone done) { return d->read(0, std::span(&seg, 1), done, 0x4005); }), 0);
  auto r = ios_of("vol0", from);
  ASSERT_EQ(r.size(), 6u);
  std::sort(r.begin(), r.begin() + 3, [](auto& x, auto& y) { return x.io.sector < y.io.sector; });
  EXPECT_EQ(r[0].io.flags, kIoFua | kIoPreflush | kIoSync);
  EXPECT_EQ(r[1].io.flags, kIoFua | kIoSync);
  EXPECT_EQ(r[2].io.flags, kIoFua | kIoSync);
  EXPECT_EQ(r[3].io.op, IoOp::flush);
  EXPECT_EQ(r[3].io.bi_size, 0u);
  EXPECT_EQ(r[4].io.op, IoOp::write_zeroes);
  EXPECT_EQ(r[4].io.flags, uint32_t{kIoNoUnmap});
  EXPECT_EQ(r[5].io.op, IoOp::read);
  EXPECT_EQ(r[5].io.prio, 0x4005);
}

// Case: read_copy / write_copy of 600 KiB from unregistered, unaligned memory, four at once
// through two bounce buffers. Expect: the bytes round trip; parts waited for a slot and came.
TEST_F(Client, CopyingPathForUnregisteredMemory) {
  start_server(1);
  auto o = options();
  o.bounce_slots = 2;
  BlockSession* s = open(o);
  ASSERT_NE(s, nullptr);
  auto d = map(*s, "vol0");
  ASSERT_NE(d, nullptr);
  constexpr size_t kLen = 600 * 1024;
  std::vector<std::byte> src(4 * kLen + 1), dst(4 * kLen + 1);
  pattern(src.data() + 1, 4 * kLen, 11);
  Done w[4];
  for (int i = 0; i < 4; ++i)
    ASSERT_TRUE(d->write_copy(i * kLen, std::span(src.data() + 1 + i * kLen, kLen), 0, w[i].io()).ok());
  for (auto& x : w) EXPECT_EQ(x.wait(), 0);
  EXPECT_TRUE(same("vol0", 0, src.data() + 1, 4 * kLen));
  Done r[4];
  for (int i = 0; i < 4; ++i)
    ASSERT_TRUE(d->read_copy(i * kLen, std::span(dst.data() + 1 + i * kLen, kLen), r[i].io()).ok());
  for (auto& x : r) EXPECT_EQ(x.wait(), 0);
  EXPECT_EQ(std::memcmp(src.data() + 1, dst.data() + 1, 4 * kLen), 0);
  std::vector<std::byte> odd(1000);
  EXPECT_EQ(sync([&](IoDone done) { return d->write_copy(0, odd, 0, done); }), -EINVAL);
  o = options(1, "nobounce");
  o.bounce_slots = 0;
  BlockSession* s2 = open(o);
  ASSERT_NE(s2, nullptr);
  auto d2 = map(*s2, "vol1", AccessMode::ro);
  ASSERT_NE(d2, nullptr);
  EXPECT_EQ(sync([&](IoDone done) { return d2->read_copy(0, std::span(dst.data(), 4096), done); }),
            -EOPNOTSUPP);
}

// Writes that submit each other from their completions (see the case below).
thread_local int tl_submitting = 0;
struct Chain {
  static constexpr int kN = 40;
  static constexpr uint32_t kLen = 200 * 1024;
  RemoteDevice* d = nullptr;
  ibtrs::RegisteredMemory* m = nullptr;
  IoSeg seg;
  int next = 0;
  int nested = 0;  // callbacks that ran inside a submit call
  int errors = 0;
  Done all;
  void submit() {
    seg = IoSeg{m->data() + (next % 4) * kLen, kLen, m};
    ++tl_submitting;
    auto st = d->write(uint64_t(next) * kLen, std::span(&seg, 1), 0, IoDone{&Chain::cb, this});
    --tl_submitting;
    if (!st.ok()) Done::cb(&all, st.error().value());
  }
  static void cb(void* ctx, int err) {
    auto* c = static_cast<Chain*>(ctx);
    if (tl_submitting != 0) ++c->nested;
    if (err != 0) ++c->errors;
    if (++c->next == kN) return Done::cb(&c->all, c->errors);
    c->submit();
  }
};

// Case: each completion submits the next split write from the callback (as an event loop or
// the daemon's completion path does), 40 times.
// Expect: every write lands; no callback ever runs inside a submit call.
TEST_F(Client, CallbacksMaySubmitAndNeverRunInsideASubmit) {
  auto [s, d, m] = up();
  ASSERT_TRUE(d && m);
  for (int i = 0; i < 4; ++i) pattern(m->data() + i * Chain::kLen, Chain::kLen, 60 + i);
  Chain c;
  c.d = d.get();
  c.m = m;
  c.submit();
  EXPECT_EQ(c.all.wait(), 0);
  EXPECT_EQ(c.nested, 0);
  for (int i = 0; i < Chain::kN; ++i)
    ASSERT_TRUE(same("vol0", uint64_t(i) * Chain::kLen, m->data() + (i % 4) * Chain::kLen, Chain::kLen)) << i;
}

// Case: 64 writes of 4 KiB and one split 256 KiB write submitted inside a submission batch
// (nested once, plus an end_batch of nothing), then read back in another. Expect: each
// completes once with 0 after the batch ends, and the bytes are the ones written.
TEST_F(Client, BatchedSubmissionsAllGoOutAtTheEnd) {
  auto [s, d, m] = up();
  ASSERT_TRUE(d && m);
  constexpr int kN = 64;
  constexpr uint32_t kLen = 4096;
  constexpr uint32_t kBig = 256 << 10;
  pattern(m->data(), kN * kLen + kBig, 77);
  std::vector<Done> w(kN + 1);
  s->end_batch();  // without a begin: nothing
  s->begin_batch();
  s->begin_batch();
  for (int i = 0; i < kN; ++i) {
    IoSeg seg{m->data() + i * kLen, kLen, m};
    ASSERT_TRUE(d->write(uint64_t(i) * kLen, std::span(&seg, 1), 0, w[i].io()).ok());
  }
  s->end_batch();  // inner: the batch stays open
  IoSeg big{m->data() + kN * kLen, kBig, m};
  ASSERT_TRUE(d->write(kN * kLen, std::span(&big, 1), 0, w[kN].io()).ok());
  s->end_batch();
  for (auto& x : w) EXPECT_EQ(x.wait(), 0);
  for (auto& x : w) EXPECT_EQ(x.calls, 1);
  ASSERT_TRUE(same("vol0", 0, m->data(), kN * kLen + kBig));

  std::byte* back = m->data() + (512 << 10);
  std::memset(back, 0, kN * kLen);
  std::vector<Done> r(kN);
  s->begin_batch();
  for (int i = 0; i < kN; ++i) {
    IoSeg seg{back + i * kLen, kLen, m};
    ASSERT_TRUE(d->read(uint64_t(i) * kLen, std::span(&seg, 1), r[i].io()).ok());
  }
  s->end_batch();
  for (auto& x : r) EXPECT_EQ(x.wait(), 0);
  EXPECT_EQ(std::memcmp(back, m->data(), kN * kLen), 0);
}

// A load of split writes, then reads, of random sizes from several threads, each thread on
// its own region; verified against what was written. Returns the failed requests.
int run_load(RemoteDevice& d, ibtrs::RegisteredMemory& m, int threads, int per_thread,
             const std::function<void(int)>& at_step = {}) {
  std::atomic<int> failed{0}, bad{0};
  const size_t region = m.size() / threads / 2;
  const uint64_t dev_region = d.size_bytes() / threads;
  std::vector<std::thread> ts;
  std::atomic<int> step{0};
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      std::mt19937 rng(t + 1);
      std::byte* wbuf = m.data() + 2 * t * region;
      std::byte* rbuf = wbuf + region;
      for (int i = 0; i < per_thread; ++i) {
        if (at_step) at_step(step.fetch_add(1));
        const uint32_t len = static_cast<uint32_t>((1 + rng() % (region / 4096)) * 4096);
        const uint64_t off = t * dev_region + (rng() % ((dev_region - len) / 4096)) * 4096;
        pattern(wbuf, len, rng());
        IoSeg ws{wbuf, len, &m};
        IoSeg rs{rbuf, len, &m};
        const int e1 = sync([&](IoDone done) { return d.write(off, std::span(&ws, 1), 0, done); });
        const int e2 = sync([&](IoDone done) { return d.read(off, std::span(&rs, 1), done); });
        if (e1 != 0 || e2 != 0) {
          ++failed;
          continue;
        }
        if (std::memcmp(wbuf, rbuf, len) != 0) ++bad;
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(bad.load(), 0) << "data read back differs from what was written";
  return failed.load();
}

// Case: split reads and writes from four threads at once. Expect: all succeed, bytes intact.
TEST_F(Client, ConcurrentSplitIoFromManyThreads) {
  auto [s, d, m] = up(2);
  ASSERT_TRUE(d && m);
  m = buffer(*s, 8 << 20);
  EXPECT_EQ(run_load(*d, *m, 4, 40), 0);
  EXPECT_EQ(d->stats().inflight, 0u);
  EXPECT_GT(d->stats().parts_sent, d->stats().writes + d->stats().reads) << "requests were split";
}

// Case: a session of queue depth 4 and 16 writes of 3 parts each submitted at once, then read
// back the same way. Expect: the parts beyond the 4 permits wait in the library (the calls
// never block) and all complete, in any order, with their bytes.
TEST_F(Client, PartsBeyondTheQueueDepthWaitForPermits) {
  start_server(1, /*qd=*/4);
  BlockSession* s = open(options(1));
  ASSERT_NE(s, nullptr);
  ASSERT_EQ(s->transport().queue_depth(), 4u);
  auto d = map(*s, "vol0");
  ASSERT_NE(d, nullptr);
  constexpr int kN = 16;
  constexpr uint32_t kLen = 3 * kMaxIo;
  auto* m = buffer(*s, 2 * kN * size_t{kLen});
  pattern(m->data(), size_t{kN} * kLen, 99);
  Done w[kN], r[kN];
  IoSeg ws[kN], rs[kN];
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kN; ++i) {
    ws[i] = IoSeg{m->data() + size_t{kLen} * i, kLen, m};
    ASSERT_TRUE(d->write(uint64_t{kLen} * i, std::span(&ws[i], 1), 0, w[i].io()).ok());
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s) << "submitting does not wait for permits";
  for (auto& x : w) EXPECT_EQ(x.wait(), 0);
  for (int i = 0; i < kN; ++i) {
    rs[i] = IoSeg{m->data() + size_t{kLen} * (kN + i), kLen, m};
    ASSERT_TRUE(d->read(uint64_t{kLen} * i, std::span(&rs[i], 1), r[i].io()).ok());
  }
  for (auto& x : r) EXPECT_EQ(x.wait(), 0);
  EXPECT_EQ(std::memcmp(m->data(), m->data() + size_t{kN} * kLen, size_t{kN} * kLen), 0);
  EXPECT_EQ(d->stats().parts_sent, 2u * 3 * kN);
  // The WATCH (re-posted after its first answer, or after it found no permit) holds the other.
  EXPECT_TRUE(wait_until([&] { return s->size_watch().armed; }));
  EXPECT_EQ(s->transport().free_permits(), 3u) << "all but the WATCH's";
}

// Case: a session with one permit for IO (queue depth 2; the WATCH holds the other); rounds of
// two 4 KiB writes submitted at once, then waited for: the first goes out, the second waits
// for the permit. The thread that pumps the waiting write stalls 2 ms after it found no
// permit (as a thread preempted on a loaded host stalls), and the first write completes then.
// Expect: every write completes within 2 s: the completion that freed the permit sees the
// write waiting and sends it (session 12's stall: it saw an empty queue, the write went back
// to it, and nothing was left to send it: no IO in flight, none submitted).
TEST_F(Client, APermitFreedWhileTheQueueIsPumpedIsNotLost) {
  start_server(1, /*qd=*/2);
  BlockSession* s = open(options(1));
  ASSERT_NE(s, nullptr);
  auto d = map(*s, "vol0");
  ASSERT_NE(d, nullptr);
  auto* m = buffer(*s, 2 * 4096);
  ASSERT_NE(m, nullptr);
  ASSERT_TRUE(wait_until([&] { return s->size_watch().armed; }));
  ASSERT_EQ(s->transport().free_permits(), 1u);
  static std::atomic<int> stalls{0};
  stalls = 0;
  client::g_pump_found_no_permit = [] {
    stalls.fetch_add(1);
    std::this_thread::sleep_for(2ms);
  };
  IoSeg seg[2];
  for (int i = 0; i < 2; ++i) seg[i] = IoSeg{m->data() + 4096 * i, 4096, m};
  // Until the pump stalled 5 times (a round whose WATCH was being re-posted has both permits
  // free: its second write does not wait), 200 rounds at most.
  for (int round = 0; round < 200 && stalls.load() < 5; ++round) {
    Done w[2];
    for (int i = 0; i < 2; ++i) ASSERT_TRUE(d->write(uint64_t(i) * 4096, std::span(&seg[i], 1), 0, w[i].io()).ok());
    for (int i = 0; i < 2; ++i) ASSERT_EQ(w[i].wait(2s), 0) << "write " << i << " of round " << round;
  }
  client::g_pump_found_no_permit = nullptr;
  EXPECT_GE(stalls.load(), 5) << "second writes found the first's permit taken";
  EXPECT_EQ(d->stats().inflight, 0u);
}

// Case: one of two paths breaks (fabric fault) while split IO runs.
// Expect: the transport fails the path's requests over; every request succeeds with its bytes.
TEST_F(Client, APathBrokenMidIoFailsOverTransparently) {
  if (g_kind != ibtrs::FabricKind::loopback) GTEST_SKIP() << "fault injection needs loopback";
  auto [s, d, m] = up(2);
  ASSERT_TRUE(d && m);
  m = buffer(*s, 8 << 20);
  const uint64_t rule = lb::faults().add(lb::FaultRule{.action = lb::FaultAction::disconnect,
                                                       .opcode = ibtrs::fabric::Opcode::write_with_imm,
                                                       .endpoint = addrs_[0].name,
                                                       .direction = lb::Direction::to_server,
                                                       .skip = 60,
                                                       .count = 1});
  EXPECT_EQ(run_load(*d, *m, 4, 30), 0);
  EXPECT_EQ(lb::faults().hits(rule), 1u) << "the fault fired";
  uint64_t failovered = 0;
  for (auto& p : s->transport().paths()) failovered += p.stats.failovered;
  EXPECT_GT(failovered, 0u);
  EXPECT_EQ(s->state(), SessionState::connected) << "the other path stayed";
  EXPECT_EQ(d->stats().remaps, 0u);
}

// Case: two devices mapped, the first unmapped (the second keeps id 1); the server drops every
// path; a write is submitted while the session is down.
// Expect: the write waits, the session reconnects and re-opens the device, which gets id 0 on
// the server's new session (reported old -> new); the write goes out with the new id and lands
// on the right volume. The maps were plain OPENs; the remap's OPEN says REOPEN (the server may
// take the device over from the client's previous server: docs/protocol.md).
TEST_F(Client, AllPathsDownAndBackRemapsAndQueuedIoResumes) {
  auto [s, d0, m] = up(2);
  ASSERT_TRUE(d0 && m);
  auto d1 = map(*s, "vol1");
  ASSERT_NE(d1, nullptr);
  EXPECT_EQ(srv_.reopens_.load(), 0u) << "a first map is no re-open";
  EXPECT_EQ(d1->device_id(), 1u);
  ASSERT_TRUE(s->unmap("vol0").ok());
  EXPECT_EQ(d0->state(), DeviceState::closed);
  srv_.fill("vol0", 0, 1 << 20, std::byte{0xee});
  server_disconnects("sess");
  ASSERT_TRUE(wait_until([&] { return s->state() != SessionState::connected; }));
  pattern(m->data(), 300000 & ~511u, 21);
  const size_t from = srv_.io_count();
  Done w;
  IoSeg seg{m->data(), 300000 & ~511u, m};
  ASSERT_TRUE(d1->write(65536, std::span(&seg, 1), 0, w.io()).ok());
  EXPECT_EQ(w.wait(), 0);
  EXPECT_EQ(s->state(), SessionState::connected);
  EXPECT_EQ(d1->state(), DeviceState::open);
  EXPECT_EQ(d1->device_id(), 0u) << "the new session's lowest id";
  EXPECT_EQ(d1->stats().remaps, 1u);
  {
    std::lock_guard l(ev_mu_);
    ASSERT_EQ(dev_events_.size(), 1u);
    EXPECT_EQ(dev_events_[0].kind, DeviceEvent::Kind::remapped);
    EXPECT_EQ(dev_events_[0].dev_name, "vol1");
    EXPECT_EQ(dev_events_[0].old_id, 1u);
    EXPECT_EQ(dev_events_[0].new_id, 0u);
  }
  for (auto& r : srv_.ios()) {
    if (r.io.op != IoOp::write) continue;
    EXPECT_EQ(r.dev, "vol1") << "nothing reached another device";
  }
  EXPECT_EQ(ios_of("vol1", from).size(), 3u) << "sent once, after the remap";
  EXPECT_TRUE(same("vol1", 65536, m->data(), 300000 & ~511u));
  std::vector<std::byte> ee(1 << 20, std::byte{0xee});
  EXPECT_TRUE(same("vol0", 0, ee.data(), ee.size())) << "vol0 untouched";
  EXPECT_GE(srv_.sess_infos_.load(), 2u) << "SESS_INFO again after the reconnect";
  EXPECT_EQ(srv_.reopens_.load(), 1u) << "the remap of vol1 (vol0 was unmapped)";
  ASSERT_EQ(read(*d1, 65536, *m, 512 * 1024, 300000 & ~511u), 0);
  EXPECT_EQ(std::memcmp(m->data(), m->data() + 512 * 1024, 300000 & ~511u), 0);
}

// Case: a server "restart" with writes in flight: the server holds 8 writes, forgets every
// device id, drops its paths and the held requests (unserved).
// Expect: the transport re-sends the writes to the new server session, which answers ENODEV;
// the client remaps and sends each once more: all complete with 0 and their bytes are there.
TEST_F(Client, ServerRestartWithIoInFlightRetriesAfterRemap) {
  auto [s, d, m] = up();
  ASSERT_TRUE(d && m);
  srv_.hold_io(true);
  constexpr int kN = 8;
  Done w[kN];
  IoSeg seg[kN];
  for (int i = 0; i < kN; ++i) {
    pattern(m->data() + i * 65536, 65536, 100 + i);
    seg[i] = IoSeg{m->data() + i * 65536, 65536, m};
    ASSERT_TRUE(d->write(uint64_t(i) * 65536, std::span(&seg[i], 1), 0, w[i].io()).ok());
  }
  ASSERT_TRUE(wait_until([&] { return srv_.held() == kN; }));
  srv_.hold_io(false);
  srv_.forget_ids();
  server_disconnects("sess");
  srv_.drop_held(EIO);  // the crashed server never answers them; nothing was written
  for (int i = 0; i < kN; ++i) EXPECT_EQ(w[i].wait(), 0) << i;
  for (int i = 0; i < kN; ++i)
    EXPECT_TRUE(same("vol0", uint64_t(i) * 65536, m->data() + i * 65536, 65536)) << i;
  EXPECT_EQ(d->stats().enodev_retries, uint64_t{kN});
  EXPECT_EQ(d->stats().remaps, 1u);
  EXPECT_EQ(d->stats().errors, 0u);
  EXPECT_EQ(s->state(), SessionState::connected);
}

// Case: the server forgets the device ids while the session stays up (an admin force close).
// Expect: IO fails with ENODEV (not retried: re-opening on our own would undo the force
// close); remap() re-opens and IO works again.
TEST_F(Client, ForgottenIdsWithoutReconnectAreReportedUntilRemap) {
  auto [s, d, m] = up();
  ASSERT_TRUE(d && m);
  ASSERT_EQ(write(*d, 0, *m, 0, 4096), 0);
  srv_.forget_ids();
  EXPECT_EQ(write(*d, 0, *m, 0, 4096), ENODEV);
  EXPECT_EQ(d->stats().enodev_retries, 0u);
  ASSERT_TRUE(s->remap("vol0").ok());
  EXPECT_EQ(d->state(), DeviceState::open);
  pattern(m->data(), 4096, 77);
  EXPECT_EQ(write(*d, 0, *m, 0, 4096), 0);
  EXPECT_TRUE(same("vol0", 0, m->data(), 4096));
  EXPECT_EQ(s->remap("nope").error(), errc(ENOENT));
  EXPECT_EQ(count_events(DeviceEvent::Kind::remapped), 1u);
}

// Case: after the paths come back, the server refuses to re-open the device (it is gone);
// a write waits meanwhile. Expect: the write fails with the server's errno, the device is
// closed and refuses new IO; once the server allows it, mapping it again re-opens it.
TEST_F(Client, RefusedReopenEndsInACleanError) {
  auto [s, d, m] = up(1, [](BlockSessionOptions& o) {
    o.transport.reconnect.delay = 300ms;  // the write below is submitted while the session is down
  });
  ASSERT_TRUE(d && m);
  srv_.refuse_open(ENOENT);
  server_disconnects("sess");
  ASSERT_TRUE(wait_until([&] { return s->state() != SessionState::connected; }));
  EXPECT_EQ(write(*d, 0, *m, 0, 4096), ENOENT);
  EXPECT_EQ(d->state(), DeviceState::closed);
  EXPECT_EQ(write(*d, 0, *m, 0, 4096), -ENODEV);
  EXPECT_EQ(count_events(DeviceEvent::Kind::remap_failed), 1u);
  EXPECT_EQ(s->state(), SessionState::connected);
  EXPECT_EQ(s->map("vol0", AccessMode::rw).error(), errc(ENOENT)) << "still refused";
  srv_.refuse_open(0);
  auto again = s->map("vol0", AccessMode::rw);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->get(), d.get()) << "the same device, open again";
  EXPECT_EQ(d->state(), DeviceState::open);
  pattern(m->data(), 4096, 5);
  EXPECT_EQ(write(*d, 0, *m, 0, 4096), 0);
  EXPECT_TRUE(same("vol0", 0, m->data(), 4096));
}

// Case: the client's only path is closed and does not come back; a write waits.
// Expect: after remap_timeout it fails with ENOTCONN; when the path is reconnected the session
// remaps and IO works.
TEST_F(Client, IoWaitsForTheRemapOnlyUntilTheTimeout) {
  auto [s, d, m] = up(1, [](BlockSessionOptions& o) {
    o.remap_timeout = 300ms;
  });
  ASSERT_TRUE(d && m);
  const std::string path = s->transport().paths()[0].name;
  ASSERT_TRUE(s->transport().disconnect_path(path).ok());
  EXPECT_EQ(s->state(), SessionState::disconnected);
  EXPECT_EQ(d->state(), DeviceState::remapping);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(write(*d, 0, *m, 0, 4096), ENOTCONN);
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(took, 250ms);
  EXPECT_LT(took, 3s);
  ASSERT_TRUE(s->transport().reconnect_path(path).ok());
  ASSERT_TRUE(wait_until([&] { return s->state() == SessionState::connected; }));
  EXPECT_EQ(write(*d, 0, *m, 0, 4096), 0);
}

// Case: unmap while a write is held by the server, then after; then a forced unmap with a
// write held. Expect: EBUSY while IO is out; then CLOSE reaches the server (no holder) and the
// device is closed; forced: new IO is refused at once, the held write still completes, and the
// unmap returns once it did.
TEST_F(Client, UnmapRefusesWhileIoIsOutUnlessForced) {
  auto [s, d, m] = up();
  ASSERT_TRUE(d && m);
  srv_.hold_io(true);
  Done w;
  IoSeg seg{m->data(), 4096, m};
  ASSERT_TRUE(d->write(0, std::span(&seg, 1), 0, w.io()).ok());
  ASSERT_TRUE(wait_until([&] { return srv_.held() == 1; }));
  EXPECT_EQ(s->unmap("vol0").error(), errc(EBUSY));
  srv_.hold_io(false);
  srv_.release_held();
  EXPECT_EQ(w.wait(), 0);
  ASSERT_TRUE(s->unmap("vol0").ok());
  EXPECT_TRUE(srv_.holders("vol0").empty()) << "CLOSE reached the server";
  EXPECT_EQ(d->state(), DeviceState::closed);
  EXPECT_EQ(write(*d, 0, *m, 0, 4096), -ENODEV);
  EXPECT_EQ(s->unmap("vol0").error(), errc(ENOENT));
  EXPECT_TRUE(s->devices().empty());

  auto d2 = map(*s, "vol0");
  ASSERT_NE(d2, nullptr);
  srv_.hold_io(true);
  Done w2;
  ASSERT_TRUE(d2->write(0, std::span(&seg, 1), 0, w2.io()).ok());
  ASSERT_TRUE(wait_until([&] { return srv_.held() == 1; }));
  auto unmapped = std::async(std::launch::async, [&] { return s->unmap("vol0", UnmapMode::force); });
  ASSERT_TRUE(wait_until([&] { return d2->state() == DeviceState::closed; }));
  EXPECT_EQ(write(*d2, 0, *m, 0, 4096), -ENODEV) << "refused at once";
  EXPECT_EQ(unmapped.wait_for(100ms), std::future_status::timeout) << "waits for the held write";
  srv_.hold_io(false);
  srv_.release_held();
  EXPECT_EQ(w2.wait(), 0);
  EXPECT_TRUE(unmapped.get().ok());
  EXPECT_TRUE(srv_.holders("vol0").empty());
}

// Case: vol0 mapped rw by one session and ro by another; the writer unmaps.
// Expect: the reader keeps reading the writer's bytes; the device is free for a new writer.
TEST_F(Client, UnmapWhileMappedElsewhere) {
  start_server(1);
  BlockSession* a = open(options(1, "sa"));
  BlockSession* b = open(options(1, "sb"));
  BlockSession* c = open(options(1, "sc"));
  ASSERT_TRUE(a && b && c);
  auto da = map(*a, "vol0", AccessMode::rw);
  auto db = map(*b, "vol0", AccessMode::ro);
  ASSERT_TRUE(da && db);
  auto* ma = buffer(*a, 65536);
  auto* mb = buffer(*b, 65536);
  pattern(ma->data(), 8192, 42);
  ASSERT_EQ(write(*da, 0, *ma, 0, 8192), 0);
  EXPECT_EQ(c->map("vol0", AccessMode::rw).error(), errc(EBUSY));
  ASSERT_TRUE(a->unmap("vol0").ok());
  auto h = srv_.holders("vol0");
  ASSERT_EQ(h.size(), 1u);
  EXPECT_EQ(h[0].mode, AccessMode::ro);
  ASSERT_EQ(read(*db, 0, *mb, 0, 8192), 0);
  EXPECT_EQ(std::memcmp(ma->data(), mb->data(), 8192), 0);
  EXPECT_NE(map(*c, "vol0", AccessMode::rw), nullptr) << "the writer slot is free";
}

// Case: vol1 mapped, then mapped again by another name the server resolves to the same store
// (a symlink, "./vol1", its absolute path): the server answers with vol1's id. Expect: the map
// is refused with EEXIST and sends no CLOSE (the id is vol1's); vol1 keeps working, also after
// an unmap of the refused name (ENOENT: never mapped); in another session the alias is the
// same device for the access rules (EBUSY for a second writer).
TEST_F(Client, AnotherNameOfAMappedDeviceIsRefused) {
  start_server(1);
  BlockSession* a = open(options(1, "sa"));
  BlockSession* b = open(options(1, "sb"));
  ASSERT_TRUE(a && b);
  auto d = map(*a, "vol1", AccessMode::rw);
  ASSERT_NE(d, nullptr);
  const uint64_t closes = srv_.closes_.load();
  EXPECT_EQ(a->map("link-to-vol1", AccessMode::rw).error(), errc(EEXIST));
  EXPECT_EQ(srv_.closes_.load(), closes) << "nothing closed: the id is vol1's";
  EXPECT_EQ(a->devices().size(), 1u);
  EXPECT_EQ(a->unmap("link-to-vol1").error(), errc(ENOENT));
  auto* m = buffer(*a, 65536);
  pattern(m->data(), 4096, 3);
  EXPECT_EQ(write(*d, 0, *m, 0, 4096), 0) << "the first mapping is intact";
  EXPECT_EQ(b->map("link-to-vol1", AccessMode::rw).error(), errc(EBUSY)) << "one writer per store";
  ASSERT_TRUE(a->unmap("vol1").ok());
  EXPECT_NE(map(*b, "link-to-vol1", AccessMode::rw), nullptr) << "free once vol1 is unmapped";
}

// Case: a server that answers SESS_INFO with a version above the one proposed, or below ours.
// Expect: open() fails with EPROTO / EPROTONOSUPPORT.
TEST_F(Client, VersionNegotiationRefusesWhatItCannotSpeak) {
  start_server(1);
  srv_.answer_version(proto::kProtoVersion + 1);
  EXPECT_EQ(BlockSession::open(options()).error(), errc(EPROTO));
  srv_.answer_version(proto::kMinProtoVersion - 1);
  EXPECT_EQ(BlockSession::open(options()).error(), errc(EPROTONOSUPPORT));
  srv_.answer_version(std::nullopt);
  EXPECT_NE(open(options()), nullptr);
}

// Case: a server that speaks version 2 (OPEN without flags, as the kernel's); all its paths drop
// and come back. Expect: the remap re-opens the device without the REOPEN bit (a version 2
// server refuses unknown bits in that byte) and IO resumes.
TEST_F(Client, RemapToAVersionTwoServerSendsNoOpenFlags) {
  start_server(1);
  srv_.answer_version(2);
  BlockSession* s = open(options());
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->proto_version(), 2);
  auto d = map(*s, "vol0");
  auto m = buffer(*s, 1 << 20);
  ASSERT_TRUE(d && m);
  server_disconnects("sess");
  ASSERT_TRUE(wait_until([&] { return s->state() != SessionState::connected; }));
  ASSERT_TRUE(wait_until([&] { return d->stats().remaps == 1; }));
  EXPECT_EQ(srv_.reopens_.load(), 0u);
  EXPECT_EQ(write(*d, 0, *m, 0, 4096), 0);
}

// Case: the session is closed while the server holds a write and the caller keeps the device.
// Expect: the write completes once with an error; the device then refuses IO with ESHUTDOWN.
TEST_F(Client, ClosingTheSessionCompletesItsIo) {
  auto [s, d, m] = up();
  ASSERT_TRUE(d && m);
  m = buffer(*s, 65536);
  srv_.hold_io(true);
  Done w;
  IoSeg seg{m->data(), 4096, m};
  ASSERT_TRUE(d->write(0, std::span(&seg, 1), 0, w.io()).ok());
  ASSERT_TRUE(wait_until([&] { return srv_.held() == 1; }));
  bufs_.clear();
  sessions_.clear();
  EXPECT_NE(w.wait(1s), 0);
  EXPECT_EQ(w.calls, 1);
  std::vector<std::byte> x(4096);
  EXPECT_EQ(sync([&](IoDone done) { return d->write_copy(0, x, 0, done); }), -ESHUTDOWN);
  EXPECT_EQ(d->state(), DeviceState::closed);
}


// ---------------------------------------------------------------------------------------------
// Size notices (protocol 4): the session's WATCH, answered by the server when a device it holds
// changes size (client.h, "Size notices").

// The last resize event of `dev`, if any.
std::optional<DeviceEvent> last_resize(std::mutex& mu, const std::vector<DeviceEvent>& evs, const std::string& dev) {
  std::lock_guard l(mu);
  for (auto it = evs.rbegin(); it != evs.rend(); ++it)
    if (it->kind == DeviceEvent::Kind::resized && it->dev_name == dev) return *it;
  return std::nullopt;
}

// Case: vol0 and vol1 mapped; the server grows vol0 from 16 to 24 MiB, then shrinks it to 8 MiB.
// Expect: the session's WATCH is held by the server (it holds one permit); within 2 s of each
// resize the device's size (and geometry) is the new one, a resized event says old -> new, and
// IO follows it: past the old end works after the growth (bytes land on the server), past the
// new end is refused before anything is sent after the shrink. vol1 hears nothing.
TEST_F(Client, ResizesReachTheMappedDevices) {
  auto [s, d, m] = up();
  ASSERT_TRUE(s && d && m);
  auto d1 = map(*s, "vol1");
  ASSERT_NE(d1, nullptr);
  EXPECT_TRUE(s->size_watch().supported);
  // Posted by open() with no epoch, answered at once (the server's differs), posted again.
  ASSERT_TRUE(wait_until([&] { return srv_.held_watches() == 1 && s->size_watch().armed; }));
  EXPECT_NE(s->size_watch().epoch, 0u);
  EXPECT_EQ(s->transport().free_permits(), s->transport().queue_depth() - 1) << "the WATCH holds one";

  srv_.resize("vol0", 24 << 20);
  ASSERT_TRUE(wait_until([&] { return d->size_bytes() == (24u << 20); }, 2s)) << d->size_bytes();
  EXPECT_EQ(d->geometry().nsectors, (24u << 20) / kSectorSize);
  auto ev = last_resize(ev_mu_, dev_events_, "vol0");
  ASSERT_TRUE(ev.has_value());
  EXPECT_EQ(ev->old_size, kVolSize);
  EXPECT_EQ(ev->new_size, 24u << 20);
  EXPECT_EQ(d->stats().resizes, 1u);
  pattern(m->data(), 65536, 3);
  EXPECT_EQ(write(*d, 20 << 20, *m, 0, 65536), 0) << "past the old end";
  EXPECT_TRUE(same("vol0", 20 << 20, m->data(), 65536));
  EXPECT_EQ(read(*d, 20 << 20, *m, 65536, 65536), 0);
  EXPECT_EQ(std::memcmp(m->data(), m->data() + 65536, 65536), 0);

  srv_.resize("vol0", 8 << 20);
  ASSERT_TRUE(wait_until([&] { return d->size_bytes() == (8u << 20); }, 2s)) << d->size_bytes();
  const size_t before = srv_.io_count();
  EXPECT_EQ(write(*d, 12 << 20, *m, 0, 4096), -EINVAL) << "past the new end";
  EXPECT_EQ(srv_.io_count(), before) << "nothing was sent";
  EXPECT_EQ(write(*d, 4 << 20, *m, 0, 4096), 0);
  EXPECT_EQ(d1->size_bytes(), 8u << 20) << "vol1 as it was";
  EXPECT_FALSE(last_resize(ev_mu_, dev_events_, "vol1").has_value());
  EXPECT_EQ(s->size_watch().resizes, 2u);
  ASSERT_TRUE(wait_until([&] { return srv_.held_watches() == 1; })) << "posted again";
  EXPECT_EQ(srv_.watches_busy_.load(), 0u);
}

// Case: two paths, the WATCH held on the first; the server resizes vol0 but its answer is lost
// with that path (the server drops the path; the answer goes nowhere). Expect: the transport
// sends the WATCH again on the second path with the epoch the client had, which the server
// answers at once: the client has the new size within 2 s, one resize, no EBUSY.
TEST_F(Client, AResizeAnswerLostWithItsPathIsAskedAgain) {
  start_server(2);
  BlockSession* s = open(options(1));
  ASSERT_NE(s, nullptr);
  auto d = map(*s, "vol0");
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(wait_until([&] { return srv_.held_watches() == 1; }));
  const std::string first = s->transport().paths().at(0).name;
  ASSERT_TRUE(s->transport().add_path(ibtrs::PathSpec{std::nullopt, addrs_[1]}).ok());
  ASSERT_TRUE(wait_until([&] {
    auto ps = s->transport().paths();
    return ps.size() == 2 && std::all_of(ps.begin(), ps.end(), [](const ibtrs::ClientPathInfo& p) {
             return p.state == ibtrs::ClientPathState::connected;
           });
  }));
  const uint64_t watches = srv_.watches_.load();
  srv_.hold_notices(true);
  srv_.resize("vol0", 20 << 20);
  EXPECT_EQ(d->size_bytes(), kVolSize) << "held back: not told yet";
  ASSERT_TRUE(server_->with_session("sess", [&](ibtrs::ServerSession& ss) {
                  EXPECT_TRUE(ss.disconnect_path(first).ok());
                }).ok());
  ASSERT_TRUE(wait_until([&] { return d->size_bytes() == (20u << 20); }, 2s)) << d->size_bytes();
  EXPECT_GE(srv_.watches_.load(), watches + 1) << "sent again";
  EXPECT_EQ(d->stats().resizes, 1u);
  EXPECT_EQ(srv_.watches_busy_.load(), 0u);
  srv_.hold_notices(false);
  EXPECT_EQ(write(*d, 18 << 20, *buffer(*s, 4096), 0, 4096), 0);
}

// Case: the server drops every path of the session; the client reconnects and remaps. Then vol0
// is resized. Expect: a WATCH is held by the new server session (re-armed after the remap;
// the copy the transport re-sent before SESS_INFO was refused and retried), and the resize
// reaches the device.
TEST_F(Client, ReconnectReArmsTheWatch) {
  auto [s, d, m] = up();
  ASSERT_TRUE(s && d && m);
  ASSERT_TRUE(wait_until([&] { return srv_.held_watches() == 1; }));
  server_disconnects("sess");
  ASSERT_TRUE(wait_until([&] { return d->stats().remaps == 1 && s->state() == SessionState::connected; }));
  ASSERT_TRUE(wait_until([&] { return srv_.held_watches() == 1 && s->size_watch().armed; }, 5s));
  srv_.resize("vol0", 32 << 20);
  ASSERT_TRUE(wait_until([&] { return d->size_bytes() == (32u << 20); }, 2s)) << d->size_bytes();
  EXPECT_EQ(write(*d, 30 << 20, *m, 0, 4096), 0);
}

// Case: a second WATCH sent by hand on a session whose own is held. Expect: EBUSY, and the held
// one still answers the next resize.
TEST_F(Client, ASecondWatchIsRefused) {
  auto [s, d, m] = up();
  ASSERT_TRUE(s && d && m);
  ASSERT_TRUE(wait_until([&] { return srv_.held_watches() == 1; }));
  std::byte msg[sizeof(proto::WatchMsg)];
  ASSERT_TRUE(proto::encode_watch(msg, proto::Watch{0}).ok());
  IoSeg seg{m->data(), static_cast<uint32_t>(proto::watch_buffer_bytes(4)), m};
  EXPECT_EQ(sync([&](IoDone done) {
              ibtrs::IoRequest r;
              r.dir = ibtrs::IoDir::read;
              r.usr = msg;
              r.data = std::span(&seg, 1);
              r.done = done.fn;
              r.ctx = done.ctx;
              return s->transport().request(r);
            }),
            EBUSY);
  EXPECT_EQ(srv_.watches_busy_.load(), 1u);
  srv_.resize("vol0", 20 << 20);
  EXPECT_TRUE(wait_until([&] { return d->size_bytes() == (20u << 20); }, 2s));
}

// Case: a server that speaks version 3 (no WATCH); the volume is resized. Expect: the session
// never sends a WATCH, every permit is IO's, and the device keeps its size until it is
// re-opened (remap), which gives the new one.
TEST_F(Client, AServerBelowVersionFourGetsNoWatch) {
  auto [s, d] = open_at_version(3);
  ASSERT_TRUE(s && d);
  EXPECT_FALSE(s->size_watch().supported);
  srv_.resize("vol0", 20 << 20);
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(srv_.watches_.load(), 0u);
  EXPECT_FALSE(s->size_watch().armed);
  EXPECT_EQ(s->transport().free_permits(), s->transport().queue_depth());
  EXPECT_EQ(d->size_bytes(), kVolSize);
  ASSERT_TRUE(s->remap("vol0").ok());
  EXPECT_EQ(d->size_bytes(), 20u << 20);
}

// Case: BLOCK_STATUS of a 16 MiB volume with 64 KiB written at 1 MiB and 4 KiB at 9 MiB, over
// the whole device and from inside the data, on an rw and an ro mapping. Expect: hole, data,
// hole, data, hole with the server's flags; a question inside the data starts with data; the
// request went to the server once each, as one IO of op block_status over the range.
TEST_F(Client, BlockStatusReportsTheServersHoles) {
  start_server(1);
  BlockSession* s = open(options());
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->proto_version(), proto::kBlockStatusVersion);
  auto d = map(*s, "vol0");
  ASSERT_NE(d, nullptr);
  std::vector<std::byte> x(65536, std::byte{7});
  ASSERT_EQ(sync([&](IoDone done) { return d->write_copy(1 << 20, x, 0, done); }), 0);
  ASSERT_EQ(sync([&](IoDone done) { return d->write_copy(9 << 20, std::span(x).first(4096), 0, done); }), 0);
  const size_t before = ios_of("vol0").size();
  ExtentList l;
  ASSERT_EQ(sync([&](IoDone done) { return d->block_status(0, kVolSize, l, done); }), 0);
  constexpr uint32_t hz = kExtentHole | kExtentZero;
  ASSERT_EQ(l.count, 5u);
  EXPECT_EQ(l.e[0], (Extent{1 << 20, hz}));
  EXPECT_EQ(l.e[1], (Extent{65536, 0}));
  EXPECT_EQ(l.e[2], (Extent{(8 << 20) - 65536, hz}));
  EXPECT_EQ(l.e[3], (Extent{4096, 0}));
  EXPECT_EQ(l.e[4], (Extent{kVolSize - (9 << 20) - 4096, hz}));
  ASSERT_EQ(sync([&](IoDone done) { return d->block_status((1 << 20) + 4096, 1 << 20, l, done); }), 0);
  ASSERT_EQ(l.count, 2u);
  EXPECT_EQ(l.e[0], (Extent{61440, 0}));
  auto ios = ios_of("vol0", before);
  ASSERT_EQ(ios.size(), 2u);
  EXPECT_EQ(ios[0].io.op, IoOp::block_status);
  EXPECT_EQ(ios[0].io.bi_size, kVolSize);
  EXPECT_EQ(d->stats().block_status, 2u);
  EXPECT_EQ(d->stats().read_bytes, 0u) << "a question reads no data";
  BlockSession* s2 = open(options(1, "ro"));
  ASSERT_NE(s2, nullptr);
  auto r = map(*s2, "vol0", AccessMode::ro);
  ASSERT_NE(r, nullptr);
  ASSERT_EQ(sync([&](IoDone done) { return r->block_status(0, 2 << 20, l, done); }), 0);
  EXPECT_EQ(l.count, 3u);
  // Refused before anything is sent: past the end, unaligned, empty.
  EXPECT_EQ(sync([&](IoDone done) { return d->block_status(kVolSize - 512, 1024, l, done); }), -EINVAL);
  EXPECT_EQ(sync([&](IoDone done) { return d->block_status(100, 512, l, done); }), -EINVAL);
  EXPECT_EQ(sync([&](IoDone done) { return d->block_status(0, 0, l, done); }), -EINVAL);
}

// Case: a server that speaks version 4 (no BLOCK_STATUS), and a hostile server whose answers
// break the rules (an extent past the range; a count beyond the buffer). Expect: the old one is
// never asked: the library answers one data extent of the whole range; the hostile answers fail
// the request with EPROTO and leave the list empty.
TEST_F(Client, BlockStatusOfOldAndHostileServers) {
  auto [s, d] = open_at_version(4);
  ASSERT_TRUE(s && d);
  const size_t before = ios_of("vol0").size();
  ExtentList l;
  ASSERT_EQ(sync([&](IoDone done) { return d->block_status(4096, 1 << 20, l, done); }), 0);
  ASSERT_EQ(l.count, 1u);
  EXPECT_EQ(l.e[0], (Extent{1 << 20, 0}));
  EXPECT_EQ(ios_of("vol0", before).size(), 0u) << "nothing was sent";
  srv_.answer_version(std::nullopt);
  BlockSession* h = open(options(1, "hostile"));
  ASSERT_NE(h, nullptr);
  auto hd = map(*h, "vol1");
  ASSERT_NE(hd, nullptr);
  proto::BlockStatusRspMsg m{};
  m.hdr.type.set(static_cast<uint16_t>(proto::MsgType::block_status_rsp));
  m.count.set(1);
  proto::ExtentMsg e{};
  e.length.set(8192);
  std::vector<std::byte> raw(sizeof(m) + sizeof(e));
  std::memcpy(raw.data(), &m, sizeof(m));
  std::memcpy(raw.data() + sizeof(m), &e, sizeof(e));
  srv_.answer_status_with(raw);
  EXPECT_EQ(sync([&](IoDone done) { return hd->block_status(0, 4096, l, done); }), EPROTO);
  EXPECT_EQ(l.count, 0u);
  m.count.set(kMaxExtents + 1);
  std::memcpy(raw.data(), &m, sizeof(m));
  srv_.answer_status_with(raw);
  EXPECT_EQ(sync([&](IoDone done) { return hd->block_status(0, 1 << 20, l, done); }), EPROTO);
  EXPECT_EQ(l.count, 0u);
}

// ---------------------------------------------------------------------------------------------
// Failover devices: two fake servers exporting one RAM volume (two gateways of one store), a
// session to each, the device mapped through both (client.h, "Gateway failover").

class Failover : public Client {
 protected:
  void TearDown() override {
    stop_server2();
    Client::TearDown();
  }

  // The buffers and sessions go, then server 2 once its sessions left.
  void stop_server2() {
    bufs_.clear();
    sessions_.clear();
    if (server2_) {
      (void)wait_until([&] { return server2_->sessions().empty(); }, 5s);
      (void)server2_->with_session("", [](ibtrs::ServerSession&) {});
    }
    srv2_.drop_held(ECONNABORTED);
    server2_.reset();
  }

  // Server 1 (srv_, the active's) and server 2 (srv2_, the standby's) over vol0 and vol1.
  void start_both(uint16_t qd = 64) {
    start_server(1, qd);
    srv2_.share_device("vol0", srv_);
    srv2_.share_device("vol1", srv_);
    server2_ = start(srv2_, {listen_addr("c0")}, qd);
    if (server2_) addrs2_ = server2_->addresses();
  }

  std::unique_ptr<ibtrs::Server> start(FakeBlockServer& h, std::vector<ibtrs::Address> listen, uint16_t qd = 64) {
    ibtrs::ServerOptions so;
    so.queue_depth = qd;
    so.chunk_size = kChunk;
    so.max_io_size = 0;
    so.io_threads = 2;
    so.handler = &h;
    so.allow_any_host = true;
    so.heartbeat = ibtrs::HeartbeatConfig{100ms, 5};
    so.listen = std::move(listen);
    auto s = ibtrs::Server::start(so);
    EXPECT_TRUE(s.ok()) << s.error().message();
    return s.ok() ? std::move(*s) : nullptr;
  }

  // A session to server 1 ("sa") or 2 ("sb"). Its reconnect waits 1 s, so that a killed
  // server is gone for good before the session looks for it again.
  BlockSession* session(int server, std::chrono::milliseconds reconnect = 1000ms) {
    BlockSessionOptions o = options(1, server == 1 ? "sa" : "sb");
    o.transport.paths = {ibtrs::PathSpec{std::nullopt, server == 1 ? addrs_[0] : addrs2_[0]}};
    o.transport.io_threads = 1;  // one connection: the order requests are sent is the order they arrive
    o.transport.reconnect = ibtrs::ReconnectConfig{reconnect, reconnect, reconnect, 10ms, -1};
    return open(std::move(o));
  }

  std::shared_ptr<RemoteDevice> map_fo(BlockSession& a, BlockSession& b, const std::string& dev = "vol0",
                                       AccessMode m = AccessMode::rw, std::chrono::milliseconds timeout = 10s) {
    FailoverOptions o;
    o.remap_timeout = timeout;
    o.on_event = [this](const FailoverEvent& e) {
      std::lock_guard l(ev_mu_);
      fo_events_.push_back(e);
    };
    auto d = map_failover(a, b, dev, m, o);
    EXPECT_TRUE(d.ok()) << d.error().message();
    return d.ok() ? *d : nullptr;
  }

  ibtrs::RegisteredMemory* fo_buffer(RemoteDevice& d, size_t size) {
    auto b = d.alloc_buffer(size);
    EXPECT_TRUE(b.ok()) << b.error().message();
    if (!b.ok()) return nullptr;
    bufs_.push_back(std::move(*b));
    return bufs_.back().get();
  }

  // As kill -9 of a server: the paths of its sessions drop at once, what it held is never
  // answered, and nothing listens at its addresses any more.
  void kill(int server) {
    auto& srv = server == 1 ? server_ : server2_;
    FakeBlockServer& h = server == 1 ? srv_ : srv2_;
    for (auto& name : srv->sessions())
      (void)srv->with_session(name, [](ibtrs::ServerSession& s) {
        for (auto& p : s.paths()) (void)s.disconnect_path(p.name);
      });
    (void)wait_until([&] { return srv->sessions().empty(); }, 5s);
    (void)srv->with_session("", [](ibtrs::ServerSession&) {});
    h.hold_io(false);
    h.drop_held(ECONNABORTED);
    srv.reset();
  }
  // Starts server 1 again on its old address.
  void restart1() { server_ = start(srv_, addrs_); }

  size_t count_fo(FailoverEvent::Kind k) {
    std::lock_guard l(ev_mu_);
    return static_cast<size_t>(std::count_if(fo_events_.begin(), fo_events_.end(),
                                             [&](const FailoverEvent& e) { return e.kind == k; }));
  }

  FakeBlockServer srv2_;
  std::unique_ptr<ibtrs::Server> server2_;
  std::vector<ibtrs::Address> addrs2_;
  std::vector<FailoverEvent> fo_events_;
};

// Case: vol0 mapped through sessions sa (server 1) and sb (server 2); every op on the failover
// device, zero copy from its own memory and through bounce buffers.
// Expect: server 1 serves everything, server 2 saw one plain OPEN (no REOPEN: it takes nothing
// over) and no IO; the listing says sa is active, sb ready, no failover.
TEST_F(Failover, ServesEveryOpOnTheActiveWithAnIdleStandby) {
  start_both();
  BlockSession* a = session(1);
  BlockSession* b = session(2);
  ASSERT_TRUE(a && b);
  auto d = map_fo(*a, *b);
  ASSERT_NE(d, nullptr);
  auto* m = fo_buffer(*d, 1 << 20);
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(d->name(), "vol0");
  EXPECT_EQ(d->size_bytes(), kVolSize);
  EXPECT_EQ(d->state(), DeviceState::open);
  EXPECT_EQ(srv2_.opens_.load(), 1u);
  EXPECT_EQ(srv2_.reopens_.load(), 0u) << "the standby's OPEN takes nothing over";
  pattern(m->data(), 300 * 1024, 9);
  EXPECT_EQ(write(*d, 4096, *m, 0, 300 * 1024), 0);
  EXPECT_EQ(read(*d, 4096, *m, 512 * 1024, 300 * 1024), 0);
  EXPECT_EQ(std::memcmp(m->data(), m->data() + 512 * 1024, 300 * 1024), 0);
  EXPECT_EQ(sync([&](IoDone done) { return d->flush(done); }), 0);
  EXPECT_EQ(sync([&](IoDone done) { return d->write_zeroes(0, 4096, true, done); }), 0);
  EXPECT_EQ(sync([&](IoDone done) { return d->discard(8192, 4096, done); }), 0);
  std::vector<std::byte> x(8192, std::byte{0x3c}), y(8192);
  EXPECT_EQ(sync([&](IoDone done) { return d->write_copy(1 << 20, x, kIoFua, done); }), 0);
  EXPECT_EQ(sync([&](IoDone done) { return d->read_copy(1 << 20, y, done); }), 0);
  EXPECT_EQ(x, y);
  EXPECT_EQ(sync([&](IoDone done) { return d->write(1, std::span<const IoSeg>(), 0, done); }), -EINVAL)
      << "refused by the call, as a plain device refuses it";
  // BLOCK_STATUS through the active leg: [0, 4 KiB) was zeroed (a hole of the RAM volume),
  // [4 KiB, 8 KiB) holds the pattern.
  ExtentList l;
  EXPECT_EQ(sync([&](IoDone done) { return d->block_status(0, 1 << 20, l, done); }), 0);
  ASSERT_GE(l.count, 2u);
  EXPECT_EQ(l.e[0], (Extent{4096, kExtentHole | kExtentZero}));
  EXPECT_EQ(l.e[1].flags, 0u);
  EXPECT_EQ(l.covered(), 1u << 20);
  EXPECT_TRUE(ios_of("vol0").size() >= 8u);
  EXPECT_EQ(srv2_.io_count(), 0u) << "the standby served no IO";
  auto fi = d->failover();
  ASSERT_TRUE(fi.has_value());
  EXPECT_EQ(fi->active, "sa");
  EXPECT_EQ(fi->standby, "sb");
  EXPECT_TRUE(fi->standby_ready);
  EXPECT_EQ(fi->failovers, 0u);
  EXPECT_FALSE(map(*a, "vol1")->failover().has_value()) << "a plain device has no failover state";
  EXPECT_EQ(a->unmap("vol0").error(), errc(EBUSY)) << "a leg is unmapped through its failover device";
  EXPECT_EQ(map_failover(*a, *b, "vol0", AccessMode::rw).error(), errc(EEXIST));
  EXPECT_TRUE(unmap_failover(*d).ok());
  EXPECT_EQ(d->state(), DeviceState::closed);
  EXPECT_EQ(write(*d, 0, *m, 0, 4096), -ENODEV);
  EXPECT_TRUE(srv_.holders("vol0").empty());
  EXPECT_TRUE(srv2_.holders("vol0").empty()) << "both sides closed";
}

// Case: server 1 holds 16 writes (its whole queue depth) and 8 more wait in the library for a
// permit; server 1 is killed; 8 more writes and a flush are submitted during the switch.
// Expect: every request completes with 0, once; its bytes are on the volume; server 2 got the
// device with REOPEN (the take-over) and the resent writes in submission order, the flush after
// the writes submitted before it; the device reports sb active, one failover, 24+ resent.
TEST_F(Failover, ActiveKilledWithIoInFlightAndQueuedResumesOnTheStandby) {
  start_both(16);
  BlockSession* a = session(1);
  BlockSession* b = session(2);
  ASSERT_TRUE(a && b);
  auto d = map_fo(*a, *b);
  ASSERT_NE(d, nullptr);
  auto* m = fo_buffer(*d, 4 << 20);
  ASSERT_NE(m, nullptr);
  constexpr int kN = 40;
  constexpr uint32_t kLen = 65536;
  Done w[kN];
  IoSeg seg[kN];
  for (int i = 0; i < kN; ++i) {
    pattern(m->data() + size_t(i) * kLen, kLen, 500 + i);
    seg[i] = IoSeg{m->data() + size_t(i) * kLen, kLen, m};
  }
  // Each session's WATCH holds one of its 16 permits (re-posted after its first answer): 15
  // writes reach server 1, the rest wait in the library.
  ASSERT_TRUE(wait_until([&] { return a->size_watch().armed && b->size_watch().armed; }));
  srv_.hold_io(true);
  for (int i = 0; i < 24; ++i) ASSERT_TRUE(d->write(uint64_t(i) * kLen, std::span(&seg[i], 1), 0, w[i].io()).ok());
  ASSERT_TRUE(wait_until([&] { return srv_.held() == 15; }));
  const size_t ios2 = srv2_.io_count();
  kill(1);
  Done f;
  for (int i = 24; i < kN; ++i) {
    ASSERT_TRUE(d->write(uint64_t(i) * kLen, std::span(&seg[i], 1), 0, w[i].io()).ok());
    if (i == 31) {
      ASSERT_TRUE(d->flush(f.io()).ok());
    }
  }
  for (int i = 0; i < kN; ++i) {
    EXPECT_EQ(w[i].wait(), 0) << i;
  }
  EXPECT_EQ(f.wait(), 0);
  for (int i = 0; i < kN; ++i) {
    EXPECT_EQ(w[i].calls, 1);
    EXPECT_TRUE(same("vol0", uint64_t(i) * kLen, m->data() + size_t(i) * kLen, kLen)) << i;
  }
  EXPECT_EQ(srv2_.reopens_.load(), 1u) << "the standby's server took the device over";
  // Server 2 saw the writes in the order they were submitted, the flush after the first 32.
  std::vector<uint64_t> got;
  size_t flush_at = SIZE_MAX;
  auto all = srv2_.ios();
  for (size_t i = ios2; i < all.size(); ++i) {
    if (all[i].io.op == IoOp::flush) flush_at = got.size();
    if (all[i].io.op == IoOp::write) got.push_back(all[i].io.sector * kSectorSize / kLen);
  }
  ASSERT_EQ(got.size(), size_t{kN});
  for (int i = 0; i < kN; ++i) EXPECT_EQ(got[i], uint64_t(i)) << "resent in submission order";
  EXPECT_EQ(flush_at, 32u) << "the flush after the writes submitted before it";
  auto fi = d->failover();
  ASSERT_TRUE(fi.has_value());
  EXPECT_EQ(fi->active, "sb");
  EXPECT_EQ(fi->standby, "sa");
  EXPECT_FALSE(fi->standby_ready) << "server 1 is dead";
  EXPECT_EQ(fi->failovers, 1u);
  EXPECT_GE(fi->resent, 24u);
  EXPECT_LT(fi->last_pause, 2s);
  EXPECT_EQ(count_fo(FailoverEvent::Kind::failed_over), 1u);
  EXPECT_EQ(d->stats().errors, 0u);
  EXPECT_EQ(d->stats().inflight, 0u);
  EXPECT_EQ(d->state(), DeviceState::open);
  pattern(m->data(), 4096, 1);
  EXPECT_EQ(write(*d, 0, *m, 0, 4096), 0);
  EXPECT_TRUE(same("vol0", 0, m->data(), 4096));
}

// Case: a write completes on server 1 (whose cache is volatile: kCacheWriteBack) with no flush
// after it; server 1 is killed. Then: a flush, another flush.
// Expect: the first flush after the failover fails with EIO (a flush promises stable what the
// dead server's cache may have lost), the second succeeds. With a flush completed after the
// write (or FUA writes only) the failover loses nothing: no flush fails.
TEST_F(Failover, AFlushAfterALossyFailoverFailsOnce) {
  start_both();
  BlockSession* a = session(1);
  BlockSession* b = session(2);
  ASSERT_TRUE(a && b);
  auto d = map_fo(*a, *b);
  auto d1 = map_fo(*a, *b, "vol1");
  ASSERT_TRUE(d && d1);
  auto* m = fo_buffer(*d, 65536);
  auto* m1 = fo_buffer(*d1, 65536);
  ASSERT_TRUE(m && m1);
  EXPECT_EQ(write(*d, 0, *m, 0, 4096), 0);                 // vol0: a write nobody flushed
  EXPECT_EQ(write(*d1, 0, *m1, 0, 4096), 0);               // vol1: flushed, then FUA only
  EXPECT_EQ(sync([&](IoDone done) { return d1->flush(done); }), 0);
  EXPECT_EQ(write(*d1, 4096, *m1, 0, 4096, kIoFua), 0);
  kill(1);
  ASSERT_TRUE(wait_until([&] { return d->failover()->failovers == 1 && d1->failover()->failovers == 1; }));
  EXPECT_EQ(sync([&](IoDone done) { return d->flush(done); }), EIO);
  EXPECT_EQ(sync([&](IoDone done) { return d->flush(done); }), 0) << "reported once";
  EXPECT_EQ(d->failover()->lost_flushes, 1u);
  EXPECT_EQ(count_fo(FailoverEvent::Kind::cache_lost), 1u);
  EXPECT_EQ(sync([&](IoDone done) { return d1->flush(done); }), 0) << "nothing unflushed on vol1";
  EXPECT_EQ(d1->failover()->lost_flushes, 0u);
}

// Case: after a failover to server 2, server 1 starts again on its address; later the admin
// switches back.
// Expect: session sa reconnects and re-opens vol0 without REOPEN (server 1 takes nothing over
// from server 2); the device stays on sb (no failback of its own) and says sa is a ready
// standby; switch_failover moves it back with REOPEN on server 1, IO lands there.
TEST_F(Failover, TheOldActiveComesBackAsStandby) {
  start_both();
  BlockSession* a = session(1, 100ms);
  BlockSession* b = session(2);
  ASSERT_TRUE(a && b);
  auto d = map_fo(*a, *b);
  ASSERT_NE(d, nullptr);
  auto* m = fo_buffer(*d, 65536);
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(write(*d, 0, *m, 0, 4096), 0);
  kill(1);
  EXPECT_EQ(write(*d, 0, *m, 0, 4096), 0);
  ASSERT_EQ(d->failover()->active, "sb");
  const uint64_t reopens1 = srv_.reopens_.load();
  restart1();
  ASSERT_NE(server_, nullptr);
  ASSERT_TRUE(wait_until([&] { return d->failover()->standby_ready; }));
  EXPECT_EQ(srv_.reopens_.load(), reopens1) << "the standby's re-open takes nothing over";
  EXPECT_EQ(srv_.holders("vol0").size(), 1u);
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(d->failover()->active, "sb") << "no failback of its own";
  ASSERT_TRUE(wait_until([&] { return count_fo(FailoverEvent::Kind::standby_back) >= 1; }, 3s));
  const size_t ios1 = srv_.io_count();
  ASSERT_TRUE(switch_failover(*d).ok());
  EXPECT_EQ(d->failover()->active, "sa");
  EXPECT_EQ(d->failover()->failovers, 2u);
  EXPECT_EQ(srv_.reopens_.load(), reopens1 + 1) << "the switch takes the device over";
  pattern(m->data(), 4096, 44);
  EXPECT_EQ(write(*d, 8192, *m, 0, 4096), 0);
  EXPECT_TRUE(same("vol0", 8192, m->data(), 4096));
  EXPECT_GT(srv_.io_count(), ios1) << "server 1 serves again";
}

// Case: both servers die with a write out; remap_timeout 500 ms.
// Expect: the write fails with ENOTCONN between 0.5 and 3 s later (never hangs); new IO is
// accepted and fails the same way.
TEST_F(Failover, BothServersDownFailsIoAfterRemapTimeout) {
  start_both();
  BlockSession* a = session(1);
  BlockSession* b = session(2);
  ASSERT_TRUE(a && b);
  auto d = map_fo(*a, *b, "vol0", AccessMode::rw, 500ms);
  ASSERT_NE(d, nullptr);
  auto* m = fo_buffer(*d, 65536);
  ASSERT_NE(m, nullptr);
  srv_.hold_io(true);
  Done w;
  IoSeg seg{m->data(), 4096, m};
  ASSERT_TRUE(d->write(0, std::span(&seg, 1), 0, w.io()).ok());
  ASSERT_TRUE(wait_until([&] { return srv_.held() == 1; }));
  const auto t0 = std::chrono::steady_clock::now();
  kill(2);
  kill(1);
  EXPECT_EQ(w.wait(10s), ENOTCONN);
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(took, 400ms);
  EXPECT_LT(took, 3s);
  EXPECT_EQ(write(*d, 0, *m, 0, 4096), ENOTCONN);
  EXPECT_EQ(w.calls, 1);
}

// Case: server 2 refuses the standby's OPEN (EACCES). Expect: the map succeeds, the device
// works on server 1 and says its standby is missing and why; server 1 killed, IO fails after
// remap_timeout (ETIMEDOUT: server 2's session is up, it refuses). Once server 2 allows it,
// remap_failover brings the standby back and a failover works.
TEST_F(Failover, ARefusingStandbyLeavesTheDeviceOnTheActive) {
  start_both();
  BlockSession* a = session(1, 100ms);
  BlockSession* b = session(2);
  ASSERT_TRUE(a && b);
  srv2_.refuse_open(EACCES);
  auto d = map_fo(*a, *b, "vol0", AccessMode::rw, 500ms);
  ASSERT_NE(d, nullptr);
  auto* m = fo_buffer(*d, 65536);
  ASSERT_NE(m, nullptr);
  auto fi = d->failover();
  EXPECT_FALSE(fi->standby_ready);
  EXPECT_EQ(fi->standby_error, errc(EACCES));
  pattern(m->data(), 4096, 3);
  EXPECT_EQ(write(*d, 0, *m, 0, 4096), 0);
  EXPECT_TRUE(same("vol0", 0, m->data(), 4096));
  EXPECT_EQ(remap_failover(*d).error(), errc(EACCES)) << "still refused";
  srv2_.refuse_open(0);
  ASSERT_TRUE(remap_failover(*d).ok());
  EXPECT_TRUE(d->failover()->standby_ready);
  EXPECT_EQ(srv2_.reopens_.load(), 0u);
  kill(1);
  pattern(m->data(), 4096, 4);
  EXPECT_EQ(write(*d, 4096, *m, 0, 4096), 0);
  EXPECT_TRUE(same("vol0", 4096, m->data(), 4096));
  EXPECT_EQ(d->failover()->active, "sb");
}

// Case: as above, but server 2 keeps refusing; server 1 is killed with a write waiting.
// Expect: the write fails with ETIMEDOUT after remap_timeout; nothing hangs.
TEST_F(Failover, NoServerToFailOverToFailsAfterRemapTimeout) {
  start_both();
  BlockSession* a = session(1);
  BlockSession* b = session(2);
  ASSERT_TRUE(a && b);
  srv2_.refuse_open(EACCES);
  auto d = map_fo(*a, *b, "vol0", AccessMode::rw, 500ms);
  ASSERT_NE(d, nullptr);
  auto* m = fo_buffer(*d, 65536);
  ASSERT_NE(m, nullptr);
  kill(1);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(write(*d, 0, *m, 0, 4096), ETIMEDOUT);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  EXPECT_EQ(d->failover()->failovers, 0u);
}

// Case: memory registered through session sa alone, used for a write on a device of session sb.
// Expect: EINVAL (before: the transport would use sa's memory keys on sb's paths); memory from
// the failover device's alloc_buffer works on either session.
TEST_F(Failover, MemoryOfAnotherSessionIsRefused) {
  start_both();
  BlockSession* a = session(1);
  BlockSession* b = session(2);
  ASSERT_TRUE(a && b);
  auto db = map(*b, "vol1");
  ASSERT_NE(db, nullptr);
  auto* ma = buffer(*a, 65536);
  EXPECT_EQ(write(*db, 0, *ma, 0, 4096), EINVAL);
  auto shared = a->alloc_buffer(65536);
  ASSERT_TRUE(shared.ok());
  EXPECT_TRUE(b->transport().share_memory(**shared).ok());
  EXPECT_EQ(b->transport().share_memory(**shared).error(), errc(EEXIST));
  EXPECT_EQ(a->transport().share_memory(**shared).error(), errc(EINVAL)) << "its own";
  pattern((*shared)->data(), 4096, 8);
  EXPECT_EQ(write(*db, 0, **shared, 0, 4096), 0);
  EXPECT_TRUE(same("vol1", 0, (*shared)->data(), 4096));
  shared->reset();
}

// Case: a failover device over two servers sharing vol0; the volume grows and both servers tell
// their sessions. Expect: the failover device (its active leg) has the new size within 2 s, and
// IO past the old end works on it.
TEST_F(Failover, AResizeReachesTheFailoverDevice) {
  start_both();
  BlockSession* a = session(1);
  BlockSession* b = session(2);
  ASSERT_TRUE(a && b);
  auto d = map_fo(*a, *b);
  ASSERT_NE(d, nullptr);
  auto* m = fo_buffer(*d, 65536);
  ASSERT_NE(m, nullptr);
  srv_.resize("vol0", 24 << 20);
  srv2_.notify_resized("vol0");
  ASSERT_TRUE(wait_until([&] { return d->size_bytes() == (24u << 20); }, 2s)) << d->size_bytes();
  EXPECT_EQ(d->stats().resizes, 1u);
  pattern(m->data(), 4096, 5);
  EXPECT_EQ(write(*d, 20 << 20, *m, 0, 4096), 0);
  EXPECT_TRUE(same("vol0", 20 << 20, m->data(), 4096));
}

// Case: two threads keep 12 writes each in flight on the failover device, each resubmitting
// as one completes, while server 1 (the active's) is killed; the sessions' pending_timeout is
// 4 s. Four rounds (fresh servers each; in odd ones server 1 holds what it got at the kill).
// Expect: every write completes once with 0 well before pending_timeout: a request submitted
// while the switch runs (after the old active's requests were taken back) is taken back too,
// not left on the dead session to fail with ENOTCONN at its pending_timeout.
TEST_F(Failover, SubmittersRacingTheSwitchLoseNothing) {
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    start_both(32);
    auto mk = [&](int server) {
      BlockSessionOptions o = options(1, server == 1 ? "sa" : "sb");
      o.transport.paths = {ibtrs::PathSpec{std::nullopt, server == 1 ? addrs_[0] : addrs2_[0]}};
      o.transport.io_threads = 2;
      o.transport.reconnect = ibtrs::ReconnectConfig{1000ms, 1000ms, 1000ms, 10ms, -1};
      o.transport.pending_timeout = 4000ms;
      return open(std::move(o));
    };
    BlockSession* a = mk(1);
    BlockSession* b = mk(2);
    ASSERT_TRUE(a && b);
    auto d = map_fo(*a, *b);
    ASSERT_NE(d, nullptr);
    auto* m = fo_buffer(*d, 1 << 20);
    ASSERT_NE(m, nullptr);
    std::atomic<bool> go{true};
    std::atomic<int> errors{0}, last_err{0};
    std::atomic<uint64_t> done_ios{0};
    struct Slot {
      std::atomic<int>* errors;
      std::atomic<int>* last_err;
      std::atomic<uint64_t>* done_ios;
      std::atomic<int> busy{0};
    };
    auto worker = [&](int t) {
      std::vector<std::unique_ptr<Slot>> slots;
      for (int i = 0; i < 12; ++i) {
        auto slot = std::make_unique<Slot>();
        slot->errors = &errors;
        slot->last_err = &last_err;
        slot->done_ios = &done_ios;
        slots.push_back(std::move(slot));
      }
      uint64_t n = 0;
      while (go.load()) {
        bool sent = false;
        for (int i = 0; i < 12; ++i) {
          Slot& s = *slots[i];
          if (s.busy.load()) continue;
          s.busy.store(1);
          IoSeg seg{m->data() + size_t(t * 12 + i) * 4096, 4096, m};
          auto cb = [](void* ctx, int err) {
            auto* x = static_cast<Slot*>(ctx);
            if (err != 0) {
              x->errors->fetch_add(1);
              x->last_err->store(err);
            }
            x->done_ios->fetch_add(1);
            x->busy.store(0);
          };
          auto st = d->write(((n++ % 64) * 24 + uint64_t(t * 12 + i)) * 4096, std::span(&seg, 1), 0, IoDone{cb, &s});
          if (!st.ok()) {
            errors.fetch_add(1);
            last_err.store(-st.error().value());
            s.busy.store(0);
          }
          sent = true;
        }
        if (!sent) std::this_thread::sleep_for(50us);
      }
      for (auto& s : slots)
        if (!wait_until([&] { return s->busy.load() == 0; }, 10s)) last_err.store(-ETIMEDOUT);
    };
    std::thread t1(worker, 0), t2(worker, 1);
    std::this_thread::sleep_for(200ms);
    if (round % 2 == 1) {  // odd rounds: server 1 holds what it got at the kill, as librbd would
      srv_.hold_io(true);
      std::this_thread::sleep_for(20ms);
    }
    kill(1);
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE(wait_until([&] { return d->failover()->failovers == 1; }, 5s));
    std::this_thread::sleep_for(300ms);
    go.store(false);
    t1.join();
    t2.join();
    const auto took = std::chrono::steady_clock::now() - t0;
    EXPECT_EQ(errors.load(), 0) << "last error " << last_err.load() << " after "
                                << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms";
    EXPECT_LT(took, 3s) << "a request waited on the dead session";
    EXPECT_GT(done_ios.load(), 100u);
    EXPECT_TRUE(unmap_failover(*d).ok());
    d.reset();
    stop_server2();
    if (server_) {
      (void)wait_until([&] { return server_->sessions().empty(); }, 5s);
      server_.reset();
    }
  }
}

}  // namespace
}  // namespace ibnbd::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--fabric=tcp") {
      ibnbd::test::g_kind = ibtrs::FabricKind::tcp;
    } else if (a != "--fabric=loopback") {
      fprintf(stderr, "usage: %s [gtest flags] [--fabric=loopback|tcp]\n", argv[0]);
      return 2;
    }
  }
  return RUN_ALL_TESTS();
}
