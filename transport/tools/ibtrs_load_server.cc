// ibtrs-load's server: a RAM volume behind the session API, and `local` (the server and a client
// in one process).
#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>

#include "ibtrs/result.h"
#include "ibtrs_load.h"

namespace ibtrs_load {
namespace {

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

}  // namespace

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

}  // namespace ibtrs_load
