// ibtrs/auth.h: secrets in their DHHC-1 text, host ids and key files.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "auth/crypto.h"
#include "base/unique_fd.h"
#include "ibtrs/auth.h"

namespace ibtrs {

namespace {

constexpr std::string_view kPrefix = "DHHC-1:";
constexpr size_t kMaxKeyFile = 64 * 1024;

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r' || s.front() == '\n'))
    s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r' || s.back() == '\n'))
    s.remove_suffix(1);
  return s;
}

bool valid_len(size_t n) { return n == 32 || n == 48 || n == 64; }

std::error_code refuse(std::string* why, int err, std::string reason) {
  if (why != nullptr) *why = std::move(reason);
  return errc(err);
}

}  // namespace

// ------------------------------------------------------------------------------------------
// Secret

Secret::Secret(const Secret& o) : transform_(o.transform_), key_(o.key_) {}

Secret& Secret::operator=(const Secret& o) {
  if (this != &o) {
    auth::cleanse(key_);
    transform_ = o.transform_;
    key_ = o.key_;
  }
  return *this;
}

Secret::Secret(Secret&& o) noexcept : transform_(o.transform_), key_(std::move(o.key_)) {
  o.key_.clear();
}

Secret& Secret::operator=(Secret&& o) noexcept {
  if (this != &o) {
    auth::cleanse(key_);
    transform_ = o.transform_;
    key_ = std::move(o.key_);
    o.key_.clear();
  }
  return *this;
}

Secret::~Secret() { auth::cleanse(key_); }

Result<Secret> Secret::parse(std::string_view text) {
  text = trim(text);
  // "DHHC-1:" hh ":" base64 ":"
  if (text.size() < kPrefix.size() + 4 || text.substr(0, kPrefix.size()) != kPrefix ||
      text.back() != ':' || text[kPrefix.size() + 2] != ':')
    return errc(EINVAL);
  const char h0 = text[kPrefix.size()], h1 = text[kPrefix.size() + 1];
  if (h0 != '0' || h1 < '0' || h1 > '3') return errc(EINVAL);
  const auto t = static_cast<Transform>(h1 - '0');
  std::string_view b64 = text.substr(kPrefix.size() + 3);
  b64.remove_suffix(1);
  BASE_ASSIGN_OR_RETURN(std::vector<uint8_t> raw, auth::base64_decode(b64));
  if (raw.size() < 4 || !valid_len(raw.size() - 4)) {
    auth::cleanse(raw);
    return errc(EINVAL);
  }
  const size_t n = raw.size() - 4;
  const uint32_t want = uint32_t{raw[n]} | uint32_t{raw[n + 1]} << 8 | uint32_t{raw[n + 2]} << 16 |
                        uint32_t{raw[n + 3]} << 24;
  const bool crc_ok = auth::crc32(std::span(raw.data(), n)) == want;
  std::vector<uint8_t> key(raw.begin(), raw.begin() + static_cast<ptrdiff_t>(n));
  auth::cleanse(raw);
  if (!crc_ok) {
    auth::cleanse(key);
    return errc(EBADMSG);
  }
  return Secret(t, std::move(key));
}

Result<Secret> Secret::generate(Transform t, size_t len) {
  if (!valid_len(len) || static_cast<uint8_t>(t) > 3) return errc(EINVAL);
  std::vector<uint8_t> key(len);
  BASE_TRY(auth::random_bytes(key));
  return Secret(t, std::move(key));
}

std::string Secret::to_string() const {
  std::vector<uint8_t> raw(key_);
  const uint32_t c = auth::crc32(key_);
  for (int i = 0; i < 4; ++i) raw.push_back(static_cast<uint8_t>(c >> (8 * i)));
  std::string s(kPrefix);
  s += '0';
  s += static_cast<char>('0' + static_cast<uint8_t>(transform_));
  s += ':';
  s += auth::base64_encode(raw);
  s += ':';
  auth::cleanse(raw);
  return s;
}

std::string Secret::fingerprint() const {
  std::string text = to_string();
  uint8_t d[32];
  const auth::Bytes parts[] = {{reinterpret_cast<const uint8_t*>(text.data()), text.size()}};
  const bool ok = auth::digest(auth::Hash::sha256, parts, d).ok();
  auth::cleanse({reinterpret_cast<uint8_t*>(text.data()), text.size()});
  return ok ? auth::to_hex(std::span(d, 8)) : std::string("?");
}

bool operator==(const Secret& a, const Secret& b) {
  return a.transform_ == b.transform_ && auth::equal_ct(a.key_, b.key_);
}

// ------------------------------------------------------------------------------------------
// Host ids

bool valid_host_id(std::string_view id) {
  if (id.empty() || id.size() > kHostIdMax) return false;
  for (char c : id) {
    if (c < 0x21 || c > 0x7e) return false;
  }
  return true;
}

std::string generate_host_id() {
  uint8_t u[16] = {};
  if (!auth::random_bytes(u).ok()) return {};
  u[6] = static_cast<uint8_t>((u[6] & 0x0f) | 0x40);  // RFC 4122 version 4
  u[8] = static_cast<uint8_t>((u[8] & 0x3f) | 0x80);  // variant 1
  const std::string h = auth::to_hex(u);
  return "nqn.2014-08.org.nvmexpress:uuid:" + h.substr(0, 8) + "-" + h.substr(8, 4) + "-" +
         h.substr(12, 4) + "-" + h.substr(16, 4) + "-" + h.substr(20);
}

// ------------------------------------------------------------------------------------------
// Key files

Result<KeyFile> load_key_file(const std::string& path, std::string* why) {
  base::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY));
  if (!fd) {
    const int e = errno;
    return refuse(why, e, path + ": " + std::generic_category().message(e));
  }
  std::string text;
  struct stat st {};
  int err = 0;
  std::string reason;
  if (::fstat(fd.get(), &st) != 0) {
    err = errno;
    reason = path + ": fstat failed";
  } else if (!S_ISREG(st.st_mode)) {
    err = EINVAL;
    reason = path + ": not a regular file";
  } else if ((st.st_mode & S_IRWXO) != 0) {
    // A secret anyone on the host can read is no secret (ssh refuses such keys too).
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    err = EPERM;
    reason = path + ": key file is accessible to others (mode " + mode + "): chmod 600 it";
  } else if (st.st_size > static_cast<off_t>(kMaxKeyFile)) {
    err = EFBIG;
    reason = path + ": too large for a key file";
  } else {
    text.resize(static_cast<size_t>(st.st_size));
    size_t got = 0;
    while (got < text.size()) {
      const ssize_t n = ::read(fd.get(), text.data() + got, text.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    text.resize(got);
  }
  fd.reset();  // read: closed before the parse, as it always was
  if (err != 0) return refuse(why, err, reason);

  KeyFile k;
  bool have_key = false;
  size_t lineno = 0;
  std::error_code bad;
  for (size_t at = 0; at <= text.size() && !bad;) {
    size_t nl = text.find('\n', at);
    if (nl == std::string::npos) nl = text.size();
    std::string_view line = trim(std::string_view(text).substr(at, nl - at));
    at = nl + 1;
    ++lineno;
    if (line.empty() || line.front() == '#') continue;
    const std::string where = path + ":" + std::to_string(lineno) + ": ";
    std::string_view word = line, value;
    if (size_t sp = line.find_first_of(" \t"); sp != std::string_view::npos) {
      word = line.substr(0, sp);
      value = trim(line.substr(sp));
    }
    if (word.substr(0, kPrefix.size()) == kPrefix && value.empty()) {
      value = word;  // nvme-cli's bare secret
      word = "key";
    }
    if (word == "host") {
      if (!valid_host_id(value)) bad = refuse(why, EINVAL, where + "host id: printable, no spaces, 1..223 bytes");
      k.host = std::string(value);
    } else if (word == "key" || word == "server-key") {
      auto s = Secret::parse(value);
      if (!s.ok()) {
        bad = refuse(why, s.error().value(),
                     where + (s.error().value() == EBADMSG ? "secret fails its CRC-32 check"
                                                           : "expected DHHC-1:<hh>:<base64>:"));
      } else if (word == "key") {
        if (have_key) bad = refuse(why, EINVAL, where + "a second key");
        k.key = std::move(*s);
        have_key = true;
      } else {
        k.server_key = std::move(*s);
      }
    } else {
      bad = refuse(why, EINVAL, where + "unknown word '" + std::string(word) + "'");
    }
  }
  auth::cleanse({reinterpret_cast<uint8_t*>(text.data()), text.size()});
  if (bad) return bad;
  if (!have_key) return refuse(why, EINVAL, path + ": no key line");
  return k;
}

std::string format_key_file(const KeyFile& k) {
  std::string s = "# ibnbd host key (ibnbd key generate). Keep it secret: mode 0600.\n";
  if (!k.host.empty()) s += "host " + k.host + "\n";
  s += "key " + k.key.to_string() + "\n";
  if (k.server_key) s += "server-key " + k.server_key->to_string() + "\n";
  return s;
}

Status save_key_file(const std::string& path, const KeyFile& k) {
  base::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!fd) return errc(errno);
  std::string text = format_key_file(k);
  int err = 0;
  for (size_t off = 0; off < text.size();) {
    const ssize_t n = ::write(fd.get(), text.data() + off, text.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      err = n < 0 ? errno : EIO;
      break;
    }
    off += static_cast<size_t>(n);
  }
  if (err == 0 && ::fsync(fd.get()) != 0) err = errno;
  fd.reset();  // closed before a failed file is unlinked
  auth::cleanse({reinterpret_cast<uint8_t*>(text.data()), text.size()});
  if (err != 0) {
    ::unlink(path.c_str());
    return errc(err);
  }
  return {};
}

Result<ClientAuth> client_auth_from_key_file(const std::string& path, const std::string& host,
                                             std::string* why) {
  auto k = load_key_file(path, why);
  if (!k.ok()) return k.error();
  ClientAuth a;
  a.host_id = host.empty() ? k->host : host;
  if (!valid_host_id(a.host_id))
    return refuse(why, EINVAL, path + ": no host line in the file and no host id given");
  a.key = std::move(k->key);
  a.server_key = std::move(k->server_key);
  return a;
}

// ------------------------------------------------------------------------------------------
// KeyTable

Status KeyTable::set(const std::string& host, HostKeys keys) {
  if (!valid_host_id(host) || keys.keys.empty()) return errc(EINVAL);
  for (const Secret& k : keys.keys) {
    if (k.empty()) return errc(EINVAL);
  }
  if (keys.server_key && keys.server_key->empty()) return errc(EINVAL);
  std::lock_guard lock(mu_);
  hosts_[host] = std::move(keys);
  return {};
}

bool KeyTable::remove(std::string_view host) {
  std::lock_guard lock(mu_);
  auto it = hosts_.find(host);
  if (it == hosts_.end()) return false;
  hosts_.erase(it);
  return true;
}

std::vector<std::string> KeyTable::hosts() const {
  std::lock_guard lock(mu_);
  std::vector<std::string> out;
  for (const auto& [h, k] : hosts_) out.push_back(h);
  return out;
}

std::optional<HostKeys> KeyTable::host_keys(std::string_view host) const {
  std::lock_guard lock(mu_);
  auto it = hosts_.find(host);
  if (it == hosts_.end()) return std::nullopt;
  return it->second;
}

std::string_view to_string(AuthState s) {
  switch (s) {
    case AuthState::none: return "none";
    case AuthState::pending: return "pending";
    case AuthState::authenticated: return "authenticated";
    case AuthState::failed: return "failed";
  }
  return "?";
}

}  // namespace ibtrs
