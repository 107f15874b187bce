// The engine's one mutex (Engine::Impl::mu, which guards every sequence, step and page table:
// engine/engine_impl.h says what it guards). A std::mutex that counts, per thread, how often it
// was taken, and how often a step was looked up, so that a test can hold a layer call to its
// budget (docs/architecture.md: one step lookup, at most two acquisitions) without timing.
#pragma once

#include <cstdint>
#include <mutex>

namespace attnd {

// What the engine did on the calling thread since it started.
struct EngineCallCounts {
  int64_t lock_acquisitions = 0;  // of the engine mutex
  int64_t step_lookups = 0;       // a client's step id resolved (Engine::Impl::FindStep)
};

class EngineMutex {
 public:
  void lock() {
    mu_.lock();
    ++counts_.lock_acquisitions;
  }
  bool try_lock() {
    if (!mu_.try_lock()) return false;
    ++counts_.lock_acquisitions;
    return true;
  }
  void unlock() { mu_.unlock(); }

  static void CountStepLookup() { ++counts_.step_lookups; }
  static EngineCallCounts CountsOnThisThread() { return counts_; }

 private:
  std::mutex mu_;
  static inline thread_local EngineCallCounts counts_;
};

using EngineLock = std::unique_lock<EngineMutex>;

}  // namespace attnd
