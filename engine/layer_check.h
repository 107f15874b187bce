// Checks a layer call's tensors against its step before any work: shapes, which tensors a layer
// kind takes, the output size, and (optionally) that every value is finite.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "common/absorption.h"
#include "common/model_spec.h"
#include "common/tensor.h"

namespace attnd {

// INVALID_ARGUMENT naming the first tensor that does not fit layer `layer` of a step of T tokens
// on a cache of `cache_dtype` (write-only steps take only the keys and no output), or OK.
// `absorb`: the server's absorption weights (null: none, and q_nope is FAILED_PRECONDITION).
absl::Status CheckLayerShapes(const ModelSpec& spec, DType cache_dtype, int64_t tokens,
                              bool write_only, int layer, const LayerInputs& in, size_t out_bytes,
                              const Absorption* absorb = nullptr);
// The messages of a context-parallel step's layer (docs/numerics.md, engine/context_parallel.h).
enum class CpMessage {
  kCandidates,  // full layers, first: the keys (unless attend-only) and index_q, index_w
  kSelection,   // full layers, then: the queries (q_latent or q_nope, q_rope) and the selection
  kLayer,       // dense and shared layers: the keys (unless attend-only) and the queries
};
// CheckLayerShapes for a context-parallel call; `attend_only` steps never carry keys;
// `selection_given`: the call carries a selection (only kSelection messages take one).
absl::Status CheckContextParallelShapes(const ModelSpec& spec, DType cache_dtype, int64_t tokens,
                                        int layer, CpMessage message, bool attend_only,
                                        bool selection_given, const LayerInputs& in,
                                        size_t out_bytes, const Absorption* absorb);
// INVALID_ARGUMENT when the call's tensors are not all of one datatype (FP32 queries with BF16
// keys would otherwise be converted silently), naming the first that differs. The exceptions:
// kv_latent and index_k may come as FP8_E4M3 with scales, quantised as an fp8 cache holds keys
// (an export's), into an fp8 cache only; q_latent, q_rope and index_q may come as FP8_E4M3 with
// one scale per token and head (fewer bytes on the wire), into any cache. CheckLayerShapes runs
// it first.
absl::Status CheckLayerDTypes(const LayerInputs& in, DType cache_dtype);
// INVALID_ARGUMENT naming the first tensor holding a NaN or an infinity, or OK.
absl::Status CheckLayerFinite(const LayerInputs& in);
// INVALID_ARGUMENT naming the first fp8 key scale that is not a power of two in [2^-126, 2^119]
// (what an fp8 cache holds, so dequantising stays exact) or fp8 query scale that is not positive
// and finite, or OK. Reads the scales: after shared memory.
absl::Status CheckFp8Scales(const LayerInputs& in);

// The output's datatype: q_latent's (q_nope's), or BF16 for FP8_E4M3 queries (the output is
// never fp8).
DType OutputDType(const LayerInputs& in);
// The output's per-head width: V for an absorbed call (q_nope given), else L.
int OutputHeadDim(const ModelSpec& spec, const LayerInputs& in, const Absorption* absorb);

}  // namespace attnd
