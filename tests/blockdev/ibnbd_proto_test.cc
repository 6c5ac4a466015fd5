// The IBNBD block protocol codec (blockdev/src/proto/ibnbd_proto.h): every message round-trips,
// the layout is the documented one, and every decoder refuses hostile input with the promised
// errno without reading past what it was given (messages live in exact-size heap buffers, so
// the ASan build sees any overread).
#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>
#include <limits>
#include <vector>

#include "base/text.h"
#include "proto/ibnbd_proto.h"

namespace ibnbd::proto {
namespace {

using Bytes = std::vector<std::byte>;
using ibtrs::IoDir;

template <typename T>
Bytes wire(const T& w) {
  Bytes b(sizeof(T));
  std::memcpy(b.data(), &w, sizeof(T));
  return b;
}

template <typename T>
T as_wire(const Bytes& b) {
  T w;
  std::memcpy(&w, b.data(), sizeof(T));
  return w;
}

// Encodes into a buffer of exactly the encoder's output.
template <typename Msg, typename Enc>
Bytes encoded(Enc enc, const Msg& m) {
  Bytes b(512);
  auto n = enc(b, m);
  EXPECT_TRUE(n.ok()) << n.error().message();
  b.resize(n.ok() ? *n : 0);
  return b;
}

Bytes enc_sess_info(const SessInfo& m) { return encoded(encode_sess_info, m); }
Bytes enc_sess_info_rsp(const SessInfoRsp& m) { return encoded(encode_sess_info_rsp, m); }
Bytes enc_open(const Open& m) { return encoded(encode_open, m); }
Bytes enc_open_rsp(const OpenRsp& m) { return encoded(encode_open_rsp, m); }
Bytes enc_close(const Close& m) { return encoded(encode_close, m); }
Bytes enc_io(const Io& m) { return encoded(encode_io, m); }
Bytes enc_watch(const Watch& m) { return encoded(encode_watch, m); }
Bytes enc_watch_rsp(const WatchRsp& m) {
  Bytes b(4096);
  auto n = encode_watch_rsp(b, m);
  EXPECT_TRUE(n.ok()) << n.error().message();
  b.resize(n.ok() ? *n : 0);
  return b;
}
WatchRsp two_devices() { return WatchRsp{77, 2, {{0, 2048}, {3, 1u << 30}}}; }

Bytes prefix(const Bytes& b, size_t n) { return Bytes(b.begin(), b.begin() + static_cast<ptrdiff_t>(n)); }

template <typename T>
int err_of(const Result<T>& r) {
  return r.ok() ? 0 : r.error().value();
}

DeviceGeometry full_geometry() {
  DeviceGeometry g;
  g.nsectors = 0x0123456789ull;
  g.logical_block_size = 4096;
  g.physical_block_size = 65536;
  g.max_hw_sectors = 2048;
  g.max_write_zeroes_sectors = 1u << 20;
  g.max_discard_sectors = 1u << 22;
  g.discard_granularity = 1u << 20;
  g.discard_alignment = 4096;
  g.max_segments = 128;
  g.secure_discard = true;
  g.cache_policy = kCacheFua | kCacheWriteBack;
  return g;
}

Io io(IoOp op, uint32_t bi_size, uint32_t flags = 0) {
  Io m;
  m.device_id = 7;
  m.sector = 1000;
  m.op = op;
  m.flags = flags;
  m.bi_size = bi_size;
  m.prio = 0x4003;
  return m;
}

// ------------------------------------------------------------------------------------------
// Layout

// Case: the wire structs. Expect: the sizes and offsets docs/protocol.md gives.
TEST(IbnbdLayout, SizesAndOffsetsAreTheDocumentedOnes) {
  EXPECT_EQ(sizeof(MsgHdr), 4u);
  EXPECT_EQ(sizeof(SessInfoMsg), 36u);
  EXPECT_EQ(sizeof(SessInfoRspMsg), 36u);
  EXPECT_EQ(sizeof(OpenMsg), 264u);
  EXPECT_EQ(sizeof(OpenRspMsg), 56u) << "the kernel's OPEN_RSP size";
  EXPECT_EQ(sizeof(CloseMsg), 8u);
  EXPECT_EQ(sizeof(IoMsg), 32u);
  EXPECT_EQ(sizeof(WatchMsg), 16u);
  EXPECT_EQ(sizeof(WatchRspMsg), 24u);
  EXPECT_EQ(sizeof(WatchEntryMsg), 16u);

  EXPECT_EQ(offsetof(SessInfoMsg, ver), 4u);
  EXPECT_EQ(offsetof(OpenMsg, access_mode), 4u);
  EXPECT_EQ(offsetof(OpenMsg, dev_name), 6u);
  EXPECT_EQ(offsetof(OpenMsg, reserved1), 261u);
  EXPECT_EQ(offsetof(OpenRspMsg, device_id), 4u);
  EXPECT_EQ(offsetof(OpenRspMsg, nsectors), 8u);
  EXPECT_EQ(offsetof(OpenRspMsg, max_hw_sectors), 16u);
  EXPECT_EQ(offsetof(OpenRspMsg, physical_block_size), 36u);
  EXPECT_EQ(offsetof(OpenRspMsg, logical_block_size), 40u);
  EXPECT_EQ(offsetof(OpenRspMsg, max_segments), 44u);
  EXPECT_EQ(offsetof(OpenRspMsg, secure_discard), 46u);
  EXPECT_EQ(offsetof(OpenRspMsg, cache_policy), 47u);
  EXPECT_EQ(offsetof(OpenRspMsg, size_epoch), 48u);
  EXPECT_EQ(offsetof(CloseMsg, device_id), 4u);
  EXPECT_EQ(offsetof(IoMsg, device_id), 4u);
  EXPECT_EQ(offsetof(IoMsg, sector), 8u);
  EXPECT_EQ(offsetof(IoMsg, rw), 16u);
  EXPECT_EQ(offsetof(IoMsg, bi_size), 20u);
  EXPECT_EQ(offsetof(IoMsg, prio), 24u);
  EXPECT_EQ(offsetof(IoMsg, reserved), 26u);
  EXPECT_EQ(offsetof(WatchMsg, reserved), 4u);
  EXPECT_EQ(offsetof(WatchMsg, epoch), 8u);
  EXPECT_EQ(offsetof(WatchRspMsg, count), 4u);
  EXPECT_EQ(offsetof(WatchRspMsg, total), 8u);
  EXPECT_EQ(offsetof(WatchRspMsg, reserved), 12u);
  EXPECT_EQ(offsetof(WatchRspMsg, epoch), 16u);
  EXPECT_EQ(offsetof(WatchEntryMsg, device_id), 0u);
  EXPECT_EQ(offsetof(WatchEntryMsg, reserved), 4u);
  EXPECT_EQ(offsetof(WatchEntryMsg, nsectors), 8u);
  EXPECT_EQ(watch_buffer_bytes(256), 24u + 256 * 16) << "the client's default buffer";
}

// Case: message types, modes, ops and flags. Expect: the kernel's values.
TEST(IbnbdLayout, EnumValuesAreTheKernels) {
  EXPECT_EQ(static_cast<uint16_t>(MsgType::sess_info), 0);
  EXPECT_EQ(static_cast<uint16_t>(MsgType::sess_info_rsp), 1);
  EXPECT_EQ(static_cast<uint16_t>(MsgType::open), 2);
  EXPECT_EQ(static_cast<uint16_t>(MsgType::open_rsp), 3);
  EXPECT_EQ(static_cast<uint16_t>(MsgType::io), 4);
  EXPECT_EQ(static_cast<uint16_t>(MsgType::close), 5);
  EXPECT_EQ(static_cast<uint16_t>(MsgType::watch), 6) << "ours: the kernel has no size notices";
  EXPECT_EQ(static_cast<uint16_t>(MsgType::watch_rsp), 7);
  EXPECT_EQ(static_cast<uint8_t>(AccessMode::migration), 2);
  EXPECT_EQ(static_cast<uint8_t>(IoOp::write_zeroes), 5);
  EXPECT_EQ(kIoSync, 1u << 8);
  EXPECT_EQ(kIoNoUnmap, 1u << 11);
  EXPECT_EQ(kProtoVersion, 5);
  EXPECT_EQ(kWatchVersion, 4);
  EXPECT_EQ(kBlockStatusVersion, 5);
  EXPECT_EQ(static_cast<uint8_t>(IoOp::block_status), 6) << "ours: the kernel has no BLOCK_STATUS";
  EXPECT_EQ(static_cast<uint16_t>(MsgType::block_status_rsp), 8);
  EXPECT_EQ(kExtentHole, 1u) << "NBD_STATE_HOLE";
  EXPECT_EQ(kExtentZero, 2u) << "NBD_STATE_ZERO";
  EXPECT_EQ(kMinProtoVersion, 2) << "version 2 peers (no OPEN flags) are still served";
  EXPECT_EQ(kOpenReopen, 1);
}

// Case: an OPEN of a device the client held before (a remap or a failover). Expect: the flag
// byte at offset 5 (the kernel's resv1 after access_mode) and back the same; an OPEN
// without it leaves the byte 0, as version 2 peers send it.
TEST(IbnbdLayout, OpenFlagsRoundTrip) {
  const Bytes b = enc_open(Open{AccessMode::rw, "disk", kOpenReopen});
  EXPECT_EQ(std::to_integer<uint8_t>(b[offsetof(OpenMsg, flags)]), kOpenReopen);
  EXPECT_EQ(offsetof(OpenMsg, flags), 5u);
  auto d = decode_open(b, kOpenCarrier);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->flags, kOpenReopen);
  const Bytes plain = enc_open(Open{AccessMode::rw, "disk"});
  EXPECT_EQ(std::to_integer<uint8_t>(plain[offsetof(OpenMsg, flags)]), 0);
  Bytes out(sizeof(OpenMsg));
  EXPECT_EQ(err_of(encode_open(out, Open{AccessMode::rw, "disk", 0x80})), EINVAL) << "unknown flag";
}

// Case: one IO encoded. Expect: little-endian fields at their offsets, reserved bytes zero.
TEST(IbnbdLayout, IoBytesAreLittleEndian) {
  Io m = io(IoOp::write, 8192, kIoFua);
  m.device_id = 0x01020304;
  m.sector = 0x0012131415161718ull;  // below 2^55: the byte offset fits 64 bits
  const Bytes b = enc_io(m);
  ASSERT_EQ(b.size(), 32u);
  const Bytes want = {
      std::byte{4},    std::byte{0},    std::byte{0},    std::byte{0},     // type IO, reserved
      std::byte{4},    std::byte{3},    std::byte{2},    std::byte{1},     // device_id
      std::byte{0x18}, std::byte{0x17}, std::byte{0x16}, std::byte{0x15},  // sector
      std::byte{0x14}, std::byte{0x13}, std::byte{0x12}, std::byte{0x00},
      std::byte{1},    std::byte{2},    std::byte{0},    std::byte{0},     // rw: WRITE | FUA
      std::byte{0},    std::byte{0x20}, std::byte{0},    std::byte{0},     // bi_size 8192
      std::byte{3},    std::byte{0x40},                                    // prio
      std::byte{0},    std::byte{0},    std::byte{0},    std::byte{0},    std::byte{0}, std::byte{0},
  };
  EXPECT_EQ(b, want);
}

// ------------------------------------------------------------------------------------------
// rw word

// Case: every op with every combination of flags it may carry. Expect: pack/unpack round trip,
// op in the low 8 bits.
TEST(IbnbdRw, PacksEveryOpAndFlag) {
  for (uint8_t o = 0; o <= static_cast<uint8_t>(IoOp::block_status); ++o) {
    for (uint32_t f = 0; f <= kIoFlagsMask; f += 1u << 8) {
      const auto op = static_cast<IoOp>(o);
      auto rw = pack_rw(op, f);
      ASSERT_TRUE(rw.ok());
      EXPECT_EQ(*rw & kRwOpMask, o);
      auto back = unpack_rw(*rw);
      ASSERT_TRUE(back.ok());
      EXPECT_EQ(*back, (Rw{op, f}));
    }
  }
}

// Case: ops and flags outside the known ones. Expect: EINVAL both ways.
TEST(IbnbdRw, RefusesUnknownOpsAndFlags) {
  EXPECT_EQ(err_of(pack_rw(static_cast<IoOp>(7), 0)), EINVAL);
  EXPECT_EQ(err_of(pack_rw(IoOp::write, 1u << 12)), EINVAL);
  EXPECT_EQ(err_of(pack_rw(IoOp::write, 1u)), EINVAL) << "a flag in the op bits";
  EXPECT_EQ(err_of(unpack_rw(7)), EINVAL);
  EXPECT_EQ(err_of(unpack_rw(0xff)), EINVAL);
  EXPECT_EQ(err_of(unpack_rw(1u | (1u << 12))), EINVAL);
  EXPECT_EQ(err_of(unpack_rw(1u | (1u << 31))), EINVAL);
}

// ------------------------------------------------------------------------------------------
// Round trips

// Case: SESS_INFO and its response. Expect: the version comes back; the server's decoder
// accepts it only as a READ whose buffer holds the response.
TEST(IbnbdRoundTrip, SessInfo) {
  const Bytes q = enc_sess_info(SessInfo{});
  auto d = decode_sess_info(q, kSessInfoCarrier);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->ver, kProtoVersion);
  auto r = decode_sess_info_rsp(enc_sess_info_rsp(SessInfoRsp{kProtoVersion}));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->ver, kProtoVersion);
}

// Case: OPEN in every mode, names of 1 and 254 bytes, UTF-8 and a path. Expect: round trip.
TEST(IbnbdRoundTrip, Open) {
  for (AccessMode mode : {AccessMode::ro, AccessMode::rw, AccessMode::migration}) {
    for (std::string name : {std::string("a"), std::string(kDevNameMax, 'x'),
                             std::string("vg0/disk-\xc3\xa9t\xc3\xa9"), std::string("nvme0n1")}) {
      const Open m{mode, name};
      auto d = decode_open(enc_open(m), kOpenCarrier);
      ASSERT_TRUE(d.ok()) << name;
      EXPECT_EQ(*d, m);
    }
  }
}

// Case: OPEN_RSP with every field set, and with the defaults. Expect: round trip.
TEST(IbnbdRoundTrip, OpenRsp) {
  OpenRsp m{0xfffffffe, full_geometry()};
  auto d = decode_open_rsp(enc_open_rsp(m));
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(*d, m);
  OpenRsp plain{0, DeviceGeometry{}};
  plain.geo.max_hw_sectors = 256;
  auto p = decode_open_rsp(enc_open_rsp(plain));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(*p, plain);
}

// Case: CLOSE. Expect: round trip as a WRITE without data.
TEST(IbnbdRoundTrip, Close) {
  auto d = decode_close(enc_close(Close{0xdeadbeef}), kCloseCarrier);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->device_id, 0xdeadbeefu);
}

// Case: IO of every op with the carrier carrier_of() gives. Expect: round trip; the carrier is
// READ with the buffer for reads, WRITE with the data for writes, WRITE without data otherwise.
TEST(IbnbdRoundTrip, IoOfEveryOp) {
  const std::vector<Io> cases = {
      io(IoOp::read, 4096),
      io(IoOp::read, 512, kIoSync),
      io(IoOp::write, 128 * 1024, kIoFua | kIoPreflush | kIoSync),
      io(IoOp::flush, 0, kIoPreflush),
      io(IoOp::discard, 1u << 20),
      io(IoOp::secure_erase, 4096),
      io(IoOp::write_zeroes, 1u << 30, kIoNoUnmap),
      io(IoOp::write_zeroes, 512),
      io(IoOp::block_status, 1u << 30),
  };
  for (const Io& m : cases) {
    const Carrier c = carrier_of(m);
    switch (m.op) {
      case IoOp::read: EXPECT_EQ(c, (Carrier{IoDir::read, m.bi_size})); break;
      case IoOp::write: EXPECT_EQ(c, (Carrier{IoDir::write, m.bi_size})); break;
      case IoOp::block_status: EXPECT_EQ(c, (Carrier{IoDir::read, kBlockStatusReplyBytes})); break;
      default: EXPECT_EQ(c, (Carrier{IoDir::write, 0})); break;
    }
    auto d = decode_io(enc_io(m), c);
    ASSERT_TRUE(d.ok()) << to_string(m.op);
    EXPECT_EQ(*d, m);
  }
}

// Case: the largest range whose end still fits 64 bits of bytes. Expect: accepted.
TEST(IbnbdRoundTrip, IoAtTheEndOfTheAddressSpace) {
  Io m = io(IoOp::discard, 1024);
  m.sector = (std::numeric_limits<uint64_t>::max() - 1024) / kSectorSize;
  auto d = decode_io(enc_io(m), carrier_of(m));
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(*d, m);
}

// Case: each request through the server's one entry point. Expect: its type and message.
TEST(IbnbdRoundTrip, DecodeRequestDispatches) {
  auto s = decode_request(enc_sess_info(SessInfo{}), kSessInfoCarrier);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->type, MsgType::sess_info);
  EXPECT_EQ(s->sess_info.ver, kProtoVersion);
  auto o = decode_request(enc_open(Open{AccessMode::rw, "d"}), kOpenCarrier);
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->type, MsgType::open);
  EXPECT_EQ(o->open, (Open{AccessMode::rw, "d"}));
  auto c = decode_request(enc_close(Close{3}), kCloseCarrier);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->type, MsgType::close);
  EXPECT_EQ(c->close.device_id, 3u);
  const Io w = io(IoOp::write, 4096);
  auto i = decode_request(enc_io(w), carrier_of(w));
  ASSERT_TRUE(i.ok());
  EXPECT_EQ(i->type, MsgType::io);
  EXPECT_EQ(i->io, w);
  EXPECT_EQ(peek_type(enc_io(w)).value(), MsgType::io);
  auto wa = decode_request(enc_watch(Watch{42}), kWatchCarrier);
  ASSERT_TRUE(wa.ok());
  EXPECT_EQ(wa->type, MsgType::watch);
  EXPECT_EQ(wa->watch.epoch, 42u);
}

// ------------------------------------------------------------------------------------------
// Size notices (version 4)

// Case: WATCH with an epoch, and with 0 (none seen yet). Expect: the bytes the layout says, and
// back the same.
TEST(IbnbdWatch, WatchRoundTrips) {
  for (uint64_t e : {uint64_t{0}, uint64_t{1}, uint64_t{0x0123456789abcdefull}}) {
    const Bytes b = enc_watch(Watch{e});
    ASSERT_EQ(b.size(), sizeof(WatchMsg));
    EXPECT_EQ(as_wire<WatchMsg>(b).epoch.get(), e);
    auto d = decode_watch(b, kWatchCarrier);
    ASSERT_TRUE(d.ok());
    EXPECT_EQ(d->epoch, e);
  }
  Carrier big{IoDir::read, watch_buffer_bytes(256)};
  EXPECT_TRUE(decode_watch(enc_watch(Watch{1}), big).ok()) << "room for entries";
}

// Case: WATCH_RSP with every entry in the buffer, with a buffer for one of two, with none.
// Expect: the full answer back; count 1 of total 2; count 0 of total 2. The encoder says how
// many bytes it wrote.
TEST(IbnbdWatch, WatchRspRoundTripsAndFitsTheBuffer) {
  const WatchRsp m = two_devices();
  const Bytes b = enc_watch_rsp(m);
  EXPECT_EQ(b.size(), watch_buffer_bytes(2));
  auto d = decode_watch_rsp(b);
  ASSERT_TRUE(d.ok()) << d.error().message();
  EXPECT_EQ(*d, m);

  Bytes one(watch_buffer_bytes(1) + 15);
  EXPECT_EQ(encode_watch_rsp(one, m).value(), watch_buffer_bytes(1));
  auto p = decode_watch_rsp(one);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->total, 2u);
  ASSERT_EQ(p->entries.size(), 1u);
  EXPECT_EQ(p->entries[0], (WatchEntry{0, 2048}));

  Bytes none(sizeof(WatchRspMsg));
  EXPECT_EQ(encode_watch_rsp(none, m).value(), sizeof(WatchRspMsg));
  auto z = decode_watch_rsp(none);
  ASSERT_TRUE(z.ok());
  EXPECT_TRUE(z->entries.empty());
  EXPECT_EQ(z->total, 2u);
  EXPECT_TRUE(decode_watch_rsp(enc_watch_rsp(WatchRsp{5, 0, {}})).ok()) << "a session without devices";
}

// Case: OPEN_RSP's size epoch (version 4). Expect: it round-trips; a session of version 3 takes
// only 0 there (a reserved field then), EINVAL otherwise.
TEST(IbnbdWatch, OpenRspCarriesTheSizeEpoch) {
  OpenRsp m{4, full_geometry(), 0xfeedull};
  const Bytes b = enc_open_rsp(m);
  EXPECT_EQ(as_wire<OpenRspMsg>(b).size_epoch.get(), 0xfeedu);
  EXPECT_EQ(decode_open_rsp(b, kWatchVersion).value(), m);
  EXPECT_EQ(err_of(decode_open_rsp(b, 3)), EINVAL);
  m.size_epoch = 0;
  EXPECT_TRUE(decode_open_rsp(enc_open_rsp(m), 3).ok());
  EXPECT_TRUE(decode_open_rsp(enc_open_rsp(m), kMinProtoVersion).ok());
}

// Case: WATCH with reserved bytes, trailing bytes, as a WRITE, with a buffer shorter than the
// answer's header. Expect: EINVAL, EBADMSG, EINVAL, EINVAL.
TEST(IbnbdWatch, BadWatch) {
  const Bytes good = enc_watch(Watch{9});
  auto w = as_wire<WatchMsg>(good);
  w.reserved.set(1);
  EXPECT_EQ(err_of(decode_watch(wire(w), kWatchCarrier)), EINVAL);
  w = as_wire<WatchMsg>(good);
  w.hdr.reserved.set(1);
  EXPECT_EQ(err_of(decode_watch(wire(w), kWatchCarrier)), EINVAL);
  Bytes longer = good;
  longer.push_back(std::byte{0});
  EXPECT_EQ(err_of(decode_watch(longer, kWatchCarrier)), EBADMSG);
  EXPECT_EQ(err_of(decode_watch(prefix(good, 15), kWatchCarrier)), EBADMSG);
  EXPECT_EQ(err_of(decode_watch(good, Carrier{IoDir::write, 0})), EINVAL);
  EXPECT_EQ(err_of(decode_watch(good, Carrier{IoDir::read, sizeof(WatchRspMsg) - 1})), EINVAL);
  EXPECT_EQ(err_of(decode_request(good, Carrier{IoDir::write, sizeof(WatchRspMsg)})), EINVAL);
}

// Case: a hostile WATCH_RSP: epoch 0, count above total, ids out of order or twice, a size past
// 2^64 bytes, reserved bytes, a count the buffer cannot hold (up to 2^32 - 1), a cut header.
// Expect: EINVAL for the rules, EBADMSG for what does not fit -- nothing read past the buffer,
// nothing allocated for a count that lies.
TEST(IbnbdWatch, BadWatchRsp) {
  const Bytes good = enc_watch_rsp(two_devices());
  auto entry = [&](const Bytes& b, size_t i) {
    WatchEntryMsg e;
    std::memcpy(&e, b.data() + sizeof(WatchRspMsg) + i * sizeof(e), sizeof(e));
    return e;
  };
  auto with_entry = [&](Bytes b, size_t i, const WatchEntryMsg& e) {
    std::memcpy(b.data() + sizeof(WatchRspMsg) + i * sizeof(e), &e, sizeof(e));
    return b;
  };
  auto with_hdr = [&](Bytes b, const WatchRspMsg& h) {
    std::memcpy(b.data(), &h, sizeof(h));
    return b;
  };
  const auto hdr = as_wire<WatchRspMsg>(good);
  auto h = hdr;
  h.epoch.set(0);
  EXPECT_EQ(err_of(decode_watch_rsp(with_hdr(good, h))), EINVAL) << "epoch 0";
  h = hdr;
  h.total.set(1);
  EXPECT_EQ(err_of(decode_watch_rsp(with_hdr(good, h))), EINVAL) << "count > total";
  h = hdr;
  h.reserved.set(1);
  EXPECT_EQ(err_of(decode_watch_rsp(with_hdr(good, h))), EINVAL) << "reserved";
  h = hdr;
  h.hdr.reserved.set(1);
  EXPECT_EQ(err_of(decode_watch_rsp(with_hdr(good, h))), EINVAL) << "header reserved";
  auto e = entry(good, 1);
  e.device_id.set(0);
  EXPECT_EQ(err_of(decode_watch_rsp(with_entry(good, 1, e))), EINVAL) << "an id twice";
  e.device_id.set(2);
  auto first = entry(good, 0);
  first.device_id.set(5);
  EXPECT_EQ(err_of(decode_watch_rsp(with_entry(with_entry(good, 1, e), 0, first))), EINVAL) << "descending";
  e = entry(good, 1);
  e.nsectors.set(std::numeric_limits<uint64_t>::max() / kSectorSize + 1);
  EXPECT_EQ(err_of(decode_watch_rsp(with_entry(good, 1, e))), EINVAL) << "size past 2^64 bytes";
  e = entry(good, 1);
  e.reserved.set(1);
  EXPECT_EQ(err_of(decode_watch_rsp(with_entry(good, 1, e))), EINVAL) << "entry reserved";
  h = hdr;
  h.count.set(3);
  h.total.set(3);
  EXPECT_EQ(err_of(decode_watch_rsp(with_hdr(good, h))), EBADMSG) << "one entry more than the buffer";
  h.count.set(UINT32_MAX);
  h.total.set(UINT32_MAX);
  EXPECT_EQ(err_of(decode_watch_rsp(with_hdr(good, h))), EBADMSG) << "a count that lies";
  EXPECT_EQ(err_of(decode_watch_rsp(prefix(good, sizeof(WatchRspMsg) - 1))), EBADMSG);
  EXPECT_EQ(err_of(decode_watch_rsp(enc_watch(Watch{1}))), EBADMSG) << "a request";
  EXPECT_EQ(err_of(decode_request(good, kWatchCarrier)), EBADMSG) << "a response where a request belongs";
  Bytes longer = good;
  longer.resize(4096, std::byte{0xee});
  EXPECT_TRUE(decode_watch_rsp(longer).ok()) << "in a longer read buffer";
}

// Case: our own WATCH_RSP breaking the rules, and a buffer without room for its header.
// Expect: EINVAL, ENOBUFS.
TEST(IbnbdWatch, EncoderRefusesWhatTheDecoderWould) {
  Bytes b(4096);
  EXPECT_EQ(err_of(encode_watch_rsp(b, WatchRsp{0, 0, {}})), EINVAL) << "epoch 0";
  EXPECT_EQ(err_of(encode_watch_rsp(b, WatchRsp{1, 1, {{0, 8}, {1, 8}}})), EINVAL) << "more than total";
  EXPECT_EQ(err_of(encode_watch_rsp(b, WatchRsp{1, 2, {{1, 8}, {0, 8}}})), EINVAL) << "not ascending";
  EXPECT_EQ(err_of(encode_watch_rsp(b, WatchRsp{1, 2, {{1, 8}, {1, 8}}})), EINVAL) << "an id twice";
  EXPECT_EQ(err_of(encode_watch_rsp(b, WatchRsp{1, 1, {{1, UINT64_MAX}}})), EINVAL) << "past 2^64 bytes";
  EXPECT_EQ(err_of(encode_watch_rsp(std::span(b).first(sizeof(WatchRspMsg) - 1), two_devices())), ENOBUFS);
  EXPECT_EQ(err_of(encode_watch(std::span(b).first(sizeof(WatchMsg) - 1), Watch{})), ENOBUFS);
}

// ------------------------------------------------------------------------------------------
// Version negotiation

// Case: the server sees older, equal and newer clients. Expect: the minimum; below our minimum
// EPROTONOSUPPORT.
TEST(IbnbdVersion, ServerUsesTheMinimum) {
  EXPECT_EQ(negotiate_version(kProtoVersion).value(), kProtoVersion);
  EXPECT_EQ(negotiate_version(kProtoVersion + 1).value(), kProtoVersion) << "newer client";
  EXPECT_EQ(negotiate_version(255).value(), kProtoVersion);
  EXPECT_EQ(err_of(negotiate_version(kMinProtoVersion - 1)), EPROTONOSUPPORT);
  EXPECT_EQ(err_of(negotiate_version(0)), EPROTONOSUPPORT);
}

// Case: the client checks the answer to its proposal. Expect: the answer when it is at most the
// proposal and at least our minimum; a higher answer is a protocol error.
TEST(IbnbdVersion, ClientChecksTheAnswer) {
  EXPECT_EQ(accept_version(kProtoVersion, kProtoVersion).value(), kProtoVersion);
  EXPECT_EQ(err_of(accept_version(kProtoVersion, kProtoVersion + 1)), EPROTO);
  EXPECT_EQ(err_of(accept_version(kProtoVersion, kMinProtoVersion - 1)), EPROTONOSUPPORT);
}

// Case: a whole exchange, and one with a newer client whose SESS_INFO carries more than we know
// (version 3, reserved bytes set, a longer message). Expect: both end on our version.
TEST(IbnbdVersion, ExchangeEndsOnTheCommonVersion) {
  auto q = decode_sess_info(enc_sess_info(SessInfo{}), kSessInfoCarrier);
  ASSERT_TRUE(q.ok());
  const uint8_t agreed = negotiate_version(q->ver).value();
  Bytes buf(4096);  // the client's read buffer may be larger than the response
  ASSERT_TRUE(encode_sess_info_rsp(buf, SessInfoRsp{agreed}).ok());
  auto r = decode_sess_info_rsp(buf);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(accept_version(kProtoVersion, r->ver).value(), kProtoVersion);

  SessInfoMsg newer{};
  newer.hdr.type.set(static_cast<uint16_t>(MsgType::sess_info));
  newer.hdr.reserved.set(0x55);
  newer.ver = kProtoVersion + 1;
  newer.reserved[30] = 0xaa;
  Bytes nb = wire(newer);
  nb.resize(nb.size() + 16, std::byte{0x77});
  auto nq = decode_sess_info(nb, Carrier{IoDir::read, 4096});
  ASSERT_TRUE(nq.ok());
  EXPECT_EQ(negotiate_version(nq->ver).value(), kProtoVersion);
}

// Case: encoders asked to send a version we do not speak. Expect: EINVAL.
TEST(IbnbdVersion, EncodersSendOnlyVersionsWeSpeak) {
  Bytes b(64);
  EXPECT_EQ(err_of(encode_sess_info(b, SessInfo{kProtoVersion + 1})), EINVAL);
  EXPECT_EQ(err_of(encode_sess_info(b, SessInfo{kMinProtoVersion - 1})), EINVAL);
  EXPECT_EQ(err_of(encode_sess_info_rsp(b, SessInfoRsp{0})), EINVAL);
}

// ------------------------------------------------------------------------------------------
// Refusals: framing (EBADMSG)

// Case: every request cut one byte short, cut to a partial header, or empty. Expect: EBADMSG
// from its decoder and from decode_request.
TEST(IbnbdRefuse, TruncatedMessages) {
  const std::vector<std::pair<Bytes, Carrier>> reqs = {
      {enc_sess_info(SessInfo{}), kSessInfoCarrier},
      {enc_open(Open{AccessMode::ro, "disk"}), kOpenCarrier},
      {enc_close(Close{1}), kCloseCarrier},
      {enc_io(io(IoOp::write, 512)), Carrier{IoDir::write, 512}},
  };
  for (const auto& [b, c] : reqs) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{3}, b.size() - 1}) {
      EXPECT_EQ(err_of(decode_request(prefix(b, n), c)), EBADMSG) << "size " << b.size() << " cut to " << n;
    }
  }
  EXPECT_EQ(err_of(decode_open(prefix(enc_open(Open{AccessMode::ro, "d"}), 263), kOpenCarrier)), EBADMSG);
  EXPECT_EQ(err_of(decode_io(prefix(enc_io(io(IoOp::flush, 0)), 31), kCloseCarrier)), EBADMSG);
  EXPECT_EQ(err_of(decode_close(prefix(enc_close(Close{1}), 7), kCloseCarrier)), EBADMSG);
  EXPECT_EQ(err_of(decode_sess_info(prefix(enc_sess_info(SessInfo{}), 35), kSessInfoCarrier)), EBADMSG);
  EXPECT_EQ(err_of(decode_sess_info_rsp(prefix(enc_sess_info_rsp(SessInfoRsp{}), 35))), EBADMSG);
  EXPECT_EQ(err_of(decode_open_rsp(prefix(enc_open_rsp(OpenRsp{1, full_geometry()}), 55))), EBADMSG);
  EXPECT_EQ(err_of(peek_type(Bytes(3))), EBADMSG);
}

// Case: OPEN, CLOSE and IO with bytes after the message. Expect: EBADMSG (requests are exact).
TEST(IbnbdRefuse, RequestsWithTrailingBytes) {
  Bytes o = enc_open(Open{AccessMode::ro, "d"});
  o.push_back(std::byte{0});
  EXPECT_EQ(err_of(decode_open(o, kOpenCarrier)), EBADMSG);
  Bytes c = enc_close(Close{1});
  c.push_back(std::byte{0});
  EXPECT_EQ(err_of(decode_close(c, kCloseCarrier)), EBADMSG);
  Bytes i = enc_io(io(IoOp::flush, 0));
  i.push_back(std::byte{0});
  EXPECT_EQ(err_of(decode_io(i, kCloseCarrier)), EBADMSG);
}

// Case: unknown types, responses sent as requests, and a message handed to the wrong decoder.
// Expect: EBADMSG.
TEST(IbnbdRefuse, UnknownAndMisplacedTypes) {
  for (uint16_t t : {uint16_t{9}, uint16_t{0x100}, uint16_t{0xffff}}) {
    MsgHdr h{};
    h.type.set(t);
    Bytes b = wire(h);
    b.resize(64);
    EXPECT_EQ(err_of(peek_type(b)), EBADMSG) << t;
    EXPECT_EQ(err_of(decode_request(b, kCloseCarrier)), EBADMSG) << t;
  }
  const Extent one[] = {{512, 0}};
  Bytes st(kBlockStatusReplyBytes);
  ASSERT_TRUE(encode_block_status_rsp(st, one, 512).ok());
  EXPECT_EQ(err_of(decode_request(st, kCloseCarrier)), EBADMSG) << "BLOCK_STATUS_RSP as a request";
  EXPECT_EQ(err_of(decode_request(enc_sess_info_rsp(SessInfoRsp{}), kSessInfoCarrier)), EBADMSG);
  EXPECT_EQ(err_of(decode_request(enc_open_rsp(OpenRsp{1, full_geometry()}), kOpenCarrier)), EBADMSG);
  EXPECT_EQ(err_of(decode_close(enc_io(io(IoOp::flush, 0)), kCloseCarrier)), EBADMSG);
  EXPECT_EQ(err_of(decode_open_rsp(enc_sess_info_rsp(SessInfoRsp{}))), EBADMSG);
  EXPECT_EQ(err_of(decode_sess_info_rsp(enc_sess_info(SessInfo{}))), EBADMSG);
}

// ------------------------------------------------------------------------------------------
// Refusals: fields (EINVAL)

// Case: OPEN with an unknown mode, a name without NUL, an empty name, bytes after the NUL, a
// control character, reserved bytes. Expect: EINVAL.
TEST(IbnbdRefuse, BadOpen) {
  const OpenMsg base = as_wire<OpenMsg>(enc_open(Open{AccessMode::rw, "disk"}));
  std::vector<std::pair<const char*, OpenMsg>> cases;
  auto m = base; m.access_mode = 3; cases.push_back({"mode 3", m});
  m = base; m.access_mode = 0xff; cases.push_back({"mode 255", m});
  m = base; std::memset(m.dev_name, 'a', kDevNameField); cases.push_back({"no NUL", m});
  m = base; std::memset(m.dev_name, 0, kDevNameField); cases.push_back({"empty", m});
  m = base; m.dev_name[200] = 'x'; cases.push_back({"byte after the NUL", m});
  m = base; m.dev_name[1] = '\n'; cases.push_back({"control character", m});
  m = base; m.dev_name[1] = 0x7f; cases.push_back({"DEL", m});
  m = base; m.flags = 2; cases.push_back({"unknown flag 2", m});
  m = base; m.flags = 0x81; cases.push_back({"unknown flag 0x80 beside a known one", m});
  m = base; m.reserved1[2] = 1; cases.push_back({"reserved1", m});
  m = base; m.hdr.reserved.set(1); cases.push_back({"header reserved", m});
  for (const auto& [name, c] : cases) {
    EXPECT_EQ(err_of(decode_open(wire(c), kOpenCarrier)), EINVAL) << name;
  }
}

// Case: IO with unknown op or flag bits, NOUNMAP on other ops, bi_size not a multiple of 512,
// FLUSH with a size, other ops without one, a range past 2^64 bytes, reserved bytes. Expect:
// EINVAL.
TEST(IbnbdRefuse, BadIo) {
  const IoMsg base = as_wire<IoMsg>(enc_io(io(IoOp::discard, 4096)));
  std::vector<std::pair<const char*, IoMsg>> cases;
  auto m = base; m.rw.set(7); cases.push_back({"op 7", m});
  m = base; m.rw.set(0xff); cases.push_back({"op 255", m});
  m = base; m.rw.set(3 | (1u << 12)); cases.push_back({"flag bit 12", m});
  m = base; m.rw.set(3 | (1u << 31)); cases.push_back({"flag bit 31", m});
  m = base; m.rw.set(3 | kIoNoUnmap); cases.push_back({"NOUNMAP on discard", m});
  m = base; m.bi_size.set(4095); cases.push_back({"bi_size 4095", m});
  m = base; m.bi_size.set(0); cases.push_back({"discard of nothing", m});
  m = base; m.rw.set(static_cast<uint32_t>(IoOp::flush)); cases.push_back({"flush with a size", m});
  m = base; m.sector.set(std::numeric_limits<uint64_t>::max() / kSectorSize); cases.push_back({"end past 2^64 bytes", m});
  m = base; m.sector.set(std::numeric_limits<uint64_t>::max()); cases.push_back({"sector * 512 overflows", m});
  m = base; m.reserved[5] = 1; cases.push_back({"reserved", m});
  m = base; m.hdr.reserved.set(1); cases.push_back({"header reserved", m});
  for (const auto& [name, c] : cases) {
    EXPECT_EQ(err_of(decode_io(wire(c), kCloseCarrier)), EINVAL) << name;
  }
}

// Case: a well-formed IO whose transport carrier does not fit it. Expect: EINVAL.
TEST(IbnbdRefuse, IoOnTheWrongCarrier) {
  struct Case {
    const char* name;
    Io io;
    Carrier c;
  };
  const std::vector<Case> cases = {
      {"write with less data", io(IoOp::write, 8192), {IoDir::write, 4096}},
      {"write with more data", io(IoOp::write, 4096), {IoDir::write, 8192}},
      {"write as a transport read", io(IoOp::write, 4096), {IoDir::read, 4096}},
      {"read into a smaller buffer", io(IoOp::read, 8192), {IoDir::read, 4096}},
      {"read into a larger buffer", io(IoOp::read, 4096), {IoDir::read, 8192}},
      {"read as a transport write", io(IoOp::read, 4096), {IoDir::write, 4096}},
      {"flush with data", io(IoOp::flush, 0), {IoDir::write, 512}},
      {"flush as a read", io(IoOp::flush, 0), {IoDir::read, 0}},
      {"discard with data", io(IoOp::discard, 4096), {IoDir::write, 4096}},
      {"secure erase with data", io(IoOp::secure_erase, 4096), {IoDir::write, 512}},
      {"write zeroes with data", io(IoOp::write_zeroes, 4096), {IoDir::write, 4096}},
  };
  for (const Case& k : cases) {
    EXPECT_EQ(err_of(decode_io(enc_io(k.io), k.c)), EINVAL) << k.name;
    EXPECT_EQ(err_of(decode_request(enc_io(k.io), k.c)), EINVAL) << k.name;
  }
}

// Case: SESS_INFO, OPEN and CLOSE on the wrong carrier. Expect: EINVAL.
TEST(IbnbdRefuse, ControlMessagesOnTheWrongCarrier) {
  const Bytes s = enc_sess_info(SessInfo{});
  EXPECT_EQ(err_of(decode_sess_info(s, {IoDir::write, 36})), EINVAL);
  EXPECT_EQ(err_of(decode_sess_info(s, {IoDir::read, 35})), EINVAL) << "response does not fit";
  EXPECT_TRUE(decode_sess_info(s, {IoDir::read, 4096}).ok()) << "a larger buffer is fine";
  const Bytes o = enc_open(Open{AccessMode::ro, "d"});
  EXPECT_EQ(err_of(decode_open(o, {IoDir::write, 56})), EINVAL);
  EXPECT_EQ(err_of(decode_open(o, {IoDir::read, 55})), EINVAL);
  EXPECT_TRUE(decode_open(o, {IoDir::read, 4096}).ok());
  const Bytes c = enc_close(Close{1});
  EXPECT_EQ(err_of(decode_close(c, {IoDir::write, 8})), EINVAL) << "CLOSE carries no data";
  EXPECT_EQ(err_of(decode_close(c, {IoDir::read, 0})), EINVAL);
  Bytes ch = c;
  auto w = as_wire<CloseMsg>(ch);
  w.hdr.reserved.set(2);
  EXPECT_EQ(err_of(decode_close(wire(w), kCloseCarrier)), EINVAL);
}

// Case: OPEN_RSP with impossible geometry, unknown cache bits, secure_discard 2, reserved bytes.
// Expect: EINVAL; a longer read buffer is fine.
TEST(IbnbdRefuse, BadOpenRsp) {
  const Bytes good = enc_open_rsp(OpenRsp{5, full_geometry()});
  const OpenRspMsg base = as_wire<OpenRspMsg>(good);
  std::vector<std::pair<const char*, OpenRspMsg>> cases;
  auto m = base; m.logical_block_size.set(0); cases.push_back({"lbs 0", m});
  m = base; m.logical_block_size.set(256); cases.push_back({"lbs 256", m});
  m = base; m.logical_block_size.set(1000); cases.push_back({"lbs 1000", m});
  m = base; m.logical_block_size.set(128 * 1024); m.physical_block_size.set(128 * 1024);
  cases.push_back({"lbs 128 KiB", m});
  m = base; m.physical_block_size.set(2048); cases.push_back({"pbs < lbs", m});
  m = base; m.physical_block_size.set(12288); cases.push_back({"pbs not a power of two", m});
  m = base; m.max_hw_sectors.set(0); cases.push_back({"max_hw_sectors 0", m});
  m = base; m.nsectors.set(std::numeric_limits<uint64_t>::max() / kSectorSize + 1);
  cases.push_back({"size past 2^64 bytes", m});
  m = base; m.cache_policy = 4; cases.push_back({"cache bit 2", m});
  m = base; m.secure_discard = 2; cases.push_back({"secure_discard 2", m});
  m = base; m.size_epoch.set(1); cases.push_back({"size_epoch below version 4", m});
  m = base; m.hdr.reserved.set(1); cases.push_back({"header reserved", m});
  for (const auto& [name, c] : cases) {
    EXPECT_EQ(err_of(decode_open_rsp(wire(c), name == std::string("size_epoch below version 4") ? 3 : kProtoVersion)),
              EINVAL)
        << name;
  }
  Bytes longer = good;
  longer.resize(4096, std::byte{0xee});
  EXPECT_TRUE(decode_open_rsp(longer).ok());
}

// Case: SESS_INFO_RSP with reserved bytes (the server knew our version). Expect: EINVAL.
TEST(IbnbdRefuse, SessInfoRspReservedBytes) {
  auto m = as_wire<SessInfoRspMsg>(enc_sess_info_rsp(SessInfoRsp{}));
  m.reserved[0] = 1;
  EXPECT_EQ(err_of(decode_sess_info_rsp(wire(m))), EINVAL);
  m.reserved[0] = 0;
  m.hdr.reserved.set(1);
  EXPECT_EQ(err_of(decode_sess_info_rsp(wire(m))), EINVAL);
}

// ------------------------------------------------------------------------------------------
// Encoders refuse what the decoders would

// Case: every encoder with a buffer one byte short. Expect: ENOBUFS, nothing else written.
TEST(IbnbdEncode, ShortBuffers) {
  Bytes b(sizeof(OpenMsg) - 1, std::byte{0x5a});
  EXPECT_EQ(err_of(encode_open(b, Open{AccessMode::ro, "d"})), ENOBUFS);
  EXPECT_EQ(b, Bytes(sizeof(OpenMsg) - 1, std::byte{0x5a}));
  EXPECT_EQ(err_of(encode_sess_info(std::span(b).first(35), SessInfo{})), ENOBUFS);
  EXPECT_EQ(err_of(encode_sess_info_rsp(std::span(b).first(35), SessInfoRsp{})), ENOBUFS);
  EXPECT_EQ(err_of(encode_open_rsp(std::span(b).first(55), OpenRsp{0, full_geometry()})), ENOBUFS);
  EXPECT_EQ(err_of(encode_close(std::span(b).first(7), Close{})), ENOBUFS);
  EXPECT_EQ(err_of(encode_io(std::span(b).first(31), io(IoOp::flush, 0))), ENOBUFS);
}

// Case: our own messages breaking the rules. Expect: EINVAL, so we never send what we refuse.
TEST(IbnbdEncode, RefusesInvalidMessages) {
  Bytes b(512);
  EXPECT_EQ(err_of(encode_open(b, Open{AccessMode::ro, ""})), EINVAL);
  EXPECT_EQ(err_of(encode_open(b, Open{AccessMode::ro, std::string(kDevNameMax + 1, 'a')})), EINVAL);
  EXPECT_EQ(err_of(encode_open(b, Open{AccessMode::ro, std::string("a\0b", 3)})), EINVAL);
  EXPECT_EQ(err_of(encode_open(b, Open{static_cast<AccessMode>(3), "d"})), EINVAL);
  DeviceGeometry g = full_geometry();
  g.logical_block_size = 520;
  EXPECT_EQ(err_of(encode_open_rsp(b, OpenRsp{0, g})), EINVAL);
  EXPECT_EQ(err_of(encode_io(b, io(IoOp::write, 100))), EINVAL);
  EXPECT_EQ(err_of(encode_io(b, io(IoOp::write, 0))), EINVAL);
  EXPECT_EQ(err_of(encode_io(b, io(IoOp::flush, 512))), EINVAL);
  EXPECT_EQ(err_of(encode_io(b, io(IoOp::write, 512, kIoNoUnmap))), EINVAL);
  EXPECT_EQ(err_of(encode_io(b, io(static_cast<IoOp>(9), 512))), EINVAL);
  EXPECT_EQ(err_of(encode_io(b, io(IoOp::read, 512, 1u << 20))), EINVAL);
}

// ------------------------------------------------------------------------------------------
// Text forms (blockdev/src/types.cc)

// ------------------------------------------------------------------------------------------
// BLOCK_STATUS (version 5)

Io status_io(uint64_t sector, uint32_t len) { return Io{3, sector, IoOp::block_status, 0, len, 0}; }

// A BLOCK_STATUS_RSP as a hostile server could write it: header fields and raw entries.
Bytes raw_status(uint32_t count, std::vector<std::pair<uint32_t, uint32_t>> entries, size_t buf = kBlockStatusReplyBytes) {
  Bytes b(std::max(buf, sizeof(BlockStatusRspMsg) + entries.size() * sizeof(ExtentMsg)));
  BlockStatusRspMsg h{};
  h.hdr.type.set(static_cast<uint16_t>(MsgType::block_status_rsp));
  h.count.set(count);
  std::memcpy(b.data(), &h, sizeof(h));
  for (size_t i = 0; i < entries.size(); ++i) {
    ExtentMsg e{};
    e.length.set(entries[i].first);
    e.flags.set(entries[i].second);
    std::memcpy(b.data() + sizeof(h) + i * sizeof(e), &e, sizeof(e));
  }
  b.resize(buf);
  return b;
}

// Case: the layout of the answer and the IO that asks. Expect: 16-byte header, 8-byte entries,
// the client's buffer holds kMaxExtents of them; the IO rides a READ of exactly that buffer,
// whatever the range.
TEST(IbnbdBlockStatus, LayoutAndCarrier) {
  EXPECT_EQ(sizeof(BlockStatusRspMsg), 16u);
  EXPECT_EQ(offsetof(BlockStatusRspMsg, count), 4u);
  EXPECT_EQ(sizeof(ExtentMsg), 8u);
  EXPECT_EQ(offsetof(ExtentMsg, flags), 4u);
  EXPECT_EQ(kMaxExtents, 128u);
  EXPECT_EQ(kBlockStatusReplyBytes, 16u + 128 * 8);
  const Io io = status_io(2048, 1u << 30);
  EXPECT_EQ(carrier_of(io), (Carrier{IoDir::read, kBlockStatusReplyBytes}));
  auto d = decode_io(enc_io(io), carrier_of(io));
  ASSERT_TRUE(d.ok()) << d.error().message();
  EXPECT_EQ(*d, io);
}

// Case: hostile BLOCK_STATUS requests at the server: flags on it, zero length, a length off 512,
// a range past 2^64, the answer's buffer too small, too large, or a WRITE. Expect: EINVAL each.
// (A range past the device is the engine's EIO, as for READ.)
TEST(IbnbdBlockStatus, ServerRefusesBadRequests) {
  for (uint32_t f : {uint32_t{kIoFua}, uint32_t{kIoPreflush}, uint32_t{kIoNoUnmap}}) {
    Io io = status_io(0, 4096);
    io.flags = f;
    EXPECT_EQ(check_io(io).error(), std::errc::invalid_argument) << f;
  }
  EXPECT_EQ(check_io(status_io(0, 0)).error(), std::errc::invalid_argument) << "zero length";
  EXPECT_EQ(check_io(status_io(0, 4000)).error(), std::errc::invalid_argument) << "unaligned";
  EXPECT_EQ(check_io(status_io(std::numeric_limits<uint64_t>::max() / 512, 4096)).error(),
            std::errc::invalid_argument) << "past 2^64";
  const Bytes b = enc_io(status_io(8, 4096));
  for (Carrier c : {Carrier{IoDir::read, kBlockStatusReplyBytes - 1}, Carrier{IoDir::read, kBlockStatusReplyBytes + 1},
                    Carrier{IoDir::read, 4096}, Carrier{IoDir::write, kBlockStatusReplyBytes}})
    EXPECT_EQ(decode_io(b, c).error(), std::errc::invalid_argument) << c.data_len;
}

// Case: an answer of three extents (hole, data, hole-and-zero... as a file's) over a prefix of
// the range. Expect: it round-trips; covered() is the prefix; the whole range may be covered.
TEST(IbnbdBlockStatus, AnswerRoundTrips) {
  const std::vector<Extent> ex = {{1u << 20, kExtentHole | kExtentZero}, {4096, 0}, {512, kExtentZero}};
  Bytes b(kBlockStatusReplyBytes);
  auto n = encode_block_status_rsp(b, ex, 8u << 20);
  ASSERT_TRUE(n.ok()) << n.error().message();
  EXPECT_EQ(*n, 16u + 3 * 8);
  ExtentList l;
  ASSERT_TRUE(decode_block_status_rsp(b, 8u << 20, l).ok());
  ASSERT_EQ(l.count, 3u);
  for (size_t i = 0; i < ex.size(); ++i) EXPECT_EQ(l.e[i], ex[i]);
  EXPECT_EQ(l.covered(), (1u << 20) + 4096 + 512);
  EXPECT_TRUE(decode_block_status_rsp(b, l.covered(), l).ok()) << "exactly the range";
}

// Case: hostile answers at the client: zero-length extents, lengths off 512, extents that
// overrun the range, unknown flags, reserved bytes, no extent, a count beyond the buffer or
// beyond kMaxExtents, a short buffer, another type. Expect: EINVAL or EBADMSG as documented,
// and `out` left empty (the caller never sees half an answer).
TEST(IbnbdBlockStatus, ClientRefusesBadAnswers) {
  ExtentList l;
  auto refused = [&](const Bytes& b, uint64_t range, std::errc want, const char* what) {
    l.count = 7;
    auto st = decode_block_status_rsp(b, range, l);
    ASSERT_FALSE(st.ok()) << what;
    EXPECT_EQ(st.error(), want) << what;
    EXPECT_EQ(l.count, 0u) << what;
  };
  refused(raw_status(1, {{0, 0}}), 4096, std::errc::invalid_argument, "zero length");
  refused(raw_status(1, {{1000, 0}}), 4096, std::errc::invalid_argument, "length off 512");
  refused(raw_status(2, {{4096, 0}, {512, 1}}), 4096, std::errc::invalid_argument, "overruns the range");
  refused(raw_status(1, {{8192, 0}}), 4096, std::errc::invalid_argument, "one extent past the range");
  refused(raw_status(2, {{0xfffffe00u, 0}, {0xfffffe00u, 0}}), 0x100000000ull, std::errc::invalid_argument,
          "a sum that would wrap 32 bits");
  refused(raw_status(1, {{512, 4}}), 4096, std::errc::invalid_argument, "unknown flag");
  refused(raw_status(0, {}), 4096, std::errc::invalid_argument, "no extent");
  Bytes r = raw_status(1, {{512, 0}});
  r[8] = std::byte{1};
  refused(r, 4096, std::errc::invalid_argument, "reserved bytes");
  r = raw_status(1, {{512, 0}});
  r[2] = std::byte{1};
  refused(r, 4096, std::errc::invalid_argument, "header reserved");
  refused(raw_status(kMaxExtents + 1, {}, kBlockStatusReplyBytes + 8), 1u << 30, std::errc::bad_message,
          "more than kMaxExtents, buffer large enough");
  refused(raw_status(3, {{512, 0}}, 16 + 8), 4096, std::errc::bad_message, "count beyond the buffer");
  refused(raw_status(0xffffffffu, {}, 16), 4096, std::errc::bad_message, "count 2^32-1");
  refused(prefix(raw_status(1, {{512, 0}}), 15), 4096, std::errc::bad_message, "shorter than the header");
  refused(enc_watch_rsp(two_devices()), 4096, std::errc::bad_message, "a WATCH_RSP");
}

// Case: our own answers breaking the rules, and a buffer too small. Expect: EINVAL / ENOBUFS,
// so the server never sends what the client refuses.
TEST(IbnbdBlockStatus, EncoderRefusesWhatTheDecoderWould) {
  Bytes b(kBlockStatusReplyBytes);
  EXPECT_EQ(encode_block_status_rsp(b, {}, 4096).error(), std::errc::invalid_argument);
  const std::vector<Extent> zero = {{0, 0}};
  EXPECT_EQ(encode_block_status_rsp(b, zero, 4096).error(), std::errc::invalid_argument);
  const std::vector<Extent> over = {{8192, 0}};
  EXPECT_EQ(encode_block_status_rsp(b, over, 4096).error(), std::errc::invalid_argument);
  const std::vector<Extent> flag = {{512, 8}};
  EXPECT_EQ(encode_block_status_rsp(b, flag, 4096).error(), std::errc::invalid_argument);
  const std::vector<Extent> many(kMaxExtents + 1, Extent{512, 0});
  EXPECT_EQ(encode_block_status_rsp(b, many, 1u << 20).error(), std::errc::invalid_argument);
  const std::vector<Extent> one = {{512, 0}};
  Bytes small(16 + 7);
  EXPECT_EQ(encode_block_status_rsp(small, one, 4096).error(), std::errc::no_buffer_space);
}

// Case: access modes as users write them. Expect: the kernel's words, a trailing newline
// tolerated, anything else refused; to_string gives the words back.
TEST(IbnbdText, AccessModes) {
  EXPECT_EQ(parse_access_mode("ro"), AccessMode::ro);
  EXPECT_EQ(parse_access_mode("rw\n"), AccessMode::rw);
  EXPECT_EQ(parse_access_mode(" migration "), AccessMode::migration);
  EXPECT_EQ(parse_access_mode("RW"), std::nullopt);
  EXPECT_EQ(parse_access_mode("1"), std::nullopt);
  EXPECT_EQ(parse_access_mode(""), std::nullopt);
  for (AccessMode m : {AccessMode::ro, AccessMode::rw, AccessMode::migration})
    EXPECT_EQ(parse_access_mode(to_string(m)), m);
  EXPECT_EQ(to_string(IoOp::write_zeroes), "write_zeroes");
  EXPECT_EQ(to_string(IoOp::secure_erase), "secure_erase");
  EXPECT_EQ(to_string(MsgType::open_rsp), "OPEN_RSP");
}

}  // namespace
}  // namespace ibnbd::proto

namespace ibnbd {
namespace {
// Case: sizes as admins type them (CLI, daemon config). Expect: binary units, nothing for
// unknown units or overflow.
TEST(ParseSize, BinaryUnitsAndRefusals) {
  EXPECT_EQ(base::parse_size("4096"), 4096u);
  EXPECT_EQ(base::parse_size("4K"), 4096u);
  EXPECT_EQ(base::parse_size("128KiB"), 131072u);
  EXPECT_EQ(base::parse_size("2M"), 2u << 20);
  EXPECT_EQ(base::parse_size("2m"), 2u << 20) << "the bench tools wrote 1m";
  EXPECT_EQ(base::parse_size("1G"), 1u << 30);
  EXPECT_EQ(base::parse_size("3T"), uint64_t{3} << 40);
  EXPECT_FALSE(base::parse_size("").has_value());
  EXPECT_FALSE(base::parse_size("12X").has_value());
  EXPECT_FALSE(base::parse_size("M").has_value());
  EXPECT_FALSE(base::parse_size("99999999999999T").has_value()) << "overflows 64 bits";
}
}  // namespace
}  // namespace ibnbd
