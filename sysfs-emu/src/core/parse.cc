#include "sysfs/parse.h"

#include <cerrno>
#include <charconv>

#include "ibnbd/types.h"
#include "ibtrs/path_spec.h"

namespace sysfs {

using ibtrs::errc;

namespace {

template <typename T>
Result<T> number(std::string_view t) {
  T v{};
  auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (t.empty() || ec != std::errc{} || p != t.data() + t.size()) return errc(EINVAL);
  return v;
}

}  // namespace

std::string_view trim(std::string_view s) {
  const char* ws = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

Status parse_one(std::string_view text) {
  return trim(text) == "1" ? Status{} : Status{errc(EINVAL)};
}

Status parse_reset(std::string_view text) {
  const auto t = trim(text);
  return t == "0" || t == "1" ? Status{} : Status{errc(EINVAL)};
}

Result<bool> parse_unmap_mode(std::string_view text) {
  const auto t = trim(text);
  if (t == "normal") return false;
  if (t == "force") return true;
  return errc(EINVAL);
}

Result<uint64_t> parse_sectors(std::string_view text) {
  auto n = number<uint64_t>(trim(text));
  if (!n || *n == 0) return errc(EINVAL);
  return n;
}

Result<std::string> parse_path(std::string_view text, std::optional<uint16_t> dest_port) {
  text = trim(text);
  // One path per write; whitespace inside would be a second argument the kernel refuses too.
  if (text.empty() || text.find_first_of(" \t\n") != std::string_view::npos) return errc(EINVAL);
  auto spec = ibtrs::PathSpec::parse(text, ibtrs::FabricKind::tcp, dest_port.value_or(ibtrs::kDefaultPort));
  if (!spec) return errc(EINVAL);
  if (!dest_port) return std::string(text);
  std::string out = spec->destination.to_string();
  if (spec->source) out = spec->source->to_string() + "@" + out;
  return out;
}

Result<MapDeviceOptions> parse_map_device(std::string_view text) {
  MapDeviceOptions o;
  std::vector<std::string_view> raw_paths;
  bool have_sess = false, have_dev = false, have_mode = false;
  text = trim(text);
  while (!text.empty()) {
    const size_t end = text.find_first_of(" \t\n");
    const std::string_view tok = text.substr(0, end);
    text = end == std::string_view::npos ? std::string_view{} : trim(text.substr(end));
    const size_t eq = tok.find('=');
    if (eq == std::string_view::npos || eq + 1 == tok.size()) return errc(EINVAL);
    const std::string_view k = tok.substr(0, eq), v = tok.substr(eq + 1);
    if (k == "sessname") {
      // The kernel's limit: NAME_MAX; ours (the transport's): 1..63 printable bytes, checked
      // by the daemon. '/' cannot name a directory.
      if (have_sess || v.size() > 255 || v.find('/') != std::string_view::npos) return errc(EINVAL);
      o.sessname = v;
      have_sess = true;
    } else if (k == "path") {
      if (raw_paths.size() == kMaxMapPaths) return errc(EINVAL);
      raw_paths.push_back(v);
    } else if (k == "device_path") {
      if (have_dev || v.size() > 255) return errc(EINVAL);
      o.device_path = v;
      have_dev = true;
    } else if (k == "access_mode") {
      if (have_mode || !ibnbd::parse_access_mode(v)) return errc(EINVAL);
      o.access_mode = v;
      have_mode = true;
    } else if (k == "dest_port") {
      auto p = number<uint16_t>(v);
      if (!p || o.dest_port || *p == 0) return errc(EINVAL);
      o.dest_port = *p;
    } else if (k == "nr_poll_queues") {
      auto n = number<int32_t>(v);
      if (!n || o.nr_poll_queues || *n < -1 || *n > 1024) return errc(EINVAL);
      o.nr_poll_queues = *n;
    } else {
      return errc(EINVAL);
    }
  }
  if (!have_sess || !have_dev || raw_paths.empty()) return errc(EINVAL);
  for (auto p : raw_paths) {  // after the loop: dest_port may come after the paths
    auto t = parse_path(p, o.dest_port);
    if (!t) return t.error();
    o.paths.push_back(std::move(*t));
  }
  return o;
}

nlohmann::json map_device_request(const MapDeviceOptions& o) {
  return {{"cmd", "device_map"}, {"device", o.device_path}, {"session", o.sessname},
          {"paths", o.paths}, {"access_mode", o.access_mode}, {"exclusive", true}, {"ublk", true}};
}

std::string escape_name(std::string_view name) {
  std::string s(name);
  for (char& c : s)
    if (c == '/') c = '!';
  return s;
}

std::string unescape_name(std::string_view entry) {
  std::string s(entry);
  for (char& c : s)
    if (c == '!') c = '/';
  return s;
}

}  // namespace sysfs
