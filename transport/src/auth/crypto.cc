#include "auth/crypto.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/rand.h>
#include <zlib.h>

#include <algorithm>
#include <climits>

namespace ibtrs::auth {

namespace {

const EVP_MD* md_of(Hash h) {
  switch (h) {
    case Hash::sha256: return EVP_sha256();
    case Hash::sha384: return EVP_sha384();
    case Hash::sha512: return EVP_sha512();
  }
  return nullptr;
}

const char* md_name(Hash h) {
  switch (h) {
    case Hash::sha256: return "SHA256";
    case Hash::sha384: return "SHA384";
    case Hash::sha512: return "SHA512";
  }
  return nullptr;
}

struct MdCtxFree {
  void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
};
struct MacFree {
  void operator()(EVP_MAC* m) const { EVP_MAC_free(m); }
};
struct MacCtxFree {
  void operator()(EVP_MAC_CTX* c) const { EVP_MAC_CTX_free(c); }
};
struct PkeyCtxFree {
  void operator()(EVP_PKEY_CTX* c) const { EVP_PKEY_CTX_free(c); }
};

}  // namespace

struct X25519::Pkey {
  EVP_PKEY* p = nullptr;
  ~Pkey() { EVP_PKEY_free(p); }
};

size_t hash_len(Hash h) {
  switch (h) {
    case Hash::sha256: return 32;
    case Hash::sha384: return 48;
    case Hash::sha512: return 64;
  }
  return 0;
}

Status random_bytes(std::span<uint8_t> out) {
  if (out.size() > INT_MAX) return errc(EINVAL);
  if (RAND_bytes(out.data(), static_cast<int>(out.size())) != 1) return errc(EIO);
  return {};
}

Status digest(Hash h, std::span<const Bytes> parts, std::span<uint8_t> out) {
  const EVP_MD* md = md_of(h);
  if (md == nullptr || out.size() != hash_len(h)) return errc(EINVAL);
  std::unique_ptr<EVP_MD_CTX, MdCtxFree> c(EVP_MD_CTX_new());
  if (!c || EVP_DigestInit_ex(c.get(), md, nullptr) != 1) return errc(EIO);
  for (Bytes p : parts) {
    if (EVP_DigestUpdate(c.get(), p.data(), p.size()) != 1) return errc(EIO);
  }
  unsigned int n = 0;
  if (EVP_DigestFinal_ex(c.get(), out.data(), &n) != 1 || n != out.size()) return errc(EIO);
  return {};
}

Status hmac(Hash h, Bytes key, std::span<const Bytes> parts, std::span<uint8_t> out) {
  const char* name = md_name(h);
  if (name == nullptr || out.size() != hash_len(h) || key.empty()) return errc(EINVAL);
  std::unique_ptr<EVP_MAC, MacFree> mac(EVP_MAC_fetch(nullptr, "HMAC", nullptr));
  if (!mac) return errc(EIO);
  std::unique_ptr<EVP_MAC_CTX, MacCtxFree> c(EVP_MAC_CTX_new(mac.get()));
  if (!c) return errc(EIO);
  OSSL_PARAM params[] = {
      OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, const_cast<char*>(name), 0),
      OSSL_PARAM_construct_end()};
  if (EVP_MAC_init(c.get(), key.data(), key.size(), params) != 1) return errc(EIO);
  for (Bytes p : parts) {
    if (EVP_MAC_update(c.get(), p.data(), p.size()) != 1) return errc(EIO);
  }
  size_t n = 0;
  if (EVP_MAC_final(c.get(), out.data(), &n, out.size()) != 1 || n != out.size()) return errc(EIO);
  return {};
}

bool equal_ct(Bytes a, Bytes b) {
  if (a.size() != b.size()) return false;
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

void cleanse(std::span<uint8_t> mem) { OPENSSL_cleanse(mem.data(), mem.size()); }

// ------------------------------------------------------------------------------------------
// X25519

X25519::X25519(X25519&&) noexcept = default;
X25519& X25519::operator=(X25519&&) noexcept = default;
X25519::~X25519() = default;

namespace {

Status fill_public(EVP_PKEY* p, X25519Key& pub) {
  size_t n = pub.size();
  if (EVP_PKEY_get_raw_public_key(p, pub.data(), &n) != 1 || n != pub.size()) return errc(EIO);
  return {};
}

}  // namespace

Result<X25519> X25519::generate() {
  std::unique_ptr<EVP_PKEY_CTX, PkeyCtxFree> c(EVP_PKEY_CTX_new_id(EVP_PKEY_X25519, nullptr));
  if (!c || EVP_PKEY_keygen_init(c.get()) != 1) return errc(EIO);
  X25519 k;
  k.key_ = std::make_unique<Pkey>();
  if (EVP_PKEY_keygen(c.get(), &k.key_->p) != 1) return errc(EIO);
  BASE_TRY(fill_public(k.key_->p, k.pub_));
  return k;
}

Result<X25519> X25519::from_private(Bytes priv) {
  if (priv.size() != kX25519Len) return errc(EINVAL);
  X25519 k;
  k.key_ = std::make_unique<Pkey>();
  k.key_->p = EVP_PKEY_new_raw_private_key(EVP_PKEY_X25519, nullptr, priv.data(), priv.size());
  if (k.key_->p == nullptr) return errc(EIO);
  BASE_TRY(fill_public(k.key_->p, k.pub_));
  return k;
}

Result<X25519Key> X25519::derive(Bytes peer_public) const {
  if (peer_public.size() != kX25519Len || !key_) return errc(EINVAL);
  struct PeerFree {
    void operator()(EVP_PKEY* p) const { EVP_PKEY_free(p); }
  };
  std::unique_ptr<EVP_PKEY, PeerFree> peer(
      EVP_PKEY_new_raw_public_key(EVP_PKEY_X25519, nullptr, peer_public.data(), peer_public.size()));
  if (!peer) return errc(EINVAL);
  std::unique_ptr<EVP_PKEY_CTX, PkeyCtxFree> c(EVP_PKEY_CTX_new(key_->p, nullptr));
  if (!c || EVP_PKEY_derive_init(c.get()) != 1) return errc(EIO);
  // OpenSSL refuses a peer value whose result is all zeros (a low-order point) here.
  if (EVP_PKEY_derive_set_peer(c.get(), peer.get()) != 1) return errc(EINVAL);
  X25519Key z{};
  size_t n = z.size();
  if (EVP_PKEY_derive(c.get(), z.data(), &n) != 1 || n != z.size()) return errc(EINVAL);
  // Belt and braces: RFC 7748 section 6.1's all-zero check, in constant time.
  static constexpr X25519Key kZero{};
  if (equal_ct(z, kZero)) return errc(EINVAL);
  return z;
}

// ------------------------------------------------------------------------------------------
// Encodings

std::string base64_encode(Bytes data) {
  std::string out(4 * ((data.size() + 2) / 3) + 1, '\0');
  if (data.size() > INT_MAX / 2) return {};
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()), data.data(),
                                static_cast<int>(data.size()));
  out.resize(static_cast<size_t>(n));
  return out;
}

Result<std::vector<uint8_t>> base64_decode(std::string_view text) {
  if (text.empty() || text.size() % 4 != 0 || text.size() > INT_MAX / 2) return errc(EINVAL);
  // EVP_DecodeBlock skips whitespace and does not report padding: check the alphabet here.
  size_t pad = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    const bool alpha = (ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') ||
                       (ch >= '0' && ch <= '9') || ch == '+' || ch == '/';
    if (ch == '=') {
      if (i + 2 < text.size()) return errc(EINVAL);
      ++pad;
    } else if (!alpha || pad != 0) {
      return errc(EINVAL);
    }
  }
  std::vector<uint8_t> out(text.size() / 4 * 3);
  const int n = EVP_DecodeBlock(out.data(), reinterpret_cast<const unsigned char*>(text.data()),
                                static_cast<int>(text.size()));
  if (n < 0 || static_cast<size_t>(n) != out.size()) return errc(EINVAL);
  out.resize(out.size() - pad);
  return out;
}

uint32_t crc32(Bytes data) {
  uLong c = ::crc32(0L, Z_NULL, 0);
  // zlib takes uInt lengths: feed large inputs in pieces.
  for (size_t off = 0; off < data.size();) {
    const size_t n = std::min<size_t>(data.size() - off, 1u << 30);
    c = ::crc32(c, data.data() + off, static_cast<uInt>(n));
    off += n;
  }
  return static_cast<uint32_t>(c);
}

std::string to_hex(Bytes data) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s;
  s.reserve(data.size() * 2);
  for (uint8_t b : data) {
    s += kDigits[b >> 4];
    s += kDigits[b & 15];
  }
  return s;
}

}  // namespace ibtrs::auth
