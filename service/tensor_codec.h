// Wire tensors (attnd.v1.Tensor) to engine views and back, without copying the payload: bytes
// are viewed in place in the request, or in a registered shared-memory region.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attnd/v1/attention.pb.h"
#include "common/tensor.h"
#include "service/shm_registry.h"

namespace attnd {

// Shared-memory regions a request uses, held mapped until it finishes.
using RegionHolds = std::vector<std::shared_ptr<ShmRegistry::Region>>;

// A view of `t`'s bytes (valid while `t` and `holds` live). An unset tensor is
// `present == false`. INVALID_ARGUMENT names the tensor for a bad datatype string, rank, or both
// data and shm; NOT_FOUND for an unknown region. Shapes and byte counts are checked by the engine.
absl::StatusOr<TensorView> ViewOf(const char* name, const v1::Tensor& t, const ShmRegistry& shm,
                                  RegionHolds* holds);

// All seven tensors of a layer message.
absl::StatusOr<LayerInputs> ViewOf(const v1::LayerInputs& in, const ShmRegistry& shm,
                                   RegionHolds* holds);

// Sizes `out` for [tokens, heads, latent] in `dtype` and returns where to write it: into
// `out_shm`'s region when `in` names one (the reply then carries that reference), else into the
// reply's bytes.
absl::StatusOr<void*> PrepareOutput(const v1::LayerInputs& in, v1::Tensor* out, DType dtype,
                                    int64_t tokens, int heads, int latent, const ShmRegistry& shm,
                                    RegionHolds* holds);

}  // namespace attnd
