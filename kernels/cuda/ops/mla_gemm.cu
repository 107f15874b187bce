#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>

#include "kernels/cuda/ops/cuda_common.cuh"
#include "kernels/cuda/ops/mla_gemm.h"

namespace attnd::cuda {
namespace {

using Bf16 = __nv_bfloat16;

// The keys query q attends: its count and, for the j-th, its slot.
__device__ __forceinline__ int64_t KeyCount(const MlaParams& p, int q, int64_t max_keys) {
  int64_t c;
  if (p.sel != nullptr && (p.needs_index == nullptr || p.needs_index[q])) {
    c = p.sel_count[q];
  } else {
    const int64_t pos = p.tables.pos[q];
    const int64_t first = p.window > 0 && pos + 1 > p.window ? pos + 1 - p.window : 0;
    c = pos - first + 1;
  }
  return c < max_keys ? c : max_keys;
}
__device__ __forceinline__ int64_t KeySlot(const MlaParams& p, int q, int64_t j) {
  if (p.sel != nullptr && (p.needs_index == nullptr || p.needs_index[q]))
    return p.sel[q * p.sel_stride + j];
  const int64_t pos = p.tables.pos[q];
  const int64_t first = p.window > 0 && pos + 1 > p.window ? pos + 1 - p.window : 0;
  return SlotOf(p.tables, q, first + j);
}

// q [wave, H, L + R] bf16 from the fp32 latent and RoPE queries.
__global__ void PackQueryKernel(MlaParams p, int first, int64_t count, Bf16* q) {
  const int D = p.latent + p.rope;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / D;  // (query - first) * H + head
    const int d = static_cast<int>(i % D);
    const int64_t at = int64_t{first} * p.heads + row;
    const float v =
        d < p.latent ? p.q_latent[at * p.latent + d] : p.q_rope[at * p.rope + d - p.latent];
    q[i] = __float2bfloat16_rn(v);
  }
}

// keys [wave, Kp, L + R] bf16: block (query, 32 keys); rows past the query's count are zeros.
template <DType T>
__global__ void GatherKeysKernel(MlaParams p, int first, int64_t kp, int64_t max_keys, Bf16* keys) {
  const int D = p.latent + p.rope;
  const int q = first + blockIdx.x;
  const int64_t count = KeyCount(p, q, max_keys);
  const int64_t j0 = int64_t{blockIdx.y} * 32;
  Bf16* out = keys + (int64_t{blockIdx.x} * kp + j0) * D;
  if constexpr (T == DType::kBF16) {
    if (D % 8 == 0 && p.kv.row_bytes % 16 == 0 &&
        reinterpret_cast<uintptr_t>(p.kv.base) % 16 == 0) {
      const int pieces = D / 8;  // 16-byte pieces a row
      for (int i = threadIdx.x; i < 32 * pieces; i += blockDim.x) {
        const int64_t j = j0 + i / pieces;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (j < count) v = reinterpret_cast<const uint4*>(p.kv.Row(KeySlot(p, q, j)))[i % pieces];
        reinterpret_cast<uint4*>(out)[i] = v;
      }
      return;
    }
  }
  for (int i = threadIdx.x; i < 32 * D; i += blockDim.x) {
    const int64_t j = j0 + i / D;
    const float v = j < count ? CacheValue<T>(p.kv, KeySlot(p, q, j), i % D) : 0.f;
    out[i] = __float2bfloat16_rn(v);
  }
}

constexpr int kSoftmaxThreads = 256;

__device__ __forceinline__ float BlockReduce(float v, bool is_max, float* shared) {
  for (int o = 16; o > 0; o /= 2) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, w) : v + w;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // the previous reduction's reads of `shared` are done
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = shared[0];
  for (int w = 1; w < kSoftmaxThreads / 32; ++w) v = is_max ? fmaxf(v, shared[w]) : v + shared[w];
  return v;
}

// One block per (query, head): P = softmax(sm_scale * S) over the query's keys, zeros past them;
// lse = m + ln(l), -inf where the query has no key.
__global__ void __launch_bounds__(kSoftmaxThreads)
    SoftmaxKernel(MlaParams p, int first, int64_t kp, int64_t max_keys, const float* s,
                  Bf16* prob) {
  __shared__ float shared[kSoftmaxThreads / 32];
  const int local = blockIdx.x / p.heads, h = blockIdx.x % p.heads, q = first + local;
  const int64_t count = KeyCount(p, q, max_keys);
  const float* row = s + int64_t{blockIdx.x} * kp;
  Bf16* out = prob + int64_t{blockIdx.x} * kp;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < count; j += kSoftmaxThreads) m = fmaxf(m, row[j] * p.sm_scale);
  m = BlockReduce(m, true, shared);
  float l = 0;
  for (int64_t j = threadIdx.x; j < count; j += kSoftmaxThreads) l += expf(row[j] * p.sm_scale - m);
  l = BlockReduce(l, false, shared);
  const float inv = l > 0 ? 1.f / l : 0.f;
  for (int64_t j = threadIdx.x; j < kp; j += kSoftmaxThreads)
    out[j] = __float2bfloat16_rn(j < count ? expf(row[j] * p.sm_scale - m) * inv : 0.f);
  if (p.lse != nullptr && threadIdx.x == 0)
    p.lse[int64_t{q} * p.heads + h] = count > 0 ? m + logf(l) : -INFINITY;
}

struct Layout {
  int64_t kp;
  size_t keys, q, s, prob;  // bytes per query, each 256-byte aligned
};
Layout LayoutFor(int heads, int latent, int rope, int64_t max_keys) {
  auto up = [](size_t b) { return (b + 255) / 256 * 256; };
  Layout l;
  l.kp = MlaGemmPaddedKeys(max_keys);
  const size_t D = size_t(latent) + rope;
  l.keys = up(size_t(l.kp) * D * 2);
  l.q = up(size_t(heads) * D * 2);
  l.s = up(size_t(heads) * l.kp * 4);
  l.prob = up(size_t(heads) * l.kp * 2);
  return l;
}

std::atomic<int64_t> g_launches{0};

}  // namespace

int64_t MlaGemmLaunches() { return g_launches.load(); }

int64_t MlaGemmPaddedKeys(int64_t max_keys) {
  return (std::max<int64_t>(max_keys, 1) + 63) / 64 * 64;
}

size_t MlaGemmQueryBytes(int heads, int latent, int rope, int64_t max_keys) {
  const Layout l = LayoutFor(heads, latent, rope, max_keys);
  return l.keys + l.q + l.s + l.prob;
}

int MlaGemmWaveQueries(int n, int heads, int latent, int rope, int64_t max_keys) {
  const int64_t fit =
      kMlaGemmScratchBytes / int64_t(MlaGemmQueryBytes(heads, latent, rope, max_keys));
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(fit, std::max(n, 1))));
}

cudaError_t LaunchMlaGemm(const MlaGemmParams& g, const CublasApi& blas, cublasHandle_t handle,
                          cudaStream_t s, std::string* why) {
  const MlaParams& p = g.mla;
  if (p.n <= 0) return cudaSuccess;
  if (p.soft_cap != 0 || g.max_keys < 1 || p.heads < 1) return cudaErrorInvalidValue;
  const int H = p.heads, L = p.latent, R = p.rope, D = L + R;
  const Layout l = LayoutFor(H, L, R, g.max_keys);
  const int wave = MlaGemmWaveQueries(p.n, H, L, R, g.max_keys);
  uint8_t* base = static_cast<uint8_t*>(g.scratch);
  Bf16* keys = reinterpret_cast<Bf16*>(base);
  Bf16* q = reinterpret_cast<Bf16*>(base + wave * l.keys);
  float* sc = reinterpret_cast<float*>(base + wave * (l.keys + l.q));
  Bf16* prob = reinterpret_cast<Bf16*>(base + wave * (l.keys + l.q + l.s));
  const float one = 1, zero = 0;
  for (int first = 0; first < p.n; first += wave) {
    const int nq = std::min(wave, p.n - first);
    const int64_t qcount = int64_t{nq} * H * D;
    PackQueryKernel<<<static_cast<unsigned>(std::min<int64_t>((qcount + 255) / 256, 65535)), 256, 0,
                      s>>>(p, first, qcount, q);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    e = Dispatch(p.kv.dtype, [&](auto t) {
      GatherKeysKernel<decltype(t)::value>
          <<<dim3(nq, static_cast<unsigned>(l.kp / 32)), 256, 0, s>>>(p, first, l.kp, g.max_keys,
                                                                      keys);
      return cudaGetLastError();
    });
    if (e != cudaSuccess) return e;
    // S^T per query, column-major [Kp x H]: keys^T (op T of [D x Kp]) times q ([D x H]).
    cublasStatus_t st = blas.gemm_strided_batched(
        handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(l.kp), H, D, &one, keys, CUDA_R_16BF, D,
        static_cast<long long>(l.keys / 2), q, CUDA_R_16BF, D, static_cast<long long>(l.q / 2),
        &zero, sc, CUDA_R_32F, static_cast<int>(l.kp), static_cast<long long>(l.s / 4), nq,
        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) {
      if (why) *why = std::string("cuBLAS Q K^T: ") + blas.status_string(st);
      return cudaErrorUnknown;
    }
    SoftmaxKernel<<<nq * H, kSoftmaxThreads, 0, s>>>(p, first, l.kp, g.max_keys, sc, prob);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    // O per query, column-major [L x H]: the keys' latent part ([L x Kp], lda D) times P^T
    // ([Kp x H]), into the fp32 output rows.
    st = blas.gemm_strided_batched(
        handle, CUBLAS_OP_N, CUBLAS_OP_N, L, H, static_cast<int>(l.kp), &one, keys, CUDA_R_16BF, D,
        static_cast<long long>(l.keys / 2), prob, CUDA_R_16BF, static_cast<int>(l.kp),
        static_cast<long long>(l.prob / 2), &zero, p.out + int64_t{first} * H * L, CUDA_R_32F, L,
        static_cast<long long>(H) * L, nq, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) {
      if (why) *why = std::string("cuBLAS P V: ") + blas.status_string(st);
      return cudaErrorUnknown;
    }
  }
  g_launches.fetch_add(1);
  return cudaSuccess;
}

}  // namespace attnd::cuda
