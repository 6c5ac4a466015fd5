// Test rig for sessions: a server with a RAM volume behind a tiny user-header protocol, and
// helpers to run synchronous IO through a client session.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ibtrs/client.h"
#include "ibtrs/server.h"

namespace ibtrs::test {

// The user header of the rig: where in the volume.
struct VolHdr {
  uint64_t offset;
  uint32_t len;
  uint32_t magic;
};
inline constexpr uint32_t kVolMagic = 0x564f4c31;

class RamVolume final : public ServerHandler {
 public:
  explicit RamVolume(size_t size) : mem_(size) {}

  void on_session_up(ServerSession& s) override {
    std::lock_guard l(mu_);
    sessions_up_.push_back(s.name());
  }
  void on_session_down(ServerSession& s) override {
    std::lock_guard l(mu_);
    sessions_down_.push_back(s.name());
  }
  void on_path_up(ServerSession&, const ServerPathInfo& p) override {
    std::lock_guard l(mu_);
    paths_up_.push_back(p.name);
  }
  void on_path_down(ServerSession&, const ServerPathInfo& p) override {
    std::lock_guard l(mu_);
    paths_down_.push_back(p.name);
  }
  void on_request(ServerRequest& r) override {
    requests_.fetch_add(1);
    if (hold_) {
      std::lock_guard l(mu_);
      held_.push_back(&r);
      return;
    }
    serve(r);
  }

  void serve(ServerRequest& r) {
    VolHdr h{};
    if (r.usr().size() != sizeof(h)) return r.complete(EINVAL);
    std::memcpy(&h, r.usr().data(), sizeof(h));
    if (h.magic != kVolMagic || h.offset + h.len > mem_.size() || h.len != r.data().size())
      return r.complete(EINVAL);
    if (fail_with_ != 0) return r.complete(fail_with_);
    // A failed-over request may be served twice at once (old copy held, new copy deferred).
    std::lock_guard l(mem_mu_);
    if (r.dir() == IoDir::write) {
      std::memcpy(mem_.data() + h.offset, r.data().data(), h.len);
    } else {
      std::memcpy(r.data().data(), mem_.data() + h.offset, h.len);
    }
    r.complete(0);
  }

  // Held requests: the test completes them later.
  void hold(bool on) { hold_ = on; }
  std::vector<ServerRequest*> take_held() {
    std::lock_guard l(mu_);
    return std::exchange(held_, {});
  }

  std::vector<std::byte>& mem() { return mem_; }
  std::atomic<uint64_t> requests_{0};
  std::atomic<int> fail_with_{0};
  std::atomic<bool> hold_{false};
  std::mutex mu_;
  std::vector<std::string> sessions_up_, sessions_down_, paths_up_, paths_down_;
  std::vector<ServerRequest*> held_;
  std::mutex mem_mu_;

 private:
  std::vector<std::byte> mem_;
};

// Waits for one completion.
struct Waiter {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  int err = -1;
  static void cb(void* ctx, int err) {
    auto* w = static_cast<Waiter*>(ctx);
    std::lock_guard l(w->mu);
    w->done = true;
    w->err = err;
    w->cv.notify_all();
  }
  int wait(std::chrono::milliseconds t = std::chrono::seconds(20)) {
    std::unique_lock l(mu);
    if (!cv.wait_for(l, t, [&] { return done; })) return -ETIMEDOUT;
    return err;
  }
};

// Synchronous IO of `len` bytes at `buf` (inside `mem`) against volume offset `off`.
inline int sync_io(ClientSession& s, IoDir dir, const RegisteredMemory& mem, std::byte* buf,
                   uint32_t len, uint64_t off) {
  VolHdr h{off, len, kVolMagic};
  IoSeg seg{buf, len, &mem};
  Waiter w;
  IoRequest r;
  r.dir = dir;
  r.usr = std::span(reinterpret_cast<const std::byte*>(&h), sizeof(h));
  r.data = std::span(&seg, 1);
  r.done = &Waiter::cb;
  r.ctx = &w;
  auto st = s.request(r);
  if (!st.ok()) return -st.error().value();
  return w.wait();
}

// The fabric a scenario binary runs on, from --fabric=loopback|tcp|rdma among its arguments
// (loopback without one); nullopt for an unknown name.
inline std::optional<FabricKind> fabric_arg(int argc, char** argv) {
  FabricKind k = FabricKind::loopback;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--fabric=", 0) != 0) continue;
    auto p = parse_fabric_kind(a.substr(9));
    if (!p.ok()) return std::nullopt;
    k = *p;
  }
  return k;
}

// The same, loopback for an unknown name too (scenario binaries that take only tcp/loopback).
inline FabricKind fabric_from_args(int argc, char** argv) {
  return fabric_arg(argc, argv).value_or(FabricKind::loopback);
}

// The fabric of a hostile-peer test binary (session_hostile: hostile_test.cc and
// hostile_server_test.cc): loopback unless its main saw --fabric=tcp.
inline FabricKind& hostile_fabric() {
  static FabricKind kind = FabricKind::loopback;
  return kind;
}

inline bool wait_until(const std::function<bool()>& pred,
                       std::chrono::milliseconds t = std::chrono::seconds(20)) {
  auto end = std::chrono::steady_clock::now() + t;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return pred();
}

}  // namespace ibtrs::test
