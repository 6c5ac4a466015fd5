// Host authentication of libibtrs (docs/security.d/auth.md, docs/protocol.md "Authentication"):
// a host is a printable id (like an NVMe host NQN) with a secret; before a path's INFO_RSP
// reveals any chunk key, the server challenges the client on the path's service connection and
// the client proves the secret with DH-HMAC-CHAP (NVMe TP 8006: HMAC-SHA-256 over the nonce,
// transaction id, sequence number, session and path identity and host id, augmented with an
// X25519 exchange so a recorded exchange cannot be replayed). Optionally the client challenges
// the server back with a second secret (bidirectional).
//
// Secrets are written as NVMe's DHHC-1 representation, "DHHC-1:<hh>:<base64(key || CRC-32)>:",
// hh = 00 (used as is), 01/02/03 (transformed with HMAC-SHA-256/384/512 over the host id and
// "NVMe-over-Fabrics" before use, as TP 8006 does with the NQN). Key files hold a host id and
// its secrets as text and are refused when anyone but their owner and group may read them.
//
// Threading: the free functions and Secret are thread-safe. Authenticator implementations are
// called from the server's control thread while their owner may change them from any thread:
// they synchronize themselves.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ibtrs/result.h"
#include "ibtrs/tls.h"

namespace ibtrs {

// A DH-HMAC-CHAP secret. Its bytes are wiped when it goes.
class Secret {
 public:
  // How the secret becomes the HMAC key (the DHHC-1 "hh" field).
  enum class Transform : uint8_t { none = 0, sha256 = 1, sha384 = 2, sha512 = 3 };

  // Parses "DHHC-1:<hh>:<base64>:" (surrounding whitespace allowed). EINVAL: not that format,
  // hh not 00..03, a key not 32, 48 or 64 bytes; EBADMSG: the CRC-32 does not match.
  static Result<Secret> parse(std::string_view text);
  // A fresh random secret of `len` bytes (32, 48 or 64; else EINVAL).
  static Result<Secret> generate(Transform t = Transform::sha256, size_t len = 32);

  Secret() = default;  // empty: no secret (parse() and generate() never return one)
  Secret(const Secret& o);
  Secret& operator=(const Secret& o);
  Secret(Secret&& o) noexcept;
  Secret& operator=(Secret&& o) noexcept;
  ~Secret();

  // The DHHC-1 text (what parse() takes).
  std::string to_string() const;
  Transform transform() const { return transform_; }
  const std::vector<uint8_t>& bytes() const { return key_; }
  bool empty() const { return key_.empty(); }
  // 16 hex digits of SHA-256 over the DHHC-1 text: names a key in listings and logs without
  // revealing it.
  std::string fingerprint() const;
  // Constant time in the key bytes.
  friend bool operator==(const Secret& a, const Secret& b);

 private:
  Secret(Transform t, std::vector<uint8_t> key) : transform_(t), key_(std::move(key)) {}
  Transform transform_ = Transform::none;
  std::vector<uint8_t> key_;
};

// Host ids: printable ASCII without spaces (0x21..0x7e), 1..kHostIdMax bytes (an NVMe NQN's
// limit).
inline constexpr size_t kHostIdMax = 223;
bool valid_host_id(std::string_view id);
// "nqn.2014-08.org.nvmexpress:uuid:<random uuid>": NVMe's form for hosts without a domain.
std::string generate_host_id();

// A key file (ibnbd key generate):
//   # comments and blank lines
//   host <host id>
//   key DHHC-1:01:...:            the host's secret (required)
//   server-key DHHC-1:01:...:     the server's secret, for bidirectional authentication
// A file holding only a bare DHHC-1 line (nvme-cli's form) is a key without a host id.
struct KeyFile {
  std::string host;                   // empty: not in the file
  Secret key;
  std::optional<Secret> server_key;
};
// Errors: EPERM (the file may be read or written by others than its owner and group: chmod
// 600), EINVAL (syntax; `why` says which line), EBADMSG (a secret's CRC), what open/read say.
Result<KeyFile> load_key_file(const std::string& path, std::string* why = nullptr);
std::string format_key_file(const KeyFile& k);
// Writes a new file with mode 0600 (EEXIST when it exists).
Status save_key_file(const std::string& path, const KeyFile& k);

// A client's credentials (ClientOptions::auth). Without a key the client does not authenticate
// and only a server that allows any host admits it.
struct ClientAuth {
  std::string host_id;
  std::optional<Secret> key;
  // Set: the client also challenges the server and refuses it unless it proves this secret.
  std::optional<Secret> server_key;
  bool enabled() const { return key.has_value(); }
};
// A client's credentials from a key file: its key and server key, as host `host` (when not
// empty) or the file's host line. Errors as load_key_file, and EINVAL when no valid host id
// results; `why` says which.
Result<ClientAuth> client_auth_from_key_file(const std::string& path, const std::string& host = {},
                                             std::string* why = nullptr);

// What a server knows of one host.
struct HostKeys {
  std::vector<Secret> keys;          // any of them authenticates the host (rotation overlap)
  std::optional<Secret> server_key;  // what the server proves when the host asks it to
};

// The server's source of host secrets (ServerOptions::authenticator).
class Authenticator {
 public:
  virtual ~Authenticator() = default;
  // The secrets of `host`, or nullopt for a host the server does not know. Called on the
  // server's control thread for every path that authenticates; must not block for long.
  virtual std::optional<HostKeys> host_keys(std::string_view host) const = 0;
};

// An Authenticator over a table the owner changes at run time (key rotation: a host's new keys
// apply to the paths that authenticate from then on; established paths stay). Thread-safe.
class KeyTable final : public Authenticator {
 public:
  // Adds or replaces `host`. EINVAL: a bad host id, no key, or an empty secret.
  Status set(const std::string& host, HostKeys keys);
  // False when the host was not there.
  bool remove(std::string_view host);
  std::vector<std::string> hosts() const;
  std::optional<HostKeys> host_keys(std::string_view host) const override;

 private:
  mutable std::mutex mu_;
  std::map<std::string, HostKeys, std::less<>> hosts_;
};

// Authentication of one path, as listings show it.
enum class AuthState : uint8_t {
  none,           // no authentication: an anonymous path of a server that allows any host
  pending,        // being established: the exchange has not finished
  authenticated,  // the host proved its secret
  failed,         // refused (the path is closed or closing)
};
std::string_view to_string(AuthState s);

struct PathAuthInfo {
  AuthState state = AuthState::none;
  std::string host;              // the authenticated host id ("" when none)
  bool bidirectional = false;    // the server proved its secret to the client too
  std::string method;            // "dhchap-sha256-x25519" when authenticated
};

// TLS pre-shared keys from host keys (the tcp fabric's TLS, docs/security.md): a host that has
// a DH-HMAC-CHAP secret also has a TLS 1.3 PSK, as NVMe/TCP derives its retained PSK from the
// configured one. Identity "<host id>/<the key's fingerprint>" (the fingerprint names which of
// a host's keys during a rotation), key HMAC-SHA-256(Kh, "IBNBD TLS PSK 1" || host id) with Kh
// the secret transformed for the host id as DH-HMAC-CHAP uses it. Errors: EINVAL (a bad host
// id, an empty secret).
Result<tls::Psk> tls_psk_of(std::string_view host, const Secret& key);
// The server's side: the key for a PSK identity, from the host's keys in `a` (nullopt: not an
// identity of ours, an unknown host, or no key of the host with that fingerprint).
std::optional<std::vector<std::byte>> tls_psk_lookup(const Authenticator& a, std::string_view identity);
// The host id a PSK identity names ("" when it is not one of ours).
std::string tls_psk_host(std::string_view identity);

}  // namespace ibtrs
