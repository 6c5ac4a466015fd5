// libFuzzer entry point (clang -fsanitize=fuzzer).
#include "qemu_stream_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return ibnbd::fuzz::qemu_stream_one_input(data, size);
}
