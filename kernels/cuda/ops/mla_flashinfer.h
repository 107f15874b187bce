// The sparse MLA on FlashInfer's Hopper MLA kernel (sm_90a; kernels/cuda/ops/mla_flashinfer.cu):
// the selected slots are a page table of page size 1 over attnd's cache rows (the latent and RoPE
// parts as FlashInfer's ckv and kpe, with the row as their stride), attnd's own work partition
// (mla_flashinfer_plan.h) and attnd's merge of the chunk partials into fp32 outputs and
// natural-log log-sum-exps. Plain C++ (no FlashInfer header): the CUDA backend includes it.
//
// It is opt-in (ATTND_CUDA_MLA=flashinfer) until a GPU run has checked and timed it
// (docs/architecture.md, "Kernels from libraries").
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/ops/cuda_kernels.h"
#include "kernels/cuda/ops/mla_flashinfer_plan.h"

namespace attnd::cuda {

// Whether this build holds the FlashInfer MLA (an sm_90a image and FlashInfer's headers).
bool FlashInferMlaBuilt();

// The step's key lists as slot ids, one segment a block: a selecting query's kept selection
// (its row of sel) or a sequence's slots from position 0, which its range queries share.
struct MlaKeyListParams {
  const int32_t* sel = nullptr;  // [n, sel_stride] selected slot ids
  int64_t sel_stride = 0;
  QueryTables tables;                 // a range segment's sequence: tables.seq[its query]
  const int64_t* start = nullptr;     // [segments] where the segment goes in `out`
  const int32_t* count = nullptr;     // [segments] its entries
  const int32_t* query = nullptr;     // [segments] the query it is for (range: any of its seq)
  const uint8_t* is_range = nullptr;  // [segments] 1: positions [0, count) of the sequence
  int segments = 0;
  int32_t* out = nullptr;  // the lists (FlashInferMlaPlanInput::list_entries)
};
cudaError_t LaunchMlaKeyList(const MlaKeyListParams& p, cudaStream_t s);

// One wave of the plan (FlashInferMlaWave), its arrays on the device.
struct FlashInferMlaWaveArgs {
  const int32_t *q_indptr = nullptr, *kv_indptr = nullptr, *partial_indptr = nullptr,
                *q_len = nullptr, *kv_len = nullptr, *q_start = nullptr, *kv_start = nullptr,
                *kv_end = nullptr, *work_indptr = nullptr;
  const int32_t* merge_row = nullptr;     // [queries]
  const int32_t* merge_chunks = nullptr;  // [queries]
  const int32_t* zeros = nullptr;         // [blocks_x * blocks_y]: FlashInfer's own merge: none
  int first_query = 0, queries = 0, blocks_x = 1, blocks_y = 1, rows_per_chunk = 0;
};

// A wave's arguments: `place(v)` puts each of the wave's arrays on the device and returns where
// (called in one fixed order, so a caller may record in one call and look up in the next; with
// a mutable wave it may take the array); `zeros`: blocks_x * blocks_y int32 zeros on the device.
template <typename Wave, typename Place>
FlashInferMlaWaveArgs FlashInferWaveArgs(Wave& w, const int32_t* zeros, Place&& place) {
  FlashInferMlaWaveArgs a;
  a.q_indptr = place(w.q_indptr);
  a.kv_indptr = place(w.kv_indptr);
  a.partial_indptr = place(w.partial_indptr);
  a.q_len = place(w.q_len);
  a.kv_len = place(w.kv_len);
  a.q_start = place(w.q_start);
  a.kv_start = place(w.kv_start);
  a.kv_end = place(w.kv_end);
  a.work_indptr = place(w.work_indptr);
  a.merge_row = place(w.merge_row);
  a.merge_chunks = place(w.merge_chunks);
  a.zeros = zeros;
  a.first_query = w.first_query;
  a.queries = w.queries;
  a.blocks_x = w.blocks_x;
  a.blocks_y = w.blocks_y;
  a.rows_per_chunk = w.rows_per_chunk;
  return a;
}

struct FlashInferMlaParams {
  const void* q_nope = nullptr;  // [n, H, 512] bf16
  const void* q_pe = nullptr;    // [n, H, 64] bf16
  CacheRows kv;                  // bf16 rows of 512 latent then 64 RoPE values
  int heads = 0;
  float sm_scale = 1;
  const int32_t* key_list = nullptr;  // the step's key lists, slot ids (MlaKeyListParams::out)
  FlashInferMlaWaveArgs wave;
  void* partial_o = nullptr;     // [wave.partial rows, 512] bf16 scratch
  float* partial_lse = nullptr;  // [wave.partial rows] fp32 scratch (log2)
  float* out = nullptr;          // [n, H, 512] fp32: the wave's queries' rows
  float* lse = nullptr;          // optional [n, H] natural log, as LaunchMla's
};
// The wave's chunks on FlashInfer's kernel (a cooperative launch), then attnd's merge of each
// query's chunks in order. cudaErrorNotSupported where the build has no FlashInfer MLA.
cudaError_t LaunchFlashInferMla(const FlashInferMlaParams& p, cudaStream_t s);
// How many waves LaunchFlashInferMla has launched in this process (tests: the form ran).
int64_t FlashInferMlaLaunches();

}  // namespace attnd::cuda
