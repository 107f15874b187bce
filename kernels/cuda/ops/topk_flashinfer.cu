#include <atomic>
#include <cub/block/block_scan.cuh>
#include <flashinfer/math.cuh>  // topk.cuh uses it without including it
#include <flashinfer/topk.cuh>
#include <type_traits>

#include "kernels/cuda/ops/topk_flashinfer.h"

namespace attnd::cuda {
namespace {

std::atomic<int64_t> g_launches{0};

// NaN to 0xffffffff: FlashInfer's ordering maps it to key 0, below -inf, so NaN ranks lowest
// (attnd's rule); several NaNs tie and keep the lower position.
__global__ void LowestNaNKernel(float* scores, const int32_t* len, int64_t max_len) {
  float* row = scores + int64_t{blockIdx.x} * max_len;
  for (int64_t j = threadIdx.x; j < len[blockIdx.x]; j += blockDim.x)
    if (isnan(row[j])) row[j] = __uint_as_float(0xffffffffu);
}

// Each query's FlashInfer row (ascending positions, -1 where the row had fewer than k) into its
// selection row, in order, and its count.
constexpr int kScatterThreads = 256;
__global__ void __launch_bounds__(kScatterThreads) ScatterKernel(FlashInferTopKParams p) {
  using Scan = cub::BlockScan<int, kScatterThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int base;
  const int q = blockIdx.x;
  const int32_t* in = p.tmp_index + int64_t{q} * p.k;
  int32_t* out = p.out + int64_t{p.out_row[q]} * p.out_stride;
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  for (int at = 0; at < p.k; at += kScatterThreads) {
    const int j = at + threadIdx.x;
    const int32_t v = j < p.k ? in[j] : -1;
    const int keep = v >= 0 && v < p.len[q];
    int offset, total;
    Scan(scan).ExclusiveSum(keep, offset, total);
    if (keep) out[base + offset] = v;
    __syncthreads();
    if (threadIdx.x == 0) base += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) p.out_count[p.out_row[q]] = base;
}

template <int kVec>
cudaError_t LaunchFiltered(const FlashInferTopKParams& p, cudaStream_t s) {
  using namespace flashinfer::sampling;
  auto kernel = FilteredTopKUnifiedKernel<float, int32_t, kVec, /*DETERMINISTIC=*/true,
                                          FilteredTopKMode::Plain, TopKTieBreak::Small>;
  constexpr size_t smem = FILTERED_TOPK_SMEM_DYNAMIC;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  const int32_t* no_ids = nullptr;
  kernel<<<p.nq, FILTERED_TOPK_BLOCK_THREADS, smem, s>>>(
      p.scores, p.tmp_index, p.tmp_value, no_ids, int64_t{0}, no_ids, p.len,
      static_cast<uint32_t>(p.nq), static_cast<uint32_t>(p.k), static_cast<uint32_t>(p.max_len));
  return cudaGetLastError();
}

// Calls f(std::integral_constant<int, v>) for FlashInfer's vector width v (1, 2 or 4 floats).
template <typename F>
cudaError_t Dispatch(int vec, F f) {
  switch (vec) {
    case 4:
      return f(std::integral_constant<int, 4>());
    case 2:
      return f(std::integral_constant<int, 2>());
    case 1:
      return f(std::integral_constant<int, 1>());
  }
  return cudaErrorInvalidValue;
}

}  // namespace

bool FlashInferTopKApplies(int64_t k) {
  return k >= 1 && k <= flashinfer::sampling::FILTERED_TOPK_MAX_K &&
         flashinfer::sampling::CanImplementFilteredTopK();
}

int64_t FlashInferTopKLaunches() { return g_launches.load(); }

cudaError_t LaunchFlashInferTopK(const FlashInferTopKParams& p, cudaStream_t s) {
  if (p.nq <= 0) return cudaSuccess;
  if (!FlashInferTopKApplies(p.k) || p.max_len < 1 || p.max_len > INT32_MAX)
    return cudaErrorInvalidValue;
  LowestNaNKernel<<<p.nq, 256, 0, s>>>(p.scores, p.len, p.max_len);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  using flashinfer::sampling::FilteredTopKMode;
  // FlashInfer's filtered kernel in its deterministic, smaller-index-wins form, launched here:
  // its own launcher also instantiates the tie-break-free forms, which spill registers (ptxas
  // refuses local memory in attnd's kernels).
  e = Dispatch(
      flashinfer::sampling::ComputeFilteredTopKVecSize<float>(static_cast<uint32_t>(p.max_len)),
      [&](auto vec) { return LaunchFiltered<decltype(vec)::value>(p, s); });
  if (e != cudaSuccess) return e;
  e = flashinfer::sampling::LaunchSortTopKByIndex<FilteredTopKMode::Plain, float, int32_t>(
      p.tmp_index, p.tmp_value, nullptr, 0, nullptr, static_cast<uint32_t>(p.nq),
      static_cast<uint32_t>(p.k), static_cast<uint32_t>(p.max_len), s);
  if (e != cudaSuccess) return e;
  ScatterKernel<<<p.nq, kScatterThreads, 0, s>>>(p);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  g_launches.fetch_add(1);
  return cudaSuccess;
}

}  // namespace attnd::cuda
