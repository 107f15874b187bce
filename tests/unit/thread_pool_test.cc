// The thread pool: every index runs once; an exception in a task reaches the caller of
// ParallelFor (not std::terminate on a worker), and the pool goes on serving.
#include "common/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <new>
#include <stdexcept>
#include <thread>
#include <vector>

namespace attnd {
namespace {

TEST(ThreadPool, EveryIndexRunsExactlyOnce) {
  ThreadPool pool(4);
  std::vector<std::atomic<int>> hits(10000);
  pool.ParallelFor(10000, [&](int64_t i) { hits[i]++; });
  for (const auto& h : hits) ASSERT_EQ(h.load(), 1);
}

TEST(ThreadPool, AnExceptionInATaskReachesTheCallerAndThePoolGoesOn) {
  ThreadPool pool(3);
  for (int round = 0; round < 20; ++round) {
    EXPECT_THROW(pool.ParallelFor(1000,
                                  [&](int64_t i) {
                                    if (i == 37 + round) throw std::bad_alloc();
                                  }),
                 std::bad_alloc);
    EXPECT_THROW(pool.ParallelFor(64, [](int64_t) { throw std::runtime_error("every task"); }),
                 std::runtime_error);
    std::atomic<int64_t> sum{0};
    pool.ParallelFor(1000, [&](int64_t i) { sum += i; });
    EXPECT_EQ(sum.load(), 999 * 1000 / 2);
  }
  // Several callers at once, one of them failing.
  std::atomic<int64_t> sum{0};
  std::thread other([&] { pool.ParallelFor(5000, [&](int64_t i) { sum += i; }); });
  EXPECT_THROW(pool.ParallelFor(5000,
                                [](int64_t i) {
                                  if (i == 4000) throw std::bad_alloc();
                                }),
               std::bad_alloc);
  other.join();
  EXPECT_EQ(sum.load(), int64_t{4999} * 5000 / 2);
}

}  // namespace
}  // namespace attnd
