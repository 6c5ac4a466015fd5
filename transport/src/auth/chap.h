// DH-HMAC-CHAP (NVMe TP 8006) as the IBTRS service connection runs it: the computations of one
// exchange, free of sockets so that the unit tests and the fuzzer drive them directly. The
// messages that carry the values are in proto/ibtrs_proto.h; the order of the exchange is in
// docs/protocol.md, "Authentication".
//
//   server                                   client
//   AUTH_CHALLENGE  tid, S1, C1, g^x  ---->
//                                     <----  AUTH_REPLY  tid, host, g^y, R1 [, S2, C2]
//   AUTH_SUCCESS    [R2]              ---->  (or AUTH_FAILURE)
//
//   Z   = X25519(x, g^y) = X25519(y, g^x)      the ephemeral shared secret
//   Ca  = HMAC(SHA-256(Z), C1)                 the augmented challenge (TP 8006)
//   Kh  = transform(host key, host id)         see ibtrs/auth.h
//   R1  = HMAC(Kh, Ca || le32 S1 || le16 tid || 00 || "HostHost" || host || 00 || binding)
//   R2  = HMAC(Kc, HMAC(SHA-256(Z), C2) || le32 S2 || le16 tid || 00 || "Controller"
//              || binding || 00 || host)
// where `binding` stands where TP 8006 has the subsystem NQN: the session uuid, path uuid,
// session name and path name of the path being authenticated, so a response proves the secret
// for this path of this session and no other. All HMACs are HMAC-SHA-256.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "auth/crypto.h"
#include "ibtrs/auth.h"
#include "ibtrs/result.h"

namespace ibtrs::auth {

inline constexpr size_t kDigestLen = 32;  // SHA-256
inline constexpr size_t kNonceLen = 32;   // C1, C2: the hash length, as TP 8006 requires
using Digest = std::array<uint8_t, kDigestLen>;
using Nonce = std::array<uint8_t, kNonceLen>;

// What a response is bound to besides the challenge.
struct Transcript {
  uint16_t tid = 0;
  std::array<uint8_t, 16> sess_uuid{};
  std::array<uint8_t, 16> path_uuid{};
  std::string sessname;
  std::string pathname;
  std::string host;
};

// The HMAC key of a secret for `id` (TP 8006; Linux: nvme_auth_transform_key): the secret as is, or
// HMAC-H(secret, id || "NVMe-over-Fabrics") with H of the secret's transform. The caller wipes
// it (cleanse) when done.
Result<std::vector<uint8_t>> transform_key(const Secret& s, std::string_view id);
// Ca = HMAC-SHA-256(SHA-256(Z), challenge).
Result<Digest> augmented_challenge(const X25519Key& z, const Nonce& challenge);
// R1, from the host key transformed for the host id.
Result<Digest> host_response(std::span<const uint8_t> key, const Digest& ca, uint32_t seq,
                             const Transcript& t);
// R2, from the server key transformed for the host id.
Result<Digest> server_response(std::span<const uint8_t> key, const Digest& ca2, uint32_t seq,
                               const Transcript& t);

// Convenience for both sides: R1 or R2 straight from a Secret (transform, compute, wipe).
enum class Role : uint8_t { host, server };
Result<Digest> response(Role role, const Secret& s, const X25519Key& z, const Nonce& challenge,
                        uint32_t seq, const Transcript& t);

}  // namespace ibtrs::auth
