// The tcp provider's receive engine against crafted streams: placement, splitting, and every
// way a peer can break the protocol.
#include <gtest/gtest.h>

#include <cstring>
#include <deque>
#include <vector>

#include "fabric/tcp/tcp_rx.h"

namespace ibtrs::fabric::tcp {
namespace {

class FakeHooks final : public RxHooks {
 public:
  virtual ~FakeHooks() = default;
  std::vector<std::byte> stream;
  size_t pos = 0;
  size_t chunk = 1 << 20;   // bytes per read at most
  bool eof = false;         // end of stream once drained (else EAGAIN)
  std::deque<RecvEntry> recvs;
  std::vector<Completion> done;
  uint32_t sent = 1000;     // our data frames sent so far (acks may not exceed it)
  uint32_t acked = 0;
  std::vector<std::pair<uint32_t, WcStatus>> naks;

  ssize_t read(const iovec* iov, int iovcnt) override {
    if (pos == stream.size()) return eof ? 0 : -EAGAIN;
    size_t budget = std::min(chunk, stream.size() - pos);
    size_t got = 0;
    for (int i = 0; i < iovcnt && got < budget; ++i) {
      size_t n = std::min(iov[i].iov_len, budget - got);
      std::memcpy(iov[i].iov_base, stream.data() + pos + got, n);
      got += n;
    }
    pos += got;
    return static_cast<ssize_t>(got);
  }
  RecvEntry* head_recv() override { return recvs.empty() ? nullptr : &recvs.front(); }
  void complete_recv(WcStatus st, Opcode op, uint32_t len, uint32_t imm, bool with_imm) override {
    done.push_back(Completion{recvs.front().wr_id, st, op, len, imm, with_imm});
    recvs.pop_front();
  }
  bool on_ack(uint32_t ack) override {
    if (ack - acked > sent - acked) return false;
    acked = ack;
    return true;
  }
  void on_nak(uint32_t frame, WcStatus st) override { naks.emplace_back(frame, st); }

  void frame(FrameHeader h, const void* payload = nullptr, size_t len = 0) {
    auto* p = reinterpret_cast<const std::byte*>(&h);
    stream.insert(stream.end(), p, p + sizeof(h));
    if (len > 0) {
      auto* q = static_cast<const std::byte*>(payload);
      stream.insert(stream.end(), q, q + len);
    }
  }
};

FrameHeader write_hdr(FrameType t, uint32_t rkey, uint64_t addr, uint32_t len, uint32_t imm = 0) {
  FrameHeader h = make_header(t, len);
  h.rkey.set(rkey);
  h.remote_addr.set(addr);
  h.imm.set(imm);
  return h;
}

class RxEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    target.assign(1 << 20, std::byte{0xEE});
    auto k = mrs.add(target.data(), target.size(), kRemoteWrite);
    ASSERT_TRUE(k.ok());
    rkey = *k;
    rbuf.assign(4096, std::byte{0});
    auto lk = mrs.add(rbuf.data(), rbuf.size(), kLocalWrite);
    ASSERT_TRUE(lk.ok());
    lkey = *lk;
  }
  uint64_t taddr(size_t off = 0) const { return reinterpret_cast<uint64_t>(target.data()) + off; }
  RecvEntry recv(uint64_t id, size_t off, uint32_t len) {
    RecvEntry r;
    r.wr_id = id;
    r.num_sge = 1;
    r.sge[0] = Sge{reinterpret_cast<uint64_t>(rbuf.data()) + off, len, lkey};
    return r;
  }
  // Pumps while the stream has bytes left (a short read ends a pump with `idle`), then once
  // more to see how the stream ends.
  RxResult run(RxEngine& rx) {
    for (int i = 0; i < 100000; ++i) {
      RxResult r = rx.pump(hooks, 4);
      if (r != RxResult::more && r != RxResult::idle) return r;
      if (hooks.pos == hooks.stream.size()) break;
    }
    return rx.pump(hooks, 4);
  }
  bool untouched() const {
    for (auto b : target) {
      if (b != std::byte{0xEE}) return false;
    }
    return true;
  }

  MrTable mrs;
  std::vector<std::byte> target;
  std::vector<std::byte> rbuf;
  uint32_t rkey = 0, lkey = 0;
  FakeHooks hooks;
};

// Case: a WRITE_IMM and a SEND, the stream delivered one byte per read.
// Expect: bytes placed exactly, both completions, placed() == 2.
TEST_F(RxEngineTest, FramesSplitAtEveryByteArePlacedExactly) {
  std::vector<std::byte> data(3000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>(i * 7);
  hooks.frame(write_hdr(FrameType::write_imm, rkey, taddr(100), 3000, 42), data.data(), 3000);
  hooks.frame(make_header(FrameType::send, 10), data.data(), 10);
  hooks.recvs.push_back(recv(1, 0, 64));
  hooks.recvs.push_back(recv(2, 64, 64));
  hooks.chunk = 1;
  RxEngine rx(mrs, 64);
  RxResult r = RxResult::more;
  for (int i = 0; i < 10000 && hooks.pos < hooks.stream.size(); ++i) r = rx.pump(hooks, 1);
  r = rx.pump(hooks, 1);
  EXPECT_EQ(r, RxResult::idle);
  EXPECT_EQ(rx.placed(), 2u);
  EXPECT_EQ(0, std::memcmp(target.data() + 100, data.data(), 3000));
  ASSERT_EQ(hooks.done.size(), 2u);
  EXPECT_EQ(hooks.done[0].opcode, Opcode::recv_rdma_with_imm);
  EXPECT_EQ(hooks.done[0].imm, 42u);
  EXPECT_EQ(hooks.done[0].byte_len, 3000u);
  EXPECT_EQ(hooks.done[1].opcode, Opcode::recv);
  EXPECT_EQ(0, std::memcmp(rbuf.data() + 64, data.data(), 10));
}

// Case: a 1 MiB WRITE read in 64 KiB pieces.
// Expect: all but the staging share of it is received in place (no extra copy).
TEST_F(RxEngineTest, LargeWritesAreReceivedInPlace) {
  std::vector<std::byte> data(1 << 20, std::byte{7});
  hooks.frame(write_hdr(FrameType::write, rkey, taddr(), 1 << 20), data.data(), data.size());
  hooks.chunk = 64 * 1024;
  RxEngine rx(mrs);
  run(rx);
  EXPECT_EQ(rx.placed(), 1u);
  EXPECT_EQ(rx.payload_bytes(), 1u << 20);
  EXPECT_LE(rx.staged_copy_bytes(), kDefaultStaging);
  EXPECT_EQ(target, data);
}

TEST_F(RxEngineTest, BadRkeyFailsWithRemoteAccessErrorAndPlacesNothing) {
  std::vector<std::byte> data(100, std::byte{1});
  hooks.frame(write_hdr(FrameType::write, rkey + 1, taddr(), 100), data.data(), 100);
  RxEngine rx(mrs);
  EXPECT_EQ(run(rx), RxResult::failed);
  EXPECT_EQ(rx.nak_status(), WcStatus::remote_access_error);
  EXPECT_EQ(rx.placed(), 0u);
  EXPECT_TRUE(untouched());
}

TEST_F(RxEngineTest, OutOfBoundsWriteFailsAndPlacesNothing) {
  std::vector<std::byte> data(100, std::byte{1});
  hooks.frame(write_hdr(FrameType::write, rkey, taddr(target.size() - 99), 100), data.data(), 100);
  RxEngine rx(mrs);
  EXPECT_EQ(run(rx), RxResult::failed);
  EXPECT_EQ(rx.nak_status(), WcStatus::remote_access_error);
  EXPECT_EQ(rx.error(), errc(EFAULT));
  EXPECT_TRUE(untouched());
}

TEST_F(RxEngineTest, WriteIntoLocalOnlyRegionIsRefused) {
  std::vector<std::byte> data(10, std::byte{1});
  hooks.frame(write_hdr(FrameType::write, lkey, reinterpret_cast<uint64_t>(rbuf.data()), 10),
              data.data(), 10);
  RxEngine rx(mrs);
  EXPECT_EQ(run(rx), RxResult::failed);
  EXPECT_EQ(rx.nak_status(), WcStatus::remote_access_error);
  EXPECT_EQ(rbuf, std::vector<std::byte>(4096, std::byte{0}));
}

// Case: headers that break the syntax rules. Expect: each fails with remote_invalid_request
// (EPROTO) before any byte is placed.
TEST_F(RxEngineTest, MalformedHeadersFailWithProtocolError) {
  std::vector<FrameHeader> bad;
  FrameHeader h = make_header(FrameType::send, 4);
  h.reserved0 = 1;
  bad.push_back(h);
  h = make_header(FrameType::send, 4);
  h.reserved1.set(9);
  bad.push_back(h);
  bad.push_back(make_header(static_cast<FrameType>(0), 0));
  bad.push_back(make_header(static_cast<FrameType>(99), 0));
  bad.push_back(make_header(FrameType::ack, 5));           // ack with payload
  bad.push_back(make_header(FrameType::connect_req, 64));  // handshake after handshake
  h = make_header(FrameType::send, 4);
  h.imm.set(1);                                            // imm on a send
  bad.push_back(h);
  h = make_header(FrameType::send, 4);
  h.flags = 0x80;                                          // unknown flag
  bad.push_back(h);
  h = make_header(FrameType::nak, 0);                      // nak without a status
  bad.push_back(h);
  h = make_header(FrameType::write, 0x80000001u);          // longer than 2 GiB
  bad.push_back(h);
  for (const FrameHeader& b : bad) {
    FakeHooks fresh;
    fresh.frame(b);
    fresh.recvs.push_back(recv(1, 0, 64));
    RxEngine rx(mrs);
    EXPECT_EQ(rx.pump(fresh, 4), RxResult::failed) << int(b.type);
    EXPECT_EQ(rx.nak_status(), WcStatus::remote_invalid_request);
    EXPECT_EQ(rx.error(), errc(EPROTO));
  }
  EXPECT_TRUE(untouched());
}

TEST_F(RxEngineTest, AckBeyondWhatWasSentIsAProtocolError) {
  FrameHeader h = make_header(FrameType::ack);
  h.ack.set(1001);
  hooks.frame(h);
  RxEngine rx(mrs);
  EXPECT_EQ(run(rx), RxResult::failed);
  EXPECT_EQ(rx.error(), errc(EPROTO));
}

TEST_F(RxEngineTest, SendWaitsForARecvThenCompletes) {
  std::vector<std::byte> data(20, std::byte{3});
  hooks.frame(make_header(FrameType::send, 20), data.data(), 20);
  RxEngine rx(mrs);
  EXPECT_EQ(run(rx), RxResult::rnr);
  EXPECT_EQ(rx.pump(hooks, 4), RxResult::rnr) << "still no RECV";
  hooks.recvs.push_back(recv(5, 0, 64));
  EXPECT_EQ(run(rx), RxResult::idle);
  ASSERT_EQ(hooks.done.size(), 1u);
  EXPECT_EQ(hooks.done[0].wr_id, 5u);
  EXPECT_EQ(hooks.done[0].byte_len, 20u);
}

TEST_F(RxEngineTest, SendLargerThanRecvFailsBothWays) {
  std::vector<std::byte> data(100, std::byte{3});
  hooks.frame(make_header(FrameType::send, 100), data.data(), 100);
  hooks.recvs.push_back(recv(5, 0, 50));
  RxEngine rx(mrs);
  EXPECT_EQ(run(rx), RxResult::failed);
  EXPECT_EQ(rx.nak_status(), WcStatus::remote_invalid_request);
  ASSERT_EQ(hooks.done.size(), 1u);
  EXPECT_EQ(hooks.done[0].status, WcStatus::local_length_error);
  EXPECT_EQ(rbuf, std::vector<std::byte>(4096, std::byte{0}));
}

TEST_F(RxEngineTest, NakReportsTheFailedFrame) {
  FrameHeader h = make_header(FrameType::nak);
  h.ack.set(7);
  h.status = static_cast<uint8_t>(WcStatus::remote_access_error);
  hooks.frame(h);
  RxEngine rx(mrs);
  EXPECT_EQ(run(rx), RxResult::nak);
  ASSERT_EQ(hooks.naks.size(), 1u);
  EXPECT_EQ(hooks.naks[0].first, 7u);
  EXPECT_EQ(hooks.naks[0].second, WcStatus::remote_access_error);
}

TEST_F(RxEngineTest, EndOfStreamInsideAFrameIsPeerClosed) {
  std::vector<std::byte> data(100, std::byte{1});
  hooks.frame(write_hdr(FrameType::write, rkey, taddr(), 100), data.data(), 50);  // cut short
  hooks.eof = true;
  RxEngine rx(mrs);
  EXPECT_EQ(run(rx), RxResult::peer_closed);
  EXPECT_EQ(rx.error(), errc(ECONNRESET));
  EXPECT_EQ(rx.placed(), 0u);
}

TEST_F(RxEngineTest, ZeroLengthWriteImmIgnoresRkey) {
  hooks.frame(write_hdr(FrameType::write_imm, 0, 0, 0, 0x80000000u));
  hooks.recvs.push_back(recv(1, 0, 0));
  RxEngine rx(mrs);
  EXPECT_EQ(run(rx), RxResult::idle);
  ASSERT_EQ(hooks.done.size(), 1u);
  EXPECT_EQ(hooks.done[0].imm, 0x80000000u);
}

TEST_F(RxEngineTest, RegionDeregisteredMidPayloadStopsPlacement) {
  std::vector<std::byte> data(100000, std::byte{1});
  hooks.frame(write_hdr(FrameType::write, rkey, taddr(), 100000), data.data(), data.size());
  hooks.chunk = 30000;
  RxEngine rx(mrs, 64);
  EXPECT_EQ(rx.pump(hooks, 1), RxResult::more);  // first piece placed
  mrs.remove(rkey);
  EXPECT_EQ(run(rx), RxResult::failed);
  EXPECT_EQ(rx.nak_status(), WcStatus::remote_access_error);
  EXPECT_EQ(rx.placed(), 0u);
}

}  // namespace
}  // namespace ibtrs::fabric::tcp
