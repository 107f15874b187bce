// The indexer's top-k on FlashInfer's filtered radix top-k (kernels/cuda/ops/topk_flashinfer.cu,
// sm_80 and sm_90a): its deterministic path with ties to the smaller index is attnd's rule
// (docs/numerics.md: equal scores, the lower position wins), and its output sorted by index is
// attnd's ascending list. attnd keeps its own NaN rule (lowest): NaN scores are rewritten to the
// lowest key FlashInfer's ordering has before it runs. Rows must be padded (row q at
// q * max_len): the step plans its score waves so when this form is on.
//
// Opt-in (ATTND_CUDA_TOPK=flashinfer) until a GPU run has checked and timed it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace attnd::cuda {

// Whether this GPU and k take it: k <= 2048 and the 128 KB of shared memory a block it needs.
bool FlashInferTopKApplies(int64_t k);

struct FlashInferTopKParams {
  float* scores = nullptr;       // [nq, max_len], row q's first len[q] values (NaNs rewritten)
  const int32_t* len = nullptr;  // [nq]
  int nq = 0;
  int64_t max_len = 0;
  int k = 0;
  int32_t* tmp_index = nullptr;  // [nq, k] scratch
  float* tmp_value = nullptr;    // [nq, k] scratch
  int32_t* out = nullptr;        // [rows, out_stride]: ascending positions
  int64_t out_stride = 0;
  int32_t* out_count = nullptr;      // [rows]: min(k, len)
  const int32_t* out_row = nullptr;  // [nq] output row of each query
};
cudaError_t LaunchFlashInferTopK(const FlashInferTopKParams& p, cudaStream_t s);
// How many waves LaunchFlashInferTopK has run in this process (tests: the form ran).
int64_t FlashInferTopKLaunches();

}  // namespace attnd::cuda
