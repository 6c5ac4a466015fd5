#include "control/daemon.h"

#include <pthread.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

namespace ibnbd::control {

using nlohmann::json;

StopSignals::StopSignals() {
  sigemptyset(&set_);
  sigaddset(&set_, SIGTERM);
  sigaddset(&set_, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set_, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
}

int StopSignals::wait() {
  int sig = 0;
  sigwait(&set_, &sig);
  return sig;
}

Result<json> read_config(const std::string& file, std::string* why) {
  std::ifstream in(file);
  if (!in) {
    const int e = errno;
    if (why) *why = "cannot read " + file + ": " + std::strerror(e);
    return errc(e != 0 ? e : EIO);
  }
  json j;
  try {
    j = json::parse(in);
  } catch (const std::exception& e) {
    if (why) *why = file + ": " + e.what();
    return errc(EINVAL);
  }
  if (!j.is_object()) {
    if (why) *why = file + ": expected a JSON object";
    return errc(EINVAL);
  }
  return j;
}

Result<SocketLock> lock_socket(std::string_view daemon, const std::string& path) {
  std::string why;
  auto lock = SocketLock::acquire(path, &why);
  if (!lock)
    std::fprintf(stderr, "%.*s: control socket %s: %s\n", static_cast<int>(daemon.size()), daemon.data(),
                 path.c_str(), why.c_str());
  return lock;
}

Result<std::unique_ptr<Socket>> start_socket(std::string_view daemon, SocketLock lock, Handler h) {
  const std::string path = lock.socket_path();
  auto s = Socket::start(std::move(lock), std::move(h));
  if (!s)
    std::fprintf(stderr, "%.*s: control socket %s: %s\n", static_cast<int>(daemon.size()), daemon.data(),
                 path.c_str(), s.error().message().c_str());
  return s;
}

Result<std::unique_ptr<metrics::HttpServer>> start_metrics(std::string_view daemon, const sockaddr_storage& addr,
                                                           metrics::HttpServer::Collector collect) {
  auto m = metrics::HttpServer::start(addr, std::move(collect));
  if (!m)
    std::fprintf(stderr, "%.*s: metrics on %s: %s\n", static_cast<int>(daemon.size()), daemon.data(),
                 metrics::to_string(addr).c_str(), m.error().message().c_str());
  return m;
}

std::string metrics_ready_line(const metrics::HttpServer& m) {
  return "metrics http://" + metrics::to_string(m.address()) + "/metrics\n";
}

void write_ready_file(const std::string& path, const std::string& text) {
  if (path.empty()) return;
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp) << text;
  ::rename(tmp.c_str(), path.c_str());
}

void remove_ready_file(const std::string& path) {
  if (!path.empty()) ::unlink(path.c_str());
}

}  // namespace ibnbd::control
