// The sparse MLA as a gather and two cuBLAS batched GEMMs (kernels/cuda/ops/mla_gemm.cu): each
// query's keys gathered into a dense bf16 block [keys, L + R], S = Q K^T on cuBLAS (fp32
// accumulation), attnd's softmax (scale, mask past the query's count, fp32, natural-log LSE)
// into bf16 P, then O = P V on cuBLAS into the fp32 output. The floor every GPU has (sm_80
// included) and the measure the hand-written kernels must beat; what PyTorch's naive path does,
// on the server's own rows. Not batch-invariant: cuBLAS picks its kernels by shape.
//
// Opt-in (ATTND_CUDA_MLA=gemm) until a GPU run has checked and timed it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/cuda/backend/cublas_loader.h"
#include "kernels/cuda/ops/cuda_kernels.h"

namespace attnd::cuda {

// Scratch the GEMM MLA's waves may hold at once.
inline constexpr int64_t kMlaGemmScratchBytes = int64_t{512} << 20;

// Keys each query's block is padded to: the longest list, a multiple of 64.
int64_t MlaGemmPaddedKeys(int64_t max_keys);
// Scratch bytes one query of a wave takes (its keys, query, scores and probabilities).
size_t MlaGemmQueryBytes(int heads, int latent, int rope, int64_t max_keys);
// Queries a wave takes (n, or as many as fit kMlaGemmScratchBytes; at least one).
int MlaGemmWaveQueries(int n, int heads, int latent, int rope, int64_t max_keys);

struct MlaGemmParams {
  // The queries, keys and outputs as LaunchMla takes them: sel and needs_index (or a range of
  // `window` keys, 0 = all) per query; soft_cap must be 0.
  MlaParams mla;
  int64_t max_keys = 0;     // every query's key count is at most this
  void* scratch = nullptr;  // MlaGemmWaveQueries(...) x MlaGemmQueryBytes(...) bytes
};
// Runs the queries in waves. cudaErrorInvalidValue for what it does not take (soft cap, a count
// past max_keys is cut to it: callers check); cudaErrorUnknown when cuBLAS fails (*why says).
cudaError_t LaunchMlaGemm(const MlaGemmParams& p, const CublasApi& blas, cublasHandle_t handle,
                          cudaStream_t s, std::string* why);
// How many times LaunchMlaGemm has run in this process (tests: the form ran).
int64_t MlaGemmLaunches();

}  // namespace attnd::cuda
