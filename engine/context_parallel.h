// Context parallelism (docs/numerics.md): one logical sequence spread over several servers, each
// holding a contiguous, page-aligned slice of its positions. Dense and shared layers merge the
// servers' partial attentions by log-sum-exp; a full layer first gathers every server's local
// top-k candidates (Engine::RunCandidates), the client merges them (MergeCandidates), and each
// server then attends its part of the global selection (Engine::RunLayer with
// LayerInputs::selection), which equals one server holding the whole sequence.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "common/candidates.h"
#include "common/model_spec.h"
#include "engine/step_plan.h"
#include "kernels/device.h"

namespace attnd {

// The local positions a query at absolute position `query_pos` attends on this server, whose
// slice starts at absolute position `offset` and shows the query `visible` keys, given its
// merged candidates keys[0, count) (scores alongside): the keys themselves (token mode), or the
// pages they rank plus the query's own page, expanded (page modes). Ascending.
void LocalSelection(const ModelSpec& spec, int32_t count, const int64_t* keys, const float* scores,
                    int64_t query_pos, int64_t offset, int64_t visible, std::vector<int32_t>* out);

// INVALID_ARGUMENT unless `sel` fits a step of `queries` whose absolute positions are
// `query_pos` and which need the indexer where `needs_index` is set: one count per query, at most
// `keep` keys each, none for queries that need no indexer, every key distinct, finite-ranked and
// visible to its query (a position <= the query's, a page <= its own).
absl::Status CheckSelection(const ModelSpec& spec, const std::vector<int64_t>& query_pos,
                            const std::vector<uint8_t>& needs_index, const Candidates& sel);

// A step's merged selection (a kSelection call's) as each plan share's local positions:
// (*kept)[share][i] for the share's token i (empty for tokens that need no indexer).
// INVALID_ARGUMENT (CheckSelection) when it does not fit the step's `tokens` queries.
absl::Status LocalSelections(const ModelSpec& spec, const StepPlan& plan, int64_t tokens,
                             const Candidates& sel,
                             std::vector<std::vector<std::vector<int32_t>>>* kept);

// Every share's local candidates (a kCandidates call's, local[share][i]) in absolute keys and
// step order: positions shifted by each slice's offset, or page ids by its first page.
Candidates GatherCandidates(const ModelSpec& spec, const StepPlan& plan, int64_t tokens,
                            const std::vector<std::vector<LayerCall::LocalCandidates>>& local);

}  // namespace attnd
