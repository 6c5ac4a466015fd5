// The hostile-peer suite (issue 13): the real ibnbd-server, in its own process, attacked as a
// raw client of the documented wire formats would (docs/protocol.md, docs/fabric.md): no
// credentials, 127.0.0.1, nothing but what the server enforces. One case per class of the
// issue. After each attack the same checks (expect_healthy): the server is alive; its control
// socket answers `ibnbd server session list` promptly; an honest client on a session of its own
// maps, writes and verifies within a deadline; the server's VmRSS and descriptor count stay
// within a bound of what they were before; the victim's bytes are intact.
//
// Cases named ClassN_... for N in 2, 3, 4, 6 and Class8Remote_ reproduce failures fixed by other
// parts of the issue (A: per-session domains and random keys; B: bounded backlog, non-blocking
// accept, caps and handshake deadlines; C: authentication). tests/hostile/CMakeLists.txt keeps
// them out of the ctest run until those parts land (HOSTILE_AWAITING); run them by hand with
//   build/tests/hostile/hostile_peers --gtest_filter='*Class2_*'
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include "hostile_harness.h"
#include "raw_peers.h"

namespace ibnbd::hostile {
namespace {

namespace iproto = ibtrs::proto;
using Clock = std::chrono::steady_clock;

// Bounds of the checks after an attack, over what the server held before it (one honest round
// trip done). 96 MiB: 24 sessions' worth of chunks at the suite's queue depth, where the
// unbounded cases grow by gigabytes; 64 descriptors: what an attack that leaked one per
// connection would blow through.
constexpr uint64_t kRssSlackKb = 96 * 1024;
constexpr size_t kFdSlack = 64;
// An honest round trip (connect, map, 1 MiB write + read, unmap) takes milliseconds here; the
// deadline is what a stalled server misses by far (19 s, 29.7 s, never in the issue).
constexpr Ms kHonestDeadline{5000};
constexpr Ms kListDeadline{2000};

constexpr uint64_t kVictimBytes = 2 << 20;
constexpr uint32_t kVictimSeed = 77;

class HostilePeer : public ::testing::Test {
 protected:
  void start(const std::vector<std::string>& extra_args = {}) {
    server_ = std::make_unique<ServerUnderTest>(extra_args);
    ASSERT_TRUE(server_->ok()) << server_->why();
    server_->make_file("honest.img", 8 << 20);
    server_->make_file("victim.img", 8 << 20);
    server_->make_file("attacker.img", 1 << 20);
    auto warm = honest_round_trip(server_->address(), "honest-0", "honest.img", 0, kHonestDeadline);
    ASSERT_EQ(warm.err, 0) << warm.what;
    auto u = server_->usage();
    ASSERT_TRUE(u.has_value());
    baseline_ = *u;
  }

  // The victim: a session of its own with victim.img mapped rw and kVictimBytes of a known
  // pattern written at offset 0.
  void victim_writes() {
    auto s = HonestSession::open(server_->address(), "victim", kHonestDeadline);
    ASSERT_TRUE(s.ok()) << s.error().message();
    victim_ = std::move(*s);
    auto d = victim_->map("victim.img", AccessMode::rw);
    ASSERT_TRUE(d.ok()) << d.error().message();
    victim_dev_ = *d;
    for (uint64_t off = 0; off < kVictimBytes; off += 1 << 20)
      ASSERT_EQ(victim_->write_verify(*victim_dev_, off, 1 << 20, kVictimSeed), 0);
  }

  void expect_victim_intact() {
    if (victim_dev_ == nullptr) return;
    auto b = server_->file_bytes("victim.img", 0, kVictimBytes);
    ASSERT_EQ(b.size(), kVictimBytes);
    EXPECT_TRUE(matches(b.data(), b.size(), 0, kVictimSeed)) << "the victim's bytes on the server changed";
    EXPECT_EQ(victim_->verify(*victim_dev_, 0, 1 << 20, kVictimSeed), 0) << "the victim reads its bytes";
  }

  // What every case asserts after its attack.
  void expect_healthy(const std::string& after) {
    SCOPED_TRACE("after " + after);
    ASSERT_TRUE(server_->alive()) << "the server died; its log:\n" << server_->log();
    auto l = server_->session_list(Ms(10000));
    EXPECT_EQ(l.exit_code, 0) << l.err;
    EXPECT_LT(l.took, kListDeadline) << "ibnbd server session list took " << l.took.count() << " ms";
    ++honest_;
    auto h = honest_round_trip(server_->address(), "honest-" + std::to_string(honest_), "honest.img",
                               static_cast<uint32_t>(honest_), kHonestDeadline);
    EXPECT_EQ(h.err, 0) << h.what;
    EXPECT_LT(h.took, kHonestDeadline) << "the honest round trip took " << h.took.count() << " ms";
    expect_bounded();
    expect_victim_intact();
  }

  void expect_bounded() {
    auto u = server_->usage();
    ASSERT_TRUE(u.has_value()) << "no /proc entry: the server is gone";
    EXPECT_LT(u->rss_kb, baseline_.rss_kb + kRssSlackKb)
        << "VmRSS " << u->rss_kb / 1024 << " MiB, " << baseline_.rss_kb / 1024 << " MiB before";
    EXPECT_LT(u->fds, baseline_.fds + kFdSlack) << u->fds << " descriptors, " << baseline_.fds << " before";
  }

  // The server's own port (tcp:127.0.0.1:PORT).
  uint16_t port() const { return server_->address().port; }

  void TearDown() override {
    victim_dev_.reset();
    victim_.reset();
    if (server_ == nullptr || !server_->ok()) return;
    EXPECT_EQ(server_->stop(Ms(15000)), std::optional<int>(0)) << "ibnbd-server did not stop cleanly";
    if (HasFailure()) std::cerr << "---- ibnbd-server log ----\n" << server_->log();
  }

  std::unique_ptr<ServerUnderTest> server_;
  Usage baseline_;
  std::unique_ptr<HonestSession> victim_;
  std::shared_ptr<RemoteDevice> victim_dev_;
  int honest_ = 0;
};

RawFabricPeer::Options attacker(const std::string& name = "attacker") {
  RawFabricPeer::Options o;
  o.session_name = name;
  return o;
}

// ---------------------------------------------------------------------------------------------
// Class 1: remote crash

// Case: a raw client sends OPENs, 32 at a time, and right behind each rewrites the message's
// type in the server's chunk (it holds the chunk's key): between the IO thread's validation and
// the control thread's work. 16 rounds, with types the server does not know and the types of
// other messages.
// Expect: every OPEN is answered (success, or EAGAIN past the session's share of the control
// thread); the attacker's session stays up; the server lives (before the fix it aborted on an
// uncaught std::bad_variant_access, 3 of 3 tries).
TEST_F(HostilePeer, Class1_ControlRequestRewrittenAfterValidation) {
  start();
  victim_writes();
  auto peer = RawFabricPeer::connect(server_->address(), attacker());
  ASSERT_TRUE(peer.ok()) << peer.error().message();
  RawFabricPeer& p = **peer;
  ASSERT_EQ(p.sess_info(), 0);
  const auto usr = open_msg(AccessMode::ro, "attacker.img");
  const uint16_t types[] = {77, 0xffff, static_cast<uint16_t>(proto::MsgType::io),
                            static_cast<uint16_t>(proto::MsgType::sess_info_rsp)};
  int opened = 0, refused = 0;
  for (int round = 0; round < 16; ++round) {
    std::byte t[2];
    const uint16_t type = types[round % 4];
    std::memcpy(t, &type, 2);  // little-endian on our hosts, as the wire wants
    for (uint32_t c = 0; c < p.queue_depth(); ++c) {
      ASSERT_TRUE(p.post_read(c, usr, sizeof(proto::OpenRspMsg), size_t{c} * 64).ok());
      // The user header of a read request starts the chunk: its first two bytes are the type.
      ASSERT_TRUE(p.rdma_write(p.chunks()[c].addr.get(), p.chunks()[c].key.get(), t).ok());
    }
    for (uint32_t c = 0; c < p.queue_depth(); ++c) {
      auto r = p.next_response(Ms(10000));
      ASSERT_TRUE(r.ok()) << "round " << round << ": " << r.error().message() << " -- the server:\n"
                          << (server_->alive() ? "alive" : "dead");
      EXPECT_TRUE(r->err == 0 || r->err == EAGAIN || r->err == EBADMSG) << "errno " << r->err;
      (r->err == 0 ? opened : refused)++;
    }
  }
  EXPECT_GT(opened, 0);
  EXPECT_TRUE(p.connected());
  expect_healthy("512 OPENs rewritten after validation");
}

// ---------------------------------------------------------------------------------------------
// Class 5: control-plane stall

// One flooding session: keeps every chunk busy with a CLOSE of an id it never opened (3 of 4)
// or an OPEN of a name that does not exist, a new one as each answer comes, until `stop`.
struct Flood {
  std::atomic<uint64_t> answered{0}, eagain{0}, unexpected{0};
  std::string broke;  // why the session ended early

  void run(RawFabricPeer& p, const std::atomic<bool>& stop) {
    uint32_t n = 0;
    auto post = [&](uint32_t c) {
      ++n;
      if (n % 4 == 0)
        return p.post_read(c, open_msg(AccessMode::rw, "missing-" + std::to_string(n) + ".img"),
                           sizeof(proto::OpenRspMsg), size_t{c} * 64);
      return p.post_write(c, close_msg(1 + n % 200));  // ids below the server's 256 per session
    };
    for (uint32_t c = 0; c < p.queue_depth(); ++c) (void)post(c);
    while (!stop.load()) {
      auto r = p.next_response(Ms(20000));
      if (!r.ok()) {
        broke = r.error().message();
        return;
      }
      answered.fetch_add(1);
      if (r->err == EAGAIN) eagain.fetch_add(1);
      else if (r->err != ENODEV && r->err != ENOENT) unexpected.fetch_add(1);
      if (!post(r->permit_id).ok()) return;
    }
    for (uint32_t c = 0; c < p.queue_depth(); ++c) (void)p.next_response(Ms(20000));
  }
};

// Case: two sessions flood the control thread for 3 s with CLOSEs of ids they never opened and
// OPENs of names that do not exist, 32 in flight each at all times. Meanwhile the admin lists
// the sessions and another session maps, writes and verifies.
// Expect: the listing within 2 s and the honest round trip within 5 s, during the flood (before:
// every such CLOSE quiesced each IO thread, ~0.1 s, and 200 of them stalled both for 19 s); each
// flood request is answered ENODEV / ENOENT, or EAGAIN past the session's share.
TEST_F(HostilePeer, Class5_ControlFloodDoesNotStallOthers) {
  start();
  victim_writes();
  std::vector<std::unique_ptr<RawFabricPeer>> peers;
  for (int i = 0; i < 2; ++i) {
    auto p = RawFabricPeer::connect(server_->address(), attacker("flood-" + std::to_string(i)));
    ASSERT_TRUE(p.ok()) << p.error().message();
    ASSERT_EQ((*p)->sess_info(), 0);
    peers.push_back(std::move(*p));
  }
  std::atomic<bool> stop{false};
  Flood floods[2];
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) threads.emplace_back([&, i] { floods[i].run(*peers[i], stop); });
  std::this_thread::sleep_for(Ms(300));
  auto l = server_->session_list(Ms(30000));
  EXPECT_EQ(l.exit_code, 0) << l.err;
  EXPECT_LT(l.took, kListDeadline) << "session list during the flood: " << l.took.count() << " ms";
  auto h = honest_round_trip(server_->address(), "honest-flood", "honest.img", 5, Ms(30000));
  EXPECT_EQ(h.err, 0) << h.what;
  EXPECT_LT(h.took, kHonestDeadline) << "an honest round trip during the flood: " << h.took.count() << " ms";
  std::this_thread::sleep_for(Ms(3000) - std::min(Ms(3000), l.took + h.took));
  stop.store(true);
  for (auto& t : threads) t.join();
  for (auto& f : floods) {
    EXPECT_TRUE(f.broke.empty()) << "a flooding session broke: " << f.broke;
    EXPECT_EQ(f.unexpected.load(), 0u);
    EXPECT_GT(f.answered.load(), 1000u) << "invalid control requests are cheap";
    std::cerr << "flood: " << f.answered.load() << " requests answered in 3 s, " << f.eagain.load()
              << " of them EAGAIN\n";
  }
  expect_healthy("a 3 s control flood");
}

// ---------------------------------------------------------------------------------------------
// Class 7: aliases

// Case: victim.img held rw by the victim; in the export directory a symlink and a hard link to
// it; and the same file as "./victim.img", its absolute path and "//" + its absolute path.
// Expect: another session (the client library, and a raw client) gets EBUSY rw through every
// alias: no second writer. The victim's own session refuses each alias as a second mapping
// (EEXIST) -- before, each became a device of its own with the same id, and unmapping one broke
// the others (EIO) -- and its mapping keeps working; its bytes are intact.
TEST_F(HostilePeer, Class7_AliasesAreOneDevice) {
  start();
  victim_writes();
  ASSERT_EQ(::symlink("victim.img", (server_->export_dir() + "/link.img").c_str()), 0);
  ASSERT_EQ(::link((server_->export_dir() + "/victim.img").c_str(), (server_->export_dir() + "/hard.img").c_str()),
            0);
  const std::string abs = server_->export_dir() + "/victim.img";
  const std::vector<std::string> aliases{"link.img", "hard.img", "./victim.img", abs, "/" + abs};

  auto other = HonestSession::open(server_->address(), "other", kHonestDeadline);
  ASSERT_TRUE(other.ok());
  for (auto& a : aliases) EXPECT_EQ((*other)->map(a, AccessMode::rw).error(), errc(EBUSY)) << a;
  auto peer = RawFabricPeer::connect(server_->address(), attacker());
  ASSERT_TRUE(peer.ok()) << peer.error().message();
  ASSERT_EQ((*peer)->sess_info(), 0);
  for (auto& a : aliases) EXPECT_EQ((*peer)->open(a, AccessMode::rw), EBUSY) << a << " (raw OPEN)";
  EXPECT_EQ((*peer)->open("link.img", AccessMode::migration), 0) << "migration: the one second writer";
  EXPECT_EQ((*peer)->open("hard.img", AccessMode::rw), EBUSY) << "the same device, in another mode";

  for (auto& a : aliases) {
    EXPECT_EQ(victim_->map(a, AccessMode::rw).error(), errc(EEXIST)) << a;
    EXPECT_EQ(victim_->unmap(a).error(), errc(ENOENT)) << a << " was never mapped";
  }
  EXPECT_EQ(victim_->session().devices().size(), 1u);
  EXPECT_EQ(victim_->write_verify(*victim_dev_, 4 << 20, 1 << 20, 3), 0) << "the one mapping works";
  other->reset();
  peer->reset();
  expect_healthy("aliases");
}

// ---------------------------------------------------------------------------------------------
// Class 8, local surfaces: the client daemon's control socket and NBD exports

// Case: an ibnbd-client daemon maps a device; a second daemon is started on its control socket;
// the first exports the device over NBD on tcp without the word insecure, and on a unix socket.
// Expect: the second daemon exits 1 at once naming the first (before: it took the socket over
// and the first, with its mapped devices, became unreachable); the first still answers and
// lists the device; tcp without insecure is refused (EPERM) and nothing listens; the unix
// socket is owner-only.
TEST_F(HostilePeer, Class8Local_DaemonSocketAndNbdExports) {
  start();
  server_->make_file("local.img", 4 << 20);
  const std::string dir = server_->dir();
  const std::string sock = dir + "/cl.sock";
  auto first = Daemon::spawn({client_bin(), "--control-socket", sock, "--ready-file", dir + "/cl.ready",
                              "--state-dir", dir + "/cl-state"},
                             dir + "/cl.log");
  ASSERT_NE(first, nullptr);
  ASSERT_TRUE(wait_for_file(dir + "/cl.ready", Ms(10000))) << first->log();
  auto cli = [&](std::vector<std::string> args) {
    std::vector<std::string> argv{cli_bin(), "--socket", sock, "-f", "json", "client"};
    argv.insert(argv.end(), args.begin(), args.end());
    return run_command(argv, Ms(10000));
  };
  auto m = cli({"device", "map", "local.img", "from", server_->address().to_string(), "rw"});
  ASSERT_EQ(m.exit_code, 0) << m.err;

  auto second = Daemon::spawn({client_bin(), "--control-socket", sock, "--state-dir", dir + "/cl2-state"},
                              dir + "/cl2.log");
  ASSERT_NE(second, nullptr);
  auto st = second->wait_exit(Ms(5000), false);
  ASSERT_TRUE(st.has_value()) << "a second daemon on a live socket keeps running";
  EXPECT_EQ(*st, 1);
  EXPECT_NE(second->log().find("pid " + std::to_string(first->pid())), std::string::npos) << second->log();
  auto l = cli({"device", "list"});
  EXPECT_EQ(l.exit_code, 0) << l.err;
  EXPECT_NE(l.out.find("local.img"), std::string::npos) << "the first daemon keeps its device: " << l.out;

  auto tcp = cli({"device", "export", "local.img", "tcp", "127.0.0.1:0"});
  EXPECT_EQ(tcp.exit_code, EPERM) << tcp.out << tcp.err;
  EXPECT_NE(tcp.err.find("insecure"), std::string::npos) << tcp.err;
  auto ex = cli({"device", "export", "local.img", "unix", dir + "/nbd.sock"});
  ASSERT_EQ(ex.exit_code, 0) << ex.err;
  struct stat sb {};
  ASSERT_EQ(::stat((dir + "/nbd.sock").c_str(), &sb), 0);
  EXPECT_EQ(sb.st_mode & 0777, 0600u) << "the NBD socket is its owner's only";
  auto e = cli({"device", "exports"});
  EXPECT_EQ(e.out.find("tcp:"), std::string::npos) << "nothing listens on tcp: " << e.out;
  EXPECT_EQ(cli({"device", "unmap", "local.img"}).exit_code, 0);
  EXPECT_EQ(first->wait_exit(Ms(10000), true), std::optional<int>(0)) << first->log();
  expect_healthy("a second client daemon and NBD exports");
}

// ---------------------------------------------------------------------------------------------
// Classes fixed by other parts of the issue: faithful attacks, kept out of the ctest run until
// those parts land (tests/hostile/CMakeLists.txt, HOSTILE_AWAITING).

// Case (class 2, part A): the victim writes and verifies 64 KiB blocks while a second session
// guesses the tcp provider's keys of the victim's chunks (slot << 12 | generation, slots handed
// out in order; chunk regions mapped next to each other) and, with a key that works, overwrites
// the victim's chunks with 0xEE.
// Expect: no guess is accepted (each breaks only the attacker's own connection), the victim's
// verifies all pass and its bytes on the server are its own (before: the key was found in 39
// probes, 38 blocks of the victim's file held the attacker's bytes).
TEST_F(HostilePeer, Class2_AnotherSessionsChunksAreOutOfReach) {
  start();
  victim_writes();
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> rounds{0}, failures{0};
  std::thread victim([&] {
    for (uint32_t i = 0; !stop.load(); ++i) {
      const uint64_t off = uint64_t{i % 32} * 65536;
      if (victim_->write_verify(*victim_dev_, off, 65536, kVictimSeed) != 0) failures.fetch_add(1);
      rounds.fetch_add(1);
    }
  });
  const std::vector<std::byte> evil(65536, std::byte{0xEE});
  int probes = 0, accepted = 0;
  const auto end = Clock::now() + Ms(8000);
  for (uint32_t slot_back = 1; slot_back <= 12 && Clock::now() < end; ++slot_back) {
    for (uint32_t gen = 0; gen < 3 && Clock::now() < end; ++gen) {
      for (int region = -3; region <= 3 && Clock::now() < end; ++region) {
        if (region == 0) continue;
        auto peer = RawFabricPeer::connect(server_->address(), attacker("probe"));
        if (!peer.ok()) continue;
        RawFabricPeer& p = **peer;
        const auto& mine = p.chunks()[0];
        const uint32_t key = (((mine.key.get() >> 12) - slot_back) << 12) | gen;
        const int64_t span = int64_t{p.queue_depth()} * p.chunk_size();
        const uint64_t addr = mine.addr.get() + static_cast<uint64_t>(region * span);
        ++probes;
        if (!p.rdma_write(addr, key, std::span(evil.data(), 4096)).ok()) continue;
        // A write the server's fabric refused ends the stream before this request's answer.
        if (p.request_write(close_msg(9999), {}, Ms(2000)) != ENODEV) continue;
        ++accepted;
        for (int k = 0; k < 200 && p.connected(); ++k)
          for (uint32_t c = 0; c < 8; ++c) (void)p.rdma_write(addr + uint64_t{c} * p.chunk_size(), key, evil);
      }
    }
  }
  stop.store(true);
  victim.join();
  std::cerr << "class 2: " << probes << " probes, " << accepted << " accepted; victim " << rounds.load()
            << " rounds, " << failures.load() << " failed\n";
  EXPECT_EQ(accepted, 0) << "a session wrote into another session's chunks";
  EXPECT_EQ(failures.load(), 0u) << "the victim read back bytes it did not write";
  for (uint32_t b = 0; b < 32; ++b) {
    auto bytes = server_->file_bytes("victim.img", uint64_t{b} * 65536, 65536);
    EXPECT_TRUE(matches(bytes.data(), bytes.size(), uint64_t{b} * 65536, kVictimSeed)) << "block " << b;
  }
  expect_healthy("key probes");
}

// Case (class 3, part B): raw tcp peers open a device, then send READs of 32 KiB in 64 pieces
// into every chunk, again and again, and never read or acknowledge what comes back; for 3 s,
// with a new session whenever the server drops one.
// Expect: the server stops taking their requests or disconnects them; VmRSS stays within the
// bound during the attack and after the peers are gone (before: 8 MB -> 1.24 GB in 4 s, still
// 1.19 GB after the session closed).
TEST_F(HostilePeer, Class3_PeersThatNeverAcknowledgeCannotGrowTheServer) {
  start();
  victim_writes();
  const uint32_t len = 32 * 1024;
  uint64_t max_rss = 0;
  uint32_t sent = 0, sessions = 0;
  std::vector<std::unique_ptr<RawTcpSession>> peers;  // kept open until the end
  const auto end = Clock::now() + Ms(3000);
  while (Clock::now() < end) {
    auto s = RawTcpSession::connect(port(), "never-acks-" + std::to_string(sessions));
    if (!s.ok()) break;  // refused: a cap did its work
    RawTcpSession& p = **s;
    peers.push_back(std::move(*s));
    ++sessions;
    ASSERT_TRUE(p.post_read(0, sess_info_msg(), sizeof(proto::SessInfoRspMsg)).ok());
    ASSERT_TRUE(p.answer(Ms(5000)).ok());
    ASSERT_TRUE(p.post_read(0, open_msg(AccessMode::ro, "attacker.img"), sizeof(proto::OpenRspMsg)).ok());
    auto opened = p.answer(Ms(5000));
    ASSERT_TRUE(opened.ok());
    ASSERT_EQ(opened->err, 0);
    // Device id 0. From here on nothing is read or acknowledged: rounds of one READ per chunk
    // (each answer is 65 work requests), 1 ms apart so that most chunks have been served (and
    // freed, before their answer is sent) when they are reused; a chunk that has not ("third
    // request on busy chunk") costs the session, and the next one takes over.
    for (bool up = true; up && Clock::now() < end;) {
      for (uint32_t c = 0; c < p.queue_depth() && up; ++c, ++sent)
        up = p.post_read(c, io_msg(0, IoOp::read, 0, len), len, iproto::kMaxReadDescs).ok();
      if (auto u = server_->usage()) max_rss = std::max(max_rss, u->rss_kb);
      std::this_thread::sleep_for(Ms(1));
    }
  }
  std::cerr << "class 3: " << sessions << " sessions sent " << sent << " READs; VmRSS at most "
            << max_rss / 1024 << " MiB, " << baseline_.rss_kb / 1024 << " MiB before\n";
  EXPECT_LT(max_rss, baseline_.rss_kb + kRssSlackKb) << "VmRSS reached " << max_rss / 1024 << " MiB";
  peers.clear();
  std::this_thread::sleep_for(Ms(500));
  expect_healthy("peers that never acknowledged");
}

// Case (class 4, part B): 15 sockets connect to the server's port and say nothing.
// Expect: an honest client maps, writes and verifies within the deadline while they sit there
// (before: one thread read each handshake with a 5 s timeout; 6 idle sockets delayed a map by
// 29.7 s, 15 made it fail with ETIMEDOUT).
TEST_F(HostilePeer, Class4_IdleSocketsDoNotHoldUpAccept) {
  start();
  victim_writes();
  std::vector<std::unique_ptr<SilentSocket>> idle;
  for (int i = 0; i < 15; ++i) {
    auto s = SilentSocket::connect(port());
    ASSERT_TRUE(s.ok()) << s.error().message();
    idle.push_back(std::move(*s));
  }
  auto h = honest_round_trip(server_->address(), "honest-beside-idle", "honest.img", 9, kHonestDeadline);
  EXPECT_EQ(h.err, 0) << h.what;
  EXPECT_LT(h.took, kHonestDeadline) << h.took.count() << " ms with 15 idle sockets";
  expect_bounded();
  idle.clear();
  expect_healthy("15 idle sockets");
}

// Case (class 6, part B): with --always-invalidate and the default queue depth (each path
// registers 512 chunk regions beside the session's), 150 new sessions connect the first
// connection of a path of two, and never the second, and never send INFO.
// Expect: an honest client still maps, writes and verifies (within the deadline, or refused
// with a clear reason until the half-open paths' handshake deadline frees them, at most 15 s);
// VmRSS and descriptors stay bounded (before: 127 half-open connections exhausted the 65,536
// key table and every later client failed with ENOMEM; 200 cost +160 MB, +600 fds).
TEST_F(HostilePeer, Class6_HalfOpenPathsDoNotExhaustTheServer) {
  start({"--always-invalidate", "--queue-depth", "512"});
  victim_writes();
  std::vector<std::unique_ptr<RawFabricPeer>> half_open;
  for (int i = 0; i < 150; ++i) {
    RawFabricPeer::Options o = attacker("half-" + std::to_string(i));
    o.info = false;
    o.connect = 1;  // the service connection of a path of two
    auto p = RawFabricPeer::connect(server_->address(), o);
    if (!p.ok()) continue;  // refused: a cap did its work
    half_open.push_back(std::move(*p));
  }
  std::cerr << "class 6: " << half_open.size() << " half-open paths accepted\n";
  HonestResult h;
  const auto t0 = Clock::now();
  for (;;) {
    h = honest_round_trip(server_->address(), "honest-beside-half-open", "honest.img", 11, kHonestDeadline);
    if (h.err == 0 || Clock::now() - t0 > Ms(15000)) break;
    std::this_thread::sleep_for(Ms(500));
  }
  EXPECT_EQ(h.err, 0) << h.what;
  expect_bounded();
  half_open.clear();
  expect_healthy("150 half-open paths");
}

// Case (class 8, part C): a raw client with no credentials opens a volume nobody holds, rw, and
// writes over it.
// Expect: the OPEN is refused (EACCES) before any byte moves; the volume is intact (before:
// anyone who reached the port opened any volume under the search path rw).
TEST_F(HostilePeer, Class8Remote_AnUnknownHostOpensNothing) {
  start();
  server_->make_file("other.img", 1 << 20);
  {
    std::vector<std::byte> b(1 << 20);
    pattern(b.data(), b.size(), 0, 99);
    std::ofstream f(server_->export_dir() + "/other.img", std::ios::binary | std::ios::in | std::ios::out);
    f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  }
  auto peer = RawFabricPeer::connect(server_->address(), attacker("stranger"));
  if (peer.ok()) {
    RawFabricPeer& p = **peer;
    const int info = p.sess_info();
    proto::OpenRsp rsp;
    const int e = info == 0 ? p.open("other.img", AccessMode::rw, &rsp) : info;
    EXPECT_NE(e, 0) << "an unauthenticated session opened other.img rw";
    if (e == 0) {
      const std::vector<std::byte> evil(4096, std::byte{0xEE});
      (void)p.request_write(io_msg(rsp.device_id, IoOp::write, 0, 4096), evil);
    }
  }
  auto b = server_->file_bytes("other.img", 0, 1 << 20);
  EXPECT_TRUE(matches(b.data(), b.size(), 0, 99)) << "other.img was written by a stranger";
  expect_healthy("an unauthenticated OPEN");
}

}  // namespace
}  // namespace ibnbd::hostile
