#include "integration_harness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <sstream>
#include <thread>

#include "base/pattern.h"
#include "fabric/loopback/loopback.h"

namespace ibnbd::itest {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using ibtrs::IoSeg;

ibtrs::FabricKind g_kind = ibtrs::FabricKind::loopback;
uint64_t g_seed = 0;

uint64_t test_seed(uint64_t fallback) {
  const uint64_t seed = g_seed != 0 ? g_seed : fallback;
  const auto* t = ::testing::UnitTest::GetInstance()->current_test_info();
  std::printf("[ seed     ] %s.%s: %llu (replay with --seed=%llu)\n", t->test_suite_name(), t->name(),
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(seed));
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  return seed;
}

// base/pattern.h's pattern with the version as its seed (the same bytes as this harness's own
// generator before base/ had one).
void fill_pattern(std::byte* p, size_t len, uint64_t dev_off, uint64_t version) {
  base::fill_pattern(std::span(p, len), version, dev_off);
}

int64_t first_diff(const std::byte* got, const std::byte* want, size_t len) {
  if (std::memcmp(got, want, len) == 0) return -1;
  for (size_t i = 0; i < len; ++i)
    if (got[i] != want[i]) return static_cast<int64_t>(i);
  return -1;
}

// ---------------------------------------------------------------------------------------------

std::string to_string(Store s) { return s == Store::direct ? "direct_var_tmp" : "buffered_dev_shm"; }

ExportFile::ExportFile(Store store, const std::string& name, uint64_t size) : name_(name) {
  std::string tmpl = store == Store::direct ? "/var/tmp/ibnbd-integ-XXXXXX" : "/dev/shm/ibnbd-integ-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) {
    why_ = "mkdtemp " + tmpl + ": " + std::strerror(errno);
    return;
  }
  base::UniqueFd fd(::open((tmpl + "/" + name).c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600));
  if (!fd) {
    why_ = "create in " + tmpl + ": " + std::strerror(errno);
    fs::remove_all(tmpl);
    return;
  }
  std::vector<std::byte> buf(1 << 20);
  for (uint64_t off = 0; off < size; off += buf.size()) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), size - off));
    fill_pattern(buf.data(), n, off, 0);
    if (::pwrite(fd.get(), buf.data(), n, static_cast<off_t>(off)) != static_cast<ssize_t>(n)) {
      why_ = "fill " + tmpl + ": " + std::strerror(errno);
      fs::remove_all(tmpl);
      return;
    }
  }
  root_ = tmpl;
}

ExportFile::~ExportFile() {
  if (!root_.empty()) {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
}

std::vector<std::byte> ExportFile::pread(uint64_t off, size_t len) const {
  std::vector<std::byte> out(len);
  base::UniqueFd fd(::open(path().c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd || ::pread(fd.get(), out.data(), len, static_cast<off_t>(off)) != static_cast<ssize_t>(len)) {
    ADD_FAILURE() << "pread " << path() << " @" << off << "+" << len << ": " << std::strerror(errno);
    out.clear();
  }
  return out;
}

Endpoints::Endpoints(const std::string& tag, size_t n) {
  static std::atomic<int> seq{0};
  const int id = ++seq;
  for (size_t i = 0; i < n; ++i) {
    if (g_kind == ibtrs::FabricKind::loopback) {
      addrs_.push_back(*ibtrs::Address::parse("loopback:integ-" + tag + "-" + std::to_string(id) + "-" +
                                              std::to_string(i) + ":" + std::to_string(4000 + i)));
      continue;
    }
    // A bound socket that never listens keeps the port ours: port 0 binds and connects elsewhere
    // in the machine skip it, and the server (SO_REUSEADDR too) may still bind and listen on it,
    // again after a restart.
    base::UniqueFd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    int one = 1;
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t sl = sizeof(sa);
    if (!s || ::setsockopt(s.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
        ::bind(s.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 ||
        ::getsockname(s.get(), reinterpret_cast<sockaddr*>(&sa), &sl) != 0) {
      ADD_FAILURE() << "reserving a tcp port: " << std::strerror(errno);
      continue;
    }
    addrs_.push_back(*ibtrs::Address::parse("tcp:127.0.0.1:" + std::to_string(ntohs(sa.sin_port))));
    holds_.push_back(std::move(s));
  }
}

// ---------------------------------------------------------------------------------------------

Model::Model(uint64_t size, uint32_t block)
    : bytes_(size), known_(size / block, true), block_(block) {
  fill_pattern(bytes_.data(), bytes_.size(), 0, 0);
}

void Model::write_pattern(uint64_t off, size_t len, uint64_t version) {
  fill_pattern(bytes_.data() + off, len, off, version);
  std::fill(known_.begin() + static_cast<ptrdiff_t>(off / block_),
            known_.begin() + static_cast<ptrdiff_t>((off + len) / block_), true);
}

void Model::zero(uint64_t off, size_t len) {
  std::memset(bytes_.data() + off, 0, len);
  std::fill(known_.begin() + static_cast<ptrdiff_t>(off / block_),
            known_.begin() + static_cast<ptrdiff_t>((off + len) / block_), true);
}

void Model::forget(uint64_t off, size_t len) {
  std::fill(known_.begin() + static_cast<ptrdiff_t>(off / block_),
            known_.begin() + static_cast<ptrdiff_t>((off + len) / block_), false);
}

std::string Model::check(uint64_t off, const std::byte* got, size_t len) const {
  size_t bad = 0;
  std::ostringstream first;
  for (size_t i = 0; i < len; i += block_) {
    const uint64_t o = off + i;
    if (!known_[o / block_]) continue;
    const int64_t d = first_diff(got + i, bytes_.data() + o, block_);
    if (d < 0) continue;
    if (bad++ == 0) {
      const bool zeros = std::all_of(got + i, got + i + block_, [](std::byte b) { return b == std::byte{0}; });
      first << "first at device offset " << o + static_cast<uint64_t>(d) << " (block " << o / block_
            << (zeros ? ", read as zeros" : "") << ")";
    }
  }
  if (bad == 0) return {};
  return std::to_string(bad) + " block(s) differ from the model, " + first.str();
}

void Done::cb(void* ctx, int err) {
  auto* d = static_cast<Done*>(ctx);
  std::lock_guard l(d->mu);
  ++d->calls;
  d->err = err;
  d->cv.notify_all();
}

int Done::wait(std::chrono::milliseconds t) {
  std::unique_lock l(mu);
  if (!cv.wait_for(l, t, [&] { return calls > 0; })) return -ETIMEDOUT;
  return err;
}

int sync_io(const std::function<Status(IoDone)>& submit) {
  Done d;
  auto st = submit(d.io());
  if (!st.ok()) return -st.error().value();
  const int e = d.wait();
  if (e == -ETIMEDOUT) {
    // The request still owns the caller's memory and `d`: nothing can be freed safely.
    std::fprintf(stderr, "a request did not complete within 30 s: aborting\n");
    std::abort();
  }
  std::lock_guard l(d.mu);
  EXPECT_EQ(d.calls, 1) << "completed more than once";
  return e;
}

bool wait_until(const std::function<bool()>& pred, std::chrono::milliseconds t) {
  const auto end = Clock::now() + t;
  while (Clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(2ms);
  }
  return pred();
}

// ---------------------------------------------------------------------------------------------
// Load

std::string_view to_string(OpKind k) {
  switch (k) {
    case OpKind::read: return "read";
    case OpKind::read_segs: return "read(segments)";
    case OpKind::read_copy: return "read_copy";
    case OpKind::write: return "write";
    case OpKind::write_segs: return "write(segments)";
    case OpKind::write_copy: return "write_copy";
    case OpKind::flush: return "flush";
    case OpKind::discard: return "discard";
    case OpKind::write_zeroes: return "write_zeroes";
    case OpKind::kCount: break;
  }
  return "?";
}

std::string LoadReport::summary() const {
  std::ostringstream o;
  for (size_t k = 0; k < static_cast<size_t>(OpKind::kCount); ++k)
    o << to_string(static_cast<OpKind>(k)) << " " << by_kind[k] << ", ";
  o << "split " << split << ", fua " << fua << ", preflush " << preflush << ", no_unmap " << no_unmap
    << ", submitted while down " << submitted_down << ", failed " << failed << ", mismatches "
    << mismatches;
  return o.str();
}

namespace {

constexpr uint32_t kMaxGenSegs = 40;   // segments of a scattered request (splits by count too)
constexpr uint32_t kMaxGap = 256;      // bytes between two segments
constexpr std::byte kPoison{0xa5};     // what a read buffer holds before the read

bool is_read(OpKind k) { return k == OpKind::read || k == OpKind::read_segs || k == OpKind::read_copy; }
bool is_write(OpKind k) { return k == OpKind::write || k == OpKind::write_segs || k == OpKind::write_copy; }

}  // namespace

struct Load::Op {
  OpKind kind = OpKind::read;
  uint64_t off = 0;
  uint64_t len = 0;
  uint32_t flags = 0;
  bool no_unmap = false;
  uint64_t version = 0;                // a write's pattern
  std::vector<uint32_t> seg_lens;      // *_segs: the scatter list
  std::vector<uint32_t> gaps;          // bytes skipped before each segment
  std::string describe() const {
    std::ostringstream o;
    o << to_string(kind) << " @" << off << "+" << len;
    if (flags != 0) o << " flags 0x" << std::hex << flags << std::dec;
    if (no_unmap) o << " no_unmap";
    if (!seg_lens.empty()) o << " in " << seg_lens.size() << " segments";
    return o.str();
  }
};

struct Load::Slot {
  Load* load = nullptr;
  uint32_t idx = 0;
  bool busy = false;
  Op op;
  std::byte* base = nullptr;          // slot_bytes_ of registered memory
  std::vector<IoSeg> segs;
  std::vector<std::byte> copy;        // read_copy / write_copy: unregistered memory
  std::vector<std::byte> scratch;     // gathered read data, the pattern of a scattered write
  std::atomic<uint32_t> calls{0};
  std::atomic<int> err{0};
};

Load::Load(BlockSession& s, RemoteDevice& d, Model& m, LoadOptions o)
    : s_(s), d_(d), m_(m), o_(std::move(o)), block_(d.geometry().logical_block_size) {
  if (o_.region_len == 0) o_.region_len = m_.size() - o_.region_off;
  // Up to three parts and a bit more: a request above max_part_bytes is split.
  max_len_ = std::min<uint64_t>(3 * uint64_t{d_.max_part_bytes()} + 5 * uint64_t{block_}, o_.region_len);
  slot_bytes_ = static_cast<size_t>(max_len_) + kMaxGenSegs * kMaxGap + 4096;
  slot_bytes_ = (slot_bytes_ + 4095) & ~size_t{4095};
  auto mem = s_.alloc_buffer(slot_bytes_ * o_.depth);
  if (!mem.ok()) {
    ADD_FAILURE() << "alloc_buffer: " << mem.error().message();
    o_.ops = 0;
    return;
  }
  mem_ = std::move(*mem);
  for (uint32_t i = 0; i < o_.depth; ++i) {
    auto sl = std::make_unique<Slot>();
    sl->load = this;
    sl->idx = i;
    sl->base = mem_->data() + size_t{i} * slot_bytes_;
    slots_.push_back(std::move(sl));
  }
}

Load::~Load() {
  for (auto& s : slots_) {
    if (s->busy) {
      std::fprintf(stderr, "Load destroyed with a request in flight: aborting\n");
      std::abort();
    }
  }
}

Load::Op Load::generate(std::mt19937_64& rng, uint64_t version) {
  struct W {
    OpKind k;
    uint32_t w;
  };
  const W weights[] = {
      {OpKind::read, 20},  {OpKind::read_segs, 12},  {OpKind::read_copy, o_.copy ? 8u : 0u},
      {OpKind::write, 20}, {OpKind::write_segs, 12}, {OpKind::write_copy, o_.copy ? 8u : 0u},
      {OpKind::flush, 4},  {OpKind::discard, o_.zeroing ? 6u : 0u},
      {OpKind::write_zeroes, o_.zeroing ? 6u : 0u},
  };
  uint32_t total = 0;
  for (auto& w : weights) total += w.w;
  uint32_t pick = static_cast<uint32_t>(rng() % total);
  Op op;
  for (auto& w : weights) {
    if (pick < w.w) {
      op.kind = w.k;
      break;
    }
    pick -= w.w;
  }
  if (op.kind == OpKind::flush) return op;

  const uint64_t region_blocks = o_.region_len / block_;
  const uint64_t part_blocks = std::max<uint64_t>(d_.max_part_bytes() / block_, 1);
  const uint64_t max_blocks = std::min<uint64_t>(max_len_ / block_, region_blocks);
  uint64_t nb = 0;
  const uint32_t size_class = static_cast<uint32_t>(rng() % 100);
  if (size_class < 55) {
    nb = 1 + rng() % 8;                                  // small
  } else if (size_class < 80) {
    nb = 1 + rng() % part_blocks;                        // up to one transport request
  } else {
    nb = part_blocks + 1 + rng() % (max_blocks - std::min(max_blocks, part_blocks) + 1);  // split
  }
  nb = std::clamp<uint64_t>(nb, 1, max_blocks);
  op.len = nb * block_;
  op.off = o_.region_off + (rng() % (region_blocks - nb + 1)) * block_;
  if (is_write(op.kind)) {
    op.version = version;
    static constexpr uint32_t kFlagSets[] = {0, kIoFua, kIoPreflush, kIoFua | kIoPreflush};
    op.flags = kFlagSets[rng() % 4];
  }
  if (op.kind == OpKind::write_zeroes) op.no_unmap = (rng() & 1) != 0;
  if (op.kind == OpKind::read_segs || op.kind == OpKind::write_segs) {
    // Mostly sector multiples, some odd lengths that end inside a block (at least an eighth of
    // one, so 15 in a row always hold a block); gaps between them, so the scatter is real.
    uint64_t left = op.len;
    while (left > 0) {
      uint64_t n = (rng() % 3 == 0) ? block_ / 8 + rng() % (2 * uint64_t{block_})
                                    : uint64_t{512} * (1 + rng() % 16);
      if (n > left || op.seg_lens.size() + 1 == kMaxGenSegs) n = left;
      op.seg_lens.push_back(static_cast<uint32_t>(n));
      op.gaps.push_back((rng() & 1) ? 0 : static_cast<uint32_t>(8 * (rng() % (kMaxGap / 8))));
      left -= n;
    }
  }
  return op;
}

bool Load::overlaps(const Op& op) const {
  if (op.kind == OpKind::flush) return false;
  for (auto& s : slots_) {
    if (!s->busy || s->op.kind == OpKind::flush) continue;
    if (op.off < s->op.off + s->op.len && s->op.off < op.off + op.len) return true;
  }
  return false;
}

void Load::on_done(void* ctx, int err) {
  auto* s = static_cast<Slot*>(ctx);
  Load* l = s->load;
  if (s->calls.fetch_add(1) != 0) {
    ADD_FAILURE() << "a request completed twice: " << s->op.describe();
    return;
  }
  s->err.store(err);
  std::lock_guard g(l->mu_);
  l->completed_.push_back(s->idx);
  l->cv_.notify_all();
}

void Load::submit(Slot& s, const Op& op) {
  s.op = op;
  s.busy = true;
  s.calls.store(0);
  s.err.store(0);
  const IoDone done{&Load::on_done, &s};
  const size_t len = static_cast<size_t>(op.len);
  ++rep_.by_kind[static_cast<size_t>(op.kind)];
  if ((is_read(op.kind) || is_write(op.kind)) && op.len > d_.max_part_bytes()) ++rep_.split;
  if (op.flags & kIoFua) ++rep_.fua;
  if (op.flags & kIoPreflush) ++rep_.preflush;
  if (op.no_unmap) ++rep_.no_unmap;
  if (s_.state() != SessionState::connected) ++rep_.submitted_down;

  s.segs.clear();
  if (!op.seg_lens.empty()) {
    size_t pos = 0;
    for (size_t i = 0; i < op.seg_lens.size(); ++i) {
      pos += op.gaps[i];
      s.segs.push_back(IoSeg{s.base + pos, op.seg_lens[i], mem_.get()});
      pos += op.seg_lens[i];
    }
  }
  Status st;
  switch (op.kind) {
    case OpKind::read: {
      std::fill_n(s.base, len, kPoison);
      s.segs.push_back(IoSeg{s.base, static_cast<uint32_t>(len), mem_.get()});
      st = d_.read(op.off, s.segs, done);
      break;
    }
    case OpKind::read_segs:
      for (auto& sg : s.segs) std::fill_n(static_cast<std::byte*>(sg.addr), sg.len, kPoison);
      st = d_.read(op.off, s.segs, done);
      break;
    case OpKind::read_copy:
      s.copy.assign(len, kPoison);
      st = d_.read_copy(op.off, s.copy, done);
      break;
    case OpKind::write:
      fill_pattern(s.base, len, op.off, op.version);
      s.segs.push_back(IoSeg{s.base, static_cast<uint32_t>(len), mem_.get()});
      st = d_.write(op.off, s.segs, op.flags, done);
      break;
    case OpKind::write_segs: {
      s.scratch.resize(len);
      fill_pattern(s.scratch.data(), len, op.off, op.version);
      size_t pos = 0;
      for (auto& sg : s.segs) {
        std::memcpy(sg.addr, s.scratch.data() + pos, sg.len);
        pos += sg.len;
      }
      st = d_.write(op.off, s.segs, op.flags, done);
      break;
    }
    case OpKind::write_copy:
      s.copy.resize(len);
      fill_pattern(s.copy.data(), len, op.off, op.version);
      st = d_.write_copy(op.off, s.copy, op.flags, done);
      break;
    case OpKind::flush: st = d_.flush(done); break;
    case OpKind::discard: st = d_.discard(op.off, op.len, done); break;
    case OpKind::write_zeroes: st = d_.write_zeroes(op.off, op.len, op.no_unmap, done); break;
    case OpKind::kCount: break;
  }
  if (!st.ok()) {
    ADD_FAILURE() << "seed " << o_.seed << ": " << op.describe() << " refused: " << st.error().message();
    ++rep_.failed;
    s.busy = false;
  }
}

void Load::complete(Slot& s) {
  const Op& op = s.op;
  const int err = s.err.load();
  s.busy = false;
  if (err != 0) {
    ++rep_.failed;
    ADD_FAILURE() << "seed " << o_.seed << ": " << op.describe() << " failed: " << std::strerror(err);
    if (!is_read(op.kind) && op.kind != OpKind::flush) m_.forget(op.off, static_cast<size_t>(op.len));
    return;
  }
  const size_t len = static_cast<size_t>(op.len);
  const std::byte* got = nullptr;
  switch (op.kind) {
    case OpKind::read: got = s.base; break;
    case OpKind::read_segs: {
      s.scratch.resize(len);
      size_t pos = 0;
      for (auto& sg : s.segs) {
        std::memcpy(s.scratch.data() + pos, sg.addr, sg.len);
        pos += sg.len;
      }
      got = s.scratch.data();
      break;
    }
    case OpKind::read_copy: got = s.copy.data(); break;
    case OpKind::write:
    case OpKind::write_segs:
    case OpKind::write_copy: m_.write_pattern(op.off, len, op.version); break;
    case OpKind::discard:
    case OpKind::write_zeroes: m_.zero(op.off, len); break;
    case OpKind::flush:
    case OpKind::kCount: break;
  }
  if (got != nullptr) {
    const std::string why = m_.check(op.off, got, len);
    if (!why.empty()) {
      ++rep_.mismatches;
      ADD_FAILURE() << "seed " << o_.seed << ": " << op.describe() << ": " << why;
    }
  }
}

LoadReport Load::run() {
  std::mt19937_64 rng(o_.seed);
  uint32_t next = 0, inflight = 0, completed = 0;
  std::optional<Op> pending;
  while (next < o_.ops || inflight > 0) {
    while (inflight < o_.depth && next < o_.ops) {
      if (!pending) pending = generate(rng, o_.seed * 1000003 + next + 1);
      if (overlaps(*pending)) break;  // waits for the overlapping request to complete
      Slot* free = nullptr;
      for (auto& s : slots_)
        if (!s->busy) free = s.get();
      submit(*free, *pending);
      pending.reset();
      ++next;
      if (free->busy) ++inflight;
    }
    if (inflight == 0) continue;
    std::vector<uint32_t> ready;
    {
      std::unique_lock l(mu_);
      if (!cv_.wait_for(l, o_.stall, [&] { return !completed_.empty(); })) {
        std::ostringstream o;
        for (auto& s : slots_)
          if (s->busy) o << "\n  in flight: " << s->op.describe();
        std::fprintf(stderr, "seed %llu: no completion for %lld ms with %u requests in flight:%s\n",
                     static_cast<unsigned long long>(o_.seed), static_cast<long long>(o_.stall.count()),
                     inflight, o.str().c_str());
        std::abort();  // their buffers cannot be freed while the library may still write them
      }
      ready.swap(completed_);
    }
    for (uint32_t idx : ready) {
      complete(*slots_[idx]);
      --inflight;
      ++completed;
      if (o_.on_step) o_.on_step(completed);
    }
  }
  return rep_;
}

std::string verify_device(RemoteDevice& d, BlockSession& s, const Model& m) {
  constexpr size_t kStep = 1 << 20;
  auto buf = s.alloc_buffer(kStep);
  if (!buf.ok()) return "alloc_buffer: " + buf.error().message();
  for (uint64_t off = 0; off < m.size(); off += kStep) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kStep, m.size() - off));
    std::fill_n((*buf)->data(), n, kPoison);
    IoSeg seg{(*buf)->data(), static_cast<uint32_t>(n), buf->get()};
    const int e = sync_io([&](IoDone done) { return d.read(off, std::span(&seg, 1), done); });
    if (e != 0) return "device read @" + std::to_string(off) + ": " + std::strerror(e < 0 ? -e : e);
    std::string why = m.check(off, (*buf)->data(), n);
    if (!why.empty()) return "device: " + why;
  }
  return {};
}

std::string verify_file(const ExportFile& f, const Model& m) {
  auto bytes = f.pread(0, static_cast<size_t>(m.size()));
  if (bytes.empty()) return "the file could not be read";
  std::string why = m.check(0, bytes.data(), bytes.size());
  return why.empty() ? why : "file: " + why;
}

// ---------------------------------------------------------------------------------------------
// Rig

void Rig::TearDown() {
  sess_.reset();
  server_.reset();
  ibtrs::fabric::loopback::faults().clear();
  eps_.reset();
  file_.reset();
}

ExportFile& Rig::make_file(Store store, uint64_t size) {
  file_ = std::make_unique<ExportFile>(store, "disk.img", size);
  return *file_;
}

BlockServerOptions Rig::server_options() const {
  BlockServerOptions o;
  o.transport.listen = eps_->addrs();
  o.transport.queue_depth = kQueueDepth;
  o.transport.chunk_size = kChunk;
  o.transport.max_io_size = kMaxIo;
  o.transport.io_threads = 2;
  o.transport.heartbeat = ibtrs::HeartbeatConfig{500ms, 6};
  o.dev_search_path = file_->root();
  o.hosts.push_back(HostConfig{kHost, {key_}, std::nullopt, {AccessRule{"**", AccessMode::migration}}});
  return o;
}

void Rig::start_server() {
  auto s = BlockServer::start(server_options());
  ASSERT_TRUE(s.ok()) << "BlockServer::start: " << s.error().message();
  server_ = std::move(*s);
}

BlockSessionOptions Rig::session_options(const std::string& name) const {
  BlockSessionOptions o;
  o.transport.session_name = name;
  for (auto& a : eps_->addrs()) o.transport.paths.push_back(ibtrs::PathSpec{std::nullopt, a});
  o.transport.io_threads = 2;
  o.transport.policy = ibtrs::MpPolicy::round_robin;
  o.transport.heartbeat = ibtrs::HeartbeatConfig{500ms, 6};
  o.transport.reconnect = ibtrs::ReconnectConfig{50ms, 50ms, 500ms, 10ms, -1};
  o.transport.connect_timeout = 3s;
  o.transport.pending_timeout = 15s;
  o.transport.auth = credentials();
  o.remap_timeout = 15s;
  o.control_timeout = 5s;
  o.bounce_slots = 8;
  auto* self = const_cast<Rig*>(this);
  o.on_device_event = [self](const DeviceEvent& e) {
    std::lock_guard l(self->ev_mu_);
    self->events_.push_back(e);
  };
  return o;
}

BlockSession* Rig::open_session(BlockSessionOptions o) {
  auto s = BlockSession::open(std::move(o));
  EXPECT_TRUE(s.ok()) << "BlockSession::open: " << s.error().message();
  if (!s.ok()) return nullptr;
  sess_ = std::move(*s);
  return sess_.get();
}

std::shared_ptr<RemoteDevice> Rig::map_rw() {
  auto d = sess_->map(file_->name(), AccessMode::rw);
  EXPECT_TRUE(d.ok()) << "map: " << d.error().message();
  return d.ok() ? *d : nullptr;
}

std::shared_ptr<RemoteDevice> Rig::bring_up(const std::string& tag, Store store,
                                             const std::function<void(BlockSessionOptions&)>& tune) {
  ExportFile& f = make_file(store);
  if (!f.ok()) {
    skip_ = f.why();
    return nullptr;
  }
  make_endpoints(tag);
  start_server();
  if (server_ == nullptr) return nullptr;
  BlockSessionOptions o = session_options();
  if (tune) tune(o);
  if (open_session(std::move(o)) == nullptr) return nullptr;
  auto d = map_rw();
  // The session's WATCH (size notices) goes out with no epoch at open, is answered at once and
  // posted again: a transport READ that the cases counting requests per path must not see.
  if (d && session().size_watch().supported) {
    EXPECT_TRUE(wait_until([&] { return session().size_watch().armed && session().size_watch().answers > 0; }));
  }
  return d;
}

std::vector<std::string> Rig::server_paths(const std::string& name) {
  std::vector<std::string> out;
  for (auto& s : server_->sessions())
    if (s.name == name)
      for (auto& p : s.paths) out.push_back(p.name);
  return out;
}

size_t Rig::device_events(DeviceEvent::Kind kind) {
  std::lock_guard l(ev_mu_);
  return static_cast<size_t>(
      std::count_if(events_.begin(), events_.end(), [&](const DeviceEvent& e) { return e.kind == kind; }));
}

}  // namespace ibnbd::itest
