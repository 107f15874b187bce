// Server-side absorption (docs/numerics.md): the weights that let a worker send q_nope [T, H, Dn]
// instead of the absorbed query q_latent = q_nope · W_UK [T, H, L], and receive the attention's
// values [T, H, V] = out_latent · W_UV^T instead of the latent output [T, H, L]. At DeepSeek
// dims that is 80 KB per token per layer instead of 288 KB.
//
// Both come from each layer's kv_b_proj.weight [H*(Dn+V), L] (transformers' DeepSeek-V3.2 and
// GLM-MoE-DSA modules): per head h, rows [h*(Dn+V), h*(Dn+V)+Dn) are W_UK[h] (k_nope = W_UK c),
// the next V rows W_UV[h] (v = W_UV c). They are read from the model's safetensors checkpoint
// (attnd --absorb-from) or uploaded by a worker (AttnService.UploadAbsorption).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_spec.h"

namespace attnd {

class Absorption {
 public:
  // Room for every layer of `spec` (filled by SetLayer). INVALID_ARGUMENT for a dim outside
  // [1, 4096].
  static absl::StatusOr<std::unique_ptr<Absorption>> Create(const ModelSpec& spec, int qk_nope,
                                                            int v_head, std::string source);

  // Layer `layer`'s kv_b_proj.weight: `w` holds [H*(Dn+V), L] fp32 values, row-major. Checks the
  // shape and that every value is finite (INVALID_ARGUMENT naming the layer); OUT_OF_RANGE for a
  // layer beyond the model.
  absl::Status SetLayer(int layer, const std::vector<int64_t>& shape, const float* w);
  // Whether every layer was set.
  bool complete() const;
  // The first layer not set yet, or -1.
  int missing_layer() const;
  // How many layers were set.
  int layers_set() const;

  int qk_nope_head_dim() const { return qk_nope_; }  // Dn
  int v_head_dim() const { return v_head_; }         // V
  int num_heads() const { return heads_; }
  int latent_dim() const { return latent_; }
  int num_layers() const { return static_cast<int>(uk_.size()); }
  const std::string& source() const { return source_; }
  // W_UK of head h: [Dn, L] (q_latent[h] = q_nope[h] · W_UK[h]).
  const float* Uk(int layer, int h) const {
    return uk_[layer].data() + static_cast<size_t>(h) * qk_nope_ * latent_;
  }
  // W_UV of head h transposed: [L, V] (v[h] = out_latent[h] · W_UV[h]^T).
  const float* UvT(int layer, int h) const {
    return uv_t_[layer].data() + static_cast<size_t>(h) * latent_ * v_head_;
  }
  // Every layer's W_UK [H, Dn, L] and W_UV^T [H, L, V], for uploads to a device.
  const std::vector<float>& uk(int layer) const { return uk_[layer]; }
  const std::vector<float>& uv_t(int layer) const { return uv_t_[layer]; }
  // Bytes the weights take (host copy).
  size_t bytes() const;
  // Same dims and bit-identical weights (a second upload of the same model is a no-op).
  bool SameAs(const Absorption& other) const;

 private:
  Absorption() = default;
  int heads_ = 0, latent_ = 0, qk_nope_ = 0, v_head_ = 0;
  std::string source_;
  std::vector<std::vector<float>> uk_, uv_t_;  // [layer]; empty until set
};

// Reads every layer's `model.layers.{i}.self_attn.kv_b_proj.weight` from a Hugging Face
// checkpoint directory: config.json for qk_nope_head_dim and v_head_dim (transformers' defaults
// for deepseek_v32, 128 and 128, and glm_moe_dsa, 192 and 256, when absent), then only those
// tensors from model.safetensors or the shards model.safetensors.index.json names. F32, F16 and
// BF16 weights are taken as stored; F8_E4M3 ones (DeepSeek's released checkpoints) are
// dequantised with their `weight_scale_inv` blocks (quantization_config.weight_block_size,
// default 128 x 128). Errors name the file and tensor.
absl::StatusOr<std::shared_ptr<const Absorption>> LoadAbsorption(const std::string& dir,
                                                                 const ModelSpec& spec);

}  // namespace attnd
