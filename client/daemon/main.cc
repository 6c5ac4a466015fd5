// ibnbd-client: holds IBNBD sessions and mapped remote devices, controlled by the `ibnbd` CLI
// over a unix socket. Runs until SIGTERM/SIGINT, then deletes its ublk devices and unmaps
// everything. At start it first takes back the ublk devices a crashed predecessor recorded in
// --state-dir (ClientDaemon::recover_ublk), then serves commands.
//
//   ibnbd-client [--control-socket PATH] [--io-threads N] [--policy P]
//                [--hb-interval-ms N] [--hb-missed N] [--reconnect-delay-ms N]
//                [--connect-timeout-ms N] [--ready-file PATH]
//                [--state-dir DIR] [--ublk-queue-depth N] [--ublk-reap caller|thread]
//                [--sysfs-dir DIR] [--host-key FILE] [--host-id ID] [--config FILE]
//                [--metrics-listen [ADDR:]PORT]
#include <charconv>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "client_daemon.h"
#include "control/daemon.h"
#include "sysfs/mount.h"
#include "sysfs/trees.h"

namespace {

const char kUsage[] =
    "usage: ibnbd-client [--control-socket PATH] [--io-threads N]\n"
    "                    [--policy round-robin|min-inflight|min-latency]\n"
    "                    [--hb-interval-ms N] [--hb-missed N] [--reconnect-delay-ms N]\n"
    "                    [--connect-timeout-ms N] [--ready-file PATH]\n"
    "                    [--state-dir DIR] [--ublk-queue-depth N] [--ublk-reap caller|thread]\n"
    "                    [--sysfs-dir DIR] [--host-key FILE] [--host-id ID] [--config FILE]\n"
    "                    [--tls off|on [--tls-ca FILE [--tls-cert FILE --tls-key FILE]\n"
    "                     [--tls-server-name NAME]]] [--metrics-listen [ADDR:]PORT]\n"
    "  --control-socket: default /run/ibnbd-client.sock (the CLI's default too). PATH.lock\n"
    "    beside it (flock) keeps a second daemon off a live socket; a dead daemon's is reused.\n"
    "  --ready-file: written once the control socket accepts commands (after the ublk\n"
    "    devices of a crashed predecessor were taken back).\n"
    "  --state-dir: records of ublk devices, for recovery after a crash (default\n"
    "    /run/ibnbd-client).\n"
    "  --ublk-queue-depth: tags per ublk queue unless device map says (default 128).\n"
    "  --ublk-reap: caller (default): each ublk queue thread reaps its own transport\n"
    "         connection, one wake-up per completion; thread: completions come from the\n"
    "         transport's IO threads and wake the queue thread (for comparison).\n"
    "  --sysfs-dir: serves the kernel's control files (DIR/ibtrs-client/<session>/add_path,\n"
    "         mp_policy, paths/<src@dst>/..., DIR/ibnbd-client/ctl/map_device, ...) through FUSE,\n"
    "         e.g. /run/ibnbd-client/sysfs; off by default (sysfs-emu/README.md).\n"
    "  --host-key FILE: the key file (ibnbd key generate; mode 0600) sessions authenticate with\n"
    "         unless device map names another; without one sessions are anonymous, which only\n"
    "         a server with allow_any_host admits. --host-id: the host to authenticate as\n"
    "         (default: the key file's host line).\n"
    "  --tls on: TLS 1.3 on the sessions' tcp paths unless device map says (docs/security.md):\n"
    "         a pre-shared key derived from the host key, or with --tls-ca (PEM) the server's\n"
    "         certificate verified (--tls-server-name: the DNS name or IP address it must\n"
    "         carry; without it any certificate the CA signed is taken) and --tls-cert and\n"
    "         --tls-key a client certificate presented.\n"
    "  --metrics-listen [ADDR:]PORT: Prometheus metrics over HTTP (GET /metrics; client/README.md,\n"
    "         \"Metrics\"); ADDR 127.0.0.1 unless named (0.0.0.0 or [::] for every address).\n"
    "  --config FILE: JSON with the options' names, e.g. {\"host_key\": \"/etc/ibnbd/host.key\",\n"
    "         \"io_threads\": 4}; options on the command line win.\n";

[[noreturn]] void die(const std::string& m) {
  std::fprintf(stderr, "ibnbd-client: %s\n%s", m.c_str(), kUsage);
  std::exit(2);
}

uint64_t number(const char* flag, const char* v, uint64_t lo, uint64_t hi) {
  uint64_t n = 0;
  std::string_view s(v);
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), n);
  if (ec != std::errc() || p != s.data() + s.size() || n < lo || n > hi)
    die(std::string(flag) + ": '" + v + "' is not a number in " + std::to_string(lo) + ".." + std::to_string(hi));
  return n;
}

// One option by its command-line name: from argv, or from --config (JSON names use '_').
struct Paths {
  std::string socket = "/run/ibnbd-client.sock";
  std::string ready_file;
  std::string sysfs_dir;
  std::optional<sockaddr_storage> metrics;
};

void apply(ibnbd::ClientDaemonOptions& o, Paths& paths, const std::string& a, const char* v) {
  if (a == "--control-socket") paths.socket = v;
  else if (a == "--ready-file") paths.ready_file = v;
  else if (a == "--state-dir") o.state_dir = v;
  else if (a == "--ublk-queue-depth") o.ublk_queue_depth = static_cast<uint16_t>(number(a.c_str(), v, 1, 4096));
  else if (a == "--ublk-reap") {
    const std::string_view m(v);
    if (m != "caller" && m != "thread") die("--ublk-reap: caller or thread");
    o.ublk_reap = m == "caller";
  } else if (a == "--sysfs-dir") paths.sysfs_dir = v;
  else if (a == "--metrics-listen") {
    auto m = ibnbd::control::metrics::parse_listen(v);
    if (!m) die("--metrics-listen '" + std::string(v) + "': expected PORT, :PORT or ADDR:PORT (ADDR numeric, IPv6 in [])");
    paths.metrics = *m;
  }
  else if (a == "--io-threads") o.io_threads = static_cast<uint32_t>(number("--io-threads", v, 0, 64));
  else if (a == "--hb-interval-ms") o.heartbeat.interval = std::chrono::milliseconds(number(a.c_str(), v, 1, 3600000));
  else if (a == "--hb-missed") o.heartbeat.missed_max = static_cast<uint32_t>(number(a.c_str(), v, 1, 1000));
  else if (a == "--reconnect-delay-ms") o.reconnect.delay = std::chrono::milliseconds(number(a.c_str(), v, 1, 3600000));
  else if (a == "--connect-timeout-ms") o.connect_timeout = std::chrono::milliseconds(number(a.c_str(), v, 1, 3600000));
  else if (a == "--host-key") o.host_key = v;
  else if (a == "--host-id") o.host_id = v;
  else if (a == "--tls") {
    auto m = ibtrs::tls::parse_mode(v);
    if (!m || *m == ibtrs::tls::Options::Mode::required) die("--tls: off or on");
    o.tls.mode = *m;
  } else if (a == "--tls-ca") o.tls.ca_file = v;
  else if (a == "--tls-cert") o.tls.cert_file = v;
  else if (a == "--tls-key") o.tls.key_file = v;
  else if (a == "--tls-server-name") o.tls.server_name = v;
  else if (a == "--policy") {
    auto p = ibtrs::parse_mp_policy(v);
    if (!p) die("--policy: round-robin, min-inflight or min-latency");
    o.policy = *p;
  } else {
    die("unknown option " + a);
  }
}

// --config FILE: {"name": value, ...} with the options' names (dashes or underscores).
std::vector<std::pair<std::string, std::string>> read_config(const std::string& file) {
  std::string why;
  auto j = ibnbd::control::read_config(file, &why);
  if (!j) die(why);
  std::vector<std::pair<std::string, std::string>> out;
  for (auto& [k, v] : j->items()) {
    std::string name = "--" + k;
    for (auto& c : name)
      if (c == '_') c = '-';
    if (v.is_string()) out.emplace_back(name, v.get<std::string>());
    else if (v.is_number_integer()) out.emplace_back(name, std::to_string(v.get<int64_t>()));
    else die(file + ": " + k + ": expected a string or a number");
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  ibnbd::ClientDaemonOptions o;
  Paths paths;
  std::vector<std::pair<std::string, std::string>> cli, config;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (i + 1 >= argc) die(a + " needs a value");
    if (a == "--config") config = read_config(argv[++i]);
    else cli.emplace_back(a, argv[++i]);
  }
  for (auto* list : {&config, &cli})
    for (auto& [a, v] : *list) apply(o, paths, a, v.c_str());
  const std::string& socket_path = paths.socket;
  const std::string& ready_file = paths.ready_file;
  const std::string& sysfs_dir = paths.sysfs_dir;
  if (o.tls.cert_file.empty() != o.tls.key_file.empty()) die("--tls-cert and --tls-key go together");
  if (!o.tls.cert_file.empty() && o.tls.ca_file.empty()) die("--tls-cert needs --tls-ca (the server's CA)");
  if (!o.host_key.empty()) {
    // A key file that is not usable stops the daemon now, not at the first map.
    std::string why;
    if (!ibtrs::client_auth_from_key_file(o.host_key, o.host_id, &why)) die("--host-key: " + why);
  }
  ibnbd::control::StopSignals signals;

  // First: a second daemon on a live control socket stops here, before it could take the ublk
  // devices of the running one for a crashed predecessor's.
  auto lock = ibnbd::control::lock_socket("ibnbd-client", socket_path);
  if (!lock) return 1;
  ibnbd::ClientDaemon daemon(o);
  for (auto& r : daemon.recover_ublk()) std::fprintf(stderr, "ibnbd-client: recovery: %s\n", r.dump().c_str());
  auto ctl = ibnbd::control::start_socket("ibnbd-client", std::move(*lock),
                                          [&](const nlohmann::json& req, const auto& emit) {
                                            return daemon.handle(req, emit);
                                          });
  if (!ctl) return 1;
  // Declared after the daemon: unmounted before it goes (the files call into it).
  std::unique_ptr<sysfs::Mount> sysfs_mount;
  if (!sysfs_dir.empty()) {
    // The files read the daemon's typed answers; writes go through its commands.
    namespace control = ibnbd::control;
    sysfs::ClientBinding binding{
        .backend = [&daemon](const nlohmann::json& req) {
          return daemon.handle(req, [](const nlohmann::json&) { return true; });
        },
        .device = [&daemon](const std::string& name) { return daemon.device(name); },
        .log = [](const std::string& l) { std::fprintf(stderr, "ibnbd-client: %s\n", l.c_str()); },
        .devices = [&daemon]() -> ibnbd::Result<std::vector<control::DeviceReport>> { return daemon.devices(); },
        .sessions = [&daemon]() -> ibnbd::Result<std::vector<control::SessionReport>> { return daemon.sessions(); },
        .session = [&daemon](const std::string& name) { return daemon.session(name); },
        .paths = [&daemon](const std::string& sess, const std::string& path) { return daemon.paths(sess, path); },
        .max_reconnect_attempts = [&daemon](const std::string& sess) { return daemon.max_reconnect_attempts(sess); }};
    auto m = sysfs::mount_for_daemon(sysfs::client_tree(std::move(binding)), sysfs_dir, "ibnbd-client");
    if (!m) {
      std::fprintf(stderr, "ibnbd-client: sysfs tree at %s: %s\n", sysfs_dir.c_str(), m.error().message().c_str());
      return 1;
    }
    sysfs_mount = std::move(*m);
  }
  std::unique_ptr<ibnbd::control::metrics::HttpServer> metrics;
  std::string ready = "ready " + socket_path + "\n";
  if (paths.metrics) {
    auto m = ibnbd::control::start_metrics("ibnbd-client", *paths.metrics, [&daemon] { return daemon.metrics(); });
    if (!m) return 1;
    metrics = std::move(*m);
    ready += ibnbd::control::metrics_ready_line(*metrics);
  }
  std::fprintf(stderr, "ibnbd-client: ready on %s\n", socket_path.c_str());
  ibnbd::control::write_ready_file(ready_file, ready);
  const int sig = signals.wait();
  std::fprintf(stderr, "ibnbd-client: %s: unmapping\n", strsignal(sig));
  metrics.reset();
  sysfs_mount.reset();
  ctl->reset();
  ibnbd::control::remove_ready_file(ready_file);
  return 0;
}
