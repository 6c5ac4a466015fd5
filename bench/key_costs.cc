// What a protection domain and per-IO keys cost on one provider, per operation, in the calling
// thread (issue 13 part A: per-session domains, read windows, always_invalidate):
//   alloc_pd       Domain::alloc_pd + destruction (a session's domain on a device)
//   alloc_mw       Domain::alloc_mw + destruction (a client read window, made once per permit)
//   reg 128K       register_memory(128 KiB) + deregistration (always_invalidate before: per IO)
//   restore 128K   MemoryRegion::revoke + restore (always_invalidate now: per IO)
//   rekey 128K     MemoryRegion::revoke + rekey (a new key each time)
//   bind+inv       Connection::bind_mw + invalidate_mw, waiting for the LOCAL_INV completion
//                  where it is asynchronous (a read window now: per read)
// A benchmark, not a test: it asserts nothing.
//
//   key-costs --fabric tcp|loopback|rdma [--iterations N]
// rdma needs IBTRS_RDMA_ADDR_A / IBTRS_RDMA_ADDR_B (the VM rig sets them: bench/vm-isolation.sh).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <string>
#include <vector>

#include "fabric/fabric.h"

namespace {

using namespace ibtrs;
using namespace ibtrs::fabric;
using Clock = std::chrono::steady_clock;

[[noreturn]] void die(const char* what, std::error_code ec) {
  std::fprintf(stderr, "%s: %s\n", what, ec.message().c_str());
  std::exit(1);
}

template <typename T>
T must(Result<T> r, const char* what) {
  if (!r.ok()) die(what, r.error());
  return std::move(r).value();
}

void report(const char* name, int n, const std::function<void()>& op) {
  op();  // warm
  auto t0 = Clock::now();
  for (int i = 0; i < n; ++i) op();
  double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / n;
  std::printf("| %s | %.3f |\n", name, us);
}

}  // namespace

int main(int argc, char** argv) {
  std::string kind_name = "tcp";
  int n = 2000;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--fabric") kind_name = argv[i + 1];
    else if (a == "--iterations") n = std::atoi(argv[i + 1]);
  }
  auto kind = parse_fabric_kind(kind_name);
  if (!kind || n <= 0) {
    std::fprintf(stderr, "usage: key-costs --fabric tcp|loopback|rdma [--iterations N]\n");
    return 2;
  }
  std::string listen = "tcp:127.0.0.1:0";
  const Address* source = nullptr;
  Address src;
  if (*kind == FabricKind::loopback) listen = "loopback:key-costs:0";
  if (*kind == FabricKind::rdma) {
    const char* a = std::getenv("IBTRS_RDMA_ADDR_A");
    const char* b = std::getenv("IBTRS_RDMA_ADDR_B");
    if (a == nullptr || b == nullptr) {
      std::fprintf(stderr, "rdma: IBTRS_RDMA_ADDR_A/B not set (run in the VM rig)\n");
      return 77;
    }
    listen = std::string("rdma:") + b + ":0";
    src = *Address::parse(std::string("rdma:") + a + ":0");
    source = &src;
  }
  auto fab = must(open_fabric(*kind), "open_fabric");
  auto listener = must(fab->listen(*Address::parse(listen)), "listen");
  Domain* srv_dev = must(fab->domain_for(listener->address()), "domain_for");
  Domain* cli_dev = must(fab->domain_for(listener->address(), source), "domain_for");

  std::printf("## key costs: %s (%s), %d iterations, microseconds per operation\n\n",
              kind_name.c_str(), srv_dev->device_name().c_str(), n);
  std::printf("| operation | us |\n| --- | --- |\n");

  report("alloc_pd + free", n, [&] { (void)must(srv_dev->alloc_pd(PdAttr{}), "alloc_pd"); });
  auto pd = must(srv_dev->alloc_pd(PdAttr{}), "alloc_pd");
  bool windows = pd->alloc_mw().ok();
  if (windows) report("alloc_mw + free", n, [&] { (void)must(pd->alloc_mw(), "alloc_mw"); });

  std::vector<std::byte> mem(128 * 1024);
  report("register 128 KiB + deregister", n, [&] {
    (void)must(pd->register_memory(mem.data(), mem.size(), kLocalWrite | kRemoteWrite), "reg");
  });
  auto mr = must(pd->register_memory(mem.data(), mem.size(), kLocalWrite | kRemoteWrite), "reg");
  report("revoke + restore 128 KiB", n, [&] {
    (void)mr->revoke();
    (void)must(mr->restore(), "restore");
  });
  report("revoke + rekey 128 KiB", n, [&] {
    (void)mr->revoke();
    (void)must(mr->rekey(), "rekey");
  });

  if (windows) {
    // A connected pair: the window is bound on the server's side of it.
    auto scq = must(srv_dev->create_cq(256), "cq");
    auto ccq = must(cli_dev->create_cq(256), "cq");
    auto accepted = std::async(std::launch::async, [&]() -> Result<std::unique_ptr<Connection>> {
      auto req = listener->get_request(std::chrono::seconds(10));
      if (!req) return req.error();
      return (*req)->accept(*pd, *scq, QueueCaps{}, {}, {});
    });
    ConnectParams p;
    p.remote = listener->address();
    p.source = source;
    p.cq = ccq.get();
    auto cc = must(cli_dev->connect(p), "connect");
    auto sc = must(accepted.get(), "accept");
    auto bmr = must(pd->register_memory(mem.data(), mem.size(), kLocalWrite | kMwBind), "reg");
    auto mw = must(pd->alloc_mw(), "alloc_mw");
    Completion wc[16];
    report("bind_mw + invalidate_mw (4 KiB window)", n, [&] {
      (void)must(sc->bind_mw(*mw, *bmr, bmr->remote_addr(0), 4096, kRemoteWrite), "bind");
      if (!must(sc->invalidate_mw(*mw, 1), "invalidate")) {
        // Sleeping on the CQ as an IO thread does: a busy loop would take the CPU from a
        // software HCA (rxe) that runs the LOCAL_INV in a kernel thread.
        for (bool done = false; !done;) {
          size_t k = scq->wait(wc, std::chrono::seconds(1));
          for (size_t i = 0; i < k; ++i) done |= wc[i].wr_id == 1;
        }
      }
    });
    mw.reset();
    sc.reset();
  }
  return 0;
}
