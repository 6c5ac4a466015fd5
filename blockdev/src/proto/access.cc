#include "proto/access.h"

#include <fnmatch.h>

namespace ibnbd::proto {

namespace {

bool known_mode(AccessMode m) { return static_cast<uint8_t>(m) <= static_cast<uint8_t>(AccessMode::migration); }

}  // namespace

Status check_op_allowed(AccessMode mode, IoOp op) {
  if (is_writer(mode)) return {};
  // Reading changes nothing (nor does asking where the data is: BLOCK_STATUS), and a FLUSH of
  // a device nobody writes through us is harmless.
  if (op == IoOp::read || op == IoOp::flush || op == IoOp::block_status) return {};
  return errc(EPERM);
}

// ------------------------------------------------------------------------------------------
// DeviceOpeners

Result<DeviceOpeners::Opened> DeviceOpeners::open(SessionId s, AccessMode mode) {
  if (!known_mode(mode)) return errc(EINVAL);
  if (auto it = holders_.find(s); it != holders_.end()) {
    if (it->second != mode) return errc(EBUSY);
    return Opened::already;
  }
  switch (mode) {
    case AccessMode::ro:
      break;
    case AccessMode::rw:
      if (writers_ != 0) return errc(EBUSY);
      break;
    case AccessMode::migration:
      if (writers_ >= 2) return errc(EBUSY);
      break;
  }
  holders_.emplace(s, mode);
  if (is_writer(mode)) ++writers_;
  return Opened::now;
}

Status DeviceOpeners::close(SessionId s) {
  auto it = holders_.find(s);
  if (it == holders_.end()) return errc(ENOENT);
  if (is_writer(it->second)) --writers_;
  holders_.erase(it);
  return {};
}

std::optional<AccessMode> DeviceOpeners::mode_of(SessionId s) const {
  auto it = holders_.find(s);
  if (it == holders_.end()) return std::nullopt;
  return it->second;
}

std::vector<Holder> DeviceOpeners::holders() const {
  std::vector<Holder> out;
  out.reserve(holders_.size());
  for (const auto& [s, m] : holders_) out.push_back(Holder{s, m});
  return out;
}

// ------------------------------------------------------------------------------------------
// DeviceIdAllocator

Result<uint32_t> DeviceIdAllocator::alloc() {
  uint64_t want = 0;  // 64 bits: "past max_id" must be representable when max_id is UINT32_MAX
  for (uint32_t id : used_) {
    if (id != want) break;
    ++want;
  }
  if (want > max_id_) return errc(ENOSPC);
  const auto id = static_cast<uint32_t>(want);
  used_.insert(id);
  return id;
}

Status DeviceIdAllocator::release(uint32_t id) {
  if (used_.erase(id) == 0) return errc(ENOENT);
  return {};
}

// ------------------------------------------------------------------------------------------
// OpenTable

const Opening* OpenTable::find_open(const SessionOpens& so, const FileId& file) const {
  for (const auto& [id, o] : so.by_id) {
    if (!o.force_closed && o.file == file) return &o;
  }
  return nullptr;
}

OpenTable::Released OpenTable::drop_holder(SessionId s, const Opening& o) {
  Released r{o.file, o.dev, false};
  auto it = devices_.find(o.file);
  if (it == devices_.end()) return r;
  (void)it->second.close(s);
  if (it->second.empty()) {
    devices_.erase(it);
    r.last_holder = true;
  }
  return r;
}

Result<OpenTable::Grant> OpenTable::open(SessionId s, const FileId& file, std::string_view name,
                                         AccessMode mode) {
  auto dit = devices_.find(file);
  const bool first = dit == devices_.end();
  if (first) dit = devices_.emplace(file, DeviceOpeners{}).first;
  auto opened = dit->second.open(s, mode);
  if (!opened.ok()) {
    if (first) devices_.erase(dit);
    return opened.error();
  }
  if (*opened == DeviceOpeners::Opened::already) {
    // A holder always has its live opening (close, force_close and end_session drop both).
    auto sit = sessions_.find(s);
    const Opening* o = sit == sessions_.end() ? nullptr : find_open(sit->second, file);
    if (o == nullptr) return errc(EBUSY);
    return Grant{o->device_id, true, false};
  }
  auto sit = sessions_.try_emplace(s, SessionOpens{DeviceIdAllocator(max_device_id_), {}}).first;
  auto id = sit->second.ids.alloc();
  if (!id.ok()) {
    (void)dit->second.close(s);
    if (first) devices_.erase(dit);
    if (sit->second.by_id.empty()) sessions_.erase(sit);
    return id.error();
  }
  sit->second.by_id.emplace(*id, Opening{*id, file, std::string(name), mode, false});
  return Grant{*id, false, first};
}

Result<OpenTable::Released> OpenTable::close(SessionId s, uint32_t device_id) {
  auto sit = sessions_.find(s);
  if (sit == sessions_.end()) return errc(ENOENT);
  auto oit = sit->second.by_id.find(device_id);
  if (oit == sit->second.by_id.end()) return errc(ENOENT);
  // A force-closed id no longer holds its device; closing it only frees the id.
  Released r = oit->second.force_closed ? Released{oit->second.file, oit->second.dev, false}
                                        : drop_holder(s, oit->second);
  (void)sit->second.ids.release(device_id);
  sit->second.by_id.erase(oit);
  if (sit->second.by_id.empty()) sessions_.erase(sit);
  return r;
}

bool OpenTable::has_id(SessionId s, uint32_t device_id) const {
  auto sit = sessions_.find(s);
  return sit != sessions_.end() && sit->second.by_id.count(device_id) != 0;
}

Result<OpenTable::Released> OpenTable::force_close(const FileId& file, SessionId s) {
  auto sit = sessions_.find(s);
  if (sit == sessions_.end()) return errc(ENOENT);
  const Opening* found = find_open(sit->second, file);
  if (found == nullptr) return errc(ENOENT);
  Opening& o = sit->second.by_id.find(found->device_id)->second;
  o.force_closed = true;
  return drop_holder(s, o);
}

std::vector<OpenTable::Released> OpenTable::end_session(SessionId s) {
  std::vector<Released> out;
  auto sit = sessions_.find(s);
  if (sit == sessions_.end()) return out;
  for (const auto& [id, o] : sit->second.by_id) {
    if (!o.force_closed) out.push_back(drop_holder(s, o));
  }
  sessions_.erase(sit);
  return out;
}

Result<Opening> OpenTable::lookup(SessionId s, uint32_t device_id) const {
  auto sit = sessions_.find(s);
  if (sit == sessions_.end()) return errc(ENODEV);
  auto oit = sit->second.by_id.find(device_id);
  if (oit == sit->second.by_id.end() || oit->second.force_closed) return errc(ENODEV);
  return oit->second;
}

std::vector<Holder> OpenTable::holders(const FileId& file) const {
  auto it = devices_.find(file);
  return it == devices_.end() ? std::vector<Holder>{} : it->second.holders();
}

std::vector<Opening> OpenTable::devices_of(SessionId s) const {
  std::vector<Opening> out;
  auto sit = sessions_.find(s);
  if (sit == sessions_.end()) return out;
  for (const auto& [id, o] : sit->second.by_id) out.push_back(o);
  return out;
}

// ------------------------------------------------------------------------------------------
// ExportAcl

bool acl_pattern_matches(std::string_view pattern, std::string_view dev) {
  if (pattern == "**") return true;
  if (pattern.size() >= 3 && pattern.substr(pattern.size() - 3) == "/**") {
    const std::string_view dir = pattern.substr(0, pattern.size() - 2);  // keeps the '/'
    return dev.size() > dir.size() && dev.substr(0, dir.size()) == dir;
  }
  return ::fnmatch(std::string(pattern).c_str(), std::string(dev).c_str(), FNM_PATHNAME) == 0;
}

Status check_acl_rule(const AclRule& r) {
  if (r.devices.empty() || r.devices.find('\0') != std::string::npos || !known_mode(r.mode))
    return errc(EINVAL);
  // Device names never have '..' components (resolve_export refuses them): a pattern with one
  // would only look like it grants something outside.
  for (std::string_view rest = r.devices; !rest.empty();) {
    const size_t slash = rest.find('/');
    if (rest.substr(0, slash) == "..") return errc(EINVAL);
    if (slash == std::string_view::npos) break;
    rest.remove_prefix(slash + 1);
  }
  return {};
}

Status ExportAcl::set_host(std::string host, std::vector<AclRule> rules) {
  for (const auto& r : rules) BASE_TRY(check_acl_rule(r));
  hosts_[std::move(host)] = std::move(rules);
  return {};
}

Status ExportAcl::remove_host(std::string_view host) {
  auto it = hosts_.find(host);
  if (it == hosts_.end()) return errc(ENOENT);
  hosts_.erase(it);
  return {};
}

const std::vector<AclRule>* ExportAcl::rules_of(std::string_view host) const {
  auto it = hosts_.find(host);
  return it == hosts_.end() ? nullptr : &it->second;
}

Status ExportAcl::check(std::string_view host, std::string_view dev, AccessMode mode) const {
  if (!known_mode(mode)) return errc(EINVAL);
  const std::vector<AclRule>* rules = host.empty() ? nullptr : rules_of(host);
  if (rules == nullptr) return any_host_ ? Status{} : Status{errc(EACCES)};
  bool matched = false;
  for (const auto& r : *rules) {
    if (!acl_pattern_matches(r.devices, dev)) continue;
    matched = true;
    if (static_cast<uint8_t>(mode) <= static_cast<uint8_t>(r.mode)) return {};
  }
  return errc(matched ? EPERM : EACCES);
}

}  // namespace ibnbd::proto
