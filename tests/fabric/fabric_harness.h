// Test harness for fabric providers: two "hosts" (two Fabric instances), a listener, connected
// pairs, registered buffers, and a driver that polls both ends (the software providers make
// progress only while their CQs are polled, like every IBTRS IO thread does).
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fabric/fabric.h"

namespace ibtrs::fabric::testing {

using namespace std::chrono_literals;

// Which provider the binary tests: --fabric=NAME on the command line (see conformance main).
FabricKind& tested_kind();
// Provider options of the run (--busy-poll).
FabricOptions& tested_options();

// TLS of the run (--tls, tcp only; --tls=user keeps the record layer in userspace even where the
// kernel has kTLS): every listener of the suite requires TLS and every connect runs it, with a
// pre-shared key made for the run. Empty contexts when off.
struct TestedTls {
  bool on = false;
  tls::Psk psk;
  std::shared_ptr<tls::Context> client, server;
};
TestedTls& tested_tls();
// Makes tested_tls() for `kernel` (false: userspace record layer); false with a message on error.
bool enable_tested_tls(bool kernel);

// Addresses for the tested provider: server listen address (port 0) and client source.
struct Endpoints {
  Address server;
  std::optional<Address> client_source;
};
Result<Endpoints> endpoints_for(FabricKind kind, const std::string& tag);

// Registered memory owned by the test.
struct Buffer {
  std::vector<std::byte> bytes;
  std::unique_ptr<MemoryRegion> mr;

  static Buffer make(Domain& d, size_t len, uint32_t access, std::byte fill = std::byte{0}) {
    Buffer b;
    b.bytes.assign(len, fill);
    auto r = d.register_memory(b.bytes.data(), len, access);
    EXPECT_TRUE(r.ok()) << r.error().message();
    if (r.ok()) b.mr = std::move(r).value();
    return b;
  }
  Sge sge(size_t off, size_t len) const { return mr->sge(off, static_cast<uint32_t>(len)); }
  void pattern(uint32_t seed) {
    for (size_t i = 0; i < bytes.size(); ++i)
      bytes[i] = static_cast<std::byte>((i * 131 + seed * 7 + (i >> 8)) & 0xff);
  }
};

struct Side {
  Domain* domain = nullptr;      // the device's domain (connect; the listener's requests)
  Domain* accept_pd = nullptr;   // server side: accept into this domain instead of domain
  std::unique_ptr<CompletionQueue> cq;
  CompletionQueue* shared_cq = nullptr;  // used instead of cq when set
  std::unique_ptr<Connection> conn;
  std::vector<Completion> done;  // completions drained so far
  std::atomic<int> disconnects{0};
  std::vector<std::byte> peer_private;

  ConnectionEvents events() {
    return ConnectionEvents{[this](std::error_code) { disconnects.fetch_add(1); }};
  }
  CompletionQueue& queue() { return shared_cq != nullptr ? *shared_cq : *cq; }
  size_t count(std::function<bool(const Completion&)> pred) const {
    size_t n = 0;
    for (const auto& c : done) n += pred(c) ? 1 : 0;
    return n;
  }
};

class FabricTest : public ::testing::Test {
 protected:
  void SetUp() override;
  // Fills the provider's part of `p`: TLS when the run has it.
  static void with_tested_tls(ConnectParams& p) { p.tls = tested_tls().client; }
  void TearDown() override;

  // Connects client -> server with private data both ways; fails the test on error.
  void connect_pair(Side& client, Side& server, const QueueCaps& caps = {},
                    std::span<const std::byte> req_pd = {}, std::span<const std::byte> rsp_pd = {});

  // Polls both sides until pred() or the deadline; returns pred().
  bool drive(Side& a, Side& b, const std::function<bool()>& pred,
             std::chrono::milliseconds timeout = 10s);
  static void poll_once(Side& s);

  FabricKind kind_{};
  Endpoints ep_;
  std::unique_ptr<Fabric> server_fabric_;
  std::unique_ptr<Fabric> client_fabric_;
  std::unique_ptr<Listener> listener_;
  Domain* server_domain_ = nullptr;
  Domain* client_domain_ = nullptr;
  Side cli_;
  Side srv_;
};

}  // namespace ibtrs::fabric::testing
