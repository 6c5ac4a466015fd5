// The server daemon's typed reports (server_commands.h): path_stats's paths as
// control::PathReport, devices' devices and refusals' refusals (control/server_reports.h).
// sysfs-emu's server tree binds them; server_command writes the devices and refusals answers
// from them. Its own file: added to server_commands.cc, server_paths changed GCC's inlining there
// enough for -Wnull-dereference to flag nlohmann::json's value() (a false positive under -Werror).
#include <cerrno>

#include "ibtrs/tls.h"
#include "server_commands.h"

namespace ibnbd {

Result<std::vector<control::PathReport>> server_paths(BlockServer& srv, const std::string& session,
                                                     const std::string& path) {
  for (auto& s : srv.sessions()) {
    if (s.name != session) continue;
    std::vector<control::PathReport> out;
    for (auto& p : s.paths) {
      if (!path.empty() && p.name != path) continue;
      // What path_stats writes of the path (path_json and its additions), typed.
      control::PathReport r;
      r.session = s.name;
      r.name = p.name;
      r.state = std::string(ibtrs::to_string(p.state));
      r.fabric = std::string(ibtrs::to_string(p.local.fabric));
      r.hca_name = p.hca_name;
      r.hca_port = p.hca_port;
      r.src_addr = p.peer.to_string();
      r.dst_addr = p.local.to_string();
      r.src_host = p.peer.host_string();
      r.dst_host = p.local.host_string();
      r.dst_port = p.local.port;
      r.auth = std::string(ibtrs::to_string(p.auth.state));
      r.auth_host = p.auth.host;
      r.auth_bidirectional = p.auth.bidirectional;
      r.auth_method = p.auth.method;
      r.tls = ibtrs::tls::describe(p.tls);
      r.stats = p.stats;
      out.push_back(std::move(r));
    }
    if (!path.empty() && out.empty()) return ibtrs::errc(ENOENT);
    return out;
  }
  return ibtrs::errc(ENOENT);
}

std::vector<control::ExportedDeviceReport> server_devices(BlockServer& srv) {
  std::vector<control::ExportedDeviceReport> out;
  for (ExportedDeviceInfo& d : srv.devices()) {
    control::ExportedDeviceReport r;
    r.name = std::move(d.name);
    r.kind = std::move(d.kind);
    r.size = d.size;
    r.direct = d.direct;
    r.read_only = d.read_only;
    for (DeviceHolderInfo& h : d.holders)
      r.holders.push_back({std::move(h.session), h.device_id, std::string(to_string(h.mode))});
    r.stats = d.stats;
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<control::RefusalReport> server_refusals(BlockServer& srv) { return srv.refusals().snapshot(); }

}  // namespace ibnbd
