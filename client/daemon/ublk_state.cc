#include "ublk_state.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <sstream>

#include "base/unique_fd.h"

namespace ibnbd {

namespace {

constexpr int kVersion = 1;
constexpr const char* kPrefix = "ublk-";
constexpr const char* kSuffix = ".json";

Status write_all(int fd, const std::string& s) {
  for (size_t off = 0; off < s.size();) {
    ssize_t n = ::write(fd, s.data() + off, s.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errc(errno);
    }
    off += static_cast<size_t>(n);
  }
  return {};
}

Status fsync_dir(const std::string& dir) {
  base::UniqueFd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!d) return errc(errno);
  if (::fsync(d.get()) != 0) return errc(errno);
  return {};
}

// mkdir -p with mode 0700 for the last component (the records name the admin's volumes).
Status make_dir(const std::string& dir) {
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    const std::string part = dir.substr(0, pos);
    if (::mkdir(part.c_str(), pos == dir.size() ? 0700 : 0755) != 0 && errno != EEXIST) return errc(errno);
  }
  return {};
}

}  // namespace

nlohmann::json to_json(const UblkRecord& r) {
  nlohmann::json j = {{"version", kVersion}, {"ublk_id", r.ublk_id}, {"session", r.session},
                      {"paths", r.paths},    {"device", r.device},   {"access_mode", std::string(to_string(r.access_mode))}};
  if (!r.host_key.empty()) j["host_key"] = r.host_key;
  if (!r.host.empty()) j["host"] = r.host;
  if (!r.tls.empty()) j["tls"] = r.tls;
  if (!r.standby_paths.empty()) {
    j["standby_session"] = r.standby_session;
    j["standby_paths"] = r.standby_paths;
  }
  return j;
}

Result<UblkRecord> ublk_record_from_json(const nlohmann::json& j) {
  if (!j.is_object()) return errc(EINVAL);
  auto has = [&](const char* k, auto pred) { return j.contains(k) && pred(j[k]); };
  auto is_str = [](const nlohmann::json& v) { return v.is_string(); };
  if (!has("version", [](auto& v) { return v.is_number_integer() && v.template get<int>() == kVersion; }) ||
      !has("ublk_id", [](auto& v) { return v.is_number_unsigned() && v.template get<uint64_t>() <= UINT32_MAX; }) ||
      !has("session", is_str) || !has("device", is_str) || !has("access_mode", is_str) ||
      !has("paths", [](auto& v) { return v.is_array() && !v.empty(); }))
    return errc(EINVAL);
  UblkRecord r;
  r.ublk_id = j["ublk_id"].get<uint32_t>();
  r.session = j["session"].get<std::string>();
  r.device = j["device"].get<std::string>();
  auto m = parse_access_mode(j["access_mode"].get<std::string>());
  if (!m || r.session.empty() || r.device.empty()) return errc(EINVAL);
  r.access_mode = *m;
  for (auto& p : j["paths"]) {
    if (!p.is_string()) return errc(EINVAL);
    r.paths.push_back(p.get<std::string>());
  }
  for (auto [k, field] : {std::pair{"host_key", &r.host_key}, std::pair{"host", &r.host}, std::pair{"tls", &r.tls}}) {
    if (!j.contains(k)) continue;
    if (!j[k].is_string()) return errc(EINVAL);
    *field = j[k].get<std::string>();
  }
  if (!r.tls.empty() && r.tls != "on" && r.tls != "off") return errc(EINVAL);
  // A standby: both of its fields, a session name and at least one path.
  if (j.contains("standby_session") || j.contains("standby_paths")) {
    if (!has("standby_session", is_str) || !has("standby_paths", [](auto& v) { return v.is_array() && !v.empty(); }))
      return errc(EINVAL);
    r.standby_session = j["standby_session"].get<std::string>();
    if (r.standby_session.empty() || r.standby_session == r.session) return errc(EINVAL);
    for (auto& p : j["standby_paths"]) {
      if (!p.is_string()) return errc(EINVAL);
      r.standby_paths.push_back(p.get<std::string>());
    }
  }
  return r;
}

std::string UblkStateDir::file_of(uint32_t ublk_id) const {
  return dir_ + "/" + kPrefix + std::to_string(ublk_id) + kSuffix;
}

Status UblkStateDir::save(const UblkRecord& r) const {
  BASE_TRY(make_dir(dir_));
  const std::string file = file_of(r.ublk_id);
  const std::string tmp = file + ".tmp";
  {
    base::UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (!fd) return errc(errno);
    BASE_TRY(write_all(fd.get(), to_json(r).dump() + "\n"));
    if (::fsync(fd.get()) != 0) return errc(errno);
  }
  if (::rename(tmp.c_str(), file.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    return errc(e);
  }
  return fsync_dir(dir_);
}

Status UblkStateDir::remove(uint32_t ublk_id) const {
  if (::unlink(file_of(ublk_id).c_str()) != 0) return errno == ENOENT ? Status{} : Status{errc(errno)};
  return fsync_dir(dir_);
}

UblkStateDir::Loaded UblkStateDir::load() const {
  Loaded out;
  DIR* d = ::opendir(dir_.c_str());
  if (d == nullptr) return out;
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n.rfind(kPrefix, 0) == 0 && n.size() > 10 && n.compare(n.size() - 5, 5, kSuffix) == 0) names.push_back(n);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  for (auto& n : names) {
    std::ifstream in(dir_ + "/" + n);
    std::stringstream ss;
    ss << in.rdbuf();
    // The one place a record is parsed: JSON exceptions stop here (a damaged file is reported,
    // never fatal).
    nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
    auto r = ublk_record_from_json(j);
    if (!r.ok() || n != std::string(kPrefix) + std::to_string(r->ublk_id) + kSuffix) {
      out.bad.push_back(n + ": not a valid record");
      continue;
    }
    out.records.push_back(std::move(*r));
  }
  std::sort(out.records.begin(), out.records.end(),
            [](auto& a, auto& b) { return a.ublk_id < b.ublk_id; });
  return out;
}

}  // namespace ibnbd
