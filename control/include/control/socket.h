// A daemon's local control socket, the server side: a unix stream socket speaking one JSON object
// per line. Each request line gets one response line. The admin CLI is the client (client.h).
//
//   request:  {"cmd": "devices", ...arguments}
//   response: {"ok": true, ...} or {"ok": false, "errno": N, "error": "text"} (command.h)
// A long command may send progress lines first ({"progress": ...}, through Emit); the line with
// "ok" is always the last one.
//
// Threading: each connection is served on a thread of its own, up to kMaxConnections at once
// (more wait in the listen backlog), so an admin tool that connects and stays silent, or a long
// command (a map waiting out a connect timeout, `device io`), does not hold up the others. The
// handler is therefore called from several threads at once and serializes what it must itself.
// Bad JSON gets an error response; the connection stays open.
#pragma once

#include <atomic>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include <nlohmann/json.hpp>

#include "ibnbd/types.h"
#include "base/unique_fd.h"

namespace ibnbd::control {

// The right to serve one control socket path: an exclusive flock(2) on PATH.lock beside it,
// held for the daemon's life (the kernel drops it when the process dies, however it dies). A
// daemon takes it before anything else, so a second daemon started on the same socket stops
// with a clear message instead of unlinking the live socket and stranding the first daemon (and,
// for ibnbd-client, recovering ublk devices the first one still serves). A socket file left by
// a dead daemon has no lock holder and is replaced as before. The lock file stays when the
// daemon ends: removing it would let two daemons lock two files of the same name.
class SocketLock {
 public:
  // EADDRINUSE when a live daemon holds the lock (`why` names its pid); the errno of creating
  // or locking the file otherwise (EACCES, ENOENT when the directory is missing, ...).
  static Result<SocketLock> acquire(const std::string& socket_path, std::string* why = nullptr);
  const std::string& socket_path() const { return socket_path_; }

 private:
  SocketLock(std::string path, base::UniqueFd fd) : socket_path_(std::move(path)), fd_(std::move(fd)) {}
  std::string socket_path_;
  base::UniqueFd fd_;
};

// Sends one progress line to the requester now; false once the requester is gone.
using Emit = std::function<bool(const nlohmann::json& progress)>;
// One request's answer (command.h's shapes). Called on the connection's thread.
using Handler = std::function<nlohmann::json(const nlohmann::json& request, const Emit& emit)>;

class Socket {
 public:
  // Binds `lock`'s path (an existing socket file there is one of a dead daemon, since we hold
  // the lock, and is replaced; its directory must exist) with mode 0600, and keeps the lock.
  // Errors: what bind/listen return, ENAMETOOLONG.
  static Result<std::unique_ptr<Socket>> start(SocketLock lock, Handler h);
  ~Socket();  // stops the thread, removes the socket file
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  static constexpr size_t kMaxConnections = 8;

 private:
  struct Conn {
    std::thread thread;
    std::atomic<bool> done{false};
  };
  void reap(bool all);
  Socket(SocketLock lock, base::UniqueFd fd, base::UniqueFd stop_fd, Handler h);
  void loop();
  void serve(int conn);
  bool send_line(int conn, const nlohmann::json& j);

  SocketLock lock_;  // released after the socket file is gone (~Socket)
  std::string path_;
  base::UniqueFd fd_;       // the listening socket
  base::UniqueFd stop_fd_;  // an eventfd: readable once ~Socket began
  Handler handler_;
  std::thread thread_;
  std::list<Conn> conns_;  // the accept thread's only
};

}  // namespace ibnbd::control
