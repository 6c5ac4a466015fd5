// Provider conformance: the semantics fabric.h promises, checked the same way on every provider.
// Run as `fabric_conformance --fabric=loopback|tcp|rdma [--busy-poll] [--tls|--tls=user]`.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <future>
#include <mutex>
#include <set>
#include <numeric>
#include <thread>

#include "fabric/loopback/loopback.h"
#include "fabric_harness.h"

namespace ibtrs::fabric::testing {
namespace {

std::vector<std::byte> bytes_of(std::string_view s) {
  std::vector<std::byte> v(s.size());
  std::memcpy(v.data(), s.data(), s.size());
  return v;
}

std::vector<std::byte> full_private_data(uint8_t seed) {
  std::vector<std::byte> v(kMaxPrivateData);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::byte>(seed + i);
  return v;
}

bool ok(const Completion& c) { return c.status == WcStatus::success; }

using Conformance = FabricTest;

// Case: a client connects with 56 bytes of private data, the server accepts with 56 of its own.
// Expect: each side sees exactly the other's bytes; both connections report connected.
TEST_F(Conformance, ConnectAcceptCarriesPrivateDataBothWays) {
  auto req = full_private_data(1);
  auto rsp = full_private_data(100);
  connect_pair(cli_, srv_, {}, req, rsp);
  EXPECT_EQ(srv_.peer_private, req);
  EXPECT_EQ(cli_.peer_private, rsp);
  EXPECT_EQ(cli_.conn->state(), ConnState::connected);
  EXPECT_EQ(srv_.conn->state(), ConnState::connected);
  EXPECT_FALSE(cli_.conn->device_name().empty());
}

// Case: every pairing of connect private data of 0, 1, 3, 8, 55, 56 bytes with accept data of
// 0, 5, 56 bytes. Expect: each side receives exactly the bytes sent, no padding.
TEST_F(Conformance, PrivateDataLengthsArriveExactly) {
  for (size_t req_len : {0, 1, 3, 8, 55, 56}) {
    for (size_t rsp_len : {0, 5, 56}) {
      Side c, s;
      c.domain = client_domain_;
      s.domain = server_domain_;
      c.shared_cq = cli_.cq.get();
      s.shared_cq = srv_.cq.get();
      auto req = full_private_data(static_cast<uint8_t>(req_len));
      auto rsp = full_private_data(static_cast<uint8_t>(100 + rsp_len));
      req.resize(req_len);
      rsp.resize(rsp_len);
      connect_pair(c, s, {}, req, rsp);
      EXPECT_EQ(s.peer_private, req) << req_len << "/" << rsp_len;
      EXPECT_EQ(c.peer_private, rsp) << req_len << "/" << rsp_len;
      c.conn.reset();
      s.conn.reset();
    }
  }
}

// Case: 20 rounds of connect, one SEND, teardown of both ends.
// Expect: every round connects and delivers; no round hangs.
TEST_F(Conformance, RepeatedConnectAndTeardown) {
  Buffer rx = Buffer::make(*server_domain_, 64, kLocalWrite);
  Buffer tx = Buffer::make(*client_domain_, 64, 0, std::byte{5});
  for (int round = 0; round < 20; ++round) {
    Side c, s;
    c.domain = client_domain_;
    s.domain = server_domain_;
    c.shared_cq = cli_.cq.get();
    s.shared_cq = srv_.cq.get();
    connect_pair(c, s);
    Sge rs = rx.sge(0, 64), ts = tx.sge(0, 64);
    RecvWr r{1, {&rs, 1}};
    SendWr w{2, Opcode::send, {&ts, 1}};
    ASSERT_TRUE(s.conn->post_recv({&r, 1}).ok());
    ASSERT_TRUE(c.conn->post_send({&w, 1}).ok());
    ASSERT_TRUE(drive(c, s, [&] { return c.done.size() == 1 && s.done.size() == 1; })) << round;
    EXPECT_TRUE(ok(c.done[0]) && ok(s.done[0])) << round;
    c.conn.reset();
    s.conn.reset();
    // Flush completions of the torn-down pair may still arrive on the shared CQs: drain them.
    Completion wc[16];
    for (int i = 0; i < 3; ++i) {
      while (cli_.cq->poll(wc) > 0) {
      }
      while (srv_.cq->poll(wc) > 0) {
      }
    }
  }
}

// Case: private data of 57 bytes. Expect: EINVAL before anything is sent.
TEST_F(Conformance, PrivateDataAboveLimitIsRefused) {
  std::vector<std::byte> big(kMaxPrivateData + 1);
  ConnectParams p;
  p.remote = listener_->address();
  p.source = ep_.client_source ? &*ep_.client_source : nullptr;
  p.cq = cli_.cq.get();
  p.private_data = big;
  p.timeout = 2s;
  with_tested_tls(p);
  auto r = client_domain_->connect(p);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error(), errc(EINVAL));
}

// Case: the server rejects with private data. Expect: connect fails with ECONNREFUSED and
// delivers the reject data.
TEST_F(Conformance, RejectDeliversPrivateData) {
  auto reject_pd = bytes_of("no: queue depth too large");
  std::thread srv([&] {
    auto req = listener_->get_request(10s);
    ASSERT_TRUE(req.ok());
    EXPECT_EQ((*req)->private_data().size(), 3u);
    EXPECT_TRUE((*req)->reject(reject_pd).ok());
  });
  auto hello = bytes_of("abc");
  ConnectParams p;
  p.remote = listener_->address();
  p.source = ep_.client_source ? &*ep_.client_source : nullptr;
  p.cq = cli_.cq.get();
  p.private_data = hello;
  p.timeout = 10s;
  with_tested_tls(p);
  std::vector<std::byte> got;
  auto r = client_domain_->connect(p, &got);
  srv.join();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error(), errc(ECONNREFUSED));
  EXPECT_EQ(got, reject_pd);
}

// Case: nobody listens on the address. Expect: connect fails (refused or unreachable), no hang.
TEST_F(Conformance, ConnectToNoListenerFails) {
  Address nowhere = listener_->address();
  listener_.reset();
  ConnectParams p;
  p.remote = nowhere;
  p.source = ep_.client_source ? &*ep_.client_source : nullptr;
  p.cq = cli_.cq.get();
  p.timeout = 5s;
  with_tested_tls(p);
  auto r = client_domain_->connect(p);
  EXPECT_FALSE(r.ok());
}

// Case: 200 SENDs of different sizes into 200 posted RECVs.
// Expect: RECVs complete in posting order, each with the bytes of the matching SEND.
TEST_F(Conformance, SendRecvInOrderByteExact) {
  QueueCaps caps{256, 256, 2, 1};
  connect_pair(cli_, srv_, caps);
  constexpr int kN = 200;
  constexpr size_t kSlot = 4096;
  Buffer rx = Buffer::make(*server_domain_, kN * kSlot, kLocalWrite);
  Buffer tx = Buffer::make(*client_domain_, kN * kSlot, 0);
  tx.pattern(7);
  for (int i = 0; i < kN; ++i) {
    Sge s = rx.sge(i * kSlot, kSlot);
    RecvWr r{static_cast<uint64_t>(i), {&s, 1}};
    ASSERT_TRUE(srv_.conn->post_recv({&r, 1}).ok());
  }
  for (int i = 0; i < kN; ++i) {
    size_t len = 1 + (static_cast<size_t>(i) * 37) % kSlot;
    Sge s = tx.sge(i * kSlot, len);
    SendWr w{static_cast<uint64_t>(1000 + i), Opcode::send, {&s, 1}};
    ASSERT_TRUE(cli_.conn->post_send({&w, 1}).ok());
  }
  ASSERT_TRUE(drive(cli_, srv_, [&] { return srv_.done.size() == kN && cli_.done.size() == kN; }));
  for (int i = 0; i < kN; ++i) {
    size_t len = 1 + (static_cast<size_t>(i) * 37) % kSlot;
    const Completion& c = srv_.done[i];
    ASSERT_TRUE(ok(c)) << to_string(c.status);
    EXPECT_EQ(c.wr_id, static_cast<uint64_t>(i));
    EXPECT_EQ(c.opcode, Opcode::recv);
    EXPECT_EQ(c.byte_len, len);
    EXPECT_EQ(0, std::memcmp(rx.bytes.data() + i * kSlot, tx.bytes.data() + i * kSlot, len)) << i;
    EXPECT_TRUE(ok(cli_.done[i]));
    EXPECT_EQ(cli_.done[i].wr_id, static_cast<uint64_t>(1000 + i));
    EXPECT_EQ(cli_.done[i].opcode, Opcode::send);
  }
}

// Case: WRITEs of every power-of-two size from 1 B to 1 MiB (and odd sizes between), each to a
// distinct offset of the server's region.
// Expect: the target bytes equal the source bytes exactly; bytes around each target untouched.
TEST_F(Conformance, WriteByteExactAllSizes) {
  QueueCaps caps{64, 64, 4, 1};
  connect_pair(cli_, srv_, caps);
  constexpr size_t kMax = 1 << 20;
  Buffer target = Buffer::make(*server_domain_, 2 * kMax + 64, kRemoteWrite, std::byte{0xEE});
  Buffer src = Buffer::make(*client_domain_, kMax, 0);
  for (size_t size = 1; size <= kMax; size = size * 2 + (size < 64 ? 1 : 0)) {
    src.pattern(static_cast<uint32_t>(size));
    std::fill(target.bytes.begin(), target.bytes.end(), std::byte{0xEE});
    const size_t off = 16 + (size % 7);
    Sge s = src.sge(0, size);
    SendWr w{size, Opcode::write, {&s, 1}, target.mr->remote_addr(off), target.mr->rkey()};
    ASSERT_TRUE(cli_.conn->post_send({&w, 1}).ok());
    const size_t before = cli_.done.size();
    ASSERT_TRUE(drive(cli_, srv_, [&] { return cli_.done.size() == before + 1; })) << size;
    ASSERT_TRUE(ok(cli_.done.back())) << size << " " << to_string(cli_.done.back().status);
    EXPECT_EQ(cli_.done.back().opcode == Opcode::write || cli_.done.back().opcode == Opcode::write_with_imm, true);
    ASSERT_EQ(0, std::memcmp(target.bytes.data() + off, src.bytes.data(), size)) << size;
    for (size_t i = 0; i < off; ++i) ASSERT_EQ(target.bytes[i], std::byte{0xEE});
    for (size_t i = off + size; i < target.bytes.size(); ++i) ASSERT_EQ(target.bytes[i], std::byte{0xEE}) << size;
    if (size == kMax) break;
  }
  EXPECT_TRUE(srv_.done.empty()) << "a plain WRITE raises no completion at the target";
}

// Case: WRITE_WITH_IMM gathering 4 SGEs (uneven pieces from two regions) into one target.
// Expect: the target holds the concatenation; the server's RECV completes with the immediate
// value and byte_len = the write's length.
TEST_F(Conformance, WriteWithImmScatterGatherAndImmediate) {
  QueueCaps caps{16, 16, 4, 1};
  connect_pair(cli_, srv_, caps);
  Buffer target = Buffer::make(*server_domain_, 1 << 20, kRemoteWrite);
  Buffer a = Buffer::make(*client_domain_, 300000, 0);
  Buffer b = Buffer::make(*client_domain_, 300000, 0);
  a.pattern(1);
  b.pattern(2);
  Buffer dummy = Buffer::make(*server_domain_, 64, kLocalWrite);
  Sge rs = dummy.sge(0, 64);
  RecvWr r{77, {&rs, 1}};
  ASSERT_TRUE(srv_.conn->post_recv({&r, 1}).ok());
  Sge sg[4] = {a.sge(0, 1), b.sge(5, 4096), a.sge(100, 250000), b.sge(0, 33)};
  const size_t total = 1 + 4096 + 250000 + 33;
  SendWr w{9, Opcode::write_with_imm, sg, target.mr->remote_addr(128), target.mr->rkey(), 0xDEADBEEF};
  ASSERT_TRUE(cli_.conn->post_send({&w, 1}).ok());
  ASSERT_TRUE(drive(cli_, srv_, [&] { return srv_.done.size() == 1 && cli_.done.size() == 1; }));
  const Completion& c = srv_.done[0];
  ASSERT_TRUE(ok(c)) << to_string(c.status);
  EXPECT_EQ(c.wr_id, 77u);
  EXPECT_EQ(c.opcode, Opcode::recv_rdma_with_imm);
  EXPECT_TRUE(c.with_imm);
  EXPECT_EQ(c.imm, 0xDEADBEEFu);
  EXPECT_EQ(c.byte_len, total);
  std::vector<std::byte> expect;
  auto append = [&](Buffer& buf, size_t off, size_t len) {
    expect.insert(expect.end(), buf.bytes.begin() + off, buf.bytes.begin() + off + len);
  };
  append(a, 0, 1);
  append(b, 5, 4096);
  append(a, 100, 250000);
  append(b, 0, 33);
  EXPECT_EQ(0, std::memcmp(target.bytes.data() + 128, expect.data(), total));
  EXPECT_EQ(std::vector<std::byte>(64, std::byte{0}), dummy.bytes) << "RECV buffer of a WRITE_IMM untouched";
}

// Case: a zero-length WRITE_WITH_IMM with rkey 0 (how IBTRS sends heartbeats).
// Expect: the immediate arrives with byte_len 0; no memory is touched.
TEST_F(Conformance, ZeroLengthWriteWithImmNeedsNoTarget) {
  connect_pair(cli_, srv_);
  RecvWr r{1, {}};
  ASSERT_TRUE(srv_.conn->post_recv({&r, 1}).ok());
  SendWr w{2, Opcode::write_with_imm, {}, 0, 0, 0x80000000u};
  ASSERT_TRUE(cli_.conn->post_send({&w, 1}).ok());
  ASSERT_TRUE(drive(cli_, srv_, [&] { return srv_.done.size() == 1 && cli_.done.size() == 1; }));
  EXPECT_TRUE(ok(srv_.done[0]));
  EXPECT_EQ(srv_.done[0].imm, 0x80000000u);
  EXPECT_EQ(srv_.done[0].byte_len, 0u);
  EXPECT_TRUE(ok(cli_.done[0]));
}

// Case: 15 unsignalled 4 KiB WRITEs, then a signalled zero-length WRITE with no SGE and rkey 0
// (a fence: its completion covers everything before it).
// Expect: exactly one completion, for the fence; the 15 writes are placed; the whole send queue
// is free again.
TEST_F(Conformance, ZeroLengthWriteFencesEarlierUnsignalledWrites) {
  QueueCaps caps{16, 4, 1, 1};
  connect_pair(cli_, srv_, caps);
  Buffer target = Buffer::make(*server_domain_, 15 * 4096, kRemoteWrite);
  Buffer src = Buffer::make(*client_domain_, 15 * 4096, 0);
  src.pattern(11);
  std::vector<Sge> sges;
  std::vector<SendWr> wrs;
  for (int i = 0; i < 15; ++i) sges.push_back(src.sge(i * 4096, 4096));
  for (int i = 0; i < 15; ++i)
    wrs.push_back(SendWr{static_cast<uint64_t>(i), Opcode::write, {&sges[i], 1},
                         target.mr->remote_addr(i * 4096), target.mr->rkey(), 0, false});
  wrs.push_back(SendWr{99, Opcode::write, {}, 0, 0, 0, true});
  ASSERT_TRUE(cli_.conn->post_send(wrs).ok());
  ASSERT_TRUE(drive(cli_, srv_, [&] { return cli_.done.size() == 1; }));
  drive(cli_, srv_, [] { return false; }, 50ms);
  ASSERT_EQ(cli_.done.size(), 1u);
  EXPECT_EQ(cli_.done[0].wr_id, 99u);
  EXPECT_TRUE(ok(cli_.done[0]));
  EXPECT_EQ(target.bytes, src.bytes);
  EXPECT_EQ(cli_.conn->send_queue_free(), 16u);
}

// Case: a WRITE into a region with a wrong rkey.
// Expect: the sender's request completes with remote_access_error, the connection breaks (every
// later request flushes), and the target memory is untouched.
TEST_F(Conformance, BadRkeyIsRemoteAccessErrorAndTargetUntouched) {
  connect_pair(cli_, srv_);
  Buffer target = Buffer::make(*server_domain_, 8192, kRemoteWrite, std::byte{0x5A});
  Buffer src = Buffer::make(*client_domain_, 4096, 0, std::byte{0x11});
  Sge s = src.sge(0, 4096);
  SendWr bad{1, Opcode::write, {&s, 1}, target.mr->remote_addr(0), target.mr->rkey() ^ 0x5555u};
  SendWr after{2, Opcode::write, {&s, 1}, target.mr->remote_addr(0), target.mr->rkey()};
  SendWr wrs[2] = {bad, after};
  ASSERT_TRUE(cli_.conn->post_send(wrs).ok());
  ASSERT_TRUE(drive(cli_, srv_, [&] { return cli_.done.size() == 2; }));
  EXPECT_EQ(cli_.done[0].wr_id, 1u);
  EXPECT_EQ(cli_.done[0].status, WcStatus::remote_access_error);
  EXPECT_EQ(cli_.done[1].wr_id, 2u);
  EXPECT_EQ(cli_.done[1].status, WcStatus::flush_error);
  EXPECT_EQ(target.bytes, std::vector<std::byte>(8192, std::byte{0x5A}));
  EXPECT_TRUE(drive(cli_, srv_, [&] { return cli_.conn->state() != ConnState::connected; }));
}

// Case: a WRITE that starts inside the region but runs 1 byte past its end.
// Expect: remote_access_error; not one byte of the region changes.
TEST_F(Conformance, OutOfBoundsWriteIsRemoteAccessErrorAndTargetUntouched) {
  connect_pair(cli_, srv_);
  Buffer target = Buffer::make(*server_domain_, 8192, kRemoteWrite, std::byte{0x5A});
  Buffer src = Buffer::make(*client_domain_, 4096, 0, std::byte{0x11});
  Sge s = src.sge(0, 4096);
  SendWr w{1, Opcode::write, {&s, 1}, target.mr->remote_addr(8192 - 4095), target.mr->rkey()};
  ASSERT_TRUE(cli_.conn->post_send({&w, 1}).ok());
  ASSERT_TRUE(drive(cli_, srv_, [&] { return cli_.done.size() == 1; }));
  EXPECT_EQ(cli_.done[0].status, WcStatus::remote_access_error);
  EXPECT_EQ(target.bytes, std::vector<std::byte>(8192, std::byte{0x5A}));
}

// Case: a WRITE into a region registered without REMOTE_WRITE.
// Expect: remote_access_error; target untouched.
TEST_F(Conformance, WriteWithoutRemoteWriteAccessIsRefused) {
  connect_pair(cli_, srv_);
  Buffer target = Buffer::make(*server_domain_, 4096, kLocalWrite, std::byte{0x5A});
  Buffer src = Buffer::make(*client_domain_, 4096, 0, std::byte{0x11});
  Sge s = src.sge(0, 64);
  SendWr w{1, Opcode::write, {&s, 1}, target.mr->remote_addr(0), target.mr->rkey()};
  ASSERT_TRUE(cli_.conn->post_send({&w, 1}).ok());
  ASSERT_TRUE(drive(cli_, srv_, [&] { return cli_.done.size() == 1; }));
  EXPECT_EQ(cli_.done[0].status, WcStatus::remote_access_error);
  EXPECT_EQ(target.bytes, std::vector<std::byte>(4096, std::byte{0x5A}));
}

// Case: a WRITE with the rkey of a region that has been deregistered.
// Expect: remote_access_error (a stale key reaches nothing).
TEST_F(Conformance, WriteToDeregisteredRegionIsRefused) {
  connect_pair(cli_, srv_);
  Buffer target = Buffer::make(*server_domain_, 4096, kRemoteWrite, std::byte{0x5A});
  const uint64_t addr = target.mr->remote_addr(0);
  const uint32_t rkey = target.mr->rkey();
  target.mr.reset();
  Buffer src = Buffer::make(*client_domain_, 64, 0, std::byte{0x11});
  Sge s = src.sge(0, 64);
  SendWr w{1, Opcode::write, {&s, 1}, addr, rkey};
  ASSERT_TRUE(cli_.conn->post_send({&w, 1}).ok());
  ASSERT_TRUE(drive(cli_, srv_, [&] { return cli_.done.size() == 1; }));
  EXPECT_EQ(cli_.done[0].status, WcStatus::remote_access_error);
  EXPECT_EQ(target.bytes, std::vector<std::byte>(4096, std::byte{0x5A}));
}

// Case: a SEND of 200 bytes into a RECV of 100.
// Expect: the receiver's RECV completes with local_length_error, the sender's SEND with
// remote_invalid_request.
TEST_F(Conformance, SendLargerThanRecvIsLengthError) {
  connect_pair(cli_, srv_);
  Buffer rx = Buffer::make(*server_domain_, 100, kLocalWrite);
  Buffer tx = Buffer::make(*client_domain_, 200, 0);
  Sge rs = rx.sge(0, 100);
  RecvWr r{1, {&rs, 1}};
  ASSERT_TRUE(srv_.conn->post_recv({&r, 1}).ok());
  Sge ts = tx.sge(0, 200);
  SendWr w{2, Opcode::send, {&ts, 1}};
  ASSERT_TRUE(cli_.conn->post_send({&w, 1}).ok());
  ASSERT_TRUE(drive(cli_, srv_, [&] { return cli_.done.size() == 1 && !srv_.done.empty(); }));
  if (kind_ == FabricKind::rdma && srv_.done[0].status == WcStatus::fatal_error) {
    // Soft-RoCE (rxe, Linux 6.12) takes its malformed-request path here: copy_data() returns
    // -EINVAL, so the pair is LOC_QP_OP_ERR / REM_OP_ERR. HCAs report the verbs pair below.
    // The responder's QP is in error then, and the disconnect that follows may flush the SEND
    // before its NAK is processed (seen with the guest's vCPUs starved by a second guest).
    EXPECT_TRUE(cli_.done[0].status == WcStatus::remote_operation_error ||
                cli_.done[0].status == WcStatus::flush_error)
        << to_string(cli_.done[0].status);
    return;
  }
  EXPECT_EQ(srv_.done[0].status, WcStatus::local_length_error);
  EXPECT_EQ(cli_.done[0].status, WcStatus::remote_invalid_request);
}

// Case: a SEND is posted before the peer posts any RECV.
// Expect: it waits (receiver not ready, retried forever) and completes once a RECV is posted.
TEST_F(Conformance, SendWaitsForReceiverNotReady) {
  connect_pair(cli_, srv_);
  Buffer rx = Buffer::make(*server_domain_, 64, kLocalWrite);
  Buffer tx = Buffer::make(*client_domain_, 64, 0, std::byte{0x42});
  Sge ts = tx.sge(0, 64);
  SendWr w{2, Opcode::send, {&ts, 1}};
  ASSERT_TRUE(cli_.conn->post_send({&w, 1}).ok());
  EXPECT_FALSE(drive(cli_, srv_, [&] { return !cli_.done.empty(); }, 300ms));
  Sge rs = rx.sge(0, 64);
  RecvWr r{1, {&rs, 1}};
  ASSERT_TRUE(srv_.conn->post_recv({&r, 1}).ok());
  ASSERT_TRUE(drive(cli_, srv_, [&] { return cli_.done.size() == 1 && srv_.done.size() == 1; }));
  EXPECT_TRUE(ok(cli_.done[0]));
  EXPECT_TRUE(ok(srv_.done[0]));
  EXPECT_EQ(rx.bytes, tx.bytes);
}

// Case: 101 WRITEs posted in one call on a send queue of 100, then 100, only every 10th
// signalled.
// Expect: the 101 are refused whole (ENOMEM); of the 100 exactly 10 complete; afterwards the
// whole send queue is free again.
TEST_F(Conformance, SelectiveSignallingAndSendQueueAccounting) {
  QueueCaps caps{100, 4, 1, 1};
  connect_pair(cli_, srv_, caps);
  Buffer target = Buffer::make(*server_domain_, 4096, kRemoteWrite);
  Buffer src = Buffer::make(*client_domain_, 4096, 0);
  Sge s = src.sge(0, 4096);
  std::vector<SendWr> wrs;
  for (int i = 0; i < 101; ++i)
    wrs.push_back(SendWr{static_cast<uint64_t>(i), Opcode::write, {&s, 1},
                         target.mr->remote_addr(0), target.mr->rkey(), 0, i % 10 == 9});
  EXPECT_EQ(cli_.conn->post_send(wrs).error(), errc(ENOMEM)) << "more than the send queue holds";
  wrs.pop_back();
  ASSERT_TRUE(cli_.conn->post_send(wrs).ok());
  SendWr one{999, Opcode::write, {&s, 1}, target.mr->remote_addr(0), target.mr->rkey()};
  ASSERT_TRUE(drive(cli_, srv_, [&] { return cli_.done.size() == 10; }));
  for (int i = 0; i < 10; ++i) EXPECT_EQ(cli_.done[i].wr_id, static_cast<uint64_t>(i * 10 + 9));
  EXPECT_TRUE(drive(cli_, srv_, [&] { return cli_.conn->send_queue_free() == 100u; }));
  EXPECT_TRUE(cli_.conn->post_send({&one, 1}).ok());
}

// Case: the server side of a connection goes away (its connection object is destroyed, as on
// process death) while the client has 20 RECVs posted and 10 unacknowledged SENDs outstanding
// (the server never posted RECVs for them).
// Expect: every one of the 30 requests completes with flush_error, on_disconnected fires once,
// and nothing hangs.
TEST_F(Conformance, PeerDeathFlushesEveryOutstandingRequest) {
  QueueCaps caps{32, 32, 1, 1};
  connect_pair(cli_, srv_, caps);
  Buffer rx = Buffer::make(*client_domain_, 20 * 64, kLocalWrite);
  Buffer tx = Buffer::make(*client_domain_, 64, 0);
  for (int i = 0; i < 20; ++i) {
    Sge s = rx.sge(i * 64, 64);
    RecvWr r{static_cast<uint64_t>(i), {&s, 1}};
    ASSERT_TRUE(cli_.conn->post_recv({&r, 1}).ok());
  }
  Sge ts = tx.sge(0, 64);
  for (int i = 0; i < 10; ++i) {
    SendWr w{static_cast<uint64_t>(100 + i), Opcode::send, {&ts, 1}};
    ASSERT_TRUE(cli_.conn->post_send({&w, 1}).ok());
  }
  drive(cli_, srv_, [] { return false; }, 100ms);
  srv_.conn.reset();
  ASSERT_TRUE(drive(cli_, srv_, [&] { return cli_.done.size() == 30; }, 20s))
      << "got " << cli_.done.size();
  EXPECT_EQ(cli_.count([](const Completion& c) { return c.status == WcStatus::flush_error; }), 30u);
  std::vector<uint64_t> ids;
  for (auto& c : cli_.done) ids.push_back(c.wr_id);
  std::sort(ids.begin(), ids.end());
  for (int i = 0; i < 20; ++i) EXPECT_EQ(ids[i], static_cast<uint64_t>(i));
  for (int i = 0; i < 10; ++i) EXPECT_EQ(ids[20 + i], static_cast<uint64_t>(100 + i));
  EXPECT_TRUE(drive(cli_, srv_, [&] { return cli_.disconnects.load() == 1; }, 10s));
  EXPECT_NE(cli_.conn->state(), ConnState::connected);
  EXPECT_EQ(cli_.conn->post_send({}).error(), errc(ENOTCONN));
}

// Case: the client calls disconnect() with RECVs posted on both sides.
// Expect: both sides flush their RECVs and both get on_disconnected.
TEST_F(Conformance, DisconnectFlushesBothSides) {
  connect_pair(cli_, srv_);
  Buffer crx = Buffer::make(*client_domain_, 64, kLocalWrite);
  Buffer srx = Buffer::make(*server_domain_, 64, kLocalWrite);
  Sge cs = crx.sge(0, 64), ss = srx.sge(0, 64);
  RecvWr cr{1, {&cs, 1}}, sr{2, {&ss, 1}};
  ASSERT_TRUE(cli_.conn->post_recv({&cr, 1}).ok());
  ASSERT_TRUE(srv_.conn->post_recv({&sr, 1}).ok());
  cli_.conn->disconnect();
  ASSERT_TRUE(drive(cli_, srv_, [&] { return cli_.done.size() == 1 && srv_.done.size() == 1; }, 20s));
  EXPECT_EQ(cli_.done[0].status, WcStatus::flush_error);
  EXPECT_EQ(srv_.done[0].status, WcStatus::flush_error);
  EXPECT_TRUE(drive(cli_, srv_, [&] { return cli_.disconnects == 1 && srv_.disconnects == 1; }, 20s));
}

// Case (loopback: the fault injector is its own): a 4 KiB WRITE_WITH_IMM under a
// late_completion rule of 300 ms (a CQE written that the receiver has not polled), then the
// sender breaks the connection at once.
// Expect: the bytes are in the receiver's memory and the sender's completion is a success at
// once; the receiver's CQ shows nothing for ~300 ms, the break's flush neither; then the RECV's
// completion with its immediate and length, and only after it the flush (CQ order). A heartbeat
// (zero bytes) does not match the rule's min_bytes.
TEST_F(Conformance, ALateCompletionShowsAfterItsDelayEvenPastABreak) {
  if (kind_ != FabricKind::loopback) GTEST_SKIP() << "fault injection is the loopback provider's";
  namespace lb = loopback;
  lb::faults().clear();
  QueueCaps caps{16, 16, 1, 1};
  connect_pair(cli_, srv_, caps);
  Buffer target = Buffer::make(*server_domain_, 8192, kRemoteWrite);
  Buffer src = Buffer::make(*client_domain_, 4096, 0);
  src.pattern(5);
  RecvWr r[3] = {{1, {}}, {2, {}}, {3, {}}};
  ASSERT_TRUE(srv_.conn->post_recv({r, 3}).ok());
  lb::FaultRule late;
  late.action = lb::FaultAction::late_completion;
  late.opcode = Opcode::write_with_imm;
  late.direction = lb::Direction::to_server;
  late.delay = 300ms;
  late.min_bytes = 1;  // not the heartbeat-like zero-length write first
  const uint64_t rule = lb::faults().add(late);
  SendWr hb{8, Opcode::write_with_imm, {}, 0, 0, 0x80000000u};
  ASSERT_TRUE(cli_.conn->post_send({&hb, 1}).ok());
  ASSERT_TRUE(drive(cli_, srv_, [&] { return srv_.done.size() == 1 && cli_.done.size() == 1; }));
  EXPECT_EQ(srv_.done[0].imm, 0x80000000u) << "a zero-length write passes the rule";
  Sge s = src.sge(0, 4096);
  SendWr w{9, Opcode::write_with_imm, {&s, 1}, target.mr->remote_addr(0), target.mr->rkey(), 0x1234};
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(cli_.conn->post_send({&w, 1}).ok());
  EXPECT_EQ(0, std::memcmp(target.bytes.data(), src.bytes.data(), 4096)) << "landed at once";
  ASSERT_TRUE(drive(cli_, srv_, [&] { return cli_.done.size() == 2; }));
  EXPECT_TRUE(ok(cli_.done[1])) << to_string(cli_.done[1].status);
  EXPECT_EQ(cli_.done[1].wr_id, 9u);
  cli_.conn->disconnect();
  drive(cli_, srv_, [&] { return srv_.done.size() > 1; }, 150ms);
  EXPECT_EQ(srv_.done.size(), 1u) << "nothing shows before the delay, the break's flush neither";
  ASSERT_TRUE(drive(cli_, srv_, [&] { return srv_.done.size() == 3; }, 5s));
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 290ms);
  const Completion& c = srv_.done[1];
  EXPECT_TRUE(ok(c)) << to_string(c.status);
  EXPECT_EQ(c.wr_id, 2u);
  EXPECT_EQ(c.opcode, Opcode::recv_rdma_with_imm);
  EXPECT_EQ(c.imm, 0x1234u);
  EXPECT_EQ(c.byte_len, 4096u);
  EXPECT_EQ(srv_.done[2].status, WcStatus::flush_error) << "the break's flush (RECV 3) after it";
  EXPECT_EQ(srv_.done[2].wr_id, 3u);
  EXPECT_EQ(lb::faults().hits(rule), 1u);
  lb::faults().clear();
}

// Case: 64 signalled WRITEs posted in one batch, then the CQ is polled with room for 64.
// Expect: completions come back several per poll (batching), all 64 in order.
TEST_F(Conformance, CompletionsArePolledInBatches) {
  QueueCaps caps{64, 4, 1, 1};
  connect_pair(cli_, srv_, caps);
  Buffer target = Buffer::make(*server_domain_, 64 * 512, kRemoteWrite);
  Buffer src = Buffer::make(*client_domain_, 64 * 512, 0);
  std::vector<Sge> sges;
  for (int i = 0; i < 64; ++i) sges.push_back(src.sge(i * 512, 512));
  std::vector<SendWr> wrs;
  for (int i = 0; i < 64; ++i)
    wrs.push_back(SendWr{static_cast<uint64_t>(i), Opcode::write, {&sges[i], 1},
                         target.mr->remote_addr(i * 512), target.mr->rkey()});
  ASSERT_TRUE(cli_.conn->post_send(wrs).ok());
  // Let the server place everything before the client looks.
  for (auto until = std::chrono::steady_clock::now() + 200ms; std::chrono::steady_clock::now() < until;)
    poll_once(srv_);
  size_t max_batch = 0;
  std::vector<Completion> all;
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (all.size() < 64 && std::chrono::steady_clock::now() < deadline) {
    Completion wc[64];
    size_t n = cli_.cq->poll(wc);
    max_batch = std::max(max_batch, n);
    all.insert(all.end(), wc, wc + n);
    poll_once(srv_);
  }
  ASSERT_EQ(all.size(), 64u);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(all[i].wr_id, static_cast<uint64_t>(i));
  EXPECT_GT(max_batch, 1u) << "completions should arrive in batches";
}

// Case: 8 connections, each driven by its own client thread with its own CQ, each streaming 200
// WRITE_WITH_IMMs into its own slice of one shared server region; one server thread polls one
// CQ for all 8.
// Expect: every immediate arrives once, and every slice holds its connection's bytes.
TEST_F(Conformance, ManyConnectionsInParallel) {
  constexpr int kConns = 8;
  constexpr int kPerConn = 200;
  constexpr size_t kSize = 8192;
  QueueCaps caps{32, kPerConn, 1, 1};
  Buffer target = Buffer::make(*server_domain_, kConns * kSize, kRemoteWrite);
  std::vector<std::unique_ptr<Side>> clients(kConns);
  std::vector<std::unique_ptr<Side>> server_sides(kConns);
  std::vector<Buffer> srcs(kConns);
  for (int i = 0; i < kConns; ++i) {
    clients[i] = std::make_unique<Side>();
    clients[i]->domain = client_domain_;
    auto cq = client_domain_->create_cq(256);
    ASSERT_TRUE(cq.ok());
    clients[i]->cq = std::move(cq).value();
    server_sides[i] = std::make_unique<Side>();
    server_sides[i]->domain = server_domain_;
    server_sides[i]->shared_cq = srv_.cq.get();
    connect_pair(*clients[i], *server_sides[i], caps);
    for (int k = 0; k < kPerConn; ++k) {
      RecvWr r{static_cast<uint64_t>(i), {}};
      ASSERT_TRUE(server_sides[i]->conn->post_recv({&r, 1}).ok());
    }
    srcs[i] = Buffer::make(*client_domain_, kSize, 0);
    srcs[i].pattern(static_cast<uint32_t>(i + 1));
  }
  std::atomic<bool> stop{false};
  std::vector<int> imms(kConns * kPerConn, 0);
  std::thread server([&] {
    size_t got = 0;
    Completion wc[64];
    // Polls until every immediate is in and the clients are done: acknowledgements of the last
    // writes still have to flow back after the last immediate.
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while ((!stop || got < static_cast<size_t>(kConns * kPerConn)) &&
           std::chrono::steady_clock::now() < deadline) {
      size_t n = srv_.cq->wait(wc, 10ms);
      for (size_t k = 0; k < n; ++k) {
        if (wc[k].status == WcStatus::success && wc[k].imm < imms.size()) ++imms[wc[k].imm];
      }
      got += n;
    }
  });
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int i = 0; i < kConns; ++i) {
    threads.emplace_back([&, i] {
      Side& c = *clients[i];
      Sge s = srcs[i].sge(0, kSize);
      int posted = 0, done = 0;
      auto deadline = std::chrono::steady_clock::now() + 20s;
      while (done < kPerConn && std::chrono::steady_clock::now() < deadline) {
        while (posted < kPerConn && c.conn->send_queue_free() > 0) {
          SendWr w{static_cast<uint64_t>(posted), Opcode::write_with_imm, {&s, 1},
                   target.mr->remote_addr(i * kSize), target.mr->rkey(),
                   static_cast<uint32_t>(i * kPerConn + posted)};
          if (!c.conn->post_send({&w, 1}).ok()) break;
          ++posted;
        }
        Completion wc[32];
        size_t n = c.cq->wait(wc, 5ms);
        for (size_t k = 0; k < n; ++k) {
          if (wc[k].status != WcStatus::success) failures.fetch_add(1);
        }
        done += static_cast<int>(n);
      }
      if (done != kPerConn) failures.fetch_add(1000);
    });
  }
  for (auto& t : threads) t.join();
  stop = true;
  server.join();
  EXPECT_EQ(failures.load(), 0);
  for (size_t k = 0; k < imms.size(); ++k) ASSERT_EQ(imms[k], 1) << "immediate " << k;
  for (int i = 0; i < kConns; ++i)
    EXPECT_EQ(0, std::memcmp(target.bytes.data() + i * kSize, srcs[i].bytes.data(), kSize)) << i;
  for (auto& c : clients) c->conn.reset();
  for (auto& s : server_sides) s->conn.reset();
}

// Case: the client's CQ owner posts from its poll loop, the way an IO thread answers or
// resubmits from its completion handlers: every WRITE_WITH_IMM completion it polls makes it post
// another WRITE + WRITE_WITH_IMM pair (the tcp provider defers those doorbells to the owner's
// next poll). Meanwhile a second thread streams SENDs on the same connection (those flush at
// once). A test-side lock makes the order of post_send calls the order of sequence numbers.
// Expect: the server's RECVs complete in exactly that order, each SEND's bytes in its RECV and
// each WRITE_WITH_IMM's two writes placed when its immediate is seen; the client's completions
// come in the same order, all successful; nothing is lost and the send queue drains.
TEST_F(Conformance, PostsFromThePollLoopAndAnotherThreadKeepOrder) {
  constexpr uint32_t kPairs = 800;  // from the poll loop (WRITE + WRITE_WITH_IMM)
  constexpr uint32_t kSends = 800;  // from the other thread
  constexpr uint32_t kTotal = kPairs + kSends;  // RECV-consuming messages = sequence numbers
  constexpr uint32_t kPrimed = 16;  // pairs posted before the loop starts
  constexpr size_t kA = 64, kB = 16;  // bytes of a pair's WRITE and WRITE_WITH_IMM
  QueueCaps caps{128, kTotal, 1, 1};
  connect_pair(cli_, srv_, caps);
  Buffer target = Buffer::make(*server_domain_, kTotal * (kA + kB), kRemoteWrite);
  Buffer rx = Buffer::make(*server_domain_, kTotal * 8, kLocalWrite);
  Buffer src = Buffer::make(*client_domain_, kTotal * (kA + kB + 8), 0);
  auto a_off = [&](uint32_t seq) { return size_t{seq} * kA; };
  auto b_off = [&](uint32_t seq) { return size_t{kTotal} * kA + size_t{seq} * kB; };
  auto s_off = [&](uint32_t seq) { return size_t{kTotal} * (kA + kB) + size_t{seq} * 8; };
  // Every source byte says which sequence number it belongs to.
  for (uint32_t seq = 0; seq < kTotal; ++seq) {
    for (size_t i = 0; i < kA; ++i) src.bytes[a_off(seq) + i] = std::byte(seq * 7 + i);
    for (size_t i = 0; i < kB; ++i) src.bytes[b_off(seq) + i] = std::byte(seq * 13 + i + 1);
    std::memcpy(&src.bytes[s_off(seq)], &seq, sizeof(seq));
  }
  for (uint32_t i = 0; i < kTotal; ++i) {
    Sge s = rx.sge(i * 8, 8);
    RecvWr r{i, {&s, 1}};
    ASSERT_TRUE(srv_.conn->post_recv({&r, 1}).ok());
  }

  std::mutex order_mu;  // post_send calls happen in sequence-number order
  uint32_t next_seq = 0;
  std::vector<uint32_t> pair_seqs, send_seqs;  // what each source posted, in order
  // Posts one pair; false when the send queue is full (retried later) or all pairs are out.
  auto post_pair = [&]() -> bool {
    std::lock_guard lock(order_mu);
    if (pair_seqs.size() == kPairs) return false;
    const uint32_t seq = next_seq;
    Sge sa = src.sge(a_off(seq), kA), sb = src.sge(b_off(seq), kB);
    SendWr wrs[2] = {
        SendWr{~uint64_t{0}, Opcode::write, {&sa, 1}, target.mr->remote_addr(a_off(seq)),
               target.mr->rkey(), 0, false},
        SendWr{seq, Opcode::write_with_imm, {&sb, 1}, target.mr->remote_addr(b_off(seq)),
               target.mr->rkey(), seq, true}};
    if (!cli_.conn->post_send(wrs).ok()) return false;
    pair_seqs.push_back(seq);
    ++next_seq;
    return true;
  };
  for (uint32_t i = 0; i < kPrimed; ++i) ASSERT_TRUE(post_pair());

  std::atomic<bool> sender_failed{false};
  std::thread sender([&] {
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (std::chrono::steady_clock::now() < deadline) {
      {
        std::lock_guard lock(order_mu);
        if (send_seqs.size() == kSends) return;
        const uint32_t seq = next_seq;
        Sge s = src.sge(s_off(seq), 8);
        SendWr w{seq, Opcode::send, {&s, 1}};
        auto st = cli_.conn->post_send({&w, 1});
        if (st.ok()) {
          send_seqs.push_back(seq);
          ++next_seq;
          continue;
        }
        if (st.error() != errc(ENOMEM)) {
          sender_failed = true;
          return;
        }
      }
      std::this_thread::yield();  // send queue full: the poll loop frees it
    }
    sender_failed = true;
  });

  // The poll loop: one thread owns both CQs, as the harness's drive() does.
  std::vector<Completion> cdone, sdone;
  uint32_t owed = 0;  // pairs earned by completions but refused for a full send queue
  bool placed_in_time = true;
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while ((sdone.size() < kTotal || cdone.size() < kTotal) &&
         std::chrono::steady_clock::now() < deadline) {
    Completion wc[32];
    size_t n = cli_.queue().poll(wc);
    for (size_t i = 0; i < n; ++i) {
      cdone.push_back(wc[i]);
      if (wc[i].status == WcStatus::success && wc[i].opcode == Opcode::write_with_imm) ++owed;
    }
    while (owed > 0 && post_pair()) --owed;  // right after poll(): inside the owner's batch
    n = srv_.queue().poll(wc);
    for (size_t i = 0; i < n; ++i) {
      const Completion& c = wc[i];
      sdone.push_back(c);
      // A WRITE_WITH_IMM's writes are placed before its immediate is delivered: look now,
      // before any later message could matter.
      if (c.status == WcStatus::success && c.opcode == Opcode::recv_rdma_with_imm &&
          c.imm < kTotal) {
        placed_in_time = placed_in_time &&
            std::memcmp(&target.bytes[a_off(c.imm)], &src.bytes[a_off(c.imm)], kA) == 0 &&
            std::memcmp(&target.bytes[b_off(c.imm)], &src.bytes[b_off(c.imm)], kB) == 0;
      }
    }
  }
  sender.join();
  EXPECT_FALSE(sender_failed.load());
  ASSERT_EQ(pair_seqs.size(), kPairs);
  ASSERT_EQ(send_seqs.size(), kSends);
  ASSERT_EQ(sdone.size(), kTotal);
  ASSERT_EQ(cdone.size(), kTotal) << "unsignalled WRITEs raise nothing, everything else one each";
  EXPECT_TRUE(placed_in_time) << "a WRITE_WITH_IMM was delivered before the writes of its pair";
  std::vector<bool> is_send(kTotal, false);
  for (uint32_t seq : send_seqs) is_send[seq] = true;
  for (uint32_t seq = 0; seq < kTotal; ++seq) {
    const Completion& r = sdone[seq];
    ASSERT_TRUE(ok(r)) << seq << " " << to_string(r.status);
    EXPECT_EQ(r.wr_id, seq) << "RECVs complete in posting order";
    if (is_send[seq]) {
      ASSERT_EQ(r.opcode, Opcode::recv) << seq;
      EXPECT_EQ(r.byte_len, 8u);
      uint32_t got = 0;
      std::memcpy(&got, &rx.bytes[seq * 8], sizeof(got));
      EXPECT_EQ(got, seq) << "message " << seq << " arrived out of order";
    } else {
      ASSERT_EQ(r.opcode, Opcode::recv_rdma_with_imm) << seq;
      EXPECT_EQ(r.imm, seq) << "message " << seq << " arrived out of order";
      EXPECT_EQ(r.byte_len, kB);
    }
    const Completion& c = cdone[seq];
    ASSERT_TRUE(ok(c)) << seq << " " << to_string(c.status);
    EXPECT_EQ(c.wr_id, seq) << "send completions in posting order";
    EXPECT_EQ(c.opcode, is_send[seq] ? Opcode::send : Opcode::write_with_imm) << seq;
  }
  EXPECT_TRUE(drive(cli_, srv_, [&] { return cli_.conn->send_queue_free() == 128u; }));
}

// Case: the server sleeps on its CQ's fd (arm, poll again, wait for readability) while the
// client sends one SEND from another thread.
// Expect: the fd becomes readable and the RECV completion is there after ack_events().
TEST_F(Conformance, CompletionFdWakesAnEventDrivenOwner) {
  connect_pair(cli_, srv_);
  Buffer rx = Buffer::make(*server_domain_, 64, kLocalWrite);
  Buffer tx = Buffer::make(*client_domain_, 64, 0, std::byte{9});
  Sge rs = rx.sge(0, 64);
  RecvWr r{1, {&rs, 1}};
  ASSERT_TRUE(srv_.conn->post_recv({&r, 1}).ok());
  std::atomic<bool> stop{false};
  std::thread client([&] {
    std::this_thread::sleep_for(50ms);
    Sge ts = tx.sge(0, 64);
    SendWr w{2, Opcode::send, {&ts, 1}};
    EXPECT_TRUE(cli_.conn->post_send({&w, 1}).ok());
    while (!stop) poll_once(cli_);  // the client's CQ owner keeps polling for its ack
  });
  std::vector<Completion> got;
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (got.empty() && std::chrono::steady_clock::now() < deadline) {
    Completion wc[8];
    ASSERT_TRUE(srv_.cq->arm().ok());
    size_t n = srv_.cq->poll(wc);  // closes the race between the last poll and arm()
    if (n == 0) {
      pollfd pfd{srv_.cq->fd(), POLLIN, 0};
      if (::poll(&pfd, 1, 1000) > 0) srv_.cq->ack_events();
      n = srv_.cq->poll(wc);
    }
    got.insert(got.end(), wc, wc + n);
  }
  stop = true;
  client.join();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_TRUE(ok(got[0]));
  EXPECT_EQ(rx.bytes, tx.bytes);
}

// Case: the server arms its CQ, a completion arrives and is polled (its notification is left
// unread), then the server waits 300 ms with nothing else coming.
// Expect: wait() returns 0 only once the 300 ms are over — a stale notification is not a result.
TEST_F(Conformance, WaitReturnsNothingOnlyAfterItsTimeout) {
  connect_pair(cli_, srv_);
  RecvWr r{1, {}};
  ASSERT_TRUE(srv_.conn->post_recv({&r, 1}).ok());
  ASSERT_TRUE(srv_.cq->arm().ok());
  SendWr w{2, Opcode::write_with_imm, {}, 0, 0, 7};
  ASSERT_TRUE(cli_.conn->post_send({&w, 1}).ok());
  ASSERT_TRUE(drive(cli_, srv_, [&] { return srv_.done.size() == 1 && cli_.done.size() == 1; }));
  std::this_thread::sleep_for(20ms);
  Completion wc[4];
  auto t0 = std::chrono::steady_clock::now();
  size_t n = srv_.cq->wait(wc, 300ms);
  auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(n, 0u);
  EXPECT_GE(waited, 280ms);
}

// Case: a RECV scattered over three SGEs receives one SEND.
// Expect: the bytes fill the SGEs in order.
TEST_F(Conformance, RecvScattersOverSges) {
  QueueCaps caps{4, 4, 1, 3};
  connect_pair(cli_, srv_, caps);
  Buffer rx = Buffer::make(*server_domain_, 300, kLocalWrite);
  Buffer tx = Buffer::make(*client_domain_, 250, 0);
  tx.pattern(3);
  Sge rs[3] = {rx.sge(0, 10), rx.sge(100, 100), rx.sge(250, 50)};
  RecvWr r{1, rs};
  ASSERT_TRUE(srv_.conn->post_recv({&r, 1}).ok());
  Sge ts = tx.sge(0, 150);
  SendWr w{2, Opcode::send, {&ts, 1}};
  ASSERT_TRUE(cli_.conn->post_send({&w, 1}).ok());
  ASSERT_TRUE(drive(cli_, srv_, [&] { return srv_.done.size() == 1; }));
  ASSERT_TRUE(ok(srv_.done[0]));
  EXPECT_EQ(srv_.done[0].byte_len, 150u);
  EXPECT_EQ(0, std::memcmp(rx.bytes.data(), tx.bytes.data(), 10));
  EXPECT_EQ(0, std::memcmp(rx.bytes.data() + 100, tx.bytes.data() + 10, 100));
  EXPECT_EQ(0, std::memcmp(rx.bytes.data() + 250, tx.bytes.data() + 110, 40));
}

// ----- Protection domains, keys and windows ---------------------------------------------------

// Tells the client something over the server's connection (a zero-length WRITE_WITH_IMM it must
// receive): what makes a bind posted before it visible to the client's requests, as a key sent
// in a later message is on every provider.
bool tell(Side& from, Side& to, const std::function<bool(Side&, Side&)>& drive2) {
  RecvWr r{4242, {}};
  if (!to.conn->post_recv({&r, 1}).ok()) return false;
  SendWr w{4243, Opcode::write_with_imm, {}, 0, 0, 1};
  if (!from.conn->post_send({&w, 1}).ok()) return false;
  return drive2(from, to);
}

class Isolation : public FabricTest {
 protected:
  // Connects cli_ to srv_ accepted into `pd` (null: the server's device domain), replacing any
  // earlier pair and forgetting its completions.
  void pair_in(Domain* pd, const QueueCaps& caps = {}) {
    cli_.conn.reset();
    srv_.conn.reset();
    Completion wc[64];
    for (int i = 0; i < 3; ++i) {
      while (cli_.cq->poll(wc) > 0) {
      }
      while (srv_.cq->poll(wc) > 0) {
      }
    }
    cli_.done.clear();
    srv_.done.clear();
    srv_.accept_pd = pd;
    connect_pair(cli_, srv_, caps);
  }
  // One WRITE of src[0, len) to (addr, rkey) from the client; its completion status.
  WcStatus write(const Buffer& src, size_t len, uint64_t addr, uint32_t rkey) {
    const size_t before = cli_.done.size();
    const uint64_t id = 9000 + before;
    Sge sg = src.sge(0, len);
    SendWr w{id, Opcode::write, {&sg, 1}, addr, rkey};
    if (!cli_.conn->post_send({&w, 1}).ok()) return WcStatus::fatal_error;
    if (!drive(cli_, srv_, [&] { return cli_.done.size() > before; })) return WcStatus::fatal_error;
    return cli_.done[before].status;
  }
  // A write of src[0, len) to (addr, rkey) is refused and `target` keeps all its bytes `fill`.
  void expect_refused(const Buffer& src, size_t len, uint64_t addr, uint32_t rkey,
                      const Buffer& target, std::byte fill = std::byte{0x5A}) {
    EXPECT_EQ(write(src, len, addr, rkey), WcStatus::remote_access_error);
    EXPECT_EQ(target.bytes, std::vector<std::byte>(target.bytes.size(), fill));
  }
  // The server tells the client (see tell()).
  bool server_tells_client() {
    const size_t before = cli_.done.size();
    return tell(srv_, cli_, [&](Side&, Side&) {
      return drive(cli_, srv_, [&] {
        for (size_t i = before; i < cli_.done.size(); ++i)
          if (cli_.done[i].wr_id == 4242) return true;
        return false;
      });
    });
  }
  // Revokes `mw` on the server's connection, waiting for the revocation where it is
  // asynchronous (rdma's LOCAL_INV).
  void revoke(MemoryWindow& mw) {
    auto r = srv_.conn->invalidate_mw(mw, 7777);
    ASSERT_TRUE(r.ok()) << r.error().message();
    if (*r) return;
    ASSERT_TRUE(drive(cli_, srv_, [&] {
      return srv_.count([](const Completion& c) { return c.wr_id == 7777; }) == 1;
    }));
    for (const auto& c : srv_.done) {
      if (c.wr_id != 7777) continue;
      EXPECT_EQ(c.status, WcStatus::success);
      EXPECT_EQ(c.opcode, Opcode::local_inv);
    }
  }
  // A window of `pd`, or a skip when the device has none.
  std::unique_ptr<MemoryWindow> window(Domain& pd) {
    auto mw = pd.alloc_mw();
    if (!mw.ok() && mw.error() == errc(ENOTSUP)) return nullptr;
    EXPECT_TRUE(mw.ok()) << mw.error().message();
    return mw.ok() ? std::move(mw).value() : nullptr;
  }
  // A new domain on d's device, kept until after the connections are gone (a domain must
  // outlive what was created in it: TearDown drops the connections, then the fixture dies).
  Domain* pd(Domain& d, uint32_t max_keys = 0) {
    auto r = d.alloc_pd(PdAttr{max_keys});
    EXPECT_TRUE(r.ok()) << r.error().message();
    if (!r.ok()) return nullptr;
    pds_.push_back(std::move(r).value());
    return pds_.back().get();
  }
  // A domain of the server's device with a 4 KiB region for windows (kMwBind, 0x5A), a client
  // source of `src_len` bytes of 0x11, and a window; false when the device has no windows.
  struct WindowRig {
    Domain* d = nullptr;
    Buffer target, src;
    std::unique_ptr<MemoryWindow> mw;  // last: a window goes before its region
  };
  bool window_rig(WindowRig& r, size_t src_len = 64) {
    r.d = pd(*server_domain_);
    if (r.d == nullptr) return false;
    r.target = Buffer::make(*r.d, 4096, kLocalWrite | kMwBind, std::byte{0x5A});
    r.src = Buffer::make(*client_domain_, src_len, 0, std::byte{0x11});
    r.mw = window(*r.d);
    return r.mw != nullptr;
  }
  std::vector<std::unique_ptr<Domain>> pds_;
};

#define SKIP_WITHOUT_WINDOWS(ok)                                                           \
  if (!(ok)) GTEST_SKIP() << "the device has no type 2 memory windows (alloc_mw: ENOTSUP)"

// Case: the server allocates protection domains A and B on its device and registers a region in
// A and one in its device domain; the client's connection is accepted into B and writes to each
// with its valid key.
// Expect: remote_access_error every time, the connection breaks, the targets are untouched. The
// same write on a connection accepted into A lands.
TEST_F(Isolation, AKeyOfAnotherDomainIsRemoteAccessErrorAndTargetUntouched) {
  auto a = pd(*server_domain_), b = pd(*server_domain_);
  ASSERT_TRUE(a && b);
  Buffer in_a = Buffer::make(*a, 4096, kRemoteWrite, std::byte{0x5A});
  Buffer in_dev = Buffer::make(*server_domain_, 4096, kRemoteWrite, std::byte{0x5A});
  Buffer src = Buffer::make(*client_domain_, 4096, 0, std::byte{0x11});
  for (Buffer* target : {&in_a, &in_dev}) {
    pair_in(b);
    EXPECT_EQ(write(src, 4096, target->mr->remote_addr(0), target->mr->rkey()),
              WcStatus::remote_access_error);
    EXPECT_TRUE(drive(cli_, srv_, [&] { return cli_.conn->state() != ConnState::connected; }));
    EXPECT_EQ(target->bytes, std::vector<std::byte>(4096, std::byte{0x5A}));
  }
  pair_in(a);
  EXPECT_EQ(write(src, 4096, in_a.mr->remote_addr(0), in_a.mr->rkey()), WcStatus::success);
  EXPECT_EQ(in_a.bytes, src.bytes);
  // The device domain's region is still out of reach from A.
  EXPECT_EQ(write(src, 4096, in_dev.mr->remote_addr(0), in_dev.mr->rkey()),
            WcStatus::remote_access_error);
  EXPECT_EQ(in_dev.bytes, std::vector<std::byte>(4096, std::byte{0x5A}));
}

// Case: two domains of one device and one CQ (made on the device's domain) on each side; a
// connection accepted into each domain; each gets a WRITE into its own domain's region and a
// SEND.
// Expect: both WRITEs land and both SENDs arrive, all through the shared CQs.
TEST_F(Isolation, DomainsOfOneDeviceShareACompletionQueue) {
  auto a = pd(*server_domain_), b = pd(*server_domain_);
  ASSERT_TRUE(a && b);
  Side c[2], s[2];
  Domain* pds[2] = {a, b};
  std::vector<Buffer> targets, rx;
  Buffer src = Buffer::make(*client_domain_, 1024, 0);
  src.pattern(5);
  for (int i = 0; i < 2; ++i) {
    c[i].domain = client_domain_;
    c[i].shared_cq = cli_.cq.get();
    s[i].domain = server_domain_;
    s[i].shared_cq = srv_.cq.get();
    s[i].accept_pd = pds[i];
    connect_pair(c[i], s[i]);
    targets.push_back(Buffer::make(*pds[i], 1024, kRemoteWrite));
    rx.push_back(Buffer::make(*pds[i], 64, kLocalWrite));
  }
  for (int i = 0; i < 2; ++i) {
    Sge rs = rx[i].sge(0, 64);
    RecvWr r{static_cast<uint64_t>(10 + i), {&rs, 1}};
    ASSERT_TRUE(s[i].conn->post_recv({&r, 1}).ok());
    Sge ws = src.sge(0, 1024), ss = src.sge(0, 64);
    SendWr w[2] = {SendWr{static_cast<uint64_t>(20 + i), Opcode::write, {&ws, 1},
                          targets[i].mr->remote_addr(0), targets[i].mr->rkey()},
                   SendWr{static_cast<uint64_t>(30 + i), Opcode::send, {&ss, 1}}};
    ASSERT_TRUE(c[i].conn->post_send(w).ok());
  }
  std::vector<Completion> sdone, cdone;
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while ((sdone.size() < 2 || cdone.size() < 4) && std::chrono::steady_clock::now() < deadline) {
    Completion wc[16];
    size_t n = srv_.cq->poll(wc);
    sdone.insert(sdone.end(), wc, wc + n);
    n = cli_.cq->poll(wc);
    cdone.insert(cdone.end(), wc, wc + n);
  }
  ASSERT_EQ(sdone.size(), 2u);
  ASSERT_EQ(cdone.size(), 4u);
  for (const auto& wc : sdone) EXPECT_TRUE(ok(wc)) << to_string(wc.status);
  for (const auto& wc : cdone) EXPECT_TRUE(ok(wc)) << to_string(wc.status);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(targets[i].bytes, src.bytes) << i;
    EXPECT_EQ(0, std::memcmp(rx[i].bytes.data(), src.bytes.data(), 64)) << i;
  }
}

// Case: a connection request accepted into a domain of another device (the client's fabric),
// then into a domain allocated on its own device.
// Expect: EINVAL first; the second accept connects.
TEST_F(Isolation, AcceptIntoADomainOfAnotherDeviceIsRefused) {
  auto mine = pd(*server_domain_);
  ASSERT_TRUE(mine);
  auto accepted = std::async(std::launch::async, [&]() -> Result<std::unique_ptr<Connection>> {
    auto req = listener_->get_request(10s);
    if (!req) return req.error();
    auto wrong = (*req)->accept(*client_domain_, *srv_.cq, {}, {}, srv_.events());
    EXPECT_FALSE(wrong.ok());
    if (!wrong.ok()) {
      EXPECT_EQ(wrong.error(), errc(EINVAL));
    }
    return (*req)->accept(*mine, *srv_.cq, {}, {}, srv_.events());
  });
  ConnectParams p;
  p.remote = listener_->address();
  p.source = ep_.client_source ? &*ep_.client_source : nullptr;
  p.cq = cli_.cq.get();
  p.events = cli_.events();
  p.timeout = 10s;
  with_tested_tls(p);
  auto c = client_domain_->connect(p);
  auto s = accepted.get();
  ASSERT_TRUE(c.ok()) << c.error().message();
  ASSERT_TRUE(s.ok()) << s.error().message();
  cli_.conn = std::move(c->connection);
  srv_.conn = std::move(s).value();
}

// Case: the client SENDs from a region of another domain of its own device than the
// connection's.
// Expect: the post fails with EINVAL, or the SEND completes with local_protection_error (or the
// connection breaks with it); the server's RECV never completes with the bytes.
TEST_F(Isolation, ALocalSgeOfAnotherDomainIsRefused) {
  pair_in(nullptr);
  auto other = pd(*client_domain_);
  ASSERT_TRUE(other);
  Buffer tx = Buffer::make(*other, 256, 0, std::byte{0x33});
  Buffer rx = Buffer::make(*server_domain_, 256, kLocalWrite, std::byte{0});
  Sge rs = rx.sge(0, 256);
  RecvWr r{1, {&rs, 1}};
  ASSERT_TRUE(srv_.conn->post_recv({&r, 1}).ok());
  Sge ts = tx.sge(0, 256);
  SendWr w{2, Opcode::send, {&ts, 1}};
  auto st = cli_.conn->post_send({&w, 1});
  if (st.ok()) {
    ASSERT_TRUE(drive(cli_, srv_, [&] { return cli_.done.size() == 1; }));
    EXPECT_NE(cli_.done[0].status, WcStatus::success);
  } else {
    EXPECT_EQ(st.error(), errc(EINVAL));
  }
  drive(cli_, srv_, [] { return false; }, 100ms);
  EXPECT_EQ(srv_.count([](const Completion& c) { return c.status == WcStatus::success; }), 0u);
  EXPECT_EQ(rx.bytes, std::vector<std::byte>(256, std::byte{0}));
}

// Case: a domain allocated with max_keys 4 gets four registrations (a window, where the device
// has them, counts as one), then one more.
// Expect: the fifth is ENOMEM; once one is freed a registration succeeds again; the device's
// domain is not limited by it.
TEST_F(Isolation, ADomainHoldsAtMostItsMaxKeys) {
  auto small = pd(*server_domain_, 4);
  ASSERT_TRUE(small);
  std::vector<std::byte> mem(4096);
  std::vector<std::unique_ptr<MemoryRegion>> mrs;
  auto mw = window(*small);
  const int regions = mw ? 3 : 4;
  for (int i = 0; i < regions; ++i) {
    auto r = small->register_memory(mem.data() + i * 512, 512, kRemoteWrite);
    ASSERT_TRUE(r.ok()) << i << ": " << r.error().message();
    mrs.push_back(std::move(r).value());
  }
  auto over = small->register_memory(mem.data(), 64, kRemoteWrite);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.error(), errc(ENOMEM));
  if (mw) {
    auto over_mw = small->alloc_mw();
    ASSERT_FALSE(over_mw.ok());
    EXPECT_EQ(over_mw.error(), errc(ENOMEM));
  }
  mrs.pop_back();
  EXPECT_TRUE(small->register_memory(mem.data(), 64, kRemoteWrite).ok());
  auto dev = server_domain_->register_memory(mem.data(), 64, kRemoteWrite);
  EXPECT_TRUE(dev.ok());
}

// Case: one buffer registered 64 times in turn, each registration dropped before the next.
// Expect: no key repeats the one before it, hardly any repeats at all (random bits: at least 8
// of them, so 64 draws of one slot repeat a few times at worst), and no fixed step from one to
// the next: a peer that saw a key cannot compute the next one.
TEST_F(Isolation, KeysAreNotASequence) {
  auto d = pd(*server_domain_);
  ASSERT_TRUE(d);
  std::vector<std::byte> mem(4096);
  std::vector<uint32_t> keys;
  for (int i = 0; i < 64; ++i) {
    auto r = d->register_memory(mem.data(), mem.size(), kRemoteWrite);
    ASSERT_TRUE(r.ok());
    keys.push_back((*r)->rkey());
  }
  std::set<uint32_t> distinct(keys.begin(), keys.end());
  EXPECT_GE(distinct.size(), 48u);
  for (size_t i = 1; i < keys.size(); ++i) EXPECT_NE(keys[i], keys[i - 1]) << i;
  std::set<uint32_t> steps;
  for (size_t i = 1; i < keys.size(); ++i) steps.insert(keys[i] - keys[i - 1]);
  EXPECT_GT(steps.size(), 8u) << "consecutive keys differ by a handful of fixed steps";
}

// Case: the server binds a window over 1 KiB in the middle of a 4 KiB region (kMwBind), tells
// the client, and the client writes into the window, then one byte before it, on a fresh
// connection with a fresh window, then one byte past its end.
// Expect: the first write lands exactly; the others are remote_access_error and change nothing.
TEST_F(Isolation, AWindowOpensOnlyItsRange) {
  auto d = pd(*server_domain_);
  ASSERT_TRUE(d);
  Buffer target = Buffer::make(*d, 4096, kLocalWrite | kMwBind, std::byte{0x5A});
  Buffer src = Buffer::make(*client_domain_, 1024, 0);
  auto mw = window(*d);
  SKIP_WITHOUT_WINDOWS(mw);
  src.pattern(9);
  for (int round = 0; round < 3; ++round) {
    pair_in(d);
    if (round > 0) mw = window(*d);
    auto key = srv_.conn->bind_mw(*mw, *target.mr, target.mr->remote_addr(1024), 1024,
                                  kRemoteWrite);
    ASSERT_TRUE(key.ok()) << key.error().message();
    EXPECT_EQ(mw->rkey(), *key);
    ASSERT_TRUE(server_tells_client());
    auto before = target.bytes;
    if (round == 0) {
      ASSERT_EQ(write(src, 1024, target.mr->remote_addr(1024), *key), WcStatus::success);
      EXPECT_EQ(0, std::memcmp(target.bytes.data() + 1024, src.bytes.data(), 1024));
      EXPECT_EQ(target.bytes[1023], std::byte{0x5A});
      EXPECT_EQ(target.bytes[2048], std::byte{0x5A});
    } else if (kind_ == FabricKind::rdma && srv_.conn->device_name().rfind("rxe", 0) == 0) {
      // Soft-RoCE checks an access through a window against the window's region, not the
      // window (measured on Debian's 6.12: a write one byte before the window lands): the
      // window's key and its connection are enforced, its range is not.
      std::printf("note: %s does not enforce window ranges; not checked here\n",
                  srv_.conn->device_name().c_str());
    } else {
      const uint64_t at = round == 1 ? target.mr->remote_addr(1023) : target.mr->remote_addr(2047);
      EXPECT_EQ(write(src, 2, at, *key), WcStatus::remote_access_error);
      EXPECT_EQ(target.bytes, before);
    }
    mw.reset();
  }
}

// Case: a window bound and used; the server revokes it (waiting for the local_inv completion
// where the provider makes the revocation asynchronous); the client writes with the key again.
// Expect: remote_access_error and the memory is untouched after the revocation.
TEST_F(Isolation, ARevokedWindowReachesNothing) {
  WindowRig r;
  SKIP_WITHOUT_WINDOWS(window_rig(r, 4096));
  auto& [d, target, src, mw] = r;
  pair_in(d);
  auto key = srv_.conn->bind_mw(*mw, *target.mr, target.mr->remote_addr(0), 4096, kRemoteWrite);
  ASSERT_TRUE(key.ok()) << key.error().message();
  ASSERT_TRUE(server_tells_client());
  ASSERT_EQ(write(src, 64, target.mr->remote_addr(0), *key), WcStatus::success);
  revoke(*mw);
  std::fill(target.bytes.begin(), target.bytes.end(), std::byte{0x5A});
  ASSERT_TRUE(server_tells_client());
  expect_refused(src, 4096, target.mr->remote_addr(0), *key, target);
}

// Case: two connections accepted into one domain; a window bound on the first; the client
// writes with its key on the second.
// Expect: remote_access_error: a window answers only the connection it was bound on; the first
// connection still writes through it.
TEST_F(Isolation, AWindowAnswersOnlyTheConnectionItWasBoundOn) {
  auto d = pd(*server_domain_);
  ASSERT_TRUE(d);
  pair_in(d);
  Side c2, s2;
  c2.domain = client_domain_;
  c2.shared_cq = cli_.cq.get();
  s2.domain = server_domain_;
  s2.shared_cq = srv_.cq.get();
  s2.accept_pd = d;
  connect_pair(c2, s2);
  Buffer target = Buffer::make(*d, 4096, kLocalWrite | kMwBind, std::byte{0x5A});
  Buffer src = Buffer::make(*client_domain_, 64, 0, std::byte{0x11});
  auto mw = window(*d);
  SKIP_WITHOUT_WINDOWS(mw);
  auto key = srv_.conn->bind_mw(*mw, *target.mr, target.mr->remote_addr(0), 4096, kRemoteWrite);
  ASSERT_TRUE(key.ok()) << key.error().message();
  ASSERT_TRUE(server_tells_client());
  Sge sg = src.sge(0, 64);
  SendWr w{55, Opcode::write, {&sg, 1}, target.mr->remote_addr(0), *key};
  ASSERT_TRUE(c2.conn->post_send({&w, 1}).ok());
  ASSERT_TRUE(drive(c2, s2, [&] { return !c2.done.empty(); }));
  EXPECT_EQ(c2.done[0].status, WcStatus::remote_access_error);
  EXPECT_EQ(target.bytes, std::vector<std::byte>(4096, std::byte{0x5A}));
  // cli_ and c2 share the client CQ: what drive(c2, ...) polled is in c2.done.
  SendWr w1{56, Opcode::write, {&sg, 1}, target.mr->remote_addr(0), *key};
  ASSERT_TRUE(cli_.conn->post_send({&w1, 1}).ok());
  ASSERT_TRUE(drive(cli_, srv_, [&] {
    return cli_.count([](const Completion& c) { return c.wr_id == 56; }) +
               c2.count([](const Completion& c) { return c.wr_id == 56; }) ==
           1;
  }));
  for (auto* side : {&cli_, &c2}) {
    for (const auto& c : side->done) {
      if (c.wr_id == 56) {
        EXPECT_EQ(c.status, WcStatus::success);
      }
    }
  }
  EXPECT_EQ(target.bytes[0], std::byte{0x11});
}

// Case: bind, revoke, bind again over the same range.
// Expect: each bind gives a new key; the old key reaches nothing; the new one works.
TEST_F(Isolation, ARebindGivesAFreshKey) {
  WindowRig r;
  SKIP_WITHOUT_WINDOWS(window_rig(r));
  auto& [d, target, src, mw] = r;
  pair_in(d);
  auto k1 = srv_.conn->bind_mw(*mw, *target.mr, target.mr->remote_addr(0), 4096, kRemoteWrite);
  ASSERT_TRUE(k1.ok()) << k1.error().message();
  revoke(*mw);
  auto k2 = srv_.conn->bind_mw(*mw, *target.mr, target.mr->remote_addr(0), 4096, kRemoteWrite);
  ASSERT_TRUE(k2.ok()) << k2.error().message();
  EXPECT_NE(*k1, *k2);
  ASSERT_TRUE(server_tells_client());
  EXPECT_EQ(write(src, 64, target.mr->remote_addr(0), *k2), WcStatus::success);
  EXPECT_EQ(target.bytes[0], std::byte{0x11});
  std::fill(target.bytes.begin(), target.bytes.end(), std::byte{0x5A});
  expect_refused(src, 64, target.mr->remote_addr(0), *k1, target);
}

// Case: binds verbs refuses: over a region without kMwBind, past the region's end, of zero
// length, with local access, of a window already bound, of another domain's region.
// Expect: EINVAL each; the connection stays connected and a valid bind still works.
TEST_F(Isolation, BadBindsAreRefused) {
  auto d = pd(*server_domain_);
  ASSERT_TRUE(d);
  pair_in(d);
  Buffer plain = Buffer::make(*d, 4096, kLocalWrite | kRemoteWrite);
  Buffer bindable = Buffer::make(*d, 4096, kLocalWrite | kMwBind);
  Buffer foreign = Buffer::make(*server_domain_, 4096, kLocalWrite | kMwBind);
  const uint64_t base = bindable.mr->remote_addr(0);
  auto mw = window(*d);
  SKIP_WITHOUT_WINDOWS(mw);
  Connection& c = *srv_.conn;
  EXPECT_EQ(c.bind_mw(*mw, *plain.mr, plain.mr->remote_addr(0), 64, kRemoteWrite).error(),
            errc(EINVAL));
  EXPECT_EQ(c.bind_mw(*mw, *bindable.mr, base + 4000, 97, kRemoteWrite).error(), errc(EINVAL));
  EXPECT_EQ(c.bind_mw(*mw, *bindable.mr, base, 0, kRemoteWrite).error(), errc(EINVAL));
  EXPECT_EQ(c.bind_mw(*mw, *bindable.mr, base, 64, kLocalWrite).error(), errc(EINVAL));
  EXPECT_EQ(c.bind_mw(*mw, *foreign.mr, foreign.mr->remote_addr(0), 64, kRemoteWrite).error(),
            errc(EINVAL));
  ASSERT_TRUE(c.bind_mw(*mw, *bindable.mr, base, 64, kRemoteWrite).ok());
  EXPECT_EQ(c.bind_mw(*mw, *bindable.mr, base, 64, kRemoteWrite).error(), errc(EINVAL));
  EXPECT_EQ(c.state(), ConnState::connected);
}

// Case: a window bound on a connection that then breaks (the peer goes away); the owner
// revokes it afterwards and binds it again on a new connection.
// Expect: the revocation is done on return (true); the new binding works.
TEST_F(Isolation, AWindowOfABrokenConnectionIsRevokedAtOnce) {
  WindowRig r;
  SKIP_WITHOUT_WINDOWS(window_rig(r));
  auto& [d, target, src, mw] = r;
  pair_in(d);
  ASSERT_TRUE(srv_.conn->bind_mw(*mw, *target.mr, target.mr->remote_addr(0), 4096, kRemoteWrite).ok());
  cli_.conn.reset();
  ASSERT_TRUE(drive(cli_, srv_, [&] { return srv_.conn->state() != ConnState::connected; }, 20s));
  auto done = srv_.conn->invalidate_mw(*mw, 1);
  ASSERT_TRUE(done.ok()) << done.error().message();
  EXPECT_TRUE(*done);
  pair_in(d);
  auto key = srv_.conn->bind_mw(*mw, *target.mr, target.mr->remote_addr(0), 4096, kRemoteWrite);
  ASSERT_TRUE(key.ok()) << key.error().message();
  ASSERT_TRUE(server_tells_client());
  EXPECT_EQ(write(src, 64, target.mr->remote_addr(0), *key), WcStatus::success);
  EXPECT_EQ(target.bytes[0], std::byte{0x11});
}

// Case: a region written through its key; revoke(); the same write; rekey(); the old key; the
// new key; revoke() and restore(); the key restore() returned (a refused write breaks its
// connection, so each runs on a fresh one).
// Expect: success, remote_access_error, remote_access_error, success, success; refused writes
// change nothing.
TEST_F(Isolation, RevokeAndRekeyMoveARegionsKey) {
  auto d = pd(*server_domain_);
  ASSERT_TRUE(d);
  Buffer target = Buffer::make(*d, 4096, kRemoteWrite, std::byte{0x5A});
  Buffer src = Buffer::make(*client_domain_, 64, 0, std::byte{0x11});
  const uint64_t at = target.mr->remote_addr(0);
  const uint32_t old_key = target.mr->rkey();
  pair_in(d);
  EXPECT_EQ(write(src, 64, at, old_key), WcStatus::success);
  std::fill(target.bytes.begin(), target.bytes.end(), std::byte{0x5A});
  ASSERT_TRUE(target.mr->revoke().ok());
  expect_refused(src, 64, at, old_key, target);
  auto new_key = target.mr->rekey();
  ASSERT_TRUE(new_key.ok()) << new_key.error().message();
  EXPECT_NE(*new_key, old_key);
  EXPECT_EQ(target.mr->rkey(), *new_key);
  pair_in(d);
  expect_refused(src, 64, at, old_key, target);
  pair_in(d);
  EXPECT_EQ(write(src, 64, at, *new_key), WcStatus::success);
  EXPECT_EQ(target.bytes[0], std::byte{0x11});
  ASSERT_TRUE(target.mr->revoke().ok());
  auto back = target.mr->restore();
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_EQ(target.mr->rkey(), *back);
  target.bytes[0] = std::byte{0x5A};
  EXPECT_EQ(write(src, 64, at, *back), WcStatus::success);
  EXPECT_EQ(target.bytes[0], std::byte{0x11});
}

// Case: memory registration with bad arguments. Expect: EINVAL, nothing registered.
TEST_F(Conformance, RegisterMemoryRejectsBadArguments) {
  std::byte b[16];
  EXPECT_EQ(server_domain_->register_memory(nullptr, 16, kLocalWrite).error(), errc(EINVAL));
  EXPECT_EQ(server_domain_->register_memory(b, 0, kLocalWrite).error(), errc(EINVAL));
  EXPECT_EQ(server_domain_->register_memory(b, 16, 1u << 20).error(), errc(EINVAL));
}

// ---- the listener never waits on one peer (fabric.h, Listener) ----

// A peer below the provider's handshake: a plain TCP socket to the tcp listener, which may send
// nothing, part of a CONNECT_REQ or garbage.
class RawSocket {
 public:
  explicit RawSocket(const Address& to) {
    fd_ = ::socket(to.family(), SOCK_STREAM | SOCK_CLOEXEC, 0);
    EXPECT_GE(fd_, 0);
    EXPECT_EQ(::connect(fd_, to.sockaddr_ptr(), to.sockaddr_len()), 0) << std::strerror(errno);
  }
  ~RawSocket() {
    if (fd_ >= 0) ::close(fd_);
  }
  RawSocket(const RawSocket&) = delete;
  RawSocket& operator=(const RawSocket&) = delete;
  void send_bytes(std::span<const std::byte> b) {
    EXPECT_EQ(::send(fd_, b.data(), b.size(), MSG_NOSIGNAL), static_cast<ssize_t>(b.size()));
  }
  // Whether the listener closed it (EOF within `t`).
  // Whether the peer closes within `t`; what it says before (a listener that requires TLS
  // tells a plaintext peer so) is read and dropped.
  bool closed_within(std::chrono::milliseconds t) {
    const auto end = std::chrono::steady_clock::now() + t;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
      pollfd pfd{fd_, POLLIN, 0};
      if (left.count() < 0 || ::poll(&pfd, 1, static_cast<int>(left.count())) != 1) return false;
      char buf[256];
      const ssize_t n = ::recv(fd_, buf, sizeof(buf), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
    }
  }

 private:
  int fd_ = -1;
};

// Serves get_request on `l` until it returns a request (then accepts it) or `deadline` passes.
std::thread accept_one(Listener& l, Side& srv, std::chrono::milliseconds deadline) {
  return std::thread([&l, &srv, deadline] {
    const auto end = std::chrono::steady_clock::now() + deadline;
    while (std::chrono::steady_clock::now() < end) {
      auto r = l.get_request(50ms);
      if (!r.ok()) continue;
      auto c = (*r)->accept(srv.queue(), {}, {}, srv.events());
      EXPECT_TRUE(c.ok());
      if (c.ok()) srv.conn = std::move(*c);
      return;
    }
  });
}

// A connect without TLS, whatever the run's.
Result<ConnectResult> connect_to_plain(Domain& d, Side& cli, const Address& to, std::chrono::milliseconds t) {
  ConnectParams p;
  p.remote = to;
  p.cq = &cli.queue();
  p.events = cli.events();
  p.timeout = t;
  return d.connect(p);
}

Result<ConnectResult> connect_to(Domain& d, Side& cli, const Address& to, std::chrono::milliseconds t) {
  ConnectParams p;
  p.remote = to;
  p.cq = &cli.queue();
  p.events = cli.events();
  p.timeout = t;
  p.tls = tested_tls().client;
  return d.connect(p);
}

// Case: 20 sockets connect to the listener and send nothing (or half a CONNECT_REQ), then an
// honest client connects. Expect: it is accepted at once (well inside the 5 s one idle socket
// could cost when handshakes were read one at a time), and the idle ones are still pending.
TEST_F(Conformance, IdlePeersDoNotDelayAnHonestConnect) {
  if (kind_ != FabricKind::tcp)
    GTEST_SKIP() << "only the tcp provider reads handshakes itself (rdma_cm and loopback deliver whole requests)";
  std::vector<std::unique_ptr<RawSocket>> idle;
  for (int i = 0; i < 20; ++i) {
    idle.push_back(std::make_unique<RawSocket>(listener_->address()));
    if (i % 2) idle.back()->send_bytes(std::vector<std::byte>(40, std::byte{0}));
  }
  std::thread srv = accept_one(*listener_, srv_, 10s);
  const auto t0 = std::chrono::steady_clock::now();
  auto c = connect_to(*client_domain_, cli_, listener_->address(), 10s);
  const auto took = std::chrono::steady_clock::now() - t0;
  srv.join();
  ASSERT_TRUE(c.ok()) << c.error().message();
  EXPECT_LT(took, 2s) << "the connect waited behind idle sockets";
  EXPECT_TRUE(srv_.conn != nullptr);
  const auto d = listener_->drops();
  EXPECT_EQ(d.timed_out + d.overflow + d.invalid, 0u) << "the idle ones wait for their own deadline";
}

// Case: a listener with backlog 4 gets 6 idle sockets, then an honest connect. Expect: the two
// oldest are dropped (closed, counted as overflow), the four newest stay, and the honest
// client, newest of all, is accepted.
TEST_F(Conformance, PendingPeersPastTheBacklogDropTheOldest) {
  if (kind_ != FabricKind::tcp) GTEST_SKIP() << "only the tcp provider keeps pending handshakes";
  Fabric::ListenOptions lo;
  lo.backlog = 4;
  lo.tls = tested_tls().server;
  lo.tls_required = tested_tls().on;
  auto l = server_fabric_->listen(ep_.server, lo);
  ASSERT_TRUE(l.ok());
  std::vector<std::unique_ptr<RawSocket>> idle;
  for (int i = 0; i < 6; ++i) {
    idle.push_back(std::make_unique<RawSocket>((*l)->address()));
    // Let the listener take it before the next one arrives, so that "oldest" is well defined.
    pollfd pfd{(*l)->fd(), POLLIN, 0};
    ASSERT_EQ(::poll(&pfd, 1, 2000), 1);
    EXPECT_EQ((*l)->get_request(0ms).error(), errc(ETIMEDOUT));
  }
  EXPECT_EQ((*l)->drops().overflow, 2u);
  EXPECT_TRUE(idle[0]->closed_within(1s));
  EXPECT_TRUE(idle[1]->closed_within(1s));
  EXPECT_FALSE(idle[2]->closed_within(50ms)) << "a newer one is still pending";
  std::thread srv = accept_one(**l, srv_, 10s);
  auto c = connect_to(*client_domain_, cli_, (*l)->address(), 10s);
  srv.join();
  ASSERT_TRUE(c.ok()) << c.error().message();
}

// Case: one socket sends a malformed CONNECT_REQ, one connects and stays silent. Expect: the
// malformed one is closed at once (invalid); the silent one is closed when its own deadline
// passes, with the listener's fd becoming readable for that without any other activity.
TEST_F(Conformance, MalformedAndSilentPeersAreDropped) {
  if (kind_ != FabricKind::tcp) GTEST_SKIP() << "only the tcp provider keeps pending handshakes";
  RawSocket bad(listener_->address());
  bad.send_bytes(std::vector<std::byte>(96, std::byte{0x41}));
  const auto t0 = std::chrono::steady_clock::now();
  RawSocket silent(listener_->address());
  // With TLS required, bytes that are not a TLS record make a plaintext peer.
  auto bad_ones = [&] { return tested_tls().on ? listener_->drops().plaintext : listener_->drops().invalid; };
  for (int i = 0; i < 100 && bad_ones() == 0; ++i)
    EXPECT_FALSE(listener_->get_request(20ms).ok());
  EXPECT_EQ(bad_ones(), 1u);
  EXPECT_TRUE(bad.closed_within(1s));
  // The waiter sleeps on fd() only, as the server's accept loop does.
  for (;;) {
    pollfd pfd{listener_->fd(), POLLIN, 0};
    ASSERT_EQ(::poll(&pfd, 1, 10000), 1) << "fd() never became readable for the deadline";
    EXPECT_FALSE(listener_->get_request(0ms).ok());
    if (listener_->drops().timed_out == 1) break;
    ASSERT_LT(std::chrono::steady_clock::now() - t0, Listener::kHandshakeTimeout + 2s);
  }
  EXPECT_GE(std::chrono::steady_clock::now() - t0, Listener::kHandshakeTimeout);
  EXPECT_TRUE(silent.closed_within(1s));
}

// ---------------------------------------------------------------------------------------------
// TLS (tcp; the run's own with --tls, and listeners of their own here)

// A listener of the provider's with `tls` (server context) and `required`.
Result<std::unique_ptr<Listener>> tls_listener(Fabric& f, const Address& at, std::shared_ptr<tls::Context> ctx,
                                               bool required) {
  Fabric::ListenOptions lo;
  lo.tls = std::move(ctx);
  lo.tls_required = required;
  return f.listen(at, lo);
}

// Drives a listener (its pending handshakes progress inside get_request) until destroyed,
// counting the requests it hands out (rejected at once).
class ListenerPump {
 public:
  explicit ListenerPump(Listener& l)
      : t_([this, &l] {
          while (!stop_.load()) {
            auto r = l.get_request(20ms);
            if (r.ok()) {
              requests_.fetch_add(1);
              (void)(*r)->reject({});
            }
          }
        }) {}
  ~ListenerPump() {
    stop_.store(true);
    t_.join();
  }
  int requests() const { return requests_.load(); }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<int> requests_{0};
  std::thread t_;
};

// A PSK context of `role` for `psk` (server: knows only that identity and key).
std::shared_ptr<tls::Context> psk_context(tls::Role role, const tls::Psk& psk) {
  tls::Config c;
  c.role = role;
  if (role == tls::Role::client) {
    c.psk = psk;
  } else {
    c.psk_lookup = [psk](std::string_view id) -> std::optional<std::vector<std::byte>> {
      if (id != psk.identity) return std::nullopt;
      return psk.key;
    };
  }
  auto r = tls::Context::create(c);
  EXPECT_TRUE(r.ok()) << r.error().message();
  return r.ok() ? *r : nullptr;
}

// Case: providers without TLS (loopback, rdma) are asked to listen or connect with it.
// Expect: EPROTONOSUPPORT from both, never a plaintext connection that looks encrypted.
TEST_F(Conformance, TlsOnlyWhereTheProviderHasIt) {
  if (kind_ == FabricKind::tcp) GTEST_SKIP() << "tcp has TLS (the cases below)";
  auto psk = tls::generate_psk("conformance/other");
  ASSERT_TRUE(psk.ok());
  auto l = tls_listener(*server_fabric_, ep_.server, psk_context(tls::Role::server, *psk), false);
  EXPECT_EQ(l.error(), errc(EPROTONOSUPPORT));
  ConnectParams p;
  p.remote = listener_->address();
  p.source = ep_.client_source ? &*ep_.client_source : nullptr;
  p.cq = cli_.cq.get();
  p.timeout = 2s;
  p.tls = psk_context(tls::Role::client, *psk);
  EXPECT_EQ(client_domain_->connect(p).error(), errc(EPROTONOSUPPORT));
}

// Case: over TLS, a connection reports what protects it.
// Expect: both ends say TLS on with the same TLS 1.3 cipher; the server's request and
// connection name the client's PSK identity; data moves (the suite's other cases).
TEST_F(Conformance, TlsConnectionsSayWhatProtectsThem) {
  if (!tested_tls().on) GTEST_SKIP() << "run with --tls";
  std::string seen_identity;
  std::thread srv([&] {
    auto req = listener_->get_request(10s);
    ASSERT_TRUE(req.ok()) << req.error().message();
    seen_identity = (*req)->tls_identity();
    auto c = (*req)->accept(srv_.queue(), {}, {}, srv_.events());
    ASSERT_TRUE(c.ok()) << c.error().message();
    srv_.conn = std::move(*c);
  });
  auto c = connect_to(*client_domain_, cli_, listener_->address(), 10s);
  srv.join();
  ASSERT_TRUE(c.ok()) << c.error().message();
  cli_.conn = std::move(c->connection);
  ASSERT_TRUE(srv_.conn != nullptr);
  EXPECT_EQ(seen_identity, tested_tls().psk.identity);
  const tls::Info ci = cli_.conn->tls(), si = srv_.conn->tls();
  EXPECT_TRUE(ci.on);
  EXPECT_TRUE(si.on);
  EXPECT_EQ(si.peer, tested_tls().psk.identity);
  EXPECT_FALSE(ci.cipher.empty());
  EXPECT_EQ(ci.cipher, si.cipher);
  std::cerr << "tls: " << ci.cipher << ", kernel tx/rx client " << ci.kernel_tx << "/" << ci.kernel_rx
            << ", server " << si.kernel_tx << "/" << si.kernel_rx << "\n";
}

// Case: a client without TLS connects to a listener that requires it; then one that offers a
// key the server does not know, and one with the right identity but a wrong key.
// Expect: the first fails with EPROTONOSUPPORT (told so in plaintext) and counts as plaintext;
// the others fail with EACCES and count as tls_failed; the listener hands out no request.
TEST_F(Conformance, TlsRequiredRefusesPlaintextAndWrongKeys) {
  if (kind_ != FabricKind::tcp) GTEST_SKIP() << "TLS is the tcp provider's";
  auto psk = tls::generate_psk("conformance/host-a");
  ASSERT_TRUE(psk.ok());
  auto l = tls_listener(*server_fabric_, ep_.server, psk_context(tls::Role::server, *psk), true);
  ASSERT_TRUE(l.ok()) << l.error().message();
  const Address at = (*l)->address();
  ListenerPump pump(**l);
  auto plain = connect_to_plain(*client_domain_, cli_, at, 5s);
  EXPECT_EQ(plain.error(), errc(EPROTONOSUPPORT));
  auto stranger = tls::generate_psk("conformance/stranger");
  tls::Psk wrong_key = *tls::generate_psk("conformance/host-a");
  for (const tls::Psk& k : {*stranger, wrong_key}) {
    ConnectParams p;
    p.remote = at;
    p.cq = cli_.cq.get();
    p.timeout = 5s;
    p.tls = psk_context(tls::Role::client, k);
    EXPECT_EQ(client_domain_->connect(p).error(), errc(EACCES)) << k.identity;
  }
  for (int i = 0; i < 50 && (*l)->drops().plaintext + (*l)->drops().tls_failed < 3; ++i)
    std::this_thread::sleep_for(20ms);
  EXPECT_EQ(pump.requests(), 0);
  EXPECT_EQ((*l)->drops().plaintext, 1u);
  EXPECT_EQ((*l)->drops().tls_failed, 2u);
  EXPECT_EQ((*l)->drops().invalid, 0u);
}

// Case: a listener that offers TLS (not required) gets a plaintext client and a TLS client; a
// TLS client reaches a plaintext listener.
// Expect: both are accepted by the first, the plaintext one reporting TLS off; the last fails
// (the listener reads a ClientHello as a malformed request) without a request.
TEST_F(Conformance, TlsOfferedTakesBothAndPlaintextListenersRefuseTls) {
  if (kind_ != FabricKind::tcp) GTEST_SKIP() << "TLS is the tcp provider's";
  auto psk = tls::generate_psk("conformance/host-b");
  ASSERT_TRUE(psk.ok());
  auto l = tls_listener(*server_fabric_, ep_.server, psk_context(tls::Role::server, *psk), false);
  ASSERT_TRUE(l.ok()) << l.error().message();
  for (bool with_tls : {false, true}) {
    Side cli, srv;
    cli.domain = client_domain_;
    srv.domain = server_domain_;
    cli.cq = std::move(client_domain_->create_cq(256)).value();
    srv.cq = std::move(server_domain_->create_cq(256)).value();
    std::thread t = accept_one(**l, srv, 10s);
    ConnectParams p;
    p.remote = (*l)->address();
    p.cq = cli.cq.get();
    p.events = cli.events();
    p.timeout = 10s;
    if (with_tls) p.tls = psk_context(tls::Role::client, *psk);
    auto c = client_domain_->connect(p);
    t.join();
    ASSERT_TRUE(c.ok()) << (with_tls ? "tls: " : "plaintext: ") << c.error().message();
    EXPECT_EQ(c->connection->tls().on, with_tls);
    ASSERT_TRUE(srv.conn != nullptr);
    EXPECT_EQ(srv.conn->tls().on, with_tls);
  }
  auto plain_listener = server_fabric_->listen(ep_.server);
  ASSERT_TRUE(plain_listener.ok());
  ListenerPump pump(**plain_listener);
  ConnectParams p;
  p.remote = (*plain_listener)->address();
  p.cq = cli_.cq.get();
  p.timeout = 5s;
  p.tls = psk_context(tls::Role::client, *psk);
  const auto t0 = std::chrono::steady_clock::now();
  auto r = client_domain_->connect(p);
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.error(), errc(ETIMEDOUT)) << "refused at once, not left to time out";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  for (int i = 0; i < 50 && (*plain_listener)->drops().invalid == 0; ++i) std::this_thread::sleep_for(20ms);
  EXPECT_EQ(pump.requests(), 0);
  EXPECT_EQ((*plain_listener)->drops().invalid, 1u);
}

}  // namespace
}  // namespace ibtrs::fabric::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    std::string_view a(argv[i]);
    if (a.rfind("--fabric=", 0) == 0) {
      auto k = ibtrs::parse_fabric_kind(a.substr(9));
      if (!k) {
        std::fprintf(stderr, "unknown fabric '%s'\n", argv[i] + 9);
        return 2;
      }
      ibtrs::fabric::testing::tested_kind() = *k;
    } else if (a == "--busy-poll") {
      ibtrs::fabric::testing::tested_options().busy_poll = true;
    } else if (a == "--tls" || a == "--tls=user") {
      if (!ibtrs::fabric::testing::enable_tested_tls(a == "--tls")) return 2;
    }
  }
  return RUN_ALL_TESTS();
}
