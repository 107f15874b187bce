// What became of recently ended steps (CANCELLED, DEADLINE_EXCEEDED, "already committed"): the
// status a late layer message for one of them gets, instead of a bare NOT_FOUND.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"

namespace attnd {

// Remembers the last `capacity` fates. Not thread safe: the engine calls it under its lock.
class StepFates {
 public:
  explicit StepFates(size_t capacity = 8192) : capacity_(capacity) {}

  // `tenant` owned the step: only it is told the fate (others are told the step does not exist).
  void Remember(uint64_t step, std::string tenant, absl::Status fate) {
    if (fates_.insert_or_assign(step, Fate{std::move(tenant), std::move(fate)}).second)
      order_.push_back(step);
    while (order_.size() > capacity_) {
      fates_.erase(order_.front());
      order_.pop_front();
    }
  }
  // The fate of `tenant`'s step `step`, or nullptr when it is not remembered.
  const absl::Status* Find(uint64_t step, const std::string& tenant) const {
    auto it = fates_.find(step);
    return it == fates_.end() || it->second.tenant != tenant ? nullptr : &it->second.status;
  }
  // Whether `step` is remembered, for any tenant (a new step id must not reuse it).
  bool Contains(uint64_t step) const { return fates_.contains(step); }

 private:
  struct Fate {
    std::string tenant;
    absl::Status status;
  };
  size_t capacity_;
  absl::flat_hash_map<uint64_t, Fate> fates_;
  std::deque<uint64_t> order_;
};

}  // namespace attnd
