// DeadlineTimer (transport/deadline_timer.h): callbacks run once their deadline passed, in
// deadline order, never before; a cancelled one never runs; those pending at destruction are
// dropped.
#include "transport/deadline_timer.h"

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <vector>

#include "absl/time/clock.h"

namespace attnd::transport {
namespace {

TEST(DeadlineTimer, RunsEachCallbackOnceAfterItsDeadlineInDeadlineOrder) {
  DeadlineTimer timer;
  std::mutex mu;
  std::vector<std::pair<int, absl::Time>> ran;
  const absl::Time t0 = absl::Now();
  // Posted out of order: 60, 20, 40 ms.
  for (int ms : {60, 20, 40})
    timer.At(t0 + absl::Milliseconds(ms), [&, ms] {
      std::lock_guard<std::mutex> lock(mu);
      ran.push_back({ms, absl::Now()});
    });
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (absl::Now() < until) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (ran.size() == 3) break;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(ran.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(ran[i].first, 20 * (i + 1));
    EXPECT_GE(ran[i].second, t0 + absl::Milliseconds(ran[i].first)) << "ran before its deadline";
  }
  EXPECT_EQ(timer.pending(), 0u);
}

TEST(DeadlineTimer, ACancelledCallbackNeverRunsAndAnEarlierOneWakesTheThread) {
  DeadlineTimer timer;
  std::atomic<int> cancelled{0}, early{0};
  const uint64_t id = timer.At(absl::Now() + absl::Milliseconds(30), [&] { ++cancelled; });
  // A deadline far out first, then one sooner: the sooner must not wait behind it.
  timer.At(absl::Now() + absl::Hours(1), [] {});
  const absl::Time t0 = absl::Now();
  timer.At(t0 + absl::Milliseconds(10), [&] { ++early; });
  timer.Cancel(id);
  timer.Cancel(id);     // twice: a no-op
  timer.Cancel(12345);  // unknown: a no-op
  while (early.load() == 0 && absl::Now() < t0 + absl::Seconds(5))
    absl::SleepFor(absl::Milliseconds(2));
  EXPECT_EQ(early.load(), 1);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
  absl::SleepFor(absl::Milliseconds(60));  // past the cancelled one's deadline
  EXPECT_EQ(cancelled.load(), 0);
  EXPECT_EQ(timer.pending(), 1u);  // the hour-long one
}

TEST(DeadlineTimer, CallbacksPendingAtDestructionAreDropped) {
  auto ran = std::make_shared<std::atomic<int>>(0);
  {
    DeadlineTimer timer;
    for (int i = 0; i < 100; ++i) timer.At(absl::Now() + absl::Seconds(30), [ran] { ++*ran; });
    EXPECT_EQ(timer.pending(), 100u);
  }  // joins at once, not after 30 s
  EXPECT_EQ(ran->load(), 0);
}

}  // namespace
}  // namespace attnd::transport
