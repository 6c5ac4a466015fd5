#include "hostile_harness.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

extern char** environ;

namespace ibnbd::hostile {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// The environment may point at other builds of the binaries (to run the attacks against an
// older server, say).
const char* bin(const char* env, const char* built) {
  const char* e = std::getenv(env);
  return e != nullptr && *e != '\0' ? e : built;
}

}  // namespace

const char* server_bin() { return bin("IBNBD_HOSTILE_SERVER", IBNBD_SERVER_BIN); }
const char* client_bin() { return bin("IBNBD_HOSTILE_CLIENT", IBNBD_CLIENT_BIN); }
const char* cli_bin() { return bin("IBNBD_HOSTILE_CLI", IBNBD_CLI_BIN); }

namespace {

Ms since(Clock::time_point t0) { return std::chrono::duration_cast<Ms>(Clock::now() - t0); }

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The environment of a spawned daemon: ours, with a small AddressSanitizer quarantine (a
// sanitizer build keeps freed memory resident up to 256 MiB by default, which would swamp the
// RSS bounds the cases check; other builds ignore the variable).
std::vector<std::string> child_env() {
  std::vector<std::string> env;
  std::string asan = "ASAN_OPTIONS=quarantine_size_mb=8";
  for (char** e = environ; *e != nullptr; ++e) {
    std::string v = *e;
    if (v.rfind("ASAN_OPTIONS=", 0) == 0) {
      asan += ":" + v.substr(std::strlen("ASAN_OPTIONS="));
      continue;
    }
    env.push_back(std::move(v));
  }
  env.push_back(asan);
  return env;
}

// posix_spawn of argv with stdin from /dev/null, stdout to `out`, stderr to `err` (may be the
// same file). -1 when it could not start.
pid_t spawn_with(const std::vector<std::string>& argv, const std::string& out, const std::string& err) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
  if (err == out) {
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
  } else {
    posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
  }
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  auto env_strings = child_env();
  std::vector<char*> env;
  for (auto& e : env_strings) env.push_back(e.data());
  env.push_back(nullptr);
  pid_t pid = -1;
  const int r = ::posix_spawn(&pid, args[0], &fa, nullptr, args.data(), env.data());
  posix_spawn_file_actions_destroy(&fa);
  return r == 0 ? pid : -1;
}

// waitpid without blocking past `t`: the exit status (as a shell shows it: 128 + signal).
std::optional<int> reap(pid_t pid, Ms t) {
  const auto end = Clock::now() + t;
  for (;;) {
    int st = 0;
    const pid_t r = ::waitpid(pid, &st, WNOHANG);
    if (r == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    if (r < 0) return -1;
    if (Clock::now() >= end) return std::nullopt;
    std::this_thread::sleep_for(5ms);
  }
}

}  // namespace

std::optional<Usage> usage_of(pid_t pid) {
  std::ifstream st("/proc/" + std::to_string(pid) + "/status");
  if (!st) return std::nullopt;
  Usage u;
  std::string line;
  while (std::getline(st, line)) {
    if (line.rfind("VmRSS:", 0) == 0) u.rss_kb = std::stoull(line.substr(6));
  }
  DIR* d = ::opendir(("/proc/" + std::to_string(pid) + "/fd").c_str());
  if (d == nullptr) return std::nullopt;
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') ++u.fds;
  }
  ::closedir(d);
  return u;
}

CommandResult run_command(const std::vector<std::string>& argv, Ms deadline) {
  CommandResult r;
  TempDir tmp;
  const std::string out = tmp.path() + "/out", err = tmp.path() + "/err";
  const auto t0 = Clock::now();
  const pid_t pid = spawn_with(argv, out, err);
  if (pid < 0) {
    r.err = "cannot start " + argv.at(0);
    return r;
  }
  auto st = reap(pid, deadline);
  if (!st) {
    ::kill(pid, SIGKILL);
    (void)reap(pid, 5s);
  } else {
    r.exit_code = *st;
  }
  r.took = since(t0);
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

TempDir::TempDir() {
  char tmpl[] = "/var/tmp/ibnbd-hostile-XXXXXX";
  if (::mkdtemp(tmpl) != nullptr) path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  if (!path_.empty()) fs::remove_all(path_, ec);
}

std::unique_ptr<Daemon> Daemon::spawn(const std::vector<std::string>& argv, const std::string& log) {
  const pid_t pid = spawn_with(argv, log, log);
  if (pid < 0) return nullptr;
  return std::unique_ptr<Daemon>(new Daemon(pid, log));
}

Daemon::~Daemon() {
  if (!wait_exit(10s, true)) {
    ::kill(pid_, SIGKILL);
    (void)reap(pid_, 5s);
  }
}

bool Daemon::alive() {
  if (status_) return false;
  status_ = reap(pid_, 0ms);
  return !status_;
}

std::optional<int> Daemon::wait_exit(Ms t, bool terminate) {
  if (status_) return status_;
  if (terminate) ::kill(pid_, SIGTERM);
  status_ = reap(pid_, t);
  return status_;
}

std::string Daemon::log() const { return slurp(log_); }

bool wait_for_file(const std::string& path, Ms t) {
  const auto end = Clock::now() + t;
  while (Clock::now() < end) {
    if (::access(path.c_str(), F_OK) == 0) return true;
    std::this_thread::sleep_for(10ms);
  }
  return ::access(path.c_str(), F_OK) == 0;
}

ServerUnderTest::ServerUnderTest(const std::vector<std::string>& extra_args) {
  if (dir().empty()) {
    why_ = "mkdtemp failed";
    return;
  }
  for (const char* d : {"honest", "mallory", "shared"}) fs::create_directories(export_dir() + "/" + d);
  if (!write_hosts()) return;
  std::vector<std::string> argv{server_bin(),        "--listen",         "tcp:127.0.0.1:0",
                                "--dev-search-path", export_dir(),       "--control-socket",
                                control_socket(),    "--ready-file",     dir() + "/srv.ready",
                                "--queue-depth",     "32",               "--io-threads",
                                "2",                 "--config",         dir() + "/hosts.json"};
  argv.insert(argv.end(), extra_args.begin(), extra_args.end());
  daemon_ = Daemon::spawn(argv, dir() + "/srv.log");
  if (daemon_ == nullptr) {
    why_ = std::string("cannot start ") + server_bin();
    return;
  }
  if (!wait_for_file(dir() + "/srv.ready", 15s)) {
    why_ = "not ready after 15 s: " + daemon_->log();
    return;
  }
  std::istringstream ready(slurp(dir() + "/srv.ready"));
  std::string word;
  ready >> word >> addr_;
  if (word != "listening" || !ibtrs::Address::parse(addr_).ok()) {
    why_ = "bad ready file: " + slurp(dir() + "/srv.ready");
    addr_.clear();
  }
}

ibtrs::Address ServerUnderTest::address() const { return *ibtrs::Address::parse(addr_); }

bool ServerUnderTest::write_hosts() {
  struct Grants {
    const char* host;
    const char* access;  // the config's JSON array
  };
  const Grants grants[] = {
      {kHonest, R"([{"devices": "honest/**", "mode": "rw"}])"},
      {kMallory, R"([{"devices": "mallory/**", "mode": "migration"}, {"devices": "shared/**", "mode": "ro"}])"},
  };
  std::string cfg = "{\"hosts\": [";
  for (const auto& g : grants) {
    auto key = ibtrs::Secret::generate();
    std::string why;
    if (!key.ok() || !ibtrs::save_key_file(key_file(g.host), ibtrs::KeyFile{g.host, *key, std::nullopt}).ok()) {
      why_ = std::string("cannot write the key file of ") + g.host;
      return false;
    }
    auto auth = ibtrs::client_auth_from_key_file(key_file(g.host), {}, &why);
    if (!auth.ok()) {
      why_ = key_file(g.host) + ": " + why;
      return false;
    }
    hosts_[g.host] = std::move(*auth);
    if (cfg.back() != '[') cfg += ", ";
    cfg += "{\"key_file\": \"" + key_file(g.host) + "\", \"access\": " + g.access + "}";
  }
  std::ofstream(dir() + "/hosts.json") << cfg << "]}\n";
  return true;
}

ibtrs::ClientAuth ServerUnderTest::credentials(const std::string& host) const {
  auto it = hosts_.find(host);
  return it == hosts_.end() ? ibtrs::ClientAuth{} : it->second;
}

void ServerUnderTest::make_file(const std::string& name, uint64_t size) const {
  const std::string p = export_dir() + "/" + name;
  fs::create_directories(fs::path(p).parent_path());
  std::ofstream(p).close();
  fs::resize_file(p, size);
}

CommandResult ServerUnderTest::session_list(Ms deadline) const {
  return run_command({cli_bin(), "--socket", control_socket(), "-f", "json", "server", "session", "list"},
                     deadline);
}

namespace {

// The JSON a CLI command printed, or null.
nlohmann::json json_of(const CommandResult& r) {
  if (r.exit_code != 0) return nullptr;
  return nlohmann::json::parse(r.out, nullptr, false);  // discarded on error: not an object
}

}  // namespace

// The CLI prints listings as an array of rows, one object per row keyed by column.
std::optional<std::vector<SessionSeen>> ServerUnderTest::sessions(Ms deadline) const {
  const auto rows = json_of(session_list(deadline));
  if (!rows.is_array()) return std::nullopt;
  std::vector<SessionSeen> out;
  for (const auto& r : rows) {
    if (!r.is_object() || !r.contains("sessname")) return std::nullopt;
    SessionSeen v;
    v.name = r.value("sessname", "");
    v.host = r.value("host", "");
    v.paths = r.value("path_cnt", size_t{0});
    out.push_back(std::move(v));
  }
  return out;
}

std::map<std::string, uint64_t> ServerUnderTest::auth_stats(Ms deadline) const {
  const auto rows = json_of(
      run_command({cli_bin(), "--socket", control_socket(), "-f", "json", "server", "host", "stats"}, deadline));
  std::map<std::string, uint64_t> out;
  if (!rows.is_array()) return out;
  for (const auto& r : rows)
    if (r.is_object()) out[r.value("counter", std::string())] = r.value("value", uint64_t{0});
  return out;
}

std::map<std::string, uint64_t> ServerUnderTest::refusals(Ms deadline) const {
  const auto rows = json_of(
      run_command({cli_bin(), "--socket", control_socket(), "-f", "json", "server", "refusals", "list"}, deadline));
  std::map<std::string, uint64_t> out;
  if (!rows.is_array()) return out;
  for (const auto& r : rows)
    if (r.is_object()) out[r.value("reason", std::string())] = r.value("count", uint64_t{0});
  return out;
}

std::vector<std::byte> ServerUnderTest::file_bytes(const std::string& name, uint64_t off, size_t len) const {
  std::vector<std::byte> out(len);
  std::ifstream in(export_dir() + "/" + name, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(off));
  in.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(len));
  out.resize(static_cast<size_t>(std::max<std::streamsize>(in.gcount(), 0)));
  return out;
}

void pattern(std::byte* p, size_t len, uint64_t offset, uint32_t seed) {
  for (size_t i = 0; i < len; ++i) {
    const uint64_t x = offset + i;
    p[i] = static_cast<std::byte>((x * 131 + seed * 7919 + (x >> 9) * 17) & 0xff);
  }
}

bool matches(const std::byte* p, size_t len, uint64_t offset, uint32_t seed) {
  std::byte want[4096];
  for (size_t done = 0; done < len;) {
    const size_t n = std::min(sizeof(want), len - done);
    pattern(want, n, offset + done, seed);
    if (std::memcmp(want, p + done, n) != 0) return false;
    done += n;
  }
  return true;
}

// ---- HonestSession ----

namespace {

// One request's answer. Owned by the session when the wait gave up (the callback may still come).
struct Done {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  int err = 0;
  static void cb(void* ctx, int err) {
    auto* d = static_cast<Done*>(ctx);
    std::lock_guard l(d->mu);
    d->done = true;
    d->err = err;
    d->cv.notify_all();
  }
};

std::vector<std::unique_ptr<Done>> g_abandoned;  // waits that timed out: freed never (rare)
std::mutex g_abandoned_mu;

}  // namespace

Result<std::unique_ptr<HonestSession>> HonestSession::open(const ibtrs::Address& a, const ibtrs::ClientAuth& auth,
                                                           const std::string& name, Ms deadline) {
  BlockSessionOptions o;
  o.transport.session_name = name;
  o.transport.auth = auth;
  o.transport.paths.push_back(ibtrs::PathSpec{std::nullopt, a});
  o.transport.io_threads = 1;
  o.transport.connect_timeout = deadline;
  o.transport.pending_timeout = deadline;
  o.control_timeout = deadline;
  o.remap_timeout = deadline;
  auto s = BlockSession::open(std::move(o));
  if (!s.ok()) return s.error();
  std::unique_ptr<HonestSession> h(new HonestSession());
  h->s_ = std::move(*s);
  h->deadline_ = deadline;
  auto b = h->s_->alloc_buffer(2 << 20);
  if (!b.ok()) return b.error();
  h->buf_ = std::move(*b);
  return h;
}

HonestSession::~HonestSession() {
  buf_.reset();
  s_.reset();
}

Result<std::shared_ptr<RemoteDevice>> HonestSession::map(const std::string& dev, AccessMode mode) {
  return s_->map(dev, mode);
}

Status HonestSession::unmap(const std::string& dev) { return s_->unmap(dev, UnmapMode::force); }

int HonestSession::io(RemoteDevice& d, bool write, uint64_t off, size_t len, std::byte* buf) {
  auto done = std::make_unique<Done>();
  ibtrs::IoSeg seg{buf, static_cast<uint32_t>(len), buf_.get()};
  IoDone cb{&Done::cb, done.get()};
  Status st = write ? d.write(off, std::span(&seg, 1), 0, cb) : d.read(off, std::span(&seg, 1), cb);
  if (!st.ok()) return st.error().value();
  std::unique_lock l(done->mu);
  if (!done->cv.wait_for(l, deadline_, [&] { return done->done; })) {
    l.unlock();
    std::lock_guard g(g_abandoned_mu);
    g_abandoned.push_back(std::move(done));
    return ETIMEDOUT;
  }
  return done->err;
}

int HonestSession::write(RemoteDevice& d, uint64_t off, size_t len, uint32_t seed) {
  if (len > (1u << 20)) return EINVAL;
  pattern(buf_->data(), len, off, seed);
  return io(d, true, off, len, buf_->data());
}

int HonestSession::verify(RemoteDevice& d, uint64_t off, size_t len, uint32_t seed) {
  if (len > (1u << 20)) return EINVAL;
  std::byte* back = buf_->data() + (1 << 20);
  std::memset(back, 0, len);
  if (int e = io(d, false, off, len, back)) return e;
  return matches(back, len, off, seed) ? 0 : EILSEQ;
}

int HonestSession::write_verify(RemoteDevice& d, uint64_t off, size_t len, uint32_t seed) {
  if (int e = write(d, off, len, seed)) return e;
  return verify(d, off, len, seed);
}

HonestResult honest_round_trip(const ibtrs::Address& a, const ibtrs::ClientAuth& auth, const std::string& session,
                               const std::string& dev, uint32_t seed, Ms deadline) {
  HonestResult r;
  const auto t0 = Clock::now();
  auto fail = [&](int e, std::string what) {
    r.err = e;
    r.what = std::move(what) + ": " + std::strerror(e);
    r.took = since(t0);
    return r;
  };
  auto s = HonestSession::open(a, auth, session, deadline);
  if (!s.ok()) return fail(s.error().value(), "open session " + session);
  auto d = (*s)->map(dev, AccessMode::rw);
  if (!d.ok()) return fail(d.error().value(), "map " + dev);
  if (int e = (*s)->write_verify(**d, 0, 1 << 20, seed)) return fail(e, "write + verify " + dev);
  if (auto u = (*s)->unmap(dev); !u.ok()) return fail(u.error().value(), "unmap " + dev);
  d->reset();
  s->reset();
  r.took = since(t0);
  return r;
}

}  // namespace ibnbd::hostile
