// AF_UNIX stream sockets for the daemons' and tools' local endpoints (NBD export, migration
// agent). Paths are limited by sockaddr_un (107 bytes): longer ones are ENAMETOOLONG.
#pragma once

#include <string>

#include "ibtrs/result.h"

namespace ibtrs {

// Binds and listens on `path`. A socket file already there is replaced only when nobody
// answers on it (left by a dead process); a live one is EADDRINUSE, any other file EEXIST.
// Returns the listening fd (close-on-exec; non-blocking if asked).
Result<int> unix_listen(const std::string& path, int backlog, bool nonblock);
// Connects to `path`; blocking, close-on-exec.
Result<int> unix_connect(const std::string& path);

}  // namespace ibtrs
