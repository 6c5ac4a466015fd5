// Fuzz target for the QEMU migration stream parser and its RDMA rewriters
// (client/migrate/src/qemu_ram_stream.h). Whatever the stream, the parser reports the same
// events and verdict fed whole or in pieces; pages lie inside their blocks; and a stream the
// restore splitter accepts comes back from the save rewriter as a stream with the same pages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ibnbd::fuzz {

int qemu_stream_one_input(const uint8_t* data, size_t size);
std::vector<std::vector<uint8_t>> qemu_stream_seeds();

}  // namespace ibnbd::fuzz
