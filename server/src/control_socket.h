// A daemon's local control socket: a unix stream socket speaking one JSON object per line. Each
// request line gets one response line. The admin CLI is the client.
//
//   request:  {"cmd": "devices", ...arguments}
//   response: {"ok": true, ...} or {"ok": false, "errno": N, "error": "text"}
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

#include <nlohmann/json.hpp>

#include "ibnbd/types.h"

namespace ibnbd {

class ControlSocket {
 public:
  // Sends one progress line to the requester now; false once the requester is gone.
  using Emit = std::function<bool(const nlohmann::json& progress)>;
  using Handler = std::function<nlohmann::json(const nlohmann::json& request, const Emit& emit)>;
  // Binds `path` (an existing socket file there is replaced; its directory must exist) with
  // mode 0600. Errors: what bind/listen return, ENAMETOOLONG.
  static Result<std::unique_ptr<ControlSocket>> start(const std::string& path, Handler h);
  ~ControlSocket();  // stops the thread, removes the socket file
  ControlSocket(const ControlSocket&) = delete;
  ControlSocket& operator=(const ControlSocket&) = delete;

  // Builds the error response for `err`.
  static nlohmann::json error(int err, const std::string& text = {});

  static constexpr size_t kMaxConnections = 8;

 private:
  struct Conn {
    std::thread thread;
    std::atomic<bool> done{false};
  };
  void reap(bool all);
  ControlSocket(std::string path, int fd, int stop_fd, Handler h);
  void loop();
  void serve(int conn);
  bool send_line(int conn, const nlohmann::json& j);

  std::string path_;
  int fd_;
  int stop_fd_;
  Handler handler_;
  std::thread thread_;
  std::list<Conn> conns_;  // the accept thread's only
};

}  // namespace ibnbd
