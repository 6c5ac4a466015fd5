// The client daemon's sessions and paths as types (issue 18: typed daemon APIs, JSON only at
// the socket edge), as control/client_devices.h has its devices: what `session_list` /
// `session_show`, `path_list` and `path_stats` answer, and their one JSON form each (the
// answers the CLI renders, command.h). The daemon fills reports (ClientDaemon::sessions, paths);
// sysfs-emu reads them in-process without a JSON round trip; the socket's answers are
// session_listing(), path_listing() and path_stats_answer() of them.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ibnbd/types.h"
#include "ibtrs/client.h"

namespace ibnbd::control {

struct SessionReport {
  std::string name;
  uint64_t path_cnt = 0;
  uint64_t act_path_cnt = 0;  // paths connected
  std::string state;          // the block session's state name
  std::string path_uu;        // one letter a path: "U" connected, "_" not
  std::string mp;             // the multipath policy's name ("min-inflight", ...)
  uint64_t rx_bytes = 0;
  uint64_t tx_bytes = 0;
  uint64_t inflight = 0;      // the paths' requests in flight
  uint64_t reconnects = 0;    // the paths' successful reconnects
  uint64_t devices = 0;       // devices mapped through it
};

// The listing answer of session_list and session_show {"ok": true, "columns", "rows"}.
nlohmann::json session_listing(const std::vector<SessionReport>& sessions);
// The inverse, for a daemon known only by its JSON (sysfs-emu's trees over a Backend): columns
// by name, a missing one keeps the default; EINVAL for an answer that is not a listing or has
// cells of the wrong type.
Result<std::vector<SessionReport>> sessions_from_listing(const nlohmann::json& rsp);

// A client path: its identity, state, authentication, stats and failover fence, flattened to
// what the answers show (the addresses as text).
struct PathReport {
  std::string session;   // path_list's sessname
  std::string name;      // "src@dst"
  std::string state;     // ClientPathState's name
  std::string fabric;    // "rdma", "tcp"
  std::string hca_name;  // "rxe0"; "tcp" for the software fabric
  uint8_t hca_port = 0;
  std::string src_addr;  // the source as given, "" for none (path_list)
  std::string dst_addr;
  // What the kernel's src_addr/dst_addr files show: the host only ("ip:10.0.0.1"); an unset
  // source is the wildcard address of the destination's family.
  std::string src_host;
  std::string dst_host;
  uint16_t dst_port = 0;
  std::optional<std::chrono::nanoseconds> latency;  // the last heartbeat round trip
  std::string auth = "none";  // AuthState's name
  std::string auth_host;
  bool auth_bidirectional = false;
  std::string auth_method;
  std::string tls = "-";  // ibtrs::tls::describe
  std::string last_error;  // why it last failed, "" when it has not
  uint32_t inflight = 0;
  ibtrs::PathStatsSnapshot stats;
  ibtrs::ClientPathInfo::Fence fence;
};

// The report of the transport's path `p` of session `session`.
PathReport client_path_report(const std::string& session, const ibtrs::ClientPathInfo& p);

// path_list's listing answer (every path with its session).
nlohmann::json path_listing(const std::vector<PathReport>& paths);
// path_stats's answer {"ok": true, "paths": [{name, state, ..., stats, fence}]}.
nlohmann::json path_stats_answer(const std::vector<PathReport>& paths);
// The inverse of path_stats's answer, either daemon's (the server's has no latency, fence or
// last_error: they keep their defaults; it has src_addr/dst_addr, which the client's lacks).
// A missing field keeps its default; EINVAL for an answer of the wrong shape or types.
Result<std::vector<PathReport>> paths_from_stats(const nlohmann::json& rsp);

}  // namespace ibnbd::control
