// The FlashInfer MLA's work partition (kernels/cuda/ops/mla_flashinfer_plan.h), without a GPU:
// every key of every query is covered once, partial rows never collide, a query's chunks depend on
// its own key count only, the groups are balanced, and what the kernel computes in 32 bits fits.
#include "kernels/cuda/ops/mla_flashinfer_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <tuple>

namespace attnd::cuda {
namespace {

// Each query's list in a row of its own, `stride` entries apart (the selecting queries' layout).
FlashInferMlaPlanInput Input(std::vector<int64_t> keys, int heads = 128, int64_t stride = 2048,
                             int sms = 132) {
  FlashInferMlaPlanInput in;
  in.keys = std::move(keys);
  for (size_t q = 0; q < in.keys.size(); ++q) in.list_start.push_back(int64_t(q) * stride);
  in.list_entries = int64_t(in.keys.size()) * stride;
  in.heads = heads;
  in.multiprocessors = sms;
  return in;
}

using Chunks = std::map<int, std::vector<std::pair<int, int>>>;

// Checks everything the kernel and the merge rely on; puts each query's chunks, as
// (kv_start, kv_end) in order, into *chunks.
void CheckPlan(const FlashInferMlaPlanInput& in, const FlashInferMlaPlan& plan, Chunks* chunks) {
  std::set<int> seen_queries;
  int next_query = 0;
  for (const FlashInferMlaWave& w : plan.waves) {
    EXPECT_EQ(w.first_query, next_query);
    next_query += w.queries;
    EXPECT_GE(w.queries, 1);
    EXPECT_LE(w.partial_rows, plan.max_partial_rows);
    const int cluster_rows = w.blocks_x * kFlashInferMlaTileRows;
    EXPECT_GE(w.rows_per_chunk, in.heads);
    EXPECT_EQ(w.rows_per_chunk % cluster_rows, 0);
    ASSERT_EQ(w.work_indptr.size(), static_cast<size_t>(w.blocks_y + 1));
    EXPECT_EQ(w.work_indptr.front(), 0);
    for (int g = 0; g < w.blocks_y; ++g) EXPECT_LE(w.work_indptr[g], w.work_indptr[g + 1]);
    const size_t items = w.q_indptr.size();
    EXPECT_EQ(static_cast<size_t>(w.work_indptr.back()), items);
    for (const auto* v :
         {&w.kv_indptr, &w.partial_indptr, &w.q_len, &w.kv_len, &w.q_start, &w.kv_start, &w.kv_end})
      EXPECT_EQ(v->size(), items);
    // Every partial row a wave writes is written by exactly one item.
    std::vector<int> written(w.partial_rows, 0);
    std::map<std::tuple<int, int, int>, int> item_of;  // (query, tile, kv_start)
    for (size_t i = 0; i < items; ++i) {
      const int q = w.q_indptr[i];
      EXPECT_GE(q, w.first_query);
      EXPECT_LT(q, w.first_query + w.queries);
      EXPECT_EQ(w.q_len[i], 1);
      EXPECT_EQ(w.kv_len[i], in.keys[q]);
      EXPECT_EQ(w.kv_indptr[i], in.list_start[q]);
      EXPECT_EQ(w.kv_start[i] % kFlashInferMlaTileKeys, 0);
      EXPECT_LT(w.kv_start[i], w.kv_end[i]);
      EXPECT_LE(w.kv_end[i], in.keys[q]);
      EXPECT_EQ(w.q_start[i] % cluster_rows, 0);
      EXPECT_LT(w.q_start[i], in.heads);
      ASSERT_GE(w.partial_indptr[i], 0);
      ASSERT_LE(w.partial_indptr[i] + cluster_rows, w.partial_rows);
      for (int r = 0; r < cluster_rows; ++r) ++written[w.partial_indptr[i] + r];
      EXPECT_TRUE(item_of.insert({{q, w.q_start[i], w.kv_start[i]}, static_cast<int>(i)}).second);
      // The merge finds this item's head rows where it wrote them.
      const int local = q - w.first_query;
      const int64_t chunk_keys = FlashInferMlaChunkKeys(in.keys[q]);
      EXPECT_EQ(w.kv_start[i] % chunk_keys, 0);
      const int c = static_cast<int>(w.kv_start[i] / chunk_keys);
      EXPECT_LT(c, w.merge_chunks[local]);
      EXPECT_EQ(w.partial_indptr[i], w.merge_row[local] + c * w.rows_per_chunk + w.q_start[i]);
    }
    for (int64_t r = 0; r < w.partial_rows; ++r) ASSERT_EQ(written[r], 1) << "row " << r;
    // Each query: its chunks tile [0, keys) in order, every head tile of every chunk once.
    for (int local = 0; local < w.queries; ++local) {
      const int q = w.first_query + local;
      EXPECT_TRUE(seen_queries.insert(q).second);
      std::vector<std::pair<int, int>> mine;
      for (size_t i = 0; i < items; ++i)
        if (w.q_indptr[i] == q && w.q_start[i] == 0) mine.push_back({w.kv_start[i], w.kv_end[i]});
      std::sort(mine.begin(), mine.end());
      EXPECT_EQ(static_cast<int>(mine.size()), w.merge_chunks[local]);
      int at = 0;
      for (const auto& [b, e] : mine) {
        EXPECT_EQ(b, at);
        at = e;
      }
      EXPECT_EQ(at, in.keys[q]);
      for (int t = 0; t < w.rows_per_chunk; t += cluster_rows)
        for (const auto& [b, e] : mine) EXPECT_EQ(item_of.count({q, t, b}), t < in.heads ? 1u : 0u);
      (*chunks)[q] = mine;
    }
  }
  EXPECT_EQ(next_query, static_cast<int>(in.keys.size()));
}

Chunks CheckedChunks(const FlashInferMlaPlanInput& in) {
  const FlashInferMlaPlanResult r = PlanFlashInferMla(in);
  EXPECT_EQ(r.refused, "");
  Chunks c;
  CheckPlan(in, r.plan, &c);
  return c;
}

TEST(FlashInferMlaPlan, DeepSeekDecodeCoversEveryKeyOnceInChunksOf512) {
  const FlashInferMlaPlanInput in = Input(std::vector<int64_t>(64, 2048));
  const FlashInferMlaPlanResult r = PlanFlashInferMla(in);
  ASSERT_EQ(r.refused, "");
  ASSERT_EQ(r.plan.waves.size(), 1u);
  const FlashInferMlaWave& w = r.plan.waves[0];
  EXPECT_EQ(w.blocks_x, 2);   // 128 heads: two blocks of 64 rows
  EXPECT_EQ(w.blocks_y, 66);  // 132 multiprocessors
  EXPECT_EQ(w.rows_per_chunk, 128);
  EXPECT_EQ(w.partial_rows, 64 * 4 * 128);
  Chunks chunks;
  CheckPlan(in, r.plan, &chunks);
  for (const auto& [q, c] : chunks)
    EXPECT_EQ(
        c, (std::vector<std::pair<int, int>>{{0, 512}, {512, 1024}, {1024, 1536}, {1536, 2048}}));
}

TEST(FlashInferMlaPlan, TheChunkRuleIsTheTensorCoreKernelsSplitRule) {
  EXPECT_EQ(FlashInferMlaChunks(1), 1);
  EXPECT_EQ(FlashInferMlaChunkKeys(1), 512);
  EXPECT_EQ(FlashInferMlaChunks(512), 1);
  EXPECT_EQ(FlashInferMlaChunks(513), 2);
  EXPECT_EQ(FlashInferMlaChunks(2048), 4);
  EXPECT_EQ(FlashInferMlaChunks(8192), 16);
  EXPECT_EQ(FlashInferMlaChunks(65536), 16);  // at most 16, longer chunks beyond
  EXPECT_EQ(FlashInferMlaChunkKeys(65536), 4096);
  EXPECT_EQ(FlashInferMlaChunkKeys(65537) % kFlashInferMlaTileKeys, 0);
}

TEST(FlashInferMlaPlan, AQuerysChunksDoNotDependOnWhatSharesItsStep) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int64_t> keys(1, 9000);
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t mine = keys(rng);
    const Chunks alone = CheckedChunks(Input({mine}, 128, 9000));
    std::vector<int64_t> batch(1 + trial * 7);
    for (auto& k : batch) k = keys(rng);
    const size_t at = static_cast<size_t>(trial) % batch.size();
    batch[at] = mine;
    const Chunks together = CheckedChunks(Input(batch, 128, 9000, 16 + trial));
    ASSERT_EQ(together.count(static_cast<int>(at)), 1u);
    EXPECT_EQ(together.at(static_cast<int>(at)), alone.at(0)) << "trial " << trial;
  }
}

TEST(FlashInferMlaPlan, HeadCountsThatAreNotTilesAreCoveredByPaddedTiles) {
  for (const int heads : {1, 16, 64, 65, 128, 192, 200}) {
    const FlashInferMlaPlanInput in = Input({100, 700, 3000}, heads, 4096, 8);
    const FlashInferMlaPlanResult r = PlanFlashInferMla(in);
    ASSERT_EQ(r.refused, "") << heads;
    EXPECT_EQ(r.plan.waves[0].blocks_x, heads > 64 ? 2 : 1);
    Chunks c;
    CheckPlan(in, r.plan, &c);
  }
}

TEST(FlashInferMlaPlan, GroupsAreBalanced) {
  const FlashInferMlaPlanInput in = Input(std::vector<int64_t>(64, 2048));
  const FlashInferMlaWave w = PlanFlashInferMla(in).plan.waves[0];
  int64_t total = 0, most = 0;
  for (int g = 0; g < w.blocks_y; ++g) {
    int64_t load = 0;
    for (int i = w.work_indptr[g]; i < w.work_indptr[g + 1]; ++i)
      load += w.kv_end[i] - w.kv_start[i];
    total += load;
    most = std::max(most, load);
  }
  EXPECT_EQ(total, 64 * 2048 * 1);  // blocks_x = 2 share an item: one entry per (chunk, tile)
  // 256 chunks of 512 keys over 66 groups: at most 4 each (the best possible).
  EXPECT_LE(most, 4 * 512);
  // Mixed sizes (two groups): longest first keeps the longest group within 4/3 of the best
  // possible; in plan order the long chunk would land on a group already holding two short ones.
  const FlashInferMlaWave m =
      PlanFlashInferMla(Input({64, 64, 64, 64, 512}, 128, 512, 4)).plan.waves[0];
  ASSERT_EQ(m.blocks_y, 2);
  int64_t costs[2] = {0, 0};
  for (int g = 0; g < 2; ++g)
    for (int i = m.work_indptr[g]; i < m.work_indptr[g + 1]; ++i)
      costs[g] += m.kv_end[i] - m.kv_start[i] + kFlashInferMlaTileKeys;
  const int64_t bound = std::max<int64_t>((costs[0] + costs[1] + 1) / 2, 512 + 64);
  EXPECT_LE(std::max(costs[0], costs[1]) * 3, bound * 4);
}

TEST(FlashInferMlaPlan, ALargeStepRunsInWavesWithinThePartialBudget) {
  FlashInferMlaPlanInput in = Input(std::vector<int64_t>(300, 2048));
  in.partial_bytes = int64_t{40} << 20;
  // 40 MiB: 40,800 rows of 1,028 bytes; a query takes 4 chunks x 128 rows, so 79 a wave.
  const FlashInferMlaPlanResult r = PlanFlashInferMla(in);
  ASSERT_EQ(r.refused, "");
  ASSERT_EQ(r.plan.waves.size(), 4u);
  EXPECT_EQ(r.plan.waves[0].queries, 79);
  EXPECT_EQ(r.plan.waves[3].queries, 300 - 3 * 79);
  for (const auto& w : r.plan.waves)
    EXPECT_LE(w.partial_rows * (kFlashInferMlaLatent * 2 + 4), in.partial_bytes);
  Chunks c;
  CheckPlan(in, r.plan, &c);
  // One query larger than the budget still runs, alone in its wave.
  in = Input({65536, 10, 65536}, 128, 65536);
  in.partial_bytes = 1000;
  const FlashInferMlaPlanResult big = PlanFlashInferMla(in);
  ASSERT_EQ(big.refused, "");
  EXPECT_EQ(big.plan.waves.size(), 3u);
  CheckPlan(in, big.plan, &c);
}

// A prefill's range queries share their sequence's list, each reading its own prefix.
TEST(FlashInferMlaPlan, QueriesOfOneSequenceShareItsList) {
  FlashInferMlaPlanInput in = Input({}, 128);
  in.keys = {2048, 3000, 3001, 3002, 1};  // a selecting query, three prefill tokens, another
  in.list_start = {0, 2048, 2048, 2048, 5050};
  in.list_entries = 5051;
  const FlashInferMlaPlanResult r = PlanFlashInferMla(in);
  ASSERT_EQ(r.refused, "");
  Chunks c;
  CheckPlan(in, r.plan, &c);
  EXPECT_EQ(c.at(3).back(), std::make_pair(2560, 3002));  // 6 chunks of 512, the last short
  in.list_start[3] = 2050;                                // 2,050 + 3,002 > 5,051: past the lists
  EXPECT_NE(PlanFlashInferMla(in).refused, "");
}

TEST(FlashInferMlaPlan, OutOfRangeInputsAreRefusedWithAReason) {
  EXPECT_NE(PlanFlashInferMla(Input({0})).refused, "");     // a query with no key
  EXPECT_NE(PlanFlashInferMla(Input({2049})).refused, "");  // more than its list holds
  EXPECT_NE(PlanFlashInferMla(Input({-5})).refused, "");
  EXPECT_NE(PlanFlashInferMla(Input({10}, 0)).refused, "");  // no heads
  EXPECT_NE(PlanFlashInferMla(Input({10}, 128, 2048, 0)).refused, "");
  // n x stride past 2^31 entries: FlashInfer's list offsets are 32-bit.
  EXPECT_NE(PlanFlashInferMla(Input(std::vector<int64_t>(1100000, 1), 128, 2048)).refused, "");
  EXPECT_EQ(PlanFlashInferMla(Input({})).plan.waves.size(), 0u);  // nothing to attend
}

TEST(FlashInferMlaPlan, LayoutReadsAttndsRowsAndQueries) {
  // DeepSeek-V3.2 bf16 rows: 512 latent then 64 RoPE values, 1,152 bytes.
  const FlashInferMlaLayout l = FlashInferMlaLayoutFor(DType::kBF16, 1152, 4096, 512, 64, 128);
  ASSERT_EQ(l.refused, "");
  EXPECT_EQ(l.ckv_stride_page, 576u);
  EXPECT_EQ(l.kpe_stride_page, 576u);
  EXPECT_EQ(l.kpe_offset_bytes, 1024u);
  EXPECT_EQ(l.q_nope_stride_n, 128u * 512);
  EXPECT_EQ(l.q_nope_stride_h, 512u);
  EXPECT_EQ(l.q_pe_stride_n, 128u * 64);
  EXPECT_EQ(l.q_pe_stride_h, 64u);
  EXPECT_NE(FlashInferMlaLayoutFor(DType::kFP8E4M3, 656, 4096, 512, 64, 128).refused, "");
  EXPECT_NE(FlashInferMlaLayoutFor(DType::kF32, 2304, 4096, 512, 64, 128).refused, "");
  EXPECT_NE(FlashInferMlaLayoutFor(DType::kBF16, 640, 4096, 256, 64, 128).refused, "");
  EXPECT_NE(FlashInferMlaLayoutFor(DType::kBF16, 1152, 4100, 512, 64, 128).refused, "");
  EXPECT_NE(FlashInferMlaLayoutFor(DType::kBF16, 1160, 4096, 512, 64, 128).refused, "");
  EXPECT_NE(FlashInferMlaLayoutFor(DType::kBF16, 1024, 4096, 512, 64, 128).refused, "");
}

}  // namespace
}  // namespace attnd::cuda
