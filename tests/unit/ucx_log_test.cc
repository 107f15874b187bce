// UCX's own log lines routed into a sink, bounded a second (transport/ucx_log.h): what attnd
// does with them so that they reach its log, not stdout, and so that a peer making UCX warn per
// message cannot flood it.
#include "transport/ucx_log.h"

#include <ucs/debug/log_def.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace attnd::transport {
namespace {

struct Captured {
  std::mutex mu;
  std::vector<std::pair<UcxLogLevel, std::string>> lines;
  UcxLogSink Sink() {
    return [this](UcxLogLevel l, const std::string& s) {
      std::lock_guard<std::mutex> lock(mu);
      lines.emplace_back(l, s);
    };
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu);
    return lines.size();
  }
};

// Gives UCX's lines back to its printer when a test ends (the sink dies with the test).
struct Restore {
  ~Restore() { RouteUcxLogs(nullptr); }
};

TEST(UcxLog, LinesReachTheSinkWithTheirLevelAndPlace) {
  Captured c;
  Restore restore;
  ASSERT_TRUE(RouteUcxLogs(c.Sink(), 100));
  ucs_warn("a peer did something odd: %d", 17);
  ucs_error("a transport failed\n");
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c.lines[0].first, UcxLogLevel::kWarning);
  EXPECT_NE(c.lines[0].second.find("ucx_log_test.cc:"), std::string::npos) << c.lines[0].second;
  EXPECT_NE(c.lines[0].second.find("a peer did something odd: 17"), std::string::npos);
  EXPECT_EQ(c.lines[1].first, UcxLogLevel::kError);
  EXPECT_EQ(c.lines[1].second.back(), 'd') << "the trailing newline is dropped";
  // Below UCX_LOG_LEVEL (warn by default) nothing is formatted or sent.
  ucs_debug("not logged");
  EXPECT_EQ(c.size(), 2u);
}

TEST(UcxLog, AFloodIsHeldToTheBoundAndCountedThenReported) {
  Captured c;
  Restore restore;
  ASSERT_TRUE(RouteUcxLogs(c.Sink(), 5));
  const int64_t before = UcxLogLinesSuppressed();
  for (int i = 0; i < 200; ++i) ucs_warn("flood %d", i);
  const size_t through = c.size();
  EXPECT_GE(through, 1u);
  EXPECT_LE(through, 10u) << "at most 5 a second (two windows at the most)";
  EXPECT_EQ(UcxLogLinesSuppressed() - before, static_cast<int64_t>(200 - through));
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  ucs_warn("after the flood");
  ASSERT_EQ(c.size(), through + 2);
  EXPECT_NE(c.lines[through].second.find(std::to_string(200 - through) + " lines held back"),
            std::string::npos)
      << c.lines[through].second;
  EXPECT_NE(c.lines[through + 1].second.find("after the flood"), std::string::npos);
}

TEST(UcxLog, UcxLogFileKeepsUcxsOwnPrinter) {
  Captured c;
  Restore restore;
  ASSERT_EQ(setenv("UCX_LOG_FILE", "/dev/null", 1), 0);
  EXPECT_FALSE(RouteUcxLogs(c.Sink()));
  ASSERT_EQ(unsetenv("UCX_LOG_FILE"), 0);
  ucs_warn("not routed");
  EXPECT_EQ(c.size(), 0u);
}

}  // namespace
}  // namespace attnd::transport
