// Rig of the integration scenarios (issue 4): the real BlockServer exporting a real file, the
// real client library (BlockSession, RemoteDevice) over two paths to it, and an in-memory model
// of the device that every read is checked against. One process, over the fabric picked with
// --fabric=loopback|tcp; fault injection needs loopback.
//
// Pieces:
//   ExportFile  the file the server exports, in /var/tmp (O_DIRECT) or /dev/shm (tmpfs:
//               buffered), created with the `old` pattern; pread for checks behind the server
//   Endpoints   listen addresses that stay the same across a server restart (tcp: ports held
//               by bound, non-listening sockets so nobody else takes them meanwhile)
//   Model       what the device must hold: bytes, and which blocks are still known
//   Load        seeded random mixes of every op with up to `depth` requests in flight on
//               non-overlapping ranges, verified against the Model as they complete
//   Rig         a gtest fixture: server, session, device, and their teardown in order
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "ibnbd/client.h"
#include "ibnbd/server.h"
#include "base/unique_fd.h"

namespace ibnbd::itest {

using namespace std::chrono_literals;

// Set by main() from the command line.
extern ibtrs::FabricKind g_kind;
extern uint64_t g_seed;  // 0: each test's own default

inline constexpr uint32_t kChunk = 64 * 1024;  // server chunk
// The largest transport request: a chunk set of three chunks less the header (protocol 2.2),
// small enough that the loads' larger requests are still split, and each spans 1..3 chunks.
inline constexpr uint32_t kMaxIo = 3 * kChunk - 4096;
inline constexpr uint16_t kQueueDepth = 64;    // transport permits per session
inline constexpr uint64_t kDevSize = 16 << 20; // the exported file

// The seed of a test: --seed=N, else `fallback`; printed so that a failure can be replayed.
uint64_t test_seed(uint64_t fallback);

// Bytes a test can predict (base/pattern.h): the 8-byte word at device offset o of `version` v
// is a hash of (o, v). Version 0 is what the file holds before the test; every write uses a version of its
// own, so a block written to the wrong place or by the wrong request is caught. `dev_off` and
// `len` are multiples of 8.
void fill_pattern(std::byte* p, size_t len, uint64_t dev_off, uint64_t version);
// Offset of the first byte where `got` differs from `want`, or -1.
int64_t first_diff(const std::byte* got, const std::byte* want, size_t len);

// ---------------------------------------------------------------------------------------------

// Where the exported file lives. /var/tmp: a disk filesystem where the server opens the file
// O_DIRECT; /dev/shm: tmpfs, which has no O_DIRECT, so the server goes through the page cache.
enum class Store : uint8_t { direct, buffered };
std::string to_string(Store s);

class ExportFile {
 public:
  // A directory under the store's root holding `name`, `size` bytes of pattern version 0.
  // ok() is false (and why() says why) when the store is not usable here.
  ExportFile(Store store, const std::string& name, uint64_t size);
  ~ExportFile();
  ExportFile(const ExportFile&) = delete;
  ExportFile& operator=(const ExportFile&) = delete;

  bool ok() const { return !root_.empty(); }
  const std::string& why() const { return why_; }
  const std::string& root() const { return root_; }
  const std::string& name() const { return name_; }
  std::string path() const { return root_ + "/" + name_; }
  // The file's bytes as they are now (a separate descriptor, through the page cache).
  std::vector<std::byte> pread(uint64_t off, size_t len) const;

 private:
  std::string root_;
  std::string name_;
  std::string why_;
};

class Endpoints {
 public:
  // `n` listen addresses for this fabric; `tag` keeps loopback names apart between tests.
  Endpoints(const std::string& tag, size_t n);
  const std::vector<ibtrs::Address>& addrs() const { return addrs_; }

 private:
  std::vector<ibtrs::Address> addrs_;
  std::vector<base::UniqueFd> holds_;  // tcp: one bound socket per port, SO_REUSEADDR, not listening
};

// ---------------------------------------------------------------------------------------------

// What the device must hold. Bytes start as pattern version 0; a block whose content the test
// cannot predict any more (a request failed) is marked unknown and no longer compared.
class Model {
 public:
  Model(uint64_t size, uint32_t block);
  uint64_t size() const { return bytes_.size(); }
  uint32_t block() const { return block_; }
  void write_pattern(uint64_t off, size_t len, uint64_t version);
  void zero(uint64_t off, size_t len);
  void forget(uint64_t off, size_t len);
  // "" when `got` (the device's bytes at `off`) matches every known block, else what differs.
  std::string check(uint64_t off, const std::byte* got, size_t len) const;

 private:
  std::vector<std::byte> bytes_;
  std::vector<bool> known_;  // per block
  uint32_t block_;
};

// One completion, and how many times it came.
struct Done {
  std::mutex mu;
  std::condition_variable cv;
  int calls = 0;
  int err = -1;
  static void cb(void* ctx, int err);
  IoDone io() { return IoDone{&Done::cb, this}; }
  // The callback's errno, or -ETIMEDOUT when it did not come within `t`.
  int wait(std::chrono::milliseconds t = 30s);
};

// Submits with `submit` and waits: the callback's errno, or minus the errno the submit call
// returned. A second callback is a test failure.
int sync_io(const std::function<Status(IoDone)>& submit);

bool wait_until(const std::function<bool()>& pred, std::chrono::milliseconds t = 20s);

// ---------------------------------------------------------------------------------------------

// Seeded random requests of every kind, with up to `depth` of them in flight. Requests in
// flight never overlap (a generated one that would waits until the range is free), so the
// model predicts every read: a read is compared when it completes, a write or a zeroing op
// updates the model when it completes. Everything runs on the thread that calls run(); the
// completion callbacks only queue.
struct LoadOptions {
  uint64_t seed = 1;
  uint32_t ops = 600;    // requests in all
  uint32_t depth = 16;   // in flight at most
  uint64_t region_off = 0;
  uint64_t region_len = 0;  // 0: the whole device from region_off
  bool copy = true;         // read_copy / write_copy in the mix
  bool zeroing = true;      // discard / write_zeroes in the mix
  // A run with no completion for this long fails (a request was lost): the test aborts, since
  // buffers of requests still in flight cannot be freed.
  std::chrono::milliseconds stall = 40s;
  // After each completion, on the driver thread (path faults, server disconnects).
  std::function<void(uint32_t completed)> on_step;
};

enum class OpKind : uint8_t {
  read, read_segs, read_copy, write, write_segs, write_copy, flush, discard, write_zeroes, kCount
};
std::string_view to_string(OpKind k);

struct LoadReport {
  uint32_t by_kind[static_cast<size_t>(OpKind::kCount)] = {};
  uint32_t failed = 0;           // completed with an errno
  uint32_t mismatches = 0;       // reads that did not match the model
  uint32_t split = 0;            // requests larger than max_part_bytes
  uint32_t submitted_down = 0;   // submitted while the session was not connected
  uint32_t fua = 0, preflush = 0, no_unmap = 0;
  std::string summary() const;
};

class Load {
 public:
  Load(BlockSession& s, RemoteDevice& d, Model& m, LoadOptions o);
  ~Load();
  Load(const Load&) = delete;
  Load& operator=(const Load&) = delete;

  // Runs every request to completion and returns what happened. Failures are reported through
  // gtest (ADD_FAILURE) with the seed and the request.
  LoadReport run();

 private:
  struct Slot;
  struct Op;
  Op generate(std::mt19937_64& rng, uint64_t version);
  bool overlaps(const Op& op) const;
  void submit(Slot& s, const Op& op);
  void complete(Slot& s);
  static void on_done(void* ctx, int err);

  BlockSession& s_;
  RemoteDevice& d_;
  Model& m_;
  LoadOptions o_;
  uint32_t block_;
  uint64_t max_len_;
  size_t slot_bytes_;
  std::unique_ptr<ibtrs::RegisteredMemory> mem_;
  std::vector<std::unique_ptr<Slot>> slots_;
  LoadReport rep_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint32_t> completed_;  // slot indexes, under mu_
};

// Reads the whole device through `d` (1 MiB requests, split by the library) and compares it
// with the model; then the same for the file behind the server. "" when both match.
std::string verify_device(RemoteDevice& d, BlockSession& s, const Model& m);
std::string verify_file(const ExportFile& f, const Model& m);

// ---------------------------------------------------------------------------------------------

// Server, session and device of one scenario, torn down in order (device handles and loads
// are the test's locals: gone before TearDown).
class Rig : public ::testing::Test {
 protected:
  void TearDown() override;

  // The exported file (GTEST_SKIP from the caller when !file().ok()).
  ExportFile& make_file(Store store, uint64_t size = kDevSize);
  ExportFile& file() { return *file_; }
  void make_endpoints(const std::string& tag, size_t n = 2) { eps_ = std::make_unique<Endpoints>(tag, n); }
  const std::vector<ibtrs::Address>& addrs() const { return eps_->addrs(); }

  BlockServerOptions server_options() const;
  // Starts a BlockServer on the endpoints exporting the file's directory.
  void start_server();
  BlockServer& server() { return *server_; }
  std::unique_ptr<BlockServer>& server_ptr() { return server_; }

  // Two paths (one per endpoint), round-robin, short heartbeats, reconnects and timeouts.
  BlockSessionOptions session_options(const std::string& name = "integ") const;
  BlockSession* open_session(BlockSessionOptions o);
  BlockSession& session() { return *sess_; }
  std::shared_ptr<RemoteDevice> map_rw();

  // The whole stack of a scenario: the file in `store`, the server on two endpoints, a session
  // (session_options(), changed by `tune` if given) and the device mapped rw. nullptr with skip_
  // saying why when the store is not usable here; nullptr and a test failure when something
  // else failed.
  std::shared_ptr<RemoteDevice> bring_up(const std::string& tag, Store store,
                                         const std::function<void(BlockSessionOptions&)>& tune = {});

  // The server's path names of session `name`.
  std::vector<std::string> server_paths(const std::string& name = "integ");
  // Number of device events of `kind` seen so far.
  size_t device_events(DeviceEvent::Kind kind);

  // Every scenario runs authenticated, as the daemons do by default: one host with this key,
  // granted every device in every mode. Its reconnects and failovers authenticate each path.
  static constexpr const char* kHost = "nqn.2014-08.org.nvmexpress:uuid:1e57a11e-0000-4000-8000-00000000c0de";
  ibtrs::Secret key_ = ibtrs::Secret::generate().value();
  ibtrs::ClientAuth credentials() const {
    ibtrs::ClientAuth a;
    a.host_id = kHost;
    a.key = key_;
    return a;
  }

  std::unique_ptr<ExportFile> file_;
  std::unique_ptr<Endpoints> eps_;
  std::unique_ptr<BlockServer> server_;
  std::unique_ptr<BlockSession> sess_;
  std::mutex ev_mu_;
  std::vector<DeviceEvent> events_;
  std::string skip_;
};

}  // namespace ibnbd::itest
