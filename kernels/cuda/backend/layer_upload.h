// What one layer call moves between the host and a GPU, as one packed buffer: the share's rows of
// every tensor the call uses (LayerNeeds), gathered once from the request's bytes into pinned
// memory and uploaded in two copies (the key rows and indexer inputs first, so the key writes
// and the indexer can start while the queries are still on their way), then the output and its
// log-sum-exp, computed into the same buffer on the GPU and downloaded in one copy. Plain C++:
// the planner, the gather and the scatter are tested on machines without a GPU
// (tests/unit/layer_upload_test.cc); kernels/cuda/backend/cuda_layer.cc moves the bytes.
//
// Buffer: [key part: kv_latent | k_rope | index_k, or the fp8 cache's packed latent and indexer
// rows; index_q (+ fp8 scales) | index_w] [query part: q_latent or q_nope (+ scales) | q_rope
// (+ scales)] [output part: out [n, H, W] in the call's out dtype | lse [n, H] fp32]; every
// section starts on a kUploadAlign boundary.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/model_spec.h"
#include "kernels/device.h"
#include "kv_store/cache_layout.h"

namespace attnd::cuda {

inline constexpr size_t kUploadAlign = 256;

// Bytes [offset, offset + bytes) of the packed buffer; bytes == 0: not in it.
struct UploadSection {
  size_t offset = 0, bytes = 0;
  bool present() const { return bytes > 0; }
};

// One tensor's share rows as the wire sent them: n rows of row_elems values in `dtype`, and for
// FP8_E4M3 queries their fp32 scales (one per token and head: n x heads).
struct UploadTensor {
  UploadSection rows, scales;
  DType dtype = DType::kBF16;
  int64_t row_elems = 0;  // values per token
  int heads = 1;          // scales per token (FP8_E4M3 queries); elements per scale = row/heads
};

struct LayerUpload {
  int64_t n = 0;  // share tokens
  // Key part. Caches other than fp8: the wire rows (written by a converting kernel). fp8 caches:
  // rows quantised on the host as the cache holds them (kernels/fp8_rows.h): latent rows of
  // CacheLayout::latent_row_bytes(), indexer rows of Di e4m3 values and their fp32 scale.
  UploadTensor kv_latent, k_rope, index_k;
  UploadSection latent_rows, index_rows;
  UploadTensor index_q, index_w;
  size_t keys_bytes = 0;  // the key part: [0, keys_bytes)
  // Query part: q_latent, or q_nope when the server absorbs (`absorbed`).
  UploadTensor query, q_rope;
  bool absorbed = false;
  size_t input_bytes = 0;  // both input parts: [0, input_bytes)
  // Output part: [n, heads, width] in out_dtype, then [n, heads] fp32 (when the call wants lse).
  UploadSection out, lse;
  int heads = 0, width = 0;
  DType out_dtype = DType::kBF16;
  size_t total_bytes = 0;  // everything: [0, total_bytes)
  // The output part, downloaded in one copy: [out.offset, total_bytes).
  size_t output_offset() const { return input_bytes; }
  size_t output_bytes() const { return total_bytes - input_bytes; }
};

// The buffer of `call` for a share of `n` tokens: which tensors it carries (from `needs`), where.
// `absorb_v` is the values' width of absorbed calls (call.absorb's v_head_dim).
LayerUpload PlanLayerUpload(const ModelSpec& spec, const CacheLayout& layout, int64_t n,
                            const LayerCall& call, const LayerNeeds& needs);

// Gathers the share's rows of every planned tensor from call.in into `buffer` (total_bytes; only
// the input part is written), quantising key rows for an fp8 cache.
void PackLayerUpload(const LayerUpload& plan, const StepShare& share, const LayerCall& call,
                     const ModelSpec& spec, const CacheLayout& layout, uint8_t* buffer);

// Scatters the output part of `buffer` to the share's rows of call.out (and call.lse).
void UnpackLayerOutput(const LayerUpload& plan, const StepShare& share, const uint8_t* buffer,
                       const LayerCall& call);

// An upper bound of total_bytes over every call a share of `n` tokens can make (any layer kind,
// wire dtype and option; absorbed calls with q_nope of `absorb_dn` values and values of
// `absorb_v` per head, 0 when the server does not absorb): what BeginStep reserves.
size_t MaxLayerUploadBytes(const ModelSpec& spec, const CacheLayout& layout, int64_t n,
                           int absorb_dn, int absorb_v);

// The same bound for a write-only share (an import): its calls carry key rows alone.
size_t MaxImportUploadBytes(const ModelSpec& spec, const CacheLayout& layout, int64_t n);

}  // namespace attnd::cuda
