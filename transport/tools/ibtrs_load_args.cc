// ibtrs-load's command line: the usage text, the argument walker and the options of each mode.
#include <charconv>
#include <cstdio>
#include <cstdlib>

#include "base/text.h"
#include "ibtrs/address.h"
#include "ibtrs_load.h"

namespace ibtrs_load {
namespace {

std::optional<uint64_t> parse_u64(std::string_view s) {
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc{} || p != s.data() + s.size()) return std::nullopt;
  return v;
}

using base::parse_size;

}  // namespace

const char kUsage[] =
    "usage:\n"
    "  ibtrs-load server --listen ADDR [--listen ADDR ...] [--queue-depth N] [--chunk-size SIZE]\n"
    "                    [--io-threads N] [--hb-interval-ms N] [--hb-missed N] [--size SIZE]\n"
    "                    [--ready-file PATH] [--busy-poll] [--always-invalidate] [--host-key FILE]\n"
    "                    [--tls on|required] [--tls-user]\n"
    "      Serves a RAM volume (default 1G) until SIGINT/SIGTERM. ADDR: tcp:127.0.0.1:1234,\n"
    "      rdma:198.18.0.2:1234, loopback:NAME; port 0 picks a free port. Prints `listening ADDR`\n"
    "      per bound address and writes the same lines to --ready-file (removed on exit).\n"
    "      --host-key FILE (ibnbd key generate): only that host may connect, authenticated;\n"
    "      without it any client may (a test volume; the server says so at start).\n"
    "      --tls: TLS 1.3 on tcp listeners, PSK derived from --host-key (which it needs);\n"
    "      --tls-user keeps the record layer in userspace where the kernel has kTLS.\n"
    "  ibtrs-load client --session NAME --path SPEC [--path SPEC ...]\n"
    "                    [--policy round-robin|min-inflight|min-latency]\n"
    "                    [--rw randread|randwrite|read|write|randrw] [--bs SIZE] [--qd N]\n"
    "                    [--seconds S] [--count N] [--size SIZE] [--verify] [--io-threads N]\n"
    "                    [--hb-interval-ms N] [--hb-missed N] [--reconnect-delay-ms N]\n"
    "                    [--pending-timeout-ms N] [--busy-poll] [--json] [--interval-ms N]\n"
    "                    [--control FIFO] [--host-key FILE] [--tls on] [--tls-user]\n"
    "      SPEC: [src@]dst, e.g. tcp:127.0.0.1:1234 or tcp:127.0.0.2@tcp:127.0.0.1:1234.\n"
    "      Runs --seconds (default 5 unless --count is given). --verify checks every read against\n"
    "      the last write of its block; blocks this client never wrote must read as zeros, so it\n"
    "      wants a fresh server. --control FIFO takes lines while running: disconnect NAME,\n"
    "      reconnect NAME, remove NAME, add SPEC, policy P.\n"
    "      Exit status 0 only without IO errors and verify errors.\n"
    "  ibtrs-load local [server options] -- [client options]\n"
    "      Server and client in one process (what the loopback fabric needs: its connections do\n"
    "      not leave the process). The client's paths default to the server's addresses.\n"
    "SIZE takes k/m/g suffixes (powers of 1024).\n";

[[noreturn]] void usage_error(const std::string& msg) {
  warn("%s", msg.c_str());
  std::fputs(kUsage, stderr);
  std::exit(2);
}

std::string_view Args::str() {
  if (i_ >= v_.size()) usage_error(std::string(flag_) + " needs a value");
  return v_[i_++];
}
uint64_t Args::num(uint64_t lo, uint64_t hi) {
  std::string_view s = str();
  auto v = parse_u64(s);
  if (!v || *v < lo || *v > hi)
    usage_error(std::string(flag_) + ": '" + std::string(s) + "' is not a number in " + std::to_string(lo) +
                ".." + std::to_string(hi));
  return *v;
}
uint64_t Args::size(uint64_t lo, uint64_t hi) {
  std::string_view s = str();
  auto v = parse_size(s);
  if (!v || *v < lo || *v > hi)
    usage_error(std::string(flag_) + ": '" + std::string(s) + "' is not a size in " + std::to_string(lo) +
                ".." + std::to_string(hi));
  return *v;
}
double Args::seconds() {
  std::string_view s = str();
  double v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc{} || p != s.data() + s.size() || !(v > 0) || v > 1e7)
    usage_error(std::string(flag_) + ": '" + std::string(s) + "' is not a positive number of seconds");
  return v;
}

namespace {

// --tls MODE and --tls-user, for both sides (the client takes on only).
bool parse_tls_flag(Args& a, std::string_view f, ibtrs::tls::Options& t, bool server) {
  if (f == "--tls-user") {
    t.kernel = false;
    return true;
  }
  if (f != "--tls") return false;
  std::string_view v = a.str();
  auto m = ibtrs::tls::parse_mode(v);
  if (!m || (!server && *m == ibtrs::tls::Options::Mode::required))
    usage_error("--tls '" + std::string(v) + "': " + (server ? "off, on or required" : "off or on"));
  t.mode = *m;
  return true;
}

}  // namespace

ServerConfig parse_server(Args& a) {
  ServerConfig c;
  while (a.next()) {
    auto f = a.flag();
    if (f == "--listen") {
      std::string_view text = a.str();
      auto addr = ibtrs::Address::parse(text);
      if (!addr) usage_error("--listen '" + std::string(text) + "': " + errtext(addr.error()));
      c.listen.push_back(*addr);
    } else if (f == "--queue-depth") {
      c.queue_depth = static_cast<uint32_t>(a.num(1, 65535));
    } else if (f == "--chunk-size") {
      c.chunk_size = static_cast<uint32_t>(a.size(1, 1u << 30));
    } else if (f == "--io-threads") {
      c.io_threads = static_cast<uint32_t>(a.num(0, 1024));
    } else if (f == "--hb-interval-ms") {
      c.hb_interval_ms = static_cast<uint32_t>(a.num(1, 3600000));
    } else if (f == "--hb-missed") {
      c.hb_missed = static_cast<uint32_t>(a.num(1, 1000000));
    } else if (f == "--size") {
      c.size = a.size(1, 1ull << 46);
    } else if (f == "--ready-file") {
      c.ready_file = std::string(a.str());
    } else if (f == "--busy-poll") {
      c.busy_poll = true;
    } else if (f == "--always-invalidate") {
      c.always_invalidate = true;
    } else if (f == "--host-key") {
      c.host_key = std::string(a.str());
    } else if (!parse_tls_flag(a, f, c.tls, true)) {
      a.unknown();
    }
  }
  if (c.listen.empty()) usage_error("server: at least one --listen ADDR");
  return c;
}

ClientConfig parse_client(Args& a, bool paths_required) {
  ClientConfig c;
  while (a.next()) {
    auto f = a.flag();
    if (f == "--session") {
      c.session = std::string(a.str());
    } else if (f == "--path") {
      std::string_view text = a.str();
      auto spec = ibtrs::PathSpec::parse(text);
      if (!spec) usage_error("--path '" + std::string(text) + "': " + errtext(spec.error()));
      c.paths.push_back(*spec);
    } else if (f == "--policy") {
      std::string_view text = a.str();
      auto p = ibtrs::parse_mp_policy(text);
      if (!p) usage_error("--policy '" + std::string(text) + "': round-robin, min-inflight or min-latency");
      c.policy = *p;
    } else if (f == "--rw") {
      std::string_view m = a.str();
      if (m == "randread") c.rw = Rw::randread;
      else if (m == "randwrite") c.rw = Rw::randwrite;
      else if (m == "read") c.rw = Rw::read;
      else if (m == "write") c.rw = Rw::write;
      else if (m == "randrw") c.rw = Rw::randrw;
      else usage_error("--rw '" + std::string(m) + "': randread, randwrite, read, write or randrw");
      c.rw_name = std::string(m);
    } else if (f == "--bs") {
      c.bs = a.size(512, 1u << 30);
      if (c.bs % 512) usage_error("--bs must be a multiple of 512");
    } else if (f == "--qd") {
      c.qd = static_cast<uint32_t>(a.num(1, 65535));
    } else if (f == "--seconds") {
      c.seconds = a.seconds();
    } else if (f == "--count") {
      c.count = a.num(1, UINT64_MAX);
    } else if (f == "--size") {
      c.size = a.size(512, 1ull << 46);
    } else if (f == "--verify") {
      c.verify = true;
    } else if (f == "--io-threads") {
      c.io_threads = static_cast<uint32_t>(a.num(0, 1024));
    } else if (f == "--hb-interval-ms") {
      c.hb_interval_ms = static_cast<uint32_t>(a.num(1, 3600000));
    } else if (f == "--hb-missed") {
      c.hb_missed = static_cast<uint32_t>(a.num(1, 1000000));
    } else if (f == "--reconnect-delay-ms") {
      c.reconnect_delay_ms = static_cast<uint32_t>(a.num(0, 3600000));
    } else if (f == "--pending-timeout-ms") {
      c.pending_timeout_ms = static_cast<uint32_t>(a.num(0, 3600000));
    } else if (f == "--busy-poll") {
      c.busy_poll = true;
    } else if (f == "--json") {
      c.json = true;
    } else if (f == "--interval-ms") {
      c.interval_ms = static_cast<uint32_t>(a.num(1, 3600000));
    } else if (f == "--control") {
      c.control = std::string(a.str());
    } else if (f == "--host-key") {
      c.host_key = std::string(a.str());
    } else if (!parse_tls_flag(a, f, c.tls, false)) {
      a.unknown();
    }
  }
  if (c.session.empty()) usage_error("client: --session NAME is required");
  if (c.paths.empty() && paths_required) usage_error("client: at least one --path SPEC");
  for (size_t i = 0; i < c.paths.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (c.paths[i].name() == c.paths[j].name())
        usage_error("paths " + std::to_string(j + 1) + " and " + std::to_string(i + 1) + " are both named " +
                    c.paths[i].name() + ": a session's paths need different names (sources, hosts or ports)");
  if (c.bs > c.size) usage_error("--bs is larger than --size");
  if (c.seconds == 0 && c.count == 0) c.seconds = 5;
  return c;
}

}  // namespace ibtrs_load
