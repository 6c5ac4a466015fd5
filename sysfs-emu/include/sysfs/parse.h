// What the control files accept, as the kernel's store() functions parse it, and the names
// under which daemon objects appear as directories. Pure functions; every error is EINVAL
// (malformed input is refused before anything reaches the daemon, so it changes nothing).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "ibtrs/result.h"
#include "ibtrs/types.h"

namespace sysfs {

using ibtrs::Result;
using ibtrs::Status;

// The written text without surrounding whitespace (a trailing newline from echo included), as
// the kernel's sysfs_streq and strim compare.
std::string_view trim(std::string_view s);

// "1": the action files (reconnect, disconnect, remove_path, remap_device, force_close).
Status parse_one(std::string_view text);
// "0" or "1": the stats files reset their counters. The seed documents "0", the kernel wants "1";
// both are accepted.
Status parse_reset(std::string_view text);
// "normal" | "force": unmap_device.
Result<bool> parse_unmap_mode(std::string_view text);  // true: force
// A decimal sector count for resize (kstrtoull; 0 refused).
Result<uint64_t> parse_sectors(std::string_view text);

// One path as add_path and map_device take it: "[src,]dst" or "src@dst", addresses in the
// kernel's forms (ip:, gid:) or ours (tcp:HOST[:PORT], rdma:...). Returns the text to pass to the
// daemon: unchanged, or, when `dest_port` is given, canonical with that port on kernel-form
// addresses (map_device's dest_port=).
Result<std::string> parse_path(std::string_view text, std::optional<uint16_t> dest_port = {});

// The kernel's map_device options, whitespace-separated key=value:
//   sessname=<name> path=<[src@]dst> [path=...] (1..6) device_path=<name>
//   [dest_port=<port>] [access_mode=ro|rw|migration] [nr_poll_queues=<n>]
// sessname, path and device_path are required; an unknown key, a key without value or a
// repeated single key is EINVAL. nr_poll_queues (-1 = one per CPU, 0..1024) parses; the
// map_device file then refuses any but 0 (EOPNOTSUPP: a ublk device has no poll queues).
struct MapDeviceOptions {
  std::string sessname;
  std::vector<std::string> paths;  // as parse_path returns them
  std::string device_path;
  std::string access_mode = "rw";
  std::optional<uint16_t> dest_port;
  std::optional<int32_t> nr_poll_queues;
};
inline constexpr size_t kMaxMapPaths = 6;  // the kernel's map_device limit (rnbd-clt-sysfs.c)
Result<MapDeviceOptions> parse_map_device(std::string_view text);
// The client daemon's device_map request for them (exclusive: mapping twice is EEXIST; ublk:
// the block device, or ENODEV without ublk_drv, as the kernel's map_device makes /dev/rnbdN).
nlohmann::json map_device_request(const MapDeviceOptions& o);

// A daemon object's name as a directory entry: '/' becomes '!' (as the kernel names kobjects
// after block devices and paths); unescape_name is the inverse.
std::string escape_name(std::string_view name);
std::string unescape_name(std::string_view entry);

}  // namespace sysfs
