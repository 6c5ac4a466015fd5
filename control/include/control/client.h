// The client side of a daemon's control socket (socket.h): one request, its progress lines, its
// answer. The `ibnbd` CLI is its user; a test or a tool may be another.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "ibnbd/types.h"

namespace ibnbd::control {

// Mapping a device may wait for a connect timeout (30 s by default); a daemon silent for longer
// than this is stuck.
inline constexpr std::chrono::milliseconds kAnswerTimeout{120000};

// Sends `request` to the daemon at `socket_path` and returns the answer line (whatever its "ok":
// command.h's shape is the caller's to read). Lines with "progress" before it go to `progress`
// (may be empty) as they come, {"progress": X} passing X.
// Errors, each with a one-line reason in `why`: ENAMETOOLONG; the errno of reaching the socket
// (ENOENT, ECONNREFUSED: no daemon; EACCES, EPERM: the daemon's and not ours) or of sending;
// EBADMSG for a line that is not JSON; ETIMEDOUT after kAnswerTimeout of silence; ECONNRESET when
// the daemon closes the connection before its answer.
Result<nlohmann::json> call(const std::string& socket_path, const nlohmann::json& request,
                            const std::function<void(const nlohmann::json& progress)>& progress,
                            std::string* why);

}  // namespace ibnbd::control
