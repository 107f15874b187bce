// Logs one line per refused or failed step-path call (a rejected sequence or step, an aborted
// step and why), rate-limited: at most `per_second` lines a second, the rest counted and reported
// by the next line that gets through. Status messages already quote at most a short prefix of
// client text, so a line never carries a client's payload. Thread safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>

#include "absl/status/status.h"

namespace attnd {

class StepLog {
 public:
  explicit StepLog(int per_second = 20) : per_second_(per_second) {}
  // `method` failed with `status` (OK statuses are ignored).
  void Record(const char* method, const absl::Status& status);
  int64_t suppressed() const;

 private:
  const int per_second_;
  mutable std::mutex mu_;
  std::chrono::steady_clock::time_point window_;
  int in_window_ = 0;
  int64_t suppressed_ = 0;        // dropped since the last line
  int64_t total_suppressed_ = 0;  // dropped ever
};

}  // namespace attnd
