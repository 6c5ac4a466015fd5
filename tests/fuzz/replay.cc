// Without libFuzzer: writes a target's seed corpus (--write-seeds TARGET DIR), or replays its
// seeds plus deterministic mutations of them (TARGET [ROUNDS]), so every build runs the fuzz
// targets' code paths.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>

#include "auth_target.h"
#include "proto_target.h"
#include "tcp_rx_target.h"
#ifdef IBTRS_FUZZ_IBNBD
#include "ibnbd_proto_target.h"
#endif
#ifdef IBTRS_FUZZ_QEMU_MIGRATE
#include "qemu_rdma_target.h"
#include "qemu_stream_target.h"
#endif

namespace {

struct Target {
  const char* name;
  int (*one)(const uint8_t*, size_t);
  std::vector<std::vector<uint8_t>> (*seeds)();
};

const Target kTargets[] = {
    {"tcp_rx", ibtrs::fuzz::tcp_rx_one_input, ibtrs::fuzz::tcp_rx_seeds},
    {"proto", ibtrs::fuzz::proto_one_input, ibtrs::fuzz::proto_seeds},
    {"auth", ibtrs::fuzz::auth_one_input, ibtrs::fuzz::auth_seeds},
#ifdef IBTRS_FUZZ_IBNBD
    {"ibnbd_proto", ibnbd::fuzz::proto_one_input, ibnbd::fuzz::proto_seeds},
#endif
#ifdef IBTRS_FUZZ_QEMU_MIGRATE
    {"qemu_rdma", ibnbd::fuzz::qemu_rdma_one_input, ibnbd::fuzz::qemu_rdma_seeds},
    {"qemu_stream", ibnbd::fuzz::qemu_stream_one_input, ibnbd::fuzz::qemu_stream_seeds},
#endif
};

const Target* find(const char* name) {
  for (const Target& t : kTargets) {
    if (std::strcmp(t.name, name) == 0) return &t;
  }
  std::fprintf(stderr, "unknown fuzz target '%s'\n", name);
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 4 && std::strcmp(argv[1], "--write-seeds") == 0) {
    const Target* t = find(argv[2]);
    if (t == nullptr) return 2;
    auto seeds = t->seeds();
    for (size_t i = 0; i < seeds.size(); ++i) {
      std::ofstream f(std::string(argv[3]) + "/seed-" + std::to_string(i), std::ios::binary);
      f.write(reinterpret_cast<const char*>(seeds[i].data()), static_cast<std::streamsize>(seeds[i].size()));
      if (!f) {
        std::fprintf(stderr, "cannot write seeds into %s\n", argv[3]);
        return 1;
      }
    }
    return 0;
  }
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr, "usage: fuzz-replay TARGET [ROUNDS] | --write-seeds TARGET DIR\n");
    return 2;
  }
  const Target* t = find(argv[1]);
  if (t == nullptr) return 2;
  const int rounds = argc == 3 ? std::atoi(argv[2]) : 20000;
  auto seeds = t->seeds();
  std::mt19937_64 rng(12345);
  size_t runs = 0;
  for (const auto& s : seeds) {
    t->one(s.data(), s.size());
    ++runs;
  }
  for (int r = 0; r < rounds; ++r) {
    auto input = seeds[rng() % seeds.size()];
    const int edits = 1 + static_cast<int>(rng() % 8);
    for (int e = 0; e < edits && !input.empty(); ++e) {
      size_t at = rng() % input.size();
      switch (rng() % 4) {
        case 0: input[at] = static_cast<uint8_t>(rng()); break;
        case 1: input[at] ^= static_cast<uint8_t>(1u << (rng() % 8)); break;
        case 2: input.resize(at); break;
        default: input.insert(input.begin() + static_cast<ptrdiff_t>(at), static_cast<uint8_t>(rng())); break;
      }
    }
    t->one(input.data(), input.size());
    ++runs;
  }
  std::printf("%s replay: %zu inputs, no fault\n", t->name, runs);
  return 0;
}
