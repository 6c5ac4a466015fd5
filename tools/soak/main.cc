// ibnbd-soak: the history checker and fault scheduler of issue 17 (soak.h, history.h;
// tools/soak/README.md). Exceptions stop here: main() catches what escapes and exits 3.
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cinttypes>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/text.h"
#include "file_volume.h"
#include "history.h"
#include "ibnbd/client.h"
#include "ibnbd/migrate_volume.h"
#include "soak.h"

namespace ibnbd::soak {
namespace {

using json = nlohmann::ordered_json;
namespace mig = ibnbd::migrate;

constexpr uint32_t kMaxBlocksPerIo = 64;
constexpr int64_t kMs = 1000000;
// How long an eio fault may stay on past its planned time waiting for a request to reach it.
constexpr int64_t kEioGraceMs = 15000;

int64_t now_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

std::atomic<int> g_signal{0};
extern "C" void on_signal(int sig) { g_signal.store(sig); }

const char kUsage[] =
    "usage: ibnbd-soak TARGET [options]\n"
    "targets (one):\n"
    "  --lib DEVICE --paths P1[,P2...] [--host-key FILE] [--session NAME] [--io-threads N]\n"
    "        [--hb-interval-ms N] [--hb-missed N] [--reconnect-delay-ms N] [--policy P]\n"
    "        the client library maps DEVICE rw over its own session (as the fio engine does)\n"
    "  --nbd SOCKET --export NAME   an NBD export on a unix socket (the client daemon's);\n"
    "        reconnects when the export goes away and comes back (client daemon restarts)\n"
    "  --file PATH    a block device or file, O_DIRECT (/dev/ublkbN, /dev/nbdN)\n"
    "workload:\n"
    "  --seed N (default: random, printed)   --duration 60s|10m|2h   --interval 10s\n"
    "  --qd N (16)  --block-size B (4096)  --max-blocks N per request (16, <= 64)\n"
    "  --size BYTES (the first BYTES of the volume; default all)\n"
    "  --read-pct N (45)  --fua-pct N (10)  --flush-pct N (3); the rest are plain writes\n"
    "  --iops N   at most N requests a second (default: as fast as the volume goes)\n"
    "faults (on a schedule drawn from the seed):\n"
    "  --faults K1,K2,...   path-cut link-flap server-kill server-stop client-kill enospc eio\n"
    "        slow policy path-remove netem (policy and path-remove run in-process on --lib)\n"
    "  --hook CMD     runs `CMD start|stop KIND [ARGS]` for each fault (tools/soak/README.md)\n"
    "  --hook-log FILE    the hook's stdout and stderr (default: inherited)\n"
    "  --gap-ms MIN,MAX (3000,8000)   --max-faults N   --path-labels A,B\n"
    "  --hb-timeout-ms N   how long server-stop must outlast (default hb interval x missed)\n"
    "  --reconnect-timeout-ms N (60000)   --drain-timeout-ms N (120000)\n"
    "report:\n"
    "  --json FILE   --watch NAME=PIDFILE (RSS and fds of a daemon; repeatable)\n"
    "  --schedule-only   print the fault schedule of the seed and exit\n"
    "exit: 0 clean; 1 lost, torn, stale or corrupt blocks, unexplained errors, a failed hook\n"
    "or requests that never completed; 2 usage; 3 the volume could not be opened\n";

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "ibnbd-soak: %s\n%s", why.c_str(), kUsage);
  std::exit(2);
}

uint64_t parse_u64(const std::string& flag, const std::string& v) {
  uint64_t n = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (ec != std::errc() || p != v.data() + v.size()) usage(flag + ": '" + v + "' is not a number");
  return n;
}

// "90", "90s", "10m", "2h", "500ms" -> ms
uint64_t parse_duration_ms(const std::string& flag, const std::string& v) {
  size_t i = 0;
  while (i < v.size() && v[i] >= '0' && v[i] <= '9') ++i;
  if (i == 0) usage(flag + ": '" + v + "' is not a duration");
  const uint64_t n = parse_u64(flag, v.substr(0, i));
  const std::string unit = v.substr(i);
  if (unit.empty() || unit == "s") return n * 1000;
  if (unit == "ms") return n;
  if (unit == "m") return n * 60000;
  if (unit == "h") return n * 3600000;
  usage(flag + ": unit '" + unit + "' (ms, s, m, h)");
}

uint64_t parse_size(const std::string& flag, const std::string& v) {
  auto n = base::parse_size(v);
  if (!n) usage(flag + ": '" + v + "' is not a size (a number, optionally K, M, G or T)");
  return *n;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i <= s.size()) {
    size_t j = s.find(sep, i);
    if (j == std::string::npos) j = s.size();
    if (j > i) out.push_back(s.substr(i, j - i));
    i = j + 1;
  }
  return out;
}

std::string errno_name(int e) {
  switch (e) {
    case EIO: return "EIO";
    case ENOSPC: return "ENOSPC";
    case ECONNRESET: return "ECONNRESET";
    case EPIPE: return "EPIPE";
    case ENOTCONN: return "ENOTCONN";
    case ETIMEDOUT: return "ETIMEDOUT";
    case ESHUTDOWN: return "ESHUTDOWN";
    case EPROTO: return "EPROTO";
    case ENODEV: return "ENODEV";
    case ECONNABORTED: return "ECONNABORTED";
    case EINVAL: return "EINVAL";
    case ECANCELED: return "ECANCELED";
    default: return "errno" + std::to_string(e);
  }
}

// ---- options ----------------------------------------------------------------------------------

enum class Target : uint8_t { lib, nbd, file };

struct Options {
  Target target = Target::lib;
  bool target_set = false;
  std::string device;  // lib: device name; nbd: socket; file: path
  std::string export_name;
  std::vector<std::string> paths;
  std::string host_key, session, policy;
  uint32_t io_threads = 0;
  uint32_t hb_interval_ms = 1000, hb_missed = 5, reconnect_delay_ms = 500;
  uint64_t seed = 0;
  bool seed_set = false;
  uint64_t duration_ms = 60000, interval_ms = 10000;
  uint32_t qd = 16, block_bytes = 4096, max_blocks = 16;
  uint64_t size = 0;
  uint32_t read_pct = 45, fua_pct = 10, flush_pct = 3;
  uint32_t iops = 0;  // 0: as fast as the volume goes
  std::vector<FaultKind> faults;
  std::string hook, hook_log;
  uint32_t gap_min_ms = 3000, gap_max_ms = 8000, max_faults = 0;
  std::vector<std::string> path_labels{"A", "B"};
  uint32_t hb_timeout_ms = 0;
  uint32_t reconnect_timeout_ms = 60000, drain_timeout_ms = 120000;
  std::string json_path;
  std::vector<std::pair<std::string, std::string>> watches;
  bool schedule_only = false;
};

Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (a == "--schedule-only") {
      o.schedule_only = true;
      continue;
    }
    if (i + 1 >= argc) usage(a + " needs a value (or is unknown)");
    const std::string v = argv[++i];
    auto set_target = [&](Target t) {
      if (o.target_set) usage("one target: --lib, --nbd or --file");
      o.target = t;
      o.target_set = true;
      o.device = v;
    };
    if (a == "--lib") set_target(Target::lib);
    else if (a == "--nbd") set_target(Target::nbd);
    else if (a == "--file") set_target(Target::file);
    else if (a == "--export") o.export_name = v;
    else if (a == "--paths") o.paths = split(v, ',');
    else if (a == "--host-key") o.host_key = v;
    else if (a == "--session") o.session = v;
    else if (a == "--policy") o.policy = v;
    else if (a == "--io-threads") o.io_threads = static_cast<uint32_t>(parse_u64(a, v));
    else if (a == "--hb-interval-ms") o.hb_interval_ms = static_cast<uint32_t>(parse_u64(a, v));
    else if (a == "--hb-missed") o.hb_missed = static_cast<uint32_t>(parse_u64(a, v));
    else if (a == "--reconnect-delay-ms") o.reconnect_delay_ms = static_cast<uint32_t>(parse_u64(a, v));
    else if (a == "--seed") { o.seed = parse_u64(a, v); o.seed_set = true; }
    else if (a == "--duration") o.duration_ms = parse_duration_ms(a, v);
    else if (a == "--interval") o.interval_ms = parse_duration_ms(a, v);
    else if (a == "--qd") o.qd = static_cast<uint32_t>(parse_u64(a, v));
    else if (a == "--block-size") o.block_bytes = static_cast<uint32_t>(parse_size(a, v));
    else if (a == "--max-blocks") o.max_blocks = static_cast<uint32_t>(parse_u64(a, v));
    else if (a == "--size") o.size = parse_size(a, v);
    else if (a == "--read-pct") o.read_pct = static_cast<uint32_t>(parse_u64(a, v));
    else if (a == "--fua-pct") o.fua_pct = static_cast<uint32_t>(parse_u64(a, v));
    else if (a == "--flush-pct") o.flush_pct = static_cast<uint32_t>(parse_u64(a, v));
    else if (a == "--iops") o.iops = static_cast<uint32_t>(parse_u64(a, v));
    else if (a == "--faults") {
      for (const auto& k : split(v, ',')) {
        auto f = parse_fault(k);
        if (!f) usage("--faults: unknown fault '" + k + "'");
        o.faults.push_back(*f);
      }
    } else if (a == "--hook") o.hook = v;
    else if (a == "--hook-log") o.hook_log = v;
    else if (a == "--gap-ms") {
      auto p = split(v, ',');
      if (p.size() != 2) usage("--gap-ms MIN,MAX");
      o.gap_min_ms = static_cast<uint32_t>(parse_u64(a, p[0]));
      o.gap_max_ms = static_cast<uint32_t>(parse_u64(a, p[1]));
    } else if (a == "--max-faults") o.max_faults = static_cast<uint32_t>(parse_u64(a, v));
    else if (a == "--path-labels") o.path_labels = split(v, ',');
    else if (a == "--hb-timeout-ms") o.hb_timeout_ms = static_cast<uint32_t>(parse_u64(a, v));
    else if (a == "--reconnect-timeout-ms") o.reconnect_timeout_ms = static_cast<uint32_t>(parse_u64(a, v));
    else if (a == "--drain-timeout-ms") o.drain_timeout_ms = static_cast<uint32_t>(parse_u64(a, v));
    else if (a == "--json") o.json_path = v;
    else if (a == "--watch") {
      const auto eq = v.find('=');
      if (eq == std::string::npos || eq == 0) usage("--watch NAME=PIDFILE");
      o.watches.emplace_back(v.substr(0, eq), v.substr(eq + 1));
    } else usage("unknown option " + a);
  }
  if (!o.target_set) usage("a target: --lib, --nbd or --file");
  if (o.target == Target::lib && o.paths.empty()) usage("--lib needs --paths");
  if (o.block_bytes < kSector || o.block_bytes % kSector != 0 || o.block_bytes > (1u << 20))
    usage("--block-size: a multiple of 512 up to 1M");
  if (o.max_blocks == 0 || o.max_blocks > kMaxBlocksPerIo) usage("--max-blocks: 1..64");
  if (o.qd == 0 || o.qd > 1024) usage("--qd: 1..1024");
  if (o.read_pct + o.fua_pct + o.flush_pct > 100) usage("--read-pct + --fua-pct + --flush-pct > 100");
  if (o.interval_ms == 0) o.interval_ms = 10000;
  if (o.hb_timeout_ms == 0) o.hb_timeout_ms = o.hb_interval_ms * o.hb_missed;
  bool needs_hook = false;
  for (FaultKind k : o.faults)
    needs_hook |= !(o.target == Target::lib && (k == FaultKind::policy || k == FaultKind::path_remove));
  if (needs_hook && o.hook.empty() && !o.schedule_only) usage("--faults " + std::string("needs --hook"));
  if (o.target == Target::lib)
    for (FaultKind k : o.faults)
      if (k == FaultKind::client_kill) usage("client-kill needs a client daemon: --nbd or --file");
  if (!o.seed_set) {
    std::random_device rd;
    o.seed = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }
  if (o.session.empty()) o.session = "soak-" + std::to_string(::getpid());
  if (o.target == Target::nbd && o.export_name.empty()) usage("--nbd needs --export NAME");
  return o;
}

// ---- the hook ---------------------------------------------------------------------------------

// Runs `hook args...`, at most `timeout_ms`; its process group is killed after that. Returns
// its exit status (-1: could not run, 124: timed out).
int run_hook(const std::string& hook, const std::string& log, const std::vector<std::string>& args,
             int timeout_ms) {
  std::vector<std::string> argv_s = split(hook, ' ');  // "bash soak.sh hook": words, no quoting
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : argv_s) argv.push_back(s.data());
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    ::setpgid(0, 0);
    if (!log.empty()) {
      FILE* f = std::fopen(log.c_str(), "a");
      if (f != nullptr) {
        ::dup2(::fileno(f), 1);
        ::dup2(::fileno(f), 2);
      }
    }
    // Nothing of ours may outlive us in what the hook starts (a restarted server must not hold
    // this client's sockets).
    ::close_range(3, ~0u, 0);
    ::execvp(argv[0], argv.data());
    _exit(127);
  }
  ::setpgid(pid, pid);
  const int64_t deadline = now_ns() + static_cast<int64_t>(timeout_ms) * kMs;
  for (;;) {
    int st = 0;
    const pid_t r = ::waitpid(pid, &st, WNOHANG);
    if (r == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    if (r < 0 && errno != EINTR) return -1;
    if (now_ns() > deadline) {
      ::kill(-pid, SIGKILL);
      ::waitpid(pid, &st, 0);
      return 124;
    }
    ::usleep(20000);
  }
}

// ---- processes watched ------------------------------------------------------------------------

struct ProcSample {
  double t_s;
  int pid;
  uint64_t rss_kb;
  uint32_t fds;
};

struct Watch {
  std::string name;
  std::string pidfile;  // "self": this process
  std::vector<ProcSample> samples;  // one per --interval
  int last_pid = 0;
  uint32_t restarts = 0;  // pid changes seen (looked at once a second)
  uint64_t max_rss_kb = 0;
  uint32_t max_fds = 0;
};

bool sample_proc(int pid, uint64_t& rss_kb, uint32_t& fds) {
  std::ifstream st("/proc/" + std::to_string(pid) + "/status");
  if (!st) return false;
  std::string line;
  rss_kb = 0;
  while (std::getline(st, line)) {
    if (line.rfind("State:", 0) == 0 && line.find('Z') != std::string::npos) return false;  // killed, not reaped
    if (line.rfind("VmRSS:", 0) == 0) rss_kb = std::strtoull(line.c_str() + 6, nullptr, 10);
  }
  std::error_code ec;
  fds = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec))
    ++fds;
  return true;
}

// ---- the run ----------------------------------------------------------------------------------

enum class OpKind : uint8_t { read, write, flush };

struct Soak;

struct Slot {
  Soak* soak = nullptr;
  uint32_t index = 0;
  bool busy = false;
  OpKind op = OpKind::read;
  bool fua = false;
  bool verify = false;  // part of the final full verify
  uint64_t block = 0;
  uint32_t nblocks = 0;
  uint32_t gens[kMaxBlocksPerIo] = {};
  uint64_t cover = 0;
  int64_t submit_ns = 0;
  // Set by the completion (any thread), read by the driver after it took the slot off the list.
  int64_t done_ns = 0;
  int err = 0;
  uint32_t kills = 0;
  Slot* next = nullptr;
};

// A fault as it happened (driver thread only).
struct Window {
  uint32_t n = 0;
  FaultKind kind = FaultKind::path_cut;
  std::string arg;
  uint64_t eio_first = 0, eio_end = 0;  // byte range (eio)
  int64_t start_ns = 0;
  int64_t end_ns = INT64_MAX;
  int64_t pause_ns = 0;
  uint64_t errors = 0;  // explained by this fault
  int64_t hook_ms = 0;  // how long the hooks took (a restart, for instance)
  bool reported = false;
};

// What the fault thread tells the driver.
struct Event {
  enum Kind : uint8_t { open, close, failed } kind = open;
  uint32_t n = 0;
  FaultKind fault = FaultKind::path_cut;
  std::string arg;
  int64_t t_ns = 0;
  uint64_t eio_first = 0, eio_end = 0;
  int64_t hook_ms = 0;
  std::string why;
};

struct KindStats {
  std::vector<double> pauses_ms;
  uint64_t errors = 0;
};

struct Soak {
  Options o;
  std::unique_ptr<BlockSession> session;  // --lib
  std::shared_ptr<RemoteDevice> dev;
  std::unique_ptr<mig::Volume> vol;
  std::unique_ptr<mig::IoBuffer> buf;
  std::unique_ptr<History> hist;
  uint32_t logical = 512;
  uint64_t blocks = 0;
  uint64_t main_blocks = 0;  // [0, main_blocks): the workload; the rest: enospc probes only
  std::vector<uint8_t> busy_block;
  std::vector<Slot> slots;
  Rng rng{0};
  int efd = -1;
  std::atomic<Slot*> done_list{nullptr};
  std::atomic<uint32_t> kills_done{0};
  uint32_t inflight = 0;
  bool broken = false;  // nbd: the connection failed; reconnect when nothing is in flight
  int64_t broken_since = 0;
  uint32_t reconnects = 0;
  std::deque<uint64_t> reread;  // suspect blocks to read again

  // Fault thread <-> driver.
  std::vector<FaultPlan> plan;
  std::thread fault_thread;
  std::atomic<bool> stop_faults{false};
  std::atomic<bool> faults_done{false};
  // A fault between its start and the end of its stop hook (fault thread). IO goes on past the
  // run's end while one is on: a fault that started late (slow hooks under TCG, a long pause
  // before it) is still met by requests, so an eio or enospc fault can bite and its pause is
  // IO's, not its stop hook's. At most kFaultOverrunMs past the end.
  std::atomic<bool> fault_on{false};
  static constexpr int64_t kFaultOverrunMs = 120000;
  int64_t end_ns = 0;  // t0 + duration: no fault starts after it (set before the fault thread)
  std::mutex ev_mu;
  std::vector<Event> events;
  std::atomic<bool> have_events{false};
  std::atomic<bool> enospc_probe{false};
  std::atomic<uint64_t> eio_probe_first{0}, eio_probe_end{0};  // blocks; end 0: none
  std::vector<Window> windows;
  uint32_t hook_failures = 0;
  std::vector<std::string> hook_errors;

  // Counters (driver thread).
  int64_t t0 = 0;
  uint64_t reads = 0, writes = 0, fua_writes = 0, flushes = 0, read_bytes = 0, write_bytes = 0;
  uint64_t errors = 0, explained = 0, unexplained = 0;
  std::map<std::string, uint64_t> errors_by;
  uint64_t enospc_seen = 0, eio_seen = 0;
  std::atomic<uint64_t> eio_seen_pub{0};  // eio_seen for the fault thread
  int64_t last_ok_ns = 0;
  std::atomic<int64_t> last_ok_pub{0};  // last_ok_ns for the fault thread
  int64_t max_gap_ns = 0;
  int64_t max_submit_ns = 0;
  int64_t stall_reported = 0;  // last_ok_ns of the stall already described
  std::vector<std::string> defects;  // the first lines of each problem (bounded)
  uint64_t defect_lines = 0;
  bool hung = false;
  std::vector<Watch> watches;

  // Verify.
  bool verifying = false;
  uint64_t verify_cursor = 0;
  uint64_t verified_blocks = 0;

  void note_defect(const std::string& line) {
    ++defect_lines;
    if (defects.size() < 50) defects.push_back(line);
    if (defect_lines <= 20) std::printf("soak: DEFECT %s\n", line.c_str());
  }
  double t_s(int64_t ns) const { return static_cast<double>(ns - t0) / 1e9; }

  // ---- setup --------------------------------------------------------------------------------

  int open_volume() {
    if (o.target == Target::lib) {
      BlockSessionOptions so;
      so.transport.session_name = o.session;
      for (const auto& p : o.paths) {
        auto spec = ibtrs::PathSpec::parse(p);
        if (!spec) {
          std::fprintf(stderr, "ibnbd-soak: bad path '%s': %s\n", p.c_str(), spec.error().message().c_str());
          return 2;
        }
        so.transport.paths.push_back(*spec);
      }
      so.transport.io_threads = o.io_threads;
      // The session's path events with the run's clock: what a pause was made of.
      so.transport.on_event = [this](const ibtrs::SessionEventInfo& e) {
        std::printf("soak: t=%.1fs session: %s %s%s%s\n", t_s(now_ns()), std::string(ibtrs::to_string(e.event)).c_str(),
                    e.path.c_str(), e.reason ? ": " : "", e.reason ? e.reason.message().c_str() : "");
      };
      so.transport.heartbeat.interval = std::chrono::milliseconds(o.hb_interval_ms);
      so.transport.heartbeat.missed_max = o.hb_missed;
      so.transport.reconnect.delay = std::chrono::milliseconds(o.reconnect_delay_ms);
      so.transport.reconnect.backoff = std::chrono::milliseconds(o.reconnect_delay_ms);
      so.transport.reconnect.max_delay = std::chrono::milliseconds(std::max<uint32_t>(o.reconnect_delay_ms, 2000));
      if (!o.policy.empty()) {
        auto p = ibtrs::parse_mp_policy(o.policy);
        if (!p) usage("--policy: round-robin, min-inflight or min-latency");
        so.transport.policy = *p;
      }
      if (!o.host_key.empty()) {
        std::string why;
        auto a = ibtrs::client_auth_from_key_file(o.host_key, {}, &why);
        if (!a) {
          std::fprintf(stderr, "ibnbd-soak: --host-key: %s\n", why.c_str());
          return 3;
        }
        so.transport.auth = std::move(*a);
      }
      auto s = BlockSession::open(std::move(so));
      if (!s) {
        std::fprintf(stderr, "ibnbd-soak: session: %s\n", s.error().message().c_str());
        return 3;
      }
      session = std::move(*s);
      auto d = session->map(o.device, AccessMode::rw);
      if (!d) {
        std::fprintf(stderr, "ibnbd-soak: map %s: %s\n", o.device.c_str(), d.error().message().c_str());
        return 3;
      }
      dev = *d;
      logical = dev->geometry().logical_block_size;
      auto v = mig::device_volume(*session, dev);
      if (!v) return 3;
      vol = std::move(*v);
    } else if (o.target == Target::nbd) {
      auto v = mig::nbd_volume(o.device, o.export_name);
      if (!v) {
        std::fprintf(stderr, "ibnbd-soak: nbd %s: %s\n", o.device.c_str(), v.error().message().c_str());
        return 3;
      }
      vol = std::move(*v);
      logical = 512;  // the export's minimum block for a file; 4096-byte devices only tear less
    } else {
      auto v = file_volume(o.device, std::min<uint32_t>(o.qd, 16), &logical);
      if (!v) {
        std::fprintf(stderr, "ibnbd-soak: %s: %s\n", o.device.c_str(), v.error().message().c_str());
        return 3;
      }
      vol = std::move(*v);
    }
    return 0;
  }

  int setup() {
    t0 = now_ns();  // the session's events during the open; run() starts the clock again
    if (int rc = open_volume(); rc != 0) return rc;
    uint64_t size = vol->size();
    if (o.size != 0) size = std::min(size, o.size);
    if (logical > o.block_bytes || o.block_bytes % logical != 0) {
      std::fprintf(stderr, "ibnbd-soak: the device's logical block (%u) does not divide --block-size %u\n",
                   logical, o.block_bytes);
      return 3;
    }
    blocks = size / o.block_bytes;
    if (blocks < 64) {
      std::fprintf(stderr, "ibnbd-soak: the volume holds %" PRIu64 " blocks; at least 64 needed\n", blocks);
      return 3;
    }
    main_blocks = blocks;
    if (std::find(o.faults.begin(), o.faults.end(), FaultKind::enospc) != o.faults.end())
      main_blocks = blocks - std::max<uint64_t>(blocks / 16, 16);  // holes for enospc's probes
    hist = std::make_unique<History>(blocks, o.block_bytes, logical, o.seed);
    busy_block.assign(blocks, 0);
    rng = Rng(o.seed);
    if (int rc = alloc_buffers(); rc != 0) return rc;
    efd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (efd < 0) return 3;
    for (auto& [name, file] : o.watches) watches.push_back(Watch{name, file, {}, 0, 0});
    return 0;
  }

  int alloc_buffers() {
    const size_t per = static_cast<size_t>(o.max_blocks) * o.block_bytes;
    auto b = vol->alloc(per * o.qd);
    if (!b) {
      std::fprintf(stderr, "ibnbd-soak: buffers: %s\n", b.error().message().c_str());
      return 3;
    }
    buf = std::move(*b);
    if (slots.empty()) {
      slots = std::vector<Slot>(o.qd);
      for (uint32_t i = 0; i < o.qd; ++i) {
        slots[i].soak = this;
        slots[i].index = i;
      }
    }
    return 0;
  }
  std::byte* data_of(const Slot& s) const {
    return buf->data() + static_cast<size_t>(s.index) * o.max_blocks * o.block_bytes;
  }
  size_t off_of(const Slot& s) const { return static_cast<size_t>(s.index) * o.max_blocks * o.block_bytes; }

  // ---- completions --------------------------------------------------------------------------

  static void on_done(void* ctx, int err) {
    auto* s = static_cast<Slot*>(ctx);
    Soak* k = s->soak;
    s->err = err;
    s->done_ns = now_ns();
    s->kills = k->kills_done.load(std::memory_order_acquire);
    Slot* head = k->done_list.load(std::memory_order_relaxed);
    do {
      s->next = head;
    } while (!k->done_list.compare_exchange_weak(head, s, std::memory_order_release, std::memory_order_relaxed));
    if (head == nullptr) {
      const uint64_t one = 1;
      (void)!::write(k->efd, &one, sizeof one);
    }
  }

  void wait_completions(int timeout_ms) {
    if (done_list.load(std::memory_order_acquire) != nullptr) return;
    pollfd p{efd, POLLIN, 0};
    ::poll(&p, 1, timeout_ms);
    uint64_t v;
    (void)!::read(efd, &v, sizeof v);
  }

  void process_completions() {
    Slot* list = done_list.exchange(nullptr, std::memory_order_acquire);
    Slot* fifo = nullptr;
    while (list != nullptr) {  // newest first: reverse
      Slot* n = list->next;
      list->next = fifo;
      fifo = list;
      list = n;
    }
    for (Slot* s = fifo; s != nullptr;) {
      Slot* n = s->next;
      complete(*s);
      s = n;
    }
  }

  bool connection_error(int e) const {
    return o.target == Target::nbd &&
           (e == ECONNRESET || e == EPIPE || e == ENOTCONN || e == EPROTO || e == ESHUTDOWN);
  }

  bool allows(const Window& w, const Slot& s) const {
    switch (w.kind) {
      case FaultKind::client_kill:
        return connection_error(s.err) || s.err == EIO;
      case FaultKind::enospc:
        return s.err == ENOSPC && s.op == OpKind::write;
      case FaultKind::eio: {
        if (s.err != EIO || s.op == OpKind::flush) return false;
        const uint64_t a = s.block * o.block_bytes, b = a + uint64_t{s.nblocks} * o.block_bytes;
        return a < w.eio_end && w.eio_first < b;
      }
      default:
        return false;
    }
  }

  // Which fault explains a failed request: one that allows the errno and overlapped it in time.
  Window* explain(const Slot& s) {
    constexpr int64_t kSlack = 1000 * kMs;  // timestamps of two threads, a hook's last steps
    for (auto it = windows.rbegin(); it != windows.rend(); ++it) {
      const int64_t end = it->end_ns == INT64_MAX ? INT64_MAX : it->end_ns + kSlack;
      if (s.submit_ns <= end && s.done_ns >= it->start_ns - kSlack && allows(*it, s)) return &*it;
    }
    return nullptr;
  }

  // A successful completion at t: the time since the previous one is a pause, which belongs to
  // the fault that was on when it began (the latest one started by then, or up to kLead after:
  // the last completion before a fault's stall precedes its start a little), else to the first
  // one that started during it; a pause that begins within kGrace after a fault ended (a remap
  // after a restart) is still that fault's. Faults run one after the other, so the walk from
  // the newest stops at the first one that ended before the pause began.
  void note_ok(int64_t t) {
    if (t <= last_ok_ns) return;
    const int64_t a = last_ok_ns, gap = t - a;
    last_ok_ns = t;
    last_ok_pub.store(t, std::memory_order_relaxed);
    max_gap_ns = std::max(max_gap_ns, gap);
    constexpr int64_t kGrace = 2000 * kMs, kLead = 100 * kMs;
    Window* before = nullptr;
    Window* after = nullptr;
    for (auto it = windows.rbegin(); it != windows.rend(); ++it) {
      if (it->end_ns != INT64_MAX && it->end_ns + kGrace < a) break;
      if (it->start_ns > t) continue;
      if (it->start_ns <= a + kLead) {
        before = &*it;
        break;
      }
      after = &*it;
    }
    if (Window* w = before != nullptr ? before : after) w->pause_ns = std::max(w->pause_ns, gap);
  }

  void complete(Slot& s) {
    --inflight;
    s.busy = false;
    for (uint32_t i = 0; i < s.nblocks; ++i) busy_block[s.block + i] = 0;
    if (s.err == 0) note_ok(s.done_ns);
    if (s.err != 0) {
      ++errors;
      ++errors_by[errno_name(s.err)];
      if (s.err == ENOSPC) ++enospc_seen;
      if (s.err == EIO) eio_seen_pub.store(++eio_seen, std::memory_order_relaxed);
      Window* w = s.verify ? nullptr : explain(s);
      if (w != nullptr) {
        ++explained;
        ++w->errors;
      } else {
        ++unexplained;
        note_defect("t=" + fmt(t_s(s.done_ns)) + "s unexplained error " + errno_name(s.err) + " on " +
                    op_name(s) + " of blocks " + std::to_string(s.block) + "+" + std::to_string(s.nblocks));
      }
      if (connection_error(s.err) && !broken) {
        broken = true;
        broken_since = now_ns();
        std::printf("soak: t=%.1fs the NBD connection failed (%s); reconnecting when idle\n", t_s(s.done_ns),
                    errno_name(s.err).c_str());
      }
    }
    hist->set_kills(kills_done.load(std::memory_order_acquire));
    switch (s.op) {
      case OpKind::flush:
        hist->flush_done(s.cover, s.err);
        break;
      case OpKind::write:
        for (uint32_t i = 0; i < s.nblocks; ++i) hist->write_done(s.block + i, s.gens[i], s.fua, s.err, s.kills);
        break;
      case OpKind::read:
        if (s.err != 0) {
          if (s.verify)  // the verify must not skip them: again later
            for (uint32_t i = 0; i < s.nblocks; ++i) reread.push_back(s.block + i);
          break;
        }
        for (uint32_t i = 0; i < s.nblocks; ++i) {
          const uint64_t b = s.block + i;
          std::string why;
          const Verdict v = hist->check_read(b, data_of(s) + static_cast<size_t>(i) * o.block_bytes, &why);
          if (s.verify && v != Verdict::suspect) ++verified_blocks;
          switch (v) {
            case Verdict::ok:
              break;
            case Verdict::suspect:
              reread.push_back(b);
              break;
            case Verdict::lost_allowed:
              if (hist->counts().lost_allowed <= 20) std::printf("soak: t=%.1fs %s\n", t_s(s.done_ns), why.c_str());
              break;
            default:
              note_defect("t=" + fmt(t_s(s.done_ns)) + "s " + to_string(v) + ": " + why);
          }
        }
        break;
    }
  }

  static std::string fmt(double v) {
    char b[32];
    std::snprintf(b, sizeof b, "%.1f", v);
    return b;
  }
  static std::string op_name(const Slot& s) {
    switch (s.op) {
      case OpKind::read: return "read";
      case OpKind::write: return s.fua ? "FUA write" : "write";
      case OpKind::flush: return "flush";
    }
    return "?";
  }

  // ---- submission ---------------------------------------------------------------------------

  bool lock_range(uint64_t b, uint32_t n) {
    for (uint32_t i = 0; i < n; ++i)
      if (busy_block[b + i]) return false;
    for (uint32_t i = 0; i < n; ++i) busy_block[b + i] = 1;
    return true;
  }

  uint32_t draw_len() {
    // Mostly small requests, some up to --max-blocks (a 64 KiB+ write is split by the library).
    const uint64_t r = rng.below(100);
    if (r < 60) return 1;
    if (r < 85) return static_cast<uint32_t>(std::min<uint64_t>(o.max_blocks, rng.range(2, 4)));
    return static_cast<uint32_t>(rng.range(1, o.max_blocks));
  }

  // Picks the next request into `s`; false when nothing can go now (its blocks are busy).
  bool choose(Slot& s) {
    s.verify = false;
    s.fua = false;
    if (verifying) {
      while (!reread.empty()) {
        const uint64_t b = reread.front();
        if (!lock_range(b, 1)) return false;
        reread.pop_front();
        s.op = OpKind::read;
        s.block = b;
        s.nblocks = 1;
        s.verify = true;
        return true;
      }
      if (verify_cursor >= blocks) return false;
      const auto n = static_cast<uint32_t>(std::min<uint64_t>(o.max_blocks, blocks - verify_cursor));
      if (!lock_range(verify_cursor, n)) return false;
      s.op = OpKind::read;
      s.block = verify_cursor;
      s.nblocks = n;
      s.verify = true;
      verify_cursor += n;
      return true;
    }
    if (!reread.empty() && lock_range(reread.front(), 1)) {
      s.op = OpKind::read;
      s.block = reread.front();
      s.nblocks = 1;
      reread.pop_front();
      return true;
    }
    const uint64_t pick = rng.below(100);
    if (pick < o.flush_pct) {
      s.op = OpKind::flush;
      s.nblocks = 0;
      s.block = 0;
      return true;
    }
    s.op = pick < o.flush_pct + o.read_pct ? OpKind::read : OpKind::write;
    s.fua = s.op == OpKind::write && pick < o.flush_pct + o.read_pct + o.fua_pct;
    uint64_t first = 0, end = main_blocks;
    // While a fault of the backend is on, a quarter of the requests go where it bites.
    const uint64_t ef = eio_probe_first.load(), ee = eio_probe_end.load();
    if (enospc_probe.load() && s.op == OpKind::write && rng.below(4) == 0) {
      first = main_blocks;
      end = blocks;
    } else if (ee > ef && rng.below(4) == 0) {
      first = ef;
      end = ee;
    }
    for (int tries = 0; tries < 4; ++tries) {
      const uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(draw_len(), end - first));
      const uint64_t b = first + rng.below(end - first - n + 1);
      if (lock_range(b, n)) {
        s.block = b;
        s.nblocks = n;
        return true;
      }
    }
    return false;
  }

  void submit(Slot& s) {
    s.busy = true;
    ++inflight;
    s.err = 0;
    s.submit_ns = now_ns();
    const size_t len = static_cast<size_t>(s.nblocks) * o.block_bytes;
    const uint64_t off = s.block * o.block_bytes;
    const mig::VolumeDone done{&Soak::on_done, &s};
    ibtrs::Status st;
    struct Timed {  // how long the submit call itself took (the library's never blocks)
      Soak& k;
      int64_t t = now_ns();
      ~Timed() { k.max_submit_ns = std::max(k.max_submit_ns, now_ns() - t); }
    } timed{*this};
    switch (s.op) {
      case OpKind::read:
        ++reads;
        read_bytes += len;
        st = vol->read(*buf, off_of(s), off, len, done);
        break;
      case OpKind::write:
        ++writes;
        if (s.fua) ++fua_writes;
        write_bytes += len;
        for (uint32_t i = 0; i < s.nblocks; ++i) {
          s.gens[i] = hist->begin_write(s.block + i);
          stamp_block(data_of(s) + static_cast<size_t>(i) * o.block_bytes, o.block_bytes, o.seed, s.block + i,
                      s.gens[i]);
        }
        st = vol->write(*buf, off_of(s), off, len, s.fua, done);
        break;
      case OpKind::flush:
        ++flushes;
        s.cover = hist->flush_begin();
        st = vol->flush(done);
        break;
    }
    if (!st.ok()) on_done(&s, st.error().value() != 0 ? st.error().value() : EIO);  // as if it failed
  }

  // --iops: a token bucket of qd tokens (no burst after a pause larger than the queue).
  int64_t next_token_ns = 0;
  bool throttled = false;
  bool take_token() {
    if (o.iops == 0 || verifying) return true;
    const int64_t now = now_ns(), step = 1000000000 / o.iops;
    next_token_ns = std::max(next_token_ns, now - step * o.qd);
    if (next_token_ns > now) return false;
    next_token_ns += step;
    return true;
  }

  void fill() {
    throttled = false;
    for (auto& s : slots) {
      if (s.busy) continue;
      if (!take_token()) {
        throttled = true;
        return;
      }
      if (!choose(s)) {
        next_token_ns -= o.iops != 0 && !verifying ? 1000000000 / o.iops : 0;  // not spent
        return;
      }
      submit(s);
    }
  }

  // ---- nbd reconnect ------------------------------------------------------------------------

  void reconnect() {
    std::printf("soak: t=%.1fs reconnecting to %s\n", t_s(now_ns()), o.device.c_str());
    buf.reset();
    vol.reset();
    const int64_t deadline = now_ns() + static_cast<int64_t>(o.reconnect_timeout_ms) * kMs;
    while (now_ns() < deadline && g_signal.load() == 0) {
      apply_events();
      auto v = mig::nbd_volume(o.device, o.export_name);
      if (v) {
        vol = std::move(*v);
        if (alloc_buffers() != 0) break;
        broken = false;
        ++reconnects;
        std::printf("soak: t=%.1fs reconnected after %.1f s\n", t_s(now_ns()),
                    static_cast<double>(now_ns() - broken_since) / 1e9);
        return;
      }
      ::usleep(200000);
    }
    note_defect("could not reconnect to the NBD export within " + std::to_string(o.reconnect_timeout_ms) + " ms");
  }

  // ---- faults -------------------------------------------------------------------------------

  void post(Event e) {
    std::lock_guard lk(ev_mu);
    events.push_back(std::move(e));
    have_events.store(true, std::memory_order_release);
  }

  void apply_events() {
    if (!have_events.load(std::memory_order_acquire)) return;
    std::vector<Event> ev;
    {
      std::lock_guard lk(ev_mu);
      ev.swap(events);
      have_events.store(false, std::memory_order_relaxed);
    }
    for (auto& e : ev) {
      if (e.kind == Event::open) {
        Window w;
        w.n = e.n;
        w.kind = e.fault;
        w.arg = e.arg;
        w.start_ns = e.t_ns;
        w.eio_first = e.eio_first;
        w.eio_end = e.eio_end;
        windows.push_back(w);
        std::printf("soak: t=%.1fs fault #%u %s %s\n", t_s(e.t_ns), e.n, std::string(to_string(e.fault)).c_str(),
                    e.arg.c_str());
      } else {
        for (auto& w : windows)
          if (w.n == e.n) {
            w.end_ns = e.t_ns;
            w.hook_ms = e.hook_ms;
          }
        if (e.kind == Event::failed) {
          ++hook_failures;
          note_defect("fault #" + std::to_string(e.n) + " " + std::string(to_string(e.fault)) + ": " + e.why);
        }
      }
    }
  }

  // The pause of a fault is final once IO flowed again after it, or 30 s after it ended.
  void report_windows(bool all) {
    const int64_t now = now_ns();
    for (auto& w : windows) {
      if (w.reported || w.end_ns == INT64_MAX) continue;
      if (!all && !(last_ok_ns > w.end_ns + 2000 * kMs || now > w.end_ns + 30000 * kMs)) continue;
      w.reported = true;
      std::printf("soak: fault #%u %s %s: %.0f ms (hooks %" PRId64 " ms), IO pause %.1f ms, errors %" PRIu64 "\n",
                  w.n, std::string(to_string(w.kind)).c_str(), w.arg.c_str(),
                  static_cast<double>(w.end_ns - w.start_ns) / 1e6, w.hook_ms,
                  static_cast<double>(w.pause_ns) / 1e6, w.errors);
    }
  }

  // Fault thread.
  int hook(const std::vector<std::string>& args, std::string& why, int64_t& hook_ms) {
    const int64_t t = now_ns();
    const int rc = run_hook(o.hook, o.hook_log, args, 90000);
    hook_ms += (now_ns() - t) / kMs;
    if (rc != 0) {
      why = "hook";
      for (auto& a : args) why += " " + a;
      why += rc == 124 ? ": timed out after 90 s" : ": exit " + std::to_string(rc);
    }
    return rc;
  }

  // Sleeps until `t` unless told to stop; true when it slept the whole time.
  // False once the run is ending, also for a time already past: a fault that is late (the one
  // before ran long: slow hooks under TCG) must not start after the end, or the schedule's rest
  // would run one by one, each waiting up to 60 s for IO that has stopped.
  bool sleep_until(int64_t t) {
    if (stop_faults.load()) return false;
    while (now_ns() < t) {
      if (stop_faults.load()) return false;
      ::usleep(static_cast<useconds_t>(std::min<int64_t>(50000, (t - now_ns()) / 1000 + 1)));
    }
    return true;
  }

  Status lib_fault(const FaultPlan& p, bool start) {
    auto& t = session->transport();
    if (p.kind == FaultKind::policy) {
      auto pol = ibtrs::parse_mp_policy(p.arg);
      if (!pol) return ibtrs::errc(EINVAL);
      return t.set_policy(*pol);
    }
    // path_remove: the path of the label's index.
    size_t idx = 0;
    for (size_t i = 0; i < o.path_labels.size(); ++i)
      if (o.path_labels[i] == p.arg) idx = i;
    if (idx >= o.paths.size()) return ibtrs::errc(EINVAL);
    auto spec = ibtrs::PathSpec::parse(o.paths[idx]);
    if (!spec) return spec.error();
    return start ? t.remove_path(spec->name()) : t.add_path(*spec);
  }

  // The plan's times are the earliest: a fault also waits until IO flowed again after the one
  // before (at most 60 s) and then the shortest gap, so that each pause has one cause.
  void run_faults() {
    uint32_t n = 0;
    int64_t prev_end = 0;
    for (const auto& p : plan) {
      int64_t start = t0 + static_cast<int64_t>(p.at_ms) * kMs;
      if (prev_end != 0) {
        const int64_t give_up = now_ns() + 60000 * kMs;
        while (last_ok_pub.load(std::memory_order_relaxed) <= prev_end && now_ns() < give_up && !stop_faults.load())
          ::usleep(10000);
        start = std::max(start, last_ok_pub.load(std::memory_order_relaxed) + int64_t{o.gap_min_ms} * kMs);
      }
      if (!sleep_until(start) || now_ns() >= end_ns) break;
      fault_on.store(true);
      ++n;
      Event opened;
      opened.kind = Event::open;
      opened.n = n;
      opened.fault = p.kind;
      opened.arg = p.arg;
      opened.t_ns = now_ns();
      std::vector<std::string> extra;
      if (!p.arg.empty()) extra.push_back(p.arg);
      if (p.kind == FaultKind::netem) {  // the hook gets `start netem A delay 5ms 1ms loss ...`
        for (size_t a = 0, b; a < p.netem.size(); a = b + 1) {
          b = std::min(p.netem.find(' ', a), p.netem.size());
          extra.push_back(p.netem.substr(a, b - a));
        }
      }
      if (p.kind == FaultKind::eio) {
        opened.eio_first = p.eio_block * o.block_bytes;
        opened.eio_end = (p.eio_block + p.eio_blocks) * o.block_bytes;
        extra = {std::to_string(opened.eio_first), std::to_string(opened.eio_end - opened.eio_first)};
      }
      post(opened);
      std::string why;
      int64_t hook_ms = 0;
      const std::string kind(to_string(p.kind));
      auto args = [&](const char* phase) {
        std::vector<std::string> a{phase, kind};
        a.insert(a.end(), extra.begin(), extra.end());
        return a;
      };
      const bool internal = o.target == Target::lib && (p.kind == FaultKind::policy || p.kind == FaultKind::path_remove);
      int rc = 0;
      if (internal) {
        const int64_t t = now_ns();
        auto st = lib_fault(p, true);
        if (st.ok() && p.kind == FaultKind::path_remove) {
          sleep_until(now_ns() + int64_t{p.dur_ms} * kMs);
          st = lib_fault(p, false);
        }
        hook_ms = (now_ns() - t) / kMs;
        if (!st.ok()) {
          rc = 1;
          why = kind + " " + p.arg + ": " + st.error().message();
        }
      } else if (p.kind == FaultKind::link_flap) {
        for (auto [down, up] : p.flaps) {
          if ((rc = hook(args("start"), why, hook_ms)) != 0) break;
          ::usleep(down * 1000);  // a flap is not cut short: the link must come back up
          if ((rc = hook(args("stop"), why, hook_ms)) != 0) break;
          if (!sleep_until(now_ns() + int64_t{up} * kMs)) break;
        }
      } else if (p.kind == FaultKind::policy) {
        rc = hook(args("start"), why, hook_ms);
      } else {
        const uint64_t eio_before = eio_seen_pub.load(std::memory_order_relaxed);
        rc = hook(args("start"), why, hook_ms);
        if (rc == 0) {
          if (p.kind == FaultKind::server_kill) kills_done.fetch_add(1, std::memory_order_release);
          if (p.kind == FaultKind::enospc) enospc_probe.store(true);
          if (p.kind == FaultKind::eio) {
            eio_probe_first.store(p.eio_block);
            eio_probe_end.store(p.eio_block + p.eio_blocks);
          }
          // The fault lasts its time even when the run is stopping: its stop always runs.
          const int64_t until = now_ns() + int64_t{p.dur_ms} * kMs;
          while (now_ns() < until && g_signal.load() == 0) ::usleep(20000);
          // An eio fault that no request reached proves nothing about how EIO travels: on a
          // loaded host the device-mapper swap and the IO pause around it can take the whole
          // window (seen in CI: 7 s of hooks, then 1.3 s with no request in 7 blocks of 4096).
          // It stays on until a request has seen its EIO, for at most kEioGraceMs more.
          if (p.kind == FaultKind::eio) {
            const int64_t grace = now_ns() + kEioGraceMs * kMs;
            while (eio_seen_pub.load(std::memory_order_relaxed) == eio_before && now_ns() < grace &&
                   g_signal.load() == 0)
              ::usleep(20000);
          }
          enospc_probe.store(false);
          eio_probe_first.store(0);
          eio_probe_end.store(0);
        }
        // The stop runs even after a failed start: whatever half-happened is undone.
        std::string why2;
        const int rc2 = hook(args("stop"), why2, hook_ms);
        if (rc == 0 && rc2 != 0) {
          rc = rc2;
          why = why2;
        }
      }
      Event closed;
      closed.kind = rc == 0 ? Event::close : Event::failed;
      closed.n = n;
      closed.fault = p.kind;
      closed.arg = p.arg;
      closed.t_ns = now_ns();
      closed.hook_ms = hook_ms;
      closed.why = why;
      post(closed);
      fault_on.store(false);
      prev_end = closed.t_ns;
      if (rc != 0) break;  // the environment is not what the plan assumes any more
    }
    faults_done.store(true);
  }

  // ---- reporting ----------------------------------------------------------------------------

  // Once per stall (1 s without a completion while requests are out): what waits, and where.
  void report_stall() {
    const int64_t now = now_ns();
    if (inflight == 0 || now - last_ok_ns < 1000 * kMs || stall_reported == last_ok_ns) return;
    stall_reported = last_ok_ns;
    int64_t oldest = now;
    for (auto& s : slots)
      if (s.busy) oldest = std::min(oldest, s.submit_ns);
    std::string paths;
    if (session) {
      for (auto& p : session->transport().paths())
        paths += " " + p.name + " " + std::string(ibtrs::to_string(p.state)) + " inflight " +
                 std::to_string(p.inflight) + ";";
    }
    std::printf("soak: t=%.1fs stall: no completion for %.0f ms, %u requests out (oldest %.0f ms)%s\n", t_s(now),
                static_cast<double>(now - last_ok_ns) / 1e6, inflight, static_cast<double>(now - oldest) / 1e6,
                paths.c_str());
  }

  // Once a second (store: false) for restarts and maxima; at each interval also a sample.
  void sample_watches(bool store = true) {
    for (auto& w : watches) {
      int pid = 0;
      if (w.pidfile == "self") {
        pid = ::getpid();
      } else {
        std::ifstream f(w.pidfile);
        if (!(f >> pid)) continue;
      }
      uint64_t rss = 0;
      uint32_t fds = 0;
      if (!sample_proc(pid, rss, fds)) continue;
      if (w.last_pid != 0 && pid != w.last_pid) ++w.restarts;
      w.last_pid = pid;
      w.max_rss_kb = std::max(w.max_rss_kb, rss);
      w.max_fds = std::max(w.max_fds, fds);
      if (store && w.samples.size() < 100000) w.samples.push_back({t_s(now_ns()), pid, rss, fds});
    }
  }

  void print_interval() {
    const Counts& c = hist->counts();
    std::string fault = "-";
    for (auto& w : windows)
      if (w.end_ns == INT64_MAX) fault = std::string(to_string(w.kind)) + (w.arg.empty() ? "" : " " + w.arg);
    std::string procs;
    for (auto& w : watches)
      if (!w.samples.empty())
        procs += " " + w.name + " " + std::to_string(w.samples.back().rss_kb / 1024) + "M/" +
                 std::to_string(w.samples.back().fds) + "fd";
    std::printf("soak: t=%.0fs ios %" PRIu64 " (r %" PRIu64 " w %" PRIu64 " f %" PRIu64 ") %.1f MiB, errors %" PRIu64
                " (unexplained %" PRIu64 "), lost %" PRIu64 " torn %" PRIu64 " stale %" PRIu64 " corrupt %" PRIu64
                ", max pause %.0f ms, fault %s%s\n",
                t_s(now_ns()), reads + writes + flushes, reads, writes, flushes,
                static_cast<double>(read_bytes + write_bytes) / 1048576.0, errors, unexplained,
                c.lost + c.lost_flushed, c.torn, c.stale, c.corrupt, static_cast<double>(max_gap_ns) / 1e6,
                fault.c_str(), procs.c_str());
    std::fflush(stdout);
  }

  static double p95(std::vector<double> v) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    const size_t i = (v.size() * 95 + 99) / 100;  // nearest rank
    return v[std::min(v.size(), std::max<size_t>(i, 1)) - 1];
  }

  bool clean() const {
    return hist->counts().defects() == 0 && unexplained == 0 && hook_failures == 0 && !hung && defect_lines == 0;
  }

  json report(double run_s) {
    const Counts& c = hist->counts();
    std::map<FaultKind, KindStats> by;
    for (auto& w : windows) {
      auto& k = by[w.kind];
      k.pauses_ms.push_back(static_cast<double>(w.pause_ns) / 1e6);
      k.errors += w.errors;
    }
    // Text.
    std::printf("\n== ibnbd-soak report: seed %" PRIu64 ", target %s, %.0f s, %" PRIu64 " blocks of %u B (logical %u), qd %u\n",
                o.seed, target_name().c_str(), run_s, blocks, o.block_bytes, logical, o.qd);
    std::printf("IOs            %" PRIu64 ": reads %" PRIu64 ", writes %" PRIu64 " (FUA %" PRIu64 "), flushes %" PRIu64
                "; read %.1f MiB, written %.1f MiB\n",
                reads + writes + flushes, reads, writes, fua_writes, flushes, static_cast<double>(read_bytes) / 1048576.0,
                static_cast<double>(write_bytes) / 1048576.0);
    std::printf("faults         %zu of the %zu planned ran\n", windows.size(), plan.size());
    std::printf("%-14s %6s %14s %14s %8s\n", "fault", "count", "max pause ms", "p95 pause ms", "errors");
    for (auto& [k, s] : by)
      std::printf("%-14s %6zu %14.1f %14.1f %8" PRIu64 "\n", std::string(to_string(k)).c_str(), s.pauses_ms.size(),
                  *std::max_element(s.pauses_ms.begin(), s.pauses_ms.end()), p95(s.pauses_ms), s.errors);
    std::string by_errno;
    for (auto& [e, n] : errors_by) by_errno += (by_errno.empty() ? "" : ", ") + e + " " + std::to_string(n);
    std::printf("app errors     %" PRIu64 ": explained by a fault %" PRIu64 ", unexplained %" PRIu64 "%s%s%s\n", errors,
                explained, unexplained, by_errno.empty() ? "" : " (", by_errno.c_str(), by_errno.empty() ? "" : ")");
    std::printf("blocks         %" PRIu64 " reads checked, %" PRIu64 " verified at the end: lost %" PRIu64
                ", lost flushed %" PRIu64 ", torn %" PRIu64 ", stale %" PRIu64 ", corrupt %" PRIu64
                "; within contract: unflushed lost after a kill %" PRIu64 ", failed writes that landed %" PRIu64 "\n",
                c.reads_checked, verified_blocks, c.lost, c.lost_flushed, c.torn, c.stale, c.corrupt, c.lost_allowed,
                c.landed);
    std::printf("writes         acknowledged %" PRIu64 ", failed %" PRIu64 "; flushes completed %" PRIu64
                "; NBD reconnects %u; longest pause %.1f ms; longest submit call %.1f ms\n",
                c.writes_acked, c.writes_failed, c.flushes, reconnects, static_cast<double>(max_gap_ns) / 1e6,
                static_cast<double>(max_submit_ns) / 1e6);
    if (!watches.empty()) std::printf("%-14s %28s %22s %9s\n", "process", "RSS MiB first/max/last", "fds first/max/last", "restarts");
    for (auto& w : watches) {
      if (w.samples.empty()) {
        std::printf("%-14s (no samples)\n", w.name.c_str());
        continue;
      }
      const uint64_t rmax = w.max_rss_kb;
      const uint32_t fmax = w.max_fds;
      char r[64], f[64];
      std::snprintf(r, sizeof r, "%.1f/%.1f/%.1f", static_cast<double>(w.samples.front().rss_kb) / 1024,
                    static_cast<double>(rmax) / 1024, static_cast<double>(w.samples.back().rss_kb) / 1024);
      std::snprintf(f, sizeof f, "%u/%u/%u", w.samples.front().fds, fmax, w.samples.back().fds);
      std::printf("%-14s %28s %22s %9u\n", w.name.c_str(), r, f, w.restarts);
    }
    std::printf("verdict        %s\n", clean() ? "clean" : "DEFECTS");
    std::fflush(stdout);

    json j;
    j["seed"] = o.seed;
    j["target"] = target_name();
    j["duration_s"] = run_s;
    j["blocks"] = blocks;
    j["block_bytes"] = o.block_bytes;
    j["logical_block"] = logical;
    j["qd"] = o.qd;
    j["ios"] = {{"total", reads + writes + flushes}, {"reads", reads}, {"writes", writes},
                {"fua_writes", fua_writes}, {"flushes", flushes}, {"read_bytes", read_bytes},
                {"write_bytes", write_bytes}};
    json faults = json::array();
    for (auto& [k, s] : by)
      faults.push_back({{"kind", std::string(to_string(k))}, {"count", s.pauses_ms.size()},
                        {"pause_ms_max", *std::max_element(s.pauses_ms.begin(), s.pauses_ms.end())},
                        {"pause_ms_p95", p95(s.pauses_ms)}, {"errors", s.errors}});
    j["faults"] = faults;
    j["faults_planned"] = plan.size();
    j["faults_run"] = windows.size();
    json log = json::array();
    for (auto& w : windows)
      log.push_back({{"n", w.n}, {"kind", std::string(to_string(w.kind))}, {"arg", w.arg}, {"t_s", t_s(w.start_ns)},
                     {"duration_ms", w.end_ns == INT64_MAX ? -1.0 : static_cast<double>(w.end_ns - w.start_ns) / 1e6},
                     {"hook_ms", w.hook_ms}, {"pause_ms", static_cast<double>(w.pause_ns) / 1e6}, {"errors", w.errors}});
    j["fault_log"] = log;
    j["errors"] = {{"total", errors}, {"explained", explained}, {"unexplained", unexplained}, {"by_errno", errors_by},
                   {"enospc", enospc_seen}, {"eio", eio_seen}};
    j["blocks_checked"] = {{"reads_checked", c.reads_checked}, {"verified", verified_blocks}, {"lost", c.lost},
                           {"lost_flushed", c.lost_flushed}, {"torn", c.torn}, {"stale", c.stale},
                           {"corrupt", c.corrupt}, {"lost_unflushed_allowed", c.lost_allowed}, {"landed", c.landed}};
    j["writes"] = {{"acked", c.writes_acked}, {"failed", c.writes_failed}, {"flushes", c.flushes}};
    j["nbd_reconnects"] = reconnects;
    j["max_pause_ms"] = static_cast<double>(max_gap_ns) / 1e6;
    j["max_submit_ms"] = static_cast<double>(max_submit_ns) / 1e6;
    j["hook_failures"] = hook_failures;
    j["hung"] = hung;
    json procs = json::array();
    for (auto& w : watches) {
      json s = json::array();
      for (auto& x : w.samples) s.push_back({x.t_s, x.pid, x.rss_kb, x.fds});
      procs.push_back({{"name", w.name}, {"restarts", w.restarts}, {"max_rss_kb", w.max_rss_kb}, {"max_fds", w.max_fds}, {"sample_fields", {"t_s", "pid", "rss_kb", "fds"}},
                       {"samples", s}});
    }
    j["processes"] = procs;
    j["defects"] = defects;
    j["verdict"] = clean() ? "clean" : "defects";
    return j;
  }

  std::string target_name() const {
    switch (o.target) {
      case Target::lib: return "lib " + o.device;
      case Target::nbd: return "nbd " + o.device;
      case Target::file: return "file " + o.device;
    }
    return "?";
  }

  // ---- the driver ---------------------------------------------------------------------------

  // Waits (serving completions) until nothing is in flight; false after `timeout`.
  bool drain(int64_t timeout_ns) {
    const int64_t until = now_ns() + timeout_ns;
    while (inflight > 0 && now_ns() < until) {
      apply_events();
      wait_completions(50);
      process_completions();
    }
    return inflight == 0;
  }

  int run() {
    if (int rc = setup(); rc != 0) return rc;
    ScheduleConfig sc;
    sc.seed = o.seed;
    sc.duration_ms = o.duration_ms;
    sc.warmup_ms = std::min<uint64_t>(3000, o.duration_ms / 10);
    sc.tail_ms = std::min<uint64_t>(5000, o.duration_ms / 10);
    sc.gap_min_ms = o.gap_min_ms;
    sc.gap_max_ms = o.gap_max_ms;
    sc.max_faults = o.max_faults;
    sc.hb_timeout_ms = o.hb_timeout_ms;
    sc.kinds = o.faults;
    sc.path_labels = o.path_labels;
    sc.eio_first = 0;
    sc.eio_last = main_blocks;
    plan = make_schedule(sc);
    std::printf("soak: seed %" PRIu64 " (--seed %" PRIu64 " replays it), target %s, %" PRIu64 " blocks of %u B, qd %u, %.0f s\n",
                o.seed, o.seed, target_name().c_str(), blocks, o.block_bytes, o.qd,
                static_cast<double>(o.duration_ms) / 1000);
    std::printf("soak: schedule of %zu faults:\n", plan.size());
    for (size_t i = 0; i < plan.size(); ++i) std::printf("soak:   #%zu %s\n", i + 1, describe(plan[i]).c_str());
    std::fflush(stdout);
    if (o.schedule_only) return 0;

    t0 = now_ns();
    last_ok_ns = t0;
    last_ok_pub.store(t0);
    next_token_ns = t0;
    const int64_t deadline = t0 + static_cast<int64_t>(o.duration_ms) * kMs;
    end_ns = deadline;
    bool overrun_said = false;
    int64_t next_interval = t0 + static_cast<int64_t>(o.interval_ms) * kMs;
    int64_t next_watch = t0 + 1000 * kMs;
    sample_watches();
    fault_thread = std::thread([this] { run_faults(); });
    bool stopping = false;
    int64_t stop_since = 0;
    while (true) {
      const int64_t now = now_ns();
      const bool fault_left = now >= deadline && fault_on.load() && now < deadline + kFaultOverrunMs * kMs;
      if (fault_left && !std::exchange(overrun_said, true)) {
        std::printf("soak: t=%.1fs a fault is still on at the end: IO goes on until it stopped\n", t_s(now));
        std::fflush(stdout);
      }
      if (!stopping && ((now >= deadline && !fault_left) || g_signal.load() != 0)) {
        stopping = true;
        stop_since = now;
        stop_faults.store(true);
        if (g_signal.load() != 0) std::printf("soak: signal %d: stopping\n", g_signal.load());
      }
      apply_events();
      if (!stopping && !broken) fill();
      if (broken && inflight == 0) {
        if (g_signal.load() != 0) break;
        reconnect();  // also after the end: the final verify needs the volume
        if (broken) break;  // gave up: reported
        continue;
      }
      if (stopping && faults_done.load()) {
        if (inflight == 0) break;
        if (now - stop_since > static_cast<int64_t>(o.drain_timeout_ms) * kMs) {
          hung = true;
          note_defect(std::to_string(inflight) + " requests did not complete within " +
                      std::to_string(o.drain_timeout_ms) + " ms of the end");
          break;
        }
      }
      wait_completions(throttled ? 1 : static_cast<int>(std::clamp<int64_t>((next_interval - now) / kMs, 1, 50)));
      process_completions();
      report_windows(false);
      report_stall();
      if (now_ns() >= next_watch) {
        sample_watches(false);
        next_watch += 1000 * kMs;
      }
      if (now_ns() >= next_interval) {
        sample_watches();
        print_interval();
        next_interval += static_cast<int64_t>(o.interval_ms) * kMs;
      }
    }
    stop_faults.store(true);
    if (fault_thread.joinable()) fault_thread.join();
    apply_events();
    const double run_s = static_cast<double>(now_ns() - t0) / 1e9;

    // The final verify: every block read back and judged, suspects twice.
    if (!hung && vol && !broken && g_signal.load() != SIGKILL) {
      std::printf("soak: t=%.1fs verifying all %" PRIu64 " blocks\n", t_s(now_ns()), blocks);
      std::fflush(stdout);
      verifying = true;
      verify_cursor = 0;
      const int64_t until = now_ns() + static_cast<int64_t>(o.drain_timeout_ms) * kMs;
      uint32_t rereads_left = 4;
      while (now_ns() < until) {
        fill();
        if (inflight == 0) {
          if (verify_cursor >= blocks && (reread.empty() || rereads_left-- == 0)) break;
          continue;
        }
        wait_completions(50);
        process_completions();
      }
      if (inflight != 0 && !drain(10000 * kMs)) {
        hung = true;
        note_defect("the final verify did not complete");
      }
    }
    sample_watches();
    report_windows(true);
    print_interval();
    json j = report(run_s);
    if (!o.json_path.empty()) {
      std::ofstream f(o.json_path);
      f << j.dump(2) << "\n";
    }
    // Close the volume before the session: the IO it may still have is failed, not dropped.
    buf.reset();
    vol.reset();
    return clean() ? 0 : 1;
  }
};

}  // namespace
}  // namespace ibnbd::soak

int main(int argc, char** argv) {
  try {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    auto o = ibnbd::soak::parse_options(argc, argv);
    struct sigaction sa {};
    sa.sa_handler = ibnbd::soak::on_signal;
    ::sigaction(SIGINT, &sa, nullptr);
    ::sigaction(SIGTERM, &sa, nullptr);
    ::signal(SIGPIPE, SIG_IGN);
    auto soak = std::make_unique<ibnbd::soak::Soak>();
    soak->o = std::move(o);
    return soak->run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ibnbd-soak: %s\n", e.what());
    return 3;
  }
}
