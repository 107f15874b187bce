// Device helpers the CUDA backend's kernels share (convert.cu, cache_write.cu, indexer.cu,
// selection.cu, mla.cu): element types and their dispatch, cached values, page-table lookups and
// the bf16 mma.sync step. For those .cu files only; internal linkage, as when they were one file.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "kernels/cuda/ops/cuda_kernels.h"

namespace attnd::cuda {

// TopKKernel's attributes (selection.cu), for ProbeKernels (mla.cu).
cudaError_t ProbeTopKKernel();

namespace {

constexpr int kThreads = 256;

// Element types as kernel template parameters: each launcher dispatches on DType once.
template <DType T>
struct Elem;
template <>
struct Elem<DType::kF32> {
  using type = float;
  __device__ static float Get(float v) { return v; }
  __device__ static float Put(float v) { return v; }
};
template <>
struct Elem<DType::kBF16> {
  using type = __nv_bfloat16;
  __device__ static float Get(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 Put(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Elem<DType::kF16> {
  using type = __half;
  __device__ static float Get(__half v) { return __half2float(v); }
  __device__ static __half Put(float v) { return __float2half_rn(v); }
};

// float8_e4m3fn codes (the fp8 cache's values; unscaled here, see CacheValue).
template <>
struct Elem<DType::kFP8E4M3> {
  using type = uint8_t;
  __device__ static float Get(uint8_t v) {
    __nv_fp8_e4m3 x;
    x.__x = v;
    return static_cast<float>(x);
  }
  __device__ static uint8_t Put(float v) {
    return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
  }
};

template <DType T>
__device__ __forceinline__ float Load(const void* base, int64_t i) {
  return Elem<T>::Get(static_cast<const typename Elem<T>::type*>(base)[i]);
}

__device__ __forceinline__ float LoadScale(const uint8_t* p) {
  float s;
  memcpy(&s, p, 4);  // scales of indexer pages need not be 4-byte aligned
  return s;
}

// Value d of the cached row at `slot`, as fp32: fp8 rows dequantised with their scales
// (docs/architecture.md: a latent row is L codes, one scale per tile of 128 (one tile below 128),
// then bf16 rope; an indexer row's one scale lives apart, after its page's values).
template <DType T>
__device__ __forceinline__ float CacheValue(const CacheRows& c, int64_t slot, int d) {
  const uint8_t* row = c.Row(slot);
  if constexpr (T == DType::kFP8E4M3) {
    if (c.scales_apart) return Load<T>(row, d) * LoadScale(c.Scales(slot));
    const int L = c.fp8_dim, tile = L < 128 ? L : 128;
    if (d < L) return Load<T>(row, d) * LoadScale(row + L + 4 * (d / tile));
    return Load<DType::kBF16>(row + L + 4 * ((L + tile - 1) / tile), d - L);
  } else {
    return Load<T>(row, d);
  }
}

template <DType T>
__device__ __forceinline__ void Store(void* base, int64_t i, float v) {
  static_cast<typename Elem<T>::type*>(base)[i] = Elem<T>::Put(v);
}

// Calls f(std::integral_constant<DType, t>) for the run-time dtype t: one dispatch per launch.
template <typename F>
cudaError_t Dispatch(DType t, F f) {
  switch (t) {
    case DType::kF32:
      return f(std::integral_constant<DType, DType::kF32>());
    case DType::kBF16:
      return f(std::integral_constant<DType, DType::kBF16>());
    case DType::kF16:
      return f(std::integral_constant<DType, DType::kF16>());
    case DType::kFP8E4M3:
      return f(std::integral_constant<DType, DType::kFP8E4M3>());
  }
  return cudaErrorInvalidValue;
}
// The cached row of query q's key at position pos, and its slot.
__device__ __forceinline__ int64_t SlotOf(const QueryTables& t, int q, int64_t pos) {
  return t.table.Slot(t.seq[q], pos);
}
__device__ __forceinline__ const uint8_t* Row(const CacheRows& c, const QueryTables& t, int q,
                                              int64_t pos) {
  return c.Row(SlotOf(t, q, pos));
}

__device__ __forceinline__ void Mma16816(float* d, uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t Pair(const __nv_bfloat16* p) {  // p[0] low, p[1] high
  return *reinterpret_cast<const uint32_t*>(p);
}

// grid.y (one query per y) is limited to 65535: the launchers below split longer query lists.
constexpr int kMaxGridY = 65535;

}  // namespace
}  // namespace attnd::cuda
