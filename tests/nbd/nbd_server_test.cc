// The NBD server against a RAM export over socketpairs (and once over its tcp and unix
// listeners): every option of the handshake, every command, simple and structured replies,
// out-of-order completion, and bad input from a client while another one keeps working.
// Spec: NetworkBlockDevice/nbd doc/proto.md.
#include <sys/socket.h>
#include <sys/un.h>
#include <arpa/inet.h>

#include <chrono>
#include <functional>
#include <memory>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "nbd_client.h"
#include "ram_export.h"

namespace ibnbd::nbd::test {
namespace {

using namespace wire;
constexpr uint64_t kSize = 4 << 20;

Bytes pattern(size_t n, unsigned seed) {
  Bytes b(n);
  std::mt19937 g(seed);
  for (auto& c : b) c = static_cast<unsigned char>(g());
  return b;
}

class NbdServerTest : public ::testing::Test {
 protected:
  void start(bool async = true, NbdServerOptions o = {},
             const std::function<void(RamExport&)>& prep = {}) {
    ram_ = std::make_shared<RamExport>(kSize, async);
    if (prep) prep(*ram_);
    ram2_ = std::make_shared<RamExport>(1 << 20, false);
    o.exports = {{"disk", ram_}, {"second", ram2_}};
    auto s = NbdServer::start(std::move(o));
    ASSERT_TRUE(s.ok()) << s.error().message();
    srv_ = std::move(*s);
  }
  void TearDown() override {
    if (ram_) ram_->release(false);
    if (srv_) srv_->stop();
  }
  std::unique_ptr<Client> connect() {
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    EXPECT_TRUE(srv_->serve_fd(sv[0]).ok());
    return std::make_unique<Client>(sv[1]);
  }
  // Connected, greeted, client flags sent: ready for options.
  std::unique_ptr<Client> negotiating() {
    auto c = connect();
    EXPECT_GE(c->handshake(), 0);
    return c;
  }
  // Connected and in transmission.
  std::unique_ptr<Client> ready(bool structured, bool meta = false) {
    auto c = connect();
    EXPECT_NE(c->go(structured, meta), 0);
    return c;
  }
  // WRITE then READ back through the connection.
  void write_read(Client& c, uint64_t off, const Bytes& data) {
    ASSERT_TRUE(c.request(kCmdWrite, 0, 1, off, static_cast<uint32_t>(data.size()), data));
    auto w = c.reply();
    ASSERT_TRUE(w);
    EXPECT_EQ(w->error, 0u);
    ASSERT_TRUE(c.request(kCmdRead, 0, 2, off, static_cast<uint32_t>(data.size())));
    auto r = c.reply(static_cast<uint32_t>(data.size()));
    ASSERT_TRUE(r);
    EXPECT_EQ(r->error, 0u);
    Bytes got = r->payload;
    if (r->structured) {
      ASSERT_EQ(r->type, kReplyOffsetData);
      EXPECT_EQ(get64(got.data()), off);
      got.erase(got.begin(), got.begin() + 8);
    }
    EXPECT_EQ(got, data);
  }
  // One request answered with the given NBD error (0: success).
  void expect_error(Client& c, uint16_t type, uint16_t flags, uint64_t off, uint32_t len,
                    uint32_t want, const Bytes& data = {}) {
    ASSERT_TRUE(c.request(type, flags, 77, off, len, data));
    auto r = c.reply(type == kCmdRead && want == 0 ? len : 0);
    ASSERT_TRUE(r) << "no reply to command " << type;
    EXPECT_EQ(r->handle, 77u);
    EXPECT_EQ(r->error, want) << "command " << type << " flags " << flags << " off " << off << " len " << len;
    if (c.structured() && want != 0) {
      EXPECT_EQ(r->type, kReplyError);
      EXPECT_TRUE(r->flags & kReplyFlagDone);
    }
  }

  std::shared_ptr<RamExport> ram_, ram2_;
  std::unique_ptr<NbdServer> srv_;
};

// ---------------------------------------------------------------------------------------------
// Handshake

// Case: a client connects. Expect: NBDMAGIC, IHAVEOPT, FIXED_NEWSTYLE | NO_ZEROES.
TEST_F(NbdServerTest, GreetingIsFixedNewstyle) {
  start();
  auto c = connect();
  EXPECT_EQ(c->handshake(), kFlagFixedNewstyle | kFlagNoZeroes);
}

// Case: client flags with an unknown bit. Expect: the server drops the connection (spec: MUST).
TEST_F(NbdServerTest, UnknownClientFlagsClose) {
  start();
  auto c = connect();
  ASSERT_GE(c->handshake(1u << 7), 0);
  EXPECT_TRUE(c->closed());
  EXPECT_EQ(srv_->stats().protocol_errors, 1u);
}

// Case: LIST, then LIST with data. Expect: one NBD_REP_SERVER per export then ACK;
// NBD_REP_ERR_INVALID for the malformed one; the connection stays usable.
TEST_F(NbdServerTest, ListExports) {
  start();
  auto c = negotiating();
  ASSERT_TRUE(c->option(kOptList, {}));
  auto rs = c->opt_replies();
  ASSERT_EQ(rs.size(), 3u);
  std::vector<std::string> names;
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(rs[i].type, kRepServer);
    EXPECT_EQ(rs[i].option, kOptList);
    const uint32_t n = get32(rs[i].data.data());
    names.emplace_back(rs[i].data.begin() + 4, rs[i].data.begin() + 4 + n);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"disk", "second"}));
  EXPECT_EQ(rs[2].type, kRepAck);
  ASSERT_TRUE(c->option(kOptList, {1, 2, 3}));
  auto bad = c->opt_reply();
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->type, kRepErrInvalid);
  ASSERT_TRUE(c->option(kOptList, {}));
  EXPECT_EQ(c->opt_replies().back().type, kRepAck);
}

// Case: ABORT. Expect: ACK, then the server closes.
TEST_F(NbdServerTest, AbortIsAcknowledgedThenClosed) {
  start();
  auto c = negotiating();
  ASSERT_TRUE(c->option(kOptAbort, {}));
  auto r = c->opt_reply();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->type, kRepAck);
  EXPECT_EQ(r->option, kOptAbort);
  EXPECT_TRUE(c->closed());
}

// Case: INFO without any information request. Expect: BLOCK_SIZE anyway and EXPORT (size,
// flags), ACK; still in the handshake (LIST answers).
TEST_F(NbdServerTest, InfoWithoutBlockSizeRequest) {
  start();
  auto c = negotiating();
  ASSERT_TRUE(c->option(kOptInfo, Client::info_data("disk", {})));
  auto rs = c->opt_replies();
  ASSERT_EQ(rs.size(), 3u);
  EXPECT_EQ(get16(rs[0].data.data()), kInfoBlockSize);
  EXPECT_EQ(get32(rs[0].data.data() + 2), 512u);
  EXPECT_EQ(get32(rs[0].data.data() + 6), 4096u);
  EXPECT_EQ(get32(rs[0].data.data() + 10), 32u << 20);
  ASSERT_EQ(rs[1].data.size(), 12u);
  EXPECT_EQ(get16(rs[1].data.data()), kInfoExport);
  EXPECT_EQ(get64(rs[1].data.data() + 2), kSize);
  const uint16_t f = get16(rs[1].data.data() + 10);
  EXPECT_EQ(f, kTxHasFlags | kTxSendFlush | kTxSendFua | kTxSendTrim | kTxSendWriteZeroes |
                   kTxSendFastZero | kTxCanMultiConn | kTxSendCache);  // no DF: simple replies
  EXPECT_EQ(rs[2].type, kRepAck);
  ASSERT_TRUE(c->option(kOptList, {}));
  EXPECT_EQ(c->opt_replies().back().type, kRepAck);
}

// Case: INFO asking for NAME, BLOCK_SIZE, DESCRIPTION and an unknown info type, for the default
// ("") export. Expect: NAME is "disk", DESCRIPTION "ram", the unknown request ignored.
TEST_F(NbdServerTest, InfoWithRequests) {
  start();
  auto c = negotiating();
  ASSERT_TRUE(c->option(kOptInfo, Client::info_data("", {kInfoName, kInfoBlockSize, kInfoDescription, 99})));
  auto rs = c->opt_replies();
  ASSERT_EQ(rs.size(), 5u);
  EXPECT_EQ(std::string(rs[0].data.begin() + 2, rs[0].data.end()), "disk");
  EXPECT_EQ(std::string(rs[1].data.begin() + 2, rs[1].data.end()), "ram");
  EXPECT_EQ(get16(rs[2].data.data()), kInfoBlockSize);
  EXPECT_EQ(get16(rs[3].data.data()), kInfoExport);
  EXPECT_EQ(rs[4].type, kRepAck);
}

// Case: INFO / GO for a name that is not exported, and malformed INFO data. Expect:
// NBD_REP_ERR_UNKNOWN and NBD_REP_ERR_INVALID; GO of the right name still works afterwards.
TEST_F(NbdServerTest, InfoErrors) {
  start();
  auto c = negotiating();
  ASSERT_TRUE(c->option(kOptGo, Client::info_data("nope", {})));
  EXPECT_EQ(c->opt_replies().back().type, kRepErrUnknown);
  Bytes bad = Client::info_data("disk", {kInfoBlockSize});
  bad.pop_back();  // a request count that does not match
  ASSERT_TRUE(c->option(kOptGo, bad));
  EXPECT_EQ(c->opt_replies().back().type, kRepErrInvalid);
  ASSERT_TRUE(c->option(kOptInfo, {0, 0, 0, 9, 'x'}));  // name length past the data
  EXPECT_EQ(c->opt_replies().back().type, kRepErrInvalid);
  ASSERT_TRUE(c->option(kOptGo, Client::info_data("second", {})));
  auto rs = c->opt_replies();
  ASSERT_EQ(rs.back().type, kRepAck);
  EXPECT_EQ(get64(rs[rs.size() - 2].data.data() + 2), 1u << 20);
}

// Case: an export with 4 KiB blocks; GO with block sizes asked for, and GO without (the
// kernel's nbd-client never asks). Expect: both enter transmission; the asking client is told
// 4096; a request below the minimum block fails with EINVAL and changes nothing, an aligned
// one works.
TEST_F(NbdServerTest, BlockSizeAbove512) {
  start();
  ExportInfo i = ram_->info();
  i.min_block = 4096;
  ram_->set_info(i);
  for (bool ask : {true, false}) {
    SCOPED_TRACE(ask ? "asked for block sizes" : "did not ask");
    auto c = negotiating();
    ASSERT_TRUE(c->option(kOptGo, Client::info_data("disk", ask ? std::vector<uint16_t>{kInfoBlockSize}
                                                                : std::vector<uint16_t>{})));
    auto rs = c->opt_replies();
    ASSERT_EQ(rs.back().type, kRepAck);
    if (ask) {
      EXPECT_EQ(get32(rs[0].data.data() + 2), 4096u);
    }
    expect_error(*c, kCmdRead, 0, 512, 4096, kEinval);  // below the minimum block
    const auto before = ram_->snapshot();
    expect_error(*c, kCmdWrite, 0, 512, 512, kEinval, Bytes(512, 1));
    EXPECT_EQ(ram_->snapshot(), before);
    expect_error(*c, kCmdRead, 0, 4096, 4096, 0);
  }
}

// Case: the oldest way in, NBD_OPT_EXPORT_NAME, with and without NO_ZEROES. Expect: size, flags,
// 124 zero bytes only without NO_ZEROES; simple replies; IO works.
TEST_F(NbdServerTest, ExportNameFallback) {
  start();
  for (bool no_zeroes : {false, true}) {
    auto c = connect();
    ASSERT_GE(c->handshake(kClientFixedNewstyle | (no_zeroes ? kClientNoZeroes : 0)), 0);
    ASSERT_TRUE(c->option(kOptExportName, {'d', 'i', 's', 'k'}));
    auto r = c->recv(10 + (no_zeroes ? 0 : 124));
    ASSERT_TRUE(r);
    EXPECT_EQ(get64(r->data()), kSize);
    EXPECT_EQ(get16(r->data() + 8) & (kTxHasFlags | kTxSendFlush), kTxHasFlags | kTxSendFlush);
    for (size_t k = 10; k < r->size(); ++k) ASSERT_EQ((*r)[k], 0);
    write_read(*c, 8192, pattern(4096, 1));
  }
}

// Case: EXPORT_NAME of an unknown export. Expect: the server closes (the option cannot fail).
TEST_F(NbdServerTest, ExportNameUnknownCloses) {
  start();
  auto c = negotiating();
  ASSERT_TRUE(c->option(kOptExportName, {'x'}));
  EXPECT_TRUE(c->closed());
}

// Case: STARTTLS, an unknown option, and a 100 KiB option. Expect: ERR_UNSUP, ERR_UNSUP,
// ERR_TOO_BIG (its data read past), and the handshake goes on to GO.
TEST_F(NbdServerTest, UnsupportedAndOversizedOptions) {
  start();
  auto c = negotiating();
  ASSERT_TRUE(c->option(kOptStartTls, {}));
  EXPECT_EQ(c->opt_reply()->type, kRepErrUnsup);
  ASSERT_TRUE(c->option(4242, {1, 2, 3}));
  auto r = c->opt_reply();
  EXPECT_EQ(r->type, kRepErrUnsup);
  EXPECT_EQ(r->option, 4242u);
  ASSERT_TRUE(c->option(kOptGo, Bytes(100 << 10, 'a')));
  EXPECT_EQ(c->opt_reply()->type, kRepErrTooBig);
  ASSERT_TRUE(c->option(kOptGo, Client::info_data("", {})));
  EXPECT_EQ(c->opt_replies().back().type, kRepAck);
  write_read(*c, 0, pattern(512, 2));
}

// Case: meta contexts. Expect: without structured replies ERR_INVALID; LIST with no query and
// with "base:" names base:allocation (id 0); SET selects it with a non-zero id; an unknown
// context selects nothing.
TEST_F(NbdServerTest, MetaContexts) {
  start();
  auto c = negotiating();
  ASSERT_TRUE(c->option(kOptListMetaContext, Client::meta_data("disk", {})));
  EXPECT_EQ(c->opt_replies().back().type, kRepErrInvalid);
  ASSERT_TRUE(c->option(kOptStructuredReply, {}));
  EXPECT_EQ(c->opt_reply()->type, kRepAck);
  for (auto q : std::vector<std::vector<std::string>>{{}, {"base:"}}) {
    ASSERT_TRUE(c->option(kOptListMetaContext, Client::meta_data("disk", q)));
    auto rs = c->opt_replies();
    ASSERT_EQ(rs.size(), 2u);
    EXPECT_EQ(rs[0].type, kRepMetaContext);
    EXPECT_EQ(get32(rs[0].data.data()), 0u);
    EXPECT_EQ(std::string(rs[0].data.begin() + 4, rs[0].data.end()), "base:allocation");
  }
  ASSERT_TRUE(c->option(kOptSetMetaContext, Client::meta_data("disk", {"qemu:dirty-bitmap:x"})));
  EXPECT_EQ(c->opt_replies().size(), 1u);  // ACK only
  ASSERT_TRUE(c->option(kOptSetMetaContext, Client::meta_data("disk", {"base:allocation"})));
  auto rs = c->opt_replies();
  ASSERT_EQ(rs.size(), 2u);
  EXPECT_EQ(get32(rs[0].data.data()), kBaseAllocationId);
  ASSERT_TRUE(c->option(kOptSetMetaContext, Client::meta_data("nope", {"base:allocation"})));
  EXPECT_EQ(c->opt_replies().back().type, kRepErrUnknown);
}

// ---------------------------------------------------------------------------------------------
// Transmission

// Case: every command with simple replies. Expect: data round-trips; FLUSH, TRIM, WRITE_ZEROES
// (NO_HOLE passed on), CACHE succeed; FUA reaches the export on WRITE and turns into a FLUSH
// after TRIM / WRITE_ZEROES.
TEST_F(NbdServerTest, EveryCommandSimpleReplies) {
  start();
  auto c = ready(false);
  const Bytes d = pattern(64 << 10, 3);
  write_read(*c, 1 << 20, d);
  expect_error(*c, kCmdFlush, 0, 0, 0, 0);
  EXPECT_EQ(ram_->flushes.load(), 1);
  expect_error(*c, kCmdWrite, kCmdFlagFua, 0, 4096, 0, pattern(4096, 4));
  EXPECT_EQ(ram_->fua_writes.load(), 1);
  expect_error(*c, kCmdTrim, kCmdFlagFua, 1 << 20, 4096, 0);
  EXPECT_EQ(ram_->trims.load(), 1);
  EXPECT_EQ(ram_->flushes.load(), 2);
  expect_error(*c, kCmdWriteZeroes, kCmdFlagNoHole, (1 << 20) + 4096, 4096, 0);
  EXPECT_EQ(ram_->no_hole_zeroes.load(), 1);
  expect_error(*c, kCmdWriteZeroes, kCmdFlagFua | kCmdFlagFastZero, (1 << 20) + 8192, 8192, 0);
  EXPECT_EQ(ram_->flushes.load(), 3);
  expect_error(*c, kCmdCache, 0, 0, 65536, 0);
  // The trimmed and zeroed blocks read back as zeroes, the rest as written.
  ASSERT_TRUE(c->request(kCmdRead, 0, 5, 1 << 20, 16384));
  auto r = c->reply(16384);
  ASSERT_TRUE(r);
  for (size_t i = 0; i < 16384; ++i) ASSERT_EQ(r->payload[i], 0) << i;
  ASSERT_TRUE(c->request(kCmdRead, 0, 6, (1 << 20) + 16384, 4096));
  auto r2 = c->reply(4096);
  ASSERT_TRUE(r2);
  ASSERT_EQ(r2->payload.size(), 4096u);
  EXPECT_TRUE(std::equal(r2->payload.begin(), r2->payload.end(), d.begin() + 16384));
  // DF without structured replies, REQ_ONE on a READ: flags not valid for the command.
  expect_error(*c, kCmdRead, kCmdFlagDf, 0, 512, kEinval);
  expect_error(*c, kCmdRead, kCmdFlagReqOne, 0, 512, kEinval);
  // BLOCK_STATUS without a metadata context: EINVAL ("Servers SHOULD reply ... with EINVAL").
  expect_error(*c, kCmdBlockStatus, 0, 0, 512, kEinval);
  // Zero-length READ and WRITE: nothing to do, success.
  expect_error(*c, kCmdRead, 0, 0, 0, 0);
  expect_error(*c, kCmdWrite, 0, 0, 0, 0);
}

// Case: structured replies with base:allocation. Expect: a READ is one OFFSET_DATA chunk with
// DONE (DF accepted); BLOCK_STATUS is one BLOCK_STATUS chunk for the whole range, status 0
// (data); errors are ERROR chunks with a message; other successes are simple replies.
TEST_F(NbdServerTest, StructuredRepliesAndBlockStatus) {
  start();
  auto c = ready(true, true);
  write_read(*c, 4096, pattern(8192, 5));
  ASSERT_TRUE(c->request(kCmdRead, kCmdFlagDf, 9, 0, 65536));
  auto r = c->reply();
  ASSERT_TRUE(r && r->structured);
  EXPECT_EQ(r->type, kReplyOffsetData);
  EXPECT_EQ(r->flags, kReplyFlagDone);
  EXPECT_EQ(r->payload.size(), 8u + 65536);
  for (uint16_t fl : {uint16_t{0}, kCmdFlagReqOne}) {
    ASSERT_TRUE(c->request(kCmdBlockStatus, fl, 10, 512, 1 << 20));
    r = c->reply();
    ASSERT_TRUE(r && r->structured);
    EXPECT_EQ(r->type, kReplyBlockStatus);
    EXPECT_EQ(r->flags, kReplyFlagDone);
    ASSERT_EQ(r->payload.size(), 12u);
    EXPECT_EQ(get32(r->payload.data()), kBaseAllocationId);
    EXPECT_EQ(get32(r->payload.data() + 4), 1u << 20);
    EXPECT_EQ(get32(r->payload.data() + 8), 0u);
  }
  ASSERT_TRUE(c->request(kCmdRead, 0, 11, kSize, 512));
  r = c->reply();
  ASSERT_TRUE(r && r->structured);
  EXPECT_EQ(r->type, kReplyError);
  EXPECT_EQ(r->error, kEinval);
  const uint16_t ml = get16(r->payload.data() + 4);
  EXPECT_GT(ml, 0);
  EXPECT_EQ(r->payload.size(), 6u + ml);
  ASSERT_TRUE(c->request(kCmdFlush, 0, 12, 0, 0));
  r = c->reply();
  ASSERT_TRUE(r);
  EXPECT_FALSE(r->structured);
  EXPECT_EQ(r->error, 0u);
  expect_error(*c, kCmdBlockStatus, 0, kSize - 512, 1024, kEinval);  // past the end
  expect_error(*c, kCmdBlockStatus, 0, 0, 0, kEinval);              // nothing to describe
}

// The descriptors of a BLOCK_STATUS reply: (length, status) pairs after the context id.
std::vector<std::pair<uint32_t, uint32_t>> descriptors(const Bytes& payload) {
  std::vector<std::pair<uint32_t, uint32_t>> d;
  for (size_t i = 4; i + 8 <= payload.size(); i += 8) d.emplace_back(get32(payload.data() + i), get32(payload.data() + i + 4));
  return d;
}

// Case: an export that knows its holes (1 MiB hole, 64 KiB data, 512 zero bytes, then a long run
// of 4 KiB data / 4 KiB hole, more than one answer holds). Expect: the descriptors are the
// export's, NBD_STATE_HOLE | NBD_STATE_ZERO as the export says; REQ_ONE gives one; an unaligned
// request is asked of the export from the block before and answered from its own offset, never
// past its end; a long range gets at most kMaxExtents descriptors covering a prefix.
TEST_F(NbdServerTest, BlockStatusAnswersTheExportsExtents) {
  start(true, {}, [](RamExport& r) {
    r.layout = {{1 << 20, kExtentHole | kExtentZero}, {65536, 0}, {512, kExtentZero}};
    uint64_t pos = (1 << 20) + 65536 + 512;
    while (pos < kSize) {
      const uint64_t n = std::min<uint64_t>(4096, kSize - pos);
      r.layout.push_back(Extent{n, r.layout.size() % 2 ? uint32_t{kExtentHole} : 0u});
      pos += n;
    }
  });
  auto c = ready(true, true);
  ASSERT_TRUE(c->request(kCmdBlockStatus, 0, 1, 0, (1 << 20) + 65536 + 512));
  auto r = c->reply();
  ASSERT_TRUE(r && r->structured);
  EXPECT_EQ(r->type, kReplyBlockStatus);
  EXPECT_EQ(r->flags, kReplyFlagDone);
  EXPECT_EQ(get32(r->payload.data()), kBaseAllocationId);
  using D = std::vector<std::pair<uint32_t, uint32_t>>;
  EXPECT_EQ(descriptors(r->payload), (D{{1 << 20, kStateHole | kStateZero}, {65536, 0}, {512, kStateZero}}));
  ASSERT_TRUE(c->request(kCmdBlockStatus, kCmdFlagReqOne, 2, 0, 4 << 20));
  r = c->reply();
  ASSERT_TRUE(r && r->structured);
  EXPECT_EQ(descriptors(r->payload), (D{{1 << 20, kStateHole | kStateZero}}));
  // Unaligned: 100 bytes into the hole, 1 MiB + 100 long (ends 200 bytes into the data).
  ASSERT_TRUE(c->request(kCmdBlockStatus, 0, 3, 100, (1 << 20) + 100));
  r = c->reply();
  ASSERT_TRUE(r && r->structured);
  EXPECT_EQ(descriptors(r->payload), (D{{(1 << 20) - 100, kStateHole | kStateZero}, {200, 0}}));
  EXPECT_EQ(ram_->status_offset.load(), 0u);
  EXPECT_EQ(ram_->status_len.load(), (1u << 20) + 512);
  // The run of small extents: at most kMaxExtents descriptors, a prefix of the range.
  const uint64_t run = (1 << 20) + 65536 + 512;
  ASSERT_TRUE(c->request(kCmdBlockStatus, 0, 4, run, static_cast<uint32_t>(kSize - run)));
  r = c->reply();
  ASSERT_TRUE(r && r->structured);
  const D d = descriptors(r->payload);
  EXPECT_EQ(d.size(), kMaxExtents);
  uint64_t sum = 0;
  for (auto [len, st] : d) sum += len;
  EXPECT_LT(sum, kSize - run);
  EXPECT_EQ(d[0].second, kStateHole);
  EXPECT_EQ(d[1].second, 0u);
}

// Case: requests outside the device or the rules. Expect: EINVAL for reads, trims, caches past
// the end, misaligned or unknown ones and bad flags; ENOSPC for writes past the end (their
// payload is still read, so the next request is parsed right); EPERM is not involved.
TEST_F(NbdServerTest, OutOfRangeAndInvalidRequests) {
  start();
  for (bool structured : {false, true}) {
    auto c = ready(structured);
    expect_error(*c, kCmdRead, 0, kSize, 512, kEinval);
    expect_error(*c, kCmdRead, 0, kSize - 512, 1024, kEinval);
    expect_error(*c, kCmdRead, 0, ~0ull - 511, 1024, kEinval);  // offset + length overflows
    expect_error(*c, kCmdTrim, 0, kSize - 512, 4096, kEinval);
    expect_error(*c, kCmdCache, 0, kSize, 4096, kEinval);
    expect_error(*c, kCmdWrite, 0, kSize - 512, 1024, kEnospc, pattern(1024, 6));
    expect_error(*c, kCmdWriteZeroes, 0, kSize, 512, kEnospc);
    expect_error(*c, kCmdRead, 0, 100, 512, kEinval);
    expect_error(*c, kCmdWrite, 0, 0, 100, kEinval, pattern(100, 7));
    expect_error(*c, 42, 0, 0, 512, kEinval);
    expect_error(*c, kCmdWrite, 1u << 9, 0, 512, kEinval, pattern(512, 8));
    expect_error(*c, kCmdTrim, kCmdFlagNoHole, 0, 512, kEinval);
    write_read(*c, 0, pattern(4096, 9));  // the stream is still in step
  }
}

// Case: a READ and a WRITE larger than the maximum payload (32 MiB). Expect: the READ gets
// EINVAL and the connection goes on; the WRITE gets EINVAL and the server then closes (its
// payload is not worth reading).
TEST_F(NbdServerTest, OversizedRequests) {
  start();
  auto c = ready(false);
  expect_error(*c, kCmdRead, 0, 0, (32u << 20) + 512, kEinval);
  write_read(*c, 0, pattern(512, 10));
  ASSERT_TRUE(c->request(kCmdWrite, 0, 13, 0, 64u << 20));
  auto r = c->reply();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->error, kEinval);
  EXPECT_TRUE(c->closed());
  EXPECT_EQ(srv_->stats().protocol_errors, 1u);
}

// Case: a request with a bad magic. Expect: a hard disconnect.
TEST_F(NbdServerTest, BadRequestMagicCloses) {
  start();
  auto c = ready(true);
  ASSERT_TRUE(c->send(Bytes(28, 0x55)));
  EXPECT_TRUE(c->closed());
}

// Case: three READs held by the export and completed newest first. Expect: the replies come
// in completion order, each with its own handle.
TEST_F(NbdServerTest, RepliesOutOfOrder) {
  start(true);
  auto c = ready(true);
  ram_->hold();
  for (uint64_t h = 1; h <= 3; ++h) ASSERT_TRUE(c->request(kCmdRead, 0, h, h * 4096, 4096));
  for (int i = 0; i < 500 && ram_->queued() < 3; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ASSERT_EQ(ram_->queued(), 3u);
  ram_->release(true);
  for (uint64_t want = 3; want >= 1; --want) {
    auto r = c->reply();
    ASSERT_TRUE(r);
    EXPECT_EQ(r->handle, want);
    EXPECT_EQ(get64(r->payload.data()), want * 4096);
  }
}

// Case: 400 WRITEs sent at once, more than the 128 slots and the byte budget of a connection.
// Expect: every one answered once (the server stops reading while full and resumes).
TEST_F(NbdServerTest, ManyRequestsInFlight) {
  NbdServerOptions o;
  o.max_inflight_bytes = 1 << 20;
  start(true, o);
  auto c = ready(false);
  const Bytes d = pattern(16384, 11);
  std::thread sender([&] {
    for (uint64_t h = 0; h < 400; ++h) ASSERT_TRUE(c->request(kCmdWrite, 0, h, (h % 256) * 16384, 16384, d));
  });
  std::vector<bool> seen(400);
  for (int i = 0; i < 400; ++i) {
    auto r = c->reply();
    ASSERT_TRUE(r) << i;
    ASSERT_LT(r->handle, 400u);
    EXPECT_FALSE(seen[r->handle]);
    seen[r->handle] = true;
    EXPECT_EQ(r->error, 0u);
  }
  sender.join();
  EXPECT_EQ(srv_->stats().write_bytes, 400u * 16384);
}

// Case: a read-only export. Expect: READ_ONLY in the flags, no TRIM / WRITE_ZEROES flags;
// WRITE, TRIM and WRITE_ZEROES get EPERM; READ works.
TEST_F(NbdServerTest, ReadOnlyExport) {
  start();
  ExportInfo i = ram_->info();
  i.read_only = true;
  ram_->set_info(i);
  auto c = connect();
  const uint16_t f = c->go(false);
  EXPECT_TRUE(f & kTxReadOnly);
  EXPECT_FALSE(f & (kTxSendTrim | kTxSendWriteZeroes));
  expect_error(*c, kCmdWrite, 0, 0, 512, kEperm, pattern(512, 12));
  expect_error(*c, kCmdTrim, 0, 0, 512, kEperm);
  expect_error(*c, kCmdWriteZeroes, 0, 0, 512, kEperm);
  expect_error(*c, kCmdRead, 0, 0, 512, 0);
}

// Case: the export fails a submit and a completion; FAST_ZERO on an export that cannot zero
// fast. Expect: EIO in a simple reply without data (and the stream stays in step), EIO in an
// error chunk, ENOTSUP for FAST_ZERO.
TEST_F(NbdServerTest, ExportErrors) {
  start(true);
  ExportInfo i = ram_->info();
  i.fast_zero = false;
  ram_->set_info(i);
  auto c = ready(false);
  ram_->fail_next(ENOTCONN);
  expect_error(*c, kCmdRead, 0, 0, 4096, kEio);
  ram_->fail_next_completion(ETIMEDOUT);
  expect_error(*c, kCmdWrite, 0, 0, 4096, kEio, pattern(4096, 13));
  expect_error(*c, kCmdWriteZeroes, kCmdFlagFastZero, 0, 4096, kEnotsup);
  expect_error(*c, kCmdWriteZeroes, 0, 0, 4096, 0);
  write_read(*c, 0, pattern(4096, 14));
  auto s = ready(true);
  ram_->fail_next_completion(EIO);
  expect_error(*s, kCmdRead, 0, 0, 4096, kEio);
}

// Case: DISC with a request still held by the export. Expect: the request is answered, then
// the server closes.
TEST_F(NbdServerTest, DisconnectAfterOutstanding) {
  start(true);
  auto c = ready(false);
  ram_->hold();
  ASSERT_TRUE(c->request(kCmdRead, 0, 1, 0, 4096));
  ASSERT_TRUE(c->request(kCmdDisc, 0, 2, 0, 0));
  for (int i = 0; i < 500 && ram_->queued() < 1; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ram_->release(false);
  auto r = c->reply(4096);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->handle, 1u);
  EXPECT_TRUE(c->closed());
}

// Case: garbage instead of a handshake (an HTTP request, random bytes), a client that stops in
// the middle of an option, and one that sends half a request and leaves -- while another client
// does IO. Expect: the bad ones are closed cleanly, the good one never notices.
TEST_F(NbdServerTest, MisbehavingClientsDoNotDisturbOthers) {
  NbdServerOptions o;
  o.handshake_timeout = std::chrono::milliseconds(300);
  start(true, o);
  auto good = ready(true);
  auto http = connect();
  ASSERT_GE(http->handshake(0x47455420), -1);  // "GET " as client flags
  std::string get = "/ HTTP/1.1\r\nHost: x\r\n\r\n";
  http->send(Bytes(get.begin(), get.end()));
  auto noise = connect();
  noise->recv(18);
  noise->send(pattern(4096, 15));
  auto stuck = connect();
  ASSERT_GE(stuck->handshake(), 0);
  Bytes half;
  put64(half, kOptMagic);
  stuck->send(half);  // then nothing: the handshake deadline closes it
  auto leaver = ready(false);
  leaver->request(kCmdWrite, 0, 1, 0, 4096, pattern(100, 16));  // 100 of 4096 payload bytes
  ::shutdown(leaver->fd(), SHUT_WR);
  for (int i = 0; i < 20; ++i) write_read(*good, uint64_t(i) * 4096, pattern(4096, 100 + i));
  EXPECT_TRUE(http->closed());
  EXPECT_TRUE(noise->closed());
  EXPECT_TRUE(stuck->closed());
  EXPECT_TRUE(leaver->closed());
  write_read(*good, 0, pattern(65536, 17));
  EXPECT_GE(srv_->stats().protocol_errors, 2u);
}

// Case: more connections than max_connections. Expect: the extra one is closed at once, the
// others work.
TEST_F(NbdServerTest, ConnectionLimit) {
  NbdServerOptions o;
  o.max_connections = 2;
  start(false, o);
  auto a = ready(false);
  auto b = ready(false);
  auto extra = connect();
  EXPECT_TRUE(extra->closed());
  write_read(*a, 0, pattern(512, 18));
  write_read(*b, 512, pattern(512, 19));
  EXPECT_EQ(srv_->stats().refused, 1u);
}

// Case: stop() while a READ is held by the export, released from another thread later.
// Expect: stop waits for it, the connection is closed, serve_fd afterwards is ESHUTDOWN.
TEST_F(NbdServerTest, StopWaitsForInflight) {
  start(true);
  auto c = ready(false);
  ram_->hold();
  ASSERT_TRUE(c->request(kCmdRead, 0, 1, 0, 4096));
  for (int i = 0; i < 500 && ram_->queued() < 1; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  std::thread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ram_->release(false);
  });
  const auto t0 = std::chrono::steady_clock::now();
  srv_->stop();
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(80));
  later.join();
  EXPECT_TRUE(c->closed());
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  EXPECT_EQ(srv_->serve_fd(sv[0]).error().value(), ESHUTDOWN);
  ::close(sv[1]);
}

// Case: the listeners: loopback tcp with port 0 and a unix socket. Expect: the real port is
// reported, both accept NBD clients; the unix socket file is removed by stop().
TEST_F(NbdServerTest, TcpAndUnixListeners) {
  NbdServerOptions o;
  auto tcp = ListenSpec::parse_tcp("127.0.0.1:0");
  ASSERT_TRUE(tcp.ok());
  const std::string path = ::testing::TempDir() + "nbd-test-" + std::to_string(::getpid()) + ".sock";
  o.listen = {*tcp, ListenSpec::unix_socket(path)};
  start(false, o);
  ASSERT_EQ(srv_->listening().size(), 2u);
  const uint16_t port = srv_->listening()[0].port;
  EXPECT_NE(port, 0);
  {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
    Client c(fd);
    ASSERT_NE(c.go(true), 0);
    write_read(c, 0, pattern(4096, 20));
  }
  {
    int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::strcpy(sa.sun_path, path.c_str());
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
    Client c(fd);
    ASSERT_NE(c.go(false), 0);
    write_read(c, 4096, pattern(4096, 21));
  }
  srv_->stop();
  EXPECT_NE(::access(path.c_str(), F_OK), 0);
}

// ---------------------------------------------------------------------------------------------
// Request memory (Export::request_memory) and polled completions (Export::attach_loop)

bool wait_for(const std::function<bool()>& pred, std::chrono::milliseconds limit = std::chrono::seconds(5)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() >= end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

// Case: an export that lends 1 MiB of request memory; WRITE and READ of 4 KiB, 64 KiB and
// 1 MiB (simple and structured replies), then a READ of 2 MiB, larger than the memory.
// Expect: the data round-trips; every request up to 1 MiB had its buffer in the export's memory
// (no copy on the server's side); the 2 MiB READ is served from the server's own memory.
TEST_F(NbdServerTest, RequestMemoryCarriesReadAndWriteData) {
  start(true, {}, [](RamExport& r) { r.lend(1 << 20); });
  for (bool structured : {false, true}) {
    auto c = ready(structured);
    unsigned seed = structured ? 100 : 200;
    for (size_t n : {size_t{4096}, size_t{65536}, size_t{1} << 20}) write_read(*c, n, pattern(n, seed++));
  }
  EXPECT_EQ(ram_->in_memory.load(), 12);
  EXPECT_EQ(ram_->outside_memory.load(), 0);
  auto c = ready(false);
  const Bytes big = pattern(2 << 20, 7);
  auto d = ram_->snapshot();
  ASSERT_TRUE(c->request(kCmdRead, 0, 9, 0, 2 << 20));
  auto r = c->reply(2 << 20);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->error, 0u);
  EXPECT_EQ(std::memcmp(r->payload.data(), d.data(), 2 << 20), 0);
  EXPECT_EQ(ram_->outside_memory.load(), 1) << "larger than the memory: the server's own buffer";
  EXPECT_EQ(srv_->stats().memory_waits, 0u);
}

// Case: 16 pages of request memory, completions held, and 40 WRITEs of 4 KiB sent at once
// (each a different pattern), then everything released. Expect: at most 16 reach the export
// while held (the rest wait in the socket: memory_waits counts it), then all 40 are answered
// with success and every block reads back as written (nothing lost or mixed up).
TEST_F(NbdServerTest, RequestMemoryExhaustedRequestsWaitNothingLost) {
  start(true, {}, [](RamExport& r) { r.lend(16 * 4096); });
  auto c = ready(false);
  ram_->hold();
  std::vector<Bytes> data;
  for (unsigned i = 0; i < 40; ++i) data.push_back(pattern(4096, 300 + i));
  std::thread sender([&] {
    for (uint64_t h = 0; h < 40; ++h) ASSERT_TRUE(c->request(kCmdWrite, 0, h, h * 4096, 4096, data[h]));
  });
  ASSERT_TRUE(wait_for([&] { return ram_->queued() == 16; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(ram_->queued(), 16u) << "no more than the memory holds";
  EXPECT_GE(srv_->stats().memory_waits, 1u);
  ram_->release(false);
  std::vector<int> seen(40);
  for (int i = 0; i < 40; ++i) {
    auto r = c->reply();
    ASSERT_TRUE(r) << i;
    ASSERT_LT(r->handle, 40u);
    ++seen[r->handle];
    EXPECT_EQ(r->error, 0u);
  }
  sender.join();
  for (int n : seen) EXPECT_EQ(n, 1);
  auto snap = ram_->snapshot();
  for (size_t h = 0; h < 40; ++h)
    EXPECT_EQ(std::memcmp(snap.data() + h * 4096, data[h].data(), 4096), 0) << "block " << h;
  EXPECT_EQ(ram_->outside_memory.load(), 0);
}

// Case: a client sends the header of a 64 KiB WRITE and 1 KiB of its payload, then nothing,
// holding all 64 KiB of request memory; nobody else needs memory for a while, then a second
// client sends a READ. Expect: the stalled client is left alone while nobody waits; once the
// READ waits for memory, the stalled client is dropped (stall_timeout) and the READ answered.
TEST_F(NbdServerTest, AStalledWriterIsDroppedOnlyWhenOthersWaitForMemory) {
  NbdServerOptions o;
  o.stall_timeout = std::chrono::milliseconds(300);
  start(true, o, [](RamExport& r) { r.lend(64 << 10); });
  auto bad = ready(false);
  Bytes hdr;
  put32(hdr, kRequestMagic);
  put16(hdr, 0);
  put16(hdr, kCmdWrite);
  put64(hdr, 1);
  put64(hdr, 0);
  put32(hdr, 64 << 10);
  hdr.resize(hdr.size() + 1024, 0xab);
  ASSERT_TRUE(bad->send(hdr));
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  EXPECT_EQ(srv_->stats().stalls, 0u) << "nobody waited: the slow writer may take its time";
  auto good = ready(false);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(good->request(kCmdRead, 0, 5, 0, 4096));
  auto r = good->reply(4096);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->error, 0u);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  EXPECT_TRUE(bad->closed());
  EXPECT_EQ(srv_->stats().stalls, 1u);
  EXPECT_GE(srv_->stats().memory_waits, 1u);
}

// Case: a client sends 80 READs of 16 KiB (more than the 1 MiB of request memory) and never
// reads the replies, which fill its socket (small buffers); a second client sends a READ. Expect: the reader that
// does not read is dropped after stall_timeout, its memory comes back, and the second client
// is answered.
TEST_F(NbdServerTest, AClientThatDoesNotReadItsRepliesIsDroppedWhenOthersWait) {
  NbdServerOptions o;
  o.stall_timeout = std::chrono::milliseconds(300);
  start(true, o, [](RamExport& r) { r.lend(1 << 20); });
  // Small socket buffers, so that the replies do not all fit in the socket.
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  const int small = 16 << 10;
  for (int fd : sv) {
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  }
  ASSERT_TRUE(srv_->serve_fd(sv[0]).ok());
  auto bad = std::make_unique<Client>(sv[1]);
  ASSERT_NE(bad->go(false), 0);
  // More than the memory holds: the socket takes a few replies, the rest keep it all.
  for (uint64_t h = 0; h < 80; ++h) ASSERT_TRUE(bad->request(kCmdRead, 0, h, h * 16384, 16384));
  ASSERT_TRUE(wait_for([&] { return ram_->in_memory.load() >= 64; }));
  auto good = ready(true);
  ASSERT_TRUE(good->request(kCmdRead, 0, 5, 0, 4096));
  auto r = good->reply();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->error, 0u);
  EXPECT_EQ(r->type, kReplyOffsetData);
  EXPECT_EQ(srv_->stats().stalls, 1u);
  EXPECT_TRUE(bad->closed());
}

// Case: a client holds all the request memory with a WRITE whose payload stops midway, a
// second client's READ waits for it, and the first client disconnects. Expect: the memory
// comes back at once (the READ is answered well before the 30 s stall_timeout) and nobody is
// counted as stalled.
TEST_F(NbdServerTest, DisconnectMidPayloadGivesTheMemoryBack) {
  start(true, {}, [](RamExport& r) { r.lend(64 << 10); });
  auto bad = ready(false);
  Bytes hdr;
  put32(hdr, kRequestMagic);
  put16(hdr, 0);
  put16(hdr, kCmdWrite);
  put64(hdr, 1);
  put64(hdr, 0);
  put32(hdr, 64 << 10);
  hdr.resize(hdr.size() + 100, 0xcd);
  ASSERT_TRUE(bad->send(hdr));
  auto good = ready(false);
  ASSERT_TRUE(good->request(kCmdRead, 0, 5, 0, 4096));
  ASSERT_TRUE(wait_for([&] { return srv_->stats().memory_waits >= 1; }));
  const auto t0 = std::chrono::steady_clock::now();
  bad.reset();  // closes the socket
  auto r = good->reply(4096);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->error, 0u);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  EXPECT_EQ(srv_->stats().stalls, 0u);
  EXPECT_EQ(ram_->snapshot()[0], std::byte{0}) << "the unfinished WRITE changed nothing";
}

// Case: huge lengths against 64 KiB of request memory: a READ of the largest payload (32 MiB),
// a READ beyond it, a WRITE header claiming 4 GiB - 1. Expect: the 32 MiB READ is served from the
// server's own memory (the request memory is not pinned by it), the larger READ is EINVAL, the
// WRITE is EINVAL and closes the connection; another client still does IO in request memory.
TEST_F(NbdServerTest, HugeLengthsDoNotPinTheRequestMemory) {
  start(true, {}, [](RamExport& r) { r.lend(64 << 10); });
  auto c = ready(false);
  ASSERT_TRUE(c->request(kCmdRead, 0, 1, 0, 32u << 20));
  // The export is 4 MiB: beyond it, EINVAL without the export being asked.
  auto r = c->reply();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->error, kEinval);
  expect_error(*c, kCmdRead, 0, 0, (32u << 20) + 512, kEinval);
  ExportInfo i = ram_->info();
  EXPECT_EQ(ram_->outside_memory.load() + ram_->in_memory.load(), 0) << "refused before the export";
  (void)i;
  ASSERT_TRUE(c->request(kCmdWrite, 0, 2, 0, 0xffffffffu));
  auto w = c->reply();
  ASSERT_TRUE(w);
  EXPECT_EQ(w->error, kEinval);
  EXPECT_TRUE(c->closed());
  auto good = ready(false);
  write_read(*good, 4096, pattern(8192, 8));
  EXPECT_EQ(ram_->in_memory.load(), 2);
}

// Case: an export whose completions the loop polls (attach_loop's eventfd, run in poll_loop),
// every 5th completing on its worker thread instead; 300 WRITEs and READs of a pattern at depth
// 32 over one connection. Expect: every request answered once with the right data; the polled
// completions ran on the loop thread; detach_loop runs once the server stops.
TEST_F(NbdServerTest, PolledCompletionsRunOnTheLoopThread) {
  start(true, {}, [](RamExport& r) {
    r.lend(1 << 20);
    r.polled(5);
  });
  auto c = ready(true);
  std::vector<Bytes> data;
  for (unsigned i = 0; i < 150; ++i) data.push_back(pattern(4096, 500 + i));
  for (int phase = 0; phase < 2; ++phase) {
    std::thread sender([&] {
      for (uint64_t h = 0; h < 150; ++h) {
        if (phase == 0) ASSERT_TRUE(c->request(kCmdWrite, 0, h, h * 4096, 4096, data[h]));
        else ASSERT_TRUE(c->request(kCmdRead, 0, h, h * 4096, 4096));
      }
    });
    std::vector<int> seen(150);
    for (int i = 0; i < 150; ++i) {
      auto r = c->reply();
      ASSERT_TRUE(r) << i;
      ASSERT_LT(r->handle, 150u);
      ++seen[r->handle];
      EXPECT_EQ(r->error, 0u);
      if (phase == 1) {
        ASSERT_EQ(r->payload.size(), 8u + 4096);
        EXPECT_EQ(std::memcmp(r->payload.data() + 8, data[r->handle].data(), 4096), 0) << r->handle;
      }
    }
    sender.join();
    for (int n : seen) EXPECT_EQ(n, 1);
  }
  EXPECT_GE(ram_->polled_done.load(), 200);
  EXPECT_EQ(ram_->off_loop.load(), 0);
  srv_->stop();
  EXPECT_EQ(ram_->detached.load(), 1);
}

// Case: the server stops while a client that never reads has replies stuck in its socket.
// Expect: stop() returns within about the drain bound (here stall_timeout, 300 ms), instead of
// waiting for that client forever.
TEST_F(NbdServerTest, StopDoesNotWaitForAClientThatDoesNotRead) {
  NbdServerOptions o;
  o.stall_timeout = std::chrono::milliseconds(300);
  start(true, o);
  auto bad = ready(false);
  for (uint64_t h = 0; h < 64; ++h) ASSERT_TRUE(bad->request(kCmdRead, 0, h, h * 65536, 65536));
  ASSERT_TRUE(wait_for([&] { return srv_->stats().requests >= 8; }));
  const auto t0 = std::chrono::steady_clock::now();
  srv_->stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  EXPECT_TRUE(bad->closed());
}


TEST(NbdListenSpec, Parse) {
  auto a = ListenSpec::parse_tcp("127.0.0.1:10809");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->port, 10809);
  EXPECT_TRUE(a->is_local());
  EXPECT_EQ(a->to_string(), "tcp:127.0.0.1:10809");
  auto b = ListenSpec::parse_tcp("[::1]:0");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->host, "::1");
  EXPECT_TRUE(b->is_local());
  EXPECT_EQ(b->to_string(), "tcp:[::1]:0");
  auto c = ListenSpec::parse_tcp("0.0.0.0:1");
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->is_local());
  EXPECT_EQ(ListenSpec::parse_tcp("5000")->host, "127.0.0.1");
  EXPECT_EQ(ListenSpec::parse_tcp("localhost:5")->host, "127.0.0.1");
  for (const char* bad : {"", "x:1", "1.2.3.4:", "1.2.3.4:70000", "::1:5", "[::1]5", "host.example:1"})
    EXPECT_FALSE(ListenSpec::parse_tcp(bad).ok()) << bad;
  EXPECT_TRUE(ListenSpec::unix_socket("/x").is_local());
}

TEST(NbdWire, BigEndianHelpers) {
  wire::be32 v;
  v.set(0x01020304u);
  EXPECT_EQ(v.b[0], 1);
  EXPECT_EQ(v.b[3], 4);
  EXPECT_EQ(v.get(), 0x01020304u);
  wire::be64 w;
  w.set(wire::kOptMagic);
  EXPECT_EQ(std::string(reinterpret_cast<char*>(w.b), 8), "IHAVEOPT");
}

}  // namespace
}  // namespace ibnbd::nbd::test
