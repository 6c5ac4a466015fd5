#include "fabric/mr_table.h"

#include <bit>
#include <thread>
#include <typeinfo>

#include "fabric/secure_random.h"

namespace ibtrs::fabric {

namespace {
// Slot state: kHeld | kLive | tag. A free slot keeps its last tag (so the next use draws a
// different one); a held slot without kLive is a revoked region or an unbound window.
constexpr uint64_t kLive = uint64_t{1} << 63;
constexpr uint64_t kHeld = uint64_t{1} << 62;
constexpr uint32_t kKnownAccess = kLocalWrite | kRemoteWrite | kRemoteRead | kMwBind;
constexpr uint32_t kRemoteAccess = kRemoteWrite | kRemoteRead;
}  // namespace

using Kind = MrTable::Kind;

struct MrSlot {
  // Published with seq_cst so that a revocation and acquire() cannot both miss each other (see
  // MrTable::transition). The fields below are written only while the slot is not live.
  std::atomic<uint64_t> state{0};
  std::atomic<uint32_t> refs{0};
  Kind kind = Kind::region;
  std::byte* base = nullptr;
  uint64_t length = 0;
  uint32_t access = 0;
  // Windows: the region bound over and its state at the bind, and the owner connection.
  MrSlot* parent = nullptr;
  uint64_t parent_state = 0;
  uint64_t owner = 0;
};

struct MrTable::Page {
  MrSlot slots[kSlotsPerPage];
};

MrTable::MrTable(uint32_t capacity)
    : capacity_(capacity == 0 || capacity > kMaxCapacity ? kMaxCapacity : capacity),
      tag_bits_(32 - static_cast<uint32_t>(std::bit_width(capacity_))),
      tag_mask_(static_cast<uint32_t>((uint64_t{1} << tag_bits_) - 1)),
      pages_(new std::atomic<Page*>[kPages]) {
  for (uint32_t i = 0; i < kPages; ++i) pages_[i].store(nullptr, std::memory_order_relaxed);
}

MrTable::~MrTable() {
  for (uint32_t i = 0; i < kPages; ++i) delete pages_[i].load(std::memory_order_relaxed);
}

MrSlot* MrTable::slot_for(uint32_t key) const {
  uint32_t index = key >> tag_bits_;
  if (index == 0 || index > capacity_) return nullptr;
  Page* page = pages_[index / kSlotsPerPage].load(std::memory_order_acquire);
  if (page == nullptr) return nullptr;
  return &page->slots[index % kSlotsPerPage];
}

uint32_t MrTable::fresh_tag(uint32_t old) const {
  uint32_t t = secure_random_u32() & tag_mask_;
  return t == old ? t ^ 1u : t;
}

MrSlot* MrTable::take_slot(uint32_t* index) {
  if (in_use_.load(std::memory_order_relaxed) >= capacity_) return nullptr;
  uint32_t i;
  if (!free_.empty()) {
    i = free_.back();
    free_.pop_back();
  } else {
    if (next_unused_ > capacity_) return nullptr;
    i = next_unused_++;
    auto& page = pages_[i / kSlotsPerPage];
    if (page.load(std::memory_order_relaxed) == nullptr) page.store(new Page, std::memory_order_release);
  }
  in_use_.fetch_add(1, std::memory_order_relaxed);
  *index = i;
  return &pages_[i / kSlotsPerPage].load(std::memory_order_relaxed)->slots[i % kSlotsPerPage];
}

Result<uint32_t> MrTable::add(void* addr, size_t length, uint32_t access) {
  if (addr == nullptr || length == 0 || (access & ~kKnownAccess) != 0) return errc(EINVAL);
  // Verbs requires LOCAL_WRITE with REMOTE_WRITE; we grant it implicitly like ibv_reg_mr users do.
  if (access & kRemoteWrite) access |= kLocalWrite;
  return publish(Kind::region, static_cast<std::byte*>(addr), length, access);
}

Result<uint32_t> MrTable::alloc_window() { return publish(Kind::window, nullptr, 0, 0); }

Result<uint32_t> MrTable::publish(Kind kind, std::byte* base, uint64_t length, uint32_t access) {
  std::lock_guard lock(mu_);
  uint32_t index;
  MrSlot* s = take_slot(&index);
  if (s == nullptr) return errc(ENOMEM);
  const uint32_t old = static_cast<uint32_t>(s->state.load(std::memory_order_relaxed)) & tag_mask_;
  const uint32_t tag = fresh_tag(old);
  s->kind = kind;
  s->base = base;
  s->length = length;
  s->access = access;
  s->parent = nullptr;
  s->owner = 0;
  // A region is live at once; a window only once bound.
  s->state.store(kHeld | (kind == Kind::region ? kLive : 0) | tag, std::memory_order_seq_cst);
  return make_key(index, tag);
}

bool MrTable::transition(uint32_t key, std::initializer_list<uint64_t> from, uint64_t to) {
  MrSlot* s = slot_for(key);
  if (s == nullptr) return false;
  const uint64_t tag = tag_of(key);
  bool moved = false;
  for (uint64_t f : from) {
    uint64_t expected = f | tag;
    // Dekker with acquire(): we publish the new state then look at refs; an acquirer bumps refs
    // then looks at the state. With seq_cst on both sides one of us sees the other.
    if (s->state.compare_exchange_strong(expected, to, std::memory_order_seq_cst)) {
      moved = true;
      break;
    }
  }
  if (!moved) return false;
  while (s->refs.load(std::memory_order_seq_cst) != 0) std::this_thread::yield();
  return true;
}

void MrTable::remove(uint32_t key) {
  if (!transition(key, {kHeld | kLive, kHeld}, tag_of(key))) return;  // stale or double removal
  std::lock_guard lock(mu_);
  free_.push_back(key >> tag_bits_);
  in_use_.fetch_sub(1, std::memory_order_relaxed);
}

void MrTable::revoke(uint32_t key) { transition(key, {kHeld | kLive}, kHeld | tag_of(key)); }

ibtrs::Status MrTable::restore(uint32_t key) {
  MrSlot* s = slot_for(key);
  if (s == nullptr || s->kind != Kind::region) return errc(ENOENT);
  const uint64_t live = kHeld | kLive | tag_of(key);
  uint64_t expected = kHeld | tag_of(key);
  // Nothing placed through the key while it was revoked, so there is nothing to wait for.
  if (s->state.compare_exchange_strong(expected, live, std::memory_order_seq_cst) ||
      expected == live)
    return {};
  return errc(ENOENT);
}

Result<uint32_t> MrTable::rekey(uint32_t key) {
  MrSlot* s = slot_for(key);
  // Only the region's owner rekeys it, with its current key: the slot is held, and its kind,
  // set before it was first published, does not change while it is.
  if (s == nullptr || (s->state.load(std::memory_order_acquire) & kHeld) == 0 ||
      s->kind != Kind::region)
    return errc(ENOENT);
  const uint32_t tag = fresh_tag(tag_of(key));
  if (!transition(key, {kHeld | kLive, kHeld}, kHeld | kLive | tag)) return errc(ENOENT);
  return make_key(key >> tag_bits_, tag);
}

Result<uint32_t> MrTable::bind_window(uint32_t window, uint32_t region, uint64_t addr,
                                      uint64_t len, uint32_t access, uint64_t owner) {
  if (len == 0 || access == 0 || (access & ~kRemoteAccess) != 0) return errc(EINVAL);
  MrSlot* w = slot_for(window);
  MrSlot* r = slot_for(region);
  if (w == nullptr || r == nullptr || w == r) return errc(EINVAL);
  // The window's owner alone binds it: its state cannot change under us except by our own hand.
  if (w->state.load(std::memory_order_acquire) != (kHeld | tag_of(window)) || w->kind != Kind::window)
    return errc(EINVAL);
  // The region is the caller's own, held by it through the bind (a window is bound only over
  // a region its owner keeps registered): a live region's fields do not change, no pin needed.
  const uint64_t rstate = r->state.load(std::memory_order_acquire);
  if (rstate != (kHeld | kLive | tag_of(region)) || r->kind != Kind::region ||
      (r->access & kMwBind) == 0 || ((access & kRemoteWrite) != 0 && (r->access & kLocalWrite) == 0))
    return errc(EINVAL);
  const uint64_t base = reinterpret_cast<uint64_t>(r->base);
  if (addr < base || addr - base > r->length || len > r->length - (addr - base)) return errc(EINVAL);
  std::byte* at = r->base + (addr - base);
  const uint32_t tag = fresh_tag(tag_of(window));
  w->base = at;
  w->length = len;
  w->access = access;
  w->parent = r;
  w->parent_state = rstate;
  w->owner = owner;
  w->state.store(kHeld | kLive | tag, std::memory_order_seq_cst);
  return make_key(window >> tag_bits_, tag);
}

MrTable::Ref& MrTable::Ref::operator=(Ref&& o) noexcept {
  if (this != &o) {
    reset();
    slot_ = o.slot_;
    parent_ = o.parent_;
    ptr_ = o.ptr_;
    o.slot_ = nullptr;
    o.parent_ = nullptr;
  }
  return *this;
}

void MrTable::Ref::reset() {
  if (parent_ != nullptr) parent_->refs.fetch_sub(1, std::memory_order_seq_cst);
  if (slot_ != nullptr) slot_->refs.fetch_sub(1, std::memory_order_seq_cst);
  slot_ = nullptr;
  parent_ = nullptr;
  ptr_ = nullptr;
}

MrTable::Ref MrTable::acquire(uint32_t key, uint64_t addr, uint64_t len, uint32_t need_access,
                              Fault* fault, uint64_t conn) const {
  Ref r;
  Fault f = Fault::bad_key;
  MrSlot* s = slot_for(key);
  if (s != nullptr) {
    s->refs.fetch_add(1, std::memory_order_seq_cst);
    MrSlot* parent = nullptr;
    bool live = s->state.load(std::memory_order_seq_cst) == (kHeld | kLive | tag_of(key));
    if (live && s->kind == Kind::window) {
      // A window answers remote accesses for its connection, and only while its region is
      // still the one it was bound over (held like the window: its removal waits for us).
      live = (need_access & kRemoteAccess) != 0 && (s->owner == 0 || s->owner == conn);
      if (live) {
        parent = s->parent;
        parent->refs.fetch_add(1, std::memory_order_seq_cst);
        live = parent->state.load(std::memory_order_seq_cst) == s->parent_state;
      }
    }
    if (live) {
      uint64_t base = reinterpret_cast<uint64_t>(s->base);
      if (addr < base || addr - base > s->length || len > s->length - (addr - base)) {
        f = Fault::out_of_bounds;
        live = false;
      } else if ((s->access & need_access) != need_access) {
        f = Fault::no_access;
        live = false;
      }
    }
    if (live) {
      f = Fault::none;
      r.slot_ = s;
      r.parent_ = parent;
      r.ptr_ = s->base + (addr - reinterpret_cast<uint64_t>(s->base));
    } else {
      if (parent != nullptr) parent->refs.fetch_sub(1, std::memory_order_seq_cst);
      s->refs.fetch_sub(1, std::memory_order_seq_cst);
    }
  }
  if (fault != nullptr) *fault = f;
  return r;
}

bool MrTable::check(uint32_t key, uint64_t addr, uint64_t len, uint32_t need_access) const {
  return static_cast<bool>(acquire(key, addr, len, need_access, nullptr));
}

// ------------------------------------------------------------------------------------------

Result<std::unique_ptr<MemoryRegion>> SoftMemoryRegion::create(std::shared_ptr<MrTable> table,
                                                               void* addr, size_t length,
                                                               uint32_t access) {
  auto key = table->add(addr, length, access);
  if (!key) return key.error();
  if (access & kRemoteWrite) access |= kLocalWrite;
  return std::unique_ptr<MemoryRegion>(
      new SoftMemoryRegion(std::move(table), addr, length, *key, access));
}

ibtrs::Status SoftMemoryRegion::revoke() {
  table_->revoke(lkey());
  return {};
}

Result<uint32_t> SoftMemoryRegion::restore() {
  BASE_TRY(table_->restore(lkey()));
  return rkey();
}

Result<uint32_t> SoftMemoryRegion::rekey() {
  BASE_ASSIGN_OR_RETURN(uint32_t key, table_->rekey(lkey()));
  set_keys(key, key);
  return key;
}

Result<std::unique_ptr<MemoryWindow>> SoftMemoryWindow::create(std::shared_ptr<MrTable> table) {
  BASE_ASSIGN_OR_RETURN(uint32_t key, table->alloc_window());
  return std::unique_ptr<MemoryWindow>(new SoftMemoryWindow(std::move(table), key));
}

Result<uint32_t> SoftMemoryWindow::bind(const MemoryRegion& mr, uint64_t addr, uint64_t len,
                                        uint32_t access, uint64_t owner) {
  BASE_ASSIGN_OR_RETURN(uint32_t key,
                         table_->bind_window(slot_key_, mr.lkey(), addr, len, access, owner));
  slot_key_ = key;
  rkey_ = key;
  owner_ = owner;
  return key;
}

void SoftMemoryWindow::revoke() { table_->revoke(slot_key_); }

namespace {
// Both classes are final, so an exact type match is the whole check, and it costs a compare
// where dynamic_cast walks the class hierarchy (a bind and a revocation per read).
template <typename To, typename From>
To* exactly(From& from) {
  return typeid(from) == typeid(To) ? static_cast<To*>(&from) : nullptr;
}
}  // namespace

Result<uint32_t> soft_bind_mw(const MrTable& mrs, uint64_t conn, MemoryWindow& mw,
                              const MemoryRegion& mr, uint64_t addr, uint64_t len,
                              uint32_t access) {
  auto* w = exactly<SoftMemoryWindow>(mw);
  auto* r = exactly<const SoftMemoryRegion>(mr);
  if (w == nullptr || r == nullptr || w->table().get() != &mrs || r->table().get() != &mrs)
    return errc(EINVAL);
  return w->bind(mr, addr, len, access, conn);
}

ibtrs::Status soft_invalidate_mw(const MrTable& mrs, uint64_t conn, MemoryWindow& mw) {
  auto* w = exactly<SoftMemoryWindow>(mw);
  if (w == nullptr || w->table().get() != &mrs || w->owner() != conn) return errc(EINVAL);
  w->revoke();  // a window already revoked stays so
  return {};
}

}  // namespace ibtrs::fabric
