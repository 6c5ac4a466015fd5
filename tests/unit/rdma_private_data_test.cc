// The rdma provider's private-data encoding (fabric/rdma/rdma_private_data.h), device-free.
#include <gtest/gtest.h>

#include <vector>

#include "fabric/rdma/rdma_private_data.h"

namespace ibtrs::fabric::rdma_pd {
namespace {

// Case: every connect length 0..56 encoded into the REQ's two 3-bit fields.
// Expect: the passive side (which sees the fields swapped) decodes the same length; both fields
// stay <= 7 so librdmacm accepts them on any device.
TEST(RdmaPrivateData, ReqLengthRoundTripsThroughSwappedFields) {
  for (size_t len = 0; len <= kMaxPrivateData; ++len) {
    ReqLength e = encode_req_length(len);
    EXPECT_LE(e.responder_resources, 7);
    EXPECT_LE(e.initiator_depth, 7);
    // cm_format_req_event reports the REQ from the responder's side: the fields are swapped.
    auto d = decode_req_length(e.initiator_depth, e.responder_resources, kReqRoom);
    ASSERT_TRUE(d.has_value()) << len;
    EXPECT_EQ(*d, len);
  }
}

TEST(RdmaPrivateData, ForeignReqFieldsAreNotOurs) {
  EXPECT_FALSE(decode_req_length(8, 0, 56).has_value()) << "field above 7";
  EXPECT_FALSE(decode_req_length(1, 7, 56).has_value()) << "57 bytes";
  EXPECT_FALSE(decode_req_length(3, 1, 10).has_value()) << "longer than what arrived";
}

TEST(RdmaPrivateData, ReplyRoundTripsEveryLength) {
  for (size_t len = 0; len <= kMaxPrivateData; ++len) {
    std::vector<std::byte> data(len);
    for (size_t i = 0; i < len; ++i) data[i] = static_cast<std::byte>(i + 1);
    std::byte wire[148] = {};  // what an IB CM REJ delivers: zero padded to its field size
    std::byte out[kReplyMax];
    size_t n = encode_reply(data, out);
    EXPECT_EQ(n, kHeaderSize + len);
    std::memcpy(wire, out, n);
    auto got = decode_reply(std::span<const std::byte>(wire, sizeof(wire)));
    ASSERT_TRUE(got.has_value()) << len;
    EXPECT_EQ(std::vector<std::byte>(got->begin(), got->end()), data);
  }
}

TEST(RdmaPrivateData, ReplyWithoutOurHeaderIsRejected) {
  std::byte zeros[148] = {};  // what the CM itself sends when nobody listens
  EXPECT_FALSE(decode_reply(zeros).has_value());
  std::byte bad_len[8] = {std::byte{'I'}, std::byte{'B'}, std::byte{1}, std::byte{57}};
  EXPECT_FALSE(decode_reply(bad_len).has_value());
  std::byte short_buf[6] = {std::byte{'I'}, std::byte{'B'}, std::byte{1}, std::byte{5}};
  EXPECT_FALSE(decode_reply(short_buf).has_value()) << "claims more than arrived";
}

}  // namespace
}  // namespace ibtrs::fabric::rdma_pd
