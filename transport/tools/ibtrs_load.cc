// ibtrs-load: a RAM-volume server and a load generator on the public session API of libibtrs.
//
//   ibtrs-load server --listen ADDR [--listen ADDR ...] [--size BYTES] [--ready-file PATH] ...
//   ibtrs-load client --session NAME --path SPEC [--path SPEC ...] [--rw MODE] [--bs SIZE] ...
//
// Every request carries a LoadHdr as its user header: where on the server's volume the data
// goes or comes from. The server copies between the request's data and its volume inline on the
// IO thread. The client keeps --qd requests in flight, resubmitting from the completion callback,
// and reports throughput, latency, errors and the longest pause between completions (what a
// failover costs the caller). `ibtrs-load --help` lists every option.
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cinttypes>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "base/pattern.h"
#include "base/text.h"
#include "ibtrs/address.h"
#include "ibtrs/client.h"
#include "ibtrs/path_spec.h"
#include "ibtrs/result.h"
#include "ibtrs/server.h"
#include "ibtrs/types.h"

namespace {

using Clock = std::chrono::steady_clock;

// ---- the tool's wire protocol -----------------------------------------------------------------

constexpr uint32_t kLoadMagic = 0x4C4F4144;  // "LOAD"

// The user header of every request. Both ends of this tool run on little-endian hosts (the
// project targets x86-64 and arm64 Linux), so the struct travels as it lies in memory.
struct LoadHdr {
  uint64_t offset = 0;  // byte offset on the server's volume
  uint32_t len = 0;     // data bytes: must equal the request's data length
  uint32_t magic = kLoadMagic;
};
static_assert(sizeof(LoadHdr) == 16, "LoadHdr is 16 bytes on the wire");
static_assert(std::endian::native == std::endian::little, "LoadHdr travels in host byte order");

// ---- output -----------------------------------------------------------------------------------

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// Completion, event, control and main threads all print; one lock keeps their lines whole, and a
// flush per line lets a script that tails the output see each line as it happens.
std::mutex g_out_mu;

__attribute__((format(printf, 1, 2))) void say(const char* fmt, ...) {
  std::lock_guard lk(g_out_mu);
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stdout, fmt, ap);
  va_end(ap);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

__attribute__((format(printf, 1, 2))) void warn(const char* fmt, ...) {
  std::lock_guard lk(g_out_mu);
  std::fflush(stdout);
  va_list ap;
  va_start(ap, fmt);
  std::fputs("ibtrs-load: ", stderr);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fputc('\n', stderr);
}

std::string errtext(std::error_code ec) { return ec.message() + " (" + std::to_string(ec.value()) + ")"; }
std::string errtext(int err) { return std::string(std::strerror(err)) + " (" + std::to_string(err) + ")"; }

double mib(uint64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

std::string json_str(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// ---- command line -----------------------------------------------------------------------------

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

std::optional<uint64_t> parse_u64(std::string_view s) {
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc{} || p != s.data() + s.size()) return std::nullopt;
  return v;
}

using base::parse_size;

// Walks argv; each typed getter takes the value after the current flag or stops with usage.
class Args {
 public:
  Args(int argc, char** argv, int first, int last = -1) {
    for (int i = first; i < (last < 0 ? argc : last); ++i) v_.emplace_back(argv[i]);
  }
  bool next() {
    if (i_ >= v_.size()) return false;
    flag_ = v_[i_++];
    return true;
  }
  std::string_view flag() const { return flag_; }
  std::string_view str() {
    if (i_ >= v_.size()) usage_error(std::string(flag_) + " needs a value");
    return v_[i_++];
  }
  uint64_t num(uint64_t lo, uint64_t hi) {
    std::string_view s = str();
    auto v = parse_u64(s);
    if (!v || *v < lo || *v > hi)
      usage_error(std::string(flag_) + ": '" + std::string(s) + "' is not a number in " + std::to_string(lo) +
                  ".." + std::to_string(hi));
    return *v;
  }
  uint64_t size(uint64_t lo, uint64_t hi) {
    std::string_view s = str();
    auto v = parse_size(s);
    if (!v || *v < lo || *v > hi)
      usage_error(std::string(flag_) + ": '" + std::string(s) + "' is not a size in " + std::to_string(lo) +
                  ".." + std::to_string(hi));
    return *v;
  }
  double seconds() {
    std::string_view s = str();
    double v = 0;
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (s.empty() || ec != std::errc{} || p != s.data() + s.size() || !(v > 0) || v > 1e7)
      usage_error(std::string(flag_) + ": '" + std::string(s) + "' is not a positive number of seconds");
    return v;
  }
  [[noreturn]] void unknown() const { usage_error("unknown option '" + std::string(flag_) + "'"); }

 private:
  std::vector<std::string_view> v_;
  size_t i_ = 0;
  std::string_view flag_;
};

// Signals are taken synchronously (sigwait / sigtimedwait), so they are blocked before any
// library thread exists: threads inherit the mask and none of them is picked to take them.
sigset_t block_stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

std::string stats_text(const ibtrs::PathStatsSnapshot& s) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), "reads %" PRIu64 " (%.1f MiB) writes %" PRIu64 " (%.1f MiB)", s.read_cnt,
                mib(s.read_bytes), s.write_cnt, mib(s.write_bytes));
  return buf;
}

// ================================ server ========================================================

struct ServerConfig {
  std::vector<ibtrs::Address> listen;
  uint32_t queue_depth = 512;
  uint32_t chunk_size = 128 * 1024;
  uint32_t io_threads = 0;
  std::optional<uint32_t> hb_interval_ms;
  std::optional<uint32_t> hb_missed;
  uint64_t size = 1ull << 30;
  std::string ready_file;
  bool busy_poll = false;
  bool always_invalidate = false;
  std::string host_key;
  ibtrs::tls::Options tls;
};

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

// What the server prints for a session when it stops: taken while the session lives and again
// when it goes down, so sessions that ended earlier are reported too.
struct SessionRecord {
  std::string name;
  bool live = true;
  ibtrs::PathStatsSnapshot total;
  std::map<std::string, ibtrs::ServerPathInfo> paths;  // by name, including paths gone since
};

class RamVolume final : public ibtrs::ServerHandler {
 public:
  RamVolume(std::byte* base, uint64_t size) : base_(base), size_(size) {}

  void on_request(ibtrs::ServerRequest& req) override {
    LoadHdr h;
    auto usr = req.usr();
    auto data = req.data();
    if (usr.size() != sizeof(h)) return reject(req, "user header length");
    std::memcpy(&h, usr.data(), sizeof(h));
    if (h.magic != kLoadMagic) return reject(req, "bad magic");
    if (h.len != data.size()) return reject(req, "length differs from the data");
    if (h.offset > size_ || h.len > size_ - h.offset) return reject(req, "beyond the volume");
    if (req.dir() == ibtrs::IoDir::write)
      std::memcpy(base_ + h.offset, data.data(), h.len);
    else
      std::memcpy(data.data(), base_ + h.offset, h.len);
    req.complete(0);
  }

  void on_session_up(ibtrs::ServerSession& s) override {
    say("session up %s (%s)", s.name().c_str(), s.uuid().to_string().c_str());
  }
  void on_session_down(ibtrs::ServerSession& s) override {
    record(s, false);
    say("session down %s (%s): %s", s.name().c_str(), s.uuid().to_string().c_str(), stats_text(s.stats()).c_str());
  }
  void on_path_up(ibtrs::ServerSession& s, const ibtrs::ServerPathInfo& p) override {
    say("path up %s %s from %s", s.name().c_str(), p.name.c_str(), p.peer.to_string().c_str());
  }
  void on_path_down(ibtrs::ServerSession& s, const ibtrs::ServerPathInfo& p) override {
    say("path down %s %s", s.name().c_str(), p.name.c_str());
    record(s, true, &p);
  }

  // By the time a session is down its paths are gone, so each path's last figures are kept
  // from when it went down.
  void record(ibtrs::ServerSession& s, bool live, const ibtrs::ServerPathInfo* gone = nullptr) {
    auto paths = s.paths();
    auto total = s.stats();
    std::string uuid = s.uuid().to_string();
    std::lock_guard lk(mu_);
    // A long soak sees many sessions come and go; the oldest finished ones are dropped first.
    if (records_.size() >= 1000 && !records_.count(uuid)) {
      auto victim = std::find_if(records_.begin(), records_.end(), [](const auto& r) { return !r.second.live; });
      records_.erase(victim == records_.end() ? records_.begin() : victim);
      ++dropped_;
    }
    SessionRecord& r = records_[uuid];
    r.name = s.name();
    r.live = live;
    r.total = total;
    for (auto& p : paths) r.paths[p.name] = std::move(p);
    if (gone) r.paths[gone->name] = *gone;
  }

  void print_records() {
    std::lock_guard lk(mu_);
    say("sessions: %zu reported%s, requests rejected: %" PRIu64, records_.size(),
        dropped_ ? (" (" + std::to_string(dropped_) + " older dropped)").c_str() : "",
        rejected_.load(std::memory_order_relaxed));
    for (const auto& [uuid, r] : records_) {
      say("session %s (%s)%s: %s", r.name.c_str(), uuid.c_str(), r.live ? "" : " ended", stats_text(r.total).c_str());
      for (const auto& [path_name, p] : r.paths)
        say("  path %s from %s %s reconnects %u: %s", p.name.c_str(), p.peer.to_string().c_str(),
            std::string(ibtrs::to_string(p.state)).c_str(), p.recon_cnt, stats_text(p.stats).c_str());
    }
  }

 private:
  void reject(ibtrs::ServerRequest& req, const char* why) {
    // A client of this tool never sends these; print a few so a broken client is noticed.
    if (rejected_.fetch_add(1, std::memory_order_relaxed) < 10)
      say("rejected a %s request of session %s: %s", req.dir() == ibtrs::IoDir::write ? "write" : "read",
          req.session().name().c_str(), why);
    req.complete(EINVAL);
  }

  std::byte* const base_;
  const uint64_t size_;
  std::atomic<uint64_t> rejected_{0};
  std::mutex mu_;
  std::map<std::string, SessionRecord> records_;
  uint64_t dropped_ = 0;
};

bool write_ready_file(const std::string& path, const std::string& text) {
  std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) {
    warn("--ready-file %s: %s", tmp.c_str(), errtext(errno).c_str());
    return false;
  }
  bool ok = std::fputs(text.c_str(), f) >= 0;
  ok = std::fclose(f) == 0 && ok;
  // rename() is atomic: a script polling for the file never reads half of it.
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    warn("--ready-file %s: %s", path.c_str(), errtext(errno).c_str());
    std::remove(tmp.c_str());
    return false;
  }
  return true;
}

// The server's options; `keys` (which must outlive the server) holds --host-key's host. EINVAL
// (said on stderr) for a bad key file.
ibtrs::Result<ibtrs::ServerOptions> server_options(const ServerConfig& c, ibtrs::ServerHandler* handler,
                                                   ibtrs::KeyTable& keys) {
  ibtrs::ServerOptions o;
  o.listen = c.listen;
  o.queue_depth = static_cast<uint16_t>(c.queue_depth);
  o.chunk_size = c.chunk_size;
  o.io_threads = c.io_threads;
  if (c.hb_interval_ms) o.heartbeat.interval = std::chrono::milliseconds(*c.hb_interval_ms);
  if (c.hb_missed) o.heartbeat.missed_max = *c.hb_missed;
  o.busy_poll = c.busy_poll;
  o.always_invalidate = c.always_invalidate;
  o.tls = c.tls;
  o.handler = handler;
  if (!c.host_key.empty()) {
    std::string why;
    auto k = ibtrs::load_key_file(c.host_key, &why);
    if (!k || k->host.empty()) {
      warn("--host-key: %s", k ? "the key file has no host line" : why.c_str());
      return ibtrs::errc(EINVAL);
    }
    (void)keys.set(k->host, ibtrs::HostKeys{{k->key}, k->server_key});
    o.authenticator = &keys;
  } else {
    warn("no --host-key: any client may connect, without authentication");
    o.allow_any_host = true;
  }
  return o;
}

int run_server(const ServerConfig& c) {
  sigset_t stop = block_stop_signals();

  // MAP_NORESERVE + anonymous: pages appear on first touch, so a large volume costs only what
  // the clients write (reads of untouched pages see the shared zero page).
  void* mem = mmap(nullptr, c.size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) {
    warn("mmap of a %" PRIu64 "-byte volume: %s", c.size, errtext(errno).c_str());
    return 1;
  }
  RamVolume volume(static_cast<std::byte*>(mem), c.size);

  ibtrs::KeyTable keys;
  auto opts = server_options(c, &volume, keys);
  if (!opts) {
    munmap(mem, c.size);
    return 2;
  }
  auto started = ibtrs::Server::start(std::move(*opts));
  if (!started) {
    warn("server start: %s", errtext(started.error()).c_str());
    munmap(mem, c.size);
    return 1;
  }
  std::unique_ptr<ibtrs::Server> server = std::move(started).value();

  std::string ready;
  for (const auto& a : server->addresses()) ready += "listening " + a.to_string() + "\n";
  {
    std::lock_guard lk(g_out_mu);
    std::fputs(ready.c_str(), stdout);
    std::fprintf(stdout, "volume %" PRIu64 " bytes, chunk %u, queue depth %u, max io %u\n", c.size, c.chunk_size,
                 c.queue_depth, c.chunk_size - ibtrs::ServerOptions{}.max_hdr_size);
    std::fflush(stdout);
  }
  int rc = 0;
  if (!c.ready_file.empty() && !write_ready_file(c.ready_file, ready)) rc = 1;

  if (rc == 0) {
    int sig = 0;
    while (sigwait(&stop, &sig) != 0) {
    }
    say("%s: stopping", sig == SIGINT ? "SIGINT" : "SIGTERM");
  }

  // Snapshot the live sessions first: the library reports their downs while the server stops,
  // which updates these records, but a session it would not report still gets printed.
  for (const auto& name : server->sessions())
    (void)server->with_session(name, [&](ibtrs::ServerSession& s) { volume.record(s, true); });
  server.reset();
  volume.print_records();
  munmap(mem, c.size);
  if (!c.ready_file.empty()) std::remove(c.ready_file.c_str());
  return rc;
}

// ================================ client ========================================================

enum class Rw { randread, randwrite, read, write, randrw };

struct ClientConfig {
  std::string session;
  std::vector<ibtrs::PathSpec> paths;
  ibtrs::MpPolicy policy = ibtrs::MpPolicy::min_inflight;
  Rw rw = Rw::randread;
  std::string rw_name = "randread";
  uint64_t bs = 4096;
  uint32_t qd = 1;
  double seconds = 0;
  uint64_t count = 0;
  uint64_t size = 1ull << 30;
  bool verify = false;
  uint32_t io_threads = 0;
  std::optional<uint32_t> hb_interval_ms;
  std::optional<uint32_t> hb_missed;
  std::optional<uint32_t> reconnect_delay_ms;
  std::optional<uint32_t> pending_timeout_ms;
  bool busy_poll = false;
  bool json = false;
  uint32_t interval_ms = 0;
  std::string control;
  std::string host_key;
  ibtrs::tls::Options tls;
};

ClientConfig parse_client(Args& a, bool paths_required = true) {
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

// Latency histogram, log-linear: exact below 128 ns, then 64 sub-buckets per power of two
// (under 1.6% error), so percentiles need no stored samples however long the run.
class LatHist {
 public:
  static constexpr size_t kBuckets = 58 * 64 + 128;

  void add(uint64_t ns) {
    ++b_[index(ns)];
    ++n_;
    max_ = std::max(max_, ns);
  }
  void merge(const LatHist& o) {
    for (size_t i = 0; i < kBuckets; ++i) b_[i] += o.b_[i];
    n_ += o.n_;
    max_ = std::max(max_, o.max_);
  }
  uint64_t count() const { return n_; }
  uint64_t max() const { return max_; }
  // The middle of the bucket holding the p-th sample, capped at the exact maximum.
  uint64_t percentile(double p) const {
    if (n_ == 0) return 0;
    uint64_t want = std::max<uint64_t>(1, static_cast<uint64_t>(p * static_cast<double>(n_) + 0.999999));
    uint64_t seen = 0;
    for (size_t i = 0; i < kBuckets; ++i) {
      seen += b_[i];
      if (seen >= want) return std::min(max_, middle(i));
    }
    return max_;
  }

 private:
  static size_t index(uint64_t v) {
    if (v < 128) return static_cast<size_t>(v);
    unsigned shift = static_cast<unsigned>(std::bit_width(v)) - 7;  // v >> shift is in [64, 128)
    return shift * 64 + static_cast<size_t>(v >> shift);
  }
  static uint64_t middle(size_t i) {
    if (i < 128) return i;
    size_t shift = i / 64 - 1;
    uint64_t low = static_cast<uint64_t>(i - shift * 64) << shift;
    return low + ((uint64_t{1} << shift) >> 1);
  }
  std::array<uint64_t, kBuckets> b_{};
  uint64_t n_ = 0;
  uint64_t max_ = 0;
};

using base::splitmix64;

// Generation 0 means "never written by this client": the block must read as zeros.
// kUnknownGen marks a block whose last write failed: its content is undefined until rewritten.
constexpr uint32_t kUnknownGen = UINT32_MAX;

// The data of a block at `offset` written for the `gen`-th time: each 512-byte sector starts
// with its own offset and the generation (so a mismatch can say whose data it found), the rest
// is the test pattern (base/pattern.h) of the generation at the sector's offsets. Generation 0
// is all zeros.
constexpr size_t kSectorHdr = 16;
base::Pattern sector_body(uint32_t gen) { return base::Pattern((uint64_t{kLoadMagic} << 32) | gen); }

void fill_pattern(std::byte* p, size_t len, uint64_t offset, uint32_t gen) {
  if (gen == 0) {
    std::memset(p, 0, len);
    return;
  }
  const base::Pattern body = sector_body(gen);
  for (size_t s = 0; s < len; s += 512) {
    const uint64_t hdr[2] = {offset + s, (uint64_t{kLoadMagic} << 32) | gen};
    std::memcpy(p + s, hdr, kSectorHdr);
    body.fill(std::span(p + s + kSectorHdr, 512 - kSectorHdr), offset + s + kSectorHdr);
  }
}

// Index of the first byte of the 512 at `p` that is not zero, or -1.
int64_t first_nonzero(const std::byte* p) {
  for (size_t i = 0; i < 512; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    if (w == 0) continue;
    while (p[i] == std::byte{0}) ++i;
    return static_cast<int64_t>(i);
  }
  return -1;
}

// Empty when the block holds what it should, else what is wrong with it.
std::string check_pattern(const std::byte* p, size_t len, uint64_t offset, uint32_t gen) {
  const base::Pattern body = sector_body(gen);
  for (size_t s = 0; s < len; s += 512) {
    const uint64_t want[2] = {gen == 0 ? 0 : offset + s, gen == 0 ? 0 : (uint64_t{kLoadMagic} << 32) | gen};
    uint64_t got[2];
    std::memcpy(got, p + s, kSectorHdr);
    int64_t first = -1;
    if (gen == 0) {
      first = first_nonzero(p + s);
    } else if (std::memcmp(want, got, kSectorHdr) != 0) {
      first = 0;
      while (reinterpret_cast<const unsigned char*>(want)[first] == reinterpret_cast<const unsigned char*>(got)[first])
        ++first;
    } else if (int64_t d = body.check(std::span(p + s + kSectorHdr, 512 - kSectorHdr), offset + s + kSectorHdr);
               d >= 0) {
      first = static_cast<int64_t>(kSectorHdr) + d;
    }
    if (first < 0) continue;
    char buf[320];
    std::string expect = gen == 0 ? "zeros (never written by this client; is the server volume fresh?)"
                                  : "generation " + std::to_string(gen);
    std::string found;
    if ((got[1] >> 32) == kLoadMagic) {
      found = "the data of offset " + std::to_string(got[0]) + " generation " + std::to_string(got[1] & 0xffffffffu);
      if (got[0] == want[0] && got[1] == want[1]) found += " with damaged bytes";
    } else {
      found = "other data";
    }
    std::snprintf(buf, sizeof(buf), "sector at %" PRIu64 ": expected %s, found %s (first difference at byte %zu)",
                  offset + s, expect.c_str(), found.c_str(), static_cast<size_t>(first));
    return buf;
  }
  return {};
}

class Load;

// One of the --qd requests kept in flight. A slot has at most one request in flight, and the
// library orders a request's completion before the next request of the slot, so everything but
// the counters read by the interval printer belongs to whichever thread runs the slot now.
struct alignas(64) Slot {
  Load* load = nullptr;
  std::byte* buf = nullptr;
  ibtrs::IoSeg seg;
  std::array<std::byte, sizeof(LoadHdr)> hdr{};
  uint64_t block = 0;
  ibtrs::IoDir dir = ibtrs::IoDir::read;
  uint32_t gen = 0;
  int64_t start_ns = 0;
  uint64_t rng = 0;
  std::atomic<uint64_t> ops{0};
  std::atomic<uint64_t> bytes{0};
  LatHist lat;
};

class Load {
 public:
  Load(const ClientConfig& c, ibtrs::ClientSession& s, const ibtrs::RegisteredMemory& mem)
      : c_(c), s_(s), nblocks_(c.size / c.bs), slots_(c.qd) {
    if (c.verify) {
      busy_ = std::make_unique<std::atomic<uint8_t>[]>(nblocks_);
      gen_ = std::make_unique<std::atomic<uint32_t>[]>(nblocks_);
    }
    uint64_t seed = static_cast<uint64_t>(now_ns());
    for (uint32_t i = 0; i < c.qd; ++i) {
      auto& sl = slots_[i];
      sl = std::make_unique<Slot>();
      sl->load = this;
      sl->buf = mem.data() + static_cast<size_t>(i) * c.bs;
      sl->seg = {sl->buf, static_cast<uint32_t>(c.bs), &mem};
      sl->rng = splitmix64(seed);
    }
  }

  // Starts the slots; from then on they run themselves from their completions.
  void start() {
    start_ns_ = now_ns();
    last_done_ns_.store(start_ns_, std::memory_order_relaxed);
    deadline_ns_ = c_.seconds > 0 ? start_ns_ + static_cast<int64_t>(c_.seconds * 1e9) : INT64_MAX;
    active_.store(c_.qd);
    for (auto& sl : slots_) submit(*sl, false);
  }

  // Ends the run early (a signal): slots retire at their next completion.
  void stop() {
    stopping_.store(true, std::memory_order_relaxed);
    wake();
  }

  // Main thread: waits up to `timeout` for the run to end, resubmitting requests a completion
  // could not (no permit). True when every slot retired.
  bool wait(std::chrono::milliseconds timeout) {
    std::vector<Slot*> parked;
    {
      std::unique_lock lk(mu_);
      cv_.wait_for(lk, timeout, [&] { return active_.load() == 0 || !parked_.empty(); });
      parked.swap(parked_);
    }
    for (Slot* s : parked) submit(*s, false);
    return active_.load() == 0;
  }

  int64_t start_ns() const { return start_ns_; }
  int64_t deadline_ns() const { return deadline_ns_; }
  uint64_t ops() const {
    uint64_t n = 0;
    for (const auto& s : slots_) n += s->ops.load(std::memory_order_relaxed);
    return n;
  }
  uint64_t bytes() const {
    uint64_t n = 0;
    for (const auto& s : slots_) n += s->bytes.load(std::memory_order_relaxed);
    return n;
  }
  uint64_t inflight() const { return active_.load(); }
  // Only once every slot retired.
  LatHist latency() const {
    LatHist h;
    for (const auto& s : slots_) h.merge(s->lat);
    return h;
  }
  int64_t end_ns() const { return last_done_ns_.load(); }
  uint64_t errors() const { return errors_.load(); }
  uint64_t verify_errors() const { return verify_errors_.load(); }
  uint64_t max_pause_ns() const { return max_pause_ns_.load(); }

 private:
  static void on_done(void* ctx, int err) {
    auto* s = static_cast<Slot*>(ctx);
    s->load->complete(*s, err);
  }

  void complete(Slot& s, int err) {
    int64_t now = now_ns();
    note_completion(now);
    s.lat.add(static_cast<uint64_t>(std::max<int64_t>(0, now - s.start_ns)));
    if (err != 0) {
      error(err, "request");
      if (c_.verify && s.dir == ibtrs::IoDir::write) gen_[s.block].store(kUnknownGen, std::memory_order_relaxed);
    } else {
      s.ops.store(s.ops.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
      s.bytes.store(s.bytes.load(std::memory_order_relaxed) + c_.bs, std::memory_order_relaxed);
      if (c_.verify) {
        if (s.dir == ibtrs::IoDir::write)
          gen_[s.block].store(s.gen, std::memory_order_relaxed);
        else if (s.gen != kUnknownGen)
          verify(s);
      }
    }
    if (c_.verify) busy_[s.block].store(0, std::memory_order_release);
    submit(s, true);
  }

  // Every completion moves the "last completion" mark forward; the biggest step is the longest
  // time the caller saw nothing complete. Completions on several threads race, so the mark only
  // ever moves forward.
  void note_completion(int64_t now) {
    int64_t prev = last_done_ns_.load(std::memory_order_relaxed);
    while (now > prev && !last_done_ns_.compare_exchange_weak(prev, now, std::memory_order_relaxed)) {
    }
    if (now <= prev) return;
    uint64_t gap = static_cast<uint64_t>(now - prev);
    uint64_t m = max_pause_ns_.load(std::memory_order_relaxed);
    while (gap > m && !max_pause_ns_.compare_exchange_weak(m, gap, std::memory_order_relaxed)) {
    }
  }

  void verify(Slot& s) {
    std::string what = check_pattern(s.buf, c_.bs, s.block * c_.bs, s.gen);
    if (what.empty()) return;
    if (verify_errors_.fetch_add(1) < 10) say("verify error: block %" PRIu64 ": %s", s.block, what.c_str());
  }

  void error(int err, const char* what) {
    if (errors_.fetch_add(1) < 10) say("io error: %s: %s", what, errtext(err).c_str());
  }

  bool claim_io(int64_t now) {
    if (stopping_.load(std::memory_order_relaxed)) return false;
    if (now >= deadline_ns_) {
      stopping_.store(true, std::memory_order_relaxed);
      return false;
    }
    if (c_.count && issued_.fetch_add(1, std::memory_order_relaxed) >= c_.count) return false;
    return true;
  }

  uint64_t pick_block(Slot& s) {
    bool sequential = c_.rw == Rw::read || c_.rw == Rw::write;
    uint64_t b = sequential ? cursor_.fetch_add(1, std::memory_order_relaxed) % nblocks_
                            : splitmix64(s.rng) % nblocks_;
    if (!c_.verify) return b;
    // Two requests on one block could complete in either order, and then no single "last
    // write" exists to check against; so a busy block is skipped. At most qd - 1 other blocks
    // are busy and nblocks >= qd, so the walk ends.
    for (;;) {
      uint8_t idle = 0;
      if (busy_[b].compare_exchange_strong(idle, 1, std::memory_order_acquire)) return b;
      b = (b + 1) % nblocks_;
    }
  }

  ibtrs::IoDir pick_dir(Slot& s) {
    switch (c_.rw) {
      case Rw::read: case Rw::randread: return ibtrs::IoDir::read;
      case Rw::write: case Rw::randwrite: return ibtrs::IoDir::write;
      case Rw::randrw: return (splitmix64(s.rng) & 1) ? ibtrs::IoDir::write : ibtrs::IoDir::read;
    }
    return ibtrs::IoDir::read;
  }

  void submit(Slot& s, bool from_callback) {
    if (!claim_io(now_ns())) return retire();
    s.block = pick_block(s);
    s.dir = pick_dir(s);
    uint64_t offset = s.block * c_.bs;
    if (c_.verify) {
      uint32_t g = gen_[s.block].load(std::memory_order_relaxed);
      if (s.dir == ibtrs::IoDir::write) {
        s.gen = g == kUnknownGen || g == kUnknownGen - 1 ? 1 : g + 1;
        fill_pattern(s.buf, c_.bs, offset, s.gen);
      } else {
        s.gen = g;
      }
    }
    LoadHdr h;
    h.offset = offset;
    h.len = static_cast<uint32_t>(c_.bs);
    std::memcpy(s.hdr.data(), &h, sizeof(h));

    ibtrs::IoRequest req;
    req.dir = s.dir;
    req.usr = s.hdr;
    req.data = std::span<const ibtrs::IoSeg>(&s.seg, 1);
    req.done = &Load::on_done;
    req.ctx = &s;
    s.start_ns = now_ns();
    // A callback must not block, and its own permit is free again by now, so it never waits;
    // should the library still have none, the main thread submits the slot with waiting.
    auto st = s_.request(req, from_callback ? ibtrs::PermitWait::no : ibtrs::PermitWait::yes);
    if (st) return;
    if (c_.verify) busy_[s.block].store(0, std::memory_order_release);
    if (from_callback && st.error().value() == EAGAIN) {
      std::lock_guard lk(mu_);
      parked_.push_back(&s);
      cv_.notify_all();
      return;
    }
    error(st.error().value(), "submit");
    retire();
  }

  void retire() {
    if (active_.fetch_sub(1) == 1) wake();
  }
  void wake() {
    std::lock_guard lk(mu_);
    cv_.notify_all();
  }

  const ClientConfig& c_;
  ibtrs::ClientSession& s_;
  const uint64_t nblocks_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::unique_ptr<std::atomic<uint8_t>[]> busy_;
  std::unique_ptr<std::atomic<uint32_t>[]> gen_;
  std::atomic<uint64_t> cursor_{0};
  std::atomic<uint64_t> issued_{0};
  std::atomic<bool> stopping_{false};
  std::atomic<uint32_t> active_{0};
  std::atomic<uint64_t> errors_{0};
  std::atomic<uint64_t> verify_errors_{0};
  std::atomic<int64_t> last_done_ns_{0};
  std::atomic<uint64_t> max_pause_ns_{0};
  int64_t start_ns_ = 0;
  int64_t deadline_ns_ = INT64_MAX;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Slot*> parked_;
};

// Reads commands from a FIFO while the load runs and applies them to the session. The FIFO is
// opened read-write so that writers coming and going never make it report end-of-file.
class ControlThread {
 public:
  ControlThread(std::string path, ibtrs::ClientSession& s) : path_(std::move(path)), s_(s) {}
  ~ControlThread() { stop(); }

  bool start() {
    struct stat st;
    if (stat(path_.c_str(), &st) != 0) {
      if (mkfifo(path_.c_str(), 0600) != 0) {
        warn("--control %s: mkfifo: %s", path_.c_str(), errtext(errno).c_str());
        return false;
      }
      created_ = true;
    } else if (!S_ISFIFO(st.st_mode)) {
      warn("--control %s: exists and is not a FIFO", path_.c_str());
      return false;
    }
    fd_ = open(path_.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (fd_ < 0 || pipe2(wake_, O_CLOEXEC) != 0) {
      warn("--control %s: %s", path_.c_str(), errtext(errno).c_str());
      return false;
    }
    th_ = std::thread([this] { run(); });
    return true;
  }

  void stop() {
    if (th_.joinable()) {
      char c = 0;
      (void)!write(wake_[1], &c, 1);
      th_.join();
    }
    for (int* fd : {&fd_, &wake_[0], &wake_[1]})
      if (*fd >= 0) close(std::exchange(*fd, -1));
    if (created_) unlink(path_.c_str());
    created_ = false;
  }

 private:
  void run() {
    std::string pending;
    for (;;) {
      pollfd p[2] = {{fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
      if (poll(p, 2, -1) < 0) {
        if (errno == EINTR) continue;
        warn("control: poll: %s", errtext(errno).c_str());
        return;
      }
      if (p[1].revents) return;
      char buf[4096];
      ssize_t n = read(fd_, buf, sizeof(buf));
      if (n <= 0) continue;
      pending.append(buf, static_cast<size_t>(n));
      size_t nl;
      while ((nl = pending.find('\n')) != std::string::npos) {
        std::string line = pending.substr(0, nl);
        pending.erase(0, nl + 1);
        handle(line);
      }
    }
  }

  void handle(std::string_view line) {
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.remove_suffix(1);
    while (!line.empty() && line.front() == ' ') line.remove_prefix(1);
    if (line.empty()) return;
    size_t sp = line.find(' ');
    std::string_view cmd = line.substr(0, sp);
    std::string_view arg = sp == std::string_view::npos ? std::string_view{} : line.substr(sp + 1);
    while (!arg.empty() && arg.front() == ' ') arg.remove_prefix(1);
    ibtrs::Status st;
    if (cmd == "disconnect") {
      st = s_.disconnect_path(arg);
    } else if (cmd == "reconnect") {
      st = s_.reconnect_path(arg);
    } else if (cmd == "remove") {
      st = s_.remove_path(arg);
    } else if (cmd == "add") {
      auto spec = ibtrs::PathSpec::parse(arg);
      st = spec ? s_.add_path(*spec) : ibtrs::Status(spec.error());
    } else if (cmd == "policy") {
      auto p = ibtrs::parse_mp_policy(arg);
      st = p ? s_.set_policy(*p) : ibtrs::Status(p.error());
    } else {
      say("control: %.*s: unknown command (disconnect|reconnect|remove NAME, add SPEC, policy P)",
          static_cast<int>(line.size()), line.data());
      return;
    }
    if (st)
      say("control: %.*s: ok", static_cast<int>(line.size()), line.data());
    else
      say("control: %.*s: %s", static_cast<int>(line.size()), line.data(), errtext(st.error()).c_str());
  }

  std::string path_;
  ibtrs::ClientSession& s_;
  bool created_ = false;
  int fd_ = -1;
  int wake_[2] = {-1, -1};
  std::thread th_;
};

void print_interval(const Load& load, ibtrs::ClientSession& s, double elapsed, uint64_t dops, double dt) {
  std::string line;
  char buf[128];
  std::snprintf(buf, sizeof(buf), "interval %.3fs iops %.0f inflight %" PRIu64, elapsed,
                dt > 0 ? static_cast<double>(dops) / dt : 0.0, load.inflight());
  line = buf;
  for (const auto& p : s.paths()) {
    std::snprintf(buf, sizeof(buf), " | %s %s ops %" PRIu64, p.name.c_str(),
                  std::string(ibtrs::to_string(p.state)).c_str(), p.stats.read_cnt + p.stats.write_cnt);
    line += buf;
  }
  say("%s", line.c_str());
}

int run_client(const ClientConfig& c) {
  sigset_t stop_set = block_stop_signals();
  const int64_t t0 = now_ns();
  // Event callbacks run on the session's control thread; after the run the teardown's path
  // downs are expected and not printed.
  auto quiet = std::make_shared<std::atomic<bool>>(false);

  ibtrs::ClientOptions o;
  o.session_name = c.session;
  o.paths = c.paths;
  o.io_threads = c.io_threads;
  o.policy = c.policy;
  if (c.hb_interval_ms) o.heartbeat.interval = std::chrono::milliseconds(*c.hb_interval_ms);
  if (c.hb_missed) o.heartbeat.missed_max = *c.hb_missed;
  if (c.reconnect_delay_ms) o.reconnect.delay = std::chrono::milliseconds(*c.reconnect_delay_ms);
  if (c.pending_timeout_ms) o.pending_timeout = std::chrono::milliseconds(*c.pending_timeout_ms);
  o.busy_poll = c.busy_poll;
  o.tls = c.tls;
  if (!c.host_key.empty()) {
    std::string why;
    auto a = ibtrs::client_auth_from_key_file(c.host_key, {}, &why);
    if (!a) {
      warn("--host-key: %s", why.c_str());
      return 2;
    }
    o.auth = std::move(*a);
  }
  o.on_event = [quiet, t0](const ibtrs::SessionEventInfo& e) {
    if (quiet->load()) return;
    say("event %.3fs %s %s%s%s", static_cast<double>(now_ns() - t0) / 1e9, std::string(ibtrs::to_string(e.event)).c_str(),
        e.path.c_str(), e.reason ? ": " : "", e.reason ? errtext(e.reason).c_str() : "");
  };

  const int64_t open_t0 = now_ns();
  auto opened = ibtrs::ClientSession::open(std::move(o));
  if (!opened) {
    warn("session %s: open: %s", c.session.c_str(), errtext(opened.error()).c_str());
    return 1;
  }
  // Session setup as the caller sees it: every path connected, the INFO exchange done.
  const double open_ms = static_cast<double>(now_ns() - open_t0) / 1e6;
  std::unique_ptr<ibtrs::ClientSession> sess = std::move(opened).value();

  if (c.bs > sess->max_io_size()) {
    warn("--bs %" PRIu64 " is larger than the session's max io size %u (the server's chunk size minus its header "
         "room): use a smaller --bs or start the server with a larger --chunk-size",
         c.bs, sess->max_io_size());
    return 1;
  }
  if (c.qd > sess->queue_depth()) {
    warn("--qd %u is larger than the session's queue depth %u (server --queue-depth)", c.qd, sess->queue_depth());
    return 1;
  }
  if (sess->max_usr_len(ibtrs::IoDir::read, 1) < sizeof(LoadHdr) ||
      sess->max_usr_len(ibtrs::IoDir::write, 1) < sizeof(LoadHdr)) {
    warn("the session cannot carry a %zu-byte user header", sizeof(LoadHdr));
    return 1;
  }
  if (c.verify && c.size / c.bs < c.qd) {
    warn("--verify needs at least --qd blocks of --bs in --size");
    return 1;
  }
  auto buf = sess->alloc_buffer(static_cast<size_t>(c.qd) * c.bs);
  if (!buf) {
    warn("alloc_buffer of %" PRIu64 " bytes: %s", static_cast<uint64_t>(c.qd) * c.bs, errtext(buf.error()).c_str());
    return 1;
  }
  std::unique_ptr<ibtrs::RegisteredMemory> mem = std::move(buf).value();

  say("session %s: %zu path(s), policy %s, queue depth %u, max io %u; %s bs %" PRIu64 " qd %u size %" PRIu64
      "%s",
      c.session.c_str(), c.paths.size(), std::string(ibtrs::to_string(sess->policy())).c_str(), sess->queue_depth(),
      sess->max_io_size(), c.rw_name.c_str(), c.bs, c.qd, c.size, c.verify ? " verify" : "");

  std::unique_ptr<ControlThread> control;
  if (!c.control.empty()) {
    control = std::make_unique<ControlThread>(c.control, *sess);
    if (!control->start()) return 1;
  }

  Load load(c, *sess, *mem);
  load.start();

  // Requests stuck past this point are a library bug; the tool reports it rather than hang.
  const auto drain_limit = std::chrono::seconds(90);
  int64_t next_report = c.interval_ms ? load.start_ns() + int64_t{c.interval_ms} * 1000000 : INT64_MAX;
  int64_t last_report = load.start_ns();
  uint64_t last_ops = 0;
  int64_t stop_at = INT64_MAX;
  bool signalled = false;
  for (;;) {
    int64_t now = now_ns();
    auto tick = std::chrono::milliseconds(50);
    if (next_report != INT64_MAX)
      tick = std::min(tick, std::chrono::milliseconds(std::max<int64_t>(1, (next_report - now) / 1000000 + 1)));
    if (load.wait(tick)) break;
    now = now_ns();
    if (now >= next_report) {
      uint64_t ops = load.ops();
      print_interval(load, *sess, static_cast<double>(now - load.start_ns()) / 1e9, ops - last_ops,
                     static_cast<double>(now - last_report) / 1e9);
      last_ops = ops;
      last_report = now;
      next_report += int64_t{c.interval_ms} * 1000000;
      if (next_report <= now) next_report = now + int64_t{c.interval_ms} * 1000000;
    }
    timespec zero{0, 0};
    int sig = sigtimedwait(&stop_set, nullptr, &zero);
    if (sig > 0 && !signalled) {
      signalled = true;
      say("%s: stopping the load", sig == SIGINT ? "SIGINT" : "SIGTERM");
      load.stop();
    }
    if (stop_at == INT64_MAX && (signalled || now >= load.deadline_ns()))
      stop_at = now;
    if (stop_at != INT64_MAX && now - stop_at > std::chrono::nanoseconds(drain_limit).count()) {
      warn("%" PRIu64 " request(s) still in flight %lld s after the end of the run: giving up", load.inflight(),
           static_cast<long long>(drain_limit.count()));
      // The session cannot be torn down under requests that use our buffer and slots.
      std::_Exit(1);
    }
  }
  if (control) control->stop();

  const uint64_t ops = load.ops();
  const uint64_t bytes = load.bytes();
  const double secs = std::max(1e-9, static_cast<double>(load.end_ns() - load.start_ns()) / 1e9);
  const LatHist lat = load.latency();
  const std::vector<ibtrs::ClientPathInfo> paths = sess->paths();

  quiet->store(true);
  mem.reset();
  sess.reset();

  const double iops = static_cast<double>(ops) / secs;
  const double mibs = mib(bytes) / secs;
  auto us = [](uint64_t ns) { return static_cast<double>(ns) / 1000.0; };
  say("%s bs %" PRIu64 " qd %u: %" PRIu64 " ops in %.3f s: %.0f IOPS, %.1f MiB/s", c.rw_name.c_str(), c.bs, c.qd, ops,
      secs, iops, mibs);
  say("latency us: p50 %.1f p99 %.1f p99.9 %.1f max %.1f; longest pause between completions %.3f ms",
      us(lat.percentile(0.5)), us(lat.percentile(0.99)), us(lat.percentile(0.999)), us(lat.max()),
      static_cast<double>(load.max_pause_ns()) / 1e6);
  say("errors %" PRIu64 ", verify errors %" PRIu64, load.errors(), load.verify_errors());
  for (const auto& p : paths)
    say("path %s %s: %s, failovered %" PRIu64 ", reconnects %" PRIu64 " ok %" PRIu64 " failed", p.name.c_str(),
        std::string(ibtrs::to_string(p.state)).c_str(), stats_text(p.stats).c_str(), p.stats.failovered,
        p.stats.reconnects_ok, p.stats.reconnects_failed);

  if (c.json) {
    std::string j;
    char buf2[512];
    std::snprintf(buf2, sizeof(buf2),
                  "{\"rw\":%s,\"bs\":%" PRIu64 ",\"qd\":%u,\"seconds\":%.3f,\"ops\":%" PRIu64 ",\"iops\":%.1f,"
                  "\"mib_s\":%.2f,\"errors\":%" PRIu64 ",\"verify_errors\":%" PRIu64 ",\"lat_p50_us\":%.1f,"
                  "\"lat_p99_us\":%.1f,\"lat_p999_us\":%.1f,\"lat_max_us\":%.1f,\"max_pause_ms\":%.3f,"
                  "\"open_ms\":%.3f,\"paths\":[",
                  json_str(c.rw_name).c_str(), c.bs, c.qd, secs, ops, iops, mibs, load.errors(), load.verify_errors(),
                  us(lat.percentile(0.5)), us(lat.percentile(0.99)), us(lat.percentile(0.999)), us(lat.max()),
                  static_cast<double>(load.max_pause_ns()) / 1e6, open_ms);
    j = buf2;
    for (size_t i = 0; i < paths.size(); ++i) {
      const auto& p = paths[i];
      std::snprintf(buf2, sizeof(buf2),
                    "%s{\"name\":%s,\"state\":%s,\"reads\":%" PRIu64 ",\"writes\":%" PRIu64 ",\"failovered\":%" PRIu64
                    ",\"reconnects_ok\":%" PRIu64 ",\"tls\":%s}",
                    i ? "," : "", json_str(p.name).c_str(), json_str(ibtrs::to_string(p.state)).c_str(),
                    p.stats.read_cnt, p.stats.write_cnt, p.stats.failovered, p.stats.reconnects_ok,
                    json_str(ibtrs::tls::describe(p.tls)).c_str());
      j += buf2;
    }
    j += "]}";
    say("%s", j.c_str());
  }
  return load.errors() == 0 && load.verify_errors() == 0 ? 0 : 1;
}

// `local`: the server of `sc` and then the client of `cc` in this process.
int run_local(const ServerConfig& sc, ClientConfig cc) {
  void* mem = mmap(nullptr, sc.size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) {
    warn("mmap of a %" PRIu64 "-byte volume: %s", sc.size, errtext(errno).c_str());
    return 1;
  }
  int rc = 1;
  {
    RamVolume volume(static_cast<std::byte*>(mem), sc.size);
    ibtrs::KeyTable keys;
    auto opts = server_options(sc, &volume, keys);
    auto started = opts ? ibtrs::Server::start(std::move(*opts)) : ibtrs::Result<std::unique_ptr<ibtrs::Server>>(opts.error());
    if (!started) {
      warn("server start: %s", errtext(started.error()).c_str());
    } else {
      std::unique_ptr<ibtrs::Server> server = std::move(started).value();
      if (cc.paths.empty()) {
        for (const auto& a : server->addresses()) cc.paths.push_back(ibtrs::PathSpec{std::nullopt, a});
      }
      rc = run_client(cc);
      server.reset();
    }
  }
  munmap(mem, sc.size);
  return rc;
}

int run(int argc, char** argv) {
  if (argc < 2) usage_error("server or client?");
  std::string_view mode = argv[1];
  if (mode == "--help" || mode == "-h" || mode == "help") {
    std::fputs(kUsage, stdout);
    return 0;
  }
  Args args(argc, argv, 2);
  if (mode == "server") return run_server(parse_server(args));
  if (mode == "client") return run_client(parse_client(args));
  if (mode == "local") {
    int split = 2;
    while (split < argc && std::string_view(argv[split]) != "--") ++split;
    Args sargs(argc, argv, 2, split);
    Args cargs(argc, argv, split < argc ? split + 1 : argc);
    ServerConfig sc = parse_server(sargs);
    return run_local(sc, parse_client(cargs, false));
  }
  usage_error("unknown mode '" + std::string(mode) + "'");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    warn("fatal: %s", e.what());
  } catch (...) {
    warn("fatal: unknown exception");
  }
  return 1;
}
