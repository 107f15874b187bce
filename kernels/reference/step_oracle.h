// The float64 oracle of whole steps: keeps every sequence's unpaged key history and computes
// what each layer of a step must return (docs/numerics.md). Used by tests and by `attnctl demo`.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/model_spec.h"

namespace attnd::reference {

// One layer's inputs of a step as the exact values the request's bytes encode, T rows each.
// Indexer vectors are empty on shared and dense layers.
struct LayerValues {
  std::vector<double> q_latent;   // [T, H, L]
  std::vector<double> q_rope;     // [T, H, R]
  std::vector<double> kv_latent;  // [T, L]
  std::vector<double> k_rope;     // [T, R]
  std::vector<double> index_q;    // [T, Hi, Di]
  std::vector<double> index_k;    // [T, Di]
  std::vector<double> index_w;    // [T, Hi]
};

// How one layer of a step compared with the engine.
struct LayerCheck {
  int selection_mismatches = 0;  // queries whose keys differ beyond score ties
  int tie_swaps = 0;             // queries whose keys differ only among tied scores
};

class StepOracle {
 public:
  // Keys are kept rounded to `cache_dtype`, as the server's caches hold them (kFP8E4M3: quantised
  // per tile with power-of-two scales, the rope part bf16; docs/architecture.md).
  StepOracle(ModelSpec spec, DType cache_dtype);
  const ModelSpec& spec() const { return spec_; }

  void Open(const std::string& id);
  void Fork(const std::string& id, const std::string& parent, int64_t prefix_len);
  void Close(const std::string& id);
  int64_t Length(const std::string& id) const;
  // Rows [begin, end) of `layer` of `id`'s keys as cached: L + R values each (latent, rope).
  std::vector<double> Rows(const std::string& id, int layer, int64_t begin, int64_t end) const;

  // Appends a committed step's keys to the histories. batch: (sequence id, q_len) in order.
  void Commit(const std::vector<std::pair<std::string, int64_t>>& batch,
              const std::vector<LayerValues>& layers);

  // The expected [T*H*L] output of every layer of a step that was just committed. When
  // `engine_keys` ([layer][token] attended positions) is given, a full layer whose selection
  // differs from the oracle's only among keys whose float64 scores tie within fp32 rounding
  // (token mode) is evaluated with the engine's keys; other differences count as mismatches.
  // lse, when given, gets each layer's [T*H] log-sum-exps (LayerOutput.lse).
  std::vector<std::vector<double>> Expected(
      const std::vector<std::pair<std::string, int64_t>>& batch,
      const std::vector<LayerValues>& layers,
      const std::vector<std::vector<std::vector<int32_t>>>* engine_keys = nullptr,
      std::vector<LayerCheck>* checks = nullptr,
      std::vector<std::vector<double>>* lse = nullptr) const;

 private:
  struct History {
    std::vector<std::vector<double>> kv;   // [layer][n * (L+R)]
    std::vector<std::vector<double>> idx;  // [layer][n * Di] (full layers only)
    int64_t length = 0;
  };
  ModelSpec spec_;
  DType cache_dtype_;
  std::map<std::string, History> hist_;
};

// ||a - b|| / ||b||.
double RelL2(const std::vector<double>& a, const std::vector<double>& b);

}  // namespace attnd::reference
