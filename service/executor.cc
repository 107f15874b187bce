#include "service/executor.h"

namespace attnd {

Executor::Executor(int num_threads) {
  for (int i = 0; i < (num_threads < 1 ? 1 : num_threads); ++i)
    threads_.emplace_back([this] { Loop(); });
}

Executor::~Executor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

size_t Executor::queue_depth() {
  std::lock_guard<std::mutex> lock(mu_);
  return tasks_.size();
}

void Executor::Post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void Executor::Loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stop_ and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace attnd
