#include "fabric/mr_table.h"

#include <thread>

namespace ibtrs::fabric {

namespace {
constexpr uint32_t kLive = 1u << 31;
constexpr uint32_t kKnownAccess = kLocalWrite | kRemoteWrite | kRemoteRead;
}  // namespace

struct MrSlot {
  // kLive | generation; the generation alone when the slot is free. Published with seq_cst so
  // that remove() and acquire() cannot both miss each other (see remove()).
  std::atomic<uint32_t> state{0};
  std::atomic<uint32_t> refs{0};
  std::byte* base = nullptr;
  uint64_t length = 0;
  uint32_t access = 0;
};

struct MrTable::Page {
  MrSlot slots[kSlotsPerPage];
};

MrTable::MrTable() : pages_(new std::atomic<Page*>[kPages]) {
  for (uint32_t i = 0; i < kPages; ++i) pages_[i].store(nullptr, std::memory_order_relaxed);
}

MrTable::~MrTable() {
  for (uint32_t i = 0; i < kPages; ++i) delete pages_[i].load(std::memory_order_relaxed);
}

MrSlot* MrTable::slot_for(uint32_t key) const {
  uint32_t index = key >> kGenBits;
  if (index >= kMaxRegions) return nullptr;
  Page* page = pages_[index / kSlotsPerPage].load(std::memory_order_acquire);
  if (page == nullptr) return nullptr;
  return &page->slots[index % kSlotsPerPage];
}

Result<uint32_t> MrTable::add(void* addr, size_t length, uint32_t access) {
  if (addr == nullptr || length == 0 || (access & ~kKnownAccess) != 0) return errc(EINVAL);
  // Verbs requires LOCAL_WRITE with REMOTE_WRITE; we grant it implicitly like ibv_reg_mr users do.
  if (access & kRemoteWrite) access |= kLocalWrite;
  std::lock_guard lock(mu_);
  uint32_t index;
  if (!free_.empty()) {
    index = free_.back();
    free_.pop_back();
  } else {
    if (next_unused_ >= kMaxRegions) return errc(ENOMEM);
    index = next_unused_++;
    auto& page = pages_[index / kSlotsPerPage];
    if (page.load(std::memory_order_relaxed) == nullptr) page.store(new Page, std::memory_order_release);
  }
  MrSlot& s = pages_[index / kSlotsPerPage].load(std::memory_order_relaxed)->slots[index % kSlotsPerPage];
  uint32_t gen = s.state.load(std::memory_order_relaxed) & kGenMask;
  s.base = static_cast<std::byte*>(addr);
  s.length = length;
  s.access = access;
  s.state.store(kLive | gen, std::memory_order_seq_cst);
  return (index << kGenBits) | gen;
}

void MrTable::remove(uint32_t key) {
  MrSlot* s = slot_for(key);
  if (s == nullptr) return;
  uint32_t gen = key & kGenMask;
  uint32_t expected = kLive | gen;
  // Dekker with acquire(): we publish "dead" then look at refs; an acquirer bumps refs then looks
  // at state. With seq_cst on both sides one of us sees the other.
  if (!s->state.compare_exchange_strong(expected, (gen + 1) & kGenMask, std::memory_order_seq_cst))
    return;  // stale or double deregistration
  while (s->refs.load(std::memory_order_seq_cst) != 0) std::this_thread::yield();
  std::lock_guard lock(mu_);
  free_.push_back(key >> kGenBits);
}

MrTable::Ref& MrTable::Ref::operator=(Ref&& o) noexcept {
  if (this != &o) {
    reset();
    slot_ = o.slot_;
    ptr_ = o.ptr_;
    o.slot_ = nullptr;
  }
  return *this;
}

void MrTable::Ref::reset() {
  if (slot_ != nullptr) slot_->refs.fetch_sub(1, std::memory_order_seq_cst);
  slot_ = nullptr;
  ptr_ = nullptr;
}

MrTable::Ref MrTable::acquire(uint32_t key, uint64_t addr, uint64_t len, uint32_t need_access,
                              Fault* fault) const {
  Ref r;
  Fault f = Fault::bad_key;
  MrSlot* s = slot_for(key);
  if (s != nullptr) {
    s->refs.fetch_add(1, std::memory_order_seq_cst);
    uint32_t st = s->state.load(std::memory_order_seq_cst);
    if (st != (kLive | (key & kGenMask))) {
      s->refs.fetch_sub(1, std::memory_order_seq_cst);
    } else {
      uint64_t base = reinterpret_cast<uint64_t>(s->base);
      if (addr < base || addr - base > s->length || len > s->length - (addr - base)) {
        f = Fault::out_of_bounds;
        s->refs.fetch_sub(1, std::memory_order_seq_cst);
      } else if ((s->access & need_access) != need_access) {
        f = Fault::no_access;
        s->refs.fetch_sub(1, std::memory_order_seq_cst);
      } else {
        f = Fault::none;
        r.slot_ = s;
        r.ptr_ = s->base + (addr - base);
      }
    }
  }
  if (fault != nullptr) *fault = f;
  return r;
}

bool MrTable::check(uint32_t key, uint64_t addr, uint64_t len, uint32_t need_access) const {
  return static_cast<bool>(acquire(key, addr, len, need_access, nullptr));
}

Result<std::unique_ptr<MemoryRegion>> SoftMemoryRegion::create(std::shared_ptr<MrTable> table,
                                                               void* addr, size_t length,
                                                               uint32_t access) {
  auto key = table->add(addr, length, access);
  if (!key) return key.error();
  if (access & kRemoteWrite) access |= kLocalWrite;
  return std::unique_ptr<MemoryRegion>(
      new SoftMemoryRegion(std::move(table), addr, length, *key, access));
}

}  // namespace ibtrs::fabric
