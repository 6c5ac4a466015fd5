// The IBNBD client daemon's state (kernel counterpart: rnbd-clt's sessions and devices): the
// block sessions it holds, the devices mapped through them, and every admin command of the CLI
// (`ibnbd client ...`) as a JSON request -> JSON answer. The control socket, and later the sysfs
// tree, are thin layers over this.
//
// Threading: handle() from any thread; commands are serialized (one at a time). Session events
// arrive on transport threads and only log.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include <nlohmann/json.hpp>

#include "control_socket.h"
#include "ibnbd/client.h"
#include "ibnbd/nbd_server.h"

namespace ibnbd {

struct ClientDaemonOptions {
  uint32_t io_threads = 0;  // per session; 0: the transport's default
  ibtrs::HeartbeatConfig heartbeat;
  ibtrs::ReconnectConfig reconnect;
  std::chrono::milliseconds connect_timeout{30000};
  ibtrs::MpPolicy policy = ibtrs::MpPolicy::min_inflight;
};

class ClientDaemon {
 public:
  explicit ClientDaemon(ClientDaemonOptions o) : opts_(std::move(o)) {}
  ~ClientDaemon();  // unmaps everything and closes the sessions

  // One admin command (see client/README.md, "Control socket"). Never throws.
  nlohmann::json handle(const nlohmann::json& req, const ControlSocket::Emit& emit);

 private:
  struct Sess {
    std::unique_ptr<BlockSession> s;
    std::unique_ptr<ibtrs::RegisteredMemory> io_buf;  // for device_io
  };
  using json = nlohmann::json;

  json device_map(const json& req);
  json device_list(const json& req, bool one);
  json device_unmap(const json& req);
  json device_remap(const json& req);
  json device_io(const json& req, const ControlSocket::Emit& emit);
  json session_list(const json& req, bool one);
  json session_close(const json& req);
  json path_list(const json& req);
  json path_op(const json& req, const std::string& op);
  json policy_set(const json& req);
  // client_daemon_paths.cc: per-path statistics and session settings (the sysfs files' commands).
  json path_stats(const json& req);
  json path_reset_stats(const json& req);
  json max_reconnect_attempts(const json& req);
  json nbd_export(const json& req);
  json nbd_unexport(const json& req);
  json nbd_list(const json& req);
  // Stops the NBD export of a device (waits for its requests in flight); false if none.
  bool stop_export(const std::string& dev);
  std::string export_addresses(const std::string& dev) const;

  // The session and device of a mapped device name. ENOENT as an answer when unknown.
  std::pair<Sess*, std::shared_ptr<RemoteDevice>> find_device(const std::string& name);
  Sess* find_session(const std::string& name);

  ClientDaemonOptions opts_;
  std::mutex mu_;  // serializes commands
  std::map<std::string, Sess, std::less<>> sessions_;
  // NBD exports by device name (nbd_export): one NBD server each, with its own listeners.
  struct NbdExport {
    std::string name;  // the NBD export name
    std::unique_ptr<nbd::NbdServer> server;
  };
  std::map<std::string, NbdExport, std::less<>> exports_;
};

}  // namespace ibnbd
