// Every (from, to) pair of path states, allowed or refused, against the table the kernel uses
// (rtrs_clt_change_state / rtrs_srv_change_state), restated here as the specification.
#include <gtest/gtest.h>

#include <set>
#include <thread>
#include <vector>

#include "core/path_state.h"

namespace ibtrs::core {
namespace {

using C = ClientPathState;
using S = ServerPathState;

const std::vector<C> kClient = {C::connecting, C::connecting_err, C::reconnecting, C::connected,
                                C::closing,    C::closed,         C::dead};
const std::vector<S> kServer = {S::connecting, S::connected, S::closing, S::closed};

const std::set<std::pair<C, C>> kClientAllowed = {
    {C::reconnecting, C::connecting},   {C::connecting, C::connecting_err},
    {C::connected, C::reconnecting},    {C::connecting_err, C::reconnecting},
    {C::closed, C::reconnecting},       {C::connecting, C::connected},
    {C::connecting, C::closing},        {C::connecting_err, C::closing},
    {C::reconnecting, C::closing},      {C::connected, C::closing},
    {C::closing, C::closed},            {C::closed, C::dead},
};

const std::set<std::pair<S, S>> kServerAllowed = {
    {S::connecting, S::connected}, {S::connecting, S::closing}, {S::connected, S::closing},
    {S::closing, S::closed},
};

TEST(ClientPathState, EveryTransitionAllowedOrRefusedAsSpecified) {
  int allowed = 0;
  for (C from : kClient) {
    for (C to : kClient) {
      const bool want = kClientAllowed.count({from, to}) == 1;
      EXPECT_EQ(transition_allowed(from, to), want) << to_string(from) << " -> " << to_string(to);
      ClientPathStateMachine m(from);
      auto r = m.change(to);
      if (want) {
        ASSERT_TRUE(r.ok()) << to_string(from) << " -> " << to_string(to);
        EXPECT_EQ(*r, from);
        EXPECT_EQ(m.get(), to);
        ++allowed;
      } else {
        EXPECT_EQ(r.error(), errc(EINVAL)) << to_string(from) << " -> " << to_string(to);
        EXPECT_EQ(m.get(), from) << "a refused change leaves the state alone";
      }
    }
  }
  EXPECT_EQ(allowed, 12);
}

TEST(ServerPathState, EveryTransitionAllowedOrRefusedAsSpecified) {
  for (S from : kServer) {
    for (S to : kServer) {
      const bool want = kServerAllowed.count({from, to}) == 1;
      ServerPathStateMachine m(from);
      auto r = m.change(to);
      EXPECT_EQ(r.ok(), want) << to_string(from) << " -> " << to_string(to);
      EXPECT_EQ(m.get(), want ? to : from);
    }
  }
}

// Case: a path's whole life: connect, break, reconnect, user disconnect, reconnect, remove.
TEST(ClientPathState, LifeCycle) {
  ClientPathStateMachine m(C::connecting);
  for (C to : {C::connected, C::reconnecting, C::connecting, C::connecting_err, C::reconnecting,
               C::connecting, C::connected, C::closing, C::closed, C::reconnecting, C::connecting,
               C::connected, C::closing, C::closed, C::dead}) {
    ASSERT_TRUE(m.change(to).ok()) << to_string(m.get()) << " -> " << to_string(to);
  }
  EXPECT_FALSE(m.change(C::reconnecting).ok()) << "a dead path stays dead";
}

// Case: a heartbeat timeout and a user disconnect race to move a CONNECTED path.
// Expect: exactly one of change_from(connected, ...) wins.
TEST(ClientPathState, ConcurrentChangesFromTheSameStateHaveOneWinner) {
  for (int round = 0; round < 200; ++round) {
    ClientPathStateMachine m(C::connected);
    std::atomic<int> wins{0};
    std::thread a([&] { wins += m.change_from(C::connected, C::reconnecting).ok(); });
    std::thread b([&] { wins += m.change_from(C::connected, C::closing).ok(); });
    a.join();
    b.join();
    ASSERT_EQ(wins.load(), 1);
  }
  ClientPathStateMachine m(C::connected);
  EXPECT_EQ(m.change_from(C::connecting, C::connected).error(), errc(EAGAIN)) << "not in that state";
  EXPECT_EQ(m.change_from(C::connected, C::dead).error(), errc(EINVAL)) << "never allowed";
}

}  // namespace
}  // namespace ibtrs::core
