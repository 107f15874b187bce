// Tenants in the engine (docs/trust.md): namespaces for sequences and steps, steps bound to their
// tenant and channel (open or ended), random step ids, and quotas that count every page held.
#include <gtest/gtest.h>

#include <set>

#include "tests/engine_harness.h"
#include "tests/run_layer.h"

namespace attnd::testing {
namespace {

EngineOptions Options() {
  EngineOptions o;
  o.spec = PresetModelSpec("tiny").value();
  o.cache_dtype = DType::kF32;
  o.pages_per_device = 128;
  o.threads = 2;
  return o;
}

// Runs every layer of `tenant`'s step over `batch` (T tokens); returns the first error.
absl::Status RunStep(Engine& e, const std::string& tenant, const std::vector<StepEntry>& batch,
                     uint64_t seed, uint64_t channel = 0) {
  int64_t T = 0;
  for (const auto& b : batch) T += b.q_len;
  StepOptions o;
  o.tenant = tenant;
  o.channel = channel;
  auto step = e.BeginStep(batch, o);
  if (!step.ok()) return step.status();
  const ModelSpec& s = e.spec();
  std::vector<float> out(static_cast<size_t>(T) * s.num_heads * s.kv_lora_rank);
  const auto layers = RandomLayers(s, T, DType::kF32, seed);
  for (int l = 0; l < s.num_layers(); ++l) {
    const absl::Status r = RunLayerInto(e, StepRef(tenant, *step, channel), l, layers[l].inputs(),
                                        out.data(), out.size() * sizeof(float));
    if (!r.ok()) return r;
  }
  return absl::OkStatus();
}

TEST(EngineTenants, TheSameIdInTwoTenantsNamesTwoSequences) {
  auto e = Engine::Create(Options()).value();
  ASSERT_TRUE(e->OpenSequence({"a", "s"}).ok());
  ASSERT_TRUE(e->OpenSequence({"b", "s"}).ok());
  EXPECT_EQ(e->OpenSequence({"a", "s"}).code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(RunStep(*e, "a", {{"s", 21}}, 1).ok());
  EXPECT_EQ(e->DescribeSequence({"a", "s"})->length, 21);
  EXPECT_EQ(e->DescribeSequence({"b", "s"})->length, 0);
  EXPECT_EQ(e->DescribeSequence("s").status().code(), absl::StatusCode::kNotFound)
      << "the anonymous tenant is a tenant too";
  // A fork's parent is looked up in the child's tenant.
  EXPECT_EQ(e->ForkSequence({"c", "f"}, "s", 4).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(e->ForkSequence({"a", "f"}, "s", 4).ok());
  const auto all = e->ListSequences(nullptr);
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0].tenant, "a");
  EXPECT_EQ(all[0].id, "f");
  EXPECT_EQ(all[2].tenant, "b");
  const std::string a = "a";
  EXPECT_EQ(e->ListSequences(&a).size(), 2u);
  for (const SequenceKey& k : {SequenceKey("a", "s"), SequenceKey("a", "f"), SequenceKey("b", "s")})
    EXPECT_TRUE(e->CloseSequence(k).ok());
  EXPECT_EQ(e->Capacity()[0].pages_free, e->Capacity()[0].pages_total);
}

TEST(EngineTenants, AnotherTenantsOrChannelsStepIsNotFoundOpenOrEnded) {
  auto e = Engine::Create(Options()).value();
  ASSERT_TRUE(e->OpenSequence({"a", "s"}).ok());
  StepOptions o;
  o.tenant = "a";
  o.channel = 7;
  auto step = e->BeginStep({{"s", 3}}, o);
  ASSERT_TRUE(step.ok());
  const std::string absent = absl::StrCat("step ", *step, " not found");
  for (const StepRef& stranger : {StepRef("b", *step, 7), StepRef("a", *step, 0), StepRef(*step)}) {
    const auto d = e->DescribeStep(stranger);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(d.status().message(), absent);
    EXPECT_EQ(e->AbortStep(stranger).code(), absl::StatusCode::kNotFound);
    const auto layers = RandomLayers(e->spec(), 3, DType::kF32, 2);
    std::vector<float> out(3 * e->spec().num_heads * e->spec().kv_lora_rank);
    EXPECT_EQ(RunLayerInto(*e, stranger, 0, layers[0].inputs(), out.data(), out.size() * 4).code(),
              absl::StatusCode::kNotFound);
  }
  EXPECT_TRUE(e->DescribeStep(StepRef("a", *step, 7)).ok()) << "strangers changed nothing";
  EXPECT_EQ(e->num_open_steps(), 1);
  ASSERT_TRUE(e->AbortStep(StepRef("a", *step, 7)).ok());
  // Ended: its owner hears its fate, everyone else that it does not exist.
  EXPECT_EQ(e->DescribeStep(StepRef("a", *step, 7)).status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(e->DescribeStep(StepRef("b", *step, 7)).status().message(), absent);
  EXPECT_EQ(e->num_open_steps(), 0);
  EXPECT_EQ(e->DescribeSequence({"a", "s"})->length, 0);
  ASSERT_TRUE(e->CloseSequence({"a", "s"}).ok());
}

TEST(EngineTenants, StepIdsAreRandomAndDistinct) {
  auto e = Engine::Create(Options()).value();
  ASSERT_TRUE(e->OpenSequence("s").ok());
  std::set<uint64_t> ids;
  int high = 0;
  for (int i = 0; i < 200; ++i) {
    auto step = e->BeginStep({{"s", 1}});
    ASSERT_TRUE(step.ok());
    EXPECT_NE(*step, 0u);
    high += *step >> 56 != 0;
    ids.insert(*step);
    ASSERT_TRUE(e->AbortStep(*step).ok());
  }
  EXPECT_EQ(ids.size(), 200u);
  EXPECT_GT(high, 180) << "ids are not spread over 64 bits";
}

TEST(EngineTenants, QuotasCountEveryPageHeldAndReleaseItOnAbortAndClose) {
  EngineOptions opts = Options();
  opts.limits.tenant_quota = {/*pages=*/4, /*sequences=*/2, /*open_steps=*/1, 0};
  auto e = Engine::Create(opts).value();
  const int P = e->spec().page_size;
  e->SetTenantQuotas(opts.limits.tenant_quota, {{"big", TenantQuota{}}});  // big: no limits
  auto expect_quota = [](const absl::Status& s, const char* quota) {
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find(absl::StrCat("tenant quota ", quota)), std::string::npos) << s;
  };
  ASSERT_TRUE(e->OpenSequence({"q", "s1"}).ok());
  ASSERT_TRUE(e->OpenSequence({"q", "s2"}).ok());
  expect_quota(e->OpenSequence({"q", "s3"}), "sequences");
  const int32_t free0 = e->Capacity()[0].pages_free;
  // A step needing 5 pages is refused before anything is reserved.
  StepOptions q;
  q.tenant = "q";
  expect_quota(e->BeginStep({{"s1", 4 * P + 1}}, q).status(), "pages");
  EXPECT_EQ(e->Capacity()[0].pages_free, free0);
  // 4 pages reserved by an open step count; a second step is refused; the abort frees them.
  auto open = e->BeginStep({{"s1", 4 * P}}, q);
  ASSERT_TRUE(open.ok());
  EXPECT_EQ(e->TenantUsageOf("q").pages, 4);
  EXPECT_EQ(e->TenantUsageOf("q").open_steps, 1);
  expect_quota(e->BeginStep({{"s2", 1}}, q).status(), "steps");
  ASSERT_TRUE(e->AbortStep(StepRef("q", *open)).ok());
  EXPECT_EQ(e->TenantUsageOf("q").pages, 0);
  EXPECT_EQ(e->TenantUsageOf("q").open_steps, 0);
  // Committed pages count; a fork counts every page of the child, shared ones too.
  ASSERT_TRUE(RunStep(*e, "q", {{"s1", 3 * P}}, 3).ok());
  EXPECT_EQ(e->TenantUsageOf("q").pages, 3);
  ASSERT_TRUE(e->CloseSequence({"q", "s2"}).ok());
  expect_quota(e->ForkSequence({"q", "f"}, "s1", 2 * P), "pages");
  EXPECT_EQ(e->TenantUsageOf("q").pages, 3);
  ASSERT_TRUE(e->ForkSequence({"q", "f"}, "s1", P).ok());
  EXPECT_EQ(e->TenantUsageOf("q").pages, 4);
  // Another tenant is held to its own quota, not q's.
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(e->OpenSequence({"big", absl::StrCat("b", i)}).ok());
  ASSERT_TRUE(RunStep(*e, "big", {{"b0", 8 * P}}, 4).ok());
  EXPECT_EQ(e->TenantUsageOf("big").pages, 8);
  for (const SequenceKey& k :
       {SequenceKey("q", "s1"), SequenceKey("q", "f"), SequenceKey("big", "b0"),
        SequenceKey("big", "b1"), SequenceKey("big", "b2")})
    ASSERT_TRUE(e->CloseSequence(k).ok());
  EXPECT_EQ(e->TenantUsageOf("q").pages, 0);
  EXPECT_EQ(e->TenantUsageOf("q").sequences, 0);
  EXPECT_EQ(e->TenantUsageOf("big").pages, 0);
  EXPECT_EQ(e->Capacity()[0].pages_free, e->Capacity()[0].pages_total);
}

}  // namespace
}  // namespace attnd::testing
