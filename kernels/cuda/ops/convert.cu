// Row conversions: a wire dtype to and from fp32, bf16 N(0,1) test data, and the per-head
// projections of server-side absorption (q_nope -> q_latent, latent -> values). Launchers return
// the launch error (never synchronise).
#include <algorithm>

#include "kernels/cuda/ops/cuda_common.cuh"
#include "kernels/cuda/ops/cuda_kernels.h"

namespace attnd::cuda {
namespace {

template <DType T>
__global__ void ToF32Kernel(const void* src, float* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = Load<T>(src, i);
}

// FP8_E4M3 queries: each value times its row's scale (one fp32 multiply).
__global__ void DequantKernel(const uint8_t* src, const float* scales, int64_t per_scale,
                              float* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = Load<DType::kFP8E4M3>(src, i) * scales[i / per_scale];
}

template <DType T>
__global__ void FromF32Kernel(const float* src, void* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    Store<T>(dst, i, src[i]);
}

__device__ __forceinline__ uint64_t Mix(uint64_t x) {  // splitmix64 finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__global__ void FillNormalKernel(__nv_bfloat16* dst, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint64_t h = Mix(seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(i));
    const float u1 = (static_cast<float>(h >> 40) + 1.0f) * (1.0f / 16777217.0f);  // (0, 1]
    const float u2 = static_cast<float>((h >> 16) & 0xffffff) * (1.0f / 16777216.0f);
    dst[i] = __float2bfloat16_rn(sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2));
  }
}

int Blocks(int64_t n) {
  return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
}

constexpr int kProjectCols = 128;  // output columns per block (one per thread)
constexpr int kProjectTokens = 8;  // tokens per block: each weight load feeds 8 FMAs
constexpr int kProjectK = 128;     // inputs staged in shared memory per round

// One block: 128 output columns of one head for 8 tokens. Weight rows are read coalesced across
// the block's threads; the tokens' inputs are staged in shared memory, 128 at a time.
__global__ void HeadProjectKernel(HeadProjectParams p) {
  __shared__ float x[kProjectTokens][kProjectK];
  const int h = blockIdx.y;
  const int j = blockIdx.x * kProjectCols + threadIdx.x;
  const int t0 = blockIdx.z * kProjectTokens;
  const int tn = min(kProjectTokens, p.n - t0);
  float acc[kProjectTokens] = {};
  const float* w = p.w + static_cast<size_t>(h) * p.k * p.cols;
  for (int k0 = 0; k0 < p.k; k0 += kProjectK) {
    const int kn = min(kProjectK, p.k - k0);
    for (int i = threadIdx.x; i < kProjectTokens * kProjectK; i += blockDim.x) {
      const int t = i / kProjectK, kk = i % kProjectK;
      x[t][kk] = t < tn && kk < kn
                     ? p.in[(static_cast<size_t>(t0 + t) * p.heads + h) * p.k + k0 + kk]
                     : 0.0f;
    }
    __syncthreads();
    if (j < p.cols)
      for (int kk = 0; kk < kn; ++kk) {
        const float wv = w[static_cast<size_t>(k0 + kk) * p.cols + j];
#pragma unroll
        for (int t = 0; t < kProjectTokens; ++t) acc[t] = fmaf(x[t][kk], wv, acc[t]);
      }
    __syncthreads();
  }
  if (j >= p.cols) return;
  for (int t = 0; t < tn; ++t)
    p.out[(static_cast<size_t>(t0 + t) * p.heads + h) * p.cols + j] = acc[t];
}

}  // namespace

cudaError_t LaunchToF32(const void* src, DType dtype, float* dst, int64_t count, cudaStream_t s,
                        const float* scales, int64_t per_scale) {
  if (count <= 0) return cudaSuccess;
  if (dtype == DType::kFP8E4M3) {
    if (scales == nullptr || per_scale <= 0) return cudaErrorInvalidValue;
    DequantKernel<<<Blocks(count), kThreads, 0, s>>>(static_cast<const uint8_t*>(src), scales,
                                                     per_scale, dst, count);
    return cudaGetLastError();
  }
  return Dispatch(dtype, [&](auto t) {
    ToF32Kernel<decltype(t)::value><<<Blocks(count), kThreads, 0, s>>>(src, dst, count);
    return cudaGetLastError();
  });
}

cudaError_t LaunchFromF32(const float* src, DType dtype, void* dst, int64_t count, cudaStream_t s) {
  if (count <= 0) return cudaSuccess;
  return Dispatch(dtype, [&](auto t) {
    FromF32Kernel<decltype(t)::value><<<Blocks(count), kThreads, 0, s>>>(src, dst, count);
    return cudaGetLastError();
  });
}

cudaError_t LaunchHeadProject(const HeadProjectParams& p, cudaStream_t s) {
  if (p.n <= 0 || p.heads <= 0 || p.cols <= 0) return cudaSuccess;
  if (p.heads > 65535) return cudaErrorInvalidValue;
  const dim3 grid((p.cols + kProjectCols - 1) / kProjectCols, p.heads,
                  (p.n + kProjectTokens - 1) / kProjectTokens);
  if (grid.z > 65535) return cudaErrorInvalidValue;
  HeadProjectKernel<<<grid, kProjectCols, 0, s>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchFillNormalBf16(void* dst, int64_t count, uint64_t seed, cudaStream_t s) {
  if (count <= 0) return cudaSuccess;
  FillNormalKernel<<<Blocks(count), kThreads, 0, s>>>(static_cast<__nv_bfloat16*>(dst), count,
                                                      seed);
  return cudaGetLastError();
}

}  // namespace attnd::cuda
