#include "base/unix_socket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/unique_fd.h"

namespace base {
namespace {

Result<sockaddr_un> address(const std::string& path) {
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(sa.sun_path)) return errc(ENAMETOOLONG);
  std::memcpy(sa.sun_path, path.c_str(), path.size() + 1);
  return sa;
}

// Connects `fd` to `sa`; errno on failure.
int connect_to(int fd, const sockaddr_un& sa) {
  return ::connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)) == 0 ? 0 : errno;
}

}  // namespace

Result<int> unix_listen(const std::string& path, int backlog, bool nonblock, const UnixSocketAccess& access) {
  if ((access.mode & ~mode_t{0777}) != 0) return errc(EINVAL);
  auto sa = address(path);
  if (!sa) return sa.error();
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) return errc(EEXIST);
    UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!probe) return errc(errno);
    const bool live = connect_to(probe.get(), *sa) == 0;
    probe.reset();  // before the unlink: the probe is done with the old socket
    if (live) return errc(EADDRINUSE);
    ::unlink(path.c_str());
  }
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | (nonblock ? SOCK_NONBLOCK : 0), 0));
  if (!fd) return errc(errno);
  // Linux creates the socket file with the socket inode's mode (less the umask): owner-only from
  // the start, widened to `access` once the group is set, and nobody can connect before listen().
  int e = ::fchmod(fd.get(), 0600) == 0 ? 0 : errno;
  if (e == 0 && ::bind(fd.get(), reinterpret_cast<const sockaddr*>(&*sa), sizeof(*sa)) != 0) e = errno;
  if (e == 0) {
    if ((access.group && ::chown(path.c_str(), static_cast<uid_t>(-1), *access.group) != 0) ||
        ::chmod(path.c_str(), access.mode) != 0 || ::listen(fd.get(), backlog) != 0) {
      e = errno;
      ::unlink(path.c_str());
    }
  }
  if (e != 0) return errc(e);
  return fd.release();  // the caller owns the listening socket (Result<int>: the API predates UniqueFd)
}

Result<int> unix_connect(const std::string& path) {
  auto sa = address(path);
  if (!sa) return sa.error();
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return errc(errno);
  if (const int e = connect_to(fd.get(), *sa); e != 0) return errc(e);
  return fd.release();  // the caller owns the connected socket
}

}  // namespace base
