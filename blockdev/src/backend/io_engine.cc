// IoEngine: requests as chains of linked SQEs on one io_uring, short transfers resumed, block
// device discards on a helper thread. The mapping of operations is documented in backend.h.
#include <fcntl.h>
#include <liburing.h>
#include <linux/fs.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cerrno>
#include <memory>
#include <thread>
#include <vector>

#include "backend/blocking_worker.h"
#include "backend/engine_slot.h"
#include "backend/rbd_image.h"
#include "ibnbd/backend.h"
#include "proto/ibnbd_proto.h"

namespace ibnbd {

using backend::BlockingWorker;
using backend::Slot;
using backend::stage_bit;
using backend::Tag;
using backend::ZeroWay;
using proto::kBlockStatusReplyBytes;

namespace {

constexpr uint32_t kMaxQueueDepth = 4096;  // slot index fits kSlotBits with room to spare
static_assert(kMaxQueueDepth <= (1u << backend::kSlotBits));
// A request holds at most this many SQEs at once (preflush, two fallocates, post-sync), so an SQ
// of depth x this never runs out between kicks.
constexpr uint32_t kMaxSqesPerRequest = 4;
constexpr uint32_t kCqeBatch = 64;
// Largest memory-file request done inside submit() (EngineOptions::sync_memory_files). Larger
// copies go to io_uring's workers: there they overlap with the owner's network work, where on
// the owner they would stall it (1 MiB sequential reads QD8 through the server: 0.7-0.8x the
// io_uring way when done inline, on 2 cores). Writes too, measured again with chunk sets (one
// request per 1 MiB; bench/large_io_ab.sh, 2 cores under load 8, medians of 3): inline against
// io_uring's workers at QD8 on tmpfs 0.64x at 128 KiB, 0.68x at 256 KiB, 0.69x at 1 MiB; on
// ext4 (a file, where inline would be pwritev2 on the IO thread) no steadier gain, as dirty
// page throttling dominates there.
constexpr uint32_t kSyncMaxBytes = 64 * 1024;

uint32_t round_up_pow2(uint32_t v) {
  uint32_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

bool is_data(IoOp op) { return op == IoOp::read || op == IoOp::write; }
bool writes(IoOp op) { return op != IoOp::read && op != IoOp::flush && op != IoOp::block_status; }
bool on_rbd(const Backend* b) { return b->kind() == Backend::Kind::rbd; }

}  // namespace

struct IoEngine::Impl {
  io_uring ring{};
  bool ring_ready = false;
  base::UniqueFd efd;
  EngineCaps caps;
  uint32_t depth = 0;
  std::vector<Slot> slots;
  std::vector<uint32_t> free_slots;  // a stack
  uint32_t in_flight = 0;            // slots in use
  uint32_t kernel_sqes = 0;          // submitted SQEs whose CQE has not been reaped
  std::unique_ptr<BlockingWorker> worker;
  std::vector<BlockingWorker::Done> worker_done;
  // Jobs posted to the worker whose results were not taken yet: a pass looks at the worker
  // (its eventfd signal, its mutex) only while there are some, not on every pass of an engine
  // that once discarded or answered a BLOCK_STATUS.
  uint32_t worker_busy = 0;
  bool sync_memory_files = false;
  std::vector<uint32_t> ready;      // slots finished inside submit(), callbacks not yet run
  std::vector<uint32_t> ready_run;  // the batch run_completions() is calling back
  // The eventfd may hold a count nobody consumed: CQEs were reaped after the last read of it
  // (or we poked it ourselves). Without one, a pass with no CQE ready skips the read(2).
  bool efd_maybe = true;
  bool in_completions = false;
  uint32_t callbacks = 0;  // made by the current run_completions()
  // The owning thread, learnt at the first submit: debug builds assert the threading contract.
  std::thread::id owner;

  // RBD images: one stage at a time per slot on librbd (rbd_aio[slot]); librbd's threads push
  // finished stages onto rbd_done (a lock-free stack) and signal the eventfd when it was empty;
  // the owner takes the whole stack in run_completions(). rbd_started counts the stages not yet
  // taken (owner only); rbd_in_callback the librbd threads between taking a stage's result and
  // their last touch of the engine, which the destructor waits out.
  std::vector<backend::RbdAio> rbd_aio;
  std::atomic<backend::RbdAio*> rbd_done{nullptr};
  std::atomic<uint32_t> rbd_in_callback{0};
  uint32_t rbd_started = 0;

  void check_owner() {
    if (owner == std::thread::id{}) owner = std::this_thread::get_id();
    assert(owner == std::this_thread::get_id() && "IoEngine used from two threads");
  }

  ~Impl() {
    // librbd may still be reading into or writing from callers' buffers: wait for every stage
    // it was given, and for its threads to leave our eventfd and stack.
    while (rbd_started > 0 || rbd_in_callback.load() > 0) {
      rbd_take();
      if (rbd_started > 0) {
        pollfd p{efd.get(), POLLIN, 0};
        (void)::poll(&p, 1, 100);
        uint64_t cnt = 0;
        [[maybe_unused]] ssize_t rd = ::read(efd.get(), &cnt, sizeof(cnt));
      } else {
        std::this_thread::yield();
      }
    }
    if (!ring_ready) return;
    worker.reset();  // joins; queued ioctls are dropped, a running one finishes
    // The kernel may still be writing into callers' buffers: wait for every submitted SQE.
    while (kernel_sqes > 0) {
      io_uring_cqe* cqe = nullptr;
      if (io_uring_wait_cqe(&ring, &cqe) != 0) break;
      io_uring_cqe_seen(&ring, cqe);
      --kernel_sqes;
    }
    io_uring_queue_exit(&ring);
  }

  Status validate(const BackendRequest& r) const;
  void plan(Slot& s);
  Status start_round(Slot& s);
  bool prep_stage(Slot& s, uint8_t stage, io_uring_sqe* sqe);
  void on_result(uint64_t user_data, int res);
  void end_round(Slot& s);
  void finish(Slot& s, int err);
  int run_sync(Slot& s);
  Status kick();
  int rbd_next(Slot& s);
  static void rbd_cb(backend::RbdAio* a, int64_t res);
  // Takes the stages librbd finished; with `run`, their results go on (else they are dropped:
  // the destructor's wait).
  void rbd_take(bool run = false);
  void on_rbd_result(uint64_t tag, int64_t res);
};

// ---------------------------------------------------------------------------------------------
// Creation

IoEngine::IoEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
IoEngine::~IoEngine() = default;

Result<std::unique_ptr<IoEngine>> IoEngine::create(const EngineOptions& o) {
  if (o.queue_depth == 0 || o.queue_depth > kMaxQueueDepth) return errc(EINVAL);
  auto impl = std::make_unique<Impl>();
  impl->depth = o.queue_depth;
  const uint32_t entries = round_up_pow2(o.queue_depth * kMaxSqesPerRequest);
  io_uring_params p{};
  // The CQ holds every CQE that can be outstanding, so completions never overflow.
  p.flags = IORING_SETUP_CQSIZE | IORING_SETUP_SUBMIT_ALL;
  p.cq_entries = entries;
  int rc = io_uring_queue_init_params(entries, &impl->ring, &p);
  if (rc == -EINVAL) {  // SUBMIT_ALL is 5.18: without it a failing SQE stops the batch there
    p = io_uring_params{};
    p.flags = IORING_SETUP_CQSIZE;
    p.cq_entries = entries;
    rc = io_uring_queue_init_params(entries, &impl->ring, &p);
  } else if (rc == 0) {
    impl->caps.submit_all = true;
  }
  if (rc < 0) return errc(-rc);
  impl->ring_ready = true;

  if (io_uring_probe* probe = io_uring_get_probe_ring(&impl->ring)) {
    impl->caps.op_read_write = io_uring_opcode_supported(probe, IORING_OP_READ) &&
                               io_uring_opcode_supported(probe, IORING_OP_WRITE);
    impl->caps.op_fallocate = io_uring_opcode_supported(probe, IORING_OP_FALLOCATE);
    io_uring_free_probe(probe);
  }  // no probe: a kernel before 5.6, READV/WRITEV/FSYNC only

  int efd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (efd < 0) return errc(errno);
  impl->efd.reset(efd);
  rc = io_uring_register_eventfd(&impl->ring, efd);
  if (rc < 0) return errc(-rc);

  impl->slots.resize(o.queue_depth);
  impl->free_slots.reserve(o.queue_depth);
  for (uint32_t i = o.queue_depth; i-- > 0;) impl->free_slots.push_back(i);
  impl->worker_done.reserve(o.queue_depth);
  impl->sync_memory_files = o.sync_memory_files;
  impl->ready.reserve(o.queue_depth);
  impl->ready_run.reserve(o.queue_depth);
  impl->rbd_aio.resize(o.queue_depth);
  return std::unique_ptr<IoEngine>(new IoEngine(std::move(impl)));
}

int IoEngine::event_fd() const { return impl_->efd.get(); }
uint32_t IoEngine::in_flight() const { return impl_->in_flight; }
uint32_t IoEngine::queue_depth() const { return impl_->depth; }
const EngineCaps& IoEngine::caps() const { return impl_->caps; }

// ---------------------------------------------------------------------------------------------
// Submission

Status IoEngine::Impl::validate(const BackendRequest& r) const {
  if (!r.backend || !r.done) return errc(EINVAL);
  if (static_cast<uint8_t>(r.op) > static_cast<uint8_t>(IoOp::block_status)) return errc(EINVAL);
  if (r.flags & ~kIoFlagsMask) return errc(EINVAL);
  const Backend& b = *r.backend;
  if (writes(r.op) && b.read_only()) return errc(EROFS);
  if (r.op == IoOp::flush) return {};
  if (r.offset > b.size() || r.len > b.size() - r.offset) return errc(EIO);
  if (b.direct() && (r.offset % b.io_align() || r.len % b.io_align())) return errc(EINVAL);
  switch (r.op) {
    case IoOp::read:
    case IoOp::write: {
      if (!r.buf.empty() && !r.iov.empty()) return errc(EINVAL);
      if (r.iov.size() > kMaxIoSegments) return errc(EINVAL);
      uint64_t sum = r.buf.size();
      for (const iovec& v : r.iov) sum += v.iov_len;
      if (sum != r.len) return errc(EINVAL);
      const uint32_t ma = b.mem_align();
      if (ma > 1) {
        auto off = [ma](const void* p, size_t n) {
          return reinterpret_cast<uintptr_t>(p) % ma != 0 || n % ma != 0;
        };
        if (!r.buf.empty() && off(r.buf.data(), r.buf.size())) return errc(EINVAL);
        for (const iovec& v : r.iov)
          if (off(v.iov_base, v.iov_len)) return errc(EINVAL);
      }
      return {};
    }
    case IoOp::discard:
      if (!b.can_discard()) return errc(EOPNOTSUPP);
      if (b.kind() == Backend::Kind::file && !caps.op_fallocate) return errc(EOPNOTSUPP);
      return {};
    case IoOp::write_zeroes:
      if (!b.can_write_zeroes() || (!on_rbd(&b) && !caps.op_fallocate)) return errc(EOPNOTSUPP);
      return {};
    case IoOp::secure_erase:
      if (b.kind() != Backend::Kind::block_device) return errc(EOPNOTSUPP);
      return {};
    case IoOp::block_status:
      // The answer is written into buf: room for the largest one, and a range whose extents
      // fit the answer's 32-bit lengths.
      if (!r.iov.empty() || r.buf.size() < kBlockStatusReplyBytes || r.len == 0) return errc(EINVAL);
      if (r.flags != 0 || r.len % kSectorSize != 0 || r.offset % kSectorSize != 0) return errc(EINVAL);
      return {};
    default:
      return {};
  }
}

// Which stages the request needs (see Stage).
void IoEngine::Impl::plan(Slot& s) {
  s.planned = stage_bit(backend::kStageMain);
  if (s.op == IoOp::flush) return;  // the flush is the operation: PREFLUSH/FUA add nothing
  if (s.flags & kIoPreflush) s.planned |= stage_bit(backend::kStagePreflush);
  // FUA on a write rides as RWF_DSYNC; the others need their own fdatasync after, and every
  // FUA on an image a flush after (librbd has no per-write durability flag).
  if ((s.flags & kIoFua) && writes(s.op) && (s.op != IoOp::write || on_rbd(s.be)))
    s.planned |= stage_bit(backend::kStagePostSync);
  if (s.op == IoOp::write_zeroes && !on_rbd(s.be)) {
    if (!(s.flags & kIoNoUnmap))
      s.zero = ZeroWay::punch;
    else if (s.be->kind() == Backend::Kind::file && s.be->zero_range_unsupported())
      s.zero = ZeroWay::punch_alloc;
    else
      s.zero = ZeroWay::zero_range;
    if (s.zero == ZeroWay::punch_alloc) s.planned |= stage_bit(backend::kStageMain2);
  }
}

Status IoEngine::submit(const BackendRequest& r) {
  Impl& m = *impl_;
  m.check_owner();
  BASE_TRY(m.validate(r));
  if (m.free_slots.empty()) return errc(EAGAIN);
  if (r.op == IoOp::discard || r.op == IoOp::secure_erase || r.op == IoOp::block_status) {
    if ((r.backend->kind() == Backend::Kind::block_device || r.op == IoOp::block_status) && !m.worker) {
      m.worker = std::make_unique<BlockingWorker>(m.depth, m.efd.get());
      if (Status st = m.worker->start(); !st.ok()) {
        m.worker.reset();
        return st;
      }
    }
  }
  const uint32_t idx = m.free_slots.back();
  Slot& s = m.slots[idx];
  const uint32_t gen = s.gen;
  s = Slot{};
  s.gen = gen;
  s.in_use = true;
  s.be = r.backend;
  s.op = r.op;
  s.flags = r.flags;
  s.offset = r.offset;
  s.len = r.len;
  s.cb = r.done;
  s.ctx = r.ctx;
  if (!r.buf.empty()) {
    s.iov[0] = {r.buf.data(), r.buf.size()};
    s.niov = 1;
  } else {
    std::copy(r.iov.begin(), r.iov.end(), s.iov);
    s.niov = static_cast<uint32_t>(r.iov.size());
  }
  m.plan(s);
  m.free_slots.pop_back();
  ++m.in_flight;
  if (on_rbd(s.be) && s.op != IoOp::block_status) {
    if (const int rc = m.rbd_next(s); rc < 0) {  // librbd refused it at once: no callback
      s.in_use = false;
      ++s.gen;
      m.free_slots.push_back(idx);
      --m.in_flight;
      return errc(-rc);
    }
    return {};
  }
  if (m.sync_memory_files && s.be->memory_backed() && is_data(s.op) &&
      s.len <= kSyncMaxBytes && s.planned == stage_bit(backend::kStageMain)) {
    s.err = m.run_sync(s);
    m.ready.push_back(idx);  // capacity: queue_depth, reserved at creation
    return {};
  }
  if (Status st = m.start_round(s); !st.ok()) {  // no SQE space even after a kick: give back
    s.in_use = false;
    ++s.gen;
    m.free_slots.push_back(idx);
    --m.in_flight;
    return st;
  }
  return {};
}

// Queues the stages of `s` not done yet, from the first, as one linked chain (IOSQE_IO_LINK: a
// stage starts only after the one before it succeeded). A helper-thread stage ends the chain.
Status IoEngine::Impl::start_round(Slot& s) {
  s.round = 0;
  s.pending = 0;
  s.progress = false;
  s.err = 0;
  const uint32_t idx = static_cast<uint32_t>(&s - slots.data());
  auto on_helper = [&s](uint8_t st) {
    if (st != backend::kStageMain) return false;
    if (s.op == IoOp::block_status) return true;
    return s.be->kind() == Backend::Kind::block_device &&
           (s.op == IoOp::discard || s.op == IoOp::secure_erase) && s.len > 0;
  };
  auto todo = [&s](uint8_t st) { return (s.planned & stage_bit(st)) && !(s.ok & stage_bit(st)); };
  uint8_t first = 0;
  while (first < backend::kStageCount && !todo(first)) ++first;
  if (first == backend::kStageCount) return {};
  if (on_helper(first)) {
    BlockingWorker::Job j{s.be->fd(), s.op == IoOp::discard ? BLKDISCARD : BLKSECDISCARD, s.offset, s.len,
                          backend::pack_tag({idx, first, s.gen})};
    if (s.op == IoOp::block_status) {
      j.status_of = s.be;
      j.out = static_cast<std::byte*>(s.iov[0].iov_base);
      j.out_len = s.iov[0].iov_len;
    }
    worker->post(j);
    ++worker_busy;
    s.round = stage_bit(first);
    s.pending = 1;
    return {};
  }
  // The whole chain must be queued before any of it is submitted: a kick between two linked
  // SQEs would send the first without its link flag. The SQ is sized for every slot's worst
  // chain, so the kick here only retries one that failed earlier.
  uint8_t last = first;
  uint32_t need = 0;
  for (uint8_t st = first; st < backend::kStageCount && !on_helper(st); ++st) {
    if (!todo(st)) continue;
    last = st;
    ++need;
  }
  if (io_uring_sq_space_left(&ring) < need) (void)kick();
  if (io_uring_sq_space_left(&ring) < need) return errc(EAGAIN);
  io_uring_sqe* prev = nullptr;
  for (uint8_t st = first; st <= last; ++st) {
    if (!todo(st)) continue;
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    if (prev) prev->flags |= IOSQE_IO_LINK;
    if (!prep_stage(s, st, sqe)) io_uring_prep_nop(sqe);
    io_uring_sqe_set_data64(sqe, backend::pack_tag({idx, st, s.gen}));
    s.round |= stage_bit(st);
    ++s.pending;
    prev = sqe;
  }
  return {};
}

// Fills one SQE for one stage. Returns false for a stage with nothing to do (zero length).
bool IoEngine::Impl::prep_stage(Slot& s, uint8_t stage, io_uring_sqe* sqe) {
  const int fd = s.be->fd();
  if (stage == backend::kStagePreflush || stage == backend::kStagePostSync) {
    io_uring_prep_fsync(sqe, fd, IORING_FSYNC_DATASYNC);
    return true;
  }
  const uint64_t off = s.offset + s.done;
  switch (s.op) {
    case IoOp::read:
    case IoOp::write: {
      if (s.len == s.done) return false;
      iovec* v = s.iov + s.iov_first;
      const uint32_t n = s.niov - s.iov_first;
      const bool w = s.op == IoOp::write;
      if (n == 1 && caps.op_read_write) {
        if (w)
          io_uring_prep_write(sqe, fd, v->iov_base, static_cast<unsigned>(v->iov_len), off);
        else
          io_uring_prep_read(sqe, fd, v->iov_base, static_cast<unsigned>(v->iov_len), off);
      } else if (w) {
        io_uring_prep_writev(sqe, fd, v, n, off);
      } else {
        io_uring_prep_readv(sqe, fd, v, n, off);
      }
      // FUA: this write is durable when it completes (pwritev2(2) RWF_DSYNC, Linux >= 4.7;
      // every io_uring carries rw_flags).
      if (w && (s.flags & kIoFua)) sqe->rw_flags = RWF_DSYNC;
      return true;
    }
    case IoOp::flush:
      io_uring_prep_fsync(sqe, fd, IORING_FSYNC_DATASYNC);
      return true;
    case IoOp::discard:
      if (s.len == 0) return false;
      io_uring_prep_fallocate(sqe, fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                              static_cast<off_t>(s.offset), s.len);
      return true;
    case IoOp::write_zeroes: {
      if (s.len == 0) return false;
      int mode = FALLOC_FL_KEEP_SIZE;  // block devices require it; files must not grow
      if (stage == backend::kStageMain)
        mode |= s.zero == ZeroWay::zero_range ? FALLOC_FL_ZERO_RANGE : FALLOC_FL_PUNCH_HOLE;
      // kStageMain2 (punch_alloc): plain allocation of the punched range, which reads as zeros.
      io_uring_prep_fallocate(sqe, fd, mode, static_cast<off_t>(s.offset), s.len);
      return true;
    }
    default:
      return false;
  }
}

// READ / WRITE of a memory-backed file on the calling thread; the same rules as a ring round:
// short transfers continue, one that moves nothing is EIO (end of file: the store shrank).
int IoEngine::Impl::run_sync(Slot& s) {
  const int fd = s.be->fd();
  const bool w = s.op == IoOp::write;
  // FUA as on the ring (RWF_DSYNC); on tmpfs it costs nothing.
  const int flags = w && (s.flags & kIoFua) ? RWF_DSYNC : 0;
  while (s.done < s.len) {
    iovec* v = s.iov + s.iov_first;
    const int n = static_cast<int>(s.niov - s.iov_first);
    const off_t off = static_cast<off_t>(s.offset + s.done);
    const ssize_t r = w ? ::pwritev2(fd, v, n, off, flags) : ::preadv2(fd, v, n, off, flags);
    if (r < 0) {
      if (errno == EINTR) continue;
      return (errno == EBADF && w) ? EROFS : errno;  // as end_round() maps it
    }
    if (r == 0) return EIO;
    s.done += static_cast<uint32_t>(r);
    s.iov_first = backend::advance_iov(s.iov, s.iov_first, s.niov, static_cast<size_t>(r));
  }
  return 0;
}

Status IoEngine::Impl::kick() {
  if (io_uring_sq_ready(&ring) == 0) return {};
  int rc = io_uring_submit(&ring);
  if (rc < 0) return errc(-rc);
  kernel_sqes += static_cast<uint32_t>(rc);
  return {};
}

Status IoEngine::kick() { return impl_->kick(); }

// ---------------------------------------------------------------------------------------------
// Completion

void IoEngine::Impl::on_result(uint64_t user_data, int res) {
  const Tag t = backend::unpack_tag(user_data);
  assert(t.slot < slots.size());
  Slot& s = slots[t.slot];
  assert(s.in_use && s.gen == t.gen && s.pending > 0);
  if (!s.in_use || s.gen != t.gen || s.pending == 0) return;  // stale: never expected
  --s.pending;
  const uint8_t bit = stage_bit(t.stage);
  if (t.stage == backend::kStageMain && is_data(s.op) && res >= 0) {
    const uint32_t n = static_cast<uint32_t>(res);
    s.done += n;
    s.iov_first = backend::advance_iov(s.iov, s.iov_first, s.niov, n);
    s.progress = s.progress || n > 0;
    if (s.done >= s.len) s.ok |= bit;
  } else if (res >= 0) {
    s.ok |= bit;
  } else if (res != -ECANCELED && s.err == 0) {
    // ECANCELED is a linked stage dropped after an earlier one failed or went short; the
    // earlier one carries the reason.
    s.err = -res;
    s.err_stage = t.stage;
  }
  if (s.pending == 0) end_round(s);
}

void IoEngine::Impl::end_round(Slot& s) {
  if (s.err != 0) {
    // A filesystem without FALLOC_FL_ZERO_RANGE (tmpfs) or a device without unmapping zeroout:
    // switch write-zeroes to the other way once, for this request and (files) the next ones.
    if (s.err == EOPNOTSUPP && s.err_stage == backend::kStageMain && s.op == IoOp::write_zeroes &&
        !s.fell_back) {
      s.fell_back = true;
      if (s.zero == ZeroWay::zero_range && s.be->kind() == Backend::Kind::file) {
        s.be->note_zero_range_unsupported();
        s.zero = ZeroWay::punch_alloc;
        s.planned |= stage_bit(backend::kStageMain2);
      } else if (s.zero == ZeroWay::punch) {
        s.zero = ZeroWay::zero_range;
      } else {
        return finish(s, s.err);
      }
      if (start_round(s).ok()) return;
      return finish(s, EAGAIN);
    }
    // A write through a descriptor the kernel considers read-only: the client's view is EROFS.
    int e = s.err;
    if (e == EBADF && writes(s.op)) e = EROFS;
    return finish(s, e);
  }
  if ((s.planned & ~s.ok) == 0) return finish(s, 0);
  // A data round that moved nothing: end of file under a read (the store shrank), or a write
  // the kernel will not continue. Never hand back a partial buffer as success.
  const uint8_t main = stage_bit(backend::kStageMain);
  if (is_data(s.op) && (s.round & main) && !(s.ok & main)) {
    if (!s.progress) return finish(s, EIO);
    // An O_DIRECT read cut at an unaligned end of file: the rest could only fail with EINVAL.
    if (s.op == IoOp::read && (s.offset + s.done) % s.be->io_align() != 0) return finish(s, EIO);
  }
  if (!start_round(s).ok()) finish(s, EAGAIN);
}

void IoEngine::Impl::finish(Slot& s, int err) {
  IoDoneFn cb = s.cb;
  void* ctx = s.ctx;
  s.in_use = false;
  ++s.gen;  // a late CQE for the old request would now be recognised as stale
  free_slots.push_back(static_cast<uint32_t>(&s - slots.data()));
  --in_flight;
  ++callbacks;
  cb(ctx, err);  // last: the callback may submit into the slot just freed
}

uint32_t IoEngine::run_completions() {
  Impl& m = *impl_;
  m.check_owner();
  assert(!m.in_completions && "run_completions() is not reentrant");
  m.in_completions = true;
  m.callbacks = 0;
  // Requests done inside submit(); their callbacks may submit more, done at once too.
  while (!m.ready.empty()) {
    m.ready_run.swap(m.ready);
    for (const uint32_t idx : m.ready_run) {
      Slot& s = m.slots[idx];
      m.finish(s, s.err);
    }
    m.ready_run.clear();
  }
  // Consume the eventfd before reaping, so a completion posted after the reap wakes us again.
  // Only when something may have signalled it: a pass with no CQE and nothing left over from
  // an earlier one saves the read(2).
  // RBD completions signal the eventfd only when their list was empty: it needs reading only
  // when the list holds something (a busy-polling owner would otherwise read(2) every pass).
  if (m.efd_maybe || m.worker_busy > 0 || m.rbd_done.load(std::memory_order_acquire) != nullptr ||
      io_uring_cq_ready(&m.ring) > 0) {
    uint64_t cnt = 0;
    [[maybe_unused]] ssize_t rd = ::read(m.efd.get(), &cnt, sizeof(cnt));
    m.efd_maybe = false;
  }
  for (;;) {
    io_uring_cqe* cqes[kCqeBatch];
    const unsigned n = io_uring_peek_batch_cqe(&m.ring, cqes, kCqeBatch);
    if (n == 0) break;
    // Copy out first: callbacks may submit, and resubmissions must see the CQ already advanced
    // only for what we consumed.
    struct Res {
      uint64_t tag;
      int res;
    } batch[kCqeBatch];
    for (unsigned i = 0; i < n; ++i) batch[i] = {io_uring_cqe_get_data64(cqes[i]), cqes[i]->res};
    io_uring_cq_advance(&m.ring, n);
    m.kernel_sqes -= n;
    m.efd_maybe = true;  // CQEs after our read signalled the eventfd again (or may have)
    for (unsigned i = 0; i < n; ++i) m.on_result(batch[i].tag, batch[i].res);
  }
  if (m.worker_busy > 0) {
    m.worker->take_done(m.worker_done);
    m.worker_busy -= static_cast<uint32_t>(m.worker_done.size());
    for (const auto& d : m.worker_done) m.on_result(d.tag, d.res);
  }
  if (m.rbd_started > 0) m.rbd_take(true);
  // Resubmissions and whatever the callbacks queued go out together. Should the kernel refuse
  // the batch (EAGAIN/EBUSY, transient), poke our own eventfd so the owner's loop comes back and
  // retries rather than sleeping on requests that never reached the kernel.
  if (!m.kick().ok()) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t wr = ::write(m.efd.get(), &one, sizeof(one));
    m.efd_maybe = true;
  }
  m.in_completions = false;
  return m.callbacks;
}

// ---------------------------------------------------------------------------------------------
// RBD images: a request's stages one after the other (PREFLUSH, the operation, FUA's flush),
// each a librbd AIO whose completion comes back through rbd_done.

int IoEngine::Impl::rbd_next(Slot& s) {
  uint8_t st = 0;
  while (st < backend::kStageCount && (!(s.planned & stage_bit(st)) || (s.ok & stage_bit(st)))) ++st;
  assert(st < backend::kStageCount);
  using backend::RbdStage;
  RbdStage what = RbdStage::flush;
  if (st == backend::kStageMain) {
    switch (s.op) {
      case IoOp::read: what = RbdStage::read; break;
      case IoOp::write: what = RbdStage::write; break;
      case IoOp::discard: what = RbdStage::discard; break;
      case IoOp::write_zeroes: what = RbdStage::write_zeroes; break;
      default: what = RbdStage::flush; break;  // FLUSH (secure erase never passes validate)
    }
  }
  const uint32_t idx = static_cast<uint32_t>(&s - slots.data());
  backend::RbdAio& a = rbd_aio[idx];
  a.fn = &Impl::rbd_cb;
  a.owner = this;
  a.tag = backend::pack_tag({idx, st, s.gen});
  a.next = nullptr;
  const int rc = backend::rbd_start(*s.be->rbd(), what, s.offset, s.len, s.iov, static_cast<int>(s.niov),
                                    (s.flags & kIoNoUnmap) != 0, &a);
  if (rc == 0) ++rbd_started;
  return rc;
}

// A librbd thread: keep the result, push, wake the owner when the stack was empty (it has taken
// everything before, so it may be asleep).
void IoEngine::Impl::rbd_cb(backend::RbdAio* a, int64_t res) {
  Impl* m = static_cast<Impl*>(a->owner);
  m->rbd_in_callback.fetch_add(1);
  a->res = res;
  backend::RbdAio* head = m->rbd_done.load(std::memory_order_relaxed);
  do {
    a->next = head;
  } while (!m->rbd_done.compare_exchange_weak(head, a, std::memory_order_release, std::memory_order_relaxed));
  if (head == nullptr) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t wr = ::write(m->efd.get(), &one, sizeof(one));
  }
  m->rbd_in_callback.fetch_sub(1);  // last touch of the engine
}

void IoEngine::Impl::rbd_take(bool run) {
  backend::RbdAio* list = rbd_done.exchange(nullptr, std::memory_order_acquire);
  // The stack holds the latest first; results go on in the order librbd finished them.
  backend::RbdAio* fifo = nullptr;
  while (list) {
    backend::RbdAio* next = list->next;
    list->next = fifo;
    fifo = list;
    list = next;
    --rbd_started;
  }
  while (fifo) {
    backend::RbdAio* next = fifo->next;  // read first: on_rbd_result may start the slot's next stage
    if (run) on_rbd_result(fifo->tag, fifo->res);
    fifo = next;
  }
}

void IoEngine::Impl::on_rbd_result(uint64_t tag, int64_t res) {
  const Tag t = backend::unpack_tag(tag);
  assert(t.slot < slots.size());
  Slot& s = slots[t.slot];
  assert(s.in_use && s.gen == t.gen);
  if (!s.in_use || s.gen != t.gen) return;  // stale: never expected
  if (res < 0) return finish(s, static_cast<int>(-res));
  // librbd reads within the image's size in full (holes read as zeros): anything shorter means
  // the image shrank under the request. Never hand back a partial buffer as success.
  if (t.stage == backend::kStageMain && s.op == IoOp::read && static_cast<uint64_t>(res) != s.len)
    return finish(s, EIO);
  s.ok |= stage_bit(t.stage);
  if ((s.planned & ~s.ok) == 0) return finish(s, 0);
  if (const int rc = rbd_next(s); rc < 0) finish(s, -rc);
}

bool IoEngine::ready() const { return !impl_->ready.empty(); }

uint32_t IoEngine::wait(std::chrono::milliseconds timeout) {
  if (impl_->in_flight == 0) return 0;
  if (!impl_->ready.empty()) return run_completions();
  (void)impl_->kick();
  pollfd p{impl_->efd.get(), POLLIN, 0};
  (void)::poll(&p, 1, static_cast<int>(timeout.count()));
  return run_completions();
}

void IoEngine::drain() {
  while (impl_->in_flight > 0) (void)wait(std::chrono::milliseconds(1000));
}

}  // namespace ibnbd
