// The rdma fabric: the devices librdmacm opened, a domain per device made on first use, and
// the one event thread that reads the fabric's cm channel, the devices' async events and the
// queue of on_disconnected notifications (see rdma_private.h, Threads and Teardown).
#include <infiniband/verbs.h>
#include <poll.h>
#include <rdma/rdma_cma.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>

#include "fabric/providers.h"
#include "fabric/rdma/rdma_private.h"

namespace ibtrs::fabric::rdma {
namespace {

// QPs by (device context, qp_num), for async events; see rdma_private.h (Threads and channels).
struct AsyncQpTable {
  std::mutex mu;  // taken before a fabric's mutex, never after
  std::map<std::pair<ibv_context*, uint32_t>, ConnCore*> qps;
};

AsyncQpTable& async_qps() {
  static AsyncQpTable table;
  return table;
}

}  // namespace

Result<RdmaDomain*> RdmaFabric::domain_for_context(ibv_context* ctx) {
  if (ctx == nullptr) return errc(ENODEV);
  std::lock_guard lk(mu_);
  auto it = domains_.find(ctx);
  if (it != domains_.end()) return it->second.get();
  ibv_pd* pd = ibv_alloc_pd(ctx);
  if (pd == nullptr) return last_error(ENOMEM);
  // The event thread reads async events without blocking; nobody else reads this fd.
  set_nonblock(ctx->async_fd);
  auto* d = new RdmaDomain(*this, ctx, pd, 0);
  domains_.emplace(ctx, std::unique_ptr<RdmaDomain>(d));
  ++domains_gen_;
  wake();
  return d;
}

void RdmaFabric::register_core(const std::shared_ptr<ConnCore>& core) {
  {
    std::lock_guard lk(mu_);
    cores_[core->id()] = core;
  }
  auto& table = async_qps();
  std::lock_guard lk(table.mu);
  table.qps[{core->context(), core->qp_num()}] = core.get();
}

void RdmaFabric::unregister_core(ConnCore* core) {
  {
    auto& table = async_qps();
    std::lock_guard lk(table.mu);
    table.qps.erase({core->context(), core->qp_num()});
  }
  std::unique_lock lk(mu_);
  core->detached = true;
  cores_.erase(core->id());
  idle_.wait(lk, [&] { return core->dispatching == 0; });
}

void RdmaFabric::run() {
  std::vector<pollfd> fds;
  std::vector<ibv_context*> fd_ctx;  // parallel to fds[2..]
  uint64_t seen_gen = UINT64_MAX;
  for (;;) {
    std::deque<std::shared_ptr<ConnCore>> pending;
    {
      std::lock_guard lk(mu_);
      if (stop_) return;
      if (seen_gen != domains_gen_) {
        seen_gen = domains_gen_;
        fds.assign({pollfd{wake_fd_.get(), POLLIN, 0}, pollfd{channel_->fd, POLLIN, 0}});
        fd_ctx.clear();
        for (auto& [ctx, domain] : domains_) {
          fds.push_back(pollfd{ctx->async_fd, POLLIN, 0});
          fd_ctx.push_back(ctx);
        }
      }
      pending.swap(notifications_);
    }
    for (auto& core : pending) deliver(core);
    pending.clear();  // the last reference to a destroyed connection's core may go here

    for (auto& p : fds) p.revents = 0;
    if (::poll(fds.data(), fds.size(), -1) < 0) continue;
    if (fds[0].revents & POLLIN) {
      uint64_t v;
      ssize_t r = ::read(wake_fd_.get(), &v, sizeof(v));
      (void)r;
    }
    if (fds[1].revents & POLLIN) handle_cm_events();
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents & POLLIN) {
        handle_async_events(fd_ctx[i - 2]);
      } else if (fds[i].revents & (POLLERR | POLLHUP | POLLNVAL)) {
        fds[i].fd = -1;  // a removed device stays readable-with-error: stop polling it
      }
    }
  }
}

void RdmaFabric::handle_cm_events() {
  for (;;) {
    rdma_cm_event* ev = nullptr;
    if (rdma_get_cm_event(channel_.get(), &ev) != 0) return;
    rdma_cm_event_type type = ev->event;
    int status = ev->status;
    std::shared_ptr<ConnCore> core;
    {
      std::lock_guard lk(mu_);
      auto it = cores_.find(ev->id);
      if (it != cores_.end() && begin_dispatch_locked(it->second.get())) core = it->second;
    }
    rdma_ack_cm_event(ev);  // rdma_destroy_id of this id waits for it; nothing above blocks
    if (!core) continue;
    switch (type) {
      case RDMA_CM_EVENT_DISCONNECTED:
        // status -ETIMEDOUT: our DREQ went unanswered (the peer is gone).
        core->to_error(ConnState::error, status == -ETIMEDOUT ? ETIMEDOUT : ECONNRESET);
        break;
      case RDMA_CM_EVENT_DEVICE_REMOVAL:
        core->to_error(ConnState::error, ENODEV);
        break;
      case RDMA_CM_EVENT_ADDR_CHANGE:
        // The address the connection was made to/from is gone; as RTRS does, treat it as reset.
        core->to_error(ConnState::error, ECONNRESET);
        break;
      default:
        break;  // TIMEWAIT_EXIT: the QP could be reused now; ours is destroyed instead
    }
    end_dispatch(core.get());
  }
}

void RdmaFabric::handle_async_events(ibv_context* ctx) {
  for (;;) {
    ibv_async_event ae;
    if (ibv_get_async_event(ctx, &ae) != 0) return;
    ibv_event_type type = ae.event_type;
    bool qp_event = type == IBV_EVENT_COMM_EST || type == IBV_EVENT_QP_FATAL ||
                    type == IBV_EVENT_QP_REQ_ERR || type == IBV_EVENT_QP_ACCESS_ERR ||
                    type == IBV_EVENT_SQ_DRAINED || type == IBV_EVENT_PATH_MIG ||
                    type == IBV_EVENT_PATH_MIG_ERR || type == IBV_EVENT_QP_LAST_WQE_REACHED;
    std::vector<std::shared_ptr<ConnCore>> targets;
    {
      // Looked up before the ack: ibv_destroy_qp waits for it, so the QP cannot go away now.
      auto& table = async_qps();
      std::lock_guard lk(table.mu);
      for (auto& [key, core] : table.qps) {
        if (key.first != ctx) continue;
        bool hit = qp_event ? key.second == ae.element.qp->qp_num : type == IBV_EVENT_DEVICE_FATAL;
        if (hit && core->fabric().begin_dispatch(core)) targets.push_back(core->shared_from_this());
      }
    }
    ibv_ack_async_event(&ae);
    for (auto& core : targets) {
      switch (type) {
        case IBV_EVENT_COMM_EST: core->comm_established(); break;
        case IBV_EVENT_QP_FATAL:
        case IBV_EVENT_QP_REQ_ERR:
        case IBV_EVENT_QP_ACCESS_ERR: core->to_error(ConnState::error, EIO); break;
        case IBV_EVENT_DEVICE_FATAL: core->to_error(ConnState::error, ENODEV); break;
        default: break;
      }
      core->fabric().end_dispatch(core.get());
    }
  }
}

void RdmaFabric::deliver(const std::shared_ptr<ConnCore>& core) {
  {
    std::lock_guard lk(mu_);
    if (!begin_dispatch_locked(core.get())) return;
  }
  if (core->events().on_disconnected) core->events().on_disconnected(errc(core->cause()));
  end_dispatch(core.get());
}

}  // namespace ibtrs::fabric::rdma

namespace ibtrs::fabric {

Result<std::unique_ptr<Fabric>> make_rdma_fabric(const FabricOptions& /*options*/) {
  int num = 0;
  ibv_device** list = ibv_get_device_list(&num);
  if (list == nullptr) return errc(ENODEV);
  ibv_free_device_list(list);
  if (num == 0) return errc(ENODEV);

  BASE_ASSIGN_OR_RETURN(rdma::ChannelPtr channel, rdma::make_channel());
  int count = 0;
  ibv_context** devices = rdma_get_devices(&count);
  if (devices == nullptr) return errc(ENODEV);
  if (count == 0) {
    rdma_free_devices(devices);
    return errc(ENODEV);
  }
  base::UniqueFd wake_fd(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!wake_fd) {
    auto err = rdma::last_error();
    rdma_free_devices(devices);
    return err;
  }
  return std::unique_ptr<Fabric>(new rdma::RdmaFabric(devices, std::move(channel), std::move(wake_fd)));
}

}  // namespace ibtrs::fabric
