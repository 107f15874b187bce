// Several devices in one engine (CPU devices here, through the same interface a GPU server
// uses): placement, batches spanning devices, page migration and forks across devices.
#include <gtest/gtest.h>

#include "tests/engine_harness.h"

namespace attnd::testing {
namespace {

EngineOptions Options(int devices, int32_t pages = 64, DType cache = DType::kF32) {
  EngineOptions o;
  o.spec = PresetModelSpec("tiny").value();
  o.cache_dtype = cache;
  o.num_devices = devices;
  o.pages_per_device = pages;
  o.threads = 2;
  return o;
}

int DeviceOf(Engine& e, const std::string& id) { return e.DescribeSequence(id)->device; }

TEST(Devices, PlacementPutsNewSequencesOnTheDeviceWithMostFreePages) {
  Harness h(Options(3));
  h.Open("a");
  EXPECT_EQ(DeviceOf(h.engine(), "a"), 0);  // ties: lowest index
  h.RunAndCheck({{"a", 40}}, DType::kF32, 1, 1e-5);
  h.Open("b");
  EXPECT_EQ(DeviceOf(h.engine(), "b"), 1);
  h.RunAndCheck({{"b", 20}}, DType::kF32, 2, 1e-5);
  h.Open("c");
  EXPECT_EQ(DeviceOf(h.engine(), "c"), 2);
  h.RunAndCheck({{"c", 60}}, DType::kF32, 3, 1e-5);
  h.Open("d");
  EXPECT_EQ(DeviceOf(h.engine(), "d"), 1);  // b used 2 pages, a 3, c 4
  const auto caps = h.engine().Capacity();
  ASSERT_EQ(caps.size(), 3u);
  EXPECT_EQ(caps[0].name, "cpu:0");
  EXPECT_EQ(caps[2].name, "cpu:2");
  EXPECT_EQ(caps[1].sequences, 2);
}

TEST(Devices, ABatchSpanningDevicesMatchesTheReferenceAndASingleDeviceRun) {
  Harness multi(Options(2));
  Harness single(Options(1, 128));
  for (Harness* h : {&multi, &single}) {
    h->Open("x", h == &multi ? 0 : -1);
    h->Open("y", h == &multi ? 1 : -1);
  }
  ASSERT_NE(DeviceOf(multi.engine(), "x"), DeviceOf(multi.engine(), "y"));
  for (int step = 0; step < 5; ++step) {
    const std::vector<StepEntry> batch = step == 0 ? std::vector<StepEntry>{{"x", 45}, {"y", 30}}
                                                   : std::vector<StepEntry>{{"y", 1}, {"x", 2}};
    const auto a = multi.RunAndCheck(batch, DType::kF32, 10 + step, 1e-5);
    const auto b = single.RunAndCheck(batch, DType::kF32, 10 + step, 1e-5);
    EXPECT_EQ(a, b) << "step " << step << ": results do not depend on the device";
  }
}

// Migration and forks across devices on an fp32 cache and on an fp8 one (whose indexer pages keep
// their values and scales apart: every copy path moves both).
class CacheKinds : public ::testing::TestWithParam<DType> {};

TEST_P(CacheKinds, MigrationMovesPagesAndLeavesOutputsUnchanged) {
  Harness h(Options(2, 64, GetParam()));
  h.Open("p", 0);
  h.RunAndCheck({{"p", 70}}, DType::kF32, 1, 1e-5);
  h.Fork("stay", "p", 70);
  h.Fork("move", "p", 70);
  const auto free_before = h.engine().Capacity();
  ASSERT_TRUE(h.engine().MigrateSequence("move", 1).ok());
  EXPECT_EQ(DeviceOf(h.engine(), "move"), 1);
  const auto free_after = h.engine().Capacity();
  // "move" shared 4 full pages with its parent (still referenced) and owned one partial page.
  EXPECT_EQ(free_after[0].pages_free, free_before[0].pages_free + 1);
  EXPECT_EQ(free_after[1].pages_free, free_before[1].pages_free - 5);
  EXPECT_EQ(h.engine().DescribeSequence("move")->length, 70);
  // The migrated twin computes exactly what the one left behind computes.
  const auto in = h.MakeInputs({{"stay", 3}}, DType::kF32, 2);
  auto a = h.Run({{"stay", 3}}, in);
  auto b = h.Run({{"move", 3}}, in);
  ASSERT_TRUE(a.status.ok() && b.status.ok());
  for (size_t l = 0; l < a.out.size(); ++l) EXPECT_EQ(a.out[l], b.out[l]) << "layer " << l;
  h.RunAndCheck({{"move", 1}, {"stay", 1}}, DType::kF32, 3, 1e-5);
  // And back again.
  ASSERT_TRUE(h.engine().MigrateSequence("move", 0).ok());
  h.RunAndCheck({{"move", 1}}, DType::kF32, 4, 1e-5);
  EXPECT_TRUE(h.engine().ReservedPageUntouched(0));
  EXPECT_TRUE(h.engine().ReservedPageUntouched(1));
}

TEST_P(CacheKinds, ForkAcrossDevicesEqualsAForkOnTheSameDevice) {
  Harness h(Options(2, 64, GetParam()));
  h.Open("p", 0);
  h.RunAndCheck({{"p", 50}}, DType::kF32, 1, 1e-5);
  h.Fork("same", "p", 37, 0);
  h.Fork("other", "p", 37, 1);
  EXPECT_EQ(DeviceOf(h.engine(), "other"), 1);
  const auto in = h.MakeInputs({{"same", 4}}, DType::kF32, 2);
  auto a = h.Run({{"same", 4}}, in);
  auto b = h.Run({{"other", 4}}, in);
  ASSERT_TRUE(a.status.ok() && b.status.ok());
  for (size_t l = 0; l < a.out.size(); ++l) EXPECT_EQ(a.out[l], b.out[l]);
  h.Close("p");  // the cross-device child owns all its pages
  h.RunAndCheck({{"other", 1}, {"same", 1}}, DType::kF32, 3, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Devices, CacheKinds, ::testing::Values(DType::kF32, DType::kFP8E4M3),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

TEST(Devices, MigrationIsRefusedMidStepOrWhenTheTargetIsFullAndChangesNothing) {
  Harness h(Options(2, 8));  // 7 usable pages per device
  h.Open("a", 0);
  h.RunAndCheck({{"a", 60}}, DType::kF32, 1, 1e-5);  // 4 pages
  h.Open("b", 1);
  h.RunAndCheck({{"b", 64}}, DType::kF32, 2, 1e-5);  // 4 pages: device 1 has 3 free
  auto step = h.engine().BeginStep({{"a", 1}});
  ASSERT_TRUE(step.ok());
  EXPECT_EQ(h.engine().MigrateSequence("a", 1).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(h.engine().AbortStep(*step).ok());
  const auto before = h.engine().DescribeSequence("a").value();
  const auto caps = h.engine().Capacity();
  const auto st = h.engine().MigrateSequence("a", 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("KV cache full on cpu:1"), std::string::npos) << st;
  const auto after = h.engine().DescribeSequence("a").value();
  EXPECT_EQ(after.pages, before.pages);
  EXPECT_EQ(after.device, 0);
  EXPECT_EQ(h.engine().Capacity()[1].pages_free, caps[1].pages_free);
  EXPECT_EQ(h.engine().MigrateSequence("a", 2).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(h.engine().MigrateSequence("zz", 1).code(), absl::StatusCode::kNotFound);
  h.RunAndCheck({{"a", 1}}, DType::kF32, 3, 1e-5);
}

}  // namespace
}  // namespace attnd::testing
