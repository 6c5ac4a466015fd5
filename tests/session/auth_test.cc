// Host authentication of sessions (DH-HMAC-CHAP on the service connection, ibtrs/auth.h), as a
// specification: honest hosts get in and are told apart, everything else gets EACCES, and
// nothing of a session is revealed before its host proved its secret. The raw client at the
// end speaks the documented messages itself, to record an exchange and play it back and to
// join another host's session.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <deque>
#include <thread>

#include "auth/chap.h"
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

// Two listen addresses of the server (a second path goes to the second), and the client's
// source (rdma needs the client's own device).
Address listen_addr(int i) {
  if (g_kind == FabricKind::tcp) return *Address::parse("tcp:127.0.0.1:0");
  if (g_kind == FabricKind::rdma) {
    const char* b = std::getenv("IBTRS_RDMA_ADDR_B");
    return *Address::parse(std::string("rdma:") + (b ? b : "198.18.0.2") + ":0");
  }
  return *Address::parse("loopback:auth" + std::to_string(i) + ":0");
}
std::optional<Address> source_addr() {
  if (g_kind != FabricKind::rdma) return std::nullopt;
  const char* a = std::getenv("IBTRS_RDMA_ADDR_A");
  return *Address::parse(std::string("rdma:") + (a ? a : "198.18.0.1") + ":0");
}

constexpr const char* kHostA = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-000000000001";
constexpr const char* kHostB = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-0000-4000-8000-000000000002";
constexpr uint16_t kQd = 48;

class AuthSession : public ::testing::Test {
 protected:
  void SetUp() override {
    if (g_kind == FabricKind::rdma && std::getenv("IBTRS_RDMA_ADDR_A") == nullptr)
      GTEST_SKIP() << "rdma runs in the VM rig (tests/vm): IBTRS_RDMA_ADDR_A is not set";
    key_a_ = *Secret::generate();
    key_b_ = *Secret::generate(Secret::Transform::sha512, 64);
    server_key_a_ = *Secret::generate();
    ASSERT_TRUE(keys_.set(kHostA, HostKeys{{key_a_}, server_key_a_}).ok());
    ASSERT_TRUE(keys_.set(kHostB, HostKeys{{key_b_}, std::nullopt}).ok());
  }

  void start(bool allow_any_host = false) {
    ServerOptions so;
    so.listen = {listen_addr(0), listen_addr(1)};
    so.queue_depth = kQd;
    so.io_threads = 1;
    so.handler = &vol_;
    so.authenticator = &keys_;
    so.allow_any_host = allow_any_host;
    so.tls.mode = server_tls_;
    auto s = Server::start(so);
    ASSERT_TRUE(s.ok()) << s.error().message();
    server_ = std::move(*s);
    addr_ = server_->addresses()[0];
    addr2_ = server_->addresses()[1];
  }

  ClientOptions client(const std::string& name, std::optional<Secret> key, const std::string& host = kHostA,
                       std::optional<Secret> server_key = std::nullopt) {
    ClientOptions co;
    co.session_name = name;
    co.paths.push_back(PathSpec{source_addr(), addr_});
    co.io_threads = 1;
    co.connect_timeout = 5s;
    co.reconnect.delay = 50ms;
    co.reconnect.backoff = 0ms;
    co.reconnect.jitter = 0ms;
    co.auth.host_id = host;
    co.auth.key = std::move(key);
    co.auth.server_key = std::move(server_key);
    return co;
  }

  static int open_err(ClientOptions co) {
    auto c = ClientSession::open(std::move(co));
    return c.ok() ? 0 : c.error().value();
  }

  static void io_works(ClientSession& c) {
    auto b = c.alloc_buffer(4096);
    ASSERT_TRUE(b.ok());
    std::memset((*b)->data(), 0x5a, 4096);
    EXPECT_EQ(sync_io(c, IoDir::write, **b, (*b)->data(), 4096, 0), 0);
    EXPECT_EQ(sync_io(c, IoDir::read, **b, (*b)->data(), 4096, 0), 0);
  }

  // The server's view of session `name`: its host and each path's authentication.
  std::pair<std::string, std::vector<PathAuthInfo>> server_view(const std::string& name) {
    std::pair<std::string, std::vector<PathAuthInfo>> out;
    auto st = server_->with_session(name, [&](ServerSession& s) {
      out.first = s.host();
      for (auto& p : s.paths()) out.second.push_back(p.auth);
    });
    EXPECT_TRUE(st.ok()) << name;
    return out;
  }

  RamVolume vol_{1 << 20};
  tls::Options::Mode server_tls_ = tls::Options::Mode::off;  // start()'s tcp listeners
  KeyTable keys_;
  Secret key_a_, key_b_, server_key_a_;
  std::unique_ptr<Server> server_;
  Address addr_, addr2_;
};

// Case: host A with its key. Expect: IO works; both sides show the path authenticated as A;
// the upper layer's session is host A's; the counters say one authenticated path.
TEST_F(AuthSession, KnownHostWithItsKeyGetsIn) {
  start();
  auto c = ClientSession::open(client("a1", key_a_));
  ASSERT_TRUE(c.ok()) << c.error().message();
  io_works(**c);
  auto paths = (*c)->paths();
  ASSERT_EQ(paths.size(), 1u);
  EXPECT_EQ(paths[0].auth.state, AuthState::authenticated);
  EXPECT_EQ(paths[0].auth.host, kHostA);
  EXPECT_FALSE(paths[0].auth.bidirectional);
  EXPECT_EQ(paths[0].auth.method, "dhchap-sha256-x25519");
  auto [host, sp] = server_view("a1");
  EXPECT_EQ(host, kHostA);
  ASSERT_EQ(sp.size(), 1u);
  EXPECT_EQ(sp[0].state, AuthState::authenticated);
  EXPECT_EQ(sp[0].host, kHostA);
  EXPECT_EQ(server_->auth_counters().authenticated, 1u);
  // A second path of the session authenticates too, as the same host.
  ASSERT_TRUE((*c)->add_path(PathSpec{source_addr(), addr2_}).ok());
  EXPECT_EQ(server_->auth_counters().authenticated, 2u);
  EXPECT_EQ(server_view("a1").second.size(), 2u);
}

// Case: host A asks the server to prove the server key too. Expect: in, bidirectional on both
// sides. With a server key the server does not have, or for a host the server has none for:
// EACCES.
TEST_F(AuthSession, BidirectionalProvesTheServer) {
  start();
  auto c = ClientSession::open(client("bidi", key_a_, kHostA, server_key_a_));
  ASSERT_TRUE(c.ok()) << c.error().message();
  io_works(**c);
  EXPECT_TRUE((*c)->paths()[0].auth.bidirectional);
  EXPECT_TRUE(server_view("bidi").second[0].bidirectional);
  EXPECT_EQ(open_err(client("bidi-wrong", key_a_, kHostA, *Secret::generate())), EACCES)
      << "a server that cannot prove the key we trust is not our server";
  EXPECT_EQ(open_err(client("bidi-b", key_b_, kHostB, *Secret::generate())), EACCES)
      << "the server has no server key for host B";
}

// Case: a host the server does not know; host A with B's key, with a fresh random key, with its
// key under another transform. Expect: EACCES each, counted by reason, and the server keeps
// serving host A.
TEST_F(AuthSession, UnknownHostAndWrongKeysAreRefused) {
  start();
  EXPECT_EQ(open_err(client("u", key_a_, "nqn.2014-08.org.example:stranger")), EACCES);
  EXPECT_EQ(open_err(client("w1", key_b_)), EACCES);
  EXPECT_EQ(open_err(client("w2", *Secret::generate())), EACCES);
  auto other_transform = *Secret::parse(key_a_.to_string().replace(8, 1, "2"));
  EXPECT_EQ(open_err(client("w3", other_transform)), EACCES);
  auto n = server_->auth_counters();
  EXPECT_EQ(n.refused_unknown_host, 1u);
  EXPECT_EQ(n.refused_bad_response, 3u);
  EXPECT_EQ(n.authenticated, 0u);
  auto c = ClientSession::open(client("a", key_a_));
  ASSERT_TRUE(c.ok());
  io_works(**c);
  EXPECT_TRUE(server_->sessions().size() == 1u) << "refused paths left no session behind";
}

// Case: a client without credentials. Expect: EACCES at its first connection (no session is
// created); with allow_any_host it gets in anonymously (host ""), while a client that
// authenticates is still checked.
TEST_F(AuthSession, AnonymousOnlyWithAllowAnyHost) {
  start(false);
  EXPECT_EQ(open_err(client("anon", std::nullopt)), EACCES);
  EXPECT_GE(server_->auth_counters().refused_no_credentials, 1u);
  EXPECT_TRUE(server_->sessions().empty());
  server_.reset();
  start(true);
  auto c = ClientSession::open(client("anon", std::nullopt));
  ASSERT_TRUE(c.ok()) << c.error().message();
  io_works(**c);
  EXPECT_EQ((*c)->paths()[0].auth.state, AuthState::none);
  auto [host, sp] = server_view("anon");
  EXPECT_EQ(host, "");
  EXPECT_EQ(sp[0].state, AuthState::none);
  EXPECT_EQ(server_->auth_counters().anonymous, 1u);
  EXPECT_EQ(open_err(client("w", *Secret::generate())), EACCES) << "credentials shown are checked";
}

TEST_F(AuthSession, ServerRefusesToStartAdmittingNobody) {
  ServerOptions so;
  so.listen.push_back(listen_addr(9));
  so.handler = &vol_;
  EXPECT_EQ(Server::start(so).error(), std::errc::invalid_argument);
  ClientOptions co = client("x", key_a_, "has space");
  EXPECT_EQ(open_err(co), EINVAL) << "a key needs a valid host id";
}

// Case: the server rotates host A's key while A's session is up, then drops A's path. Expect:
// the path's reconnect is refused (EACCES) and not retried in a loop: it rests CLOSED with
// EACCES, its IO fails instead of hanging; a session with the new key gets in, the old key is
// refused.
TEST_F(AuthSession, KeyRotationAndNoReconnectLoop) {
  start();
  auto c = ClientSession::open(client("rot", key_a_));
  ASSERT_TRUE(c.ok());
  io_works(**c);
  const Secret rotated = *Secret::generate();
  ASSERT_TRUE(keys_.set(kHostA, HostKeys{{rotated}, std::nullopt}).ok());
  io_works(**c);  // established paths stay
  EXPECT_EQ((*c)->add_path(PathSpec{source_addr(), addr2_}).error(), std::errc::permission_denied)
      << "a path added with the old key";
  EXPECT_EQ((*c)->paths().size(), 1u) << "the refused path is gone";
  const std::string pname = (*c)->paths()[0].name;
  ASSERT_TRUE(server_->with_session("rot", [&](ServerSession& s) { (void)s.disconnect_path(pname); }).ok());
  ASSERT_TRUE(wait_until([&] { return (*c)->paths()[0].state == ClientPathState::closed; }, 10s));
  auto p = (*c)->paths()[0];
  EXPECT_EQ(p.last_error, std::errc::permission_denied);
  EXPECT_EQ(p.auth.state, AuthState::failed);
  const auto failed = p.stats.reconnects_failed;
  std::this_thread::sleep_for(400ms);  // 8 reconnect delays
  EXPECT_EQ((*c)->paths()[0].stats.reconnects_failed, failed) << "no retry loop";
  EXPECT_EQ((*c)->paths()[0].state, ClientPathState::closed);
  auto b = (*c)->alloc_buffer(4096);
  ASSERT_TRUE(b.ok());
  const int e = sync_io(**c, IoDir::write, **b, (*b)->data(), 4096, 0);
  EXPECT_TRUE(e == -ENOTCONN || e == EACCES || e == ENOTCONN) << e;
  EXPECT_EQ(open_err(client("old", key_a_)), EACCES);
  auto n = ClientSession::open(client("new", rotated));
  ASSERT_TRUE(n.ok());
  io_works(**n);
  // The admin fixes the client's credentials by a new session; reconnect_path of the old one
  // still presents the old key.
  EXPECT_EQ((*c)->reconnect_path(pname).error(), std::errc::permission_denied);
}

// ------------------------------------------------------------------------------------------
// A raw client: the documented messages by hand.

class RawAuth : public AuthSession {
 protected:
  void SetUp() override {
    if (g_kind == FabricKind::rdma) GTEST_SKIP() << "the raw client speaks over loopback and tcp";
    AuthSession::SetUp();
    start();
    auto f = core::shared_fabric(addr_.fabric, false);
    ASSERT_TRUE(f.ok());
    auto d = (*f)->domain_for(addr_);
    ASSERT_TRUE(d.ok());
    dom_ = *d;
    auto mr = dom_->register_memory(buf_, sizeof(buf_), fabric::kLocalWrite | fabric::kRemoteWrite);
    ASSERT_TRUE(mr.ok());
    mr_ = std::move(*mr);
  }

  struct Con {
    std::unique_ptr<fabric::CompletionQueue> cq;
    std::unique_ptr<fabric::Connection> conn;
  };
  struct Raw {
    Uuid sess{}, path{};
    std::vector<Con> cons;
    std::string sessname = "raw", pathname = "raw@server";
    std::shared_ptr<tls::Context> tls;  // TLS on its connections (tcp)
    std::vector<std::vector<std::byte>> sent;  // what we sent, in order (to play back)
    std::deque<std::vector<std::byte>> inbox;  // received, not yet taken by recv()
    bool broken = false;
  };

  static constexpr size_t kSlot = 1024;  // INFO_RSP of 48 chunks: 776 bytes
  static constexpr size_t kSlots = 16;

  // Connects the service and one IO connection, the CON_REQ auth flag as given (the IO
  // connection's may differ).
  Status connect(Raw& r, bool auth, std::optional<bool> io_auth = std::nullopt) {
    for (uint16_t cid = 0; cid < 2; ++cid) {
      Con c;
      BASE_ASSIGN_OR_RETURN(c.cq, dom_->create_cq(128));
      auto req = make_con_req(cid, 2, 0, cid == 0, r.sess, r.path, cid == 0 ? auth : io_auth.value_or(auth));
      fabric::ConnectParams p;
      p.remote = addr_;
      p.cq = c.cq.get();
      p.caps.max_recv_wr = kSlots;
      p.caps.max_send_wr = 16;
      p.private_data = as_bytes_of(req);
      p.timeout = 5s;
      p.tls = r.tls;
      BASE_ASSIGN_OR_RETURN(auto res, dom_->connect(p, nullptr));
      c.conn = std::move(res.connection);
      if (cid == 0) {
        fabric::RecvWr rw[kSlots];
        fabric::Sge sg[kSlots];
        for (size_t i = 0; i < kSlots; ++i) {
          sg[i] = mr_->sge(i * kSlot, kSlot);
          rw[i] = fabric::RecvWr{i, std::span(&sg[i], 1)};
        }
        BASE_TRY(c.conn->post_recv(rw));
      }
      r.cons.push_back(std::move(c));
    }
    return {};
  }

  void send(Raw& r, std::span<const std::byte> m) {
    r.sent.emplace_back(m.begin(), m.end());
    std::byte* at = buf_ + kSlots * kSlot + (r.sent.size() % 4) * kSlot;
    std::memcpy(at, m.data(), m.size());
    fabric::Sge s = mr_->sge(static_cast<size_t>(at - buf_), static_cast<uint32_t>(m.size()));
    fabric::SendWr w{};
    w.opcode = Opcode::send;
    w.sg_list = std::span(&s, 1);
    ASSERT_TRUE(r.cons[0].conn->post_send(std::span(&w, 1)).ok());
  }

  // The next message the server sends on the service connection; empty when it closed us (or
  // after 5 s of silence).
  std::vector<std::byte> recv(Raw& r) {
    fabric::Completion wc[8];
    for (int i = 0; i < 200 && r.inbox.empty() && !r.broken; ++i) {
      const size_t n = r.cons[0].cq->wait(wc, 25ms);
      for (size_t k = 0; k < n; ++k) {
        if (wc[k].status != fabric::WcStatus::success) r.broken = true;
        if (r.broken || wc[k].opcode != Opcode::recv) continue;
        const std::byte* b = buf_ + wc[k].wr_id * kSlot;
        r.inbox.emplace_back(b, b + wc[k].byte_len);
      }
    }
    if (r.inbox.empty()) return {};
    auto m = std::move(r.inbox.front());
    r.inbox.pop_front();
    return m;
  }

  void send_info(Raw& r) {
    auto info = make_info_req(r.sessname, r.pathname);
    ASSERT_TRUE(info.ok());
    send(r, as_bytes_of(*info));
  }

  // Answers an AUTH_CHALLENGE as `host` with `key`, as an honest client computes it.
  AuthReply reply_to(Raw& r, std::span<const std::byte> challenge, const std::string& host, const Secret& key) {
    std::string why;
    auto c = parse_auth_challenge(challenge, &why);
    EXPECT_TRUE(c.ok()) << why;
    auto dh = *auth::X25519::generate();
    auth::Transcript t;
    t.tid = c->tid;
    std::memcpy(t.sess_uuid.data(), r.sess.data(), 16);
    std::memcpy(t.path_uuid.data(), r.path.data(), 16);
    t.sessname = r.sessname;
    t.pathname = r.pathname;
    t.host = host;
    AuthReplyView v;
    v.tid = c->tid;
    v.host = host;
    v.dh_public = dh.public_key();
    v.response = *auth::response(auth::Role::host, key, *dh.derive(c->dh_public), c->nonce, c->seqnum, t);
    return *make_auth_reply(v);
  }

  static MsgType type_of(const std::vector<std::byte>& m) {
    auto t = peek_msg_type(m);
    return t.ok() ? *t : static_cast<MsgType>(0);
  }
  static uint16_t failure_reason(const std::vector<std::byte>& m) {
    auto f = parse_auth_failure(m, nullptr);
    return f.ok() ? f->reason : 0;
  }

  static Uuid random_uuid() {
    Uuid u;
    const Uuid16 r = Uuid16::random();
    std::memcpy(u.data(), r.bytes, 16);
    return u;
  }

  fabric::Domain* dom_ = nullptr;
  alignas(4096) std::byte buf_[(kSlots + 4) * kSlot] = {};
  std::unique_ptr<fabric::MemoryRegion> mr_;
};

// Case: the raw client authenticates honestly as host A, records INFO_REQ and AUTH_REPLY, hangs
// up, then plays the same CON_REQs and messages back. Expect: the first exchange gets
// AUTH_SUCCESS and INFO_RSP; the replay gets a fresh challenge, AUTH_FAILURE (EACCES) and never
// an INFO_RSP; the server counts a bad response.
TEST_F(RawAuth, ReplayedExchangeIsRefused) {
  Raw r;
  r.sess = random_uuid();
  r.path = random_uuid();
  ASSERT_TRUE(connect(r, true).ok());
  send_info(r);
  auto ch = recv(r);
  ASSERT_EQ(type_of(ch), MsgType::auth_challenge);
  send(r, as_bytes_of(reply_to(r, ch, kHostA, key_a_)));
  EXPECT_EQ(type_of(recv(r)), MsgType::auth_success);
  EXPECT_EQ(type_of(recv(r)), MsgType::info_rsp);
  const auto recorded = r.sent;
  r.cons.clear();  // hang up
  ASSERT_TRUE(wait_until([&] { return server_->sessions().empty(); }, 10s));

  Raw replay;
  replay.sess = r.sess;
  replay.path = r.path;
  ASSERT_TRUE(connect(replay, true).ok());
  send(replay, recorded[0]);  // INFO_REQ
  auto ch2 = recv(replay);
  ASSERT_EQ(type_of(ch2), MsgType::auth_challenge);
  EXPECT_NE(ch2, ch) << "a fresh challenge";
  send(replay, recorded[1]);  // the recorded AUTH_REPLY
  auto verdict = recv(replay);
  ASSERT_EQ(type_of(verdict), MsgType::auth_failure);
  EXPECT_EQ(failure_reason(verdict), EACCES);
  EXPECT_TRUE(recv(replay).empty()) << "no INFO_RSP: the server closes the path";
  EXPECT_EQ(server_->auth_counters().refused_bad_response, 1u);
  replay.cons.clear();
  ASSERT_TRUE(wait_until([&] { return server_->sessions().empty(); }, 10s));

  // The same, with the recorded reply's transaction id patched to the new challenge's: the
  // response itself is bound to the old challenge and DH values.
  Raw patched;
  patched.sess = r.sess;
  patched.path = r.path;
  ASSERT_TRUE(connect(patched, true).ok());
  send(patched, recorded[0]);
  auto ch3 = recv(patched);
  ASSERT_EQ(type_of(ch3), MsgType::auth_challenge);
  AuthReply old;
  ASSERT_EQ(recorded[1].size(), sizeof(old));
  std::memcpy(&old, recorded[1].data(), sizeof(old));
  old.tid.set(parse_auth_challenge(ch3, nullptr)->tid);
  send(patched, as_bytes_of(old));
  auto v3 = recv(patched);
  ASSERT_EQ(type_of(v3), MsgType::auth_failure);
  EXPECT_EQ(failure_reason(v3), EACCES);
  EXPECT_TRUE(recv(patched).empty());
  EXPECT_EQ(server_->auth_counters().refused_bad_response, 2u);
  EXPECT_EQ(server_->auth_counters().authenticated, 1u) << "only the honest exchange";
}

// Case: host A's honest session is up; the raw client adds a path to it (its session uuid and
// name) as host B with B's valid key, then as host A with a wrong key. Expect: EACCES both
// times (a session of host A, a wrong key), and A's session keeps working with one path.
TEST_F(RawAuth, PathOfAnotherHostOrKeyIsRefused) {
  auto c = ClientSession::open(client("victim", key_a_));
  ASSERT_TRUE(c.ok());
  Raw r;
  const Uuid16 u = (*c)->uuid();
  std::memcpy(r.sess.data(), u.bytes, 16);
  r.path = random_uuid();
  r.sessname = "victim";
  ASSERT_TRUE(connect(r, true).ok());
  send_info(r);
  auto ch = recv(r);
  ASSERT_EQ(type_of(ch), MsgType::auth_challenge);
  send(r, as_bytes_of(reply_to(r, ch, kHostB, key_b_)));
  auto verdict = recv(r);
  ASSERT_EQ(type_of(verdict), MsgType::auth_failure);
  EXPECT_EQ(failure_reason(verdict), EACCES);
  EXPECT_EQ(server_->auth_counters().refused_host_mismatch, 1u);

  Raw k;
  k.sess = r.sess;
  k.path = random_uuid();
  k.sessname = "victim";
  ASSERT_TRUE(connect(k, true).ok());
  send_info(k);
  auto ch2 = recv(k);
  ASSERT_EQ(type_of(ch2), MsgType::auth_challenge);
  send(k, as_bytes_of(reply_to(k, ch2, kHostA, *Secret::generate())));
  auto v2 = recv(k);
  ASSERT_EQ(type_of(v2), MsgType::auth_failure);
  EXPECT_EQ(failure_reason(v2), EACCES);
  EXPECT_EQ(server_->auth_counters().refused_bad_response, 1u);
  EXPECT_TRUE(recv(r).empty() && recv(k).empty()) << "the server closes refused paths itself";
  io_works(**c);
  EXPECT_TRUE(wait_until([&] { return server_view("victim").second.size() == 1u; }, 5s));
  EXPECT_EQ(server_view("victim").first, kHostA);
}

// Case: protocol abuse: an AUTH_REPLY on a path that did not ask to authenticate (and a server
// that refuses anonymous paths anyway), an AUTH_REPLY before INFO_REQ, a second INFO_REQ during
// the challenge, a path whose connections disagree on authentication, and garbage instead of a
// reply. Expect: each refused or closed, never an INFO_RSP.
TEST_F(RawAuth, OutOfOrderAndMalformedMessages) {
  Raw anon;
  anon.sess = random_uuid();
  anon.path = random_uuid();
  EXPECT_FALSE(connect(anon, false).ok()) << "allow_any_host is off";

  Raw early;
  early.sess = random_uuid();
  early.path = random_uuid();
  ASSERT_TRUE(connect(early, true).ok());
  AuthReplyView v;
  v.host = kHostA;
  v.tid = 1;
  send(early, as_bytes_of(*make_auth_reply(v)));
  auto m = recv(early);
  EXPECT_TRUE(m.empty() || type_of(m) == MsgType::auth_failure);
  EXPECT_NE(type_of(recv(early)), MsgType::info_rsp);

  Raw twice;
  twice.sess = random_uuid();
  twice.path = random_uuid();
  ASSERT_TRUE(connect(twice, true).ok());
  send_info(twice);
  ASSERT_EQ(type_of(recv(twice)), MsgType::auth_challenge);
  send_info(twice);
  EXPECT_TRUE(recv(twice).empty()) << "a second INFO_REQ closes the path";

  Raw mixed;
  mixed.sess = random_uuid();
  mixed.path = random_uuid();
  EXPECT_FALSE(connect(mixed, true, false).ok()) << "the IO connection says it does not authenticate";
  EXPECT_EQ(mixed.cons.size(), 1u) << "the service connection was accepted";
  mixed.cons.clear();

  Raw junk;
  junk.sess = random_uuid();
  junk.path = random_uuid();
  ASSERT_TRUE(connect(junk, true).ok());
  send_info(junk);
  auto ch = recv(junk);
  ASSERT_EQ(type_of(ch), MsgType::auth_challenge);
  auto rep = reply_to(junk, ch, kHostA, key_a_);
  rep.reserved[0] = 1;
  send(junk, as_bytes_of(rep));
  auto verdict = recv(junk);
  ASSERT_EQ(type_of(verdict), MsgType::auth_failure);
  EXPECT_EQ(failure_reason(verdict), EPROTO);
  EXPECT_GE(server_->auth_counters().refused_protocol, 2u);
  EXPECT_EQ(server_->auth_counters().authenticated, 0u);
  // The server still serves honest hosts.
  auto c = ClientSession::open(client("after", key_a_));
  ASSERT_TRUE(c.ok());
  io_works(**c);
}

// ---------------------------------------------------------------------------------------------
// TLS on tcp paths, keyed by the host keys (ServerOptions::tls required)

class TlsAuth : public RawAuth {
 protected:
  void SetUp() override {
    if (g_kind != FabricKind::tcp) GTEST_SKIP() << "TLS is the tcp fabric's";
    server_tls_ = tls::Options::Mode::required;
    RawAuth::SetUp();
  }
  ClientOptions tls_client(const std::string& name, std::optional<Secret> key, const std::string& host = kHostA) {
    ClientOptions co = client(name, std::move(key), host);
    co.tls.mode = tls::Options::Mode::on;
    return co;
  }
  uint64_t refused(std::string_view reason) const { return server_->refusals().count(reason); }
};

// Case: host A maps with TLS on, its PSK derived from its DH-HMAC-CHAP key.
// Expect: IO works; both ends report TLS on with the same cipher, the server naming A's PSK
// identity; the path is also authenticated as A.
TEST_F(TlsAuth, HostKeyPskCarriesTheSession) {
  auto c = ClientSession::open(tls_client("t1", key_a_));
  ASSERT_TRUE(c.ok()) << c.error().message();
  io_works(**c);
  auto paths = (*c)->paths();
  ASSERT_EQ(paths.size(), 1u);
  EXPECT_TRUE(paths[0].tls.on);
  EXPECT_FALSE(paths[0].tls.cipher.empty());
  EXPECT_EQ(paths[0].auth.state, AuthState::authenticated);
  std::vector<ServerPathInfo> sp;
  ASSERT_TRUE(server_->with_session("t1", [&](ServerSession& s) { sp = s.paths(); }).ok());
  ASSERT_EQ(sp.size(), 1u);
  EXPECT_TRUE(sp[0].tls.on);
  EXPECT_EQ(sp[0].tls.cipher, paths[0].tls.cipher);
  EXPECT_EQ(sp[0].tls.peer, tls_psk_of(kHostA, key_a_)->identity);
  EXPECT_EQ(sp[0].auth.host, kHostA);
}

// Case: a client without TLS; one with TLS whose host the server does not know; one with host
// A's id and a key that is not A's; one that asks for TLS with no host key to derive a PSK from.
// Expect: EPROTONOSUPPORT at once (not retried until the connect timeout), EACCES twice (the
// TLS handshake fails before any session exists), EINVAL before connecting; the server counts
// one plaintext peer and two failed handshakes, and lists no session.
TEST_F(TlsAuth, PlaintextAndForeignPsksAreRefusedForGood) {
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(open_err(client("plain", key_a_)), EPROTONOSUPPORT);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s) << "a plaintext client is not left to retry";
  EXPECT_EQ(open_err(tls_client("stranger", *Secret::generate(), "nqn.2014-08.org.example:stranger")), EACCES);
  EXPECT_EQ(open_err(tls_client("wrong-key", *Secret::generate())), EACCES);
  EXPECT_EQ(open_err(tls_client("no-key", std::nullopt)), EINVAL);
  EXPECT_TRUE(wait_until([&] { return refused(refusal::kListenPlaintext) >= 1 && refused(refusal::kListenTlsFailed) >= 2; }, 5s))
      << refused(refusal::kListenPlaintext) << " plaintext, " << refused(refusal::kListenTlsFailed) << " tls failed";
  EXPECT_EQ(server_->auth_counters().authenticated, 0u);
  for (const char* n : {"plain", "stranger", "wrong-key", "no-key"})
    EXPECT_FALSE(server_->with_session(n, [](ServerSession&) {}).ok()) << n;
}

// Case: a raw client runs TLS with host B's PSK (it holds B's key) and then answers the
// DH-HMAC-CHAP challenge as host A with A's key.
// Expect: AUTH_FAILURE (EACCES), counted as a host mismatch, never an INFO_RSP: one path proves
// one host, in TLS and in DH-HMAC-CHAP alike.
TEST_F(TlsAuth, TlsIdentityMustBeTheAuthenticatedHost) {
  Raw r;
  r.sess = random_uuid();
  r.path = random_uuid();
  tls::Config tc;
  tc.role = tls::Role::client;
  tc.psk = *tls_psk_of(kHostB, key_b_);
  r.tls = *tls::Context::create(tc);
  ASSERT_TRUE(connect(r, true).ok());
  send_info(r);
  auto ch = recv(r);
  ASSERT_EQ(type_of(ch), MsgType::auth_challenge);
  send(r, as_bytes_of(reply_to(r, ch, kHostA, key_a_)));
  auto verdict = recv(r);
  ASSERT_EQ(type_of(verdict), MsgType::auth_failure);
  EXPECT_EQ(failure_reason(verdict), EACCES);
  EXPECT_EQ(server_->auth_counters().refused_host_mismatch, 1u);
  EXPECT_TRUE(recv(r).empty()) << "closed, no INFO_RSP";
}

}  // namespace
}  // namespace ibtrs::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto k = ibtrs::test::fabric_arg(argc, argv);
  if (!k) return 2;
  ibtrs::test::g_kind = *k;
  return RUN_ALL_TESTS();
}
