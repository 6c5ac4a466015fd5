// Memory-key table of the software providers (tcp, loopback): what an HCA's memory translation
// table does for verbs, one per protection domain. Keys are checked here before a single byte is
// placed, and a key is only ever looked up in the table of the connection's own domain, so a
// key of one domain means nothing on another's connections.
//
// Key layout (one key serves as lkey and rkey): [31..tag_bits] slot index, [tag_bits-1..0] tag.
// The index takes bit_width(capacity) bits (slots 1..capacity; key 0 is never valid) and the
// tag every bit left: 16 at the largest capacity (65535), 19 for a table of 4096. Every
// registration, window bind and rekey draws a fresh tag from the kernel's CSPRNG
// (common/secure_random.h), never equal to the slot's previous one: a key cannot be predicted
// from keys seen before (a peer guessing hits with probability 2^-tag_bits per try, and a wrong
// guess breaks its connection), and a stale key never reaches the slot's next use.
//
// Slots hold regions (registered memory) or windows (memory windows: a remotely accessible
// range of one region, with a key of its own that is bound, revoked and bound again without
// registering anything; verbs type 2). A window may be tied to one connection (an owner id):
// then it answers only lookups made for that connection, as a verbs type 2B window answers
// only its queue pair. A window is reachable only while its region is live under the key it
// was bound with.
//
// Concurrency: registration, deregistration, binds and revocations from any thread; lookups
// from the pollers of any number of connections at once. A poller that places bytes into a
// region holds a Ref for the duration of one placement step (one readv/memcpy); revoking or
// removing a key waits for the Refs taken before it to drop, so no byte lands through a key
// after the call that revoked it returns. Revocation is a compare-and-swap and that wait: no
// lock and no system call.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <vector>

#include "fabric/fabric.h"

namespace ibtrs::fabric {

struct MrSlot;

class MrTable {
 public:
  // What a slot holds.
  enum class Kind : uint8_t { region, window };

  static constexpr uint32_t kSlotsPerPage = 256;
  static constexpr uint32_t kMaxCapacity = 65535;  // slots 1..65535: 16 index bits
  static constexpr uint32_t kPages = (kMaxCapacity + 1) / kSlotsPerPage;

  // `capacity`: keys (regions + windows) the table holds at once, 1..kMaxCapacity; adding
  // beyond it is ENOMEM. Smaller tables get wider tags.
  explicit MrTable(uint32_t capacity = kMaxCapacity);
  ~MrTable();
  MrTable(const MrTable&) = delete;
  MrTable& operator=(const MrTable&) = delete;

  uint32_t capacity() const { return capacity_; }
  uint32_t tag_bits() const { return tag_bits_; }
  // Slots held now (regions and windows, bound or not).
  uint32_t in_use() const { return in_use_.load(std::memory_order_relaxed); }

  // Registers a region; returns its key, or EINVAL (bad args) / ENOMEM (table full).
  Result<uint32_t> add(void* addr, size_t length, uint32_t access);
  // Frees the slot of `key` (a region or a window, live or revoked); returns after every
  // placement through it has finished. A key that is not the slot's current one is ignored.
  void remove(uint32_t key);
  // Region `key` gets a new key; the old one fails from the return on (placements through it
  // have finished). Works on a revoked region too (it is live again). ENOENT: not a region
  // held under `key`.
  Result<uint32_t> rekey(uint32_t key);
  // Revokes a region's key or unbinds a window: lookups with it fail from the return on. The
  // slot stays held (restore() or rekey() a region, bind_window() a window to use it again).
  void revoke(uint32_t key);
  // The revoked region `key` is live again under the same key (a live one stays so). ENOENT:
  // not a region held under `key`.
  ibtrs::Status restore(uint32_t key);

  // Reserves a window slot, unbound; the key returned is not valid for access until bound.
  // ENOMEM when the table is full.
  Result<uint32_t> alloc_window();
  // Binds the unbound window `window` to [addr, addr + len) of the live region `region` with
  // `access` (kRemoteWrite and/or kRemoteRead), usable only by lookups for connection `owner`
  // (0: any). Returns the window's new key. EINVAL: not an unbound window, not a live region
  // registered with kMwBind, range outside the region (overflow-safe), len 0, bad access bits,
  // or remote write over a region without local write.
  Result<uint32_t> bind_window(uint32_t window, uint32_t region, uint64_t addr, uint64_t len,
                               uint32_t access, uint64_t owner);

  // A checked range of a live region or bound window, held for one placement step.
  class Ref {
   public:
    Ref() = default;
    Ref(Ref&& o) noexcept : slot_(o.slot_), parent_(o.parent_), ptr_(o.ptr_) {
      o.slot_ = nullptr;
      o.parent_ = nullptr;
    }
    Ref& operator=(Ref&& o) noexcept;
    ~Ref() { reset(); }
    explicit operator bool() const { return slot_ != nullptr; }
    std::byte* ptr() const { return ptr_; }
    void reset();

   private:
    friend class MrTable;
    MrSlot* slot_ = nullptr;
    MrSlot* parent_ = nullptr;  // a window's region, held with it
    std::byte* ptr_ = nullptr;
  };

  // Why a lookup failed; maps to the completion status the verbs HCA would report.
  enum class Fault : uint8_t { none, bad_key, out_of_bounds, no_access };

  // Acquires [addr, addr + len) of the region or window `key` if it is live, contains the
  // whole range (overflow-safe) and grants every bit of `need_access`. len may be 0 (then only
  // the key and access are checked). Windows answer only remote accesses (need_access with
  // kRemoteWrite or kRemoteRead) made for their owner connection (`conn`).
  Ref acquire(uint32_t key, uint64_t addr, uint64_t len, uint32_t need_access, Fault* fault,
              uint64_t conn = 0) const;

  // A check without holding: whether a local SGE lies inside a live region with `need_access`.
  bool check(uint32_t key, uint64_t addr, uint64_t len, uint32_t need_access) const;

 private:
  struct Page;
  MrSlot* slot_for(uint32_t key) const;
  uint32_t tag_of(uint32_t key) const { return key & tag_mask_; }
  uint32_t make_key(uint32_t index, uint32_t tag) const { return (index << tag_bits_) | tag; }
  uint32_t fresh_tag(uint32_t old) const;
  // Takes a free slot (mu_ held); nullptr when the table is full.
  MrSlot* take_slot(uint32_t* index);
  // Fills a free slot with a fresh tag: a live region, or an unbound window.
  Result<uint32_t> publish(Kind kind, std::byte* base, uint64_t length, uint32_t access);
  // Moves the slot of `key` from any state in `from` (with key's tag) to `to`; waits for the
  // lookups in flight. False: `key` is not the slot's current key in one of those states.
  bool transition(uint32_t key, std::initializer_list<uint64_t> from, uint64_t to);

  const uint32_t capacity_;
  const uint32_t tag_bits_;
  const uint32_t tag_mask_;
  mutable std::mutex mu_;  // guards allocation of slots and pages (not lookups)
  std::unique_ptr<std::atomic<Page*>[]> pages_;
  std::vector<uint32_t> free_;
  uint32_t next_unused_ = 1;  // slot 0 unused: key 0 is never valid
  std::atomic<uint32_t> in_use_{0};
};

// A MemoryRegion of the software providers.
class SoftMemoryRegion final : public MemoryRegion {
 public:
  static Result<std::unique_ptr<MemoryRegion>> create(std::shared_ptr<MrTable> table, void* addr,
                                                      size_t length, uint32_t access);
  ~SoftMemoryRegion() override { table_->remove(lkey()); }
  const std::shared_ptr<MrTable>& table() const { return table_; }
  ibtrs::Status revoke() override;
  Result<uint32_t> restore() override;
  Result<uint32_t> rekey() override;

 private:
  SoftMemoryRegion(std::shared_ptr<MrTable> table, void* addr, size_t length, uint32_t key,
                   uint32_t access)
      : MemoryRegion(addr, length, key, key, access), table_(std::move(table)) {}
  std::shared_ptr<MrTable> table_;
};

// A MemoryWindow of the software providers: a window slot of the domain's table.
class SoftMemoryWindow final : public MemoryWindow {
 public:
  static Result<std::unique_ptr<MemoryWindow>> create(std::shared_ptr<MrTable> table);
  ~SoftMemoryWindow() override { table_->remove(slot_key_); }
  const std::shared_ptr<MrTable>& table() const { return table_; }
  // Bind / revoke on behalf of connection `owner` (the provider's connection id).
  Result<uint32_t> bind(const MemoryRegion& mr, uint64_t addr, uint64_t len, uint32_t access,
                        uint64_t owner);
  void revoke();
  // The connection of the current or last binding (0: never bound).
  uint64_t owner() const { return owner_; }

 private:
  SoftMemoryWindow(std::shared_ptr<MrTable> table, uint32_t key)
      : table_(std::move(table)), slot_key_(key) {}
  std::shared_ptr<MrTable> table_;
  uint32_t slot_key_;  // the slot's current key (bound or not)
  uint64_t owner_ = 0;
};

// Connection::bind_mw / invalidate_mw of the software providers, for a connection with id
// `conn` in the domain whose table is `mrs`: EINVAL for objects of another domain or provider,
// and for a window last bound on another connection.
Result<uint32_t> soft_bind_mw(const MrTable& mrs, uint64_t conn, MemoryWindow& mw,
                              const MemoryRegion& mr, uint64_t addr, uint64_t len,
                              uint32_t access);
ibtrs::Status soft_invalidate_mw(const MrTable& mrs, uint64_t conn, MemoryWindow& mw);

}  // namespace ibtrs::fabric
