// UblkDevice: the served ublk device and its queues (the design is at the top of ibnbd/ublk.h).
//
// A queue's life, on its own thread:
//   setup   ring; FETCH_REQ for every tag and a read of the queue's eventfd, one submit; ready.
//   serve   a tag's CQE (res 0) means a request in its descriptor: decode it, hand it to the
//           RemoteDevice with the tag as context (the requests of one wake-up in one submission
//           batch). Its completion comes back one of two ways:
//           - reaped (the usual way, UblkOptions::reap): the thread's ibtrs::CompletionReaper
//             holds the transport connection its requests go to, and the reaper's fd() is
//             polled in the ring (multishot POLL_ADD). Its CQE makes the thread call reap(0),
//             which reads the connection and runs the completions right here: each writes its
//             COMMIT_AND_FETCH_REQ into the SQ at once. One wake-up per completion batch, where
//             the inbox way costs three (the IO thread's, the eventfd write, ours).
//           - through the inbox: a completion on another thread (a transport IO thread that
//             took the connection back after ~10 ms unreaped, a large request spread over the
//             connections, failover, a request that waited for a path, no reaper) writes the
//             result into the tag and pushes it on the queue's Inbox; the first push onto an
//             empty inbox writes the eventfd. Its read's CQE makes the thread take the whole
//             inbox and queue one COMMIT_AND_FETCH_REQ per tag, then reap(0) once: an IO
//             thread's completion means the connection went back to it, and reap borrows it
//             again.
//           The next io_uring_enter submits the commits and waits.
//   end     a tag's CQE with -ENODEV (UBLK_IO_RES_ABORT) means the device is going away: the
//           tag is done. The thread ends when stop is asked (after STOP_DEV) or every tag is
//           done, and in both cases only once no request of it is with the RemoteDevice (the
//           completions point into the queue). The reaper goes first (its connections back to
//           the IO threads), then the ring: leaving it cancels fetches still pending.
#include <fcntl.h>
#include <liburing.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <future>
#include <thread>
#include <vector>

#include "desc.h"
#include "ibnbd/ublk.h"
#include "base/unique_fd.h"
#include "inbox.h"

#ifndef PR_SET_IO_FLUSHER
#define PR_SET_IO_FLUSHER 57  // Linux 5.6; older glibc headers lack it
#endif

namespace ibnbd::ublk {

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kEventfdUserData = ~uint64_t{0};  // user_data of the eventfd read
constexpr uint64_t kReapUserData = ~uint64_t{1};     // user_data of the reaper fd's poll
constexpr uint64_t kCancelUserData = ~uint64_t{2};   // user_data of that poll's removal
constexpr long kPageSize = 4096;

uint64_t page_round(uint64_t v) { return (v + kPageSize - 1) / kPageSize * kPageSize; }

uint32_t round_up_pow2(uint32_t v) {
  uint32_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

}  // namespace

struct Queue;

// The queue whose thread this is (nullptr on any other thread): a completion running here may
// commit its tag itself.
thread_local Queue* tl_queue = nullptr;

// One tag of a queue: its buffer segment and, while its request is with the RemoteDevice, the
// result to commit. Only the queue thread touches it, except `result` and `next`, which the
// completing thread writes before Inbox::push (release) and the queue thread reads after
// take_all (acquire).
struct Tag {
  Tag* next = nullptr;
  Queue* q = nullptr;
  uint16_t tag = 0;
  int32_t result = 0;
  int32_t ok_result = 0;  // what success commits (bytes or 0), set at submit
  ibtrs::IoSeg seg{};     // the tag's buffer (len set per request)
};

struct Queue {
  const UblkOptions* opts = nullptr;
  std::shared_ptr<RemoteDevice> dev;
  uint16_t q_id = 0;
  uint16_t depth = 0;
  uint32_t buf_bytes = 0;
  int cdev_fd = -1;
  const uapi::ublksrv_io_desc* descs = nullptr;  // the kernel's, read-only
  size_t descs_len = 0;
  std::unique_ptr<ibtrs::RegisteredMemory> buf;
  ibtrs::ClientSession* transport = nullptr;  // for make_reaper (outlives the device)
  std::vector<Tag> tags;
  Inbox<Tag, &Tag::next> inbox;
  base::UniqueFd efd;
  std::thread thread;
  // Set once by the thread when its fetches are queued (or it failed). A member, not a local of
  // the starter: the promise must outlive set_value's return on the queue thread.
  std::promise<std::error_code> ready;
  std::atomic<bool> stop{false};

  // Queue thread only.
  io_uring ring{};
  uint64_t efd_value = 0;      // the eventfd read's buffer
  uint32_t remote = 0;         // requests with the RemoteDevice
  uint32_t kernel_tags = 0;    // tags whose FETCH / COMMIT_AND_FETCH the driver holds
  uint32_t pending_sqes = 0;   // prepared, not yet submitted
  // The reaper of this thread's connection (null: none, or dropped after an error) and
  // whether its fd's poll is armed in the ring.
  std::unique_ptr<ibtrs::CompletionReaper> reaper;
  bool reap_polled = false;
  bool need_reap = false;  // call reap(0) once the CQEs of this wake-up are handled

  std::atomic<uint64_t> requests{0}, errors{0}, wakeups{0}, reaps{0}, reaped{0};

  ~Queue() {
    if (descs != nullptr) ::munmap(const_cast<uapi::ublksrv_io_desc*>(descs), descs_len);
  }

  void log(const std::string& m) const {
    if (opts->log) opts->log("ublk queue " + std::to_string(q_id) + ": " + m);
  }

  // Any thread: makes the queue thread look at its inbox and its stop flag.
  void wake() {
    const uint64_t one = 1;
    // Cannot fail short of a closed fd: the counter would need 2^64 - 1 unread wakeups.
    if (::write(efd.get(), &one, sizeof(one)) < 0) return;
  }

  static void on_done(void* ctx, int err) {
    auto* t = static_cast<Tag*>(ctx);
    t->result = err != 0 ? -err : t->ok_result;
    Queue* q = t->q;  // read before the push: after it the tag belongs to the queue thread
    if (q == tl_queue) {
      // Our own thread (inside reap(), or a completion run inside a submission): commit now,
      // the next io_uring_enter sends it.
      q->reaped.fetch_add(1, std::memory_order_relaxed);
      --q->remote;
      q->commit(*t, t->result);
      return;
    }
    if (q->inbox.push(t)) q->wake();
  }

  io_uring_sqe* get_sqe() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    if (sqe == nullptr) {  // cannot happen (SQ >= depth + 1 entries), but never crash on it
      io_uring_submit(&ring);
      pending_sqes = 0;
      sqe = io_uring_get_sqe(&ring);
    }
    if (sqe != nullptr) ++pending_sqes;
    return sqe;
  }

  // FETCH_REQ (first) or COMMIT_AND_FETCH_REQ with `result` for tag t.
  bool queue_cmd(Tag& t, uint32_t cmd_op, int32_t result) {
    io_uring_sqe* sqe = get_sqe();
    if (sqe == nullptr) return false;
    std::memset(static_cast<void*>(sqe), 0, sizeof(*sqe));
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->fd = cdev_fd;
    sqe->cmd_op = cmd_op;
    sqe->user_data = t.tag;
    uapi::ublksrv_io_cmd c{};
    c.q_id = q_id;
    c.tag = t.tag;
    c.result = result;
    c.addr = reinterpret_cast<uintptr_t>(t.seg.addr);
    static_assert(sizeof(c) == 16, "an IO command fits the 16 cmd bytes of a 64-byte SQE");
    std::memcpy(sqe->cmd, &c, sizeof(c));
    ++kernel_tags;
    return true;
  }

  void commit(Tag& t, int32_t result) {
    if (result < 0) errors.fetch_add(1, std::memory_order_relaxed);
    if (!queue_cmd(t, uapi::kUIoCommitAndFetchReq, result)) log("no SQE for a commit (tag lost)");
  }

  // The reaper's fd in the ring: multishot, so it stays armed across completions (re-armed
  // when the kernel ends it, e.g. on a CQ overflow).
  bool arm_reap_poll(int fd) {
    io_uring_sqe* sqe = get_sqe();
    if (sqe == nullptr) return false;
    io_uring_prep_poll_multishot(sqe, fd, POLLIN);
    sqe->user_data = kReapUserData;
    reap_polled = true;
    return true;
  }

  // Makes this thread's reaper (its requests' connection index: the session's choice for this
  // thread) and arms its fd. Without one (EBUSY: another thread of this process reaps that
  // index, such as a queue of another device on the same session) the queue runs on the inbox
  // alone.
  void setup_reaper() {
    auto r = transport->make_reaper();
    if (!r.ok()) {
      log("no completion reaper (" + r.error().message() + "): completions through the IO threads");
      return;
    }
    auto fd = (*r)->fd();
    if (!fd.ok()) {
      log("no completion reaper fd (" + fd.error().message() + "): completions through the IO threads");
      return;
    }
    reaper = std::move(*r);
    // Borrow the connections now, so the fd watches them before the first request.
    (void)reaper->reap(std::chrono::microseconds(0));
    if (!arm_reap_poll(*fd)) drop_reaper("no SQE for its poll");
  }

  // From here on the inbox carries every completion: the reaper's connections go back to
  // their IO threads. Its fd's poll, if armed, is cancelled (its CQE is then ignored).
  void drop_reaper(const std::string& why) {
    if (!reaper) return;
    log("completion reaper dropped (" + why + "): completions through the IO threads");
    if (reap_polled) {
      io_uring_sqe* sqe = get_sqe();
      if (sqe != nullptr) {
        io_uring_prep_poll_remove(sqe, kReapUserData);
        sqe->user_data = kCancelUserData;
      }
      reap_polled = false;
    }
    reaper.reset();
  }

  // Runs what completed on the reaper's connections; their callbacks commit their tags.
  void reap_now() {
    need_reap = false;
    if (!reaper) return;
    reaps.fetch_add(1, std::memory_order_relaxed);
    auto r = reaper->reap(std::chrono::microseconds(0));
    if (!r.ok()) drop_reaper(r.error().message());
  }

  bool arm_eventfd() {
    io_uring_sqe* sqe = get_sqe();
    if (sqe == nullptr) return false;
    io_uring_prep_read(sqe, efd.get(), &efd_value, sizeof(efd_value), 0);
    sqe->user_data = kEventfdUserData;
    return true;
  }

  // A request arrived in tag t's descriptor.
  void start(Tag& t) {
    requests.fetch_add(1, std::memory_order_relaxed);
    uapi::ublksrv_io_desc d;
    std::memcpy(&d, &descs[t.tag], sizeof(d));
    auto r = decode_desc(d, buf_bytes);
    if (!r.ok()) {
      const int e = r.error().value();
      log("refused request op_flags " + std::to_string(d.op_flags) + " sectors " +
          std::to_string(d.nr_sectors) + ": " + r.error().message());
      commit(t, e == EOPNOTSUPP ? -EOPNOTSUPP : -EIO);
      return;
    }
    t.ok_result = success_result(*r);
    t.seg.len = static_cast<uint32_t>(r->op == IoOp::read || r->op == IoOp::write ? r->len : 0);
    const IoDone done{&Queue::on_done, &t};
    // Counted before: the completion may run on this thread before the call returns.
    ++remote;
    Status st;
    switch (r->op) {
      case IoOp::read: st = dev->read(r->offset, std::span(&t.seg, 1), done); break;
      case IoOp::write: st = dev->write(r->offset, std::span(&t.seg, 1), r->flags, done); break;
      case IoOp::flush: st = dev->flush(done); break;
      case IoOp::discard: st = dev->discard(r->offset, r->len, done); break;
      case IoOp::write_zeroes:
        st = dev->write_zeroes(r->offset, r->len, (r->flags & kIoNoUnmap) != 0, done);
        break;
      default: st = errc(EOPNOTSUPP); break;
    }
    if (!st.ok()) {  // the callback does not run
      --remote;
      commit(t, -st.error().value());
    }
  }

  void handle(const io_uring_cqe* cqe) {
    if (cqe->user_data == kEventfdUserData) {
      // The inbox is taken at the top of the loop; re-arm for the next push onto an empty one.
      wakeups.fetch_add(1, std::memory_order_relaxed);
      if (cqe->res < 0 && cqe->res != -EINTR && cqe->res != -EAGAIN)
        log("eventfd read: " + std::string(std::strerror(-cqe->res)));
      if (!arm_eventfd()) log("no SQE for the eventfd");
      return;
    }
    if (cqe->user_data == kReapUserData) {
      if (!reaper) return;  // the poll of a dropped reaper, ending
      if (cqe->res < 0) {
        reap_polled = false;
        drop_reaper("poll: " + std::string(std::strerror(-cqe->res)));
        return;
      }
      need_reap = true;
      if ((cqe->flags & IORING_CQE_F_MORE) == 0) {
        reap_polled = false;
        auto fd = reaper->fd();
        if (!fd.ok() || !arm_reap_poll(*fd)) drop_reaper("poll not re-armed");
      }
      return;
    }
    if (cqe->user_data >= tags.size()) return;  // not ours: ignore
    Tag& t = tags[cqe->user_data];
    --kernel_tags;
    if (cqe->res == uapi::kIoResOk) {
      start(t);
    } else if (cqe->res != uapi::kIoResAbort) {
      // EINVAL & co: the driver refused the command (a bug of ours or a device being torn
      // down in a way we did not expect). The tag is out of service; say so.
      log("tag " + std::to_string(t.tag) + ": command failed: " + std::strerror(-cqe->res));
    }
  }

  // Commits what completed on other threads; how many.
  uint32_t drain_inbox() {
    uint32_t n = 0;
    for (Tag* t = inbox.take_all(); t != nullptr; ++n) {
      Tag* next = t->next;
      --remote;
      commit(*t, t->result);
      t = next;
    }
    return n;
  }

  // Waits for the requests still with the RemoteDevice without the ring (it failed): they
  // point into this queue.
  void wait_remote_without_ring() {
    reap_polled = false;  // the ring is not used any more
    reaper.reset();       // its connections back to the IO threads: completions via the inbox
    while (remote > 0) {
      uint64_t v;
      if (::read(efd.get(), &v, sizeof(v)) < 0 && errno != EINTR) sleep_ms(1);
      for (Tag* t = inbox.take_all(); t != nullptr; t = t->next) --remote;
    }
  }

  void run() {
    char name[16];
    std::snprintf(name, sizeof(name), "ublk-q%u", static_cast<unsigned>(q_id));
    pthread_setname_np(pthread_self(), name);
    // The kernel may need this thread to make progress for memory reclaim to go on (writeback to
    // this very device): PR_SET_IO_FLUSHER keeps its allocations from recursing into IO. Needs
    // CAP_SYS_RESOURCE; without it we serve anyway.
    (void)::prctl(PR_SET_IO_FLUSHER, 1, 0, 0, 0);
    tl_queue = this;

    // SQ: one SQE per tag at most (a FETCH or a COMMIT) plus the eventfd read, the reaper's
    // poll and its removal.
    const uint32_t entries = round_up_pow2(uint32_t{depth} + 3);
    io_uring_params p{};
    p.flags = IORING_SETUP_COOP_TASKRUN | IORING_SETUP_SINGLE_ISSUER;
    int r = io_uring_queue_init_params(entries, &ring, &p);
    if (r == -EINVAL) {  // a kernel without those flags
      p = io_uring_params{};
      r = io_uring_queue_init_params(entries, &ring, &p);
    }
    if (r < 0) {
      ready.set_value(errc(-r));
      return;
    }
    bool ok = arm_eventfd();
    if (ok && opts->reap) setup_reaper();
    for (auto& t : tags) ok = ok && queue_cmd(t, uapi::kUIoFetchReq, 0);
    r = io_uring_submit(&ring);
    if (!ok || r < 0 || static_cast<uint32_t>(r) != pending_sqes) {
      reaper.reset();
      io_uring_queue_exit(&ring);
      ready.set_value(errc(r < 0 ? -r : EIO));
      return;
    }
    pending_sqes = 0;
    ready.set_value({});

    for (;;) {
      // A completion that came through an IO thread says the connection may have gone back to
      // it (left unreaped ~10 ms): reap borrows it again.
      if (drain_inbox() > 0) need_reap = true;
      if (need_reap) reap_now();
      if (remote == 0 && (stop.load(std::memory_order_acquire) || kernel_tags == 0)) break;
      r = io_uring_submit_and_wait(&ring, 1);
      if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY) {
        log("io_uring_submit_and_wait: " + std::string(std::strerror(-r)) + "; the queue stops");
        wait_remote_without_ring();
        break;
      }
      if (r >= 0) pending_sqes = 0;
      unsigned head;
      unsigned n = 0;
      io_uring_cqe* cqe;
      // The requests of one wake-up go to the wire together (one send per connection on tcp,
      // one doorbell on rdma), as the block layer's plug does for a driver.
      dev->begin_batch();
      io_uring_for_each_cqe(&ring, head, cqe) {
        ++n;
        handle(cqe);
      }
      dev->end_batch();
      io_uring_cq_advance(&ring, n);
      // Not inside the batch (reap() refuses it): the requests just started are on the wire,
      // and what completed meanwhile is committed before the next io_uring_enter.
      if (need_reap) reap_now();
    }
    if (kernel_tags == 0 && !stop.load()) log("every tag aborted: the device is gone");
    // The connections back to their IO threads, then the ring: fetches still pending are
    // cancelled by its end (the device is stopped, or the driver quiesces it as for a dead
    // daemon), and so is the reaper fd's poll.
    reaper.reset();
    io_uring_queue_exit(&ring);
  }
};

struct UblkDevice::Impl {
  UblkOptions opts;
  std::unique_ptr<UblkControl> ctl;
  std::shared_ptr<RemoteDevice> dev;
  uapi::ublksrv_ctrl_dev_info info{};
  base::UniqueFd cdev;
  std::vector<std::unique_ptr<Queue>> queues;
  bool owned = false;    // ours to DEL_DEV (added, or recovered)
  bool started = false;  // START_DEV / END_USER_RECOVERY done: STOP_DEV first
  bool stopped = false;
  bool recovered = false;
  std::atomic<uint64_t> size{0};  // bytes /dev/ublkbN has (UblkDevice::size)

  ~Impl() { (void)stop(); }

  std::string path(const char* kind) const {
    return opts.dev_dir + "/ublk" + kind + std::to_string(info.dev_id);
  }

  // Opens /dev/ublkcN: devtmpfs creates it when ADD_DEV registers the char device (udev may
  // still be changing its mode); a dead daemon's descriptor may still be closing (EBUSY).
  Status open_cdev() {
    const auto deadline = Clock::now() + opts.wait_timeout;
    for (;;) {
      int fd = ::open(path("c").c_str(), O_RDWR | O_CLOEXEC);
      if (fd >= 0) {
        cdev.reset(fd);
        return {};
      }
      const int e = errno;
      if (e != ENOENT && e != EBUSY && e != EACCES) return errc(e);
      if (Clock::now() > deadline) return errc(ETIMEDOUT);
      sleep_ms(10);
    }
  }

  // Maps the descriptors, registers the buffers and starts every queue thread; returns once
  // each has queued FETCH_REQ on all its tags (what START_DEV / END_USER_RECOVERY wait for).
  Status start_queues(BlockSession& session) {
    BASE_TRY(open_cdev());
    const uint32_t buf_bytes = info.max_io_buf_bytes;
    for (uint16_t q = 0; q < info.nr_hw_queues; ++q) {
      auto queue = std::make_unique<Queue>();
      queue->opts = &opts;
      queue->dev = dev;
      queue->q_id = q;
      queue->depth = info.queue_depth;
      queue->buf_bytes = buf_bytes;
      queue->cdev_fd = cdev.get();
      queue->descs_len = page_round(uint64_t{info.queue_depth} * sizeof(uapi::ublksrv_io_desc));
      void* m = ::mmap(nullptr, queue->descs_len, PROT_READ, MAP_SHARED | MAP_POPULATE, cdev.get(),
                       static_cast<off_t>(uapi::kCmdBufOffset + q * uapi::kDescQueueStride));
      if (m == MAP_FAILED) return errc(errno);
      queue->descs = static_cast<const uapi::ublksrv_io_desc*>(m);
      // One registration per queue for all its tags (not one per tag: registrations are
      // scarce on an HCA and each costs a round of every path).
      // Through the device: a failover device's is registered with both its sessions.
      auto b = dev->alloc_buffer(size_t{buf_bytes} * info.queue_depth);
      if (!b.ok()) return b.error();
      queue->buf = std::move(*b);
      queue->transport = &session.transport();
      queue->tags.resize(info.queue_depth);
      for (uint16_t i = 0; i < info.queue_depth; ++i) {
        Tag& t = queue->tags[i];
        t.q = queue.get();
        t.tag = i;
        t.seg = ibtrs::IoSeg{queue->buf->data() + size_t{i} * buf_bytes, 0, queue->buf.get()};
      }
      queue->efd.reset(::eventfd(0, EFD_CLOEXEC));
      if (!queue->efd) return errc(errno);
      auto fut = queue->ready.get_future();
      Queue* qp = queue.get();
      queue->thread = std::thread([qp] { qp->run(); });
      queues.push_back(std::move(queue));
      if (auto ec = fut.get()) return ec;
    }
    return {};
  }

  void stop_queues() {
    for (auto& q : queues) {
      q->stop.store(true, std::memory_order_release);
      q->wake();
    }
    for (auto& q : queues)
      if (q->thread.joinable()) q->thread.join();
    queues.clear();  // descriptors unmapped, buffers deregistered
    cdev.reset();
  }

  Status stop() {
    if (stopped) return {};
    stopped = true;
    Status first;
    if (started && ctl) {
      // The gendisk goes; its IO in flight is still served by the queues meanwhile.
      if (auto st = ctl->stop_dev(info.dev_id); !st.ok()) first = st;
    }
    stop_queues();
    if (owned && ctl) {
      if (auto st = ctl->del_dev(info.dev_id); !st.ok() && first.ok()) first = st;
    }
    return first;
  }
};

UblkDevice::UblkDevice(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
UblkDevice::~UblkDevice() = default;

Status UblkDevice::stop() { return impl_->stop(); }
uint32_t UblkDevice::dev_id() const { return impl_->info.dev_id; }
std::string UblkDevice::block_path() const { return impl_->path("b"); }
std::string UblkDevice::char_path() const { return impl_->path("c"); }
uint16_t UblkDevice::nr_queues() const { return impl_->info.nr_hw_queues; }
uint16_t UblkDevice::queue_depth() const { return impl_->info.queue_depth; }
bool UblkDevice::recovered() const { return impl_->recovered; }
uint64_t UblkDevice::size() const { return impl_->size.load(std::memory_order_relaxed); }

Status UblkDevice::update_size(uint64_t bytes) {
  const uint32_t lbs = impl_->dev->geometry().logical_block_size;
  if (lbs == 0 || bytes % lbs != 0) return errc(EINVAL);
  if (bytes == size()) return {};
  BASE_TRY(impl_->ctl->update_size(impl_->info.dev_id, bytes / kSectorSize));
  impl_->size.store(bytes, std::memory_order_relaxed);
  return {};
}

UblkStats UblkDevice::stats() const {
  UblkStats s;
  for (auto& q : impl_->queues) {
    s.requests += q->requests.load(std::memory_order_relaxed);
    s.errors += q->errors.load(std::memory_order_relaxed);
    s.wakeups += q->wakeups.load(std::memory_order_relaxed);
    s.reaps += q->reaps.load(std::memory_order_relaxed);
    s.reaped += q->reaped.load(std::memory_order_relaxed);
  }
  return s;
}

namespace {

// The driver supports what recovery needs (6.0 has USER_RECOVERY, 6.1 REISSUE): its features.
Result<uint64_t> check_features(UblkControl& ctl) {
  auto f = ctl.get_features();
  if (!f.ok()) return errc(EOPNOTSUPP);  // GET_FEATURES itself is 6.5+
  const uint64_t need = uapi::kFUserRecovery | uapi::kFUserRecoveryReissue;
  if ((*f & need) != need) return errc(EOPNOTSUPP);
  return *f;
}

}  // namespace

Result<std::unique_ptr<UblkDevice>> UblkDevice::create(std::shared_ptr<RemoteDevice> dev,
                                                       BlockSession& session, const UblkOptions& o) {
  if (!dev || o.nr_queues == 0 || o.queue_depth == 0 || o.queue_depth > uapi::kMaxQueueDepth ||
      o.max_io_bytes == 0 || o.max_io_bytes % kPageSize != 0 || o.max_io_bytes > uapi::kMaxIoBufBytes)
    return errc(EINVAL);
  const bool ro = dev->access_mode() == AccessMode::ro;
  auto params = make_params(dev->geometry(), ro, o.max_io_bytes);
  if (!params.ok()) return params.error();

  auto impl = std::make_unique<Impl>();
  impl->opts = o;
  impl->dev = dev;
  BASE_ASSIGN_OR_RETURN(impl->ctl, UblkControl::open(o.control_path));
  BASE_ASSIGN_OR_RETURN(const uint64_t features, check_features(*impl->ctl));

  uapi::ublksrv_ctrl_dev_info want{};
  want.nr_hw_queues = o.nr_queues;
  want.queue_depth = o.queue_depth;
  want.max_io_buf_bytes = o.max_io_bytes;
  want.dev_id = ~0u;  // the driver picks the number
  want.flags = uapi::kFUserRecovery | uapi::kFUserRecoveryReissue | uapi::kFCmdIoctlEncode;
  // Resizes (update_size) where both this build and the kernel know them.
  if (update_size_supported()) want.flags |= features & uapi::kFUpdateSize;
  BASE_ASSIGN_OR_RETURN(impl->info, impl->ctl->add_dev(want));
  impl->owned = true;  // from here on, failure paths DEL_DEV
  // The driver may have lowered the buffer size (page rounding, its own cap): requests follow.
  if (impl->info.max_io_buf_bytes < dev->geometry().logical_block_size || impl->info.queue_depth == 0 ||
      impl->info.nr_hw_queues == 0)
    return errc(EINVAL);
  params->basic.max_sectors = std::min(params->basic.max_sectors, impl->info.max_io_buf_bytes / kSectorSize);
  BASE_TRY(impl->ctl->set_params(impl->info.dev_id, *params));
  BASE_TRY(impl->start_queues(session));
  BASE_TRY(impl->ctl->start_dev(impl->info.dev_id, ::getpid()));
  impl->started = true;
  impl->size.store(params->basic.dev_sectors * kSectorSize, std::memory_order_relaxed);
  return std::unique_ptr<UblkDevice>(new UblkDevice(std::move(impl)));
}

Result<std::unique_ptr<UblkDevice>> UblkDevice::recover(uint32_t dev_id, std::shared_ptr<RemoteDevice> dev,
                                                        BlockSession& session, const UblkOptions& o) {
  if (!dev) return errc(EINVAL);
  auto impl = std::make_unique<Impl>();
  impl->opts = o;
  impl->dev = dev;
  BASE_ASSIGN_OR_RETURN(impl->ctl, UblkControl::open(o.control_path));
  const auto deadline = Clock::now() + o.wait_timeout;
  // The dead daemon's rings and /dev/ublkcN are released asynchronously: the device is LIVE
  // until the driver notices, then QUIESCED, and START_USER_RECOVERY says EBUSY until the
  // character device is closed too.
  for (;;) {
    auto info = impl->ctl->get_dev_info(dev_id);
    if (!info.ok()) return info.error() == std::errc::no_such_device ? errc(ENOENT) : info.error();
    impl->info = *info;
    if ((info->flags & uapi::kFUserRecovery) == 0 || info->state == uapi::kStateDead) return errc(EINVAL);
    if (info->state == uapi::kStateQuiesced) {
      auto st = impl->ctl->start_user_recovery(dev_id);
      if (st.ok()) break;
      if (st.error() != std::errc::device_or_resource_busy) return st.error();
    }
    if (Clock::now() > deadline) return errc(ETIMEDOUT);
    sleep_ms(50);
  }
  if (impl->info.queue_depth == 0 || impl->info.nr_hw_queues == 0 ||
      impl->info.max_io_buf_bytes < dev->geometry().logical_block_size)
    return errc(EINVAL);
  BASE_TRY(impl->start_queues(session));
  BASE_TRY(impl->ctl->end_user_recovery(dev_id, ::getpid()));
  // The kernel kept the size it had: the volume may have been resized since.
  if (auto p = impl->ctl->get_params(dev_id); p.ok())
    impl->size.store(p->basic.dev_sectors * kSectorSize, std::memory_order_relaxed);
  impl->owned = true;
  impl->started = true;
  impl->recovered = true;
  return std::unique_ptr<UblkDevice>(new UblkDevice(std::move(impl)));
}

}  // namespace ibnbd::ublk
