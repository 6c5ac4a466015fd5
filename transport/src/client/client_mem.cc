// The client's memory (siw_mem.c; kernel rtrs: the IU and buffer registrations of rtrs-clt.c):
// the session's protection domain on each device, the permits' IUs and read windows there, and
// the user's registrations in every one of them. Structure in client_impl.h.
#include <sys/mman.h>

#include "client/client_impl.h"
#include "base/log.h"

namespace ibtrs {
namespace client {

uint32_t Session::user_access(uint32_t slot) const {
  // With windows the user's memory is never remotely writable through its own key.
  return fabric::kLocalWrite | (use_windows[slot] ? fabric::kMwBind : fabric::kRemoteWrite);
}

Result<uint32_t> Session::domain_slot(fabric::Domain* d) {
  std::lock_guard lock(mem_mu);
  for (uint32_t i = 0; i < kMaxDomains; ++i) {
    if (devices[i].load() == d) return i;
  }
  uint32_t slot = kMaxDomains;
  for (uint32_t i = 0; i < kMaxDomains; ++i) {
    if (devices[i].load() == nullptr) {
      slot = i;
      break;
    }
  }
  if (slot == kMaxDomains) return errc(ENOSPC);
  // The session's own protection domain on the device: no other session's server reaches it.
  BASE_ASSIGN_OR_RETURN(auto pd, d->alloc_pd(fabric::PdAttr{}));
  {
    auto probe = pd->alloc_mw();
    use_windows[slot] = probe.ok();
    if (!probe.ok()) {
      BASE_LOG(warn, "session %s: device %s has no memory windows (%s): read buffers stay "
                "remotely writable while registered", opts.session_name.c_str(),
                d->device_name().c_str(), probe.error().message().c_str());
    }
  }
  // Everything a request may point at must be registered in the domain before a path on it
  // carries IO: every user registration now, the permit IUs once the geometry is known.
  std::vector<std::unique_ptr<fabric::MemoryRegion>> regs;
  for (auto* r : regions) {
    BASE_ASSIGN_OR_RETURN(auto mr, pd->register_memory(r->addr, r->size, user_access(slot)));
    regs.push_back(std::move(mr));
  }
  for (size_t i = 0; i < regions.size(); ++i) {
    regions[i]->mrs[slot].store(regs[i].get(), std::memory_order_release);
    regions[i]->keep.push_back(std::move(regs[i]));
  }
  pds[slot] = std::move(pd);
  devices[slot].store(d, std::memory_order_release);
  return slot;
}

Status Session::slot_io_setup(uint32_t slot) {
  std::lock_guard lock(mem_mu);
  fabric::Domain& pd = *pds[slot];
  if (!iu_mrs[slot]) {
    BASE_ASSIGN_OR_RETURN(auto iu_mr, pd.register_memory(iu, iu_len, fabric::kLocalWrite));
    iu_lkey[slot].store(iu_mr->lkey(), std::memory_order_release);
    iu_mrs[slot] = std::move(iu_mr);
  }
  if (use_windows[slot] && !wins[slot]) {
    // A permit's first window is made here, so that one-segment reads allocate nothing.
    const size_t n = size_t{geo.queue_depth} * ClientSession::kMaxSegments;
    auto table = std::make_unique<std::unique_ptr<fabric::MemoryWindow>[]>(n);
    for (uint32_t p = 0; p < geo.queue_depth; ++p) {
      BASE_ASSIGN_OR_RETURN(table[size_t{p} * ClientSession::kMaxSegments], pd.alloc_mw());
    }
    wins[slot] = std::move(table);
  }
  return {};
}

}  // namespace client

RegisteredMemory::~RegisteredMemory() {
  for (auto& sh : impl_->shares) {
    Impl* o = sh.load(std::memory_order_acquire);
    if (o == nullptr) continue;
    {
      std::lock_guard lock(o->session->mem_mu);
      std::erase(o->session->regions, o);
    }
    delete o;
  }
  client::Session* s = impl_->session;
  {
    std::lock_guard lock(s->mem_mu);
    std::erase(s->regions, impl_);
  }
  const bool owned = impl_->owned;
  delete impl_;  // deregisters from every device
  if (owned) ::munmap(addr_, (size_ + 4095) & ~size_t{4095});
}

Result<std::unique_ptr<RegisteredMemory>> ClientSession::register_memory(void* addr, size_t size) {
  if (addr == nullptr || size == 0) return errc(EINVAL);
  auto mi = std::make_unique<RegisteredMemory::Impl>();
  mi->session = impl_.get();
  mi->addr = addr;
  mi->size = size;
  std::lock_guard lock(impl_->mem_mu);
  for (uint32_t i = 0; i < kMaxDomains; ++i) {
    if (impl_->devices[i].load() == nullptr) continue;
    BASE_ASSIGN_OR_RETURN(auto mr,
                           impl_->pds[i]->register_memory(addr, size, impl_->user_access(i)));
    mi->mrs[i].store(mr.get(), std::memory_order_release);
    mi->keep.push_back(std::move(mr));
  }
  impl_->regions.push_back(mi.get());
  auto* raw = mi.release();
  std::unique_ptr<RegisteredMemory> h(new RegisteredMemory(addr, size, raw));
  return h;
}

Status ClientSession::share_memory(const RegisteredMemory& mem) {
  RegisteredMemory::Impl* owner = mem.impl();
  if (owner->session == impl_.get()) return errc(EINVAL);
  for (auto& sh : owner->shares) {
    const RegisteredMemory::Impl* o = sh.load(std::memory_order_acquire);
    if (o != nullptr && o->session == impl_.get()) return errc(EEXIST);
  }
  auto mi = std::make_unique<RegisteredMemory::Impl>();
  mi->session = impl_.get();
  mi->addr = owner->addr;
  mi->size = owner->size;
  std::lock_guard lock(impl_->mem_mu);
  for (uint32_t i = 0; i < kMaxDomains; ++i) {
    if (impl_->devices[i].load() == nullptr) continue;
    BASE_ASSIGN_OR_RETURN(auto mr, impl_->pds[i]->register_memory(owner->addr, owner->size,
                                                                   impl_->user_access(i)));
    mi->mrs[i].store(mr.get(), std::memory_order_release);
    mi->keep.push_back(std::move(mr));
  }
  for (auto& sh : owner->shares) {
    RegisteredMemory::Impl* expected = nullptr;
    if (sh.compare_exchange_strong(expected, mi.get(), std::memory_order_acq_rel)) {
      impl_->regions.push_back(mi.release());
      return {};
    }
  }
  return errc(ENOSPC);
}

Result<std::unique_ptr<RegisteredMemory>> ClientSession::alloc_buffer(size_t size) {
  if (size == 0) return errc(EINVAL);
  const size_t len = (size + 4095) & ~size_t{4095};
  void* m = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return errc(ENOMEM);
  auto r = register_memory(m, size);
  if (!r.ok()) {
    ::munmap(m, len);
    return r.error();
  }
  (*r)->impl()->owned = true;
  return r;
}

}  // namespace ibtrs
