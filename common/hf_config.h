// A model spec from a Hugging Face config.json (attnd --hf-config): DeepSeek-V3.2
// (model_type "deepseek_v32") and GLM-5 (model_type "glm_moe_dsa"), read as transformers reads
// them, so a worker running that checkpoint and attnd agree on every layer.
#pragma once

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/model_spec.h"

namespace attnd {

// What is taken, with transformers' defaults for absent fields:
// - layers: num_hidden_layers; deepseek_v32: every layer full; glm_moe_dsa: `indexer_types`
//   ("full"/"shared"), else `index_topk_pattern` ("FSS..." or a list), else the schedule
//   layer i full iff max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0 (defaults
//   offset 2, freq 1: every layer full).
// - kv_lora_rank, qk_rope_head_dim, num_attention_heads (H), index_n_heads, index_head_dim,
//   index_topk, max_position_embeddings (max_context).
// - sm_scale = (qk_nope_head_dim + qk_rope_head_dim)^-0.5, times mscale^2 when `rope_parameters`
//   (or the older `rope_scaling`) is not the default type and has mscale_all_dim:
//   mscale = 0.1 * mscale_all_dim * ln(factor) + 1 (factor > 1), as transformers' attention does.
// Everything else (page_size, selection, prefill) keeps attnd's defaults. The name is the
// config's model_type. INVALID_ARGUMENT for another model_type, a malformed field or a spec
// that does not validate.
absl::StatusOr<ModelSpec> SpecFromHfConfig(absl::string_view config_json);

}  // namespace attnd
