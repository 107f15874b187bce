// The sparse MLA on FlashInfer's Hopper MLA kernel, and attnd's two small kernels around it:
// the key lists (slot ids per query) and the merge of chunk partials. Built for sm_90a only
// (CMakeLists.txt: the attnd_cuda_flashinfer library); FlashInfer's headers come from its wheel
// (scripts/fetch-gpu-libs.sh), never from the tree.
#include <cuda_bf16.h>

#include <atomic>
#include <flashinfer/attention/mla_hopper.cuh>

#include "kernels/cuda/ops/cuda_common.cuh"
#include "kernels/cuda/ops/mla_flashinfer.h"
#include "kernels/cuda/ops/mla_flashinfer_pack.cuh"
#include "kernels/cuda/ops/mla_flashinfer_plan.h"

namespace attnd::cuda {
namespace {

using Bf16 = __nv_bfloat16;

__global__ void MlaKeyListKernel(MlaKeyListParams p) {
  const int g = blockIdx.x;
  const int q = p.query[g];
  const int32_t count = p.count[g];
  int32_t* out = p.out + p.start[g];
  if (p.is_range[g]) {
    for (int j = threadIdx.x; j < count; j += blockDim.x)
      out[j] = static_cast<int32_t>(SlotOf(p.tables, q, j));
  } else {
    const int32_t* sel = p.sel + q * p.sel_stride;
    for (int j = threadIdx.x; j < count; j += blockDim.x) out[j] = sel[j];
  }
}

// One block per (query, head) of the wave: its chunks' partials (each normalised over its own
// keys, with its log2-sum-exp) combined in chunk order, in fp32.
constexpr int kMergeThreads = 128;
constexpr int kMergePerThread = kFlashInferMlaLatent / kMergeThreads;

__global__ void __launch_bounds__(kMergeThreads)
    MlaMergeChunksKernel(FlashInferMlaWaveArgs w, const Bf16* partial_o, const float* partial_lse,
                         int heads, float* out, float* lse) {
  const int local = blockIdx.x / heads, h = blockIdx.x % heads;
  const int q = w.first_query + local;
  const int chunks = w.merge_chunks[local];
  const int64_t row0 = int64_t{w.merge_row[local]} + h;
  float m = -INFINITY;
  for (int c = 0; c < chunks; ++c) m = fmaxf(m, partial_lse[row0 + int64_t{c} * w.rows_per_chunk]);
  float acc[kMergePerThread] = {};
  float sum = 0;
  for (int c = 0; c < chunks; ++c) {
    const int64_t row = row0 + int64_t{c} * w.rows_per_chunk;
    const float l = partial_lse[row];
    if (l == -INFINITY) continue;  // a chunk that saw no key adds nothing
    const float wgt = exp2f(l - m);
    sum += wgt;
    const Bf16* o = partial_o + row * kFlashInferMlaLatent;
#pragma unroll
    for (int i = 0; i < kMergePerThread; ++i)
      acc[i] += wgt * __bfloat162float(o[threadIdx.x + i * kMergeThreads]);
  }
  float* dst = out + (int64_t{q} * heads + h) * kFlashInferMlaLatent;
  const float inv = sum > 0 ? 1.f / sum : 0.f;
#pragma unroll
  for (int i = 0; i < kMergePerThread; ++i) dst[threadIdx.x + i * kMergeThreads] = acc[i] * inv;
  if (lse != nullptr && threadIdx.x == 0)
    lse[int64_t{q} * heads + h] = sum > 0 ? (m + log2f(sum)) * 0.69314718055994530942f : -INFINITY;
}

std::atomic<int64_t> g_launches{0};

}  // namespace

bool FlashInferMlaBuilt() { return true; }
int64_t FlashInferMlaLaunches() { return g_launches.load(); }

cudaError_t LaunchMlaKeyList(const MlaKeyListParams& p, cudaStream_t s) {
  if (p.segments <= 0) return cudaSuccess;
  MlaKeyListKernel<<<p.segments, 256, 0, s>>>(p);
  return cudaGetLastError();
}

cudaError_t PackFlashInferMla(const FlashInferMlaParams& p, FlashInferMlaKernelParams* out) {
  const FlashInferMlaWaveArgs& w = p.wave;
  const FlashInferMlaLayout l =
      FlashInferMlaLayoutFor(p.kv.dtype, p.kv.row_bytes, reinterpret_cast<uintptr_t>(p.kv.base),
                             kFlashInferMlaLatent, kFlashInferMlaRope, p.heads);
  if (!l.refused.empty() || p.kv.scales_apart != 0) return cudaErrorInvalidValue;
  auto ids = [](const int32_t* v) { return const_cast<int32_t*>(v); };
  FlashInferMlaKernelParams& f = *out;
  f = FlashInferMlaKernelParams{};
  f.q_nope = static_cast<Bf16*>(const_cast<void*>(p.q_nope));
  f.q_pe = static_cast<Bf16*>(const_cast<void*>(p.q_pe));
  f.ckv = reinterpret_cast<Bf16*>(const_cast<uint8_t*>(p.kv.base));
  f.kpe = reinterpret_cast<Bf16*>(const_cast<uint8_t*>(p.kv.base) + l.kpe_offset_bytes);
  f.partial_o = static_cast<Bf16*>(p.partial_o);
  f.partial_lse = p.partial_lse;
  f.final_o = static_cast<Bf16*>(p.partial_o);  // never written: every item writes a partial
  f.final_lse = nullptr;
  f.q_indptr = ids(w.q_indptr);
  f.kv_indptr = ids(w.kv_indptr);
  f.partial_indptr = ids(w.partial_indptr);
  f.merge_packed_offset_start = ids(w.zeros);  // FlashInfer's in-kernel merge: nothing to do
  f.merge_packed_offset_end = ids(w.zeros);
  f.merge_partial_packed_offset_start = ids(w.zeros);
  f.merge_partial_packed_offset_end = ids(w.zeros);
  f.merge_partial_stride = ids(w.zeros);
  f.kv_indices = ids(p.key_list);
  f.q_len = ids(w.q_len);
  f.kv_len = ids(w.kv_len);
  f.q_start = ids(w.q_start);
  f.kv_start = ids(w.kv_start);
  f.kv_end = ids(w.kv_end);
  f.work_indptr = ids(w.work_indptr);
  f.block_size = flashinfer::uint_fastdiv(1);
  f.num_heads = flashinfer::uint_fastdiv(static_cast<uint32_t>(p.heads));
  f.q_nope_stride_n = l.q_nope_stride_n;
  f.q_nope_stride_h = l.q_nope_stride_h;
  f.q_pe_stride_n = l.q_pe_stride_n;
  f.q_pe_stride_h = l.q_pe_stride_h;
  f.ckv_stride_page = l.ckv_stride_page;
  f.ckv_stride_n = l.ckv_stride_page;  // page size 1: never stepped
  f.kpe_stride_page = l.kpe_stride_page;
  f.kpe_stride_n = l.kpe_stride_page;
  f.o_stride_n = static_cast<uint32_t>(p.heads * kFlashInferMlaLatent);
  f.o_stride_h = kFlashInferMlaLatent;
  f.sm_scale = p.sm_scale;
  f.return_lse_base_on_e = false;  // the partials stay log2; the merge converts
  return cudaSuccess;
}

cudaError_t LaunchFlashInferMla(const FlashInferMlaParams& p, cudaStream_t s) {
  const FlashInferMlaWaveArgs& w = p.wave;
  if (w.queries <= 0) return cudaSuccess;
  FlashInferMlaKernelParams f;
  if (const cudaError_t e = PackFlashInferMla(p, &f); e != cudaSuccess) return e;
  cudaError_t e =
      flashinfer::mla::BatchMLAPageAttentionHopper<flashinfer::MaskMode::kNone,
                                                   kFlashInferMlaLatent, kFlashInferMlaRope>(
          f, static_cast<uint32_t>(w.blocks_x), static_cast<uint32_t>(w.blocks_y), s);
  if (e != cudaSuccess) return e;
  g_launches.fetch_add(1);
  MlaMergeChunksKernel<<<w.queries * p.heads, kMergeThreads, 0, s>>>(
      w, static_cast<const Bf16*>(p.partial_o), p.partial_lse, p.heads, p.out, p.lse);
  return cudaGetLastError();
}

}  // namespace attnd::cuda
