// Synthetic workloads for attnctl: random layer inputs on the wire plus the exact values they
// encode (for the float64 oracle), and latency statistics.
#pragma once

#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attnd/v1/attention.pb.h"
#include "common/model_spec.h"
#include "kernels/reference/step_oracle.h"
#include "proto/convert/model_spec_proto.h"

namespace attnd::client {

struct GeneratedLayer {
  v1::LayerInputs wire;
  reference::LayerValues values;
};

// Random N(0, 1) inputs for every layer of a step of T tokens in `dtype`. Write-only steps get
// only kv_latent, k_rope and (full layers) index_k.
std::vector<GeneratedLayer> GenerateStep(const ModelSpec& spec, int64_t tokens, DType dtype,
                                         bool write_only, std::mt19937_64& rng);
// One layer of GenerateStep (the same draws, in the same order: GenerateStep is this for every
// layer), for callers that send a layer before making the next.
GeneratedLayer GenerateLayer(const ModelSpec& spec, int layer, int64_t tokens, DType dtype,
                             bool write_only, std::mt19937_64& rng);

// Sample collector for latencies in seconds.
class LatencyStats {
 public:
  void Add(double seconds) { samples_.push_back(seconds); }
  size_t count() const { return samples_.size(); }
  double Percentile(double p) const;  // p in [0, 100]
  double Sum() const;

 private:
  std::vector<double> samples_;
};

}  // namespace attnd::client
