// libFuzzer entry point (clang -fsanitize=fuzzer).
#include "tcp_rx_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return ibtrs::fuzz::tcp_rx_one_input(data, size);
}
