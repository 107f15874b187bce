// Selection on the GPU, agreeing bit for bit with kernels/selection.h: exact radix top-k with
// ties to the lower index and NaN lowest, page keys (page maxima, pages hit by the top-k), page
// lists expanded to positions, and positions to slot ids.
#include <algorithm>

#include "kernels/cuda/ops/cuda_common.cuh"
#include "kernels/cuda/ops/cuda_kernels.h"
#include "kernels/cuda/ops/topk_block.h"

namespace attnd::cuda {
namespace {

// The block interface of kernels/cuda/ops/topk_block.h on the GPU: each thread runs the body once,
// shared memory is the block's own.
struct DeviceBlock {
  uint32_t* words;
  __device__ int threads() const { return kTopKThreads; }
  template <typename F>
  __device__ void Each(F&& f) {
    f(static_cast<int>(threadIdx.x));
  }
  __device__ void Sync() { __syncthreads(); }
  __device__ uint32_t Ld(int w, int) const { return words[w]; }
  __device__ void St(int w, uint32_t v, int) { words[w] = v; }
  __device__ void Add(int w, uint32_t v, int) { atomicAdd(&words[w], v); }
};

__device__ __forceinline__ uint32_t Key(float f) { return TopKKey(f); }

// grid (queries, slices of the longest row): TopKSliceBlock.
__global__ void __launch_bounds__(kTopKThreads) TopKSliceKernel(TopKRows p) {
  __shared__ uint32_t words[TopKWords::words];
  DeviceBlock b{words};
  TopKSliceBlock(b, p, blockIdx.x, static_cast<int>(blockIdx.y));
}

// grid (queries): TopKMergeBlock (rows of one slice return at once).
__global__ void __launch_bounds__(kTopKThreads) TopKMergeKernel(TopKRows p) {
  __shared__ uint32_t words[TopKWords::words];
  DeviceBlock b{words};
  TopKMergeBlock(b, p, blockIdx.x);
}

__global__ void PageMaxKernel(PageMaxParams p) {
  const PageKeyRows& r = p.rows;
  const int qi = blockIdx.y;
  const int64_t n = p.row_len[qi];
  const int64_t pages = (n + r.page_size - 1) / r.page_size;
  const int64_t pg = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (pg >= pages) return;
  uint32_t best = 0;
  const int64_t hi = min(n, (pg + 1) * r.page_size);
  for (int64_t t = pg * r.page_size; t < hi; ++t)
    best = max(best, Key(r.scores[r.row_offset[qi] + t]));  // Key is never 0 ("excluded")
  r.page_keys[r.page_offset[qi] + pg] = best;
}

__global__ void PageHitKernel(PageHitParams p) {
  const PageKeyRows& r = p.rows;
  const int qi = blockIdx.y;
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= p.selected_count[qi]) return;
  const int32_t tok = p.selected[qi * p.sel_stride + i];
  atomicMax(&r.page_keys[r.page_offset[qi] + tok / r.page_size],
            Key(r.scores[r.row_offset[qi] + tok]));
}

__global__ void ExpandKernel(ExpandParams p) {
  const int qi = blockIdx.x;
  const int64_t n = p.row_len[qi];
  const int32_t own = static_cast<int32_t>((n - 1) / p.page_size);
  const int32_t* pages = p.pages + qi * p.page_stride;
  int count = p.page_count[qi];
  const bool has_own = count > 0 && pages[count - 1] == own;  // ascending: own is the largest
  const int total_pages = count + (has_own ? 0 : 1);
  const int64_t orow = p.out_row ? p.out_row[qi] : qi;
  int32_t* out = p.out + orow * p.out_stride;
  for (int64_t i = threadIdx.x; i < int64_t{total_pages} * p.page_size; i += blockDim.x) {
    const int slot = static_cast<int>(i / p.page_size);
    const int32_t page = slot < count ? pages[slot] : own;
    const int64_t key = int64_t{page} * p.page_size + i % p.page_size;
    if (key < n) out[i] = static_cast<int32_t>(key);
  }
  if (threadIdx.x == 0)
    p.out_count[orow] = static_cast<int32_t>(int64_t{total_pages - 1} * p.page_size +
                                             (n - int64_t{own} * p.page_size));
}

__global__ void PositionsToSlotsKernel(SlotsParams p) {
  const int r = blockIdx.x;
  const int32_t* in = p.positions + r * p.stride;
  int32_t* out = p.slots + r * p.stride;
  for (int i = threadIdx.x; i < p.count[r]; i += blockDim.x)
    out[i] = static_cast<int32_t>(p.tables.table.Slot(p.tables.seq[r], in[i]));
}

}  // namespace

cudaError_t ProbeTopKKernel() {
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, TopKSliceKernel);
}

cudaError_t LaunchTopK(const TopKParams& p, cudaStream_t s) {
  if (p.nq <= 0) return cudaSuccess;
  if (p.rows.k < 1 || p.max_len < 0) return cudaErrorInvalidValue;
  const TopKRows& r = p.rows;
  const int slices = TopKSlices(p.max_len, r.k);  // the most any row has
  if (slices > 1 && (r.slice_offset == nullptr || r.cand_key == nullptr ||
                     r.cand_index == nullptr || r.cand_count == nullptr))
    return cudaErrorInvalidValue;
  TopKSliceKernel<<<dim3(p.nq, slices), kTopKThreads, 0, s>>>(r);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || slices == 1) return e;
  TopKMergeKernel<<<p.nq, kTopKThreads, 0, s>>>(r);
  return cudaGetLastError();
}

// Launches `kernel` over the rows in chunks of kMaxGridY queries (grid y), a thread for each of
// `per_row` items of a row (grid x); advance(c, q0) moves the kind's own per-query pointers.
template <typename Params, typename Advance>
cudaError_t LaunchPageKeys(void (*kernel)(Params), const Params& p, int64_t per_row,
                           Advance advance, cudaStream_t s) {
  if (p.rows.nq <= 0 || per_row <= 0) return cudaSuccess;
  for (int q0 = 0; q0 < p.rows.nq; q0 += kMaxGridY) {
    Params c = p;
    c.rows = p.rows.From(q0, kMaxGridY);
    advance(c, q0);
    const dim3 grid(static_cast<unsigned>((per_row + kThreads - 1) / kThreads), c.rows.nq);
    kernel<<<grid, kThreads, 0, s>>>(c);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t LaunchPageMax(const PageMaxParams& p, cudaStream_t s) {
  return LaunchPageKeys(
      PageMaxKernel, p, p.max_pages, [](PageMaxParams& c, int q0) { c.row_len += q0; }, s);
}

cudaError_t LaunchPageHits(const PageHitParams& p, cudaStream_t s) {
  return LaunchPageKeys(
      PageHitKernel, p, p.max_sel,
      [&](PageHitParams& c, int q0) {
        c.selected += q0 * p.sel_stride;
        c.selected_count += q0;
      },
      s);
}

cudaError_t LaunchExpandPages(const ExpandParams& p, cudaStream_t s) {
  if (p.nq <= 0) return cudaSuccess;
  ExpandKernel<<<p.nq, kThreads, 0, s>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchPositionsToSlots(const SlotsParams& p, cudaStream_t s) {
  if (p.n <= 0) return cudaSuccess;
  PositionsToSlotsKernel<<<p.n, kThreads, 0, s>>>(p);
  return cudaGetLastError();
}

}  // namespace attnd::cuda
