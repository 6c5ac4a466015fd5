// The OpenSSL glue of host authentication, and nothing else: the primitives DH-HMAC-CHAP needs
// (docs/security.d/auth.md), each a thin, checked wrapper around OpenSSL 3's EVP interface, so
// that no code of ours does cryptography itself. CRC-32 and base64 are here too because the
// DHHC-1 secret representation needs them (zlib's crc32, OpenSSL's EVP base64).
//
// Every function is thread-safe (OpenSSL 3 needs no locking callbacks) and may be called from
// any thread. Failures of OpenSSL itself (out of memory, a missing algorithm in a crippled
// build) come back as EIO; bad arguments as EINVAL.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ibtrs/result.h"

namespace ibtrs::auth {

using Bytes = std::span<const uint8_t>;

// Hash functions by their TP 8006 identifier (the DHHC-1 "hh" field and the HashID of the
// messages): 1 SHA-256, 2 SHA-384, 3 SHA-512.
enum class Hash : uint8_t { sha256 = 1, sha384 = 2, sha512 = 3 };
size_t hash_len(Hash h);

// Cryptographically secure random bytes (RAND_bytes, seeded from the kernel's getrandom).
Status random_bytes(std::span<uint8_t> out);

// Message digest of the concatenation of `parts`. `out` must hold hash_len(h) bytes.
Status digest(Hash h, std::span<const Bytes> parts, std::span<uint8_t> out);
// HMAC (RFC 2104) keyed with `key` over the concatenation of `parts`. `out` holds hash_len(h).
Status hmac(Hash h, Bytes key, std::span<const Bytes> parts, std::span<uint8_t> out);

// Compares in time independent of where the inputs differ (CRYPTO_memcmp). Different lengths
// compare unequal (the lengths are not secret).
bool equal_ct(Bytes a, Bytes b);

// Overwrites memory the compiler may not optimise away (OPENSSL_cleanse).
void cleanse(std::span<uint8_t> mem);

// X25519 (RFC 7748) key agreement: an ephemeral key pair per exchange.
inline constexpr size_t kX25519Len = 32;
using X25519Key = std::array<uint8_t, kX25519Len>;
class X25519 {
 public:
  // A fresh random key pair.
  static Result<X25519> generate();
  // A key pair from a given private key (known-answer tests).
  static Result<X25519> from_private(Bytes priv);
  X25519(X25519&&) noexcept;
  X25519& operator=(X25519&&) noexcept;
  ~X25519();

  const X25519Key& public_key() const { return pub_; }
  // The shared secret with the peer's public key. EINVAL when the peer's value is a low-order
  // point (the result would be all zeros: RFC 7748 section 6.1 says to refuse it).
  Result<X25519Key> derive(Bytes peer_public) const;

 private:
  X25519() = default;
  struct Pkey;
  std::unique_ptr<Pkey> key_;
  X25519Key pub_{};
};

// Base64 (RFC 4648, with padding, no line breaks).
std::string base64_encode(Bytes data);
// EINVAL on characters outside the alphabet, bad padding or a length not a multiple of 4.
Result<std::vector<uint8_t>> base64_decode(std::string_view text);

// CRC-32 (IEEE 802.3, zlib's crc32): the check value of a DHHC-1 secret.
uint32_t crc32(Bytes data);

// Lowercase hexadecimal.
std::string to_hex(Bytes data);

}  // namespace ibtrs::auth
