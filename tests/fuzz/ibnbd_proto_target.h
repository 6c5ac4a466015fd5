// Fuzz target for the IBNBD block protocol decoders (blockdev/src/proto/ibnbd_proto.h): the
// server's decode_request with any carrier, the client's SESS_INFO_RSP, OPEN_RSP, WATCH_RSP and
// BLOCK_STATUS_RSP decoders, and the rw word. Whatever a peer sends, a decoder refuses it or returns a message that
// encodes back to the same bytes and fits its carrier.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ibnbd::fuzz {

int proto_one_input(const uint8_t* data, size_t size);
std::vector<std::vector<uint8_t>> proto_seeds();

}  // namespace ibnbd::fuzz
