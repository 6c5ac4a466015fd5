// What both daemons (ibnbd-server, ibnbd-client) do around their own work at start and at the
// end: the stop signals, the config file, the control socket's lock and socket, the metrics
// endpoint and the ready file. Failures are told on stderr as "DAEMON: what PATH: reason", DAEMON
// the program's name; what to do then (exit 1) is the daemon's.
#pragma once

#include <signal.h>

#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "control/metrics_http.h"
#include "control/socket.h"
#include "ibnbd/types.h"

namespace ibnbd::control {

// SIGTERM and SIGINT blocked in the calling thread, and so in every thread started from it
// afterwards (they inherit the mask): only wait() takes them. SIGPIPE is ignored: a peer that
// went away mid-send is an EPIPE of that send, not the end of the daemon. Constructed in main
// before any thread starts.
class StopSignals {
 public:
  StopSignals();
  // Blocks until SIGTERM or SIGINT; which one came.
  int wait();

 private:
  sigset_t set_;
};

// --config FILE: a JSON object. Errors, the reason in `why`: the errno of opening it ("cannot
// read FILE: ..."), EINVAL for a parse error ("FILE: <the parser's text>") or another JSON value
// ("FILE: expected a JSON object").
Result<nlohmann::json> read_config(const std::string& file, std::string* why);

// SocketLock::acquire and Socket::start, telling a failure ("DAEMON: control socket PATH: ...").
Result<SocketLock> lock_socket(std::string_view daemon, const std::string& path);
Result<std::unique_ptr<Socket>> start_socket(std::string_view daemon, SocketLock lock, Handler h);

// metrics::HttpServer::start on --metrics-listen's address, telling a failure ("DAEMON: metrics
// on ADDR: ..."); and the ready file's line for it, "metrics http://ADDR:PORT/metrics\n".
Result<std::unique_ptr<metrics::HttpServer>> start_metrics(std::string_view daemon, const sockaddr_storage& addr,
                                                           metrics::HttpServer::Collector collect);
std::string metrics_ready_line(const metrics::HttpServer& m);

// The ready file (--ready-file): whole or not at all (written beside it, then renamed), so a
// reader that sees the file sees every line. Removed at the end. Both do nothing for "".
void write_ready_file(const std::string& path, const std::string& text);
void remove_ready_file(const std::string& path);

}  // namespace ibnbd::control
