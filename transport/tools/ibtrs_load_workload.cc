// ibtrs-load's workload: the IO path of the client (a completion resubmits its slot), the block
// and direction choice, and the --verify data with its check.
#include "ibtrs_load_workload.h"

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <span>

#include "base/pattern.h"

namespace ibtrs_load {
namespace {

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

}  // namespace

Load::Load(const ClientConfig& c, ibtrs::ClientSession& s, const ibtrs::RegisteredMemory& mem)
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

void Load::start() {
  start_ns_ = now_ns();
  last_done_ns_.store(start_ns_, std::memory_order_relaxed);
  deadline_ns_ = c_.seconds > 0 ? start_ns_ + static_cast<int64_t>(c_.seconds * 1e9) : INT64_MAX;
  active_.store(c_.qd);
  for (auto& sl : slots_) submit(*sl, false);
}

void Load::stop() {
  stopping_.store(true, std::memory_order_relaxed);
  wake();
}

bool Load::wait(std::chrono::milliseconds timeout) {
  std::vector<Slot*> parked;
  {
    std::unique_lock lk(mu_);
    cv_.wait_for(lk, timeout, [&] { return active_.load() == 0 || !parked_.empty(); });
    parked.swap(parked_);
  }
  for (Slot* s : parked) submit(*s, false);
  return active_.load() == 0;
}

inline void Load::on_done(void* ctx, int err) {
  auto* s = static_cast<Slot*>(ctx);
  s->load->complete(*s, err);
}

inline void Load::complete(Slot& s, int err) {
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

inline void Load::note_completion(int64_t now) {
  int64_t prev = last_done_ns_.load(std::memory_order_relaxed);
  while (now > prev && !last_done_ns_.compare_exchange_weak(prev, now, std::memory_order_relaxed)) {
  }
  if (now <= prev) return;
  uint64_t gap = static_cast<uint64_t>(now - prev);
  uint64_t m = max_pause_ns_.load(std::memory_order_relaxed);
  while (gap > m && !max_pause_ns_.compare_exchange_weak(m, gap, std::memory_order_relaxed)) {
  }
}

inline void Load::verify(Slot& s) {
  std::string what = check_pattern(s.buf, c_.bs, s.block * c_.bs, s.gen);
  if (what.empty()) return;
  if (verify_errors_.fetch_add(1) < 10) say("verify error: block %" PRIu64 ": %s", s.block, what.c_str());
}

inline void Load::error(int err, const char* what) {
  if (errors_.fetch_add(1) < 10) say("io error: %s: %s", what, errtext(err).c_str());
}

inline bool Load::claim_io(int64_t now) {
  if (stopping_.load(std::memory_order_relaxed)) return false;
  if (now >= deadline_ns_) {
    stopping_.store(true, std::memory_order_relaxed);
    return false;
  }
  if (c_.count && issued_.fetch_add(1, std::memory_order_relaxed) >= c_.count) return false;
  return true;
}

inline uint64_t Load::pick_block(Slot& s) {
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

inline ibtrs::IoDir Load::pick_dir(Slot& s) {
  switch (c_.rw) {
    case Rw::read: case Rw::randread: return ibtrs::IoDir::read;
    case Rw::write: case Rw::randwrite: return ibtrs::IoDir::write;
    case Rw::randrw: return (splitmix64(s.rng) & 1) ? ibtrs::IoDir::write : ibtrs::IoDir::read;
  }
  return ibtrs::IoDir::read;
}

inline void Load::submit(Slot& s, bool from_callback) {
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

inline void Load::retire() {
  if (active_.fetch_sub(1) == 1) wake();
}

inline void Load::wake() {
  std::lock_guard lk(mu_);
  cv_.notify_all();
}

}  // namespace ibtrs_load
