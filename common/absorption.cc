#include "common/absorption.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/json_fields.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace attnd {

absl::StatusOr<std::unique_ptr<Absorption>> Absorption::Create(const ModelSpec& spec, int qk_nope,
                                                               int v_head, std::string source) {
  if (qk_nope < 1 || qk_nope > 4096 || v_head < 1 || v_head > 4096)
    return absl::InvalidArgumentError(absl::StrCat("absorption: qk_nope_head_dim ", qk_nope,
                                                   " and v_head_dim ", v_head,
                                                   " must be in [1, 4096]"));
  std::unique_ptr<Absorption> a(new Absorption());
  a->heads_ = spec.num_heads;
  a->latent_ = spec.kv_lora_rank;
  a->qk_nope_ = qk_nope;
  a->v_head_ = v_head;
  a->source_ = std::move(source);
  a->uk_.resize(spec.num_layers());
  a->uv_t_.resize(spec.num_layers());
  return a;
}

absl::Status Absorption::SetLayer(int layer, const std::vector<int64_t>& shape, const float* w) {
  if (layer < 0 || layer >= num_layers())
    return absl::OutOfRangeError(
        absl::StrCat("absorption: layer ", layer, " of a model of ", num_layers(), " layers"));
  const int64_t rows = int64_t{heads_} * (qk_nope_ + v_head_);
  if (shape.size() != 2 || shape[0] != rows || shape[1] != latent_)
    return absl::InvalidArgumentError(absl::StrCat(
        "absorption: layer ", layer, "'s kv_b_proj.weight must be [H*(qk_nope+v_head), L] = [",
        rows, ", ", latent_, "] (H ", heads_, ", qk_nope ", qk_nope_, ", v_head ", v_head_, ", L ",
        latent_, "); got [", absl::StrJoin(shape, ", "), "]"));
  const size_t n = static_cast<size_t>(rows) * latent_;
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(w[i]))
      return absl::InvalidArgumentError(absl::StrCat("absorption: layer ", layer,
                                                     "'s kv_b_proj.weight holds ", w[i], " at [",
                                                     i / latent_, ", ", i % latent_, "]"));
  const int D = qk_nope_ + v_head_, L = latent_, V = v_head_;
  std::vector<float> uk(static_cast<size_t>(heads_) * qk_nope_ * L);
  std::vector<float> uv_t(static_cast<size_t>(heads_) * L * V);
  for (int h = 0; h < heads_; ++h) {
    const float* head = w + static_cast<size_t>(h) * D * L;
    std::memcpy(uk.data() + static_cast<size_t>(h) * qk_nope_ * L, head,
                sizeof(float) * qk_nope_ * L);
    float* t = uv_t.data() + static_cast<size_t>(h) * L * V;
    for (int v = 0; v < V; ++v)
      for (int l = 0; l < L; ++l) t[static_cast<size_t>(l) * V + v] = head[(qk_nope_ + v) * L + l];
  }
  uk_[layer] = std::move(uk);
  uv_t_[layer] = std::move(uv_t);
  return absl::OkStatus();
}

int Absorption::missing_layer() const {
  for (int l = 0; l < num_layers(); ++l)
    if (uk_[l].empty()) return l;
  return -1;
}

int Absorption::layers_set() const {
  int n = 0;
  for (const auto& uk : uk_) n += uk.empty() ? 0 : 1;
  return n;
}

bool Absorption::complete() const { return missing_layer() < 0; }

size_t Absorption::bytes() const {
  size_t n = 0;
  for (int l = 0; l < num_layers(); ++l) n += 4 * (uk_[l].size() + uv_t_[l].size());
  return n;
}

bool Absorption::SameAs(const Absorption& o) const {
  if (heads_ != o.heads_ || latent_ != o.latent_ || qk_nope_ != o.qk_nope_ ||
      v_head_ != o.v_head_ || num_layers() != o.num_layers())
    return false;
  const auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), 4 * a.size()) == 0;
  };
  for (int l = 0; l < num_layers(); ++l)
    if (!same(uk_[l], o.uk_[l]) || !same(uv_t_[l], o.uv_t_[l])) return false;
  return true;
}

namespace {

struct CheckpointConfig {
  int qk_nope = 0, v_head = 0;
  int block_rows = 128, block_cols = 128;  // fp8 weights' scale blocks
};

absl::StatusOr<CheckpointConfig> ReadConfig(const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/config.json");
  std::ifstream f(path);
  if (!f)
    return absl::NotFoundError(absl::StrCat(path,
                                            ": cannot open (--absorb-from names a "
                                            "checkpoint directory with its config.json)"));
  std::stringstream text;
  text << f.rdbuf();
  ASSIGN_OR_RETURN(const nlohmann::json doc, json::Parse(text.str(), path));
  const json::Fields cfg(doc, path);
  CheckpointConfig c;
  std::string type;
  if (cfg.Has("model_type")) RETURN_IF_ERROR(cfg.String("model_type", &type));
  // transformers' defaults (configuration_deepseek_v32.py, configuration_glm_moe_dsa.py).
  c.qk_nope = type == "glm_moe_dsa" ? 192 : 128;
  c.v_head = type == "glm_moe_dsa" ? 256 : 128;
  RETURN_IF_ERROR(cfg.OptionalInt("qk_nope_head_dim", &c.qk_nope));
  RETURN_IF_ERROR(cfg.OptionalInt("v_head_dim", &c.v_head));
  if (cfg.Has("quantization_config") && cfg.At("quantization_config").is_object()) {
    const json::Fields q(cfg.At("quantization_config"), absl::StrCat(path, " quantization_config"));
    if (q.Has("weight_block_size")) {
      const nlohmann::json& b = q.At("weight_block_size");
      if (!b.is_array() || b.size() != 2 || !b[0].is_number_integer() ||
          !b[1].is_number_integer() || b[0].get<int64_t>() < 1 || b[1].get<int64_t>() < 1 ||
          b[0].get<int64_t>() > 1 << 20 || b[1].get<int64_t>() > 1 << 20)
        return q.Bad("weight_block_size", "must be two positive integers");
      c.block_rows = b[0].get<int>();
      c.block_cols = b[1].get<int>();
    }
  }
  return c;
}

// An F8_E4M3 weight [rows, cols] times its scale_inv blocks [ceil(rows/br), ceil(cols/bc)].
absl::Status Dequantise(safetensors::Checkpoint& ck, const std::string& name,
                        const std::vector<int64_t>& shape, const CheckpointConfig& cfg,
                        std::vector<float>* w) {
  const std::string sname = absl::StrCat(name, "_scale_inv");
  std::vector<int64_t> sshape;
  std::vector<float> s;
  if (!ck.Has(sname))
    return absl::InvalidArgumentError(
        absl::StrCat(ck.dir(), ": '", name, "' is F8_E4M3 without its '", sname, "'"));
  RETURN_IF_ERROR(ck.ReadF32(sname, &sshape, &s));
  const int64_t rows = shape[0], cols = shape[1];
  const int64_t br = cfg.block_rows, bc = cfg.block_cols;
  const int64_t sr = (rows + br - 1) / br, sc = (cols + bc - 1) / bc;
  if (sshape.size() != 2 || sshape[0] != sr || sshape[1] != sc)
    return absl::InvalidArgumentError(absl::StrCat(ck.dir(), ": '", sname, "' must be [", sr, ", ",
                                                   sc, "] for ", br, "x", bc, " blocks of [", rows,
                                                   ", ", cols, "]"));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) (*w)[i * cols + j] *= s[(i / br) * sc + j / bc];
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Absorption>> LoadAbsorption(const std::string& dir,
                                                                 const ModelSpec& spec) {
  ASSIGN_OR_RETURN(const CheckpointConfig cfg, ReadConfig(dir));
  ASSIGN_OR_RETURN(std::unique_ptr<safetensors::Checkpoint> ck, safetensors::Checkpoint::Open(dir));
  ASSIGN_OR_RETURN(
      std::unique_ptr<Absorption> a,
      Absorption::Create(spec, cfg.qk_nope, cfg.v_head, absl::StrCat("checkpoint ", dir)));
  std::vector<int64_t> shape;
  std::vector<float> w;
  for (int l = 0; l < spec.num_layers(); ++l) {
    const std::string name = absl::StrCat("model.layers.", l, ".self_attn.kv_b_proj.weight");
    ASSIGN_OR_RETURN(auto found, ck->Find(name));
    shape = found.second->shape;
    RETURN_IF_ERROR(found.first->ReadF32(*found.second, &w));
    if (found.second->dtype == "F8_E4M3" && shape.size() == 2)
      RETURN_IF_ERROR(Dequantise(*ck, name, shape, cfg, &w));
    if (absl::Status s = a->SetLayer(l, shape, w.data()); !s.ok())
      return absl::InvalidArgumentError(absl::StrCat(found.first->path(), ": ", s.message()));
  }
  return std::shared_ptr<const Absorption>(std::move(a));
}

}  // namespace attnd
