// Without libFuzzer: writes the seed corpus (--write-seeds DIR), or replays the seeds plus
// deterministic mutations of them, so every build runs the fuzz target's code paths.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>

#include "tcp_rx_target.h"

int main(int argc, char** argv) {
  auto seeds = ibtrs::fuzz::tcp_rx_seeds();
  if (argc == 3 && std::strcmp(argv[1], "--write-seeds") == 0) {
    for (size_t i = 0; i < seeds.size(); ++i) {
      std::ofstream f(std::string(argv[2]) + "/seed-" + std::to_string(i), std::ios::binary);
      f.write(reinterpret_cast<const char*>(seeds[i].data()), static_cast<std::streamsize>(seeds[i].size()));
      if (!f) {
        std::fprintf(stderr, "cannot write seeds into %s\n", argv[2]);
        return 1;
      }
    }
    return 0;
  }
  const int rounds = argc == 2 ? std::atoi(argv[1]) : 20000;
  std::mt19937_64 rng(12345);
  size_t runs = 0;
  for (const auto& s : seeds) {
    ibtrs::fuzz::tcp_rx_one_input(s.data(), s.size());
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
    ibtrs::fuzz::tcp_rx_one_input(input.data(), input.size());
    ++runs;
  }
  std::printf("tcp_rx replay: %zu inputs, no fault\n", runs);
  return 0;
}
