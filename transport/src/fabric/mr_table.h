// Memory-region table of the software providers (tcp, loopback): what an HCA's memory
// translation table does for verbs. Keys are checked here before a single byte is placed.
//
// Key layout (one key serves as lkey and rkey): [31..12] slot index, [11..0] generation. The
// generation changes on every deregistration, so a stale key never reaches a reused slot
// (4096 reuses of one slot before a key repeats).
//
// Concurrency: registration and deregistration from any thread; lookups from the pollers of any
// number of connections at once. A poller that places bytes into a region holds a Ref for the
// duration of one placement step (one readv/memcpy); deregistration waits for the Refs taken
// before it to drop, so no byte lands after deregister() returns.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "fabric/fabric.h"

namespace ibtrs::fabric {

struct MrSlot;

class MrTable {
 public:
  static constexpr uint32_t kGenBits = 12;
  static constexpr uint32_t kGenMask = (1u << kGenBits) - 1;
  static constexpr uint32_t kSlotsPerPage = 256;
  static constexpr uint32_t kPages = 256;
  static constexpr uint32_t kMaxRegions = kSlotsPerPage * kPages;  // 65536
  static_assert(kMaxRegions <= (1u << (32 - kGenBits)), "slot index must fit the key");

  MrTable();
  ~MrTable();
  MrTable(const MrTable&) = delete;
  MrTable& operator=(const MrTable&) = delete;

  // Returns the key, or EINVAL (bad args) / ENOMEM (table full).
  Result<uint32_t> add(void* addr, size_t length, uint32_t access);
  // Removes the region; returns after every in-progress placement into it has finished.
  void remove(uint32_t key);

  // A checked window of a live region, held for one placement step.
  class Ref {
   public:
    Ref() = default;
    Ref(Ref&& o) noexcept : slot_(o.slot_), ptr_(o.ptr_) { o.slot_ = nullptr; }
    Ref& operator=(Ref&& o) noexcept;
    ~Ref() { reset(); }
    explicit operator bool() const { return slot_ != nullptr; }
    std::byte* ptr() const { return ptr_; }
    void reset();

   private:
    friend class MrTable;
    MrSlot* slot_ = nullptr;
    std::byte* ptr_ = nullptr;
  };

  // Why a lookup failed; maps to the completion status the verbs HCA would report.
  enum class Fault : uint8_t { none, bad_key, out_of_bounds, no_access };

  // Acquires [addr, addr + len) of the region `key` if it is live, contains the whole window
  // (overflow-safe) and grants every bit of `need_access`. len may be 0 (then only the key and
  // access are checked).
  Ref acquire(uint32_t key, uint64_t addr, uint64_t len, uint32_t need_access, Fault* fault) const;

  // A check without holding: whether a local SGE lies inside a live region with `need_access`.
  bool check(uint32_t key, uint64_t addr, uint64_t len, uint32_t need_access) const;

 private:
  struct Page;
  MrSlot* slot_for(uint32_t key) const;

  mutable std::mutex mu_;  // guards allocation of slots and pages (not lookups)
  std::unique_ptr<std::atomic<Page*>[]> pages_;
  std::vector<uint32_t> free_;
  uint32_t next_unused_ = 1;  // slot 0 unused: key 0 is never valid
};

// A MemoryRegion of the software providers.
class SoftMemoryRegion final : public MemoryRegion {
 public:
  static Result<std::unique_ptr<MemoryRegion>> create(std::shared_ptr<MrTable> table, void* addr,
                                                      size_t length, uint32_t access);
  ~SoftMemoryRegion() override { table_->remove(lkey()); }

 private:
  SoftMemoryRegion(std::shared_ptr<MrTable> table, void* addr, size_t length, uint32_t key,
                   uint32_t access)
      : MemoryRegion(addr, length, key, key, access), table_(std::move(table)) {}
  std::shared_ptr<MrTable> table_;
};

}  // namespace ibtrs::fabric
