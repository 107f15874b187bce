#include "common/model_spec.h"

#include <gtest/gtest.h>

#include <cmath>

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

}  // namespace
}  // namespace attnd
