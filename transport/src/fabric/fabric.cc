#include "fabric/fabric.h"

#include <poll.h>

#include "fabric/providers.h"

namespace ibtrs::fabric {

std::string_view to_string(WcStatus s) {
  switch (s) {
    case WcStatus::success: return "success";
    case WcStatus::flush_error: return "flush_error";
    case WcStatus::local_length_error: return "local_length_error";
    case WcStatus::local_protection_error: return "local_protection_error";
    case WcStatus::remote_access_error: return "remote_access_error";
    case WcStatus::remote_invalid_request: return "remote_invalid_request";
    case WcStatus::remote_operation_error: return "remote_operation_error";
    case WcStatus::retry_exceeded: return "retry_exceeded";
    case WcStatus::fatal_error: return "fatal_error";
  }
  return "?";
}

std::string_view to_string(Opcode o) {
  switch (o) {
    case Opcode::send: return "send";
    case Opcode::write: return "write";
    case Opcode::write_with_imm: return "write_with_imm";
    case Opcode::recv: return "recv";
    case Opcode::recv_rdma_with_imm: return "recv_rdma_with_imm";
    case Opcode::local_inv: return "local_inv";
  }
  return "?";
}

size_t CompletionQueue::wait(std::span<Completion> out, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    size_t n = poll(out);
    if (n > 0) return n;
    if (!arm().ok()) return 0;
    n = poll(out);  // a completion may have arrived between the first poll and arm()
    if (n > 0) return n;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return 0;
    // An event left over from an earlier arm wakes us with nothing new to poll: keep waiting,
    // so that 0 always means the timeout expired.
    pollfd pfd{fd(), POLLIN, 0};
    int ms = left.count() > INT32_MAX ? INT32_MAX : static_cast<int>(left.count());
    if (::poll(&pfd, 1, ms) > 0) ack_events();
  }
}

namespace {
uint64_t total_length(std::span<const Sge> sges) {
  uint64_t total = 0;
  for (const Sge& s : sges) total += s.length;
  return total;
}
}  // namespace

ibtrs::Status check_send_batch(std::span<const SendWr> wrs, const QueueCaps& caps) {
  for (const SendWr& wr : wrs) {
    if (wr.opcode != Opcode::send && wr.opcode != Opcode::write &&
        wr.opcode != Opcode::write_with_imm)
      return errc(EINVAL);
    if (wr.sg_list.size() > caps.max_send_sge) return errc(EINVAL);
    if (total_length(wr.sg_list) > kMaxMessage) return errc(EINVAL);
  }
  return {};
}

ibtrs::Status check_recv_batch(std::span<const RecvWr> wrs, const QueueCaps& caps) {
  for (const RecvWr& wr : wrs) {
    if (wr.sg_list.size() > caps.max_recv_sge) return errc(EINVAL);
    if (total_length(wr.sg_list) > kMaxMessage) return errc(EINVAL);
  }
  return {};
}

ibtrs::Status check_caps(const QueueCaps& c, uint32_t max_wr, uint32_t max_sge) {
  if (c.max_send_wr == 0 || c.max_send_wr > max_wr || c.max_recv_wr == 0 ||
      c.max_recv_wr > max_wr || c.max_send_sge == 0 || c.max_send_sge > max_sge ||
      c.max_recv_sge == 0 || c.max_recv_sge > max_sge)
    return errc(EINVAL);
  return {};
}

Result<std::unique_ptr<Fabric>> open_fabric(FabricKind kind, const FabricOptions& options) {
  switch (kind) {
    case FabricKind::tcp: return make_tcp_fabric(options);
    case FabricKind::loopback: return make_loopback_fabric(options);
    case FabricKind::rdma:
#ifdef IBTRS_HAVE_RDMA
      return make_rdma_fabric(options);
#else
      return errc(ENOTSUP);
#endif
  }
  return errc(EINVAL);
}

}  // namespace ibtrs::fabric
