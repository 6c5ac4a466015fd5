// Adaptive hybrid polling for a thread that waits for its own completions (the fio engine's
// getevents) or for the next request (a server IO poller, HybridPollConfig::server()). Part of
// what the transport offers its users (PollMode::adaptive is this policy): header only and
// inline, since every wait of a poller plans and records through it.
// Models: io_uring's hybrid IOPOLL (sleep for part of the expected completion time,
// then poll) and NAPI busy-poll budgets (spin within a bound, then sleep).
//
// A blocking wait pays a wake-up when the completion arrives, and on a virtual machine's idle
// vCPU that wake-up is a large part of a 4 KiB round trip. Spinning avoids it but burns the CPU,
// and on a contended host it takes the CPU the other side needs. The hybrid wait learns when
// completions arrive (an EWMA of the time from the start of a wait to its first completion, from
// the waits that saw it arrive while spinning), sleeps for a share of that (a blocking wait with
// a timeout, which a completion still ends: never later than a plain blocking wait), then spins
// within a budget, then blocks. It falls back to blocking:
//   - while the CPU is contended: the other runnable tasks leave no CPU idle (sampled by the
//     caller, e.g. from /proc/loadavg), or spins are often preempted (a long gap between two of
//     their iterations);
//   - while tasks wait for a CPU (the kernel's CPU pressure, PSI "some", over a sample interval
//     above max_stall): the spinner may hold the CPU they wait for, which neither of the above
//     sees when the waiting tasks sit on the other CPUs' run queues (two vCPUs of a VM, the
//     spinner on one, a client's threads queued on the other). This back-off doubles while the
//     pressure recurs and shrinks after intervals in which spins cost nobody a CPU;
//   - when spins keep missing (completions do not come within the budget);
//   - when it does not pay: one wait in probe_every blocks anyway, and hybrid waits must not
//     cost more per completion than those blocking ones (beyond max_loss).
// Each fall-back lasts a back-off period, doubled while the reason recurs (up to 1 s), and
// short again after a period in which hybrid waits paid.
//
// The server's poller (core/poller.cc) waits for the next request rather than for a completion
// it knows is due: nothing is due while its clients are idle. It plans a wait only after a pass
// that found work, never sleeps before spinning (a timer wake-up is what spinning saves), learns
// the gap from blocking waits too (they are all it sees while it does not spin), and blocks
// (BlockReason::idle) while the expected gap is beyond its spin cap: an idle or slow client.
//
// A pure policy: no clock, no system call; the caller passes times (ns on a monotonic clock) and
// observations, so that tests drive it. One instance per waiting thread; not thread-safe.
// (std::min) and friends are parenthesized: fio's headers define min/max macros.
#pragma once

#include <algorithm>
#include <cstdint>

namespace ibtrs {

struct HybridPollConfig {
  int64_t max_spin_ns = 100'000;   // one wait spins at most this long after its sleep
  int64_t min_sleep_ns = 10'000;   // a shorter sleep is not worth a timer: spin from the start
  // Spin slack beyond the expected arrival (NAPI busy-poll budgets are some 50 us): completions
  // of a QD32 stream come in bursts around a short average.
  int64_t min_spin_ns = 20'000;
  int64_t preempt_gap_ns = 50'000; // a spin iteration this long: another task had our CPU
  uint32_t miss_limit = 3;         // consecutive spins without a completion before backing off
  // Preempted spins back off when they come often: each adds preempt_weight to a score that
  // every clean hybrid wait lowers by one, and a score above preempt_limit backs off (with the
  // defaults: a third preempted spin within ~32 waits). One hiccup (an interrupt, the
  // hypervisor) does not.
  uint32_t preempt_weight = 16;
  uint32_t preempt_limit = 32;
  int64_t backoff_min_ns = 10'000'000;     // 10 ms
  int64_t backoff_max_ns = 1'000'000'000;  // 1 s
  uint32_t probe_every = 32;       // one wait in this many blocks, to compare against
  // Hybrid waits may cost at most this share more per completion than blocking ones. The
  // averages are noisy on a loaded host (one sample per wait, a probe in 32): demanding a clear
  // gain would back off on noise, so only a loss counts.
  double max_loss = 0.03;
  uint32_t min_samples = 16;       // of each kind before the comparison counts
  // CPU pressure above this share of a sample interval backs off (bench/fio.sh's stall column:
  // 1-3 % while our waits spin on a quiet 2-core host, 20-50 % beside nbdkit's thread pool).
  double max_stall = 0.10;
  // Blocking waits feed the arrival estimate always, not only while it learns (a wake-up late:
  // an overestimate, but the only samples while the policy blocks).
  bool learn_from_blocking = false;
  // Block while the expected arrival is beyond max_spin_ns, rather than sleep most of it.
  bool block_beyond_cap = false;

  // A server IO poller: spin right after a pass that found requests (no sleep: min_sleep_ns
  // unreachable), at most 100 us (NAPI's busy-poll budgets are some 50 us; the gap it learns
  // is a whole QD1 round trip, ~45 us on loopback here, since the backend's IO completions
  // fall inside it), and not at all while its clients are idle or slower than that.
  static constexpr HybridPollConfig server() {
    HybridPollConfig c;
    c.max_spin_ns = 100'000;
    c.min_sleep_ns = INT64_MAX;
    c.learn_from_blocking = true;
    c.block_beyond_cap = true;
    return c;
  }
};

// How a wait goes: sleep (a blocking wait with a timeout) for sleep_ns, then spin until spin_ns
// after the start, then block. spin_ns == 0: block from the start.
struct WaitPlan {
  int64_t sleep_ns = 0;
  int64_t spin_ns = 0;
  bool hybrid() const { return spin_ns > 0; }
};

// Where a wait saw the completions it waited for.
enum class WaitEnd : uint8_t {
  slept,    // during the sleep (a completion woke it: a wake-up paid, as blocking pays)
  spun,     // while spinning: no wake-up
  blocked,  // in the final blocking wait (for a hybrid plan: the spin budget ran out)
};

struct WaitOutcome {
  WaitEnd end = WaitEnd::blocked;
  int64_t wait_ns = 0;     // from the start of the wait to the completions
  bool preempted = false;  // a spin iteration took longer than preempt_gap_ns
  // When a sleep that ran its full length ended (from the start of the wait; -1: no sleep, or
  // a completion cut it short). How late the timer wakes us: plans sleep that much less.
  int64_t woke_ns = -1;
  // Time per completion of the cycle this wait ended (since the previous wait ended, the
  // caller's own work included); 0: unknown (no sample).
  int64_t cost_ns = 0;
};

// Why a plan blocks (statistics and tests). none: a hybrid plan.
// idle: the expected arrival is beyond the spin cap (block_beyond_cap).
// pressure: tasks waited for a CPU (observe_pressure).
enum class BlockReason : uint8_t { none, learning, probe, contended, preempted, misses, no_gain, idle, pressure };
constexpr int kBlockReasons = 9;
// Their names in statistics, by value.
inline constexpr const char* kBlockReasonNames[kBlockReasons] = {
    "none", "learning", "probe", "contended", "preempted", "misses", "no_gain", "idle", "pressure"};

class HybridPoll {
 public:
  explicit HybridPoll(HybridPollConfig cfg = {}) : cfg_(cfg) {}

  // The plan for a wait that starts at `now_ns`.
  WaitPlan plan(int64_t now_ns) {
    reason_ = decide(now_ns);
    if (reason_ != BlockReason::none) return {};
    spun_since_sample_ = true;
    const int64_t e = expected_ns();
    // Wake at share_ of the expected arrival: sleep that long less the timer's lateness.
    int64_t sleep = static_cast<int64_t>(static_cast<double>(e) * share_) - oversleep_.v;
    if (sleep < cfg_.min_sleep_ns) sleep = 0;
    // Spin past the expected arrival by half of it (at least min_spin_ns), within the cap.
    const int64_t spin_end = e + (std::max)(e / 2, cfg_.min_spin_ns);
    const int64_t spin = std::clamp(spin_end - sleep, cfg_.min_spin_ns, cfg_.max_spin_ns);
    return {sleep, sleep + spin};
  }

  // What happened in the wait planned by `p` (the last plan()), which ended at `now_ns`.
  void record(const WaitPlan& p, const WaitOutcome& o, int64_t now_ns) {
    if (o.cost_ns > 0) {
      if (p.hybrid()) {
        hybrid_cost_.add(o.cost_ns, 5);
      } else {
        block_cost_.add(o.cost_ns, 4);
      }
    }
    if (p.sleep_ns > 0 && o.woke_ns >= 0) oversleep_.add(o.woke_ns - p.sleep_ns, 3);
    if (!p.hybrid()) {
      // A blocking wait sees the completion a wake-up late: it only seeds the estimate.
      if (cfg_.learn_from_blocking || arrival_.n < cfg_.min_samples) arrival_.add(o.wait_ns, 3);
      return;
    }
    if (o.preempted) {
      preempt_score_ += cfg_.preempt_weight;
      if (preempt_score_ > cfg_.preempt_limit) {
        back_off(now_ns, BlockReason::preempted);
        return;
      }
    } else if (preempt_score_ > 0) {
      --preempt_score_;
    }
    switch (o.end) {
      case WaitEnd::slept:
        // It came while we slept, or while the timer woke us: sleep less next time.
        misses_ = 0;
        share_ = (std::max)(0.0, share_ - 0.125);
        break;
      case WaitEnd::spun: {
        misses_ = 0;
        arrival_.add(o.wait_ns, 3);  // seen as it came: the estimate's real samples
        // Woken well before it came: sleep a little longer next time.
        if (o.wait_ns - p.sleep_ns > expected_ns() / 4)
          share_ = (std::min)(kMaxShare, share_ + 1.0 / 32);
        break;
      }
      case WaitEnd::blocked:
        arrival_.add(o.wait_ns, 3);  // after the spin: at least this late
        if (++misses_ >= cfg_.miss_limit) {
          back_off(now_ns, BlockReason::misses);
          return;
        }
        break;
    }
    switch (pays()) {
      case Verdict::no:
        ++no_gain_verdicts_;
        back_off(now_ns, BlockReason::no_gain);
        break;
      case Verdict::yes:
        backoff_ns_ = 0;  // a period that paid: the next back-off starts short again
        break;
      case Verdict::unknown:
        break;
    }
  }

  // The other runnable tasks (the system's runnable count minus the calling thread) and the
  // CPUs they share, sampled every few ms. Contended while their average leaves no CPU idle for
  // a spinner: above cpus - 0.25 (a QD32 stream keeps the server's thread runnable nearly all
  // the time: 1 other task, with bursts, on 2 CPUs is not contention).
  void observe_runnable(double others, uint32_t cpus) {
    runnable_.add(static_cast<int64_t>(others * 1000), 2);
    contended_ = static_cast<double>(runnable_.v) / 1000 > static_cast<double>(cpus) - 0.25;
  }

  // The share of the last sample interval (at most a few ms, ending at `now_ns`) in which some
  // task waited for a CPU. Above max_stall: block for a back-off period of its own, doubled
  // while the pressure recurs (up to backoff_max_ns) whether or not this waiter spun (pressure
  // while it blocks is someone else's load: blocking is right then too); halved after an
  // interval in which it spun and the pressure stayed low.
  void observe_pressure(double stall, int64_t now_ns) {
    const bool spun = spun_since_sample_;
    spun_since_sample_ = false;
    stall_ = stall;
    if (stall > cfg_.max_stall) {
      pressure_ns_ = std::clamp(pressure_ns_ * 2, cfg_.backoff_min_ns, cfg_.backoff_max_ns);
      if (now_ns + pressure_ns_ > backoff_until_) {
        backoff_until_ = now_ns + pressure_ns_;
        backoff_reason_ = BlockReason::pressure;
      }
      hybrid_cost_ = {};
      misses_ = 0;
      preempt_score_ = 0;
      ++pressure_backoffs_;
    } else if (spun) {
      pressure_ns_ /= 2;
    }
  }

  // Statistics and tests.
  BlockReason last_reason() const { return reason_; }
  double stall() const { return stall_; }
  int64_t pressure_backoff_ns() const { return pressure_ns_; }
  uint64_t pressure_backoffs() const { return pressure_backoffs_; }
  int64_t expected_ns() const { return arrival_.v; }
  int64_t oversleep_ns() const { return oversleep_.v; }
  double sleep_share() const { return share_; }
  bool contended() const { return contended_; }
  int64_t hybrid_cost_ns() const { return hybrid_cost_.v; }
  int64_t block_cost_ns() const { return block_cost_.v; }
  int64_t backoff_until_ns() const { return backoff_until_; }
  uint64_t no_gain_verdicts() const { return no_gain_verdicts_; }

 private:
  static constexpr double kMaxShare = 0.75;

  // An EWMA with weight 2^-shift, seeded by the first sample. Samples beyond twice the average
  // are clamped, so that one preempted wait on a loaded host does not swing it.
  struct Ewma {
    int64_t v = 0;
    uint32_t n = 0;
    void add(int64_t x, int shift) {
      x = (std::max)(x, int64_t{0});
      if (n++ == 0) {
        v = x;
        return;
      }
      if (v > 0) x = (std::min)(x, 2 * v);
      v += (x - v) / (int64_t{1} << shift);
    }
  };

  enum class Verdict : uint8_t { unknown, yes, no };
  Verdict pays() const {
    if (hybrid_cost_.n < cfg_.min_samples || block_cost_.n < cfg_.min_samples)
      return Verdict::unknown;
    const double limit = static_cast<double>(block_cost_.v) * (1.0 + cfg_.max_loss);
    return static_cast<double>(hybrid_cost_.v) <= limit ? Verdict::yes : Verdict::no;
  }

  BlockReason decide(int64_t now_ns) {
    if (contended_) return BlockReason::contended;
    if (now_ns < backoff_until_) return backoff_reason_;
    if (arrival_.n < cfg_.min_samples) return BlockReason::learning;
    if (cfg_.block_beyond_cap && expected_ns() > cfg_.max_spin_ns) return BlockReason::idle;
    if (cfg_.probe_every > 0 && ++plans_ % cfg_.probe_every == 0) return BlockReason::probe;
    return BlockReason::none;
  }

  void back_off(int64_t now_ns, BlockReason why) {
    backoff_ns_ = std::clamp(backoff_ns_ * 2, cfg_.backoff_min_ns, cfg_.backoff_max_ns);
    backoff_until_ = now_ns + backoff_ns_;
    backoff_reason_ = why;
    // The hybrid waits after the back-off are judged afresh (the host may have changed).
    hybrid_cost_ = {};
    misses_ = 0;
    preempt_score_ = 0;
  }

  HybridPollConfig cfg_;
  Ewma arrival_;      // start of a wait -> its completions
  Ewma oversleep_;    // how much later than asked a sleep ends
  Ewma hybrid_cost_;  // ns per completion, hybrid waits
  Ewma block_cost_;   // ns per completion, blocking waits
  Ewma runnable_;     // other runnable tasks, x1000
  double share_ = 0.5;  // of the expected arrival slept before spinning
  uint32_t misses_ = 0;
  uint32_t preempt_score_ = 0;
  uint32_t plans_ = 0;
  bool contended_ = false;
  bool spun_since_sample_ = false;  // a hybrid plan since the last observe_pressure
  double stall_ = 0;
  int64_t pressure_ns_ = 0;         // the pressure back-off's current length
  uint64_t pressure_backoffs_ = 0;
  int64_t backoff_ns_ = 0;
  int64_t backoff_until_ = 0;
  BlockReason backoff_reason_ = BlockReason::none;
  BlockReason reason_ = BlockReason::learning;
  uint64_t no_gain_verdicts_ = 0;
};

}  // namespace ibtrs
