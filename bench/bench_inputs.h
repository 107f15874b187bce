// Random bf16 layer inputs for the benchmarks (engine_bench, tier_bench): the tensors live in a
// Tensors that outlives the LayerInputs viewing them.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <random>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "common/model_spec.h"
#include "engine/engine.h"

namespace attnd::bench {

struct Tensors {
  std::vector<std::vector<uint16_t>> bufs;
  TensorView Add(std::mt19937& rng, std::initializer_list<int64_t> shape) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    std::normal_distribution<float> dist(0, 1);
    std::vector<uint16_t> b(n);
    for (auto& x : b) x = F32ToBF16(dist(rng));
    bufs.push_back(std::move(b));
    return TensorView::Of(DType::kBF16, shape, bufs.back().data(), n * 2);
  }
};

// One layer call's tensors for T tokens: the new keys (and on a full layer the indexer key),
// then unless write_only the queries (and on a full layer the indexer's).
inline LayerInputs MakeInputs(const ModelSpec& s, int64_t T, bool full, bool write_only,
                              Tensors& tb, std::mt19937& rng) {
  LayerInputs in;
  in.kv_latent = tb.Add(rng, {T, s.kv_lora_rank});
  in.k_rope = tb.Add(rng, {T, s.qk_rope_head_dim});
  if (full) in.index_k = tb.Add(rng, {T, s.index_head_dim});
  if (write_only) return in;
  in.q_latent = tb.Add(rng, {T, s.num_heads, s.kv_lora_rank});
  in.q_rope = tb.Add(rng, {T, s.num_heads, s.qk_rope_head_dim});
  if (full) {
    in.index_q = tb.Add(rng, {T, s.index_n_heads, s.index_head_dim});
    in.index_w = tb.Add(rng, {T, s.index_n_heads});
  }
  return in;
}

}  // namespace attnd::bench
