// libFuzzer entry point (clang -fsanitize=fuzzer).
#include "ibnbd_proto_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return ibnbd::fuzz::proto_one_input(data, size);
}
