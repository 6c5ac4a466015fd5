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
