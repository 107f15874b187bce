// What became of recently ended steps (CANCELLED, DEADLINE_EXCEEDED, "already committed"): the
// status a late layer message for one of them gets, instead of a bare NOT_FOUND.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"

namespace attnd {

// Remembers the last `capacity` fates. Not thread safe: the engine calls it under its lock.
class StepFates {
 public:
  explicit StepFates(size_t capacity = 8192) : capacity_(capacity) {}

  void Remember(uint64_t step, absl::Status fate) {
    if (fates_.insert_or_assign(step, std::move(fate)).second) order_.push_back(step);
    while (order_.size() > capacity_) {
      fates_.erase(order_.front());
      order_.pop_front();
    }
  }
  // The fate of `step`, or nullptr when it is not remembered.
  const absl::Status* Find(uint64_t step) const {
    auto it = fates_.find(step);
    return it == fates_.end() ? nullptr : &it->second;
  }

 private:
  size_t capacity_;
  absl::flat_hash_map<uint64_t, absl::Status> fates_;
  std::deque<uint64_t> order_;
};

}  // namespace attnd
