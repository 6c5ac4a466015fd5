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

#include "core/fabrics.h"
#include "fabric/fabric.h"
#include "proto/ibtrs_proto.h"
#include "session_harness.h"

namespace ibtrs::test {
namespace {

using namespace std::chrono_literals;
using namespace ibtrs::proto;
using fabric::Opcode;

FabricKind g_kind = FabricKind::loopback;

size_t open_fds() {
  size_t n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d) != nullptr) ++n;
    ::closedir(d);
  }
  return n;
}

size_t rss_kib() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoul(line.substr(6));
  return 0;
}

Uuid to_uuid(const Uuid16& u) {
  Uuid r;
  std::memcpy(r.data(), u.bytes, 16);
  return r;
}

// One connection of a raw peer. Its CQ is polled only when the test says so: a software
// provider's connection whose CQ is never polled takes nothing and acknowledges nothing.
struct RawCon {
  std::unique_ptr<fabric::CompletionQueue> cq;
  std::unique_ptr<fabric::Connection> conn;
};

// A client that speaks the wire protocol by hand (docs/protocol.md), owning a registered buffer
// for its messages: bytes [0, 8K) are what it sends, [8K, 16K) where it receives, [16K, 32K)
// read requests (one place per chunk), and a separate region its reads land in.
class RawPeer {
 public:
  explicit RawPeer(const Address& server) : server_(server) {
    auto f = core::shared_fabric(server.fabric, false);
    EXPECT_TRUE(f.ok());
    auto d = (*f)->domain_for(server);
    EXPECT_TRUE(d.ok());
    dom_ = *d;
    auto mr = dom_->register_memory(buf_, sizeof(buf_), fabric::kLocalWrite | fabric::kRemoteWrite);
    EXPECT_TRUE(mr.ok());
    mr_ = std::move(*mr);
    auto rm = dom_->register_memory(read_.data(), read_.size(), fabric::kLocalWrite | fabric::kRemoteWrite);
    EXPECT_TRUE(rm.ok());
    read_mr_ = std::move(*rm);
  }

  // One connection carrying `req`; the CON_RSP errno of a refusal comes back in `refused`.
  Result<RawCon> connect(const ConReq& req, int* refused = nullptr, uint32_t send_depth = 64) {
    RawCon c;
    IBTRS_ASSIGN_OR_RETURN(c.cq, dom_->create_cq(send_depth + 64));
    fabric::ConnectParams p;
    p.remote = server_;
    p.cq = c.cq.get();
    p.caps.max_send_wr = send_depth;
    p.caps.max_recv_wr = 64;
    p.private_data = as_bytes_of(req);
    p.timeout = 5s;
    std::vector<std::byte> rej;
    auto r = dom_->connect(p, &rej);
    if (!r.ok()) {
      std::string why;
      if (refused != nullptr && !rej.empty()) {
        auto rsp = parse_con_rsp(rej, &why);
        *refused = rsp.ok() ? rsp->errno_.get() : -1;
      }
      return r.error();
    }
    c.conn = std::move(r->connection);
    recv_sge_ = mr_->sge(8192, 8192);
    std::vector<fabric::RecvWr> rw(64);
    for (auto& w : rw) w = fabric::RecvWr{0, std::span(&recv_sge_, 1)};
    IBTRS_TRY(c.conn->post_recv(rw));
    return c;
  }

  // The first connection of a new path of a new session, and nothing after: half-open.
  Result<RawCon> half_open() {
    return connect(make_con_req(0, 2, 0, true, to_uuid(Uuid16::random()), to_uuid(Uuid16::random())));
  }

  // A whole path (service connection + one IO connection with `io_send_depth`) through
  // INFO_RSP. Returns the chunk descriptors (empty when the server refused).
  std::vector<ChunkDesc> establish(std::vector<RawCon>& cons, const std::string& sessname,
                                   uint16_t qd, uint32_t io_send_depth = 64) {
    const Uuid sess = to_uuid(Uuid16::random()), path = to_uuid(Uuid16::random());
    for (uint16_t cid = 0; cid < 2; ++cid) {
      auto c = connect(make_con_req(cid, 2, 0, cid == 0, sess, path), nullptr,
                       cid == 0 ? 64 : io_send_depth);
      if (!c.ok()) return {};
      cons.push_back(std::move(*c));
    }
    auto info = make_info_req(sessname, "raw@server");
    std::memcpy(buf_, &*info, sizeof(*info));
    fabric::Sge s = mr_->sge(0, sizeof(*info));
    fabric::SendWr w{};
    w.opcode = Opcode::send;
    w.sg_list = std::span(&s, 1);
    if (!cons[0].conn->post_send(std::span(&w, 1)).ok()) return {};
    fabric::Completion wc[8];
    for (int i = 0; i < 200; ++i) {
      size_t n = cons[0].cq->wait(wc, 50ms);
      for (size_t k = 0; k < n; ++k) {
        if (wc[k].status != fabric::WcStatus::success) return {};
        if (wc[k].opcode != Opcode::recv) continue;
        std::string why;
        auto d = parse_info_rsp(std::span<const std::byte>(buf_ + 8192, wc[k].byte_len), qd,
                                128 * 1024, &why);
        if (!d.ok()) return {};
        return std::vector<ChunkDesc>(d->begin(), d->end());
      }
    }
    return {};
  }

  // A write request without user header or data (the test volume answers it with EINVAL: an
  // answer all the same) into `chunk`, on `io`.
  Status send_request(RawCon& io, const ChunkDesc& chunk, uint32_t chunk_id, const ImmLayout& l) {
    WriteMsg m{};
    m.type.set(static_cast<uint16_t>(MsgType::write));
    std::memcpy(buf_ + 4096, &m, sizeof(m));
    fabric::Sge s = mr_->sge(4096, sizeof(m));
    fabric::SendWr w{};
    w.opcode = Opcode::write_with_imm;
    w.sg_list = std::span(&s, 1);
    w.remote_addr = chunk.addr.get();
    w.rkey = chunk.key.get();
    IBTRS_ASSIGN_OR_RETURN(w.imm, encode_io_req_imm(l, chunk_id, 0));
    w.signaled = false;
    return io.conn->post_send(std::span(&w, 1));
  }

  // A read of `descs` pieces of `piece` bytes from volume offset `off`, landing at the same
  // offset in read_area().
  Status send_read(RawCon& io, const ChunkDesc& chunk, uint32_t chunk_id, const ImmLayout& l,
                   uint64_t off, uint32_t descs, uint32_t piece) {
    std::byte msg[sizeof(VolHdr) + sizeof(ReadMsgHeader) + kMaxReadDescs * sizeof(BufDesc)];
    const VolHdr h{off, descs * piece, kVolMagic};
    ReadMsgHeader m{};
    m.type.set(static_cast<uint16_t>(MsgType::read));
    m.usr_len.set(sizeof(VolHdr));
    m.sg_cnt.set(static_cast<uint16_t>(descs));
    std::memcpy(msg, &h, sizeof(h));
    std::memcpy(msg + sizeof(h), &m, sizeof(m));
    for (uint32_t i = 0; i < descs; ++i) {
      BufDesc d{};
      d.addr.set(read_mr_->remote_addr(off + size_t{i} * piece));
      d.key.set(read_mr_->rkey());
      d.len.set(piece);
      std::memcpy(msg + sizeof(h) + sizeof(m) + i * sizeof(d), &d, sizeof(d));
    }
    const size_t len = sizeof(h) + sizeof(m) + descs * sizeof(BufDesc);
    // Each chunk's message has its own place: a post only references it.
    std::byte* at = buf_ + kReadMsgs + (chunk_id % 32) * 512;
    std::memcpy(at, msg, len);
    fabric::Sge s = mr_->sge(static_cast<size_t>(at - buf_), static_cast<uint32_t>(len));
    fabric::SendWr w{};
    w.opcode = Opcode::write_with_imm;
    w.sg_list = std::span(&s, 1);
    w.remote_addr = chunk.addr.get();
    w.rkey = chunk.key.get();
    IBTRS_ASSIGN_OR_RETURN(w.imm, encode_io_req_imm(l, chunk_id, sizeof(VolHdr)));
    w.signaled = false;
    return io.conn->post_send(std::span(&w, 1));
  }
  std::byte* read_area() { return read_.data(); }

  // Polls `io` until `n` IO responses arrived (reposting receives); returns how many did.
  uint32_t collect_responses(RawCon& io, uint32_t n, std::chrono::milliseconds t) {
    fabric::Completion wc[64];
    uint32_t got = 0;
    const auto end = std::chrono::steady_clock::now() + t;
    while (got < n && std::chrono::steady_clock::now() < end) {
      size_t k = io.cq->wait(wc, 20ms);
      for (size_t i = 0; i < k; ++i) {
        if (wc[i].status != fabric::WcStatus::success) return got;
        if (wc[i].opcode != Opcode::recv_rdma_with_imm) continue;
        if (imm_type(wc[i].imm) == ImmType::io_rsp) ++got;
        fabric::RecvWr rw{0, std::span(&recv_sge_, 1)};
        (void)io.conn->post_recv(std::span(&rw, 1));
      }
    }
    return got;
  }

  // Whether the server closed every connection in `cons` within `t` (polls their CQs).
  static bool closed_by_server(std::vector<RawCon>& cons, std::chrono::milliseconds t) {
    fabric::Completion wc[64];
    const auto end = std::chrono::steady_clock::now() + t;
    for (;;) {
      bool all = true;
      for (auto& c : cons) {
        while (c.cq->poll(wc) > 0) {
        }
        if (c.conn->state() == fabric::ConnState::connected) all = false;
      }
      if (all) return true;
      if (std::chrono::steady_clock::now() > end) return false;
      std::this_thread::sleep_for(10ms);
    }
  }

 private:
  Address server_;
  fabric::Domain* dom_ = nullptr;
  static constexpr size_t kReadMsgs = 16384;
  alignas(4096) std::byte buf_[32768] = {};
  std::unique_ptr<fabric::MemoryRegion> mr_;
  std::vector<std::byte> read_ = std::vector<std::byte>(256 * 1024);
  std::unique_ptr<fabric::MemoryRegion> read_mr_;
  fabric::Sge recv_sge_{};
};

class Bounds : public ::testing::Test {
 protected:
  void start(ServerOptions so) {
    so.listen.push_back(g_kind == FabricKind::tcp ? *Address::parse("tcp:127.0.0.1:0")
                                                  : *Address::parse("loopback:bounds:0"));
    so.io_threads = 1;
    so.handler = &vol_;
    // Long heartbeats: the raw peers never answer them, and no scenario is about them.
    so.heartbeat.interval = 60s;
    auto s = Server::start(so);
    ASSERT_TRUE(s.ok()) << s.error().message();
    server_ = std::move(*s);
    addr_ = server_->addresses()[0];
  }

  // An honest client of its own session connects and writes + reads back 64 KiB within
  // `deadline` in all. Returns the error of the step that failed (0: all went well).
  int honest_client(const std::string& name, std::chrono::milliseconds deadline = 10s) {
    const auto end = std::chrono::steady_clock::now() + deadline;
    ClientOptions co;
    co.session_name = name;
    co.paths.push_back(PathSpec{std::nullopt, addr_});
    co.io_threads = 1;
    co.connect_timeout = deadline;
    auto c = ClientSession::open(co);
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
  EXPECT_LE(rss_kib(), rss0 + 16 * 1024) << "RSS " << rss0 << " KiB before";
}

// Case: a peer floods 150 half-open sessions at a server capped at 8 sessions, while an honest
// session is connected. Expect: the server never holds more than 8 sessions; the flood only
// pushes out its own oldest half-open sessions (counted); the connected session is untouched
// and keeps working; a new honest client gets in (evicting one) and does IO.
TEST_F(Bounds, AFloodOfNewSessionsEvictsOnlyHalfOpenOnes) {
  ServerOptions so;
  so.max_sessions = 8;
  start(so);
  ClientOptions co;
  co.session_name = "resident";
  co.paths.push_back(PathSpec{std::nullopt, addr_});
  co.io_threads = 1;
  auto resident = ClientSession::open(co);
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
    ClientOptions co;
    co.session_name = name;
    co.paths.push_back(PathSpec{std::nullopt, addr_});
    co.io_threads = 1;
    auto c = ClientSession::open(co);
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

class NeverAcknowledging : public Bounds {
 protected:
  void SetUp() override {
    if (g_kind != FabricKind::tcp)
      GTEST_SKIP() << "a loopback send completes when posted: only tcp lets a peer withhold acks";
  }
  static constexpr uint16_t kQd = 32;
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
  ServerOptions so;
  so.queue_depth = kQd;
  so.ack_timeout = 1s;
  start(so);
  RawPeer peer(addr_);
  std::vector<RawCon> cons;
  auto chunks = peer.establish(cons, "mute", kQd, 4096);
  ASSERT_EQ(chunks.size(), kQd);
  auto layout = imm_layout(kQd, so.chunk_size);
  // Lockstep: each request is served before the next goes, until one is not taken.
  uint32_t sent = 0;
  std::optional<std::chrono::steady_clock::time_point> backlog_seen;
  for (; sent < 1000; ++sent) {
    const uint64_t before = vol_.requests_.load();
    ASSERT_TRUE(peer.send_request(cons[1], chunks[sent % kQd], sent % kQd, *layout).ok());
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
  ServerOptions so;
  so.queue_depth = kQd;
  so.ack_timeout = 1s;
  start(so);
  ASSERT_EQ(honest_client("warm-up"), 0);
  const size_t rss0 = rss_kib();
  RawPeer peer(addr_);
  std::vector<RawCon> cons;
  auto chunks = peer.establish(cons, "flood", kQd, 4096);
  ASSERT_EQ(chunks.size(), kQd);
  auto layout = imm_layout(kQd, so.chunk_size);
  uint64_t peak = 0;
  for (uint32_t i = 0; i < 3000; ++i) {
    ASSERT_TRUE(peer.send_request(cons[1], chunks[i % kQd], i % kQd, *layout).ok());
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
  EXPECT_LE(rss_kib(), rss0 + 32 * 1024) << "RSS " << rss0 << " KiB before";
}

// Case: a peer within its credit (queue_depth reads of 15 pieces: 16 work requests per
// response, far more than the send queue holds) acknowledges nothing for 500 ms, then polls
// again. Expect: every response arrives with the right bytes, nobody is cut off.
TEST_F(NeverAcknowledging, APeerSlowToAcknowledgeWithinItsCreditGetsEveryResponse) {
  ServerOptions so;
  so.queue_depth = kQd;
  so.ack_timeout = 5s;
  start(so);
  for (size_t i = 0; i < vol_.mem().size(); ++i) vol_.mem()[i] = static_cast<std::byte>(i * 7 + (i >> 9));
  RawPeer peer(addr_);
  std::vector<RawCon> cons;
  auto chunks = peer.establish(cons, "slow", kQd, 256);
  ASSERT_EQ(chunks.size(), kQd);
  auto layout = imm_layout(kQd, so.chunk_size);
  constexpr uint32_t kDescs = 15, kPiece = 16;  // 240 bytes per read, into the peer's buffer
  for (uint32_t r = 0; r < kQd; ++r) {
    auto st = peer.send_read(cons[1], chunks[r], r, *layout, uint64_t{r} * kDescs * kPiece, kDescs, kPiece);
    ASSERT_TRUE(st.ok()) << st.error().message();
  }
  ASSERT_TRUE(wait_until([&] { return vol_.requests_.load() == kQd; }, 5s));
  EXPECT_GT(server_->usage().backlog, 0u) << "the responses did not fit the send queue";
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ(peer.collect_responses(cons[1], kQd, 5s), kQd);
  for (uint32_t r = 0; r < kQd; ++r) {
    const size_t off = size_t{r} * kDescs * kPiece;
    EXPECT_EQ(std::memcmp(peer.read_area() + off, vol_.mem().data() + off, kDescs * kPiece), 0) << "read " << r;
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
  ClientOptions co;
  co.session_name = "reader";
  co.paths.push_back(PathSpec{std::nullopt, addr_});
  co.io_threads = 1;
  auto c = ClientSession::open(co);
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

}  // namespace
}  // namespace ibtrs::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--fabric=tcp") ibtrs::test::g_kind = ibtrs::FabricKind::tcp;
  }
  return RUN_ALL_TESTS();
}
