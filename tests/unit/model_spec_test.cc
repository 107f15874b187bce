#include "common/model_spec.h"

#include <gtest/gtest.h>

#include <cmath>

#include "common/hf_config.h"

namespace attnd {
namespace {

TEST(ModelSpec, PresetsHaveTheirPublishedShapes) {
  auto ds = PresetModelSpec("deepseek-v3.2");
  ASSERT_TRUE(ds.ok());
  EXPECT_EQ(ds->num_layers(), 61);
  EXPECT_EQ(ds->num_full_layers(), 61);
  EXPECT_EQ(ds->num_heads, 128);
  EXPECT_EQ(ds->index_n_heads, 64);
  EXPECT_EQ(ds->latent_dim(), 576);
  // 192^-0.5 · mscale², mscale = 0.1 ln 40 + 1: not 576^-0.5.
  EXPECT_NEAR(ds->sm_scale, 0.135234, 1e-5);

  auto glm = PresetModelSpec("glm-5");
  ASSERT_TRUE(glm.ok());
  EXPECT_EQ(glm->num_layers(), 78);
  EXPECT_EQ(glm->num_full_layers(), 78);
  EXPECT_DOUBLE_EQ(glm->sm_scale, 0.0625);

  auto glm52 = PresetModelSpec("glm-5.2");
  ASSERT_TRUE(glm52.ok());
  EXPECT_EQ(glm52->num_layers(), 78);
  EXPECT_EQ(glm52->num_full_layers(), 21);
  std::vector<int> full;
  for (int i = 0; i < 78; ++i)
    if (glm52->layers[i] == LayerKind::kFull) full.push_back(i);
  EXPECT_EQ(full.front(), 0);
  EXPECT_EQ((std::vector<int>(full.begin(), full.begin() + 5)), (std::vector<int>{0, 1, 2, 6, 10}));
  EXPECT_EQ(full.back(), 74);
  EXPECT_EQ(glm52->FullSlot(6), 3);
  EXPECT_EQ(glm52->FullSlot(3), -1);

  for (const auto& name : PresetModelNames()) EXPECT_TRUE(PresetModelSpec(name).ok()) << name;
  EXPECT_EQ(PresetModelSpec("gpt-2").status().code(), absl::StatusCode::kNotFound);
}

TEST(ModelSpec, JsonFormOverridesABase) {
  auto s = ParseModelSpecJson(R"({"base": "tiny", "name": "t2", "layers": "FSD",
      "index_topk": 8, "selection": "page_budget:3", "prefill": "dense",
      "sliding_window": 16, "soft_cap": 30.5, "sm_scale": 0.125})");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->name, "t2");
  EXPECT_EQ(s->num_layers(), 3);
  EXPECT_EQ(s->layers[2], LayerKind::kDense);
  EXPECT_EQ(s->index_topk, 8);
  EXPECT_EQ(s->selection, SelectionMode::kPageBudget);
  EXPECT_EQ(s->page_budget, 3);
  EXPECT_EQ(s->prefill, PrefillMode::kDense);
  EXPECT_EQ(s->sliding_window, 16);
  EXPECT_DOUBLE_EQ(s->soft_cap, 30.5);
  EXPECT_EQ(s->kv_lora_rank, 32);  // from the base
  auto list = ParseModelSpecJson(R"({"base": "tiny", "layers": ["full", "shared"]})");
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->layers[1], LayerKind::kShared);
}

TEST(ModelSpec, InvalidSpecsGiveClearErrors) {
  struct Case {
    const char* json;
    const char* needle;
  } cases[] = {
      {R"({"base": "tiny", "layers": "SF"})", "shared layer 0 has no full layer before it"},
      {R"({"base": "tiny", "kv_lora_rank": 0})", "kv_lora_rank"},
      {R"({"base": "tiny", "num_heads": 0})", "num_heads"},
      {R"({"base": "tiny", "index_topk": 0})", "index_topk"},
      {R"({"base": "tiny", "page_size": 24})", "page_size"},
      {R"({"base": "tiny", "page_size": 0})", "page_size"},
      {R"({"base": "tiny", "sm_scale": 0})", "sm_scale"},
      {R"({"base": "tiny", "selection": "page_budget:0"})", "page_budget"},
      {R"({"base": "tiny", "selection": "best"})", "selection"},
      {R"({"base": "tiny", "index_head_dim": 0})", "index_head_dim"},
      {R"({"base": "tiny", "layers": "FX"})", "unknown layer kind"},
      {R"({"base": "tiny", "bogus": 1})", "unknown key 'bogus'"},
      {R"({"base": "tiny", "num_heads": 2.5})", "integer"},
      {R"({"base": "tiny", )", "model spec JSON"},
      {R"({"layers": "F", "sm_scale": 0.1})", nullptr},  // defaults + layers + scale: valid
      {R"({"layers": "F"})", "sm_scale"},                // no scale given: never derived
  };
  for (const auto& c : cases) {
    auto s = ParseModelSpecJson(c.json);
    if (c.needle == nullptr) {
      EXPECT_TRUE(s.ok()) << c.json << ": " << s.status();
      continue;
    }
    ASSERT_FALSE(s.ok()) << c.json;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << c.json;
    EXPECT_NE(s.status().message().find(c.needle), std::string::npos)
        << c.json << " -> " << s.status().message();
  }
}

// The fields of the published config.json files that attnd reads (with their neighbours, as
// published; quantization_config and tokenizer ids trimmed).
constexpr const char* kDeepSeekV32Config = R"({
  "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
  "attention_bias": false, "first_k_dense_replace": 3, "hidden_size": 7168,
  "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048, "intermediate_size": 18432,
  "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
  "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "num_attention_heads": 128,
  "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
  "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                   "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                   "type": "yarn"},
  "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
  "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280})";
constexpr const char* kGlm5Config = R"({
  "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
  "attention_bias": false, "first_k_dense_replace": 3, "head_dim": 64, "hidden_size": 6144,
  "index_head_dim": 128, "index_n_heads": 32, "index_topk": 2048,
  "indexer_rope_interleave": true, "intermediate_size": 12288, "kv_lora_rank": 512,
  "max_position_embeddings": 202752, "moe_intermediate_size": 2048, "n_routed_experts": 256,
  "num_attention_heads": 64, "num_hidden_layers": 78, "num_key_value_heads": 64,
  "q_lora_rank": 2048, "qk_head_dim": 256, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
  "rope_interleave": true, "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
  "v_head_dim": 256, "vocab_size": 154880})";
constexpr const char* kGlm52Config = R"({
  "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
  "first_k_dense_replace": 3, "hidden_size": 6144, "index_head_dim": 128, "index_n_heads": 32,
  "index_topk": 2048, "index_topk_freq": 4, "index_skip_topk_offset": 3,
  "index_share_for_mtp_iteration": true, "indexer_rope_interleave": true, "kv_lora_rank": 512,
  "max_position_embeddings": 1048576, "num_attention_heads": 64, "num_hidden_layers": 78,
  "q_lora_rank": 2048, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
  "rope_parameters": {"rope_theta": 8000000, "rope_type": "default"}})";

void ExpectSameSpec(const ModelSpec& got, const ModelSpec& want) {
  EXPECT_EQ(got.layers, want.layers) << want.name;
  EXPECT_EQ(got.kv_lora_rank, want.kv_lora_rank) << want.name;
  EXPECT_EQ(got.qk_rope_head_dim, want.qk_rope_head_dim) << want.name;
  EXPECT_EQ(got.num_heads, want.num_heads) << want.name;
  EXPECT_EQ(got.index_n_heads, want.index_n_heads) << want.name;
  EXPECT_EQ(got.index_head_dim, want.index_head_dim) << want.name;
  EXPECT_EQ(got.index_topk, want.index_topk) << want.name;
  EXPECT_EQ(got.page_size, want.page_size) << want.name;
  EXPECT_NEAR(got.sm_scale, want.sm_scale, 1e-15 * want.sm_scale) << want.name;
  EXPECT_EQ(got.max_context, want.max_context) << want.name;
  EXPECT_EQ(got.selection, want.selection) << want.name;
  EXPECT_EQ(got.prefill, want.prefill) << want.name;
}

TEST(HfConfig, ThePublishedConfigsGiveThePresets) {
  const std::pair<const char*, const char*> cases[] = {
      {kDeepSeekV32Config, "deepseek-v3.2"}, {kGlm5Config, "glm-5"}, {kGlm52Config, "glm-5.2"}};
  for (const auto& [config, preset] : cases) {
    auto s = SpecFromHfConfig(config);
    ASSERT_TRUE(s.ok()) << preset << ": " << s.status();
    ExpectSameSpec(*s, PresetModelSpec(preset).value());
  }
  // DeepSeek-V3.2's softmax scale carries YaRN's mscale^2 (factor 40): (0.1 ln 40 + 1)^2.
  EXPECT_NEAR(SpecFromHfConfig(kDeepSeekV32Config)->sm_scale * std::sqrt(192.0), 1.873854, 1e-6);
}

TEST(HfConfig, LayerSchedulesAsTransformersReadsThem) {
  auto kinds = [](const std::string& extra) {
    auto s =
        SpecFromHfConfig(R"({"model_type": "glm_moe_dsa", "num_hidden_layers": 8)" + extra + "}");
    EXPECT_TRUE(s.ok()) << extra << ": " << s.status();
    std::string out;
    for (LayerKind k : s->layers) out += k == LayerKind::kFull ? 'F' : 'S';
    return out;
  };
  EXPECT_EQ(kinds(""), "FFFFFFFF");  // freq 1: every layer runs its indexer
  EXPECT_EQ(kinds(R"(, "index_topk_freq": 4, "index_skip_topk_offset": 3)"), "FFFSSSFS");
  EXPECT_EQ(kinds(R"(, "index_topk_freq": 4, "index_skip_topk_offset": 2)"), "FFSSSFSS");
  EXPECT_EQ(kinds(R"(, "index_topk_freq": 3, "index_skip_topk_offset": 2)"), "FFSSFSSF");
  EXPECT_EQ(kinds(R"(, "index_topk_pattern": "FSFSFSSS")"), "FSFSFSSS");
  EXPECT_EQ(kinds(R"(, "indexer_types": ["full","shared","shared","full","full","shared",)"
                  R"("shared","shared"], "index_topk_freq": 2)"),
            "FSSFFSSS");  // an explicit list wins over the schedule
}

TEST(HfConfig, RefusalsSayWhat) {
  const std::pair<const char*, const char*> cases[] = {
      {R"({"model_type": "llama"})", "'model_type' is 'llama'"},
      {R"({"hidden_size": 8})", "'model_type' is missing"},
      {R"({"model_type": "deepseek_v32", "num_hidden_layers": 0})", "num_hidden_layers"},
      {R"({"model_type": "deepseek_v32", "kv_lora_rank": "big"})", "'kv_lora_rank' has the wrong"},
      {R"({"model_type": "deepseek_v32", "index_topk": 1.5})", "'index_topk' must be an integer"},
      {R"({"model_type": "glm_moe_dsa", "num_hidden_layers": 2, "indexer_types": ["full"]})",
       "has 1 entries for 2 layers"},
      {R"({"model_type": "glm_moe_dsa", "num_hidden_layers": 2, "indexer_types": ["shared",)"
       R"( "full"]})",
       "shared layer 0 has no full layer before it"},
      {R"({"model_type": "glm_moe_dsa", "num_hidden_layers": 1, "indexer_types": ["dense"]})",
       "is not \"full\" or \"shared\""},
      {R"({"model_type": "deepseek_v32", "rope_scaling": {"type": "yarn", "mscale_all_dim": 1}})",
       "'factor' is missing"},
      {R"({"model_type": "deepseek_v32", )", "not valid JSON"},
      {R"([1, 2])", "not an object"},
  };
  for (const auto& [json, needle] : cases) {
    auto s = SpecFromHfConfig(json);
    ASSERT_FALSE(s.ok()) << json;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << json;
    EXPECT_NE(s.status().message().find(needle), std::string::npos)
        << json << " -> " << s.status().message();
  }
}

}  // namespace
}  // namespace attnd
