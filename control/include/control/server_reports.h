// The server daemon's exported devices and refusals as types (issue 18: typed daemon APIs, JSON
// only at the socket edge), as client_devices.h and client_sessions.h have the client daemon's:
// what its `devices` and `refusals` commands answer, and their one JSON form each (the answers
// `ibnbd server device list` and `ibnbd server refusals list` render). The daemon fills reports
// (ibnbd::server_devices and server_refusals, server/src/server_reports.cc) and writes its
// answers with devices_answer() and refusals_answer() of them; sysfs-emu's server tree reads the
// reports in-process without a JSON round trip, or, over a Backend alone, reads them back from
// the answers (devices_from_answer, refusals_from_answer).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ibnbd/types.h"
#include "ibtrs/refusals.h"

namespace ibnbd::control {

// A session holding an exported device open (BlockServer's DeviceHolderInfo), flattened to what
// the answer shows.
struct HolderReport {
  std::string session;
  uint32_t device_id = 0;   // the session's id of the device
  std::string access_mode;  // "ro", "rw", "migration"
  bool operator==(const HolderReport&) const = default;
};

// An exported device (BlockServer's ExportedDeviceInfo).
struct ExportedDeviceReport {
  std::string name;   // as BlockServer::devices() names it (the path under the search root)
  std::string kind;   // "file", "block_device", "rbd"
  uint64_t size = 0;  // bytes
  bool direct = false;
  bool read_only = false;
  std::vector<HolderReport> holders;
  BlockStats stats;
  bool operator==(const ExportedDeviceReport&) const = default;
};

// {"ok": true, "devices": [{name, kind, size, direct, read_only, sessions: [{session,
// device_id, access_mode}], stats}]}: the devices answer.
nlohmann::json devices_answer(const std::vector<ExportedDeviceReport>& devices);
// The inverse, for a daemon known only by its JSON. A device needs its name and a holder its
// session (strings); any other missing field keeps its default (access_mode is shown as the
// daemon wrote it, as the CLI does). EINVAL for an answer of the wrong shape or types.
Result<std::vector<ExportedDeviceReport>> devices_from_answer(const nlohmann::json& rsp);

// A device's or a session's counters as the `devices` and `sessions` answers write them
// ({read_ops, read_bytes, ..., inflight}).
nlohmann::json block_stats_to_json(const BlockStats& s);

// A reason with its count, the latest refusal's detail and time: the transport's own type
// (ibtrs/refusals.h), which holds nothing but what the answer shows.
using RefusalReport = ibtrs::RefusalCount;

// {"ok": true, "refusals": [{reason, count, last, last_unix_ms}]}: the refusals answer.
nlohmann::json refusals_answer(const std::vector<RefusalReport>& refusals);
// The inverse. A refusal needs its reason (a string); a missing count, last or last_unix_ms
// keeps its default. EINVAL for an answer of the wrong shape or types.
Result<std::vector<RefusalReport>> refusals_from_answer(const nlohmann::json& rsp);

}  // namespace ibnbd::control
