// The integration scenarios' main: --fabric=loopback|tcp picks the fabric of every server and
// session (loopback by default), --seed=N replays the random choices of a failed run.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "integration_harness.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--fabric=", 0) == 0) {
      auto k = ibtrs::parse_fabric_kind(a.substr(9));
      if (!k.ok() || *k == ibtrs::FabricKind::rdma) {
        std::fprintf(stderr, "--fabric: loopback or tcp\n");
        return 2;
      }
      ibnbd::itest::g_kind = *k;
    } else if (a.rfind("--seed=", 0) == 0) {
      ibnbd::itest::g_seed = std::strtoull(a.c_str() + 7, nullptr, 0);
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  return RUN_ALL_TESTS();
}
