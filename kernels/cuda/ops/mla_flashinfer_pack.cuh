// How attnd's FlashInferMlaParams become FlashInfer's MLAParams (mla_flashinfer.cu): every
// pointer and stride FlashInfer's Hopper MLA reads. CUDA-only (FlashInfer's headers); host code,
// so tests/unit/mla_flashinfer_pack_test.cu checks it on a machine without a GPU.
#pragma once

#include <cuda_bf16.h>

#include <flashinfer/attention/mla_params.cuh>

#include "kernels/cuda/ops/mla_flashinfer.h"

namespace attnd::cuda {

using FlashInferMlaKernelParams =
    flashinfer::MLAParams<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, int32_t>;

// Fills *out for one wave of p; cudaErrorInvalidValue where the cache rows do not fit the kernel
// (FlashInferMlaLayoutFor) or are fp8 indexer rows.
cudaError_t PackFlashInferMla(const FlashInferMlaParams& p, FlashInferMlaKernelParams* out);

}  // namespace attnd::cuda
