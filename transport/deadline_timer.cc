#include "transport/deadline_timer.h"

#include <algorithm>

#include "absl/time/clock.h"

namespace attnd::transport {

DeadlineTimer::DeadlineTimer() : thread_([this] { Loop(); }) {}

DeadlineTimer::~DeadlineTimer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

uint64_t DeadlineTimer::At(absl::Time deadline, std::function<void()> fn) {
  const Clock::time_point when = Clock::now() + absl::ToChronoNanoseconds(std::max(
                                                    deadline - absl::Now(), absl::ZeroDuration()));
  uint64_t id;
  bool first;
  {
    std::lock_guard<std::mutex> lock(mu_);
    id = next_id_++;
    first = due_.empty() || std::make_pair(when, id) < due_.begin()->first;
    due_.emplace(std::make_pair(when, id), std::move(fn));
    when_[id] = when;
  }
  if (first) cv_.notify_all();  // the thread sleeps until a later deadline
  return id;
}

void DeadlineTimer::Cancel(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = when_.find(id);
  if (it == when_.end()) return;
  due_.erase({it->second, id});
  when_.erase(it);
}

size_t DeadlineTimer::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return due_.size();
}

void DeadlineTimer::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (due_.empty()) {
      cv_.wait(lock);
      continue;
    }
    const Clock::time_point next = due_.begin()->first.first;
    if (Clock::now() < next) {
      cv_.wait_until(lock, next);
      continue;
    }
    auto node = due_.extract(due_.begin());
    when_.erase(node.key().second);
    lock.unlock();
    node.mapped()();
    lock.lock();
  }
}

}  // namespace attnd::transport
