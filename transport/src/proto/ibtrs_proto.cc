#include "proto/ibtrs_proto.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "ibtrs/auth.h"

namespace ibtrs::proto {

namespace {

template <typename T>
Result<T> fail(std::string* why, const char* reason, int err = EPROTO) {
  if (why != nullptr) *why = reason;
  return errc(err);
}

template <typename T>
T load(std::span<const std::byte> bytes, size_t at = 0) {
  T v;
  std::memcpy(&v, bytes.data() + at, sizeof(T));
  return v;
}

bool all_zero(const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != 0) return false;
  }
  return true;
}

// A NUL-padded name field: printable ASCII, then only NULs.
bool read_name(const uint8_t* field, size_t n, std::string& out) {
  size_t len = 0;
  while (len < n && field[len] != 0) {
    if (field[len] < 0x20 || field[len] > 0x7e) return false;
    ++len;
  }
  if (len == n) return false;  // no terminator
  if (!all_zero(field + len, n - len)) return false;
  out.assign(reinterpret_cast<const char*>(field), len);
  return true;
}

}  // namespace

Result<ImmLayout> imm_layout(uint32_t queue_depth, uint32_t chunk_size) {
  if (queue_depth == 0 || queue_depth > 65535 || chunk_size == 0) return errc(EINVAL);
  ImmLayout l;
  l.id_bits = queue_depth == 1 ? 1 : static_cast<uint32_t>(std::bit_width(queue_depth - 1));
  l.offset_bits = kImmPayloadBits - l.id_bits;
  // Offsets go up to chunk_size - 1.
  if (uint64_t{chunk_size} > (uint64_t{1} << l.offset_bits)) return errc(EINVAL);
  return l;
}

Result<uint32_t> encode_io_req_imm(const ImmLayout& l, uint32_t chunk_id, uint32_t offset) {
  if (l.id_bits + l.offset_bits != kImmPayloadBits) return errc(EINVAL);
  if (chunk_id >= (1u << l.id_bits) || offset >= (1u << l.offset_bits)) return errc(EINVAL);
  return make_imm(ImmType::io_req, (chunk_id << l.offset_bits) | offset);
}

IoReqImm decode_io_req_imm(const ImmLayout& l, uint32_t imm) {
  uint32_t p = imm_payload(imm);
  return IoReqImm{p >> l.offset_bits, p & ((1u << l.offset_bits) - 1)};
}

Result<uint32_t> encode_io_rsp_imm(uint32_t permit_id, int err, bool with_invalidate) {
  if (permit_id >= (1u << kRspIdBits)) return errc(EINVAL);
  uint32_t e = static_cast<uint32_t>(err < 0 ? -err : err);
  if (e >= (1u << kRspErrnoBits)) e = EIO;  // errnos above 511 do not exist in Linux
  return make_imm(with_invalidate ? ImmType::io_rsp_w_inv : ImmType::io_rsp,
                  (e << kRspIdBits) | permit_id);
}

IoRspImm decode_io_rsp_imm(uint32_t imm) {
  uint32_t p = imm_payload(imm);
  return IoRspImm{p & ((1u << kRspIdBits) - 1), static_cast<int>(p >> kRspIdBits)};
}

Result<ConReq> parse_con_req(std::span<const std::byte> pd, std::string* why) {
  if (pd.size() != sizeof(ConReq)) return fail<ConReq>(why, "CON_REQ has the wrong size");
  auto m = load<ConReq>(pd);
  if (m.magic.get() != kMagic) return fail<ConReq>(why, "CON_REQ: bad magic");
  if (version_major(m.version.get()) != kVersionMajor)
    return fail<ConReq>(why, "CON_REQ: unsupported protocol major version", EPROTONOSUPPORT);
  if (m.cid_num.get() < 2) return fail<ConReq>(why, "CON_REQ: a path needs a service and an IO connection");
  if (m.cid.get() >= m.cid_num.get()) return fail<ConReq>(why, "CON_REQ: connection id out of range");
  if ((m.flags.get() & ~(kConReqFirstConn | kConReqAuth)) != 0 || m.reserved0.get() != 0 ||
      !all_zero(m.reserved1, sizeof(m.reserved1)))
    return fail<ConReq>(why, "CON_REQ: reserved bits set");
  if (all_zero(m.sess_uuid, 16) || all_zero(m.path_uuid, 16))
    return fail<ConReq>(why, "CON_REQ: nil session or path uuid");
  return m;
}

Result<ConRsp> parse_con_rsp(std::span<const std::byte> pd, std::string* why) {
  if (pd.size() != sizeof(ConRsp)) return fail<ConRsp>(why, "CON_RSP has the wrong size");
  auto m = load<ConRsp>(pd);
  if (m.magic.get() != kMagic) return fail<ConRsp>(why, "CON_RSP: bad magic");
  if (version_major(m.version.get()) != kVersionMajor)
    return fail<ConRsp>(why, "CON_RSP: unsupported protocol major version", EPROTONOSUPPORT);
  const uint32_t flags = m.flags.get();
  if (!all_zero(m.reserved, sizeof(m.reserved)) || (flags & ~kConRspKnownFlags) != 0)
    return fail<ConRsp>(why, "CON_RSP: reserved bits set");
  if (m.errno_.get() != 0) return m;  // a reject carries only its errno
  const uint32_t chunk = m.chunk_size.get();
  if (m.queue_depth.get() == 0) return fail<ConRsp>(why, "CON_RSP: queue depth 0");
  if (chunk < kMinChunkSize || chunk > kMaxChunkSize || !std::has_single_bit(chunk))
    return fail<ConRsp>(why, "CON_RSP: chunk size not a power of two in range");
  const uint64_t extent = m.max_io_size.get() + uint64_t{m.max_hdr_size.get()};
  if (m.max_hdr_size.get() == 0 || m.max_hdr_size.get() >= chunk || m.max_io_size.get() == 0)
    return fail<ConRsp>(why, "CON_RSP: IO and header sizes do not fit the chunk");
  if ((flags & kConRspChunkSets) == 0) {
    if (extent > chunk) return fail<ConRsp>(why, "CON_RSP: IO and header sizes do not fit the chunk");
  } else {
    if ((flags & kConRspInvalidatePerIo) != 0)
      return fail<ConRsp>(why, "CON_RSP: chunk sets with a key per chunk");
    if (set_chunks(extent, chunk) > std::min<uint32_t>(m.queue_depth.get(), kMaxSetChunks))
      return fail<ConRsp>(why, "CON_RSP: max IO size spans more chunks than a set may have");
  }
  if (!imm_layout(m.queue_depth.get(), chunk))
    return fail<ConRsp>(why, "CON_RSP: queue depth and chunk size do not fit the immediate");
  return m;
}

Result<InfoReqView> parse_info_req(std::span<const std::byte> msg, std::string* why) {
  if (msg.size() != sizeof(InfoReq)) return fail<InfoReqView>(why, "INFO_REQ has the wrong size");
  auto m = load<InfoReq>(msg);
  if (m.type.get() != static_cast<uint16_t>(MsgType::info_req))
    return fail<InfoReqView>(why, "INFO_REQ: wrong type");
  if (m.reserved0.get() != 0 || !all_zero(m.reserved1, sizeof(m.reserved1)))
    return fail<InfoReqView>(why, "INFO_REQ: reserved bytes set");
  InfoReqView v;
  if (!read_name(m.sessname, kNameMax, v.sessname) || v.sessname.empty())
    return fail<InfoReqView>(why, "INFO_REQ: bad session name");
  if (!read_name(m.pathname, kNameMax, v.pathname))
    return fail<InfoReqView>(why, "INFO_REQ: bad path name");
  return v;
}

Result<std::span<const ChunkDesc>> parse_info_rsp(std::span<const std::byte> msg,
                                                  uint16_t expect_chunks, uint32_t chunk_size,
                                                  std::string* why) {
  using R = std::span<const ChunkDesc>;
  if (msg.size() < sizeof(InfoRspHeader)) return fail<R>(why, "INFO_RSP too short");
  auto h = load<InfoRspHeader>(msg);
  if (h.type.get() != static_cast<uint16_t>(MsgType::info_rsp)) return fail<R>(why, "INFO_RSP: wrong type");
  if (h.reserved.get() != 0) return fail<R>(why, "INFO_RSP: reserved bytes set");
  if (h.sg_cnt.get() != expect_chunks) return fail<R>(why, "INFO_RSP: chunk count differs from the queue depth");
  if (msg.size() != info_rsp_size(expect_chunks)) return fail<R>(why, "INFO_RSP: wrong length");
  R descs(reinterpret_cast<const ChunkDesc*>(msg.data() + sizeof(InfoRspHeader)), expect_chunks);
  for (const ChunkDesc& d : descs) {
    if (d.len.get() != chunk_size) return fail<R>(why, "INFO_RSP: chunk of the wrong size");
    if (d.addr.get() == 0 || d.addr.get() + chunk_size < d.addr.get())
      return fail<R>(why, "INFO_RSP: bad chunk address");
  }
  return descs;
}

namespace {

// Both request parsers: `chunks` is `nchunks` x `cs` bytes, the message lies in chunk `lead` at
// `offset`. Writes may start up to kMaxSetChunks - 1 chunks before the lead (0 when lead is 0:
// the single-chunk rule). `max_io` 0: no length bound (the single-chunk parser leaves it to
// the caller).
Result<IoReq> parse_impl(std::span<const std::byte> chunks, uint64_t cs, uint64_t lead,
                         uint32_t offset, uint32_t max_hdr_size, uint64_t max_io,
                         std::span<std::byte> copy, std::string* why) {
  static_assert(sizeof(WriteMsg) == sizeof(ReadMsgHeader), "one fixed message header size");
  constexpr size_t kHdr = sizeof(WriteMsg);
  if (copy.size() < max_hdr_size || max_hdr_size < kHdr)
    return fail<IoReq>(why, "copy buffer smaller than max_hdr_size", EINVAL);
  const uint64_t lead_at = lead * cs;
  if (uint64_t{offset} + kHdr > cs) return fail<IoReq>(why, "IO message past the chunk");
  const std::byte* msg = chunks.data() + lead_at + offset;
  // The fixed header is read once, into server memory; every length below comes from it.
  std::byte hdr[kHdr];
  std::memcpy(hdr, msg, kHdr);
  const uint16_t type = load<le16>(hdr).get();
  IoReq r{};
  if (type == static_cast<uint16_t>(MsgType::write)) {
    auto m = load<WriteMsg>(hdr);
    const uint64_t usr = m.usr_len.get();
    const uint64_t data = m.data_len.get();
    if (usr + kHdr > max_hdr_size) return fail<IoReq>(why, "write: user header too large");
    // data_len + usr_len = offset + (chunks before the lead) x chunk size: the data starts at
    // the start of a chunk, the lead's or one of the chunks before it.
    const uint64_t ext = data + usr;
    if (ext < offset || (ext - offset) % cs != 0)
      return fail<IoReq>(why, "write: lengths do not add up to the offset");
    const uint64_t before = (ext - offset) / cs;
    if (before > lead || before >= kMaxSetChunks)
      return fail<IoReq>(why, "write: data starts before the session's chunks or spans too many");
    if (max_io != 0 && data > max_io) return fail<IoReq>(why, "write longer than max_io_size");
    const uint64_t start = lead_at - before * cs;
    std::memcpy(copy.data(), chunks.data() + start + data, usr);
    r.kind = IoKind::write;
    r.write.data = chunks.subspan(start, data);
    r.write.usr = copy.first(usr);
    return r;
  }
  if (type == static_cast<uint16_t>(MsgType::read)) {
    auto h = load<ReadMsgHeader>(hdr);
    const uint64_t usr = h.usr_len.get();
    const uint64_t cnt = h.sg_cnt.get();
    if (cnt == 0 || cnt > kMaxReadDescs)
      return fail<IoReq>(why, "read: descriptor count out of range");
    if ((h.flags.get() & ~kReadNeedInvalidate) != 0) return fail<IoReq>(why, "read: unknown flags");
    const uint64_t desc_len = cnt * sizeof(BufDesc);
    if (uint64_t{offset} + kHdr + desc_len > cs)
      return fail<IoReq>(why, "read descriptors past the chunk");
    if (usr > offset) return fail<IoReq>(why, "read: user header before the chunk start");
    if (usr + kHdr + desc_len > max_hdr_size) return fail<IoReq>(why, "read: header too large");
    // The copy: [user header][descriptors]; the header was taken above.
    std::memcpy(copy.data(), msg - usr, usr);
    std::memcpy(copy.data() + usr, msg + kHdr, desc_len);
    std::span<const BufDesc> descs(reinterpret_cast<const BufDesc*>(copy.data() + usr), cnt);
    uint64_t total = 0;
    for (const BufDesc& d : descs) {
      if (d.len.get() == 0) return fail<IoReq>(why, "read: empty descriptor");
      total += d.len.get();
    }
    if (max_io != 0) {
      if (total > max_io) return fail<IoReq>(why, "read longer than max_io_size");
      if (lead_at + max_hdr_size + total > chunks.size())
        return fail<IoReq>(why, "read data area past the session's chunks");
      r.read.data = chunks.subspan(lead_at + max_hdr_size, total);
    }
    r.kind = IoKind::read;
    r.read.usr = copy.first(usr);
    r.read.flags = h.flags.get();
    r.read.descs = descs;
    r.read.total_len = total;
    return r;
  }
  return fail<IoReq>(why, "unknown IO message type");
}

}  // namespace

Result<IoReq> parse_io_req(std::span<const std::byte> chunk, uint32_t offset,
                           uint32_t max_hdr_size, std::span<std::byte> copy, std::string* why) {
  if (chunk.empty()) return fail<IoReq>(why, "IO message past the chunk");
  return parse_impl(chunk, chunk.size(), 0, offset, max_hdr_size, 0, copy, why);
}

Result<IoReq> parse_io_req(std::span<const std::byte> chunks, const SetGeometry& g, uint32_t lead,
                           uint32_t offset, std::span<std::byte> copy, std::string* why) {
  const uint64_t cs = g.chunk_size;
  if (cs == 0 || chunks.size() % cs != 0 || uint64_t{lead} >= chunks.size() / cs ||
      g.max_io_size == 0)
    return fail<IoReq>(why, "chunk geometry out of range", EINVAL);
  return parse_impl(chunks, cs, lead, offset, g.max_hdr_size, g.max_io_size, copy, why);
}

Result<MsgType> peek_msg_type(std::span<const std::byte> msg) {
  if (msg.size() < sizeof(le16)) return errc(EPROTO);
  return static_cast<MsgType>(load<le16>(msg).get());
}

namespace {

template <typename M>
Result<M> load_exact(std::span<const std::byte> msg, MsgType type, const char* name, std::string* why) {
  if (msg.size() != sizeof(M)) {
    if (why != nullptr) *why = std::string(name) + " has the wrong size";
    return errc(EPROTO);
  }
  auto m = load<M>(msg);
  if (m.type.get() != static_cast<uint16_t>(type)) {
    if (why != nullptr) *why = std::string(name) + ": wrong type";
    return errc(EPROTO);
  }
  return m;
}

template <size_t N>
std::array<uint8_t, N> to_array(const uint8_t (&a)[N]) {
  std::array<uint8_t, N> out{};
  std::memcpy(out.data(), a, N);
  return out;
}

bool ours(uint8_t hash_id, uint8_t dh_group) {
  return hash_id == kAuthHashSha256 && dh_group == kAuthDhX25519;
}

}  // namespace

Result<AuthChallengeView> parse_auth_challenge(std::span<const std::byte> msg, std::string* why) {
  using R = AuthChallengeView;
  BASE_ASSIGN_OR_RETURN(auto m, load_exact<AuthChallenge>(msg, MsgType::auth_challenge, "AUTH_CHALLENGE", why));
  if (m.reserved0.get() != 0 || !all_zero(m.reserved1, sizeof(m.reserved1)))
    return fail<R>(why, "AUTH_CHALLENGE: reserved bytes set");
  if (!ours(m.hash_id, m.dh_group))
    return fail<R>(why, "AUTH_CHALLENGE: hash or DH group not HMAC-SHA-256 / X25519", EPROTONOSUPPORT);
  if (m.seqnum.get() == 0) return fail<R>(why, "AUTH_CHALLENGE: sequence number 0");
  R v;
  v.tid = m.tid.get();
  v.seqnum = m.seqnum.get();
  v.nonce = to_array(m.nonce);
  v.dh_public = to_array(m.dh_public);
  return v;
}

Result<AuthReplyView> parse_auth_reply(std::span<const std::byte> msg, std::string* why) {
  using R = AuthReplyView;
  BASE_ASSIGN_OR_RETURN(auto m, load_exact<AuthReply>(msg, MsgType::auth_reply, "AUTH_REPLY", why));
  if ((m.flags.get() & ~kAuthReplyBidirectional) != 0 || !all_zero(m.reserved, sizeof(m.reserved)))
    return fail<R>(why, "AUTH_REPLY: reserved bits set");
  if (!ours(m.hash_id, m.dh_group))
    return fail<R>(why, "AUTH_REPLY: hash or DH group not the challenge's");
  R v;
  v.bidirectional = (m.flags.get() & kAuthReplyBidirectional) != 0;
  const bool c2_zero = all_zero(m.challenge2, sizeof(m.challenge2));
  if (v.bidirectional != (m.seqnum2.get() != 0) || v.bidirectional == c2_zero)
    return fail<R>(why, "AUTH_REPLY: challenge2 and seqnum2 must be set exactly when bidirectional");
  if (!read_name(m.host, kAuthHostField, v.host) || !valid_host_id(v.host))
    return fail<R>(why, "AUTH_REPLY: bad host id");
  v.tid = m.tid.get();
  v.seqnum2 = m.seqnum2.get();
  v.dh_public = to_array(m.dh_public);
  v.response = to_array(m.response);
  v.challenge2 = to_array(m.challenge2);
  return v;
}

Result<AuthSuccessView> parse_auth_success(std::span<const std::byte> msg, std::string* why) {
  using R = AuthSuccessView;
  BASE_ASSIGN_OR_RETURN(auto m, load_exact<AuthSuccess>(msg, MsgType::auth_success, "AUTH_SUCCESS", why));
  if ((m.flags.get() & ~kAuthSuccessResponse) != 0 || m.reserved0.get() != 0)
    return fail<R>(why, "AUTH_SUCCESS: reserved bits set");
  R v;
  v.tid = m.tid.get();
  v.has_response = (m.flags.get() & kAuthSuccessResponse) != 0;
  if (!v.has_response && !all_zero(m.response, sizeof(m.response)))
    return fail<R>(why, "AUTH_SUCCESS: a response without its flag");
  v.response = to_array(m.response);
  return v;
}

Result<AuthFailureView> parse_auth_failure(std::span<const std::byte> msg, std::string* why) {
  using R = AuthFailureView;
  BASE_ASSIGN_OR_RETURN(auto m, load_exact<AuthFailure>(msg, MsgType::auth_failure, "AUTH_FAILURE", why));
  if (m.reserved0.get() != 0) return fail<R>(why, "AUTH_FAILURE: reserved bytes set");
  if (m.reason.get() == 0) return fail<R>(why, "AUTH_FAILURE: no reason");
  return R{m.tid.get(), m.reason.get()};
}

Result<FenceView> parse_path_fence(std::span<const std::byte> msg, std::string* why) {
  using R = FenceView;
  BASE_ASSIGN_OR_RETURN(auto m, load_exact<PathFence>(msg, MsgType::path_fence, "PATH_FENCE", why));
  if (m.reserved0.get() != 0 || m.reserved1.get() != 0 || !all_zero(m.reserved2, sizeof(m.reserved2)))
    return fail<R>(why, "PATH_FENCE: reserved bytes set");
  if (all_zero(m.path_uuid, 16)) return fail<R>(why, "PATH_FENCE: nil path uuid");
  R v;
  std::memcpy(v.path_uuid.data(), m.path_uuid, 16);
  v.recon_cnt = m.recon_cnt.get();
  return v;
}

Result<FenceView> parse_fence_rsp(std::span<const std::byte> msg, std::string* why) {
  using R = FenceView;
  BASE_ASSIGN_OR_RETURN(auto m, load_exact<FenceRsp>(msg, MsgType::fence_rsp, "FENCE_RSP", why));
  if (m.reserved0.get() != 0 || !all_zero(m.reserved1, sizeof(m.reserved1)))
    return fail<R>(why, "FENCE_RSP: reserved bytes set");
  if (m.status.get() != kFenceClosed && m.status.get() != kFenceNotLive)
    return fail<R>(why, "FENCE_RSP: unknown status");
  if (all_zero(m.path_uuid, 16)) return fail<R>(why, "FENCE_RSP: nil path uuid");
  R v;
  std::memcpy(v.path_uuid.data(), m.path_uuid, 16);
  v.recon_cnt = m.recon_cnt.get();
  v.status = m.status.get();
  return v;
}

PathFence make_path_fence(const Uuid& path, uint16_t recon_cnt) {
  PathFence m;
  std::memset(&m, 0, sizeof(m));
  m.type.set(static_cast<uint16_t>(MsgType::path_fence));
  std::memcpy(m.path_uuid, path.data(), 16);
  m.recon_cnt.set(recon_cnt);
  return m;
}

FenceRsp make_fence_rsp(uint16_t status, const Uuid& path, uint16_t recon_cnt) {
  FenceRsp m;
  std::memset(&m, 0, sizeof(m));
  m.type.set(static_cast<uint16_t>(MsgType::fence_rsp));
  m.status.set(status);
  std::memcpy(m.path_uuid, path.data(), 16);
  m.recon_cnt.set(recon_cnt);
  return m;
}

Result<AuthChallenge> make_auth_challenge(const AuthChallengeView& v) {
  if (v.seqnum == 0) return errc(EINVAL);
  AuthChallenge m;
  std::memset(&m, 0, sizeof(m));
  m.type.set(static_cast<uint16_t>(MsgType::auth_challenge));
  m.tid.set(v.tid);
  m.seqnum.set(v.seqnum);
  m.hash_id = kAuthHashSha256;
  m.dh_group = kAuthDhX25519;
  std::memcpy(m.nonce, v.nonce.data(), kAuthValueLen);
  std::memcpy(m.dh_public, v.dh_public.data(), kAuthValueLen);
  return m;
}

Result<AuthReply> make_auth_reply(const AuthReplyView& v) {
  const bool c2_zero = std::all_of(v.challenge2.begin(), v.challenge2.end(), [](uint8_t b) { return b == 0; });
  if (!valid_host_id(v.host) || v.bidirectional != (v.seqnum2 != 0) || v.bidirectional == c2_zero)
    return errc(EINVAL);
  AuthReply m;
  std::memset(&m, 0, sizeof(m));
  m.type.set(static_cast<uint16_t>(MsgType::auth_reply));
  m.tid.set(v.tid);
  m.flags.set(v.bidirectional ? kAuthReplyBidirectional : 0);
  m.hash_id = kAuthHashSha256;
  m.dh_group = kAuthDhX25519;
  m.seqnum2.set(v.seqnum2);
  std::memcpy(m.dh_public, v.dh_public.data(), kAuthValueLen);
  std::memcpy(m.response, v.response.data(), kAuthValueLen);
  std::memcpy(m.challenge2, v.challenge2.data(), kAuthValueLen);
  std::memcpy(m.host, v.host.data(), v.host.size());
  return m;
}

AuthSuccess make_auth_success(const AuthSuccessView& v) {
  AuthSuccess m;
  std::memset(&m, 0, sizeof(m));
  m.type.set(static_cast<uint16_t>(MsgType::auth_success));
  m.tid.set(v.tid);
  m.flags.set(v.has_response ? kAuthSuccessResponse : 0);
  if (v.has_response) std::memcpy(m.response, v.response.data(), kAuthValueLen);
  return m;
}

AuthFailure make_auth_failure(uint16_t tid, int reason) {
  AuthFailure m;
  std::memset(&m, 0, sizeof(m));
  m.type.set(static_cast<uint16_t>(MsgType::auth_failure));
  m.tid.set(tid);
  m.reason.set(static_cast<uint16_t>(reason <= 0 ? EPROTO : reason));
  return m;
}

ConReq make_con_req(uint16_t cid, uint16_t cid_num, uint16_t recon_cnt, bool first_conn,
                    const Uuid& sess, const Uuid& path, bool auth) {
  ConReq m;
  std::memset(&m, 0, sizeof(m));
  m.magic.set(kMagic);
  m.version.set(kVersion);
  m.cid.set(cid);
  m.cid_num.set(cid_num);
  m.recon_cnt.set(recon_cnt);
  m.flags.set(static_cast<uint16_t>((first_conn ? kConReqFirstConn : 0) | (auth ? kConReqAuth : 0)));
  std::memcpy(m.sess_uuid, sess.data(), 16);
  std::memcpy(m.path_uuid, path.data(), 16);
  return m;
}

ConRsp make_con_rsp(int err, uint16_t queue_depth, uint32_t chunk_size, uint32_t max_hdr_size,
                    uint32_t flags, uint32_t max_io_size) {
  ConRsp m;
  std::memset(&m, 0, sizeof(m));
  m.magic.set(kMagic);
  m.version.set(kVersion);
  m.errno_.set(static_cast<uint16_t>(err < 0 ? -err : err));
  if (err == 0) {
    m.queue_depth.set(queue_depth);
    m.chunk_size.set(chunk_size);
    m.max_hdr_size.set(max_hdr_size);
    m.max_io_size.set(max_io_size != 0 ? max_io_size : chunk_size - max_hdr_size);
    m.flags.set(flags);
  }
  return m;
}

Result<InfoReq> make_info_req(std::string_view sessname, std::string_view pathname) {
  if (sessname.empty() || sessname.size() >= kNameMax || pathname.size() >= kNameMax)
    return errc(EINVAL);
  for (std::string_view n : {sessname, pathname}) {
    for (char c : n) {
      if (c < 0x20 || c > 0x7e) return errc(EINVAL);
    }
  }
  InfoReq m;
  std::memset(&m, 0, sizeof(m));
  m.type.set(static_cast<uint16_t>(MsgType::info_req));
  std::memcpy(m.sessname, sessname.data(), sessname.size());
  std::memcpy(m.pathname, pathname.data(), pathname.size());
  return m;
}

}  // namespace ibtrs::proto
