// nbd_volume (the agent's Volume over a client daemon's NBD export) against the project's NBD
// server with a RAM export on a unix socket: a whole image round trip, replies out of order,
// a read-only export, an unknown export name, and a server that goes away with requests in
// flight. Every wait is bounded.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>

#include "ibnbd/migrate_image.h"
#include "ibnbd/migrate_volume.h"
#include "ibnbd/nbd_server.h"
#include "ram_export.h"

namespace ibnbd::migrate {
namespace {

using Bytes = std::vector<std::byte>;
constexpr uint64_t kMiB = 1 << 20;

// Completions of volume requests, counted; wait() is bounded.
struct Waiter {
  std::mutex mu;
  std::condition_variable cv;
  int done = 0;
  std::vector<int> errors;
  static void fn(void* ctx, int e) {
    auto* w = static_cast<Waiter*>(ctx);
    std::lock_guard lk(w->mu);
    ++w->done;
    w->errors.push_back(e);
    w->cv.notify_all();
  }
  bool wait(int n) {
    std::unique_lock lk(mu);
    return cv.wait_for(lk, std::chrono::seconds(10), [&] { return done >= n; });
  }
};

class NbdVolumeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ibnbd-nbdvol.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    sock_ = dir_ + "/e.sock";
    ram_ = std::make_shared<nbd::test::RamExport>(64 * kMiB, true);
  }
  void TearDown() override {
    server_.reset();
    std::filesystem::remove_all(dir_);
  }
  void start() {
    nbd::NbdServerOptions o;
    o.exports.emplace_back("images.img", ram_);
    o.listen.push_back(nbd::ListenSpec::unix_socket(sock_));
    auto s = nbd::NbdServer::start(std::move(o));
    ASSERT_TRUE(s) << s.error().message();
    server_ = std::move(*s);
  }
  static Bytes random_bytes(size_t n, uint32_t seed) {
    std::mt19937 g(seed);
    Bytes b(n);
    for (auto& x : b) x = std::byte(g());
    return b;
  }

  std::string dir_, sock_;
  std::shared_ptr<nbd::test::RamExport> ram_;
  std::unique_ptr<nbd::NbdServer> server_;
};

// Case: save an image (random, a zero chunk, a short tail) through the export, read it back,
// verify. Expect: the same bytes; the export's RAM holds the directory magic at offset 0.
TEST_F(NbdVolumeTest, ImageRoundTrip) {
  start();
  auto v = nbd_volume(sock_, "images.img");
  ASSERT_TRUE(v) << v.error().message();
  EXPECT_EQ((*v)->size(), 64 * kMiB);
  auto st = ImageStore::open(**v);
  ASSERT_TRUE(st);
  Bytes data = random_bytes(5 * kMiB + 123, 7);
  std::memset(data.data() + 2 * kMiB, 0, kMiB);
  {
    CreateOptions o;
    o.name = "n1";
    auto w = (*st)->create(o);
    ASSERT_TRUE(w) << (*st)->last_error();
    size_t at = 0;
    while (at < data.size()) {
      auto span = (*w)->buffer(0);
      ASSERT_TRUE(span);
      const size_t n = std::min(span->size(), std::min<size_t>(data.size() - at, 300000));
      std::memcpy(span->data(), data.data() + at, n);
      ASSERT_TRUE((*w)->produced(0, n));
      at += n;
    }
    ASSERT_TRUE((*w)->commit()) << (*w)->last_error();
  }
  auto r = (*st)->open_image("n1");
  ASSERT_TRUE(r) << (*st)->last_error();
  EXPECT_EQ((*r)->info().zero_chunks, 1u);
  ASSERT_TRUE((*r)->verify()) << (*r)->last_error();
  auto sr = (*r)->stream(0);
  ASSERT_TRUE(sr);
  Bytes back;
  for (;;) {
    auto p = (*sr)->next();
    ASSERT_TRUE(p) << (*sr)->last_error();
    if (p->empty()) break;
    back.insert(back.end(), p->begin(), p->end());
  }
  EXPECT_EQ(back, data);
  auto ram = ram_->snapshot();
  EXPECT_EQ(std::memcmp(ram.data(), "IBNBDDIR", 8), 0);
}

// Case: eight reads in flight whose completions the export releases newest first. Expect: each
// buffer gets its own region (replies matched by handle, not by order).
TEST_F(NbdVolumeTest, OutOfOrderRepliesLandInTheirBuffers) {
  start();
  Bytes pattern = random_bytes(8 * 65536, 3);
  {
    auto v = nbd_volume(sock_, "images.img");
    ASSERT_TRUE(v);
    auto b = (*v)->alloc(pattern.size());
    ASSERT_TRUE(b);
    std::memcpy((*b)->data(), pattern.data(), pattern.size());
    Waiter w;
    ASSERT_TRUE((*v)->write(**b, 0, 4 * kMiB, pattern.size(), true, {&Waiter::fn, &w}));
    ASSERT_TRUE(w.wait(1));
    EXPECT_EQ(w.errors[0], 0);
  }
  auto v = nbd_volume(sock_, "images.img");
  ASSERT_TRUE(v);
  auto b = (*v)->alloc(pattern.size());
  ASSERT_TRUE(b);
  std::memset((*b)->data(), 0, pattern.size());
  Waiter w;
  ram_->hold();
  for (size_t i = 0; i < 8; ++i)
    ASSERT_TRUE((*v)->read(**b, i * 65536, 4 * kMiB + i * 65536, 65536, {&Waiter::fn, &w}));
  for (int i = 0; i < 100 && ram_->queued() < 8; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(ram_->queued(), 8u);
  ram_->release(true);
  ASSERT_TRUE(w.wait(8));
  for (int e : w.errors) EXPECT_EQ(e, 0);
  EXPECT_EQ(std::memcmp((*b)->data(), pattern.data(), pattern.size()), 0);
}

// Case: a read-only export (a daemon mapping in ro mode). Expect: list works, a save is EPERM.
TEST_F(NbdVolumeTest, ReadOnlyExportRefusesWrites) {
  auto info = ram_->info();
  info.read_only = true;
  ram_->set_info(info);
  start();
  auto v = nbd_volume(sock_, "images.img");
  ASSERT_TRUE(v);
  auto st = ImageStore::open(**v);
  ASSERT_TRUE(st);
  auto l = (*st)->list();
  ASSERT_TRUE(l);
  EXPECT_TRUE(l->empty());
  CreateOptions o;
  o.name = "x";
  auto w = (*st)->create(o);
  ASSERT_FALSE(w);
  EXPECT_EQ(w.error().value(), EPERM);
}

// Case: an export name the server does not have, and a socket nobody listens on.
// Expect: ENOENT for both (no hang).
TEST_F(NbdVolumeTest, UnknownExportAndNoServer) {
  auto none = nbd_volume(sock_, "images.img");
  ASSERT_FALSE(none);
  EXPECT_EQ(none.error().value(), ENOENT);
  start();
  auto v = nbd_volume(sock_, "other.img");
  ASSERT_FALSE(v);
  EXPECT_EQ(v.error().value(), ENOENT);
}

// Case: the server goes away while reads wait in the export. Expect: every read completes (the
// server may still answer them, or the connection's end fails them), and once the connection is
// gone a submit fails at once: nothing waits forever.
TEST_F(NbdVolumeTest, ServerGoneNothingWaitsForever) {
  start();
  auto v = nbd_volume(sock_, "images.img");
  ASSERT_TRUE(v);
  auto b = (*v)->alloc(4 * 4096);
  ASSERT_TRUE(b);
  Waiter w;
  ram_->hold();
  for (size_t i = 0; i < 4; ++i) ASSERT_TRUE((*v)->read(**b, i * 4096, i * 4096, 4096, {&Waiter::fn, &w}));
  for (int i = 0; i < 100 && ram_->queued() < 4; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::thread release([this] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    ram_->release(false);  // the server's teardown may wait for its requests
  });
  server_.reset();
  release.join();
  ASSERT_TRUE(w.wait(4));
  Waiter w2;
  int submitted = 0;
  for (int i = 0; i < 100; ++i) {
    auto r = (*v)->read(**b, 0, 0, 4096, {&Waiter::fn, &w2});
    if (!r) return;  // ENOTCONN once the reader saw the end; EPIPE if the send saw it first
    ASSERT_TRUE(w2.wait(++submitted));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ADD_FAILURE() << "submits kept succeeding after the server went away";
}

}  // namespace
}  // namespace ibnbd::migrate
