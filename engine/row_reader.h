// Reads a sequence's committed cache rows of one layer from its device, as the cache stores them:
// the export path (handing a sequence to another server).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/model_spec.h"
#include "kernels/device.h"

namespace attnd {

// kv_latent [n, L], k_rope [n, R] and, on full layers, index_k [n, Di] (empty otherwise), in the
// cache dtype. An fp8 cache's: kv_latent e4m3 with kv_latent_scales [n, tiles] fp32, k_rope bf16,
// index_k e4m3 with index_k_scales [n] fp32.
struct LayerRowBytes {
  std::string kv_latent, k_rope, index_k;
  std::string kv_latent_scales, index_k_scales;
};

// Rows [begin, end) of `layer`; pages[0] is the page holding row `begin`, and the pages after it
// follow the sequence. Appends to *out.
absl::Status ReadLayerRows(Device& device, const ModelSpec& spec, int layer,
                           const std::vector<int32_t>& pages, int64_t begin, int64_t end,
                           LayerRowBytes* out);

}  // namespace attnd
