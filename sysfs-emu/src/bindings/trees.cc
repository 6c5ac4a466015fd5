// The four trees: each file is a read that formats a daemon answer or a write that sends one
// command. Names of sessions, paths and devices are escaped as directory entries (parse.h).
#include "sysfs/trees.h"

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "sysfs/format.h"
#include "sysfs/parse.h"

namespace sysfs {

namespace {

using nlohmann::json;
using ibtrs::errc;

// ---- talking to the daemon ----

std::string line(std::string s) { return s + "\n"; }
std::string str(const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

using ibnbd::control::DeviceReport;
using ibnbd::control::ExportedDeviceReport;
using ibnbd::control::HolderReport;
using ibnbd::control::PathReport;
using ibnbd::control::RefusalReport;
using ibnbd::control::SessionReport;

// The backend, the typed commands and the log the tree's files share (copied into each file's
// callbacks). Each tree fills every typed command of its side, from the binding or over the
// backend's JSON: the client tree `device` to `max_reconnect_attempts`, the server tree `paths`
// and the `server_` ones.
struct Daemon {
  Backend backend;
  Log log;
  decltype(ClientBinding::device) device;
  decltype(ClientBinding::devices) devices;
  decltype(ClientBinding::sessions) sessions;
  decltype(ClientBinding::session) session;
  decltype(ClientBinding::paths) paths;
  decltype(ClientBinding::max_reconnect_attempts) max_reconnect_attempts;
  decltype(ServerBinding::sessions) server_sessions;
  decltype(ServerBinding::devices) server_devices;
  decltype(ServerBinding::refusals) server_refusals;
  json operator()(const json& req) const { return backend(req); }
};

Result<json> call(const Backend& backend, const json& req) {
  json r = backend(req);
  if (r.is_object() && r.value("ok", false)) return r;
  int e = r.is_object() ? r.value("errno", EIO) : EIO;
  return errc(e > 0 ? e : EIO);
}

// A write's command. The writer sees only the errno; the daemon's reason goes to the log.
Status act(const Daemon& b, const json& req) {
  json r = b(req);
  if (r.is_object() && r.value("ok", false)) return {};
  const int e = r.is_object() ? r.value("errno", EIO) : EIO;
  if (b.log) {
    const json why = r.is_object() ? r.value("error", json()) : json();
    b.log("sysfs: " + str(req.value("cmd", json("?"))) + ": " + (why.is_string() ? why.get<std::string>() : std::strerror(e > 0 ? e : EIO)));
  }
  return errc(e > 0 ? e : EIO);
}

ReadFn text(std::string s) {
  return [s = std::move(s)]() -> Result<std::string> { return s; };
}

// An action file: write-only in effect, reading shows how to use it (as the kernel's do).
NodePtr action(std::string usage, WriteFn w) { return Node::attr(0644, text(std::move(usage)), std::move(w)); }

// ---- paths (both sides answer path_stats alike) ----

Result<PathReport> path_info(const Daemon& b, const std::string& sess, const std::string& path) {
  BASE_ASSIGN_OR_RETURN(std::vector<PathReport> ps, b.paths(sess, path));
  if (ps.empty()) return errc(ENOENT);
  return std::move(ps.front());
}

// hca_port: an HCA's port; for the software fabric (no HCA, hca_name "tcp") the TCP port the
// path goes to.
std::string hca_port(const PathReport& p) {
  if (p.fabric == "tcp") return line(std::to_string(p.dst_port));
  return line(std::to_string(p.hca_port));
}

Result<std::vector<std::string>> path_names(const Daemon& b, const std::string& sess) {
  BASE_ASSIGN_OR_RETURN(std::vector<PathReport> ps, b.paths(sess, ""));
  std::vector<std::string> out;
  for (auto& p : ps) out.push_back(escape_name(p.name));
  return out;
}

using PathInfo = std::function<Result<PathReport>()>;

// A read-only file showing f(the path's report).
NodePtr path_field(const PathInfo& info, std::function<std::string(const PathReport&)> f) {
  return Node::read_only([info, f = std::move(f)]() -> Result<std::string> {
    BASE_ASSIGN_OR_RETURN(PathReport p, info());
    return f(p);
  });
}

// The path's authentication (ours; the kernel's RTRS has none): "authenticated HOST", with
// " bidirectional" when the server proved its key too, or "none" / "pending" / "failed".
std::string auth_line(const PathReport& p) {
  if (p.auth != "authenticated") return line(p.auth);
  return line(p.auth + " " + p.auth_host + (p.auth_bidirectional ? " bidirectional" : ""));
}

// hca_name, hca_port, src_addr, dst_addr, auth, tls: the same files on both sides. tls (ours):
// "-" without TLS, else where the record layer runs (kTLS or user) and the cipher.
void add_address_files(Node& d, const PathInfo& info) {
  d.add("auth", path_field(info, auth_line));
  d.add("tls", path_field(info, [](const PathReport& p) { return line(p.tls); }));
  d.add("hca_name", path_field(info, [](const PathReport& p) { return line(p.hca_name); }));
  d.add("hca_port", path_field(info, hca_port));
  d.add("src_addr", path_field(info, [](const PathReport& p) { return line(p.src_host); }));
  d.add("dst_addr", path_field(info, [](const PathReport& p) { return line(p.dst_host); }));
}

using Formatter = std::string (*)(const PathStatsSnapshot&);
struct StatFile {
  const char* name;
  Formatter format;
};

using ResetFn = std::function<Status(const char* group)>;

// A stats file: shows show(the path's report) and resets its counters (`group`) when written.
NodePtr stat_file(const PathInfo& info, const ResetFn& reset, std::string group,
                  std::function<std::string(const PathReport&)> show) {
  return Node::attr(
      0644,
      [info, show = std::move(show)]() -> Result<std::string> {
        BASE_ASSIGN_OR_RETURN(PathReport p, info());
        return show(p);
      },
      [reset, group = std::move(group)](std::string_view t) -> Status {
        BASE_TRY(parse_reset(t));
        return reset(group.c_str());
      });
}

// stats/: each file prints its counters and resets them when written (reset_all: every group).
std::shared_ptr<Node> stats_dir(const PathInfo& info, const ResetFn& reset, std::initializer_list<StatFile> files) {
  auto d = Node::dir();
  d->add("reset_all", Node::attr(0644, text("Usage: echo 1 > reset_all (0 too) resets all the statistics\n"),
                                 [reset](std::string_view t) -> Status {
                                   BASE_TRY(parse_reset(t));
                                   return reset("all");
                                 }));
  for (const StatFile& f : files)
    d->add(f.name, stat_file(info, reset, f.name, [fmt = f.format](const PathReport& p) { return fmt(p.stats); }));
  return d;
}

NodePtr client_path_dir(const Daemon& b, const std::string& sess, const std::string& path) {
  PathInfo info = [b, sess, path] { return path_info(b, sess, path); };
  auto path_cmd = [b, sess, path](const char* cmd) {
    return [b, sess, path, cmd](std::string_view t) -> Status {
      BASE_TRY(parse_one(t));
      return act(b, {{"cmd", cmd}, {"session", sess}, {"path", path}});
    };
  };
  auto d = Node::dir();
  // The seed's two states: connected, or disconnected for every other state of the path.
  d->add("state", path_field(info, [](const PathReport& p) {
    return std::string(p.state == "connected" ? "connected\n" : "disconnected\n");
  }));
  d->add("reconnect", action("Usage: echo 1 > reconnect\n", path_cmd("path_reconnect")));
  d->add("disconnect", action("Usage: echo 1 > disconnect\n", path_cmd("path_disconnect")));
  d->add("remove_path", action("Usage: echo 1 > remove_path\n", path_cmd("path_delete")));
  add_address_files(*d, info);
  d->add("cur_latency", path_field(info, [](const PathReport& p) {
    return std::to_string(p.latency ? p.latency->count() : 0) + " ns\n";
  }));
  auto reset = [b, sess, path](const char* group) {
    return act(b, {{"cmd", "path_reset_stats"}, {"session", sess}, {"path", path}, {"stats", group}});
  };
  std::shared_ptr<Node> stats = stats_dir(info, reset,
                                          {{"rdma", format_client_rdma},
                                           {"rdma_lat", format_rdma_lat},
                                           {"wc_completion", format_client_wc_completion},
                                           {"sg_entries", format_sg_entries},
                                           {"cpu_migration", format_cpu_migration},
                                           {"reconnects", format_reconnects}});
  // Ours (the kernel's RTRS has no failover fence); reset_all resets it too (the daemon's reset
  // of "all" includes the fence's counters).
  stats->add("fence", stat_file(info, reset, "fence", [](const PathReport& p) { return format_fence(p.fence); }));
  d->add("stats", stats);
  return d;
}

// ---- ibtrs-client/<session>/ ----

NodePtr client_session_dir(const Daemon& b, const std::string& sess) {
  auto d = Node::dir();
  d->add("add_path",
         action("Usage: echo [<source addr>@]<destination addr> > add_path\n\n"
                "*addr ::= [ ip:<ipv4|ipv6> | gid:<gid> | tcp:<host>[:<port>] | rdma:<host>[:<port>] ]\n",
                [b, sess](std::string_view t) -> Status {
                  BASE_ASSIGN_OR_RETURN(std::string path, parse_path(t));
                  return act(b, {{"cmd", "path_add"}, {"session", sess}, {"path", path}});
                }));
  d->add("max_reconnect_attempts",
         Node::attr(
             0644,
             [b, sess]() -> Result<std::string> {
               BASE_ASSIGN_OR_RETURN(int32_t v, b.max_reconnect_attempts(sess));
               return line(std::to_string(v));
             },
             [b, sess](std::string_view t) -> Status {
               BASE_ASSIGN_OR_RETURN(int32_t v, ibtrs::parse_max_reconnect_attempts(t));
               return act(b, {{"cmd", "session_max_reconnect_attempts"}, {"session", sess}, {"value", v}});
             }));
  // mp_policy is the seed's name; mpath_policy the kernel's file: one node under both names.
  auto policy = Node::attr(
      0644,
      [b, sess]() -> Result<std::string> {
        BASE_ASSIGN_OR_RETURN(SessionReport r, b.session(sess));
        auto p = ibtrs::parse_mp_policy(r.mp);
        if (!p) return errc(EIO);
        return format_policy(*p);
      },
      [b, sess](std::string_view t) -> Status {
        BASE_ASSIGN_OR_RETURN(ibtrs::MpPolicy p, ibtrs::parse_mp_policy(t));
        return act(b, {{"cmd", "session_policy"}, {"session", sess}, {"policy", std::string(ibtrs::to_string(p))}});
      });
  d->add("mp_policy", policy);
  d->add("mpath_policy", policy);
  d->add("paths", Node::dynamic_dir([b, sess] { return path_names(b, sess); },
                                    [b, sess](const std::string& n) -> Result<NodePtr> {
                                      return client_path_dir(b, sess, unescape_name(n));
                                    }));
  return d;
}

// The escaped names of a listing's reports (`name` of each).
template <typename Report, typename Name>
Result<std::vector<std::string>> listing_names(const Result<std::vector<Report>>& reports, Name name) {
  if (!reports) return reports.error();
  std::vector<std::string> out;
  for (const Report& r : *reports) out.push_back(escape_name(r.*name));
  return out;
}

// ---- ibnbd-client/ctl/ ----

NodePtr client_device_dir(const Daemon& b, const std::string& dev) {
  using Report = DeviceReport;
  auto field = [b, dev](std::string (*show)(const Report&)) {
    return Node::read_only([b, dev, show]() -> Result<std::string> {
      BASE_ASSIGN_OR_RETURN(Report r, b.device(dev));
      return line(show(r));
    });
  };
  auto d = Node::dir();
  d->add("unmap_device", action("Usage: echo <normal|force> > unmap_device\n", [b, dev](std::string_view t) -> Status {
           BASE_ASSIGN_OR_RETURN(bool force, parse_unmap_mode(t));
           return act(b, {{"cmd", "device_unmap"}, {"device", dev}, {"force", force}});
         }));
  d->add("remap_device", action("Usage: echo 1 > remap_device\n", [b, dev](std::string_view t) -> Status {
           BASE_TRY(parse_one(t));
           return act(b, {{"cmd", "device_remap"}, {"device", dev}});
         }));
  // The kernel sets the gendisk's capacity to the written sectors; here the device has no local
  // capacity of its own: the number is checked and the size is taken anew from the server.
  d->add("resize", action("Usage: echo <SECTORS> > resize\n", [b, dev](std::string_view t) -> Status {
           BASE_TRY(parse_sectors(t));
           return act(b, {{"cmd", "device_resize"}, {"device", dev}});
         }));
  d->add("state", field([](const Report& r) { return r.state; }));
  d->add("session", field([](const Report& r) { return r.session; }));
  d->add("access_mode", field([](const Report& r) { return r.access_mode; }));
  // The gendisk's /sys/block/<dev>/size: 512-byte sectors, the size the server last gave (at
  // OPEN, or in a resize notice).
  d->add("size", field([](const Report& r) { return std::to_string(r.size / 512); }));
  // Not the kernel's: a device mapped with a standby server (gateway failover). session is the
  // active one; standby is "-" for a device of one session.
  d->add("standby", field([](const Report& r) { return r.standby; }));
  d->add("standby_state", field([](const Report& r) { return r.standby_state; }));
  d->add("failovers", field([](const Report& r) { return std::to_string(r.failovers); }));
  d->add("failover", action("Usage: echo 1 > failover\n", [b, dev](std::string_view t) -> Status {
           BASE_TRY(parse_one(t));
           return act(b, {{"cmd", "device_failover"}, {"device", dev}});
         }));
  d->add("mapping_path", Node::read_only(text(line(dev))));
  // The block device map_device made (the kernel's devices/<name> is a link into
  // /sys/block/rnbdN/): its /sys/block name, "ublkb0"; "-" for a device mapped in the library
  // only (ibnbd device map without --ublk).
  d->add("block", field([](const Report& r) {
           return r.ublk.empty() ? std::string("-") : r.ublk.substr(r.ublk.rfind('/') + 1);
         }));
  return d;
}

NodePtr ibnbd_client_dir(const Daemon& b) {
  auto ctl = Node::dir();
  ctl->add("map_device",
           action("Usage: echo \"sessname=<name> path=<[srcaddr@]dstaddr> [path=<[srcaddr@]dstaddr>] "
                  "device_path=<name on the server> [dest_port=<port>] [access_mode=<ro|rw|migration>] "
                  "[nr_poll_queues=<n>]\" > map_device\n\n"
                  "addr ::= [ ip:<ipv4|ipv6> | gid:<gid> | tcp:<host>[:<port>] | rdma:<host>[:<port>] ]\n",
                  [b](std::string_view t) -> Status {
                    BASE_ASSIGN_OR_RETURN(MapDeviceOptions o, parse_map_device(t));
                    // The kernel's poll queues (blk-mq HCTX_TYPE_POLL) have no counterpart in a
                    // ublk device: refused rather than taken and ignored. 0 asks for none.
                    if (o.nr_poll_queues.value_or(0) != 0) {
                      if (b.log) b.log("sysfs: map_device: nr_poll_queues=" + std::to_string(*o.nr_poll_queues) +
                                       ": a ublk device has no poll queues (0 or none)");
                      return errc(EOPNOTSUPP);
                    }
                    // As the kernel makes /dev/rnbdN: the daemon serves it as /dev/ublkbN, or
                    // refuses (ENODEV without ublk_drv) and maps nothing.
                    return act(b, map_device_request(o));
                  }));
  ctl->add("devices", Node::dynamic_dir([b] { return listing_names(b.devices(), &DeviceReport::device); },
                                        [b](const std::string& n) -> Result<NodePtr> {
                                          return client_device_dir(b, unescape_name(n));
                                        }));
  auto d = Node::dir();
  d->add("ctl", ctl);
  return d;
}

// ---- server side ----

NodePtr server_path_dir(const Daemon& b, const std::string& sess, const std::string& path) {
  PathInfo info = [b, sess, path] { return path_info(b, sess, path); };
  auto d = Node::dir();
  d->add("disconnect", action("Usage: echo 1 > disconnect\n", [b, sess, path](std::string_view t) -> Status {
           BASE_TRY(parse_one(t));
           return act(b, {{"cmd", "disconnect_path"}, {"session", sess}, {"path", path}});
         }));
  add_address_files(*d, info);
  auto reset = [b, sess, path](const char* group) {
    return act(b, {{"cmd", "reset_stats"}, {"session", sess}, {"path", path}, {"stats", group}});
  };
  d->add("stats", stats_dir(info, reset, {{"rdma", format_server_rdma}, {"wc_completion", format_server_wc_completion}}));
  return d;
}

// ctl/: the server's refusals (ibtrs/refusals.h), one read-only file per reason with its count,
// and reset_refusals (echo 1) to zero them.
NodePtr ibtrs_server_ctl(const Daemon& b) {
  auto count_of = [b](const std::string& reason) -> Result<uint64_t> {
    BASE_ASSIGN_OR_RETURN(std::vector<RefusalReport> rs, b.server_refusals());
    for (const RefusalReport& r : rs)
      if (r.reason == reason) return r.count;
    return errc(ENOENT);
  };
  auto d = Node::dir();
  d->add("refusals", Node::dynamic_dir([b] { return listing_names(b.server_refusals(), &RefusalReport::reason); },
                                       [count_of](const std::string& n) -> Result<NodePtr> {
                                         const std::string reason = unescape_name(n);
                                         return NodePtr(Node::read_only([count_of, reason]() -> Result<std::string> {
                                           BASE_ASSIGN_OR_RETURN(uint64_t count, count_of(reason));
                                           return line(std::to_string(count));
                                         }));
                                       }));
  d->add("reset_refusals", action("Usage: echo 1 > reset_refusals (0 too) zeroes every refusals/ count\n",
                                  [b](std::string_view t) -> Status {
                                    BASE_TRY(parse_reset(t));
                                    return act(b, {{"cmd", "reset_refusals"}});
                                  }));
  return d;
}

// The sessions, and ctl/ beside them (a session named "ctl" is shadowed here; the CLI lists it).
NodePtr ibtrs_server_dir(const Daemon& b) {
  auto sessions = [b]() -> Result<std::vector<std::string>> {
    BASE_ASSIGN_OR_RETURN(std::vector<std::string> n, b.server_sessions());
    for (std::string& s : n) s = escape_name(s);
    std::erase(n, std::string("ctl"));
    n.insert(n.begin(), "ctl");
    return n;
  };
  NodePtr ctl = ibtrs_server_ctl(b);
  return Node::dynamic_dir(sessions, [b, ctl](const std::string& n) -> Result<NodePtr> {
    if (n == "ctl") return ctl;
    const std::string sess = unescape_name(n);
    auto d = Node::dir();
    d->add("paths", Node::dynamic_dir([b, sess] { return path_names(b, sess); },
                                      [b, sess](const std::string& p) -> Result<NodePtr> {
                                        return server_path_dir(b, sess, unescape_name(p));
                                      }));
    return NodePtr(d);
  });
}

// The holders of one exported device (the first device of that name, as listed).
Result<std::vector<HolderReport>> device_holders(const Daemon& b, const std::string& dev) {
  BASE_ASSIGN_OR_RETURN(std::vector<ExportedDeviceReport> ds, b.server_devices());
  for (ExportedDeviceReport& d : ds)
    if (d.name == dev) return std::move(d.holders);
  return errc(ENOENT);
}

Result<HolderReport> device_holder(const Daemon& b, const std::string& dev, const std::string& sess) {
  BASE_ASSIGN_OR_RETURN(std::vector<HolderReport> hs, device_holders(b, dev));
  for (HolderReport& h : hs)
    if (h.session == sess) return std::move(h);
  return errc(ENOENT);
}

NodePtr server_holder_dir(const Daemon& b, const std::string& dev, const std::string& sess) {
  auto mode = [b, dev, sess]() -> Result<std::string> {
    BASE_ASSIGN_OR_RETURN(HolderReport h, device_holder(b, dev, sess));
    return std::move(h.access_mode);
  };
  auto d = Node::dir();
  d->add("read_only", Node::read_only([mode]() -> Result<std::string> {
           BASE_ASSIGN_OR_RETURN(std::string m, mode());
           return std::string(m == "ro" ? "1\n" : "0\n");
         }));
  d->add("access_mode", Node::read_only([mode]() -> Result<std::string> {
           BASE_ASSIGN_OR_RETURN(std::string m, mode());
           return line(m);
         }));
  d->add("mapping_path", Node::read_only(text(line(dev))));
  d->add("force_close", action("Usage: echo 1 > force_close\n", [b, dev, sess](std::string_view t) -> Status {
           BASE_TRY(parse_one(t));
           return act(b, {{"cmd", "force_close"}, {"device", dev}, {"session", sess}});
         }));
  return d;
}

NodePtr ibnbd_server_dir(const Daemon& b) {
  auto devices = [b] { return listing_names(b.server_devices(), &ExportedDeviceReport::name); };
  auto dev_dir = [b](const std::string& n) -> Result<NodePtr> {
    const std::string dev = unescape_name(n);
    auto holders = [b, dev] { return listing_names(device_holders(b, dev), &HolderReport::session); };
    auto d = Node::dir();
    d->add("sessions", Node::dynamic_dir(holders, [b, dev](const std::string& s) -> Result<NodePtr> {
             return server_holder_dir(b, dev, unescape_name(s));
           }));
    return NodePtr(d);
  };
  auto ctl = Node::dir();
  ctl->add("devices", Node::dynamic_dir(devices, dev_dir));
  auto d = Node::dir();
  d->add("ctl", ctl);
  return d;
}

}  // namespace

NodePtr client_tree(Backend backend, Log log) {
  ClientBinding binding;
  binding.backend = std::move(backend);
  binding.log = std::move(log);
  return client_tree(std::move(binding));
}

namespace {

// A listing command's reports over the backend's JSON, read back by `from` (a wrong shape: EIO).
template <typename Report>
Result<std::vector<Report>> listing_over(const Backend& backend, const json& req,
                                         Result<std::vector<Report>> (*from)(const json&)) {
  BASE_ASSIGN_OR_RETURN(json r, call(backend, req));
  auto reports = from(r);
  if (!reports) return errc(EIO);
  return reports;
}

// The one report of a show command (none: the wrong shape, EIO).
template <typename Report>
Result<Report> one_of(Result<std::vector<Report>> reports) {
  if (!reports) return reports.error();
  if (reports->empty()) return errc(EIO);
  return std::move(reports->front());
}

// path_stats over the backend's JSON, either daemon's (the path named only when one is asked).
decltype(Daemon::paths) paths_over(const Backend& backend) {
  return [backend](const std::string& sess, const std::string& path) {
    json req{{"cmd", "path_stats"}, {"session", sess}};
    if (!path.empty()) req["path"] = path;
    return listing_over(backend, req, &ibnbd::control::paths_from_stats);
  };
}

}  // namespace

NodePtr client_tree(ClientBinding binding) {
  Daemon b;
  b.backend = std::move(binding.backend);
  b.log = std::move(binding.log);
  b.device = std::move(binding.device);
  b.devices = std::move(binding.devices);
  b.sessions = std::move(binding.sessions);
  b.session = std::move(binding.session);
  b.paths = std::move(binding.paths);
  b.max_reconnect_attempts = std::move(binding.max_reconnect_attempts);
  // Whatever the daemon did not bind typed is read from its JSON answers.
  const Backend& backend = b.backend;
  if (!b.device)
    b.device = [backend](const std::string& name) {
      return one_of(listing_over(backend, {{"cmd", "device_show"}, {"device", name}},
                                 &ibnbd::control::devices_from_listing));
    };
  if (!b.devices)
    b.devices = [backend] { return listing_over(backend, {{"cmd", "device_list"}}, &ibnbd::control::devices_from_listing); };
  if (!b.sessions)
    b.sessions = [backend] {
      return listing_over(backend, {{"cmd", "session_list"}}, &ibnbd::control::sessions_from_listing);
    };
  if (!b.session)
    b.session = [backend](const std::string& name) {
      return one_of(listing_over(backend, {{"cmd", "session_show"}, {"session", name}},
                                 &ibnbd::control::sessions_from_listing));
    };
  if (!b.paths) b.paths = paths_over(backend);
  if (!b.max_reconnect_attempts)
    b.max_reconnect_attempts = [backend](const std::string& sess) -> Result<int32_t> {
      BASE_ASSIGN_OR_RETURN(json r, call(backend, {{"cmd", "session_max_reconnect_attempts"}, {"session", sess}}));
      // One number, -1..9999 as the daemon writes it; anything else is the wrong shape (EIO).
      const auto v = r.find("max_reconnect_attempts");
      if (v == r.end() || !v->is_number_integer()) return errc(EIO);
      if (v->is_number_unsigned() ? v->get<uint64_t>() > uint64_t(INT32_MAX)
                                  : v->get<int64_t>() < INT32_MIN || v->get<int64_t>() > INT32_MAX)
        return errc(EIO);
      return static_cast<int32_t>(v->get<int64_t>());
    };
  auto root = Node::dir();
  root->add("ibtrs-client", Node::dynamic_dir([b] { return listing_names(b.sessions(), &SessionReport::name); },
                                              [b](const std::string& n) -> Result<NodePtr> {
                                                return client_session_dir(b, unescape_name(n));
                                              }));
  root->add("ibnbd-client", ibnbd_client_dir(b));
  return root;
}

NodePtr server_tree(Backend backend, Log log) {
  ServerBinding binding;
  binding.backend = std::move(backend);
  binding.log = std::move(log);
  return server_tree(std::move(binding));
}

NodePtr server_tree(ServerBinding binding) {
  Daemon b;
  b.backend = std::move(binding.backend);
  b.log = std::move(binding.log);
  b.paths = std::move(binding.paths);
  b.server_sessions = std::move(binding.sessions);
  b.server_devices = std::move(binding.devices);
  b.server_refusals = std::move(binding.refusals);
  const Backend& backend = b.backend;
  if (!b.paths) b.paths = paths_over(backend);
  if (!b.server_sessions)
    b.server_sessions = [backend]() -> Result<std::vector<std::string>> {
      BASE_ASSIGN_OR_RETURN(json r, call(backend, {{"cmd", "sessions"}}));
      std::vector<std::string> out;
      for (auto& e : r.at("sessions")) out.push_back(e.at("name").get<std::string>());
      return out;
    };
  if (!b.server_devices)
    b.server_devices = [backend] {
      return listing_over(backend, {{"cmd", "devices"}}, &ibnbd::control::devices_from_answer);
    };
  if (!b.server_refusals)
    b.server_refusals = [backend] {
      return listing_over(backend, {{"cmd", "refusals"}}, &ibnbd::control::refusals_from_answer);
    };
  auto root = Node::dir();
  root->add("ibtrs-server", ibtrs_server_dir(b));
  root->add("ibnbd-server", ibnbd_server_dir(b));
  return root;
}

}  // namespace sysfs
