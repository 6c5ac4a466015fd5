// Private state of a failover device (client.h, "Gateway failover"; docs/architecture.md). A
// RemoteDevice over two legs, each a plain RemoteDevice of its own session to one server;
// the kernel's counterparts are dm-multipath's failover policy (a priority group per server)
// and NVMe's ANA groups, with rnbd's remap doing the re-open on each leg.
//
// The life of a request (FoReq): validated against the active leg's geometry, then sent on
// the active leg (Leg::out counts it there) or, while a failover holds the gate, queued in
// `waiting`. Its leg's completion either finishes it, or, for an error that says the leg could
// not carry it (a transport error, or the leg's device closed), puts it on `retry` and wants a
// failover when it came from the active leg. The worker thread switches legs and sends `retry`
// then `waiting`, in order, on the new active leg.
//
// The gate pairs with Leg::out as the library's gate pairs with its counters: a sender counts
// itself on a leg, then checks the gate; the switch closes the gate first. A request counted on
// the old leg when the gate closed is either sent there (and comes back through its
// completion) or gives up its count and queues.
//
// Locks: `mu` guards the lists and the switch's state; nothing calls into a session, a leg or
// a user callback while holding it. `ctl_mu` serializes the control functions with each other
// and with the worker's calls into the sessions.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ibnbd/client.h"
#include "lib/client_impl.h"

namespace ibnbd::client {

struct Failover;

// One block request of the caller, kept until it completes so it can be sent again.
struct FoReq {
  FoReq* next = nullptr;  // free list, or the wait list that holds it
  Failover* f = nullptr;
  IoOp op = IoOp::read;
  uint64_t offset = 0;
  uint64_t len = 0;  // bytes (bounced READ/WRITE, DISCARD, ...); from the segments otherwise
  uint32_t flags = 0;
  uint16_t prio = 0;
  IoDone done;
  std::byte* copy = nullptr;          // read_copy / write_copy: the caller's memory
  std::vector<ibtrs::IoSeg> segs;     // read / write: the caller's segments (capacity kept)
  uint64_t seq = 0;                   // submission order
  uint8_t leg = 0;                    // the leg it was last sent on
  uint32_t sends = 0;                 // how many times it was sent
  uint64_t epoch = 0;                 // FLUSH / PREFLUSH: writes_done when it was submitted
  Clock::time_point since{};          // when it first had to wait here (expiry)
};

// An intrusive FIFO of requests (the caller holds the lock that guards it).
struct FoList {
  FoReq* head = nullptr;
  FoReq* tail = nullptr;
  size_t size = 0;
  bool empty() const { return head == nullptr; }
  void push(FoReq* r) {
    r->next = nullptr;
    if (tail) tail->next = r; else head = r;
    tail = r;
    ++size;
  }
  FoReq* pop() {
    FoReq* r = head;
    head = r->next;
    if (head == nullptr) tail = nullptr;
    r->next = nullptr;
    --size;
    return r;
  }
  FoList take() { return std::exchange(*this, FoList{}); }
};

struct Failover {
  struct Leg {
    BlockSession* s = nullptr;
    std::shared_ptr<RemoteDevice> dev;  // null while missing (its OPEN was refused); set once
    std::atomic<Device*> dp{nullptr};   // dev's Impl, for the IO path (set after dev)
    std::error_code error;              // why it is missing or closed (under mu)
    std::atomic<uint32_t> out{0};       // requests sent on it and not back
    std::atomic<bool> down{false};      // its session has no path (events)
    uint64_t listener = 0;
    Clock::time_point next_map{};       // a missing leg's OPEN is retried at most this often (ctl_mu)
  };

  std::string name;
  AccessMode mode = AccessMode::ro;
  FailoverOptions opts;
  Leg legs[2];

  std::atomic<uint8_t> active{0};
  std::atomic<bool> open{true};     // gate: IO goes to legs[active]
  std::atomic<bool> closed{false};  // unmapped: IO is refused (ENODEV)
  std::atomic<uint64_t> outstanding{0};  // user requests not completed
  std::atomic<uint64_t> next_seq{0};
  std::vector<FoReq*> order;  // the worker's, to put requests back in submission order

  mutable std::mutex mu;
  std::condition_variable cv;
  FoList retry;    // taken back from a leg, oldest first
  FoList waiting;  // submitted while the gate was closed, oldest first
  bool want = false;          // a failover is wanted
  bool manual = false;        // ... by switch_failover: to the other leg only
  int manual_result = 0;      // switch_failover's answer (-1: pending)
  Clock::time_point trigger_at{};
  bool stop = false;
  bool standby_was_ready = true;  // for standby_lost / standby_back events
  std::thread worker;

  std::mutex ctl_mu;  // control functions and the worker's calls into sessions

  FreeList<FoReq> reqs;
  Stats counts;  // user requests, as a device of one session counts them
  std::atomic<uint64_t> failovers{0}, resent{0}, lost_flushes{0};
  std::atomic<int64_t> last_pause_ms{0};
  // Volatile cache accounting (client.h, "Flush"): non-FUA writes completed OK on the active
  // leg, how many of them a completed flush covers, and whether a failover may have lost some
  // (the next flush then fails with EIO).
  std::atomic<uint64_t> writes_done{0};
  std::atomic<uint64_t> durable{0};
  std::atomic<bool> cache_lost{false};

  ~Failover();
  static std::shared_ptr<RemoteDevice> wrap(std::unique_ptr<Failover> f) {
    return std::shared_ptr<RemoteDevice>(new RemoteDevice(std::move(f)));
  }

  // ---- IO path ----
  Status submit(IoOp op, uint64_t offset, uint64_t len, std::span<const ibtrs::IoSeg> segs,
                std::byte* copy, uint32_t flags, IoDone done, uint16_t prio);
  // Sends `r` on leg `a` (counted there by the caller).
  Status send(FoReq* r, uint8_t a);
  static void on_leg_done(void* ctx, int err);
  // Puts `r` on `retry` (wanting a failover when it came from the active leg). False once
  // unmapped: the caller completes it.
  bool requeue(FoReq* r, bool from_active);
  void finish(FoReq* r, int err);
  // Sends `r` on the active leg from the worker, or queues it again.
  void resend(FoReq* r);
  // Worker: sends what `a` and `b` hold, in submission order.
  void resend_all(FoList a, FoList b);

  // ---- worker ----
  void run();
  void fail_over();
  void switch_to(uint8_t to, uint8_t from, Clock::time_point t0, bool by_admin);
  bool usable(uint8_t i);
  Status take_over(uint8_t i);
  void expire(Clock::time_point now);
  void watch_standby();
  void on_session_event(uint8_t leg, const ibtrs::SessionEventInfo& e);
  void emit(const FailoverEvent& e);

  // ---- control ----
  Status unmap(UnmapMode how);
  Status remap();
  Status switch_now();
  FailoverInfo info() const;
  void detach();  // listeners off, worker stopped (unmap and the destructor)
};

// Errors that say a leg could not carry a request (not the server's verdict on it).
inline bool leg_error(int e) {
  return e == ENOTCONN || e == ECONNABORTED || e == ECONNRESET || e == ETIMEDOUT || e == ESHUTDOWN;
}

}  // namespace ibnbd::client
