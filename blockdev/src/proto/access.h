// Server-side device access rules of the block protocol, as pure logic (no IO, no locks): who
// may open an exported device in which mode, the device ids a session sees, and what CLOSE,
// force_close and a session's end release. Kernel counterpart: rnbd-srv.c
// (rnbd_srv_check_update_open_perm, the per-session index_idr, keep_id on force close).
//
// Rules (docs/protocol.md, "Access rules"):
//   ro         always granted
//   rw         granted while no session writes the device
//   migration  granted while fewer than two sessions write it (source and destination of a live
//              migration); rw and migration holders both count as writers
// A refusal is EBUSY (the kernel says EPERM; EBUSY tells the operator the device is held).
//
// ExportAcl (below) is the other half: which authenticated host may open which device at all,
// checked before these rules.
//
// Thread-safety: none of these classes synchronizes. The server keeps one OpenTable and calls it
// from one thread, its control thread: OPEN and CLOSE requests, admin force_close and session
// ends are posted there. The IO path does not call lookup() per request; the server publishes
// each session's id -> device map to its IO threads itself and refreshes it from this table
// (or, if it does call in, holds the one mutex that guards every call).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "ibnbd/types.h"

namespace ibnbd::proto {

// A server session as the access rules know it. The server numbers its sessions and never
// reuses a number while it runs, so a stale number cannot name a newer session.
using SessionId = uint64_t;

// rw and migration holders may write; they are what the rules count.
inline constexpr bool is_writer(AccessMode m) { return m != AccessMode::ro; }

// EPERM when a holder with `mode` may not do `op`: ro holders READ, FLUSH and BLOCK_STATUS only.
Status check_op_allowed(AccessMode mode, IoOp op);

struct Holder {
  SessionId session = 0;
  AccessMode mode = AccessMode::ro;
  bool operator==(const Holder&) const = default;
};

// Who holds one exported device open.
class DeviceOpeners {
 public:
  enum class Opened : uint8_t {
    now,      // `s` holds the device from now on
    already,  // `s` held it in the same mode: nothing changed, nothing counted twice
  };
  // EBUSY when the rules refuse `mode`, or when `s` already holds the device in another mode:
  // a mode change is CLOSE then OPEN, so the rules are checked against the other holders and a
  // client never ends up with a mode it did not ask for. EINVAL for an unknown mode.
  Result<Opened> open(SessionId s, AccessMode mode);
  // ENOENT when `s` does not hold the device.
  Status close(SessionId s);

  std::optional<AccessMode> mode_of(SessionId s) const;
  std::vector<Holder> holders() const;  // by session id
  uint32_t writers() const { return writers_; }
  bool empty() const { return holders_.empty(); }

 private:
  std::map<SessionId, AccessMode> holders_;
  uint32_t writers_ = 0;
};

// Device ids of one session (kernel: the session's index_idr). The lowest free id is handed out;
// an id comes back only through release().
class DeviceIdAllocator {
 public:
  explicit DeviceIdAllocator(uint32_t max_id = UINT32_MAX) : max_id_(max_id) {}
  // ENOSPC when every id 0..max_id is taken.
  Result<uint32_t> alloc();
  // ENOENT when `id` is not taken.
  Status release(uint32_t id);
  bool in_use(uint32_t id) const { return used_.count(id) != 0; }
  size_t size() const { return used_.size(); }

 private:
  uint32_t max_id_;
  std::set<uint32_t> used_;  // ordered, so the lowest gap is found by one walk
};

// One device id of a session.
struct Opening {
  uint32_t device_id = 0;
  FileId file;      // which store: what the rules count
  std::string dev;  // the server's name of the exported device (for listings and the admin)
  AccessMode mode = AccessMode::ro;
  bool force_closed = false;  // taken away by the admin; the id waits for the client's CLOSE
  bool operator==(const Opening&) const = default;
};

// The server's open state across sessions and exported devices. A device is its FileId: every
// name that leads to the same store (symlinks, "./x", "/root/x", another device node of the same
// disk) is the same device here, for every session, so the rules hold across aliases. `name` is
// what listings show; the server passes the name of the device's first opening for every later
// one, so one device has one name while it is open.
class OpenTable {
 public:
  explicit OpenTable(uint32_t max_device_id = UINT32_MAX) : max_device_id_(max_device_id) {}

  struct Grant {
    uint32_t device_id = 0;
    bool reopened = false;      // `s` already held `dev` in this mode: same id, nothing changed
    bool first_holder = false;  // nobody held `dev` before: the server opens its backend now
  };
  // OPEN from session `s`. A session that already holds `file` (under any name) in this mode gets
  // its id back (reopened): one store is one device id in a session. EBUSY (the rules, or `s`
  // holds `file` in another mode), ENOSPC (the session has no device id left), EINVAL (unknown
  // mode).
  Result<Grant> open(SessionId s, const FileId& file, std::string_view name, AccessMode mode);

  struct Released {
    FileId file;
    std::string dev;  // its name
    bool last_holder = false;  // this call removed the device's last holder: close its backend
  };
  // CLOSE from session `s`: frees the id, force-closed or not. ENOENT for an id `s` does not have.
  Result<Released> close(SessionId s, uint32_t device_id);
  // Whether `s` has `device_id` (held or force-closed): what a CLOSE would free. Cheap: the server
  // answers a CLOSE of anything else at once, without quiescing its IO threads.
  bool has_id(SessionId s, uint32_t device_id) const;
  // Admin: takes `file` away from `s`. The id stays reserved, and IO to it fails (lookup: ENODEV),
  // until the client CLOSEs it or the session ends: the client may still send IO with that id,
  // and a later OPEN must not give the same id to another device. ENOENT when `s` does not hold
  // `file`.
  Result<Released> force_close(const FileId& file, SessionId s);
  // Session `s` is gone: releases everything it held, reserved ids included. Returns the devices
  // it still held.
  std::vector<Released> end_session(SessionId s);

  // The device behind an id of `s`, for IO. ENODEV for an unknown or force-closed id.
  Result<Opening> lookup(SessionId s, uint32_t device_id) const;
  // Listings: who holds a device (empty when nobody does), and a session's ids by id.
  std::vector<Holder> holders(const FileId& file) const;
  std::vector<Opening> devices_of(SessionId s) const;

 private:
  struct SessionOpens {
    DeviceIdAllocator ids;
    std::map<uint32_t, Opening> by_id;
  };
  const Opening* find_open(const SessionOpens& so, const FileId& file) const;
  Released drop_holder(SessionId s, const Opening& o);

  uint32_t max_device_id_;
  std::map<FileId, DeviceOpeners> devices_;
  std::map<SessionId, SessionOpens> sessions_;
};

// ------------------------------------------------------------------------------------------
// Per-export access control (nvmet's allowed_hosts, per device): which hosts may open which
// devices in which modes (docs/security.d/auth.md).

// One grant: devices whose path under the search root matches `devices`, up to `mode`.
//   pattern  "**" every device; "dir/**" everything beneath dir; otherwise fnmatch(3) with
//            FNM_PATHNAME ("a/*.img": the .img files directly in a; '*' never crosses a '/')
//   mode     the highest mode granted, ro < rw < migration (rw also grants ro; migration all)
struct AclRule {
  std::string devices;
  AccessMode mode = AccessMode::ro;
  bool operator==(const AclRule&) const = default;
};

// EINVAL for an empty pattern, one with a NUL or a '..' component, or an unknown mode.
Status check_acl_rule(const AclRule& r);
bool acl_pattern_matches(std::string_view pattern, std::string_view dev);

class ExportAcl {
 public:
  // Sets (replaces) a host's grants; a listed host with no rules may open nothing. EINVAL for a
  // bad rule.
  Status set_host(std::string host, std::vector<AclRule> rules);
  // ENOENT for a host not listed.
  Status remove_host(std::string_view host);
  // Hosts not listed (and anonymous sessions, host "") may open every device in every mode.
  // Listed hosts keep their own rules.
  void set_allow_any_host(bool on) { any_host_ = on; }
  bool allow_any_host() const { return any_host_; }

  // May `host` open `dev` (the clean path under the search root) in `mode`? EACCES: the host is
  // not listed (and any host is not allowed) or none of its rules matches `dev`; EPERM: a rule
  // matches but grants less than `mode` (an ro-only host asking rw).
  Status check(std::string_view host, std::string_view dev, AccessMode mode) const;
  const std::vector<AclRule>* rules_of(std::string_view host) const;

 private:
  std::map<std::string, std::vector<AclRule>, std::less<>> hosts_;
  bool any_host_ = false;
};

}  // namespace ibnbd::proto
