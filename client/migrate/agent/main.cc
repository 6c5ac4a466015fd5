// ibnbd-migrate: the migration agent. Saves QEMU migration streams onto a remote volume as
// images (docs/migration-image.md) and plays them back, over its own IBNBD session with every
// path given (failover included). QEMU 7.2 uses it unchanged:
//
//   save:    migrate "exec:ibnbd-migrate save VOL from PATH... image NAME"        (stdin)
//            ibnbd-migrate save VOL from PATH... image NAME unix SOCK [channels N] &
//            migrate unix:SOCK                                   (listens; multifd: 1 + N)
//            ibnbd-migrate save VOL from PATH... image NAME rdma HOST:PORT &
//            migrate rdma:HOST:PORT          (QEMU's RDMA protocol: listens, as -incoming rdma:)
//   restore: qemu ... -incoming "exec:ibnbd-migrate restore VOL from PATH... image NAME"
//            ibnbd-migrate restore VOL from PATH... image NAME unix SOCK
//                                 (connects to QEMU's migrate-incoming unix:SOCK, main first)
//            ibnbd-migrate restore VOL from PATH... image NAME rdma HOST:PORT [pin-all]
//                                 (connects to QEMU's -incoming rdma:HOST:PORT as its source)
//   list | verify | delete: ibnbd-migrate list VOL from PATH...   (no QEMU)
//
// The volume is mapped `migration` for save and delete (a second writer beside the VM host
// that holds it rw) and `ro` otherwise. With `nbd SOCK` instead of `from PATH...` the agent maps
// nothing: it works through a client daemon's NBD export of a device the daemon maps (the
// daemon's access mode rules; how two hypervisors share one volume, source rw and destination
// migration, when a third opener would be refused). Progress goes to stderr. Exit status: 0,
// or the errno of the failure (1 for usage errors).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <charconv>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/text.h"
#include "ibnbd/client.h"
#include "ibnbd/migrate_image.h"
#include "ibnbd/migrate_volume.h"
#include "ibnbd/types.h"
#include "base/unique_fd.h"
#include "base/unix_socket.h"
#include "ibtrs/path_spec.h"
#include "control/output.h"
#ifdef IBNBD_MIGRATE_RDMA
#include "qemu_rdma_endpoint.h"
#endif

namespace {

using namespace ibnbd;
using namespace ibnbd::migrate;

const char kUsage[] =
    "usage: ibnbd-migrate save    VOLUME WHERE image NAME [unix SOCKET [channels N] | rdma HOST:PORT [pin-max SIZE]]\n"
    "                             [max SIZE] [timeout SECONDS]\n"
    "       ibnbd-migrate restore VOLUME WHERE image NAME [unix SOCKET | rdma HOST:PORT [pin-all]] [timeout SECONDS]\n"
    "       ibnbd-migrate list    VOLUME WHERE\n"
    "       ibnbd-migrate verify  VOLUME WHERE image NAME\n"
    "       ibnbd-migrate delete  VOLUME WHERE image NAME\n"
    "  WHERE: from PATH... [session NAME] [host-key FILE]\n"
    "                                       the agent maps VOLUME over its own session,\n"
    "                                       authenticated with FILE (ibnbd key generate)\n"
    "         nbd SOCKET                    a client daemon's NBD export of VOLUME (the daemon\n"
    "                                       maps it: `ibnbd client device export VOLUME unix SOCKET`)\n"
    "  save reads the stream from stdin (QEMU exec:), or listens on SOCKET for QEMU's\n"
    "  `migrate unix:SOCKET` (1 + N multifd channels); restore writes it to stdout (QEMU\n"
    "  -incoming exec:) or connects to SOCKET (QEMU's `migrate-incoming unix:SOCKET`).\n"
    "  rdma: QEMU's own RDMA migration protocol. save listens on HOST:PORT (port 0: any, printed)\n"
    "  for `migrate rdma:HOST:PORT` (dynamic registration or rdma-pin-all, the source's choice;\n"
    "  guest RAM registered at once: at most pin-max, default the memlock limit or half the\n"
    "  memory); restore connects to `-incoming rdma:HOST:PORT` (pin-all: ask QEMU to pin all\n"
    "  of its RAM). timeout: the longest wait for QEMU over rdma (default 120). The image is\n"
    "  an ordinary stream either way: any transport restores what any other saved.\n"
    "  PATH: [src@]dst as for `ibnbd client device map`, e.g. tcp:10.0.0.2 or rdma:10.0.0.2.\n";

struct Args {
  std::string cmd, volume, image, unix_path, session, nbd_path, host_key, rdma;
  std::vector<ibtrs::PathSpec> paths;
  uint32_t channels = 0;
  uint64_t max_bytes = 0;
  uint64_t pin_max = 0;
  bool pin_all = false;
  uint32_t timeout_s = 0;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "ibnbd-migrate: %s\n%s", why.c_str(), kUsage);
  std::exit(1);
}

Args parse(int argc, char** argv) {
  if (argc < 2) usage("no command");
  Args a;
  a.cmd = argv[1];
  if (a.cmd == "-h" || a.cmd == "--help") {
    std::fputs(kUsage, stdout);
    std::exit(0);
  }
  if (a.cmd != "save" && a.cmd != "restore" && a.cmd != "list" && a.cmd != "verify" && a.cmd != "delete")
    usage("unknown command '" + a.cmd + "'");
  if (argc < 3) usage("no volume");
  a.volume = argv[2];
  static const char* const kWords[] = {"from",  "image", "unix", "channels", "max",     "session",
                                      "nbd",   "host-key", "rdma", "pin-max", "pin-all", "timeout"};
  auto is_word = [](const std::string& w) {
    return std::any_of(std::begin(kWords), std::end(kWords), [&](const char* k) { return w == k; });
  };
  for (int i = 3; i < argc;) {
    const std::string w = argv[i++];
    if (!is_word(w)) usage("unexpected '" + w + "'");
    if (w == "pin-all") {  // a flag
      a.pin_all = true;
      continue;
    }
    if (i >= argc) usage(w + " needs a value");
    if (w == "from") {
      for (; i < argc && !is_word(argv[i]); ++i) {
        auto p = ibtrs::PathSpec::parse(argv[i]);
        if (!p) usage(std::string("path '") + argv[i] + "': " + p.error().message());
        a.paths.push_back(*p);
      }
    } else if (w == "image") {
      a.image = argv[i++];
    } else if (w == "unix") {
      a.unix_path = argv[i++];
    } else if (w == "nbd") {
      a.nbd_path = argv[i++];
    } else if (w == "session") {
      a.session = argv[i++];
    } else if (w == "host-key") {
      a.host_key = argv[i++];
    } else if (w == "channels") {
      const std::string_view v(argv[i++]);
      auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), a.channels);
      if (ec != std::errc() || p != v.data() + v.size() || a.channels > kMaxStreams - 1)
        usage("channels: 0.." + std::to_string(kMaxStreams - 1));
    } else if (w == "max") {
      auto s = base::parse_size(argv[i++]);
      if (!s) usage("max: a size such as 4G");
      a.max_bytes = *s;
    } else if (w == "rdma") {
      a.rdma = argv[i++];
    } else if (w == "pin-max") {
      auto s = base::parse_size(argv[i++]);
      if (!s || *s == 0) usage("pin-max: a size such as 4G");
      a.pin_max = *s;
    } else if (w == "timeout") {
      const std::string_view v(argv[i++]);
      auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), a.timeout_s);
      if (ec != std::errc() || p != v.data() + v.size() || a.timeout_s == 0 || a.timeout_s > 86400)
        usage("timeout: seconds, 1..86400");
    }
  }
  if (a.paths.empty() == a.nbd_path.empty()) usage("from PATH... or nbd SOCKET (one of them)");
  if (!a.nbd_path.empty() && !a.session.empty()) usage("session: only with from (nbd uses the daemon's)");
  if (a.cmd != "list" && a.image.empty()) usage("image NAME is needed");
  if (a.channels > 0 && (a.cmd != "save" || a.unix_path.empty()))
    usage("channels: only for save over a unix socket (restore finds them in the image)");
  if (!a.rdma.empty() && a.cmd != "save" && a.cmd != "restore") usage("rdma: only for save and restore");
  if (!a.rdma.empty() && !a.unix_path.empty()) usage("unix or rdma, not both");
  if (a.pin_all && (a.cmd != "restore" || a.rdma.empty()))
    usage("pin-all: only for restore over rdma (a save grants what QEMU's source asks)");
  if (a.pin_max != 0 && (a.cmd != "save" || a.rdma.empty())) usage("pin-max: only for save over rdma");
  if (a.timeout_s != 0 && a.rdma.empty()) usage("timeout: only with rdma");
#ifndef IBNBD_MIGRATE_RDMA
  if (!a.rdma.empty()) usage("rdma: this ibnbd-migrate was built without rdma-core (libibverbs, librdmacm)");
#else
  if (std::string why; !a.rdma.empty() && !qrdma::parse_rdma_address(a.rdma, &why)) usage("rdma " + why);
#endif
  return a;
}

int fail(const std::string& what, std::error_code e, const std::string& detail = "") {
  std::fprintf(stderr, "ibnbd-migrate: %s: %s%s%s\n", what.c_str(), e.message().c_str(),
               detail.empty() ? "" : ": ", detail.c_str());
  return e.value() > 0 && e.value() < 256 ? e.value() : 1;
}

// "saved 1.2G at 850.0M/s" or, with a known total, "... of 2.0G, ETA 1 s" (the CLI's units).
void report(const char* verb, const Progress& p, bool final) {
  const double s = std::chrono::duration<double>(p.elapsed).count();
  const double rate = s > 0 ? static_cast<double>(p.bytes) / s : 0;
  using control::format_bytes;
  using control::Unit;
  std::string line = std::string(verb) + " " + format_bytes(p.bytes, Unit::automatic);
  if (p.total) line += " of " + format_bytes(p.total, Unit::automatic);
  line += " at " + format_bytes(static_cast<uint64_t>(rate), Unit::automatic) + "/s";
  if (p.total && !final && rate > 0)
    line += ", ETA " + std::to_string(static_cast<uint64_t>(static_cast<double>(p.total - p.bytes) / rate)) + " s";
  if (final) {
    char t[32];
    std::snprintf(t, sizeof t, " in %.2f s", s);
    line += t;
  }
  std::fprintf(stderr, "ibnbd-migrate: %s\n", line.c_str());
}

// A progress line per second from a thread beside the copy.
class Ticker {
 public:
  Ticker(const char* verb, std::function<Progress()> get) : verb_(verb), get_(std::move(get)) {
    t_ = std::thread([this] {
      auto next = std::chrono::steady_clock::now();
      while (!stop_.load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        if (std::chrono::steady_clock::now() - next < std::chrono::seconds(1)) continue;
        next = std::chrono::steady_clock::now();
        report(verb_, get_(), false);
      }
    });
  }
  ~Ticker() {
    stop_ = true;
    t_.join();
  }

 private:
  const char* verb_;
  std::function<Progress()> get_;
  std::atomic<bool> stop_{false};
  std::thread t_;
};

// QEMU's migrate-incoming may still be setting up its socket: retry for a while (bounded).
Result<int> connect_retrying(const std::string& path) {
  Result<int> c = ibtrs::errc(ENOENT);
  for (int i = 0; i < 100; ++i) {
    c = base::unix_connect(path);
    if (c || (c.error().value() != ENOENT && c.error().value() != ECONNREFUSED)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return c;
}

// Copies bytes already read (a connection's first bytes, read to tell its stream) into `stream`.
Status produce(ImageWriter& w, uint32_t stream, std::span<const std::byte> bytes) {
  while (!bytes.empty()) {
    auto span = w.buffer(stream);
    if (!span) return span.error();
    const size_t n = std::min(span->size(), bytes.size());
    std::memcpy(span->data(), bytes.data(), n);
    BASE_TRY(w.produced(stream, n));
    bytes = bytes.subspan(n);
  }
  return {};
}

// exec: hands the agent a pipe of 64 KiB. QEMU moves its stream in 32 KiB pieces, so every
// chunk costs dozens of wake-ups on both sides; a pipe of one chunk (1 MiB, the default
// pipe-max-size) lets the writer run a chunk ahead. Measured with bench/migrate.sh's driver
// (1 GiB, 4 runs each, loaded 2-core host): exec restore 4.1 -> 3.0 s median, agent CPU
// 0.61 -> 0.47 s/GiB; exec save time unchanged, its CPU 0.61 -> 0.50 s/GiB. Best effort: a
// pipe that cannot grow (pipe-max-size lowered, the user's pipe quota spent) works as it is.
void widen_pipe(int fd) {
  struct stat st{};
  if (::fstat(fd, &st) == 0 && S_ISFIFO(st.st_mode)) (void)::fcntl(fd, F_SETPIPE_SZ, 1 << 20);
}

// Reads one connection (or stdin) into `stream` of the image until EOF.
Status pump_in(ImageWriter& w, uint32_t stream, int fd) {
  for (;;) {
    auto span = w.buffer(stream);
    if (!span) return span.error();
    ssize_t n = ::read(fd, span->data(), span->size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ibtrs::errc(errno);
    if (n == 0) return {};
    BASE_TRY(w.produced(stream, static_cast<size_t>(n)));
  }
}

Status write_all(int fd, const std::byte* p, size_t n) {
  while (n > 0) {
    ssize_t k = ::write(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return ibtrs::errc(errno);
    p += k;
    n -= static_cast<size_t>(k);
  }
  return {};
}

// Which stream a save connection carries: the main stream starts with "QEVM"; a multifd channel
// with its init packet (be32 magic 0x11223344, be32 version, 16-byte uuid, u8 channel id).
Result<uint32_t> classify(int fd, std::vector<std::byte>& head) {
  head.resize(25);
  size_t got = 0;
  while (got < 4) {
    ssize_t n = ::recv(fd, head.data() + got, head.size() - got, 0);
    if (n <= 0) return ibtrs::errc(n == 0 ? EPROTO : errno);
    got += static_cast<size_t>(n);
  }
  auto be32 = [&](size_t at) {
    uint32_t v = 0;
    for (size_t i = 0; i < 4; ++i) v = (v << 8) | std::to_integer<uint32_t>(head[at + i]);
    return v;
  };
  if (be32(0) == 0x5145564D) {
    head.resize(got);
    return 0u;
  }
  if (be32(0) != 0x11223344) return ibtrs::errc(EPROTO);
  while (got < 25) {
    ssize_t n = ::recv(fd, head.data() + got, head.size() - got, 0);
    if (n <= 0) return ibtrs::errc(n == 0 ? EPROTO : errno);
    got += static_cast<size_t>(n);
  }
  head.resize(got);
  return 1u + std::to_integer<uint32_t>(head[24]);
}

#ifdef IBNBD_MIGRATE_RDMA
// The rewritten stream of an rdma save into the image's main stream.
class ImageSink final : public ibnbd::migrate::qstream::ByteSink {
 public:
  explicit ImageSink(ImageWriter& w) : w_(w) {}
  Status write(std::span<const std::byte> b) override { return produce(w_, 0, b); }

 private:
  ImageWriter& w_;
};

qrdma::EndpointOptions rdma_options(const Args& a) {
  qrdma::EndpointOptions o;
  if (a.timeout_s != 0) o.timeout = std::chrono::seconds(a.timeout_s);
  o.pin_limit = a.pin_max;
  o.pin_all = a.pin_all;
  return o;
}

Result<qrdma::RdmaAddress> rdma_address(const Args& a) {
  std::string why;
  auto r = qrdma::parse_rdma_address(a.rdma, &why);
  if (!r) std::fprintf(stderr, "ibnbd-migrate: rdma %s\n", why.c_str());
  return r;
}
#endif

int do_save(const Args& a, ImageStore& store) {
  CreateOptions o;
  o.name = a.image;
  o.streams = 1 + a.channels;
  o.max_bytes = a.max_bytes;
  o.ring_chunks = std::max<uint32_t>(32, 4 * o.streams);
  base::UniqueFd listen_fd;
  if (!a.unix_path.empty()) {
    auto l = base::unix_listen(a.unix_path, kMaxStreams, false);
    if (!l) return fail("listen on " + a.unix_path, l.error());
    listen_fd.reset(*l);
    std::fprintf(stderr, "ibnbd-migrate: waiting for QEMU on %s (%u stream%s)\n", a.unix_path.c_str(),
                 o.streams, o.streams > 1 ? "s" : "");
  }
#ifdef IBNBD_MIGRATE_RDMA
  std::unique_ptr<qrdma::SaveEndpoint> rdma;
  if (!a.rdma.empty()) {
    auto at = rdma_address(a);
    if (!at) return 1;
    std::string why;
    auto l = qrdma::SaveEndpoint::listen(*at, rdma_options(a), &why);
    if (!l) return fail("listen on rdma:" + at->text(), l.error(), why);
    rdma = std::move(*l);
    at->port = std::to_string(rdma->port());
    std::fprintf(stderr, "ibnbd-migrate: waiting for QEMU on rdma:%s\n", at->text().c_str());
  }
#endif
  auto w = store.create(o);
  if (!w) return fail("image " + a.image, w.error(), store.last_error());
  ImageWriter& writer = **w;
  Status result;
  {
    Ticker tick("saved", [&] { return writer.progress(); });
#ifdef IBNBD_MIGRATE_RDMA
    if (rdma) {
      ImageSink sink(writer);
      result = rdma->run(sink);
      if (!result) {
        // Said here: writer.last_error() (below) is about the image, this is about QEMU.
        std::fprintf(stderr, "ibnbd-migrate: rdma: %s\n", rdma->last_error().c_str());
      } else {
        const auto& st = rdma->stats();
        std::fprintf(stderr, "ibnbd-migrate: rdma: %" PRIu64 " rounds, %s, %" PRIu64 " MiB registered, %" PRIu64
                     " MiB of pages, %" PRIu64 " MiB of other stream bytes\n",
                     st.rounds.load(), rdma->pinned_all() ? "pin-all" : "dynamic registration",
                     rdma->pinned_bytes() >> 20, st.ram_bytes.load() >> 20, st.file_bytes.load() >> 20);
      }
    } else
#endif
    if (!listen_fd) {
      widen_pipe(STDIN_FILENO);
      result = pump_in(writer, 0, STDIN_FILENO);
    } else {
      // Accept 1 + channels connections; each one's stream is found from its first bytes.
      std::vector<std::thread> pumps;
      std::vector<Status> results(o.streams);
      std::vector<bool> taken(o.streams, false);
      for (uint32_t i = 0; i < o.streams && result; ++i) {
        base::UniqueFd c(::accept4(listen_fd.get(), nullptr, nullptr, SOCK_CLOEXEC));
        if (!c) {
          result = ibtrs::errc(errno);
          break;
        }
        std::vector<std::byte> head;
        auto s = classify(c.get(), head);
        if (!s || *s >= o.streams || taken[*s]) {
          c.reset();
          result = ibtrs::errc(EPROTO);
          std::fprintf(stderr, "ibnbd-migrate: connection %u is not a migration stream this save expects\n", i);
          break;
        }
        taken[*s] = true;
        pumps.emplace_back([&, c = std::move(c), s = *s, head = std::move(head)]() mutable {
          Status r = produce(writer, s, head);
          if (r) r = pump_in(writer, s, c.get());
          c.reset();
          results[s] = r;
        });
      }
      for (auto& t : pumps) t.join();
      for (auto& r : results)
        if (result && !r) result = r;
      listen_fd.reset();
      ::unlink(a.unix_path.c_str());
    }
  }
  if (!result) return fail("save " + a.image + " (the image stays PARTIAL)", result.error(), writer.last_error());
  if (auto c = writer.commit(); !c) return fail("commit " + a.image, c.error(), writer.last_error());
  report("saved", writer.progress(), true);
  return 0;
}

// Plays `stream` of the image into fd; stops at the first bad chunk (the connection is then
// closed early, and QEMU fails the load).
Status pump_out(ImageReader& r, uint32_t stream, int fd, std::atomic<uint64_t>& done) {
  auto sr = r.stream(stream);
  if (!sr) return sr.error();
  for (;;) {
    auto p = (*sr)->next();
    if (!p) {
      std::fprintf(stderr, "ibnbd-migrate: %s\n", (*sr)->last_error().c_str());
      return p.error();
    }
    if (p->empty()) return {};
    BASE_TRY(write_all(fd, p->data(), p->size()));
    done += p->size();
  }
}

// Makes QEMU give up at once: over a socket, connect and close ("not a migration stream"); on
// exec's stdout, bytes that are not a stream (an empty stream would leave QEMU waiting).
void refuse(const Args& a) {
#ifdef IBNBD_MIGRATE_RDMA
  if (!a.rdma.empty()) {
    // ERROR after QEMU's first READY: its incoming migration fails at once.
    auto at = qrdma::parse_rdma_address(a.rdma);
    if (!at) return;
    auto o = rdma_options(a);
    o.timeout = std::min<std::chrono::milliseconds>(o.timeout, std::chrono::seconds(30));
    if (auto c = qrdma::RestoreEndpoint::connect(*at, o)) (*c)->abort();
    return;
  }
#endif
  if (!a.unix_path.empty()) {
    if (auto c = connect_retrying(a.unix_path)) base::UniqueFd refused(*c);  // connected and closed: QEMU reads EOF
  } else {
    static const char kNot[] = "IBNBD: image refused\n";
    (void)write_all(STDOUT_FILENO, reinterpret_cast<const std::byte*>(kNot), sizeof kNot - 1);
  }
}

#ifdef IBNBD_MIGRATE_RDMA
// Plays the image's stream into QEMU's -incoming rdma: as its source would.
Status restore_rdma(const Args& a, ImageReader& reader, std::atomic<uint64_t>& done) {
  auto at = rdma_address(a);
  if (!at) return at.error();
  auto sr = reader.stream(0);
  if (!sr) {
    refuse(a);
    return sr.error();
  }
  std::string why;
  auto c = qrdma::RestoreEndpoint::connect(*at, rdma_options(a), &why);
  if (!c) {
    std::fprintf(stderr, "ibnbd-migrate: rdma: %s\n", why.c_str());
    return c.error();
  }
  qrdma::RestoreEndpoint& ep = **c;
  if (a.pin_all && !ep.pin_all()) std::fprintf(stderr, "ibnbd-migrate: rdma: QEMU did not grant pin-all\n");
  Status result;
  for (;;) {
    auto p = (*sr)->next();
    if (!p) {
      std::fprintf(stderr, "ibnbd-migrate: %s\n", (*sr)->last_error().c_str());
      ep.abort();
      return p.error();
    }
    if (p->empty()) break;
    if (result = ep.feed(*p); !result) break;
    done += p->size();
  }
  if (result) result = ep.finish();
  if (!result) {
    std::fprintf(stderr, "ibnbd-migrate: rdma: %s\n", ep.last_error().c_str());
    ep.abort();
    return result;
  }
  const auto& st = ep.stats();
  std::fprintf(stderr, "ibnbd-migrate: rdma: %" PRIu64 " rounds, %s, %" PRIu64 " MiB of pages, %" PRIu64
               " MiB of other stream bytes\n", st.rounds.load(), ep.pin_all() ? "pin-all" : "dynamic registration",
               st.ram_bytes.load() >> 20, st.file_bytes.load() >> 20);
  return {};
}
#endif

int do_restore(const Args& a, ImageStore& store) {
  auto r = store.open_image(a.image);
  if (!r) {
    refuse(a);
    return fail("image " + a.image + " refused", r.error(), store.last_error());
  }
  ImageReader& reader = **r;
  const auto& info = reader.info();
  const auto n = static_cast<uint32_t>(info.streams.size());
  std::atomic<uint64_t> done{0};
  const auto t0 = std::chrono::steady_clock::now();
  auto progress = [&] {
    return Progress{done.load(), info.total_bytes(), std::chrono::steady_clock::now() - t0};
  };
  Status result;
  {
    Ticker tick("restored", progress);
#ifdef IBNBD_MIGRATE_RDMA
    if (!a.rdma.empty()) {
      if (n != 1) {
        refuse(a);
        return fail("image " + a.image, ibtrs::errc(EINVAL), "it holds multifd channels: restore it over a unix socket");
      }
      result = restore_rdma(a, reader, done);
    } else
#endif
    if (a.unix_path.empty()) {
      if (n != 1) {
        refuse(a);
        return fail("image " + a.image, ibtrs::errc(EINVAL), "it holds multifd channels: restore it over a unix socket");
      }
      widen_pipe(STDOUT_FILENO);
      result = pump_out(reader, 0, STDOUT_FILENO, done);
    } else {
      // Main first: QEMU takes the first connection as the main channel; the multifd channels
      // then connect in their order, each fed by its own thread.
      std::vector<base::UniqueFd> fds;
      for (uint32_t s = 0; s < n && result; ++s) {
        auto c = connect_retrying(a.unix_path);
        if (!c) result = c.error();
        else fds.emplace_back(*c);
      }
      std::vector<Status> results(fds.size());
      std::vector<std::thread> pumps;
      for (uint32_t s = 0; s < fds.size(); ++s)
        pumps.emplace_back([&, s] {
          results[s] = pump_out(reader, s, fds[s].get(), done);
          ::shutdown(fds[s].get(), SHUT_WR);
        });
      for (auto& t : pumps) t.join();
      fds.clear();
      for (auto& x : results)
        if (result && !x) result = x;
    }
  }
  if (!result) return fail("restore " + a.image, result.error());
  report("restored", progress(), true);
  return 0;
}

std::string uuid_string(const std::array<uint8_t, 16>& u) {
  char b[37];
  std::snprintf(b, sizeof b, "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
                u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
  return b;
}

std::string time_string(std::chrono::system_clock::time_point t) {
  if (t.time_since_epoch().count() == 0) return "-";
  const std::time_t tt = std::chrono::system_clock::to_time_t(t);
  std::tm tm{};
  ::gmtime_r(&tt, &tm);
  char b[32];
  std::strftime(b, sizeof b, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return b;
}

int do_list(ImageStore& store) {
  auto l = store.list();
  if (!l) return fail("list", l.error(), store.last_error());
  std::printf("%-20s %-9s %10s %7s %6s %-20s %-36s %-20s %s\n", "image", "state", "bytes", "streams",
              "zero", "machine", "vm_uuid", "committed", "problem");
  for (const auto& i : *l)
    std::printf("%-20s %-9s %10" PRIu64 " %7zu %6" PRIu64 " %-20s %-36s %-20s %s\n", i.name.c_str(),
                std::string(to_string(i.state)).c_str(), i.total_bytes(), i.streams.size(), i.zero_chunks,
                i.machine_type.empty() ? "-" : i.machine_type.c_str(), uuid_string(i.vm_uuid).c_str(),
                time_string(i.committed).c_str(), i.problem.c_str());
  return 0;
}

int do_verify(const Args& a, ImageStore& store) {
  auto r = store.open_image(a.image);
  if (!r) return fail("image " + a.image, r.error(), store.last_error());
  Progress last;
  auto v = (*r)->verify([&](const Progress& p) { last = p; });
  if (!v) return fail("verify " + a.image, v.error(), (*r)->last_error());
  report("verified", last, true);
  std::printf("%s: ok (%" PRIu64 " bytes in %zu stream%s)\n", a.image.c_str(), (*r)->info().total_bytes(),
              (*r)->info().streams.size(), (*r)->info().streams.size() > 1 ? "s" : "");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  ::signal(SIGPIPE, SIG_IGN);  // a closed QEMU socket is an error return, not a death
  std::unique_ptr<BlockSession> session;
  Result<std::unique_ptr<Volume>> vol = ibtrs::errc(EINVAL);
  if (!a.nbd_path.empty()) {
    // The daemon's mapping: its access mode decides (a ro export fails a save with EPERM).
    vol = nbd_volume(a.nbd_path, a.volume);
    if (!vol) {
      if (a.cmd == "restore") refuse(a);
      return fail("nbd export " + a.volume + " on " + a.nbd_path, vol.error());
    }
  } else {
    BlockSessionOptions o;
    o.transport.session_name = a.session.empty() ? "migrate-" + std::to_string(::getpid()) : a.session;
    o.transport.paths = a.paths;
    o.bounce_slots = 0;  // chunks move from the image's registered rings
    if (!a.host_key.empty()) {
      std::string why;
      auto auth = ibtrs::client_auth_from_key_file(a.host_key, {}, &why);
      if (!auth) {
        std::fprintf(stderr, "ibnbd-migrate: host-key: %s\n", why.c_str());
        return auth.error().value();
      }
      o.transport.auth = std::move(*auth);
    }
    auto s = BlockSession::open(std::move(o));
    if (!s) return fail("session", s.error());
    session = std::move(*s);
    const bool writes = a.cmd == "save" || a.cmd == "delete";
    auto dev = session->map(a.volume, writes ? AccessMode::migration : AccessMode::ro);
    if (!dev) {
      if (a.cmd == "restore") refuse(a);
      return fail("map " + a.volume, dev.error());
    }
    vol = device_volume(*session, *dev);
    if (!vol) return fail("volume", vol.error());
  }
  auto store = ImageStore::open(**vol);
  if (!store) {
    if (a.cmd == "restore") refuse(a);
    return fail("images on " + a.volume, store.error());
  }
  int rc = 0;
  if (a.cmd == "save") rc = do_save(a, **store);
  else if (a.cmd == "restore") rc = do_restore(a, **store);
  else if (a.cmd == "list") rc = do_list(**store);
  else if (a.cmd == "verify") rc = do_verify(a, **store);
  else if (auto d = (*store)->remove(a.image); !d) rc = fail("delete " + a.image, d.error(), (*store)->last_error());
  store->reset();
  vol->reset();
  if (session) (void)session->unmap(a.volume);
  return rc;
}
