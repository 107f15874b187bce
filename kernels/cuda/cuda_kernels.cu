// The CUDA backend's kernels. Correctness first: fp32 accumulation, exact radix top-k with ties
// to the lower index, online softmax. Launchers return the launch error (never synchronise).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cub/block/block_scan.cuh>
#include <type_traits>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/mma_fragments.h"

namespace attnd::cuda {
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

// Value d of the cached row at `slot`, as fp32: fp8 rows dequantised with their scales (DESIGN
// §4: a latent row is L codes, one scale per tile of 128 (one tile below 128), then bf16 rope;
// an indexer row's one scale lives apart, after its page's values).
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

// Order-preserving float -> uint32 (larger float, larger key), ranking like the CPU backend: NaN
// ties with -inf (lowest) and -0 with +0. Never 0, the "excluded" page key.
__device__ __forceinline__ uint32_t Key(float f) {
  if (isnan(f)) f = -INFINITY;
  if (f == 0.0f) return 0x80000000u;  // -0 == +0
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The cached row of query q's key at position pos, and its slot.
__device__ __forceinline__ int64_t SlotOf(const QueryTables& t, int q, int64_t pos) {
  return t.table.Slot(t.seq[q], pos);
}
__device__ __forceinline__ const uint8_t* Row(const CacheRows& c, const QueryTables& t, int q,
                                              int64_t pos) {
  return c.Row(SlotOf(t, q, pos));
}

template <DType T>
__global__ void ToF32Kernel(const void* src, float* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = Load<T>(src, i);
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

template <DType T>
__global__ void WriteRowsKernel(WriteRowsParams p) {
  const int r = blockIdx.x;
  uint8_t* row = p.cache.MutableRow(p.slot[r]);
  for (int d = threadIdx.x; d < p.dim; d += blockDim.x)
    Store<T>(row, p.col_offset + d, p.src[int64_t{r} * p.dim + d]);
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

__global__ void PositionsToSlotsKernel(SlotsParams p) {
  const int r = blockIdx.x;
  const int32_t* in = p.positions + r * p.stride;
  int32_t* out = p.slots + r * p.stride;
  for (int i = threadIdx.x; i < p.count[r]; i += blockDim.x)
    out[i] = static_cast<int32_t>(p.tables.table.Slot(p.tables.seq[r], in[i]));
}

// grid (queries, head groups). Shared: q [HB, D+1] | keys [kMlaTile, D+1] | s [HB, kMlaTile] |
// m, l, corr [HB].
constexpr int kMlaTile = 32;
constexpr int kMlaHeads = 16;
constexpr int kMlaDimsPerThread = 2;  // L <= kThreads * 2 = 512
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
      float mx = m[h];
      for (int j = 0; j < nk; ++j) mx = fmaxf(mx, ss[h * kMlaTile + j]);
      const float c = m[h] == -INFINITY ? 0.0f : __expf(m[h] - mx);
      const bool none = mx == -INFINITY;  // nothing visible yet: probabilities stay 0
      float sum = 0.0f;
      for (int j = 0; j < kMlaTile; ++j) {
        const float e = j < nk && !none ? __expf(ss[h * kMlaTile + j] - mx) : 0.0f;
        ss[h * kMlaTile + j] = e;
        sum += e;
      }
      l[h] = l[h] * c + sum;
      m[h] = mx;
      corr[h] = c;
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
// kernels/cuda/mla_mma_sim.h runs this kernel lane by lane on the CPU.
// grid (queries, heads / 16), 8 warps. Per tile of 64 keys: S[16 heads][64 keys] = Q·K^T, each
// warp 8 keys (D/16 k-steps); online softmax by 16 threads; O[16][L] += P·V, each warp L/8
// columns. Shared: Q [16][D+8] bf16 | K [64][D+8] bf16 | P [16][64+8] bf16 | S [16][64] f32 |
// m, l, corr [16] f32. Row pads of 8 bf16 keep the 32-bit fragment loads off one bank.
constexpr int kMmaKeys = 64;

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

__device__ __forceinline__ uint32_t Pack(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(lo)) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
}

// HB heads per block (16, or 64 so that 128 heads read each selected key twice, not 8 times).
template <int HB>
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
  const int q = blockIdx.x, h0 = blockIdx.y * HB;
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
  // Split-K (flash-decoding): block z takes tiles [z * per, (z + 1) * per) of the query's keys.
  const int64_t tiles = (keys.total + kMmaKeys - 1) / kMmaKeys;
  const int64_t per = (tiles + p.splits - 1) / p.splits;
  const int64_t first = min(tiles, blockIdx.z * per) * kMmaKeys;
  const int64_t last = min(keys.total, (blockIdx.z + 1) * per * kMmaKeys);
  __syncthreads();
  for (int64_t t0 = first; t0 < last; t0 += kMmaKeys) {
    const int nk = static_cast<int>(min(static_cast<int64_t>(kMmaKeys), last - t0));
    // 1. Key rows into shared memory, 16 bytes at a time (D % 8 == 0).
    const int chunks = D / 8;
    for (int i = threadIdx.x; i < kMmaKeys * chunks; i += blockDim.x) {
      const int j = i / chunks, c = i % chunks;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (j < nk) {
        v = reinterpret_cast<const uint4*>(keys.Row(p, q, t0 + j))[c];
      }
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
      float mx = m[h];
      for (int j = 0; j < nk; ++j) mx = fmaxf(mx, sf[h * kMmaKeys + j]);
      const float cr = m[h] == -INFINITY ? 0.0f : __expf(m[h] - mx);
      // Nothing visible yet (every score -inf): the probabilities stay 0, as on the CPU.
      const bool none = mx == -INFINITY;
      float sum = 0.0f;
      for (int j = 0; j < kMmaKeys; ++j) {
        const __nv_bfloat16 e =
            __float2bfloat16_rn(j < nk && !none ? __expf(sf[h * kMmaKeys + j] - mx) : 0.0f);
        ps[h * PP + j] = e;
        sum += __bfloat162float(e);  // the denominator sums what the numerator uses
      }
      l[h] = l[h] * cr + sum;
      m[h] = mx;
      corr[h] = cr;
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
  // One split: the normalised output. Several: this split's unnormalised sums and its (m, l),
  // which MlaCombineKernel merges.
  const bool partial = p.splits > 1;
  float* out = partial ? p.part_out + int64_t{blockIdx.z} * p.n * p.heads * L : p.out;
  if (partial && threadIdx.x < HB) {
    float* ml = p.part_ml + ((int64_t{blockIdx.z} * p.n + q) * p.heads + h0 + threadIdx.x) * 2;
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
      float* lo = out + (int64_t{q} * p.heads + h0 + lo_row) * L + col;
      float* hi = out + (int64_t{q} * p.heads + h0 + hi_row) * L + col;
      lo[0] = acc[mt][nt][0] * inv_lo;
      lo[1] = acc[mt][nt][1] * inv_lo;
      hi[0] = acc[mt][nt][2] * inv_hi;
      hi[1] = acc[mt][nt][3] * inv_hi;
    }
  }
}

// Merges the splits of MlaMmaKernel: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s with
// M the largest m_s; splits that saw no key (m_s = -inf) add nothing. grid (queries, heads).
__global__ void MlaCombineKernel(MlaParams p) {
  const int q = blockIdx.x, h = blockIdx.y, L = p.latent;
  const int64_t stride = int64_t{p.n} * p.heads;  // between splits, in (query, head) rows
  const int64_t row = int64_t{q} * p.heads + h;
  float M = -INFINITY;
  for (int z = 0; z < p.splits; ++z) M = fmaxf(M, p.part_ml[(z * stride + row) * 2]);
  float denom = 0.0f;
  for (int z = 0; z < p.splits; ++z) {
    const float mz = p.part_ml[(z * stride + row) * 2];
    if (mz != -INFINITY) denom += __expf(mz - M) * p.part_ml[(z * stride + row) * 2 + 1];
  }
  const float inv = denom > 0 ? 1.0f / denom : 0.0f;
  if (p.lse != nullptr && threadIdx.x == 0) p.lse[row] = denom == 0 ? -INFINITY : M + logf(denom);
  for (int d = threadIdx.x; d < L; d += blockDim.x) {
    float v = 0.0f;
    for (int z = 0; z < p.splits; ++z) {
      const float mz = p.part_ml[(z * stride + row) * 2];
      if (mz != -INFINITY) v += __expf(mz - M) * p.part_out[(z * stride + row) * L + d];
    }
    p.out[row * L + d] = v * inv;
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
// and shuffles. kernels/cuda/indexer_mma_sim.h runs this code lane by lane on the CPU.
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

int Blocks(int64_t n) {
  return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
}

// grid.y (one query per y) is limited to 65535: the launchers below split longer query lists.
constexpr int kMaxGridY = 65535;

}  // namespace

cudaError_t ProbeKernels() {
  cudaFuncAttributes a;
  cudaError_t e = cudaFuncGetAttributes(&a, MlaKernel<DType::kBF16>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, TopKKernel);
  return e;
}

cudaError_t LaunchToF32(const void* src, DType dtype, float* dst, int64_t count, cudaStream_t s) {
  if (count <= 0) return cudaSuccess;
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

namespace {

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

cudaError_t LaunchWriteRows(const WriteRowsParams& p, cudaStream_t s) {
  if (p.n <= 0) return cudaSuccess;
  if (p.cache.dtype == DType::kFP8E4M3) return cudaErrorInvalidValue;  // LaunchScatterRows
  return Dispatch(p.cache.dtype, [&](auto t) {
    WriteRowsKernel<decltype(t)::value><<<p.n, 128, 0, s>>>(p);
    return cudaGetLastError();
  });
}

cudaError_t LaunchScatterRows(const ScatterRowsParams& p, cudaStream_t s) {
  if (p.n <= 0) return cudaSuccess;
  ScatterRowsKernel<<<p.n, 128, 0, s>>>(p);
  return cudaGetLastError();
}

bool IndexerUsesTensorCores(const IndexerParams& p) {
  return p.tensor_cores && p.keys.dtype == DType::kBF16 && p.heads % 16 == 0 && p.heads > 0 &&
         p.dim % 16 == 0 && p.dim > 0 && p.keys.row_bytes % 16 == 0 &&
         reinterpret_cast<uintptr_t>(p.keys.base) % 16 == 0;  // uint4 rows
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

bool MlaUsesTensorCores(const MlaParams& p) {
  const int D = p.latent + p.rope;
  return p.tensor_cores && p.kv.dtype == DType::kBF16 && p.heads % 16 == 0 && p.latent % 64 == 0 &&
         p.latent <= 512 && D % 16 == 0 && p.kv.row_bytes % 16 == 0 &&
         reinterpret_cast<uintptr_t>(p.kv.base) % 16 == 0;  // uint4 rows
}

// Dynamic shared memory of MlaMmaKernel<hb> for rows of d = L + R elements.
size_t MlaMmaSmem(int hb, int d) {
  return 2 * (size_t(hb) * (d + 8) + size_t(kMmaKeys) * (d + 8) + size_t(hb) * (kMmaKeys + 8)) +
         4 * (size_t(hb) * kMmaKeys + 3 * size_t(hb));
}

int MlaHeadsPerBlock(const MlaParams& p) {
  if (p.heads_per_block == 16 || p.heads % 64 != 0) return 16;
  int device = 0, optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess) {
    cudaGetLastError();
    return 16;
  }
  return MlaMmaSmem(64, p.latent + p.rope) <= static_cast<size_t>(optin) ? 64 : 16;
}

int MlaSplits(int n, int heads, int sms, int64_t max_keys, int heads_per_block) {
  const int64_t blocks = int64_t{n} * std::max(1, heads / std::max(1, heads_per_block));
  const int64_t tiles = (max_keys + kMmaKeys - 1) / kMmaKeys;
  const int64_t want = (2 * int64_t{sms} + blocks - 1) / std::max<int64_t>(1, blocks);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({want, 16, tiles})));
}

cudaError_t LaunchMla(const MlaParams& p, cudaStream_t s) {
  if (p.n <= 0) return cudaSuccess;
  if (MlaUsesTensorCores(p)) {
    const int hb = MlaHeadsPerBlock(p);
    const size_t smem = MlaMmaSmem(hb, p.latent + p.rope);
    auto kernel = hb == 64 ? MlaMmaKernel<64> : MlaMmaKernel<16>;
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
    if (e != cudaSuccess) return e;
    const int splits = std::max(1, p.splits);
    if (splits > 1 && (p.part_out == nullptr || p.part_ml == nullptr)) return cudaErrorInvalidValue;
    MlaParams c = p;
    c.splits = splits;
    kernel<<<dim3(p.n, p.heads / hb, splits), kThreads, smem, s>>>(c);
    if ((e = cudaGetLastError()) != cudaSuccess || splits == 1) return e;
    MlaCombineKernel<<<dim3(p.n, p.heads), 128, 0, s>>>(c);
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
