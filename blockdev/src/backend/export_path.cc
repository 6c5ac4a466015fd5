// resolve_export(): dev_search_path (+ %SESSNAME%) and a client's dev_name -> a device beneath
// the search root. Lexical checks first (they give the clearest reasons), then the kernel's
// RESOLVE_BENEATH walk, which is what actually keeps symlinks and races inside the root.
#include <fcntl.h>
#include <linux/limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "backend/sys.h"
#include "ibnbd/backend.h"

namespace ibnbd {

namespace {

std::error_code refuse(std::string* why, int e, std::string reason) {
  if (why) *why = std::move(reason);
  return errc(e);
}

// Session names become one path component: no separators, no dot-dot games, no NUL.
bool session_name_ok(std::string_view s) {
  return !s.empty() && s.size() <= NAME_MAX && s.find('/') == std::string_view::npos &&
         s.find('\0') == std::string_view::npos && s.find("..") == std::string_view::npos &&
         s != ".";
}

// Splits a path into components, dropping empty ones and ".". Returns false on a ".." component.
bool split_components(std::string_view p, std::vector<std::string_view>& out) {
  while (!p.empty()) {
    size_t slash = p.find('/');
    std::string_view c = p.substr(0, slash);
    p = slash == std::string_view::npos ? std::string_view{} : p.substr(slash + 1);
    if (c.empty() || c == ".") continue;
    if (c == "..") return false;
    out.push_back(c);
  }
  return true;
}

// The path an open descriptor stands for, as the kernel names it (/proc/self/fd/N).
Result<std::string> fd_path(int fd) {
  const std::string link = "/proc/self/fd/" + std::to_string(fd);
  std::string out(PATH_MAX, '\0');
  const ssize_t n = ::readlink(link.c_str(), out.data(), out.size());
  if (n < 0) return errc(errno);
  if (n == 0 || static_cast<size_t>(n) >= out.size()) return errc(ENAMETOOLONG);
  out.resize(static_cast<size_t>(n));
  return out;
}

std::string join(const std::vector<std::string_view>& parts, bool absolute) {
  std::string s = absolute ? "/" : "";
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i) s += '/';
    s += parts[i];
  }
  return s;
}

}  // namespace

Result<ExportTarget> resolve_export(std::string_view search_path_template,
                                    std::string_view session_name, std::string_view dev_name,
                                    std::string* why) {
  // 1. The search root, with every %SESSNAME% replaced by the (checked) session name.
  std::string root;
  for (std::string_view t = search_path_template;;) {
    size_t at = t.find(kSessNamePlaceholder);
    root += t.substr(0, at);
    if (at == std::string_view::npos) break;
    if (!session_name_ok(session_name))
      return refuse(why, EINVAL, "session name unusable as a directory name");
    root += session_name;
    t.remove_prefix(at + kSessNamePlaceholder.size());
  }
  if (root.empty() || root.front() != '/' || root.find('\0') != std::string::npos)
    return refuse(why, EINVAL, "dev_search_path must be an absolute path");
  std::vector<std::string_view> root_parts;
  if (!split_components(root, root_parts))
    return refuse(why, EINVAL, "dev_search_path has a '..' component");
  const std::string root_clean = join(root_parts, true);

  // 2. dev_name as components beneath the root.
  if (dev_name.empty()) return refuse(why, EINVAL, "empty device name");
  if (dev_name.find('\0') != std::string_view::npos)
    return refuse(why, EINVAL, "device name contains a NUL byte");
  if (dev_name.size() >= PATH_MAX) return refuse(why, ENAMETOOLONG, "device name too long");
  std::vector<std::string_view> parts;
  if (!split_components(dev_name, parts))
    return refuse(why, EINVAL, "device name has a '..' component");
  if (dev_name.front() == '/') {
    // An absolute name is accepted when it lies beneath the root (the admin may paste a full
    // path); then it is the same as the relative rest. Anything else escapes.
    if (parts.size() < root_parts.size() ||
        !std::equal(root_parts.begin(), root_parts.end(), parts.begin()))
      return refuse(why, EXDEV, "absolute device name outside " + root_clean);
    parts.erase(parts.begin(), parts.begin() + static_cast<ptrdiff_t>(root_parts.size()));
  }
  if (parts.empty()) return refuse(why, EINVAL, "device name names the search root itself");
  std::string rel = join(parts, false);
  if (root_clean.size() + 1 + rel.size() >= PATH_MAX)
    return refuse(why, ENAMETOOLONG, "joined path too long");

  // 3. Open the root, then walk beneath it. The O_PATH handle only proves the name; the backend
  // opens it again (beneath the same root) with the real access mode.
  int rfd = ::open(root_clean.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (rfd < 0) {
    int e = errno;
    return refuse(why, e, "search root " + root_clean + ": " + std::generic_category().message(e));
  }
  base::UniqueFd root_fd(rfd);
  auto target = backend::openat2_beneath(root_fd.get(), rel, O_PATH, backend::kResolveExport);
  if (!target) {
    int e = target.error().value();
    std::string reason;
    switch (e) {
      case EXDEV:
        reason = "a symlink leads outside " + root_clean;
        break;
      case ELOOP:
        reason = "symlink loop or /proc magic link";
        break;
      case ENOSYS:
        reason = "kernel lacks openat2 (Linux >= 5.6): exports refused";
        break;
      default:
        reason = rel + ": " + std::generic_category().message(e);
        break;
    }
    return refuse(why, e, std::move(reason));
  }
  struct stat st {};
  if (::fstat(target->get(), &st) != 0) return refuse(why, errno, "fstat failed");
  ExportTarget t;
  if (S_ISREG(st.st_mode)) {
    t.kind = ExportTarget::Kind::file;
  } else if (S_ISBLK(st.st_mode)) {
    t.kind = ExportTarget::Kind::block_device;
  } else if (S_ISDIR(st.st_mode)) {
    return refuse(why, EISDIR, rel + " is a directory");
  } else {
    return refuse(why, ENOTBLK, rel + " is neither a regular file nor a block device");
  }
  // 4. Where the name leads beneath the root: a symlink inside the root may point anywhere else
  // in it (another host's directory), and the access rules must hold for that file too.
  auto root_real = fd_path(root_fd.get());
  auto file_real = fd_path(target->get());
  if (!root_real.ok() || !file_real.ok())
    return refuse(why, (root_real.ok() ? file_real : root_real).error().value(),
                  "cannot tell where " + rel + " leads (/proc/self/fd)");
  const std::string prefix = *root_real == "/" ? "/" : *root_real + "/";
  if (file_real->size() <= prefix.size() || file_real->compare(0, prefix.size(), prefix) != 0)
    return refuse(why, EXDEV, rel + " leads outside " + root_clean);
  t.real_path = file_real->substr(prefix.size());
  t.root = std::move(root_fd);
  t.root_path = root_clean;
  t.rel_path = std::move(rel);
  t.id = file_id_of(st);
  return t;
}

}  // namespace ibnbd
