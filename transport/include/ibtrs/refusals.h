// Refusals: every peer a server turns away, or cuts off, counted by reason and logged.
//
// The transport server counts its own (ibtrs::refusal below: caps, deadlines, peers that stop
// acknowledging); the layers above count theirs through the same object (ibtrs::Server::
// refusals()), under names of their own (authentication failures, access rules). A reason is a
// short snake_case word naming what was exceeded or violated; its count is cumulative since the
// server started or reset() was called. Daemons show the snapshot in their stats (ibnbd-server:
// the control socket's `refusals`, `ibnbd server refusals`, ibtrs-server/ctl/refusals/).
//
// Logging: each refusal is a warn line with its reason and detail, rate-limited per reason: after
// a line, further refusals of that reason within kLogInterval are only counted, and the next line
// says how many went unlogged. A flood of one kind costs one line a second, and still shows.
//
// Threading: every method is thread-safe. refuse() takes a mutex: refusals are rare by nature,
// and the IO path refuses only a peer it is about to disconnect.
#pragma once

#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace ibtrs {

struct RefusalCount {
  std::string reason;
  uint64_t count = 0;
  std::string last;          // the detail of the latest refusal ("" before the first)
  int64_t last_unix_ms = 0;  // when it happened (0 before the first)
};

class Refusals {
 public:
  static constexpr std::chrono::seconds kLogInterval{1};

  // Reasons listed (with count 0) before their first refusal, so that a snapshot shows what is
  // watched. refuse() accepts any reason, declared or not.
  void declare(std::initializer_list<std::string_view> reasons);
  // Counts `n` refusals of `reason` and logs `detail` (rate-limited, see above).
  void refuse(std::string_view reason, std::string_view detail, uint64_t n = 1);
  // Every declared or counted reason, sorted by name.
  std::vector<RefusalCount> snapshot() const;
  uint64_t count(std::string_view reason) const;
  // Zeroes the counts (the reasons stay listed).
  void reset();

 private:
  struct Entry {
    uint64_t count = 0;
    uint64_t unlogged = 0;
    std::chrono::steady_clock::time_point logged{};
    bool ever_logged = false;
    std::string last;
    int64_t last_unix_ms = 0;
  };
  mutable std::mutex mu_;
  std::map<std::string, Entry, std::less<>> entries_;
};

// The transport server's reasons (docs/security.d/bounds.md has what each bounds and the errno
// a refused client sees).
namespace refusal {
// Connection requests refused (the client's connect fails with the CON_RSP errno).
inline constexpr std::string_view kSessionLimit = "session_limit";            // EUSERS
inline constexpr std::string_view kPathLimit = "path_limit";                  // EMLINK
inline constexpr std::string_view kChunkMemoryLimit = "chunk_memory_limit";   // ENOMEM
inline constexpr std::string_view kBadConnectRequest = "bad_connect_request";  // CON_REQ refused
inline constexpr std::string_view kNoResources = "no_resources";  // registration, CQ failed: ENOMEM
// Held behind a session still draining (ServerOptions::drain_hold): EAGAIN, retried by the client.
inline constexpr std::string_view kDrainHoldTimeout = "drain_hold_timeout";  // held past drain_hold
inline constexpr std::string_view kDrainHoldLimit = "drain_hold_limit";  // too many held already
// Paths closed by the server.
inline constexpr std::string_view kProtocolError = "protocol_error";  // a malformed message
inline constexpr std::string_view kHandshakeTimeout = "handshake_timeout";  // not CONNECTED in time
inline constexpr std::string_view kHandshakeEvicted = "handshake_evicted";  // made room at a cap
inline constexpr std::string_view kAckTimeout = "ack_timeout";  // responses not acknowledged
// Authentication (ibtrs/auth.h): connection requests and paths refused with EACCES/EPROTO.
inline constexpr std::string_view kAuthNoCredentials = "auth_no_credentials";  // allow_any_host off
inline constexpr std::string_view kAuthUnknownHost = "auth_unknown_host";
inline constexpr std::string_view kAuthBadResponse = "auth_bad_response";  // wrong key, replay
inline constexpr std::string_view kAuthHostMismatch = "auth_host_mismatch";  // another host's session
inline constexpr std::string_view kAuthProtocol = "auth_protocol";  // malformed, out of order
// Sockets dropped by a listener before they made a request (fabric::Listener::Drops).
inline constexpr std::string_view kListenTimeout = "listen_timeout";
inline constexpr std::string_view kListenOverflow = "listen_overflow";
inline constexpr std::string_view kListenInvalid = "listen_invalid";
inline constexpr std::string_view kListenError = "listen_error";  // accept failed (EMFILE, ...)
inline constexpr std::string_view kListenPlaintext = "listen_plaintext";  // no TLS, TLS required
inline constexpr std::string_view kListenTlsFailed = "listen_tls_failed";  // TLS handshake failed
}  // namespace refusal

}  // namespace ibtrs
