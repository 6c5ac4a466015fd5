// TLS sessions over stream sockets (ibtrs/tls.h) with OpenSSL 3: contexts, the handshake and the
// userspace record layer (kernel TLS is in tls_kernel.cc, PSK files in tls_psk.cc).
//
// The SSL object never touches the socket: it reads and writes memory BIOs, and this file moves
// the bytes. During the handshake it reads the socket one TLS record at a time (header, then
// exactly the body), so when the handshake ends nothing of the peer's application data sits in
// userspace, and the kernel can take the receive direction at record sequence 0. OpenSSL 3.0
// hands TLS 1.3 only the transmit direction to the kernel itself, so both directions are set up
// here (go_kernel), from the traffic secrets the key-log callback reports, with the keys
// tls_kernel.cc derives from them.
#include "ibtrs/tls.h"

#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <deque>

#include "tls/tls_private.h"

namespace ibtrs::tls {

namespace {

using Clock = std::chrono::steady_clock;

// The SHA-256 suites first, chosen by the server's preference: a PSK is bound to one hash
// (ours to SHA-256), and OpenSSL ignores a PSK whose hash is not the negotiated suite's (a
// GnuTLS client lists AES-256-GCM-SHA384 first).
constexpr const char* kCipherSuites =
    "TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256:TLS_AES_256_GCM_SHA384";
// RFC 8446 5.1: a record carries at most 2^14 bytes of plaintext, and a TLS 1.3 ciphertext at
// most 2^14 + 256.
constexpr size_t kMaxPlain = 16384;
constexpr size_t kMaxRecordBody = kMaxPlain + 256;
constexpr size_t kRecordHeader = 5;
// Userspace record layer: ciphertext sealed ahead of the socket, at most this much.
constexpr size_t kMaxSealedAhead = 256 << 10;

enum ContentType : uint8_t { kChangeCipherSpec = 20, kAlert = 21, kHandshake = 22, kAppData = 23 };

std::string openssl_error_text() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    if (!out.empty()) out += "; ";
    out += buf;
  }
  return out;
}

int session_index() {
  static const int idx = SSL_get_ex_new_index(0, nullptr, nullptr, nullptr, nullptr);
  return idx;
}

ssize_t send_some(int fd, const void* p, size_t n) {
  for (;;) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    return w;
  }
}

ssize_t recv_some(int fd, void* p, size_t n) {
  for (;;) {
    ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    return r;
  }
}

// Handshake failures that mean "these credentials are refused" (EACCES); anything else the
// handshake trips on is a protocol mismatch (EPROTO).
bool is_credential_failure(unsigned long e) {
  switch (ERR_GET_REASON(e)) {
    case SSL_R_BINDER_DOES_NOT_VERIFY:
    case SSL_R_BAD_PSK:
    case SSL_R_BAD_PSK_IDENTITY:
    case SSL_R_PSK_IDENTITY_NOT_FOUND:
    case SSL_R_NO_SHARED_CIPHER:
    case SSL_R_CERTIFICATE_VERIFY_FAILED:
    case SSL_R_PEER_DID_NOT_RETURN_A_CERTIFICATE:
    case SSL_R_NO_CERTIFICATE_SET:
    case SSL_R_MISSING_SIGALGS_EXTENSION:
    case SSL_R_SSLV3_ALERT_HANDSHAKE_FAILURE:
    case SSL_R_TLSV1_ALERT_DECRYPT_ERROR:
    case SSL_R_TLSV1_ALERT_UNKNOWN_CA:
    case SSL_R_TLSV1_ALERT_ACCESS_DENIED:
    case SSL_R_SSLV3_ALERT_BAD_CERTIFICATE:
    case SSL_R_SSLV3_ALERT_CERTIFICATE_UNKNOWN:
    case SSL_R_TLSV13_ALERT_CERTIFICATE_REQUIRED:
    case SSL_R_TLSV1_ALERT_UNKNOWN_PSK_IDENTITY:
    case SSL_R_SSLV3_ALERT_ILLEGAL_PARAMETER:
      return true;
    default:
      return false;
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------

struct Context::Impl {
  Config cfg;
  SSL_CTX* ctx = nullptr;
  ~Impl() { SSL_CTX_free(ctx); }
};

struct Session::Impl {
  std::shared_ptr<Context> ctx;
  int fd = -1;
  SSL* ssl = nullptr;
  BIO* rbio = nullptr;  // ciphertext from the peer (owned by ssl)
  BIO* wbio = nullptr;  // ciphertext to the peer (owned by ssl)
  bool established = false;
  bool first_record = true;
  short want = POLLIN;
  std::string peer;
  std::string error;
  bool credentials_refused = false;  // our PSK lookup refused the peer's identity
  std::string client_secret, server_secret;  // hex, from the key log, until the kernel took them
  bool ktx = false, krx = false;

  // Handshake reader: one record at a time.
  unsigned char rec[kRecordHeader + kMaxRecordBody];
  size_t rec_have = 0, rec_need = kRecordHeader;
  // Ciphertext to send (handshake flights, and the userspace record layer's sealed records).
  std::vector<unsigned char> tx;
  size_t tx_head = 0;
  // Userspace record layer, transmit side (see writev): plaintext counters of this stream.
  uint64_t sealed = 0;    // plaintext bytes sealed into records
  uint64_t reported = 0;  // plaintext bytes the caller was told are written
  uint64_t tx_sent = 0;   // ciphertext bytes that left on the socket (stream offset)
  uint64_t tx_total = 0;  // ciphertext bytes sealed (stream offset of the end of tx)
  struct Rec {
    uint64_t cipher_end;  // stream offset just past this record's ciphertext
    uint64_t plain_end;   // plaintext offset just past this record's plaintext
  };
  std::deque<Rec> recs;
  unsigned char stage[kMaxPlain];  // the plaintext of one record gathered from an iovec

  ~Impl() {
    if (ssl != nullptr) SSL_free(ssl);
    OPENSSL_cleanse(client_secret.data(), client_secret.size());
    OPENSSL_cleanse(server_secret.data(), server_secret.size());
  }

  size_t tx_pending() const { return tx.size() - tx_head; }
  bool client() const { return ctx->role() == Role::client; }

  // Moves ciphertext OpenSSL produced into tx.
  void collect_wbio() {
    char* p = nullptr;
    long n = BIO_get_mem_data(wbio, &p);
    if (n > 0) {
      tx.insert(tx.end(), p, p + n);
      tx_total += static_cast<uint64_t>(n);
      (void)BIO_reset(wbio);
    }
  }

  // Sends what tx holds. True when all of it left; false with errno (EAGAIN, or an error).
  bool flush_tx() {
    while (tx_pending() > 0) {
      ssize_t w = send_some(fd, tx.data() + tx_head, tx_pending());
      if (w < 0) return false;
      tx_head += static_cast<size_t>(w);
      tx_sent += static_cast<uint64_t>(w);
    }
    tx.clear();
    tx_head = 0;
    return true;
  }

  // Reads the next whole record of the handshake into rbio. 1: a record arrived; 0: not yet
  // (EAGAIN); -1: errno set (EPROTO: not TLS).
  int read_record() {
    while (rec_have < rec_need) {
      ssize_t r = recv_some(fd, rec + rec_have, rec_need - rec_have);
      if (r == 0) {
        errno = ECONNRESET;
        return -1;
      }
      if (r < 0) return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
      rec_have += static_cast<size_t>(r);
      if (rec_have == kRecordHeader && rec_need == kRecordHeader) {
        const uint8_t type = rec[0];
        const size_t len = size_t{rec[3]} << 8 | rec[4];
        const bool known = type >= kChangeCipherSpec && type <= kAppData;
        if (!known || rec[1] != 3 || len == 0 || len > kMaxRecordBody || (first_record && type != kHandshake && !(type == kAlert && client()))) {
          error = first_record ? "the peer does not speak TLS (plaintext or another protocol)"
                               : "malformed TLS record";
          errno = EPROTO;
          return -1;
        }
        rec_need = kRecordHeader + len;
      }
    }
    first_record = false;
    BIO_write(rbio, rec, static_cast<int>(rec_have));
    rec_have = 0;
    rec_need = kRecordHeader;
    return 1;
  }

  // After the handshake: hands the record layer to the kernel where it can take it.
  void go_kernel() {
    const Suite* s = suite_of(SSL_get_current_cipher(ssl));
    if (!ctx->impl()->cfg.kernel || s == nullptr || !kernel_tls_available()) return;
    const bool client = ctx->role() == Role::client;
    auto unhex = [](const std::string& h) {
      std::vector<unsigned char> out;
      for (size_t i = 0; i + 1 < h.size(); i += 2) out.push_back(static_cast<unsigned char>(std::stoi(h.substr(i, 2), nullptr, 16)));
      return out;
    };
    std::vector<unsigned char> txs = unhex(client ? client_secret : server_secret);
    std::vector<unsigned char> rxs = unhex(client ? server_secret : client_secret);
    // Nothing of the peer may wait in userspace, or the kernel would start at the wrong record.
    const bool rx_clean = BIO_ctrl_pending(rbio) == 0 && SSL_has_pending(ssl) == 0 && rec_have == 0;
    if (!txs.empty() && !rxs.empty() && tx_pending() == 0 &&
        ::setsockopt(fd, SOL_TCP, TCP_ULP, "tls", sizeof("tls")) == 0) {
      ktx = install_kernel_keys(fd, TLS_TX, *s, txs);
      krx = rx_clean && install_kernel_keys(fd, TLS_RX, *s, rxs);
    }
    OPENSSL_cleanse(txs.data(), txs.size());
    OPENSSL_cleanse(rxs.data(), rxs.size());
  }

  Status fail_handshake(int ssl_err) {
    // Tell the peer why, best effort (an alert OpenSSL queued), then say what happened.
    collect_wbio();
    (void)flush_tx();
    int e = EPROTO;
    unsigned long first = ERR_peek_error();
    if (ssl_err == SSL_ERROR_SSL && (credentials_refused || (first != 0 && is_credential_failure(first))))
      e = EACCES;
    if (ssl_err == SSL_ERROR_SYSCALL || ssl_err == SSL_ERROR_ZERO_RETURN) e = ECONNRESET;
    std::string text = openssl_error_text();
    if (error.empty()) error = text.empty() ? std::string("TLS handshake failed") : text;
    return errc(e);
  }

  Status step() {
    if (established) return {};
    for (;;) {
      if (!flush_tx()) {
        if (errno != EAGAIN && errno != EWOULDBLOCK) return errc(errno == EPIPE ? ECONNRESET : errno);
        want = POLLOUT;
        return errc(EAGAIN);
      }
      ERR_clear_error();
      const int r = SSL_do_handshake(ssl);
      collect_wbio();
      if (r == 1) {
        if (!flush_tx()) {
          if (errno != EAGAIN && errno != EWOULDBLOCK) return errc(errno == EPIPE ? ECONNRESET : errno);
          want = POLLOUT;
          return errc(EAGAIN);
        }
        established = true;
        finish();
        return {};
      }
      const int err = SSL_get_error(ssl, r);
      if (err == SSL_ERROR_WANT_WRITE) continue;  // memory BIO: never full
      if (err != SSL_ERROR_WANT_READ) return fail_handshake(err);
      if (tx_pending() > 0) continue;
      const int got = read_record();
      if (got < 0) {
        const int e = errno;
        if (error.empty()) error = std::strerror(e);
        return errc(e);
      }
      if (got == 0) {
        want = POLLIN;
        return errc(EAGAIN);
      }
    }
  }

  void finish() {
    if (ctx->impl()->cfg.psk || ctx->impl()->cfg.psk_lookup) {
      if (ctx->role() == Role::client) {
        peer = ctx->impl()->cfg.psk->identity;
      }  // server: set by the find callback
    } else if (X509* cert = SSL_get1_peer_certificate(ssl)) {
      char buf[512];
      X509_NAME_oneline(X509_get_subject_name(cert), buf, sizeof(buf));
      peer = buf;
      X509_free(cert);
    }
    go_kernel();
  }

  // ---- userspace record layer ----

  // Whether rbio holds at least one whole record.
  bool whole_record_buffered() const {
    char* p = nullptr;
    long n = BIO_get_mem_data(rbio, &p);
    if (n < static_cast<long>(kRecordHeader)) return false;
    const auto* u = reinterpret_cast<const unsigned char*>(p);
    return static_cast<size_t>(n) >= kRecordHeader + (size_t{u[3]} << 8 | u[4]);
  }

  ssize_t user_readv(const iovec* iov, int iovcnt) {
    size_t total = 0;
    for (int i = 0; i < iovcnt; ++i) {
      auto* p = static_cast<unsigned char*>(iov[i].iov_base);
      size_t left = iov[i].iov_len;
      while (left > 0) {
        size_t got = 0;
        ERR_clear_error();
        if (SSL_read_ex(ssl, p, left, &got) == 1) {
          p += got;
          left -= got;
          total += got;
          continue;
        }
        const int err = SSL_get_error(ssl, 0);
        if (err == SSL_ERROR_WANT_READ) {
          unsigned char buf[kRecordHeader + kMaxRecordBody];
          ssize_t r = recv_some(fd, buf, sizeof(buf));
          if (r > 0) {
            BIO_write(rbio, buf, static_cast<int>(r));
            continue;
          }
          if (r == 0) return static_cast<ssize_t>(total);
          if (total > 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return static_cast<ssize_t>(total);
          return -1;
        }
        if (err == SSL_ERROR_ZERO_RETURN) return static_cast<ssize_t>(total);  // close_notify
        error = openssl_error_text();
        if (total > 0) return static_cast<ssize_t>(total);
        errno = EIO;
        return -1;
      }
    }
    return static_cast<ssize_t>(total);
  }

  // Reports to the caller only plaintext whose records left on the socket in full; records
  // sealed ahead stand for the first bytes of the caller's next call (socket semantics: the
  // caller sends its unsent bytes first, unchanged).
  ssize_t user_writev(const iovec* iov, int iovcnt) {
    size_t want_total = 0;
    for (int i = 0; i < iovcnt; ++i) want_total += iov[i].iov_len;
    if (want_total == 0) return 0;
    const uint64_t base = reported;  // plaintext offset of iov's first byte
    bool blocked = !flush_tx();
    if (blocked && errno != EAGAIN && errno != EWOULDBLOCK) return -1;
    if (!blocked) {
      // Seal the caller's bytes past what is already sealed, bounded.
      uint64_t off = sealed - base;  // into iov
      size_t idx = 0, in = 0;
      uint64_t skip = off;
      while (idx < static_cast<size_t>(iovcnt) && skip >= iov[idx].iov_len) {
        skip -= iov[idx].iov_len;
        ++idx;
      }
      in = static_cast<size_t>(skip);
      // One record per up to 16 KiB of the caller's bytes, whatever its iovec: a frame header
      // and its payload travel in one record (each record costs its own sealing, 22 bytes of
      // overhead and the reader's whole-record wait).
      while (tx_pending() < kMaxSealedAhead) {
        while (idx < static_cast<size_t>(iovcnt) && in == iov[idx].iov_len) {
          ++idx;
          in = 0;
        }
        if (idx == static_cast<size_t>(iovcnt)) break;
        const unsigned char* from = static_cast<const unsigned char*>(iov[idx].iov_base) + in;
        size_t n = std::min(iov[idx].iov_len - in, kMaxPlain);
        if (n == kMaxPlain) {
          in += n;  // a whole record from one element: sealed in place
        } else {
          n = 0;
          while (idx < static_cast<size_t>(iovcnt) && n < kMaxPlain) {
            const size_t take = std::min(iov[idx].iov_len - in, kMaxPlain - n);
            std::memcpy(stage + n, static_cast<const unsigned char*>(iov[idx].iov_base) + in, take);
            n += take;
            in += take;
            if (in == iov[idx].iov_len) {
              ++idx;
              in = 0;
            }
          }
          from = stage;
        }
        size_t w = 0;
        ERR_clear_error();
        if (SSL_write_ex(ssl, from, n, &w) != 1 || w != n) {
          error = openssl_error_text();
          errno = EIO;
          return -1;
        }
        collect_wbio();
        sealed += n;
        recs.push_back(Rec{tx_total, sealed});
      }
      blocked = !flush_tx();
      if (blocked && errno != EAGAIN && errno != EWOULDBLOCK) return -1;
    }
    uint64_t acked = reported;
    while (!recs.empty() && recs.front().cipher_end <= tx_sent) {
      acked = recs.front().plain_end;
      recs.pop_front();
    }
    // A record that left in full may reach past this call's bytes (a caller passing fewer
    // bytes than before): report what this call covers, the rest next time.
    const uint64_t n = std::min<uint64_t>(acked - reported, want_total);
    if (acked > reported + n) recs.push_front(Rec{0, acked});
    reported += n;
    if (n == 0) {
      errno = EAGAIN;
      return -1;
    }
    return static_cast<ssize_t>(n);
  }
};

// ------------------------------------------------------------------------------------------

namespace {

void keylog_cb(const SSL* ssl, const char* line) {
  auto* s = static_cast<Session::Impl*>(SSL_get_ex_data(ssl, session_index()));
  if (s == nullptr) return;
  std::string_view l(line);
  auto take = [&](std::string_view label, std::string& into) {
    if (l.substr(0, label.size()) != label) return;
    const size_t sp = l.rfind(' ');
    if (sp != std::string_view::npos) into.assign(l.substr(sp + 1));
  };
  take("CLIENT_TRAFFIC_SECRET_0 ", s->client_secret);
  take("SERVER_TRAFFIC_SECRET_0 ", s->server_secret);
}

const SSL_CIPHER* psk_cipher(SSL* ssl) {
  static const unsigned char kAes128GcmSha256[] = {0x13, 0x01};
  return SSL_CIPHER_find(ssl, kAes128GcmSha256);
}

SSL_SESSION* psk_session(SSL* ssl, const std::vector<std::byte>& key) {
  SSL_SESSION* sess = SSL_SESSION_new();
  const SSL_CIPHER* c = psk_cipher(ssl);
  if (sess == nullptr || c == nullptr ||
      SSL_SESSION_set1_master_key(sess, reinterpret_cast<const unsigned char*>(key.data()), key.size()) != 1 ||
      SSL_SESSION_set_cipher(sess, c) != 1 || SSL_SESSION_set_protocol_version(sess, TLS1_3_VERSION) != 1) {
    SSL_SESSION_free(sess);
    return nullptr;
  }
  return sess;
}

int psk_use_cb(SSL* ssl, const EVP_MD* md, const unsigned char** id, size_t* idlen, SSL_SESSION** sess) {
  auto* s = static_cast<Session::Impl*>(SSL_get_ex_data(ssl, session_index()));
  if (s == nullptr || !s->ctx->impl()->cfg.psk) return 0;
  const Psk& psk = *s->ctx->impl()->cfg.psk;
  const SSL_CIPHER* c = psk_cipher(ssl);
  // A HelloRetryRequest may have fixed another hash: our PSK is bound to SHA-256.
  if (md != nullptr && c != nullptr && md != SSL_CIPHER_get_handshake_digest(c)) {
    *sess = nullptr;
    return 1;
  }
  *sess = psk_session(ssl, psk.key);
  if (*sess == nullptr) return 0;
  *id = reinterpret_cast<const unsigned char*>(psk.identity.data());
  *idlen = psk.identity.size();
  return 1;
}

int psk_find_cb(SSL* ssl, const unsigned char* id, size_t idlen, SSL_SESSION** sess) {
  *sess = nullptr;
  auto* s = static_cast<Session::Impl*>(SSL_get_ex_data(ssl, session_index()));
  if (s == nullptr || !s->ctx->impl()->cfg.psk_lookup) return 1;
  std::string identity(reinterpret_cast<const char*>(id), idlen);
  if (identity.empty() || identity.size() > 255 || !printable(identity)) {
    s->error = "PSK identity is not printable ASCII";
    s->credentials_refused = true;
    return 1;
  }
  auto key = s->ctx->impl()->cfg.psk_lookup(identity);
  if (!key) {
    s->error = "unknown PSK identity '" + identity + "'";
    s->credentials_refused = true;
    return 1;  // no session: the handshake fails for want of credentials
  }
  *sess = psk_session(ssl, *key);
  OPENSSL_cleanse(key->data(), key->size());
  if (*sess == nullptr) return 0;
  s->peer = std::move(identity);
  return 1;
}

}  // namespace

Context::Context(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Context::~Context() = default;
Role Context::role() const { return impl_->cfg.role; }

Result<std::shared_ptr<Context>> Context::create(Config cfg) {
  const bool psk = cfg.role == Role::client ? cfg.psk.has_value() : static_cast<bool>(cfg.psk_lookup);
  const bool certs = !cfg.cert_file.empty() || !cfg.ca_file.empty();
  if (psk == certs) return errc(EINVAL);  // exactly one mode
  if (cfg.psk && !valid_psk(*cfg.psk)) return errc(EINVAL);
  if (certs && cfg.role == Role::server && (cfg.cert_file.empty() || cfg.key_file.empty()))
    return errc(EINVAL);
  if (certs && cfg.role == Role::client && cfg.ca_file.empty()) return errc(EINVAL);
  auto impl = std::make_unique<Impl>();
  impl->ctx = SSL_CTX_new(cfg.role == Role::client ? TLS_client_method() : TLS_server_method());
  if (impl->ctx == nullptr) return errc(ENOMEM);
  SSL_CTX* c = impl->ctx;
  SSL_CTX_set_min_proto_version(c, TLS1_3_VERSION);
  SSL_CTX_set_max_proto_version(c, TLS1_3_VERSION);
  if (SSL_CTX_set_ciphersuites(c, kCipherSuites) != 1) return errc(EINVAL);
  // No tickets (the kernel must start at record 0 and nothing follows the handshake), no
  // compression, no renegotiation, no middlebox-compatibility change_cipher_spec records.
  SSL_CTX_set_num_tickets(c, 0);
  SSL_CTX_set_options(c, SSL_OP_NO_TICKET | SSL_OP_NO_COMPRESSION | SSL_OP_NO_RENEGOTIATION |
                             SSL_OP_CIPHER_SERVER_PREFERENCE);
  SSL_CTX_clear_options(c, SSL_OP_ENABLE_MIDDLEBOX_COMPAT);
  SSL_CTX_set_session_cache_mode(c, SSL_SESS_CACHE_OFF);
  SSL_CTX_set_keylog_callback(c, keylog_cb);
  if (psk) {
    if (cfg.role == Role::server) SSL_CTX_set_psk_find_session_callback(c, psk_find_cb);
    else SSL_CTX_set_psk_use_session_callback(c, psk_use_cb);
  } else {
    if (!cfg.cert_file.empty() &&
        (SSL_CTX_use_certificate_chain_file(c, cfg.cert_file.c_str()) != 1 ||
         SSL_CTX_use_PrivateKey_file(c, cfg.key_file.c_str(), SSL_FILETYPE_PEM) != 1 ||
         SSL_CTX_check_private_key(c) != 1)) {
      ERR_clear_error();
      return errc(EINVAL);
    }
    if (!cfg.ca_file.empty()) {
      if (SSL_CTX_load_verify_locations(c, cfg.ca_file.c_str(), nullptr) != 1) {
        ERR_clear_error();
        return errc(EINVAL);
      }
      SSL_CTX_set_verify(c, SSL_VERIFY_PEER | (cfg.role == Role::server ? SSL_VERIFY_FAIL_IF_NO_PEER_CERT : 0),
                         nullptr);
    }
  }
  impl->cfg = std::move(cfg);
  // The kernel's first use costs what a handshake on an event loop must not wait for.
  if (impl->cfg.kernel) (void)kernel_tls_available();
  return std::shared_ptr<Context>(new Context(std::move(impl)));
}

Session::Session(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Session::~Session() = default;

Result<std::unique_ptr<Session>> Session::create(std::shared_ptr<Context> ctx, int fd) {
  if (ctx == nullptr || fd < 0) return errc(EINVAL);
  auto impl = std::make_unique<Impl>();
  impl->ctx = std::move(ctx);
  impl->fd = fd;
  impl->ssl = SSL_new(impl->ctx->impl()->ctx);
  impl->rbio = BIO_new(BIO_s_mem());
  impl->wbio = BIO_new(BIO_s_mem());
  if (impl->ssl == nullptr || impl->rbio == nullptr || impl->wbio == nullptr) {
    BIO_free(impl->rbio);
    BIO_free(impl->wbio);
    return errc(ENOMEM);
  }
  BIO_set_mem_eof_return(impl->rbio, -1);  // empty means "more to come", not end of stream
  SSL_set_bio(impl->ssl, impl->rbio, impl->wbio);
  SSL_set_ex_data(impl->ssl, session_index(), impl.get());
  const Config& cfg = impl->ctx->impl()->cfg;
  if (impl->ctx->role() == Role::client) {
    SSL_set_connect_state(impl->ssl);
    if (!cfg.server_name.empty()) {
      // An IP address is matched as one, anything else as a DNS name.
      ASN1_OCTET_STRING* ip = a2i_IPADDRESS(cfg.server_name.c_str());
      if (ip != nullptr) {
        ASN1_OCTET_STRING_free(ip);
        X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(impl->ssl), cfg.server_name.c_str());
      } else {
        SSL_set1_host(impl->ssl, cfg.server_name.c_str());
        SSL_set_tlsext_host_name(impl->ssl, cfg.server_name.c_str());
      }
    }
  } else {
    SSL_set_accept_state(impl->ssl);
  }
  return std::unique_ptr<Session>(new Session(std::move(impl)));
}

Status Session::handshake_step() { return impl_->step(); }
short Session::want() const { return impl_->want; }

Status Session::handshake(Clock::time_point deadline, int cancel_fd) {
  for (;;) {
    auto st = impl_->step();
    if (st.ok() || st.error() != std::errc::resource_unavailable_try_again) return st;
    pollfd p[2] = {{impl_->fd, impl_->want, 0}, {cancel_fd, POLLIN, 0}};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return errc(ETIMEDOUT);
    const int r = ::poll(p, cancel_fd >= 0 ? 2 : 1, static_cast<int>(std::min<int64_t>(left.count(), INT32_MAX)));
    if (r < 0 && errno != EINTR) return errc(errno);
    if (cancel_fd >= 0 && (p[1].revents & POLLIN)) return errc(ECANCELED);
  }
}

bool Session::established() const { return impl_->established; }
const std::string& Session::last_error() const { return impl_->error; }
const std::string& Session::peer_identity() const { return impl_->peer; }
std::string_view Session::cipher() const {
  const SSL_CIPHER* c = SSL_get_current_cipher(impl_->ssl);
  return c != nullptr ? SSL_CIPHER_get_name(c) : "";
}
bool Session::kernel_tx() const { return impl_->ktx; }
bool Session::kernel_rx() const { return impl_->krx; }

ssize_t Session::readv(const iovec* iov, int iovcnt) {
  if (!impl_->established) {
    errno = ENOTCONN;
    return -1;
  }
  if (impl_->krx) {
    for (;;) {
      ssize_t r = ::readv(impl_->fd, iov, iovcnt);
      if (r < 0 && errno == EINTR) continue;
      return r;
    }
  }
  return impl_->user_readv(iov, iovcnt);
}

ssize_t Session::writev(const iovec* iov, int iovcnt) {
  if (!impl_->established) {
    errno = ENOTCONN;
    return -1;
  }
  if (impl_->ktx) {
    msghdr m{};
    m.msg_iov = const_cast<iovec*>(iov);
    m.msg_iovlen = static_cast<size_t>(iovcnt);
    for (;;) {
      ssize_t w = ::sendmsg(impl_->fd, &m, MSG_NOSIGNAL);
      if (w < 0 && errno == EINTR) continue;
      return w;
    }
  }
  return impl_->user_writev(iov, iovcnt);
}

bool Session::read_pending() const {
  if (!impl_->established || impl_->krx) return false;
  return SSL_pending(impl_->ssl) > 0 || impl_->whole_record_buffered();
}

std::string describe(const Info& i) {
  if (!i.on) return "-";
  return std::string(i.kernel_tx && i.kernel_rx ? "kTLS " : "user ") + i.cipher;
}

Result<Options::Mode> parse_mode(std::string_view s) {
  if (s == "off") return Options::Mode::off;
  if (s == "on") return Options::Mode::on;
  if (s == "required") return Options::Mode::required;
  return errc(EINVAL);
}

std::string_view to_string(Options::Mode m) {
  switch (m) {
    case Options::Mode::off: return "off";
    case Options::Mode::on: return "on";
    case Options::Mode::required: return "required";
  }
  return "?";
}

bool looks_like_tls(std::span<const std::byte> first) {
  if (first.size() < 3) return false;
  return static_cast<uint8_t>(first[0]) == kHandshake && static_cast<uint8_t>(first[1]) == 3 &&
         static_cast<uint8_t>(first[2]) <= 4;
}

}  // namespace ibtrs::tls
