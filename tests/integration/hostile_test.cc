// Bad input against the real block server while an honest client works: a raw ibtrs client
// session writes IBNBD messages by hand -- unknown types, truncated and overlong messages, bad
// flags, wrong carriers, sizes that do not match the data, bad OPENs, unknown ids, ranges past
// the end -- next to a BlockSession running a verified load on the same server and device.
#include <cstring>
#include <thread>

#include "integration_harness.h"
#include "proto/ibnbd_proto.h"

namespace ibnbd::itest {
namespace {

using ibtrs::IoDir;
using ibtrs::IoSeg;

// One transport client session speaking IBNBD by hand.
class RawPeer {
 public:
  static std::unique_ptr<RawPeer> open(const ibtrs::Address& a, const std::string& name,
                                       ibtrs::ClientAuth auth) {
    ibtrs::ClientOptions co;
    co.auth = std::move(auth);  // an authenticated host that misbehaves
    co.session_name = name;
    co.paths.push_back(ibtrs::PathSpec{std::nullopt, a});
    co.io_threads = 1;
    co.heartbeat = ibtrs::HeartbeatConfig{500ms, 6};
    auto s = ibtrs::ClientSession::open(co);
    EXPECT_TRUE(s.ok()) << s.error().message();
    if (!s.ok()) return nullptr;
    auto p = std::make_unique<RawPeer>();
    p->s = std::move(*s);
    auto b = p->s->alloc_buffer(1 << 20);
    EXPECT_TRUE(b.ok());
    if (!b.ok()) return nullptr;
    p->buf = std::move(*b);
    return p;
  }
  ~RawPeer() {
    buf.reset();
    s.reset();
  }

  // Sends `usr` as the user header with `len` bytes of the buffer as data (write) or as the
  // place for the answer (read); returns the errno of the server's answer, or minus the errno
  // the transport refused the request with.
  int send(IoDir dir, std::span<const std::byte> usr, uint32_t len) {
    IoSeg seg{buf->data(), len, buf.get()};
    ibtrs::IoRequest r;
    r.dir = dir;
    r.usr = usr;
    if (len > 0) r.data = std::span(&seg, 1);
    Done d;
    r.done = &Done::cb;
    r.ctx = &d;
    auto st = s->request(r);
    if (!st.ok()) return -st.error().value();
    return d.wait();
  }

  std::unique_ptr<ibtrs::ClientSession> s;
  std::unique_ptr<ibtrs::RegisteredMemory> buf;
};

template <typename T>
std::vector<std::byte> bytes_of(const T& t) {
  std::vector<std::byte> v(sizeof(T));
  std::memcpy(v.data(), &t, sizeof(T));
  return v;
}

proto::IoMsg io_msg(uint32_t id, uint64_t sector, uint32_t rw, uint32_t bi_size) {
  proto::IoMsg m{};
  m.hdr.type.set(static_cast<uint16_t>(proto::MsgType::io));
  m.device_id.set(id);
  m.sector.set(sector);
  m.rw.set(rw);
  m.bi_size.set(bi_size);
  return m;
}

uint32_t rw_of(IoOp op, uint32_t flags = 0) { return static_cast<uint32_t>(op) | flags; }

std::vector<std::byte> sess_info_msg(uint8_t ver) {
  proto::SessInfoMsg m{};
  m.hdr.type.set(static_cast<uint16_t>(proto::MsgType::sess_info));
  m.ver = ver;
  return bytes_of(m);
}

std::vector<std::byte> open_msg(AccessMode mode, std::string_view name) {
  proto::OpenMsg m{};
  m.hdr.type.set(static_cast<uint16_t>(proto::MsgType::open));
  m.access_mode = static_cast<uint8_t>(mode);
  std::memcpy(m.dev_name, name.data(), std::min(name.size(), sizeof(m.dev_name)));
  return bytes_of(m);
}

// One bad (or good) request and the errno the server must answer.
struct Probe {
  std::string what;
  IoDir dir;
  std::vector<std::byte> usr;
  uint32_t data_len;
  int expect;
};

// Everything a client might send wrong, against device id `id` (opened ro by this peer) of a
// device of `size` bytes.
std::vector<Probe> probes(uint32_t id, uint64_t size) {
  const uint64_t last = size / kSectorSize;
  std::vector<Probe> v;
  auto add = [&](std::string what, IoDir dir, std::vector<std::byte> usr, uint32_t len, int e) {
    v.push_back(Probe{std::move(what), dir, std::move(usr), len, e});
  };
  // Framing.
  add("a 2-byte header", IoDir::write, std::vector<std::byte>(2), 0, EBADMSG);
  {
    proto::MsgHdr h{};
    h.type.set(77);
    add("unknown type 77", IoDir::write, bytes_of(h), 0, EBADMSG);
    auto io = bytes_of(io_msg(id, 0, rw_of(IoOp::read), 4096));
    io[0] = std::byte{6};
    add("unknown type 6 in an IO-sized message", IoDir::read, io, 4096, EBADMSG);
  }
  {
    proto::SessInfoRspMsg r{};
    r.hdr.type.set(static_cast<uint16_t>(proto::MsgType::sess_info_rsp));
    add("a SESS_INFO_RSP sent as a request", IoDir::read, bytes_of(r), 64, EBADMSG);
    proto::OpenRspMsg o{};
    o.hdr.type.set(static_cast<uint16_t>(proto::MsgType::open_rsp));
    add("an OPEN_RSP sent as a request", IoDir::read, bytes_of(o), 64, EBADMSG);
  }
  {
    auto io = bytes_of(io_msg(id, 0, rw_of(IoOp::read), 4096));
    io.resize(sizeof(proto::IoMsg) - 1);
    add("IO truncated by one byte", IoDir::read, io, 4096, EBADMSG);
    io.resize(sizeof(proto::IoMsg) + 1);
    std::memcpy(io.data(), bytes_of(io_msg(id, 0, rw_of(IoOp::read), 4096)).data(), sizeof(proto::IoMsg));
    add("IO one byte too long", IoDir::read, io, 4096, EBADMSG);
  }
  {
    auto m = io_msg(id, 0, rw_of(IoOp::read), 4096);
    m.hdr.reserved.set(1);
    add("IO with reserved header bytes set", IoDir::read, bytes_of(m), 4096, EINVAL);
    m = io_msg(id, 0, rw_of(IoOp::read), 4096);
    m.reserved[5] = 1;
    add("IO with reserved tail bytes set", IoDir::read, bytes_of(m), 4096, EINVAL);
  }
  // Ops and flags.
  add("unknown op 9", IoDir::write, bytes_of(io_msg(id, 0, 9, 4096)), 0, EINVAL);
  add("unknown flag bit 20", IoDir::read, bytes_of(io_msg(id, 0, rw_of(IoOp::read, 1u << 20), 4096)), 4096, EINVAL);
  add("WRITE with NOUNMAP", IoDir::write, bytes_of(io_msg(id, 0, rw_of(IoOp::write, kIoNoUnmap), 4096)), 4096,
      EINVAL);
  add("DISCARD with FUA|NOUNMAP", IoDir::write,
      bytes_of(io_msg(id, 0, rw_of(IoOp::discard, kIoFua | kIoNoUnmap), 4096)), 0, EINVAL);
  // Carriers and sizes.
  add("a READ carrier for a WRITE", IoDir::read, bytes_of(io_msg(id, 0, rw_of(IoOp::write), 4096)), 4096, EINVAL);
  add("a WRITE carrier for a READ", IoDir::write, bytes_of(io_msg(id, 0, rw_of(IoOp::read), 4096)), 4096, EINVAL);
  add("WRITE bi_size 8192 with 4096 bytes of data", IoDir::write,
      bytes_of(io_msg(id, 0, rw_of(IoOp::write), 8192)), 4096, EINVAL);
  add("WRITE bi_size 4096 without data", IoDir::write, bytes_of(io_msg(id, 0, rw_of(IoOp::write), 4096)), 0,
      EINVAL);
  add("READ bi_size 4096 into an 8192-byte buffer", IoDir::read,
      bytes_of(io_msg(id, 0, rw_of(IoOp::read), 4096)), 8192, EINVAL);
  add("READ bi_size 1000 (not whole sectors)", IoDir::read, bytes_of(io_msg(id, 0, rw_of(IoOp::read), 1000)),
      1000, EINVAL);
  add("READ bi_size 0", IoDir::read, bytes_of(io_msg(id, 0, rw_of(IoOp::read), 0)), 512, EINVAL);
  add("FLUSH with bi_size 512", IoDir::write, bytes_of(io_msg(id, 0, rw_of(IoOp::flush), 512)), 0, EINVAL);
  add("DISCARD carrying data", IoDir::write, bytes_of(io_msg(id, 0, rw_of(IoOp::discard), 4096)), 4096, EINVAL);
  {
    proto::CloseMsg c{};
    c.hdr.type.set(static_cast<uint16_t>(proto::MsgType::close));
    c.device_id.set(id);
    add("CLOSE carrying data", IoDir::write, bytes_of(c), 512, EINVAL);
  }
  // OPEN.
  {
    auto m = open_msg(AccessMode::ro, std::string(255, 'a'));
    add("OPEN with a 255-byte name and no NUL", IoDir::read, m, 64, EINVAL);
    m = open_msg(AccessMode::ro, "disk.img");
    m[4] = std::byte{7};
    add("OPEN with access mode 7", IoDir::read, m, 64, EINVAL);
    add("OPEN of a name with a newline", IoDir::read, open_msg(AccessMode::ro, "disk\n.img"), 64, EINVAL);
    m = open_msg(AccessMode::ro, "disk.img");
    m[6 + 10] = std::byte{'x'};  // after the NUL that ends the name: something hidden
    add("OPEN with bytes after the name's NUL", IoDir::read, m, 64, EINVAL);
    m.resize(100);
    add("OPEN truncated", IoDir::read, m, 64, EBADMSG);
    add("OPEN answered into a buffer too small", IoDir::read, open_msg(AccessMode::ro, "disk.img"), 16, EINVAL);
    add("OPEN of ../disk.img", IoDir::read, open_msg(AccessMode::ro, "../disk.img"), 64, EINVAL);
  }
  add("SESS_INFO of version 1", IoDir::read, sess_info_msg(1), 64, EPROTONOSUPPORT);
  // Ids and ranges.
  add("READ of device id 200 (never opened)", IoDir::read, bytes_of(io_msg(200, 0, rw_of(IoOp::read), 4096)),
      4096, ENODEV);
  add("READ of device id 2^32-1", IoDir::read, bytes_of(io_msg(UINT32_MAX, 0, rw_of(IoOp::read), 4096)), 4096,
      ENODEV);
  {
    proto::CloseMsg c{};
    c.hdr.type.set(static_cast<uint16_t>(proto::MsgType::close));
    c.device_id.set(200);
    add("CLOSE of device id 200 (never opened)", IoDir::write, bytes_of(c), 0, ENODEV);
  }
  add("READ of the last sector and one more", IoDir::read,
      bytes_of(io_msg(id, last - 1, rw_of(IoOp::read), 1024)), 1024, EIO);
  add("READ starting at the end", IoDir::read, bytes_of(io_msg(id, last, rw_of(IoOp::read), 512)), 512, EIO);
  add("READ at sector 2^54 (range fits 64 bits)", IoDir::read,
      bytes_of(io_msg(id, uint64_t{1} << 54, rw_of(IoOp::read), 4096)), 4096, EIO);
  add("READ at sector 2^55 (range past 2^64)", IoDir::read,
      bytes_of(io_msg(id, uint64_t{1} << 55, rw_of(IoOp::read), 4096)), 4096, EINVAL);
  add("READ at sector 2^64-1", IoDir::read, bytes_of(io_msg(id, UINT64_MAX, rw_of(IoOp::read), 512)), 512,
      EINVAL);
  // Access mode: this peer holds the device ro, the honest client rw.
  add("WRITE to a device opened ro", IoDir::write, bytes_of(io_msg(id, 0, rw_of(IoOp::write), 4096)), 4096,
      EPERM);
  add("WRITE_ZEROES to a device opened ro", IoDir::write,
      bytes_of(io_msg(id, 0, rw_of(IoOp::write_zeroes), 4096)), 0, EPERM);
  add("DISCARD to a device opened ro", IoDir::write, bytes_of(io_msg(id, 0, rw_of(IoOp::discard), 4096)), 0,
      EPERM);
  add("OPEN rw of a device another session holds rw", IoDir::read, open_msg(AccessMode::rw, "disk.img"), 64,
      EBUSY);
  // And what is right still works in between.
  add("READ of the first 4 KiB", IoDir::read, bytes_of(io_msg(id, 0, rw_of(IoOp::read), 4096)), 4096, 0);
  return v;
}

class Hostile : public Rig {};

// Case: an honest BlockSession runs a verified random load (two paths, 16 in flight) on the
// exported file; meanwhile a raw transport session ("hostile") that opened the same device ro
// sends, round after round until the load ends, every malformed request above: bad framing
// (2-byte header, unknown types, responses as requests, IO one byte short or long, reserved
// bytes set), bad ops and flags, carriers that do not fit (a READ carrier for a WRITE, data on
// a DISCARD or CLOSE, bi_size not matching the data, not whole sectors), bad OPENs (255-byte
// name without NUL, unknown mode, control characters, bytes after the NUL, truncated, '..'),
// an old version, unknown device ids, ranges past the end and past 2^64, writes through its
// ro id, a second rw OPEN; and a peer that skipped SESS_INFO sends IO and OPEN.
// Expect: each is answered with its errno -- EBADMSG (framing), EINVAL (fields, carriers),
// EPROTONOSUPPORT (version), ENODEV (unknown id), ENODEV (CLOSE of an unknown id too), EIO (range
// past the end of the device), EPERM (access mode), EBUSY (access rules), EPROTO (OPEN before
// SESS_INFO) -- and a good READ in between still works; the hostile session stays up; the
// honest load completes every request with 0 and every read matches the model, with no remap;
// the device and the file equal the model at the end.
TEST_F(Hostile, GarbageIsAnsweredWhileAnHonestClientKeepsVerifying) {
  auto d = bring_up("hostile", Store::direct);
  if (!skip_.empty()) GTEST_SKIP() << skip_;
  ASSERT_NE(d, nullptr);

  auto peer = RawPeer::open(addrs()[1], "hostile", credentials());
  ASSERT_NE(peer, nullptr);
  auto info = sess_info_msg(proto::kProtoVersion);
  ASSERT_EQ(peer->send(IoDir::read, info, sizeof(proto::SessInfoRspMsg)), 0);
  ASSERT_EQ(peer->send(IoDir::read, open_msg(AccessMode::ro, "disk.img"), sizeof(proto::OpenRspMsg)), 0);
  auto rsp = proto::decode_open_rsp(std::span(peer->buf->data(), sizeof(proto::OpenRspMsg)));
  ASSERT_TRUE(rsp.ok());
  const auto list = probes(rsp->device_id, rsp->geo.nsectors * kSectorSize);

  // A second peer that never says SESS_INFO.
  auto early = RawPeer::open(addrs()[0], "early", credentials());
  ASSERT_NE(early, nullptr);

  Model m(d->size_bytes(), d->geometry().logical_block_size);
  LoadOptions o;
  o.seed = test_seed(4301);
  o.ops = 1500;
  std::atomic<bool> load_done{false};
  LoadReport rep;
  std::thread honest([&] {
    Load load(session(), *d, m, o);
    rep = load.run();
    load_done.store(true);
  });
  int rounds = 0;
  bool overlapped = false;
  do {
    overlapped |= !load_done.load();
    for (const Probe& p : list) {
      const int e = peer->send(p.dir, p.usr, p.data_len);
      EXPECT_EQ(e, p.expect) << p.what << ": got " << (e < 0 ? "a local refusal " : "")
                             << std::strerror(e < 0 ? -e : e);
    }
    EXPECT_EQ(early->send(IoDir::read, bytes_of(io_msg(0, 0, rw_of(IoOp::read), 4096)), 4096), ENODEV)
        << "IO before SESS_INFO: no device can be open";
    EXPECT_EQ(early->send(IoDir::read, open_msg(AccessMode::ro, "disk.img"), 64), EPROTO)
        << "OPEN before SESS_INFO";
    ++rounds;
  } while (!load_done.load() && rounds < 200 && !HasFailure());
  honest.join();
  std::printf("[ hostile  ] %d rounds of %zu bad requests while the load ran\n", rounds, list.size());
  std::printf("[ load     ] %s\n", rep.summary().c_str());
  EXPECT_TRUE(overlapped) << "the bad requests ran while the honest load did";
  EXPECT_EQ(rep.failed, 0u);
  EXPECT_EQ(rep.mismatches, 0u);
  EXPECT_EQ(d->stats().remaps, 0u);
  EXPECT_EQ(session().state(), SessionState::connected);
  EXPECT_EQ(peer->s->paths().at(0).state, ibtrs::ClientPathState::connected) << "answered, not cut off";
  EXPECT_EQ(verify_device(*d, session(), m), "");
  EXPECT_EQ(verify_file(file(), m), "");
}

}  // namespace
}  // namespace ibnbd::itest
