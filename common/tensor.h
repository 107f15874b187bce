// Tensors as the engine sees them: a dtype, a shape and a view of raw little-endian bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "common/dtype.h"

namespace attnd {

// A read-only view of a row-major tensor owned by the caller. `present == false` means the tensor
// was not given at all (e.g. indexer inputs on a shared layer).
struct TensorView {
  static constexpr int kMaxRank = 4;
  bool present = false;
  DType dtype = DType::kBF16;
  int rank = 0;
  int64_t dims[kMaxRank] = {0, 0, 0, 0};
  const void* data = nullptr;
  size_t nbytes = 0;
  // kFP8E4M3 tensors only: their fp32 scales, [dims[0], ..., dims[rank-2], scales_per_row], each
  // scaling dims[rank-1] / scales_per_row consecutive values of a row (Tensor.scales on the wire).
  const void* scales = nullptr;
  size_t scales_nbytes = 0;
  int64_t scales_per_row = 0;

  static TensorView Of(DType dtype, std::initializer_list<int64_t> shape, const void* data,
                       size_t nbytes);
  int64_t num_elements() const;
  // Row `row` of the tensor seen as [rows, elems] (bytes; shape checked by the caller).
  const uint8_t* Row(int64_t row, int64_t elems) const {
    return static_cast<const uint8_t*>(data) + row * elems * static_cast<int64_t>(DTypeSize(dtype));
  }
  std::string ShapeString() const;  // "[8, 16, 512]"
};

// The tensors of one layer call (docs/architecture.md), T = total new tokens of the step in batch
// order. Indexer tensors are given on full layers only. Each may have its own dtype; the output
// takes q_latent's. With server-side absorption (common/absorption.h) a call may give q_nope
// instead of q_latent: the server absorbs it and returns [T, H, V] instead of [T, H, L].
struct LayerInputs {
  TensorView q_latent;   // [T, H, L]
  TensorView q_nope;     // [T, H, Dn], instead of q_latent (absorbed on the server)
  TensorView q_rope;     // [T, H, R]
  TensorView kv_latent;  // [T, L]
  TensorView k_rope;     // [T, R]
  TensorView index_q;    // [T, Hi, Di]
  TensorView index_k;    // [T, Di]
  TensorView index_w;    // [T, Hi]
  // The output's datatype (BF16, FP16 or FP32) instead of the query's; unset: the query's, BF16
  // for FP8_E4M3 queries.
  std::optional<DType> out_dtype;
};

// Checks that `t` is present, has exactly `expected` dims and a byte count matching them in its
// dtype (which datatypes a tensor may have is the layer checks' business). The error
// (INVALID_ARGUMENT) names the tensor and says what was expected and what came.
absl::Status CheckTensor(const char* name, const TensorView& t,
                         std::initializer_list<int64_t> expected);

// The flat index of the first NaN or infinite element of `t` (which CheckTensor accepted), or
// -1 when every element is finite. Reads the bits (no conversion), so it is memory-bound.
int64_t FirstNonFinite(const TensorView& t);

// INVALID_ARGUMENT naming the tensor and the multi-index of its first non-finite element, or OK.
absl::Status CheckFinite(const char* name, const TensorView& t);

}  // namespace attnd
