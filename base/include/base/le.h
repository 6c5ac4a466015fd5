// Wire integers: little-endian (IBTRS, IBNBD, the migration image) and big-endian (network byte
// order: NBD, QEMU's RDMA migration protocol). Wire structs are built from these (alignment 1,
// trivially copyable), so their layout is the same on every host and no packing pragma is needed.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace base {

template <typename T>
struct Le {
  static_assert(std::is_unsigned_v<T>, "wire integers are unsigned");
  unsigned char b[sizeof(T)];

  T get() const {
    T v = 0;
    for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(static_cast<T>(b[i]) << (8 * i));
    return v;
  }
  void set(T v) {
    for (size_t i = 0; i < sizeof(T); ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
  }
};

using le16 = Le<uint16_t>;
using le32 = Le<uint32_t>;
using le64 = Le<uint64_t>;
static_assert(sizeof(le16) == 2 && alignof(le16) == 1);
static_assert(sizeof(le32) == 4 && alignof(le32) == 1);
static_assert(sizeof(le64) == 8 && alignof(le64) == 1);

template <typename T>
struct Be {
  static_assert(std::is_unsigned_v<T>, "wire integers are unsigned");
  unsigned char b[sizeof(T)];

  T get() const {
    T v = 0;
    for (size_t i = 0; i < sizeof(T); ++i) v = static_cast<T>((v << 8) | b[i]);
    return v;
  }
  void set(T v) {
    for (size_t i = sizeof(T); i-- > 0;) {
      b[i] = static_cast<unsigned char>(v & 0xff);
      v = static_cast<T>(sizeof(T) > 1 ? v >> 8 : 0);
    }
  }
};

using be16 = Be<uint16_t>;
using be32 = Be<uint32_t>;
using be64 = Be<uint64_t>;
static_assert(sizeof(be16) == 2 && alignof(be16) == 1);
static_assert(sizeof(be32) == 4 && alignof(be32) == 1);
static_assert(sizeof(be64) == 8 && alignof(be64) == 1);

// Checks that a wire struct has exactly the size the protocol document gives it.
#define BASE_WIRE_STRUCT(T, size)                                                   \
  static_assert(sizeof(T) == (size), #T " must be " #size " bytes on the wire");   \
  static_assert(std::is_trivially_copyable_v<T>, #T " must be trivially copyable"); \
  static_assert(alignof(T) == 1, #T " must have no padding requirements")

}  // namespace base
