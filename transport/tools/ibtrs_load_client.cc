// ibtrs-load's client: the session, the --control FIFO and the run loop around the workload.
#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdlib>
#include <memory>
#include <thread>

#include "base/unique_fd.h"
#include "ibtrs/result.h"
#include "ibtrs_load.h"
#include "ibtrs_load_workload.h"

namespace ibtrs_load {
namespace {

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
    fd_.reset(open(path_.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC));
    int wake[2] = {-1, -1};
    const bool piped = fd_ && pipe2(wake, O_CLOEXEC) == 0;
    wake_r_.reset(wake[0]);
    wake_w_.reset(wake[1]);
    if (!piped) {
      warn("--control %s: %s", path_.c_str(), errtext(errno).c_str());
      return false;
    }
    th_ = std::thread([this] { run(); });
    return true;
  }

  void stop() {
    if (th_.joinable()) {
      char c = 0;
      (void)!write(wake_w_.get(), &c, 1);
      th_.join();
    }
    for (base::UniqueFd* fd : {&fd_, &wake_r_, &wake_w_}) fd->reset();
    if (created_) unlink(path_.c_str());
    created_ = false;
  }

 private:
  void run() {
    std::string pending;
    for (;;) {
      pollfd p[2] = {{fd_.get(), POLLIN, 0}, {wake_r_.get(), POLLIN, 0}};
      if (poll(p, 2, -1) < 0) {
        if (errno == EINTR) continue;
        warn("control: poll: %s", errtext(errno).c_str());
        return;
      }
      if (p[1].revents) return;
      char buf[4096];
      ssize_t n = read(fd_.get(), buf, sizeof(buf));
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
  base::UniqueFd fd_;
  base::UniqueFd wake_r_, wake_w_;  // the self-pipe that stops run()
  std::thread th_;
};

}  // namespace

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
      print_interval(load.inflight(), *sess, static_cast<double>(now - load.start_ns()) / 1e9, ops - last_ops,
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

  RunResult r;
  r.ops = load.ops();
  r.bytes = load.bytes();
  r.secs = std::max(1e-9, static_cast<double>(load.end_ns() - load.start_ns()) / 1e9);
  r.lat = load.latency();
  r.errors = load.errors();
  r.verify_errors = load.verify_errors();
  r.max_pause_ns = load.max_pause_ns();
  r.open_ms = open_ms;
  r.paths = sess->paths();

  quiet->store(true);
  mem.reset();
  sess.reset();

  print_report(c, r);
  return r.errors == 0 && r.verify_errors == 0 ? 0 : 1;
}

}  // namespace ibtrs_load
