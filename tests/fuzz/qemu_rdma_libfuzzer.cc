// libFuzzer entry point (clang -fsanitize=fuzzer).
#include "qemu_rdma_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return ibnbd::fuzz::qemu_rdma_one_input(data, size);
}
