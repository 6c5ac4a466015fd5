// The IBNBD client daemon's state (kernel counterpart: rnbd-clt's sessions and devices): the
// block sessions it holds, the devices mapped through them, and every admin command of the CLI
// (`ibnbd client ...`) as a JSON request -> JSON answer. The control socket, and later the sysfs
// tree, are thin layers over this.
//
// A device mapped with `ublk` is also served as /dev/ublkbN (client/ublk); its record is kept in
// the state directory so that a daemon restarted after a crash takes it back (recover_ublk).
//
// Threading: handle() and recover_ublk() from any thread; commands are serialized (one at a
// time). Session events arrive on transport threads and only log; device events on the
// sessions' own threads: a resize logs and resizes the device's ublk device (ublk_mu_ only).
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "control/client_devices.h"
#include "control/client_sessions.h"
#include "control/socket.h"
#include "ibnbd/client.h"
#include "ibnbd/nbd_server.h"
#include "ibnbd/ublk.h"
#include "ublk_state.h"

namespace ibnbd {

struct ClientDaemonOptions {
  uint32_t io_threads = 0;  // per session; 0: the transport's default
  ibtrs::HeartbeatConfig heartbeat;
  ibtrs::ReconnectConfig reconnect;
  std::chrono::milliseconds connect_timeout{30000};
  ibtrs::MpPolicy policy = ibtrs::MpPolicy::min_inflight;
  // Records of ublk devices (see ublk_state.h).
  std::string state_dir = "/run/ibnbd-client";
  uint16_t ublk_queue_depth = 128;  // default of device_map's ublk_queue_depth
  std::string ublk_control = "/dev/ublk-control";
  bool ublk_reap = true;  // UblkOptions::reap: queue threads reap their connections
  // Host authentication (ibtrs/auth.h): the key file sessions authenticate with unless device
  // map names another, and the host id to authenticate as (default: the key file's host line).
  // No key file: sessions are anonymous, which only a server with allow_any_host admits.
  std::string host_key;
  std::string host_id;
  // TLS on the sessions' tcp paths (ibtrs/tls.h; mode off or on) unless device map says: a PSK
  // derived from the host key, or certificates (ca_file to verify the server).
  ibtrs::tls::Options tls;
};

class ClientDaemon {
 public:
  explicit ClientDaemon(ClientDaemonOptions o) : opts_(std::move(o)) {}
  // Stops and deletes its ublk devices (and their records), unmaps everything, closes the
  // sessions. Only a crash leaves ublk devices behind, for recover_ublk().
  ~ClientDaemon();

  // At start, before commands: for each record in the state directory, opens its session, maps
  // its device and takes the ublk device back (UblkDevice::recover). A record whose ublk device
  // no longer exists is dropped; one that fails otherwise (server unreachable, ...) is kept, with
  // the kernel device left quiesced, for the next start. Answers what happened per record.
  nlohmann::json recover_ublk();

  // One admin command (see client/README.md, "Control socket"). Never throws.
  nlohmann::json handle(const nlohmann::json& req, const control::Emit& emit);

  // The typed answers of commands (handle() writes them as JSON, control/client_devices.h and
  // client_sessions.h), serialized with the commands as handle() is:
  //   devices / device(name): device_list, and device_show of `name` (ENOENT when it is not
  //   mapped); sessions / session(name): session_list and session_show (ENOENT: no session);
  //   paths(session, path): path_stats of one path, or with path "" of every path of the
  //   session (ENOENT: no such session, or no such path in it);
  //   max_reconnect_attempts(session): session_max_reconnect_attempts without a value, the
  //   session's setting (-1..9999; ENOENT: no session).
  std::vector<control::DeviceReport> devices();
  Result<control::DeviceReport> device(const std::string& name);
  std::vector<control::SessionReport> sessions();
  Result<control::SessionReport> session(const std::string& name);
  Result<std::vector<control::PathReport>> paths(const std::string& session, const std::string& path);
  Result<int32_t> max_reconnect_attempts(const std::string& session);

  // The Prometheus text of the daemon's counters (client_daemon_metrics.cc; the metrics
  // endpoint's collector). Nothing when a command has held the daemon for kMetricsWait.
  std::optional<std::string> metrics();
  static constexpr std::chrono::milliseconds kMetricsWait{1000};

 private:
  // A block session the daemon opened for a map (ibnbd::BlockSession), with what it was opened
  // with: later maps through the same session name share it, and must name the same credentials
  // and TLS setting (open_session refuses others).
  struct OpenSession {
    std::unique_ptr<BlockSession> s;
    std::unique_ptr<ibtrs::RegisteredMemory> io_buf;  // for device_io
    std::string host_key, host;  // the credentials it was opened with (as map named them)
    std::string tls;             // "on", "off" as map named it, "" for the daemon's default
  };
  // Credentials from a key file and a host id (either may be "": the daemon's defaults). Errors
  // (EPERM for a key file others may read, EINVAL, ...) with a reason in `why`.
  Result<ibtrs::ClientAuth> credentials(const std::string& key_file, const std::string& host,
                                        std::string* why) const;
  using json = nlohmann::json;

  json device_map(const json& req);
  // device_map with standby_paths: a failover device over two sessions.
  json failover_map(const json& req, const std::string& dev, AccessMode mode, const std::vector<ibtrs::PathSpec>& paths,
                    const std::vector<std::string>& path_strs);
  json device_failover(const json& req);
  json device_list(const json& req, bool one);
  // device_list's reports (mu_ held): every device, or with `one` the device `only` (none when it
  // is not mapped) with its detail.
  std::vector<control::DeviceReport> device_reports(bool one, const std::string& only);
  json device_unmap(const json& req);
  json device_remap(const json& req);
  json device_io(const json& req, const control::Emit& emit);
  json session_list(const json& req, bool one);
  // session_list's reports (mu_ held): every session, or with `one` the session `only` (none
  // when there is no such session).
  std::vector<control::SessionReport> session_reports(bool one, const std::string& only);
  json session_close(const json& req);
  json path_list(const json& req);
  json path_op(const json& req, const std::string& op);
  json policy_set(const json& req);
  // client_daemon_paths.cc: per-path statistics and session settings (the sysfs files' commands).
  json path_stats(const json& req);
  // Appends the reports of the paths of session `sess` (mu_ held): every path, or the path
  // `only`; false when none was appended.
  bool path_reports(const std::string& sess, OpenSession& s, const std::string& only, std::vector<control::PathReport>& out);
  json path_reset_stats(const json& req);
  json session_max_reconnect_attempts(const json& req);
  json nbd_export(const json& req);
  json nbd_unexport(const json& req);
  json nbd_list(const json& req);
  // Stops the NBD export of a device (waits for its requests in flight); false if none.
  bool stop_export(const std::string& dev);
  std::string export_addresses(const std::string& dev) const;
  std::string ublk_path(const std::string& dev) const;  // "" without one

  // The session and device of a mapped device name (a failover device's active session), or
  // nulls.
  std::pair<OpenSession*, std::shared_ptr<RemoteDevice>> find_device(const std::string& name);
  // Unmaps a failover device (both sessions lose the device; a session left without devices
  // goes). The unmap's status.
  Status failover_unmap(const std::string& name, UnmapMode mode);
  OpenSession* find_session(const std::string& name);
  // The session `name`, opened over `paths` when there is none (paths it lacks are added).
  // With credentials as credentials() takes them; EINVAL (and `why`) when a session of that name
  // exists with other credentials.
  Result<OpenSession*> open_session(const std::string& name, const std::vector<ibtrs::PathSpec>& paths,
                             const std::string& host_key, const std::string& host, const std::string& tls,
                             std::string* why);
  // ENODEV naming ublk_drv when --ublk-control is missing (the module is not loaded), else null.
  nlohmann::json ublk_unavailable() const;
  // Serves a mapped device as /dev/ublkbN and records it. The answer is an error or null.
  nlohmann::json ublk_start(OpenSession& s, const std::shared_ptr<RemoteDevice>& d, const UblkRecord& rec,
                            uint16_t queue_depth);
  // Stops and deletes the device's ublk device and its record, if it has one.
  Status ublk_stop(const std::string& dev);
  // BlockSessionOptions::on_device_event of session `session` (resizes: the log, the ublk
  // device's size).
  void on_device_event(const std::string& session, const DeviceEvent& e);
  ublk::UblkOptions ublk_options(const RemoteDevice& d, uint16_t queue_depth) const;

  ClientDaemonOptions opts_;
  std::timed_mutex mu_;  // serializes commands (timed: metrics() does not wait out a long one)
  std::map<std::string, OpenSession, std::less<>> sessions_;
  // Failover devices by name (device map ... standby ...): the device, and its sessions as
  // mapped (the first was active then). Their legs are in both sessions' device lists, which
  // the listings skip.
  struct Failover {
    std::shared_ptr<RemoteDevice> dev;
    std::string sessions[2];
    std::vector<std::string> paths[2];
  };
  std::map<std::string, Failover, std::less<>> failover_;
  // NBD exports by device name (nbd_export): one NBD server each, with its own listeners.
  struct NbdExport {
    std::string name;  // the NBD export name
    std::unique_ptr<nbd::NbdServer> server;
    bool tls = false;  // STARTTLS required
  };
  std::map<std::string, NbdExport, std::less<>> exports_;
  // ublk devices by device name, and the directory of their records.
  struct Ublk {
    std::unique_ptr<ublk::UblkDevice> dev;
    UblkRecord rec;
  };
  // Changed by commands (under mu_) with ublk_mu_ held too; read by commands under mu_, and by
  // on_device_event under ublk_mu_ alone.
  std::map<std::string, Ublk, std::less<>> ublk_;
  std::mutex ublk_mu_;
  UblkStateDir state_{opts_.state_dir};
};

}  // namespace ibnbd
