// The IBTRS wire protocol (proto/ibtrs_proto.h): encodings round-trip, every field width is
// checked, and every decoder refuses hostile input with a reason.
#include <gtest/gtest.h>

#include <cstring>
#include <tuple>
#include <vector>

#include "proto/ibtrs_proto.h"

namespace ibtrs::proto {
namespace {

Uuid uuid(uint8_t seed) {
  Uuid u;
  for (size_t i = 0; i < u.size(); ++i) u[i] = static_cast<uint8_t>(seed + i);
  return u;
}

template <typename T>
std::vector<std::byte> bytes(const T& v) {
  auto s = as_bytes_of(v);
  return std::vector<std::byte>(s.begin(), s.end());
}

// Whether `parse` refuses the message `b` one byte short and one byte long.
template <typename Parse>
bool short_long(Parse parse, std::vector<std::byte> b) {
  auto shorter = b;
  shorter.pop_back();
  b.push_back(std::byte{0});
  return !parse(shorter, nullptr).ok() && !parse(b, nullptr).ok();
}

TEST(ImmLayout, SplitsThePayloadByQueueDepth) {
  auto l = imm_layout(512, 128 * 1024);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->id_bits, 9u);
  EXPECT_EQ(l->offset_bits, 19u);
  EXPECT_TRUE(imm_layout(512, 512 * 1024).ok()) << "19 bits address 512 KiB";
  EXPECT_FALSE(imm_layout(512, 1024 * 1024).ok()) << "1 MiB chunks need 20 offset bits";
  auto one = imm_layout(1, 128 * 1024);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->id_bits, 1u);
  auto big = imm_layout(65535, 4096);
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(big->id_bits, 16u);
  EXPECT_FALSE(imm_layout(65535, 128 * 1024).ok());
  EXPECT_FALSE(imm_layout(0, 4096).ok());
}

TEST(Imm, IoRequestRoundTripsAndChecksWidths) {
  auto l = imm_layout(512, 128 * 1024).value();
  for (uint32_t id : {0u, 1u, 255u, 511u}) {
    for (uint32_t off : {0u, 8u, 131071u, (1u << 19) - 1}) {
      auto imm = encode_io_req_imm(l, id, off);
      ASSERT_TRUE(imm.ok());
      EXPECT_EQ(imm_type(*imm), ImmType::io_req);
      auto d = decode_io_req_imm(l, *imm);
      EXPECT_EQ(d.chunk_id, id);
      EXPECT_EQ(d.offset, off);
    }
  }
  EXPECT_FALSE(encode_io_req_imm(l, 512, 0).ok()) << "chunk id needs a 10th bit";
  EXPECT_FALSE(encode_io_req_imm(l, 0, 1u << 19).ok()) << "offset needs a 20th bit";
}

TEST(Imm, IoResponseCarriesPermitAndErrno) {
  auto imm = encode_io_rsp_imm((1u << 19) - 1, EIO);
  ASSERT_TRUE(imm.ok());
  EXPECT_EQ(imm_type(*imm), ImmType::io_rsp);
  auto d = decode_io_rsp_imm(*imm);
  EXPECT_EQ(d.permit_id, (1u << 19) - 1);
  EXPECT_EQ(d.err, EIO);
  EXPECT_EQ(decode_io_rsp_imm(encode_io_rsp_imm(7, -ENOSPC).value()).err, ENOSPC) << "sign dropped";
  EXPECT_EQ(decode_io_rsp_imm(encode_io_rsp_imm(7, 600).value()).err, EIO) << "clamped to a real errno";
  EXPECT_EQ(imm_type(encode_io_rsp_imm(3, 0, true).value()), ImmType::io_rsp_w_inv);
  EXPECT_FALSE(encode_io_rsp_imm(1u << 19, 0).ok());
}

TEST(Imm, HeartbeatTypesAreTheKernels) {
  EXPECT_EQ(make_imm(ImmType::hb_msg, 0), 0x80000000u);
  EXPECT_EQ(make_imm(ImmType::hb_ack, 0), 0x90000000u);
}

TEST(ConReq, RoundTrips) {
  auto m = make_con_req(1, 3, 7, true, uuid(1), uuid(50));
  std::string why;
  auto p = parse_con_req(bytes(m), &why);
  ASSERT_TRUE(p.ok()) << why;
  EXPECT_EQ(p->cid.get(), 1);
  EXPECT_EQ(p->cid_num.get(), 3);
  EXPECT_EQ(p->recon_cnt.get(), 7);
  EXPECT_EQ(p->flags.get(), kConReqFirstConn);
  EXPECT_EQ(0, std::memcmp(p->path_uuid, uuid(50).data(), 16));
}

TEST(ConReq, CarriesTheAuthFlag) {
  auto m = make_con_req(0, 2, 0, true, uuid(1), uuid(2), true);
  auto p = parse_con_req(bytes(m), nullptr);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->flags.get(), kConReqFirstConn | kConReqAuth);
  EXPECT_EQ(version_major(p->version.get()), kVersionMajor);
  EXPECT_GE(p->version.get() & 0xff, 1) << "authentication came with minor version 1";
}

TEST(ConReq, AcceptsANewerMinorVersion) {
  auto m = make_con_req(0, 2, 0, false, uuid(1), uuid(2));
  m.version.set((kVersionMajor << 8) | 7);
  EXPECT_TRUE(parse_con_req(bytes(m), nullptr).ok());
}

// Case: CON_REQs broken in every field a peer controls. Expect: refused with a reason.
TEST(ConReq, RefusesHostileRequests) {
  auto base = make_con_req(0, 2, 0, true, uuid(1), uuid(2));
  std::vector<std::pair<const char*, ConReq>> cases;
  auto m = base; m.magic.set(0x1234); cases.push_back({"magic", m});
  m = base; m.version.set(3 << 8); cases.push_back({"major", m});
  m = base; m.cid.set(2); cases.push_back({"cid >= cid_num", m});
  m = base; m.cid_num.set(1); m.cid.set(0); cases.push_back({"cid_num < 2", m});
  m = base; m.flags.set(0x8000); cases.push_back({"flags", m});
  m = base; m.reserved0.set(1); cases.push_back({"reserved0", m});
  m = base; m.reserved1[3] = 1; cases.push_back({"reserved1", m});
  m = base; std::memset(m.sess_uuid, 0, 16); cases.push_back({"nil session uuid", m});
  m = base; std::memset(m.path_uuid, 0, 16); cases.push_back({"nil path uuid", m});
  for (auto& [name, c] : cases) {
    std::string why;
    EXPECT_FALSE(parse_con_req(bytes(c), &why).ok()) << name;
    EXPECT_FALSE(why.empty()) << name;
  }
  auto b = bytes(base);
  b.pop_back();
  EXPECT_FALSE(parse_con_req(b, nullptr).ok()) << "short";
}

TEST(ConRsp, RoundTripsAcceptAndReject) {
  auto a = make_con_rsp(0, 512, 128 * 1024, 4096, kConRspInvalidatePerIo);
  std::string why;
  auto p = parse_con_rsp(bytes(a), &why);
  ASSERT_TRUE(p.ok()) << why;
  EXPECT_EQ(p->queue_depth.get(), 512);
  EXPECT_EQ(p->max_io_size.get(), 128u * 1024 - 4096);
  EXPECT_EQ(p->flags.get(), kConRspInvalidatePerIo);
  auto r = parse_con_rsp(bytes(make_con_rsp(-EBUSY, 0, 0, 0, 0)), &why);
  ASSERT_TRUE(r.ok()) << why;
  EXPECT_EQ(r->errno_.get(), EBUSY);
}

TEST(ConRsp, RefusesImpossibleGeometry) {
  auto base = make_con_rsp(0, 512, 128 * 1024, 4096, 0);
  std::vector<std::pair<const char*, ConRsp>> cases;
  auto m = base; m.queue_depth.set(0); cases.push_back({"depth 0", m});
  m = base; m.chunk_size.set(100000); cases.push_back({"not a power of two", m});
  m = base; m.chunk_size.set(4096); cases.push_back({"below the minimum", m});
  m = base; m.chunk_size.set(1u << 20); cases.push_back({"does not fit the immediate at depth 512", m});
  m = base; m.max_io_size.set(128 * 1024); cases.push_back({"io + header > chunk", m});
  m = base; m.max_hdr_size.set(0); cases.push_back({"no header room", m});
  m = base; m.flags.set(0x10); cases.push_back({"unknown flag", m});
  m = base; m.reserved[0] = 1; cases.push_back({"reserved", m});
  for (auto& [name, c] : cases) {
    std::string why;
    EXPECT_FALSE(parse_con_rsp(bytes(c), &why).ok()) << name;
  }
}

// Case: a 2.2 CON_RSP with chunk sets: max_io_size above chunk - header, up to what a set of
// min(queue depth, 64) chunks holds. Expect: accepted; one chunk more, with per-IO keys, or
// (without the flag) any max IO beyond one chunk: refused.
TEST(ConRsp, ChunkSetsAllowALargerMaxIoWithinTheirLimits) {
  auto sets = make_con_rsp(0, 512, 128 * 1024, 4096, kConRspChunkSets, 1u << 20);
  std::string why;
  auto p = parse_con_rsp(bytes(sets), &why);
  ASSERT_TRUE(p.ok()) << why;
  EXPECT_EQ(p->max_io_size.get(), 1u << 20);
  EXPECT_EQ(p->flags.get(), kConRspChunkSets);
  EXPECT_EQ(set_chunks((1u << 20) + 4096, 128 * 1024), 9u);
  auto m = sets; m.max_io_size.set(64 * 128 * 1024 - 4096);
  EXPECT_TRUE(parse_con_rsp(bytes(m), nullptr).ok()) << "64 chunks: the largest set";
  m = sets; m.max_io_size.set(64 * 128 * 1024 - 4095);
  EXPECT_FALSE(parse_con_rsp(bytes(m), nullptr).ok()) << "65 chunks";
  m = sets; m.queue_depth.set(8);
  EXPECT_FALSE(parse_con_rsp(bytes(m), nullptr).ok()) << "a set larger than the queue depth";
  m = sets; m.flags.set(kConRspChunkSets | kConRspInvalidatePerIo);
  EXPECT_FALSE(parse_con_rsp(bytes(m), nullptr).ok()) << "sets need one key over all chunks";
  m = sets; m.flags.set(0);
  EXPECT_FALSE(parse_con_rsp(bytes(m), nullptr).ok()) << "a larger max IO without the flag";
  m = sets; m.max_io_size.set(0);
  EXPECT_FALSE(parse_con_rsp(bytes(m), nullptr).ok()) << "max IO 0";
}

// ---- authentication messages ----

AuthChallengeView challenge_view() {
  AuthChallengeView v;
  v.tid = 0x1234;
  v.seqnum = 0xdeadbeef;
  v.nonce.fill(0xa1);
  v.dh_public.fill(0xb2);
  return v;
}

AuthReplyView reply_view(bool bidi) {
  AuthReplyView v;
  v.tid = 0x1234;
  v.bidirectional = bidi;
  v.seqnum2 = bidi ? 77 : 0;
  v.dh_public.fill(0xc3);
  v.response.fill(0xd4);
  if (bidi) v.challenge2.fill(0xe5);
  v.host = "nqn.2024-01.io.example:host-a";
  return v;
}

TEST(Auth, MessagesRoundTrip) {
  EXPECT_EQ(sizeof(AuthReply), 336u);
  std::string why;
  auto c = make_auth_challenge(challenge_view());
  ASSERT_TRUE(c.ok());
  auto cv = parse_auth_challenge(bytes(*c), &why);
  ASSERT_TRUE(cv.ok()) << why;
  EXPECT_EQ(cv->tid, 0x1234);
  EXPECT_EQ(cv->seqnum, 0xdeadbeefu);
  EXPECT_EQ(cv->nonce, challenge_view().nonce);
  EXPECT_EQ(cv->dh_public, challenge_view().dh_public);
  for (bool bidi : {false, true}) {
    auto r = make_auth_reply(reply_view(bidi));
    ASSERT_TRUE(r.ok());
    auto rv = parse_auth_reply(bytes(*r), &why);
    ASSERT_TRUE(rv.ok()) << why;
    EXPECT_EQ(rv->host, "nqn.2024-01.io.example:host-a");
    EXPECT_EQ(rv->bidirectional, bidi);
    EXPECT_EQ(rv->seqnum2, bidi ? 77u : 0u);
    EXPECT_EQ(rv->response, reply_view(bidi).response);
    EXPECT_EQ(rv->challenge2, reply_view(bidi).challenge2);
  }
  AuthSuccessView sv;
  sv.tid = 9;
  sv.has_response = true;
  sv.response.fill(0x42);
  auto ok = parse_auth_success(bytes(make_auth_success(sv)), &why);
  ASSERT_TRUE(ok.ok()) << why;
  EXPECT_TRUE(ok->has_response);
  EXPECT_EQ(ok->response, sv.response);
  auto f = parse_auth_failure(bytes(make_auth_failure(9, EACCES)), &why);
  ASSERT_TRUE(f.ok()) << why;
  EXPECT_EQ(f->reason, EACCES);
  EXPECT_EQ(*peek_msg_type(bytes(make_auth_failure(9, EACCES))), MsgType::auth_failure);
  EXPECT_FALSE(peek_msg_type(std::vector<std::byte>(1)).ok());
}

TEST(Auth, BuildersRefuseWhatParsersWould) {
  auto c = challenge_view();
  c.seqnum = 0;
  EXPECT_FALSE(make_auth_challenge(c).ok());
  auto r = reply_view(false);
  r.host = "two words";
  EXPECT_FALSE(make_auth_reply(r).ok());
  r = reply_view(false);
  r.host = std::string(224, 'h');
  EXPECT_FALSE(make_auth_reply(r).ok());
  r = reply_view(true);
  r.seqnum2 = 0;
  EXPECT_FALSE(make_auth_reply(r).ok());
  r = reply_view(false);
  r.challenge2.fill(1);
  EXPECT_FALSE(make_auth_reply(r).ok());
}

// Case: authentication messages broken in every field a peer controls. Expect: refused with a
// reason, and a message of another type is never taken for this one.
TEST(Auth, RefusesHostileMessages) {
  const AuthChallenge cb = *make_auth_challenge(challenge_view());
  std::vector<std::pair<const char*, AuthChallenge>> cc;
  auto c = cb; c.type.set(7); cc.push_back({"type", c});
  c = cb; c.hash_id = 2; cc.push_back({"hash", c});
  c = cb; c.dh_group = 1; cc.push_back({"ffdhe2048", c});
  c = cb; c.seqnum.set(0); cc.push_back({"seqnum 0", c});
  c = cb; c.reserved0.set(1); cc.push_back({"reserved0", c});
  c = cb; c.reserved1[2] = 1; cc.push_back({"reserved1", c});
  for (auto& [name, m] : cc) {
    std::string why;
    EXPECT_FALSE(parse_auth_challenge(bytes(m), &why).ok()) << name;
    EXPECT_FALSE(why.empty()) << name;
  }
  const AuthReply rb = *make_auth_reply(reply_view(true));
  std::vector<std::pair<const char*, AuthReply>> rc;
  auto r = rb; r.type.set(6); rc.push_back({"type", r});
  r = rb; r.flags.set(0x8001); rc.push_back({"flags", r});
  r = rb; r.hash_id = 3; rc.push_back({"hash", r});
  r = rb; r.seqnum2.set(0); rc.push_back({"bidirectional without seqnum2", r});
  r = rb; std::memset(r.challenge2, 0, sizeof(r.challenge2)); rc.push_back({"bidirectional without C2", r});
  r = rb; r.flags.set(0); rc.push_back({"C2 without bidirectional", r});
  r = rb; std::memset(r.host, 0, sizeof(r.host)); rc.push_back({"empty host", r});
  r = rb; std::memset(r.host, 'h', sizeof(r.host)); rc.push_back({"unterminated host", r});
  r = rb; r.host[3] = ' '; rc.push_back({"space in host", r});
  r = rb; r.host[200] = 'x'; rc.push_back({"bytes after the NUL", r});
  r = rb; r.host[2] = 0x7f; rc.push_back({"control character", r});
  r = rb; r.reserved[1] = 1; rc.push_back({"reserved", r});
  for (auto& [name, m] : rc) {
    std::string why;
    EXPECT_FALSE(parse_auth_reply(bytes(m), &why).ok()) << name;
    EXPECT_FALSE(why.empty()) << name;
  }
  AuthSuccessView sv;
  auto s = make_auth_success(sv);
  s.response[0] = 1;  // a response without its flag
  EXPECT_FALSE(parse_auth_success(bytes(s), nullptr).ok());
  s = make_auth_success(sv);
  s.reserved0.set(1);
  EXPECT_FALSE(parse_auth_success(bytes(s), nullptr).ok());
  auto f = make_auth_failure(1, EACCES);
  f.reason.set(0);
  EXPECT_FALSE(parse_auth_failure(bytes(f), nullptr).ok());
  // Lengths: one byte short or long of each is refused.
  EXPECT_TRUE(short_long(parse_auth_challenge, bytes(cb)));
  EXPECT_TRUE(short_long(parse_auth_reply, bytes(rb)));
  EXPECT_TRUE(short_long(parse_auth_success, bytes(make_auth_success(sv))));
  EXPECT_TRUE(short_long(parse_auth_failure, bytes(make_auth_failure(1, EACCES))));
  // A failure is not a success of the same size class, nor the other way round.
  EXPECT_FALSE(parse_auth_failure(bytes(make_auth_success(sv)), nullptr).ok());
}

// Case: PATH_FENCE and FENCE_RSP built and parsed back; then each with a reserved byte set, a
// nil path uuid, one byte short or long, the other's type; FENCE_RSP with an unknown status.
// Expect: the round trips keep path, incarnation and status; every hostile variant is refused
// with a reason; kConRspFence is a known CON_RSP flag; the version says minor 3.
TEST(Fence, MessagesRoundTripAndRefuseHostileOnes) {
  std::string why;
  const auto f = make_path_fence(uuid(7), 0xfffe);
  auto pf = parse_path_fence(bytes(f), &why);
  ASSERT_TRUE(pf.ok()) << why;
  EXPECT_EQ(pf->path_uuid, uuid(7));
  EXPECT_EQ(pf->recon_cnt, 0xfffe);
  EXPECT_EQ(*peek_msg_type(bytes(f)), MsgType::path_fence);
  for (uint16_t st : {kFenceClosed, kFenceNotLive}) {
    auto r = parse_fence_rsp(bytes(make_fence_rsp(st, uuid(9), 4)), &why);
    ASSERT_TRUE(r.ok()) << why;
    EXPECT_EQ(r->status, st);
    EXPECT_EQ(r->path_uuid, uuid(9));
    EXPECT_EQ(r->recon_cnt, 4);
  }
  auto bad = f;
  bad.reserved0.set(1);
  EXPECT_FALSE(parse_path_fence(bytes(bad), &why).ok());
  bad = f;
  bad.reserved1.set(1);
  EXPECT_FALSE(parse_path_fence(bytes(bad), &why).ok());
  bad = f;
  bad.reserved2[7] = 1;
  EXPECT_FALSE(parse_path_fence(bytes(bad), &why).ok());
  EXPECT_NE(why.find("reserved"), std::string::npos) << why;
  EXPECT_FALSE(parse_path_fence(bytes(make_path_fence(Uuid{}, 1)), &why).ok());
  EXPECT_NE(why.find("nil"), std::string::npos) << why;
  auto rsp = make_fence_rsp(kFenceClosed, uuid(9), 4);
  auto badr = rsp;
  badr.status.set(2);
  EXPECT_FALSE(parse_fence_rsp(bytes(badr), &why).ok());
  EXPECT_NE(why.find("status"), std::string::npos) << why;
  badr = rsp;
  badr.reserved1[0] = 1;
  EXPECT_FALSE(parse_fence_rsp(bytes(badr), nullptr).ok());
  badr = rsp;
  badr.reserved0.set(1);
  EXPECT_FALSE(parse_fence_rsp(bytes(badr), nullptr).ok());
  EXPECT_FALSE(parse_fence_rsp(bytes(make_fence_rsp(kFenceNotLive, Uuid{}, 4)), nullptr).ok());
  EXPECT_TRUE(short_long(parse_path_fence, bytes(f)));
  EXPECT_TRUE(short_long(parse_fence_rsp, bytes(rsp)));
  // Same size, other type: neither is taken for the other.
  EXPECT_FALSE(parse_path_fence(bytes(rsp), nullptr).ok());
  EXPECT_FALSE(parse_fence_rsp(bytes(f), nullptr).ok());
  auto c = parse_con_rsp(bytes(make_con_rsp(0, 512, 128 * 1024, 4096, kConRspFence)), &why);
  ASSERT_TRUE(c.ok()) << why;
  EXPECT_EQ(c->flags.get(), kConRspFence);
  EXPECT_EQ(version_minor(kVersion), kMinorFence);
}

TEST(InfoReq, RoundTripsAndRefusesBadNames) {
  auto m = make_info_req("sess-1", "ip:198.18.0.1@ip:198.18.0.2");
  ASSERT_TRUE(m.ok());
  std::string why;
  auto p = parse_info_req(bytes(*m), &why);
  ASSERT_TRUE(p.ok()) << why;
  EXPECT_EQ(p->sessname, "sess-1");
  EXPECT_EQ(p->pathname, "ip:198.18.0.1@ip:198.18.0.2");
  EXPECT_FALSE(make_info_req("", "x").ok());
  EXPECT_FALSE(make_info_req(std::string(64, 'a'), "x").ok());
  EXPECT_FALSE(make_info_req("a\nb", "x").ok());

  auto bad = *m;
  bad.sessname[2] = 0x01;  // control character
  EXPECT_FALSE(parse_info_req(bytes(bad), nullptr).ok());
  bad = *m;
  std::memset(bad.sessname, 'a', kNameMax);  // no terminator
  EXPECT_FALSE(parse_info_req(bytes(bad), nullptr).ok());
  bad = *m;
  bad.pathname[60] = 'x';  // garbage after the terminator
  EXPECT_FALSE(parse_info_req(bytes(bad), nullptr).ok());
  bad = *m;
  bad.type.set(static_cast<uint16_t>(MsgType::info_rsp));
  EXPECT_FALSE(parse_info_req(bytes(bad), nullptr).ok());
}

std::vector<std::byte> info_rsp(uint16_t n, uint32_t len) {
  std::vector<std::byte> out(info_rsp_size(n));
  InfoRspHeader h{};
  h.type.set(static_cast<uint16_t>(MsgType::info_rsp));
  h.sg_cnt.set(n);
  std::memcpy(out.data(), &h, sizeof(h));
  for (uint16_t i = 0; i < n; ++i) {
    ChunkDesc d{};
    d.addr.set(0x100000 + uint64_t{i} * len);
    d.key.set(77);
    d.len.set(len);
    std::memcpy(out.data() + sizeof(h) + i * sizeof(d), &d, sizeof(d));
  }
  return out;
}

TEST(InfoRsp, ParsesAndRefusesMismatches) {
  std::string why;
  const auto msg = info_rsp(4, 8192);  // the result is a view into it
  auto ok = parse_info_rsp(msg, 4, 8192, &why);
  ASSERT_TRUE(ok.ok()) << why;
  EXPECT_EQ(ok->size(), 4u);
  EXPECT_EQ((*ok)[3].addr.get(), 0x100000u + 3 * 8192);
  EXPECT_FALSE(parse_info_rsp(info_rsp(4, 8192), 5, 8192, nullptr).ok()) << "count";
  EXPECT_FALSE(parse_info_rsp(info_rsp(4, 4096), 4, 8192, nullptr).ok()) << "chunk size";
  auto shortmsg = info_rsp(4, 8192);
  shortmsg.pop_back();
  EXPECT_FALSE(parse_info_rsp(shortmsg, 4, 8192, nullptr).ok()) << "length";
  auto zero = info_rsp(2, 8192);
  std::memset(zero.data() + sizeof(InfoRspHeader), 0, 8);
  EXPECT_FALSE(parse_info_rsp(zero, 2, 8192, nullptr).ok()) << "address 0";
}

class IoReqTest : public ::testing::Test {
 protected:
  static constexpr uint32_t kChunk = 8192;
  std::vector<std::byte> chunk = std::vector<std::byte>(kChunk);

  uint32_t put_write(uint32_t data, uint32_t usr) {
    WriteMsg m{};
    m.type.set(static_cast<uint16_t>(MsgType::write));
    m.usr_len.set(static_cast<uint16_t>(usr));
    m.data_len.set(data);
    std::memcpy(chunk.data() + data + usr, &m, sizeof(m));
    return data + usr;
  }
  uint32_t put_read(uint32_t usr, uint16_t cnt, uint32_t desc_len = 4096, uint16_t flags = 0) {
    ReadMsgHeader h{};
    h.type.set(static_cast<uint16_t>(MsgType::read));
    h.usr_len.set(static_cast<uint16_t>(usr));
    h.flags.set(flags);
    h.sg_cnt.set(cnt);
    std::memcpy(chunk.data() + usr, &h, sizeof(h));
    for (uint16_t i = 0; i < cnt; ++i) {
      BufDesc d{};
      d.addr.set(0x5000 + i * 4096ull);
      d.key.set(9);
      d.len.set(desc_len);
      std::memcpy(chunk.data() + usr + sizeof(h) + i * sizeof(d), &d, sizeof(d));
    }
    return usr;
  }
  bool inside(std::span<const std::byte> s) const {
    return s.empty() || (s.data() >= chunk.data() && s.data() + s.size() <= chunk.data() + chunk.size());
  }
  bool in_copy(std::span<const std::byte> s) const {
    return s.empty() || (s.data() >= copy.data() && s.data() + s.size() <= copy.data() + copy.size());
  }
  std::vector<std::byte> copy = std::vector<std::byte>(8192);
};

TEST_F(IoReqTest, WriteSplitsDataAndUserHeader) {
  uint32_t off = put_write(4000, 24);
  std::string why;
  auto r = parse_io_req(chunk, off, 4096, copy, &why);
  ASSERT_TRUE(r.ok()) << why;
  EXPECT_EQ(r->kind, IoKind::write);
  EXPECT_EQ(r->write.data.size(), 4000u);
  EXPECT_EQ(r->write.usr.size(), 24u);
  EXPECT_EQ(r->write.data.data(), chunk.data()) << "the payload stays in the chunk";
  EXPECT_TRUE(inside(r->write.data));
  EXPECT_TRUE(in_copy(r->write.usr)) << "the user header is the server's copy";
  EXPECT_EQ(0, std::memcmp(r->write.usr.data(), chunk.data() + 4000, 24));
}

TEST_F(IoReqTest, ReadCarriesDescriptors) {
  uint32_t off = put_read(32, 3);
  std::string why;
  auto r = parse_io_req(chunk, off, 4096, copy, &why);
  ASSERT_TRUE(r.ok()) << why;
  EXPECT_EQ(r->kind, IoKind::read);
  EXPECT_EQ(r->read.usr.size(), 32u);
  EXPECT_EQ(r->read.descs.size(), 3u);
  EXPECT_EQ(r->read.total_len, 3u * 4096);
  EXPECT_EQ(r->read.descs[2].addr.get(), 0x5000u + 2 * 4096);
  EXPECT_TRUE(in_copy(r->read.usr));
  EXPECT_TRUE(in_copy(std::as_bytes(r->read.descs)));
}

// Case: a read and a write parsed, then the client rewrites every byte of the chunk (as it can
// at any time: the chunk is remotely writable) with 0xff.
// Expect: what the parse returned - user header, descriptors, lengths - is unchanged: it was
// copied once and the chunk is never read again (issue 13, class 1).
TEST_F(IoReqTest, TheChunkRewrittenAfterTheParseChangesNothing) {
  uint32_t off = put_read(32, 3);
  for (uint32_t i = 0; i < 32; ++i) chunk[i] = std::byte{static_cast<uint8_t>(i)};
  auto r = parse_io_req(chunk, off, 4096, copy, nullptr);
  ASSERT_TRUE(r.ok());
  std::fill(chunk.begin(), chunk.end(), std::byte{0xff});
  EXPECT_EQ(r->read.descs.size(), 3u);
  EXPECT_EQ(r->read.total_len, 3u * 4096);
  for (const BufDesc& d : r->read.descs) {
    EXPECT_EQ(d.len.get(), 4096u);
    EXPECT_EQ(d.key.get(), 9u);
  }
  for (uint32_t i = 0; i < 32; ++i) EXPECT_EQ(r->read.usr[i], std::byte{static_cast<uint8_t>(i)});

  std::fill(chunk.begin(), chunk.end(), std::byte{0});
  off = put_write(100, 16);
  for (uint32_t i = 0; i < 16; ++i) chunk[100 + i] = std::byte{static_cast<uint8_t>(0x40 + i)};
  auto w = parse_io_req(chunk, off, 4096, copy, nullptr);
  ASSERT_TRUE(w.ok());
  std::fill(chunk.begin(), chunk.end(), std::byte{0xff});
  ASSERT_EQ(w->write.usr.size(), 16u);
  for (uint32_t i = 0; i < 16; ++i)
    EXPECT_EQ(w->write.usr[i], std::byte{static_cast<uint8_t>(0x40 + i)});
}

// Case: a copy buffer smaller than max_hdr_size. Expect: EINVAL, nothing parsed.
TEST_F(IoReqTest, ACopyBufferSmallerThanTheHeaderLimitIsRefused) {
  uint32_t off = put_write(100, 16);
  std::vector<std::byte> small(100);
  auto r = parse_io_req(chunk, off, 4096, small, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error(), errc(EINVAL));
}

// Case: IO messages that lie about their sizes or sit where the immediate says nothing is.
// Expect: each refused with a reason; nothing returned points outside the chunk.
TEST_F(IoReqTest, RefusesHostileMessages) {
  struct Case {
    const char* name;
    uint32_t offset;
  };
  std::vector<Case> cases;
  // write: lengths disagree with the offset
  uint32_t off = put_write(100, 10);
  chunk[off + 4] = std::byte{99};  // data_len low byte: 100 -> 99
  cases.push_back({"write lengths do not add up", off});
  // offset past the chunk
  cases.push_back({"offset at the last byte", kChunk - 1});
  cases.push_back({"offset past the end", kChunk + 100});
  for (auto& c : cases) {
    std::string why;
    EXPECT_FALSE(parse_io_req(chunk, c.offset, 4096, copy, &why).ok()) << c.name;
    EXPECT_FALSE(why.empty()) << c.name;
  }

  std::fill(chunk.begin(), chunk.end(), std::byte{0});
  off = put_write(0, 4090);
  EXPECT_FALSE(parse_io_req(chunk, off, 4096, copy, nullptr).ok()) << "user header over max_hdr_size";
  std::fill(chunk.begin(), chunk.end(), std::byte{0});
  off = put_write(kChunk - 8, 0);  // message would end exactly at the chunk end: fine
  EXPECT_TRUE(parse_io_req(chunk, off, 4096, copy, nullptr).ok());

  std::fill(chunk.begin(), chunk.end(), std::byte{0});
  EXPECT_FALSE(parse_io_req(chunk, put_read(0, 0), 4096, copy, nullptr).ok()) << "no descriptors";
  std::fill(chunk.begin(), chunk.end(), std::byte{0});
  EXPECT_FALSE(parse_io_req(chunk, put_read(0, kMaxReadDescs + 1), 8192, copy, nullptr).ok()) << "too many";
  std::fill(chunk.begin(), chunk.end(), std::byte{0});
  EXPECT_FALSE(parse_io_req(chunk, put_read(0, 2, 0), 4096, copy, nullptr).ok()) << "empty descriptor";
  std::fill(chunk.begin(), chunk.end(), std::byte{0});
  EXPECT_FALSE(parse_io_req(chunk, put_read(0, 1, 4096, 0x40), 4096, copy, nullptr).ok()) << "flags";
  std::fill(chunk.begin(), chunk.end(), std::byte{0});
  off = put_read(16, 1);
  chunk[off + 2] = std::byte{0xff};  // usr_len low byte 16 -> 255, more than the offset
  EXPECT_FALSE(parse_io_req(chunk, off, 4096, copy, nullptr).ok()) << "user header before the chunk";
  std::fill(chunk.begin(), chunk.end(), std::byte{0});
  off = put_read(0, 2);
  EXPECT_FALSE(parse_io_req(std::span(chunk).first(off + 8 + 16), off, 4096, copy, nullptr).ok())
      << "descriptors past the chunk";
  std::fill(chunk.begin(), chunk.end(), std::byte{0});
  chunk[0] = std::byte{42};
  EXPECT_FALSE(parse_io_req(chunk, 0, 4096, copy, nullptr).ok()) << "unknown type";
}

// Chunk sets: the session's chunks as one area, requests across several of them.
class SetReqTest : public ::testing::Test {
 protected:
  static constexpr uint32_t kChunk = 8192;
  static constexpr uint32_t kChunks = 8;
  static constexpr uint32_t kHdr = 1024;
  std::vector<std::byte> area = std::vector<std::byte>(size_t{kChunks} * kChunk);
  std::vector<std::byte> copy = std::vector<std::byte>(kHdr);
  SetGeometry geo{kChunk, kHdr, 4 * kChunk - kHdr};

  // A write whose data starts at chunk `first`: returns the lead chunk and the immediate's offset.
  std::pair<uint32_t, uint32_t> put_write(uint32_t first, uint32_t data, uint32_t usr) {
    const size_t end = size_t{first} * kChunk + data + usr;
    WriteMsg m{};
    m.type.set(static_cast<uint16_t>(MsgType::write));
    m.usr_len.set(static_cast<uint16_t>(usr));
    m.data_len.set(data);
    std::memcpy(area.data() + end, &m, sizeof(m));
    return {static_cast<uint32_t>(end / kChunk), static_cast<uint32_t>(end % kChunk)};
  }
  uint32_t put_read(uint32_t lead, uint32_t usr, uint32_t len) {
    ReadMsgHeader h{};
    h.type.set(static_cast<uint16_t>(MsgType::read));
    h.usr_len.set(static_cast<uint16_t>(usr));
    h.sg_cnt.set(1);
    BufDesc d{};
    d.addr.set(0x5000);
    d.key.set(9);
    d.len.set(len);
    std::byte* at = area.data() + size_t{lead} * kChunk + usr;
    std::memcpy(at, &h, sizeof(h));
    std::memcpy(at + sizeof(h), &d, sizeof(d));
    return usr;
  }
};

// Case: a write whose data fills chunks 2 and 3 and part of 4, its user header straddling the
// boundary of chunks 4 and 5, its message in chunk 5 (the lead the immediate names).
// Expect: the data span starts at chunk 2 and has data_len bytes; the user header is the copy of
// the bytes just before the message.
TEST_F(SetReqTest, AWriteSpansChunksBeforeItsLead) {
  const uint32_t data = 3 * kChunk - 10;
  for (uint32_t i = 0; i < 20; ++i) area[2 * kChunk + data + i] = std::byte{static_cast<uint8_t>(0x30 + i)};
  auto [lead, off] = put_write(2, data, 20);
  ASSERT_EQ(lead, 5u);
  std::string why;
  auto r = parse_io_req(area, geo, lead, off, copy, &why);
  ASSERT_TRUE(r.ok()) << why;
  ASSERT_EQ(r->kind, IoKind::write);
  EXPECT_EQ(r->write.data.data(), area.data() + 2 * kChunk);
  EXPECT_EQ(r->write.data.size(), data);
  ASSERT_EQ(r->write.usr.size(), 20u);
  EXPECT_EQ(r->write.usr.data(), reinterpret_cast<const std::byte*>(copy.data()));
  for (uint32_t i = 0; i < 20; ++i) EXPECT_EQ(r->write.usr[i], std::byte{static_cast<uint8_t>(0x30 + i)});
}

// Case: a read in chunk 3 whose data area (kHdr past the chunk's start) runs into chunk 6.
// Expect: its data span is there, inside the area.
TEST_F(SetReqTest, AReadsDataAreaRunsIntoTheChunksAfterItsLead) {
  const uint32_t len = geo.max_io_size;
  const uint32_t off = put_read(3, 16, len);
  std::string why;
  auto r = parse_io_req(area, geo, 3, off, copy, &why);
  ASSERT_TRUE(r.ok()) << why;
  ASSERT_EQ(r->kind, IoKind::read);
  EXPECT_EQ(r->read.data.data(), area.data() + 3 * kChunk + kHdr);
  EXPECT_EQ(r->read.data.size(), len);
}

// Case: requests that lie about where their data is: a write claiming to start before chunk 0,
// one longer than max_io_size, one whose data would not start at a chunk's start, a read past
// the last chunk, a read longer than max_io_size, a lead chunk out of range.
// Expect: each refused with a reason; the single-chunk rules still hold in the lead chunk.
TEST_F(SetReqTest, RefusesSetsThatLeaveTheAreaOrTheLimits) {
  std::string why;
  auto [lead, off] = put_write(0, 2 * kChunk, 8);
  ASSERT_EQ(lead, 2u);
  EXPECT_TRUE(parse_io_req(area, geo, lead, off, copy, nullptr).ok());
  EXPECT_FALSE(parse_io_req(area, geo, lead - 1, off, copy, &why).ok()) << "before chunk 0";
  std::fill(area.begin(), area.end(), std::byte{0});
  std::tie(lead, off) = put_write(0, 4 * kChunk, 8);
  EXPECT_FALSE(parse_io_req(area, geo, lead, off, copy, &why).ok()) << "longer than max_io_size";
  std::fill(area.begin(), area.end(), std::byte{0});
  std::tie(lead, off) = put_write(1, kChunk + 100, 8);
  EXPECT_FALSE(parse_io_req(area, geo, lead, off + 8, copy, &why).ok()) << "data not at a chunk start";
  EXPECT_FALSE(why.empty());
  std::fill(area.begin(), area.end(), std::byte{0});
  EXPECT_FALSE(parse_io_req(area, geo, kChunks - 1, put_read(kChunks - 1, 0, 2 * kChunk), copy, &why).ok())
      << "read area past the last chunk";
  std::fill(area.begin(), area.end(), std::byte{0});
  EXPECT_FALSE(parse_io_req(area, geo, 0, put_read(0, 0, geo.max_io_size + 1), copy, &why).ok())
      << "read longer than max_io_size";
  EXPECT_FALSE(parse_io_req(area, geo, kChunks, 0, copy, &why).ok()) << "lead out of range";
  EXPECT_FALSE(parse_io_req(std::span(area).first(kChunk + 1), geo, 0, 0, copy, &why).ok())
      << "an area that is not whole chunks";
}

// Case: the single-chunk geometry (max_io_size = chunk - header) through the set parser.
// Expect: exactly the single-chunk rules: nothing reaches outside the lead chunk.
TEST_F(SetReqTest, WithoutSetsEveryRequestStaysInItsChunk) {
  const SetGeometry one{kChunk, kHdr, kChunk - kHdr};
  auto [lead, off] = put_write(3, kChunk - kHdr, 16);
  ASSERT_EQ(lead, 3u);
  EXPECT_TRUE(parse_io_req(area, one, lead, off, copy, nullptr).ok());
  std::fill(area.begin(), area.end(), std::byte{0});
  std::tie(lead, off) = put_write(3, kChunk, 16);
  EXPECT_FALSE(parse_io_req(area, one, lead, off, copy, nullptr).ok()) << "a chunk of data and more";
  std::fill(area.begin(), area.end(), std::byte{0});
  auto r = parse_io_req(area, one, 2, put_read(2, 0, kChunk - kHdr), copy, nullptr);
  ASSERT_TRUE(r.ok());
  EXPECT_LE(r->read.data.data() + r->read.data.size(), area.data() + 3 * kChunk);
  EXPECT_FALSE(parse_io_req(area, one, 2, put_read(2, 0, kChunk - kHdr + 1), copy, nullptr).ok());
}

}  // namespace
}  // namespace ibtrs::proto
