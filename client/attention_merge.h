// Merging attention computed over disjoint key sets: a sequence whose positions are split over
// several attnd servers (docs/numerics.md), each attending its own keys and returning its output
// with each query head's log-sum-exp (LayerInputs.return_lse, LayerOutput.lse).
//
//   out = sum_i exp(lse_i - lse) out_i,   lse = log sum_i exp(lse_i)
//
// which is exactly the softmax attention over the union of the parts' keys.
#pragma once

#include <cstdint>
#include <vector>

namespace attnd::client {

// One part: rows x dim outputs (rows = T * H query heads, dim = L) and rows log-sum-exps, fp32.
struct AttentionPart {
  const float* out = nullptr;
  const float* lse = nullptr;
};

// Writes the merged out [rows, dim] and lse [rows] (either may alias nothing of the parts).
// Computed in float64. Parts with lse -inf for a row (no key seen) add nothing to it; a row no
// part saw gets out 0 and lse -inf, as one server attending nothing reports. A NaN lse or output
// makes its row NaN.
void MergeAttention(const std::vector<AttentionPart>& parts, int64_t rows, int64_t dim, float* out,
                    float* lse);

}  // namespace attnd::client
