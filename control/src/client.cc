#include "control/client.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <cerrno>
#include <cstring>

#include "base/unique_fd.h"

namespace ibnbd::control {

using nlohmann::json;

Result<json> call(const std::string& path, const json& req, const std::function<void(const json&)>& progress,
                  std::string* why) {
  auto fail = [why](int e, std::string text) -> Result<json> {
    if (why) *why = std::move(text);
    return errc(e);
  };
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  if (path.size() >= sizeof(sa.sun_path)) return fail(ENAMETOOLONG, "socket path too long: " + path);
  std::memcpy(sa.sun_path, path.c_str(), path.size() + 1);
  base::UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd || ::connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    const int e = errno;
    // Only a missing socket or nobody listening says the daemon may be down; a refusal of
    // permission means it runs and its socket is not ours (owner-only by default).
    const char* hint = e == EACCES || e == EPERM
                           ? " (the daemon runs, but its socket is its owner's: run as that user or root)"
                           : e == ENOENT || e == ECONNREFUSED ? " (is it running? --socket PATH)" : "";
    return fail(e, "cannot reach the daemon at " + path + ": " + std::strerror(e) + hint);
  }
  std::string out = req.dump() + "\n";
  for (size_t off = 0; off < out.size();) {
    ssize_t n = ::send(fd.get(), out.data() + off, out.size() - off, MSG_NOSIGNAL);
    if (n <= 0) {
      const int e = errno;
      return fail(e, std::string("sending to the daemon: ") + std::strerror(e));
    }
    off += static_cast<size_t>(n);
  }
  std::string in;
  char buf[65536];
  for (;;) {
    size_t nl;
    while ((nl = in.find('\n')) != std::string::npos) {
      json line;
      try {
        line = json::parse(in.substr(0, nl));
      } catch (const std::exception& e) {
        return fail(EBADMSG, std::string("bad answer from the daemon: ") + e.what());
      }
      in.erase(0, nl + 1);
      if (!line.contains("progress")) return line;
      if (progress) progress(line["progress"]);
    }
    pollfd p{fd.get(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(kAnswerTimeout.count())) <= 0) return fail(ETIMEDOUT, "no answer from the daemon");
    ssize_t n = ::recv(fd.get(), buf, sizeof(buf), 0);
    if (n <= 0) return fail(ECONNRESET, "the daemon closed the connection");
    in.append(buf, static_cast<size_t>(n));
  }
}

}  // namespace ibnbd::control
