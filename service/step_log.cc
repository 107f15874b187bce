#include "service/step_log.h"

#include <glog/logging.h>

#include <string>

namespace attnd {

void StepLog::Record(const char* method, const absl::Status& status) {
  if (status.ok()) return;
  int64_t dropped = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    if (now - window_ >= std::chrono::seconds(1)) {
      window_ = now;
      in_window_ = 0;
    }
    if (in_window_ >= per_second_) {
      ++suppressed_;
      ++total_suppressed_;
      return;
    }
    ++in_window_;
    dropped = suppressed_;
    suppressed_ = 0;
  }
  // Capacity and client mistakes are warnings; a broken device or invariant is an error.
  const bool severe =
      status.code() == absl::StatusCode::kInternal || status.code() == absl::StatusCode::kDataLoss;
  const std::string suffix =
      dropped > 0 ? " (" + std::to_string(dropped) + " similar lines dropped)" : "";
  if (severe) {
    LOG(ERROR) << method << ": " << status << suffix;
  } else {
    LOG(WARNING) << method << ": " << status << suffix;
  }
}

int64_t StepLog::suppressed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return total_suppressed_;
}

}  // namespace attnd
