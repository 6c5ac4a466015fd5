// The client daemon's records of its ublk devices, one file per device in the state directory
// (--state-dir, default /run/ibnbd-client): what a daemon restarted after a crash needs to take
// each /dev/ublkbN back (the session and its paths, the remote device and its access mode, the
// ublk device number). /run is a tmpfs: records do not outlive a reboot, nor do ublk devices.
//
//   <dir>/ublk-<id>.json   {"version": 1, "ublk_id": N, "session": S, "paths": [...],
//                           "device": D, "access_mode": "rw", "host_key"?: F, "host"?: H,
//                           "tls"?: "on"|"off", "standby_session"?: S2, "standby_paths"?: [...]}
//   (host_key / host / tls: what device map named; absent: the daemon's default; standby_*: a
//   failover device, `session` being the one it was mapped active on)
//
// Files are replaced atomically (written to a temporary file, fsync'd, renamed over the old one,
// the directory fsync'd), so a crash at any moment leaves the old record or the new one.
// Threading: none of its own; the daemon calls it under its command lock.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ibnbd/types.h"

namespace ibnbd {

struct UblkRecord {
  uint32_t ublk_id = 0;
  std::string session;
  std::vector<std::string> paths;  // as the admin gave them to device map
  std::string device;
  AccessMode access_mode = AccessMode::rw;
  std::string host_key;  // key file path, "" for the daemon's default
  std::string host;      // host id override, "" for the key file's
  std::string tls;       // "on" / "off" as map named it, "" for the daemon's default
  // A failover device's standby (device map ... standby ...); empty for a device of one session.
  std::string standby_session;
  std::vector<std::string> standby_paths;
  bool operator==(const UblkRecord&) const = default;
};

nlohmann::json to_json(const UblkRecord& r);
// EINVAL for anything but a version-1 record with every field of the right type (the file may
// be damaged or from another version: never trusted blindly).
Result<UblkRecord> ublk_record_from_json(const nlohmann::json& j);

class UblkStateDir {
 public:
  explicit UblkStateDir(std::string dir) : dir_(std::move(dir)) {}

  // Writes the record of r.ublk_id, creating the directory (mode 0700) when missing. Errors:
  // those of mkdir, open, write, fsync and rename.
  Status save(const UblkRecord& r) const;
  // Removes the record; a missing one is not an error.
  Status remove(uint32_t ublk_id) const;

  struct Loaded {
    std::vector<UblkRecord> records;  // by ublk id
    std::vector<std::string> bad;     // "file: why" for files that are not valid records
  };
  // Every record in the directory (none when it does not exist). Temporary files of an
  // interrupted save are ignored.
  Loaded load() const;

  std::string file_of(uint32_t ublk_id) const;
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
};

}  // namespace ibnbd
