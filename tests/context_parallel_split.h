// Test helper: context parallelism driven on engines in one process (engine/context_parallel.h),
// for the CPU and the CUDA backends' tests alike.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "common/status_macros.h"
#include "engine/context_parallel.h"
#include "tests/engine_harness.h"
#include "tests/run_layer.h"

namespace attnd::testing {

// The inputs of one part's call: the queries, the keys, the indexer's, as `kind` of call needs.
inline LayerInputs Part(const LayerData& d, bool keys, bool queries, bool index_queries) {
  LayerInputs in = d.inputs();
  if (!keys) in.kv_latent = in.k_rope = in.index_k = TensorView();
  if (!queries) in.q_latent = in.q_rope = TensorView();
  if (!index_queries) in.index_q = in.index_w = TensorView();
  return in;
}

// Context parallelism (engine/context_parallel.h): one sequence "s" split over engines, part k
// holding positions [bounds[k], bounds[k + 1]); a step's new tokens go to the part holding them
// and the parts before it run attend-only steps; outputs merge by log-sum-exp in float64.
class ContextParallelSplit {
 public:
  ContextParallelSplit(const EngineOptions& options, std::vector<int64_t> bounds)
      : spec_(options.spec), bounds_(bounds) {
    for (size_t k = 0; k + 1 < bounds.size(); ++k) {
      auto e = Engine::Create(options);
      EXPECT_TRUE(e.ok()) << e.status();
      EXPECT_TRUE((*e)->OpenSequence(SequenceKey("", "s")).ok());
      parts_.push_back(std::move(e).value());
    }
  }

  struct Output {
    std::vector<std::vector<double>> out;                 // [layer][T*H*L]
    std::vector<std::vector<std::vector<int32_t>>> keys;  // [layer][T] attended, absolute
  };

  // One step of q_len new tokens at the sequence's end (inside one part's slice).
  absl::StatusOr<Output> Step(int64_t q_len, const std::vector<LayerData>& layers) {
    const int64_t start = length_;
    size_t tail = 0;
    while (start >= bounds_[tail + 1]) ++tail;
    EXPECT_LE(start + q_len, bounds_[tail + 1]) << "a step stays inside one slice";
    std::vector<uint64_t> ids(tail + 1);
    for (size_t k = 0; k <= tail; ++k) {
      StepEntry e{"s", q_len};
      e.position_offset = bounds_[k];
      StepOptions o;
      o.context_parallel = true;
      o.attend_only = k < tail;
      if (o.attend_only) e.query_position = start;
      ASSIGN_OR_RETURN(ids[k], parts_[k]->BeginStep({e}, o));
    }
    const int H = spec_.num_heads, L = spec_.kv_lora_rank;
    const size_t n = static_cast<size_t>(q_len) * H;
    Output res;
    for (int l = 0; l < spec_.num_layers(); ++l) {
      const bool full = spec_.layers[l] == LayerKind::kFull;
      Candidates merged;
      if (full) {
        std::vector<Candidates> cand(tail + 1);
        for (size_t k = 0; k <= tail; ++k)
          RETURN_IF_ERROR(RunCandidatesInto(*parts_[k], ids[k], l,
                                            Part(layers[l], k == tail, false, true), &cand[k]));
        std::vector<const Candidates*> ptrs;
        for (const auto& c : cand) ptrs.push_back(&c);
        RETURN_IF_ERROR(MergeCandidates(ptrs, &merged));
      }
      std::vector<std::vector<float>> out(tail + 1, std::vector<float>(n * L)),
          lse(tail + 1, std::vector<float>(n));
      std::vector<std::vector<int32_t>> keys(q_len);
      for (size_t k = 0; k <= tail; ++k) {
        LayerInputs in = Part(layers[l], k == tail && !full, true, false);
        LayerTrace trace;
        RETURN_IF_ERROR(RunLayerInto(*parts_[k], ids[k], l, in, out[k].data(), 4 * out[k].size(),
                                     &trace, lse[k].data(), full ? &merged : nullptr));
        for (int64_t t = 0; t < q_len; ++t)
          keys[t].insert(keys[t].end(), trace.keys[t].begin(), trace.keys[t].end());
      }
      // out = sum_k exp(lse_k - lse) out_k, lse = log sum_k exp(lse_k), in float64.
      std::vector<double> merged_out(n * L, 0.0);
      for (size_t r = 0; r < n; ++r) {
        double top = -std::numeric_limits<double>::infinity();
        for (size_t k = 0; k <= tail; ++k) top = std::max(top, double{lse[k][r]});
        double denom = 0;
        for (size_t k = 0; k <= tail; ++k) denom += std::exp(lse[k][r] - top);
        for (size_t k = 0; k <= tail; ++k) {
          const double w = std::exp(lse[k][r] - top) / denom;
          for (int i = 0; i < L; ++i) merged_out[r * L + i] += w * out[k][r * L + i];
        }
      }
      for (auto& k : keys) std::sort(k.begin(), k.end());
      res.out.push_back(std::move(merged_out));
      res.keys.push_back(std::move(keys));
    }
    length_ += q_len;
    return res;
  }

  Engine& part(size_t k) { return *parts_[k]; }

 private:
  ModelSpec spec_;
  std::vector<int64_t> bounds_;
  std::vector<std::unique_ptr<Engine>> parts_;
  int64_t length_ = 0;
};

}  // namespace attnd::testing
