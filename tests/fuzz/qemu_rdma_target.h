// Fuzz target for QEMU's RDMA migration control channel (client/migrate/src/qemu_rdma_wire.h):
// the capabilities and every control message, decoded with and without a RAM layout. Whatever a
// peer sends, the decoder refuses it or returns fields inside the layout (a registration span
// inside its block, a COMPRESS range inside one chunk) that encode back to a message decoding to
// the same fields.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ibnbd::fuzz {

int qemu_rdma_one_input(const uint8_t* data, size_t size);
std::vector<std::vector<uint8_t>> qemu_rdma_seeds();

}  // namespace ibnbd::fuzz
