#include "auth/chap.h"

namespace ibtrs::auth {

namespace {

constexpr std::string_view kTransformLabel = "NVMe-over-Fabrics";
constexpr std::string_view kHostLabel = "HostHost";
constexpr std::string_view kServerLabel = "Controller";

Bytes bytes_of(std::string_view s) { return {reinterpret_cast<const uint8_t*>(s.data()), s.size()}; }

// The identity part every response covers, after the label: the session and path this
// exchange authenticates.
std::string binding(const Transcript& t) {
  std::string b;
  b.append(reinterpret_cast<const char*>(t.sess_uuid.data()), t.sess_uuid.size());
  b.append(reinterpret_cast<const char*>(t.path_uuid.data()), t.path_uuid.size());
  b.append(t.sessname);
  b.push_back('\0');
  b.append(t.pathname);
  return b;
}

Result<Digest> respond(std::span<const uint8_t> key, const Digest& ca, uint32_t seq,
                       const Transcript& t, std::string_view label, std::string_view first,
                       std::string_view second) {
  const uint8_t s[4] = {static_cast<uint8_t>(seq), static_cast<uint8_t>(seq >> 8),
                        static_cast<uint8_t>(seq >> 16), static_cast<uint8_t>(seq >> 24)};
  const uint8_t tid[2] = {static_cast<uint8_t>(t.tid), static_cast<uint8_t>(t.tid >> 8)};
  const uint8_t zero[1] = {0};
  const Bytes parts[] = {ca, s, tid, zero, bytes_of(label), bytes_of(first), zero, bytes_of(second)};
  Digest out{};
  BASE_TRY(hmac(Hash::sha256, key, parts, out));
  return out;
}

}  // namespace

Result<std::vector<uint8_t>> transform_key(const Secret& s, std::string_view id) {
  if (s.empty()) return errc(EINVAL);
  if (s.transform() == Secret::Transform::none) return s.bytes();
  const auto h = static_cast<Hash>(s.transform());
  std::vector<uint8_t> out(hash_len(h));
  const Bytes parts[] = {bytes_of(id), bytes_of(kTransformLabel)};
  BASE_TRY(hmac(h, s.bytes(), parts, out));
  return out;
}

Result<Digest> augmented_challenge(const X25519Key& z, const Nonce& challenge) {
  Digest hz{};
  const Bytes zp[] = {z};
  BASE_TRY(digest(Hash::sha256, zp, hz));
  Digest out{};
  const Bytes cp[] = {challenge};
  auto st = hmac(Hash::sha256, hz, cp, out);
  cleanse(hz);
  if (!st.ok()) return st.error();
  return out;
}

Result<Digest> host_response(std::span<const uint8_t> key, const Digest& ca, uint32_t seq,
                             const Transcript& t) {
  return respond(key, ca, seq, t, kHostLabel, t.host, binding(t));
}

Result<Digest> server_response(std::span<const uint8_t> key, const Digest& ca2, uint32_t seq,
                               const Transcript& t) {
  return respond(key, ca2, seq, t, kServerLabel, binding(t), t.host);
}

Result<Digest> response(Role role, const Secret& s, const X25519Key& z, const Nonce& challenge,
                        uint32_t seq, const Transcript& t) {
  BASE_ASSIGN_OR_RETURN(auto ca, augmented_challenge(z, challenge));
  BASE_ASSIGN_OR_RETURN(auto key, transform_key(s, t.host));
  auto r = role == Role::host ? host_response(key, ca, seq, t) : server_response(key, ca, seq, t);
  cleanse(key);
  cleanse(ca);
  return r;
}

}  // namespace ibtrs::auth
