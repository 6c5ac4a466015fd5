// Fuzz target for the IBTRS message decoders (proto/ibtrs_proto.h): CON_REQ, CON_RSP, INFO_REQ,
// INFO_RSP and IO messages in a chunk. Whatever a peer sends, a decoder returns an error or
// views that lie inside the bytes it was given.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ibtrs::fuzz {

int proto_one_input(const uint8_t* data, size_t size);
std::vector<std::vector<uint8_t>> proto_seeds();

}  // namespace ibtrs::fuzz
