// Key selection on the host, every backend's and the interface's rule in one place: the exact
// top-k, the ranking (NaN below every number, ties to the lower key), page maxima, the page
// modes' best pages, a query's whole selection from its indexer scores, and a query's local
// candidates (context parallelism). The CUDA backend selects on the GPU (kernels/cuda/
// selection.cu) and must agree with these bit for bit; it calls LocalCandidatesOf itself.
// Depends on nothing of any backend. Every function is thread safe and may run concurrently.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "common/model_spec.h"

namespace attnd {

// NaN ranks below every number in a selection.
float RankKey(float score);

// The exact top-k of scores[0, n): the k (or n when smaller) positions with the highest score,
// ties to the lower position, NaN ranked below every number. Writes them to out in ascending
// position order and returns how many were written.
int64_t ExactTopK(const float* scores, int64_t n, int64_t k, int32_t* out);

// Keeps the best `keep` of (score, page) pairs (ties to the lower page), appends `own_page` if
// missing and returns the pages ascending. `cand` is reordered and truncated.
std::vector<int32_t> BestPages(std::vector<std::pair<float, int32_t>>& cand, int keep,
                               int32_t own_page);
// (best RankKey score, page) of every page of scores[0, n), in page order.
void PageMaxima(const float* scores, int64_t n, int page_size,
                std::vector<std::pair<float, int32_t>>* out);

// Page selection for the page modes (docs/numerics.md). `scores` covers positions [0, n) where n -
// 1 is the query's position; the query's own page is (n - 1) / page_size. Both append the attended
// key positions to *out in ascending order.
//  - page_union: pages holding any of `topk` (positions, ascending), best `max_pages` by their
//    best token, plus the own page.
//  - page_budget: the best `budget` pages by their max token score, plus the own page.
void PageUnionSelect(const float* scores, int64_t n, const int32_t* topk, int64_t num_topk,
                     int page_size, int max_pages, std::vector<int32_t>* out);
void PageBudgetSelect(const float* scores, int64_t n, int page_size, int budget,
                      std::vector<int32_t>* out);

// A query's selection under spec.selection from its indexer scores over its n visible keys
// (n - 1 is its position): the key positions it attends, ascending, in *out (replaced).
void SelectKeys(const ModelSpec& spec, const float* scores, int64_t n, std::vector<int32_t>* out);

// A query's local candidates (context parallelism) from its indexer scores over its n visible
// keys: the top-K tokens (token, page_union) or the best `budget` pages by their best token
// (page_budget), best first, ties to the lower key, at most CandidatesPerQuery(spec) of them.
// *keys and *scores (RankKey scores) are replaced.
void LocalCandidatesOf(const ModelSpec& spec, const float* scores, int64_t n,
                       std::vector<int32_t>* keys, std::vector<float>* key_scores);

}  // namespace attnd
