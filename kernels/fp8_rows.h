// An fp8 cache's rows (docs/architecture.md, kv_store/cache_layout.h) made from a layer's key
// tensors on the host: the one quantiser every backend uses, so a key is cached as the same bytes
// on every device (and a migration, export or import moves bytes, never re-quantises). Keys given
// as FP8_E4M3 with their scales (an export's) are copied as they are.
#pragma once

#include <cstdint>

#include "common/tensor.h"

namespace attnd {

// Row `row` of a [T, n] key tensor as n e4m3 `values` and their fp32 `scales` (one per `tile`
// values, written as little-endian bytes).
void QuantizeKeyRow(const TensorView& t, int64_t row, int n, int tile, uint8_t* values,
                    uint8_t* scales);

// Row `row` of kv_latent [T, L] and k_rope [T, R] as one latent cache row (fp8::LatentTokenBytes):
// L e4m3 values, their tile scales, R bf16 values.
void PackLatentRow(const TensorView& kv_latent, const TensorView& k_rope, int64_t row, int L, int R,
                   uint8_t* out);

// Row `row` of a query tensor seen as [rows, elems] as fp32 (docs/numerics.md): FP8_E4M3 codes
// times the row's one scale (TensorView::scales, one per token and head), any other datatype
// converted.
void QueryRowToF32(const TensorView& t, int64_t row, int64_t elems, float* dst);

}  // namespace attnd
