// A raw IBTRS client for scenario tests: it speaks the wire protocol by hand on the fabric
// layer (docs/protocol.md), so a test can send what no honest client would: half-open paths,
// malformed messages, requests without acknowledging the responses.
#pragma once

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/fabrics.h"
#include "fabric/fabric.h"
#include "proto/ibtrs_proto.h"
#include "session_harness.h"

namespace ibtrs::test {
namespace raw {

using namespace std::chrono_literals;
using namespace ibtrs::proto;

inline Uuid to_uuid(const Uuid16& u) {
  Uuid r;
  std::memcpy(r.data(), u.bytes, 16);
  return r;
}

// One connection of a raw peer. Its CQ is polled only when the test says so: a software
// provider's connection whose CQ is never polled takes nothing and acknowledges nothing.
struct RawCon {
  std::unique_ptr<fabric::CompletionQueue> cq;
  std::unique_ptr<fabric::Connection> conn;
};

// A client that speaks the wire protocol by hand (docs/protocol.md), owning a registered buffer
// for its messages: bytes [0, 8K) are what it sends, [8K, 16K) where it receives, [16K, 32K)
// read requests (one place per chunk), and a separate region its reads land in.
class RawPeer {
 public:
  explicit RawPeer(const Address& server) : server_(server) {
    auto f = core::shared_fabric(server.fabric, false);
    EXPECT_TRUE(f.ok());
    auto d = (*f)->domain_for(server);
    EXPECT_TRUE(d.ok());
    dom_ = *d;
    auto mr = dom_->register_memory(buf_, sizeof(buf_), fabric::kLocalWrite | fabric::kRemoteWrite);
    EXPECT_TRUE(mr.ok());
    mr_ = std::move(*mr);
    auto rm = dom_->register_memory(read_.data(), read_.size(), fabric::kLocalWrite | fabric::kRemoteWrite);
    EXPECT_TRUE(rm.ok());
    read_mr_ = std::move(*rm);
  }

  // One connection carrying `req`; the CON_RSP errno of a refusal comes back in `refused`.
  Result<RawCon> connect(const ConReq& req, int* refused = nullptr, uint32_t send_depth = 64,
                         std::chrono::milliseconds timeout = 5s) {
    RawCon c;
    BASE_ASSIGN_OR_RETURN(c.cq, dom_->create_cq(send_depth + 64));
    fabric::ConnectParams p;
    p.remote = server_;
    p.cq = c.cq.get();
    p.caps.max_send_wr = send_depth;
    p.caps.max_recv_wr = 64;
    p.private_data = as_bytes_of(req);
    p.timeout = timeout;
    std::vector<std::byte> rej;
    auto r = dom_->connect(p, &rej);
    if (!r.ok()) {
      std::string why;
      if (refused != nullptr && !rej.empty()) {
        auto rsp = parse_con_rsp(rej, &why);
        *refused = rsp.ok() ? rsp->errno_.get() : -1;
      }
      return r.error();
    }
    c.conn = std::move(r->connection);
    con_rsp_.assign(r->private_data.begin(), r->private_data.end());
    recv_sge_ = mr_->sge(8192, 8192);
    std::vector<fabric::RecvWr> rw(64);
    for (auto& w : rw) w = fabric::RecvWr{0, std::span(&recv_sge_, 1)};
    BASE_TRY(c.conn->post_recv(rw));
    return c;
  }

  // The CON_RSP of the last accepted connection.
  std::span<const std::byte> last_con_rsp() const { return con_rsp_; }

  // The first connection of a new path of a new session, and nothing after: half-open.
  Result<RawCon> half_open() {
    return connect(make_con_req(0, 2, 0, true, to_uuid(Uuid16::random()), to_uuid(Uuid16::random())));
  }

  // A whole path (service connection + one IO connection with `io_send_depth`) through
  // INFO_RSP, of a new session and path. Returns the chunk descriptors (empty when the server
  // refused or closed the path).
  std::vector<ChunkDesc> establish(std::vector<RawCon>& cons, const std::string& sessname,
                                   uint16_t qd, uint32_t io_send_depth = 64) {
    return establish(cons, sessname, qd, to_uuid(Uuid16::random()), to_uuid(Uuid16::random()),
                     io_send_depth);
  }
  // The same for the session and path given, speaking protocol `version`.
  std::vector<ChunkDesc> establish(std::vector<RawCon>& cons, const std::string& sessname,
                                   uint16_t qd, const Uuid& sess, const Uuid& path,
                                   uint32_t io_send_depth = 64, uint16_t version = kVersion) {
    for (uint16_t cid = 0; cid < 2; ++cid) {
      auto req = make_con_req(cid, 2, 0, cid == 0, sess, path);
      req.version.set(version);
      auto c = connect(req, nullptr, cid == 0 ? 64 : io_send_depth);
      if (!c.ok()) return {};
      cons.push_back(std::move(*c));
    }
    auto info = make_info_req(sessname, "raw@server");
    std::memcpy(buf_, &*info, sizeof(*info));
    fabric::Sge s = mr_->sge(0, sizeof(*info));
    fabric::SendWr w{};
    w.opcode = fabric::Opcode::send;
    w.sg_list = std::span(&s, 1);
    if (!cons[0].conn->post_send(std::span(&w, 1)).ok()) return {};
    fabric::Completion wc[8];
    for (int i = 0; i < 200; ++i) {
      size_t n = cons[0].cq->wait(wc, 50ms);
      for (size_t k = 0; k < n; ++k) {
        if (wc[k].status != fabric::WcStatus::success) return {};
        if (wc[k].opcode != fabric::Opcode::recv) continue;
        std::string why;
        auto d = parse_info_rsp(std::span<const std::byte>(buf_ + 8192, wc[k].byte_len), qd,
                                128 * 1024, &why);
        if (!d.ok()) return {};
        return std::vector<ChunkDesc>(d->begin(), d->end());
      }
    }
    return {};
  }

  // A write request without user header or data (the test volume answers it with EINVAL: an
  // answer all the same) into `chunk`, on `io`.
  Status send_request(RawCon& io, const ChunkDesc& chunk, uint32_t chunk_id, const ImmLayout& l) {
    WriteMsg m{};
    m.type.set(static_cast<uint16_t>(MsgType::write));
    std::memcpy(buf_ + 4096, &m, sizeof(m));
    fabric::Sge s = mr_->sge(4096, sizeof(m));
    fabric::SendWr w{};
    w.opcode = fabric::Opcode::write_with_imm;
    w.sg_list = std::span(&s, 1);
    w.remote_addr = chunk.addr.get();
    w.rkey = chunk.key.get();
    BASE_ASSIGN_OR_RETURN(w.imm, encode_io_req_imm(l, chunk_id, 0));
    w.signaled = false;
    return io.conn->post_send(std::span(&w, 1));
  }

  // A read of `descs` pieces of `piece` bytes from volume offset `off`, landing at the same
  // offset in read_area().
  Status send_read(RawCon& io, const ChunkDesc& chunk, uint32_t chunk_id, const ImmLayout& l,
                   uint64_t off, uint32_t descs, uint32_t piece) {
    std::byte msg[sizeof(VolHdr) + sizeof(ReadMsgHeader) + kMaxReadDescs * sizeof(BufDesc)];
    const VolHdr h{off, descs * piece, kVolMagic};
    ReadMsgHeader m{};
    m.type.set(static_cast<uint16_t>(MsgType::read));
    m.usr_len.set(sizeof(VolHdr));
    m.sg_cnt.set(static_cast<uint16_t>(descs));
    std::memcpy(msg, &h, sizeof(h));
    std::memcpy(msg + sizeof(h), &m, sizeof(m));
    for (uint32_t i = 0; i < descs; ++i) {
      BufDesc d{};
      d.addr.set(read_mr_->remote_addr(off + size_t{i} * piece));
      d.key.set(read_mr_->rkey());
      d.len.set(piece);
      std::memcpy(msg + sizeof(h) + sizeof(m) + i * sizeof(d), &d, sizeof(d));
    }
    const size_t len = sizeof(h) + sizeof(m) + descs * sizeof(BufDesc);
    // Each chunk's message has its own place: a post only references it.
    std::byte* at = buf_ + kReadMsgs + (chunk_id % 32) * 512;
    std::memcpy(at, msg, len);
    fabric::Sge s = mr_->sge(static_cast<size_t>(at - buf_), static_cast<uint32_t>(len));
    fabric::SendWr w{};
    w.opcode = fabric::Opcode::write_with_imm;
    w.sg_list = std::span(&s, 1);
    w.remote_addr = chunk.addr.get();
    w.rkey = chunk.key.get();
    BASE_ASSIGN_OR_RETURN(w.imm, encode_io_req_imm(l, chunk_id, sizeof(VolHdr)));
    w.signaled = false;
    return io.conn->post_send(std::span(&w, 1));
  }
  std::byte* read_area() { return read_.data(); }
  // The message buffer (32 KiB: see the class comment) and its registration.
  std::byte* buf() { return buf_; }
  fabric::MemoryRegion& mr() { return *mr_; }

  // Polls `io` until `n` IO responses arrived (reposting receives); returns how many did.
  uint32_t collect_responses(RawCon& io, uint32_t n, std::chrono::milliseconds t) {
    fabric::Completion wc[64];
    uint32_t got = 0;
    const auto end = std::chrono::steady_clock::now() + t;
    while (got < n && std::chrono::steady_clock::now() < end) {
      size_t k = io.cq->wait(wc, 20ms);
      for (size_t i = 0; i < k; ++i) {
        if (wc[i].status != fabric::WcStatus::success) return got;
        if (wc[i].opcode != fabric::Opcode::recv_rdma_with_imm) continue;
        if (imm_type(wc[i].imm) == ImmType::io_rsp) ++got;
        fabric::RecvWr rw{0, std::span(&recv_sge_, 1)};
        (void)io.conn->post_recv(std::span(&rw, 1));
      }
    }
    return got;
  }

  // Whether the server closed every connection in `cons` within `t` (polls their CQs).
  static bool closed_by_server(std::vector<RawCon>& cons, std::chrono::milliseconds t) {
    fabric::Completion wc[64];
    const auto end = std::chrono::steady_clock::now() + t;
    for (;;) {
      bool all = true;
      for (auto& c : cons) {
        while (c.cq->poll(wc) > 0) {
        }
        if (c.conn->state() == fabric::ConnState::connected) all = false;
      }
      if (all) return true;
      if (std::chrono::steady_clock::now() > end) return false;
      std::this_thread::sleep_for(10ms);
    }
  }

 private:
  Address server_;
  fabric::Domain* dom_ = nullptr;
  static constexpr size_t kReadMsgs = 16384;
  alignas(4096) std::byte buf_[32768] = {};
  std::unique_ptr<fabric::MemoryRegion> mr_;
  std::vector<std::byte> read_ = std::vector<std::byte>(256 * 1024);
  std::unique_ptr<fabric::MemoryRegion> read_mr_;
  fabric::Sge recv_sge_{};
  std::vector<std::byte> con_rsp_;
};

}  // namespace raw

using raw::RawCon;
using raw::RawPeer;
using raw::to_uuid;

}  // namespace ibtrs::test
