// fio external ioengine over libibnbd-client: `ioengine=external:/path/libibnbd-fio.so` sends
// fio's IO straight through a BlockSession (no kernel block device, no NBD hop), so fio measures
// the client library, the transport and the server alone.
//
// Life of a job (fio calls, in this order, on the job's thread or process):
//   setup      may run in fio's parent process before it forks the job (create_serialize), so
//              it only opens a short-lived probe session to learn the device size, and closes
//              it: transport threads do not survive fork().
//   init       opens the job's own BlockSession (one per job: the server tells sessions apart by
//              name, so the name gets the job number) and maps the device.
//   iomem_alloc  fio's IO buffers come from BlockSession::alloc_buffer, so read() and write()
//              go out zero copy; when registration fails the buffers are plain memory and every
//              IO goes through read_copy / write_copy instead.
//   queue      keeps the io_u for commit and returns FIO_Q_QUEUED.
//   commit     submits what queue kept as one submission batch of the session (a tcp path sends
//              them with one system call). fio calls it after every iodepth_batch_submit queued
//              io_us and before it waits.
//   getevents  ibnbd_reap=caller (default): the job thread reaps its own completions
//              (ibtrs::CompletionReaper): it polls its transport connection - reads the tcp
//              socket, polls the rdma CQ - and the callbacks run on it, so a round trip wakes the
//              server's IO thread and this thread, and no transport IO thread in between.
//              ibnbd_reap=thread: completions run on transport IO threads and are pushed on a
//              lock-free stack; getevents takes them, or sleeps on a futex that only a
//              completion finding it asleep wakes. In caller mode the requests that complete
//              elsewhere (large ones spread over the connections, failed-over ones, failures)
//              take that same stack and wake the reaper instead.
//              How it waits, in both modes: ibnbd_poll=adaptive (default, ibtrs/hybrid_poll.h) sleeps
//              until shortly before the expected completion (a blocking wait with a timeout,
//              which a completion ends early), spins (non-blocking looks: a readv per look in
//              caller mode on tcp) within a budget, then blocks; it blocks from the start while
//              the CPU is contended (/proc/loadavg's run queue, preempted spins), when spins keep
//              missing, and when spinning costs more per IO than the blocking waits it probes
//              now and then. ibnbd_poll=block blocks at once; ibnbd_poll_us spins that long first,
//              whatever ibnbd_poll says (the fixed spin of before).
//   cleanup    destroys the session (it fails whatever still waits with ESHUTDOWN first).
//
// fio is C: no exception may unwind into it. Every entry point catches at the boundary and turns
// what it caught into an errno for fio (td_verror) or into io_u->error.
#include <atomic>  // before fio's headers: arch/arch.h includes it for C++, not inside extern "C"
#include <linux/futex.h>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <string_view>
#include <vector>

#include "base/unique_fd.h"
#include "ibtrs/hybrid_poll.h"
#include "ibtrs/cpu_load.h"
#include "ibnbd/client.h"

extern "C" {
#include "fio.h"
#include "optgroup.h"
}

namespace {

// ---- options --------------------------------------------------------------------------------

// fio stores engine options at td->eo; it writes the thread_data pointer into the first member.
struct EngineOptions {
  void* pad;
  char* paths;
  char* device;
  char* session;
  char* mode;
  char* policy;
  unsigned int io_threads;
  unsigned int poll_us;
  char* reap;
  char* host_key;
  char* poll;
  unsigned int poll_stats;
  unsigned int poll_runnable;
  char* standby_paths;
};

// Non-const because fio's ioengine_ops::options is a plain pointer; fio only reads it.
fio_option g_options[] = {
    {
        .name = "ibnbd_paths",
        .lname = "IBNBD paths",
        .type = FIO_OPT_STR_STORE,
        .off1 = offsetof(EngineOptions, paths),
        .help = "Server paths, comma or space separated (tcp:127.0.0.1:1234,tcp:127.0.0.1:1235)",
        .category = FIO_OPT_C_ENGINE,
        .group = FIO_OPT_G_INVALID,
    },
    {
        .name = "ibnbd_device",
        .lname = "IBNBD device",
        .type = FIO_OPT_STR_STORE,
        .off1 = offsetof(EngineOptions, device),
        .help = "Remote device name (as the server resolves it)",
        .category = FIO_OPT_C_ENGINE,
        .group = FIO_OPT_G_INVALID,
    },
    {
        .name = "ibnbd_session",
        .lname = "IBNBD session",
        .type = FIO_OPT_STR_STORE,
        .off1 = offsetof(EngineOptions, session),
        .help = "Session name prefix; each job appends -<job number> (default fio-<pid>)",
        .category = FIO_OPT_C_ENGINE,
        .group = FIO_OPT_G_INVALID,
    },
    {
        .name = "ibnbd_mode",
        .lname = "IBNBD access mode",
        .type = FIO_OPT_STR_STORE,
        .off1 = offsetof(EngineOptions, mode),
        .help = "Access mode: ro, rw or migration (default: rw when the job writes or trims, else ro)",
        .category = FIO_OPT_C_ENGINE,
        .group = FIO_OPT_G_INVALID,
    },
    {
        .name = "ibnbd_policy",
        .lname = "IBNBD multipath policy",
        .type = FIO_OPT_STR_STORE,
        .off1 = offsetof(EngineOptions, policy),
        .help = "Multipath policy: round-robin, min-inflight (default) or min-latency",
        .category = FIO_OPT_C_ENGINE,
        .group = FIO_OPT_G_INVALID,
    },
    {
        .name = "ibnbd_io_threads",
        .lname = "IBNBD IO threads",
        .type = FIO_OPT_INT,
        .off1 = offsetof(EngineOptions, io_threads),
        .help = "Transport IO connections per path (0: the library's default)",
        .def = "0",
        .category = FIO_OPT_C_ENGINE,
        .group = FIO_OPT_G_INVALID,
    },
    {
        .name = "ibnbd_poll_us",
        .lname = "IBNBD completion polling",
        .type = FIO_OPT_INT,
        .off1 = offsetof(EngineOptions, poll_us),
        .help = "Fixed spin: microseconds getevents spins for completions before it sleeps, "
                "overriding ibnbd_poll (0: ibnbd_poll decides)",
        .def = "0",
        .category = FIO_OPT_C_ENGINE,
        .group = FIO_OPT_G_INVALID,
    },
    {
        .name = "ibnbd_poll",
        .lname = "IBNBD completion waiting",
        .type = FIO_OPT_STR_STORE,
        .off1 = offsetof(EngineOptions, poll),
        .help = "How getevents waits: adaptive (default: sleeps until shortly before the expected "
                "completion, then spins within a budget; blocks when the CPU is contended, spins "
                "miss or do not pay) or block (sleeps at once)",
        .category = FIO_OPT_C_ENGINE,
        .group = FIO_OPT_G_INVALID,
    },
    {
        .name = "ibnbd_poll_stats",
        .lname = "IBNBD completion waiting statistics",
        .type = FIO_OPT_BOOL,
        .off1 = offsetof(EngineOptions, poll_stats),
        .help = "Print how ibnbd_poll=adaptive waited (hybrid waits and why it blocked) at the end",
        .def = "0",
        .category = FIO_OPT_C_ENGINE,
        .group = FIO_OPT_G_INVALID,
    },
    {
        .name = "ibnbd_poll_runnable",
        .lname = "IBNBD run queue check",
        .type = FIO_OPT_BOOL,
        .off1 = offsetof(EngineOptions, poll_runnable),
        .help = "ibnbd_poll=adaptive samples the run queue (/proc/loadavg) and the CPU pressure "
                "(/proc/pressure/cpu) and blocks while the other runnable tasks leave no CPU idle "
                "or tasks wait for a CPU (0: only preempted spins, misses and the cost comparison "
                "make it block)",
        .def = "1",
        .category = FIO_OPT_C_ENGINE,
        .group = FIO_OPT_G_INVALID,
    },
    {
        .name = "ibnbd_reap",
        .lname = "IBNBD completion reaping",
        .type = FIO_OPT_STR_STORE,
        .off1 = offsetof(EngineOptions, reap),
        .help = "Who runs completions: caller (getevents polls the connection itself; "
                "default) or thread (transport IO threads, handed over through a futex)",
        .category = FIO_OPT_C_ENGINE,
        .group = FIO_OPT_G_INVALID,
    },
    {
        .name = "ibnbd_standby_paths",
        .lname = "IBNBD standby paths",
        .type = FIO_OPT_STR_STORE,
        .off1 = offsetof(EngineOptions, standby_paths),
        .help = "A second server exporting the same store (a gateway of the same RBD image): the "
                "device is mapped through both and fails over to it (client.h, Gateway failover)",
        .category = FIO_OPT_C_ENGINE,
        .group = FIO_OPT_G_INVALID,
    },
    {
        .name = "ibnbd_host_key",
        .lname = "IBNBD host key file",
        .type = FIO_OPT_STR_STORE,
        .off1 = offsetof(EngineOptions, host_key),
        .help = "Key file to authenticate with (ibnbd key generate; mode 0600); none: anonymous, "
                "which only a server with allow_any_host admits",
        .category = FIO_OPT_C_ENGINE,
        .group = FIO_OPT_G_INVALID,
    },
    {},  // the end of the table
};

std::vector<std::string> split_paths(std::string_view text) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i < text.size()) {
    size_t j = text.find_first_of(", \t", i);
    if (j == std::string_view::npos) j = text.size();
    if (j > i) out.emplace_back(text.substr(i, j - i));
    i = j + 1;
  }
  return out;
}

// What the options say, checked once; errors carry the text fio prints.
struct Config {
  ibnbd::BlockSessionOptions session;
  std::vector<ibtrs::PathSpec> standby;  // ibnbd_standby_paths: a failover device
  std::string device;
  ibnbd::AccessMode mode = ibnbd::AccessMode::ro;
  bool reap_caller = true;
  bool adaptive = true;
};

int make_config(thread_data* td, const std::string& name, Config& out) {
  const auto* o = static_cast<const EngineOptions*>(td->eo);
  if (o->paths == nullptr || o->device == nullptr) {
    log_err("ibnbd: ibnbd_paths and ibnbd_device are required\n");
    return EINVAL;
  }
  for (const auto& p : split_paths(o->paths)) {
    auto spec = ibtrs::PathSpec::parse(p);
    if (!spec) {
      log_err("ibnbd: bad path '%s': %s\n", p.c_str(), spec.error().message().c_str());
      return EINVAL;
    }
    out.session.transport.paths.push_back(*spec);
  }
  if (out.session.transport.paths.empty()) {
    log_err("ibnbd: ibnbd_paths names no path\n");
    return EINVAL;
  }
  if (o->standby_paths != nullptr) {
    for (const auto& p : split_paths(o->standby_paths)) {
      auto spec = ibtrs::PathSpec::parse(p);
      if (!spec) {
        log_err("ibnbd: bad standby path '%s': %s\n", p.c_str(), spec.error().message().c_str());
        return EINVAL;
      }
      out.standby.push_back(*spec);
    }
  }
  if (o->policy != nullptr) {
    auto pol = ibtrs::parse_mp_policy(o->policy);
    if (!pol) {
      log_err("ibnbd: bad ibnbd_policy '%s'\n", o->policy);
      return EINVAL;
    }
    out.session.transport.policy = *pol;
  }
  // A job that writes or trims needs rw; a read-only job maps ro so that it can run next to a
  // writer (the server allows one rw open per device).
  out.mode = (td_write(td) || td_trim(td)) ? ibnbd::AccessMode::rw : ibnbd::AccessMode::ro;
  if (o->mode != nullptr) {
    auto m = ibnbd::parse_access_mode(o->mode);
    if (!m) {
      log_err("ibnbd: bad ibnbd_mode '%s' (ro, rw, migration)\n", o->mode);
      return EINVAL;
    }
    out.mode = *m;
  }
  if (o->reap != nullptr) {
    const std::string_view r = o->reap;
    if (r != "caller" && r != "thread") {
      log_err("ibnbd: bad ibnbd_reap '%s' (caller, thread)\n", o->reap);
      return EINVAL;
    }
    out.reap_caller = r == "caller";
  }
  if (o->poll != nullptr) {
    const std::string_view m = o->poll;
    if (m != "adaptive" && m != "block") {
      log_err("ibnbd: bad ibnbd_poll '%s' (adaptive, block)\n", o->poll);
      return EINVAL;
    }
    out.adaptive = m == "adaptive";
  }
  if (o->host_key != nullptr) {
    std::string why;
    auto a = ibtrs::client_auth_from_key_file(o->host_key, {}, &why);
    if (!a) {
      log_err("ibnbd: ibnbd_host_key: %s\n", why.c_str());
      return a.error().value();
    }
    out.session.transport.auth = std::move(*a);
  }
  out.session.transport.session_name = name;
  out.session.transport.io_threads = o->io_threads;
  out.device = o->device;
  return 0;
}

// ---- per-job state --------------------------------------------------------------------------

struct Engine;

// One per io_u (by fio's io_u->index, 0..iodepth-1): the context of its request and its link in
// the completion stack, so that completing allocates nothing and takes no lock.
struct Node {
  Engine* e = nullptr;
  io_u* u = nullptr;
  Node* next = nullptr;
};

struct Engine {
  std::string base_name;  // session name prefix, fixed in setup (before any fork)
  std::unique_ptr<ibnbd::BlockSession> session;
  std::unique_ptr<ibnbd::BlockSession> standby;  // ibnbd_standby_paths: the failover's second
  std::shared_ptr<ibnbd::RemoteDevice> dev;
  std::unique_ptr<ibtrs::RegisteredMemory> buffers;  // fio's IO buffers when registered
  std::unique_ptr<std::byte[]> plain_buffers;        // the fallback: every IO copies
  std::chrono::microseconds poll{0};
  // ibnbd_reap=caller: the job thread's reaper (destroyed before the session).
  std::unique_ptr<ibtrs::CompletionReaper> reaper;

  std::unique_ptr<Node[]> nodes;  // iodepth of them
  unsigned int nnodes = 0;
  std::vector<io_u*> pending;  // queued, submitted by the next commit (job thread only)

  // Completions: pushed by transport threads (newest first), taken by getevents.
  std::atomic<Node*> done{nullptr};
  // getevents sleeps (or is about to): kSleepFutex on `word`, kSleepReaper in the reaper.
  std::atomic<uint32_t> sleeping{0};
  std::atomic<uint32_t> word{0};      // futex word, bumped by a completion that wakes it
  // Job thread only: completions taken off the stack, oldest first, not yet handed to fio
  // (ready[ready_head..]); and what the last getevents handed over, read by ->event.
  std::vector<io_u*> ready;
  size_t ready_head = 0;
  std::vector<io_u*> events;

  // Job thread only: whether waits reap (caller mode, and the reaper has not refused).
  bool reaper_ok = false;
  bool reaping() const { return reaper_ok; }

  // ibnbd_poll=adaptive (job thread only).
  bool adaptive = false;
  ibtrs::HybridPoll policy;
  int64_t policy_gap_ns = ibtrs::HybridPollConfig{}.preempt_gap_ns;
  std::unique_ptr<ibtrs::CpuLoadSampler> load;  // adaptive mode: run queue, CPU pressure
  int64_t last_wait_end = 0;  // for the time per completion
  size_t taken = 0;           // completions taken off the stack since then
  int old_timer_slack = -1;   // restored at cleanup
  struct Stats {
    uint64_t waits = 0;
    uint64_t reason[ibtrs::kBlockReasons] = {};  // by BlockReason (none: a hybrid wait)
    uint64_t end[3] = {};  // hybrid waits by WaitEnd
    uint64_t preempted = 0;
  };
  std::unique_ptr<Stats> stats;  // ibnbd_poll_stats
};

constexpr uint32_t kSleepFutex = 1;
constexpr uint32_t kSleepReaper = 2;

Engine* engine_of(thread_data* td) { return static_cast<Engine*>(td->io_ops_data); }

long futex(std::atomic<uint32_t>* w, int op, uint32_t val, const timespec* rel) {
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(w), op, val, rel, nullptr, 0);
}

// The engine whose getevents is reaping on this thread: its completions need no wake-up.
thread_local const Engine* t_reaping = nullptr;

// Runs on a transport thread (or the session's control thread), or on the job thread inside
// its reap: one CAS, and a wake-up only when getevents sleeps on another thread's account.
// seq_cst pairs with getevents: either its look at the stack sees this push, or this load sees
// it asleep.
void on_done(void* ctx, int err) {
  auto* n = static_cast<Node*>(ctx);
  Engine* e = n->e;
  n->u->error = static_cast<unsigned>(err);
  if (err == 0) n->u->resid = 0;
  Node* head = e->done.load(std::memory_order_relaxed);
  do {
    n->next = head;
  } while (!e->done.compare_exchange_weak(head, n, std::memory_order_seq_cst,
                                          std::memory_order_relaxed));
  if (t_reaping == e) return;
  const uint32_t sleeping = e->sleeping.load(std::memory_order_seq_cst);
  if (sleeping == 0) return;
  if (sleeping == kSleepReaper) {
    e->reaper->wake();
    return;
  }
  e->word.fetch_add(1, std::memory_order_seq_cst);
  futex(&e->word, FUTEX_WAKE_PRIVATE, 1, nullptr);
}

// Moves the completed io_us off the stack to the end of `ready`, oldest first. Returns how many.
size_t take_done(Engine& e) {
  // A load first: an empty look (most of a spin) then leaves the line shared with the pushers.
  if (e.done.load(std::memory_order_seq_cst) == nullptr) return 0;
  Node* n = e.done.exchange(nullptr, std::memory_order_seq_cst);
  if (n == nullptr) return 0;
  if (e.ready_head > 0) {  // drop what was handed over, so that iodepth entries always fit
    e.ready.erase(e.ready.begin(), e.ready.begin() + static_cast<std::ptrdiff_t>(e.ready_head));
    e.ready_head = 0;
  }
  const size_t start = e.ready.size();
  for (; n != nullptr; n = n->next) e.ready.push_back(n->u);  // reserved: at most iodepth
  std::reverse(e.ready.begin() + static_cast<std::ptrdiff_t>(start), e.ready.end());
  e.taken += e.ready.size() - start;
  return e.ready.size() - start;
}

std::string job_session_name(const Engine& e, thread_data* td) {
  return e.base_name + "-" + std::to_string(td->thread_number);
}

// Turns an exception caught at a boundary into an errno for fio.
int caught(thread_data* td, const char* where) {
  try {
    throw;
  } catch (const std::bad_alloc&) {
    td_verror(td, ENOMEM, where);
    return ENOMEM;
  } catch (const std::exception& ex) {
    log_err("ibnbd: %s: %s\n", where, ex.what());
  } catch (...) {
    log_err("ibnbd: %s: unknown exception\n", where);
  }
  td_verror(td, EIO, where);
  return EIO;
}

// What the probe child writes to its pipe: a plain struct, written once (well below PIPE_BUF).
struct ProbeAnswer {
  int err = EIO;
  uint64_t size = 0;
  char what[240] = "probe: no answer";
};

void set_what(ProbeAnswer& a, const std::string& text) {
  std::snprintf(a.what, sizeof a.what, "%s", text.c_str());
}

// Opens a session in a forked child, maps the device ro and sends back its size; returns 0 or
// the errno, with `a.what` saying what failed.
int probe_in_child(Config& cfg, ProbeAnswer& a) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    a.err = errno;
    set_what(a, std::string("probe pipe: ") + std::strerror(a.err));
    return a.err;
  }
  base::UniqueFd rd(fds[0]), wr(fds[1]);
  const pid_t pid = fork();
  if (pid < 0) {
    a.err = errno;
    set_what(a, std::string("probe fork: ") + std::strerror(a.err));
    return a.err;
  }
  if (pid == 0) {
    rd.reset();
    ProbeAnswer out;
    try {
      auto s = ibnbd::BlockSession::open(std::move(cfg.session));
      if (!s) {
        out.err = s.error().value();
        set_what(out, "probe session: " + s.error().message());
      } else if (auto dev = (*s)->map(cfg.device, ibnbd::AccessMode::ro); !dev) {
        out.err = dev.error().value();
        set_what(out, "map " + cfg.device + ": " + dev.error().message());
      } else {
        out.err = 0;
        out.size = (*dev)->size_bytes();
        set_what(out, "");
      }
    } catch (...) {
      set_what(out, "probe: exception");
    }
    // _exit: no atexit handlers or static destructors of fio's in this copy of its process.
    _exit(write(wr.get(), &out, sizeof out) == static_cast<ssize_t>(sizeof out) ? 0 : 1);
  }
  wr.reset();  // the child's copy is the only writer left: its exit ends the read
  ProbeAnswer in;
  ssize_t n;
  do {
    n = read(rd.get(), &in, sizeof in);
  } while (n < 0 && errno == EINTR);
  rd.reset();
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (n != static_cast<ssize_t>(sizeof in)) {
    a.err = EIO;
    set_what(a, "probe child died without an answer (status " + std::to_string(status) + ")");
    return a.err;
  }
  a = in;
  a.what[sizeof a.what - 1] = '\0';
  return a.err;
}

// ---- fio entry points -----------------------------------------------------------------------

int eng_setup(thread_data* td) noexcept {
  try {
    auto* e = engine_of(td);
    if (e == nullptr) {
      e = new Engine;
      td->io_ops_data = e;
      const auto* o = static_cast<const EngineOptions*>(td->eo);
      e->base_name = o->session != nullptr ? std::string(o->session)
                                           : "fio-" + std::to_string(static_cast<long>(getpid()));
    }
    // fio's file stands for the remote device; its name is only a label.
    if (td->files_index == 0) {
      const auto* o = static_cast<const EngineOptions*>(td->eo);
      add_file(td, o->device != nullptr ? o->device : "ibnbd", 0, 0);
      if (td->o.nr_files == 0) td->o.nr_files = 1;
      td->o.open_files++;
    }
    // The probe: map read-only (allowed next to any writer) and take the size.
    Config cfg;
    if (int err = make_config(td, job_session_name(*e, td) + "-probe", cfg); err != 0) {
      td_verror(td, err, "ibnbd options");
      return 1;
    }
    // In a child process of its own: fio calls setup in its parent and forks the jobs after it,
    // and nothing the transport opens survives that fork. librdmacm keeps the device contexts it
    // opened in process-wide state, and the kernel refuses their files to a forked child
    // (ib_safe_file_access: EACCES); the session and path UUIDs come from a thread_local
    // generator seeded on first use, which every job would inherit (same UUIDs, which the server
    // takes for one session). The parent only reads the answer from a pipe.
    ProbeAnswer answer;
    if (int err = probe_in_child(cfg, answer); err != 0) {
      log_err("ibnbd: %s\n", answer.what);
      td_verror(td, err, "ibnbd probe");
      return 1;
    }
    const uint64_t size = answer.size;
    for (unsigned i = 0; i < td->files_index; i++) {
      td->files[i]->real_file_size = size;
      fio_file_set_size_known(td->files[i]);
    }
    return 0;
  } catch (...) {
    caught(td, "ibnbd setup");
    return 1;
  }
}

int eng_init(thread_data* td) noexcept {
  try {
    auto* e = engine_of(td);
    if (e == nullptr) {
      log_err("ibnbd: init without setup\n");
      td_verror(td, EINVAL, "ibnbd init");
      return 1;
    }
    Config cfg;
    if (int err = make_config(td, job_session_name(*e, td), cfg); err != 0) {
      td_verror(td, err, "ibnbd options");
      return 1;
    }
    // The standby's session: the same options but the paths and the name.
    ibnbd::BlockSessionOptions so;
    if (!cfg.standby.empty()) {
      so = cfg.session;
      so.transport.paths = cfg.standby;
      so.transport.session_name += "-standby";
    }
    auto s = ibnbd::BlockSession::open(std::move(cfg.session));
    if (!s) {
      log_err("ibnbd: session open: %s\n", s.error().message().c_str());
      td_verror(td, s.error().value(), "ibnbd session open");
      return 1;
    }
    e->session = std::move(*s);
    ibtrs::Result<std::shared_ptr<ibnbd::RemoteDevice>> dev = ibtrs::errc(EINVAL);
    if (cfg.standby.empty()) {
      dev = e->session->map(cfg.device, cfg.mode);
    } else {
      auto sb = ibnbd::BlockSession::open(std::move(so));
      if (!sb) {
        log_err("ibnbd: standby session open: %s\n", sb.error().message().c_str());
        td_verror(td, sb.error().value(), "ibnbd standby session open");
        return 1;
      }
      e->standby = std::move(*sb);
      dev = ibnbd::map_failover(*e->session, *e->standby, cfg.device, cfg.mode);
    }
    if (!dev) {
      log_err("ibnbd: map %s (%s): %s\n", cfg.device.c_str(),
              std::string(ibnbd::to_string(cfg.mode)).c_str(), dev.error().message().c_str());
      td_verror(td, dev.error().value(), "ibnbd map");
      return 1;
    }
    e->dev = std::move(*dev);
    e->poll = std::chrono::microseconds(static_cast<const EngineOptions*>(td->eo)->poll_us);
    if (cfg.reap_caller) {
      // init runs on the job thread, which submits and reaps from here on.
      auto r = e->session->transport().make_reaper();
      if (r) {
        e->reaper = std::move(*r);
        e->reaper_ok = true;
      } else if (r.error() == std::errc::device_or_resource_busy) {
        // Another thread of this process reaps the same connection: completions stay on the
        // IO threads (correct either way, only slower).
        log_info("ibnbd: ibnbd_reap=caller: %s, using thread mode\n",
                 r.error().message().c_str());
      } else {
        log_err("ibnbd: ibnbd_reap=caller: %s\n", r.error().message().c_str());
        td_verror(td, r.error().value(), "ibnbd reaper");
        return 1;
      }
    }
    const auto* o = static_cast<const EngineOptions*>(td->eo);
    e->adaptive = cfg.adaptive && o->poll_us == 0;
    if (e->adaptive) {
      // The sleeps are short timed waits: with the default 50 us timer slack a 20 us sleep
      // could last 70. The job thread's slack goes back at cleanup.
      e->old_timer_slack = ::prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
      ::prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
      // ibnbd_poll_runnable=0: neither the run queue nor the CPU pressure is looked at.
      e->load = std::make_unique<ibtrs::CpuLoadSampler>(o->poll_runnable != 0,
                                                              o->poll_runnable != 0);
    }
    if (o->poll_stats) e->stats = std::make_unique<Engine::Stats>();
    // fio numbers its io_us 0..iodepth-1 (io_u->index); at most iodepth requests are out at
    // once, so with room reserved for that many nothing allocates per IO.
    e->nnodes = td->o.iodepth;
    e->nodes = std::make_unique<Node[]>(e->nnodes);
    e->pending.reserve(e->nnodes);
    e->ready.reserve(e->nnodes);
    e->events.reserve(e->nnodes);
    return 0;
  } catch (...) {
    caught(td, "ibnbd init");
    return 1;
  }
}

void eng_cleanup(thread_data* td) noexcept {
  auto* e = engine_of(td);
  if (e == nullptr) return;
  if (e->stats) {
    const auto& st = *e->stats;
    const auto& r = st.reason;
    // stderr: fio's log_info of a job process does not reach a JSON run's output.
    std::fprintf(stderr,
                 "ibnbd: %llu waits: hybrid %llu (slept %llu, spun %llu, spin missed %llu, "
                 "preempted %llu); blocked: learning %llu, probe %llu, contended %llu, after "
                 "preemption %llu, after misses %llu, no gain %llu (%llu verdicts), CPU pressure "
                 "%llu (%llu back-offs, last stall %.0f %%); expected "
                 "%lld us, sleep share %.2f, timer late %lld us; ns per IO: hybrid %lld, blocking %lld\n",
                 (unsigned long long)st.waits, (unsigned long long)r[0],
                 (unsigned long long)st.end[0], (unsigned long long)st.end[1],
                 (unsigned long long)st.end[2], (unsigned long long)st.preempted,
                 (unsigned long long)r[1], (unsigned long long)r[2], (unsigned long long)r[3],
                 (unsigned long long)r[4], (unsigned long long)r[5], (unsigned long long)r[6],
                 (unsigned long long)e->policy.no_gain_verdicts(),
                 (unsigned long long)r[static_cast<size_t>(ibtrs::BlockReason::pressure)],
                 (unsigned long long)e->policy.pressure_backoffs(), e->policy.stall() * 100,
                 (long long)(e->policy.expected_ns() / 1000), e->policy.sleep_share(),
                 (long long)(e->policy.oversleep_ns() / 1000),
                 (long long)e->policy.hybrid_cost_ns(), (long long)e->policy.block_cost_ns());
  }
  if (e->old_timer_slack > 0)
    ::prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(e->old_timer_slack), 0, 0, 0);
  try {
    // The reaper, the device and the registration before the session: it must outlive them.
    e->reaper.reset();
    if (e->dev && e->dev->failover()) (void)ibnbd::unmap_failover(*e->dev, ibnbd::UnmapMode::force);
    e->dev.reset();
    e->buffers.reset();
    e->standby.reset();
    e->session.reset();
  } catch (...) {
    caught(td, "ibnbd cleanup");
  }
  delete e;
  td->io_ops_data = nullptr;
}

int eng_iomem_alloc(thread_data* td, size_t size) noexcept {
  try {
    auto* e = engine_of(td);
    if (e == nullptr || !e->session) return 1;
    // Through the device: a failover device's memory is registered with both its sessions.
    auto mem = e->dev ? e->dev->alloc_buffer(size) : e->session->alloc_buffer(size);
    if (mem) {
      e->buffers = std::move(*mem);
      td->orig_buffer = reinterpret_cast<char*>(e->buffers->data());
      return 0;
    }
    log_info("ibnbd: registering %zu bytes of IO buffers failed (%s): IO copies\n", size,
             mem.error().message().c_str());
    e->plain_buffers.reset(new (std::nothrow) std::byte[size]);
    if (!e->plain_buffers) return 1;
    td->orig_buffer = reinterpret_cast<char*>(e->plain_buffers.get());
    return 0;
  } catch (...) {
    caught(td, "ibnbd iomem_alloc");
    return 1;
  }
}

void eng_iomem_free(thread_data* td) noexcept {
  auto* e = engine_of(td);
  if (e == nullptr) return;
  e->buffers.reset();
  e->plain_buffers.reset();
}

// The registration covering [p, p + len), or nullptr (then the copying variants are used).
const ibtrs::RegisteredMemory* registration_of(const Engine& e, const void* p, size_t len) {
  if (!e.buffers) return nullptr;
  const auto* b = e.buffers->data();
  const auto* q = static_cast<const std::byte*>(p);
  return (q >= b && q + len <= b + e.buffers->size()) ? e.buffers.get() : nullptr;
}

// Sends one io_u; 0, or the errno of a refusal (the callback then never runs).
int submit_one(Engine* e, io_u* u) {
  Node* n = &e->nodes[u->index];
  n->e = e;
  n->u = u;
  const ibnbd::IoDone done{on_done, n};
  const uint64_t off = u->offset;
  const auto len = static_cast<size_t>(u->xfer_buflen);
  ibtrs::Status st;
  try {
    switch (u->ddir) {
      case DDIR_READ:
      case DDIR_WRITE: {
        const auto* mem = registration_of(*e, u->xfer_buf, len);
        auto* p = static_cast<std::byte*>(u->xfer_buf);
        if (mem != nullptr) {
          const ibtrs::IoSeg seg{u->xfer_buf, static_cast<uint32_t>(len), mem};
          st = u->ddir == DDIR_READ ? e->dev->read(off, {&seg, 1}, done)
                                    : e->dev->write(off, {&seg, 1}, 0, done);
        } else {
          st = u->ddir == DDIR_READ ? e->dev->read_copy(off, {p, len}, done)
                                    : e->dev->write_copy(off, {p, len}, 0, done);
        }
        break;
      }
      case DDIR_SYNC:
      case DDIR_DATASYNC:
        st = e->dev->flush(done);
        break;
      case DDIR_TRIM:
        st = e->dev->discard(off, len, done);
        break;
      default:
        st = ibtrs::errc(EINVAL);
        break;
    }
  } catch (const std::bad_alloc&) {
    st = ibtrs::errc(ENOMEM);
  } catch (...) {
    st = ibtrs::errc(EIO);
  }
  return st ? 0 : st.error().value();
}

fio_q_status eng_queue(thread_data* td, io_u* u) noexcept {
  fio_ro_check(td, u);
  auto* e = engine_of(td);
  if (u->index >= e->nnodes) {  // fio never numbers beyond iodepth; refuse rather than overrun
    u->error = EINVAL;
    return FIO_Q_COMPLETED;
  }
  e->pending.push_back(u);  // reserved: at most iodepth
  return FIO_Q_QUEUED;
}

// Submits what queue kept, in one submission batch. A request the library refuses completes
// at once with its errno (fio already counts it as queued, so it comes back through getevents).
int eng_commit(thread_data* td) noexcept {
  auto* e = engine_of(td);
  if (e->pending.empty()) return 0;
  e->dev->begin_batch();  // the session the device sends on (a failover device's active one)
  for (io_u* u : e->pending) {
    if (int err = submit_one(e, u); err != 0) on_done(&e->nodes[u->index], err);
  }
  e->dev->end_batch();
  io_u_mark_submit(td, static_cast<unsigned int>(e->pending.size()));
  e->pending.clear();
  return 0;
}

using Clock = std::chrono::steady_clock;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

size_t have(const Engine& e) { return e.ready.size() - e.ready_head; }

// A non-blocking look for completions: caller mode reaps the connection (on tcp a readv),
// thread mode looks at the stack. When the reaper refuses (the session is closing), thread mode
// (the stack, the futex) takes over for good.
void look(Engine& e) {
  if (e.reaping()) {
    t_reaping = &e;
    e.reaper_ok = e.reaper->reap(std::chrono::microseconds(0)).ok();
    t_reaping = nullptr;
  }
  take_done(e);
}

// Blocks until a completion arrives or `ns` pass (kForever: with no timeout, so no timer to
// arm and cancel): caller mode in the connection's fd (a completion on another thread wakes it
// through on_done), thread mode on the futex. Spurious returns are fine: the caller looks again.
constexpr int64_t kForever = -1;
void block_for(Engine& e, int64_t ns) {
  const bool forever = ns == kForever;
  ns = std::max<int64_t>(ns, 1000);
  // Announce the sleep first, so that a completion on another thread wakes us; seq_cst pairs
  // with on_done: either our look at the stack sees its push, or its load sees us asleep.
  const bool reap = e.reaping();
  e.sleeping.store(reap ? kSleepReaper : kSleepFutex, std::memory_order_seq_cst);
  const uint32_t w = e.word.load(std::memory_order_seq_cst);
  if (take_done(e) > 0) {
    e.sleeping.store(0, std::memory_order_seq_cst);
    return;
  }
  if (reap) {
    t_reaping = &e;
    // A refusal (the session is closing) sends this and every later wait to the futex.
    const auto wait = forever ? (std::chrono::microseconds::max)()
                              : std::chrono::microseconds((ns + 999) / 1000);
    e.reaper_ok = e.reaper->reap(wait).ok();
    t_reaping = nullptr;
  } else {
    const timespec rel{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    // EAGAIN, EINTR, ETIMEDOUT: look again
    futex(&e.word, FUTEX_WAIT_PRIVATE, w, forever ? nullptr : &rel);
  }
  e.sleeping.store(0, std::memory_order_seq_cst);
  take_done(e);
}

// Waits until `min` completions are ready or `t` passes, as the plan says: sleep (a blocking
// wait with a timeout, which a completion ends early), spin (non-blocking looks), then block.
void wait_for(Engine* e, size_t min, const timespec* t) {
  const int64_t start = now_ns();
  const int64_t deadline =
      t != nullptr ? start + t->tv_sec * 1000000000LL + t->tv_nsec : INT64_MAX;
  ibtrs::WaitPlan plan;
  if (e->poll.count() > 0) {
    plan.spin_ns = e->poll.count() * 1000;  // ibnbd_poll_us: a fixed spin, no sleep
  } else if (e->adaptive) {
    e->load->maybe_sample(start, e->policy);
    plan = e->policy.plan(start);
  }
  ibtrs::WaitOutcome out;
  int64_t now = start;
  const auto done = [&] { return have(*e) >= min; };
  if (plan.sleep_ns > 0) {
    block_for(*e, std::min<int64_t>(plan.sleep_ns, deadline - now));
    now = now_ns();
    // A sleep that ran its length tells how late the timer wakes us.
    if (now - start >= plan.sleep_ns) out.woke_ns = now - start;
    if (done()) out.end = ibtrs::WaitEnd::slept;
  }
  if (!done() && plan.spin_ns > 0) {
    const int64_t spin_end = std::min<int64_t>(start + plan.spin_ns, deadline);
    int64_t last = now;
    for (;;) {
      look(*e);
      now = now_ns();
      if (now - last > e->policy_gap_ns) out.preempted = true;
      last = now;
      if (done()) {
        out.end = ibtrs::WaitEnd::spun;
        break;
      }
      if (now >= spin_end) break;
      if (!e->reaping()) __builtin_ia32_pause();  // thread mode: the stack is only memory
    }
  }
  while (!done() && now < deadline) {
    block_for(*e, t != nullptr ? deadline - now : kForever);
    now = now_ns();
  }
  if (!e->adaptive || e->poll.count() > 0) return;
  out.wait_ns = now - start;
  if (e->last_wait_end > 0 && e->taken > 0)
    out.cost_ns = (now - e->last_wait_end) / static_cast<int64_t>(e->taken);
  e->last_wait_end = now;
  e->taken = 0;
  e->policy.record(plan, out, now);
  if (e->stats) {
    auto& st = *e->stats;
    ++st.waits;
    ++st.reason[static_cast<size_t>(e->policy.last_reason())];
    if (plan.hybrid()) ++st.end[static_cast<size_t>(out.end)];
    if (out.preempted) ++st.preempted;
  }
}

int getevents(Engine* e, unsigned int min, unsigned int max, const timespec* t) {
  take_done(*e);
  if (have(*e) < min) {
    wait_for(e, min, t);
  } else if (e->reaping() && min == 0 && have(*e) < max) {
    // fio only looks: what arrived is still in the connection until someone reaps it.
    look(*e);
  }
  // Hand over at most `max`, oldest first; the rest stays for the next call. Every vector holds
  // at most iodepth entries (reserved in init), so nothing here allocates.
  const size_t n = std::min<size_t>(max, have(*e));
  const auto first = e->ready.begin() + static_cast<std::ptrdiff_t>(e->ready_head);
  e->events.assign(first, first + static_cast<std::ptrdiff_t>(n));
  e->ready_head += n;
  if (e->ready_head == e->ready.size()) {
    e->ready.clear();
    e->ready_head = 0;
  }
  return static_cast<int>(n);
}

int eng_getevents(thread_data* td, unsigned int min, unsigned int max, const timespec* t) noexcept {
  return getevents(engine_of(td), min, max, t);
}

io_u* eng_event(thread_data* td, int i) noexcept { return engine_of(td)->events[static_cast<size_t>(i)]; }

// The device is opened by init; fio's per-file hooks have nothing left to do (fio calls
// open_file without checking for NULL).
int eng_open_file(thread_data*, fio_file*) noexcept { return 0; }
int eng_close_file(thread_data*, fio_file*) noexcept { return 0; }

ioengine_ops make_ops() {
  ioengine_ops ops{};
  ops.name = "ibnbd";
  ops.version = FIO_IOOPS_VERSION;
  // DISKLESSIO: the "file" is a remote device, not a path; NOEXTEND: its size is the device's;
  // NODISKUTIL: no local disk to sample.
  ops.flags = FIO_DISKLESSIO | FIO_NOEXTEND | FIO_NODISKUTIL;
  ops.setup = eng_setup;
  ops.init = eng_init;
  ops.queue = eng_queue;
  ops.commit = eng_commit;
  ops.getevents = eng_getevents;
  ops.event = eng_event;
  ops.cleanup = eng_cleanup;
  ops.open_file = eng_open_file;
  ops.close_file = eng_close_file;
  ops.iomem_alloc = eng_iomem_alloc;
  ops.iomem_free = eng_iomem_free;
  ops.option_struct_size = sizeof(EngineOptions);
  ops.options = g_options;
  return ops;
}

ioengine_ops g_ops = make_ops();

}  // namespace

// fio looks this up by name (C++ engines cannot easily export a C ops struct under the engine's
// file name); the only symbol the .so exports.
extern "C" __attribute__((visibility("default"))) void get_ioengine(ioengine_ops** ops) {
  *ops = &g_ops;
}
