// AF_UNIX stream sockets for the daemons' and tools' local endpoints (NBD export, migration
// agent). Paths are limited by sockaddr_un (107 bytes): longer ones are ENAMETOOLONG.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>

#include "base/result.h"

namespace base {

// Who may connect to a listening socket file: connecting needs write permission on it. The
// default is its owner only, whatever the process umask.
struct UnixSocketAccess {
  mode_t mode = 0600;            // permission bits of the socket file (within 0777)
  std::optional<gid_t> group;    // its group; the caller must be a member (else EPERM)
};

// Binds and listens on `path`. A socket file already there is replaced only when nobody
// answers on it (left by a dead process); a live one is EADDRINUSE, any other file EEXIST.
// The file is created owner-only and gets `access` before anyone can connect (listen comes
// after). Returns the listening fd (close-on-exec; non-blocking if asked). EINVAL for mode bits
// outside 0777.
Result<int> unix_listen(const std::string& path, int backlog, bool nonblock,
                        const UnixSocketAccess& access = {});
// Connects to `path`; blocking, close-on-exec.
Result<int> unix_connect(const std::string& path);

}  // namespace base
