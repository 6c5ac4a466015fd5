// TLS pre-shared keys derived from host keys (ibtrs/auth.h): the only place their derivation
// lives, so the client that offers one and the server that looks it up cannot disagree.
#include <cstring>

#include "auth/chap.h"
#include "auth/crypto.h"
#include "ibtrs/auth.h"

namespace ibtrs {

namespace {

constexpr std::string_view kLabel = "IBNBD TLS PSK 1";

Result<std::vector<std::byte>> derive(std::string_view host, const Secret& key) {
  if (!valid_host_id(host) || key.empty()) return errc(EINVAL);
  BASE_ASSIGN_OR_RETURN(auto kh, auth::transform_key(key, host));
  std::vector<uint8_t> out(auth::hash_len(auth::Hash::sha256));
  const auth::Bytes parts[] = {
      auth::Bytes(reinterpret_cast<const uint8_t*>(kLabel.data()), kLabel.size()),
      auth::Bytes(reinterpret_cast<const uint8_t*>(host.data()), host.size()),
  };
  auto st = auth::hmac(auth::Hash::sha256, kh, parts, out);
  auth::cleanse(kh);
  if (!st.ok()) return st.error();
  std::vector<std::byte> k(out.size());
  std::memcpy(k.data(), out.data(), out.size());
  auth::cleanse(out);
  return k;
}

}  // namespace

Result<tls::Psk> tls_psk_of(std::string_view host, const Secret& key) {
  BASE_ASSIGN_OR_RETURN(auto k, derive(host, key));
  return tls::Psk{std::string(host) + "/" + key.fingerprint(), std::move(k)};
}

std::string tls_psk_host(std::string_view identity) {
  const size_t slash = identity.rfind('/');
  if (slash == std::string_view::npos || slash == 0) return {};
  const std::string_view host = identity.substr(0, slash);
  return valid_host_id(host) ? std::string(host) : std::string();
}

std::optional<std::vector<std::byte>> tls_psk_lookup(const Authenticator& a, std::string_view identity) {
  const std::string host = tls_psk_host(identity);
  if (host.empty()) return std::nullopt;
  const std::string_view fpr = identity.substr(host.size() + 1);
  auto keys = a.host_keys(host);
  if (!keys) return std::nullopt;
  for (const Secret& s : keys->keys) {
    if (s.fingerprint() != fpr) continue;
    auto k = derive(host, s);
    if (k.ok()) return std::move(*k);
  }
  return std::nullopt;
}

}  // namespace ibtrs
