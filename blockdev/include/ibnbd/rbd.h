// RBD images (Ceph) as exports of ibnbd-server, through librbd: the gateway role SPDK's bdev_rbd,
// ceph-nvmeof and rbd-nbd play. A client asks for "rbd:POOL/IMAGE[@SNAP]"; the server opens the
// image with the cephx credentials of its own configuration (clients never name credentials) and
// serves it through the same IoEngine as files and block devices (backend.h: what each
// operation becomes on an image).
//
// Threading: RbdCluster::connect() and RbdCluster::open() block on the network (up to
// RbdConfig::connect_timeout for the cluster, librados' own op timeouts for the image): the
// server's control thread calls them, never an IO thread. An opened image is a Backend like any
// other (backend.h's contract); its completions come from librbd's threads and are handed to the
// owning IoEngine (run on its thread, as io_uring's are).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ibnbd/backend.h"

namespace ibnbd {

// Whether this build has librbd (Debian's librbd-dev at build time). Without it every call below
// fails with EOPNOTSUPP.
bool rbd_supported();

// The server's "rbd" configuration: which cluster, as whom, which pools.
struct RbdConfig {
  std::string conf_file;  // ceph.conf; "" = librados' search ($CEPH_CONF, /etc/ceph/ceph.conf)
  std::string client_id = "admin";  // the cephx user without "client."
  std::string keyring;              // its keyring file; "" = what ceph.conf names
  // Pools that may be exported; empty: every pool the user's caps reach.
  std::vector<std::string> pools;
  // RADOS namespace of the images, "" for the pool's default; %SESSNAME% (backend.h's
  // kSessNamePlaceholder) is replaced by the client's session name, so each client sees only
  // its own namespace ("rbd:pool/img" of session A and of session B are two images).
  std::string namespace_template;
  std::chrono::seconds connect_timeout{10};  // the cluster's mons must answer within it
};

// "rbd:POOL/IMAGE" or "rbd:POOL/IMAGE@SNAP". Pool, image and snapshot names are what Ceph
// allows minus what would make the name ambiguous: non-empty, at most 255 bytes each, no '/',
// '@', NUL or control characters, not "." or "..".
inline constexpr std::string_view kRbdPrefix = "rbd:";
struct RbdName {
  std::string pool;
  std::string image;
  std::string snap;  // "" = the image's head (writable)
  std::string text() const;  // "rbd:POOL/IMAGE[@SNAP]"
};
bool is_rbd_name(std::string_view dev_name);  // starts with "rbd:"
// EINVAL (with the reason in *why) for anything else.
Result<RbdName> parse_rbd_name(std::string_view dev_name, std::string* why = nullptr);

// The namespace of a session's images: RbdConfig::namespace_template with %SESSNAME% replaced.
// EINVAL for a session name that cannot be a namespace (empty, '/', NUL, "." or "..").
Result<std::string> rbd_namespace(std::string_view tmpl, std::string_view session_name);

// One librados connection (one cephx identity), shared by every image the server opens.
class RbdCluster {
 public:
  // Connects: reads conf_file, sets the keyring and timeouts, waits for the mons. Errors:
  // EOPNOTSUPP (no librbd in this build), ENOENT (conf or keyring missing), ETIMEDOUT (no mon
  // answered), EACCES / EPERM (cephx refused the key), or librados' errno; *why says which.
  static Result<std::unique_ptr<RbdCluster>> connect(const RbdConfig& c, std::string* why = nullptr);
  ~RbdCluster();
  RbdCluster(const RbdCluster&) = delete;
  RbdCluster& operator=(const RbdCluster&) = delete;

  // Opens an image of `name.pool` in namespace `ns`. Read-only when o.read_only or a snapshot is
  // named (librbd serves snapshots read-only; a write gets EROFS). Errors: ENOENT (no such pool,
  // image or snapshot), EACCES / EPERM (the user's caps), EROFS (o.read_only unset for a
  // snapshot), or librbd's errno; *why says which. The Backend keeps the cluster's connection:
  // the cluster must outlive it.
  Result<std::unique_ptr<Backend>> open(const RbdName& name, std::string_view ns, const OpenOptions& o,
                                        std::string* why = nullptr);

  const std::string& fsid() const;
  struct Impl;

 private:
  explicit RbdCluster(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ibnbd
