#include "engine/layer_check.h"

#include <array>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/fp8.h"
#include "common/status_macros.h"

namespace attnd {
namespace {

// Every tensor a layer call carries, by name, in the order errors name them.
std::array<std::pair<const char*, const TensorView*>, 8> Named(const LayerInputs& in) {
  return {{{"q_latent", &in.q_latent},
           {"q_nope", &in.q_nope},
           {"q_rope", &in.q_rope},
           {"kv_latent", &in.kv_latent},
           {"k_rope", &in.k_rope},
           {"index_q", &in.index_q},
           {"index_k", &in.index_k},
           {"index_w", &in.index_w}}};
}

bool IsKey(const TensorView* t, const LayerInputs& in) {
  return t == &in.kv_latent || t == &in.index_k;
}

// Queries that may travel as FP8_E4M3 with one fp32 scale per token and head (docs/numerics.md).
bool IsQuery(const TensorView* t, const LayerInputs& in) {
  return t == &in.q_latent || t == &in.q_nope || t == &in.q_rope || t == &in.index_q;
}

// An fp8 key tensor's scales: FP32, [T, tiles] (the cache's tiles of its rows).
absl::Status CheckScales(const char* name, const TensorView& t, int64_t T, int64_t tiles) {
  if (t.scales == nullptr)
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": FP8_E4M3 without scales; give FP32 scales [", T, ", ", tiles, "]"));
  if (t.scales_per_row != tiles || t.scales_nbytes != static_cast<size_t>(T * tiles * 4))
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": scales of ", t.scales_per_row, " per row (", t.scales_nbytes,
        " bytes); the fp8 cache keeps ", tiles, " per row: FP32 [", T, ", ", tiles, "]"));
  return absl::OkStatus();
}

// fp8 queries' scales: FP32 [T, heads, 1], one per token and head.
absl::Status CheckQueryScales(const ModelSpec& s, int64_t T, const LayerInputs& in) {
  const std::array<std::tuple<const char*, const TensorView*, int>, 4> queries = {
      {{"q_latent", &in.q_latent, s.num_heads},
       {"q_nope", &in.q_nope, s.num_heads},
       {"q_rope", &in.q_rope, s.num_heads},
       {"index_q", &in.index_q, s.index_n_heads}}};
  for (const auto& [name, t, heads] : queries) {
    if (!t->present || t->dtype != DType::kFP8E4M3) continue;
    const size_t want = static_cast<size_t>(T) * heads * 4;
    if (t->scales == nullptr || t->scales_per_row != 1 || t->scales_nbytes != want)
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": FP8_E4M3 queries take one FP32 scale per token and head, scales [", T, ", ",
          heads, ", 1]",
          t->scales == nullptr ? "; none given"
                               : absl::StrCat("; got ", t->scales_per_row, " per row, ",
                                              t->scales_nbytes, " bytes")));
  }
  return absl::OkStatus();
}

// fp8 keys' scales, once their tensors' shapes were checked: the cache's tiles per row.
absl::Status CheckKeyScales(const ModelSpec& s, int64_t T, const LayerInputs& in) {
  if (in.kv_latent.dtype == DType::kFP8E4M3)
    RETURN_IF_ERROR(CheckScales("kv_latent", in.kv_latent, T, fp8::LatentTiles(s.kv_lora_rank)));
  if (in.index_k.present && in.index_k.dtype == DType::kFP8E4M3)
    RETURN_IF_ERROR(CheckScales("index_k", in.index_k, T, 1));
  return absl::OkStatus();
}

// The attention queries (q_latent, or q_nope where the server absorbs, and q_rope) of a step of
// T tokens.
absl::Status CheckQueries(const ModelSpec& s, int64_t T, const LayerInputs& in,
                          const Absorption* absorb) {
  if (in.q_nope.present) {
    if (in.q_latent.present)
      return absl::InvalidArgumentError(
          "q_nope and q_latent: give one (q_nope is absorbed on the server, q_latent was "
          "absorbed by the worker)");
    if (absorb == nullptr)
      return absl::FailedPreconditionError(
          "q_nope: this server holds no absorption weights (start attnd with "
          "--absorb-from=CHECKPOINT_DIR or upload them with UploadAbsorption); send q_latent");
    RETURN_IF_ERROR(CheckTensor("q_nope", in.q_nope, {T, s.num_heads, absorb->qk_nope_head_dim()}));
  } else {
    RETURN_IF_ERROR(CheckTensor("q_latent", in.q_latent, {T, s.num_heads, s.kv_lora_rank}));
  }
  return CheckTensor("q_rope", in.q_rope, {T, s.num_heads, s.qk_rope_head_dim});
}

// The output buffer: [T, H, L] (or [T, H, V] absorbed) in the call's output datatype.
absl::Status CheckOutput(const ModelSpec& s, int64_t T, const LayerInputs& in, size_t out_bytes,
                         const Absorption* absorb) {
  const DType out_dtype = OutputDType(in);
  if (out_dtype == DType::kFP8E4M3)
    return absl::InvalidArgumentError(
        "out_dtype: the engine writes BF16, FP16 or FP32 outputs (an fp8 reply is quantised from "
        "FP32 by the service)");
  const int width = OutputHeadDim(s, in, absorb);
  const size_t want = static_cast<size_t>(T) * s.num_heads * width * DTypeSize(out_dtype);
  if (out_bytes != want)
    return absl::InvalidArgumentError(absl::StrCat(
        "output buffer: ", out_bytes, " bytes, expected ", want,
        in.q_nope.present ? " ([T, H, V] in " : " ([T, H, L] in ", DTypeName(out_dtype), ")"));
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckLayerDTypes(const LayerInputs& in, DType cache_dtype) {
  for (const auto& [name, t] : Named(in)) {
    if (!t->present) continue;
    if (t->dtype != DType::kFP8E4M3) {
      if (t->scales != nullptr)
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": scales belong to FP8_E4M3 tensors only"));
      continue;
    }
    if (IsQuery(t, in)) continue;  // any cache: dequantised on arrival
    if (!IsKey(t, in))
      return absl::InvalidArgumentError(
          absl::StrCat(name,
                       ": FP8_E4M3 is taken for queries (q_latent or q_nope, q_rope, index_q, with "
                       "per-token-head scales) and for kv_latent and index_k (keys quantised as an "
                       "fp8 cache holds them)"));
    if (cache_dtype != DType::kFP8E4M3)
      return absl::InvalidArgumentError(
          absl::StrCat(name,
                       ": FP8_E4M3 keys need an fp8 cache (--cache-dtype=fp8); this server "
                       "caches ",
                       DTypeName(cache_dtype)));
  }
  // Every other tensor has one datatype: fp8 keys are the cache's own bytes and fp8 queries carry
  // their own scales, so neither sets it.
  const char* first = nullptr;
  DType dtype = DType::kF32;
  for (const auto& [name, t] : Named(in)) {
    if (!t->present || t->dtype == DType::kFP8E4M3) continue;
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

absl::Status CheckLayerShapes(const ModelSpec& s, DType cache_dtype, int64_t T, bool write_only,
                              int layer, const LayerInputs& in, size_t out_bytes,
                              const Absorption* absorb) {
  RETURN_IF_ERROR(CheckLayerDTypes(in, cache_dtype));
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
    if (in.q_latent.present || in.q_nope.present || in.q_rope.present || in.index_q.present ||
        in.index_w.present || in.out_dtype || out_bytes != 0)
      return absl::InvalidArgumentError(
          "write-only step: give only kv_latent, k_rope and (full layers) index_k; no output");
    return CheckKeyScales(s, T, in);
  }
  RETURN_IF_ERROR(CheckQueries(s, T, in, absorb));
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
  RETURN_IF_ERROR(CheckKeyScales(s, T, in));
  RETURN_IF_ERROR(CheckQueryScales(s, T, in));
  return CheckOutput(s, T, in, out_bytes, absorb);
}

absl::Status CheckContextParallelShapes(const ModelSpec& s, DType cache_dtype, int64_t T, int layer,
                                        CpMessage message, bool attend_only, bool selection_given,
                                        const LayerInputs& in, size_t out_bytes,
                                        const Absorption* absorb) {
  RETURN_IF_ERROR(CheckLayerDTypes(in, cache_dtype));
  const bool full = s.layers[layer] == LayerKind::kFull;
  const char* why = message == CpMessage::kSelection
                        ? "the layer's first call (candidates) carried the keys"
                        : "an attend-only step writes nothing";
  const bool keys = !attend_only && message != CpMessage::kSelection;
  for (const auto& [name, t] :
       {std::pair<const char*, const TensorView*>{"kv_latent", &in.kv_latent},
        {"k_rope", &in.k_rope},
        {"index_k", &in.index_k}}) {
    if (!keys && t->present)
      return absl::InvalidArgumentError(absl::StrCat(name, ": not on this call (", why, ")"));
  }
  if (keys) {
    RETURN_IF_ERROR(CheckTensor("kv_latent", in.kv_latent, {T, s.kv_lora_rank}));
    RETURN_IF_ERROR(CheckTensor("k_rope", in.k_rope, {T, s.qk_rope_head_dim}));
    if (full) RETURN_IF_ERROR(CheckTensor("index_k", in.index_k, {T, s.index_head_dim}));
  }
  if (message == CpMessage::kCandidates) {
    if (in.q_latent.present || in.q_nope.present || in.q_rope.present || out_bytes != 0 ||
        in.out_dtype)
      return absl::InvalidArgumentError(
          "candidates call: give the keys and index_q, index_w; the queries come with the "
          "selection");
    RETURN_IF_ERROR(CheckTensor("index_q", in.index_q, {T, s.index_n_heads, s.index_head_dim}));
    RETURN_IF_ERROR(CheckTensor("index_w", in.index_w, {T, s.index_n_heads}));
  } else {
    if (in.index_q.present || in.index_w.present || (!full && in.index_k.present))
      return absl::InvalidArgumentError(absl::StrCat(
          in.index_q.present   ? "index_q"
          : in.index_w.present ? "index_w"
                               : "index_k",
          full ? ": not on the selection call (the candidates call carried the indexer's)"
               : ": indexer tensors belong to full layers only"));
    RETURN_IF_ERROR(CheckQueries(s, T, in, absorb));
    RETURN_IF_ERROR(CheckOutput(s, T, in, out_bytes, absorb));
  }
  if ((message == CpMessage::kSelection) != selection_given)
    return absl::InvalidArgumentError(
        message == CpMessage::kSelection
            ? "selection: a context-parallel full layer attends the merged candidates; give them"
            : "selection: only a context-parallel full layer's second call takes one");
  if (keys) RETURN_IF_ERROR(CheckKeyScales(s, T, in));
  return CheckQueryScales(s, T, in);
}

absl::Status CheckLayerFinite(const LayerInputs& in) {
  for (const auto& [name, t] : Named(in)) RETURN_IF_ERROR(CheckFinite(name, *t));
  return absl::OkStatus();
}

DType OutputDType(const LayerInputs& in) {
  if (in.out_dtype) return *in.out_dtype;
  const TensorView& q = in.q_nope.present ? in.q_nope : in.q_latent;
  return q.dtype == DType::kFP8E4M3 ? DType::kBF16 : q.dtype;
}

int OutputHeadDim(const ModelSpec& spec, const LayerInputs& in, const Absorption* absorb) {
  return in.q_nope.present && absorb != nullptr ? absorb->v_head_dim() : spec.kv_lora_rank;
}

absl::Status CheckFp8Scales(const LayerInputs& in) {
  for (const auto& [name, t] : Named(in)) {
    if (!t->present || t->dtype != DType::kFP8E4M3) continue;
    const size_t n = t->scales_nbytes / 4;
    const bool query = IsQuery(t, in);
    for (size_t i = 0; i < n; ++i) {
      float v;
      std::memcpy(&v, static_cast<const uint8_t*>(t->scales) + 4 * i, 4);
      if (query) {  // any positive scale that keeps 448 x scale (e4m3's largest) finite
        if (!(v > 0 && v <= std::numeric_limits<float>::max() / 448))
          return absl::InvalidArgumentError(
              absl::StrCat(name, ": scale ", v, " at row ", i,
                           " is not a positive finite number of at most 3.4e38 / 448"));
        continue;
      }
      if (!fp8::IsTileScale(v))
        return absl::InvalidArgumentError(absl::StrCat(
            name, ": scale ", v, " at [", i / t->scales_per_row, ", ", i % t->scales_per_row,
            "] is not a power of two in [2^-126, 2^119] (an fp8 cache holds no other)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace attnd
