// The DSA indexer's scores, I[s] = sum_h w[h] relu(q[h] . k[s]), over each query's visible keys:
// a SIMT kernel (any cache dtype), the streaming tensor-core one (bf16 and fp8 keys at the
// models' shapes: kernels/cuda/ops/indexer_stream.h) and the tile-per-block tensor-core one (bf16
// keys, other shapes). fp32 accumulation.
#include <algorithm>

#include "kernels/cuda/backend/gpu_facts.h"
#include "kernels/cuda/ops/cuda_common.cuh"
#include "kernels/cuda/ops/cuda_kernels.h"
#include "kernels/cuda/ops/indexer_stream.h"
#include "kernels/cuda/ops/mma_fragments.h"
#include "kernels/cuda/ops/simt.cuh"

namespace attnd::cuda {
namespace {

// grid (key tiles, queries). Shared: q [Hi, Di] | w [Hi] | keys [kTile, Di + 1] | part [4, kTile]
constexpr int kIdxTile = 64;
template <DType T>
__global__ void IndexerKernel(IndexerParams p) {
  extern __shared__ float sm[];
  const int qi = blockIdx.y;
  const int q = p.queries[qi];
  const int64_t n = p.tables.pos[q] + 1;
  const int64_t t0 = int64_t{blockIdx.x} * kIdxTile;
  if (t0 >= n) return;
  const int H = p.heads, D = p.dim;
  float* qs = sm;
  float* ws = qs + H * D;
  float* ks = ws + H;
  float* part = ks + kIdxTile * (D + 1);
  for (int i = threadIdx.x; i < H * D; i += blockDim.x) qs[i] = p.q[int64_t{q} * H * D + i];
  for (int i = threadIdx.x; i < H; i += blockDim.x) ws[i] = p.w[int64_t{q} * H + i];
  const int nk = static_cast<int>(min(static_cast<int64_t>(kIdxTile), n - t0));
  for (int i = threadIdx.x; i < kIdxTile * D; i += blockDim.x) {
    const int j = i / D, d = i % D;
    ks[j * (D + 1) + d] = j < nk ? CacheValue<T>(p.keys, SlotOf(p.tables, q, t0 + j), d) : 0.0f;
  }
  __syncthreads();
  const int j = threadIdx.x % kIdxTile;
  const int group = threadIdx.x / kIdxTile;  // 0..3
  float acc = 0.0f;
  for (int h = group; h < H; h += blockDim.x / kIdxTile) {
    float dot = 0.0f;
    for (int d = 0; d < D; ++d) dot += qs[h * D + d] * ks[j * (D + 1) + d];
    acc += ws[h] * (dot < 0.0f ? 0.0f : dot);  // relu like std::max(dot, 0): NaN stays NaN
  }
  part[group * kIdxTile + j] = acc;
  __syncthreads();
  if (threadIdx.x < nk) {
    float total = 0.0f;
    for (int g = 0; g < blockDim.x / kIdxTile; ++g) total += part[g * kIdxTile + threadIdx.x];
    p.scores[p.score_offset[qi] + t0 + threadIdx.x] = total;
  }
}

// cp.async (sm_80+): 16 bytes global -> shared, bypassing registers and L1; `valid` false
// zero-fills the destination and reads nothing.
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(valid ? 16 : 0));
}
// Waits for this thread's outstanding cp.async copies (a barrier then publishes them).
__device__ __forceinline__ void CpAsyncWaitAll() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

// ---- the indexer on bf16 tensor cores ----
// grid (tiles of 64 keys, queries), 8 warps. Shared: Q [Hi][Di+8] bf16 | K [64][Di+8] bf16 |
// w [Hi] f32. Warp w scores keys [8w, 8w + 8) for every head: Hi/16 m-tiles x Di/16 k-steps of
// m16n8k16 (fp32 accumulation), then relu, the head weights and the sum over heads in registers
// and shuffles. tests/sim/indexer_mma_sim.h runs this code lane by lane on the CPU.
constexpr int kIdxMmaKeys = 64;

__global__ void IndexerMmaKernel(IndexerParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int H = p.heads, D = p.dim, DP = D + 8;
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  __nv_bfloat16* ks = qs + H * DP;
  float* ws = reinterpret_cast<float*>(ks + kIdxMmaKeys * DP);
  const int qi = blockIdx.y;
  const int q = p.queries[qi];
  const int64_t n = p.tables.pos[q] + 1;
  const int64_t t0 = int64_t{blockIdx.x} * kIdxMmaKeys;
  if (t0 >= n) return;
  const int nk = static_cast<int>(min(static_cast<int64_t>(kIdxMmaKeys), n - t0));
  for (int i = threadIdx.x; i < H * D; i += blockDim.x)
    qs[(i / D) * DP + i % D] = __float2bfloat16_rn(p.q[int64_t{q} * H * D + i]);
  for (int i = threadIdx.x; i < H; i += blockDim.x) ws[i] = p.w[int64_t{q} * H + i];
  // Paged key rows straight into shared memory with asynchronous 16-byte copies (no register
  // staging); rows past the last key are zero-filled (source size 0).
  const int chunks = D / 8;  // 16-byte pieces of a key row
  for (int i = threadIdx.x; i < kIdxMmaKeys * chunks; i += blockDim.x) {
    const int j = i / chunks, c = i % chunks;
    const bool valid = j < nk;
    const uint8_t* src = valid ? Row(p.keys, p.tables, q, t0 + j) + c * 16 : p.keys.base;
    CpAsync16(ks + j * DP + c * 8, src, valid);
  }
  CpAsyncWaitAll();
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const __nv_bfloat16* krow = ks + (warp * 8 + mma::ColB(lane)) * DP;
  float part[2] = {0.0f, 0.0f};  // keys warp * 8 + ColC(lane, 0 and 1), summed over heads
  for (int m0 = 0; m0 < H; m0 += 16) {
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k0 = 0; k0 < D; k0 += 16) {
      uint32_t a[4];
#pragma unroll
      for (int r = 0; r < 4; ++r)
        a[r] = Pair(qs + (m0 + mma::RowA(lane, r)) * DP + k0 + mma::ColA(lane, r, 0));
      Mma16816(c, a[0], a[1], a[2], a[3], Pair(krow + k0 + mma::RowB(lane, 0, 0)),
               Pair(krow + k0 + mma::RowB(lane, 1, 0)));
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float x = c[i];  // relu like std::max(x, 0): NaN stays NaN
      part[i & 1] += ws[m0 + mma::RowC(lane, i)] * (x < 0.0f ? 0.0f : x);
    }
  }
  // The 8 groups of a warp hold the same keys for different heads: sum across them.
  for (int off = 4; off < 32; off <<= 1) {
    part[0] += __shfl_xor_sync(0xffffffffu, part[0], off);
    part[1] += __shfl_xor_sync(0xffffffffu, part[1], off);
  }
  if (mma::Group(lane) == 0) {
    for (int e = 0; e < 2; ++e) {
      const int j = warp * 8 + mma::ColC(lane, e);
      if (j < nk) p.scores[p.score_offset[qi] + t0 + j] = part[e];
    }
  }
}

// ---- the streaming indexer (kernels/cuda/ops/indexer_stream.h, the body the CPU simulation runs):
// grid (key ranges, queries), 8 warps, the query in registers, key tiles through a cp.async
// ring. At least 3 blocks an SM (<= 85 registers): without the bound ptxas aimed at 64 on sm_80
// and spilled (the build refuses local memory); shared memory allows 4 at DeepSeek dims.
template <int HG, bool kFp8>
__global__ void __launch_bounds__(kStreamThreads, 3) IndexerStreamKernel(IndexerStreamParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  GpuThread g{smem_raw};
  IndexerStreamBlock<HG, kFp8>(g, p, blockIdx.x, static_cast<int>(blockIdx.y));
}

// The streaming kernel's rows: 16-byte aligned (cp.async), fp8 rows with their scales apart and
// 4-byte aligned scales.
bool StreamRowsFit(const IndexerParams& p) {
  const CacheRows& k = p.keys;
  if (reinterpret_cast<uintptr_t>(k.base) % 16 != 0) return false;
  if (k.dtype == DType::kBF16) return k.row_bytes % 16 == 0;
  return k.dtype == DType::kFP8E4M3 && k.scales_apart > 0 && k.fp8_dim == p.dim &&
         (static_cast<size_t>(k.scales_apart) * k.row_bytes) % 16 == 0;
}

}  // namespace

bool IndexerUsesStream(const IndexerParams& p) {
  return p.tensor_cores && IndexerStreamTakes(p.heads, p.dim, p.keys.dtype) && StreamRowsFit(p);
}

bool IndexerUsesTensorCores(const IndexerParams& p) {
  if (IndexerUsesStream(p)) return true;
  return p.tensor_cores && p.keys.dtype == DType::kBF16 && p.heads % 16 == 0 && p.heads > 0 &&
         p.dim % 16 == 0 && p.dim > 0 && p.keys.row_bytes % 16 == 0 &&
         reinterpret_cast<uintptr_t>(p.keys.base) % 16 == 0;  // uint4 rows
}

// Keys per block of the streaming kernel: enough blocks to fill the GPU about twice, 256 to 4096
// keys each (a multiple of the tile). A key's score does not depend on it.
int64_t StreamRange(int64_t max_keys, int nq, int sms) {
  const int64_t want_blocks = 2 * static_cast<int64_t>(sms);
  int64_t range = (max_keys * nq + want_blocks - 1) / want_blocks;
  range = std::min<int64_t>(4096, std::max<int64_t>(256, range));
  return (range + kStreamTile - 1) / kStreamTile * kStreamTile;
}

cudaError_t LaunchIndexerStream(const IndexerParams& p, cudaStream_t s) {
  GpuFacts g;
  cudaError_t e = CurrentGpuFacts(&g);
  if (e != cudaSuccess) return e;
  const int sms = g.sms;
  IndexerStreamParams sp;
  sp.q = p.q;
  sp.w = p.w;
  sp.heads = p.heads;
  sp.dim = p.dim;
  sp.keys = p.keys;
  sp.tables = p.tables;
  sp.scores = p.scores;
  sp.range = StreamRange(p.max_keys, p.nq, sms);
  const bool fp8 = p.keys.dtype == DType::kFP8E4M3;
  const size_t smem = StreamSmemBytes(p.heads, p.dim, fp8);
  auto kernel = [&]() -> void (*)(IndexerStreamParams) {
    const int hg = p.heads / 16;
    if (hg == 2) return fp8 ? IndexerStreamKernel<2, true> : IndexerStreamKernel<2, false>;
    if (hg == 4) return fp8 ? IndexerStreamKernel<4, true> : IndexerStreamKernel<4, false>;
    return fp8 ? IndexerStreamKernel<8, true> : IndexerStreamKernel<8, false>;
  }();
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  for (int q0 = 0; q0 < p.nq; q0 += kMaxGridY) {
    sp.queries = p.queries + q0;
    sp.score_offset = p.score_offset + q0;
    const int nq = std::min(kMaxGridY, p.nq - q0);
    const dim3 grid(static_cast<unsigned>((p.max_keys + sp.range - 1) / sp.range), nq);
    kernel<<<grid, kStreamThreads, smem, s>>>(sp);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// Launches an indexer kernel over tiles of `tile` keys and the queries, splitting the query list
// where it passes the grid's y limit.
template <typename Kernel>
cudaError_t LaunchIndexerGrid(const IndexerParams& p, Kernel kernel, int tile, size_t smem,
                              cudaStream_t s) {
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  for (int q0 = 0; q0 < p.nq; q0 += kMaxGridY) {
    IndexerParams c = p;
    c.queries += q0;
    c.score_offset += q0;
    c.nq = std::min(kMaxGridY, p.nq - q0);
    const dim3 grid(static_cast<unsigned>((p.max_keys + tile - 1) / tile), c.nq);
    kernel<<<grid, kThreads, smem, s>>>(c);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t LaunchIndexerScores(const IndexerParams& p, cudaStream_t s) {
  if (p.nq <= 0 || p.max_keys <= 0) return cudaSuccess;
  if (IndexerUsesStream(p)) return LaunchIndexerStream(p, s);
  if (IndexerUsesTensorCores(p))
    return LaunchIndexerGrid(p, IndexerMmaKernel, kIdxMmaKeys,
                             2 * size_t(p.heads + kIdxMmaKeys) * (p.dim + 8) + 4 * size_t(p.heads),
                             s);
  const size_t smem =
      sizeof(float) * (p.heads * p.dim + p.heads + kIdxTile * (p.dim + 1) + 4 * kIdxTile);
  return Dispatch(p.keys.dtype, [&](auto t) {
    return LaunchIndexerGrid(p, IndexerKernel<decltype(t)::value>, kIdxTile, smem, s);
  });
}

}  // namespace attnd::cuda
