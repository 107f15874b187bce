// The step plan: how a batch is split by device, each token's row, position, sequence and slot,
// the page tables, which queries need the indexer, and the query blocks.
#include "engine/step_plan.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace attnd {
namespace {

ModelSpec Spec() {
  ModelSpec s = PresetModelSpec("tiny").value();  // page size 16
  s.index_topk = 20;
  s.selection = SelectionMode::kToken;
  return s;
}

TEST(StepPlan, SplitsTheBatchByDeviceAndPlacesEveryToken) {
  const ModelSpec s = Spec();
  const int ps = s.page_size;
  // a: 30 committed + 5 new on device 1; b: 0 + 3 on device 0; c: 18 + 1 on device 1.
  const std::vector<int32_t> pa = {4, 9, 2}, pb = {7}, pc = {3, 8};
  const StepPlan plan = StepPlan::Build(s, {{1, 30, 5, &pa}, {0, 0, 3, &pb}, {1, 18, 1, &pc}});
  EXPECT_EQ(plan.tokens, 9);
  ASSERT_EQ(plan.shares.size(), 2u);
  const StepShare& d0 = plan.shares[0].share;
  const StepShare& d1 = plan.shares[1].share;
  EXPECT_EQ(plan.shares[0].device, 0);
  EXPECT_EQ(plan.shares[1].device, 1);
  // Rows: a is rows 0..4, b rows 5..7, c row 8.
  EXPECT_EQ(d0.rows, (std::vector<int64_t>{5, 6, 7}));
  EXPECT_EQ(d1.rows, (std::vector<int64_t>{0, 1, 2, 3, 4, 8}));
  EXPECT_EQ(d1.pos, (std::vector<int64_t>{30, 31, 32, 33, 34, 18}));
  EXPECT_EQ(d1.seq, (std::vector<int32_t>{0, 0, 0, 0, 0, 1}));
  EXPECT_EQ(d1.indptr, (std::vector<int32_t>{0, 3, 5}));
  EXPECT_EQ(d1.pages, (std::vector<int32_t>{4, 9, 2, 3, 8}));
  // Position 30 of a is on its page 1 (physical 9), row 14; 32 on page 2 (physical 2), row 0.
  EXPECT_EQ(d1.slot[0], 9 * ps + 14);
  EXPECT_EQ(d1.slot[2], 2 * ps + 0);
  EXPECT_EQ(d1.slot[5], 8 * ps + 2);
  for (int64_t i = 0; i < d1.size(); ++i)
    EXPECT_EQ(d1.slot[i], d1.table().Slot(d1.seq[i], d1.pos[i]));
  EXPECT_EQ(d0.slot, (std::vector<int32_t>{7 * ps, 7 * ps + 1, 7 * ps + 2}));
  EXPECT_EQ(d1.page_size, ps);
}

TEST(StepPlan, OnlyQueriesWhoseSelectionCouldMissAKeyNeedTheIndexer) {
  ModelSpec s = Spec();
  s.prefill = PrefillMode::kSparse;
  const std::vector<int32_t> pages = {1, 2, 3};
  // Positions 15..24: a query at position p sees p + 1 keys; top-20 covers up to 20 keys.
  const StepPlan plan = StepPlan::Build(s, {{0, 15, 10, &pages}});
  const StepShare& sh = plan.shares[0].share;
  for (int64_t i = 0; i < sh.size(); ++i)
    EXPECT_EQ(sh.needs_index[i], sh.pos[i] + 1 > 20) << "pos " << sh.pos[i];
  EXPECT_EQ(sh.max_selected, 20);
  // Dense prefill attends every visible key: no query of a q_len > 1 entry needs the indexer,
  // a single-token (decode) entry still does.
  s.prefill = PrefillMode::kDense;
  const StepPlan dense = StepPlan::Build(s, {{0, 15, 10, &pages}, {0, 40, 1, &pages}});
  const StepShare& dd = dense.shares[0].share;
  for (int64_t i = 0; i < 10; ++i) EXPECT_EQ(dd.needs_index[i], 0);
  EXPECT_EQ(dd.needs_index[10], 1);
}

TEST(StepPlan, AnImportPlansKeysAloneNoIndexerNoBlocksNoSelection) {
  const ModelSpec s = Spec();
  std::vector<int32_t> pages = {1, 2, 3, 4, 5};
  const StepPlan plan = StepPlan::Build(s, {{0, 15, 60, &pages}}, /*write_only=*/true);
  ASSERT_EQ(plan.shares.size(), 1u);
  const StepShare& sh = plan.shares[0].share;
  EXPECT_TRUE(sh.write_only);
  EXPECT_EQ(sh.size(), 60);
  EXPECT_EQ(sh.pos.front(), 15);
  EXPECT_EQ(sh.pos.back(), 74);
  EXPECT_TRUE(
      std::all_of(sh.needs_index.begin(), sh.needs_index.end(), [](uint8_t x) { return x == 0; }));
  EXPECT_TRUE(sh.dense_blocks.empty());
  EXPECT_TRUE(sh.sparse_blocks.empty());
  EXPECT_EQ(sh.max_selected, 0);
  // The same batch as a step that attends: long histories need the indexer.
  const StepPlan attending = StepPlan::Build(s, {{0, 15, 60, &pages}});
  const StepShare& attends = attending.shares[0].share;
  EXPECT_FALSE(attends.write_only);
  EXPECT_GT(std::count(attends.needs_index.begin(), attends.needs_index.end(), 1), 0);
  EXPECT_GT(attends.max_selected, 0);
}

TEST(StepPlan, QueryBlocksCoverRangeQueriesOfOneSequenceInOrder) {
  ModelSpec s = Spec();
  s.prefill = PrefillMode::kSparse;
  const std::vector<int32_t> a = {1, 2}, b = {3};
  // a: positions 0..18 (19 queries, all attend everything: <= 20 keys); b: 10..13 (4).
  const StepPlan plan = StepPlan::Build(s, {{0, 0, 19, &a}, {0, 10, 4, &b}});
  const StepShare& sh = plan.shares[0].share;
  const std::vector<std::pair<int32_t, int32_t>> want = {{0, 8}, {8, 8}, {16, 3}, {19, 4}};
  ASSERT_EQ(sh.dense_blocks.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(sh.dense_blocks[i].first, want[i].first);
    EXPECT_EQ(sh.dense_blocks[i].count, want[i].second);
  }
  // No block mixes sequences, and on sparse layers blocks hold only queries needing no indexer.
  const StepPlan long_plan = StepPlan::Build(s, {{0, 14, 12, &a}});  // positions 14..25
  const StepShare& ls = long_plan.shares[0].share;
  int32_t covered = 0;
  for (const QueryBlock& q : ls.sparse_blocks)
    for (int32_t i = q.first; i < q.first + q.count; ++i) {
      EXPECT_EQ(ls.needs_index[i], 0);
      ++covered;
    }
  int32_t range = 0;
  for (int64_t i = 0; i < ls.size(); ++i) range += !ls.needs_index[i];
  EXPECT_EQ(covered, range);
  EXPECT_EQ(range, 6);  // positions 14..19
}

TEST(StepPlan, TraceListsTheVisibleRangeOrTheSelection) {
  ModelSpec s = Spec();
  s.prefill = PrefillMode::kSparse;
  const std::vector<int32_t> pages = {1, 2};
  const StepPlan plan = StepPlan::Build(s, {{0, 3, 1, &pages}, {0, 25, 1, &pages}});
  const StepShare& sh = plan.shares[0].share;
  std::vector<std::vector<int32_t>> selected = {{}, {0, 5, 25}};
  std::vector<std::vector<int32_t>> keys(2);
  TraceAttended(s, LayerKind::kFull, sh, &selected, &keys);
  EXPECT_EQ(keys[0], (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(keys[1], (std::vector<int32_t>{0, 5, 25}));
}

}  // namespace
}  // namespace attnd
