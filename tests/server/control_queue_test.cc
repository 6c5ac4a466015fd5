// FairQueue (server/src/control_queue.h): the block server's per-session queues of control
// requests, bounded per session and served round robin; and the control thread's periodic task
// (base/include/base/worker.h: the size check).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "control_queue.h"
#include "base/worker.h"

namespace ibnbd::server {
namespace {

// Case: three sessions queue requests, one of them a flood. Expect: served one per session per
// round, each session in its own order; the flood past the bound is refused and costs the
// others nothing.
TEST(FairQueue, RoundRobinAcrossKeysFifoWithin) {
  FairQueue<int, std::string> q(3);
  for (int i = 0; i < 10; ++i) {
    const bool in = q.push(1, "flood" + std::to_string(i));
    EXPECT_EQ(in, i < 3) << i;
  }
  EXPECT_TRUE(q.push(2, "a0"));
  EXPECT_TRUE(q.push(3, "b0"));
  EXPECT_TRUE(q.push(2, "a1"));
  EXPECT_EQ(q.size(), 6u);
  EXPECT_EQ(q.queued(1), 3u);
  std::vector<std::string> order;
  while (auto next = q.pop()) order.push_back(std::to_string(next->first) + ":" + next->second);
  EXPECT_EQ(order, (std::vector<std::string>{"1:flood0", "2:a0", "3:b0", "1:flood1", "2:a1",
                                             "1:flood2"}));
  EXPECT_TRUE(q.empty());
  EXPECT_EQ(q.queued(1), 0u);
}

// Case: a key drains and comes back; a refused push. Expect: it joins the ring again at the
// back; a refused item is left to the caller (not moved from).
TEST(FairQueue, AKeyThatDrainedRejoinsAtTheBack) {
  FairQueue<int, std::string> q(1);
  ASSERT_TRUE(q.push(1, "x"));
  ASSERT_TRUE(q.push(2, "y"));
  EXPECT_EQ(q.pop()->first, 1);
  ASSERT_TRUE(q.push(1, "z"));
  std::string kept = "refused";
  EXPECT_FALSE(q.push(1, std::move(kept)));
  EXPECT_EQ(kept, "refused");
  EXPECT_EQ(q.pop()->second, "y");
  EXPECT_EQ(q.pop()->second, "z");
  EXPECT_FALSE(q.pop().has_value());
  FairQueue<int, int> none(0);
  EXPECT_FALSE(none.push(1, 1)) << "a bound of 0 takes nothing";
  EXPECT_TRUE(none.empty());
}

// Case: a periodic task of 20 ms set on a control thread that already sleeps for want of work,
// then 150 ms idle, then a stream of tasks that each take 1 ms for 150 ms; then stop().
// Expect: it runs about every period both times (the stream delays it by a task, never starves
// it), on the control thread (never beside a task), and not after stop().
TEST(Worker, PeriodicTaskRunsBetweenTasksAndStopsWithTheThread) {
  base::Worker t;
  t.call([] { return 0; });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // asleep, no task, no tick yet
  std::atomic<int> ticks{0};
  std::atomic<bool> in_task{false}, overlap{false};
  t.every(std::chrono::milliseconds(20), [&] {
    if (in_task.load()) overlap.store(true);
    ticks.fetch_add(1);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  const int idle = ticks.load();
  EXPECT_GE(idle, 4);
  EXPECT_LE(idle, 8);
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(150);
  while (std::chrono::steady_clock::now() < end) {
    t.post([&] {
      in_task.store(true);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      in_task.store(false);
    });
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  t.call([] { return 0; });
  const int busy = ticks.load() - idle;
  EXPECT_GE(busy, 3) << "a stream of tasks must not starve it";
  EXPECT_FALSE(overlap.load());
  t.stop();
  const int at_stop = ticks.load();
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  EXPECT_EQ(ticks.load(), at_stop);
}

}  // namespace
}  // namespace ibnbd::server
