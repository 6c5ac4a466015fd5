// Bounded resources (docs/security.d/bounds.md): a real server against raw peers built on the
// fabric layer with crafted protocol messages — half-open paths, floods of new sessions, peers
// past the caps, a peer that never acknowledges. Each scenario checks that the server refuses or
// cuts off the peer with a counted reason, that an honest client still connects and completes
// IO within a deadline, and that the server's memory and file descriptors return to a bound.
//
//   session_bounds --fabric=tcp|loopback   (the never-acknowledging peer needs tcp)
#include <gtest/gtest.h>

#include <dirent.h>

#include <array>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <thread>

#include "raw_peer.h"
#include "session_harness.h"

namespace ibtrs::test {
namespace {

using namespace std::chrono_literals;
using namespace ibtrs::proto;

FabricKind g_kind = FabricKind::loopback;

size_t open_fds() {
  size_t n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d) != nullptr) ++n;
    ::closedir(d);
  }
  return n;
}

// Sanitizer runtimes keep freed memory in quarantine or shadow it: RSS then says nothing about
// what the server gave back, and the RSS bounds are not checked.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kRssMeaningful = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kRssMeaningful = false;
#else
constexpr bool kRssMeaningful = true;
#endif
#else
constexpr bool kRssMeaningful = true;
#endif

size_t rss_kib() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoul(line.substr(6));
  return 0;
}

class Bounds : public ::testing::Test {
 protected:
  void start(ServerOptions so) {
    so.listen.push_back(g_kind == FabricKind::tcp ? *Address::parse("tcp:127.0.0.1:0")
                                                  : *Address::parse("loopback:bounds:0"));
    so.io_threads = 1;
    so.handler = &vol_;
    so.allow_any_host = true;  // the raw peers do not authenticate (tests/session/auth_test.cc does)
    // Long heartbeats: the raw peers never answer them, and no scenario is about them.
    so.heartbeat.interval = 60s;
    auto s = Server::start(so);
    ASSERT_TRUE(s.ok()) << s.error().message();
    server_ = std::move(*s);
    addr_ = server_->addresses()[0];
  }

  // A client session of one path to the server, one IO connection.
  Result<std::unique_ptr<ClientSession>> open_client(const std::string& name,
                                                     std::chrono::milliseconds timeout = 10s) {
    ClientOptions co;
    co.session_name = name;
    co.paths.push_back(PathSpec{std::nullopt, addr_});
    co.io_threads = 1;
    co.connect_timeout = timeout;
    return ClientSession::open(co);
  }

  // An honest client of its own session connects and writes + reads back 64 KiB within
  // `deadline` in all. Returns the error of the step that failed (0: all went well).
  int honest_client(const std::string& name, std::chrono::milliseconds deadline = 10s) {
    const auto end = std::chrono::steady_clock::now() + deadline;
    auto c = open_client(name, deadline);
    if (!c.ok()) return c.error().value();
    auto b = (*c)->alloc_buffer(64 * 1024);
    if (!b.ok()) return b.error().value();
    std::memset((*b)->data(), name.size(), 32 * 1024);
    int e = sync_io(**c, IoDir::write, **b, (*b)->data(), 32 * 1024, 0);
    if (e == 0) e = sync_io(**c, IoDir::read, **b, (*b)->data() + 32 * 1024, 32 * 1024, 0);
    if (e == 0 && std::memcmp((*b)->data(), (*b)->data() + 32 * 1024, 32 * 1024) != 0) e = EIO;
    if (e == 0 && std::chrono::steady_clock::now() > end) e = ETIMEDOUT;
    b->reset();
    return e;
  }

  uint64_t refused(std::string_view reason) const { return server_->refusals().count(reason); }

  RamVolume vol_{1 << 20};
  std::unique_ptr<Server> server_;
  Address addr_;
};

// Case: 40 peers each open the first connection of a new session and never finish the
// handshake; the handshake deadline is 500 ms. Expect: while they are pending an honest client
// connects and does IO; each half-open path is closed by the server at its deadline and counted;
// every half-open session is freed; after the peers go, the process holds the file descriptors
// and about the memory it held before.
TEST_F(Bounds, HalfOpenPathsAreClosedAtTheirDeadlineAndTheirSessionsFreed) {
  ServerOptions so;
  so.handshake_timeout = 500ms;
  start(so);
  ASSERT_EQ(honest_client("warm-up"), 0);  // the client side's threads and buffers exist now
  const size_t fds0 = open_fds(), rss0 = rss_kib();
  {
    RawPeer peer(addr_);
    std::vector<RawCon> half;
    for (int i = 0; i < 40; ++i) {
      auto c = peer.half_open();
      ASSERT_TRUE(c.ok()) << c.error().message();
      half.push_back(std::move(*c));
    }
    const ServerUsage during = server_->usage();
    RecordProperty("fds_during", static_cast<int>(open_fds() - fds0));
    RecordProperty("rss_during_kib", static_cast<int>(rss_kib() - rss0));
    EXPECT_GE(during.sessions, 30u) << "the deadline is not past for most of them yet";
    EXPECT_EQ(during.handshaking_sessions, during.sessions);
    EXPECT_EQ(honest_client("honest"), 0) << "an honest client is not held up by half-open ones";
    EXPECT_TRUE(RawPeer::closed_by_server(half, 3s)) << "every half-open path closed at its deadline";
    EXPECT_EQ(refused(refusal::kHandshakeTimeout), 40u);
    EXPECT_TRUE(wait_until([&] { return server_->usage().sessions == 0; }, 3s))
        << server_->usage().sessions << " sessions left";
    EXPECT_EQ(server_->usage().chunk_memory, 0u);
  }
  EXPECT_TRUE(wait_until([&] { return open_fds() <= fds0 + 2; }, 3s)) << open_fds() << " fds, " << fds0 << " before";
  RecordProperty("rss_after_kib", static_cast<int>(rss_kib() - rss0));
  EXPECT_TRUE(!kRssMeaningful || rss_kib() <= rss0 + 16 * 1024) << "RSS " << rss_kib() << " KiB, " << rss0 << " before";
}

// Case: a peer floods 150 half-open sessions at a server capped at 8 sessions, while an honest
// session is connected. Expect: the server never holds more than 8 sessions; the flood only
// pushes out its own oldest half-open sessions (counted); the connected session is untouched
// and keeps working; a new honest client gets in (evicting one) and does IO.
TEST_F(Bounds, AFloodOfNewSessionsEvictsOnlyHalfOpenOnes) {
  ServerOptions so;
  so.max_sessions = 8;
  start(so);
  auto resident = open_client("resident");
  ASSERT_TRUE(resident.ok());
  auto b = (*resident)->alloc_buffer(4096);
  ASSERT_TRUE(b.ok());
  RawPeer peer(addr_);
  std::vector<RawCon> flood;
  uint32_t peak = 0;
  for (int i = 0; i < 150; ++i) {
    auto c = peer.half_open();
    ASSERT_TRUE(c.ok()) << "a new session evicts a half-open one instead of being refused";
    flood.push_back(std::move(*c));
    peak = std::max(peak, server_->usage().sessions);
  }
  EXPECT_LE(peak, 8u);
  EXPECT_GE(refused(refusal::kHandshakeEvicted), 150u - 7u);
  EXPECT_EQ(refused(refusal::kSessionLimit), 0u);
  EXPECT_EQ(sync_io(**resident, IoDir::write, **b, (*b)->data(), 4096, 0), 0) << "the connected session lives";
  EXPECT_EQ(honest_client("newcomer"), 0);
  EXPECT_LE(server_->usage().sessions, 8u);
  b->reset();
}

// Case: every session slot is held by a connected session. Expect: a new session is refused
// with EUSERS (what the client's connect returns) and counted; the others keep working.
TEST_F(Bounds, ConnectedSessionsAtTheCapRefuseANewOneWithEusers) {
  ServerOptions so;
  so.max_sessions = 2;
  start(so);
  std::vector<std::unique_ptr<ClientSession>> held;
  for (const char* name : {"one", "two"}) {
    auto c = open_client(name);
    ASSERT_TRUE(c.ok());
    held.push_back(std::move(*c));
  }
  EXPECT_EQ(honest_client("three"), EUSERS);
  EXPECT_GE(refused(refusal::kSessionLimit), 1u);
  auto b = held[0]->alloc_buffer(4096);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(sync_io(*held[0], IoDir::write, **b, (*b)->data(), 4096, 0), 0);
  b->reset();
  held.pop_back();
  EXPECT_TRUE(wait_until([&] { return honest_client("three") == 0; }, 10s)) << "a freed slot is usable";
}

// Case: the chunk memory cap holds two sessions' chunks. Expect: with two connected sessions a
// third is refused with ENOMEM (counted), and usage() shows the memory held.
TEST_F(Bounds, ChunkMemoryCapRefusesWithEnomem) {
  ServerOptions so;
  so.queue_depth = 32;
  so.max_chunk_memory = uint64_t{2} * 32 * so.chunk_size;
  start(so);
  RawPeer peer(addr_);
  std::vector<RawCon> a, b;
  ASSERT_FALSE(peer.establish(a, "a", 32).empty());
  ASSERT_FALSE(peer.establish(b, "b", 32).empty());
  EXPECT_EQ(server_->usage().chunk_memory, so.max_chunk_memory);
  EXPECT_EQ(honest_client("c"), ENOMEM);
  EXPECT_EQ(refused(refusal::kChunkMemoryLimit), 1u);
}

// Case: a session's client opens paths past max_paths_per_session. Expect: the first two are
// accepted, the third refused with EMLINK and counted.
TEST_F(Bounds, PathsPastTheCapAreRefusedWithEmlink) {
  ServerOptions so;
  so.max_paths_per_session = 2;
  start(so);
  RawPeer peer(addr_);
  const Uuid sess = to_uuid(Uuid16::random());
  std::vector<RawCon> paths;
  for (int i = 0; i < 2; ++i) {
    auto c = peer.connect(make_con_req(0, 2, 0, i == 0, sess, to_uuid(Uuid16::random())));
    ASSERT_TRUE(c.ok());
    paths.push_back(std::move(*c));
  }
  int err = 0;
  EXPECT_EQ(peer.connect(make_con_req(0, 2, 0, false, sess, to_uuid(Uuid16::random())), &err).error(),
            errc(ECONNREFUSED));
  EXPECT_EQ(err, EMLINK);
  EXPECT_EQ(refused(refusal::kPathLimit), 1u);
  EXPECT_EQ(server_->usage().paths, 2u);
}

// Case: a connected peer sends an IO request naming a chunk past the queue depth. Expect: its
// path is closed, the violation counted once under protocol_error, the server serves others.
TEST_F(Bounds, AProtocolViolationIsCountedAsARefusal) {
  ServerOptions so;
  so.queue_depth = 48;  // chunk ids 48..63 fit the immediate's field but are out of range
  start(so);
  RawPeer peer(addr_);
  std::vector<RawCon> cons;
  auto chunks = peer.establish(cons, "violator", 48);
  ASSERT_EQ(chunks.size(), 48u);
  auto layout = imm_layout(48, so.chunk_size);
  ASSERT_TRUE(peer.send_request(cons[1], chunks[0], 50, *layout).ok());
  EXPECT_TRUE(RawPeer::closed_by_server(cons, 3s));
  EXPECT_EQ(refused(refusal::kProtocolError), 1u);
  EXPECT_EQ(honest_client("honest"), 0);
}

class NeverAcknowledging : public Bounds {
 protected:
  void SetUp() override {
    if (g_kind != FabricKind::tcp)
      GTEST_SKIP() << "a loopback send completes when posted: only tcp lets a peer withhold acks";
  }
  static constexpr uint16_t kQd = 32;

  void start_server(std::chrono::milliseconds ack_timeout) {
    ServerOptions so;
    so.queue_depth = kQd;
    so.ack_timeout = ack_timeout;
    start(so);
    layout_ = *imm_layout(kQd, so.chunk_size);
  }
  // A raw peer's path, whose IO connection can post `send_depth` requests without polling.
  void connect_peer(const std::string& name, uint32_t send_depth) {
    peer_.emplace(addr_);
    chunks_ = peer_->establish(cons_, name, kQd, send_depth);
    ASSERT_EQ(chunks_.size(), kQd);
  }
  // The peer's request number `i`, into chunk i % queue depth.
  Status send(uint32_t i) { return peer_->send_request(cons_[1], chunks_[i % kQd], i % kQd, layout_); }

  std::optional<RawPeer> peer_;
  std::vector<RawCon> cons_;
  std::vector<ChunkDesc> chunks_;
  ImmLayout layout_;
  // What the server can hold for one connection of a peer that sends into every receive it
  // posted and acknowledges nothing, with an upper layer that answers at once: fewer than
  // queue_depth waiting when it last reposted receives, plus the receives it had posted
  // (queue_depth + 32 on an IO connection).
  static constexpr uint64_t kMaxBacklog = kQd + (kQd + 32);
};

// Case: a peer establishes a path, then sends requests one at a time on its IO connection
// without ever polling its CQ (so it acknowledges nothing); ack_timeout is 1 s. Expect: the
// server stops taking requests (the peer's last ones are never served) with the waiting
// responses bounded; the peer is cut off after ack_timeout, counted; the waiting responses are
// freed; an honest client works meanwhile.
TEST_F(NeverAcknowledging, APeerThatStopsAcknowledgingStopsBeingServedAndIsCutOff) {
  start_server(1s);
  connect_peer("mute", 4096);
  // Lockstep: each request is served before the next goes, until one is not taken.
  uint32_t sent = 0;
  std::optional<std::chrono::steady_clock::time_point> backlog_seen;
  for (; sent < 1000; ++sent) {
    const uint64_t before = vol_.requests_.load();
    ASSERT_TRUE(send(sent).ok());
    if (!wait_until([&] { return vol_.requests_.load() > before; }, 300ms)) break;
    if (!backlog_seen && server_->usage().backlog > 0) backlog_seen = std::chrono::steady_clock::now();
  }
  ASSERT_TRUE(backlog_seen.has_value());
  const ServerUsage u = server_->usage();
  EXPECT_LT(sent, 1000u) << "the server kept taking requests it could not answer";
  EXPECT_GE(u.backlog, kQd) << "it stops only past the peer's credit";
  EXPECT_LE(u.backlog, kMaxBacklog);
  EXPECT_EQ(honest_client("honest"), 0);
  // The server's side is what is checked: the peer, stalled on its own receives, may never
  // read the disconnect.
  EXPECT_TRUE(wait_until([&] { return refused(refusal::kAckTimeout) == 1; }, 5s)) << "cut off";
  EXPECT_GE(std::chrono::steady_clock::now() - *backlog_seen, 900ms)
      << "not before ack_timeout from the first response that had to wait";
  EXPECT_TRUE(wait_until([&] { return server_->usage().backlog == 0 && server_->usage().sessions == 0; }, 2s))
      << "its path closed, its session and waiting responses freed";
}

// Case: a peer floods 3000 requests without waiting for any response and without acknowledging
// any. Expect: the server never holds more waiting responses than the peer's receive credit
// allows, cuts the peer off after ack_timeout, frees them, keeps the process's RSS within a
// bound, and serves an honest client meanwhile.
TEST_F(NeverAcknowledging, AFloodWithoutAcknowledgementsStaysBounded) {
  start_server(1s);
  ASSERT_EQ(honest_client("warm-up"), 0);
  const size_t rss0 = rss_kib();
  connect_peer("flood", 4096);
  uint64_t peak = 0;
  for (uint32_t i = 0; i < 3000; ++i) {
    ASSERT_TRUE(send(i).ok());
    if (i % 64 == 0) peak = std::max(peak, server_->usage().backlog);
  }
  for (int i = 0; i < 20; ++i) {
    peak = std::max(peak, server_->usage().backlog);
    std::this_thread::sleep_for(10ms);
  }
  RecordProperty("peak_backlog", static_cast<int>(peak));
  RecordProperty("requests_taken", static_cast<int>(vol_.requests_.load()));
  RecordProperty("rss_growth_kib", static_cast<int>(rss_kib() - rss0));
  EXPECT_LE(peak, kMaxBacklog);
  EXPECT_LT(vol_.requests_.load(), 3000u);
  EXPECT_EQ(honest_client("honest"), 0);
  EXPECT_TRUE(wait_until([&] { return refused(refusal::kAckTimeout) == 1; }, 5s)) << "cut off";
  EXPECT_TRUE(wait_until([&] { return server_->usage().backlog == 0 && server_->usage().sessions == 0; }, 2s));
  EXPECT_TRUE(!kRssMeaningful || rss_kib() <= rss0 + 32 * 1024) << "RSS " << rss_kib() << " KiB, " << rss0 << " before";
}

// Case: a peer within its credit (queue_depth reads of 15 pieces: 16 work requests per
// response, far more than the send queue holds) acknowledges nothing for 500 ms, then polls
// again. Expect: every response arrives with the right bytes, nobody is cut off.
TEST_F(NeverAcknowledging, APeerSlowToAcknowledgeWithinItsCreditGetsEveryResponse) {
  start_server(5s);
  for (size_t i = 0; i < vol_.mem().size(); ++i) vol_.mem()[i] = static_cast<std::byte>(i * 7 + (i >> 9));
  connect_peer("slow", 256);
  constexpr uint32_t kDescs = 15, kPiece = 16;  // 240 bytes per read, into the peer's buffer
  for (uint32_t r = 0; r < kQd; ++r) {
    auto st = peer_->send_read(cons_[1], chunks_[r], r, layout_, uint64_t{r} * kDescs * kPiece, kDescs, kPiece);
    ASSERT_TRUE(st.ok()) << st.error().message();
  }
  ASSERT_TRUE(wait_until([&] { return vol_.requests_.load() == kQd; }, 5s));
  EXPECT_GT(server_->usage().backlog, 0u) << "the responses did not fit the send queue";
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ(peer_->collect_responses(cons_[1], kQd, 5s), kQd);
  for (uint32_t r = 0; r < kQd; ++r) {
    const size_t off = size_t{r} * kDescs * kPiece;
    EXPECT_EQ(std::memcmp(peer_->read_area() + off, vol_.mem().data() + off, kDescs * kPiece), 0) << "read " << r;
  }
  EXPECT_EQ(refused(refusal::kAckTimeout), 0u);
  EXPECT_EQ(server_->usage().backlog, 0u);
}

// Case: an honest client keeps queue_depth reads of 15 segments each in flight (16 work requests
// per response, far more than the send queue holds), for several rounds. Expect: every read
// completes with the right bytes (responses wait in the backlog and go out as sends complete),
// and nobody is cut off.
TEST_F(Bounds, AnHonestClientWhoseResponsesOverflowTheSendQueueGetsThemAll) {
  ServerOptions so;
  so.queue_depth = 32;
  so.ack_timeout = 5s;
  start(so);
  for (size_t i = 0; i < vol_.mem().size(); ++i) vol_.mem()[i] = static_cast<std::byte>(i * 7 + (i >> 9));
  auto c = open_client("reader");
  ASSERT_TRUE(c.ok());
  constexpr uint32_t kSegs = ClientSession::kMaxSegments, kSeg = 512, kLen = kSegs * kSeg;
  auto buf = (*c)->alloc_buffer(size_t{32} * kLen);
  ASSERT_TRUE(buf.ok());
  for (int round = 0; round < 20; ++round) {
    std::vector<Waiter> w(32);
    std::vector<std::array<IoSeg, kSegs>> segs(32);
    std::vector<VolHdr> hdr(32);
    for (uint32_t r = 0; r < 32; ++r) {
      std::byte* base = (*buf)->data() + size_t{r} * kLen;
      std::memset(base, 0, kLen);
      for (uint32_t k = 0; k < kSegs; ++k) segs[r][k] = IoSeg{base + k * kSeg, kSeg, buf->get()};
      hdr[r] = VolHdr{uint64_t{r} * kLen, kLen, kVolMagic};
      IoRequest req;
      req.dir = IoDir::read;
      req.usr = std::span(reinterpret_cast<const std::byte*>(&hdr[r]), sizeof(VolHdr));
      req.data = segs[r];
      req.done = &Waiter::cb;
      req.ctx = &w[r];
      ASSERT_TRUE((*c)->request(req).ok());
    }
    for (uint32_t r = 0; r < 32; ++r) {
      ASSERT_EQ(w[r].wait(10s), 0) << "round " << round << " read " << r;
      ASSERT_EQ(std::memcmp((*buf)->data() + size_t{r} * kLen, vol_.mem().data() + size_t{r} * kLen, kLen), 0);
    }
  }
  EXPECT_EQ(refused(refusal::kAckTimeout), 0u);
  buf->reset();
}

// Case: 16 client sessions of the default geometry (256 chunks of 128 KiB: 32 MiB reserved
// each) connect and each writes and reads 4 KiB, then idles; then one of them writes 1 MiB.
// Expect: the server holds the reserved chunk memory in its accounting (16 x 32 MiB) but only
// what the requests touched in RAM: at most 64 KiB of chunks per idle session, and 1 MiB more
// after the large write. The whole process (servers and clients) grows by less than 8 MiB of
// RSS per idle session. (rdma: registration pins every chunk, so resident = reserved: skipped.)
TEST_F(Bounds, IdleSessionsHoldLittleOfTheirChunkMemory) {
  if (g_kind == FabricKind::rdma) GTEST_SKIP() << "rdma registration pins the chunks";
  ServerOptions so;
  so.max_chunk_memory = uint64_t{1} << 40;
  start(so);
  const size_t rss0 = rss_kib();
  constexpr int kSessions = 16;
  std::vector<std::unique_ptr<ClientSession>> cs;
  std::vector<std::unique_ptr<RegisteredMemory>> bufs;
  for (int i = 0; i < kSessions; ++i) {
    auto c = open_client("idle" + std::to_string(i));
    ASSERT_TRUE(c.ok()) << c.error().message();
    auto b = (*c)->alloc_buffer(2 << 20);
    ASSERT_TRUE(b.ok());
    std::memset((*b)->data(), i, 4096);
    ASSERT_EQ(sync_io(**c, IoDir::write, **b, (*b)->data(), 4096, 0), 0);
    ASSERT_EQ(sync_io(**c, IoDir::read, **b, (*b)->data() + 4096, 4096, 0), 0);
    cs.push_back(std::move(*c));
    bufs.push_back(std::move(*b));
  }
  const ServerUsage u = server_->usage();
  EXPECT_EQ(u.sessions, uint32_t{kSessions});
  EXPECT_EQ(u.chunk_memory, uint64_t{kSessions} * so.queue_depth * so.chunk_size);
  EXPECT_LE(u.chunk_resident, uint64_t{kSessions} * 64 * 1024) << "idle sessions touched little";
  EXPECT_GT(u.chunk_resident, 0u) << "the requests' pages are counted";
  RecordProperty("chunk_resident_kib_per_session", static_cast<int>(u.chunk_resident / 1024 / kSessions));
  RecordProperty("rss_kib_per_session", static_cast<int>((rss_kib() - std::min(rss0, rss_kib())) / kSessions));
  if (kRssMeaningful) {
    const size_t grown = rss_kib() - std::min(rss0, rss_kib());
    EXPECT_LT(grown, size_t{kSessions} * 8 * 1024) << "KiB of RSS for " << kSessions << " sessions";
  }
  ASSERT_GE(cs[0]->max_io_size(), 1u << 20);
  ASSERT_EQ(sync_io(*cs[0], IoDir::write, *bufs[0], bufs[0]->data(), 1 << 20, 0), 0);
  EXPECT_GE(server_->usage().chunk_resident, u.chunk_resident + (1u << 20) - 8192)
      << "a 1 MiB write lands in RAM in its chunk set";
  bufs.clear();
  cs.clear();
}

}  // namespace
}  // namespace ibtrs::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  ibtrs::test::g_kind = ibtrs::test::fabric_from_args(argc, argv);
  return RUN_ALL_TESTS();
}
