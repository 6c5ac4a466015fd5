// Fuzz target for host authentication's peer input: the AUTH_* messages (proto/ibtrs_proto.h),
// what each side computes from them (auth/chap.h: X25519 with a peer's public value, the
// responses), and DHHC-1 secret text (ibtrs/auth.h). Whatever a peer sends, a decoder returns an
// error or a message that encodes back to the same bytes, and nothing crashes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ibtrs::fuzz {

int auth_one_input(const uint8_t* data, size_t size);
std::vector<std::vector<uint8_t>> auth_seeds();

}  // namespace ibtrs::fuzz
