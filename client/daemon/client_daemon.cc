#include "client_daemon.h"

#include <fcntl.h>
#include <grp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <optional>
#include <thread>
#include <vector>

#include "base/pattern.h"
#include "base/unique_fd.h"
#include "control/command.h"
#include "ibnbd/nbd_device_export.h"
#include "ibtrs/gid.h"
#include "ibtrs/tls.h"

namespace ibnbd {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace tls = ibtrs::tls;

json err(int e, const std::string& text = {}) { return control::error(e, text); }

// A ublk map without ublk_drv: the module, and the way to a block device without it.
const std::string kUblkMissing = "ublk: ublk_drv not loaded (no ";
constexpr const char* kUblkMissingHint =
    "): modprobe ublk_drv, or map without ublk and serve the device over NBD (ibnbd device export)";
json err(std::error_code ec, const std::string& what) { return control::error(ec, what); }

// A group by name or number (nothing when there is no such group).
std::optional<gid_t> group_id(const std::string& g) {
  unsigned v = 0;
  auto [p, ec] = std::from_chars(g.data(), g.data() + g.size(), v);
  if (!g.empty() && ec == std::errc() && p == g.data() + g.size()) return static_cast<gid_t>(v);
  std::vector<char> buf(16384);
  group gr{};
  group* found = nullptr;
  if (::getgrnam_r(g.c_str(), &gr, buf.data(), buf.size(), &found) != 0 || found == nullptr)
    return std::nullopt;
  return found->gr_gid;
}

using control::bytes_cell;
using control::column;
using control::string_arg;

// A session name the kernel would accept (printable, no '/'), from the first server address.
std::string default_session_name(const ibtrs::PathSpec& p) {
  std::string n = "ibnbd-" + p.destination.to_string();
  for (char& c : n)
    if (c == '/' || c == ' ') c = '_';
  return n;
}

// device_io's verification pattern (base/pattern.h): a block read back from the wrong place or a
// stale one does not match.
void fill_pattern(std::byte* p, uint64_t off, uint32_t len, uint64_t seed) {
  base::Pattern(seed).fill({p, len}, off);
}
bool check_pattern(const std::byte* p, uint64_t off, uint32_t len, uint64_t seed) {
  return base::Pattern(seed).check({p, len}, off) < 0;
}

// One pass of device_io: every block of the range written (or read and checked) with `qd`
// requests in flight, progress reported about five times a second.
struct Pass {
  RemoteDevice& dev;
  ibtrs::RegisteredMemory& mem;
  bool write;
  uint64_t seed;
  uint64_t offset, size;
  uint32_t bs, qd;

  std::mutex mu;
  std::condition_variable cv;
  std::vector<uint32_t> free_slots;
  std::vector<uint64_t> slot_off;
  uint64_t done_bytes = 0;
  uint64_t errors = 0, bad_blocks = 0;
  int first_err = 0;

  struct Ctx {
    Pass* p;
    uint32_t slot;
  };
  std::vector<Ctx> ctxs;

  static void on_done(void* c, int e) {
    auto* x = static_cast<Ctx*>(c);
    Pass& p = *x->p;
    bool bad = false;
    if (e == 0 && !p.write)
      bad = !check_pattern(p.mem.data() + size_t{x->slot} * p.bs, p.slot_off[x->slot], p.bs, p.seed);
    std::lock_guard l(p.mu);
    if (e != 0) {
      ++p.errors;
      if (p.first_err == 0) p.first_err = e;
    }
    if (bad) ++p.bad_blocks;
    p.done_bytes += p.bs;
    p.free_slots.push_back(x->slot);
    p.cv.notify_one();
  }

  // Returns the seconds it took.
  double run(const control::Emit& emit) {
    ctxs.resize(qd);
    slot_off.assign(qd, 0);
    for (uint32_t i = 0; i < qd; ++i) {
      ctxs[i] = Ctx{this, i};
      free_slots.push_back(qd - 1 - i);
    }
    const auto t0 = Clock::now();
    auto last = t0;
    auto report = [&](bool force) {
      auto now = Clock::now();
      if (!force && now - last < std::chrono::milliseconds(200)) return;
      last = now;
      const double s = std::chrono::duration<double>(now - t0).count();
      uint64_t d;
      {
        std::lock_guard l(mu);
        d = done_bytes;
      }
      emit({{"progress",
             {{"phase", write ? "write" : "verify"}, {"done", d}, {"total", size},
              {"mib_s", s > 0 ? static_cast<double>(d) / s / (1 << 20) : 0.0}}}});
    };
    for (uint64_t off = offset; off < offset + size; off += bs) {
      uint32_t slot;
      {
        std::unique_lock l(mu);
        cv.wait(l, [&] { return !free_slots.empty(); });
        slot = free_slots.back();
        free_slots.pop_back();
      }
      slot_off[slot] = off;
      std::byte* b = mem.data() + size_t{slot} * bs;
      ibtrs::IoSeg seg{b, bs, &mem};
      Status st;
      if (write) {
        fill_pattern(b, off, bs, seed);
        st = dev.write(off, std::span(&seg, 1), 0, IoDone{&Pass::on_done, &ctxs[slot]});
      } else {
        st = dev.read(off, std::span(&seg, 1), IoDone{&Pass::on_done, &ctxs[slot]});
      }
      if (!st.ok()) on_done(&ctxs[slot], st.error().value());
      report(false);
    }
    std::unique_lock l(mu);
    cv.wait(l, [&] { return free_slots.size() == qd; });
    l.unlock();
    report(true);
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }
};

}  // namespace

ClientDaemon::~ClientDaemon() {
  std::lock_guard l(mu_);
  // ublk devices go first, cleanly (STOP_DEV drains their IO through the mappings), and their
  // records with them: a daemon told to stop leaves nothing to recover.
  while (!ublk_.empty()) (void)ublk_stop(ublk_.begin()->first);
  exports_.clear();  // each NBD server stops first: its requests end before the unmaps
  // Failover devices before their sessions (they call into both).
  for (auto& [n, f] : failover_) (void)unmap_failover(*f.dev, UnmapMode::force);
  failover_.clear();
  for (auto& [n, s] : sessions_) {
    for (auto& d : s.s->devices()) (void)s.s->unmap(d->name(), UnmapMode::force);
    s.io_buf.reset();
  }
  sessions_.clear();
}

json ClientDaemon::handle(const json& req, const control::Emit& emit) {
  std::lock_guard l(mu_);
  try {
    const std::string cmd = req.at("cmd").get<std::string>();
    if (cmd == "device_map") return device_map(req);
    if (cmd == "device_list") return device_list(req, false);
    if (cmd == "device_show") return device_list(req, true);
    if (cmd == "device_unmap") return device_unmap(req);
    if (cmd == "device_remap" || cmd == "device_resize") return device_remap(req);
    if (cmd == "device_failover") return device_failover(req);
    if (cmd == "device_io") return device_io(req, emit);
    if (cmd == "session_list") return session_list(req, false);
    if (cmd == "session_show") return session_list(req, true);
    if (cmd == "session_disconnect" || cmd == "session_close") return session_close(req);
    if (cmd == "session_policy") return policy_set(req);
    if (cmd == "path_list") return path_list(req);
    if (cmd == "path_stats") return path_stats(req);
    if (cmd == "path_reset_stats") return path_reset_stats(req);
    if (cmd == "session_max_reconnect_attempts") return session_max_reconnect_attempts(req);
    if (cmd == "nbd_export") return nbd_export(req);
    if (cmd == "nbd_unexport") return nbd_unexport(req);
    if (cmd == "nbd_list") return nbd_list(req);
    if (cmd == "path_add" || cmd == "path_delete" || cmd == "path_disconnect" || cmd == "path_reconnect")
      return path_op(req, cmd.substr(5));
    if (cmd == "session_recover" || cmd == "device_recover" || cmd == "path_recover") {
      // The rnbd tool's recover: reconnect every path that is not up and re-open every device
      // a failed remap left closed, in one session or in all.
      const std::string only = req.contains("session") ? string_arg(req, "session") : "";
      if (!only.empty() && find_session(only) == nullptr) return err(ENOENT, "no session " + only);
      json done = json::array();
      for (auto& [n, s] : sessions_) {
        if (!only.empty() && n != only) continue;
        for (auto& p : s.s->transport().paths()) {
          if (p.state == ibtrs::ClientPathState::connected) continue;
          auto st = s.s->transport().reconnect_path(p.name);
          done.push_back({{"path", p.name}, {"ok", st.ok()}});
        }
        for (auto& d : s.s->devices()) {
          if (d->state() != DeviceState::closed || failover_.count(d->name())) continue;
          auto st = s.s->remap(d->name());
          done.push_back({{"device", d->name()}, {"ok", st.ok()}});
        }
      }
      // Failover devices with a side missing or closed: open it again (the standby without
      // taking the device over).
      for (auto& [n, f] : failover_) {
        if (!only.empty() && f.sessions[0] != only && f.sessions[1] != only) continue;
        auto fi = f.dev->failover();
        if (fi->standby_ready && f.dev->state() != DeviceState::closed) continue;
        auto st = remap_failover(*f.dev);
        done.push_back({{"device", n}, {"ok", st.ok()}});
      }
      return {{"ok", true}, {"recovered", done},
              {"message", std::to_string(done.size()) + " path(s) or device(s) recovered"}};
    }
    if (cmd == "session_reconnect") {
      OpenSession* s = find_session(string_arg(req, "session"));
      if (s == nullptr) return err(ENOENT, "no session " + string_arg(req, "session"));
      for (auto& p : s->s->transport().paths()) {
        if (p.state != ibtrs::ClientPathState::connected) (void)s->s->transport().reconnect_path(p.name);
      }
      return {{"ok", true}};
    }
    return err(EINVAL, "unknown command '" + cmd + "'");
  } catch (const std::exception& e) {
    return err(EINVAL, e.what());
  }
}

ClientDaemon::OpenSession* ClientDaemon::find_session(const std::string& name) {
  auto it = sessions_.find(name);
  return it == sessions_.end() ? nullptr : &it->second;
}

std::pair<ClientDaemon::OpenSession*, std::shared_ptr<RemoteDevice>> ClientDaemon::find_device(const std::string& name) {
  if (auto it = failover_.find(name); it != failover_.end())
    return {find_session(it->second.dev->failover()->active), it->second.dev};
  for (auto& [n, s] : sessions_) {
    if (auto d = s.s->find(name)) return {&s, d};
  }
  return {nullptr, nullptr};
}

Result<ibtrs::ClientAuth> ClientDaemon::credentials(const std::string& key_file, const std::string& host,
                                                   std::string* why) const {
  const std::string& file = key_file.empty() ? opts_.host_key : key_file;
  ibtrs::ClientAuth a;
  if (file.empty()) {
    if (!host.empty()) {
      *why = "a host id without a key file";
      return errc(EINVAL);
    }
    return a;  // anonymous
  }
  // A host id given with the map wins, then the daemon's --host-id, then the file's.
  return ibtrs::client_auth_from_key_file(file, host.empty() ? opts_.host_id : host, why);
}

Result<ClientDaemon::OpenSession*> ClientDaemon::open_session(const std::string& sname,
                                                       const std::vector<ibtrs::PathSpec>& paths,
                                                       const std::string& host_key,
                                                       const std::string& host, const std::string& tls,
                                                       std::string* why) {
  OpenSession* s = find_session(sname);
  if (s != nullptr && s->tls != tls) {
    *why = "session " + sname + " was opened with " + (s->tls.empty() ? "the daemon's TLS setting" : "tls " + s->tls) +
           ": map through it with the same, or another session";
    return errc(EINVAL);
  }
  if (s != nullptr && (s->host_key != host_key || s->host != host)) {
    // Every path of a session authenticates as one host with one key.
    *why = "session " + sname + " authenticates with " +
           (s->host_key.empty() ? std::string("the daemon's key") : "key file " + s->host_key) +
           (s->host.empty() ? "" : " as host " + s->host) + ": map through it with the same, or another session";
    return errc(EINVAL);
  }
  if (s == nullptr) {
    BASE_ASSIGN_OR_RETURN(ibtrs::ClientAuth auth, credentials(host_key, host, why));
    BlockSessionOptions o;
    o.transport.auth = std::move(auth);
    o.transport.session_name = sname;
    o.transport.paths = paths;
    o.transport.io_threads = opts_.io_threads;
    o.transport.heartbeat = opts_.heartbeat;
    o.transport.reconnect = opts_.reconnect;
    o.transport.connect_timeout = opts_.connect_timeout;
    o.transport.policy = opts_.policy;
    o.transport.tls = opts_.tls;
    o.on_device_event = [this, sname](const DeviceEvent& e) { on_device_event(sname, e); };
    if (!tls.empty()) o.transport.tls.mode = tls == "on" ? ibtrs::tls::Options::Mode::on : ibtrs::tls::Options::Mode::off;
    if (o.transport.tls.mode != ibtrs::tls::Options::Mode::off && o.transport.tls.ca_file.empty() &&
        !o.transport.auth.enabled()) {
      *why = "TLS with a pre-shared key derives it from the host key: give the daemon --host-key (or map host-key FILE), or --tls-ca for certificates";
      return errc(EINVAL);
    }
    // NBD exports lend their own registered request memory to the NBD server (zero copy); the
    // bounce buffers serve only an export whose registration failed, at the library's depth.
    auto bs = BlockSession::open(std::move(o));
    if (!bs.ok()) {
      if (bs.error() == std::errc::permission_denied)
        *why = "the server refused the host or its key (ibnbd server host list on the server)";
      if (bs.error() == std::errc::protocol_not_supported)
        *why = "the server requires TLS on tcp paths (map with tls on, or start the daemon with --tls on)";
      return bs.error();
    }
    s = &sessions_[sname];
    s->s = std::move(*bs);
    s->host_key = host_key;
    s->host = host;
    s->tls = tls;
  } else {
    // Paths named here that the session lacks are added, as map_device with more paths would.
    auto have = s->s->transport().paths();
    for (auto& p : paths) {
      if (std::none_of(have.begin(), have.end(), [&](auto& h) { return h.name == p.name(); }))
        (void)s->s->transport().add_path(p);
    }
  }
  return s;
}

json ClientDaemon::device_map(const json& req) {
  const std::string dev = string_arg(req, "device");
  AccessMode mode = AccessMode::rw;
  if (req.contains("access_mode")) {
    auto m = parse_access_mode(req["access_mode"].get<std::string>());
    if (!m) return err(EINVAL, "access_mode: ro, rw or migration");
    mode = *m;
  }
  std::vector<ibtrs::PathSpec> paths;
  std::vector<std::string> path_strs;
  for (auto& p : req.at("paths")) {
    auto spec = ibtrs::PathSpec::parse(p.get<std::string>());
    if (!spec.ok()) return err(EINVAL, "path '" + p.get<std::string>() + "': " + spec.error().message());
    std::string why;
    if (auto st = ibtrs::check_gid_path(*spec, &why); !st.ok()) return err(st.error().value(), "path '" + p.get<std::string>() + "': " + why);
    // Two paths of one session with the same name would be one path twice (the library says
    // only EEXIST): name it.
    for (auto& known : paths)
      if (known.name() == spec->name())
        return err(EINVAL, "path " + spec->name() + " is given twice ('" + p.get<std::string>() + "')");
    paths.push_back(*spec);
    path_strs.push_back(p.get<std::string>());
  }
  if (paths.empty()) return err(EINVAL, "at least one path");
  if (req.contains("standby_paths")) return failover_map(req, dev, mode, paths, path_strs);
  if (failover_.count(dev)) return err(EEXIST, "device " + dev + " is mapped with a standby (unmap it first)");
  const bool want_ublk = req.value("ublk", false);
  const uint32_t depth = req.value("ublk_queue_depth", uint32_t{opts_.ublk_queue_depth});
  if (want_ublk && (depth == 0 || depth > ublk::uapi::kMaxQueueDepth))
    return err(EINVAL, "ublk_queue_depth: 1.." + std::to_string(ublk::uapi::kMaxQueueDepth));
  if (want_ublk && ublk_.count(dev))
    return err(EEXIST, "device " + dev + " already has " + ublk_.at(dev).dev->block_path());
  const std::string sname = req.contains("session") ? string_arg(req, "session") : default_session_name(paths[0]);
  auto [old_s, old_d] = find_device(dev);
  if (old_d && old_s->s->name() != sname)
    return err(EEXIST, "device " + dev + " is mapped through session " + old_s->s->name());
  // exclusive (the kernel's map_device): mapping a mapped device again is EEXIST, not a no-op.
  if (old_d && req.value("exclusive", false)) return err(EEXIST, "device " + dev + " is already mapped");
  if (json e = want_ublk ? ublk_unavailable() : json(); !e.is_null()) return e;
  std::string host_key = req.contains("host_key") ? string_arg(req, "host_key") : "";
  const std::string host = req.contains("host") ? string_arg(req, "host") : "";
  const std::string tls = req.contains("tls") ? string_arg(req, "tls") : "";
  if (!tls.empty() && tls != "on" && tls != "off") return err(EINVAL, "tls: on or off");
  std::string why;
  auto s = open_session(sname, paths, host_key, host, tls, &why);
  if (!s.ok()) return err(s.error().value(), "session " + sname + ": " + (why.empty() ? s.error().message() : why));
  auto d = (*s)->s->map(dev, mode);
  if (!d.ok()) {
    if ((*s)->s->devices().empty()) sessions_.erase(sname);
    std::string hint;
    if (d.error() == std::errc::permission_denied) hint = " (the server's access rules do not grant this host the device)";
    if (d.error() == std::errc::operation_not_permitted) hint = " (the server grants this host less than " + std::string(to_string(mode)) + " there)";
    return err(d.error(), "map " + dev + hint);
  }
  if (want_ublk) {
    json e = ublk_start(**s, *d, UblkRecord{0, sname, path_strs, dev, mode, host_key, host, tls, {}, {}},
                        static_cast<uint16_t>(depth));
    if (!e.is_null()) {
      // Roll back what this command did: a device that was mapped before stays mapped.
      if (!old_d) {
        (void)(*s)->s->unmap(dev, UnmapMode::force);
        if ((*s)->s->devices().empty()) sessions_.erase(sname);
      }
      return e;
    }
  }
  return device_list(json{{"device", dev}}, true);
}

// device_map {..., standby_paths: [...], standby_session?}: the device through two sessions,
// the first (`paths`, `session`) active, the second a standby (library: map_failover).
json ClientDaemon::failover_map(const json& req, const std::string& dev, AccessMode mode,
                                const std::vector<ibtrs::PathSpec>& paths, const std::vector<std::string>& path_strs) {
  std::vector<ibtrs::PathSpec> spaths;
  std::vector<std::string> spath_strs;
  for (auto& p : req.at("standby_paths")) {
    auto spec = ibtrs::PathSpec::parse(p.get<std::string>());
    if (!spec.ok()) return err(EINVAL, "standby path '" + p.get<std::string>() + "': " + spec.error().message());
    std::string why;
    if (auto st = ibtrs::check_gid_path(*spec, &why); !st.ok())
      return err(st.error().value(), "standby path '" + p.get<std::string>() + "': " + why);
    spaths.push_back(*spec);
    spath_strs.push_back(p.get<std::string>());
  }
  if (spaths.empty()) return err(EINVAL, "standby: at least one path");
  const std::string sname = req.contains("session") ? string_arg(req, "session") : default_session_name(paths[0]);
  const std::string bname =
      req.contains("standby_session") ? string_arg(req, "standby_session") : default_session_name(spaths[0]);
  if (sname == bname)
    return err(EINVAL, "the standby needs a session of its own: another server, or standby-session NAME");
  if (auto it = failover_.find(dev); it != failover_.end()) {
    if (it->second.sessions[0] == sname && it->second.sessions[1] == bname && it->second.dev->access_mode() == mode &&
        !req.value("exclusive", false) && !req.value("ublk", false))
      return device_list(json{{"device", dev}}, true);
    return err(EEXIST, "device " + dev + " is already mapped (with standby " + it->second.sessions[1] + ")");
  }
  if (auto [os, od] = find_device(dev); od)
    return err(EEXIST, "device " + dev + " is mapped through session " + os->s->name() + " (unmap it to map it with a standby)");
  const bool want_ublk = req.value("ublk", false);
  const uint32_t depth = req.value("ublk_queue_depth", uint32_t{opts_.ublk_queue_depth});
  if (want_ublk && (depth == 0 || depth > ublk::uapi::kMaxQueueDepth))
    return err(EINVAL, "ublk_queue_depth: 1.." + std::to_string(ublk::uapi::kMaxQueueDepth));
  if (json e = want_ublk ? ublk_unavailable() : json(); !e.is_null()) return e;
  const std::string host_key = req.contains("host_key") ? string_arg(req, "host_key") : "";
  const std::string host = req.contains("host") ? string_arg(req, "host") : "";
  const std::string tls = req.contains("tls") ? string_arg(req, "tls") : "";
  if (!tls.empty() && tls != "on" && tls != "off") return err(EINVAL, "tls: on or off");
  // Sessions this command opened go again when it fails.
  const bool had_a = find_session(sname) != nullptr, had_b = find_session(bname) != nullptr;
  auto drop_new = [&] {
    for (auto [n, had] : {std::pair{sname, had_a}, std::pair{bname, had_b}}) {
      OpenSession* s = find_session(n);
      if (!had && s != nullptr && s->s->devices().empty()) sessions_.erase(n);
    }
  };
  std::string why;
  auto a = open_session(sname, paths, host_key, host, tls, &why);
  if (!a.ok()) return err(a.error().value(), "session " + sname + ": " + (why.empty() ? a.error().message() : why));
  auto b = open_session(bname, spaths, host_key, host, tls, &why);
  if (!b.ok()) {
    drop_new();
    return err(b.error().value(), "standby session " + bname + ": " + (why.empty() ? b.error().message() : why));
  }
  FailoverOptions fo;
  fo.on_event = [](const FailoverEvent& e) {
    switch (e.kind) {
      case FailoverEvent::Kind::failed_over:
        std::fprintf(stderr, "ibnbd-client: %s: failed over from session %s to %s (IO paused %lld ms, %llu requests sent again)\n",
                     e.dev_name.c_str(), e.from.c_str(), e.to.c_str(), static_cast<long long>(e.pause.count()),
                     static_cast<unsigned long long>(e.resent));
        break;
      case FailoverEvent::Kind::standby_lost:
        std::fprintf(stderr, "ibnbd-client: %s: standby %s not ready: %s\n", e.dev_name.c_str(), e.to.c_str(),
                     e.error.message().c_str());
        break;
      case FailoverEvent::Kind::standby_back:
        std::fprintf(stderr, "ibnbd-client: %s: standby %s ready\n", e.dev_name.c_str(), e.to.c_str());
        break;
      case FailoverEvent::Kind::cache_lost:
        std::fprintf(stderr, "ibnbd-client: %s: %llu writes completed on %s since its last flush may be lost with its cache\n",
                     e.dev_name.c_str(), static_cast<unsigned long long>(e.resent), e.from.c_str());
        break;
    }
  };
  auto d = map_failover(*(*a)->s, *(*b)->s, dev, mode, std::move(fo));
  if (!d.ok()) {
    drop_new();
    std::string hint;
    if (d.error() == std::errc::permission_denied) hint = " (the server's access rules do not grant this host the device)";
    if (d.error() == std::errc::operation_not_permitted)
      hint = " (the server grants this host less than " + std::string(to_string(mode)) + " there)";
    return err(d.error(), "map " + dev + hint);
  }
  failover_[dev] = Failover{*d, {sname, bname}, {path_strs, spath_strs}};
  if (want_ublk) {
    UblkRecord rec{0, sname, path_strs, dev, mode, host_key, host, tls, bname, spath_strs};
    json e = ublk_start(**a, *d, rec, static_cast<uint16_t>(depth));
    if (!e.is_null()) {
      (void)failover_unmap(dev, UnmapMode::force);
      drop_new();
      return e;
    }
  }
  return device_list(json{{"device", dev}}, true);
}

ublk::UblkOptions ClientDaemon::ublk_options(const RemoteDevice& d, uint16_t queue_depth) const {
  ublk::UblkOptions o;
  // A block request as large as one transport request of the device (124 KiB against a
  // server with default settings), so each is one RDMA transfer straight from its tag's buffer: larger ones
  // are split by the block layer, not by the library, and the registered memory stays small
  // (queues x depth x this: 2 x 128 x 124 KiB = 31 MiB). Page multiple (the driver's unit),
  // at least a page, at most o.max_io_bytes.
  o.max_io_bytes = std::clamp(d.max_part_bytes() / 4096 * 4096, 4096u, o.max_io_bytes);
  // One queue per IO thread of the session (the transport's default when not set); the driver
  // clamps it to the CPUs.
  const uint32_t threads =
      opts_.io_threads != 0 ? opts_.io_threads : std::clamp(std::thread::hardware_concurrency(), 1u, 8u);
  o.nr_queues = static_cast<uint16_t>(threads);
  o.queue_depth = queue_depth;
  o.control_path = opts_.ublk_control;
  o.reap = opts_.ublk_reap;
  o.log = [](const std::string& m) { std::fprintf(stderr, "ibnbd-client: %s\n", m.c_str()); };
  return o;
}

// Before anything is opened: without ublk_drv the map would open the session and the device on
// the server only to close them again (ublk_start still checks: the module may go meanwhile).
json ClientDaemon::ublk_unavailable() const {
  if (::access(opts_.ublk_control.c_str(), F_OK) == 0) return nullptr;
  return err(ENODEV, kUblkMissing + opts_.ublk_control + kUblkMissingHint);
}

json ClientDaemon::ublk_start(OpenSession& s, const std::shared_ptr<RemoteDevice>& d, const UblkRecord& rec,
                              uint16_t queue_depth) {
  auto u = ublk::UblkDevice::create(d, *s.s, ublk_options(*d, queue_depth));
  if (!u.ok()) {
    if (u.error() == std::errc::no_such_device && ::access(opts_.ublk_control.c_str(), F_OK) != 0)
      return err(ENODEV, kUblkMissing + opts_.ublk_control + kUblkMissingHint);
    return err(u.error(), "ublk device for " + d->name());
  }
  UblkRecord r = rec;
  r.ublk_id = (*u)->dev_id();
  if (auto st = state_.save(r); !st.ok()) {
    // Without its record the device could not be recovered after a crash: refuse it now.
    (void)(*u)->stop();
    return err(st.error(), "ublk: record in " + state_.dir());
  }
  std::fprintf(stderr, "ibnbd-client: %s served as %s (%u queues x %u)\n", d->name().c_str(),
               (*u)->block_path().c_str(), (*u)->nr_queues(), (*u)->queue_depth());
  std::lock_guard ul(ublk_mu_);
  ublk_[d->name()] = Ublk{std::move(*u), r};
  return nullptr;
}

Status ClientDaemon::ublk_stop(const std::string& name) {
  const std::string dev = name;  // `name` may be the map's own key, erased below
  Ublk u;
  {
    // Out of the map first: a resize notice (on_device_event) finds it no more. Not held while
    // it stops: STOP_DEV waits for IO whose completions may need the thread that notices run on.
    std::lock_guard ul(ublk_mu_);
    auto it = ublk_.find(dev);
    if (it == ublk_.end()) return {};
    u = std::move(it->second);
    ublk_.erase(it);
  }
  const auto us = u.dev->stats();
  std::fprintf(stderr, "ibnbd-client: %s: stopping %s (%llu requests, %llu errors, %llu wakeups)\n", dev.c_str(),
               u.dev->block_path().c_str(), static_cast<unsigned long long>(us.requests),
               static_cast<unsigned long long>(us.errors), static_cast<unsigned long long>(us.wakeups));
  Status st = u.dev->stop();
  if (!st.ok())
    std::fprintf(stderr, "ibnbd-client: ublk %s of %s: stop: %s\n", u.dev->block_path().c_str(), dev.c_str(),
                 st.error().message().c_str());
  // The device is not served any more either way; a record would only make a restarted daemon
  // try to recover a device that is stopped.
  (void)state_.remove(u.rec.ublk_id);
  return st;
}

// A session's worker thread (BlockSessionOptions::on_device_event): only resizes do anything
// here, and only under ublk_mu_, never mu_ (a command holding mu_ may be waiting for this
// thread).
void ClientDaemon::on_device_event(const std::string& session, const DeviceEvent& e) {
  if (e.kind != DeviceEvent::Kind::resized) return;
  std::fprintf(stderr, "ibnbd-client: %s: resized by the server (session %s): %llu -> %llu bytes\n",
               e.dev_name.c_str(), session.c_str(), static_cast<unsigned long long>(e.old_size),
               static_cast<unsigned long long>(e.new_size));
  std::lock_guard ul(ublk_mu_);
  auto it = ublk_.find(e.dev_name);
  if (it == ublk_.end() || it->second.dev->size() == e.new_size) return;
  ublk::UblkDevice& u = *it->second.dev;
  if (auto st = u.update_size(e.new_size); st.ok()) {
    std::fprintf(stderr, "ibnbd-client: %s: %s now %llu bytes\n", e.dev_name.c_str(), u.block_path().c_str(),
                 static_cast<unsigned long long>(e.new_size));
  } else {
    // NBD clients connecting from now on see the new size, but a block device of a kernel or a
    // build without UBLK_U_CMD_UPDATE_SIZE keeps its capacity (device show: ublk_size).
    std::fprintf(stderr, "ibnbd-client: %s: %s keeps %llu bytes until unmapped and mapped again (%s)\n",
                 e.dev_name.c_str(), u.block_path().c_str(), static_cast<unsigned long long>(u.size()),
                 st.error() == std::errc::operation_not_supported
                     ? (ublk::update_size_supported() ? "the kernel has no UBLK_U_CMD_UPDATE_SIZE"
                                                      : "built without UBLK_U_CMD_UPDATE_SIZE, Linux 6.16")
                     : st.error().message().c_str());
  }
}

json ClientDaemon::recover_ublk() {
  std::lock_guard l(mu_);
  json out = json::array();
  auto loaded = state_.load();
  for (auto& b : loaded.bad) {
    std::fprintf(stderr, "ibnbd-client: %s/%s: ignored\n", state_.dir().c_str(), b.c_str());
    out.push_back({{"record", b}, {"ok", false}});
  }
  for (const auto& r : loaded.records) {
    json row{{"device", r.device}, {"ublk_id", r.ublk_id}};
    auto fail = [&](const std::string& why, bool drop) {
      std::fprintf(stderr, "ibnbd-client: recovery of /dev/ublkb%u (%s): %s%s\n", r.ublk_id, r.device.c_str(),
                   why.c_str(), drop ? "; record dropped" : "; record kept for the next start");
      if (drop) (void)state_.remove(r.ublk_id);
      row["ok"] = false;
      row["error"] = why;
      out.push_back(row);
    };
    std::vector<ibtrs::PathSpec> paths;
    for (auto& p : r.paths)
      if (auto spec = ibtrs::PathSpec::parse(p); spec.ok()) paths.push_back(*spec);
    if (paths.empty()) {
      fail("no valid path in the record", true);
      continue;
    }
    std::string why;
    auto s = open_session(r.session, paths, r.host_key, r.host, r.tls, &why);
    if (!s.ok()) {
      fail("session " + r.session + ": " + (why.empty() ? s.error().message() : why), false);
      continue;
    }
    // A failover device: its standby's session too.
    OpenSession* sb = nullptr;
    if (!r.standby_paths.empty()) {
      std::vector<ibtrs::PathSpec> spaths;
      for (auto& p : r.standby_paths)
        if (auto spec = ibtrs::PathSpec::parse(p); spec.ok()) spaths.push_back(*spec);
      auto b = spaths.empty() ? Result<OpenSession*>(errc(EINVAL))
                              : open_session(r.standby_session, spaths, r.host_key, r.host, r.tls, &why);
      if (!b.ok()) {
        if ((*s)->s->devices().empty()) sessions_.erase(r.session);
        fail("standby session " + r.standby_session + ": " + (why.empty() ? b.error().message() : why), false);
        continue;
      }
      sb = *b;
    }
    // The server may still hold the dead daemon's session, and the device with it (EBUSY for
    // a second writer), until it notices the connections are gone.
    auto map_once = [&]() -> Result<std::shared_ptr<RemoteDevice>> {
      if (sb == nullptr) return (*s)->s->map(r.device, r.access_mode);
      // The standby's server may hold it too: a busy standby maps as missing; remap_failover
      // brings it back once that server let go.
      return map_failover(*(*s)->s, *sb->s, r.device, r.access_mode);
    };
    Result<std::shared_ptr<RemoteDevice>> d = errc(EBUSY);
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    while (!(d = map_once()).ok() && d.error() == std::errc::device_or_resource_busy && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    auto drop_sessions = [&] {
      for (const std::string& n : {r.session, r.standby_session}) {
        OpenSession* x = n.empty() ? nullptr : find_session(n);
        if (x != nullptr && x->s->devices().empty()) sessions_.erase(n);
      }
    };
    if (!d.ok()) {
      drop_sessions();
      fail("map " + r.device + ": " + d.error().message(), false);
      continue;
    }
    if (sb != nullptr) failover_[r.device] = Failover{*d, {r.session, r.standby_session}, {r.paths, r.standby_paths}};
    auto u = ublk::UblkDevice::recover(r.ublk_id, *d, *(*s)->s, ublk_options(**d, opts_.ublk_queue_depth));
    if (!u.ok()) {
      if (sb != nullptr) {
        (void)failover_unmap(r.device, UnmapMode::force);
      } else {
        (void)(*s)->s->unmap(r.device, UnmapMode::force);
      }
      drop_sessions();
      // ENOENT: the kernel has no such device (any more): nothing to recover, ever.
      fail("ublk: " + u.error().message(), u.error() == std::errc::no_such_file_or_directory ||
                                               u.error() == std::errc::invalid_argument);
      continue;
    }
    std::fprintf(stderr, "ibnbd-client: %s recovered as %s\n", r.device.c_str(), (*u)->block_path().c_str());
    row["ok"] = true;
    row["ublk"] = (*u)->block_path();
    std::lock_guard ul(ublk_mu_);
    ublk_[r.device] = Ublk{std::move(*u), r};
    out.push_back(row);
  }
  return out;
}

std::vector<control::DeviceReport> ClientDaemon::device_reports(bool one, const std::string& only) {
  std::vector<control::DeviceReport> out;
  // One report per device: a failover device's under its active session, with its standby.
  auto report_of = [&](const std::string& sess, const std::shared_ptr<RemoteDevice>& d) {
    auto st = d->stats();
    const auto fi = d->failover();
    control::DeviceReport r;
    if (fi) {
      r.standby = fi->standby;
      r.standby_state = fi->standby_ready ? "ready" : fi->standby_error ? fi->standby_error.message() : "not ready";
    }
    r.device = d->name();
    r.session = fi ? fi->active : sess;
    r.access_mode = std::string(to_string(d->access_mode()));
    r.size = d->size_bytes();
    r.state = std::string(to_string(d->state()));
    r.device_id = d->device_id();
    r.rx_bytes = st.read_bytes;
    r.tx_bytes = st.write_bytes;
    r.inflight = st.inflight;
    r.errors = st.errors;
    r.remaps = st.remaps;
    r.nbd = export_addresses(d->name());
    r.ublk = ublk_path(d->name());
    r.failovers = fi ? fi->failovers : 0;
    if (one) {
      control::DeviceReport::Detail x;
      // How the ublk queues got their completions: committed by the queue thread that reaped
      // them, or handed over by the transport's IO threads (eventfd wake-ups).
      auto it = ublk_.find(d->name());
      const auto us = it == ublk_.end() ? ublk::UblkStats{} : it->second.dev->stats();
      x.ublk_requests = us.requests;
      x.ublk_reaped = us.reaped;
      x.ublk_wakeups = us.wakeups;
      // Sizes the server announced, and the size /dev/ublkbN has: behind `size` until it is
      // mapped again where the kernel cannot resize it (no UBLK_U_CMD_UPDATE_SIZE).
      x.resizes = st.resizes;
      if (it != ublk_.end()) x.ublk_size = it->second.dev->size();
      // The last failover: its pause (trigger to IO flowing again), the requests sent again,
      // and flushes failed because the old active's cache may have lost writes.
      x.last_failover_ms = fi ? static_cast<uint64_t>(fi->last_pause.count()) : 0;
      x.resent = fi ? fi->resent : 0;
      x.lost_flushes = fi ? fi->lost_flushes : 0;
      r.detail = x;
    }
    out.push_back(std::move(r));
  };
  for (auto& [n, s] : sessions_) {
    for (auto& d : s.s->devices()) {
      if (one && d->name() != only) continue;
      if (failover_.count(d->name())) continue;  // a leg: listed once, below
      report_of(n, d);
    }
  }
  for (auto& [n, f] : failover_) {
    if (one && n != only) continue;
    report_of("", f.dev);
  }
  return out;
}

std::vector<control::DeviceReport> ClientDaemon::devices() {
  std::lock_guard l(mu_);
  return device_reports(false, "");
}

Result<control::DeviceReport> ClientDaemon::device(const std::string& name) {
  std::lock_guard l(mu_);
  auto r = device_reports(true, name);
  if (r.empty()) return errc(ENOENT);
  return std::move(r.front());
}

json ClientDaemon::device_list(const json& req, bool one) {
  const std::string only = one ? string_arg(req, "device") : "";
  auto reports = device_reports(one, only);
  if (one && reports.empty()) return err(ENOENT, "device " + only + " is not mapped");
  return control::device_listing(reports, one);
}

Status ClientDaemon::failover_unmap(const std::string& name, UnmapMode mode) {
  auto it = failover_.find(name);
  if (it == failover_.end()) return errc(ENOENT);
  auto st = unmap_failover(*it->second.dev, mode);
  if (!st.ok() && st.error() == std::errc::device_or_resource_busy) return st;
  const Failover f = it->second;
  failover_.erase(it);
  for (const std::string& n : f.sessions) {
    OpenSession* s = find_session(n);
    if (s != nullptr && s->s->devices().empty()) {
      s->io_buf.reset();
      sessions_.erase(n);
    }
  }
  return st;
}

json ClientDaemon::device_unmap(const json& req) {
  const std::string dev = string_arg(req, "device");
  auto [s, d] = find_device(dev);
  if (d == nullptr) return err(ENOENT, "device " + dev + " is not mapped");
  const bool is_failover = d->failover().has_value();
  d.reset();
  const bool force = req.value("force", false);
  if (auto it = ublk_.find(dev); it != ublk_.end() && !force) {
    // As rnbd refuses to unmap an opened device: a mounted filesystem (or any exclusive opener)
    // would lose its disk. O_EXCL on a block device fails with EBUSY while one holds it.
    const std::string bdev = it->second.dev->block_path();
    // Closed at the end of this block, before the unmap: our own O_EXCL open must not hold it.
    const base::UniqueFd fd(::open(bdev.c_str(), O_RDONLY | O_EXCL | O_CLOEXEC));
    if (!fd && errno == EBUSY) return err(EBUSY, bdev + " is in use (mounted?); unmap " + dev + " force");
  }
  stop_export(dev);  // NBD clients lose the device before the IBNBD mapping goes
  // So does /dev/ublkbN: STOP_DEV waits for its IO, which still needs the mapping.
  const Status ublk_st = ublk_stop(dev);
  if (is_failover) {
    auto fst = failover_unmap(dev, force ? UnmapMode::force : UnmapMode::normal);
    if (!fst.ok() && fst.error() == std::errc::device_or_resource_busy)
      return err(EBUSY, "device " + dev + " has IO outstanding (unmap " + dev + " force)");
    if (!fst.ok()) return err(fst.error(), "close " + dev + " on the servers (unmapped here)");
    if (!ublk_st.ok()) return err(ublk_st.error(), "ublk device of " + dev + " (unmapped anyway)");
    return {{"ok", true}};
  }
  auto st = s->s->unmap(dev, force ? UnmapMode::force : UnmapMode::normal);
  if (!st.ok() && st.error() == std::errc::device_or_resource_busy)
    return err(EBUSY, "device " + dev + " has IO outstanding (unmap " + dev + " force)");
  if (s->s->devices().empty()) {
    // The last device gone: the session goes too (the kernel's rnbd keeps it; nothing uses it).
    const std::string n = s->s->name();
    s->io_buf.reset();
    sessions_.erase(n);
  }
  if (!st.ok()) return err(st.error(), "close " + dev + " on the server (unmapped here)");
  if (!ublk_st.ok()) return err(ublk_st.error(), "ublk device of " + dev + " (unmapped anyway)");
  return {{"ok", true}};
}

json ClientDaemon::device_remap(const json& req) {
  const std::string dev = string_arg(req, "device");
  auto [s, d] = find_device(dev);
  if (d == nullptr) return err(ENOENT, "device " + dev + " is not mapped");
  auto st = d->failover() ? remap_failover(*d) : s->s->remap(dev);
  if (!st.ok()) return err(st.error(), "remap " + dev);
  return device_list(json{{"device", dev}}, true);
}

// device_failover {device}: the standby becomes active now (an administrative failover).
json ClientDaemon::device_failover(const json& req) {
  const std::string dev = string_arg(req, "device");
  auto [s, d] = find_device(dev);
  if (d == nullptr) return err(ENOENT, "device " + dev + " is not mapped");
  if (!d->failover()) return err(EINVAL, "device " + dev + " has no standby (map it with standby SERVER)");
  auto st = switch_failover(*d);
  if (!st.ok()) {
    auto fi = d->failover();
    const bool why = fi->standby_error && fi->standby_error != st.error();
    return err(st.error(), "failover of " + dev + " to " + fi->standby + (why ? " (" + fi->standby_error.message() + ")" : ""));
  }
  return device_list(json{{"device", dev}}, true);
}

json ClientDaemon::device_io(const json& req, const control::Emit& emit) {
  const std::string dev = string_arg(req, "device");
  auto [s, d] = find_device(dev);
  if (d == nullptr) return err(ENOENT, "device " + dev + " is not mapped");
  const uint32_t lbs = d->geometry().logical_block_size;
  uint32_t bs = req.value("bs", 1u << 20);
  bs = std::min(bs, d->max_part_bytes());
  const uint32_t qd = std::clamp(req.value("qd", 16u), 1u, 256u);
  const uint64_t offset = req.value("offset", uint64_t{0});
  uint64_t size = req.value("size", d->size_bytes() - std::min(offset, d->size_bytes()));
  const uint64_t dev_bytes = d->size_bytes();
  if (bs == 0 || bs % lbs != 0 || offset % lbs != 0 || size % lbs != 0)
    return err(EINVAL, "offset, size and bs must be multiples of the block size (" + std::to_string(lbs) + " bytes)");
  if (offset > dev_bytes || size > dev_bytes - offset)
    return err(EINVAL, "size " + std::to_string(size) + " at offset " + std::to_string(offset) +
                           " reaches beyond the end of " + dev + " (" + std::to_string(dev_bytes) + " bytes)");
  size -= size % bs;
  if (size == 0) return err(EINVAL, "nothing to do: size below one block of bs");
  const std::string mode = req.value("mode", std::string("write-verify"));
  const bool do_write = mode == "write-verify" || mode == "write";
  const bool do_verify = mode == "write-verify" || mode == "verify";
  if (!do_write && !do_verify) return err(EINVAL, "mode: write-verify, write or verify");
  // Writing fails on every request of a read-only mapping: refuse before the first, not after
  // a pass of errors and "bad blocks" (verify alone reads, and is fine).
  if (do_write && d->access_mode() == AccessMode::ro)
    return err(EROFS, dev + " is mapped read-only: only mode verify reads it");
  const size_t need = size_t{bs} * qd;
  // A failover device's buffers are its own (registered with both its sessions); a plain
  // device's session keeps one for the next run.
  std::unique_ptr<ibtrs::RegisteredMemory> own;
  ibtrs::RegisteredMemory* buf = nullptr;
  if (d->failover()) {
    auto b = d->alloc_buffer(need);
    if (!b.ok()) return err(b.error(), "IO buffers");
    own = std::move(*b);
    buf = own.get();
  } else {
    if (!s->io_buf || s->io_buf->size() < need) {
      s->io_buf.reset();
      auto b = d->alloc_buffer(need);
      if (!b.ok()) return err(b.error(), "IO buffers");
      s->io_buf = std::move(*b);
    }
    buf = s->io_buf.get();
  }
  const uint64_t seed = req.value("seed", uint64_t{0x1b7d5eed});
  json out{{"ok", true}, {"device", dev}, {"bytes", size}, {"bs", bs}, {"qd", qd}};
  for (bool w : {true, false}) {
    if ((w && !do_write) || (!w && !do_verify)) continue;
    Pass p{*d, *buf, w, seed, offset, size, bs, qd, {}, {}, {}, {}, 0, 0, 0, 0, {}};
    const double secs = p.run(emit);
    json r{{"seconds", secs}, {"mib_s", static_cast<double>(size) / secs / (1 << 20)},
           {"errors", p.errors}};
    if (!w) r["bad_blocks"] = p.bad_blocks;
    if (p.first_err) r["first_error"] = std::strerror(p.first_err);
    out[w ? "write" : "verify"] = r;
    if (p.errors || p.bad_blocks) out["ok"] = false;
  }
  json paths = json::array();
  for (auto& pi : s->s->transport().paths())
    paths.push_back({{"name", pi.name}, {"state", std::string(ibtrs::to_string(pi.state))},
                     {"read_cnt", pi.stats.read_cnt}, {"read_bytes", pi.stats.read_bytes},
                     {"write_cnt", pi.stats.write_cnt}, {"write_bytes", pi.stats.write_bytes},
                     {"failovered", pi.stats.failovered}});
  out["paths"] = paths;
  if (!out["ok"].get<bool>()) {
    out["errno"] = EIO;
    out["error"] = "IO errors or blocks that did not verify";
  }
  return out;
}

std::vector<control::SessionReport> ClientDaemon::session_reports(bool one, const std::string& only) {
  std::vector<control::SessionReport> out;
  for (auto& [n, s] : sessions_) {
    if (one && n != only) continue;
    auto ps = s.s->transport().paths();
    control::SessionReport r;
    r.name = n;
    r.path_cnt = ps.size();
    uint32_t up = 0, inflight = 0;  // 32 bits, as the listing always counted them
    for (auto& p : ps) {
      const bool u = p.state == ibtrs::ClientPathState::connected;
      r.path_uu += u ? 'U' : '_';
      up += u;
      inflight += p.inflight;
      r.reconnects += p.stats.reconnects_ok;
    }
    r.act_path_cnt = up;
    r.inflight = inflight;
    auto st = s.s->transport().stats();
    r.state = std::string(to_string(s.s->state()));
    r.mp = std::string(ibtrs::to_string(s.s->transport().policy()));
    r.rx_bytes = st.read_bytes;
    r.tx_bytes = st.write_bytes;
    r.devices = s.s->devices().size();
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<control::SessionReport> ClientDaemon::sessions() {
  std::lock_guard l(mu_);
  return session_reports(false, "");
}

Result<control::SessionReport> ClientDaemon::session(const std::string& name) {
  std::lock_guard l(mu_);
  auto r = session_reports(true, name);
  if (r.empty()) return errc(ENOENT);
  return std::move(r.front());
}

json ClientDaemon::session_list(const json& req, bool one) {
  const std::string only = one ? string_arg(req, "session") : "";
  auto reports = session_reports(one, only);
  if (one && reports.empty()) return err(ENOENT, "no session " + only);
  return control::session_listing(reports);
}

json ClientDaemon::session_close(const json& req) {
  const std::string n = string_arg(req, "session");
  OpenSession* s = find_session(n);
  if (s == nullptr) return err(ENOENT, "no session " + n);
  // A failover device through this session goes, on both of its sessions.
  std::vector<std::string> fo;
  for (auto& [name, f] : failover_)
    if (f.sessions[0] == n || f.sessions[1] == n) fo.push_back(name);
  for (auto& name : fo) {
    stop_export(name);
    (void)ublk_stop(name);
    (void)failover_unmap(name, UnmapMode::force);
  }
  s = find_session(n);
  if (s == nullptr) return {{"ok", true}};
  for (auto& d : s->s->devices()) {
    stop_export(d->name());
    (void)ublk_stop(d->name());
    (void)s->s->unmap(d->name(), UnmapMode::force);
  }
  s->io_buf.reset();
  sessions_.erase(n);
  return {{"ok", true}};
}

json ClientDaemon::policy_set(const json& req) {
  OpenSession* s = find_session(string_arg(req, "session"));
  if (s == nullptr) return err(ENOENT, "no session " + string_arg(req, "session"));
  auto p = ibtrs::parse_mp_policy(string_arg(req, "policy"));
  if (!p) return err(EINVAL, "policy: round-robin, min-inflight or min-latency");
  auto st = s->s->transport().set_policy(*p);
  return st.ok() ? json{{"ok", true}} : err(st.error(), "policy");
}

json ClientDaemon::path_list(const json& req) {
  const std::string only = req.contains("session") ? string_arg(req, "session") : "";
  std::vector<control::PathReport> paths;
  for (auto& [n, s] : sessions_) {
    if (!only.empty() && n != only) continue;
    path_reports(n, s, "", paths);
  }
  if (!only.empty() && find_session(only) == nullptr) return err(ENOENT, "no session " + only);
  return control::path_listing(paths);
}

json ClientDaemon::path_op(const json& req, const std::string& op) {
  const std::string n = string_arg(req, "session");
  OpenSession* s = find_session(n);
  if (s == nullptr) return err(ENOENT, "no session " + n);
  const std::string path = string_arg(req, "path");
  auto& t = s->s->transport();
  Status st;
  if (op == "add") {
    auto spec = ibtrs::PathSpec::parse(path);
    if (!spec.ok()) return err(EINVAL, "path '" + path + "': " + spec.error().message());
    std::string why;
    if (st = ibtrs::check_gid_path(*spec, &why); !st.ok()) return err(st.error().value(), "path '" + path + "': " + why);
    st = t.add_path(*spec);
    if (st.error() == std::errc::file_exists)
      return err(EEXIST, "session " + n + " has path " + spec->name() + " already");
  } else {
    // A path is named as the kernel names it ("src@dst"), or by what was given when it was added.
    std::string name = path;
    if (auto spec = ibtrs::PathSpec::parse(path); spec.ok()) {
      for (auto& p : t.paths())
        if (p.name == spec->name()) name = p.name;
    }
    if (op == "delete") st = t.remove_path(name);
    else if (op == "disconnect") st = t.disconnect_path(name);
    else st = t.reconnect_path(name);
  }
  return st.ok() ? json{{"ok", true}} : err(st.error(), op + " path " + path);
}

bool ClientDaemon::stop_export(const std::string& dev) {
  auto it = exports_.find(dev);
  if (it == exports_.end()) return false;
  it->second.server->stop();
  exports_.erase(it);
  return true;
}

std::string ClientDaemon::ublk_path(const std::string& dev) const {
  auto it = ublk_.find(dev);
  return it == ublk_.end() ? "" : it->second.dev->block_path();
}

std::string ClientDaemon::export_addresses(const std::string& dev) const {
  auto it = exports_.find(dev);
  if (it == exports_.end()) return "";
  std::string out;
  for (auto& l : it->second.server->listening()) out += (out.empty() ? "" : " ") + l.to_string();
  return out;
}

// nbd_export {device, unix?: PATH, mode?: "0660", group?: NAME|GID, tcp?: "HOST:PORT",
// insecure?, name?, remote?, tls_psk?: FILE, tls_cert?: FILE, tls_key?: FILE, tls_ca?: FILE}:
// serves a mapped device over NBD, whose plain protocol authenticates nobody, so every way in is
// explicit. The unix socket is owner-only unless `mode` / `group` say who else may connect.
// With TLS (a PSK file of "identity:hexkey" lines, or a certificate and key, plus a CA to
// require client certificates) every client must complete STARTTLS with those credentials
// before it sees the export (nbdkit's --tls=require). Without TLS, tcp needs `insecure`: any
// local user can connect to a loopback port and read and write the device; beyond loopback it
// needs `remote` as well.
json ClientDaemon::nbd_export(const json& req) {
  const std::string dev = string_arg(req, "device");
  auto [s, d] = find_device(dev);
  if (d == nullptr) return err(ENOENT, "device " + dev + " is not mapped");
  nbd::NbdServerOptions o;
  const bool psk = req.contains("tls_psk"), cert = req.contains("tls_cert") || req.contains("tls_key");
  if (psk && cert) return err(EINVAL, "tls_psk or tls_cert/tls_key, not both");
  if (req.contains("tls_ca") && !cert) return err(EINVAL, "tls_ca goes with tls_cert and tls_key");
  if (psk || cert) {
    tls::Config tc;
    tc.role = tls::Role::server;
    if (psk) {
      const std::string f = string_arg(req, "tls_psk");
      auto entries = tls::read_psk_entries(f);
      if (!entries.ok())
        return err(entries.error(), "tls_psk " + f +
                                        (entries.error() == std::errc::permission_denied
                                             ? ": readable by others (chmod 600)"
                                             : ": lines of identity:hexkey (32..64-byte keys), each identity once"));
      auto table = std::make_shared<std::vector<tls::Psk>>(std::move(*entries));
      tc.psk_lookup = [table](std::string_view id) -> std::optional<std::vector<std::byte>> {
        for (const auto& e : *table)
          if (e.identity == id) return e.key;
        return std::nullopt;
      };
    } else {
      if (!req.contains("tls_cert") || !req.contains("tls_key")) return err(EINVAL, "tls_cert and tls_key go together");
      tc.cert_file = string_arg(req, "tls_cert");
      tc.key_file = string_arg(req, "tls_key");
      if (req.contains("tls_ca")) tc.ca_file = string_arg(req, "tls_ca");
    }
    auto ctx = tls::Context::create(std::move(tc));
    if (!ctx.ok()) return err(ctx.error(), "TLS credentials: unreadable or mismatched certificate, key or CA file");
    o.tls = std::move(*ctx);
    o.tls_required = true;
  }
  if (req.contains("unix")) {
    nbd::ListenSpec l = nbd::ListenSpec::unix_socket(string_arg(req, "unix"));
    if (req.contains("mode")) {
      const std::string m = string_arg(req, "mode");
      unsigned v = 0;
      auto [p, ec] = std::from_chars(m.data(), m.data() + m.size(), v, 8);
      if (m.empty() || ec != std::errc() || p != m.data() + m.size() || v > 0777)
        return err(EINVAL, "mode '" + m + "': octal permission bits, e.g. 0660");
      l.mode = static_cast<mode_t>(v);
    }
    if (req.contains("group")) {
      auto g = group_id(string_arg(req, "group"));
      if (!g) return err(EINVAL, "group '" + string_arg(req, "group") + "': no such group");
      l.group = *g;
    }
    o.listen.push_back(std::move(l));
  } else if (req.contains("mode") || req.contains("group")) {
    return err(EINVAL, "mode and group are for the unix socket");
  }
  if (req.contains("tcp")) {
    const std::string a = string_arg(req, "tcp");
    auto l = nbd::ListenSpec::parse_tcp(a.empty() ? "127.0.0.1:0" : a);
    if (!l.ok()) return err(EINVAL, "tcp '" + a + "': HOST:PORT with a numeric address");
    if (!o.tls && !req.value("insecure", false))
      return err(EPERM, "tcp " + l->to_string() + ": NBD over tcp without TLS authenticates nobody: " +
                            "anyone who can connect (any local user, on loopback) reads and writes " + dev +
                            "; give tls-psk FILE (or tls-cert/tls-key), or pass insecure to serve it in the " +
                            "clear anyway, or use a unix socket");
    if (!o.tls && !l->is_local() && !req.value("remote", false))
      return err(EPERM, "tcp " + l->to_string() + " is not a loopback address; NBD has no " +
                            "authentication: pass remote to listen there anyway");
    o.listen.push_back(*l);
  }
  if (o.listen.empty()) return err(EINVAL, "nothing to listen on: unix PATH and/or tcp HOST:PORT");
  if (exports_.count(dev)) return err(EEXIST, "device " + dev + " is already exported (unexport it first)");
  const std::string name = req.contains("name") ? string_arg(req, "name") : dev;
  if (name.size() > 4096 || name.find('\0') != std::string::npos) return err(EINVAL, "bad export name");
  // Request memory registered with the session (zero copy between the NBD socket and the
  // transport) and the loop reaping its own completions; without the memory (registration
  // failed), the copy path through the device's bounce buffers.
  std::shared_ptr<nbd::DeviceExport> ex;
  if (auto e = nbd::DeviceExport::create(d, *s->s); e.ok()) {
    ex = std::move(*e);
  } else {
    std::fprintf(stderr, "ibnbd-client: %s: nbd request memory: %s; copying through bounce buffers\n", dev.c_str(),
                 e.error().message().c_str());
    ex = std::make_shared<nbd::DeviceExport>(d);
  }
  o.exports.emplace_back(name, std::move(ex));
  o.log = [dev](const std::string& m) { std::fprintf(stderr, "ibnbd-client: %s: %s\n", dev.c_str(), m.c_str()); };
  const bool with_tls = o.tls != nullptr;
  auto srv = nbd::NbdServer::start(std::move(o));
  if (!srv.ok()) return err(srv.error(), "nbd export of " + dev);
  exports_[dev] = NbdExport{name, std::move(*srv), with_tls};
  json rsp = nbd_list(json{{"device", dev}});
  for (auto& l : exports_[dev].server->listening()) {
    if (l.kind == nbd::ListenSpec::Kind::unix_socket) rsp["unix"] = l.path;
    else {
      rsp["tcp"] = l.to_string().substr(4);
      rsp["port"] = l.port;
    }
  }
  return rsp;
}

json ClientDaemon::nbd_unexport(const json& req) {
  const std::string dev = string_arg(req, "device");
  if (!stop_export(dev)) return err(ENOENT, "device " + dev + " is not exported");
  return {{"ok", true}};
}

// One row per export, with the NBD URIs a client would use (nbdinfo, qemu-img, fio uri=).
json ClientDaemon::nbd_list(const json& req) {
  const std::string only = req.contains("device") ? string_arg(req, "device") : "";
  json rows = json::array();
  for (auto& [dev, e] : exports_) {
    if (!only.empty() && dev != only) continue;
    std::string unix_path, tcp;
    json uris = json::array();
    for (auto& l : e.server->listening()) {
      if (l.kind == nbd::ListenSpec::Kind::unix_socket) {
        unix_path = l.path;
        // TLS: libnbd's nbds schemes (the client adds its tls-psk-file= or certificates).
        uris.push_back((e.tls ? "nbds+unix:///" : "nbd+unix:///") + e.name + "?socket=" + l.path);
      } else {
        tcp = l.to_string().substr(4);
        uris.push_back((e.tls ? "nbds://" : "nbd://") + tcp + "/" + e.name);
      }
    }
    const auto st = e.server->stats();
    rows.push_back(json::array({dev, e.name, unix_path, tcp, st.connections, st.requests, st.errors,
                                bytes_cell(st.read_bytes), bytes_cell(st.write_bytes), uris}));
  }
  if (!only.empty() && rows.empty()) return err(ENOENT, "device " + only + " is not exported");
  return {{"ok", true},
          {"columns", json::array({column("device"), column("name"), column("unix"), column("tcp"),
                                   column("connections", true), column("requests", true), column("errors", true),
                                   column("read_bytes", true), column("write_bytes", true), column("uris")})},
          {"rows", rows}};
}

}  // namespace ibnbd
