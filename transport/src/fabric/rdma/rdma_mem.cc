// Protection domains, memory regions and windows of the rdma provider: one ibv_pd per Domain,
// the regions it tracks (for inline sends), key accounting against max_keys, revocation and
// re-keying by re-registration, and type 2 windows.
#include <infiniband/verbs.h>

#include <cerrno>
#include <mutex>
#include <shared_mutex>

#include "fabric/rdma/rdma_private.h"

namespace ibtrs::fabric::rdma {

RdmaMr::RdmaMr(RdmaDomain& domain, ibv_mr* mr, uint32_t access)
    : MemoryRegion(mr->addr, mr->length, mr->lkey, mr->rkey, access), domain_(domain), mr_(mr) {
  domain_.track(mr_);
}

RdmaMr::~RdmaMr() {
  release();
  domain_.put_key();
}

void RdmaMr::release() {
  if (mr_ == nullptr) return;
  domain_.untrack(mr_);
  ibv_dereg_mr(mr_);
  mr_ = nullptr;
  set_keys(0, 0);
}

ibtrs::Status RdmaMr::revoke() {
  release();
  return {};
}

Result<uint32_t> RdmaMr::restore() {
  // A revoked region was deregistered: it comes back registered, with the HCA's new keys.
  if (mr_ != nullptr) return mr_->rkey;
  return rekey();
}

Result<uint32_t> RdmaMr::rekey() {
  // ibv_rereg_mr keeps the keys on Soft-RoCE (and may elsewhere): a new registration is what
  // gives new ones.
  release();
  BASE_ASSIGN_OR_RETURN(mr_, domain_.reg(addr(), length(), access()));
  domain_.track(mr_);
  set_keys(mr_->lkey, mr_->rkey);
  return mr_->rkey;
}

RdmaMw::~RdmaMw() {
  if (mw_ != nullptr) ibv_dealloc_mw(mw_);
  domain_.put_key();
}

ibtrs::Status RdmaMw::replace() {
  if (mw_ != nullptr) ibv_dealloc_mw(mw_);
  state = State::unbound;
  errno = 0;
  mw_ = ibv_alloc_mw(domain_.pd(), IBV_MW_TYPE_2);
  if (mw_ == nullptr) return last_error(ENOMEM);
  return {};
}

void RdmaDomain::track(const ibv_mr* mr) {
  std::lock_guard lk(mr_mu_);
  mrs_[mr->lkey] = Range{reinterpret_cast<uint64_t>(mr->addr), mr->length};
}

void RdmaDomain::untrack(const ibv_mr* mr) {
  std::lock_guard lk(mr_mu_);
  mrs_.erase(mr->lkey);
}

Result<ibv_mr*> RdmaDomain::reg(void* addr, size_t length, uint32_t access) {
  int flags = 0;
  // Verbs refuses REMOTE_WRITE without LOCAL_WRITE: the HCA writes the memory either way.
  if (access & (kLocalWrite | kRemoteWrite)) flags |= IBV_ACCESS_LOCAL_WRITE;
  if (access & kRemoteWrite) flags |= IBV_ACCESS_REMOTE_WRITE;
  if (access & kRemoteRead) flags |= IBV_ACCESS_REMOTE_READ;
  if (access & kMwBind) flags |= IBV_ACCESS_MW_BIND;
  errno = 0;
  ibv_mr* mr = ibv_reg_mr(pd_, addr, length, flags);
  if (mr == nullptr) return errno == EFAULT ? errc(EINVAL) : last_error(ENOMEM);
  return mr;
}

Result<std::unique_ptr<MemoryRegion>> RdmaDomain::register_memory(void* addr, size_t length,
                                                                  uint32_t access) {
  constexpr uint32_t kKnown = kLocalWrite | kRemoteWrite | kRemoteRead | kMwBind;
  if (addr == nullptr || length == 0 || (access & ~kKnown) != 0) return errc(EINVAL);
  BASE_TRY(take_key());
  auto mr = reg(addr, length, access);
  if (!mr) {
    put_key();
    return mr.error();
  }
  return std::unique_ptr<MemoryRegion>(new RdmaMr(*this, *mr, access));
}

Result<std::unique_ptr<MemoryWindow>> RdmaDomain::alloc_mw() {
  BASE_TRY(take_key());
  errno = 0;
  ibv_mw* mw = ibv_alloc_mw(pd_, IBV_MW_TYPE_2);
  if (mw == nullptr) {
    put_key();
    if (errno == EOPNOTSUPP || errno == ENOSYS || errno == EINVAL || errno == 0)
      return errc(ENOTSUP);
    return last_error(ENOMEM);
  }
  return std::unique_ptr<MemoryWindow>(new RdmaMw(*this, mw));
}

Result<std::unique_ptr<Domain>> RdmaDomain::alloc_pd(const PdAttr& attr) {
  errno = 0;
  ibv_pd* pd = ibv_alloc_pd(ctx_);
  if (pd == nullptr) return last_error(ENOMEM);
  return std::unique_ptr<Domain>(new RdmaDomain(fabric_, ctx_, pd, attr.max_keys));
}

}  // namespace ibtrs::fabric::rdma
