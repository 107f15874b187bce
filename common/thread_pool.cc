#include "common/thread_pool.h"

namespace attnd {

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::thread::hardware_concurrency());
  if (num_threads <= 0) num_threads = 1;
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this] { WorkerMain(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::Drain(Loop& loop) {
  int64_t finished = 0;
  for (;;) {
    const int64_t i = loop.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= loop.n) break;
    if (!loop.failed.load(std::memory_order_relaxed)) {
      try {
        (*loop.fn)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(loop.mu);
        if (!loop.error) loop.error = std::current_exception();
        loop.failed = true;
      }
    }
    ++finished;
  }
  if (finished > 0 && loop.done.fetch_add(finished) + finished == loop.n) {
    std::lock_guard<std::mutex> lock(loop.mu);
    loop.cv.notify_all();
  }
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (n == 1 || workers_.empty()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto loop = std::make_shared<Loop>();
  loop->fn = &fn;
  loop->n = n;
  {
    std::lock_guard<std::mutex> lock(mu_);
    loops_.push_back(loop);
  }
  cv_.notify_all();
  Drain(*loop);
  {
    std::unique_lock<std::mutex> lock(loop->mu);
    loop->cv.wait(lock, [&] { return loop->done.load() == loop->n; });
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = loops_.begin(); it != loops_.end(); ++it) {
      if (*it == loop) {
        loops_.erase(it);
        break;
      }
    }
  }
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(loop->mu);
    error = loop->error;
  }
  if (error) std::rethrow_exception(error);
}

void ThreadPool::WorkerMain() {
  for (;;) {
    std::shared_ptr<Loop> loop;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] {
        if (stop_) return true;
        for (auto& l : loops_)
          if (l->next.load(std::memory_order_relaxed) < l->n) return true;
        return false;
      });
      if (stop_) return;
      for (auto& l : loops_) {
        if (l->next.load(std::memory_order_relaxed) < l->n) {
          loop = l;
          break;
        }
      }
    }
    if (loop) Drain(*loop);
  }
}

}  // namespace attnd
