// Selection on the GPU, agreeing bit for bit with kernels/selection.h: exact radix top-k with
// ties to the lower index and NaN lowest, page keys (page maxima, pages hit by the top-k), page
// lists expanded to positions, and positions to slot ids.
#include <algorithm>
#include <cub/block/block_scan.cuh>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace attnd::cuda {
namespace {

// Order-preserving float -> uint32 (larger float, larger key), ranking like the CPU backend: NaN
// ties with -inf (lowest) and -0 with +0. Never 0, the "excluded" page key.
__device__ __forceinline__ uint32_t Key(float f) {
  if (isnan(f)) f = -INFINITY;
  if (f == 0.0f) return 0x80000000u;  // -0 == +0
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

constexpr int kTopKThreads = 512;
__global__ void TopKKernel(TopKParams p) {
  using Scan = cub::BlockScan<int, kTopKThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ unsigned int hist[256];
  __shared__ uint32_t prefix_s, mask_s;
  __shared__ int64_t want_s;
  __shared__ int running_take, running_eq;
  const int qi = blockIdx.x;
  const int64_t n = p.row_len[qi], off = p.row_offset[qi];
  const int64_t orow = p.out_row ? p.out_row[qi] : qi;
  int32_t* out = p.out + orow * p.out_stride;
  auto key_at = [&](int64_t i) -> uint32_t {
    return p.keys ? p.keys[off + i] : Key(p.scores[off + i]);
  };
  uint32_t threshold = 0;
  int64_t take_equal = 0;
  const bool all = p.k >= n;
  if (!all) {
    if (threadIdx.x == 0) {
      prefix_s = 0;
      mask_s = 0;
      want_s = p.k;
    }
    __syncthreads();
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
      __syncthreads();
      const uint32_t prefix = prefix_s, mask = mask_s;
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const uint32_t k = key_at(i);
        if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1u);
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        int64_t cum = 0;
        for (int d = 255; d >= 0; --d) {
          if (cum + hist[d] >= want_s) {
            want_s -= cum;
            prefix_s = prefix | (static_cast<uint32_t>(d) << shift);
            mask_s = mask | (255u << shift);
            break;
          }
          cum += hist[d];
        }
      }
      __syncthreads();
    }
    threshold = prefix_s;
    take_equal = want_s;
  }
  if (threadIdx.x == 0) {
    running_take = 0;
    running_eq = 0;
  }
  __syncthreads();
  for (int64_t base = 0; base < n; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    uint32_t k = 0;
    int gt = 0, eq = 0;
    if (i < n) {
      k = key_at(i);
      gt = all || k > threshold;
      eq = !all && k == threshold;
    }
    int eq_rank, eq_total;
    Scan(scan).ExclusiveSum(eq, eq_rank, eq_total);
    __syncthreads();
    int take = gt || (eq && running_eq + eq_rank < take_equal);
    if (p.drop_zero && k == 0) take = 0;
    int out_rank, take_total;
    Scan(scan).ExclusiveSum(take, out_rank, take_total);
    if (take) out[running_take + out_rank] = static_cast<int32_t>(i);
    __syncthreads();
    if (threadIdx.x == 0) {
      running_take += take_total;
      running_eq += eq_total;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) p.out_count[orow] = running_take;
}

__global__ void PageMaxKernel(PageMaxParams p) {
  const int qi = blockIdx.y;
  const int64_t n = p.row_len[qi];
  const int64_t pages = (n + p.page_size - 1) / p.page_size;
  const int64_t pg = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (pg >= pages) return;
  uint32_t best = 0;
  const int64_t hi = min(n, (pg + 1) * p.page_size);
  for (int64_t t = pg * p.page_size; t < hi; ++t)
    best = max(best, Key(p.scores[p.row_offset[qi] + t]));  // Key is never 0 ("excluded")
  p.page_keys[p.page_offset[qi] + pg] = best;
}

__global__ void PageHitKernel(PageHitParams p) {
  const int qi = blockIdx.y;
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= p.selected_count[qi]) return;
  const int32_t tok = p.selected[qi * p.sel_stride + i];
  atomicMax(&p.page_keys[p.page_offset[qi] + tok / p.page_size],
            Key(p.scores[p.row_offset[qi] + tok]));
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
  return cudaFuncGetAttributes(&a, TopKKernel);
}

cudaError_t LaunchTopK(const TopKParams& p, cudaStream_t s) {
  if (p.nq <= 0) return cudaSuccess;
  TopKKernel<<<p.nq, kTopKThreads, 0, s>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchPageMax(const PageMaxParams& p, cudaStream_t s) {
  if (p.nq <= 0 || p.max_pages <= 0) return cudaSuccess;
  for (int q0 = 0; q0 < p.nq; q0 += kMaxGridY) {
    PageMaxParams c = p;
    c.row_offset += q0;
    c.row_len += q0;
    c.page_offset += q0;
    c.nq = std::min(kMaxGridY, p.nq - q0);
    const dim3 grid(static_cast<unsigned>((p.max_pages + kThreads - 1) / kThreads), c.nq);
    PageMaxKernel<<<grid, kThreads, 0, s>>>(c);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t LaunchPageHits(const PageHitParams& p, cudaStream_t s) {
  if (p.nq <= 0 || p.max_sel <= 0) return cudaSuccess;
  for (int q0 = 0; q0 < p.nq; q0 += kMaxGridY) {
    PageHitParams c = p;
    c.row_offset += q0;
    c.selected += q0 * p.sel_stride;
    c.selected_count += q0;
    c.page_offset += q0;
    c.nq = std::min(kMaxGridY, p.nq - q0);
    const dim3 grid(static_cast<unsigned>((p.max_sel + kThreads - 1) / kThreads), c.nq);
    PageHitKernel<<<grid, kThreads, 0, s>>>(c);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
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
