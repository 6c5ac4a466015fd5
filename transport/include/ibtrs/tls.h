// TLS 1.3 over a connected stream socket (OpenSSL): the handshake in userspace, then the record
// layer in the kernel (kTLS: TCP_ULP "tls", SOL_TLS TLS_TX/TLS_RX) where the kernel has it, so
// the data path stays plain sendmsg/readv on the socket; where it does not, a userspace record
// layer behind the same non-blocking readv/writev shape. Used by the tcp fabric provider and by
// the NBD export's STARTTLS.
//
// Credentials: a TLS 1.3 external pre-shared key (RFC 8446 section 2.2; the identity names the
// host), or X.509 certificates (PEM files). Cipher suites: AES-128-GCM, AES-256-GCM and
// ChaCha20-Poly1305, the ones kTLS can take; no session tickets, no early data, no
// renegotiation of any kind, so that the kernel can take both directions at sequence 0 right
// after the handshake.
//
// Threading: a Context is immutable once made and shared by any number of sessions on any
// threads. A Session is used by one thread at a time (its socket's owner); reads and writes
// after the handshake may come from two threads (one reader, one writer) only when both
// directions are in the kernel (kernel_rx() && kernel_tx()).
#pragma once

#include <sys/uio.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ibtrs/result.h"

namespace ibtrs::tls {

enum class Role : uint8_t { client, server };

// A pre-shared key. The key is 32..64 bytes (TLS 1.3 with SHA-256 binds it with HMAC-SHA-256).
struct Psk {
  std::string identity;  // 1..255 printable ASCII bytes
  std::vector<std::byte> key;
};

struct Config {
  Role role = Role::client;
  // PSK mode. client: the key to offer. server: looks an identity up; nullopt refuses it (the
  // handshake then fails and both sides see EACCES).
  std::optional<Psk> psk;
  std::function<std::optional<std::vector<std::byte>>(std::string_view identity)> psk_lookup;
  // Certificate mode (PEM files). server: cert_file + key_file, and ca_file to require and
  // verify client certificates. client: ca_file to verify the server (required in this mode),
  // server_name to match its certificate (DNS name or IP address), cert_file + key_file to
  // present one.
  std::string cert_file, key_file, ca_file, server_name;
  // Hand the record layer to the kernel after the handshake when it can take it.
  bool kernel = true;
};

// The credentials and settings shared by many sessions.
class Context {
 public:
  // Errors: EINVAL (no credentials, both modes, a bad PSK, unreadable or mismatched PEM files:
  // the message names the file), ENOMEM.
  static Result<std::shared_ptr<Context>> create(Config config);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  Role role() const;
  struct Impl;
  Impl* impl() const { return impl_.get(); }

 private:
  explicit Context(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// One TLS connection over a connected, non-blocking stream socket it does not own (the caller
// closes the socket after destroying the session).
class Session {
 public:
  static Result<std::unique_ptr<Session>> create(std::shared_ptr<Context> ctx, int fd);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // One non-blocking step of the handshake. {} when it is complete; EAGAIN: wait until the
  // socket is ready for want() (POLLIN or POLLOUT) and call again. Errors: EACCES (credentials
  // refused, by either side: unknown PSK identity, wrong key, certificate not trusted), EPROTO
  // (the peer does not speak TLS 1.3: a plaintext peer, another protocol), ECONNRESET (the
  // peer closed), EIO.
  Status handshake_step();
  short want() const;
  // The whole handshake, waiting on the socket up to `deadline`; ETIMEDOUT, or ECANCELED when
  // `cancel_fd` (>= 0) becomes readable first.
  Status handshake(std::chrono::steady_clock::time_point deadline, int cancel_fd = -1);

  bool established() const;
  // What went wrong last, in OpenSSL's words (for logs); empty when nothing did.
  const std::string& last_error() const;
  // After the handshake: the PSK identity the peer used, or its certificate's subject.
  const std::string& peer_identity() const;
  std::string_view cipher() const;
  // Whether the kernel carries the record layer in that direction: then writes and reads may
  // go straight to the socket (sendmsg/readv); these calls then do exactly that.
  bool kernel_tx() const;
  bool kernel_rx() const;

  // After the handshake, shaped like readv/writev on a non-blocking socket: the bytes moved, 0
  // at end of stream (read), or -1 with errno set (EAGAIN: wait for POLLIN/POLLOUT and call
  // again; ECONNRESET, EIO (a record failed authentication, an alert), EPIPE). As with a
  // socket, a writer that got a short count or EAGAIN calls again with the unsent bytes first,
  // unchanged: the userspace record layer may already have sealed some of them.
  ssize_t readv(const iovec* iov, int iovcnt);
  ssize_t writev(const iovec* iov, int iovcnt);
  // Decrypted or received bytes held in userspace that readv() would return now: the socket
  // need not be readable while they wait, so an epoll reader drains while this is true.
  bool read_pending() const;

  struct Impl;

 private:
  explicit Session(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// What a connection's TLS is, for listings and stats.
struct Info {
  bool on = false;
  bool kernel_tx = false, kernel_rx = false;  // the kernel carries the record layer (kTLS)
  std::string cipher;                         // "TLS_AES_128_GCM_SHA256"
  std::string peer;                           // the peer's PSK identity or certificate subject
};

// For listings: "-" without TLS, "kTLS CIPHER" when the kernel carries both directions, "user
// CIPHER" when userspace does (either direction).
std::string describe(const Info& i);

// How a client session's tcp paths, or a server's tcp listeners, use TLS (ClientOptions::tls,
// ServerOptions::tls). TLS is the tcp fabric's: rdma paths are not encrypted (NVMe/RDMA has no
// TLS either), loopback needs none.
struct Options {
  // client: off, or on (TLS on every tcp path). server: off, on (offered: a client may use it),
  // required (a plaintext client is refused with EPROTONOSUPPORT).
  enum class Mode : uint8_t { off, on, required };
  Mode mode = Mode::off;
  // Certificates (PEM; Config says what each role needs). Without them, PSKs derived from the
  // host keys of authentication (ibtrs/auth.h, tls_psk_of): the client needs its key, the
  // server its Authenticator.
  std::string cert_file, key_file, ca_file, server_name;
  bool kernel = true;  // Config::kernel
};
// "off", "on", "required"; EINVAL for anything else.
Result<Options::Mode> parse_mode(std::string_view s);
std::string_view to_string(Options::Mode m);

// Whether this kernel has TLS record offload (TCP_ULP "tls"); probed once per process on a
// loopback socket pair.
bool kernel_tls_available();

// True when `first` starts a TLS handshake record (content type 22, version 3.x): lets a
// listener that requires TLS tell a plaintext peer from a TLS one by its first bytes.
bool looks_like_tls(std::span<const std::byte> first);

// PSK files: lines "identity:hexkey" (the GnuTLS psktool format nbdkit and libnbd take; blank
// lines and '#' comments skipped). Errors: ENOENT, EACCES (the file is readable by group or
// others), EINVAL (format, an identity twice, no entry).
Result<std::vector<Psk>> read_psk_entries(const std::string& path);
// The first entry (a client's file).
Result<Psk> read_psk_file(const std::string& path);
// Writes one entry, mode 0600 (EEXIST unless `overwrite`).
Status write_psk_file(const std::string& path, const Psk& psk, bool overwrite = false);
// A fresh 32-byte key from OpenSSL's CSPRNG for `identity`. EINVAL for a bad identity.
Result<Psk> generate_psk(std::string identity);

}  // namespace ibtrs::tls
