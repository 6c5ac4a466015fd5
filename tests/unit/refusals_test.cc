// ibtrs::Refusals: counts by reason, a snapshot that lists declared reasons, and logging that
// a flood cannot turn into a flood of lines.
#include "ibtrs/refusals.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <thread>
#include <vector>

namespace ibtrs {
namespace {

// Captures what is written to stderr (the log) while it lives.
class StderrCapture {
 public:
  StderrCapture() {
    std::fflush(stderr);
    saved_ = ::dup(2);
    file_ = std::tmpfile();
    ::dup2(::fileno(file_), 2);
  }
  ~StderrCapture() {
    restore();
    std::fclose(file_);
  }
  std::vector<std::string> lines() {
    restore();
    std::rewind(file_);
    std::vector<std::string> out;
    char buf[2048];
    while (std::fgets(buf, sizeof(buf), file_) != nullptr) out.emplace_back(buf);
    return out;
  }

 private:
  void restore() {
    if (saved_ < 0) return;
    ::dup2(saved_, 2);
    ::close(saved_);
    saved_ = -1;
  }
  int saved_ = -1;
  std::FILE* file_ = nullptr;
};

// Case: two reasons declared, one counted. Expect: both listed in name order, the undeclared
// counted reason added, the latest detail kept; reset zeroes counts and keeps the names.
TEST(Refusals, SnapshotListsDeclaredAndCountedReasons) {
  Refusals r;
  r.declare({"session_limit", "ack_timeout"});
  StderrCapture quiet;
  r.refuse("session_limit", "first");
  r.refuse("session_limit", "second", 2);
  r.refuse("auth_failed", "unknown host");
  auto s = r.snapshot();
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0].reason, "ack_timeout");
  EXPECT_EQ(s[0].count, 0u);
  EXPECT_EQ(s[0].last_unix_ms, 0);
  EXPECT_EQ(s[1].reason, "auth_failed");
  EXPECT_EQ(s[2].reason, "session_limit");
  EXPECT_EQ(s[2].count, 3u);
  EXPECT_EQ(s[2].last, "second");
  EXPECT_GT(s[2].last_unix_ms, 0);
  EXPECT_EQ(r.count("session_limit"), 3u);
  EXPECT_EQ(r.count("nothing"), 0u);
  r.reset();
  EXPECT_EQ(r.count("session_limit"), 0u);
  EXPECT_EQ(r.snapshot().size(), 3u);
}

// Case: 500 refusals of one reason from 4 threads at once, one of another, then one more of the
// first after kLogInterval. Expect: every refusal counted; the flood logged as one line, the
// other reason logged on its own, and the later line says how many went unlogged.
TEST(Refusals, AFloodIsCountedInFullAndLoggedOncePerInterval) {
  Refusals r;
  StderrCapture cap;
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&] {
      for (int i = 0; i < 125; ++i) r.refuse("listen_timeout", "idle socket");
    });
  for (auto& t : ts) t.join();
  r.refuse("path_limit", "16 paths");
  std::this_thread::sleep_for(Refusals::kLogInterval + std::chrono::milliseconds(50));
  r.refuse("listen_timeout", "idle socket");
  auto lines = cap.lines();
  EXPECT_EQ(r.count("listen_timeout"), 501u);
  ASSERT_EQ(lines.size(), 3u) << (lines.empty() ? "" : lines[0]);
  EXPECT_NE(lines[0].find("refused (listen_timeout): idle socket"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find("refused (path_limit): 16 paths"), std::string::npos) << lines[1];
  EXPECT_NE(lines[2].find("(and 499 more not logged)"), std::string::npos) << lines[2];
}

}  // namespace
}  // namespace ibtrs
