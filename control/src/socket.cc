#include "control/socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "control/command.h"

namespace ibnbd::control {

namespace {
constexpr size_t kMaxLine = 1 << 20;  // a request larger than this is refused, not buffered
constexpr int kIdleMs = 30000;        // a silent admin connection is dropped after this
}  // namespace

Result<SocketLock> SocketLock::acquire(const std::string& socket_path, std::string* why) {
  const std::string lock_path = socket_path + ".lock";
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    const int e = errno;
    if (why) *why = lock_path + ": " + std::strerror(e);
    return errc(e);
  }
  base::UniqueFd lock(fd);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    if (e != EWOULDBLOCK) {
      if (why) *why = lock_path + ": " + std::strerror(e);
      return errc(e);
    }
    char pid[32] = {};
    const ssize_t n = ::pread(fd, pid, sizeof(pid) - 1, 0);
    std::string holder = n > 0 ? std::string(pid, static_cast<size_t>(n)) : std::string();
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    if (why)
      *why = "another daemon" + (holder.empty() ? std::string() : " (pid " + holder + ")") + " serves " +
             socket_path + " (it holds " + lock_path + "); stop it first or choose another socket";
    return errc(EADDRINUSE);
  }
  // Whose lock it is, for the message above; the flock is the lock, with or without the pid.
  const std::string me = std::to_string(::getpid()) + "\n";
  [[maybe_unused]] const bool noted =
      ::ftruncate(fd, 0) == 0 && ::pwrite(fd, me.data(), me.size(), 0) == static_cast<ssize_t>(me.size());
  return SocketLock(socket_path, std::move(lock));
}

Result<std::unique_ptr<Socket>> Socket::start(SocketLock lock, Handler h) {
  const std::string path = lock.socket_path();
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(sa.sun_path)) return errc(ENAMETOOLONG);
  std::memcpy(sa.sun_path, path.c_str(), path.size() + 1);
  base::UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return errc(errno);
  ::unlink(path.c_str());
  const mode_t old = ::umask(0077);
  int r = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
  ::umask(old);
  if (r != 0 || ::listen(fd.get(), 16) != 0) return errc(errno);
  base::UniqueFd stop(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!stop) return errc(errno);
  std::unique_ptr<Socket> cs(new Socket(std::move(lock), std::move(fd), std::move(stop), std::move(h)));
  cs->thread_ = std::thread([p = cs.get()] { p->loop(); });
  return cs;
}

Socket::Socket(SocketLock lock, base::UniqueFd fd, base::UniqueFd stop_fd, Handler h)
    : lock_(std::move(lock)),
      path_(lock_.socket_path()),
      fd_(std::move(fd)),
      stop_fd_(std::move(stop_fd)),
      handler_(std::move(h)) {}

Socket::~Socket() {
  uint64_t one = 1;
  [[maybe_unused]] ssize_t w = ::write(stop_fd_.get(), &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  // Closed before the socket file goes (and the lock after it), as always: by then no thread
  // polls them.
  fd_.reset();
  stop_fd_.reset();
  ::unlink(path_.c_str());
}

// Joins the connection threads that have finished (all: every one, after stop was signalled;
// their polls see the stop eventfd, which stays readable).
void Socket::reap(bool all) {
  for (auto it = conns_.begin(); it != conns_.end();) {
    if (all || it->done.load(std::memory_order_acquire)) {
      it->thread.join();
      it = conns_.erase(it);
    } else {
      ++it;
    }
  }
}

void Socket::loop() {
  for (;;) {
    reap(false);
    // At the limit the listening socket is left alone (clients wait in the backlog); the
    // timeout comes back to reap.
    const bool full = conns_.size() >= kMaxConnections;
    pollfd p[2] = {{fd_.get(), static_cast<short>(full ? 0 : POLLIN), 0}, {stop_fd_.get(), POLLIN, 0}};
    if (::poll(p, 2, full ? 50 : 1000) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (p[1].revents != 0) break;
    if ((p[0].revents & POLLIN) == 0) continue;
    base::UniqueFd c(::accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!c) continue;
    Conn& conn = conns_.emplace_back();
    // The connection's thread owns its fd: closed before the thread says it is done.
    conn.thread = std::thread([this, c = std::move(c), &conn]() mutable {
      serve(c.get());
      c.reset();
      conn.done.store(true, std::memory_order_release);
    });
  }
  reap(true);
}

bool Socket::send_line(int conn, const nlohmann::json& j) {
  std::string out = j.dump() + "\n";
  for (size_t off = 0; off < out.size();) {
    ssize_t n = ::send(conn, out.data() + off, out.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

void Socket::serve(int conn) {
  std::string buf;
  char tmp[4096];
  for (;;) {
    size_t nl;
    while ((nl = buf.find('\n')) != std::string::npos) {
      std::string line = buf.substr(0, nl);
      buf.erase(0, nl + 1);
      nlohmann::json rsp;
      try {
        auto req = nlohmann::json::parse(line);
        if (!req.is_object() || !req.contains("cmd") || !req["cmd"].is_string())
          rsp = error(EINVAL, "a request is a JSON object with a string \"cmd\"");
        else
          rsp = handler_(req, [this, conn](const nlohmann::json& p) { return send_line(conn, p); });
      } catch (const std::exception& e) {
        rsp = error(EINVAL, std::string("bad request: ") + e.what());
      }
      if (!send_line(conn, rsp)) return;
    }
    if (buf.size() > kMaxLine) return;
    pollfd p[2] = {{conn, POLLIN, 0}, {stop_fd_.get(), POLLIN, 0}};
    int r = ::poll(p, 2, kIdleMs);
    if (r <= 0 || p[1].revents != 0) return;
    ssize_t n = ::recv(conn, tmp, sizeof(tmp), 0);
    if (n <= 0) return;
    buf.append(tmp, static_cast<size_t>(n));
  }
}

}  // namespace ibnbd::control
