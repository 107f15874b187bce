// Tensor-parallel shards of one worker send their slice of the heads for each layer of a
// sharded step; this collects them until every shard's message for the layer is in, then hands
// the set to one computation (docs/architecture.md). Thread safe.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "attnd/v1/attention.pb.h"
#include "engine/engine.h"
#include "service/shm_registry.h"

namespace attnd {

class ShardGather {
 public:
  using Clock = std::chrono::steady_clock;
  // One shard's message: its inputs, where its output goes, and how to answer it. The pointers
  // stay valid until `done` runs.
  struct Part {
    const v1::LayerInputs* in = nullptr;
    v1::LayerOutput* out = nullptr;
    std::function<void(absl::Status)> done;
    // The shared memory this shard's own caller may name (its transport and tenant decide, not
    // the last shard to arrive's).
    ShmAccess shm;
  };

  // Steps are named by StepRef: another tenant's sharded step reads as one that is not there.
  void Register(const StepRef& step, int num_shards);
  // 0 when `step` is not sharded (or unknown).
  int NumShards(const StepRef& step) const;
  // Checks that `shard` may join `step`: NOT_FOUND, INVALID_ARGUMENT (shard out of range).
  absl::Status CheckJoin(const StepRef& step, int shard) const;
  // Parks one shard's message. Returns every shard's part (sorted by shard) when this was the
  // last one for the layer, nullopt while others are missing, or an error (the part is not kept:
  // its caller answers it) for a shard out of range, a repeated shard or a different layer.
  absl::StatusOr<std::optional<std::vector<Part>>> Add(const StepRef& step, Part part);
  // Answers every parked part of `step` with `status` and forgets the step.
  void Fail(const StepRef& step, const absl::Status& status);
  void Forget(const StepRef& step);
  // Sharded steps with a part parked longer than `idle` (some shard never came).
  std::vector<StepRef> Stale(Clock::duration idle) const;
  // Every registered step.
  std::vector<StepRef> Steps() const;

 private:
  struct Entry {
    std::string tenant;
    int num_shards = 0;
    int layer = -1;  // layer of the parked parts
    Clock::time_point since;
    std::vector<std::optional<Part>> parts;
    int parked = 0;
  };
  // The entry of `step` if its tenant owns it, else end(). mu_ held.
  std::map<uint64_t, Entry>::const_iterator Find(const StepRef& step) const;
  std::map<uint64_t, Entry>::iterator Find(const StepRef& step);
  mutable std::mutex mu_;
  std::map<uint64_t, Entry> steps_;
};

}  // namespace attnd
