#include "common/model_spec.h"

#include <cctype>
#include <cmath>
#include <map>
#include <memory>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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

absl::string_view LayerKindName(LayerKind k) {
  switch (k) {
    case LayerKind::kFull:
      return "full";
    case LayerKind::kShared:
      return "shared";
    case LayerKind::kDense:
      return "dense";
  }
  return "?";
}

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

absl::string_view PrefillModeName(PrefillMode m) {
  return m == PrefillMode::kDense ? "dense" : "sparse";
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
  if (s.max_context < 1) return bad("max_context must be >= 1");
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
  s.sm_scale = 1.0 / 16.0;  // 256^-0.5
  s.max_context = 202752;
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

// ---- a small JSON reader, enough for model spec files ----

struct Json {
  enum Kind { kNull, kBool, kNumber, kString, kArray, kObject } kind = kNull;
  bool b = false;
  double num = 0;
  std::string str;
  std::vector<Json> arr;
  std::map<std::string, Json> obj;
};

class JsonReader {
 public:
  explicit JsonReader(absl::string_view text) : t_(text) {}

  absl::StatusOr<Json> ReadDocument() {
    ASSIGN_OR_RETURN(Json v, ReadValue(0));
    SkipSpace();
    if (i_ != t_.size()) return Error("trailing characters");
    return v;
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("model spec JSON: ", what, " at offset ", i_));
  }
  void SkipSpace() {
    while (i_ < t_.size() && std::isspace(static_cast<unsigned char>(t_[i_]))) ++i_;
  }
  bool Consume(char c) {
    SkipSpace();
    if (i_ < t_.size() && t_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  absl::StatusOr<std::string> ReadString() {
    if (!Consume('"')) return Error("expected a string");
    std::string out;
    while (i_ < t_.size() && t_[i_] != '"') {
      char c = t_[i_++];
      if (c == '\\') {
        if (i_ >= t_.size()) break;
        char e = t_[i_++];
        switch (e) {
          case 'n':
            out += '\n';
            break;
          case 't':
            out += '\t';
            break;
          case '"':
          case '\\':
          case '/':
            out += e;
            break;
          default:
            return Error("unsupported escape");
        }
      } else {
        out += c;
      }
    }
    if (i_ >= t_.size()) return Error("unterminated string");
    ++i_;
    return out;
  }
  absl::StatusOr<Json> ReadValue(int depth) {
    if (depth > 16) return Error("nesting too deep");
    SkipSpace();
    if (i_ >= t_.size()) return Error("unexpected end");
    Json v;
    const char c = t_[i_];
    if (c == '{') {
      ++i_;
      v.kind = Json::kObject;
      if (Consume('}')) return v;
      do {
        ASSIGN_OR_RETURN(std::string key, ReadString());
        if (!Consume(':')) return Error("expected ':'");
        ASSIGN_OR_RETURN(Json item, ReadValue(depth + 1));
        v.obj[key] = std::move(item);
      } while (Consume(','));
      if (!Consume('}')) return Error("expected '}'");
    } else if (c == '[') {
      ++i_;
      v.kind = Json::kArray;
      if (Consume(']')) return v;
      do {
        ASSIGN_OR_RETURN(Json item, ReadValue(depth + 1));
        v.arr.push_back(std::move(item));
      } while (Consume(','));
      if (!Consume(']')) return Error("expected ']'");
    } else if (c == '"') {
      v.kind = Json::kString;
      ASSIGN_OR_RETURN(v.str, ReadString());
    } else if (t_.substr(i_, 4) == "true" || t_.substr(i_, 5) == "false") {
      v.kind = Json::kBool;
      v.b = t_[i_] == 't';
      i_ += v.b ? 4 : 5;
    } else if (t_.substr(i_, 4) == "null") {
      i_ += 4;
    } else {
      size_t j = i_;
      while (j < t_.size() && (std::isdigit(static_cast<unsigned char>(t_[j])) || t_[j] == '-' ||
                               t_[j] == '+' || t_[j] == '.' || t_[j] == 'e' || t_[j] == 'E'))
        ++j;
      if (j == i_ || !absl::SimpleAtod(t_.substr(i_, j - i_), &v.num))
        return Error("expected a value");
      v.kind = Json::kNumber;
      i_ = j;
    }
    return v;
  }

  absl::string_view t_;
  size_t i_ = 0;
};

absl::StatusOr<LayerKind> ParseLayerKind(absl::string_view s) {
  if (s == "full" || s == "F") return LayerKind::kFull;
  if (s == "shared" || s == "S") return LayerKind::kShared;
  if (s == "dense" || s == "D") return LayerKind::kDense;
  return absl::InvalidArgumentError(
      absl::StrCat("model spec JSON: unknown layer kind '", s, "' (full, shared, dense)"));
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

absl::StatusOr<ModelSpec> ParseModelSpecJson(absl::string_view text) {
  ASSIGN_OR_RETURN(Json doc, JsonReader(text).ReadDocument());
  if (doc.kind != Json::kObject)
    return absl::InvalidArgumentError("model spec JSON: not an object");
  ModelSpec s;
  s.name = "custom";
  s.sm_scale = 0;
  if (auto it = doc.obj.find("base"); it != doc.obj.end()) {
    if (it->second.kind != Json::kString)
      return absl::InvalidArgumentError("model spec JSON: 'base' must be a preset name");
    ASSIGN_OR_RETURN(s, PresetModelSpec(it->second.str));
  }
  for (const auto& entry : doc.obj) {
    const std::string& key = entry.first;
    const Json& v = entry.second;
    auto need = [&](Json::Kind k) -> absl::Status {
      if (v.kind != k)
        return absl::InvalidArgumentError(
            absl::StrCat("model spec JSON: '", key, "' has the wrong type"));
      return absl::OkStatus();
    };
    auto integer = [&](auto* out) -> absl::Status {
      RETURN_IF_ERROR(need(Json::kNumber));
      if (v.num != std::floor(v.num) || std::abs(v.num) > 1e15)
        return absl::InvalidArgumentError(
            absl::StrCat("model spec JSON: '", key, "' must be an integer"));
      *out = static_cast<std::remove_pointer_t<decltype(out)>>(v.num);
      return absl::OkStatus();
    };
    if (key == "base") continue;
    if (key == "name") {
      RETURN_IF_ERROR(need(Json::kString));
      s.name = v.str;
    } else if (key == "layers") {
      s.layers.clear();
      if (v.kind == Json::kString) {
        for (char c : v.str) {
          ASSIGN_OR_RETURN(LayerKind k, ParseLayerKind(absl::string_view(&c, 1)));
          s.layers.push_back(k);
        }
      } else {
        RETURN_IF_ERROR(need(Json::kArray));
        for (const Json& e : v.arr) {
          if (e.kind != Json::kString)
            return absl::InvalidArgumentError("model spec JSON: 'layers' entries must be strings");
          ASSIGN_OR_RETURN(LayerKind k, ParseLayerKind(e.str));
          s.layers.push_back(k);
        }
      }
    } else if (key == "kv_lora_rank") {
      RETURN_IF_ERROR(integer(&s.kv_lora_rank));
    } else if (key == "qk_rope_head_dim") {
      RETURN_IF_ERROR(integer(&s.qk_rope_head_dim));
    } else if (key == "num_heads") {
      RETURN_IF_ERROR(integer(&s.num_heads));
    } else if (key == "index_n_heads") {
      RETURN_IF_ERROR(integer(&s.index_n_heads));
    } else if (key == "index_head_dim") {
      RETURN_IF_ERROR(integer(&s.index_head_dim));
    } else if (key == "index_topk") {
      RETURN_IF_ERROR(integer(&s.index_topk));
    } else if (key == "page_size") {
      RETURN_IF_ERROR(integer(&s.page_size));
    } else if (key == "max_context") {
      RETURN_IF_ERROR(integer(&s.max_context));
    } else if (key == "page_union_max_pages") {
      RETURN_IF_ERROR(integer(&s.page_union_max_pages));
    } else if (key == "sliding_window") {
      RETURN_IF_ERROR(integer(&s.sliding_window));
    } else if (key == "sm_scale") {
      RETURN_IF_ERROR(need(Json::kNumber));
      s.sm_scale = v.num;
    } else if (key == "soft_cap") {
      RETURN_IF_ERROR(need(Json::kNumber));
      s.soft_cap = v.num;
    } else if (key == "selection") {
      RETURN_IF_ERROR(need(Json::kString));
      if (v.str == "token") {
        s.selection = SelectionMode::kToken;
      } else if (v.str == "page_union") {
        s.selection = SelectionMode::kPageUnion;
      } else if (v.str.rfind("page_budget:", 0) == 0 &&
                 absl::SimpleAtoi(v.str.substr(12), &s.page_budget)) {
        s.selection = SelectionMode::kPageBudget;
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            "model spec JSON: selection '", v.str, "' is not token, page_union or page_budget:B"));
      }
    } else if (key == "prefill") {
      RETURN_IF_ERROR(need(Json::kString));
      if (v.str == "sparse") {
        s.prefill = PrefillMode::kSparse;
      } else if (v.str == "dense") {
        s.prefill = PrefillMode::kDense;
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("model spec JSON: prefill '", v.str, "' is not sparse or dense"));
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat("model spec JSON: unknown key '", key, "'"));
    }
  }
  RETURN_IF_ERROR(ValidateModelSpec(s));
  return s;
}

}  // namespace attnd
