// Heartbeat and reconnect timing on a manual clock.
#include <gtest/gtest.h>

#include "core/heartbeat.h"

namespace ibtrs::core {
namespace {

using namespace std::chrono_literals;

// Case: the peer never answers. Expect: 5 heartbeats go out, the 6th tick (30 s) declares the
// peer dead - the kernel's 5 s x 5.
TEST(Heartbeat, SilentPeerIsDeadAfterMissedMaxIntervals) {
  Heartbeat hb({5000ms, 5});
  Clock::time_point t{};
  for (int i = 1; i <= 5; ++i) {
    t += 5s;
    EXPECT_EQ(hb.on_timer(t), Heartbeat::Action::send_hb) << i;
  }
  t += 5s;
  EXPECT_EQ(hb.on_timer(t), Heartbeat::Action::peer_dead);
  EXPECT_EQ(t.time_since_epoch(), 30s);
}

// Case: IO traffic arrives between ticks. Expect: the peer is never declared dead.
TEST(Heartbeat, AnyImmediateKeepsThePathAlive) {
  Heartbeat hb({1000ms, 2});
  Clock::time_point t{};
  for (int i = 0; i < 100; ++i) {
    t += 1s;
    ASSERT_EQ(hb.on_timer(t), Heartbeat::Action::send_hb) << i;
    hb.on_imm();
  }
  EXPECT_EQ(hb.missed(), 0u);
}

TEST(Heartbeat, AckMeasuresTheRoundTrip) {
  Heartbeat hb({1000ms, 5});
  EXPECT_FALSE(hb.latency().has_value());
  Clock::time_point t = Clock::time_point{} + 10s;
  ASSERT_EQ(hb.on_timer(t), Heartbeat::Action::send_hb);
  hb.on_ack(t + 250us);
  ASSERT_TRUE(hb.latency().has_value());
  EXPECT_EQ(*hb.latency(), 250us);
  EXPECT_EQ(hb.missed(), 0u);
}

// Case: the ACK of a heartbeat arrives after the next heartbeat went out (round trip longer than
// the interval). Expect: the latency counts from the unanswered heartbeat, not the newer one, and
// the next round is measured afresh.
TEST(Heartbeat, ALateAckIsMeasuredFromTheOldestUnansweredHeartbeat) {
  Heartbeat hb({100ms, 5});
  Clock::time_point t = Clock::time_point{} + 10s;
  ASSERT_EQ(hb.on_timer(t), Heartbeat::Action::send_hb);
  ASSERT_EQ(hb.on_timer(t + 100ms), Heartbeat::Action::send_hb);
  hb.on_ack(t + 130ms);
  EXPECT_EQ(*hb.latency(), 130ms) << "not the 30 ms since the second heartbeat";
  ASSERT_EQ(hb.on_timer(t + 200ms), Heartbeat::Action::send_hb);
  hb.on_ack(t + 201ms);
  EXPECT_EQ(*hb.latency(), 1ms);
  hb.on_ack(t + 400ms);
  EXPECT_EQ(*hb.latency(), 1ms) << "an ACK with no heartbeat out measures nothing";
}

TEST(Reconnect, DelaysGrowByTheBackoffUpToTheCap) {
  ReconnectSchedule s({1000ms, 1000ms, 3500ms, 0ms, -1});
  std::vector<int64_t> got;
  for (int i = 0; i < 5; ++i) got.push_back(s.next_delay()->count());
  EXPECT_EQ(got, (std::vector<int64_t>{1000, 2000, 3000, 3500, 3500}));
  s.reset();
  EXPECT_EQ(s.next_delay()->count(), 1000);
}

TEST(Reconnect, AttemptLimits) {
  ReconnectSchedule never({1000ms, 0ms, 1000ms, 0ms, 0});
  EXPECT_FALSE(never.next_delay().has_value());
  ReconnectSchedule three({10ms, 0ms, 10ms, 0ms, 3});
  EXPECT_TRUE(three.next_delay() && three.next_delay() && three.next_delay());
  EXPECT_FALSE(three.next_delay().has_value());
  ReconnectSchedule forever({10ms, 0ms, 10ms, 0ms, -1});
  for (int i = 0; i < 10000; ++i) ASSERT_TRUE(forever.next_delay().has_value());
}

TEST(Reconnect, JitterStaysBelowItsBound) {
  ReconnectSchedule s({1000ms, 0ms, 1000ms, 500ms, -1}, 42);
  bool varied = false;
  int64_t first = s.next_delay()->count();
  for (int i = 0; i < 200; ++i) {
    int64_t d = s.next_delay()->count();
    ASSERT_GE(d, 1000);
    ASSERT_LT(d, 1500);
    varied |= d != first;
  }
  EXPECT_TRUE(varied);
}

TEST(Reconnect, ParsesTheKernelsAttemptRange) {
  EXPECT_EQ(parse_max_reconnect_attempts("-1\n").value(), -1);
  EXPECT_EQ(parse_max_reconnect_attempts("9999").value(), 9999);
  EXPECT_EQ(parse_max_reconnect_attempts(" 0 ").value(), 0);
  for (const char* bad : {"", "-2", "10000", "abc", "1.5", "+3x"})
    EXPECT_FALSE(parse_max_reconnect_attempts(bad).ok()) << bad;
}

}  // namespace
}  // namespace ibtrs::core
