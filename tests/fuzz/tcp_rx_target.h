// Fuzz target for the tcp provider's frame decoder (fabric/tcp/tcp_rx): arbitrary bytes from a
// peer must never place a byte outside a registered region, crash, or hang.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ibtrs::fuzz {

// Runs one input through an RxEngine. Returns 0 (libFuzzer convention).
int tcp_rx_one_input(const uint8_t* data, size_t size);

// Well-formed streams that reach every frame type, to seed the corpus.
std::vector<std::vector<uint8_t>> tcp_rx_seeds();

}  // namespace ibtrs::fuzz
