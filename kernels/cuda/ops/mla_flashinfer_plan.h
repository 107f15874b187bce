// The work partition of the sparse MLA on FlashInfer's Hopper MLA kernel
// (kernels/cuda/ops/mla_flashinfer.cu), built by attnd on the host, once per step, and reused by
// every sparse layer of the step (plan once, run per layer).
//
// FlashInfer's kernel is persistent: blocks_y groups of blocks_x blocks each walk a list of work
// items; an item is one query's tile of packed (token, head) rows against one chunk of that
// query's keys, and writes a partial output (bf16) and a partial log2-sum-exp per row. attnd
// merges the partials itself (LaunchMlaMergeChunks) in chunk order, so a query's bits depend only
// on its own keys: its chunks are cut by its own key count (mla_split.h's rule, the one the
// hand-written tensor-core kernel uses), never by the batch or the grid, and which block runs an
// item changes nothing. FlashInfer's own planner sizes chunks by the batch's total work instead;
// attnd does not use it.
//
// Plain C++: tested without a GPU (tests/unit/mla_flashinfer_plan_test.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"

namespace attnd::cuda {

// FlashInfer's Hopper MLA tile: 64 packed query rows per block, 64 keys per tile.
inline constexpr int kFlashInferMlaTileRows = 64;
inline constexpr int kFlashInferMlaTileKeys = 64;
// The latent and RoPE widths its kernel is instantiated for (DeepSeek-V3.2, GLM-5).
inline constexpr int kFlashInferMlaLatent = 512;
inline constexpr int kFlashInferMlaRope = 64;
// Partials one wave may hold ([rows, latent] bf16 + [rows] fp32): a larger step runs in waves.
inline constexpr int64_t kFlashInferMlaPartialBytes = int64_t{256} << 20;

// One launch's work: the arrays FlashInfer's MLAParams points at, as attnd fills them.
struct FlashInferMlaWave {
  int first_query = 0, queries = 0;  // the wave's queries [first_query, first_query + queries)
  int blocks_x = 1, blocks_y = 1;    // the grid (a cooperative launch: all resident at once)
  int64_t partial_rows = 0;          // rows of partial output the wave writes
  // Per work item (FlashInfer's names). q_indptr: the query (global index; q_len 1); kv_indptr:
  // the first entry of its key list (list_start, page size 1); kv_len: its key count;
  // q_start: the tile's first packed row; kv_start, kv_end: the chunk; partial_indptr: the first
  // partial row the item writes.
  std::vector<int32_t> q_indptr, kv_indptr, partial_indptr, q_len, kv_len, q_start, kv_start,
      kv_end;
  std::vector<int32_t> work_indptr;  // [blocks_y + 1] each block group's items
  // The merge of the wave's queries (local index i): head h's partial of chunk c is row
  // merge_row[i] + c * rows_per_chunk + h, for c < merge_chunks[i].
  std::vector<int32_t> merge_row, merge_chunks;
  int rows_per_chunk = 0;
};

struct FlashInferMlaPlan {
  std::vector<FlashInferMlaWave> waves;
  int64_t max_partial_rows = 0;  // the largest wave's (scratch to reserve)
};

// What the plan is built from: each query's exact key count (>= 1) and where its key list starts
// in the step's key lists (a selecting query has a row of its own; the range queries of a
// sequence share its list, each reading a prefix of it), the heads and the GPU's multiprocessor
// count.
struct FlashInferMlaPlanInput {
  std::vector<int64_t> keys;        // [n]
  std::vector<int64_t> list_start;  // [n] entries before the query's first key
  int64_t list_entries = 0;         // the key lists' size: every list_start + keys within it
  int heads = 0;
  int multiprocessors = 0;
  int64_t partial_bytes = kFlashInferMlaPartialBytes;
};

// The plan, or an empty string error when the input is out of the kernel's range (the caller
// then keeps the hand-written kernels): every count is checked, and every index FlashInfer
// computes in 32 bits (rows x latent, list entries) is shown to fit.
struct FlashInferMlaPlanResult {
  FlashInferMlaPlan plan;
  std::string refused;  // empty when planned
};
FlashInferMlaPlanResult PlanFlashInferMla(const FlashInferMlaPlanInput& in);

// The keys per chunk for a query of `keys` keys (a multiple of kFlashInferMlaTileKeys) and its
// chunk count: mla_split.h's rule.
int64_t FlashInferMlaChunkKeys(int64_t keys);
int FlashInferMlaChunks(int64_t keys);

// How FlashInfer reads attnd's rows (page size 1: a key's page is its slot): element strides of
// the latent and RoPE parts of a cache row and of the queries, or why they do not fit (the
// kernel loads 16-byte pieces, in 32-bit element offsets).
struct FlashInferMlaLayout {
  uint32_t ckv_stride_page = 0, kpe_stride_page = 0;  // elements between consecutive slots
  size_t kpe_offset_bytes = 0;                        // RoPE part's offset inside a row
  uint32_t q_nope_stride_n = 0, q_nope_stride_h = 0;  // [n, H, L] bf16
  uint32_t q_pe_stride_n = 0, q_pe_stride_h = 0;      // [n, H, R] bf16
  std::string refused;
};
FlashInferMlaLayout FlashInferMlaLayoutFor(DType cache_dtype, size_t row_bytes, uintptr_t base,
                                           int latent, int rope, int heads);

}  // namespace attnd::cuda
