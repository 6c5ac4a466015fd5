// PSK files and keys (ibtrs/tls.h): the file format (one "identity:hex key" a line, no group or
// other access), a fresh key, and what a valid PSK is. Apart from the sessions (tls.cc) because
// the CLI writes these files and the client daemon reads them with no session at all.
#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>

#include "base/unique_fd.h"
#include "tls/tls_private.h"

namespace ibtrs::tls {

bool valid_psk(const Psk& p) {
  return !p.identity.empty() && p.identity.size() <= 255 && printable(p.identity) &&
         p.key.size() >= 32 && p.key.size() <= 64;
}

Result<std::vector<Psk>> read_psk_entries(const std::string& path) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) return errc(errno);
  if ((st.st_mode & (S_IRWXG | S_IRWXO)) != 0) return errc(EACCES);
  std::ifstream in(path);
  if (!in) return errc(errno != 0 ? errno : EIO);
  auto nib = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::vector<Psk> out;
  std::string line;
  Status bad;
  while (std::getline(in, line)) {
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    const size_t colon = line.rfind(':');
    Psk p;
    if (colon != std::string::npos) p.identity = line.substr(0, colon);
    const std::string_view hex = colon == std::string::npos ? std::string_view{} : std::string_view(line).substr(colon + 1);
    bool ok = colon != std::string::npos && hex.size() % 2 == 0;
    for (size_t i = 0; ok && i < hex.size(); i += 2) {
      const int hi = nib(hex[i]), lo = nib(hex[i + 1]);
      ok = hi >= 0 && lo >= 0;
      p.key.push_back(static_cast<std::byte>(hi << 4 | lo));
    }
    OPENSSL_cleanse(line.data(), line.size());
    ok = ok && valid_psk(p) &&
         std::none_of(out.begin(), out.end(), [&](const Psk& q) { return q.identity == p.identity; });
    if (!ok) {
      OPENSSL_cleanse(p.key.data(), p.key.size());
      bad = errc(EINVAL);
      break;
    }
    out.push_back(std::move(p));
  }
  if (bad.ok() && out.empty()) bad = errc(EINVAL);
  if (!bad.ok()) {
    for (auto& p : out) OPENSSL_cleanse(p.key.data(), p.key.size());
    return bad.error();
  }
  return out;
}

Result<Psk> read_psk_file(const std::string& path) {
  BASE_ASSIGN_OR_RETURN(auto all, read_psk_entries(path));
  for (size_t i = 1; i < all.size(); ++i) OPENSSL_cleanse(all[i].key.data(), all[i].key.size());
  return std::move(all.front());
}

Result<Psk> generate_psk(std::string identity) {
  Psk p{std::move(identity), std::vector<std::byte>(32)};
  if (RAND_bytes(reinterpret_cast<unsigned char*>(p.key.data()), static_cast<int>(p.key.size())) != 1)
    return errc(EIO);
  if (!valid_psk(p)) return errc(EINVAL);
  return p;
}

Status write_psk_file(const std::string& path, const Psk& psk, bool overwrite) {
  if (!valid_psk(psk)) return errc(EINVAL);
  base::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | (overwrite ? O_TRUNC : O_EXCL), 0600));
  if (!fd) return errc(errno);
  std::string line = psk.identity + ":";
  static const char kHex[] = "0123456789abcdef";
  for (std::byte b : psk.key) {
    line += kHex[static_cast<uint8_t>(b) >> 4];
    line += kHex[static_cast<uint8_t>(b) & 15];
  }
  line += '\n';
  const bool ok = ::fchmod(fd.get(), 0600) == 0 &&
                  ::write(fd.get(), line.data(), line.size()) == static_cast<ssize_t>(line.size());
  const int e = errno;
  OPENSSL_cleanse(line.data(), line.size());
  return ok ? Status{} : Status{errc(e)};
}

}  // namespace ibtrs::tls
