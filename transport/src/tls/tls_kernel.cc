// Kernel TLS (ibtrs/tls.h): the TLS 1.3 suites the kernel's record layer takes, one direction's
// keys installed in it, and the probe that decides whether it is used at all. Apart from the
// sessions (tls.cc) because it is the one place that talks to the kernel's TLS ULP.
//
// OpenSSL 3.0 hands TLS 1.3 only the transmit direction to the kernel itself, so both directions
// are installed here, from the traffic secrets the key-log callback reports (tls.cc) and the key
// schedule's own HKDF-Expand-Label (OpenSSL's TLS13-KDF): no cryptography of our own.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/kdf.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "base/unique_fd.h"
#include "tls/tls_private.h"

namespace ibtrs::tls {

struct Suite {
  uint16_t id;
  const char* digest;
  size_t key_len;
  uint16_t kernel_cipher;
};

namespace {

const Suite* suite_by_id(uint16_t id) {
  static const Suite kSuites[] = {
      {0x1301, "SHA256", 16, TLS_CIPHER_AES_GCM_128},
      {0x1302, "SHA384", 32, TLS_CIPHER_AES_GCM_256},
      {0x1303, "SHA256", 32, TLS_CIPHER_CHACHA20_POLY1305},
  };
  for (const auto& s : kSuites)
    if (s.id == id) return &s;
  return nullptr;
}

// HKDF-Expand-Label(secret, label, "", len) of the TLS 1.3 key schedule (RFC 8446 7.1, 7.3).
bool expand_label(const Suite& s, const std::vector<unsigned char>& secret, const char* label,
                  unsigned char* out, size_t len) {
  EVP_KDF* kdf = EVP_KDF_fetch(nullptr, OSSL_KDF_NAME_TLS1_3_KDF, nullptr);
  if (kdf == nullptr) return false;
  EVP_KDF_CTX* k = EVP_KDF_CTX_new(kdf);
  EVP_KDF_free(kdf);
  if (k == nullptr) return false;
  int mode = EVP_KDF_HKDF_MODE_EXPAND_ONLY;
  static const char kPrefix[] = "tls13 ";
  OSSL_PARAM params[] = {
      OSSL_PARAM_construct_int(OSSL_KDF_PARAM_MODE, &mode),
      OSSL_PARAM_construct_utf8_string(OSSL_KDF_PARAM_DIGEST, const_cast<char*>(s.digest), 0),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_KEY, const_cast<unsigned char*>(secret.data()),
                                        secret.size()),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_PREFIX, const_cast<char*>(kPrefix),
                                        sizeof(kPrefix) - 1),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_LABEL, const_cast<char*>(label), std::strlen(label)),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_DATA, const_cast<char*>(""), 0),
      OSSL_PARAM_construct_end(),
  };
  const bool ok = EVP_KDF_derive(k, out, len, params) == 1;
  EVP_KDF_CTX_free(k);
  return ok;
}

}  // namespace

const Suite* suite_of(const SSL_CIPHER* c) {
  return c == nullptr ? nullptr : suite_by_id(static_cast<uint16_t>(SSL_CIPHER_get_id(c) & 0xffff));
}

// Installs one direction's keys in the kernel at record sequence 0.
bool install_kernel_keys(int fd, int direction, const Suite& s, const std::vector<unsigned char>& secret) {
  unsigned char key[32], iv[12];
  if (!expand_label(s, secret, "key", key, s.key_len) || !expand_label(s, secret, "iv", iv, sizeof(iv)))
    return false;
  int rc = -1;
  switch (s.kernel_cipher) {
    case TLS_CIPHER_AES_GCM_128: {
      tls12_crypto_info_aes_gcm_128 ci{};
      ci.info.version = TLS_1_3_VERSION;
      ci.info.cipher_type = TLS_CIPHER_AES_GCM_128;
      std::memcpy(ci.key, key, sizeof(ci.key));
      std::memcpy(ci.salt, iv, sizeof(ci.salt));
      std::memcpy(ci.iv, iv + sizeof(ci.salt), sizeof(ci.iv));
      rc = ::setsockopt(fd, SOL_TLS, direction, &ci, sizeof(ci));
      OPENSSL_cleanse(&ci, sizeof(ci));
      break;
    }
    case TLS_CIPHER_AES_GCM_256: {
      tls12_crypto_info_aes_gcm_256 ci{};
      ci.info.version = TLS_1_3_VERSION;
      ci.info.cipher_type = TLS_CIPHER_AES_GCM_256;
      std::memcpy(ci.key, key, sizeof(ci.key));
      std::memcpy(ci.salt, iv, sizeof(ci.salt));
      std::memcpy(ci.iv, iv + sizeof(ci.salt), sizeof(ci.iv));
      rc = ::setsockopt(fd, SOL_TLS, direction, &ci, sizeof(ci));
      OPENSSL_cleanse(&ci, sizeof(ci));
      break;
    }
    case TLS_CIPHER_CHACHA20_POLY1305: {
      tls12_crypto_info_chacha20_poly1305 ci{};
      ci.info.version = TLS_1_3_VERSION;
      ci.info.cipher_type = TLS_CIPHER_CHACHA20_POLY1305;
      std::memcpy(ci.key, key, sizeof(ci.key));
      std::memcpy(ci.iv, iv, sizeof(ci.iv));
      rc = ::setsockopt(fd, SOL_TLS, direction, &ci, sizeof(ci));
      OPENSSL_cleanse(&ci, sizeof(ci));
      break;
    }
  }
  OPENSSL_cleanse(key, sizeof(key));
  OPENSSL_cleanse(iv, sizeof(iv));
  return rc == 0;
}

bool kernel_tls_available() {
  static const bool available = [] {
    // A loopback pair whose ends take the record layer with throw-away keys, and one record
    // through it: the kernel's layer is trusted only once it has moved a record. The first use
    // of kTLS in a kernel loads modules and instantiates and self-tests the AEADs (12 s under
    // QEMU TCG in the VM rig), which is why Context::create() pays it, not a handshake.
    base::UniqueFd l(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!l) return false;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    bool ok = false;
    base::UniqueFd s, c;  // declared after l, s before c: they close c, s, then l
    if (::bind(l.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 && ::listen(l.get(), 4) == 0 &&
        ::getsockname(l.get(), reinterpret_cast<sockaddr*>(&a), &len) == 0) {
      c.reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
      if (c && ::connect(c.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0)
        s.reset(::accept4(l.get(), nullptr, nullptr, SOCK_CLOEXEC));
      ok = s && ::setsockopt(c.get(), SOL_TCP, TCP_ULP, "tls", sizeof("tls")) == 0;
    }
    if (ok) {
      const std::vector<unsigned char> secret(32, 0x5a);
      const Suite* suite = suite_by_id(0x1301);
      bool exchanged = ::setsockopt(s.get(), SOL_TCP, TCP_ULP, "tls", sizeof("tls")) == 0 &&
                       install_kernel_keys(c.get(), TLS_TX, *suite, secret) &&
                       install_kernel_keys(s.get(), TLS_RX, *suite, secret);
      if (exchanged) {
        const char ping[] = "ibtrs-ktls-probe";
        char got[sizeof(ping)] = {};
        timeval tv{2, 0};
        ::setsockopt(s.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        exchanged = ::send(c.get(), ping, sizeof(ping), MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof(ping)) &&
                    ::recv(s.get(), got, sizeof(got), MSG_WAITALL) == static_cast<ssize_t>(sizeof(got)) &&
                    std::memcmp(got, ping, sizeof(ping)) == 0;
      }
      // Without a working exchange the kernel's layer is not trusted: userspace it is.
      ok = exchanged;
    }
    return ok;
  }();
  return available;
}

}  // namespace ibtrs::tls
