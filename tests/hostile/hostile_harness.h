// The hostile-peer suite's harness: the real daemons as separate processes (ibnbd-server on a
// free loopback port with a temporary export directory and control socket; ibnbd-client where a
// case needs it), what a case asserts after an attack (the server is alive, its control socket
// answers, an honest client on its own session writes and verifies within a deadline, its VmRSS
// and descriptor count stay bounded, a victim's bytes are intact), and the honest clients
// themselves (the client library, in this process).
//
// Threading: one test thread drives everything; HonestSession may be used from one other thread
// (a victim writing while the test attacks).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ibnbd/client.h"
#include "ibtrs/address.h"

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

// ibnbd-server on tcp:127.0.0.1 (a free port), exporting <dir>/export, with its control socket
// <dir>/srv.sock. Small sessions (queue depth 32 of 128 KiB chunks: 4 MiB each) so that memory
// figures mean something.
class ServerUnderTest {
 public:
  explicit ServerUnderTest(const std::vector<std::string>& extra_args = {});
  bool ok() const { return daemon_ != nullptr && !addr_.empty(); }
  const std::string& why() const { return why_; }  // when !ok()

  const std::string& dir() const { return dir_.path(); }
  std::string export_dir() const { return dir() + "/export"; }
  std::string control_socket() const { return dir() + "/srv.sock"; }
  ibtrs::Address address() const;
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
  // The file's bytes as the server stored them.
  std::vector<std::byte> file_bytes(const std::string& name, uint64_t off, size_t len) const;

 private:
  TempDir dir_;
  std::unique_ptr<Daemon> daemon_;
  std::string addr_;
  std::string why_;
};

// Deterministic bytes of a (seed, offset): what honest clients write and verify.
void pattern(std::byte* p, size_t len, uint64_t offset, uint32_t seed);
bool matches(const std::byte* p, size_t len, uint64_t offset, uint32_t seed);

// An honest client: one BlockSession (its own session name) and devices mapped through it.
// Every wait is bounded by `deadline` (connect, control requests, IO).
class HonestSession {
 public:
  static Result<std::unique_ptr<HonestSession>> open(const ibtrs::Address& a, const std::string& name,
                                                     Ms deadline);
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

// One honest round trip on a fresh session: open, map `dev` rw, write + verify 1 MiB, unmap,
// close. `err` 0 on success, else what failed (`what`).
struct HonestResult {
  int err = 0;
  std::string what;
  Ms took{0};
};
HonestResult honest_round_trip(const ibtrs::Address& a, const std::string& session, const std::string& dev,
                               uint32_t seed, Ms deadline);

}  // namespace ibnbd::hostile
