// One thread running callbacks at their deadlines: the data plane's waits for a transfer end
// there when the transfer never comes (UcxPlane: a layer call waits for its inputs without
// holding an executor thread, docs/data-plane.md).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/time/time.h"

namespace attnd::transport {

class DeadlineTimer {
 public:
  DeadlineTimer();
  // Joins the thread; callbacks whose deadline has not come are dropped, never run.
  ~DeadlineTimer();
  DeadlineTimer(const DeadlineTimer&) = delete;
  DeadlineTimer& operator=(const DeadlineTimer&) = delete;

  // Runs fn on the timer's thread once `when` has passed (callbacks due together run in deadline
  // order, one at a time: each must be short and must not block). Returns an id for Cancel. The
  // wait is measured on the monotonic clock from now: a step of the wall clock moves no deadline.
  uint64_t At(absl::Time when, std::function<void()> fn);
  // fn of `id` will not run (a no-op once it ran or began to).
  void Cancel(uint64_t id);
  // Callbacks waiting for their deadline (tests, metrics).
  size_t pending() const;

 private:
  void Loop();

  mutable std::mutex mu_;
  std::condition_variable cv_;
  using Clock = std::chrono::steady_clock;
  std::map<std::pair<Clock::time_point, uint64_t>, std::function<void()>> due_;
  std::map<uint64_t, Clock::time_point> when_;  // id -> its key's deadline, for Cancel
  uint64_t next_id_ = 1;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace attnd::transport
