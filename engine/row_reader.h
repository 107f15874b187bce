// Reads a sequence's committed cache rows of one layer, as the cache stores them, from its device
// or from the host and disk tiers: the export path (handing a sequence to another server).
#pragma once

#include <cstdint>
#include <functional>
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

// Reads rows [first, first + rows) of the i-th page of the range (first row of the range's i-th
// page), as Device::ReadRows does: latent rows to `latent`, on full layers indexer rows to `index`.
using PageRowReader =
    std::function<absl::Status(size_t i, int first, int rows, uint8_t* latent, uint8_t* index)>;

// Rows [begin, end) of `layer`, the range's pages read by `read` (the first holds row `begin`,
// the ones after it follow the sequence). Appends to *out.
absl::Status ReadLayerRows(const CacheLayout& layout, const ModelSpec& spec, int layer,
                           int64_t begin, int64_t end, const PageRowReader& read,
                           LayerRowBytes* out);

// The same from `device`: pages[0] is its page holding row `begin`.
absl::Status ReadLayerRows(Device& device, const ModelSpec& spec, int layer,
                           const std::vector<int32_t>& pages, int64_t begin, int64_t end,
                           LayerRowBytes* out);

}  // namespace attnd
