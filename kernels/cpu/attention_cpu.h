// The CPU backend's per-query operations: indexer scores and MLA attention over paged caches
// (selection, every backend's, is kernels/selection.h). Device-neutral inputs (CacheRows and
// PageTable, spans as pointer + count); fp32 accumulation everywhere. Every function is thread
// safe and may run concurrently.
#pragma once

#include <cstdint>

#include "kernels/cpu/cpu_isa.h"
#include "kernels/selection.h"
#include "kv_store/page_table.h"

namespace attnd::cpu {

// I[s] = Σ_h w[h] · relu(q[h,:] · k[s,:]) for key positions s in [begin, end).
struct IndexerScoreParams {
  const float* q = nullptr;  // [num_heads, head_dim] indexer query of one token
  const float* w = nullptr;  // [num_heads] indexer head weights
  int num_heads = 0;
  int head_dim = 0;
  CacheRows keys;   // indexer-key cache rows, dim == head_dim
  PageTable table;  // the query's sequence is table sequence `seq`
  int32_t seq = 0;
  int64_t begin = 0;        // first key position
  int64_t end = 0;          // one past the last
  float* scores = nullptr;  // [end - begin] output
};
void IndexerScores(const Kernels& k, const IndexerScoreParams& p);

// MLA for one query token over a set of keys, for heads [0, num_heads) of q:
//   s_j = sm_scale·(q_latent·c_kv_j + q_rope·k_pe_j) [soft-capped], p = softmax(s),
//   out = Σ_j p_j c_kv_j.
// Keys are either the explicit physical `slots` (num_keys of them: a selection, translated
// through the page table once when it was made) or, when slots is null, the positions
// [begin, end) of table sequence `seq`.
struct MlaParams {
  const float* q = nullptr;  // [num_heads, L+R]: q_latent | q_rope per head
  int num_heads = 0;
  int latent_dim = 0;  // L
  int rope_dim = 0;    // R
  CacheRows kv;        // latent cache rows [c_kv | k_pe], dim == L+R
  const int32_t* slots = nullptr;
  int64_t num_keys = 0;
  PageTable table;  // range mode
  int32_t seq = 0;
  int64_t begin = 0;
  int64_t end = 0;
  float sm_scale = 1.0f;
  float soft_cap = 0.0f;  // 0 = off
  float* out = nullptr;   // [num_queries * num_heads, L]
  // Optional [num_queries * num_heads]: each score row's natural-log log-sum-exp of its scaled
  // (and capped) scores, -inf for a row that sees no key (partial attentions merge by it).
  float* lse = nullptr;
  // A block of queries sharing the key range [begin, end) (prefill): q and out hold
  // num_queries x num_heads rows, and query i sees only keys in [row_begin[i], row_end[i]).
  // Sharing each converted key tile across the block is what makes prefill fast.
  int num_queries = 1;
  const int64_t* row_begin = nullptr;  // [num_queries]; range mode only
  const int64_t* row_end = nullptr;    // [num_queries]; range mode only
};
void MlaAttend(const Kernels& k, const MlaParams& p);

}  // namespace attnd::cpu
