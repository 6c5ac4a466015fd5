// The IBNBD block server (kernel counterpart: rnbd-srv): exports regular files and block devices
// found under a search path, and RBD images of a Ceph cluster (ibnbd/rbd.h), to IBNBD clients
// over an IBTRS server, with the IO moved by io_uring (librbd for images) straight between the
// transport chunks and the store.
//
// Threads: the IBTRS server's IO threads decode requests and submit IO to their own io_uring
// (one per IO thread, driven as an IoThreadHook, so a request is received, submitted and
// answered on one thread); OPEN and CLOSE, which touch the filesystem, WATCH (size notices),
// the periodic size check and the admin operations run on the block server's control thread. Every public function may be called from any thread
// except from inside a request's completion (none are exposed).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ibnbd/backend.h"
#include "ibnbd/rbd.h"
#include "ibnbd/types.h"
#include "ibtrs/server.h"

namespace ibnbd {

// Per-export access control (docs/security.d/auth.md): one grant of a host.
//   devices  "**" every device; "dir/**" everything beneath dir; otherwise a glob (fnmatch(3),
//            '*' never crosses a '/') over the device's path under the search root
//   mode     the highest mode granted: ro < rw < migration
struct AccessRule {
  std::string devices;
  AccessMode mode = AccessMode::ro;
};

// A host the server knows: its secrets (ibtrs/auth.h) and what it may open.
struct HostConfig {
  std::string host;                      // host id (ibtrs::valid_host_id)
  std::vector<ibtrs::Secret> keys;       // at least one; any of them authenticates the host
  std::optional<ibtrs::Secret> server_key;  // for hosts that make the server prove itself
  std::vector<AccessRule> access;        // none: the host authenticates but may open nothing
};

// A host as listings show it: fingerprints, never secrets.
struct HostInfo {
  std::string host;
  std::vector<std::string> key_fingerprints;
  std::string server_key_fingerprint;    // "" without one
  std::vector<AccessRule> access;
  uint32_t sessions = 0;                 // live sessions authenticated as this host
};

struct AuthStats {
  ibtrs::AuthCounters transport;         // per path: authenticated, anonymous, refusals
  uint64_t open_refused_eacces = 0;      // OPENs of devices the host may not open
  uint64_t open_refused_eperm = 0;       // OPENs in a mode the host may not use there
  bool allow_any_host = false;
};

struct BlockServerOptions {
  // The transport: listen addresses, queue depth, chunk size, IO threads, heartbeats,
  // always_invalidate. `handler` is set by the block server.
  ibtrs::ServerOptions transport;
  // Where exported devices live (kernel: dev_search_path); %SESSNAME% is replaced by the client
  // session's name for per-session namespaces. Must be absolute.
  std::string dev_search_path = "/";
  DirectIo direct_io = DirectIo::prefer;
  // Every device is exported read-only: rw and migration opens are refused with EROFS.
  bool read_only = false;
  uint32_t engine_queue_depth = 1024;  // io_uring requests in flight per IO thread
  uint32_t max_devices_per_session = 256;
  // How often the control thread re-reads the size of every open device (fstat, BLKGETSIZE64,
  // librbd's cached size) and tells the sessions that hold a resized one (protocol 4's WATCH;
  // docs/protocol.md). An RBD image's header watch tells at once besides. 0: never polled.
  std::chrono::milliseconds size_check_interval{1000};
  // Who may connect and open what. A host must authenticate with one of its keys and may open
  // the devices its access rules grant: OPEN of another device is EACCES, in a higher mode
  // EPERM. Unlisted hosts are refused (EACCES) unless allow_any_host, which admits anyone who
  // reaches the port -- anonymous clients included -- to every device in every mode (the
  // kernel's RNBD); listed hosts keep their rules then. The transport's authenticator and
  // allow_any_host are set from these.
  std::vector<HostConfig> hosts;
  bool allow_any_host = false;
  // RBD exports: a client's "rbd:POOL/IMAGE[@SNAP]" opens that image of this cluster (never a
  // file of the search path; without this, such names are EOPNOTSUPP). The access rules apply
  // to the name as written ("rbd:pool/**" grants a pool). The cluster is connected at the first
  // such OPEN, on the control thread (at most connect_timeout; after a failure, OPENs within 5 s
  // get its error at once rather than waiting again).
  std::optional<RbdConfig> rbd;
};

// A device's and a session's counters are BlockStats (ibnbd/types.h, where the daemon's typed
// reports in control/ reach them too).

struct DeviceHolderInfo {
  std::string session;
  uint32_t device_id = 0;
  AccessMode mode = AccessMode::ro;
};

struct ExportedDeviceInfo {
  std::string name;  // the resolved path under the search root
  std::string kind;  // "file" | "block_device" | "rbd"
  uint64_t size = 0;
  bool direct = false;
  bool read_only = false;
  std::vector<DeviceHolderInfo> holders;
  BlockStats stats;
};

struct SessionOpenInfo {
  uint32_t device_id = 0;
  std::string device;
  AccessMode mode = AccessMode::ro;
  bool force_closed = false;
};

struct BlockSessionInfo {
  std::string name;
  std::string host;     // the authenticated host ("" anonymous)
  uint8_t version = 0;  // negotiated (0 before SESS_INFO)
  bool watching = false;     // its WATCH (size notices, version 4) is held by the server
  uint64_t size_epoch = 0;   // its size epoch (changes when a device it holds is resized)
  std::vector<ibtrs::ServerPathInfo> paths;
  std::vector<SessionOpenInfo> devices;
  BlockStats stats;
};

class BlockServer {
 public:
  // Errors: EINVAL (bad options), what ibtrs::Server::start and io_uring setup return.
  static Result<std::unique_ptr<BlockServer>> start(BlockServerOptions options);
  // Graceful: closes every session, waits for the IO in flight, syncs and closes the devices.
  ~BlockServer();
  BlockServer(const BlockServer&) = delete;
  BlockServer& operator=(const BlockServer&) = delete;

  std::vector<ibtrs::Address> addresses() const;
  // As given to start().
  const BlockServerOptions& options() const;
  // The transport's options in force (ibtrs::Server::options: options().transport with the
  // transport's clamps applied, e.g. drain_hold): what `limits` and the metrics show. Any thread.
  const ibtrs::ServerOptions& transport_options() const;
  std::vector<BlockSessionInfo> sessions() const;
  std::vector<ExportedDeviceInfo> devices() const;
  // Takes `device` (its name as devices() shows it) away from `session`: its IO gets ENODEV until
  // the client closes and reopens it. ENOENT when the session does not hold the device.
  Status force_close(std::string_view device, std::string_view session);
  // Passes through to the transport session (ENOENT for an unknown session or path).
  Status disconnect_path(std::string_view session, std::string_view path);
  // `path` empty: every path of the session. `group`: the counters of one stats file, or all.
  Status reset_path_stats(std::string_view session, std::string_view path,
                          ibtrs::StatsGroup group = ibtrs::StatsGroup::all);
  // Peers refused or cut off, by reason (ibtrs/refusals.h): the transport's and whatever the
  // block server counts there itself. Valid while the server lives.
  ibtrs::Refusals& refusals() const;
  // What peers hold now, against transport_options()' caps.
  ibtrs::ServerUsage usage() const;
  // How each transport IO thread waited for work (ibtrs::Server::io_thread_stats).
  std::vector<ibtrs::IoThreadWaitStats> io_thread_stats() const;

  // Hosts at run time (`ibnbd server host add/list/remove`). set_host adds a host or replaces
  // it: new keys (key rotation) apply to paths that authenticate from now on -- the old key is
  // refused, established paths stay -- and new rules to OPENs from now on. keep_access: a
  // replaced host keeps its rules (only the keys change). EINVAL: a bad host id, no key, a bad
  // rule. remove_host: ENOENT; its live sessions stay, but their new paths and OPENs are
  // refused.
  Status set_host(HostConfig h, bool keep_access = false);
  Status remove_host(std::string_view host);
  std::vector<HostInfo> hosts() const;
  AuthStats auth_stats() const;

  struct Impl;

 private:
  explicit BlockServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ibnbd
