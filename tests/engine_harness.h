// Test harness: drives an Engine with random steps and checks every layer against the float64
// reference, keeping each sequence's full unpaged history on the side.
#pragma once

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "kernels/reference/step_oracle.h"

namespace attnd::testing {

// A tensor held by the test: bytes in `dtype` plus the exact values those bytes encode.
struct HostTensor {
  bool present = false;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
  std::vector<double> values;
  std::vector<float> scales;  // FP8_E4M3 queries: one per row of the last dim
  TensorView view() const;
};

// Random N(0, scale²) values rounded to dtype; never all zeros.
HostTensor RandomTensor(DType dtype, std::vector<int64_t> shape, std::mt19937_64& rng,
                        double scale = 1.0);

struct LayerData {
  HostTensor q_latent, q_rope, kv_latent, k_rope, index_q, index_k, index_w;
  LayerInputs inputs() const;
  reference::LayerValues values() const;
};

// Random FP8_E4M3 query values with one fp32 scale per row of the last dim (amax / 448, not a
// power of two); `values` are the dequantised ones, code x scale in fp32, as the server computes.
HostTensor RandomFp8Query(std::vector<int64_t> shape, std::mt19937_64& rng);

// Random inputs of every layer of a step of T tokens, in `dtype` (indexer tensors on full layers).
// kFP8E4M3: the queries (q_latent, q_rope, index_q) in fp8 with per-token-head scales, the rest
// in BF16.
// queries=false: the keys alone (a write-only step's inputs; the queries are T x H x 576 values,
// tens of GB for an import of 100K tokens at 128 heads).
std::vector<LayerData> RandomLayers(const ModelSpec& spec, int64_t T, DType dtype, uint64_t seed,
                                    bool queries = true);

// The tiny preset with one layer of each kind (full, shared, full, dense: IndexShare, a sliding
// window and a soft cap) under `mode`, top-24, at most 3 union pages, a budget of 2 pages.
ModelSpec MixedLayerSpec(SelectionMode mode);

// Engine options for tests: `spec`, `pages` per device, a `cache` dtype, two threads.
EngineOptions TestEngineOptions(ModelSpec spec, int32_t pages, DType cache = DType::kF32);

// Everything observable about the engine's state on device 0: the named sequences (id, length,
// pages, in_step), page refcounts, free pages, open steps. A failed or refused call must leave
// it equal.
struct EngineSnapshot {
  std::vector<SequenceInfo> seqs;
  std::vector<int32_t> refcounts;
  int32_t free_pages = 0;
  int64_t open_steps = 0;
  bool operator==(const EngineSnapshot& o) const;
};
EngineSnapshot TakeSnapshot(Engine& e, const std::vector<std::string>& ids);

using reference::LayerCheck;
using reference::RelL2;

class Harness {
 public:
  explicit Harness(EngineOptions options);
  Engine& engine() { return *engine_; }
  const ModelSpec& spec() const { return engine_->spec(); }

  void Open(const std::string& id, int device = -1, int64_t import_length = 0);
  void Fork(const std::string& id, const std::string& parent, int64_t prefix_len, int device = -1);
  // A standby copy (Engine::OpenStandby); the reference follows its write-only steps.
  void OpenStandby(const std::string& id, uint64_t generation);
  void Close(const std::string& id);
  // Opens `id` on the prefix cache's blocks of `prefix` (Engine::OpenSequence); the reference
  // takes its cached tokens from `donor`, a sequence (open in the reference, closed or not in
  // the engine) whose first tokens those blocks hold. Returns the cached tokens.
  int64_t OpenCached(const std::string& id, PrefixQuery prefix, const std::string& donor,
                     int device = -1);
  int64_t Length(const std::string& id) const;

  // Random inputs for every layer of a step over `batch`, in `dtype`.
  std::vector<LayerData> MakeInputs(const std::vector<StepEntry>& batch, DType dtype,
                                    uint64_t seed);
  // The keys alone, for a write-only step (StepOptions::WriteOnly()).
  std::vector<LayerData> MakeKeys(const std::vector<StepEntry>& batch, DType dtype, uint64_t seed);

  // Runs the step on the engine. On success records the new keys in the histories and returns
  // per-layer outputs (as doubles) and traces.
  struct Result {
    absl::Status status;
    std::vector<std::vector<double>> out;  // [layer][T*H*L]
    std::vector<std::vector<double>> lse;  // [layer][T*H] (every call asks for it)
    std::vector<LayerTrace> traces;
  };
  // With options.write_only the queries are not sent and no output comes back.
  Result Run(const std::vector<StepEntry>& batch, const std::vector<LayerData>& layers,
             const StepOptions& options = {});

  // The reference outputs for a step that has just run (histories already include its keys),
  // comparing selections with the engine's traces; fills checks[layer] (and lse[layer]).
  std::vector<std::vector<double>> Reference(const std::vector<StepEntry>& batch,
                                             const std::vector<LayerData>& layers,
                                             const std::vector<LayerTrace>& traces,
                                             std::vector<LayerCheck>* checks,
                                             std::vector<std::vector<double>>* lse = nullptr) const;

  // For the step that has just run (as Reference): per layer, the queries whose selection in
  // run `a` or run `b` differs from the float64 one beyond score ties (the oracle's rule). Two
  // backends or kernels that sum scores in different orders may keep different keys among ties;
  // 0 everywhere means their top-k sets agree under that rule.
  std::vector<int> SelectionsBeyondTies(const std::vector<StepEntry>& batch,
                                        const std::vector<LayerData>& layers,
                                        const std::vector<LayerTrace>& a,
                                        const std::vector<LayerTrace>& b) const;

  // Run + Reference + the checks as gtest expectations with `tol` relative L2 (and each query
  // head's log-sum-exp within tol x (1 + |lse|)). Returns outputs.
  std::vector<std::vector<double>> RunAndCheck(const std::vector<StepEntry>& batch, DType dtype,
                                               uint64_t seed, double tol);

  // Worst relative L2 seen by RunAndCheck so far.
  double worst_rel_l2() const { return worst_; }

 private:
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<reference::StepOracle> oracle_;
  double worst_ = 0;
};

}  // namespace attnd::testing
