// libFuzzer entry point (clang -fsanitize=fuzzer).
#include "auth_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return ibtrs::fuzz::auth_one_input(data, size);
}
