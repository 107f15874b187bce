// New key rows into the paged caches: fp32 rows converted to the cache dtype, or fp8 rows packed
// on the host scattered to their slots.
#include "kernels/cuda/ops/cuda_common.cuh"
#include "kernels/cuda/ops/cuda_kernels.h"

namespace attnd::cuda {
namespace {

// Cache dtype T, source dtype S: each value converted once (S -> fp32 -> T, exact where T holds S).
template <DType T, DType S>
__global__ void WriteRowsKernel(WriteRowsParams p) {
  const int r = blockIdx.x;
  uint8_t* row = p.cache.MutableRow(p.slot[r]);
  for (int d = threadIdx.x; d < p.dim; d += blockDim.x)
    Store<T>(row, p.col_offset + d, Load<S>(p.src, int64_t{r} * p.dim + d));
}

// One block per row: an fp8 cache row packed on the host (kernels/fp8_rows.h) to its slot; an
// indexer row's last 4 bytes (its scale) go apart, after its page's values.
__global__ void ScatterRowsKernel(ScatterRowsParams p) {
  const int r = blockIdx.x;
  const uint8_t* src = p.src + size_t{static_cast<unsigned>(r)} * p.src_row_bytes;
  const int64_t slot = p.slot[r];
  uint8_t* row = p.cache.MutableRow(slot);
  const size_t values = p.cache.scales_apart ? p.cache.fp8_dim : p.src_row_bytes;
  for (size_t i = threadIdx.x; i < values; i += blockDim.x) row[i] = src[i];
  if (p.cache.scales_apart && threadIdx.x < 4)
    const_cast<uint8_t*>(p.cache.Scales(slot))[threadIdx.x] = src[values + threadIdx.x];
}

}  // namespace

cudaError_t LaunchWriteRows(const WriteRowsParams& p, cudaStream_t s) {
  if (p.n <= 0) return cudaSuccess;
  if (p.cache.dtype == DType::kFP8E4M3) return cudaErrorInvalidValue;  // LaunchScatterRows
  if (p.src_dtype == DType::kFP8E4M3) return cudaErrorInvalidValue;    // fp8 keys: fp8 caches
  return Dispatch(p.cache.dtype, [&](auto t) {
    return Dispatch(p.src_dtype, [&](auto src) {
      if constexpr (decltype(t)::value == DType::kFP8E4M3 ||
                    decltype(src)::value == DType::kFP8E4M3) {
        return cudaErrorInvalidValue;  // refused above; not instantiated
      } else {
        WriteRowsKernel<decltype(t)::value, decltype(src)::value><<<p.n, 128, 0, s>>>(p);
        return cudaGetLastError();
      }
    });
  });
}

cudaError_t LaunchScatterRows(const ScatterRowsParams& p, cudaStream_t s) {
  if (p.n <= 0) return cudaSuccess;
  ScatterRowsKernel<<<p.n, 128, 0, s>>>(p);
  return cudaGetLastError();
}

}  // namespace attnd::cuda
