#include "ibnbd_proto_target.h"

#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "proto/ibnbd_proto.h"

namespace ibnbd::fuzz {
namespace {

using namespace ibnbd::proto;

// Decoders are strict, so a message they accept has one encoding: the bytes it came from.
template <typename Msg, typename Enc>
void expect_reencodes(Enc enc, const Msg& m, std::span<const std::byte> original) {
  std::byte out[512];
  auto n = enc(std::span<std::byte>(out), m);
  if (!n.ok() || *n > original.size() || std::memcmp(out, original.data(), *n) != 0) std::abort();
}

std::vector<uint8_t> with_prefix(uint8_t which, ibtrs::IoDir dir, uint32_t data_len,
                                 std::span<const std::byte> msg) {
  std::vector<uint8_t> s{which, static_cast<uint8_t>(dir)};
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<uint8_t>(data_len >> (8 * i)));
  const auto* p = reinterpret_cast<const uint8_t*>(msg.data());
  s.insert(s.end(), p, p + msg.size());
  return s;
}

}  // namespace

// Input: [selector][carrier direction][carrier data length, 4 bytes LE][message bytes].
int proto_one_input(const uint8_t* data, size_t size) {
  if (size < 6) return 0;
  const Carrier c{(data[1] & 1) != 0 ? ibtrs::IoDir::write : ibtrs::IoDir::read,
                  size_t{data[2]} | size_t{data[3]} << 8 | size_t{data[4]} << 16 |
                      size_t{data[5]} << 24};
  std::span<const std::byte> msg(reinterpret_cast<const std::byte*>(data + 6), size - 6);
  switch (data[0] % 6) {
    case 0: {
      auto r = decode_request(msg, c);
      if (!r.ok()) break;
      switch (r->type) {
        case MsgType::sess_info:
          if (c.dir != ibtrs::IoDir::read || c.data_len < kSessInfoCarrier.data_len) std::abort();
          (void)negotiate_version(r->sess_info.ver);
          break;
        case MsgType::open:
          if (c.dir != ibtrs::IoDir::read || c.data_len < kOpenCarrier.data_len) std::abort();
          expect_reencodes(encode_open, r->open, msg);
          break;
        case MsgType::close:
          if (c != kCloseCarrier) std::abort();
          expect_reencodes(encode_close, r->close, msg);
          break;
        case MsgType::io:
          if (c != carrier_of(r->io)) std::abort();
          expect_reencodes(encode_io, r->io, msg);
          break;
        case MsgType::watch:
          if (c.dir != ibtrs::IoDir::read || c.data_len < kWatchCarrier.data_len) std::abort();
          expect_reencodes(encode_watch, r->watch, msg);
          break;
        default:
          std::abort();  // responses are never requests
      }
      break;
    }
    case 1: {
      auto r = decode_sess_info_rsp(msg);
      if (r.ok() && accept_version(kProtoVersion, r->ver).ok())
        expect_reencodes(encode_sess_info_rsp, *r, msg);
      break;
    }
    case 2: {
      auto r = decode_open_rsp(msg);
      if (r.ok()) expect_reencodes(encode_open_rsp, *r, msg);
      break;
    }
    case 4: {
      // A WATCH_RSP: what it lists lies in the buffer, and it encodes back to its own bytes
      // (into a buffer of exactly what it used, so the encoder lists as many).
      auto r = decode_watch_rsp(msg);
      if (!r.ok()) break;
      if (r->entries.size() > r->total || watch_buffer_bytes(r->entries.size()) > msg.size()) std::abort();
      std::vector<std::byte> out(watch_buffer_bytes(r->entries.size()));
      auto n = encode_watch_rsp(out, *r);
      if (!n.ok() || *n != out.size() || std::memcmp(out.data(), msg.data(), out.size()) != 0) std::abort();
      break;
    }
    case 5: {
      // A BLOCK_STATUS_RSP; the carrier's length field doubles as the range asked about. What
      // it lists lies in the buffer and in the range, and encodes back to its own bytes.
      const uint64_t range = c.data_len;
      static ExtentList l;  // 2 KiB: off the fuzzer's stack
      if (!decode_block_status_rsp(msg, range, l).ok()) break;
      const size_t used = sizeof(BlockStatusRspMsg) + l.count * sizeof(ExtentMsg);
      if (l.count == 0 || l.count > kMaxExtents || used > msg.size() || l.covered() > range) std::abort();
      std::vector<std::byte> out(used);
      auto n = encode_block_status_rsp(out, std::span<const Extent>(l.e, l.count), range);
      if (!n.ok() || *n != used || std::memcmp(out.data(), msg.data(), used) != 0) std::abort();
      break;
    }
    default: {
      // The carrier's length field doubles as the rw word.
      const auto rw = static_cast<uint32_t>(c.data_len);
      auto r = unpack_rw(rw);
      if (r.ok() && pack_rw(r->op, r->flags).value() != rw) std::abort();
      break;
    }
  }
  return 0;
}

std::vector<std::vector<uint8_t>> proto_seeds() {
  using ibtrs::IoDir;
  std::vector<std::vector<uint8_t>> seeds;
  std::byte buf[512];
  auto add = [&](uint8_t which, Carrier c, Result<size_t> n) {
    seeds.push_back(with_prefix(which, c.dir, static_cast<uint32_t>(c.data_len),
                                std::span<const std::byte>(buf, n.ok() ? *n : 0)));
  };
  add(0, kSessInfoCarrier, encode_sess_info(buf, SessInfo{}));
  add(0, kOpenCarrier, encode_open(buf, Open{AccessMode::migration, "vg0/disk1"}));
  add(0, kCloseCarrier, encode_close(buf, Close{3}));
  Io w;
  w.device_id = 1;
  w.sector = 2048;
  w.op = IoOp::write;
  w.flags = kIoFua;
  w.bi_size = 4096;
  add(0, carrier_of(w), encode_io(buf, w));
  Io z = w;
  z.op = IoOp::write_zeroes;
  z.flags = kIoNoUnmap;
  z.bi_size = 1u << 20;
  add(0, carrier_of(z), encode_io(buf, z));
  add(1, kSessInfoCarrier, encode_sess_info_rsp(buf, SessInfoRsp{}));
  DeviceGeometry g;
  g.nsectors = 1u << 21;
  g.max_hw_sectors = 256;
  g.max_discard_sectors = 1u << 16;
  g.discard_granularity = 4096;
  g.max_segments = 64;
  g.cache_policy = kCacheWriteBack;
  add(2, kOpenCarrier, encode_open_rsp(buf, OpenRsp{9, g}));
  seeds.push_back(with_prefix(3, IoDir::read, pack_rw(IoOp::flush, kIoPreflush).value(), {}));
  add(0, Carrier{IoDir::read, watch_buffer_bytes(256)}, encode_watch(buf, Watch{0x1122334455667788ull}));
  add(4, kWatchCarrier, encode_watch_rsp(buf, WatchRsp{9, 3, {{0, 2048}, {2, 1u << 21}, {7, 8}}}));
  Io bs;
  bs.device_id = 2;
  bs.sector = 4096;
  bs.op = IoOp::block_status;
  bs.bi_size = 1u << 30;
  add(0, carrier_of(bs), encode_io(buf, bs));
  const Extent ex[] = {{1u << 20, kExtentHole | kExtentZero}, {65536, 0}, {4096, kExtentZero}};
  add(5, Carrier{IoDir::read, 8u << 20}, encode_block_status_rsp(buf, ex, 8u << 20));
  return seeds;
}

}  // namespace ibnbd::fuzz
