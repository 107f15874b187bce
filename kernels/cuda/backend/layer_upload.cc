#include "kernels/cuda/backend/layer_upload.h"

#include <algorithm>
#include <cstring>

#include "common/fp8.h"
#include "kernels/fp8_rows.h"

namespace attnd::cuda {
namespace {

size_t Align(size_t x) { return (x + kUploadAlign - 1) / kUploadAlign * kUploadAlign; }

// Appends `bytes` to the buffer at *end (aligned).
UploadSection Take(size_t* end, size_t bytes) {
  UploadSection s;
  if (bytes == 0) return s;
  s.offset = Align(*end);
  s.bytes = bytes;
  *end = s.offset + bytes;
  return s;
}

// A wire tensor's share rows (and an FP8_E4M3 query's scales, `heads` per token).
UploadTensor TakeTensor(size_t* end, const TensorView& t, int64_t n, int64_t row_elems, int heads) {
  UploadTensor u;
  u.dtype = t.dtype;
  u.row_elems = row_elems;
  u.heads = heads;
  u.rows = Take(end, static_cast<size_t>(n * row_elems) * DTypeSize(t.dtype));
  if (t.dtype == DType::kFP8E4M3) u.scales = Take(end, static_cast<size_t>(n) * heads * 4);
  return u;
}

// dst[i] = row rows[i] of `src` (row_bytes each), one memcpy per run of consecutive rows.
void Gather(const uint8_t* src, const std::vector<int64_t>& rows, size_t row_bytes, uint8_t* dst) {
  const size_t n = rows.size();
  for (size_t i = 0; i < n;) {
    size_t j = i + 1;
    while (j < n && rows[j] == rows[j - 1] + 1) ++j;
    std::memcpy(dst + i * row_bytes, src + rows[i] * row_bytes, (j - i) * row_bytes);
    i = j;
  }
}

// Row rows[i] of `dst` = src[i] (row_bytes each), one memcpy per run.
void Scatter(const uint8_t* src, const std::vector<int64_t>& rows, size_t row_bytes, uint8_t* dst) {
  const size_t n = rows.size();
  for (size_t i = 0; i < n;) {
    size_t j = i + 1;
    while (j < n && rows[j] == rows[j - 1] + 1) ++j;
    std::memcpy(dst + rows[i] * row_bytes, src + i * row_bytes, (j - i) * row_bytes);
    i = j;
  }
}

void PackTensor(const UploadTensor& u, const TensorView& t, const StepShare& share,
                uint8_t* buffer) {
  if (!u.rows.present()) return;
  Gather(static_cast<const uint8_t*>(t.data), share.rows,
         static_cast<size_t>(u.row_elems) * DTypeSize(u.dtype), buffer + u.rows.offset);
  if (u.scales.present())
    Gather(static_cast<const uint8_t*>(t.scales), share.rows, static_cast<size_t>(u.heads) * 4,
           buffer + u.scales.offset);
}

}  // namespace

LayerUpload PlanLayerUpload(const ModelSpec& spec, const CacheLayout& layout, int64_t n,
                            const LayerCall& call, const LayerNeeds& needs) {
  LayerUpload p;
  p.n = n;
  const LayerInputs& in = *call.in;
  const int H = spec.num_heads, L = spec.kv_lora_rank, R = spec.qk_rope_head_dim;
  const int Hi = spec.index_n_heads, Di = spec.index_head_dim;
  const bool full = spec.layers[call.layer] == LayerKind::kFull;
  size_t end = 0;
  if (needs.keys) {
    if (layout.fp8()) {
      p.latent_rows = Take(&end, static_cast<size_t>(n) * layout.latent_row_bytes());
      if (full) p.index_rows = Take(&end, static_cast<size_t>(n) * (Di + 4));
    } else {
      p.kv_latent = TakeTensor(&end, in.kv_latent, n, L, 1);
      p.k_rope = TakeTensor(&end, in.k_rope, n, R, 1);
      if (full) p.index_k = TakeTensor(&end, in.index_k, n, Di, 1);
    }
  }
  if (needs.indexer) {
    p.index_q = TakeTensor(&end, in.index_q, n, int64_t{Hi} * Di, Hi);
    p.index_w = TakeTensor(&end, in.index_w, n, Hi, 1);
  }
  p.keys_bytes = Align(end);
  end = p.keys_bytes;
  p.heads = H;
  p.width = L;
  p.out_dtype = call.out_dtype;
  if (needs.attend) {
    p.absorbed = call.absorb != nullptr;
    if (p.absorbed) {
      p.query = TakeTensor(&end, in.q_nope, n, int64_t{H} * call.absorb->qk_nope_head_dim(), H);
      p.width = call.absorb->v_head_dim();
    } else {
      p.query = TakeTensor(&end, in.q_latent, n, int64_t{H} * L, H);
    }
    p.q_rope = TakeTensor(&end, in.q_rope, n, int64_t{H} * R, H);
  }
  p.input_bytes = Align(end);
  end = p.input_bytes;
  if (needs.attend) {
    p.out = Take(&end, static_cast<size_t>(n) * H * p.width * DTypeSize(call.out_dtype));
    if (call.lse != nullptr) p.lse = Take(&end, static_cast<size_t>(n) * H * 4);
  }
  p.total_bytes = Align(end);
  return p;
}

void PackLayerUpload(const LayerUpload& plan, const StepShare& share, const LayerCall& call,
                     const ModelSpec& spec, const CacheLayout& layout, uint8_t* buffer) {
  const LayerInputs& in = *call.in;
  if (plan.latent_rows.present()) {
    const int L = spec.kv_lora_rank, R = spec.qk_rope_head_dim;
    const size_t row = layout.latent_row_bytes();
    for (int64_t i = 0; i < plan.n; ++i)
      PackLatentRow(in.kv_latent, in.k_rope, share.rows[i], L, R,
                    buffer + plan.latent_rows.offset + i * row);
  }
  if (plan.index_rows.present()) {
    const int Di = spec.index_head_dim;
    for (int64_t i = 0; i < plan.n; ++i) {
      uint8_t* row = buffer + plan.index_rows.offset + i * (Di + 4);
      QuantizeKeyRow(in.index_k, share.rows[i], Di, Di, row, row + Di);
    }
  }
  PackTensor(plan.kv_latent, in.kv_latent, share, buffer);
  PackTensor(plan.k_rope, in.k_rope, share, buffer);
  PackTensor(plan.index_k, in.index_k, share, buffer);
  PackTensor(plan.index_q, in.index_q, share, buffer);
  PackTensor(plan.index_w, in.index_w, share, buffer);
  PackTensor(plan.query, plan.absorbed ? in.q_nope : in.q_latent, share, buffer);
  PackTensor(plan.q_rope, in.q_rope, share, buffer);
}

void UnpackLayerOutput(const LayerUpload& plan, const StepShare& share, const uint8_t* buffer,
                       const LayerCall& call) {
  if (plan.out.present())
    Scatter(buffer + plan.out.offset, share.rows,
            static_cast<size_t>(plan.heads) * plan.width * DTypeSize(plan.out_dtype), call.out);
  if (plan.lse.present())
    Scatter(buffer + plan.lse.offset, share.rows, static_cast<size_t>(plan.heads) * 4,
            reinterpret_cast<uint8_t*>(call.lse));
}

namespace {
// A token's key rows at the widest wire dtype (4 bytes), fp8 keys packed no wider than that.
size_t KeyUploadBytes(const ModelSpec& spec, const CacheLayout& layout) {
  const size_t L = spec.kv_lora_rank, R = spec.qk_rope_head_dim, Di = spec.index_head_dim;
  return std::max(4 * (L + R + Di), layout.latent_row_bytes() + Di + 4);
}
}  // namespace

size_t MaxLayerUploadBytes(const ModelSpec& spec, const CacheLayout& layout, int64_t n,
                           int absorb_dn, int absorb_v) {
  const size_t H = spec.num_heads, L = spec.kv_lora_rank, R = spec.qk_rope_head_dim;
  const size_t Hi = spec.index_n_heads, Di = spec.index_head_dim;
  const size_t dn = std::max<size_t>(L, absorb_dn), w = std::max<size_t>(L, absorb_v);
  const size_t rows = static_cast<size_t>(std::max<int64_t>(n, 1));
  // The keys, every query tensor at 4 bytes, fp8 queries' scales, the fp32 output and its lse,
  // and a pad per section (at most 12 sections).
  const size_t per_token = KeyUploadBytes(spec, layout) + 4 * (Hi * Di + Hi) + 4 * Hi +
                           4 * H * (dn + R) + 8 * H + 4 * H * w + 4 * H;
  return rows * per_token + 13 * kUploadAlign;
}

size_t MaxImportUploadBytes(const ModelSpec& spec, const CacheLayout& layout, int64_t n) {
  const size_t rows = static_cast<size_t>(std::max<int64_t>(n, 1));
  return rows * KeyUploadBytes(spec, layout) + 13 * kUploadAlign;
}

}  // namespace attnd::cuda
