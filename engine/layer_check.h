// Checks a layer call's tensors against its step before any work: shapes, which tensors a layer
// kind takes, the output size, and (optionally) that every value is finite.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "common/model_spec.h"
#include "common/tensor.h"

namespace attnd {

// INVALID_ARGUMENT naming the first tensor that does not fit layer `layer` of a step of T tokens
// (write-only steps take only the keys and no output), or OK.
absl::Status CheckLayerShapes(const ModelSpec& spec, int64_t tokens, bool write_only, int layer,
                              const LayerInputs& in, size_t out_bytes);
// INVALID_ARGUMENT when the call's tensors are not all of one datatype (FP32 queries with BF16
// keys would otherwise be converted silently), naming the first that differs. CheckLayerShapes
// runs it first.
absl::Status CheckLayerDTypes(const LayerInputs& in);
// INVALID_ARGUMENT naming the first tensor holding a NaN or an infinity, or OK.
absl::Status CheckLayerFinite(const LayerInputs& in);

}  // namespace attnd
