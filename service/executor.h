// A fixed set of threads running posted tasks in order of arrival. The gRPC callback handlers
// post layer computations here so that no gRPC thread ever blocks on compute.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace attnd {

class Executor {
 public:
  explicit Executor(int num_threads);
  // Runs every task already posted, then joins.
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Thread safe. Tasks must not throw.
  void Post(std::function<void()> task);
  // Tasks posted and not yet started (metrics).
  size_t queue_depth();

 private:
  void Loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace attnd
