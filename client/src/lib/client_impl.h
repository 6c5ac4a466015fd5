// Private state of the IBNBD client library (kernel: rnbd-clt.h). The public contract is
// client/include/ibnbd/client.h; this file says how the pieces hold it up.
//
// The life of a block request:
//   RemoteDevice::read/write/... validates, takes a UserReq (kernel: the blk-mq request) and
//   cuts it into Parts (kernel: rnbd_iu), one per transport request. A part goes through at most
//   three waits, each a FIFO of parts linked through Part::next:
//     1. a bounce slot of its device (read_copy / write_copy only)   Device::bounce_wait
//     2. its device being re-opened                                   Device::held
//     3. the session: a free permit, or the session being remapped    Session::queue
//   and is then sent with the device's current id. Its completion re-sends it once on ENODEV
//   (after a remap), or finishes it; the last part to finish completes the UserReq.
//
// Counters that make remap safe (see Session::remap_all):
//   Session::inflight   requests on the transport that carry a device id (IO parts, CLOSE);
//                       a remap re-OPENs nothing until it is 0, so an old id can never reach
//                       a device that got it anew.
//   Device::inflight_parts  the same per device, for remap() and a forced unmap.
// Senders increment the counter, then check the gate (Session::open, Device::remapping); the
// remapper closes the gate, then waits for the counter: both sequentially consistent, so one
// of the two sees the other.
//
// Locks, never two at once except where noted: Session::ctl_mu (control functions and the
// remap, held across the others), Session::st_mu (link state, worker), Session::q_mu, Device::mu,
// Device::bounce_mu, Session::ctl_slot_mu, Session::dev_mu.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ibnbd/client.h"
#include "lib/split.h"
#include "proto/ibnbd_proto.h"

namespace ibnbd {

namespace client {

using Clock = std::chrono::steady_clock;
using Session = BlockSession::Impl;
using Device = RemoteDevice::Impl;
struct UserReq;

// One transport request of a block request.
struct Part {
  Part* next = nullptr;  // link in whichever wait list (or free list) holds the part
  UserReq* req = nullptr;
  proto::Io io;           // device_id is filled in at every send
  uint8_t nseg = 0;
  bool retried = false;   // re-sent once after ENODEV already
  int32_t slot = -1;      // bounce slot held, or -1
  std::byte* user = nullptr;  // bounce: the caller's memory of this part
  uint32_t dev_gen = 0;       // Device::gen when last sent
  Clock::time_point queued_at{};  // when it started waiting (expiry)
  ibtrs::IoSeg segs[kMaxPartSegs];
  std::byte usr[sizeof(proto::IoMsg)];
};

// One block request of the caller.
struct UserReq {
  UserReq* next = nullptr;  // free list
  Device* dev = nullptr;
  IoDone done;
  ibtrs::IoDir dir = ibtrs::IoDir::read;
  bool bounce = false;
  std::atomic<uint32_t> left{0};  // parts not finished
  std::atomic<int> err{0};        // the first part's error
};

// Objects recycled through a free list; grows when empty (the hot path allocates only while
// the load exceeds everything seen before).
template <typename T>
class FreeList {
 public:
  void grow(size_t n) {
    auto block = std::make_unique<T[]>(n);
    for (size_t i = 0; i < n; ++i) {
      block[i].next = head_;
      head_ = &block[i];
    }
    blocks_.push_back(std::move(block));
  }
  T* get() {
    std::lock_guard l(mu_);
    if (head_ == nullptr) grow(64);
    T* t = head_;
    head_ = t->next;
    t->next = nullptr;
    return t;
  }
  void put(T* t) {
    std::lock_guard l(mu_);
    t->next = head_;
    head_ = t;
  }

 private:
  std::mutex mu_;
  T* head_ = nullptr;
  std::vector<std::unique_ptr<T[]>> blocks_;
};

// An intrusive FIFO of parts (the caller holds the lock that guards it).
struct PartList {
  Part* head = nullptr;
  Part* tail = nullptr;
  size_t size = 0;
  bool empty() const { return head == nullptr; }
  void push(Part* p) {
    p->next = nullptr;
    if (tail) tail->next = p; else head = p;
    tail = p;
    ++size;
  }
  void push_front(Part* p) {
    p->next = head;
    head = p;
    if (tail == nullptr) tail = p;
    ++size;
  }
  Part* pop() {
    Part* p = head;
    head = p->next;
    if (head == nullptr) tail = nullptr;
    p->next = nullptr;
    --size;
    return p;
  }
  PartList take() { return std::exchange(*this, PartList{}); }
  // Moves the parts for which pred(p) holds into the returned list, keeping the order of both.
  template <typename Pred>
  PartList extract(Pred pred) {
    PartList keep, out;
    while (!empty()) {
      Part* p = pop();
      (pred(p) ? out : keep).push(p);
    }
    *this = keep;
    return out;
  }
};

// While a thread submits (or runs a control function), completions it causes are handed to the
// session's worker instead of running on it: a caller's callback never runs inside its own call.
// (inline, not extern: g++ 12's UBSan misreads the TLS wrapper of an extern thread_local.)
inline thread_local int tl_defer_completions = 0;
struct DeferCompletions {
  DeferCompletions() { ++tl_defer_completions; }
  ~DeferCompletions() { --tl_defer_completions; }
  DeferCompletions(const DeferCompletions&) = delete;
  DeferCompletions& operator=(const DeferCompletions&) = delete;
};

// try_send outcomes besides 0 (sent) and a positive errno.
inline constexpr int kWaitSession = -1;  // no permit, or the session is not open: Session::queue
inline constexpr int kWaitDevice = -2;   // the device is being re-opened: Device::held
inline constexpr int kAnsweredHere = -3;  // a BLOCK_STATUS the session's version cannot carry,
                                          // answered "all data" by the library: done, 0

// Fault injection for tests (tests/client/client_test.cc): when set, Session::pump calls it
// after a part it took off the queue found no permit, before the part goes back: a test
// stalls the pumping thread there, as a preempted thread on a loaded host is stalled, so that
// a completion lands in that window. Read only on that path (no permit: the part waits anyway).
inline std::atomic<void (*)()> g_pump_found_no_permit{nullptr};

struct Stats {
  std::atomic<uint64_t> reads{0}, writes{0}, flushes{0}, discards{0}, write_zeroes{0}, block_status{0};
  std::atomic<uint64_t> read_bytes{0}, write_bytes{0}, parts_sent{0}, errors{0};
  std::atomic<uint64_t> enodev_retries{0}, remaps{0}, resizes{0};

  // One user request of `op` over `len` bytes (IO path: relaxed increments only).
  void count(IoOp op, uint64_t len) {
    switch (op) {
      case IoOp::read:
        reads.fetch_add(1, std::memory_order_relaxed);
        read_bytes.fetch_add(len, std::memory_order_relaxed);
        break;
      case IoOp::write:
        writes.fetch_add(1, std::memory_order_relaxed);
        write_bytes.fetch_add(len, std::memory_order_relaxed);
        break;
      case IoOp::flush: flushes.fetch_add(1, std::memory_order_relaxed); break;
      case IoOp::discard:
      case IoOp::secure_erase: discards.fetch_add(1, std::memory_order_relaxed); break;
      case IoOp::write_zeroes: write_zeroes.fetch_add(1, std::memory_order_relaxed); break;
      case IoOp::block_status: block_status.fetch_add(1, std::memory_order_relaxed); break;
    }
  }
};

}  // namespace client

struct RemoteDevice::Impl {
  client::Session* s = nullptr;  // null once the session is gone
  std::string name;
  AccessMode mode = AccessMode::ro;

  // Current incarnation on the server. `id` is stored before `gen` is bumped, so a sender that
  // reads the new gen (acquire) sends the new id.
  std::atomic<uint32_t> id{0};
  std::atomic<uint32_t> gen{0};
  std::atomic<DeviceState> state{DeviceState::open};
  std::atomic<bool> remapping{false};  // gate: parts wait in `held`
  std::atomic<int> closed_err{ENODEV};  // what parts still waiting get when the device closes
  // A leg of a failover device (failover.cc): its owner unmaps it, BlockSession::unmap refuses.
  std::atomic<bool> leg{false};
  // The standby leg: its re-opens after a reconnect, and remap(), send no REOPEN, which would
  // make the server take the device over from the active gateway (fence it).
  std::atomic<bool> standby{false};
  uint64_t open_link_gen = 0;  // Session::link_gen of the last OPEN (under Session::ctl_mu)
  // The server's size epoch of `size` (OPEN_RSP's, or the last WATCH_RSP applied; under
  // Session::ctl_mu): a WATCH_RSP applies only when its epoch is higher, so an answer taken
  // before this OPEN (a device id that named another device then) changes nothing.
  uint64_t size_epoch = 0;

  // Limits for validation and splitting, relaxed: the server checks every part again.
  std::atomic<uint64_t> size{0};
  std::atomic<uint32_t> lbs{512};
  std::atomic<uint32_t> max_rw{0};       // bytes per READ/WRITE part
  std::atomic<uint32_t> max_discard{0};  // bytes per DISCARD/SECURE_ERASE part, 0: none
  std::atomic<uint32_t> max_wz{0};       // bytes per WRITE_ZEROES part, 0: none
  std::atomic<bool> secure{false};

  std::atomic<uint32_t> inflight_reqs{0};   // user requests outstanding
  std::atomic<uint32_t> inflight_parts{0};  // parts on the transport

  mutable std::mutex mu;  // geo, held
  DeviceGeometry geo;
  client::PartList held;

  // Bounce buffers: slot i is bytes [i * slot_size, (i + 1) * slot_size) of `bounce`.
  std::unique_ptr<ibtrs::RegisteredMemory> bounce;
  uint32_t slot_size = 0;
  std::mutex bounce_mu;
  std::vector<int32_t> free_slots;  // capacity fixed at map: no allocation when returned
  client::PartList bounce_wait;

  client::Stats st;

  // Validation, splitting, submission (device.cc).
  Status submit(IoOp op, uint64_t offset, uint64_t len, std::span<const ibtrs::IoSeg> segs,
                std::byte* copy_buf, uint32_t flags, IoDone done, uint16_t prio);
  // The checks of submit() that depend on the request and the geometry only (what a failover
  // device checks before it queues a request): how it is cut, or the errno. `len` is set from
  // the segments for zero-copy READ/WRITE.
  struct Cut {
    uint64_t nparts;
    uint32_t max_part;  // bytes per part (0 for FLUSH)
  };
  Result<Cut> check(IoOp op, uint64_t offset, uint64_t& len, std::span<const ibtrs::IoSeg> segs,
                    bool bounced, uint32_t flags) const;
  void apply(const proto::OpenRsp& rsp, uint32_t max_io_size);
  // A size from the server's notice (bytes, a multiple of the logical block size): the limit
  // requests are checked against from now on.
  void set_size(uint64_t bytes);
  bool take_slot(client::Part* p);
  client::Part* release_slot(client::Part* p);
  std::byte* slot_addr(int32_t slot) const { return bounce->data() + size_t(slot) * slot_size; }
  // Moves the parts of this device out of its wait lists (not the session's queue).
  client::PartList take_waiting();
};

namespace client {
// How a device is mapped: on its own, or as the active or standby leg of a failover device.
enum class MapAs : uint8_t { plain, active_leg, standby_leg };
}  // namespace client

struct BlockSession::Impl {
  using Clock = client::Clock;
  using Device = RemoteDevice::Impl;

  BlockSessionOptions opts;
  std::unique_ptr<ibtrs::ClientSession> ts;
  std::atomic<uint8_t> version{0};  // rewritten by every remap
  std::atomic<bool> closing{false};

  // ---- link state (events from the transport, the worker) -----------------------------------
  std::atomic<bool> open{true};  // gate: IO may go out (connected and remapped)
  std::mutex st_mu;
  std::condition_variable st_cv;
  bool link_up = true;
  uint64_t link_gen = 0;  // bumped by disconnected and reconnected
  Clock::time_point down_since{};
  Clock::time_point remap_due{};
  bool stop = false;
  std::vector<client::UserReq*> deferred;  // completions for the worker to run
  std::thread worker;
  uint64_t worker_gen = 0;  // link_gen the worker's remap is for (worker thread only)

  std::atomic<int64_t> inflight{0};      // see the top of this file
  std::atomic<uint64_t> outstanding{0};  // user requests not completed (destructor waits)

  // Listeners of the library's own (failover devices): called on the transport's control
  // thread after the block layer noted the event, before opts.transport.on_event, under ev_mu
  // (remove_listener waits for a running call). They must not block or call into the session.
  std::mutex ev_mu;
  uint64_t next_listener = 1;
  std::vector<std::pair<uint64_t, std::function<void(const ibtrs::SessionEventInfo&)>>> listeners;
  uint64_t add_listener(std::function<void(const ibtrs::SessionEventInfo&)> fn);
  void remove_listener(uint64_t id);

  // ---- the session queue ----------------------------------------------------------------------
  std::mutex q_mu;
  client::PartList queue;
  std::atomic<size_t> q_len{0};

  client::FreeList<client::Part> parts;
  client::FreeList<client::UserReq> reqs;

  // ---- control ----------------------------------------------------------------------------------
  std::mutex ctl_mu;
  // Control messages land in slots of one registered buffer. A slot stays busy until the
  // transport completes its request, even if the waiter gave up: the server may still write.
  static constexpr size_t kCtlSlots = 32;
  static constexpr size_t kCtlSlotSize = 64;
  static_assert(kCtlSlotSize >= sizeof(proto::OpenRspMsg) &&
                kCtlSlotSize >= sizeof(proto::SessInfoRspMsg));
  struct CtlSlot {
    Impl* s = nullptr;
    bool busy = false;
    bool done = false;
    bool abandoned = false;
    bool counted = false;  // counts in `inflight` (CLOSE carries a device id)
    int err = 0;
  };
  std::unique_ptr<ibtrs::RegisteredMemory> ctl_mem;
  std::mutex ctl_slot_mu;
  std::condition_variable ctl_cv;
  CtlSlot ctl_slots[kCtlSlots];

  // ---- size notices (protocol 4: WATCH; session.cc) ---------------------------------------------
  // One WATCH outstanding while the session speaks 4 and is open. Posted by open() and then by
  // the worker, which also takes the answers (under ctl_mu, so they are serialized with map,
  // unmap and remap: an answer never meets a device half re-opened).
  static constexpr uint32_t kWatchMinEntries = 256;  // the server's default devices per session
  std::unique_ptr<ibtrs::RegisteredMemory> watch_mem;  // the answer lands here (worker; replaced
                                                       // only while no WATCH is out)
  uint32_t watch_entries = kWatchMinEntries;          // entries watch_mem holds
  // Under st_mu: the transport has it; its answer waits for the worker.
  bool watch_posted = false;
  bool watch_answered = false;
  int watch_err = 0;
  bool watch_wake = false;  // an answer came since the worker's last watch_step
  // Worker (and open() before the worker starts).
  uint64_t watch_sent = 0;                  // the epoch the outstanding WATCH carries
  Clock::time_point watch_due{};            // not posted before
  std::chrono::milliseconds watch_backoff{0};
  int watch_logged_err = 0;                 // the last error logged (each new one is, once)
  bool watch_partial_logged = false;
  // For size_watch().
  std::atomic<uint64_t> watch_epoch{0};     // the last epoch seen (sent with the next WATCH)
  std::atomic<uint64_t> watch_answers{0}, watch_resizes{0};
  std::atomic<int> watch_last_err{0};

  // ---- devices ----------------------------------------------------------------------------------
  mutable std::mutex dev_mu;
  std::map<std::string, std::shared_ptr<RemoteDevice>, std::less<>> devices;
  // Unmapped (forced) devices whose requests are still out: kept alive for their completions.
  std::vector<std::shared_ptr<RemoteDevice>> retired;
  // Every device ever mapped, to detach the survivors when the session goes.
  std::vector<std::weak_ptr<RemoteDevice>> all_devices;

  ~Impl();

  // ---- IO path (io.cc) --------------------------------------------------------------------------
  static void on_part_done(void* ctx, int err);
  void advance(client::Part* p);
  void send_or_queue(client::Part* p);
  int try_send(client::Part* p);
  bool hold(client::Part* p);
  void pump();
  void left_transport(Device* d);
  void finish_part(client::Part* p, int err);
  void complete_req(client::UserReq* r);
  void run_completion(client::UserReq* r);
  void release_held(Device* d);
  void close_device(Device* d, int err);
  void fail_list(client::PartList l, int err);
  // Fails with `err` every part of `d` that waits in the library (its held and bounce lists,
  // the session queue) or in the transport for a path (their connections are gone): none of
  // them is on a wire, so the failover device may send their requests to its other server.
  // Parts on a live connection are left to complete. The device stays as it is. From a thread
  // that may call control functions; the completions run on it (or the transport's).
  void abandon(Device* d, int err);

  // ---- control and remap (session.cc) -----------------------------------------------------------
  void on_transport_event(const ibtrs::SessionEventInfo& e);
  void worker_main();
  bool remap_all(uint64_t gen);
  bool wait_drain(uint64_t gen, Clock::time_point deadline);
  bool wait_device_drain(Device* d, Clock::time_point deadline);
  Clock::time_point expire(Clock::time_point now);
  void run_deferred();
  bool link_changed(uint64_t gen);
  static void on_ctl_done(void* ctx, int err);
  // Size notices: posts the WATCH (EAGAIN without a free permit; the transport's errors); the
  // worker's step (answers, re-posts; returns when it wants to run again); the answer.
  Status post_watch();
  static void on_watch_done(void* ctx, int err);
  Clock::time_point watch_step(Clock::time_point now);
  void on_watch_answer(int err, Clock::time_point now);
  Status control(ibtrs::IoDir dir, std::span<const std::byte> usr, std::span<std::byte> rsp,
                 bool carries_id);
  Result<uint8_t> sess_info();
  // `reopen`: the device was mapped before (remaps): sent as kOpenReopen when the session
  // speaks a version that has OPEN flags.
  Result<proto::OpenRsp> open_device(const std::string& name, AccessMode mode, bool reopen = false);
  Status close_id(uint32_t id);
  Status remap_device(Device* d);
  // BlockSession::map, and the legs of failover devices (`as`: marked before the next remap
  // can see them). A leg's name mapped again is EEXIST, as is any mapped name for a leg.
  Result<std::shared_ptr<RemoteDevice>> map_device(std::string_view dev_name, AccessMode mode,
                                                   client::MapAs as);
  std::shared_ptr<RemoteDevice> find_locked(std::string_view dev_name) const;
  // The mapped device other than `except` that holds server id `id` from the OPEN of link
  // generation `gen`, if any. The server answers an OPEN of another name for a device this
  // session holds with that device's id (one store, one id): such a name must not become a
  // second mapping, whose CLOSE would close the first. Under ctl_mu.
  std::shared_ptr<RemoteDevice> holder_of(uint32_t id, uint64_t gen, const Device* except) const;
  void emit(const DeviceEvent& e);
  std::vector<Device*> device_list();
  void reap_retired();
};

namespace client {

// Errors that say "the transport could not carry it", not "the server said no": a remap that
// meets one is tried again when the link allows.
inline bool transport_error(int e) {
  return e == ENOTCONN || e == ECONNABORTED || e == ETIMEDOUT || e == ESHUTDOWN ||
         e == ECONNRESET || e == EAGAIN || e == ENOBUFS;
}

}  // namespace client

}  // namespace ibnbd
