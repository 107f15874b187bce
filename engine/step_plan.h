// A step's plan, built once when the step opens and reused by every layer (FlashInfer's
// plan/run split): which device computes which token, each token's position and slot, the page
// tables, which queries need the indexer, and the query blocks of range attention.
#pragma once

#include <cstdint>
#include <vector>

#include "common/model_spec.h"
#include "kernels/device.h"

namespace attnd {

// One batch entry as the plan sees it: `q_len` new tokens after `length` committed ones, on
// `device`, whose page table (committed pages and the step's new ones) is `*pages`.
struct PlanEntry {
  int device = 0;
  int64_t length = 0;
  int64_t q_len = 0;
  const std::vector<int32_t>* pages = nullptr;
  // Context parallelism: the absolute position of the sequence's local key 0; with attend_only
  // the queries sit at absolute positions query_pos.. after every local key and write nothing.
  bool context_parallel = false;
  int64_t offset = 0;
  bool attend_only = false;
  int64_t query_pos = 0;
};

struct StepPlan {
  int64_t tokens = 0;  // T: the step's new tokens, entry after entry in batch order
  struct Share {
    int device = 0;
    StepShare share;
  };
  std::vector<Share> shares;  // one per device holding tokens, ascending device

  // Builds the plan; a write_only step's shares only write keys (StepShare::write_only). May
  // throw std::bad_alloc (the caller rolls back).
  static StepPlan Build(const ModelSpec& spec, const std::vector<PlanEntry>& batch,
                        bool write_only = false);
};

// Sets keys[share.rows[i]] to what share token i attended on a layer of `kind`: its visible key
// range (dense layers, queries needing no indexer) or (*selected)[i] (moved from).
void TraceAttended(const ModelSpec& spec, LayerKind kind, const StepShare& share,
                   std::vector<std::vector<int32_t>>* selected,
                   std::vector<std::vector<int32_t>>* keys);

// Consecutive queries sharing key tiles in one CPU attention task (prefill).
inline constexpr int kQueryBlock = 8;

// The most keys one query's selection can hold under the spec's selection mode, given that the
// query sees `visible` keys.
int64_t MaxSelected(const ModelSpec& spec, int64_t visible);

}  // namespace attnd
