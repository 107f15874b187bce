#include "engine/layer_check.h"

#include <array>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace attnd {
namespace {

// Every tensor a layer call carries, by name, in the order errors name them.
std::array<std::pair<const char*, const TensorView*>, 7> Named(const LayerInputs& in) {
  return {{{"q_latent", &in.q_latent},
           {"q_rope", &in.q_rope},
           {"kv_latent", &in.kv_latent},
           {"k_rope", &in.k_rope},
           {"index_q", &in.index_q},
           {"index_k", &in.index_k},
           {"index_w", &in.index_w}}};
}

}  // namespace

absl::Status CheckLayerDTypes(const LayerInputs& in) {
  const char* first = nullptr;
  DType dtype = DType::kF32;
  for (const auto& [name, t] : Named(in)) {
    if (!t->present) continue;
    if (first == nullptr) {
      first = name;
      dtype = t->dtype;
    } else if (t->dtype != dtype) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": ", DTypeName(t->dtype), ", but ", first, " is ", DTypeName(dtype),
                       "; every tensor of a layer call has one datatype"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckLayerShapes(const ModelSpec& s, int64_t T, bool write_only, int layer,
                              const LayerInputs& in, size_t out_bytes) {
  RETURN_IF_ERROR(CheckLayerDTypes(in));
  RETURN_IF_ERROR(CheckTensor("kv_latent", in.kv_latent, {T, s.kv_lora_rank}));
  RETURN_IF_ERROR(CheckTensor("k_rope", in.k_rope, {T, s.qk_rope_head_dim}));
  if (write_only) {
    if (s.layers[layer] == LayerKind::kFull) {
      RETURN_IF_ERROR(CheckTensor("index_k", in.index_k, {T, s.index_head_dim}));
    } else if (in.index_k.present) {
      return absl::InvalidArgumentError(
          absl::StrCat("index_k: given for layer ", layer, ", a ", LayerKindName(s.layers[layer]),
                       " layer; indexer tensors belong to full layers only"));
    }
    if (in.q_latent.present || in.q_rope.present || in.index_q.present || in.index_w.present ||
        out_bytes != 0)
      return absl::InvalidArgumentError(
          "write-only step: give only kv_latent, k_rope and (full layers) index_k; no output");
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(CheckTensor("q_latent", in.q_latent, {T, s.num_heads, s.kv_lora_rank}));
  RETURN_IF_ERROR(CheckTensor("q_rope", in.q_rope, {T, s.num_heads, s.qk_rope_head_dim}));
  if (s.layers[layer] == LayerKind::kFull) {
    RETURN_IF_ERROR(CheckTensor("index_q", in.index_q, {T, s.index_n_heads, s.index_head_dim}));
    RETURN_IF_ERROR(CheckTensor("index_k", in.index_k, {T, s.index_head_dim}));
    RETURN_IF_ERROR(CheckTensor("index_w", in.index_w, {T, s.index_n_heads}));
  } else {
    const char* given = in.index_q.present   ? "index_q"
                        : in.index_k.present ? "index_k"
                        : in.index_w.present ? "index_w"
                                             : nullptr;
    if (given)
      return absl::InvalidArgumentError(
          absl::StrCat(given, ": given for layer ", layer, ", a ", LayerKindName(s.layers[layer]),
                       " layer; indexer tensors belong to full layers only"));
  }
  const size_t want =
      static_cast<size_t>(T) * s.num_heads * s.kv_lora_rank * DTypeSize(in.q_latent.dtype);
  if (out_bytes != want)
    return absl::InvalidArgumentError(absl::StrCat("output buffer: ", out_bytes,
                                                   " bytes, expected ", want, " ([T, H, L] in ",
                                                   DTypeName(in.q_latent.dtype), ")"));
  return absl::OkStatus();
}

absl::Status CheckLayerFinite(const LayerInputs& in) {
  for (const auto& [name, t] : Named(in)) RETURN_IF_ERROR(CheckFinite(name, *t));
  return absl::OkStatus();
}

}  // namespace attnd
