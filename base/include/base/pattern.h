// One test-data pattern for the tests and tools (tests/blockdev, tests/integration, ibtrs-load,
// the soak's stamps): the bytes a device holds after a write with pattern `seed`, as a pure
// function of the seed and the device offset. Any range can be filled or checked on its own
// without keeping what was written, and data read back from the wrong offset or of another
// seed (another generation, another run) does not match.
//
// Word-wise: the 8-byte word at device offset 8k is mix64(k ^ salt(seed)), stored little-endian,
// so fill and check cost one multiply-xor chain and one 8-byte store or compare per word (GB/s,
// what ibtrs-load --verify needs at full speed); only a range's unaligned head and tail go byte
// by byte.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace base {

inline constexpr uint64_t kGolden64 = 0x9E3779B97F4A7C15ull;  // 2^64 / phi: splitmix64's step

// splitmix64's finalizer: a bijection on 64-bit words that mixes every input bit into every
// output bit.
constexpr uint64_t mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// splitmix64: advances the state `x` and returns the next value of its sequence (the same on
// every platform, unlike the standard library's distributions).
constexpr uint64_t splitmix64(uint64_t& x) { return mix64(x += kGolden64); }

class Pattern {
 public:
  explicit constexpr Pattern(uint64_t seed) : salt_(mix64(seed * kGolden64 + 1)) {}

  // The word at device offset `off` (rounded down to a multiple of 8) as a number; its bytes lie
  // on the device least significant first.
  constexpr uint64_t word(uint64_t off) const { return mix64((off >> 3) ^ salt_); }
  constexpr std::byte byte(uint64_t off) const {
    return static_cast<std::byte>(word(off) >> ((off & 7) * 8));
  }

  // Fills `b`, which lies at device offset `dev_off`.
  void fill(std::span<std::byte> b, uint64_t dev_off) const {
    size_t i = 0;
    for (; i < b.size() && ((dev_off + i) & 7) != 0; ++i) b[i] = byte(dev_off + i);
    for (; i + 8 <= b.size(); i += 8) store(b.data() + i, word(dev_off + i));
    for (; i < b.size(); ++i) b[i] = byte(dev_off + i);
  }

  // Index in `b` (at device offset `dev_off`) of the first byte that differs from the pattern,
  // or -1 when all match.
  int64_t check(std::span<const std::byte> b, uint64_t dev_off) const {
    size_t i = 0;
    for (; i < b.size() && ((dev_off + i) & 7) != 0; ++i)
      if (b[i] != byte(dev_off + i)) return static_cast<int64_t>(i);
    for (; i + 8 <= b.size(); i += 8)
      if (load(b.data() + i) != word(dev_off + i)) break;  // the byte loop below finds which
    for (; i < b.size(); ++i)
      if (b[i] != byte(dev_off + i)) return static_cast<int64_t>(i);
    return -1;
  }

 private:
  static constexpr uint64_t to_le(uint64_t w) {
    if constexpr (std::endian::native == std::endian::big) return __builtin_bswap64(w);
    return w;
  }
  static void store(std::byte* p, uint64_t w) {
    w = to_le(w);
    std::memcpy(p, &w, 8);
  }
  static uint64_t load(const std::byte* p) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    return to_le(w);
  }

  uint64_t salt_;
};

inline void fill_pattern(std::span<std::byte> b, uint64_t seed, uint64_t dev_off) {
  Pattern(seed).fill(b, dev_off);
}
inline int64_t check_pattern(std::span<const std::byte> b, uint64_t seed, uint64_t dev_off) {
  return Pattern(seed).check(b, dev_off);
}

}  // namespace base
