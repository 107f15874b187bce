// What attnctl's benches send (attnctl bench, attnctl transport): the same decode layers in each
// form a worker may put on the wire, contexts imported without attention, and layers moved into
// a shared-memory region.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/attnd_client.h"
#include "client/workload.h"

namespace attnd::client::ctl {

// What a worker may put on the wire for the same decode layer (docs/numerics.md).
struct WireVariant {
  const char* name;
  bool absorbed;     // q_nope [T, H, Dn] instead of q_latent (the server holds W_UK, W_UV)
  bool fp8_queries;  // every query tensor FP8_E4M3 with per-token-head scales
  bool fp8_reply;    // out_datatype FP8_E4M3
};

// The layers of `g` as `v` sends them: the same keys and indexer keys, the queries re-encoded.
std::vector<v1::LayerInputs> VariantLayers(const std::vector<GeneratedLayer>& g,
                                           const WireVariant& v, int B, int H, int Dn,
                                           std::mt19937_64& rng);

// Grows each (id, length) of `batch` by `length` tokens with write-only steps (no attention
// computed), a chunk of each sequence at a time: memory stays bounded by the chunk.
absl::Status ImportContexts(Client& c, const ModelSpec& spec, const Batch& batch,
                            std::mt19937_64& rng);

// `layers` with every tensor's bytes copied into `mem` (from `offset` on) and named in region
// `region`, and each output asked into it too (out_bytes each; 0: in the reply).
std::vector<v1::LayerInputs> InSharedMemory(const std::vector<v1::LayerInputs>& layers,
                                            SharedMemory& mem, const std::string& region,
                                            size_t out_bytes);

}  // namespace attnd::client::ctl
