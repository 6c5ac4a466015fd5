// The adaptive wait policy of the fio engine and of the server's IO pollers
// (transport/include/ibtrs/hybrid_poll.h) as a pure function: given
// arrival times, spin outcomes and run queue samples, when it sleeps, when it spins and for how
// long, and when it falls back to blocking.
#include "ibtrs/hybrid_poll.h"
#include "ibtrs/cpu_load.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <string>

namespace ibtrs::core {
namespace {

constexpr int64_t us = 1000;
constexpr int64_t ms = 1000 * us;

// Drives a policy through waits at a steady clock.
struct Driver {
  explicit Driver(HybridPollConfig c = {}) : p(c) {}
  HybridPoll p;
  int64_t now = 1 * ms;

  // One wait: plans it and reports `o` (its times relative to the start), 10 us of work after.
  WaitPlan wait(WaitOutcome o) {
    const WaitPlan plan = p.plan(now);
    now += o.wait_ns;
    p.record(plan, o, now);
    now += 10 * us;
    return plan;
  }
  // Blocking waits that see completions `arrival` after they start (the learning phase).
  void learn(int64_t arrival, int n = 16) {
    for (int i = 0; i < n; ++i) wait({WaitEnd::blocked, arrival, false, -1, 0});
  }
  // A hybrid wait whose completion comes `arrival` after the start, with the outcome the plan
  // gives it (slept when it comes before the sleep ends, spun within the spin, else blocked).
  WaitPlan arrive(int64_t arrival, int64_t cost = 0, bool preempted = false) {
    const WaitPlan plan = p.plan(now);
    WaitOutcome o{WaitEnd::blocked, arrival, preempted, -1, cost};
    if (plan.hybrid()) {
      if (plan.sleep_ns > 0 && arrival <= plan.sleep_ns) {
        o.end = WaitEnd::slept;
      } else {
        if (plan.sleep_ns > 0) o.woke_ns = plan.sleep_ns;
        o.end = arrival <= plan.spin_ns ? WaitEnd::spun : WaitEnd::blocked;
      }
    }
    now += arrival;
    p.record(plan, o, now);
    now += 10 * us;
    return plan;
  }
};

TEST(HybridPoll, BlocksWhileItLearnsThenSleepsHalfTheArrivalAndSpinsPastIt) {
  // Case: the first waits, with no arrival time known yet, then completions 100 us after the
  // start of every wait.
  // Expect: the first min_samples plans block (learning); then the plan sleeps half of the
  // expected arrival (50 us) and spins until half of it again past the arrival (150 us).
  Driver d;
  for (int i = 0; i < 16; ++i) {
    EXPECT_FALSE(d.p.plan(d.now).hybrid()) << i;
    EXPECT_EQ(d.p.last_reason(), BlockReason::learning);
    d.p.record({}, {WaitEnd::blocked, 100 * us, false, -1, 0}, d.now);
  }
  const WaitPlan plan = d.p.plan(d.now);
  ASSERT_TRUE(plan.hybrid());
  EXPECT_EQ(d.p.last_reason(), BlockReason::none);
  EXPECT_EQ(plan.sleep_ns, 50 * us);
  EXPECT_EQ(plan.spin_ns, 150 * us);
}

TEST(HybridPoll, ShortArrivalsSpinWithoutSleeping) {
  // Case: completions 15 us after a wait starts: half of that is below min_sleep_ns (10 us).
  // Expect: no sleep (a timer costs more than it saves); a spin until min_spin_ns (20 us) past
  // the expected arrival.
  Driver d;
  d.learn(15 * us);
  const WaitPlan plan = d.p.plan(d.now);
  EXPECT_EQ(plan.sleep_ns, 0);
  EXPECT_EQ(plan.spin_ns, 35 * us);
}

TEST(HybridPoll, LongArrivalsSpinNoLongerThanTheCap) {
  // Case: completions 2 ms after the start (a slow device).
  // Expect: the plan sleeps 1 ms and then spins at most max_spin_ns (100 us).
  Driver d;
  d.learn(2 * ms);
  const WaitPlan plan = d.p.plan(d.now);
  EXPECT_EQ(plan.sleep_ns, 1 * ms);
  EXPECT_EQ(plan.spin_ns - plan.sleep_ns, 100 * us);
}

TEST(HybridPoll, LearnsArrivalsFromSpinsNotFromWakeUps) {
  // Case: blocking waits saw completions 100 us in (arrival plus a wake-up); spinning then sees
  // them at 60 us.
  // Expect: the estimate follows the spins towards 60 us, and the sleeps shrink with it.
  Driver d;
  d.learn(100 * us);
  for (int i = 0; i < 60; ++i) d.arrive(60 * us);
  EXPECT_NEAR(static_cast<double>(d.p.expected_ns()), 60.0 * us, 3.0 * us);
  EXPECT_LT(d.p.plan(d.now).sleep_ns, 50 * us);
}

TEST(HybridPoll, CompletionsThatComeDuringTheSleepShortenIt) {
  // Case: the expected arrival is 100 us, but completions come 30 us in, inside the 50 us sleep
  // (each woke the thread: a wake-up paid).
  // Expect: the share of the arrival slept drops, until the sleep ends before they come.
  Driver d;
  d.learn(100 * us);
  const double before = d.p.sleep_share();
  d.arrive(30 * us);
  EXPECT_LT(d.p.sleep_share(), before);
  for (int i = 0; i < 10; ++i) d.arrive(30 * us);
  EXPECT_LT(d.p.plan(d.now).sleep_ns, 30 * us);
}

TEST(HybridPoll, LongSpinsLengthenTheSleep) {
  // Case: completions at 200 us, a sleep of 100 us: every wait spins 100 us.
  // Expect: the share grows (the thread wakes too early), up to its cap of 0.75.
  Driver d;
  d.learn(200 * us);
  for (int i = 0; i < 100; ++i) d.arrive(200 * us);
  EXPECT_DOUBLE_EQ(d.p.sleep_share(), 0.75);
  EXPECT_EQ(d.p.plan(d.now).sleep_ns, 150 * us);
}

TEST(HybridPoll, TheTimersLatenessComesOffTheSleep) {
  // Case: sleeps end 20 us later than asked (a slow timer), expected arrival 100 us.
  // Expect: the plan asks for 20 us less, so that the thread is up at half the arrival.
  Driver d;
  d.learn(100 * us);
  for (int i = 0; i < 40; ++i) {
    const WaitPlan plan = d.p.plan(d.now);
    d.p.record(plan, {WaitEnd::spun, 100 * us, false, plan.sleep_ns + 20 * us, 0}, d.now);
  }
  EXPECT_EQ(d.p.oversleep_ns(), 20 * us);
  const WaitPlan plan = d.p.plan(d.now);
  EXPECT_NEAR(static_cast<double>(plan.sleep_ns),
              d.p.sleep_share() * static_cast<double>(d.p.expected_ns()) - 20.0 * us, 1.0 * us);
}

TEST(HybridPoll, SpinsThatKeepMissingBackOffAndTheBackOffDoubles) {
  // Case: completions never come within the spin (they come 10x later than learnt).
  // Expect: after miss_limit (3) misses in a row the policy blocks (misses) for backoff_min
  // (10 ms); hybrid again after it, and the next run of misses blocks twice as long.
  Driver d;
  d.learn(50 * us);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(d.p.plan(d.now).hybrid()) << i;
    d.p.record(d.p.plan(d.now), {WaitEnd::blocked, 500 * us, false, -1, 0}, d.now);
  }
  EXPECT_FALSE(d.p.plan(d.now).hybrid());
  EXPECT_EQ(d.p.last_reason(), BlockReason::misses);
  EXPECT_EQ(d.p.backoff_until_ns(), d.now + 10 * ms);
  d.now += 10 * ms;
  ASSERT_TRUE(d.p.plan(d.now).hybrid());
  for (int i = 0; i < 3; ++i) d.p.record(d.p.plan(d.now), {WaitEnd::blocked, 1 * ms, false, -1, 0}, d.now);
  EXPECT_EQ(d.p.backoff_until_ns(), d.now + 20 * ms);
}

TEST(HybridPoll, AMissNowAndThenDoesNotBackOff) {
  // Case: every third spin misses, the others hit.
  // Expect: never three misses in a row: the policy keeps spinning.
  Driver d;
  d.learn(50 * us);
  for (int i = 0; i < 300; ++i) {
    const WaitPlan plan = d.arrive(i % 3 == 0 ? 400 * us : 50 * us);
    if (d.p.last_reason() == BlockReason::probe) continue;
    ASSERT_TRUE(plan.hybrid()) << i << " reason " << static_cast<int>(d.p.last_reason());
  }
}

TEST(HybridPoll, ALongRunQueueMakesItBlockUntilItShortens) {
  // Case: 2 CPUs; the other runnable tasks average 2 (stress-ng on both), then 0.3.
  // Expect: plans block (contended) while others > cpus - 0.25, and spin again once the average
  // falls below it.
  Driver d;
  d.learn(50 * us);
  ASSERT_TRUE(d.p.plan(d.now).hybrid());
  for (int i = 0; i < 8; ++i) d.p.observe_runnable(2.0, 2);
  EXPECT_TRUE(d.p.contended());
  EXPECT_FALSE(d.p.plan(d.now).hybrid());
  EXPECT_EQ(d.p.last_reason(), BlockReason::contended);
  for (int i = 0; i < 8; ++i) d.p.observe_runnable(0.3, 2);
  EXPECT_FALSE(d.p.contended());
  EXPECT_TRUE(d.p.plan(d.now).hybrid());
}

TEST(HybridPoll, OneBusySampleDoesNotStopTheSpinning) {
  // Case: the run queue is mostly the server's thread (1 other task on 2 CPUs) with a burst of
  // 3 others in one sample.
  // Expect: the average stays below 1.75: not contended.
  Driver d;
  d.learn(50 * us);
  for (int i = 0; i < 8; ++i) d.p.observe_runnable(1.0, 2);
  d.p.observe_runnable(3.0, 2);
  EXPECT_FALSE(d.p.contended());
  d.p.observe_runnable(1.0, 2);
  EXPECT_FALSE(d.p.contended());
}

TEST(HybridPoll, FrequentPreemptionBacksOffAndASingleOneDoesNot) {
  // Case: one spin preempted among clean ones; then spins preempted one after another.
  // Expect: the single one changes nothing; the third of the run backs off (preempted).
  Driver d;
  d.learn(50 * us);
  d.arrive(50 * us, 0, true);
  for (int i = 0; i < 40; ++i) d.arrive(50 * us);
  EXPECT_EQ(d.p.backoff_until_ns(), 0);
  d.arrive(50 * us, 0, true);
  d.arrive(50 * us, 0, true);
  EXPECT_EQ(d.p.backoff_until_ns(), 0);
  d.arrive(50 * us, 0, true);
  EXPECT_GT(d.p.backoff_until_ns(), d.now);
  EXPECT_FALSE(d.p.plan(d.now).hybrid());
  EXPECT_EQ(d.p.last_reason(), BlockReason::preempted);
}

TEST(HybridPoll, OneWaitInProbeEveryBlocks) {
  // Case: steady hits.
  // Expect: exactly one plan in 32 blocks (probe), the others are hybrid.
  Driver d;
  d.learn(50 * us);
  int probes = 0;
  for (int i = 0; i < 320; ++i) {
    if (!d.arrive(50 * us).hybrid()) {
      EXPECT_EQ(d.p.last_reason(), BlockReason::probe);
      ++probes;
    }
  }
  EXPECT_EQ(probes, 10);
}

TEST(HybridPoll, HybridWaitsThatCostMoreThanBlockingOnesBackOff) {
  // Case: per completion, hybrid waits cost 80 us and the blocking probes 60 us (the spinner
  // takes the CPU the server needs).
  // Expect: once both have min_samples, the policy backs off (no gain).
  Driver d;
  d.learn(50 * us);
  int i = 0;
  for (; i < 2000 && d.p.no_gain_verdicts() == 0; ++i) {
    const WaitPlan plan = d.p.plan(d.now);
    const int64_t cost = plan.hybrid() ? 80 * us : 60 * us;
    WaitOutcome o{plan.hybrid() ? WaitEnd::spun : WaitEnd::blocked, 50 * us, false, -1, cost};
    d.p.record(plan, o, d.now);
    d.now += 60 * us;
  }
  EXPECT_EQ(d.p.no_gain_verdicts(), 1u) << "after " << i << " waits";
  EXPECT_FALSE(d.p.plan(d.now).hybrid());
  EXPECT_EQ(d.p.last_reason(), BlockReason::no_gain);
}

TEST(HybridPoll, HybridWaitsThatPayKeepSpinning) {
  // Case: hybrid waits cost 40 us per completion, blocking probes 60 us, with noise.
  // Expect: no back-off in 5000 waits; every plan but the probes is hybrid.
  Driver d;
  d.learn(50 * us);
  for (int i = 0; i < 5000; ++i) {
    const WaitPlan plan = d.p.plan(d.now);
    const int64_t noise = (i * 7919 % 21 - 10) * us;
    const int64_t cost = (plan.hybrid() ? 40 * us : 60 * us) + noise;
    WaitOutcome o{plan.hybrid() ? WaitEnd::spun : WaitEnd::blocked, 50 * us, false, -1, cost};
    d.p.record(plan, o, d.now);
    d.now += 60 * us;
    if (!plan.hybrid()) {
      ASSERT_EQ(d.p.last_reason(), BlockReason::probe) << i;
    }
  }
  EXPECT_EQ(d.p.no_gain_verdicts(), 0u);
}

TEST(HybridPoll, OneOutlierMovesTheEstimateLittle) {
  // Case: steady 50 us arrivals, then one wait that saw its completion 10 ms late (preempted).
  // Expect: the estimate grows by at most 1/8 of 2x the average (outliers are clamped).
  Driver d;
  d.learn(50 * us);
  for (int i = 0; i < 30; ++i) d.arrive(50 * us);
  const int64_t before = d.p.expected_ns();
  d.p.record(d.p.plan(d.now), {WaitEnd::blocked, 10 * ms, false, -1, 0}, d.now);
  EXPECT_LE(d.p.expected_ns(), before + before / 8 + 1);
}

// ---- The server's IO poller (HybridPollConfig::server()): a wait starts after a pass that found
// work and ends with the next request.

TEST(ServerPoll, SpinsRightAfterWorkPastTheLearnedGapWithoutSleeping) {
  // Case: a QD1 client whose next request comes 30 us after the server's reply, learned from
  // blocking waits (the server's first waits).
  // Expect: no sleep at all (a timer wake-up is what spinning saves); a spin until half the gap
  // (at least 20 us) past it: 50 us.
  Driver d(HybridPollConfig::server());
  d.learn(30 * us);
  const WaitPlan plan = d.p.plan(d.now);
  EXPECT_EQ(d.p.last_reason(), BlockReason::none);
  EXPECT_EQ(plan.sleep_ns, 0);
  EXPECT_EQ(plan.spin_ns, 50 * us);
}

TEST(ServerPoll, NeverSleepsBeforeSpinningEvenForLongGaps) {
  // Case: gaps of 80 us (a slower client), within the 100 us cap.
  // Expect: a spin from the start, capped at 100 us; never a sleep.
  Driver d(HybridPollConfig::server());
  d.learn(80 * us);
  for (int i = 0; i < 20; ++i) {
    const WaitPlan plan = d.arrive(80 * us);
    if (!plan.hybrid()) continue;  // a probe
    EXPECT_EQ(plan.sleep_ns, 0) << i;
    EXPECT_EQ(plan.spin_ns, 100 * us) << i;
  }
}

TEST(ServerPoll, AnIdleClientMakesItBlockAndItSpinsAgainWhenTrafficResumes) {
  // Case: QD1 traffic (30 us gaps), then the client goes idle: the passes that still find work
  // (heartbeats) see the next one milliseconds later; then QD1 traffic again.
  // Expect: after a few missed spins it blocks (back-off, then idle: the expected gap is beyond
  // the cap) and stays blocked while idle, spinning at most a few times in all; once the short
  // gaps come back, blocking waits bring the estimate down and it spins again.
  Driver d(HybridPollConfig::server());
  d.learn(30 * us);
  for (int i = 0; i < 40; ++i) d.arrive(30 * us);
  int spins = 0;
  for (int i = 0; i < 200; ++i) {
    if (d.arrive(5 * ms).hybrid()) ++spins;
  }
  EXPECT_LE(spins, 12);
  EXPECT_FALSE(d.p.plan(d.now).hybrid());
  EXPECT_EQ(d.p.last_reason(), BlockReason::idle);
  d.now += 2000 * ms;  // past any back-off
  bool spun_again = false;
  for (int i = 0; i < 200 && !spun_again; ++i) spun_again = d.arrive(30 * us).hybrid();
  EXPECT_TRUE(spun_again);
  EXPECT_LE(d.p.expected_ns(), HybridPollConfig::server().max_spin_ns);
}

TEST(ServerPoll, ANewServerWithAnIdleClientNeverSpins) {
  // Case: the first passes of a server whose client sends a request every 10 ms.
  // Expect: it learns, then blocks as idle: not one spin.
  Driver d(HybridPollConfig::server());
  for (int i = 0; i < 100; ++i) EXPECT_FALSE(d.arrive(10 * ms).hybrid()) << i;
  EXPECT_EQ(d.p.last_reason(), BlockReason::idle);
}

TEST(ServerPoll, ContentionMakesItBlock) {
  // Case: QD1 traffic that spins, then the run queue shows 3 other runnable tasks on 2 CPUs
  // (stress-ng --cpu 2 beside the run).
  // Expect: it blocks (contended) at once and for as long as that lasts.
  Driver d(HybridPollConfig::server());
  d.learn(30 * us);
  d.arrive(30 * us);
  ASSERT_TRUE(d.p.plan(d.now).hybrid());
  d.p.observe_runnable(3, 2);
  for (int i = 0; i < 50; ++i) {
    EXPECT_FALSE(d.arrive(30 * us).hybrid()) << i;
    EXPECT_EQ(d.p.last_reason(), BlockReason::contended);
  }
}

// Runs QD1 traffic (a request 30 us after each wait starts) for `for_ns`, feeding the policy a
// CPU pressure sample of `stall` every 10 ms (as CpuLoadSampler does). Returns the share of the
// waits that spun.
double traffic_with_pressure(Driver& d, int64_t for_ns, double stall) {
  const int64_t end = d.now + for_ns;
  int64_t next_sample = d.now + 10 * ms;
  int waits = 0, spun = 0;
  while (d.now < end) {
    if (d.now >= next_sample) {
      d.p.observe_pressure(stall, d.now);
      next_sample = d.now + 10 * ms;
    }
    ++waits;
    if (d.arrive(30 * us).hybrid()) ++spun;
  }
  return waits > 0 ? static_cast<double>(spun) / waits : 0;
}

TEST(ServerPoll, CpuPressureMakesItBlockLongerEachTimeItRecurs) {
  // Case: QD1 traffic that spins; then every 10 ms sample shows tasks waiting for a CPU 30 % of
  // the time (the spinner holds the vCPU a client's threads wait for), for 4 s.
  // Expect: it blocks for CPU pressure at once; the back-off doubles each time the pressure
  // recurs, up to 1 s, so that over the 4 s fewer than 5 % of the waits spin.
  Driver d(HybridPollConfig::server());
  d.learn(30 * us);
  ASSERT_GT(traffic_with_pressure(d, 50 * ms, 0.0), 0.8);
  const double spun = traffic_with_pressure(d, 4000 * ms, 0.30);
  EXPECT_LT(spun, 0.05);
  EXPECT_FALSE(d.p.plan(d.now).hybrid());
  EXPECT_EQ(d.p.last_reason(), BlockReason::pressure);
  EXPECT_EQ(d.p.pressure_backoff_ns(), HybridPollConfig::server().backoff_max_ns);
  EXPECT_GE(d.p.pressure_backoffs(), 7u);
}

TEST(ServerPoll, PressureBelowTheLimitChangesNothingAndPressureThatEndsLetsItSpinAgain) {
  // Case: QD1 traffic with 5 % CPU pressure (below max_stall: a quiet 2-core host measures 1-3 %
  // while our waits spin); then 30 % for 200 ms; then none for 4 s.
  // Expect: at 5 % it spins as without pressure; at 30 % it blocks; once the pressure is gone it
  // spins again and the back-off shrinks (halved after each interval that spun without it).
  Driver d(HybridPollConfig::server());
  d.learn(30 * us);
  EXPECT_GT(traffic_with_pressure(d, 200 * ms, 0.05), 0.8);
  EXPECT_EQ(d.p.pressure_backoffs(), 0u);
  EXPECT_LT(traffic_with_pressure(d, 200 * ms, 0.30), 0.2);
  const int64_t grown = d.p.pressure_backoff_ns();
  EXPECT_GT(grown, 10 * ms);
  EXPECT_GT(traffic_with_pressure(d, 4000 * ms, 0.0), 0.5);
  EXPECT_LT(d.p.pressure_backoff_ns(), grown);
  EXPECT_TRUE(d.p.plan(d.now).hybrid() || d.p.last_reason() == BlockReason::probe);
}

TEST(HybridPoll, CpuPressureMakesTheEngineBlockToo) {
  // Case: the fio engine's policy spinning on 100 us completions, then 50 % CPU pressure.
  // Expect: its next plans block for pressure.
  Driver d;
  d.learn(100 * us);
  for (int i = 0; i < 8; ++i) d.arrive(100 * us);
  ASSERT_TRUE(d.p.plan(d.now).hybrid());
  d.p.observe_pressure(0.5, d.now);
  for (int i = 0; i < 20; ++i) {
    EXPECT_FALSE(d.arrive(100 * us).hybrid()) << i;
    EXPECT_EQ(d.p.last_reason(), BlockReason::pressure);
  }
}

// A file with `text`, read as the sampler reads /proc (pread at offset 0).
int file_with(const std::string& text) {
  const int fd = ::memfd_create("proc", MFD_CLOEXEC);
  if (fd >= 0 && ::write(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
    ::close(fd);
    return -1;
  }
  return fd;
}

TEST(CpuLoad, ReadsTheRunQueueAndThePressureTotalAndRefusesWhatItDoesNotKnow) {
  // Case: /proc/loadavg and /proc/pressure/cpu as Linux writes them, and damaged ones.
  // Expect: the runnable count and the "some" total; -1 for anything else (the signal is then
  // not fed, never a wrong value).
  struct Case {
    const char* text;
    int64_t pressure;
  };
  const Case cases[] = {
      {"some avg10=4.83 avg60=12.30 avg300=26.97 total=17747567183\nfull avg10=0.00 avg60=0.00 "
       "avg300=0.00 total=0\n", 17747567183},
      {"some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n", 0},
      {"full avg10=0.00 avg60=0.00 avg300=0.00 total=5\n", -1},
      {"some avg10=0.00\nfull total=5\n", -1},
      {"", -1},
  };
  for (const auto& c : cases) {
    const int fd = file_with(c.text);
    ASSERT_GE(fd, 0);
    EXPECT_EQ(cpu_pressure_us(fd), c.pressure) << c.text;
    ::close(fd);
  }
  EXPECT_EQ(cpu_pressure_us(-1), -1);
  int fd = file_with("0.81 1.96 2.77 3/412 12345\n");
  EXPECT_EQ(runnable_now(fd), 3);
  ::close(fd);
  fd = file_with("0.81 1.96\n");
  EXPECT_EQ(runnable_now(fd), -1);
  ::close(fd);
}

}  // namespace
}  // namespace ibtrs::core
