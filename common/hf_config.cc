#include "common/hf_config.h"

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/json_fields.h"
#include "common/status_macros.h"

namespace attnd {
namespace {

constexpr absl::string_view kWhat = "--hf-config";

// The transformers defaults of the fields read (configuration_deepseek_v32.py,
// configuration_glm_moe_dsa.py).
struct HfDefaults {
  int layers, heads, kv_lora_rank, qk_rope, qk_nope, index_heads, index_dim, index_topk;
  int64_t max_position;
};
constexpr HfDefaults kDeepSeekV32{61, 128, 512, 64, 128, 64, 128, 2048, 163840};
constexpr HfDefaults kGlmMoeDsa{78, 64, 512, 64, 192, 32, 128, 2048, 202752};

absl::StatusOr<LayerKind> IndexerKind(const nlohmann::json& v) {
  if (v == "full" || v == "F") return LayerKind::kFull;
  if (v == "shared" || v == "S") return LayerKind::kShared;
  return absl::InvalidArgumentError(
      absl::StrCat(kWhat, ": indexer type ", v.dump(), " is not \"full\" or \"shared\""));
}

absl::StatusOr<std::vector<LayerKind>> GlmLayers(const json::Fields& f, int n) {
  std::vector<LayerKind> out;
  for (const char* key : {"indexer_types", "index_topk_pattern"}) {
    if (!f.Has(key) || f.At(key).is_null()) continue;
    const nlohmann::json& v = f.At(key);
    if (v.is_string()) {
      for (char c : v.get<std::string>()) {
        ASSIGN_OR_RETURN(LayerKind k, IndexerKind(std::string(1, c)));
        out.push_back(k);
      }
    } else if (v.is_array()) {
      for (const nlohmann::json& e : v) {
        ASSIGN_OR_RETURN(LayerKind k, IndexerKind(e));
        out.push_back(k);
      }
    } else {
      return f.Bad(key, "must be a list of \"full\"/\"shared\" or a string of F/S");
    }
    if (static_cast<int>(out.size()) != n)
      return f.Bad(key, absl::StrCat("has ", out.size(), " entries for ", n, " layers"));
    return out;
  }
  int freq = 1, offset = 2;
  RETURN_IF_ERROR(f.OptionalInt("index_topk_freq", &freq));
  RETURN_IF_ERROR(f.OptionalInt("index_skip_topk_offset", &offset));
  freq = std::max(freq, 1);
  for (int i = 0; i < n; ++i)
    out.push_back(std::max(i - offset + 1, 0) % freq == 0 ? LayerKind::kFull : LayerKind::kShared);
  return out;
}

// transformers' yarn_apply_mscale: the softmax scale's factor under YaRN (1 otherwise).
absl::StatusOr<double> MscaleSquared(const json::Fields& f) {
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (!f.Has(key) || f.At(key).is_null()) continue;
    if (!f.At(key).is_object()) return f.Bad(key, "must be an object");
    const json::Fields rope(f.At(key), absl::StrCat(kWhat, " ", key));
    std::string type = "default";
    if (rope.Has("rope_type")) {
      RETURN_IF_ERROR(rope.String("rope_type", &type));
    } else if (rope.Has("type")) {
      RETURN_IF_ERROR(rope.String("type", &type));
    }
    double all_dim = 0, factor = 1;
    if (rope.Has("mscale_all_dim") && !rope.At("mscale_all_dim").is_null())
      RETURN_IF_ERROR(rope.Number("mscale_all_dim", &all_dim));
    if (type == "default" || all_dim == 0) return 1.0;
    if (!rope.Has("factor")) return rope.Bad("factor", "is missing (needed with mscale_all_dim)");
    RETURN_IF_ERROR(rope.Number("factor", &factor));
    const double m = factor <= 1 ? 1.0 : 0.1 * all_dim * std::log(factor) + 1.0;
    return m * m;
  }
  return 1.0;
}

}  // namespace

absl::StatusOr<ModelSpec> SpecFromHfConfig(absl::string_view text) {
  ASSIGN_OR_RETURN(const nlohmann::json doc, json::Parse(text, kWhat));
  const json::Fields f(doc, kWhat);
  std::string type;
  if (!f.Has("model_type")) return f.Bad("model_type", "is missing");
  RETURN_IF_ERROR(f.String("model_type", &type));
  const bool glm = type == "glm_moe_dsa";
  if (!glm && type != "deepseek_v32")
    return f.Bad("model_type", absl::StrCat("is '", type,
                                            "'; attnd reads deepseek_v32 (DeepSeek-V3.2) and "
                                            "glm_moe_dsa (GLM-5) configs"));
  const HfDefaults& d = glm ? kGlmMoeDsa : kDeepSeekV32;
  ModelSpec s;
  s.name = type;
  int layers = d.layers, qk_nope = d.qk_nope;
  s.num_heads = d.heads;
  s.kv_lora_rank = d.kv_lora_rank;
  s.qk_rope_head_dim = d.qk_rope;
  s.index_n_heads = d.index_heads;
  s.index_head_dim = d.index_dim;
  s.index_topk = d.index_topk;
  s.max_context = d.max_position;
  RETURN_IF_ERROR(f.OptionalInt("num_hidden_layers", &layers));
  RETURN_IF_ERROR(f.OptionalInt("num_attention_heads", &s.num_heads));
  RETURN_IF_ERROR(f.OptionalInt("kv_lora_rank", &s.kv_lora_rank));
  RETURN_IF_ERROR(f.OptionalInt("qk_rope_head_dim", &s.qk_rope_head_dim));
  RETURN_IF_ERROR(f.OptionalInt("qk_nope_head_dim", &qk_nope));
  RETURN_IF_ERROR(f.OptionalInt("index_n_heads", &s.index_n_heads));
  RETURN_IF_ERROR(f.OptionalInt("index_head_dim", &s.index_head_dim));
  RETURN_IF_ERROR(f.OptionalInt("index_topk", &s.index_topk));
  RETURN_IF_ERROR(f.OptionalInt("max_position_embeddings", &s.max_context));
  if (layers < 1 || layers > 4096)
    return f.Bad("num_hidden_layers", absl::StrCat("is ", layers, "; expected 1..4096"));
  if (qk_nope < 0 || s.qk_rope_head_dim < 1)
    return f.Bad("qk_nope_head_dim", "and qk_rope_head_dim must be positive");
  if (glm) {
    ASSIGN_OR_RETURN(s.layers, GlmLayers(f, layers));
  } else {
    s.layers.assign(layers, LayerKind::kFull);
  }
  ASSIGN_OR_RETURN(const double mscale2, MscaleSquared(f));
  s.sm_scale = std::pow(static_cast<double>(qk_nope + s.qk_rope_head_dim), -0.5) * mscale2;
  RETURN_IF_ERROR(ValidateModelSpec(s));
  return s;
}

}  // namespace attnd
