#include "raw_peers.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>

#include "auth/chap.h"
#include "core/fabrics.h"
#include "fabric/tcp/tcp_wire.h"

namespace ibnbd::hostile {

namespace fabric = ibtrs::fabric;
namespace iproto = ibtrs::proto;
using ibtrs::errc;
using Clock = std::chrono::steady_clock;

namespace {

template <typename T>
std::vector<std::byte> bytes_of(const T& t) {
  std::vector<std::byte> v(sizeof(T));
  std::memcpy(v.data(), &t, sizeof(T));
  return v;
}

iproto::Uuid to_uuid(const ibtrs::Uuid16& u) {
  iproto::Uuid r;
  std::memcpy(r.data(), u.bytes, 16);
  return r;
}

Ms left(Clock::time_point end) {
  return std::max(Ms(0), std::chrono::duration_cast<Ms>(end - Clock::now()));
}

// Receive slots: the service connection gets room for INFO_RSP and the authentication
// messages before it (never re-posted: 8 outlast a case), the IO connections 64-byte slots
// (RKEY_RSP is 8 bytes; responses are immediates).
constexpr uint32_t kServiceSlot = 64 * 1024;
constexpr uint32_t kServiceSlots = 8;
constexpr uint32_t kIoSlot = 64;
constexpr uint32_t kIoSlots = 64;

// What a path's response is bound to (auth/chap.h, Transcript): who we said we are in CON_REQ
// and INFO_REQ.
struct Binding {
  const ibtrs::Uuid16& session;
  const ibtrs::Uuid16& path;
  const std::string& sessname;
  const std::string& pathname;
};

// The host's side of the exchange after INFO_REQ (docs/protocol.md, "Authentication"), as an
// honest client computes it: the challenge, AUTH_REPLY with R1 from `a`'s key, the verdict.
// `recv` gives the service connection's next message (empty: it closed or stayed silent).
// EACCES, or the AUTH_FAILURE's reason, when refused; EPROTO for anything unexpected.
Status authenticate(const ibtrs::ClientAuth& a, const Binding& b,
                    const std::function<Status(std::span<const std::byte>)>& send,
                    const std::function<std::vector<std::byte>()>& recv) {
  auto refused = [](const std::vector<std::byte>& m) -> std::optional<std::error_code> {
    if (m.empty()) return errc(ECONNRESET);
    auto t = iproto::peek_msg_type(m);
    if (!t.ok() || *t != iproto::MsgType::auth_failure) return std::nullopt;
    auto f = iproto::parse_auth_failure(m, nullptr);
    return errc(f.ok() && f->reason != 0 ? f->reason : EPROTO);
  };
  const auto challenge = recv();
  if (auto e = refused(challenge)) return *e;
  auto c = iproto::parse_auth_challenge(challenge, nullptr);
  if (!c.ok()) return errc(EPROTO);
  BASE_ASSIGN_OR_RETURN(auto dh, ibtrs::auth::X25519::generate());
  BASE_ASSIGN_OR_RETURN(auto z, dh.derive(c->dh_public));
  ibtrs::auth::Transcript t;
  t.tid = c->tid;
  std::memcpy(t.sess_uuid.data(), b.session.bytes, 16);
  std::memcpy(t.path_uuid.data(), b.path.bytes, 16);
  t.sessname = b.sessname;
  t.pathname = b.pathname;
  t.host = a.host_id;
  iproto::AuthReplyView v;
  v.tid = c->tid;
  v.host = a.host_id;
  v.dh_public = dh.public_key();
  BASE_ASSIGN_OR_RETURN(v.response,
                         ibtrs::auth::response(ibtrs::auth::Role::host, *a.key, z, c->nonce, c->seqnum, t));
  BASE_ASSIGN_OR_RETURN(auto reply, iproto::make_auth_reply(v));
  BASE_TRY(send(iproto::as_bytes_of(reply)));
  const auto verdict = recv();
  if (auto e = refused(verdict)) return *e;
  auto ok = iproto::parse_auth_success(verdict, nullptr);
  if (!ok.ok() || ok->tid != c->tid) return errc(EPROTO);
  return {};
}

}  // namespace

std::vector<std::byte> sess_info_msg() {
  std::vector<std::byte> m(sizeof(proto::SessInfoMsg));
  (void)proto::encode_sess_info(m, proto::SessInfo{proto::kProtoVersion});
  return m;
}

std::vector<std::byte> open_msg(AccessMode mode, std::string_view name) {
  proto::OpenMsg m{};
  m.hdr.type.set(static_cast<uint16_t>(proto::MsgType::open));
  m.access_mode = static_cast<uint8_t>(mode);
  std::memcpy(m.dev_name, name.data(), std::min(name.size(), sizeof(m.dev_name) - 1));
  return bytes_of(m);
}

std::vector<std::byte> close_msg(uint32_t device_id) {
  proto::CloseMsg m{};
  m.hdr.type.set(static_cast<uint16_t>(proto::MsgType::close));
  m.device_id.set(device_id);
  return bytes_of(m);
}

std::vector<std::byte> io_msg(uint32_t device_id, IoOp op, uint64_t offset, uint32_t len) {
  proto::IoMsg m{};
  m.hdr.type.set(static_cast<uint16_t>(proto::MsgType::io));
  m.device_id.set(device_id);
  m.sector.set(offset / kSectorSize);
  m.rw.set(static_cast<uint32_t>(op));
  m.bi_size.set(len);
  return bytes_of(m);
}

// ---- RawFabricPeer ----

Result<std::unique_ptr<RawFabricPeer>> RawFabricPeer::connect(const ibtrs::Address& a, const Options& o) {
  auto f = ibtrs::core::shared_fabric(a.fabric, false);
  if (!f.ok()) return f.error();
  auto dom = (*f)->domain_for(a);
  if (!dom.ok()) return dom.error();
  std::unique_ptr<RawFabricPeer> p(new RawFabricPeer());
  p->dom_ = *dom;
  p->buf_ = std::make_unique<std::byte[]>(kBufSize);
  BASE_ASSIGN_OR_RETURN(p->mr_, p->dom_->register_memory(p->buf_.get(), kBufSize,
                                                           fabric::kLocalWrite | fabric::kRemoteWrite));
  if (o.claim_auth && !o.auth.enabled() && o.info) return errc(EINVAL);  // no answer to a challenge
  const bool auth = o.auth.enabled() || o.claim_auth;
  const uint16_t ncon = o.connect == 0 ? o.cid_num : std::min(o.connect, o.cid_num);
  for (uint16_t cid = 0; cid < ncon; ++cid) {
    Con c;
    BASE_ASSIGN_OR_RETURN(c.cq, p->dom_->create_cq(1024));
    const auto req =
        iproto::make_con_req(cid, o.cid_num, 0, cid == 0, to_uuid(o.session), to_uuid(o.path), auth);
    fabric::ConnectParams cp;
    cp.remote = a;
    cp.cq = c.cq.get();
    cp.caps.max_send_wr = 256;
    cp.caps.max_recv_wr = 128;
    cp.private_data = iproto::as_bytes_of(req);
    cp.timeout = Ms(5000);
    std::vector<std::byte> rej;
    auto r = p->dom_->connect(cp, &rej);
    if (!r.ok()) {
      std::string why;
      auto rsp = iproto::parse_con_rsp(rej, &why);
      if (!rej.empty() && rsp.ok() && rsp->errno_.get() != 0) return errc(rsp->errno_.get());
      return r.error();
    }
    if (cid == 0) {
      std::string why;
      auto rsp = iproto::parse_con_rsp(r->private_data, &why);
      if (!rsp.ok()) return errc(EPROTO);
      p->qd_ = rsp->queue_depth.get();
      p->chunk_size_ = rsp->chunk_size.get();
      p->invalidate_ = (rsp->flags.get() & iproto::kConRspInvalidatePerIo) != 0;
    }
    c.conn = std::move(r->connection);
    p->cons_.push_back(std::move(c));
    BASE_TRY(cid == 0 ? p->post_recvs(p->cons_.back(), kRecvOff, kServiceSlot, kServiceSlots)
                       : p->post_recvs(p->cons_.back(), kRecvOff + kServiceSlot * kServiceSlots +
                                                            size_t{cid - 1u} * kIoSlot * kIoSlots,
                                       kIoSlot, kIoSlots));
  }
  if (!o.info) return p;

  const std::string pathname = "raw@server";
  BASE_ASSIGN_OR_RETURN(auto info, iproto::make_info_req(o.session_name, pathname));
  BASE_TRY(p->svc_send(iproto::as_bytes_of(info), 0));
  if (o.auth.enabled()) {
    BASE_TRY(authenticate(
        o.auth, Binding{o.session, o.path, o.session_name, pathname},
        [&](std::span<const std::byte> m) { return p->svc_send(m, 1); }, [&] { return p->svc_recv(Ms(5000)); }));
  }
  const auto rsp = p->svc_recv(Ms(5000));
  if (rsp.empty()) return errc(ETIMEDOUT);
  auto d = iproto::parse_info_rsp(rsp, p->qd_, p->chunk_size_, nullptr);
  if (!d.ok()) return errc(EPROTO);
  p->chunks_.assign(d->begin(), d->end());
  BASE_ASSIGN_OR_RETURN(p->layout_, iproto::imm_layout(p->qd_, p->chunk_size_));
  return p;
}

Status RawFabricPeer::svc_send(std::span<const std::byte> m, uint32_t slot) {
  if (m.size() > 1024 || slot >= 16) return errc(EINVAL);
  const size_t off = kDataOff + size_t{slot} * 1024;
  std::memcpy(buf_.get() + off, m.data(), m.size());
  fabric::Sge s = mr_->sge(off, static_cast<uint32_t>(m.size()));
  fabric::SendWr w{};
  w.opcode = fabric::Opcode::send;
  w.sg_list = std::span(&s, 1);
  return cons_[0].conn->post_send(std::span(&w, 1));
}

std::vector<std::byte> RawFabricPeer::svc_recv(Ms t) {
  const auto end = Clock::now() + t;
  fabric::Completion wc[1];  // one at a time: a second message stays queued for the next call
  while (Clock::now() < end) {
    if (cons_[0].cq->wait(wc, std::min(left(end), Ms(50))) == 0) continue;
    if (wc[0].status != fabric::WcStatus::success) return {};
    if (wc[0].opcode != fabric::Opcode::recv) continue;  // our sends
    const std::byte* m = buf_.get() + wc[0].wr_id;
    return std::vector<std::byte>(m, m + wc[0].byte_len);
  }
  return {};
}

RawFabricPeer::~RawFabricPeer() {
  for (auto& c : cons_) c.conn->disconnect();
  // Flushed work requests complete before the connections go.
  fabric::Completion wc[64];
  for (auto& c : cons_) (void)c.cq->poll(wc);
  cons_.clear();
  mr_.reset();
}

Status RawFabricPeer::post_recvs(Con& c, size_t area_off, uint32_t slot, uint32_t n) {
  std::vector<fabric::Sge> sges(n);
  std::vector<fabric::RecvWr> wrs(n);
  for (uint32_t i = 0; i < n; ++i) {
    const size_t off = area_off + size_t{i} * slot;
    sges[i] = mr_->sge(off, slot);
    wrs[i] = fabric::RecvWr{off, std::span(&sges[i], 1)};
  }
  return c.conn->post_recv(wrs);
}

bool RawFabricPeer::connected() {
  fabric::Completion wc[64];
  bool all = true;
  for (auto& c : cons_) {
    (void)c.cq->poll(wc);  // progress; what arrives on the side is not looked at here
    all = all && c.conn->state() == fabric::ConnState::connected;
  }
  return all;
}

Status RawFabricPeer::post_request(uint32_t chunk, uint32_t len, uint32_t offset, size_t stage_off) {
  if (chunk >= chunks_.size() || cons_.size() < 2) return errc(EINVAL);
  auto imm = iproto::encode_io_req_imm(layout_, chunk, offset);
  if (!imm.ok()) return imm.error();
  fabric::Sge s = mr_->sge(stage_off, len);
  fabric::SendWr w{};
  w.opcode = fabric::Opcode::write_with_imm;
  w.sg_list = std::span(&s, len ? 1 : 0);
  w.remote_addr = chunks_[chunk].addr.get();
  w.rkey = chunks_[chunk].key.get();
  w.imm = *imm;
  w.signaled = false;
  return cons_[1].conn->post_send(std::span(&w, 1));
}

Status RawFabricPeer::post_read(uint32_t chunk, std::span<const std::byte> usr, uint32_t len, size_t resp_off) {
  if (usr.size() + sizeof(iproto::ReadMsgHeader) + sizeof(iproto::BufDesc) > kStageSlot ||
      resp_off + len > kRespSize || chunk >= qd_)
    return errc(EINVAL);
  std::byte* p = stage(chunk);
  std::memcpy(p, usr.data(), usr.size());
  iproto::ReadMsgHeader h{};
  h.type.set(static_cast<uint16_t>(iproto::MsgType::read));
  h.usr_len.set(static_cast<uint16_t>(usr.size()));
  h.sg_cnt.set(1);
  iproto::BufDesc d{};
  d.addr.set(mr_->remote_addr(resp_off));
  d.key.set(mr_->rkey());
  d.len.set(len);
  std::memcpy(p + usr.size(), &h, sizeof(h));
  std::memcpy(p + usr.size() + sizeof(h), &d, sizeof(d));
  const auto total = static_cast<uint32_t>(usr.size() + sizeof(h) + sizeof(d));
  return post_request(chunk, total, static_cast<uint32_t>(usr.size()), kStageOff + size_t{chunk} * kStageSlot);
}

Status RawFabricPeer::post_write(uint32_t chunk, std::span<const std::byte> usr, std::span<const std::byte> data) {
  const size_t total = data.size() + usr.size() + sizeof(iproto::WriteMsg);
  if (chunk >= qd_ || total > chunk_size_ || total > kRecvOff - kDataOff) return errc(EINVAL);
  // Small requests are staged per chunk (many may be in flight); one with data uses the data
  // area (one at a time).
  const size_t off = total <= kStageSlot ? kStageOff + size_t{chunk} * kStageSlot : kDataOff;
  std::byte* p = buf_.get() + off;
  if (!data.empty()) std::memcpy(p, data.data(), data.size());
  std::memcpy(p + data.size(), usr.data(), usr.size());
  iproto::WriteMsg m{};
  m.type.set(static_cast<uint16_t>(iproto::MsgType::write));
  m.usr_len.set(static_cast<uint16_t>(usr.size()));
  m.data_len.set(static_cast<uint32_t>(data.size()));
  std::memcpy(p + data.size() + usr.size(), &m, sizeof(m));
  return post_request(chunk, static_cast<uint32_t>(total), static_cast<uint32_t>(data.size() + usr.size()), off);
}

Result<iproto::IoRspImm> RawFabricPeer::next_response(Ms t) {
  if (cons_.size() < 2) return errc(ENOTCONN);
  Con& c = cons_[1];
  const auto end = Clock::now() + t;
  fabric::Completion wc[32];
  do {
    if (!answers_.empty()) {
      const auto a = answers_.front();
      answers_.pop_front();
      return a;
    }
    const size_t n = c.cq->wait(wc, std::min(left(end), Ms(20)));
    for (size_t k = 0; k < n; ++k) {
      if (wc[k].status != fabric::WcStatus::success) return errc(ECONNRESET);
      const bool recv = wc[k].opcode == fabric::Opcode::recv;
      const bool imm = wc[k].opcode == fabric::Opcode::recv_rdma_with_imm;
      if (!recv && !imm) continue;  // our own sends
      fabric::Sge s = mr_->sge(wc[k].wr_id, kIoSlot);
      fabric::RecvWr again{wc[k].wr_id, std::span(&s, 1)};
      if (!c.conn->post_recv(std::span(&again, 1)).ok()) return errc(ECONNRESET);
      if (recv && wc[k].byte_len >= sizeof(iproto::RkeyRsp)) {
        iproto::RkeyRsp r;
        std::memcpy(&r, buf_.get() + wc[k].wr_id, sizeof(r));
        if (r.buf_id.get() < chunks_.size()) chunks_[r.buf_id.get()].key.set(r.rkey.get());
      }
      const auto type = iproto::imm_type(wc[k].imm);
      if (imm && (type == iproto::ImmType::io_rsp || type == iproto::ImmType::io_rsp_w_inv))
        answers_.push_back(iproto::decode_io_rsp_imm(wc[k].imm));
    }
    if (answers_.empty() && c.conn->state() != fabric::ConnState::connected) return errc(ECONNRESET);
  } while (Clock::now() < end || !answers_.empty());
  return errc(ETIMEDOUT);
}

int RawFabricPeer::answer_of(const Status& posted, uint32_t chunk, Ms t) {
  if (!posted.ok()) return -posted.error().value();
  const auto end = Clock::now() + t;
  for (;;) {
    auto r = next_response(left(end));
    if (!r.ok()) return -r.error().value();
    if (r->permit_id == chunk) return r->err;
  }
}

int RawFabricPeer::request_read(std::span<const std::byte> usr, uint32_t len, Ms t) {
  return answer_of(post_read(0, usr, len), 0, t);
}

int RawFabricPeer::request_write(std::span<const std::byte> usr, std::span<const std::byte> data, Ms t) {
  return answer_of(post_write(0, usr, data), 0, t);
}

Status RawFabricPeer::rdma_write(uint64_t addr, uint32_t key, std::span<const std::byte> bytes) {
  if (bytes.size() > kRecvOff - kDataOff || cons_.size() < 2) return errc(EINVAL);
  std::memcpy(buf_.get() + kDataOff, bytes.data(), bytes.size());
  fabric::Sge s = mr_->sge(kDataOff, static_cast<uint32_t>(bytes.size()));
  fabric::SendWr w{};
  w.opcode = fabric::Opcode::write;
  w.sg_list = std::span(&s, 1);
  w.remote_addr = addr;
  w.rkey = key;
  w.signaled = false;
  return cons_[1].conn->post_send(std::span(&w, 1));
}

int RawFabricPeer::sess_info() { return request_read(sess_info_msg(), sizeof(proto::SessInfoRspMsg)); }

int RawFabricPeer::open(const std::string& name, AccessMode mode, proto::OpenRsp* rsp) {
  const int e = request_read(open_msg(mode, name), sizeof(proto::OpenRspMsg));
  if (e == 0 && rsp != nullptr) {
    auto r = proto::decode_open_rsp(std::span(buf_.get(), sizeof(proto::OpenRspMsg)));
    if (!r.ok()) return -EPROTO;
    *rsp = *r;
  }
  return e;
}

int RawFabricPeer::close(uint32_t device_id) { return request_write(close_msg(device_id)); }

// ---- RawTcpPeer ----

namespace {

Result<int> tcp_connect(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return errc(errno);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    const int e = errno;
    ::close(fd);
    return errc(e);
  }
  return fd;
}

}  // namespace

Result<std::unique_ptr<RawTcpPeer>> RawTcpPeer::connect(uint16_t port, const iproto::ConReq& con_req,
                                                        iproto::ConRsp* rsp) {
  BASE_ASSIGN_OR_RETURN(int fd, tcp_connect(port));
  std::unique_ptr<RawTcpPeer> p(new RawTcpPeer(fd));
  int one = 1;
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  namespace tcp = fabric::tcp;
  auto h = tcp::make_header(tcp::FrameType::connect_req, sizeof(tcp::ConnectBody));
  tcp::ConnectBody body{};
  body.magic.set(tcp::kMagic);
  body.version.set(tcp::kVersion);
  body.private_len = sizeof(con_req);
  std::memcpy(body.private_data, &con_req, sizeof(con_req));
  BASE_TRY(p->send_all(&h, sizeof(h)));
  BASE_TRY(p->send_all(&body, sizeof(body)));
  tcp::FrameHeader rh{};
  BASE_TRY(p->recv_all(&rh, sizeof(rh), Ms(5000)));
  if (rh.type != static_cast<uint8_t>(tcp::FrameType::connect_rsp) || rh.length.get() != sizeof(tcp::ConnectBody))
    return errc(EPROTO);
  tcp::ConnectBody rb{};
  BASE_TRY(p->recv_all(&rb, sizeof(rb), Ms(5000)));
  if (rb.verdict != 1) {
    std::string why;
    auto refusal = iproto::parse_con_rsp(std::span(reinterpret_cast<const std::byte*>(rb.private_data),
                                                   std::min<size_t>(rb.private_len, sizeof(rb.private_data))),
                                         &why);
    return errc(refusal.ok() && refusal->errno_.get() != 0 ? refusal->errno_.get() : ECONNREFUSED);
  }
  if (rsp != nullptr) std::memcpy(rsp, rb.private_data, sizeof(*rsp));
  return p;
}

RawTcpPeer::~RawTcpPeer() { ::close(fd_); }

Status RawTcpPeer::send_all(const void* p, size_t n) {
  const auto* c = static_cast<const char*>(p);
  const auto end = Clock::now() + kSendStall;
  while (n > 0) {
    const ssize_t w = ::send(fd_, c, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd pf{fd_, POLLOUT, 0};
      if (::poll(&pf, 1, static_cast<int>(left(end).count())) == 0) return errc(ETIMEDOUT);
      continue;
    }
    if (w <= 0) return errc(w < 0 ? errno : EPIPE);
    c += w;
    n -= static_cast<size_t>(w);
  }
  return {};
}

Status RawTcpPeer::recv_all(void* p, size_t n, Ms t) {
  auto* c = static_cast<char*>(p);
  const auto end = Clock::now() + t;
  while (n > 0) {
    pollfd pf{fd_, POLLIN, 0};
    const int r = ::poll(&pf, 1, static_cast<int>(left(end).count()));
    if (r == 0) return errc(ETIMEDOUT);
    if (r < 0 && errno == EINTR) continue;
    const ssize_t got = ::recv(fd_, c, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return errc(got < 0 ? errno : ECONNRESET);
    c += got;
    n -= static_cast<size_t>(got);
  }
  return {};
}

Status RawTcpPeer::send(std::span<const std::byte> payload) {
  namespace tcp = fabric::tcp;
  auto h = tcp::make_header(tcp::FrameType::send, static_cast<uint32_t>(payload.size()));
  BASE_TRY(send_all(&h, sizeof(h)));
  return send_all(payload.data(), payload.size());
}

Status RawTcpPeer::write_imm(uint64_t addr, uint32_t rkey, uint32_t imm, std::span<const std::byte> payload) {
  namespace tcp = fabric::tcp;
  auto h = tcp::make_header(tcp::FrameType::write_imm, static_cast<uint32_t>(payload.size()));
  h.imm.set(imm);
  h.remote_addr.set(addr);
  h.rkey.set(rkey);
  BASE_TRY(send_all(&h, sizeof(h)));
  return send_all(payload.data(), payload.size());
}

Result<RawTcpPeer::Frame> RawTcpPeer::read_frame(uint8_t type, Ms t) {
  const auto end = Clock::now() + t;
  for (;;) {
    fabric::tcp::FrameHeader h{};
    BASE_TRY(recv_all(&h, sizeof(h), left(end)));
    const uint32_t len = h.length.get();
    if (len > (16u << 20)) return errc(EPROTO);
    Frame f;
    f.type = h.type;
    f.imm = h.imm.get();
    f.payload.resize(len);
    if (len > 0) BASE_TRY(recv_all(f.payload.data(), len, left(end)));
    if (f.type == type) return f;
  }
}

// ---- RawTcpSession ----

Result<std::unique_ptr<RawTcpSession>> RawTcpSession::connect(uint16_t port, const std::string& name,
                                                              const ibtrs::ClientAuth& auth) {
  const auto sess = ibtrs::Uuid16::random(), path = ibtrs::Uuid16::random();
  const bool a = auth.enabled();
  std::unique_ptr<RawTcpSession> s(new RawTcpSession());
  iproto::ConRsp rsp{};
  BASE_ASSIGN_OR_RETURN(s->svc_, RawTcpPeer::connect(port, iproto::make_con_req(0, 2, 0, true, to_uuid(sess),
                                                                                to_uuid(path), a),
                                                      &rsp));
  BASE_ASSIGN_OR_RETURN(s->io_, RawTcpPeer::connect(port, iproto::make_con_req(1, 2, 0, false, to_uuid(sess),
                                                                               to_uuid(path), a),
                                                     nullptr));
  s->qd_ = rsp.queue_depth.get();
  const uint32_t chunk = rsp.chunk_size.get();
  const std::string pathname = "raw@server";
  BASE_ASSIGN_OR_RETURN(auto info, iproto::make_info_req(name, pathname));
  BASE_TRY(s->svc_->send(iproto::as_bytes_of(info)));
  const auto send_frame = static_cast<uint8_t>(fabric::tcp::FrameType::send);
  if (a) {
    BASE_TRY(authenticate(
        auth, Binding{sess, path, name, pathname}, [&](std::span<const std::byte> m) { return s->svc_->send(m); },
        [&] {
          auto f = s->svc_->read_frame(send_frame, Ms(5000));
          return f.ok() ? std::move(f->payload) : std::vector<std::byte>{};
        }));
  }
  BASE_ASSIGN_OR_RETURN(auto frame, s->svc_->read_frame(send_frame, Ms(5000)));
  std::string why;
  auto descs = iproto::parse_info_rsp(frame.payload, s->qd_, chunk, &why);
  if (!descs.ok()) return errc(EPROTO);
  s->chunks_.assign(descs->begin(), descs->end());
  BASE_ASSIGN_OR_RETURN(s->layout_, iproto::imm_layout(s->qd_, chunk));
  return s;
}

Status RawTcpSession::post_read(uint32_t c, std::span<const std::byte> usr, uint32_t len, uint16_t ndesc) {
  if (c >= chunks_.size() || ndesc == 0 || ndesc > iproto::kMaxReadDescs) return errc(EINVAL);
  std::vector<std::byte> m(usr.begin(), usr.end());
  iproto::ReadMsgHeader h{};
  h.type.set(static_cast<uint16_t>(iproto::MsgType::read));
  h.usr_len.set(static_cast<uint16_t>(usr.size()));
  h.sg_cnt.set(ndesc);
  m.resize(usr.size() + sizeof(h) + ndesc * sizeof(iproto::BufDesc));
  std::memcpy(m.data() + usr.size(), &h, sizeof(h));
  for (uint16_t i = 0; i < ndesc; ++i) {
    iproto::BufDesc d{};
    d.addr.set(0x100000 + uint64_t{i} * (len / ndesc));
    d.key.set(0x1234);
    d.len.set(len / ndesc);
    std::memcpy(m.data() + usr.size() + sizeof(h) + i * sizeof(d), &d, sizeof(d));
  }
  BASE_ASSIGN_OR_RETURN(uint32_t imm, iproto::encode_io_req_imm(layout_, c, static_cast<uint32_t>(usr.size())));
  return io_->write_imm(chunks_[c].addr.get(), chunks_[c].key.get(), imm, m);
}

Result<iproto::IoRspImm> RawTcpSession::answer(Ms t) {
  BASE_ASSIGN_OR_RETURN(auto f, io_->read_frame(static_cast<uint8_t>(fabric::tcp::FrameType::write_imm), t));
  return iproto::decode_io_rsp_imm(f.imm);
}

// ---- SilentSocket ----

Result<std::unique_ptr<SilentSocket>> SilentSocket::connect(uint16_t port) {
  BASE_ASSIGN_OR_RETURN(int fd, tcp_connect(port));
  return std::unique_ptr<SilentSocket>(new SilentSocket(fd));
}

SilentSocket::~SilentSocket() { ::close(fd_); }

}  // namespace ibnbd::hostile
