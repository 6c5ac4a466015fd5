// The hostile-peer suite's harness: the real daemons as separate processes (ibnbd-server on a
// free loopback port with a temporary export directory, control socket and host config;
// ibnbd-client where a case needs it), what a case asserts after an attack (the server is alive,
// its control socket answers, an honest client on its own session writes and verifies within a
// deadline, its VmRSS and descriptor count stay bounded, a victim's bytes are intact), and the
// library clients (in this process, authenticated as a host of the config).
//
// Threading: one test thread drives everything; HonestSession may be used from one other thread
// (a victim writing while the test attacks).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ibnbd/client.h"
#include "ibtrs/address.h"
#include "ibtrs/auth.h"

namespace ibnbd::hostile {

using namespace std::chrono_literals;
using Ms = std::chrono::milliseconds;

// The binaries under test: CMake's, unless IBNBD_HOSTILE_SERVER, IBNBD_HOSTILE_CLIENT or
// IBNBD_HOSTILE_CLI name others.
const char* server_bin();
const char* client_bin();
const char* cli_bin();

// What a process holds, from /proc/PID/status and /proc/PID/fd.
struct Usage {
  uint64_t rss_kb = 0;
  size_t fds = 0;
};
std::optional<Usage> usage_of(pid_t pid);

struct CommandResult {
  int exit_code = -1;  // -1: killed at the deadline or not started
  std::string out, err;
  Ms took{0};
};
// Runs `argv` with stdin closed; kills it at `deadline`.
CommandResult run_command(const std::vector<std::string>& argv, Ms deadline);

// A directory under /var/tmp, removed with everything in it.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A daemon process, its stdout and stderr in a log file. Stopped (SIGTERM, then SIGKILL after
// the grace) at destruction.
class Daemon {
 public:
  static std::unique_ptr<Daemon> spawn(const std::vector<std::string>& argv, const std::string& log);
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  pid_t pid() const { return pid_; }
  bool alive();
  // Its exit status once it ended within `t` (after SIGTERM when `terminate`); nothing if not.
  std::optional<int> wait_exit(Ms t, bool terminate);
  std::string log() const;

 private:
  Daemon(pid_t pid, std::string log) : pid_(pid), log_(std::move(log)) {}
  pid_t pid_;
  std::string log_;
  std::optional<int> status_;
};

// Waits until `path` exists (true) or `t` passed.
bool wait_for_file(const std::string& path, Ms t);

// A session as `ibnbd server session list` shows it.
struct SessionSeen {
  std::string name;
  std::string host;  // "" anonymous
  size_t paths = 0;
};

// The hosts of the server's config (docs/security.d/auth.md), as users run it: no
// --allow-any-host, so a client without credentials, an unknown host or a wrong key gets nothing.
//   honest   rw on honest/**: the honest clients and the victims
//   mallory  migration on mallory/**, ro on shared/**: an insider, a host with valid credentials
//            and grants of its own, which the attackers that need a session authenticate as
inline constexpr const char* kHonest = "honest";
inline constexpr const char* kMallory = "mallory";

// ibnbd-server on tcp:127.0.0.1 (a free port), exporting <dir>/export (with the directories
// honest/, mallory/ and shared/), with its control socket <dir>/srv.sock and the hosts above in
// <dir>/hosts.json, their key files <dir>/HOST.key (fresh secrets, mode 0600). Small sessions
// (queue depth 32 of 128 KiB chunks: 4 MiB each) so that memory figures mean something.
class ServerUnderTest {
 public:
  explicit ServerUnderTest(const std::vector<std::string>& extra_args = {});
  bool ok() const { return daemon_ != nullptr && !addr_.empty(); }
  const std::string& why() const { return why_; }  // when !ok()

  const std::string& dir() const { return dir_.path(); }
  std::string export_dir() const { return dir() + "/export"; }
  std::string control_socket() const { return dir() + "/srv.sock"; }
  ibtrs::Address address() const;
  std::string key_file(const std::string& host) const { return dir() + "/" + host + ".key"; }
  // The credentials of kHonest or kMallory, from their key files (empty for others: anonymous).
  ibtrs::ClientAuth credentials(const std::string& host) const;
  pid_t pid() const { return daemon_->pid(); }
  bool alive() { return daemon_->alive(); }
  std::string log() const { return daemon_->log(); }
  std::optional<Usage> usage() const { return usage_of(pid()); }
  // SIGTERM and its exit status (0: it closed every session and, in a sanitizer build, found
  // nothing); nothing when it did not end within `t`.
  std::optional<int> stop(Ms t) { return daemon_->wait_exit(t, true); }

  // A sparse file of `size` bytes in the export directory.
  void make_file(const std::string& name, uint64_t size) const;
  // `ibnbd server session list --socket <control socket>` (JSON).
  CommandResult session_list(Ms deadline) const;
  // The same, read: nothing when the command failed or printed something else.
  std::optional<std::vector<SessionSeen>> sessions(Ms deadline) const;
  // `ibnbd server host stats`: its counters by name (authenticated, anonymous,
  // refused_no_credentials, refused_unknown_host, refused_bad_response, refused_host_mismatch,
  // open_refused_eacces, open_refused_eperm, ...); empty when the command failed.
  std::map<std::string, uint64_t> auth_stats(Ms deadline) const;
  // `ibnbd server refusals list`: the count of each reason (docs/security.d/bounds.md); empty
  // when the command failed.
  std::map<std::string, uint64_t> refusals(Ms deadline) const;
  // The file's bytes as the server stored them.
  std::vector<std::byte> file_bytes(const std::string& name, uint64_t off, size_t len) const;

 private:
  // The key files and hosts.json; false (why_ set) when they could not be written.
  bool write_hosts();
  TempDir dir_;
  std::map<std::string, ibtrs::ClientAuth> hosts_;
  std::unique_ptr<Daemon> daemon_;
  std::string addr_;
  std::string why_;
};

// Deterministic bytes of a (seed, offset): what honest clients write and verify.
void pattern(std::byte* p, size_t len, uint64_t offset, uint32_t seed);
bool matches(const std::byte* p, size_t len, uint64_t offset, uint32_t seed);

// A client of the library: one BlockSession (its own session name, authenticated with `auth`)
// and devices mapped through it. Honest in the cases' victims and honest round trips (as
// kHonest); an insider's own library session where a case needs one. Every wait is bounded by
// `deadline` (connect, control requests, IO).
class HonestSession {
 public:
  // Errors: BlockSession::open's (EACCES: refused credentials).
  static Result<std::unique_ptr<HonestSession>> open(const ibtrs::Address& a, const ibtrs::ClientAuth& auth,
                                                     const std::string& name, Ms deadline);
  ~HonestSession();
  Result<std::shared_ptr<RemoteDevice>> map(const std::string& dev, AccessMode mode);
  Status unmap(const std::string& dev);
  // Writes `len` bytes of pattern(seed) at `off` and reads them back: 0, or the errno (EILSEQ
  // when the bytes read differ).
  int write_verify(RemoteDevice& d, uint64_t off, size_t len, uint32_t seed);
  int write(RemoteDevice& d, uint64_t off, size_t len, uint32_t seed);
  int verify(RemoteDevice& d, uint64_t off, size_t len, uint32_t seed);
  BlockSession& session() { return *s_; }

 private:
  HonestSession() = default;
  int io(RemoteDevice& d, bool write, uint64_t off, size_t len, std::byte* buf);
  std::unique_ptr<BlockSession> s_;
  std::unique_ptr<ibtrs::RegisteredMemory> buf_;  // 2 MiB: data out, data back
  Ms deadline_{10000};
};

// One honest round trip on a fresh session authenticated with `auth`: open, map `dev` rw, write
// + verify 1 MiB, unmap, close. `err` 0 on success, else what failed (`what`).
struct HonestResult {
  int err = 0;
  std::string what;
  Ms took{0};
};
HonestResult honest_round_trip(const ibtrs::Address& a, const ibtrs::ClientAuth& auth, const std::string& session,
                               const std::string& dev, uint32_t seed, Ms deadline);

}  // namespace ibnbd::hostile
