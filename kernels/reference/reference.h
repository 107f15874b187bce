// A float64 reference of the per-layer contract (docs/numerics.md), for tests only. Written
// independently of the fast path: whole unpaged histories, naive loops, full sorts.
#pragma once

#include <cstdint>
#include <vector>

#include "common/model_spec.h"

namespace attnd::reference {

// I[s] = Σ_h w[h] relu(q[h]·k[s]) for s in [0, n). q [Hi, Di], w [Hi], keys [n, Di].
std::vector<double> IndexerScores(const ModelSpec& spec, const double* q, const double* w,
                                  const double* keys, int64_t n);

// Positions of the top-k scores by a full sort (score descending, position ascending),
// returned in ascending position order.
std::vector<int32_t> TopK(const std::vector<double>& scores, int64_t k);

// The keys a full layer's query at position n-1 attends, per the spec's selection mode, given
// the scores of positions [0, n). `dense_prefill` is true for a query of a q_len > 1 sequence
// under prefill=dense. Ascending positions.
std::vector<int32_t> SelectKeys(const ModelSpec& spec, const std::vector<double>& scores,
                                bool dense_prefill);

// MLA over the given keys for all heads: q [H, L+R], kv rows [*, L+R] (c_kv | k_pe), out [H, L].
// soft_cap 0 = off. lse, when given, gets [H] natural-log log-sum-exps of the scaled (capped)
// scores (-inf over no keys).
void Attend(const ModelSpec& spec, const double* q, const double* kv,
            const std::vector<int32_t>& keys, double soft_cap, double* out, double* lse = nullptr);

}  // namespace attnd::reference
