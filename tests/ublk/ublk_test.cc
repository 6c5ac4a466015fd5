// The ublk target without the kernel: the uAPI layouts against an independent source (the
// system's older linux/ublk_cmd.h, where it has the same thing), descriptor decoding, the
// parameters made of a geometry, the completion inbox under threads, and the daemon's recovery
// records on disk. What needs ublk_drv is in vm_ublk.sh (VM rig).
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "desc.h"
#include "ibnbd/ublk_uapi.h"
#include "inbox.h"
#include "ublk_state.h"

#if __has_include(<linux/ublk_cmd.h>)
#include <linux/ublk_cmd.h>
#define HAVE_SYSTEM_UBLK_H 1
#endif

namespace ibnbd::ublk {
namespace {

namespace u = uapi;

// ---- uAPI ----

// Case: our structs and constants against the system header (Linux 6.1 on bookworm: no
// ioctl-encoded commands yet, but the structs, op codes, flags and states were already there).
// Expect: identical sizes, offsets and values.
TEST(UblkUapi, MatchesTheSystemHeaderWhereItHasTheSame) {
#ifdef HAVE_SYSTEM_UBLK_H
  EXPECT_EQ(sizeof(u::ublksrv_ctrl_cmd), sizeof(::ublksrv_ctrl_cmd));
  EXPECT_EQ(sizeof(u::ublksrv_ctrl_dev_info), sizeof(::ublksrv_ctrl_dev_info));
  EXPECT_EQ(sizeof(u::ublksrv_io_desc), sizeof(::ublksrv_io_desc));
  EXPECT_EQ(sizeof(u::ublksrv_io_cmd), sizeof(::ublksrv_io_cmd));
  EXPECT_EQ(sizeof(u::ublk_param_basic), sizeof(::ublk_param_basic));
  EXPECT_EQ(sizeof(u::ublk_param_discard), sizeof(::ublk_param_discard));
  EXPECT_EQ(offsetof(u::ublksrv_ctrl_dev_info, flags), offsetof(::ublksrv_ctrl_dev_info, flags));
  EXPECT_EQ(offsetof(u::ublksrv_ctrl_dev_info, ublksrv_pid), offsetof(::ublksrv_ctrl_dev_info, ublksrv_pid));
  EXPECT_EQ(offsetof(u::ublk_param_basic, dev_sectors), offsetof(::ublk_param_basic, dev_sectors));
  EXPECT_EQ(offsetof(u::ublk_params, discard), offsetof(::ublk_params, discard));
  EXPECT_EQ(u::kCmdAddDev, UBLK_CMD_ADD_DEV);
  EXPECT_EQ(u::kCmdStartUserRecovery, UBLK_CMD_START_USER_RECOVERY);
  EXPECT_EQ(u::kCmdEndUserRecovery, UBLK_CMD_END_USER_RECOVERY);
  EXPECT_EQ(u::kIoFetchReq, UBLK_IO_FETCH_REQ);
  EXPECT_EQ(u::kIoCommitAndFetchReq, UBLK_IO_COMMIT_AND_FETCH_REQ);
  EXPECT_EQ(u::kFUserRecovery, UBLK_F_USER_RECOVERY);
  EXPECT_EQ(u::kFUserRecoveryReissue, UBLK_F_USER_RECOVERY_REISSUE);
  EXPECT_EQ(u::kIoOpWriteZeroes, UBLK_IO_OP_WRITE_ZEROES);
  EXPECT_EQ(u::kIoFFua, UBLK_IO_F_FUA);
  EXPECT_EQ(u::kIoFNoUnmap, UBLK_IO_F_NOUNMAP);
  EXPECT_EQ(u::kStateQuiesced, UBLK_S_DEV_QUIESCED);
  EXPECT_EQ(u::kAttrVolatileCache, UBLK_ATTR_VOLATILE_CACHE);
  EXPECT_EQ(u::kParamTypeDiscard, UBLK_PARAM_TYPE_DISCARD);
  EXPECT_EQ(u::kMaxQueueDepth, UBLK_MAX_QUEUE_DEPTH);
  EXPECT_EQ(u::kIoBufOffset, UBLKSRV_IO_BUF_OFFSET);
#else
  GTEST_SKIP() << "no linux/ublk_cmd.h";
#endif
}

// Case: the encoded opcodes (the header asserts them at compile time; this keeps the values in
// the test report). Expect: devices.md's values.
TEST(UblkUapi, EncodedOpcodes) {
  EXPECT_EQ(u::kUCmdAddDev, 0xc0207504u);
  EXPECT_EQ(u::kUCmdGetDevInfo, 0x80207502u);
  EXPECT_EQ(u::kUCmdGetFeatures, 0x80207513u);
  EXPECT_EQ(u::kUCmdEndUserRecovery, 0xc0207511u);
  EXPECT_EQ(u::kUIoFetchReq, 0xc0107520u);
  EXPECT_EQ(u::kUIoCommitAndFetchReq, 0xc0107521u);
  EXPECT_EQ(u::kDescQueueStride, 98304u);
}

// ---- descriptors ----

u::ublksrv_io_desc desc(uint32_t op, uint32_t flags, uint64_t sector, uint32_t nr) {
  u::ublksrv_io_desc d{};
  d.op_flags = op | flags;
  d.start_sector = sector;
  d.nr_sectors = nr;
  d.addr = 0x1000;
  return d;
}

constexpr uint32_t kBuf = 512u << 10;

// Case: each operation the driver sends. Expect: our op, flags, byte range and commit result.
TEST(UblkDesc, DecodesEveryOperation) {
  auto r = decode_desc(desc(u::kIoOpRead, 0, 8, 16), kBuf);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->op, IoOp::read);
  EXPECT_EQ(r->flags, 0u);
  EXPECT_EQ(r->offset, 4096u);
  EXPECT_EQ(r->len, 8192u);
  EXPECT_EQ(success_result(*r), 8192);

  r = decode_desc(desc(u::kIoOpWrite, u::kIoFFua, 0, 1), kBuf);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->op, IoOp::write);
  EXPECT_EQ(r->flags, uint32_t{kIoFua});
  EXPECT_EQ(success_result(*r), 512);

  r = decode_desc(desc(u::kIoOpFlush, 0, 0, 0), kBuf);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->op, IoOp::flush);
  EXPECT_EQ(r->len, 0u);
  EXPECT_EQ(success_result(*r), 0);

  // Discards and zeroing carry no data: longer than the tag's buffer is fine.
  r = decode_desc(desc(u::kIoOpDiscard, 0, 2048, 1u << 20), kBuf);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->op, IoOp::discard);
  EXPECT_EQ(r->len, uint64_t{1} << 29);
  EXPECT_EQ(success_result(*r), 0);

  r = decode_desc(desc(u::kIoOpWriteZeroes, u::kIoFNoUnmap, 0, 8), kBuf);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->op, IoOp::write_zeroes);
  EXPECT_EQ(r->flags, uint32_t{kIoNoUnmap});
  r = decode_desc(desc(u::kIoOpWriteZeroes, 0, 0, 8), kBuf);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->flags, 0u);
}

// Case: flags that are hints or belong to other ops. Expect: dropped, never passed on.
TEST(UblkDesc, DropsHintsAndMisplacedFlags) {
  const uint32_t hints = u::kIoFFailfastDev | u::kIoFFailfastTransport | u::kIoFFailfastDriver |
                         u::kIoFMeta | u::kIoFSwap;
  auto r = decode_desc(desc(u::kIoOpWrite, hints, 0, 8), kBuf);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->flags, 0u);
  r = decode_desc(desc(u::kIoOpRead, u::kIoFFua | u::kIoFNoUnmap, 0, 8), kBuf);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->flags, 0u);
  r = decode_desc(desc(u::kIoOpDiscard, u::kIoFNoUnmap | u::kIoFFua, 0, 8), kBuf);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->flags, 0u);
}

// Case: what the kernel should never send, or we do not serve. Expect: an errno, no crash.
TEST(UblkDesc, RefusesWhatItCannotServe) {
  EXPECT_EQ(decode_desc(desc(u::kIoOpWriteSame, 0, 0, 8), kBuf).error(), std::errc::operation_not_supported);
  for (uint32_t op : {10u, 11u, 15u, 200u, 255u})
    EXPECT_EQ(decode_desc(desc(op, 0, 0, 8), kBuf).error(), std::errc::operation_not_supported) << op;
  EXPECT_EQ(decode_desc(desc(u::kIoOpRead, 0, 0, 0), kBuf).error(), std::errc::invalid_argument);
  EXPECT_EQ(decode_desc(desc(u::kIoOpDiscard, 0, 0, 0), kBuf).error(), std::errc::invalid_argument);
  // Longer than the tag's buffer.
  EXPECT_EQ(decode_desc(desc(u::kIoOpWrite, 0, 0, kBuf / 512 + 1), kBuf).error(), std::errc::invalid_argument);
  EXPECT_TRUE(decode_desc(desc(u::kIoOpWrite, 0, 0, kBuf / 512), kBuf).ok());
  // A range whose end overflows 64 bits (in bytes).
  EXPECT_EQ(decode_desc(desc(u::kIoOpDiscard, 0, ~uint64_t{0} / 512, 8), kBuf).error(), std::errc::invalid_argument);
  EXPECT_EQ(decode_desc(desc(u::kIoOpRead, 0, ~uint64_t{0}, 1), kBuf).error(), std::errc::invalid_argument);
}

// ---- parameters ----

DeviceGeometry geometry() {
  DeviceGeometry g;
  g.nsectors = 262144;  // 128 MiB
  g.logical_block_size = 512;
  g.physical_block_size = 4096;
  g.max_hw_sectors = 256;
  g.max_discard_sectors = 1u << 16;
  g.max_write_zeroes_sectors = 1u << 15;
  g.discard_granularity = 4096;
  g.cache_policy = kCacheWriteBack | kCacheFua;
  return g;
}

// Case: a file-backed volume with write-back cache, discard and write-zeroes, mapped rw.
// Expect: sizes and shifts, VOLATILE_CACHE + FUA, discard limits with one segment.
TEST(UblkParams, FromGeometry) {
  auto p = make_params(geometry(), false, 512u << 10);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->len, sizeof(u::ublk_params));
  EXPECT_EQ(p->types, u::kParamTypeBasic | u::kParamTypeDiscard);
  EXPECT_EQ(p->basic.logical_bs_shift, 9);
  EXPECT_EQ(p->basic.physical_bs_shift, 12);
  EXPECT_EQ(p->basic.io_min_shift, 12);
  EXPECT_EQ(p->basic.max_sectors, 1024u);
  EXPECT_EQ(p->basic.dev_sectors, 262144u);
  EXPECT_EQ(p->basic.attrs, u::kAttrVolatileCache | u::kAttrFua);
  EXPECT_EQ(p->discard.max_discard_sectors, 1u << 16);
  EXPECT_EQ(p->discard.max_write_zeroes_sectors, 1u << 15);
  EXPECT_EQ(p->discard.discard_granularity, 4096u);
  EXPECT_EQ(p->discard.max_discard_segments, 1);
}

// Case: ro mapping, no cache, no discard. Expect: READ_ONLY, no DISCARD parameters.
TEST(UblkParams, ReadOnlyAndPlain) {
  auto g = geometry();
  g.cache_policy = 0;
  auto p = make_params(g, true, 512u << 10);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->basic.attrs, u::kAttrReadOnly);
  EXPECT_EQ(p->types, u::kParamTypeBasic);
  g.max_discard_sectors = g.max_write_zeroes_sectors = 0;
  p = make_params(g, false, 512u << 10);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->types, u::kParamTypeBasic);
}

// Case: write-zeroes without discard, and a server that gives no granularity. Expect: the
// DISCARD type (it carries the write-zeroes limit) with no discard and the logical block as
// granularity (the driver refuses 0).
TEST(UblkParams, WriteZeroesOnlyAndNoGranularity) {
  auto g = geometry();
  g.max_discard_sectors = 0;
  g.discard_granularity = 0;
  auto p = make_params(g, false, 512u << 10);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->types, u::kParamTypeBasic | u::kParamTypeDiscard);
  EXPECT_EQ(p->discard.max_discard_sectors, 0u);
  EXPECT_EQ(p->discard.max_write_zeroes_sectors, 1u << 15);
  EXPECT_EQ(p->discard.discard_granularity, 512u);
}

// Case: block sizes ublk cannot take, and a physical block below the logical one.
// Expect: EINVAL; the physical block is raised to the logical one.
TEST(UblkParams, BlockSizes) {
  auto g = geometry();
  g.logical_block_size = 4096;
  g.physical_block_size = 512;
  auto p = make_params(g, false, 512u << 10);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->basic.logical_bs_shift, 12);
  EXPECT_EQ(p->basic.physical_bs_shift, 12);
  for (uint32_t lbs : {0u, 256u, 1000u, 8192u}) {
    g.logical_block_size = lbs;
    EXPECT_EQ(make_params(g, false, 512u << 10).error(), std::errc::invalid_argument) << lbs;
  }
  g = geometry();
  g.physical_block_size = 6144;
  EXPECT_EQ(make_params(g, false, 512u << 10).error(), std::errc::invalid_argument);
  g = geometry();
  g.nsectors = 0;
  EXPECT_EQ(make_params(g, false, 512u << 10).error(), std::errc::invalid_argument);
  EXPECT_EQ(make_params(geometry(), false, 256).error(), std::errc::invalid_argument);
}

// ---- the completion inbox ----

struct Node {
  Node* next = nullptr;
  uint32_t producer = 0;
  uint32_t seq = 0;
};

// Case: 4 producer threads (the transport's completion threads) push 20000 nodes each; the
// consumer follows the queue thread's protocol: sleep on an eventfd that only a push onto an
// empty inbox writes, then take everything. Expect: every node exactly once, each producer's in
// its order, and never a push left without a wakeup (the consumer would hang: the test times
// out).
TEST(UblkInbox, ManyProducersOneConsumer) {
  constexpr uint32_t kProducers = 4, kPerProducer = 20000;
  std::vector<std::vector<Node>> nodes(kProducers, std::vector<Node>(kPerProducer));
  Inbox<Node, &Node::next> inbox;
  const int efd = ::eventfd(0, EFD_CLOEXEC);
  ASSERT_GE(efd, 0);
  std::atomic<uint64_t> wakeups_sent{0};
  std::vector<std::thread> producers;
  for (uint32_t p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      for (uint32_t i = 0; i < kPerProducer; ++i) {
        Node& n = nodes[p][i];
        n.producer = p;
        n.seq = i;
        if (inbox.push(&n)) {
          wakeups_sent.fetch_add(1, std::memory_order_relaxed);
          const uint64_t one = 1;
          ASSERT_EQ(::write(efd, &one, sizeof(one)), 8);
        }
        // Completions come in bursts: every 64 pushes wait until the consumer has emptied the
        // inbox, so it is emptied many times while others push, however slowly the consumer
        // runs (a timed pause was not enough under TSan: one run saw only 10 rounds).
        if (i % 64 == 63) {
          while (!inbox.empty()) std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
      }
    });
  }
  std::vector<uint32_t> next_seq(kProducers, 0);
  uint64_t received = 0, wakeups = 0, batches_over_one = 0;
  while (received < uint64_t{kProducers} * kPerProducer) {
    uint64_t v;
    ASSERT_EQ(::read(efd, &v, sizeof(v)), 8);  // blocks: a lost wakeup hangs here
    ++wakeups;
    uint32_t batch = 0;
    for (Node* n = inbox.take_all(); n != nullptr; n = n->next) {
      ASSERT_LT(n->producer, kProducers);
      ASSERT_EQ(n->seq, next_seq[n->producer]) << "producer " << n->producer;
      ++next_seq[n->producer];
      ++received;
      ++batch;
    }
    batches_over_one += batch > 1;
  }
  for (auto& t : producers) t.join();
  EXPECT_TRUE(inbox.empty());
  EXPECT_EQ(received, uint64_t{kProducers} * kPerProducer);
  for (uint32_t p = 0; p < kProducers; ++p) EXPECT_EQ(next_seq[p], kPerProducer);
  // The protocol was exercised (many rounds: each producer saw the inbox emptied after every
  // 64 of its pushes, and only a take empties it, one per read), and batching happened (fewer
  // wakeups than nodes).
  EXPECT_GE(wakeups, kPerProducer / 64);
  EXPECT_LT(wakeups_sent.load(), received);
  ::close(efd);
  std::printf("# %llu nodes, %llu wakeups sent, %llu reads, %llu batches > 1\n",
              static_cast<unsigned long long>(received), static_cast<unsigned long long>(wakeups_sent.load()),
              static_cast<unsigned long long>(wakeups), static_cast<unsigned long long>(batches_over_one));
}

// Case: pushes while nothing is taken. Expect: only the first says "wake", take is FIFO.
TEST(UblkInbox, OnlyThePushOntoAnEmptyInboxWakes) {
  Node a, b, c;
  Inbox<Node, &Node::next> inbox;
  EXPECT_TRUE(inbox.push(&a));
  EXPECT_FALSE(inbox.push(&b));
  EXPECT_FALSE(inbox.push(&c));
  Node* n = inbox.take_all();
  ASSERT_EQ(n, &a);
  ASSERT_EQ(n->next, &b);
  ASSERT_EQ(n->next->next, &c);
  EXPECT_EQ(n->next->next->next, nullptr);
  EXPECT_EQ(inbox.take_all(), nullptr);
  EXPECT_TRUE(inbox.push(&a));
}

// ---- the daemon's records ----

class UblkState : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ublk-state-test.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    dir_ = root_ + "/a/b";  // created by save
  }
  void TearDown() override { std::filesystem::remove_all(root_); }
  std::string root_, dir_;
};

UblkRecord record(uint32_t id) {
  return UblkRecord{id, "sess-" + std::to_string(id), {"rdma:198.18.0.1@rdma:198.18.0.2:1234", "tcp:10.0.0.2"},
                    "sub/vol" + std::to_string(id) + ".img", id % 2 ? AccessMode::ro : AccessMode::rw,
                    // Odd records carry the credentials device map named; even ones use the default.
                    id % 2 ? "/etc/ibnbd/host.key" : "", id % 2 ? "nqn.2014-08.org.example:h" : "", id % 3 == 0 ? "on" : "", {}, {}};
}

// Case: save, load, overwrite, remove. Expect: the same records back, a private directory,
// nothing but the record files in it.
TEST_F(UblkState, RoundTrip) {
  UblkStateDir st(dir_);
  EXPECT_TRUE(st.load().records.empty());  // no directory yet: nothing, no error
  ASSERT_TRUE(st.save(record(3)).ok());
  ASSERT_TRUE(st.save(record(0)).ok());
  struct stat sb{};
  ASSERT_EQ(::stat(dir_.c_str(), &sb), 0);
  EXPECT_EQ(sb.st_mode & 0777, 0700u);
  auto l = st.load();
  ASSERT_EQ(l.records.size(), 2u);
  EXPECT_EQ(l.records[0], record(0));
  EXPECT_EQ(l.records[1], record(3));
  EXPECT_TRUE(l.bad.empty());

  auto r = record(3);
  r.session = "renamed";
  ASSERT_TRUE(st.save(r).ok());
  l = st.load();
  ASSERT_EQ(l.records.size(), 2u);
  EXPECT_EQ(l.records[1].session, "renamed");
  size_t files = 0;
  for (auto& e : std::filesystem::directory_iterator(dir_)) {
    ++files;
    EXPECT_EQ(e.path().extension(), ".json") << e.path();
  }
  EXPECT_EQ(files, 2u);

  ASSERT_TRUE(st.remove(0).ok());
  ASSERT_TRUE(st.remove(0).ok());  // gone already: fine
  l = st.load();
  ASSERT_EQ(l.records.size(), 1u);
  EXPECT_EQ(l.records[0].ublk_id, 3u);
}

// Case: damaged, foreign and half-written files beside a good one. Expect: the good record
// loads; the damaged ones are reported, not fatal; a temporary file is ignored.
TEST_F(UblkState, DamagedFilesAreReportedNotFatal) {
  UblkStateDir st(dir_);
  ASSERT_TRUE(st.save(record(1)).ok());
  auto put = [&](const std::string& name, const std::string& text) { std::ofstream(dir_ + "/" + name) << text; };
  put("ublk-2.json", "{\"version\": 1, \"ublk_id\": 2, \"sess");           // truncated
  put("ublk-3.json", "[1, 2, 3]");                                          // not an object
  put("ublk-4.json", to_json(record(5)).dump());                            // id != file name
  auto v2 = to_json(record(6));
  v2["version"] = 2;
  put("ublk-6.json", v2.dump());                                            // another version
  auto no_paths = to_json(record(7));
  no_paths["paths"] = nlohmann::json::array();
  put("ublk-7.json", no_paths.dump());
  auto bad_mode = to_json(record(8));
  bad_mode["access_mode"] = "rwx";
  put("ublk-8.json", bad_mode.dump());
  auto big_id = to_json(record(9));
  big_id["ublk_id"] = uint64_t{1} << 33;
  put("ublk-9.json", big_id.dump());
  put("ublk-10.json.tmp", to_json(record(10)).dump());                       // an interrupted save
  put("other.txt", "x");
  auto l = st.load();
  ASSERT_EQ(l.records.size(), 1u);
  EXPECT_EQ(l.records[0], record(1));
  EXPECT_EQ(l.bad.size(), 7u);
}

// Case: JSON with the wrong types. Expect: EINVAL, never an exception.
TEST(UblkRecordJson, WrongTypes) {
  auto j = to_json(record(1));
  EXPECT_TRUE(ublk_record_from_json(j).ok());
  for (const char* k : {"ublk_id", "session", "device", "access_mode", "paths", "version"}) {
    auto bad = j;
    bad[k] = nlohmann::json::object();
    EXPECT_EQ(ublk_record_from_json(bad).error(), std::errc::invalid_argument) << k;
    bad.erase(k);
    EXPECT_EQ(ublk_record_from_json(bad).error(), std::errc::invalid_argument) << k;
  }
  auto bad = j;
  bad["paths"] = nlohmann::json::array({1});
  EXPECT_EQ(ublk_record_from_json(bad).error(), std::errc::invalid_argument);
  bad = j;
  bad["ublk_id"] = -1;
  EXPECT_EQ(ublk_record_from_json(bad).error(), std::errc::invalid_argument);
  EXPECT_EQ(ublk_record_from_json(nlohmann::json()).error(), std::errc::invalid_argument);
}

// Case: the record of a failover device (device map ... standby ...), and standby fields that
// are incomplete, mistyped or name the active session again.
// Expect: the record comes back equal; each bad one is EINVAL; a record without them has none.
TEST(UblkRecordJson, AStandbyRoundTripsAndIsChecked) {
  auto r = record(4);
  r.standby_session = "sess-b";
  r.standby_paths = {"tcp:10.0.1.2", "tcp:10.0.2.2"};
  auto j = to_json(r);
  auto back = ublk_record_from_json(j);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, r);
  EXPECT_FALSE(to_json(record(4)).contains("standby_session")) << "nothing written without a standby";
  std::vector<nlohmann::json> bad(5, j);
  bad[0].erase("standby_paths");
  bad[1].erase("standby_session");
  bad[2]["standby_paths"] = nlohmann::json::array();
  bad[3]["standby_paths"] = nlohmann::json::array({7});
  bad[4]["standby_session"] = r.session;
  for (size_t i = 0; i < bad.size(); ++i)
    EXPECT_EQ(ublk_record_from_json(bad[i]).error(), std::errc::invalid_argument) << i;
}

}  // namespace
}  // namespace ibnbd::ublk
