// A fixed pool of worker threads running data-parallel loops.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace attnd {

// Runs `ParallelFor` loops on `num_threads - 1` workers plus the calling thread. Thread safe:
// several threads may call ParallelFor at once; their loops share the workers.
class ThreadPool {
 public:
  // num_threads <= 0 means std::thread::hardware_concurrency().
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(i) for every i in [0, n), spread over the pool; returns when all calls returned.
  // If a call throws, the remaining calls are skipped and the first exception is rethrown here,
  // on the calling thread, once every worker has left the loop (the pool stays usable).
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  struct Loop {
    const std::function<void(int64_t)>* fn;
    int64_t n;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::atomic<bool> failed{false};
    std::exception_ptr error;  // the first exception, guarded by mu
    std::mutex mu;
    std::condition_variable cv;
  };
  static void Drain(Loop& loop);
  void WorkerMain();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Loop>> loops_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace attnd
