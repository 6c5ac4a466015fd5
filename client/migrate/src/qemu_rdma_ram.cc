#include "qemu_rdma_ram.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>

namespace ibnbd::migrate::qrdma {
// Helpers of this file only, named apart from qemu_rdma_wire.cc's (unity builds join the two).
namespace {

std::error_code ram_fail(int e, std::string* why, std::string msg) {
  if (why != nullptr) *why = std::move(msg);
  return ibtrs::errc(e);
}

std::string ram_mib(uint64_t bytes) { return std::to_string((bytes + (1u << 20) - 1) >> 20) + " MiB"; }

constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kP2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kP3 = 0x165667B19E3779F9ull;
constexpr uint64_t kP4 = 0x85EBCA77C2B2AE63ull;

uint64_t round64(uint64_t acc, uint64_t in) { return std::rotl(acc + in * kP2, 31) * kP1; }

size_t ram_host_page() {
  static const size_t p = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return p;
}

size_t ram_round_up(size_t v, size_t to) { return (v + to - 1) / to * to; }

}  // namespace

uint64_t page_hash(const std::byte* p, size_t n, bool* all_zero) {
  uint64_t a = kP1 + kP2, b = kP2, c = 0, d = 0 - kP1;
  uint64_t any = 0;
  for (size_t i = 0; i + 32 <= n; i += 32) {
    uint64_t w[4];
    std::memcpy(w, p + i, sizeof(w));
    any |= w[0] | w[1] | w[2] | w[3];
    a = round64(a, w[0]);
    b = round64(b, w[1]);
    c = round64(c, w[2]);
    d = round64(d, w[3]);
  }
  uint64_t h = std::rotl(a, 1) + std::rotl(b, 7) + std::rotl(c, 12) + std::rotl(d, 18);
  for (uint64_t v : {a, b, c, d}) h = (h ^ round64(0, v)) * kP1 + kP4;
  h += n;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  if (all_zero != nullptr) *all_zero = any == 0;
  return h;
}

RamMirror::RamMirror(Registrar& reg, uint64_t pin_limit) : reg_(reg), pin_limit_(pin_limit) {}

RamMirror::~RamMirror() {
  // Registrations first: nothing may be registered over an unmapped range.
  for (Block& b : blocks_) {
    b.chunks.clear();
    b.whole.reset();
    if (b.base != nullptr) ::munmap(b.base, b.reserved);
  }
}

Status RamMirror::init(const RamLayout& layout, uint32_t page_size, std::string* why) {
  if (ready()) return ram_fail(EALREADY, why, "the RAM layout is already set");
  if (page_size < 32 || !std::has_single_bit(page_size) || page_size > kChunkSize)
    return ram_fail(EINVAL, why, "page size " + std::to_string(page_size));
  uint64_t total = 0;
  for (const RamBlockLayout& b : layout.blocks()) {
    if (b.length % page_size != 0)
      return ram_fail(EINVAL, why, "RAM block '" + b.name + "': length " + std::to_string(b.length) +
                                   " is not a multiple of the page size " + std::to_string(page_size));
    total += ram_round_up(b.length, kChunkSize);
    if (b.length > kMaxLayoutBytes || total > kMaxLayoutBytes)
      return ram_fail(E2BIG, why, "RAM blocks of more than " + ram_mib(kMaxLayoutBytes) + " in all");
  }
  std::vector<Block> blocks(layout.size());
  auto undo = [&] {
    for (Block& b : blocks)
      if (b.base != nullptr) ::munmap(b.base, b.reserved);
  };
  for (size_t i = 0; i < layout.size(); ++i) {
    Block& b = blocks[i];
    b.length = layout.block(i).length;
    b.reserved = ram_round_up(b.length, kChunkSize);
    // Address space only: no access and no commit until a chunk is registered.
    void* m = ::mmap(nullptr, b.reserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      const int e = errno;
      undo();
      return ram_fail(e, why, "reserving " + ram_mib(b.reserved) + " for RAM block '" + layout.block(i).name + "'");
    }
    b.base = static_cast<std::byte*>(m);
  }
  blocks_ = std::move(blocks);
  names_.clear();
  for (const RamBlockLayout& b : layout.blocks()) names_.push_back(b.name);
  page_size_ = page_size;
  max_registrations_ = 2 * static_cast<size_t>(pin_limit_ >> kChunkShift) + blocks_.size() + 16;
  return {};
}

uint64_t RamMirror::host_addr(uint32_t block) const {
  return reinterpret_cast<uintptr_t>(blocks_.at(block).base);
}

uint64_t RamMirror::chunk_length(uint32_t block, uint64_t chunk) const {
  const uint64_t start = chunk << kChunkShift;
  return std::min(kChunkSize, blocks_[block].length - start);
}

Status RamMirror::map_chunk(uint32_t block, uint64_t chunk, std::string* why) {
  Block& b = blocks_[block];
  if (b.chunks.count(chunk) != 0) return {};
  const uint64_t len = chunk_length(block, chunk);
  if (pinned_bytes_ + len > pin_limit_)
    return ram_fail(ENOMEM, why, "registering chunk " + std::to_string(chunk) + " of RAM block '" + names_[block] +
                                 "' would pin more than the limit of " + ram_mib(pin_limit_) +
                                 " (pin-max; the source has " + ram_mib(pinned_bytes_) + " registered)");
  std::byte* at = b.base + (chunk << kChunkShift);
  if (::mprotect(at, ram_round_up(len, ram_host_page()), PROT_READ | PROT_WRITE) != 0)
    return ram_fail(errno, why, "mapping chunk " + std::to_string(chunk) + " of RAM block '" + names_[block] + "'");
  Chunk c;
  const size_t pages = len / page_size_;
  c.hash.assign(pages, 0);
  c.sent.assign(pages, false);
  b.chunks.emplace(chunk, std::move(c));
  pinned_bytes_ += len;
  return {};
}

Result<std::vector<uint32_t>> RamMirror::pin_all(std::string* why) {
  if (!ready()) return ram_fail(EPROTO, why, "pin-all before the RAM block list");
  std::vector<uint32_t> keys;
  if (!pinned_all_) {
    uint64_t need = 0;
    for (const Block& b : blocks_) need += b.length;
    if (need > pin_limit_)
      return ram_fail(ENOMEM, why, "pin-all needs " + ram_mib(need) + " registered at once, more than the limit of " +
                                   ram_mib(pin_limit_) + " (pin-max)");
    for (uint32_t i = 0; i < blocks_.size(); ++i) {
      for (uint64_t c = 0; c < (blocks_[i].length + kChunkSize - 1) >> kChunkShift; ++c)
        BASE_TRY(map_chunk(i, c, why));
      Block& b = blocks_[i];
      if (b.whole) continue;  // an earlier call that failed on a later block
      BASE_ASSIGN_OR_RETURN(b.whole, reg_.register_memory(b.base, b.length, why));
      ++registrations_;
    }
    pinned_all_ = true;
  }
  for (const Block& b : blocks_) keys.push_back(b.whole->rkey());
  return keys;
}

Result<uint32_t> RamMirror::register_chunks(const RegisterRequest& r, std::string* why) {
  if (!ready() || r.block >= blocks_.size()) return ram_fail(EPROTO, why, "register before the RAM block list");
  Block& b = blocks_[r.block];
  if (r.end > b.length || r.begin >= r.end) return ram_fail(ERANGE, why, "register outside the block");
  if (b.whole) return b.whole->rkey();  // pin-all: what QEMU's destination answers too
  const uint64_t last = (r.end - 1) >> kChunkShift;
  for (uint64_t c = r.first_chunk; c <= last; ++c) BASE_TRY(map_chunk(r.block, c, why));
  Chunk& c = b.chunks.at(r.first_chunk);
  if (!c.regs.empty() && c.reg_end >= r.end) return c.regs.back()->rkey();
  if (registrations_ >= max_registrations_)
    return ram_fail(ENOMEM, why, "more than " + std::to_string(max_registrations_) + " registrations");
  BASE_ASSIGN_OR_RETURN(auto reg, reg_.register_memory(b.base + r.begin, r.end - r.begin, why));
  c.regs.push_back(std::move(reg));
  c.reg_end = r.end;
  ++registrations_;
  return c.regs.back()->rkey();
}

Status RamMirror::unregister_chunk(const UnregisterRequest& r, std::string* why) {
  if (!ready() || r.block >= blocks_.size()) return ram_fail(EPROTO, why, "unregister before the RAM block list");
  auto it = blocks_[r.block].chunks.find(r.chunk);
  if (it == blocks_[r.block].chunks.end() || it->second.regs.empty())
    return ram_fail(ENOENT, why, "unregister: chunk " + std::to_string(r.chunk) + " of RAM block '" + names_[r.block] +
                                 "' is not registered");
  registrations_ -= it->second.regs.size();
  it->second.regs.clear();
  it->second.reg_end = 0;
  return {};
}

Status RamMirror::compress(const Compress& c, qstream::PageWriter& out, std::string* why) {
  if (!ready() || c.block >= blocks_.size()) return ram_fail(EPROTO, why, "compress before the RAM block list");
  Block& b = blocks_[c.block];
  if (c.length == 0 || c.offset >= b.length || c.length > b.length - c.offset)
    return ram_fail(ERANGE, why, "compress outside the block");
  const uint64_t chunk = c.offset >> kChunkShift;
  const bool mapped = b.chunks.count(chunk) != 0;
  if (!mapped && c.value == 0 && c.offset % page_size_ == 0 && c.length % page_size_ == 0) {
    for (uint64_t off = c.offset; off < c.offset + c.length; off += page_size_) {
      BASE_TRY(out.zero(c.block, off, 0));
      ++pages_reported_;
    }
    return {};
  }
  if (!mapped) BASE_TRY(map_chunk(c.block, chunk, why));
  // Validated to stay inside this (now mapped) chunk.
  std::memset(b.base + c.offset, c.value, c.length);
  return {};
}

Status RamMirror::report(qstream::PageWriter& out) {
  for (uint32_t bi = 0; bi < blocks_.size(); ++bi) {
    Block& b = blocks_[bi];
    for (auto& [index, c] : b.chunks) {
      const uint64_t start = index << kChunkShift;
      for (size_t i = 0; i < c.hash.size(); ++i) {
        const uint64_t off = start + i * page_size_;
        const std::byte* p = b.base + off;
        bool zero = false;
        const uint64_t h = page_hash(p, page_size_, &zero);
        if (c.sent[i] && c.hash[i] == h) continue;
        if (zero) BASE_TRY(out.zero(bi, off, 0));
        else BASE_TRY(out.data(bi, off, {p, page_size_}));
        c.sent[i] = true;
        c.hash[i] = h;
        ++pages_reported_;
      }
    }
  }
  return {};
}

}  // namespace ibnbd::migrate::qrdma
