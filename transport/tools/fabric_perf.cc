// ibtrs-fabric-perf: moves and verifies data over a fabric provider and measures it.
//
//   ibtrs-fabric-perf server --listen tcp:127.0.0.1:18515 [--once] [--busy-poll]
//   ibtrs-fabric-perf client --connect tcp:127.0.0.1:18515 --test lat|bw|verify [options]
//
// Protocol between the two (over the fabric itself): the client's connect private data carries
// its buffer (addr, rkey, length); the server's accept data carries the server's. Every request
// is a WRITE_WITH_IMM into the server's buffer whose immediate says what it is:
//   kPing   | seq    the server answers with a WRITE_WITH_IMM of the same size (round trip)
//   kVerify | block  the server checks the block's pattern, writes its own pattern for the block
//                    back into the client's buffer and answers kVerify | block | ok-bit
//   kBw              plain WRITEs carry no immediate; a final kPing closes a bandwidth run
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/le.h"
#include "base/pattern.h"
#include "base/text.h"
#include "fabric/fabric.h"

using namespace ibtrs;
using namespace ibtrs::fabric;
using base::le32;
using base::le64;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint32_t kPing = 1u << 28;
constexpr uint32_t kVerify = 2u << 28;
constexpr uint32_t kTypeMask = 0xfu << 28;
constexpr uint32_t kVerifyBad = 1u << 27;
constexpr uint32_t kPayloadMask = (1u << 27) - 1;
constexpr uint32_t kRecvDepth = 256;

struct BufferInfo {
  le64 addr;        // base of the peer's registered buffer
  le32 rkey;        // its key
  le32 reserved;    // 0
  le64 length;      // its size in bytes
  le32 block_size;  // client: verify block size; server: 0
  le32 reserved2;   // 0
};
BASE_WIRE_STRUCT(BufferInfo, 32);

struct Options {
  std::string mode;
  std::string address;
  std::string source;
  std::string test = "lat";
  size_t size = 8;
  std::vector<size_t> sizes;
  uint32_t iters = 10000;
  uint32_t depth = 16;
  uint32_t batch = 1;  // bw: work requests per post_send call
  double seconds = 2.0;
  size_t buffer = 64u << 20;
  bool busy_poll = false;
  bool once = false;
  bool json = false;
};

[[noreturn]] void die(const char* what, std::error_code ec = {}) {
  std::fprintf(stderr, "ibtrs-fabric-perf: %s%s%s\n", what, ec ? ": " : "", ec ? ec.message().c_str() : "");
  std::exit(1);
}

// The pattern of a block (base/pattern.h's, seeded by the block number), from its first byte.
void fill_pattern(std::byte* p, size_t len, uint32_t seed) { base::Pattern(seed).fill({p, len}, 0); }

bool check_pattern(const std::byte* p, size_t len, uint32_t seed) {
  return base::Pattern(seed).check({p, len}, 0) < 0;
}

struct Endpoint {
  std::unique_ptr<Fabric> fabric;
  Domain* domain = nullptr;
  std::unique_ptr<CompletionQueue> cq;
  std::unique_ptr<Connection> conn;
  std::vector<std::byte> buf;
  std::unique_ptr<MemoryRegion> mr;
  BufferInfo peer{};
  bool busy = false;
  bool down = false;

  size_t reap(std::span<Completion> wc, std::chrono::milliseconds timeout) {
    if (!busy) return cq->wait(wc, timeout);
    auto until = Clock::now() + timeout;
    do {
      size_t n = cq->poll(wc);
      if (n > 0) return n;
    } while (Clock::now() < until);
    return 0;
  }
  void post_recvs(uint32_t n) {
    std::vector<RecvWr> r(n, RecvWr{0, {}});
    if (auto st = conn->post_recv(r); !st) die("post_recv", st.error());
  }
  // Verbs frees the send-queue slots of unsignalled requests only when a later signalled one
  // completes, so every kSignalEvery-th request is signalled whatever the caller asked.
  static constexpr uint64_t kSignalEvery = 16;
  uint64_t posted = 0;

  void write_imm(uint64_t id, size_t off, size_t len, uint64_t remote_off, uint32_t imm, bool signaled = true) {
    signaled = signaled || ++posted % kSignalEvery == 0;
    Sge s = mr->sge(off, static_cast<uint32_t>(len));
    SendWr w{id, Opcode::write_with_imm, len ? std::span<const Sge>(&s, 1) : std::span<const Sge>(),
             peer.addr.get() + remote_off, peer.rkey.get(), imm, signaled};
    if (auto st = conn->post_send({&w, 1}); !st) die("post_send", st.error());
  }
};

Endpoint make_endpoint(const Address& addr, const Options& o) {
  Endpoint e;
  FabricOptions fo;
  fo.busy_poll = o.busy_poll;
  auto f = open_fabric(addr.fabric, fo);
  if (!f) die("open fabric", f.error());
  e.fabric = std::move(f).value();
  e.busy = o.busy_poll;
  return e;
}

void setup_memory(Endpoint& e, size_t len) {
  auto cq = e.domain->create_cq(4 * kRecvDepth);
  if (!cq) die("create_cq", cq.error());
  e.cq = std::move(cq).value();
  e.buf.assign(len, std::byte{0});
  auto mr = e.domain->register_memory(e.buf.data(), len, kLocalWrite | kRemoteWrite);
  if (!mr) die("register_memory", mr.error());
  e.mr = std::move(mr).value();
}

BufferInfo info_of(const Endpoint& e, uint32_t block_size) {
  BufferInfo b{};
  std::memset(&b, 0, sizeof(b));
  b.addr.set(e.mr->remote_addr());
  b.rkey.set(e.mr->rkey());
  b.length.set(e.buf.size());
  b.block_size.set(block_size);
  return b;
}

QueueCaps caps_for(uint32_t depth) {
  QueueCaps c;
  c.max_send_wr = std::max<uint32_t>(depth + 2, 64);
  c.max_recv_wr = kRecvDepth;
  c.max_send_sge = 1;
  c.max_recv_sge = 1;
  return c;
}

// ----- server ----------------------------------------------------------------------------------

void serve(Endpoint& e) {
  Completion wc[64];
  uint64_t verified = 0, bad = 0;
  const uint32_t bs = e.peer.block_size.get();
  while (!e.down) {
    size_t n = e.reap(wc, std::chrono::milliseconds(200));
    uint32_t reposts = 0;
    for (size_t i = 0; i < n; ++i) {
      const Completion& c = wc[i];
      if (c.status != WcStatus::success) {
        if (c.status != WcStatus::flush_error) std::fprintf(stderr, "server: completion %s\n", std::string(to_string(c.status)).c_str());
        e.down = true;
        continue;
      }
      if (c.opcode != Opcode::recv_rdma_with_imm) continue;
      ++reposts;
      const uint32_t type = c.imm & kTypeMask;
      const uint32_t arg = c.imm & kPayloadMask;
      if (type == kPing) {
        e.write_imm(0, 0, c.byte_len, 0, c.imm, false);
      } else if (type == kVerify && bs > 0) {
        const size_t nblocks = e.buf.size() / bs;
        const size_t off = (arg % nblocks) * bs;
        bool good = c.byte_len == bs && check_pattern(e.buf.data() + off, bs, arg);
        good ? ++verified : ++bad;
        fill_pattern(e.buf.data() + off, bs, arg ^ 0x5a5a5a);
        e.write_imm(0, off, bs, off, kVerify | arg | (good ? 0 : kVerifyBad), false);
      }
    }
    if (reposts > 0) e.post_recvs(reposts);
    if (e.conn->state() != ConnState::connected) e.down = true;
  }
  std::printf("server: client gone; %" PRIu64 " blocks verified, %" PRIu64 " bad\n", verified, bad);
  std::fflush(stdout);
}

int run_server(const Options& o) {
  auto addr = Address::parse(o.address);
  if (!addr) die("bad --listen address", addr.error());
  Endpoint proto = make_endpoint(*addr, o);
  auto l = proto.fabric->listen(*addr);
  if (!l) die("listen", l.error());
  std::printf("server: listening on %s\n", (*l)->address().to_string().c_str());
  std::fflush(stdout);
  do {
    auto req = (*l)->get_request(std::chrono::hours(24));
    if (!req) {
      if (req.error() == errc(ETIMEDOUT)) continue;
      die("get_request", req.error());
    }
    Endpoint e;
    e.busy = o.busy_poll;
    e.domain = &(*req)->domain();
    auto pd = (*req)->private_data();
    if (pd.size() != sizeof(BufferInfo)) {
      std::vector<std::byte> why(4);
      (void)(*req)->reject(why);
      continue;
    }
    std::memcpy(&e.peer, pd.data(), sizeof(BufferInfo));
    setup_memory(e, o.buffer);
    BufferInfo mine = info_of(e, 0);
    auto c = (*req)->accept(*e.cq, caps_for(o.depth),
                            std::span(reinterpret_cast<const std::byte*>(&mine), sizeof(mine)),
                            ConnectionEvents{[&e](std::error_code) { e.down = true; }});
    if (!c) {
      std::fprintf(stderr, "server: accept failed: %s\n", c.error().message().c_str());
      continue;
    }
    e.conn = std::move(c).value();
    e.post_recvs(kRecvDepth);
    std::printf("server: client %s connected\n", e.conn->peer_address().to_string().c_str());
    std::fflush(stdout);
    serve(e);
    e.conn.reset();
  } while (!o.once);
  return 0;
}

// ----- client ----------------------------------------------------------------------------------

Endpoint connect_client(const Options& o, uint32_t block_size) {
  auto addr = Address::parse(o.address);
  if (!addr) die("bad --connect address", addr.error());
  Endpoint e = make_endpoint(*addr, o);
  std::optional<Address> src;
  if (!o.source.empty()) {
    auto s = Address::parse(o.source);
    if (!s || s->fabric != addr->fabric) die("bad --source address");
    src = *s;
  }
  auto d = e.fabric->domain_for(*addr, src ? &*src : nullptr);
  if (!d) die("domain_for", d.error());
  e.domain = *d;
  setup_memory(e, o.buffer);
  BufferInfo mine = info_of(e, block_size);
  ConnectParams p;
  p.remote = *addr;
  p.source = src ? &*src : nullptr;
  p.cq = e.cq.get();
  p.caps = caps_for(o.depth);
  p.private_data = std::span(reinterpret_cast<const std::byte*>(&mine), sizeof(mine));
  p.events.on_disconnected = [&e](std::error_code) { e.down = true; };
  p.timeout = std::chrono::seconds(10);
  std::vector<std::byte> reject;
  auto c = e.domain->connect(p, &reject);
  if (!c) die("connect", c.error());
  e.conn = std::move(c->connection);
  if (c->private_data.size() != sizeof(BufferInfo)) die("bad accept data");
  std::memcpy(&e.peer, c->private_data.data(), sizeof(BufferInfo));
  e.post_recvs(kRecvDepth);
  return e;
}

double pct(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  size_t i = std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + static_cast<ptrdiff_t>(i), v.end());
  return v[i];
}

// Round trip of `size`-byte WRITE_WITH_IMMs, one at a time.
int run_lat(Endpoint& e, const Options& o) {
  std::vector<double> us;
  us.reserve(o.iters);
  Completion wc[16];
  const uint32_t warmup = std::min<uint32_t>(1000, o.iters / 10);
  for (uint32_t i = 0; i < o.iters + warmup; ++i) {
    auto t0 = Clock::now();
    e.write_imm(i, 0, o.size, 0, kPing | (i & kPayloadMask), false);
    bool got = false;
    while (!got) {
      size_t n = e.reap(wc, std::chrono::milliseconds(5000));
      if (n == 0) die("round trip timed out");
      for (size_t k = 0; k < n; ++k) {
        if (wc[k].status != WcStatus::success) die("completion error");
        if (wc[k].opcode == Opcode::recv_rdma_with_imm) {
          got = true;
          e.post_recvs(1);
        }
      }
    }
    if (i >= warmup) us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  double avg = 0;
  for (double v : us) avg += v;
  avg /= static_cast<double>(us.size());
  double p50 = pct(us, 0.5), p99 = pct(us, 0.99);
  if (o.json) {
    std::printf("{\"test\":\"lat\",\"size\":%zu,\"iters\":%u,\"avg_us\":%.3f,\"p50_us\":%.3f,\"p99_us\":%.3f}\n",
                o.size, o.iters, avg, p50, p99);
  } else {
    std::printf("latency  size %zu B  round trip: avg %.2f us  p50 %.2f us  p99 %.2f us  (%u iters)\n",
                o.size, avg, p50, p99, o.iters);
  }
  return 0;
}

// Streams WRITEs of each size for o.seconds with o.depth outstanding.
int run_bw(Endpoint& e, const Options& o) {
  std::vector<size_t> sizes = o.sizes.empty() ? std::vector<size_t>{o.size} : o.sizes;
  Completion wc[64];
  for (size_t size : sizes) {
    if (size > e.peer.length.get() || size > e.buf.size()) die("size larger than the buffers");
    const size_t slots = std::max<size_t>(1, std::min<size_t>(e.peer.length.get(), e.buf.size()) / size);
    // Signal every 8th write: completions free the slots of the ones before (verbs rule).
    const uint32_t signal_every = std::min<uint32_t>(8, std::max<uint32_t>(1, o.depth / 2));
    uint64_t posted = 0, completed = 0;
    bool tail_signaled = true;
    std::vector<Sge> sges(o.batch);
    std::vector<SendWr> wrs(o.batch);
    auto t0 = Clock::now();
    auto until = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.seconds));
    while (Clock::now() < until || completed < posted) {
      while (Clock::now() < until && posted - completed < o.depth) {
        // Up to o.batch writes per post_send: one system call for the batch on tcp.
        const uint64_t n = std::min<uint64_t>(o.batch, o.depth - (posted - completed));
        for (uint64_t i = 0; i < n; ++i) {
          const uint64_t k = posted + i;
          size_t off = (k % slots) * size;
          sges[i] = e.mr->sge(off, static_cast<uint32_t>(size));
          wrs[i] = SendWr{k + 1, Opcode::write, {&sges[i], 1}, e.peer.addr.get() + off,
                          e.peer.rkey.get(), 0, (k + 1) % signal_every == 0};
        }
        if (auto st = e.conn->post_send({wrs.data(), n}); !st) {
          if (st.error() == errc(ENOMEM)) break;
          die("post_send", st.error());
        }
        posted += n;
        tail_signaled = wrs[n - 1].signaled;
      }
      if (!tail_signaled && Clock::now() >= until) {
        // Close the run with a signalled zero-length write: its completion covers the tail.
        SendWr w{posted, Opcode::write, {}, 0, 0, 0, true};
        if (auto st = e.conn->post_send({&w, 1}); st.ok()) {
          tail_signaled = true;
        } else if (st.error() != errc(ENOMEM)) {
          die("post_send (closing write)", st.error());
        }
      }
      size_t n = e.reap(wc, std::chrono::milliseconds(5000));
      if (n == 0) die("bandwidth run stalled");
      for (size_t k = 0; k < n; ++k) {
        if (wc[k].status != WcStatus::success) die("completion error");
        completed = std::max<uint64_t>(completed, wc[k].wr_id);
      }
    }
    double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    double mib = static_cast<double>(posted) * static_cast<double>(size) / (1 << 20);
    if (o.json) {
      std::printf("{\"test\":\"bw\",\"size\":%zu,\"depth\":%u,\"batch\":%u,\"seconds\":%.3f,\"mib_s\":%.1f,\"ops_s\":%.0f}\n",
                  size, o.depth, o.batch, secs, mib / secs, static_cast<double>(posted) / secs);
    } else {
      std::printf("bandwidth  size %8zu B  depth %u: %9.1f MiB/s  %9.0f writes/s\n", size, o.depth,
                  mib / secs, static_cast<double>(posted) / secs);
    }
    std::fflush(stdout);
  }
  return 0;
}

// Writes o.iters blocks of patterned data; the server checks each and writes its own pattern
// back, which the client checks: data verified in both directions.
int run_verify(Endpoint& e, const Options& o) {
  const size_t bs = o.size;
  const size_t nblocks = std::min(e.buf.size(), static_cast<size_t>(e.peer.length.get())) / bs;
  if (nblocks < o.depth) die("buffer too small for --depth blocks of --size");
  Completion wc[64];
  uint64_t sent = 0, ok = 0, bad = 0, inflight = 0;
  auto t0 = Clock::now();
  while (ok + bad < o.iters) {
    while (sent < o.iters && inflight < o.depth) {
      const uint32_t block = static_cast<uint32_t>(sent & kPayloadMask);
      const size_t off = (block % nblocks) * bs;
      fill_pattern(e.buf.data() + off, bs, block);
      e.write_imm(sent, off, bs, off, kVerify | block, false);
      ++sent;
      ++inflight;
    }
    size_t n = e.reap(wc, std::chrono::milliseconds(5000));
    if (n == 0) {
      std::fprintf(stderr, "verify: sent %" PRIu64 ", answered %" PRIu64 ", in flight %" PRIu64 "\n",
                   sent, ok + bad, inflight);
      die("verify run stalled for 5 s");
    }
    uint32_t reposts = 0;
    for (size_t k = 0; k < n; ++k) {
      if (wc[k].status != WcStatus::success) die("completion error");
      if (wc[k].opcode != Opcode::recv_rdma_with_imm) continue;
      ++reposts;
      --inflight;
      const uint32_t block = wc[k].imm & kPayloadMask;
      const size_t off = (block % nblocks) * bs;
      const bool server_ok = (wc[k].imm & kVerifyBad) == 0;
      const bool back_ok = check_pattern(e.buf.data() + off, bs, block ^ 0x5a5a5a);
      (server_ok && back_ok) ? ++ok : ++bad;
    }
    if (reposts > 0) e.post_recvs(reposts);
  }
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  double mib = 2.0 * static_cast<double>(ok + bad) * static_cast<double>(bs) / (1 << 20);
  if (o.json) {
    std::printf("{\"test\":\"verify\",\"size\":%zu,\"blocks\":%" PRIu64 ",\"bad\":%" PRIu64 ",\"mib_s\":%.1f}\n",
                bs, ok, bad, mib / secs);
  } else {
    std::printf("verify  %" PRIu64 " blocks of %zu B written, checked by the server, written back and "
                "checked: %" PRIu64 " good, %" PRIu64 " bad  (%.1f MiB/s both ways)\n",
                ok + bad, bs, ok, bad, mib / secs);
  }
  return bad == 0 ? 0 : 3;
}

size_t parse_size(std::string_view s) {
  auto v = base::parse_size(s);
  if (!v || *v == 0) die("bad size");
  return static_cast<size_t>(*v);
}

[[noreturn]] void usage() {
  std::fprintf(stderr,
               "usage: ibtrs-fabric-perf server --listen ADDR [--once] [--busy-poll] [--buffer SIZE]\n"
               "       ibtrs-fabric-perf client --connect ADDR [--source ADDR] --test lat|bw|verify [--size SIZE]\n"
               "                         [--sizes S1,S2,...] [--iters N] [--depth N] [--batch N] [--seconds S]\n"
               "                         [--busy-poll] [--buffer SIZE] [--json]\n"
               "ADDR: tcp:HOST:PORT | rdma:HOST:PORT\n");
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) usage();
  Options o;
  o.mode = argv[1];
  for (int i = 2; i < argc; ++i) {
    std::string_view a = argv[i];
    auto next = [&]() -> std::string_view {
      if (i + 1 >= argc) usage();
      return argv[++i];
    };
    if (a == "--listen" || a == "--connect") o.address = next();
    else if (a == "--source") o.source = next();
    else if (a == "--test") o.test = next();
    else if (a == "--size") o.size = parse_size(next());
    else if (a == "--sizes") {
      std::string_view list = next();
      while (!list.empty()) {
        auto comma = list.find(',');
        o.sizes.push_back(parse_size(list.substr(0, comma)));
        list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
      }
    } else if (a == "--iters") o.iters = static_cast<uint32_t>(std::atoi(std::string(next()).c_str()));
    else if (a == "--batch") o.batch = static_cast<uint32_t>(std::atoi(std::string(next()).c_str()));
    else if (a == "--depth") o.depth = static_cast<uint32_t>(std::atoi(std::string(next()).c_str()));
    else if (a == "--seconds") o.seconds = std::atof(std::string(next()).c_str());
    else if (a == "--buffer") o.buffer = parse_size(next());
    else if (a == "--busy-poll") o.busy_poll = true;
    else if (a == "--once") o.once = true;
    else if (a == "--json") o.json = true;
    else usage();
  }
  if (o.address.empty() || o.depth == 0 || o.depth > 1024 || o.iters == 0 || o.batch == 0 ||
      o.batch > o.depth)
    usage();
  if (o.mode == "server") return run_server(o);
  if (o.mode != "client") usage();
  Endpoint e = connect_client(o, o.test == "verify" ? static_cast<uint32_t>(o.size) : 0);
  int rc;
  if (o.test == "lat") rc = run_lat(e, o);
  else if (o.test == "bw") rc = run_bw(e, o);
  else if (o.test == "verify") rc = run_verify(e, o);
  else usage();
  e.conn->disconnect();
  return rc;
}
