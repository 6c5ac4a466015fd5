// A hostile or broken client speaking raw fabric to a real server: every malformed message
// closes that path (or refuses that connection) with a reason, the server survives, nothing
// outside the session's chunks changes, and an honest client keeps working.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <optional>
#include <thread>

#include "raw_peer.h"
#include "session_harness.h"

namespace ibtrs::test {
namespace {

using namespace std::chrono_literals;
using namespace ibtrs::proto;
using fabric::Opcode;

FabricKind& g_kind = hostile_fabric();

class Hostile : public ::testing::Test {
 protected:
  void SetUp() override { start_server(); }

  // The server of the case (again, for a case that wants other options: `tune` changes them),
  // a raw peer of it, and fresh uuids.
  void start_server(const std::function<void(ServerOptions&)>& tune = {}) {
    peer_.reset();
    server_.reset();
    ServerOptions so;
    so.listen.push_back(g_kind == FabricKind::tcp ? *Address::parse("tcp:127.0.0.1:0")
                                                  : *Address::parse("loopback:hostile:0"));
    so.queue_depth = 48;  // chunk ids 48..63 fit the immediate but are out of range
    so.io_threads = 1;
    so.handler = &vol_;
    so.allow_any_host = true;  // the raw client speaks without credentials (auth_test.cc has those)
    so.always_invalidate = always_invalidate();
    if (tune) tune(so);
    auto s = Server::start(so);
    ASSERT_TRUE(s.ok());
    server_ = std::move(*s);
    addr_ = server_->addresses()[0];
    peer_.emplace(addr_);
    buf_ = peer_->buf();
    mr_ = &peer_->mr();
    sess_ = Uuid16::random();
    path_ = Uuid16::random();
  }

  virtual bool always_invalidate() const { return false; }

  using Con = RawCon;

  // Connects one connection with `req` as private data. The error and the CON_RSP errno of a
  // refusal come back in `refused`.
  Result<Con> connect(const ConReq& req, int* refused = nullptr) { return peer_->connect(req, refused); }

  // A whole path (service + one IO connection) through INFO_RSP; returns the chunk descriptors.
  bool establish(std::vector<Con>& cons, std::vector<ChunkDesc>& chunks,
                 const std::string& sessname = "hostile") {
    chunks = peer_->establish(cons, sessname, 48, to_uuid(sess_), to_uuid(path_));
    return !chunks.empty();
  }

  // Writes `len` bytes of buf_ into chunk `chunk` with immediate `imm` on the IO connection.
  void send_io(Con& io, const ChunkDesc& chunk, uint32_t len, uint32_t imm) {
    fabric::Sge s = mr_->sge(0, len);
    fabric::SendWr w{};
    w.opcode = Opcode::write_with_imm;
    w.sg_list = std::span(&s, len ? 1 : 0);
    w.remote_addr = chunk.addr.get();
    w.rkey = chunk.key.get();
    w.imm = imm;
    ASSERT_TRUE(io.conn->post_send(std::span(&w, 1)).ok());
  }

  // Expect the server to close the path: our connections go to error.
  bool closed_by_server(std::vector<Con>& cons) { return RawPeer::closed_by_server(cons, 3s); }

  // A write request of 4096 bytes of `fill` into chunk `id` with `key`.
  void write_request(Con& io, const ChunkDesc& chunk, uint32_t id, uint32_t key, char fill) {
    std::memset(buf_, fill, 4096);
    WriteMsg m{};
    m.type.set(static_cast<uint16_t>(MsgType::write));
    m.usr_len.set(0);
    m.data_len.set(4096);
    std::memcpy(buf_ + 4096, &m, sizeof(m));
    ChunkDesc d = chunk;
    d.key.set(key);
    auto layout = imm_layout(48, 128 * 1024);
    send_io(io, d, 4096 + sizeof(m), *encode_io_req_imm(*layout, id, 4096));
  }
  std::vector<ServerRequest*> wait_held(size_t n) {
    std::vector<ServerRequest*> got;
    for (int i = 0; i < 300 && got.size() < n; ++i) {
      auto h = vol_.take_held();
      got.insert(got.end(), h.begin(), h.end());
      if (got.size() < n) std::this_thread::sleep_for(10ms);
    }
    return got;
  }

  // Case (issue 13, class 2): a second session writes into the first session's chunks with the
  // keys the first session was given: the key of the chunk whose write request the server
  // holds, and the current key of an idle chunk (with always_invalidate: its own live key).
  // Expect: each write is refused by the fabric (remote_access_error; the attacker's connection
  // breaks and the server closes its path); the held request still has the victim's bytes, the
  // victim's connections stay up, and an honest client works.
  void another_sessions_key_is_refused() {
    std::vector<Con> victim;
    std::vector<ChunkDesc> vchunks;
    ASSERT_TRUE(establish(victim, vchunks, "victim"));
    vol_.hold(true);
    write_request(victim[1], vchunks[0], 0, vchunks[0].key.get(), 'V');
    auto held = wait_held(1);
    ASSERT_EQ(held.size(), 1u);
    for (uint32_t target : {0u, 1u}) {
      std::vector<Con> attacker;
      std::vector<ChunkDesc> achunks;
      sess_ = Uuid16::random();
      path_ = Uuid16::random();
      ASSERT_TRUE(establish(attacker, achunks, "attacker"));
      std::memset(buf_, 'X', 4096);
      fabric::Sge sx = mr_->sge(0, 4096);
      fabric::SendWr w{};
      w.wr_id = 77;
      w.opcode = Opcode::write;
      w.sg_list = std::span(&sx, 1);
      w.remote_addr = vchunks[target].addr.get();
      w.rkey = vchunks[target].key.get();
      ASSERT_TRUE(attacker[1].conn->post_send(std::span(&w, 1)).ok());
      fabric::WcStatus status = fabric::WcStatus::success;
      bool seen = false;
      fabric::Completion wc[8];
      for (int i = 0; i < 300 && !seen; ++i) {
        size_t n = attacker[1].cq->wait(wc, 10ms);
        for (size_t k = 0; k < n; ++k) {
          if (wc[k].wr_id == 77) {
            seen = true;
            status = wc[k].status;
          }
        }
      }
      ASSERT_TRUE(seen) << "chunk " << target;
      EXPECT_EQ(status, fabric::WcStatus::remote_access_error) << "chunk " << target;
      EXPECT_TRUE(closed_by_server(attacker)) << "chunk " << target;
    }
    auto data = held[0]->data();
    ASSERT_EQ(data.size(), 4096u);
    EXPECT_TRUE(std::all_of(data.begin(), data.end(), [](std::byte b) { return b == std::byte{'V'}; }))
        << "the victim's bytes are its own";
    for (auto& c : victim) EXPECT_EQ(c.conn->state(), fabric::ConnState::connected);
    held[0]->complete(0);
    vol_.hold(false);
    honest_client_works();
  }

  // Sends `msg` (a PATH_FENCE, or what a test makes of one) on service connection `svc` and
  // returns the FENCE_RSP that answers it; nullopt when none came within 3 s (heartbeats
  // arriving meanwhile are skipped).
  std::optional<FenceView> fence(Con& svc, std::span<const std::byte> msg) {
    std::memcpy(buf_ + 2048, msg.data(), msg.size());
    fabric::Sge s = mr_->sge(2048, static_cast<uint32_t>(msg.size()));
    fabric::SendWr w{};
    w.opcode = Opcode::send;
    w.sg_list = std::span(&s, 1);
    if (!svc.conn->post_send(std::span(&w, 1)).ok()) return std::nullopt;
    fabric::Completion wc[8];
    for (int i = 0; i < 60; ++i) {
      const size_t n = svc.cq->wait(wc, 50ms);
      for (size_t k = 0; k < n; ++k) {
        if (wc[k].status != fabric::WcStatus::success) return std::nullopt;
        if (wc[k].opcode != Opcode::recv) continue;
        std::string why;
        auto v = parse_fence_rsp(std::span<const std::byte>(buf_ + 8192, wc[k].byte_len), &why);
        EXPECT_TRUE(v.ok()) << why;
        if (v.ok()) return *v;
        return std::nullopt;
      }
    }
    return std::nullopt;
  }
  std::optional<FenceView> fence(Con& svc, const Uuid& path, uint16_t recon) {
    const PathFence m = make_path_fence(path, recon);
    return fence(svc, as_bytes_of(m));
  }
  bool fence_offered() const {
    std::string why;
    auto r = parse_con_rsp(peer_->last_con_rsp(), &why);
    return r.ok() && (r->flags.get() & kConRspFence) != 0;
  }

  // An honest client still gets served.
  void honest_client_works() {
    ClientOptions co;
    co.session_name = "honest";
    co.paths.push_back(PathSpec{std::nullopt, addr_});
    co.io_threads = 1;
    auto c = ClientSession::open(co);
    ASSERT_TRUE(c.ok()) << c.error().message();
    auto b = (*c)->alloc_buffer(4096);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(sync_io(**c, IoDir::write, **b, (*b)->data(), 4096, 0), 0);
    b->reset();
  }

  RamVolume vol_{1 << 20};
  std::unique_ptr<Server> server_;
  Address addr_;
  std::optional<RawPeer> peer_;
  std::byte* buf_ = nullptr;  // the peer's message buffer ([0, 8K) out, [8K, 16K) in)
  fabric::MemoryRegion* mr_ = nullptr;
  Uuid16 sess_, path_;
};

TEST_F(Hostile, BadMagicAndVersionAreRefusedAtConnect) {
  auto req = make_con_req(0, 2, 0, true, to_uuid(sess_), to_uuid(path_));
  req.magic.set(0xdead);
  int err = 0;
  EXPECT_EQ(connect(req, &err).error(), errc(ECONNREFUSED));
  EXPECT_EQ(err, EPROTO) << "the reject says why";
  req = make_con_req(0, 2, 0, true, to_uuid(sess_), to_uuid(path_));
  req.version.set(0x0900);
  EXPECT_EQ(connect(req, &err).error(), errc(ECONNREFUSED));
  EXPECT_EQ(err, EPROTONOSUPPORT);
  req = make_con_req(5, 2, 0, true, to_uuid(sess_), to_uuid(path_));
  EXPECT_EQ(connect(req, &err).error(), errc(ECONNREFUSED)) << "connection id past cid_num";
  honest_client_works();
}

TEST_F(Hostile, AStaleIncarnationOfAPathIsRefused) {
  auto now = connect(make_con_req(0, 2, 5, true, to_uuid(sess_), to_uuid(path_)));
  ASSERT_TRUE(now.ok());
  int err = 0;
  EXPECT_EQ(connect(make_con_req(1, 2, 3, false, to_uuid(sess_), to_uuid(path_)), &err).error(),
            errc(ECONNREFUSED));
  EXPECT_EQ(err, ESTALE) << "an older reconnect counter is a stale path";
  EXPECT_EQ(connect(make_con_req(0, 2, 5, true, to_uuid(sess_), to_uuid(path_)), &err).error(),
            errc(ECONNREFUSED));
  EXPECT_EQ(err, EEXIST) << "the same connection twice";
}

TEST_F(Hostile, ChunkIdOutOfRangeClosesThePath) {
  std::vector<Con> cons;
  std::vector<ChunkDesc> chunks;
  ASSERT_TRUE(establish(cons, chunks));
  auto layout = imm_layout(48, 128 * 1024);
  send_io(cons[1], chunks[0], 0, *encode_io_req_imm(*layout, 50, 0));
  EXPECT_TRUE(closed_by_server(cons));
  honest_client_works();
}

TEST_F(Hostile, MessageOffsetPastTheChunkClosesThePath) {
  std::vector<Con> cons;
  std::vector<ChunkDesc> chunks;
  ASSERT_TRUE(establish(cons, chunks));
  auto layout = imm_layout(48, 128 * 1024);
  send_io(cons[1], chunks[3], 16, *encode_io_req_imm(*layout, 3, 128 * 1024 - 4));
  EXPECT_TRUE(closed_by_server(cons));
  EXPECT_EQ(vol_.requests_.load(), 0u) << "nothing reached the upper layer";
  honest_client_works();
}

TEST_F(Hostile, LengthsThatDoNotAddUpCloseThePath) {
  std::vector<Con> cons;
  std::vector<ChunkDesc> chunks;
  ASSERT_TRUE(establish(cons, chunks));
  WriteMsg m{};
  m.type.set(static_cast<uint16_t>(MsgType::write));
  m.usr_len.set(16);
  m.data_len.set(100000);  // claims more data than precedes the message
  std::memcpy(buf_ + 4096 + 16, &m, sizeof(m));
  std::memmove(buf_, buf_ + 4096, 16 + sizeof(m));
  auto layout = imm_layout(48, 128 * 1024);
  send_io(cons[1], chunks[1], 16 + sizeof(m), *encode_io_req_imm(*layout, 1, 16));
  EXPECT_TRUE(closed_by_server(cons));
  EXPECT_EQ(vol_.requests_.load(), 0u);
}

// Case: a read asking for more than max_io_size (1 MiB: the peer speaks 2.2 and got chunk
// sets) in chunk 2. Expect: the path is closed, the upper layer sees nothing.
TEST_F(Hostile, AReadLongerThanTheChunkClosesThePath) {
  std::vector<Con> cons;
  std::vector<ChunkDesc> chunks;
  ASSERT_TRUE(establish(cons, chunks));
  ReadMsgHeader h{};
  h.type.set(static_cast<uint16_t>(MsgType::read));
  h.usr_len.set(0);
  h.sg_cnt.set(2);
  BufDesc d[2]{};
  for (auto& x : d) {
    x.addr.set(mr_->remote_addr(0));
    x.key.set(mr_->rkey());
    x.len.set(600 * 1024);  // 1200 KiB in all: more than max_io_size
  }
  std::memcpy(buf_, &h, sizeof(h));
  std::memcpy(buf_ + sizeof(h), d, sizeof(d));
  auto layout = imm_layout(48, 128 * 1024);
  send_io(cons[1], chunks[2], sizeof(h) + sizeof(d), *encode_io_req_imm(*layout, 2, 0));
  EXPECT_TRUE(closed_by_server(cons));
  EXPECT_EQ(vol_.requests_.load(), 0u);
  honest_client_works();
}

// Case: chunk sets that leave the session: a read in the last chunk (47) whose data area would
// run past it, on one path; a write in chunk 0 whose lengths claim data from a chunk before it,
// on another. Expect: each path is closed, the upper layer sees neither, an honest client works.
TEST_F(Hostile, ChunkSetsOutsideTheSessionCloseThePath) {
  {
    std::vector<Con> cons;
    std::vector<ChunkDesc> chunks;
    ASSERT_TRUE(establish(cons, chunks));
    ReadMsgHeader h{};
    h.type.set(static_cast<uint16_t>(MsgType::read));
    h.sg_cnt.set(1);
    BufDesc d{};
    d.addr.set(mr_->remote_addr(0));
    d.key.set(mr_->rkey());
    d.len.set(256 * 1024);  // within max_io_size, but two chunks past the last one
    std::memcpy(buf_, &h, sizeof(h));
    std::memcpy(buf_ + sizeof(h), &d, sizeof(d));
    auto layout = imm_layout(48, 128 * 1024);
    send_io(cons[1], chunks[47], sizeof(h) + sizeof(d), *encode_io_req_imm(*layout, 47, 0));
    EXPECT_TRUE(closed_by_server(cons));
  }
  {
    std::vector<Con> cons;
    std::vector<ChunkDesc> chunks;
    ASSERT_TRUE(establish(cons, chunks));
    WriteMsg m{};
    m.type.set(static_cast<uint16_t>(MsgType::write));
    m.usr_len.set(16);
    m.data_len.set(128 * 1024);  // offset 16 + one whole chunk: the data would start in chunk -1
    std::memcpy(buf_ + 16, &m, sizeof(m));
    auto layout = imm_layout(48, 128 * 1024);
    send_io(cons[1], chunks[0], 16 + sizeof(m), *encode_io_req_imm(*layout, 0, 16));
    EXPECT_TRUE(closed_by_server(cons));
  }
  EXPECT_EQ(vol_.requests_.load(), 0u);
  honest_client_works();
}

// Case: a second client uses the session uuid of a live session under another session name
// (a uuid drawn twice, or a lie). Expect: its path is refused; the first session keeps working.
TEST_F(Hostile, ASessionUuidReusedUnderAnotherNameIsRefused) {
  std::vector<Con> first, second;
  std::vector<ChunkDesc> chunks;
  ASSERT_TRUE(establish(first, chunks));
  path_ = Uuid16::random();
  EXPECT_FALSE(establish(second, chunks, "someone-else")) << "no INFO_RSP for the impostor";
  EXPECT_TRUE(closed_by_server(second));
  for (auto& c : first) EXPECT_EQ(c.conn->state(), fabric::ConnState::connected);
  honest_client_works();
}

TEST_F(Hostile, GarbageInfoRequestClosesThePath) {
  std::vector<Con> cons;
  for (uint16_t cid = 0; cid < 2; ++cid) {
    auto c = connect(make_con_req(cid, 2, 0, cid == 0, to_uuid(sess_), to_uuid(path_)));
    ASSERT_TRUE(c.ok());
    cons.push_back(std::move(*c));
  }
  std::memset(buf_, 0x41, 144);
  fabric::Sge s = mr_->sge(0, 144);
  fabric::SendWr w{};
  w.opcode = Opcode::send;
  w.sg_list = std::span(&s, 1);
  ASSERT_TRUE(cons[0].conn->post_send(std::span(&w, 1)).ok());
  EXPECT_TRUE(closed_by_server(cons));
  honest_client_works();
}

// Case: a session of two raw paths A and B (protocol 2.3), and another session with path C.
// C fences A; B fences an unknown path; B fences A; B fences A again.
// Expect: the flag was offered; C's fence finds nothing (another session's path is never
// found) and A stays up; the unknown path is answered "not live"; B's fence of A closes A
// ("closed") while B stays up; the repeat is "not live". Each answer names the fence's path and
// incarnation, and the server counts 4 answers, 1 close.
TEST_F(Hostile, APathFenceClosesTheNamedPathOfItsOwnSessionOnly) {
  std::vector<Con> a, b, c;
  std::vector<ChunkDesc> chunks;
  ASSERT_TRUE(establish(a, chunks));
  EXPECT_TRUE(fence_offered()) << "a client of 2.3 is offered the fence";
  const Uuid path_a = to_uuid(path_);
  path_ = Uuid16::random();
  ASSERT_TRUE(establish(b, chunks));
  sess_ = Uuid16::random();
  path_ = Uuid16::random();
  ASSERT_TRUE(establish(c, chunks, "other"));

  auto r = fence(c[0], path_a, 0);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, kFenceNotLive) << "another session's path is not found";
  EXPECT_EQ(r->path_uuid, path_a);
  EXPECT_FALSE(RawPeer::closed_by_server(a, 300ms)) << "A stays up";

  Uuid unknown = to_uuid(Uuid16::random());
  r = fence(b[0], unknown, 7);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, kFenceNotLive);
  EXPECT_EQ(r->path_uuid, unknown);
  EXPECT_EQ(r->recon_cnt, 7u);

  r = fence(b[0], path_a, 0);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, kFenceClosed);
  EXPECT_TRUE(closed_by_server(a)) << "the server closed A before it answered";
  for (auto& k : b) EXPECT_EQ(k.conn->state(), fabric::ConnState::connected);
  r = fence(b[0], path_a, 0);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, kFenceNotLive) << "closed already";
  // The server counts an answer once it is posted: the client may have it before that.
  EXPECT_TRUE(wait_until([&] { return server_->usage().fences_answered == 4; }, 3s));
  EXPECT_EQ(server_->usage().fences_closed, 1u);
  honest_client_works();
}

// Case: PATH_FENCE messages no honest client sends, each on a fresh path: a reserved byte set,
// one byte short, a nil path uuid, the path it comes on.
// Expect: each closes its carrier path with a protocol_error refusal and no FENCE_RSP.
TEST_F(Hostile, AMalformedPathFenceClosesThePath) {
  for (int kind = 0; kind < 4; ++kind) {
    std::vector<Con> cons;
    std::vector<ChunkDesc> chunks;
    sess_ = Uuid16::random();
    path_ = Uuid16::random();
    ASSERT_TRUE(establish(cons, chunks));
    const uint64_t before = server_->refusals().count(refusal::kProtocolError);
    PathFence m = make_path_fence(to_uuid(Uuid16::random()), 0);
    size_t len = sizeof(m);
    if (kind == 0) m.reserved2[3] = 1;
    if (kind == 1) len -= 1;
    if (kind == 2) m = make_path_fence(Uuid{}, 0);
    if (kind == 3) m = make_path_fence(to_uuid(path_), 0);
    EXPECT_FALSE(fence(cons[0], std::span(reinterpret_cast<const std::byte*>(&m), len)).has_value())
        << kind;
    EXPECT_TRUE(closed_by_server(cons)) << kind;
    EXPECT_EQ(server_->refusals().count(refusal::kProtocolError), before + 1) << kind;
  }
  honest_client_works();
}

// Case: a raw client of protocol 2.2 (before the fence) establishes a path, then sends a
// PATH_FENCE anyway.
// Expect: its CON_RSP has no kConRspFence (a 2.2 client refuses unknown flags), and the
// PATH_FENCE is a protocol error that closes the path.
TEST_F(Hostile, AClientOfMinor2IsNotOfferedTheFence) {
  std::vector<Con> cons;
  const auto chunks = peer_->establish(cons, "old", 48, to_uuid(sess_), to_uuid(path_), 64,
                                       static_cast<uint16_t>(kVersionMajor << 8 | 2));
  ASSERT_FALSE(chunks.empty());
  EXPECT_FALSE(fence_offered());
  const uint64_t before = server_->refusals().count(refusal::kProtocolError);
  EXPECT_FALSE(fence(cons[0], to_uuid(Uuid16::random()), 0).has_value());
  EXPECT_TRUE(closed_by_server(cons));
  EXPECT_EQ(server_->refusals().count(refusal::kProtocolError), before + 1);
  honest_client_works();
}

TEST_F(Hostile, IoBeforeTheHandshakeClosesThePath) {
  std::vector<Con> cons;
  for (uint16_t cid = 0; cid < 2; ++cid) {
    auto c = connect(make_con_req(cid, 2, 0, cid == 0, to_uuid(sess_), to_uuid(path_)));
    ASSERT_TRUE(c.ok());
    cons.push_back(std::move(*c));
  }
  // No INFO exchange, so no key; a zero-length write with an IO immediate is still a request.
  ChunkDesc none{};
  send_io(cons[1], none, 0, make_imm(ImmType::io_req, 0));
  EXPECT_TRUE(closed_by_server(cons));
  EXPECT_EQ(vol_.requests_.load(), 0u);
}

TEST_F(Hostile, AnotherSessionsValidChunkKeyIsRefused) { another_sessions_key_is_refused(); }

// Case: two sessions of raw paths, each with a write the volume holds, lose their paths: both
// drain. Connection requests that would start their new sessions (each a new path, from a peer
// of its own, all at once) are held for at most drain_hold (4 s), at most
// max_paths_per_session (3) per uuid and max_sessions (4) in all: ten against one uuid, then
// twenty against both. Meanwhile an honest client opens a session and writes.
// Expect: every request is refused with EAGAIN (past a cap at once: drain_hold_limit; held ones
// after the hold: drain_hold_timeout), none later than the hold plus slack; never more held
// than the caps allow; the honest client is done while requests are still held (it waited for
// none of them); afterwards nothing is held and (tcp) no descriptor is left. Once the writes
// complete, the uuid's next request is accepted at once.
TEST_F(Hostile, ConnectRequestsBehindADrainingSessionAreBoundedAndRefused) {
  // Long enough that an honest client, even on a loaded host, is done well within it.
  static constexpr auto kHold = 4s;
  start_server([&](ServerOptions& so) {
    so.drain_hold = kHold;
    so.max_sessions = 4;
    so.max_paths_per_session = 3;
  });
  auto fds = [] {
    size_t n = 0;
    for ([[maybe_unused]] auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
    return n;
  };
  vol_.hold(true);
  std::vector<Uuid> drained;
  std::vector<ServerRequest*> writes;  // the drained sessions' writes, held
  for (int i = 0; i < 2; ++i) {
    sess_ = Uuid16::random();
    path_ = Uuid16::random();
    std::vector<Con> cons;
    std::vector<ChunkDesc> chunks;
    ASSERT_TRUE(establish(cons, chunks, "drained" + std::to_string(i)));
    write_request(cons[1], chunks[0], 0, chunks[0].key.get(), 'D');
    auto w = wait_held(1);
    ASSERT_EQ(w.size(), 1u) << i;
    writes.push_back(w[0]);
    drained.push_back(to_uuid(sess_));
  }  // the raw connections go: both sessions lose their only path with a write held
  vol_.hold(false);  // the honest client's IO is served
  ASSERT_TRUE(wait_until([&] { return server_->usage().sessions == 0; }, 5s));
  const size_t fds_before = fds();

  // `n` requests at once against the drained uuids (round robin over the first `uuids`);
  // returns the most held at any time seen.
  auto flood = [&](int n, size_t uuids) {
    struct Outcome {
      Status st;
      int err = 0;
      std::chrono::steady_clock::duration took{};
    };
    std::atomic<bool> go{false};
    std::vector<std::future<Outcome>> reqs;
    for (int i = 0; i < n; ++i) {
      const Uuid sess = drained[i % uuids];
      reqs.push_back(std::async(std::launch::async, [&go, this, sess] {
        RawPeer p(addr_);
        while (!go.load()) std::this_thread::yield();
        Outcome o;
        const auto t0 = std::chrono::steady_clock::now();
        auto c = p.connect(make_con_req(0, 2, 0, true, sess, to_uuid(Uuid16::random())), &o.err, 64,
                           kHold + 6s);
        o.took = std::chrono::steady_clock::now() - t0;
        o.st = c.ok() ? Status{} : Status{c.error()};
        return o;
      }));
    }
    const uint64_t timeouts = server_->refusals().count(refusal::kDrainHoldTimeout);
    go = true;
    uint32_t most = 0;
    EXPECT_TRUE(wait_until([&] { return (most = server_->usage().held_connects) > 0; }, 3s));
    honest_client_works();
    EXPECT_GT(server_->usage().held_connects, 0u) << "the honest client waited for no held request";
    EXPECT_EQ(server_->refusals().count(refusal::kDrainHoldTimeout), timeouts);
    for (auto& f : reqs)
      while (f.wait_for(5ms) != std::future_status::ready) most = std::max(most, server_->usage().held_connects);
    for (auto& f : reqs) {
      const Outcome o = f.get();
      EXPECT_EQ(o.st.error(), errc(ECONNREFUSED));
      EXPECT_EQ(o.err, EAGAIN);
      EXPECT_LT(o.took, kHold + 3s) << "a held request is answered after its hold";
    }
    return most;
  };
  const auto& r = server_->refusals();
  EXPECT_LE(flood(10, 1), 3u) << "one uuid: max_paths_per_session held";
  EXPECT_EQ(r.count(refusal::kDrainHoldLimit) + r.count(refusal::kDrainHoldTimeout), 10u);
  EXPECT_GE(r.count(refusal::kDrainHoldTimeout), 1u) << "some were held";
  EXPECT_LE(flood(20, 2), 4u) << "two uuids: max_sessions held in all";
  EXPECT_EQ(r.count(refusal::kDrainHoldLimit) + r.count(refusal::kDrainHoldTimeout), 30u);
  EXPECT_EQ(server_->usage().held_connects, 0u);
  if (g_kind == FabricKind::tcp) {
    EXPECT_TRUE(wait_until([&] { return fds() <= fds_before; }, 3s)) << fds() << " > " << fds_before;
  }

  // The writes complete: both sessions are freed, and a request of the uuid goes through.
  for (auto* q : writes) vol_.serve(*q);
  ASSERT_TRUE(wait_until([&] { return server_->usage().chunk_memory == 0; }, 5s));
  auto c = connect(make_con_req(0, 2, 0, true, drained[0], to_uuid(Uuid16::random())));
  EXPECT_TRUE(c.ok()) << "no longer held";
}

// Case: a raw session of three paths A, B, C. A write in chunk 0 on A is held by the volume
// (copy 1); the same request on B waits behind it (copy 2); a copy on C while B is connected
// is no request an honest client sends. Then, on a new session the same up to copy 2, B's
// connections close and the copy comes on C.
// Expect: the first copy on C is a protocol error that closes C (copy 2 still waits: served
// once copy 1 completes); the second takes copy 2's place, no protocol error, and runs once
// after copy 1.
TEST_F(Hostile, AThirdCopyReplacesTheSecondOnlyOnceItsConnectionClosed) {
  for (bool b_closed : {false, true}) {
    SCOPED_TRACE(b_closed ? "B closed" : "B connected");
    vol_.hold(true);
    sess_ = Uuid16::random();
    std::vector<Con> a, b, c;
    std::vector<ChunkDesc> chunks;
    const std::string name = b_closed ? "third-b-closed" : "third-b-live";
    path_ = Uuid16::random();
    ASSERT_TRUE(establish(a, chunks, name));
    path_ = Uuid16::random();
    ASSERT_TRUE(establish(b, chunks, name));
    path_ = Uuid16::random();
    ASSERT_TRUE(establish(c, chunks, name));
    const uint64_t errors = server_->refusals().count(refusal::kProtocolError);
    const uint64_t served = vol_.requests_.load();
    write_request(a[1], chunks[0], 0, chunks[0].key.get(), '1');
    auto first = wait_held(1);
    ASSERT_EQ(first.size(), 1u);
    vol_.hold(false);
    write_request(b[1], chunks[0], 0, chunks[0].key.get(), '1');
    std::this_thread::sleep_for(100ms);  // deferred behind copy 1
    if (b_closed) {
      b.clear();
      // The server closes B once it sees its connections go.
      ASSERT_TRUE(wait_until([&] {
        bool found = false;
        (void)server_->with_session(name, [&](ServerSession& ss) { found = ss.paths().size() == 2; });
        return found;
      }, 3s));
    }
    write_request(c[1], chunks[0], 0, chunks[0].key.get(), '1');
    if (b_closed) {
      EXPECT_FALSE(RawPeer::closed_by_server(c, 300ms));
      EXPECT_EQ(server_->refusals().count(refusal::kProtocolError), errors);
    } else {
      EXPECT_TRUE(closed_by_server(c));
      EXPECT_EQ(server_->refusals().count(refusal::kProtocolError), errors + 1);
    }
    EXPECT_EQ(vol_.requests_.load(), served + 1) << "nothing beside copy 1";
    first[0]->complete(0);
    EXPECT_TRUE(wait_until([&] { return vol_.requests_.load() == served + 2; }, 3s))
        << "the waiting copy runs after copy 1";
    std::this_thread::sleep_for(100ms);
    EXPECT_EQ(vol_.requests_.load(), served + 2) << "once";
  }
  honest_client_works();
}


// Case (issue 13, class 1, transport side): a write request with a 16-byte user header of 'U'
// is held by the upper layer; the client then rewrites the whole request area of the chunk -
// data, user header and message - with 'Z' through its still valid chunk key.
// Expect: the held request's usr() still reads 'U' (the server's copy; only the payload is the
// client's to change), and the path stays up (the write was allowed).
TEST_F(Hostile, AUserHeaderRewrittenInTheChunkAfterArrivalChangesNothing) {
  std::vector<Con> cons;
  std::vector<ChunkDesc> chunks;
  ASSERT_TRUE(establish(cons, chunks));
  vol_.hold(true);
  std::memset(buf_, 'D', 4096);
  std::memset(buf_ + 4096, 'U', 16);
  WriteMsg m{};
  m.type.set(static_cast<uint16_t>(MsgType::write));
  m.usr_len.set(16);
  m.data_len.set(4096);
  std::memcpy(buf_ + 4096 + 16, &m, sizeof(m));
  auto layout = imm_layout(48, 128 * 1024);
  send_io(cons[1], chunks[2], 4096 + 16 + sizeof(m), *encode_io_req_imm(*layout, 2, 4096 + 16));
  auto held = wait_held(1);
  ASSERT_EQ(held.size(), 1u);
  ASSERT_EQ(held[0]->usr().size(), 16u);
  std::memset(buf_, 'Z', 4096 + 16 + sizeof(m));
  fabric::Sge sz = mr_->sge(0, 4096 + 16 + sizeof(m));
  fabric::SendWr w{};
  w.wr_id = 5;
  w.opcode = Opcode::write;
  w.sg_list = std::span(&sz, 1);
  w.remote_addr = chunks[2].addr.get();
  w.rkey = chunks[2].key.get();
  ASSERT_TRUE(cons[1].conn->post_send(std::span(&w, 1)).ok());
  fabric::Completion wc[8];
  bool done = false;
  for (int i = 0; i < 300 && !done; ++i) {
    size_t n = cons[1].cq->wait(wc, 10ms);
    for (size_t k = 0; k < n; ++k) {
      if (wc[k].wr_id == 5) {
        EXPECT_EQ(wc[k].status, fabric::WcStatus::success);
        done = true;
      }
    }
  }
  ASSERT_TRUE(done);
  ASSERT_EQ(held[0]->data()[0], std::byte{'Z'}) << "the rewrite reached the chunk";
  auto usr = held[0]->usr();
  EXPECT_TRUE(std::all_of(usr.begin(), usr.end(), [](std::byte b) { return b == std::byte{'U'}; }))
      << "usr() is the server's copy, not the chunk";
  held[0]->complete(0);
  vol_.hold(false);
  for (auto& c : cons) EXPECT_EQ(c.conn->state(), fabric::ConnState::connected);
}

class HostileInvalidate : public Hostile {
 protected:
  bool always_invalidate() const override { return true; }
};

TEST_F(HostileInvalidate, AnotherSessionsValidChunkKeyIsRefused) {
  another_sessions_key_is_refused();
}

// Case: the server runs with always_invalidate; a request is held by the upper layer and the
// client writes into its chunk again with the key it was given. Expect: the response makes the
// chunk reachable again - with the same key on the software fabrics (a plain IO_RSP), or a new
// one (RKEY_RSP, then IO_RSP_W_INV) - and a write while the next request is served is refused
// by the fabric: the path breaks and the served bytes are the request's own.
TEST_F(HostileInvalidate, AChunkCannotBeRewrittenWhileItsRequestIsServed) {
  std::vector<Con> cons;
  std::vector<ChunkDesc> chunks;
  ASSERT_TRUE(establish(cons, chunks));
  vol_.hold(true);
  const uint32_t first_key = chunks[0].key.get();
  write_request(cons[1], chunks[0], 0, first_key, 'A');
  auto held = wait_held(1);
  ASSERT_EQ(held.size(), 1u);
  held[0]->complete(0);

  uint32_t new_key = 0;
  bool rsp = false;
  fabric::Completion wc[8];
  for (int i = 0; i < 200 && !rsp; ++i) {
    size_t n = cons[1].cq->wait(wc, 20ms);
    for (size_t k = 0; k < n; ++k) {
      ASSERT_EQ(wc[k].status, fabric::WcStatus::success);
      if (wc[k].opcode == Opcode::recv) {
        RkeyRsp m;
        ASSERT_GE(wc[k].byte_len, sizeof(m));
        std::memcpy(&m, buf_ + 8192, sizeof(m));
        EXPECT_EQ(m.type.get(), static_cast<uint16_t>(MsgType::rkey_rsp));
        EXPECT_EQ(m.buf_id.get(), 0u);
        new_key = m.rkey.get();
      } else if (wc[k].opcode == Opcode::recv_rdma_with_imm) {
        // IO_RSP_W_INV exactly when a new key came first.
        EXPECT_EQ(imm_type(wc[k].imm), new_key != 0 ? ImmType::io_rsp_w_inv : ImmType::io_rsp);
        rsp = true;
      }
    }
  }
  ASSERT_TRUE(rsp);
  if (new_key != 0) {
    EXPECT_NE(new_key, first_key);
  } else {
    new_key = first_key;  // restored in place: the key the client holds works again
  }

  write_request(cons[1], chunks[0], 0, new_key, 'B');
  held = wait_held(1);
  ASSERT_EQ(held.size(), 1u);
  std::memset(buf_, 'X', 4096);
  fabric::Sge sx = mr_->sge(0, 4096);
  fabric::SendWr w{};
  w.opcode = Opcode::write;
  w.sg_list = std::span(&sx, 1);
  w.remote_addr = chunks[0].addr.get();
  w.rkey = new_key;
  ASSERT_TRUE(cons[1].conn->post_send(std::span(&w, 1)).ok());
  EXPECT_TRUE(closed_by_server(cons)) << "a write with a revoked key breaks the connection";
  auto data = held[0]->data();
  ASSERT_EQ(data.size(), 4096u);
  EXPECT_TRUE(std::all_of(data.begin(), data.end(), [](std::byte b) { return b == std::byte{'B'}; }))
      << "the request's bytes did not change while it was served";
  held[0]->complete(0);
  vol_.hold(false);
  honest_client_works();
}

}  // namespace
}  // namespace ibtrs::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  ibtrs::test::g_kind = ibtrs::test::fabric_from_args(argc, argv);
  return RUN_ALL_TESTS();
}
