// The JSON form of a model spec (--model-file), parsed with nlohmann::json.
#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/json_fields.h"
#include "common/model_spec.h"
#include "common/status_macros.h"

namespace attnd {
namespace {

// One letter per layer (F, S, D) or the kind's name.
absl::StatusOr<LayerKind> ParseLayerLetterOrName(absl::string_view s) {
  if (s == "F") return LayerKind::kFull;
  if (s == "S") return LayerKind::kShared;
  if (s == "D") return LayerKind::kDense;
  return ParseLayerKind(s);
}

absl::StatusOr<std::vector<LayerKind>> ParseLayerKinds(const nlohmann::json& v) {
  std::vector<LayerKind> out;
  if (v.is_string()) {
    for (char c : v.get<std::string>()) {
      ASSIGN_OR_RETURN(LayerKind k, ParseLayerLetterOrName(absl::string_view(&c, 1)));
      out.push_back(k);
    }
    return out;
  }
  if (!v.is_array()) return absl::InvalidArgumentError("a string of F/S/D or a list of kinds");
  for (const nlohmann::json& e : v) {
    if (!e.is_string()) return absl::InvalidArgumentError("its entries must be strings");
    ASSIGN_OR_RETURN(LayerKind k, ParseLayerLetterOrName(e.get<std::string>()));
    out.push_back(k);
  }
  return out;
}

}  // namespace

absl::StatusOr<ModelSpec> ParseModelSpecJson(absl::string_view text) {
  ASSIGN_OR_RETURN(const nlohmann::json doc, json::Parse(text, "model spec JSON"));
  const json::Fields f(doc, "model spec JSON");
  ModelSpec s;
  s.name = "custom";
  s.sm_scale = 0;
  if (doc.contains("base")) {
    std::string base;
    RETURN_IF_ERROR(f.String("base", &base));
    ASSIGN_OR_RETURN(s, PresetModelSpec(base));
  }
  for (const auto& [key, v] : doc.items()) {
    if (key == "base") continue;
    if (key == "name") {
      RETURN_IF_ERROR(f.String(key, &s.name));
    } else if (key == "layers") {
      auto kinds = ParseLayerKinds(v);
      if (!kinds.ok()) return f.Bad(key, kinds.status().message());
      s.layers = *std::move(kinds);
    } else if (key == "kv_lora_rank") {
      RETURN_IF_ERROR(f.Int(key, &s.kv_lora_rank));
    } else if (key == "qk_rope_head_dim") {
      RETURN_IF_ERROR(f.Int(key, &s.qk_rope_head_dim));
    } else if (key == "num_heads") {
      RETURN_IF_ERROR(f.Int(key, &s.num_heads));
    } else if (key == "index_n_heads") {
      RETURN_IF_ERROR(f.Int(key, &s.index_n_heads));
    } else if (key == "index_head_dim") {
      RETURN_IF_ERROR(f.Int(key, &s.index_head_dim));
    } else if (key == "index_topk") {
      RETURN_IF_ERROR(f.Int(key, &s.index_topk));
    } else if (key == "page_size") {
      RETURN_IF_ERROR(f.Int(key, &s.page_size));
    } else if (key == "max_context") {
      RETURN_IF_ERROR(f.Int(key, &s.max_context));
    } else if (key == "page_union_max_pages") {
      RETURN_IF_ERROR(f.Int(key, &s.page_union_max_pages));
    } else if (key == "sliding_window") {
      RETURN_IF_ERROR(f.Int(key, &s.sliding_window));
    } else if (key == "sm_scale") {
      RETURN_IF_ERROR(f.Number(key, &s.sm_scale));
    } else if (key == "soft_cap") {
      RETURN_IF_ERROR(f.Number(key, &s.soft_cap));
    } else if (key == "selection") {
      std::string m;
      RETURN_IF_ERROR(f.String(key, &m));
      absl::Status st = ParseSelectionMode(m, &s);
      if (!st.ok()) return f.Bad(key, st.message());
    } else if (key == "prefill") {
      std::string m;
      RETURN_IF_ERROR(f.String(key, &m));
      absl::StatusOr<PrefillMode> mode = ParsePrefillMode(m);
      if (!mode.ok()) return f.Bad(key, mode.status().message());
      s.prefill = *mode;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("model spec JSON: unknown key '", key, "'"));
    }
  }
  RETURN_IF_ERROR(ValidateModelSpec(s));
  return s;
}

}  // namespace attnd
