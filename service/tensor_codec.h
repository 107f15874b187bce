// Wire tensors (attnd.v1.Tensor) to engine views and back, without copying the payload.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "attnd/v1/attention.pb.h"
#include "engine/engine.h"

namespace attnd {

// A view of `t`'s bytes (valid while `t` lives). An unset tensor (no datatype, no shape, no
// data) is `present == false`. INVALID_ARGUMENT names the tensor for a bad datatype string or
// rank; shapes and byte counts are checked by the engine against the step.
absl::StatusOr<TensorView> ViewOf(const char* name, const v1::Tensor& t);

// All seven tensors of a layer message.
absl::StatusOr<LayerInputs> ViewOf(const v1::LayerInputs& in);

// Sizes `out` for [T, H, L] in `dtype` and returns where the engine writes it.
void* PrepareOutput(v1::Tensor* out, DType dtype, int64_t tokens, int heads, int latent);

}  // namespace attnd
