// Standby copies through the engine (docs/replication.md): a copy fed its primary's keys by
// write-only steps and promoted decodes bit for bit as a sequence that never moved (also when
// promotion cuts it back to the length its worker knows); copies refuse ordinary steps, forks,
// other generations and mixed batches with nothing changed; promotion fences old generations,
// aborts a half-sent import, and is idempotent; copies are charged to the standby budget, not to
// their tenant, and spill before primaries. Every state is audited (CheckInvariants).
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "kv_store/cache_layout.h"
#include "tests/engine_harness.h"

namespace attnd::testing {
namespace {

EngineOptions Options(int32_t usable, int64_t standby_bytes = -1) {
  EngineOptions o = TestEngineOptions(MixedLayerSpec(SelectionMode::kToken), usable + 1);
  o.standby_cache_bytes = standby_bytes;
  return o;
}

void ExpectAudited(Engine& e) {
  const absl::Status s = e.CheckInvariants();
  EXPECT_TRUE(s.ok()) << s;
}

StepEntry Entry(const std::string& id, int64_t q, uint64_t generation) {
  StepEntry e{id, q};
  e.generation = generation;
  return e;
}

// The primary steps; its copy takes the same keys write-only; the worker saw only the first
// two steps confirmed when the primary died. Promoted at that length, the copy decodes as a twin
// that ran exactly the confirmed steps (checked against float64).
TEST(Standby, APromotedCopyDecodesBitForBitAsASequenceThatNeverMoved) {
  Harness primary(Options(64)), copy(Options(64)), twin(Options(64));
  Engine& c = copy.engine();
  primary.Open("s");
  twin.Open("s");
  copy.OpenStandby("s", 1);
  int64_t confirmed = 0;
  for (int k = 0; k < 3; ++k) {
    const int64_t q = k == 0 ? 37 : 1;
    const std::vector<StepEntry> batch{{"s", q}};
    const auto in = primary.MakeInputs(batch, DType::kF32, 10 + k);
    ASSERT_TRUE(primary.Run(batch, in).status.ok());
    ASSERT_TRUE(copy.Run({Entry("s", q, 1)}, in, StepOptions::WriteOnly()).status.ok());
    if (k < 2) {
      ASSERT_TRUE(twin.Run(batch, in).status.ok());
      confirmed += q;
    }
  }
  auto d = c.DescribeSequence("s");
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->standby);
  EXPECT_EQ(d->generation, 1u);
  EXPECT_EQ(d->length, 39);
  ExpectAudited(c);
  auto promoted = c.PromoteSequence("s", 1, confirmed);
  ASSERT_TRUE(promoted.ok()) << promoted.status();
  EXPECT_FALSE(promoted->standby);
  EXPECT_EQ(promoted->generation, 2u);
  EXPECT_EQ(promoted->length, confirmed);  // cut back to what the worker knows
  EXPECT_EQ(promoted->pages.size(), twin.engine().DescribeSequence("s")->pages.size());
  ExpectAudited(c);
  for (int k = 0; k < 3; ++k) {
    const std::vector<StepEntry> batch{{"s", k == 1 ? 5 : 1}};
    const auto want = twin.RunAndCheck(batch, DType::kF32, 20 + k, 1e-5);  // against float64
    const Harness::Result got =
        copy.Run({Entry("s", batch[0].q_len, 2)}, copy.MakeInputs(batch, DType::kF32, 20 + k));
    ASSERT_TRUE(got.status.ok()) << got.status;
    EXPECT_EQ(got.out, want) << "step " << k;  // bit for bit
  }
  ExpectAudited(c);
}

TEST(Standby, CopiesRefuseOrdinaryStepsForksOtherGenerationsAndMixedBatches) {
  Harness h(Options(64));
  Engine& e = h.engine();
  h.Open("p");
  ASSERT_TRUE(h.Run({{"p", 7}}, h.MakeInputs({{"p", 7}}, DType::kF32, 1)).status.ok());
  h.OpenStandby("c", 3);
  const auto keys = h.MakeInputs({Entry("c", 9, 3)}, DType::kF32, 2);
  ASSERT_TRUE(h.Run({Entry("c", 9, 3)}, keys, StepOptions::WriteOnly()).status.ok());
  const EngineSnapshot before = TakeSnapshot(e, {"p", "c"});
  auto refused = [&](const std::vector<StepEntry>& batch, StepOptions o, absl::StatusCode code,
                     const char* why) {
    const auto r = e.BeginStep(batch, o);
    EXPECT_EQ(r.status().code(), code) << why << ": " << r.status();
    EXPECT_TRUE(TakeSnapshot(e, {"p", "c"}) == before) << why;
  };
  refused({{"c", 1}}, {}, absl::StatusCode::kFailedPrecondition, "an ordinary step on a copy");
  refused({Entry("c", 1, 2)}, StepOptions::WriteOnly(), absl::StatusCode::kFailedPrecondition,
          "another generation");
  refused({Entry("c", 1, 3), {"p", 1}}, StepOptions::WriteOnly(),
          absl::StatusCode::kInvalidArgument, "copies and primaries in one step");
  refused({Entry("p", 1, 2)}, {}, absl::StatusCode::kFailedPrecondition, "a stale generation");
  StepEntry resent = Entry("c", 4, 3);
  resent.start = 5;  // the copy holds 9: a replication step it took already, sent again
  refused({resent}, StepOptions::WriteOnly(), absl::StatusCode::kFailedPrecondition,
          "a step starting before the copy's end");
  StepEntry ahead = Entry("p", 1, 0);
  ahead.start = 8;  // p holds 7
  refused({ahead}, {}, absl::StatusCode::kFailedPrecondition, "a step starting past the end");
  // Replication closes only the copy at its generation.
  EXPECT_EQ(e.CloseSequence("c", 2).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(e.CloseSequence("p", 1).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(TakeSnapshot(e, {"p", "c"}) == before);
  EXPECT_EQ(e.ForkSequence("child", "c", 4).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(e.OpenStandby("z", 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e.OpenStandby("z", (uint64_t{1} << 62) + 1).code(),
            absl::StatusCode::kInvalidArgument);  // promotions must not wrap to 0 ("not named")
  EXPECT_EQ(e.OpenStandby("c", 1).code(), absl::StatusCode::kAlreadyExists);
  // Promotion: only a copy, only at its generation; a retry answers as it is.
  EXPECT_EQ(e.PromoteSequence("p", 1, 7).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(e.PromoteSequence("c", 2, 9).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(e.PromoteSequence("nope", 1, 0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(TakeSnapshot(e, {"p", "c"}) == before);
  auto p = e.PromoteSequence("c", 3, 50);  // the worker knows more: the copy stays as it is
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->length, 9);
  EXPECT_EQ(p->generation, 4u);
  auto again = e.PromoteSequence("c", 3, 9);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->generation, 4u);
  EXPECT_EQ(again->length, 9);
  // Now a sequence: ordinary steps at its generation (or none named, or where it ends), forks.
  StepEntry at_end = Entry("c", 1, 4);
  at_end.start = 9;
  EXPECT_TRUE(h.Run({at_end}, h.MakeInputs({{"c", 1}}, DType::kF32, 3)).status.ok());
  EXPECT_TRUE(h.Run({{"c", 1}}, h.MakeInputs({{"c", 1}}, DType::kF32, 4)).status.ok());
  EXPECT_EQ(e.BeginStep({Entry("c", 1, 3)}).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(e.ForkSequence("child", "c", 4).ok());
  ExpectAudited(e);
}

// The dead primary's replication step, half sent when the worker promotes: aborted, the copy as
// it was before it.
TEST(Standby, PromotionAbortsAHalfSentImport) {
  Harness h(Options(64));
  Engine& e = h.engine();
  h.OpenStandby("c", 1);
  ASSERT_TRUE(h.Run({Entry("c", 20, 1)}, h.MakeInputs({{"c", 20}}, DType::kF32, 1),
                    StepOptions::WriteOnly())
                  .status.ok());
  auto step = e.BeginStep({Entry("c", 3, 1)}, StepOptions::WriteOnly());
  ASSERT_TRUE(step.ok()) << step.status();
  auto p = e.PromoteSequence("c", 1, 23);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->length, 20);
  EXPECT_FALSE(p->in_step);
  EXPECT_EQ(e.DescribeStep(*step).status().code(), absl::StatusCode::kCancelled);
  ExpectAudited(e);
}

// Copies count against --standby-cache-bytes, never against their tenant (until promoted), and
// are the first to go down a tier.
TEST(Standby, CopiesAreChargedToTheStandbyBudgetNotTheirTenant) {
  const ModelSpec spec = MixedLayerSpec(SelectionMode::kToken);
  EngineOptions o = Options(64);
  o.standby_cache_bytes =
      3 * static_cast<int64_t>(CacheLayout::ForModel(spec, o.cache_dtype, 0).BytesPerPage());
  o.limits.tenant_quota.pages = 2;
  Harness h(o);
  Engine& e = h.engine();
  const int32_t P = spec.page_size;
  h.OpenStandby("c", 1);
  ASSERT_TRUE(h.Run({Entry("c", 3 * P, 1)}, h.MakeInputs({{"c", 3 * P}}, DType::kF32, 1),
                    StepOptions::WriteOnly())
                  .status.ok());  // 3 pages: beyond the tenant's 2, within the budget's 3
  EXPECT_EQ(e.TenantUsageOf("").pages, 0);
  EXPECT_EQ(e.Standby().pages, 3);
  EXPECT_EQ(e.Standby().sequences, 1);
  EXPECT_EQ(e.Standby().budget_pages, 3);
  const EngineSnapshot before = TakeSnapshot(e, {"c"});
  const auto full = e.BeginStep({Entry("c", 1, 1)}, StepOptions::WriteOnly());
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted) << full.status();
  EXPECT_NE(full.status().message().find("--standby-cache-bytes"), std::string::npos);
  EXPECT_TRUE(TakeSnapshot(e, {"c"}) == before);
  ASSERT_TRUE(e.PromoteSequence("c", 1, 2 * P + 1).ok());  // cut back to 3 pages' first rows
  EXPECT_EQ(e.Standby().pages, 0);
  EXPECT_EQ(e.TenantUsageOf("").pages, 3);  // kept beyond the quota, as kept pages are
  EXPECT_EQ(e.DescribeSequence("c")->pages.size(), 3u);
  ExpectAudited(e);
  ASSERT_TRUE(e.CloseSequence("c").ok());
  EXPECT_EQ(e.TenantUsageOf("").pages, 0);
  ExpectAudited(e);
}

TEST(Standby, CopiesSpillBeforePrimaries) {
  EngineOptions o = Options(8);
  o.tiers.host_bytes = 16 * CacheLayout::ForModel(o.spec, o.cache_dtype, 0).BytesPerPage();
  Harness h(o);
  Engine& e = h.engine();
  const int32_t P = h.spec().page_size;
  h.Open("old");  // the least recently used: without copies it would go first
  ASSERT_TRUE(h.Run({{"old", 3 * P}}, h.MakeInputs({{"old", 3 * P}}, DType::kF32, 1)).status.ok());
  h.OpenStandby("c", 1);
  ASSERT_TRUE(h.Run({Entry("c", 3 * P, 1)}, h.MakeInputs({{"c", 3 * P}}, DType::kF32, 2),
                    StepOptions::WriteOnly())
                  .status.ok());
  h.Open("new");
  ASSERT_TRUE(h.Run({{"new", 3 * P}}, h.MakeInputs({{"new", 3 * P}}, DType::kF32, 3)).status.ok());
  EXPECT_EQ(e.DescribeSequence("c")->tier, Tier::kHost);
  EXPECT_EQ(e.DescribeSequence("old")->tier, Tier::kDevice);
  ExpectAudited(e);
}

// Leases (docs/replication.md#leases): a step whose commit_by passed before its last layer is
// aborted there (UNAVAILABLE) with nothing committed; the same step under a lease that holds
// commits, and the sequence decodes on against float64.
TEST(Standby, AStepWhoseLeaseRanOutBeforeItsLastLayerCommitsNothing) {
  Harness h(Options(64));
  Engine& e = h.engine();
  h.Open("s");
  h.RunAndCheck({{"s", 21}}, DType::kF32, 1, 1e-5);
  const EngineSnapshot before = TakeSnapshot(e, {"s"});
  const std::vector<StepEntry> batch{{"s", 3}};
  StepOptions late;
  late.commit_by = std::chrono::steady_clock::now() - std::chrono::milliseconds(1);
  const auto refused = h.Run(batch, h.MakeInputs(batch, DType::kF32, 2), late);
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kUnavailable) << refused.status;
  EXPECT_NE(refused.status.message().find("lease"), std::string::npos) << refused.status;
  EXPECT_TRUE(TakeSnapshot(e, {"s"}) == before) << "nothing committed, no step left open";
  ExpectAudited(e);
  StepOptions held;
  held.commit_by = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  const auto ok = h.Run(batch, h.MakeInputs(batch, DType::kF32, 3), held);
  ASSERT_TRUE(ok.status.ok()) << ok.status;
  EXPECT_EQ(h.Length("s"), 24);
  h.RunAndCheck({{"s", 1}}, DType::kF32, 4, 1e-5);
  ExpectAudited(e);
}

}  // namespace
}  // namespace attnd::testing
