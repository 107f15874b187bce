// MLA over paged caches: s = sm_scale (q . [c_kv | k_pe]) [soft-capped], online softmax,
// out = sum p c_kv, per query and head, over a selection or a key range. A SIMT kernel (any cache
// dtype) and a tensor-core one (bf16 mma, for bf16 and fp8 caches: fp8 rows are decoded to bf16
// as they are loaded) with split-K (flash-decoding) and its merge.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <type_traits>
#include <vector>

#include "kernels/cuda/backend/gpu_facts.h"
#include "kernels/cuda/experimental/mla_wgmma.h"
#include "kernels/cuda/experimental/mla_wgmma_ws.h"
#include "kernels/cuda/experimental/wgmma_self_check.h"
#include "kernels/cuda/ops/cuda_common.cuh"
#include "kernels/cuda/ops/cuda_kernels.h"
#include "kernels/cuda/ops/fp8_chunks.h"
#include "kernels/cuda/ops/mla_pipe.h"
#include "kernels/cuda/ops/mla_split.h"
#include "kernels/cuda/ops/mma_fragments.h"
#include "kernels/cuda/ops/simt.cuh"

namespace attnd::cuda {
namespace {

// The keys query q attends: a contiguous range [begin, pos] (dense layers, or a query whose
// selection covers every visible key) through the page table, or its selected slot ids.
struct KeySet {
  const int32_t* sel;  // null in range mode
  int64_t begin, total;
  __device__ int64_t Slot(const MlaParams& p, int q, int64_t i) const {
    return sel ? sel[i] : SlotOf(p.tables, q, begin + i);
  }
  __device__ const uint8_t* Row(const MlaParams& p, int q, int64_t i) const {
    return p.kv.Row(Slot(p, q, i));
  }
};
__device__ __forceinline__ KeySet KeysOf(const MlaParams& p, int q) {
  const int64_t pos = p.tables.pos[q];
  if (p.sel == nullptr || (p.needs_index && !p.needs_index[q])) {
    const int64_t begin = p.window > 0 ? max(static_cast<int64_t>(0), pos + 1 - p.window) : 0;
    return {nullptr, begin, pos + 1 - begin};
  }
  return {p.sel + q * p.sel_stride, 0, p.sel_count[q]};
}

// grid (queries, head groups). Shared: q [HB, D+1] | keys [kMlaTile, D+1] | s [HB, kMlaTile] |
// m, l, corr [HB].
constexpr int kMlaTile = 32;
constexpr int kMlaHeads = 16;
constexpr int kMlaDimsPerThread = 2;  // L <= kThreads * 2 = 512
// One head's online softmax over a tile of `width` scores s (the first nk visible): the
// probabilities into p (fp32, or bf16 for a P·V product on tensor cores; the denominator sums
// what the numerator uses), the running max m and sum l carried, and corr, the factor the
// output so far is scaled by. Nothing visible yet (every score -inf): the probabilities stay 0,
// as on the CPU. p may be s.
template <typename P>
__device__ __forceinline__ void SoftmaxTileRow(const float* s, P* p, int nk, int width, float& m,
                                               float& l, float& corr) {
  float mx = m;
  for (int j = 0; j < nk; ++j) mx = fmaxf(mx, s[j]);
  const float c = m == -INFINITY ? 0.0f : __expf(m - mx);
  const bool none = mx == -INFINITY;
  float sum = 0.0f;
  for (int j = 0; j < width; ++j) {
    const float e = j < nk && !none ? __expf(s[j] - mx) : 0.0f;
    if constexpr (std::is_same_v<P, float>) {
      p[j] = e;
      sum += e;
    } else {
      p[j] = __float2bfloat16_rn(e);
      sum += __bfloat162float(p[j]);
    }
  }
  l = l * c + sum;
  m = mx;
  corr = c;
}

template <DType T>
__global__ void MlaKernel(MlaParams p) {
  extern __shared__ float sm[];
  const int q = blockIdx.x;
  const int h0 = blockIdx.y * kMlaHeads;
  const int HB = min(kMlaHeads, p.heads - h0);
  const int L = p.latent, D = p.latent + p.rope;
  float* qs = sm;
  float* ks = qs + kMlaHeads * (D + 1);
  float* ss = ks + kMlaTile * (D + 1);
  float* m = ss + kMlaHeads * kMlaTile;
  float* l = m + kMlaHeads;
  float* corr = l + kMlaHeads;
  for (int i = threadIdx.x; i < HB * D; i += blockDim.x) {
    const int h = i / D, d = i % D;
    const int64_t head = int64_t{q} * p.heads + h0 + h;
    const float v = d < L ? p.q_latent[head * L + d] : p.q_rope[head * p.rope + (d - L)];
    qs[h * (D + 1) + d] = v * p.sm_scale;
  }
  if (threadIdx.x < kMlaHeads) {
    m[threadIdx.x] = -INFINITY;
    l[threadIdx.x] = 0.0f;
  }
  float acc[kMlaHeads][kMlaDimsPerThread];
  for (int h = 0; h < kMlaHeads; ++h)
    for (int i = 0; i < kMlaDimsPerThread; ++i) acc[h][i] = 0.0f;
  const KeySet keys = KeysOf(p, q);
  const int64_t total = keys.total;
  __syncthreads();
  for (int64_t t0 = 0; t0 < total; t0 += kMlaTile) {
    const int nk = static_cast<int>(min(static_cast<int64_t>(kMlaTile), total - t0));
    for (int i = threadIdx.x; i < kMlaTile * D; i += blockDim.x) {
      const int j = i / D, d = i % D;
      float v = 0.0f;
      if (j < nk) {
        v = CacheValue<T>(p.kv, keys.Slot(p, q, t0 + j), d);
      }
      ks[j * (D + 1) + d] = v;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < HB * kMlaTile; i += blockDim.x) {
      const int h = i / kMlaTile, j = i % kMlaTile;
      float s = -INFINITY;
      if (j < nk) {
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot += qs[h * (D + 1) + d] * ks[j * (D + 1) + d];
        s = p.soft_cap > 0 ? p.soft_cap * tanhf(dot / p.soft_cap) : dot;
      }
      ss[h * kMlaTile + j] = s;
    }
    __syncthreads();
    if (threadIdx.x < HB) {  // one thread per head: the tile's softmax bookkeeping
      const int h = threadIdx.x;
      SoftmaxTileRow(ss + h * kMlaTile, ss + h * kMlaTile, nk, kMlaTile, m[h], l[h], corr[h]);
    }
    __syncthreads();
    // Constant trip counts with guards keep acc[][] in registers (no local-memory spill).
#pragma unroll
    for (int i = 0; i < kMlaDimsPerThread; ++i) {
      const int d = threadIdx.x + i * blockDim.x;
#pragma unroll
      for (int h = 0; h < kMlaHeads; ++h) {
        if (h >= HB || d >= L) continue;
        float a = acc[h][i] * corr[h];
        for (int j = 0; j < nk; ++j) a += ss[h * kMlaTile + j] * ks[j * (D + 1) + d];
        acc[h][i] = a;
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < kMlaDimsPerThread; ++i) {
    const int d = threadIdx.x + i * blockDim.x;
#pragma unroll
    for (int h = 0; h < kMlaHeads; ++h) {
      if (h >= HB || d >= L) continue;
      const float inv = l[h] > 0 ? 1.0f / l[h] : 0.0f;
      p.out[(int64_t{q} * p.heads + h0 + h) * L + d] = acc[h][i] * inv;
    }
  }
  if (p.lse != nullptr && threadIdx.x < HB) {
    const int h = threadIdx.x;
    p.lse[int64_t{q} * p.heads + h0 + h] = l[h] == 0 ? -INFINITY : m[h] + logf(l[h]);
  }
}

// ---- MLA on bf16 tensor cores (mma.sync m16n8k16, fp32 accumulation) ----
// tests/sim/mla_mma_sim.h runs this kernel lane by lane on the CPU.
// grid (queries, heads / 16), 8 warps. Per tile of 64 keys: S[16 heads][64 keys] = Q·K^T, each
// warp 8 keys (D/16 k-steps); online softmax by 16 threads; O[16][L] += P·V, each warp L/8
// columns. Shared: Q [16][D+8] bf16 | K [64][D+8] bf16 | P [16][64+8] bf16 | S [16][64] f32 |
// m, l, corr [16] f32. Row pads of 8 bf16 keep the 32-bit fragment loads off one bank.
constexpr int kMmaKeys = 64;

// Chunk c (8 values, 16 bytes of shared memory) of a cached key row as bf16: a bf16 row's own
// bytes, or an fp8 row's codes decoded with their tile's scale (exact, fp8_chunks.h) or its bf16
// rope values.
template <bool kFp8>
__device__ __forceinline__ uint4 KeyChunk(const uint8_t* row, int L, int c) {
  if constexpr (kFp8) {
    const Fp8LatentChunk at = LatentChunkAt(L, c);
    if (at.rope) return *reinterpret_cast<const uint4*>(row + at.rope_bytes);
    const uint2 codes = *reinterpret_cast<const uint2*>(row + at.codes);
    const float scale = *reinterpret_cast<const float*>(row + at.scale);
    uint32_t w[4];
    DecodeE4M3x8(static_cast<uint64_t>(codes.x) | (static_cast<uint64_t>(codes.y) << 32), scale, w);
    return make_uint4(w[0], w[1], w[2], w[3]);
  } else {
    return reinterpret_cast<const uint4*>(row)[c];
  }
}

__device__ __forceinline__ uint32_t Pack(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(lo)) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
}

// HB heads per block (16, or 64 so that 128 heads read each selected key twice, not 8 times);
// kFp8: an fp8 cache, decoded to bf16 as its rows are loaded.
template <int HB, bool kFp8>
__global__ void __launch_bounds__(256) MlaMmaKernel(MlaParams p) {
  constexpr int MT = HB / 16;  // m-tiles of 16 heads
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int L = p.latent, D = p.latent + p.rope, DP = D + 8, PP = kMmaKeys + 8;
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  __nv_bfloat16* ks = qs + HB * DP;
  __nv_bfloat16* ps = ks + kMmaKeys * DP;
  float* sf = reinterpret_cast<float*>(ps + HB * PP);
  float* m = sf + HB * kMmaKeys;
  float* l = m + HB;
  float* corr = l + HB;
  // The query, and its row among this wave's partials (LaunchMla runs a step in waves of
  // part_queries queries when their partials would not fit at once).
  const int q = p.first_query + static_cast<int>(blockIdx.x), wq = blockIdx.x;
  const int h0 = blockIdx.y * HB;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < HB * D; i += blockDim.x) {
    const int h = i / D, d = i % D;
    const int64_t head = int64_t{q} * p.heads + h0 + h;
    qs[h * DP + d] =
        __float2bfloat16_rn(d < L ? p.q_latent[head * L + d] : p.q_rope[head * p.rope + (d - L)]);
  }
  if (threadIdx.x < HB) {
    m[threadIdx.x] = -INFINITY;
    l[threadIdx.x] = 0.0f;
  }
  const int cols = L / 8;  // output columns per warp
  const int ntiles = cols / 8;
  float acc[MT][8][4];  // per m-tile, up to 8 n-tiles of 8 columns (L <= 512)
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0;
  const KeySet keys = KeysOf(p, q);
  // Split-K (flash-decoding) by the query's own keys (mla_split.h): block z takes tiles
  // [z * per, (z + 1) * per); the grid's splits past the query's own have nothing to do.
  const int query_splits = MlaQuerySplits(keys.total);
  if (static_cast<int>(blockIdx.z) >= query_splits) return;  // the whole block: no barrier left
  const int64_t tiles = (keys.total + kMmaKeys - 1) / kMmaKeys;
  const int64_t per = MlaTilesPerSplit(keys.total);
  const int64_t first = min(tiles, blockIdx.z * per) * kMmaKeys;
  const int64_t last = min(keys.total, (blockIdx.z + 1) * per * kMmaKeys);
  __syncthreads();
  for (int64_t t0 = first; t0 < last; t0 += kMmaKeys) {
    const int nk = static_cast<int>(min(static_cast<int64_t>(kMmaKeys), last - t0));
    // 1. Key rows into shared memory as bf16, 16 bytes at a time (D % 8 == 0).
    const int chunks = D / 8;
    for (int i = threadIdx.x; i < kMmaKeys * chunks; i += blockDim.x) {
      const int j = i / chunks, c = i % chunks;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (j < nk) v = KeyChunk<kFp8>(keys.Row(p, q, t0 + j), L, c);
      *reinterpret_cast<uint4*>(ks + j * DP + c * 8) = v;
    }
    __syncthreads();
    // 2. Scores: warp w takes keys [8w, 8w + 8) for every m-tile of heads.
    {
      const __nv_bfloat16* krow = ks + (warp * 8 + mma::ColB(lane)) * DP;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int k0 = 0; k0 < D; k0 += 16) {
          uint32_t a[4];
#pragma unroll
          for (int r = 0; r < 4; ++r)
            a[r] = Pair(qs + (mt * 16 + mma::RowA(lane, r)) * DP + k0 + mma::ColA(lane, r, 0));
          Mma16816(c, a[0], a[1], a[2], a[3], Pair(krow + k0 + mma::RowB(lane, 0, 0)),
                   Pair(krow + k0 + mma::RowB(lane, 1, 0)));
        }
        for (int i = 0; i < 4; ++i) {
          const int h = mt * 16 + mma::RowC(lane, i), j = warp * 8 + mma::ColC(lane, i);
          float x = c[i] * p.sm_scale;
          if (p.soft_cap > 0) x = p.soft_cap * tanhf(x / p.soft_cap);
          sf[h * kMmaKeys + j] = j < nk ? x : -INFINITY;
        }
      }
    }
    __syncthreads();
    // 3. Online softmax, one thread per head; probabilities to bf16 for the P·V product.
    if (threadIdx.x < HB) {
      const int h = threadIdx.x;
      SoftmaxTileRow(sf + h * kMmaKeys, ps + h * PP, nk, kMmaKeys, m[h], l[h], corr[h]);
    }
    __syncthreads();
    // 4. O += P·V: warp w owns columns [w * cols, (w + 1) * cols), n-tiles of 8, every m-tile.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float c_lo = corr[mt * 16 + mma::RowC(lane, 0)];
      const float c_hi = corr[mt * 16 + mma::RowC(lane, 2)];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        if (nt >= ntiles) break;
        acc[mt][nt][0] *= c_lo;
        acc[mt][nt][1] *= c_lo;
        acc[mt][nt][2] *= c_hi;
        acc[mt][nt][3] *= c_hi;
      }
    }
    for (int k0 = 0; k0 < kMmaKeys; k0 += 16) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          a[mt][r] = Pair(ps + (mt * 16 + mma::RowA(lane, r)) * PP + k0 + mma::ColA(lane, r, 0));
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        if (nt >= ntiles) break;
        const __nv_bfloat16* v = ks + warp * cols + nt * 8 + mma::ColB(lane);  // B[k][n]: K^T
        const uint32_t b0 =
            Pack(v[(k0 + mma::RowB(lane, 0, 0)) * DP], v[(k0 + mma::RowB(lane, 0, 1)) * DP]);
        const uint32_t b1 =
            Pack(v[(k0 + mma::RowB(lane, 1, 0)) * DP], v[(k0 + mma::RowB(lane, 1, 1)) * DP]);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          Mma16816(acc[mt][nt], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
      }
    }
    __syncthreads();
  }
  // A query of one split: the normalised output. Several: this split's unnormalised sums and
  // its (m, l), which MlaCombineKernel merges.
  const bool partial = query_splits > 1;
  const int64_t wave = p.part_queries;  // partials: [splits, part_queries, H, L]
  const int row_q = partial ? wq : q;
  float* out = partial ? p.part_out + int64_t{blockIdx.z} * wave * p.heads * L : p.out;
  if (partial && threadIdx.x < HB) {
    float* ml = p.part_ml + ((int64_t{blockIdx.z} * wave + wq) * p.heads + h0 + threadIdx.x) * 2;
    ml[0] = m[threadIdx.x];
    ml[1] = l[threadIdx.x];
  }
  if (!partial && p.lse != nullptr && threadIdx.x < HB) {
    const float lh = l[threadIdx.x];
    p.lse[int64_t{q} * p.heads + h0 + threadIdx.x] =
        lh == 0 ? -INFINITY : m[threadIdx.x] + logf(lh);
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int lo_row = mt * 16 + mma::RowC(lane, 0), hi_row = mt * 16 + mma::RowC(lane, 2);
    const float inv_lo = partial ? 1.0f : l[lo_row] > 0 ? 1.0f / l[lo_row] : 0.0f;
    const float inv_hi = partial ? 1.0f : l[hi_row] > 0 ? 1.0f / l[hi_row] : 0.0f;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      if (nt >= ntiles) break;
      const int col = warp * cols + nt * 8 + mma::ColC(lane, 0);
      float* lo = out + (int64_t{row_q} * p.heads + h0 + lo_row) * L + col;
      float* hi = out + (int64_t{row_q} * p.heads + h0 + hi_row) * L + col;
      lo[0] = acc[mt][nt][0] * inv_lo;
      lo[1] = acc[mt][nt][1] * inv_lo;
      hi[0] = acc[mt][nt][2] * inv_hi;
      hi[1] = acc[mt][nt][3] * inv_hi;
    }
  }
}

// Merges the splits of MlaMmaKernel: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s with
// M the largest m_s, over the query's own splits; splits that saw no key (m_s = -inf) add
// nothing. A query of one split wrote its output itself. grid (queries, heads).
__global__ void MlaCombineKernel(MlaParams p) {
  const int q = p.first_query + static_cast<int>(blockIdx.x), h = blockIdx.y, L = p.latent;
  const int splits = MlaQuerySplits(KeysOf(p, q).total);
  if (splits == 1) return;
  const int64_t stride = int64_t{p.part_queries} * p.heads;    // between splits, in rows
  const int64_t part_row = int64_t{blockIdx.x} * p.heads + h;  // this wave's
  const int64_t row = int64_t{q} * p.heads + h;
  float M = -INFINITY;
  for (int z = 0; z < splits; ++z) M = fmaxf(M, p.part_ml[(z * stride + part_row) * 2]);
  float denom = 0.0f;
  for (int z = 0; z < splits; ++z) {
    const float mz = p.part_ml[(z * stride + part_row) * 2];
    if (mz != -INFINITY) denom += __expf(mz - M) * p.part_ml[(z * stride + part_row) * 2 + 1];
  }
  const float inv = denom > 0 ? 1.0f / denom : 0.0f;
  if (p.lse != nullptr && threadIdx.x == 0) p.lse[row] = denom == 0 ? -INFINITY : M + logf(denom);
  for (int d = threadIdx.x; d < L; d += blockDim.x) {
    float v = 0.0f;
    for (int z = 0; z < splits; ++z) {
      const float mz = p.part_ml[(z * stride + part_row) * 2];
      if (mz != -INFINITY) v += __expf(mz - M) * p.part_out[(z * stride + part_row) * L + d];
    }
    p.out[row * L + d] = v * inv;
  }
}

// ---- the pipelined tensor-core MLA (kernels/cuda/ops/mla_pipe.h, the body the CPU simulation
// runs): one block per (query of the wave, 64 heads, split), 8 warps. Block x names its head
// block fastest, then its split, then its query, so a query's blocks are launched side by side:
// at 128 heads the second head block reads the key tiles the first just brought into L2 (at
// large batches the two were a wave apart), and every block of a query reads its Q from L2.
struct PipeBlockId {
  int qx, hy, z;  // query of the wave, head block, split
};
__device__ PipeBlockId PipeBlockOf(int head_blocks, int splits) {
  const int x = static_cast<int>(blockIdx.x);
  return {x / (head_blocks * splits), x % head_blocks, (x / head_blocks) % splits};
}

// Which of the pipelined kernel's forms a launch takes: the mma form (kernels/cuda/ops/mla_pipe.h);
// its wgmma form (kernels/cuda/experimental/mla_wgmma.h), two warpgroups a block, whose body is
// wgmma only in the sm_90a image (elsewhere GpuThread's wgmma traps; MlaUsesWgmma launches it
// only on compute capability 9.0); its warp-specialised form (kernels/cuda/experimental/
// mla_wgmma_ws.h), a producer warpgroup more. All three take the same grid.
enum class PipeForm { kMma, kWgmma, kWgmmaWs };

constexpr int PipeThreads(PipeForm f) {
  return f == PipeForm::kWgmmaWs ? kWsThreads : f == PipeForm::kWgmma ? kWgThreads : kPipeThreads;
}

// A block of form kForm: its body, the grid's block id decoded.
template <PipeForm kForm, bool kFp8>
__device__ __forceinline__ void PipeGridBlock(const MlaPipeParams& p, int head_blocks, int splits) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  GpuThread g{smem_raw};
  const PipeBlockId b = PipeBlockOf(head_blocks, splits);
  if constexpr (kForm == PipeForm::kWgmmaWs)
    MlaWgmmaWsBlock<kFp8>(g, p, b.qx, b.hy, b.z);
  else if constexpr (kForm == PipeForm::kWgmma)
    MlaWgmmaBlock<kFp8>(g, p, b.qx, b.hy, b.z);
  else
    MlaPipeBlock<kFp8>(g, p, b.qx, b.hy, b.z);
}

// One kernel name per form: the profilers select them by name (gpu-check's ncu stage,
// bench/gpu_report.py).
template <bool kFp8>
__global__ void __launch_bounds__(kPipeThreads, 1) MlaPipeKernel(MlaPipeParams p, int hb, int s) {
  PipeGridBlock<PipeForm::kMma, kFp8>(p, hb, s);
}
template <bool kFp8>
__global__ void __launch_bounds__(kWgThreads, 1) MlaWgmmaKernel(MlaPipeParams p, int hb, int s) {
  PipeGridBlock<PipeForm::kWgmma, kFp8>(p, hb, s);
}
template <bool kFp8>
__global__ void __launch_bounds__(kWsThreads, 1) MlaWgmmaWsKernel(MlaPipeParams p, int hb, int s) {
  PipeGridBlock<PipeForm::kWgmmaWs, kFp8>(p, hb, s);
}

std::atomic<int64_t> g_wgmma_launches{0}, g_wgmma_ws_launches{0};

// The dynamic shared memory of a form at `stages`.
uint32_t PipeSmemBytes(const MlaParams& p, PipeForm form, int stages) {
  const bool fp8 = p.kv.dtype == DType::kFP8E4M3;
  switch (form) {
    case PipeForm::kWgmmaWs:
      return MlaWgmmaWsSmem::Of(p.latent, p.rope, fp8, stages).bytes;
    case PipeForm::kWgmma:
      return MlaWgmmaSmem::Of(p.latent, p.rope, fp8, stages).bytes;
    case PipeForm::kMma:
      break;
  }
  return MlaPipeSmem::Of(p.latent, p.rope, fp8, stages).bytes;
}

// The stages the pipelined kernel (or its wgmma forms) can have on this GPU (4 for the
// warp-specialised one, 3, 2), or 0 when it does not fit.
int PipeStages(const MlaParams& p, PipeForm form) {
  GpuFacts g;
  if (CurrentGpuFacts(&g) != cudaSuccess) return 0;
  for (int stages : {kWsMaxStages, 3, 2}) {
    if (stages > 3 && form != PipeForm::kWgmmaWs) continue;
    if (PipeSmemBytes(p, form, stages) <= static_cast<uint32_t>(g.smem_optin)) return stages;
  }
  return 0;
}

}  // namespace

bool MlaUsesPipeline(const MlaParams& p) {
  return MlaUsesTensorCores(p) && p.pipeline && p.heads_per_block != 16 &&
         MlaPipeTakes(p.heads, p.latent, p.rope, p.kv.dtype) &&
         reinterpret_cast<uintptr_t>(p.q_latent) % 16 == 0 &&  // its 16-byte query loads
         reinterpret_cast<uintptr_t>(p.q_rope) % 16 == 0 && PipeStages(p, PipeForm::kMma) > 0;
}

bool MlaUsesWgmma(const MlaParams& p) {
#ifdef ATTND_CUDA_SM90A
  // The cheap tests first: this runs for every MLA launch with p.wgmma set.
  if (!p.wgmma || !WgmmaSelfCheckPassed() || !MlaWgmmaTakes(p.heads, p.latent, p.rope, p.kv.dtype))
    return false;
  int device = 0;
  return CurrentGpuIsCc90(&device) && MlaUsesPipeline(p) &&
         PipeStages(p, p.wgmma_ws ? PipeForm::kWgmmaWs : PipeForm::kWgmma) > 0;
#else
  (void)p;
  return false;  // no sm_90a image was built (CMakeLists.txt): the kernel would trap
#endif
}

int64_t MlaWgmmaLaunches() { return g_wgmma_launches.load(); }
int64_t MlaWgmmaWsLaunches() { return g_wgmma_ws_launches.load(); }

bool MlaWgmmaBuilt() {
#ifdef ATTND_CUDA_SM90A
  return true;
#else
  return false;
#endif
}

cudaError_t ProbeKernels() {
  cudaFuncAttributes a;
  cudaError_t e = cudaFuncGetAttributes(&a, MlaKernel<DType::kBF16>);
  if (e == cudaSuccess) e = ProbeTopKKernel();
  return e;
}

bool MlaUsesTensorCores(const MlaParams& p) {
  const int D = p.latent + p.rope;
  const bool rows = p.kv.dtype == DType::kBF16 ||
                    (p.kv.dtype == DType::kFP8E4M3 && Fp8LatentRowsTakeChunks(p.latent, p.rope));
  return p.tensor_cores && rows && p.heads % 16 == 0 && p.latent % 64 == 0 && p.latent <= 512 &&
         D % 16 == 0 && p.kv.row_bytes % 16 == 0 &&
         reinterpret_cast<uintptr_t>(p.kv.base) % 16 == 0;  // uint4 rows
}

// Dynamic shared memory of MlaMmaKernel<hb> for rows of d = L + R elements.
size_t MlaMmaSmem(int hb, int d) {
  return 2 * (size_t(hb) * (d + 8) + size_t(kMmaKeys) * (d + 8) + size_t(hb) * (kMmaKeys + 8)) +
         4 * (size_t(hb) * kMmaKeys + 3 * size_t(hb));
}

int MlaHeadsPerBlock(const MlaParams& p) {
  if (p.heads_per_block == 16 || p.heads % 64 != 0) return 16;
  GpuFacts g;
  if (CurrentGpuFacts(&g) != cudaSuccess) return 16;
  return MlaMmaSmem(64, p.latent + p.rope) <= static_cast<size_t>(g.smem_optin) ? 64 : 16;
}

// The pipelined kernel (or its wgmma form) over the waves of a step (same splits, partials and
// merge as the tile-per-block kernel).
cudaError_t LaunchMlaPipe(const MlaParams& p, cudaStream_t s) {
  const bool wg = MlaUsesWgmma(p), ws = wg && p.wgmma_ws;
  const PipeForm form = ws ? PipeForm::kWgmmaWs : wg ? PipeForm::kWgmma : PipeForm::kMma;
  MlaPipeParams pp;
  pp.q_latent = p.q_latent;
  pp.q_rope = p.q_rope;
  pp.heads = p.heads;
  pp.latent = p.latent;
  pp.rope = p.rope;
  pp.sm_scale = p.sm_scale;
  pp.soft_cap = p.soft_cap;
  pp.kv = p.kv;
  pp.tables = p.tables;
  pp.sel = p.sel;
  pp.sel_count = p.sel_count;
  pp.needs_index = p.needs_index;
  pp.sel_stride = p.sel_stride;
  pp.window = p.window;
  pp.out = p.out;
  pp.lse = p.lse;
  pp.part_out = p.part_out;
  pp.part_ml = p.part_ml;
  pp.part_queries = p.part_queries;
  pp.stages = PipeStages(p, form);
  const bool fp8 = p.kv.dtype == DType::kFP8E4M3;
  const size_t smem = PipeSmemBytes(p, form, pp.stages);
  using Kernel = void (*)(MlaPipeParams, int, int);
  const Kernel kernel = ws   ? (fp8 ? MlaWgmmaWsKernel<true> : MlaWgmmaWsKernel<false>)
                        : wg ? (fp8 ? MlaWgmmaKernel<true> : MlaWgmmaKernel<false>)
                             : (fp8 ? MlaPipeKernel<true> : MlaPipeKernel<false>);
  const int threads = PipeThreads(form);
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  const int splits = MlaQuerySplits(p.max_keys);
  const int wave = splits > 1 ? p.part_queries : p.n;
  for (int first = 0; first < p.n; first += wave) {
    pp.first_query = first;
    MlaParams c = p;
    c.first_query = first;
    const int count = std::min(wave, p.n - first);
    const int head_blocks = p.heads / kPipeHeads;
    kernel<<<count * head_blocks * splits, threads, smem, s>>>(pp, head_blocks, splits);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    if (wg) (ws ? g_wgmma_ws_launches : g_wgmma_launches).fetch_add(1);
    if (splits == 1) continue;
    MlaCombineKernel<<<dim3(count, p.heads), 128, 0, s>>>(c);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t LaunchMla(const MlaParams& p, cudaStream_t s) {
  if (p.n <= 0) return cudaSuccess;
  if (MlaUsesTensorCores(p) && p.max_keys >= 1 &&
      (MlaQuerySplits(p.max_keys) == 1 ||
       (p.part_out != nullptr && p.part_ml != nullptr && p.part_queries >= 1)) &&
      MlaUsesPipeline(p))
    return LaunchMlaPipe(p, s);
  if (MlaUsesTensorCores(p)) {
    const int hb = MlaHeadsPerBlock(p);
    const size_t smem = MlaMmaSmem(hb, p.latent + p.rope);
    const bool fp8 = p.kv.dtype == DType::kFP8E4M3;
    auto kernel = hb == 64 ? (fp8 ? MlaMmaKernel<64, true> : MlaMmaKernel<64, false>)
                           : (fp8 ? MlaMmaKernel<16, true> : MlaMmaKernel<16, false>);
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
    if (e != cudaSuccess) return e;
    if (p.max_keys < 1) return cudaErrorInvalidValue;  // the grid would miss keys
    const int splits = MlaQuerySplits(p.max_keys);
    if (splits > 1 && (p.part_out == nullptr || p.part_ml == nullptr || p.part_queries < 1))
      return cudaErrorInvalidValue;
    // Waves of part_queries queries (their partials fit part_out); a query's bits do not depend
    // on its wave.
    const int wave = splits > 1 ? p.part_queries : p.n;
    for (int first = 0; first < p.n; first += wave) {
      MlaParams c = p;
      c.first_query = first;
      const int count = std::min(wave, p.n - first);
      kernel<<<dim3(count, p.heads / hb, splits), kThreads, smem, s>>>(c);
      if ((e = cudaGetLastError()) != cudaSuccess) return e;
      if (splits == 1) continue;
      MlaCombineKernel<<<dim3(count, p.heads), 128, 0, s>>>(c);
      if ((e = cudaGetLastError()) != cudaSuccess) return e;
    }
    return cudaSuccess;
    return cudaGetLastError();
  }
  if (p.latent > kThreads * kMlaDimsPerThread) return cudaErrorInvalidValue;
  const int D = p.latent + p.rope;
  const size_t smem = sizeof(float) * (kMlaHeads * (D + 1) + kMlaTile * (D + 1) +
                                       kMlaHeads * kMlaTile + 3 * kMlaHeads);
  return Dispatch(p.kv.dtype, [&](auto t) {
    cudaError_t e =
        cudaFuncSetAttribute(MlaKernel<decltype(t)::value>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return e;
    const dim3 grid(p.n, (p.heads + kMlaHeads - 1) / kMlaHeads);
    MlaKernel<decltype(t)::value><<<grid, kThreads, smem, s>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace attnd::cuda
