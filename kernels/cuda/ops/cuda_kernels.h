// Launchers of the CUDA backend's kernels. Plain C++ parameter structs, one comment per field
// ([shape] in brackets); the .cu files hold the __global__ code, by operation (kernels/cuda/
// convert, cache_write, indexer, selection and mla.cu). Launchers return the launch error and
// never synchronise. Caches are CacheRows addressed by global slot id and sequences' pages a
// PageTable (kv_store/page_table.h, the structs the CPU backend uses); element types are DType,
// dispatched once per launch to a templated kernel.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "kernels/cuda/backend/span_chunks.h"
#include "kernels/cuda/ops/topk_block.h"
#include "kv_store/page_table.h"

namespace attnd::cuda {

// Whether the kernels have code for the current GPU (cudaErrorNoKernelImageForDevice if not).
cudaError_t ProbeKernels();

// dst[i] = float(src[i]) for `count` elements of dtype. FP8_E4M3 (queries) takes `scales`: one
// fp32 scale per `per_scale` consecutive values, dst[i] = e4m3(src[i]) x scales[i / per_scale]
// (one fp32 multiply, as kernels/fp8_rows.h's QueryRowToF32 does it on the host).
cudaError_t LaunchToF32(const void* src, DType dtype, float* dst, int64_t count, cudaStream_t s,
                        const float* scales = nullptr, int64_t per_scale = 0);
// dst[i] = dtype(src[i]) (round to nearest even).
cudaError_t LaunchFromF32(const float* src, DType dtype, void* dst, int64_t count, cudaStream_t s);

// Server-side absorption's per-head products (fp32): out[t, h, j] = sum_k in[t, h, k] w[h, k, j]
// for t < n, h < heads, j < cols. W_UK [heads, Dn, L] turns q_nope into q_latent, W_UV^T
// [heads, L, V] the latent output into the values.
struct HeadProjectParams {
  const float* in = nullptr;  // [n, heads, k]
  const float* w = nullptr;   // [heads, k, cols]
  float* out = nullptr;       // [n, heads, cols]
  int n = 0, heads = 0, k = 0, cols = 0;
};
cudaError_t LaunchHeadProject(const HeadProjectParams& p, cudaStream_t s);

// Fills `count` bf16 values with N(0,1) from a counter-based hash of (seed, index): test and
// benchmark data without a host round trip.
cudaError_t LaunchFillNormalBf16(void* dst, int64_t count, uint64_t seed, cudaStream_t s);

struct WriteRowsParams {
  const void* src = nullptr;  // [n, dim] new rows in src_dtype (BF16, FP16 or FP32)
  DType src_dtype = DType::kF32;
  int n = 0, dim = 0;
  CacheRows cache;                // the layer's rows (cache dtype)
  int col_offset = 0;             // first column written inside the cache row
  const int32_t* slot = nullptr;  // [n] slot of each row
};
// Not for fp8 caches (cudaErrorInvalidValue): their rows are packed on the host and scattered.
cudaError_t LaunchWriteRows(const WriteRowsParams& p, cudaStream_t s);

// fp8 caches: n rows packed on the host (kernels/fp8_rows.h) to their slots. A latent row is the
// cache row (src_row_bytes = its row bytes); an indexer row is its Di values then its 4-byte
// scale, which goes apart (CacheRows::Scales).
struct ScatterRowsParams {
  const uint8_t* src = nullptr;  // [n, src_row_bytes] on the device
  int n = 0;
  size_t src_row_bytes = 0;
  CacheRows cache;
  const int32_t* slot = nullptr;  // [n]
};
cudaError_t LaunchScatterRows(const ScatterRowsParams& p, cudaStream_t s);

// table[i].bytes from table[i].src to table[i].dst, for i < count (device addresses; spans do
// not overlap). One launch for a page move's thousands of spans.
cudaError_t LaunchCopySpans(const SpanCopy* table, int64_t count, cudaStream_t s);

// I[s] = Σ_h w[h] relu(q[h]·k[s]) for s in [0, pos+1) of each listed query.
struct IndexerParams {
  const float* q = nullptr;  // [n, Hi, Di]
  const float* w = nullptr;  // [n, Hi]
  int heads = 0, dim = 0;
  CacheRows keys;
  QueryTables tables;
  const int32_t* queries = nullptr;       // [nq] local query index
  const int64_t* score_offset = nullptr;  // [nq] where the query's scores start
  int nq = 0;
  int64_t max_keys = 0;
  // The queries whose partials part_out and part_ml hold (MlaPartialQueries): a larger step
  // runs in waves of that many.
  int part_queries = 0;
  int first_query = 0;      // LaunchMla's: the wave's first query     // longest row (grid size)
  float* scores = nullptr;  // [sum of pos+1]
  // Use a bf16 tensor-core kernel (mma.sync m16n8k16). It rounds q to bf16, so it is meant for
  // bf16-precision requests (bf16 or fp8 index_q). The streaming kernel takes bf16 and fp8 keys
  // at 32, 64 or 128 heads and dims up to 128 (IndexerUsesStream); the tile-per-block one bf16
  // keys with heads % 16 == 0, dim % 16 == 0 and 16-byte aligned rows; otherwise the SIMT
  // kernel runs.
  bool tensor_cores = false;
};
cudaError_t LaunchIndexerScores(const IndexerParams& p, cudaStream_t s);
// Whether LaunchIndexerScores would take a tensor-core kernel for `p`, and whether the streaming
// one (kernels/cuda/ops/indexer_stream.h: 32, 64 or 128 heads, dims up to 128, bf16 or fp8 keys).
bool IndexerUsesTensorCores(const IndexerParams& p);
bool IndexerUsesStream(const IndexerParams& p);

// Exact top-k per row, ties to the lower index, NaN lowest; output ascending indices. A row of
// more than max(8k, 8192) keys runs on several blocks (kernels/cuda/ops/topk_block.h): each slice's
// own top-k into candidate scratch, then a merge.
struct TopKParams {
  TopKRows rows;  // the rows, k, where the selection goes, the slices' candidates (topk_block.h)
  int nq = 0;
  int64_t max_len = 0;  // the longest row (the grid's slices)
};
cudaError_t LaunchTopK(const TopKParams& p, cudaStream_t s);

// Page keys of rows of token scores: page p of query q's row gets page_keys[page_offset[q] + p].
struct PageKeyRows {
  const float* scores = nullptr;
  const int64_t* row_offset = nullptr;   // [nq] token scores
  const int64_t* page_offset = nullptr;  // [nq] where the row's page keys go
  int nq = 0;
  int page_size = 0;
  uint32_t* page_keys = nullptr;

  // The rows from query q0, at most n of them.
  PageKeyRows From(int q0, int n) const {
    PageKeyRows r = *this;
    r.row_offset += q0;
    r.page_offset += q0;
    r.nq = nq - q0 < n ? nq - q0 : n;
    return r;
  }
};

// page_budget: page key = max token key per page of each row (rows of length n -> ceil(n/ps)).
struct PageMaxParams {
  PageKeyRows rows;
  const int64_t* row_len = nullptr;  // [nq] tokens
  int64_t max_pages = 0;
};
cudaError_t LaunchPageMax(const PageMaxParams& p, cudaStream_t s);

// page_union: page key = max key of the selected tokens on it (0 = not hit). page_keys must be
// zeroed first.
struct PageHitParams {
  PageKeyRows rows;
  const int32_t* selected = nullptr;  // [nq, sel_stride] token indices
  const int32_t* selected_count = nullptr;
  int64_t sel_stride = 0;
  int64_t max_sel = 0;
};
cudaError_t LaunchPageHits(const PageHitParams& p, cudaStream_t s);

// Expands ascending page lists to key positions, adding the query's own page (rows <= pos).
struct ExpandParams {
  const int32_t* pages = nullptr;       // [nq, page_stride] ascending
  const int32_t* page_count = nullptr;  // [nq]
  int64_t page_stride = 0;
  const int64_t* row_len = nullptr;  // [nq] visible keys (pos + 1)
  int nq = 0;
  int page_size = 0;
  int32_t* out = nullptr;  // [rows, out_stride]
  int64_t out_stride = 0;
  int32_t* out_count = nullptr;      // [rows]
  const int32_t* out_row = nullptr;  // [nq] output row of each query; null = the query index
};
cudaError_t LaunchExpandPages(const ExpandParams& p, cudaStream_t s);

// Selected key positions to slot ids: slots[r][i] = table slot of positions[r][i] for the
// out_count[r] entries of each row r (a query's sequence and the table come from `tables`).
struct SlotsParams {
  const int32_t* positions = nullptr;  // [n, stride]
  const int32_t* count = nullptr;      // [n]
  int64_t stride = 0;
  int n = 0;
  QueryTables tables;
  int32_t* slots = nullptr;  // [n, stride]
};
cudaError_t LaunchPositionsToSlots(const SlotsParams& p, cudaStream_t s);

// MLA: s = sm_scale·(q·[c_kv | k_pe]) [soft-capped], softmax, out = Σ p·c_kv, per query & head.
struct MlaParams {
  const float* q_latent = nullptr;  // [n, H, L]
  const float* q_rope = nullptr;    // [n, H, R]
  int n = 0, heads = 0, latent = 0, rope = 0;
  float sm_scale = 1, soft_cap = 0;
  CacheRows kv;
  QueryTables tables;
  const int32_t* sel = nullptr;  // [n, sel_stride] selected slot ids, or null: the range below
  const int32_t* sel_count = nullptr;
  const uint8_t* needs_index = nullptr;  // [n] 0 = attend the range [begin, pos] instead of sel
  int64_t sel_stride = 0;
  int window = 0;        // range mode: keys in (pos - window, pos]; 0 = all
  float* out = nullptr;  // [n, H, L]
  float* lse = nullptr;  // optional [n, H]: m + ln(l) per query head, -inf where no key was seen
  // Use the bf16 tensor-core kernel (mma.sync m16n8k16). It rounds q and the probabilities to
  // bf16, so it is meant for bf16-precision requests (bf16 or fp8 queries, absorbed or not); it
  // needs a bf16 cache or an fp8 one whose rows load in 16-byte chunks
  // (Fp8LatentRowsTakeChunks: DeepSeek-V3.2's 656-byte rows do), heads % 16 == 0,
  // latent % 64 == 0 and <= 512, (latent + rope) % 16 == 0 and 16-byte aligned cache rows
  // (base and row bytes); otherwise the SIMT kernel runs.
  bool tensor_cores = false;
  // Tensor-core kernel only: the most keys any query attends (a bound: position + 1 will do).
  // Each query splits its keys by its own count (mla_split.h), so its bits do not depend on the
  // batch; the grid takes S = MlaQuerySplits(max_keys) blocks per query, and S > 1 needs part_out
  // [S, part_queries, H, L] and part_ml [S, part_queries, H, 2] fp32 scratch. 0 is refused
  // (cudaErrorInvalidValue).
  int64_t max_keys = 0;
  // The queries whose partials part_out and part_ml hold (MlaPartialQueries): a larger step
  // runs in waves of that many.
  int part_queries = 0;
  int first_query = 0;  // LaunchMla's: the wave's first query
  float* part_out = nullptr;
  float* part_ml = nullptr;
  // Tensor-core kernel only: take the pipelined kernel where it can (MlaUsesPipeline); false
  // keeps the tile-per-block one (the benchmark compares them).
  bool pipeline = true;
  // Pipelined kernel only: take its wgmma form (kernels/cuda/experimental/mla_wgmma.h) where
  // MlaUsesWgmma says it can (compute capability 9.0, the sm_90a image). Off unless asked for
  // (ATTND_CUDA_MLA=wgmma, WgmmaMla()) until a GPU run has checked and timed it.
  bool wgmma = false;
  // wgmma form only: its warp-specialised variant (kernels/cuda/experimental/mla_wgmma_ws.h: a
  // producer warpgroup gathers, handing tiles over by mbarriers). Off unless asked for
  // (ATTND_CUDA_MLA=wgmma-ws, WgmmaWsMla()) until a GPU run has checked and timed it.
  bool wgmma_ws = false;
  // Tensor-core kernel only: heads per block, 16 or 64 (keys are read once per block, so 64
  // reads them 4x less at 128 heads); 0 = 64 when heads % 64 == 0 and the GPU has the shared
  // memory (H100/H200: 172 KB at D = 576), else 16.
  int heads_per_block = 0;
};
cudaError_t LaunchMla(const MlaParams& p, cudaStream_t s);
// The heads per block the tensor-core MLA takes for `p` on the current GPU (16 or 64).
int MlaHeadsPerBlock(const MlaParams& p);
// Whether LaunchMla would take a tensor-core kernel for `p`, and whether the pipelined one
// (kernels/cuda/ops/mla_pipe.h: 64 heads a block, key rows through a cp.async ring; heads % 64 ==
// 0, unless heads_per_block is 16, and its shared memory fits the GPU).
bool MlaUsesTensorCores(const MlaParams& p);
bool MlaUsesPipeline(const MlaParams& p);
// Whether the pipelined kernel would take its wgmma form (p.wgmma, a compute capability 9.0 GPU,
// its shared memory fits, MlaWgmmaSelfCheck has passed), and how many times LaunchMla has
// launched it in this process.
bool MlaUsesWgmma(const MlaParams& p);
int64_t MlaWgmmaLaunches();
// How many times LaunchMla has launched the wgmma form's warp-specialised variant (p.wgmma_ws
// where MlaUsesWgmma holds).
int64_t MlaWgmmaWsLaunches();
// Whether this build has the sm_90a image the wgmma MLA needs (CMakeLists.txt).
bool MlaWgmmaBuilt();
// On the current GPU, if it is compute capability 9.0 and the build has sm_90a: one warpgroup
// runs wgmma_probe.h (wgmma as the wgmma MLA issues it, the body the CPU simulation checks)
// against float64, once per process (then the verdict is remembered), and prints its verdict to
// stderr. Until it has passed the wgmma MLA never launches. Run it outside steps (a CUDA device
// does at creation under ATTND_CUDA_MLA=wgmma): it allocates and synchronises. A probe that
// faults leaves the context unusable; the caller's next CUDA call reports it.
bool MlaWgmmaSelfCheck();

}  // namespace attnd::cuda
