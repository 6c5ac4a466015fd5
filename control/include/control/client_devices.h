// The client daemon's device listing as a type (issue 18: typed daemon APIs, JSON only at the
// socket edge): what `device_list` / `device_show` answer, one DeviceReport per mapped device,
// and its one JSON form, the listing the CLI renders (command.h). The daemon fills reports
// (ClientDaemon::devices); sysfs-emu reads them in-process without a JSON round trip; the
// socket's answer is device_listing() of them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ibnbd/types.h"

namespace ibnbd::control {

struct DeviceReport {
  std::string device;       // the name it was mapped with
  std::string session;      // a failover device's active session
  std::string access_mode;  // "ro", "rw", "migration"
  uint64_t size = 0;        // bytes, the server's last word
  std::string state;        // DeviceState's name
  uint64_t device_id = 0;   // the server's id in the session
  uint64_t rx_bytes = 0;
  uint64_t tx_bytes = 0;
  uint64_t inflight = 0;
  uint64_t errors = 0;
  uint64_t remaps = 0;
  std::string nbd;                  // the NBD export's addresses, "" without one
  std::string ublk;                 // /dev/ublkbN, "" without one
  std::string standby = "-";        // a failover device's standby session
  std::string standby_state = "-";  // "ready", or why not
  uint64_t failovers = 0;
  // device_show's columns besides the list's.
  struct Detail {
    uint64_t ublk_requests = 0;  // how the ublk queues got their completions
    uint64_t ublk_reaped = 0;
    uint64_t ublk_wakeups = 0;
    uint64_t resizes = 0;                 // sizes the server announced
    std::optional<uint64_t> ublk_size;    // what /dev/ublkbN has; nothing without one
    uint64_t last_failover_ms = 0;        // the last failover's pause
    uint64_t resent = 0;
    uint64_t lost_flushes = 0;
  };
  std::optional<Detail> detail;
};

// The listing answer {"ok": true, "columns": [...], "rows": [...]}: the list's columns, and
// with `detail` device_show's too (every report then has its Detail).
nlohmann::json device_listing(const std::vector<DeviceReport>& devices, bool detail);

// The inverse, for a daemon known only by its JSON (sysfs-emu's trees over a Backend): the
// columns are found by name, so an answer with fewer or more of them reads; a missing one keeps
// the default. EINVAL for an answer that is not a listing or has cells of the wrong type.
Result<std::vector<DeviceReport>> devices_from_listing(const nlohmann::json& rsp);

}  // namespace ibnbd::control
