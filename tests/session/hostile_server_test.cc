// A hostile server speaking raw fabric to a real client: what a client registered is reachable
// only while the server was granted it. A read's buffer is writable through the key the read
// carries until its response arrives, and not after: the client revokes the read's windows
// before the caller's callback runs (docs/protocol.md, "Read invalidation").
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <future>
#include <thread>

#include "core/fabrics.h"
#include "fabric/fabric.h"
#include "proto/ibtrs_proto.h"
#include "session_harness.h"

namespace ibtrs::test {
namespace {

using namespace std::chrono_literals;
using namespace ibtrs::proto;
using fabric::Completion;
using fabric::Opcode;
using fabric::WcStatus;

FabricKind& g_kind = hostile_fabric();

constexpr uint16_t kQd = 4;
constexpr uint32_t kChunk = 128 * 1024;
constexpr uint32_t kMaxHdr = 4096;

// The server side of the protocol, by hand: accepts a one-IO-connection path, answers INFO_REQ
// with its chunks, and then does with a read whatever the test says.
class EvilServer {
 public:
  void start() {
    auto f = core::shared_fabric(g_kind, false);
    ASSERT_TRUE(f.ok());
    auto a = g_kind == FabricKind::tcp ? Address::parse("tcp:127.0.0.1:0")
                                       : Address::parse("loopback:evil-server:0");
    auto l = (*f)->listen(*a);
    ASSERT_TRUE(l.ok()) << l.error().message();
    listener_ = std::move(*l);
    auto d = (*f)->domain_for(listener_->address());
    ASSERT_TRUE(d.ok());
    dev_ = *d;
    chunks_.assign(size_t{kQd} * kChunk, std::byte{0});
    auto mr = dev_->register_memory(chunks_.data(), chunks_.size(),
                                    fabric::kLocalWrite | fabric::kRemoteWrite);
    ASSERT_TRUE(mr.ok());
    chunks_mr_ = std::move(*mr);
    auto lm = dev_->register_memory(local_, sizeof(local_), fabric::kLocalWrite);
    ASSERT_TRUE(lm.ok());
    local_mr_ = std::move(*lm);
  }
  const Address& address() const { return listener_->address(); }

  // Accepts the service and the IO connection of one path.
  void accept_path() {
    for (int i = 0; i < 2; ++i) {
      auto req = listener_->get_request(10s);
      ASSERT_TRUE(req.ok()) << req.error().message();
      std::string why;
      auto cr = parse_con_req((*req)->private_data(), &why);
      ASSERT_TRUE(cr.ok()) << why;
      const uint16_t cid = cr->cid.get();
      ASSERT_LT(cid, 2u);
      Side& s = side_[cid];
      auto cq = dev_->create_cq(256);
      ASSERT_TRUE(cq.ok());
      s.cq = std::move(*cq);
      fabric::QueueCaps caps{64, 64, 1, 1};
      auto rsp = make_con_rsp(0, kQd, kChunk, kMaxHdr, 0);
      auto c = (*req)->accept(*s.cq, caps, as_bytes_of(rsp), {});
      ASSERT_TRUE(c.ok()) << c.error().message();
      s.conn = std::move(*c);
      std::vector<fabric::RecvWr> rw(32);
      fabric::Sge sg = local_mr_->sge(0, 256);  // the service RECV: INFO_REQ lands here
      for (auto& w : rw) w = cid == 0 ? fabric::RecvWr{0, std::span(&sg, 1)} : fabric::RecvWr{};
      ASSERT_TRUE(s.conn->post_recv(cid == 0 ? std::span(rw).first(1) : std::span(rw)).ok());
    }
  }

  // Answers the path's INFO_REQ with the chunks.
  void answer_info() {
    Completion wc;
    ASSERT_TRUE(next(side_[0], Opcode::recv, wc));
    std::string why;
    ASSERT_TRUE(parse_info_req(std::span(local_, wc.byte_len), &why).ok()) << why;
    InfoRspHeader h{};
    h.type.set(static_cast<uint16_t>(MsgType::info_rsp));
    h.sg_cnt.set(kQd);
    std::memcpy(local_ + 512, &h, sizeof(h));
    for (uint32_t i = 0; i < kQd; ++i) {
      ChunkDesc d{};
      d.addr.set(chunks_mr_->remote_addr(size_t{i} * kChunk));
      d.key.set(chunks_mr_->rkey());
      d.len.set(kChunk);
      std::memcpy(local_ + 512 + sizeof(h) + i * sizeof(d), &d, sizeof(d));
    }
    send(side_[0], Opcode::send, 512, static_cast<uint32_t>(info_rsp_size(kQd)), 0, 0, 0);
  }

  // Takes the next IO request: a read; keeps its descriptors and flags.
  void take_read() {
    Completion wc;
    ASSERT_TRUE(next(side_[1], Opcode::recv_rdma_with_imm, wc));
    ASSERT_EQ(imm_type(wc.imm), ImmType::io_req);
    auto layout = imm_layout(kQd, kChunk);
    auto io = decode_io_req_imm(*layout, wc.imm);
    ASSERT_LT(io.chunk_id, kQd);
    std::string why;
    auto chunk = std::span(chunks_).subspan(size_t{io.chunk_id} * kChunk, kChunk);
    auto r = parse_io_req(chunk, io.offset, kMaxHdr, copy_, &why);
    ASSERT_TRUE(r.ok()) << why;
    ASSERT_EQ(r->kind, IoKind::read);
    read_flags_ = r->read.flags;
    descs_.assign(r->read.descs.begin(), r->read.descs.end());
    permit_ = io.chunk_id;
  }

  // Writes `fill` over the read's first descriptor; with `respond`, then answers it. Returns
  // the status of the data write.
  WcStatus write_data(char fill, bool respond) {
    const BufDesc& d = descs_.at(0);
    std::memset(local_ + 4096, fill, d.len.get());
    const uint64_t id = ++wr_;
    send(side_[1], Opcode::write, 4096, d.len.get(), d.addr.get(), d.key.get(), 0, id);
    if (respond) {
      send(side_[1], Opcode::write_with_imm, 0, 0, 0, 0, *encode_io_rsp_imm(permit_, 0), 0);
    }
    Completion wc;
    if (!wait_for(side_[1], id, wc)) return WcStatus::fatal_error;
    return wc.status;
  }

  uint16_t read_flags() const { return read_flags_; }
  fabric::Connection& io() { return *side_[1].conn; }
  void close() {
    for (auto& s : side_) s.conn.reset();
  }

 private:
  struct Side {
    std::unique_ptr<fabric::CompletionQueue> cq;
    std::unique_ptr<fabric::Connection> conn;
  };

  void send(Side& s, Opcode op, size_t off, uint32_t len, uint64_t raddr, uint32_t rkey,
            uint32_t imm, uint64_t id = 0) {
    fabric::Sge sg = local_mr_->sge(off, len);
    fabric::SendWr w{};
    w.wr_id = id;
    w.opcode = op;
    w.sg_list = std::span(&sg, len > 0 ? 1 : 0);
    w.remote_addr = raddr;
    w.rkey = rkey;
    w.imm = imm;
    w.signaled = id != 0;
    ASSERT_TRUE(s.conn->post_send(std::span(&w, 1)).ok());
  }
  bool next(Side& s, Opcode op, Completion& out) {
    Completion wc[8];
    for (int i = 0; i < 500; ++i) {
      size_t n = s.cq->wait(wc, 10ms);
      for (size_t k = 0; k < n; ++k) {
        if (wc[k].status == WcStatus::success && wc[k].opcode == op) {
          out = wc[k];
          return true;
        }
      }
    }
    return false;
  }
  bool wait_for(Side& s, uint64_t id, Completion& out) {
    Completion wc[8];
    for (int i = 0; i < 500; ++i) {
      size_t n = s.cq->wait(wc, 10ms);
      for (size_t k = 0; k < n; ++k) {
        if (wc[k].wr_id == id) {
          out = wc[k];
          return true;
        }
      }
    }
    return false;
  }

  std::unique_ptr<fabric::Listener> listener_;
  fabric::Domain* dev_ = nullptr;
  std::vector<std::byte> chunks_;
  std::unique_ptr<fabric::MemoryRegion> chunks_mr_;
  alignas(4096) std::byte local_[16384] = {};
  std::unique_ptr<fabric::MemoryRegion> local_mr_;
  Side side_[2];
  std::byte copy_[kMaxHdr];
  std::vector<BufDesc> descs_;
  uint16_t read_flags_ = 0;
  uint32_t permit_ = 0;
  uint64_t wr_ = 100;
};

class HostileServer : public ::testing::Test {
 protected:
  void SetUp() override {
    srv_.start();
    if (HasFatalFailure()) return;
    ClientOptions co;
    co.session_name = "victim";
    co.paths.push_back(PathSpec{std::nullopt, srv_.address()});
    co.io_threads = 1;
    co.reconnect.max_attempts = 0;  // the evil server answers one path once
    co.heartbeat.interval = 60s;
    auto opened = std::async(std::launch::async, [co] { return ClientSession::open(co); });
    srv_.accept_path();
    if (HasFatalFailure()) return;
    srv_.answer_info();
    if (HasFatalFailure()) return;
    auto c = opened.get();
    ASSERT_TRUE(c.ok()) << c.error().message();
    client_ = std::move(*c);
    auto b = client_->alloc_buffer(8192);
    ASSERT_TRUE(b.ok());
    buf_ = std::move(*b);
    std::memset(buf_->data(), 0, 8192);
  }
  void TearDown() override {
    buf_.reset();
    client_.reset();
    srv_.close();
  }

  // Submits a read of 4096 bytes into the start of buf_.
  void submit_read(Waiter& w) {
    VolHdr h{0, 4096, kVolMagic};
    seg_ = IoSeg{buf_->data(), 4096, buf_.get()};
    IoRequest r;
    r.dir = IoDir::read;
    r.usr = std::span(reinterpret_cast<const std::byte*>(&h), sizeof(h));
    r.data = std::span(&seg_, 1);
    r.done = &Waiter::cb;
    r.ctx = &w;
    ASSERT_TRUE(client_->request(r).ok());
  }
  bool buffer_is(size_t from, size_t len, char c) const {
    return std::all_of(buf_->data() + from, buf_->data() + from + len,
                       [c](std::byte b) { return b == std::byte(c); });
  }

  EvilServer srv_;
  std::unique_ptr<ClientSession> client_;
  std::unique_ptr<RegisteredMemory> buf_;
  IoSeg seg_;
};

// Case: the server answers a read (data, then the response), and once the caller has its
// completion writes the buffer again with the key the read carried.
// Expect: the read asked for invalidation (kReadNeedInvalidate); its data arrived; the late
// write is refused by the fabric (remote_access_error at the server, whose connection breaks)
// and not one byte of the client's buffer changes.
TEST_F(HostileServer, AWriteAfterTheResponseIsRefused) {
  Waiter w;
  submit_read(w);
  srv_.take_read();
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_NE(srv_.read_flags() & kReadNeedInvalidate, 0) << "every read asks for invalidation";
  ASSERT_EQ(srv_.write_data('D', /*respond=*/true), WcStatus::success);
  ASSERT_EQ(w.wait(), 0);
  ASSERT_TRUE(buffer_is(0, 4096, 'D'));
  EXPECT_EQ(srv_.write_data('E', /*respond=*/false), WcStatus::remote_access_error);
  EXPECT_TRUE(buffer_is(0, 4096, 'D')) << "the read's buffer after its response";
  EXPECT_TRUE(buffer_is(4096, 4096, '\0')) << "the rest of the registration";
  EXPECT_NE(srv_.io().state(), fabric::ConnState::connected);
}

// Case: the server writes the read's buffer twice before answering, then answers.
// Expect: both writes land (the buffer is the server's until the response); the caller sees
// the last one, and the read completes with success.
TEST_F(HostileServer, TheBufferIsTheServersUntilTheResponse) {
  Waiter w;
  submit_read(w);
  srv_.take_read();
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_EQ(srv_.write_data('A', /*respond=*/false), WcStatus::success);
  ASSERT_EQ(srv_.write_data('B', /*respond=*/true), WcStatus::success);
  ASSERT_EQ(w.wait(), 0);
  EXPECT_TRUE(buffer_is(0, 4096, 'B'));
}

}  // namespace
}  // namespace ibtrs::test
