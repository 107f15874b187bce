#include "common/model_spec.h"

#include <cctype>
#include <cmath>
#include <map>
#include <memory>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/enum_names.h"
#include "common/status_macros.h"

namespace attnd {

int ModelSpec::num_full_layers() const {
  int n = 0;
  for (LayerKind k : layers) n += k == LayerKind::kFull;
  return n;
}

int ModelSpec::FullSlot(int layer) const {
  if (layer < 0 || layer >= num_layers() || layers[layer] != LayerKind::kFull) return -1;
  int slot = 0;
  for (int i = 0; i < layer; ++i) slot += layers[i] == LayerKind::kFull;
  return slot;
}

int64_t FirstVisibleKey(const ModelSpec& spec, LayerKind kind, int64_t pos) {
  if (kind != LayerKind::kDense || spec.sliding_window <= 0) return 0;
  return std::max<int64_t>(0, pos + 1 - spec.sliding_window);
}

int64_t CandidatesPerQuery(const ModelSpec& spec) {
  return spec.selection == SelectionMode::kPageBudget ? spec.page_budget : spec.index_topk;
}

bool SelectsEveryVisibleKey(const ModelSpec& spec, int64_t visible) {
  const int64_t pages = (visible + spec.page_size - 1) / spec.page_size;
  switch (spec.selection) {
    case SelectionMode::kToken:
      return visible <= spec.index_topk;
    case SelectionMode::kPageUnion:
      return visible <= spec.index_topk && pages <= spec.page_union_max_pages;
    case SelectionMode::kPageBudget:
      return pages <= spec.page_budget;
  }
  return false;
}

namespace {
constexpr NamedValue<LayerKind> kLayerKindNames[] = {
    {LayerKind::kFull, "full"}, {LayerKind::kShared, "shared"}, {LayerKind::kDense, "dense"}};
constexpr NamedValue<PrefillMode> kPrefillModeNames[] = {{PrefillMode::kSparse, "sparse"},
                                                         {PrefillMode::kDense, "dense"}};
}  // namespace

absl::string_view LayerKindName(LayerKind k) { return NameIn(kLayerKindNames, k); }

std::string SelectionModeName(const ModelSpec& spec) {
  switch (spec.selection) {
    case SelectionMode::kToken:
      return "token";
    case SelectionMode::kPageUnion:
      return "page_union";
    case SelectionMode::kPageBudget:
      return absl::StrCat("page_budget:", spec.page_budget);
  }
  return "?";
}

absl::string_view PrefillModeName(PrefillMode m) { return NameIn(kPrefillModeNames, m, "sparse"); }

absl::StatusOr<LayerKind> ParseLayerKind(absl::string_view name) {
  if (auto kind = ValueNamed(kLayerKindNames, name)) return *kind;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown layer kind '", name, "' (full, shared, dense)"));
}

absl::Status ParseSelectionMode(absl::string_view name, ModelSpec* spec) {
  absl::string_view budget = name;
  if (name == "token") {
    spec->selection = SelectionMode::kToken;
  } else if (name == "page_union") {
    spec->selection = SelectionMode::kPageUnion;
  } else if (absl::ConsumePrefix(&budget, "page_budget:") &&
             absl::SimpleAtoi(budget, &spec->page_budget)) {
    spec->selection = SelectionMode::kPageBudget;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("'", name, "' is not token, page_union or page_budget:B"));
  }
  return absl::OkStatus();
}

absl::StatusOr<PrefillMode> ParsePrefillMode(absl::string_view name) {
  if (auto mode = ValueNamed(kPrefillModeNames, name)) return *mode;
  return absl::InvalidArgumentError(absl::StrCat("'", name, "' is not sparse or dense"));
}

absl::Status ValidateModelSpec(const ModelSpec& s) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("model spec '", s.name, "': ", what));
  };
  if (s.layers.empty()) return bad("no layers");
  if (s.kv_lora_rank < 1) return bad("kv_lora_rank must be >= 1");
  if (s.qk_rope_head_dim < 0) return bad("qk_rope_head_dim must be >= 0");
  if (s.num_heads < 1) return bad("num_heads must be >= 1");
  if (s.index_topk < 1) return bad("index_topk (K) must be >= 1");
  if (s.page_size < 1 || s.page_size > 4096 || (s.page_size & (s.page_size - 1)) != 0)
    return bad(absl::StrCat("page_size must be a power of two in [1, 4096], got ", s.page_size));
  if (!(s.sm_scale > 0) || !std::isfinite(s.sm_scale))
    return bad("sm_scale must be a positive number given by the model");
  if (s.max_context < 1 || s.max_context > (int64_t{1} << 31))
    return bad("max_context must be in [1, 2^31] (32-bit positions)");
  if (s.sliding_window < 0) return bad("sliding_window must be >= 0");
  if (s.soft_cap < 0 || !std::isfinite(s.soft_cap)) return bad("soft_cap must be >= 0");
  const bool any_full = s.num_full_layers() > 0;
  if (any_full && (s.index_n_heads < 1 || s.index_head_dim < 1))
    return bad("index_n_heads and index_head_dim must be >= 1 when there are full layers");
  for (int i = 0; i < s.num_layers(); ++i) {
    if (s.layers[i] == LayerKind::kShared && s.FullSlot(i) < 0) {
      bool seen_full = false;
      for (int j = 0; j < i; ++j) seen_full |= s.layers[j] == LayerKind::kFull;
      if (!seen_full) return bad(absl::StrCat("shared layer ", i, " has no full layer before it"));
    }
  }
  if (s.selection == SelectionMode::kPageBudget && s.page_budget < 1)
    return bad("page_budget B must be >= 1");
  if (s.selection == SelectionMode::kPageUnion && s.page_union_max_pages < 1)
    return bad("page_union_max_pages must be >= 1");
  return absl::OkStatus();
}

namespace {

ModelSpec DeepSeekV32() {
  ModelSpec s;
  s.name = "deepseek-v3.2";
  s.layers.assign(61, LayerKind::kFull);
  s.num_heads = 128;
  s.index_n_heads = 64;
  const double mscale = 0.1 * std::log(40.0) + 1.0;  // YaRN factor 40
  s.sm_scale = std::pow(192.0, -0.5) * mscale * mscale;
  s.max_context = 163840;
  return s;
}

ModelSpec Glm5(bool index_share) {
  ModelSpec s;
  s.name = index_share ? "glm-5.2" : "glm-5";
  s.layers.assign(78, LayerKind::kFull);
  if (index_share) {
    for (int i = 0; i < 78; ++i)
      s.layers[i] = (std::max(i - 2, 0) % 4 == 0) ? LayerKind::kFull : LayerKind::kShared;
  }
  s.num_heads = 64;
  s.index_n_heads = 32;
  s.sm_scale = 1.0 / 16.0;                         // 256^-0.5
  s.max_context = index_share ? 1048576 : 202752;  // the configs' max_position_embeddings
  return s;
}

ModelSpec Tiny() {
  ModelSpec s;
  s.name = "tiny";
  s.layers = {LayerKind::kFull, LayerKind::kShared, LayerKind::kFull, LayerKind::kShared};
  s.kv_lora_rank = 32;
  s.qk_rope_head_dim = 16;
  s.num_heads = 4;
  s.index_n_heads = 4;
  s.index_head_dim = 16;
  s.index_topk = 24;
  s.page_size = 16;
  s.sm_scale = 1.0 / std::sqrt(48.0);
  s.max_context = 8192;
  return s;
}

// DeepSeek-V3.2 dims with 16 heads (one TP-8 shard's worth) and 4 layers, two sharing.
ModelSpec Demo() {
  ModelSpec s = DeepSeekV32();
  s.name = "demo";
  s.layers = {LayerKind::kFull, LayerKind::kShared, LayerKind::kFull, LayerKind::kShared};
  s.num_heads = 16;
  s.max_context = 65536;
  return s;
}

}  // namespace

std::vector<std::string> PresetModelNames() {
  return {"deepseek-v3.2", "glm-5", "glm-5.2", "tiny", "demo"};
}

absl::StatusOr<ModelSpec> PresetModelSpec(absl::string_view name) {
  if (name == "deepseek-v3.2") return DeepSeekV32();
  if (name == "glm-5") return Glm5(false);
  if (name == "glm-5.2") return Glm5(true);
  if (name == "tiny") return Tiny();
  if (name == "demo") return Demo();
  return absl::NotFoundError(absl::StrCat("no model preset '", name,
                                          "'; presets: ", absl::StrJoin(PresetModelNames(), ", ")));
}

}  // namespace attnd
