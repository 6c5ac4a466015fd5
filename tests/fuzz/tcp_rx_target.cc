#include "tcp_rx_target.h"

#include <sys/mman.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>

#include "fabric/tcp/tcp_rx.h"

namespace ibtrs::fuzz {
namespace {

using namespace ibtrs::fabric;
using namespace ibtrs::fabric::tcp;

// Regions at fixed addresses, so the fuzzer can find valid (rkey, addr) pairs by comparison
// tracing, each fenced by PROT_NONE pages: a stray byte outside a region faults at once.
constexpr uintptr_t kRemoteBase = 0x10000000;
constexpr size_t kRemoteLen = 64 * 1024;
constexpr uintptr_t kLocalBase = 0x10100000;
constexpr size_t kLocalLen = 4096;
constexpr size_t kPage = 4096;

std::byte* fenced(uintptr_t at, size_t len) {
  void* p = ::mmap(reinterpret_cast<void*>(at - kPage), len + 2 * kPage, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
  if (p == MAP_FAILED || reinterpret_cast<uintptr_t>(p) != at - kPage) {
    std::perror("mmap fixed");
    std::abort();
  }
  ::mprotect(p, kPage, PROT_NONE);
  ::mprotect(static_cast<std::byte*>(p) + kPage + len, kPage, PROT_NONE);
  return static_cast<std::byte*>(p) + kPage;
}

struct World {
  MrTable mrs;
  std::byte* remote = fenced(kRemoteBase, kRemoteLen);
  std::byte* local = fenced(kLocalBase, kLocalLen);
  uint32_t rkey = 0;
  uint32_t lkey = 0;
  World() {
    rkey = mrs.add(remote, kRemoteLen, kRemoteWrite).value();
    lkey = mrs.add(local, kLocalLen, kLocalWrite).value();
  }
};

World& world() {
  static World w;
  return w;
}

class Hooks final : public RxHooks {
 public:
  Hooks(const uint8_t* data, size_t size, uint32_t lkey) : data_(data), size_(size), lkey_(lkey) {
    chunk_seed_ = size > 0 ? data[0] : 0;
  }
  virtual ~Hooks() = default;

  ssize_t read(const iovec* iov, int iovcnt) override {
    if (pos_ >= size_) return 0;
    // Read sizes vary with the input, so frame boundaries land anywhere in a read.
    static constexpr size_t kChunks[] = {1, 2, 3, 7, 31, 32, 33, 100, 4096, 65536};
    size_t budget = kChunks[(chunk_seed_ + reads_++) % 10];
    budget = std::min(budget, size_ - pos_);
    size_t got = 0;
    for (int i = 0; i < iovcnt && got < budget; ++i) {
      size_t n = std::min(iov[i].iov_len, budget - got);
      std::memcpy(iov[i].iov_base, data_ + pos_ + got, n);
      got += n;
    }
    pos_ += got;
    return static_cast<ssize_t>(got);
  }
  RecvEntry* head_recv() override {
    if (recvs_left_ == 0) return nullptr;
    // An endless supply, alternating one SGE and two uneven SGEs over the local region.
    cur_ = RecvEntry{};
    cur_.wr_id = recvs_left_;
    const uint64_t base = reinterpret_cast<uint64_t>(world().local);
    if (recvs_left_ % 2 == 0) {
      cur_.num_sge = 1;
      cur_.sge[0] = Sge{base, static_cast<uint32_t>(kLocalLen), lkey_};
    } else {
      cur_.num_sge = 2;
      cur_.sge[0] = Sge{base + 3000, 100, lkey_};
      cur_.sge[1] = Sge{base, 2000, lkey_};
    }
    return &cur_;
  }
  void complete_recv(WcStatus, Opcode op, uint32_t byte_len, uint32_t, bool) override {
    // A SEND can only have filled the RECV's buffers; a WRITE_IMM reports the write's length.
    if (op == Opcode::recv && byte_len > kLocalLen) std::abort();
    --recvs_left_;
  }
  bool on_ack(uint32_t ack) override {
    if (ack - acked_ > kSent - acked_) return false;
    acked_ = ack;
    return true;
  }
  void on_nak(uint32_t, WcStatus) override {}
  bool drained() const { return pos_ >= size_; }

 private:
  static constexpr uint32_t kSent = 1u << 20;
  const uint8_t* data_;
  size_t size_;
  uint32_t lkey_;
  size_t pos_ = 1;
  uint8_t chunk_seed_;
  uint64_t reads_ = 0;
  uint32_t recvs_left_ = 64;
  uint32_t acked_ = 0;
  RecvEntry cur_{};
};

void put(std::vector<uint8_t>& out, const FrameHeader& h, size_t payload) {
  auto* p = reinterpret_cast<const uint8_t*>(&h);
  out.insert(out.end(), p, p + sizeof(h));
  for (size_t i = 0; i < payload; ++i) out.push_back(static_cast<uint8_t>(i * 13));
}

}  // namespace

int tcp_rx_one_input(const uint8_t* data, size_t size) {
  World& w = world();
  Hooks hooks(data, size, w.lkey);
  RxEngine rx(w.mrs, 256);
  RxResult last = RxResult::idle;
  // Each pump reads at least one byte or ends, so this bounds the work by the input size.
  for (size_t i = 0; i <= size + 2; ++i) {
    RxResult r = rx.pump(hooks, 2);
    last = r;
    if (r != RxResult::idle && r != RxResult::more) break;
    if (hooks.drained() && r == RxResult::idle) {
      if (rx.pump(hooks, 1) != RxResult::idle) break;
    }
  }
  if (rx.payload_bytes() > size) std::abort();
  if (std::getenv("IBTRS_FUZZ_DEBUG")) std::fprintf(stderr, "placed %u frames, %llu payload bytes, end %d %s\n", rx.placed(), static_cast<unsigned long long>(rx.payload_bytes()), static_cast<int>(last), rx.error().message().c_str());
  return 0;
}

std::vector<std::vector<uint8_t>> tcp_rx_seeds() {
  World& w = world();
  std::vector<std::vector<uint8_t>> seeds;
  auto write = [&](FrameType t, uint64_t off, uint32_t len, uint32_t imm) {
    FrameHeader h = make_header(t, len);
    h.rkey.set(w.rkey);
    h.remote_addr.set(kRemoteBase + off);
    h.imm.set(imm);
    h.flags = kFlagAckRequested;
    return h;
  };
  for (uint8_t chunking = 0; chunking < 4; ++chunking) {
    std::vector<uint8_t> s{chunking};
    put(s, write(FrameType::write, 0, 100, 0), 100);
    put(s, write(FrameType::write_imm, 1000, 5000, 77), 5000);
    put(s, write(FrameType::write_imm, 0, 0, 0x80000000u), 0);
    put(s, make_header(FrameType::send, 2100), 2100);
    FrameHeader ack = make_header(FrameType::ack);
    ack.ack.set(3);
    put(s, ack, 0);
    FrameHeader last = make_header(FrameType::send, 10);
    last.ack.set(3);  // acks never go backwards
    put(s, last, 10);
    seeds.push_back(s);
  }
  std::vector<uint8_t> nak{0};
  FrameHeader n = make_header(FrameType::nak);
  n.status = 4;
  n.ack.set(1);
  put(nak, n, 0);
  seeds.push_back(nak);
  std::vector<uint8_t> disc{5};
  put(disc, make_header(FrameType::disconnect), 0);
  seeds.push_back(disc);
  return seeds;
}

}  // namespace ibtrs::fuzz
