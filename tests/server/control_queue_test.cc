// FairQueue (server/src/control_queue.h): the block server's per-session queues of control
// requests, bounded per session and served round robin.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "control_queue.h"

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

}  // namespace
}  // namespace ibnbd::server
