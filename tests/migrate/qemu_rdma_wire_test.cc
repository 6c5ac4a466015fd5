// QEMU's RDMA migration control channel (client/migrate/src/qemu_rdma_wire.h) against the bytes
// QEMU 7.2's migration/rdma.c puts on the wire, and every check a hostile peer meets.
#include <gtest/gtest.h>

#include <cstring>

#include "qemu_rdma_wire.h"

namespace ibnbd::migrate::qrdma {
namespace {

using Bytes = std::vector<std::byte>;
constexpr uint64_t MiB = 1ull << 20;

Bytes hexbytes(std::initializer_list<int> v) {
  Bytes b;
  for (int x : v) b.push_back(static_cast<std::byte>(x));
  return b;
}

// A message as a peer would send it: header fields and payload chosen freely.
Bytes raw(uint32_t len, uint32_t type, uint32_t repeat, const Bytes& payload, uint32_t padding = 0) {
  HeaderWire h{};
  h.len.set(len);
  h.type.set(type);
  h.repeat.set(repeat);
  h.padding.set(padding);
  Bytes b(sizeof(h));
  std::memcpy(b.data(), &h, sizeof(h));
  b.insert(b.end(), payload.begin(), payload.end());
  return b;
}

template <typename T>
Bytes entries(const std::vector<T>& v) {
  Bytes b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

RegisterWire reg(uint64_t key, uint32_t index, uint64_t chunks, uint32_t padding = 0) {
  RegisterWire w{};
  w.key.set(key);
  w.current_index.set(index);
  w.padding.set(padding);
  w.chunks.set(chunks);
  return w;
}

CompressWire comp(uint32_t value, uint32_t block, uint64_t addr, uint64_t length) {
  CompressWire w{};
  w.value.set(value);
  w.block_idx.set(block);
  w.offset.set(addr);
  w.length.set(length);
  return w;
}

// The destination's layout of a pc guest with 32 MiB: pc.ram (a multiple of 1 MiB), a 128 KiB
// ROM and a 1.5 MiB block, at offsets the way QEMU lays out ram_addr (not from 0, with holes).
RamLayout layout() {
  auto l = RamLayout::make({{"pc.ram", 0, 32 * MiB}, {"/rom@etc/acpi/tables", 64 * MiB, 128 * 1024},
                            {"odd", 128 * MiB, 3 * MiB / 2}});
  EXPECT_TRUE(l.ok());
  return *l;
}

std::error_code decode_err(const Bytes& m, const RamLayout* l = nullptr, std::string* why = nullptr) {
  return decode_control(m, l, why).error();
}

// Case: QEMU 7.2's enum of control messages. Expect: the numbering of rdma.c (NONE 0 .. UNREGISTER
// FINISHED 11), not the 2013 seed's 1-based list of 9.
TEST(QemuRdmaWire, MessageTypesHaveQemu72Numbering) {
  EXPECT_EQ(static_cast<uint32_t>(MsgType::none), 0u);
  EXPECT_EQ(static_cast<uint32_t>(MsgType::error), 1u);
  EXPECT_EQ(static_cast<uint32_t>(MsgType::ready), 2u);
  EXPECT_EQ(static_cast<uint32_t>(MsgType::qemu_file), 3u);
  EXPECT_EQ(static_cast<uint32_t>(MsgType::ram_blocks_request), 4u);
  EXPECT_EQ(static_cast<uint32_t>(MsgType::ram_blocks_result), 5u);
  EXPECT_EQ(static_cast<uint32_t>(MsgType::compress), 6u);
  EXPECT_EQ(static_cast<uint32_t>(MsgType::register_request), 7u);
  EXPECT_EQ(static_cast<uint32_t>(MsgType::register_result), 8u);
  EXPECT_EQ(static_cast<uint32_t>(MsgType::register_finished), 9u);
  EXPECT_EQ(static_cast<uint32_t>(MsgType::unregister_request), 10u);
  EXPECT_EQ(static_cast<uint32_t>(MsgType::unregister_finished), 11u);
  EXPECT_EQ(to_string(MsgType::register_finished), "REGISTER FINISHED");
}

// Case: READY as our side sends it. Expect: rdma.c's 16-byte header, big-endian: len 0, type 2,
// repeat 1, padding 0.
TEST(QemuRdmaWire, ReadyIsSixteenBigEndianBytes) {
  Bytes out(64);
  auto n = encode_empty(out, MsgType::ready);
  ASSERT_TRUE(n.ok());
  out.resize(*n);
  EXPECT_EQ(out, hexbytes({0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0}));
  auto m = decode_control(out, nullptr);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->type, MsgType::ready);
}

// Case: the capabilities in the rdma_cm private data. Expect: version then flags, each a
// big-endian u32; a padded private data (InfiniBand hands over 56 bytes) decodes; a short one,
// version 0 or 2 do not.
TEST(QemuRdmaWire, CapabilitiesAreNetworkOrder) {
  auto b = encode_caps({kVersion, kCapPinAll});
  EXPECT_EQ(Bytes(b.begin(), b.end()), hexbytes({0, 0, 0, 1, 0, 0, 0, 1}));
  Bytes padded(b.begin(), b.end());
  padded.resize(56, std::byte{0xee});
  auto c = decode_caps(padded);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->flags, kCapPinAll);
  std::string why;
  EXPECT_EQ(decode_caps(std::span(padded).first(7), &why).error(), ibtrs::errc(EBADMSG));
  EXPECT_NE(why.find("8 needed"), std::string::npos) << why;
  EXPECT_EQ(decode_caps(hexbytes({0, 0, 0, 2, 0, 0, 0, 0})).error(), ibtrs::errc(EPROTONOSUPPORT));
  EXPECT_EQ(decode_caps(hexbytes({0, 0, 0, 0, 0, 0, 0, 0})).error(), ibtrs::errc(EPROTONOSUPPORT));
}

// Case: a source asks for pin-all and two flags nobody knows. Expect: the answer keeps pin-all
// only (or nothing when pin-all is not allowed), as qemu_rdma_accept does; a destination that
// grants what was not asked is refused by the source's check.
TEST(QemuRdmaWire, CapabilityNegotiation) {
  const Caps asked{kVersion, kCapPinAll | 0x6};
  EXPECT_EQ(answer_caps(asked, true).flags, kCapPinAll);
  EXPECT_EQ(answer_caps(asked, false).flags, 0u);
  EXPECT_EQ(answer_caps(asked, true).version, kVersion);
  auto ok = encode_caps({kVersion, kCapPinAll});
  EXPECT_TRUE(check_answer({kVersion, kCapPinAll}, ok).ok());
  std::string why;
  EXPECT_EQ(check_answer({kVersion, 0}, ok, &why).error(), ibtrs::errc(EPROTO));
  EXPECT_NE(why.find("0x1"), std::string::npos) << why;
}

// Case: lengths a peer lies about. Expect: a header shorter than 16 bytes, a len that disagrees
// with the bytes received (both ways), a message beyond RDMA_CONTROL_MAX_BUFFER: EBADMSG.
TEST(QemuRdmaWire, LengthMustMatchTheReceivedBytes) {
  EXPECT_EQ(decode_err(Bytes(15)), ibtrs::errc(EBADMSG));
  EXPECT_EQ(decode_err(raw(8, 3, 1, Bytes(4))), ibtrs::errc(EBADMSG));
  EXPECT_EQ(decode_err(raw(2, 3, 1, Bytes(4))), ibtrs::errc(EBADMSG));
  const size_t max_payload = kControlMaxBuffer - sizeof(HeaderWire);
  EXPECT_TRUE(decode_control(raw(static_cast<uint32_t>(max_payload), 3, 1, Bytes(max_payload)), nullptr).ok());
  EXPECT_EQ(decode_err(raw(static_cast<uint32_t>(max_payload + 1), 3, 1, Bytes(max_payload + 1))),
            ibtrs::errc(EBADMSG));
  EXPECT_EQ(decode_err(raw(0xffffffff, 3, 1, Bytes(32))), ibtrs::errc(EBADMSG));
}

// Case: types outside 1..11. Expect: EPROTO, NONE included (rdma.c's "expect anything" value).
TEST(QemuRdmaWire, UnknownTypesAreRefused) {
  for (uint32_t t : {0u, 12u, 13u, 0x80000000u, 0xffffffffu}) {
    std::string why;
    EXPECT_EQ(decode_err(raw(0, t, 1, {}), nullptr, &why), ibtrs::errc(EPROTO)) << t;
    EXPECT_NE(why.find("unknown"), std::string::npos) << why;
  }
}

// Case: QEMU FILE as QEMU 7.2 sends it: repeat and padding are stack garbage (writev leaves
// them uninitialised). Expect: accepted; the payload comes back as a view of the input.
TEST(QemuRdmaWire, QemuFileIgnoresRepeatAndPadding) {
  Bytes payload = hexbytes({'Q', 'E', 'V', 'M', 0, 0, 0, 3});
  Bytes m = raw(8, 3, 0xdeadbeef, payload, 0x41414141);
  auto d = decode_control(m, nullptr);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->type, MsgType::qemu_file);
  ASSERT_EQ(d->file.size(), 8u);
  EXPECT_EQ(d->file.data(), m.data() + 16);
  Bytes out(32);
  auto n = encode_qemu_file(out, payload);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(Bytes(out.begin(), out.begin() + 12), hexbytes({0, 0, 0, 8, 0, 0, 0, 3, 0, 0, 0, 1}));
  EXPECT_EQ(encode_qemu_file(out, Bytes(17)).error(), ibtrs::errc(ENOBUFS));
  Bytes big(kControlMaxBuffer);
  EXPECT_TRUE(encode_qemu_file(big, Bytes(kControlMaxBuffer - 16)).ok());
  EXPECT_EQ(encode_qemu_file(big, Bytes(kControlMaxBuffer - 15)).error(), ibtrs::errc(EINVAL));
}

// Case: messages without payload that carry some, and repeat beyond
// RDMA_CONTROL_MAX_COMMANDS_PER_MESSAGE. Expect: EBADMSG.
TEST(QemuRdmaWire, PayloadFreeMessagesAndRepeatBound) {
  for (uint32_t t : {1u, 2u, 4u, 9u, 11u}) {
    EXPECT_EQ(decode_err(raw(4, t, 1, Bytes(4))), ibtrs::errc(EBADMSG)) << t;
    EXPECT_TRUE(decode_control(raw(0, t, kMaxCommands, {}), nullptr).ok()) << t;
    EXPECT_EQ(decode_err(raw(0, t, kMaxCommands + 1, {})), ibtrs::errc(EBADMSG)) << t;
  }
  Bytes out(8);
  EXPECT_EQ(encode_empty(out, MsgType::ready).error(), ibtrs::errc(ENOBUFS));
  Bytes big(64);
  EXPECT_EQ(encode_empty(big, MsgType::compress).error(), ibtrs::errc(EINVAL));
}

// Case: REGISTER REQUEST as QEMU's source builds it (repeat 1, padding uninitialised): the
// address in the destination's ram_addr space. Expect: decoded to block, offset and the chunk
// span; our encoder writes the same bytes (with padding 0).
TEST(QemuRdmaWire, RegisterRequestRoundTrip) {
  const RamLayout l = layout();
  Bytes m = raw(24, 7, 1, entries<RegisterWire>({reg(64 * MiB + 8192, 1, 0, 0x12345678)}));
  auto d = decode_control(m, &l);
  ASSERT_TRUE(d.ok());
  ASSERT_EQ(d->registers.size(), 1u);
  const RegisterRequest& r = d->registers[0];
  EXPECT_EQ(r.block, 1u);
  EXPECT_EQ(r.offset, 8192u);
  EXPECT_EQ(r.first_chunk, 0u);
  EXPECT_EQ(r.begin, 0u);
  EXPECT_EQ(r.end, 128u * 1024);  // the block is shorter than a chunk
  Bytes out(64);
  const RegisterArg arg{1, 8192, 0};
  auto n = encode_register_request(out, l, std::span(&arg, 1));
  ASSERT_TRUE(n.ok());
  out.resize(*n);
  EXPECT_EQ(out, raw(24, 7, 1, entries<RegisterWire>({reg(64 * MiB + 8192, 1, 0)})));
}

// Case: registrations that reach the end of a block. Expect: the last chunk of a 1.5 MiB block
// ends at 1.5 MiB; two chunks from chunk 0 cover it; chunk 32 of a 32 MiB block (the empty
// chunk QEMU's table has) cannot be named; `chunks` that would wrap is refused.
TEST(QemuRdmaWire, RegisterRequestChunkSpans) {
  const RamLayout l = layout();
  auto d = decode_control(raw(24, 7, 1, entries<RegisterWire>({reg(128 * MiB + MiB, 2, 0)})), &l);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->registers[0].begin, MiB);
  EXPECT_EQ(d->registers[0].end, 3 * MiB / 2);
  d = decode_control(raw(24, 7, 1, entries<RegisterWire>({reg(128 * MiB, 2, 1)})), &l);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->registers[0].end, 3 * MiB / 2);
  EXPECT_EQ(decode_err(raw(24, 7, 1, entries<RegisterWire>({reg(128 * MiB, 2, 2)})), &l), ibtrs::errc(ERANGE));
  EXPECT_EQ(decode_err(raw(24, 7, 1, entries<RegisterWire>({reg(32 * MiB, 0, 0)})), &l), ibtrs::errc(ERANGE));
  EXPECT_EQ(decode_err(raw(24, 7, 1, entries<RegisterWire>({reg(31 * MiB, 0, ~0ull)})), &l), ibtrs::errc(ERANGE));
  EXPECT_EQ(decode_err(raw(24, 7, 1, entries<RegisterWire>({reg(0, 0, ~0ull - 1)})), &l), ibtrs::errc(ERANGE));
}

// Case: REGISTER REQUESTs a hostile source sends. Expect: a block index beyond the layout and an
// address below the block (QEMU checks both), an address past the block's end (QEMU does not:
// it would register memory after the block), repeat 0, repeat that disagrees with the length,
// repeat 4097: all refused; without a layout (before the RAM block list): EPROTO.
TEST(QemuRdmaWire, RegisterRequestHostile) {
  const RamLayout l = layout();
  std::string why;
  EXPECT_EQ(decode_err(raw(24, 7, 1, entries<RegisterWire>({reg(0, 3, 0)})), &l, &why), ibtrs::errc(ERANGE));
  EXPECT_NE(why.find("block index 3"), std::string::npos) << why;
  EXPECT_EQ(decode_err(raw(24, 7, 1, entries<RegisterWire>({reg(64 * MiB - 4096, 1, 0)})), &l), ibtrs::errc(ERANGE));
  EXPECT_EQ(decode_err(raw(24, 7, 1, entries<RegisterWire>({reg(64 * MiB + 128 * 1024, 1, 0)})), &l, &why),
            ibtrs::errc(ERANGE));
  EXPECT_NE(why.find("outside block 1"), std::string::npos) << why;
  EXPECT_EQ(decode_err(raw(0, 7, 0, {}), &l), ibtrs::errc(EBADMSG));
  EXPECT_EQ(decode_err(raw(24, 7, 2, entries<RegisterWire>({reg(0, 0, 0)})), &l), ibtrs::errc(EBADMSG));
  std::vector<RegisterWire> many(kMaxCommands + 1, reg(0, 0, 0));
  EXPECT_EQ(decode_err(raw(static_cast<uint32_t>(many.size() * 24), 7, kMaxCommands + 1, entries(many)), &l),
            ibtrs::errc(EBADMSG));
  many.pop_back();
  auto d = decode_control(raw(static_cast<uint32_t>(many.size() * 24), 7, kMaxCommands, entries(many)), &l);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->registers.size(), kMaxCommands);
  EXPECT_EQ(decode_err(raw(24, 7, 1, entries<RegisterWire>({reg(0, 0, 0)}))), ibtrs::errc(EPROTO));
  Bytes out(64);
  const RegisterArg bad{0, 32 * MiB, 0};
  EXPECT_EQ(encode_register_request(out, l, std::span(&bad, 1)).error(), ibtrs::errc(EINVAL));
}

// Case: COMPRESS of a zero chunk as QEMU sends it (value 0, one chunk at most). Expect: decoded;
// a range crossing a chunk boundary or the block's end, an empty range, an address outside the
// block, a value that is not a byte, repeat 2: refused.
TEST(QemuRdmaWire, Compress) {
  const RamLayout l = layout();
  auto d = decode_control(raw(24, 6, 1, entries<CompressWire>({comp(0, 0, 3 * MiB, MiB)})), &l);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->compress.block, 0u);
  EXPECT_EQ(d->compress.offset, 3 * MiB);
  EXPECT_EQ(d->compress.length, MiB);
  d = decode_control(raw(24, 6, 1, entries<CompressWire>({comp(0x5a, 2, 128 * MiB + MiB, MiB / 2)})), &l);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->compress.value, 0x5a);
  std::string why;
  EXPECT_EQ(decode_err(raw(24, 6, 1, entries<CompressWire>({comp(0, 0, 3 * MiB + 4096, MiB)})), &l, &why),
            ibtrs::errc(ERANGE));
  EXPECT_NE(why.find("leave its chunk"), std::string::npos) << why;
  EXPECT_EQ(decode_err(raw(24, 6, 1, entries<CompressWire>({comp(0, 2, 128 * MiB + MiB, MiB)})), &l),
            ibtrs::errc(ERANGE));
  EXPECT_EQ(decode_err(raw(24, 6, 1, entries<CompressWire>({comp(0, 0, 0, 0)})), &l), ibtrs::errc(ERANGE));
  EXPECT_EQ(decode_err(raw(24, 6, 1, entries<CompressWire>({comp(0, 1, 0, 4096)})), &l), ibtrs::errc(ERANGE));
  EXPECT_EQ(decode_err(raw(24, 6, 1, entries<CompressWire>({comp(0, 0, ~0ull, 4096)})), &l), ibtrs::errc(ERANGE));
  EXPECT_EQ(decode_err(raw(24, 6, 1, entries<CompressWire>({comp(0x100, 0, 0, 4096)})), &l), ibtrs::errc(EBADMSG));
  EXPECT_EQ(decode_err(raw(48, 6, 2, entries<CompressWire>({comp(0, 0, 0, 4096), comp(0, 0, 0, 4096)})), &l),
            ibtrs::errc(EBADMSG));
  Bytes out(64);
  auto n = encode_compress(out, l, 2, MiB, MiB / 2);
  ASSERT_TRUE(n.ok());
  out.resize(*n);
  EXPECT_EQ(out, raw(24, 6, 1, entries<CompressWire>({comp(0, 2, 128 * MiB + MiB, MiB / 2)})));
  EXPECT_EQ(encode_compress(out, l, 0, MiB - 4096, 8192).error(), ibtrs::errc(EINVAL));
}

// Case: RAM BLOCKS RESULT from a destination (repeat 1, one 32-byte entry per block). Expect:
// decoded in order; a count or a length that differs from the source's blocks (QEMU's source
// checks both) and destination offsets that overlap are refused.
TEST(QemuRdmaWire, RamBlocksResult) {
  const RamLayout src = layout();
  auto dst = RamLayout::packed({{"pc.ram", 0, 32 * MiB}, {"/rom@etc/acpi/tables", 0, 128 * 1024}, {"odd", 0, 3 * MiB / 2}});
  ASSERT_TRUE(dst.ok());
  EXPECT_EQ(dst->block(1).offset, 32 * MiB);
  EXPECT_EQ(dst->block(2).offset, 33 * MiB);
  Bytes out(256);
  const uint64_t addrs[] = {0x7f0000000000, 0x7f1000000000, 0x7f2000000000};
  const uint32_t rkeys[] = {11, 12, 13};
  auto n = encode_ram_blocks_result(out, *dst, addrs, rkeys);
  ASSERT_TRUE(n.ok());
  out.resize(*n);
  EXPECT_EQ(*n, 16u + 3 * 32);
  auto d = decode_control(out, &src);
  ASSERT_TRUE(d.ok());
  ASSERT_EQ(d->blocks.size(), 3u);
  EXPECT_EQ(d->blocks[1].host_addr, 0x7f1000000000u);
  EXPECT_EQ(d->blocks[1].offset, 32 * MiB);
  EXPECT_EQ(d->blocks[2].rkey, 13u);
  // Two blocks where the source has three.
  Bytes two(out.begin(), out.end() - 32);
  two[3] = std::byte{64};
  EXPECT_EQ(decode_err(two, &src), ibtrs::errc(ERANGE));
  // A different length for block 1.
  auto other = RamLayout::packed({{"a", 0, 32 * MiB}, {"b", 0, 256 * 1024}, {"c", 0, 3 * MiB / 2}});
  Bytes out2(256);
  out2.resize(*encode_ram_blocks_result(out2, *other, addrs, {}));
  std::string why;
  EXPECT_EQ(decode_err(out2, &src, &why), ibtrs::errc(ERANGE));
  EXPECT_NE(why.find("262144 bytes at the destination"), std::string::npos) << why;
  // Overlapping destination offsets.
  std::vector<DestBlockWire> e(3);
  for (size_t i = 0; i < 3; ++i) {
    e[i].offset.set(i * MiB);
    e[i].length.set(src.block(i).length);
  }
  EXPECT_EQ(decode_err(raw(96, 5, 1, entries(e)), &src), ibtrs::errc(ERANGE));
  EXPECT_EQ(decode_err(raw(95, 5, 1, Bytes(95)), &src), ibtrs::errc(EBADMSG));
  EXPECT_EQ(decode_err(raw(0, 5, 1, {}), &src), ibtrs::errc(EBADMSG));
}

// Case: REGISTER RESULT. Expect: one 16-byte entry per request; QEMU's destination would answer
// a repeat-2 request with len 16 and repeat 2, which we refuse (its source only sends repeat 1).
TEST(QemuRdmaWire, RegisterResult) {
  Bytes out(64);
  const RegisterResult r{0x1234, 0x7f00deadb000};
  auto n = encode_register_result(out, std::span(&r, 1));
  ASSERT_TRUE(n.ok());
  out.resize(*n);
  EXPECT_EQ(*n, 32u);
  auto d = decode_control(out, nullptr);
  ASSERT_TRUE(d.ok());
  ASSERT_EQ(d->results.size(), 1u);
  EXPECT_EQ(d->results[0].rkey, 0x1234u);
  EXPECT_EQ(d->results[0].host_addr, 0x7f00deadb000u);
  out[11] = std::byte{2};
  EXPECT_EQ(decode_err(out), ibtrs::errc(EBADMSG));
}

// Case: UNREGISTER REQUEST (key = chunk). Expect: a chunk inside the block decodes; the chunk
// past the last one and a bad index are refused (QEMU's destination indexes its MR table with
// them unchecked).
TEST(QemuRdmaWire, UnregisterRequest) {
  const RamLayout l = layout();
  auto d = decode_control(raw(24, 10, 1, entries<RegisterWire>({reg(31, 0, 0)})), &l);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->unregisters[0].chunk, 31u);
  EXPECT_EQ(decode_err(raw(24, 10, 1, entries<RegisterWire>({reg(32, 0, 0)})), &l), ibtrs::errc(ERANGE));
  EXPECT_EQ(decode_err(raw(24, 10, 1, entries<RegisterWire>({reg(0, 7, 0)})), &l), ibtrs::errc(ERANGE));
  Bytes out(64);
  const UnregisterRequest u{2, 1};
  auto n = encode_unregister_request(out, l, std::span(&u, 1));
  ASSERT_TRUE(n.ok());
  out.resize(*n);
  EXPECT_EQ(out, raw(24, 10, 1, entries<RegisterWire>({reg(1, 2, 0)})));
}

// Case: layouts a caller or a stream could produce. Expect: no blocks, a zero length, an
// overlap, an end that wraps around 2^64: EINVAL.
TEST(QemuRdmaWire, LayoutChecks) {
  EXPECT_FALSE(RamLayout::make({}).ok());
  EXPECT_FALSE(RamLayout::make({{"a", 0, 0}}).ok());
  EXPECT_FALSE(RamLayout::make({{"a", 0, 2 * MiB}, {"b", MiB, MiB}}).ok());
  EXPECT_FALSE(RamLayout::make({{"a", ~0ull - 10, 4096}}).ok());
  EXPECT_FALSE(RamLayout::packed({{"a", 0, ~0ull - 10}, {"b", 0, 4096}}).ok());
  auto l = RamLayout::packed({{"a", 0, 4096}, {"b", 0, 4096}});
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->block(1).offset, MiB);
  EXPECT_EQ(l->chunks(0), 1u);
}

}  // namespace
}  // namespace ibnbd::migrate::qrdma
