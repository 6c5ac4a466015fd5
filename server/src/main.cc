// ibnbd-server: exports files and block devices under a search path to IBNBD clients.
//
//   ibnbd-server --listen ADDR [--listen ADDR ...] --dev-search-path DIR [options]
//   ibnbd-server --config FILE [options]        (options override the file)
//
// Runs until SIGTERM/SIGINT, then closes every session, waits for the IO in flight and syncs the
// devices. Admin commands (ibnbd server ...) come over --control-socket.
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/text.h"
#include "control/daemon.h"
#include "server_commands.h"
#include "server_metrics.h"
#include "sysfs/mount.h"
#include "sysfs/trees.h"
#include "ibnbd/server.h"

namespace {

using base::parse_size;

using nlohmann::json;

const char kUsage[] =
    "usage: ibnbd-server [--config FILE] [--listen ADDR ...] [--dev-search-path DIR]\n"
    "                    [--queue-depth N] [--chunk-size SIZE] [--max-io-size SIZE]\n"
    "                    [--io-threads N]\n"
    "                    [--direct-io prefer|off|require] [--read-only] [--always-invalidate]\n"
    "                    [--hb-interval-ms N] [--hb-missed N] [--poll adaptive|block|spin]\n"
    "                    [--max-sessions N] [--max-paths-per-session N] [--max-chunk-memory SIZE]\n"
    "                    [--handshake-timeout-ms N] [--ack-timeout-ms N] [--drain-hold-ms N]\n"
    "                    [--size-check-ms N] [--shutdown-timeout-ms N]\n"
    "                    [--control-socket PATH] [--ready-file PATH] [--sysfs-dir DIR]\n"
    "                    [--allow-any-host] [--metrics-listen [ADDR:]PORT]\n"
    "                    [--rbd-conf FILE] [--rbd-client-id ID] [--rbd-keyring FILE]\n"
    "                    [--rbd-pools POOL,...] [--rbd-namespace NS]\n"
    "                    [--tls off|on|required [--tls-cert FILE --tls-key FILE [--tls-ca FILE]]]\n"
    "  ADDR: tcp:IP[:PORT] or rdma:IP[:PORT] (port 1234 when left out; 0 picks a free one).\n"
    "  DIR:  absolute; %SESSNAME% in it is replaced by the client session's name.\n"
    "  --config FILE: JSON with the same names, e.g. {\"listen\": [\"tcp:0.0.0.0\"],\n"
    "         \"dev_search_path\": \"/srv/ibnbd\", \"queue_depth\": 256, \"read_only\": false}.\n"
    "  --poll: how the IO threads wait for the next request (default adaptive: keep polling for a\n"
    "         learned gap after work, sleep at once while idle or with the CPU contended; block:\n"
    "         sleep at once; spin: never sleep, a core per IO thread). --busy-poll: spin, and the\n"
    "         fabric's own waits busy-poll too.\n"
    "  --max-io-size: the largest request (default 1M) of a client that takes chunk sets: it spans\n"
    "         consecutive chunks (docs/protocol.md, \"Chunk sets\"); 0: one chunk per request.\n"
    "  --control-socket: default /run/ibnbd-server.sock; PATH.lock beside it (flock) keeps a\n"
    "         second daemon off a live socket. --ready-file: written with one\n"
    "         `listening ADDR` line per address once the server accepts connections.\n"
    "  Bounds (docs/security.d/bounds.md): --max-sessions (default 256; half-open sessions are\n"
    "         evicted first, then EUSERS), --max-paths-per-session (16; EMLINK),\n"
    "         --max-chunk-memory (8G: queue depth x chunk size of all sessions; ENOMEM),\n"
    "         --handshake-timeout-ms (30000: a path not connected by then is closed),\n"
    "         --ack-timeout-ms (30000: a peer whose responses wait that long unacknowledged\n"
    "         is disconnected), --drain-hold-ms (5000, at most half the handshake timeout: a\n"
    "         reconnect that would start a new session while the session it replaces still has\n"
    "         requests with the backend is held until they completed, that long at most, then\n"
    "         refused with EAGAIN, which the client retries; 0: no hold, and an old write may\n"
    "         land after the new session's writes). Refusals: `ibnbd server refusals`.\n"
    "  --size-check-ms: how often the size of every open device is re-read (default 1000; 0\n"
    "         never): a resized one is announced to the sessions that hold it (protocol 4).\n"
    "  --shutdown-timeout-ms: how long closing the sessions and devices after SIGTERM may take\n"
    "         (default 25000; 0: as long as it takes); past it the daemon says so and exits 1\n"
    "         (an RBD image's close waits for its cluster's OSDs with no timeout of its own).\n"
    "  --metrics-listen [ADDR:]PORT: Prometheus metrics over HTTP (GET /metrics; server/README.md,\n"
    "         \"Metrics\"); ADDR 127.0.0.1 unless named (0.0.0.0 or [::] for every address).\n"
    "  --sysfs-dir DIR: serves the kernel's control files (DIR/ibtrs-server/<session>/paths/...,\n"
    "         DIR/ibnbd-server/ctl/devices/...) through FUSE, e.g. /run/ibnbd-server/sysfs;\n"
    "         off by default (sysfs-emu/README.md).\n"
    "  Hosts: every client authenticates (DH-HMAC-CHAP) as a host of the config's \"hosts\" and may\n"
    "         open what its \"access\" rules grant; others are refused. E.g. \"hosts\": [{\"host\":\n"
    "         \"nqn...:host-a\", \"key_file\": \"/etc/ibnbd/host-a.key\", \"access\": [{\"devices\":\n"
    "         \"a/**\", \"mode\": \"rw\"}]}]; at run time `ibnbd server host add|list|remove`.\n"
    "  --allow-any-host: anyone who reaches the port opens any device rw, without credentials\n"
    "         (the kernel's RNBD). Off by default; the server warns when it is on.\n"
    "  RBD: with --rbd-conf (or \"rbd\": {\"conf\", \"client_id\", \"keyring\", \"pools\",\n"
    "         \"namespace\", \"connect_timeout_s\"} in the config) a client's rbd:POOL/IMAGE[@SNAP]\n"
    "         opens that image of the Ceph cluster as client.ID (default admin) with the keyring;\n"
    "         --rbd-pools limits the pools; NS may hold %SESSNAME%. Snapshots are read-only.\n"
    "  --tls: TLS 1.3 on the tcp listeners (docs/security.md): on offers it, required refuses\n"
    "         plaintext clients. Keys: PSKs derived from the hosts' keys, or with --tls-cert and\n"
    "         --tls-key (PEM) a certificate, and --tls-ca to require client certificates.\n"
    "         rdma listeners are not encrypted.\n";

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "ibnbd-server: %s\n", msg.c_str());
  std::exit(2);
}

struct Config {
  ibnbd::BlockServerOptions o;
  std::string control_socket = "/run/ibnbd-server.sock";
  std::string ready_file;
  std::string sysfs_dir;
  std::optional<sockaddr_storage> metrics_listen;
  // How long the stop after SIGTERM/SIGINT may take (0: as long as it takes).
  std::chrono::milliseconds shutdown_timeout{25000};  // below the unit's TimeoutStopSec=30: we say why first
};

// One setting by name, from the command line (text) or the config file (JSON).
void apply(Config& c, const std::string& key, const json& v) {
  auto text = [&]() -> std::string {
    if (v.is_string()) return v.get<std::string>();
    if (v.is_number_unsigned() || v.is_number_integer()) return std::to_string(v.get<int64_t>());
    if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
    die(key + ": expected a string or a number");
  };
  auto number = [&](uint64_t lo, uint64_t hi) {
    auto n = parse_size(text());
    if (!n || *n < lo || *n > hi)
      die(key + ": '" + text() + "' is not in " + std::to_string(lo) + ".." + std::to_string(hi));
    return *n;
  };
  auto flag = [&] { return v.is_boolean() ? v.get<bool>() : text() == "true"; };
  auto& t = c.o.transport;
  if (key == "listen") {
    std::vector<std::string> items;
    if (v.is_array()) {
      for (auto& e : v) items.push_back(e.get<std::string>());
    } else {
      items.push_back(text());
    }
    for (auto& s : items) {
      auto a = ibtrs::Address::parse(s);
      if (!a) die("listen '" + s + "': " + a.error().message());
      t.listen.push_back(*a);
    }
  } else if (key == "dev_search_path") {
    c.o.dev_search_path = text();
  } else if (key == "queue_depth") {
    t.queue_depth = static_cast<uint16_t>(number(1, 65535));
  } else if (key == "chunk_size") {
    t.chunk_size = static_cast<uint32_t>(number(8192, 16u << 20));
  } else if (key == "max_io_size") {
    t.max_io_size = static_cast<uint32_t>(number(0, 64u << 20));
  } else if (key == "io_threads") {
    t.io_threads = static_cast<uint32_t>(number(0, 64));
  } else if (key == "direct_io") {
    auto s = text();
    if (s == "prefer") c.o.direct_io = ibnbd::DirectIo::prefer;
    else if (s == "off") c.o.direct_io = ibnbd::DirectIo::off;
    else if (s == "require") c.o.direct_io = ibnbd::DirectIo::require;
    else die("direct_io: prefer, off or require");
  } else if (key == "read_only") {
    c.o.read_only = flag();
  } else if (key == "always_invalidate") {
    t.always_invalidate = flag();
  } else if (key == "busy_poll") {
    t.busy_poll = flag();
  } else if (key == "poll") {
    auto m = text();
    if (m == "adaptive") t.io_poll = ibtrs::ServerOptions::IoPoll::adaptive;
    else if (m == "block") t.io_poll = ibtrs::ServerOptions::IoPoll::block;
    else if (m == "spin") t.io_poll = ibtrs::ServerOptions::IoPoll::spin;
    else die("poll: adaptive, block or spin");
  } else if (key == "hb_interval_ms") {
    t.heartbeat.interval = std::chrono::milliseconds(number(1, 3600000));
  } else if (key == "hb_missed") {
    t.heartbeat.missed_max = static_cast<uint32_t>(number(1, 1000));
  } else if (key == "max_sessions") {
    t.max_sessions = static_cast<uint32_t>(number(1, 1u << 20));
  } else if (key == "max_paths_per_session") {
    t.max_paths_per_session = static_cast<uint32_t>(number(1, 1024));
  } else if (key == "max_chunk_memory") {
    t.max_chunk_memory = number(1u << 20, uint64_t{1} << 50);
  } else if (key == "handshake_timeout_ms") {
    t.handshake_timeout = std::chrono::milliseconds(number(1, 3600000));
  } else if (key == "drain_hold_ms") {
    t.drain_hold = std::chrono::milliseconds(number(0, 3600000));
  } else if (key == "ack_timeout_ms") {
    t.ack_timeout = std::chrono::milliseconds(number(1, 3600000));
  } else if (key == "shutdown_timeout_ms") {
    c.shutdown_timeout = std::chrono::milliseconds(number(0, 3600000));
  } else if (key == "size_check_ms") {
    c.o.size_check_interval = std::chrono::milliseconds(number(0, 3600000));
  } else if (key == "control_socket") {
    c.control_socket = text();
  } else if (key == "ready_file") {
    c.ready_file = text();
  } else if (key == "sysfs_dir") {
    c.sysfs_dir = text();
  } else if (key == "metrics_listen") {
    auto a = ibnbd::control::metrics::parse_listen(text());
    if (!a) die("metrics_listen '" + text() + "': expected PORT, :PORT or ADDR:PORT (ADDR numeric, IPv6 in [])");
    c.metrics_listen = *a;
  } else if (key == "allow_any_host") {
    c.o.allow_any_host = flag();
  } else if (key == "tls") {
    auto m = ibtrs::tls::parse_mode(text());
    if (!m) die("tls: off, on or required");
    t.tls.mode = *m;
  } else if (key == "tls_cert") {
    t.tls.cert_file = text();
  } else if (key == "tls_key") {
    t.tls.key_file = text();
  } else if (key == "tls_ca") {
    t.tls.ca_file = text();
  } else if (key == "rbd") {
    // The whole section from the config file: {"conf", "client_id", "keyring", "pools",
    // "namespace", "connect_timeout_s"}.
    if (!v.is_object()) die("rbd: an object {\"conf\", \"client_id\", \"keyring\", \"pools\", \"namespace\"}");
    for (auto& [k, x] : v.items()) {
      if (k == "pools") {
        if (!x.is_array()) die("rbd.pools: a list of pool names");
        for (auto& p : x) apply(c, "rbd_pools", p);
      } else if (k == "conf" || k == "client_id" || k == "keyring" || k == "namespace" || k == "connect_timeout_s") {
        apply(c, "rbd_" + k, x);
      } else {
        die("rbd: unknown setting '" + k + "'");
      }
    }
  } else if (key.rfind("rbd_", 0) == 0) {
    if (!c.o.rbd) c.o.rbd.emplace();
    auto& r = *c.o.rbd;
    if (key == "rbd_conf") {
      r.conf_file = text();
    } else if (key == "rbd_client_id") {
      r.client_id = text();
    } else if (key == "rbd_keyring") {
      r.keyring = text();
    } else if (key == "rbd_namespace") {
      r.namespace_template = text();
    } else if (key == "rbd_connect_timeout_s") {
      r.connect_timeout = std::chrono::seconds(number(1, 3600));
    } else if (key == "rbd_pools") {
      std::string list = text();
      for (size_t pos = 0; pos <= list.size();) {
        const size_t comma = std::min(list.find(',', pos), list.size());
        std::string p = list.substr(pos, comma - pos);
        if (p.empty()) die("rbd pools: an empty pool name in '" + list + "'");
        r.pools.push_back(std::move(p));
        pos = comma + 1;
      }
    } else {
      die("unknown setting '" + key + "'");
    }
  } else if (key == "hosts") {
    if (!v.is_array()) die("hosts: a list of {\"host\", \"key_file\" | \"key\", \"access\": [...]}");
    for (auto& h : v) {
      std::string why;
      auto hc = ibnbd::host_from_json(h, &why);
      if (!hc) die("hosts: " + why);
      for (auto& known : c.o.hosts)
        if (known.host == hc->host) die("hosts: " + hc->host + " is listed twice");
      c.o.hosts.push_back(std::move(*hc));
    }
  } else {
    die("unknown setting '" + key + "'");
  }
}

// The command line's options that take a value (with '-' as '_'); apply() knows each, and the
// config file's keys besides ("hosts", "rbd").
constexpr std::string_view kValueOptions[] = {
    "ack_timeout_ms", "chunk_size", "config", "control_socket", "dev_search_path", "direct_io", "drain_hold_ms",
    "handshake_timeout_ms", "hb_interval_ms", "hb_missed", "io_threads", "listen", "max_chunk_memory",
    "max_io_size", "max_paths_per_session", "max_sessions", "metrics_listen", "poll", "queue_depth", "rbd_client_id",
    "rbd_conf", "rbd_connect_timeout_s", "rbd_keyring", "rbd_namespace", "rbd_pools", "ready_file",
    "shutdown_timeout_ms", "size_check_ms", "sysfs_dir", "tls", "tls_ca", "tls_cert", "tls_key"};

Config parse(int argc, char** argv) {
  Config c;
  std::vector<std::pair<std::string, json>> cli;
  std::string config_file;
  bool listen_given = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (a.rfind("--", 0) != 0) die("unexpected argument '" + a + "'\n" + kUsage);
    std::string key = a.substr(2);
    for (auto& ch : key)
      if (ch == '-') ch = '_';
    if (key == "read_only" || key == "always_invalidate" || key == "busy_poll" || key == "allow_any_host") {
      cli.emplace_back(key, true);
      continue;
    }
    if (std::find(std::begin(kValueOptions), std::end(kValueOptions), key) == std::end(kValueOptions))
      die("unknown option " + a + " (ibnbd-server --help lists them)");
    if (i + 1 >= argc) die(a + " needs a value");
    if (key == "config") {
      config_file = argv[++i];
      continue;
    }
    if (key == "listen") listen_given = true;
    cli.emplace_back(key, std::string(argv[++i]));
  }
  if (!config_file.empty()) {
    std::string why;
    auto j = ibnbd::control::read_config(config_file, &why);
    if (!j) die(why);
    for (auto& [k, v] : j->items()) {
      if (k == "listen" && listen_given) continue;  // the command line's addresses win
      apply(c, k, v);
    }
  }
  for (auto& [k, v] : cli) apply(c, k, v);
  if (c.o.transport.listen.empty()) die("at least one --listen ADDR\n" + std::string(kUsage));
  // Every OPEN resolves beneath it: refuse at start what would refuse every OPEN later.
  const std::string& dsp = c.o.dev_search_path;
  if (dsp.empty() || dsp[0] != '/') die("--dev-search-path '" + dsp + "': not an absolute path");
  struct stat st{};
  if (::stat(dsp.c_str(), &st) != 0) die("--dev-search-path " + dsp + ": " + std::strerror(errno));
  if (!S_ISDIR(st.st_mode)) die("--dev-search-path " + dsp + ": not a directory");
  const auto& tls = c.o.transport.tls;
  if (tls.cert_file.empty() != tls.key_file.empty()) die("--tls-cert and --tls-key go together");
  if (!tls.ca_file.empty() && tls.cert_file.empty())
    die("--tls-ca verifies client certificates: it needs the server's own --tls-cert and --tls-key");
  if (tls.mode == ibtrs::tls::Options::Mode::off && !tls.cert_file.empty())
    die("--tls-cert without --tls on|required");
  return c;
}

}  // namespace

namespace {

// Every connection costs the tcp provider three descriptors (socket, epoll set, eventfd), and
// the caps allow more connections than the usual soft limit of 1024 descriptors: take the
// hard limit, as systemd advises services that do not use select().
void raise_fd_limit() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &rl);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Config c = parse(argc, argv);
  raise_fd_limit();
  // Signals go to signals.wait() below only: every thread started from here inherits the mask.
  ibnbd::control::StopSignals signals;

  // First, before anything listens: a second server on a live control socket stops here.
  auto lock = ibnbd::control::lock_socket("ibnbd-server", c.control_socket);
  if (!lock) return 1;
  if (c.o.allow_any_host) {
    std::fprintf(stderr,
                 "ibnbd-server: WARNING: allow_any_host is on: anyone who reaches %s opens any device "
                 "under %s in any mode, without credentials (only listed hosts keep their rules)\n",
                 c.o.transport.listen[0].to_string().c_str(), c.o.dev_search_path.c_str());
  } else if (c.o.hosts.empty()) {
    std::fprintf(stderr, "ibnbd-server: no hosts configured: every client is refused until "
                         "`ibnbd server host add` (or \"hosts\" in --config)\n");
  }
  if (c.o.transport.drain_hold.count() == 0)
    std::fprintf(stderr,
                 "ibnbd-server: WARNING: drain_hold_ms is 0: a reconnecting client starts a new session "
                 "while its old one may still have writes in the backend, which can land after the new "
                 "session's (docs/protocol.md, \"Path incarnations\")\n");
  auto srv = ibnbd::BlockServer::start(c.o);
  if (!srv) {
    std::fprintf(stderr, "ibnbd-server: cannot start: %s\n", srv.error().message().c_str());
    return 1;
  }
  ibnbd::BlockServer& s = **srv;
  // The transport clamps the hold to half the handshake timeout (ibtrs::ServerOptions::drain_hold):
  // say so, rather than let an admin believe the longer hold is in force.
  const auto hold = s.transport_options().drain_hold;
  if (hold != c.o.transport.drain_hold)
    std::fprintf(stderr,
                 "ibnbd-server: drain_hold_ms %lld is more than half of handshake_timeout_ms %lld: %lld in force\n",
                 static_cast<long long>(c.o.transport.drain_hold.count()),
                 static_cast<long long>(c.o.transport.handshake_timeout.count()), static_cast<long long>(hold.count()));
  auto ctl = ibnbd::control::start_socket("ibnbd-server", std::move(*lock), [&s](const json& req, const auto&) {
    return ibnbd::server_command(s, req);
  });
  if (!ctl) return 1;
  std::unique_ptr<sysfs::Mount> sysfs_mount;
  if (!c.sysfs_dir.empty()) {
    auto m = sysfs::mount_for_daemon(
        // The files read the server's typed reports; the writes go through its commands.
        sysfs::server_tree(sysfs::ServerBinding{
            .backend = [&s](const json& req) { return ibnbd::server_command(s, req); },
            .log = [](const std::string& l) { std::fprintf(stderr, "ibnbd-server: %s\n", l.c_str()); },
            .sessions = [&s]() -> ibnbd::Result<std::vector<std::string>> {
              std::vector<std::string> names;
              for (auto& i : s.sessions()) names.push_back(i.name);
              return names;
            },
            .paths = [&s](const std::string& sess, const std::string& path) {
              return ibnbd::server_paths(s, sess, path);
            },
            .devices = [&s]() -> ibnbd::Result<std::vector<ibnbd::control::ExportedDeviceReport>> {
              return ibnbd::server_devices(s);
            },
            .refusals = [&s]() -> ibnbd::Result<std::vector<ibnbd::control::RefusalReport>> {
              return ibnbd::server_refusals(s);
            }}),
        c.sysfs_dir,
        "ibnbd-server");
    if (!m) {
      std::fprintf(stderr, "ibnbd-server: sysfs tree at %s: %s\n", c.sysfs_dir.c_str(), m.error().message().c_str());
      return 1;
    }
    sysfs_mount = std::move(*m);
  }
  std::unique_ptr<ibnbd::control::metrics::HttpServer> metrics;
  if (c.metrics_listen) {
    auto m = ibnbd::control::start_metrics("ibnbd-server", *c.metrics_listen, [&s] { return ibnbd::server_metrics(s); });
    if (!m) return 1;
    metrics = std::move(*m);
  }
  std::string lines;
  for (auto& a : s.addresses()) lines += "listening " + a.to_string() + "\n";
  if (metrics) lines += ibnbd::control::metrics_ready_line(*metrics);
  std::fputs(lines.c_str(), stdout);
  std::fflush(stdout);
  ibnbd::control::write_ready_file(c.ready_file, lines);
  const int sig = signals.wait();
  std::fprintf(stderr, "ibnbd-server: %s: closing sessions\n", strsignal(sig));
  if (c.shutdown_timeout.count() > 0) {
    // A backend's close may wait on what is gone for good (librbd's rbd_close on a cluster that
    // is down waits for OSD ops with no timeout): the stop is bounded, as a service manager's
    // would be, and says why. Exiting here loses nothing a crash would not: what the clients
    // were told is stable was flushed when they asked.
    std::thread([t = c.shutdown_timeout] {
      std::this_thread::sleep_for(t);
      std::fprintf(stderr,
                   "ibnbd-server: closing took more than %lld ms (shutdown_timeout_ms): a device's backend "
                   "did not finish closing (an RBD image whose cluster is unreachable?); exiting\n",
                   static_cast<long long>(t.count()));
      std::fflush(stderr);
      ::_exit(1);
    }).detach();
  }
  metrics.reset();      // it reads the server too
  sysfs_mount.reset();  // the files call into the server: they go first
  ctl->reset();
  srv->reset();
  ibnbd::control::remove_ready_file(c.ready_file);
  return 0;
}
