// The hostile-peer suite (issue 13): the real ibnbd-server, in its own process, configured as
// users run it -- every client authenticates as a host of its config, each host opens only what
// its grants allow (docs/security.d/auth.md), no --allow-any-host -- and attacked as a raw client
// of the documented wire formats would (docs/protocol.md, docs/fabric.md), on 127.0.0.1, with
// nothing but what the server enforces. The attackers that need a session are an insider: host
// "mallory", with valid credentials and grants of its own (mallory/**, shared/** ro), running
// the authentication exchange by hand; those of the classes before a session (idle sockets,
// half-open paths) come without credentials, and class 8's outsiders without or with forged
// ones. The victims and the honest clients are host "honest" (honest/**). One case (or a few)
// per class of the issue.
// After each attack the same checks (expect_healthy): the server is alive; its control socket
// answers `ibnbd server session list` promptly; an honest client on a session of its own maps,
// writes and verifies within a deadline; the server's VmRSS and descriptor count stay within a
// bound of what they were before; the victim's bytes are intact.
//
// Classes 2 and 6 reproduced failures that part A of the issue fixed (per-session protection
// domains and random keys: a guessed key of another session's chunk was accepted; half-open
// paths of --always-invalidate sessions exhausted the shared key table, ENOMEM).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
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
// connection would blow through. Under ThreadSanitizer the server's RSS carries the shadow of
// every byte it touches and the sync state of every thread it ran (class 6's 127 held half-open
// sessions: 195 MiB against 37 MiB before), so the bound is 3 times as wide.
#if defined(__SANITIZE_THREAD__)
constexpr uint64_t kRssSlackKb = 3 * 96 * 1024;
#else
constexpr uint64_t kRssSlackKb = 96 * 1024;
#endif
constexpr size_t kFdSlack = 64;
// A tcp connection the server holds: its socket and its completion queue's epoll and eventfd.
constexpr size_t kFdsPerConnection = 3;
// An honest round trip (connect and authenticate, map, 1 MiB write + read, unmap) takes
// milliseconds here; the deadline is what a stalled server misses by far (19 s, 29.7 s, never in
// the issue).
constexpr Ms kHonestDeadline{5000};
constexpr Ms kListDeadline{2000};

constexpr uint64_t kVictimBytes = 2 << 20;
constexpr uint32_t kVictimSeed = 77;

// The devices (paths under the export directory; the grants in hostile_harness.h): honest's
// under honest/, the insider's under mallory/, and one it may only read under shared/.
const std::string kHonestImg = "honest/honest.img";  // the honest round trips'
const std::string kVictimImg = "honest/victim.img";  // held rw by the victim during attacks
const std::string kAttackerImg = "mallory/attacker.img";
const std::string kSharedImg = "shared/base.img";

class HostilePeer : public ::testing::Test {
 protected:
  void start(const std::vector<std::string>& extra_args = {}) {
    server_ = std::make_unique<ServerUnderTest>(extra_args);
    ASSERT_TRUE(server_->ok()) << server_->why();
    server_->make_file(kHonestImg, 8 << 20);
    server_->make_file(kVictimImg, 8 << 20);
    server_->make_file(kAttackerImg, 1 << 20);
    server_->make_file(kSharedImg, 1 << 20);
    auto warm = honest_trip("honest-0", 0, kHonestDeadline);
    ASSERT_EQ(warm.err, 0) << warm.what;
    auto u = server_->usage();
    ASSERT_TRUE(u.has_value());
    baseline_ = *u;
  }

  ibtrs::ClientAuth honest() const { return server_->credentials(kHonest); }
  ibtrs::ClientAuth mallory() const { return server_->credentials(kMallory); }

  // An honest round trip on kHonestImg, as host honest.
  HonestResult honest_trip(const std::string& session, uint32_t seed, Ms deadline) const {
    return honest_round_trip(server_->address(), honest(), session, kHonestImg, seed, deadline);
  }

  // The victim: host honest, a session of its own with kVictimImg mapped rw and kVictimBytes of a
  // known pattern written at offset 0.
  void victim_writes() {
    auto s = HonestSession::open(server_->address(), honest(), "victim", kHonestDeadline);
    ASSERT_TRUE(s.ok()) << s.error().message();
    victim_ = std::move(*s);
    auto d = victim_->map(kVictimImg, AccessMode::rw);
    ASSERT_TRUE(d.ok()) << d.error().message();
    victim_dev_ = *d;
    for (uint64_t off = 0; off < kVictimBytes; off += 1 << 20)
      ASSERT_EQ(victim_->write_verify(*victim_dev_, off, 1 << 20, kVictimSeed), 0);
  }

  void expect_victim_intact() {
    if (victim_dev_ == nullptr) return;
    auto b = server_->file_bytes(kVictimImg, 0, kVictimBytes);
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
    auto h = honest_trip("honest-" + std::to_string(honest_), static_cast<uint32_t>(honest_), kHonestDeadline);
    EXPECT_EQ(h.err, 0) << h.what;
    EXPECT_LT(h.took, kHonestDeadline) << "the honest round trip took " << h.took.count() << " ms";
    expect_bounded();
    expect_victim_intact();
  }

  // `held`: connections of the attack the server still holds, at kFdsPerConnection each.
  void expect_bounded(size_t held = 0) {
    auto u = server_->usage();
    ASSERT_TRUE(u.has_value()) << "no /proc entry: the server is gone";
    EXPECT_LT(u->rss_kb, baseline_.rss_kb + kRssSlackKb)
        << "VmRSS " << u->rss_kb / 1024 << " MiB, " << baseline_.rss_kb / 1024 << " MiB before";
    EXPECT_LT(u->fds, baseline_.fds + kFdSlack + held * kFdsPerConnection)
        << u->fds << " descriptors, " << baseline_.fds << " before, " << held << " connections held";
  }

  // The server's own port (tcp:127.0.0.1:PORT).
  uint16_t port() const { return server_->address().port; }

  // A raw client authenticated as the insider.
  RawFabricPeer::Options attacker(const std::string& name = "attacker") const {
    RawFabricPeer::Options o;
    o.session_name = name;
    o.auth = mallory();
    return o;
  }

  // A raw client of the insider with its session announced (SESS_INFO); null, with a failure
  // added, when that did not work.
  std::unique_ptr<RawFabricPeer> insider(const std::string& name = "attacker") const {
    auto p = RawFabricPeer::connect(server_->address(), attacker(name));
    if (!p.ok()) {
      ADD_FAILURE() << "the insider's raw session " << name << ": " << p.error().message();
      return nullptr;
    }
    if (const int e = (*p)->sess_info(); e != 0) {
      ADD_FAILURE() << "SESS_INFO of " << name << ": " << e;
      return nullptr;
    }
    return std::move(*p);
  }

  // An ibnbd-client daemon (`tag` names its socket, ready file, state directory and log in the
  // server's directory) with `extra` arguments, ready; and the CLI on its socket.
  std::unique_ptr<Daemon> client_daemon(const std::string& tag, const std::vector<std::string>& extra) {
    const std::string dir = server_->dir();
    std::vector<std::string> argv{client_bin(),        "--control-socket", dir + "/" + tag + ".sock",
                                  "--ready-file",      dir + "/" + tag + ".ready",
                                  "--state-dir",       dir + "/" + tag + "-state"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto d = Daemon::spawn(argv, dir + "/" + tag + ".log");
    if (d != nullptr && !wait_for_file(dir + "/" + tag + ".ready", Ms(10000))) {
      ADD_FAILURE() << "ibnbd-client " << tag << " not ready: " << d->log();
      return nullptr;
    }
    return d;
  }
  CommandResult cli(const std::string& tag, const std::vector<std::string>& args) const {
    std::vector<std::string> argv{cli_bin(), "--socket", server_->dir() + "/" + tag + ".sock", "-f", "json", "client"};
    argv.insert(argv.end(), args.begin(), args.end());
    return run_command(argv, Ms(10000));
  }

  // Writes `len` bytes of pattern(seed) at offset 0 of `name`, straight into the export.
  void fill(const std::string& name, size_t len, uint32_t seed) const {
    std::vector<std::byte> b(len);
    pattern(b.data(), b.size(), 0, seed);
    std::ofstream f(server_->export_dir() + "/" + name, std::ios::binary | std::ios::in | std::ios::out);
    f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  }

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

// ---------------------------------------------------------------------------------------------
// Class 1: remote crash

// Case: a raw client (the insider, authenticated) sends OPENs of its own device, 32 at a time, and right behind each rewrites the message's
// type in the server's chunk (it holds the chunk's key): between the IO thread's validation and
// the control thread's work. 16 rounds, with types the server does not know and the types of
// other messages.
// Expect: every OPEN is answered (success, or EAGAIN past the session's share of the control
// thread); the attacker's session stays up; the server lives (before the fix it aborted on an
// uncaught std::bad_variant_access, 3 of 3 tries).
TEST_F(HostilePeer, Class1_ControlRequestRewrittenAfterValidation) {
  ASSERT_NO_FATAL_FAILURE(start());
  ASSERT_NO_FATAL_FAILURE(victim_writes());
  auto peer = insider();
  ASSERT_NE(peer, nullptr);
  RawFabricPeer& p = *peer;
  const auto usr = open_msg(AccessMode::ro, kAttackerImg);
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
        return p.post_read(c, open_msg(AccessMode::rw, "mallory/missing-" + std::to_string(n) + ".img"),
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

// Case: two sessions of the insider flood the control thread for 3 s with CLOSEs of ids they
// never opened and OPENs of names that do not exist in its directory (so they pass its grants and
// reach the filesystem), 32 in flight each at all times. Meanwhile the admin lists
// the sessions and another session maps, writes and verifies.
// Expect: the listing within 2 s and the honest round trip within 5 s, during the flood (before:
// every such CLOSE quiesced each IO thread, ~0.1 s, and 200 of them stalled both for 19 s); each
// flood request is answered ENODEV / ENOENT, or EAGAIN past the session's share.
TEST_F(HostilePeer, Class5_ControlFloodDoesNotStallOthers) {
  ASSERT_NO_FATAL_FAILURE(start());
  ASSERT_NO_FATAL_FAILURE(victim_writes());
  std::vector<std::unique_ptr<RawFabricPeer>> peers;
  for (int i = 0; i < 2; ++i) {
    peers.push_back(insider("flood-" + std::to_string(i)));
    ASSERT_NE(peers.back(), nullptr);
  }
  std::atomic<bool> stop{false};
  Flood floods[2];
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) threads.emplace_back([&, i] { floods[i].run(*peers[i], stop); });
  std::this_thread::sleep_for(Ms(300));
  auto l = server_->session_list(Ms(30000));
  EXPECT_EQ(l.exit_code, 0) << l.err;
  EXPECT_LT(l.took, kListDeadline) << "session list during the flood: " << l.took.count() << " ms";
  auto h = honest_trip("honest-flood", 5, Ms(30000));
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

// Case: the insider holds its own file mallory/own.img rw through its library session; in its
// directory a symlink and a hard link to it; and the same file as "./mallory/own.img", its
// absolute path and "//" + its absolute path.
// Expect: another session of the insider (the client library, and a raw client) gets EBUSY rw
// through every alias: no second writer. The holding session refuses each alias as a second
// mapping (EEXIST) -- before, each became a device of its own with the same id, and unmapping
// one broke the others (EIO) -- and its mapping keeps working; the victim's bytes are intact.
TEST_F(HostilePeer, Class7_AliasesAreOneDevice) {
  ASSERT_NO_FATAL_FAILURE(start());
  ASSERT_NO_FATAL_FAILURE(victim_writes());
  const std::string own = "mallory/own.img";
  server_->make_file(own, 4 << 20);
  auto holder = HonestSession::open(server_->address(), mallory(), "holder", kHonestDeadline);
  ASSERT_TRUE(holder.ok()) << holder.error().message();
  auto held = (*holder)->map(own, AccessMode::rw);
  ASSERT_TRUE(held.ok()) << held.error().message();
  ASSERT_EQ((*holder)->write_verify(**held, 0, 1 << 20, 21), 0);

  const std::string dir = server_->export_dir() + "/mallory";
  ASSERT_EQ(::symlink("own.img", (dir + "/link.img").c_str()), 0);
  ASSERT_EQ(::link((dir + "/own.img").c_str(), (dir + "/hard.img").c_str()), 0);
  const std::string abs = server_->export_dir() + "/" + own;
  const std::vector<std::string> aliases{"mallory/link.img", "mallory/hard.img", "./" + own, abs, "/" + abs};

  auto other = HonestSession::open(server_->address(), mallory(), "other", kHonestDeadline);
  ASSERT_TRUE(other.ok()) << other.error().message();
  for (auto& a : aliases) EXPECT_EQ((*other)->map(a, AccessMode::rw).error(), errc(EBUSY)) << a;
  auto peer = insider();
  ASSERT_NE(peer, nullptr);
  for (auto& a : aliases) EXPECT_EQ(peer->open(a, AccessMode::rw), EBUSY) << a << " (raw OPEN)";
  EXPECT_EQ(peer->open("mallory/link.img", AccessMode::migration), 0) << "migration: the one second writer";
  EXPECT_EQ(peer->open("mallory/hard.img", AccessMode::rw), EBUSY) << "the same device, in another mode";

  for (auto& a : aliases) {
    EXPECT_EQ((*holder)->map(a, AccessMode::rw).error(), errc(EEXIST)) << a;
    EXPECT_EQ((*holder)->unmap(a).error(), errc(ENOENT)) << a << " was never mapped";
  }
  EXPECT_EQ((*holder)->session().devices().size(), 1u);
  EXPECT_EQ((*holder)->write_verify(**held, 2 << 20, 1 << 20, 3), 0) << "the one mapping works";
  held->reset();
  holder->reset();
  other->reset();
  peer.reset();
  expect_healthy("aliases");
}

// Case: in the insider's own directory, where its grant lets it open anything, names that lead
// into honest's directory: a relative symlink to honest/data.img (nobody holds it), one to the
// victim's file (held rw), a symlink to honest's whole directory (mallory/sub/data.img), and an
// absolute symlink. The insider opens each, ro and rw, raw and through the client library, and
// writes 0xEE over what it got.
// Expect: every OPEN is refused (EACCES: a grant holds for the file a name leads to, not for the
// name; the absolute symlink leaves the search root, EXDEV); honest's bytes are intact -- the
// victim's and data.img's.
TEST_F(HostilePeer, Class7_SymlinkIntoAnotherHostsDirectoryIsRefused) {
  ASSERT_NO_FATAL_FAILURE(start());
  ASSERT_NO_FATAL_FAILURE(victim_writes());
  server_->make_file("honest/data.img", 1 << 20);
  fill("honest/data.img", 1 << 20, 99);
  const std::string dir = server_->export_dir() + "/mallory";
  ASSERT_EQ(::symlink("../honest/data.img", (dir + "/steal.img").c_str()), 0);
  ASSERT_EQ(::symlink("../honest/victim.img", (dir + "/steal-victim.img").c_str()), 0);
  ASSERT_EQ(::symlink("../honest", (dir + "/sub").c_str()), 0);
  ASSERT_EQ(::symlink((server_->export_dir() + "/honest/data.img").c_str(), (dir + "/steal-abs.img").c_str()), 0);
  const std::vector<std::string> names{"mallory/steal.img", "mallory/steal-victim.img", "mallory/sub/data.img"};

  auto peer = insider();
  ASSERT_NE(peer, nullptr);
  RawFabricPeer& p = *peer;
  const std::vector<std::byte> evil(4096, std::byte{0xEE});
  for (auto& n : names) {
    for (AccessMode m : {AccessMode::rw, AccessMode::ro}) {
      proto::OpenRsp rsp;
      const int e = p.open(n, m, &rsp);
      EXPECT_EQ(e, EACCES) << n << " " << to_string(m);
      if (e == 0 && m == AccessMode::rw) (void)p.request_write(io_msg(rsp.device_id, IoOp::write, 0, 4096), evil);
    }
  }
  const int abs = p.open("mallory/steal-abs.img", AccessMode::rw);
  EXPECT_TRUE(abs == EXDEV || abs == EACCES) << "an absolute symlink: " << std::strerror(abs);
  auto lib = HonestSession::open(server_->address(), mallory(), "lib", kHonestDeadline);
  ASSERT_TRUE(lib.ok()) << lib.error().message();
  for (auto& n : names) {
    auto d = (*lib)->map(n, AccessMode::rw);
    EXPECT_EQ(d.error(), errc(EACCES)) << n << " (library)";
    if (d.ok()) (void)(*lib)->write(**d, 4096, 4096, 1);
  }

  auto b = server_->file_bytes("honest/data.img", 0, 1 << 20);
  EXPECT_TRUE(matches(b.data(), b.size(), 0, 99)) << "honest/data.img was written through a symlink";
  lib->reset();
  peer.reset();
  expect_healthy("symlinks into another host's directory");
}

// ---------------------------------------------------------------------------------------------
// Class 8, local surfaces: the client daemon's control socket and NBD exports

// Case: an ibnbd-client daemon (host honest's key) maps a device; a second daemon is started on
// its control socket; the first exports the device over NBD on tcp without the word insecure,
// and on a unix socket.
// Expect: the second daemon exits 1 at once naming the first (before: it took the socket over
// and the first, with its mapped devices, became unreachable); the first still answers and
// lists the device; tcp without insecure is refused (EPERM) and nothing listens; the unix
// socket is owner-only.
TEST_F(HostilePeer, Class8Local_DaemonSocketAndNbdExports) {
  ASSERT_NO_FATAL_FAILURE(start());
  const std::string dev = "honest/local.img";
  server_->make_file(dev, 4 << 20);
  const std::string dir = server_->dir();
  auto first = client_daemon("cl", {"--host-key", server_->key_file(kHonest)});
  ASSERT_NE(first, nullptr);
  auto m = cli("cl", {"device", "map", dev, "from", server_->address().to_string(), "rw"});
  ASSERT_EQ(m.exit_code, 0) << m.err;

  auto second = Daemon::spawn({client_bin(), "--control-socket", dir + "/cl.sock", "--state-dir", dir + "/cl2-state"},
                              dir + "/cl2.log");
  ASSERT_NE(second, nullptr);
  auto st = second->wait_exit(Ms(5000), false);
  ASSERT_TRUE(st.has_value()) << "a second daemon on a live socket keeps running";
  EXPECT_EQ(*st, 1);
  EXPECT_NE(second->log().find("pid " + std::to_string(first->pid())), std::string::npos) << second->log();
  auto l = cli("cl", {"device", "list"});
  EXPECT_EQ(l.exit_code, 0) << l.err;
  EXPECT_NE(l.out.find("local.img"), std::string::npos) << "the first daemon keeps its device: " << l.out;

  auto tcp = cli("cl", {"device", "export", dev, "tcp", "127.0.0.1:0"});
  EXPECT_EQ(tcp.exit_code, EPERM) << tcp.out << tcp.err;
  EXPECT_NE(tcp.err.find("insecure"), std::string::npos) << tcp.err;
  auto ex = cli("cl", {"device", "export", dev, "unix", dir + "/nbd.sock"});
  ASSERT_EQ(ex.exit_code, 0) << ex.err;
  struct stat sb {};
  ASSERT_EQ(::stat((dir + "/nbd.sock").c_str(), &sb), 0);
  EXPECT_EQ(sb.st_mode & 0777, 0600u) << "the NBD socket is its owner's only";
  auto e = cli("cl", {"device", "exports"});
  EXPECT_EQ(e.out.find("tcp:"), std::string::npos) << "nothing listens on tcp: " << e.out;
  EXPECT_EQ(cli("cl", {"device", "unmap", dev}).exit_code, 0);
  EXPECT_EQ(first->wait_exit(Ms(10000), true), std::optional<int>(0)) << first->log();
  expect_healthy("a second client daemon and NBD exports");
}

// ---------------------------------------------------------------------------------------------
// Class 2: one session writes another's chunks (fixed by part A)

// Case: the victim writes and verifies 64 KiB blocks while the insider, in sessions of its own,
// guesses the tcp provider's keys of the victim's chunks (slot << 12 | generation, slots handed
// out in order; chunk regions mapped next to each other) and, with a key that works, overwrites
// the victim's chunks with 0xEE.
// Expect: no guess is accepted (each breaks only the attacker's own connection), the victim's
// verifies all pass and its bytes on the server are its own (before: the key was found in 39
// probes, 38 blocks of the victim's file held the attacker's bytes).
TEST_F(HostilePeer, Class2_AnotherSessionsChunksAreOutOfReach) {
  ASSERT_NO_FATAL_FAILURE(start());
  ASSERT_NO_FATAL_FAILURE(victim_writes());
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

// ---------------------------------------------------------------------------------------------
// Class 3: unbounded memory

// Case: raw tcp peers of the insider open its device, then send READs of 32 KiB in 64 pieces
// into every chunk, again and again, and never read or acknowledge what comes back; for 3 s,
// with a new session whenever the server drops one or stops reading it (a send stalled 1 s).
// Expect: the server stops taking their requests or disconnects them; VmRSS stays within the
// bound during the attack and after the peers are gone (before: 8 MB -> 1.24 GB in 4 s, still
// 1.19 GB after the session closed).
TEST_F(HostilePeer, Class3_PeersThatNeverAcknowledgeCannotGrowTheServer) {
  ASSERT_NO_FATAL_FAILURE(start());
  ASSERT_NO_FATAL_FAILURE(victim_writes());
  const uint32_t len = 32 * 1024;
  uint64_t max_rss = 0;
  uint32_t sent = 0, sessions = 0;
  std::vector<std::unique_ptr<RawTcpSession>> peers;  // kept open until the end
  const auto end = Clock::now() + Ms(3000);
  while (Clock::now() < end) {
    auto s = RawTcpSession::connect(port(), "never-acks-" + std::to_string(sessions), mallory());
    if (!s.ok()) break;  // refused: a cap did its work
    RawTcpSession& p = **s;
    peers.push_back(std::move(*s));
    ++sessions;
    ASSERT_TRUE(p.post_read(0, sess_info_msg(), sizeof(proto::SessInfoRspMsg)).ok());
    ASSERT_TRUE(p.answer(Ms(5000)).ok());
    ASSERT_TRUE(p.post_read(0, open_msg(AccessMode::ro, kAttackerImg), sizeof(proto::OpenRspMsg)).ok());
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

// ---------------------------------------------------------------------------------------------
// Class 4: head-of-line accept

// Case: 15 sockets connect to the server's port and say nothing (no credentials needed for that).
// Expect: an honest client maps, writes and verifies within the deadline while they sit there
// (before: one thread read each handshake with a 5 s timeout; 6 idle sockets delayed a map by
// 29.7 s, 15 made it fail with ETIMEDOUT).
TEST_F(HostilePeer, Class4_IdleSocketsDoNotHoldUpAccept) {
  ASSERT_NO_FATAL_FAILURE(start());
  ASSERT_NO_FATAL_FAILURE(victim_writes());
  std::vector<std::unique_ptr<SilentSocket>> idle;
  for (int i = 0; i < 15; ++i) {
    auto s = SilentSocket::connect(port());
    ASSERT_TRUE(s.ok()) << s.error().message();
    idle.push_back(std::move(*s));
  }
  auto h = honest_trip("honest-beside-idle", 9, kHonestDeadline);
  EXPECT_EQ(h.err, 0) << h.what;
  EXPECT_LT(h.took, kHonestDeadline) << h.took.count() << " ms with 15 idle sockets";
  expect_bounded();
  idle.clear();
  expect_healthy("15 idle sockets");
}

// ---------------------------------------------------------------------------------------------
// Class 6: key-table exhaustion, unlimited sessions

// Case: with --always-invalidate and a queue depth of 512 (each path registers 512 chunk regions
// beside the session's), 150 new sessions connect the first connection of a path of two, and
// never the second, and never send INFO. They have no credentials: their CON_REQs ask to
// authenticate (a CON_REQ that does not is refused at once), and the challenge, which comes
// after INFO_REQ, never does.
// Expect: the server holds at most --max-sessions (128 here, below the 150: the default is
// 256; under TSan 40 sessions against 32) of them (each new one beyond pushes out
// the oldest half-open one); an honest client still maps,
// writes and verifies (retried for at most 15 s); VmRSS stays bounded, and descriptors within
// what the held connections cost (3 each: the socket and its completion queue's epoll and
// eventfd) -- bounded by the session cap; after they hang up, within the usual bound (before:
// 127 half-open connections exhausted the 65,536-entry key table and every later client failed
// with ENOMEM; 200 cost +160 MB, +600 fds).
// Under TSan the same with 40 half-open sessions against a cap of 32: the eviction and the
// bounds are the same code, and 150 sessions' registrations cost 24 s of the TSan stage (4 s
// here without it).
#if defined(__SANITIZE_THREAD__)
constexpr int kHalfOpen = 40;
constexpr int kHalfOpenCap = 32;
#else
constexpr int kHalfOpen = 150;
constexpr int kHalfOpenCap = 128;
#endif
TEST_F(HostilePeer, Class6_HalfOpenPathsDoNotExhaustTheServer) {
  ASSERT_NO_FATAL_FAILURE(start({"--always-invalidate", "--queue-depth", "512", "--max-sessions",
                                 std::to_string(kHalfOpenCap)}));
  ASSERT_NO_FATAL_FAILURE(victim_writes());
  std::vector<std::unique_ptr<RawFabricPeer>> half_open;
  for (int i = 0; i < kHalfOpen; ++i) {
    RawFabricPeer::Options o;
    o.session_name = "half-" + std::to_string(i);
    o.claim_auth = true;
    o.info = false;
    o.connect = 1;  // the service connection of a path of two
    auto p = RawFabricPeer::connect(server_->address(), o);
    if (!p.ok()) continue;  // refused: a cap did its work
    half_open.push_back(std::move(*p));
  }
  std::cerr << "class 6: " << half_open.size() << " half-open paths accepted\n";
  // A new session beyond the cap pushes out the oldest half-open one (counted as
  // handshake_evicted), so the server never holds more than --max-sessions of them. On a slow
  // host (TSan at load 15 took 42 s for the 150) the first ones reach the handshake deadline
  // (30 s) before the cap and are dropped as handshake_timeout instead.
  const auto refused = server_->refusals(Ms(5000));
  ASSERT_FALSE(refused.empty()) << "ibnbd server refusals list";
  auto count = [&](const char* k) -> uint64_t { return refused.count(k) ? refused.at(k) : 0; };
  const uint64_t dropped = count("handshake_evicted") + count("handshake_timeout");
  const size_t held = half_open.size() - std::min<size_t>(dropped, half_open.size());
  std::cerr << "class 6: the server holds " << held << " of them\n";
  EXPECT_LE(held, size_t{kHalfOpenCap}) << "--max-sessions";
  HonestResult h;
  const auto t0 = Clock::now();
  for (;;) {
    h = honest_trip("honest-beside-half-open", 11, kHonestDeadline);
    if (h.err == 0 || Clock::now() - t0 > Ms(15000)) break;
    std::this_thread::sleep_for(Ms(500));
  }
  EXPECT_EQ(h.err, 0) << h.what;
  expect_bounded(held);
  half_open.clear();
  expect_healthy(std::to_string(kHalfOpen) + " half-open paths");
}

// ---------------------------------------------------------------------------------------------
// Class 8, remote: authentication and per-export grants

// The names of the sessions the attacks below try to create: none may be listed by the server.
bool listed(const std::vector<SessionSeen>& seen, std::string_view prefix) {
  for (auto& s : seen)
    if (s.name.rfind(prefix, 0) == 0) return true;
  return false;
}

// Case: outsiders without credentials try what the daemons offer: a raw client whose CON_REQs do
// not ask to authenticate (over the fabric layer, and as a raw tcp stream), the client library
// without a key, and an ibnbd-client daemon without --host-key mapping honest/data.img rw. One
// that got in would open honest/data.img rw and write 0xEE over it.
// Expect: each is refused at its first connection with EACCES (the daemon's map exits 13),
// before any session exists: the server lists none of theirs and counts the refusals; honest's
// bytes are intact (before: anyone who reached the port opened any volume under the search path
// rw).
TEST_F(HostilePeer, Class8Remote_NoCredentialsNoSession) {
  ASSERT_NO_FATAL_FAILURE(start());
  ASSERT_NO_FATAL_FAILURE(victim_writes());
  const std::string data = "honest/data.img";
  server_->make_file(data, 1 << 20);
  fill(data, 1 << 20, 99);
  const std::vector<std::byte> evil(4096, std::byte{0xEE});

  RawFabricPeer::Options o;
  o.session_name = "stranger-raw";
  auto peer = RawFabricPeer::connect(server_->address(), o);
  EXPECT_EQ(peer.error(), errc(EACCES)) << "a raw client without credentials";
  if (peer.ok()) {
    proto::OpenRsp rsp;
    if ((*peer)->sess_info() == 0 && (*peer)->open(data, AccessMode::rw, &rsp) == 0)
      (void)(*peer)->request_write(io_msg(rsp.device_id, IoOp::write, 0, 4096), evil);
    peer->reset();
  }
  auto tcp = RawTcpSession::connect(port(), "stranger-tcp", {});
  EXPECT_EQ(tcp.error(), errc(EACCES)) << "a raw tcp stream without credentials";
  auto lib = HonestSession::open(server_->address(), {}, "stranger-lib", kHonestDeadline);
  EXPECT_EQ(lib.error(), errc(EACCES)) << "the client library without a key";
  if (lib.ok()) {
    if (auto d = (*lib)->map(data, AccessMode::rw); d.ok()) (void)(*lib)->write(**d, 0, 4096, 1);
    lib->reset();
  }
  {
    auto anon = client_daemon("anon", {});
    ASSERT_NE(anon, nullptr);
    auto m = cli("anon", {"device", "map", data, "from", server_->address().to_string(), "rw"});
    EXPECT_EQ(m.exit_code, EACCES) << m.out << m.err;
    EXPECT_EQ(anon->wait_exit(Ms(10000), true), std::optional<int>(0)) << anon->log();
  }

  auto seen = server_->sessions(Ms(10000));
  ASSERT_TRUE(seen.has_value());
  EXPECT_FALSE(listed(*seen, "stranger")) << "a session without credentials exists";
  for (auto& s : *seen) EXPECT_FALSE(s.host.empty()) << "an anonymous session: " << s.name;
  auto n = server_->auth_stats(Ms(10000));
  EXPECT_GE(n["refused_no_credentials"], 4u) << "each refusal counted";
  EXPECT_EQ(n["anonymous"], 0u);
  auto b = server_->file_bytes(data, 0, 1 << 20);
  EXPECT_TRUE(matches(b.data(), b.size(), 0, 99)) << data << " was written by a client without credentials";
  expect_healthy("clients without credentials");
}

// Case: hosts that cannot prove a secret, each as a raw client (the exchange by hand) and
// through the client library: an unknown host with a key of its own; honest's host id with the
// insider's key and with a fresh random key; the insider's id with honest's key. Then the
// insider, with its own valid key, adds a path to the victim's session (its uuid and name, which
// an insider may learn).
// Expect: EACCES every time; none of their sessions exists; the server counts them by reason
// (unknown host, bad response, host mismatch); the victim's session keeps its one path, its
// host and its bytes.
TEST_F(HostilePeer, Class8Remote_UnknownHostAndWrongKeysAreRefused) {
  ASSERT_NO_FATAL_FAILURE(start());
  ASSERT_NO_FATAL_FAILURE(victim_writes());
  auto as = [](const std::string& host, const ibtrs::Secret& key) {
    ibtrs::ClientAuth a;
    a.host_id = host;
    a.key = key;
    return a;
  };
  const ibtrs::Secret own = *ibtrs::Secret::generate();
  const std::vector<std::pair<std::string, ibtrs::ClientAuth>> tries{
      {"unknown host", as("stranger", own)},
      {"honest with the insider's key", as(kHonest, *mallory().key)},
      {"honest with a random key", as(kHonest, *ibtrs::Secret::generate())},
      {"the insider with honest's key", as(kMallory, *honest().key)},
  };
  int i = 0;
  for (auto& [what, auth] : tries) {
    RawFabricPeer::Options o;
    o.session_name = "forger-" + std::to_string(i++);
    o.auth = auth;
    EXPECT_EQ(RawFabricPeer::connect(server_->address(), o).error(), errc(EACCES)) << what << " (raw)";
    EXPECT_EQ(HonestSession::open(server_->address(), auth, "forger-" + std::to_string(i++), kHonestDeadline).error(),
              errc(EACCES))
        << what << " (library)";
  }
  RawFabricPeer::Options join = attacker("victim");
  join.session = victim_->session().transport().uuid();
  EXPECT_EQ(RawFabricPeer::connect(server_->address(), join).error(), errc(EACCES))
      << "the insider joins the victim's session";

  auto seen = server_->sessions(Ms(10000));
  ASSERT_TRUE(seen.has_value());
  EXPECT_FALSE(listed(*seen, "forger")) << "a session of a host that proved no secret exists";
  for (auto& s : *seen) {
    if (s.name != "victim") continue;
    EXPECT_EQ(s.host, kHonest);
    EXPECT_EQ(s.paths, 1u) << "the insider's path joined the victim's session";
  }
  auto n = server_->auth_stats(Ms(10000));
  EXPECT_GE(n["refused_unknown_host"], 2u);
  EXPECT_GE(n["refused_bad_response"], 6u);
  EXPECT_GE(n["refused_host_mismatch"], 1u);
  EXPECT_EQ(victim_->write_verify(*victim_dev_, 0, 1 << 20, kVictimSeed), 0) << "the victim's session works";
  expect_healthy("forged credentials");
}

// Case: the insider, authenticated, opens what is not its own: honest's files by name, by
// absolute and "//" path, with "./" and through ".."; a name that does not exist in honest's
// directory; the shared device, granted ro, rw and for migration. Raw, through the client library
// and through an ibnbd-client daemon with its key. Its own grants work: its device rw (and a
// write lands), the shared one ro. With its device open it sends IO for device ids it does not
// hold.
// Expect: EACCES for honest's names (the ".." one may be EINVAL) -- the missing one too, so it
// learns nothing of what exists there; EPERM for modes beyond a grant (the daemon's maps exit 13
// and 1); ENODEV for IO on ids it does not hold; the server counts the refused OPENs; honest's
// bytes are intact.
TEST_F(HostilePeer, Class8Remote_AnInsiderOpensOnlyItsGrants) {
  ASSERT_NO_FATAL_FAILURE(start());
  ASSERT_NO_FATAL_FAILURE(victim_writes());
  auto peer = insider();
  ASSERT_NE(peer, nullptr);
  RawFabricPeer& p = *peer;
  const std::string abs = server_->export_dir() + "/" + kVictimImg;
  for (const std::string& n : {kVictimImg, kHonestImg, abs, "/" + abs, "./" + kVictimImg, std::string("honest/nothing.img")})
    for (AccessMode m : {AccessMode::rw, AccessMode::ro, AccessMode::migration})
      EXPECT_EQ(p.open(n, m), EACCES) << n << " " << to_string(m);
  const int dots = p.open("mallory/../" + kVictimImg, AccessMode::rw);
  EXPECT_TRUE(dots == EACCES || dots == EINVAL) << std::strerror(dots);
  EXPECT_EQ(p.open(kSharedImg, AccessMode::rw), EPERM);
  EXPECT_EQ(p.open(kSharedImg, AccessMode::migration), EPERM);
  proto::OpenRsp shared, own;
  EXPECT_EQ(p.open(kSharedImg, AccessMode::ro, &shared), 0) << "its ro grant";
  ASSERT_EQ(p.open(kAttackerImg, AccessMode::rw, &own), 0) << "its rw grant";
  std::vector<std::byte> mine(4096);
  pattern(mine.data(), mine.size(), 0, 5);
  EXPECT_EQ(p.request_write(io_msg(own.device_id, IoOp::write, 0, 4096), mine), 0);
  auto landed = server_->file_bytes(kAttackerImg, 0, 4096);
  EXPECT_TRUE(matches(landed.data(), landed.size(), 0, 5)) << "the insider's own write landed";
  const std::vector<std::byte> evil(4096, std::byte{0xEE});
  EXPECT_NE(p.request_write(io_msg(shared.device_id, IoOp::write, 0, 4096), evil), 0) << "a write to its ro device";
  for (uint32_t id = 0; id < 8; ++id) {
    if (id == own.device_id || id == shared.device_id) continue;
    EXPECT_EQ(p.request_write(io_msg(id, IoOp::write, 0, 4096), evil), ENODEV) << "device id " << id;
  }
  peer.reset();

  auto lib = HonestSession::open(server_->address(), mallory(), "insider-lib", kHonestDeadline);
  ASSERT_TRUE(lib.ok()) << lib.error().message();
  EXPECT_EQ((*lib)->map(kVictimImg, AccessMode::ro).error(), errc(EACCES));
  EXPECT_EQ((*lib)->map(kSharedImg, AccessMode::rw).error(), errc(EPERM));
  auto ro = (*lib)->map(kSharedImg, AccessMode::ro);
  ASSERT_TRUE(ro.ok()) << ro.error().message();
  EXPECT_NE((*lib)->write(**ro, 0, 4096, 1), 0) << "a write to a device mapped ro";
  ro->reset();
  lib->reset();

  {
    auto d = client_daemon("insider", {"--host-key", server_->key_file(kMallory)});
    ASSERT_NE(d, nullptr);
    const std::string from = server_->address().to_string();
    auto m1 = cli("insider", {"device", "map", kVictimImg, "from", from, "rw"});
    EXPECT_EQ(m1.exit_code, EACCES) << m1.out << m1.err;
    auto m2 = cli("insider", {"device", "map", kSharedImg, "from", from, "rw"});
    EXPECT_EQ(m2.exit_code, EPERM) << m2.out << m2.err;
    auto m3 = cli("insider", {"device", "map", kSharedImg, "from", from, "ro"});
    EXPECT_EQ(m3.exit_code, 0) << m3.out << m3.err;
    EXPECT_EQ(cli("insider", {"device", "unmap", kSharedImg}).exit_code, 0);
    EXPECT_EQ(d->wait_exit(Ms(10000), true), std::optional<int>(0)) << d->log();
  }
  auto n = server_->auth_stats(Ms(10000));
  EXPECT_GE(n["open_refused_eacces"], 20u);
  EXPECT_GE(n["open_refused_eperm"], 4u);
  auto shared_bytes = server_->file_bytes(kSharedImg, 0, 4096);
  EXPECT_TRUE(std::all_of(shared_bytes.begin(), shared_bytes.end(), [](std::byte c) { return c == std::byte{0}; }))
      << "the ro device was written";
  expect_healthy("an insider beyond its grants");
}

}  // namespace
}  // namespace ibnbd::hostile
