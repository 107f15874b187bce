// The GPU's top-k (kernels/cuda/ops/topk_block.h), run on the CPU thread by thread between barriers
// with checked shared memory (tests/sim/block_sim.h): the same code the kernels run. Every
// row equals the host's exact top-k (kernels/selection.h) bit for bit, ties to the lower index,
// NaN lowest, -0 = +0; page keys with their zeros left out; rows of several slices and their
// merge; and every barrier of the block is needed: skipping any one is caught as a race or a
// wrong result.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <stdexcept>
#include <vector>

#include "kernels/cuda/ops/topk_block.h"
#include "kernels/selection.h"
#include "tests/sim/block_sim.h"
#include "tests/sim/sim_mutation.h"

namespace attnd::cuda {
namespace {

// A SimBlock that skips its barrier number `skip` (counting from 0), to show it is needed.
class SkippingBlock : public sim::SimBlock {
 public:
  SkippingBlock(int skip) : sim::SimBlock(kTopKThreads, TopKWords::words), skip_(skip) {}
  void Sync() {
    if (count_++ != skip_) sim::SimBlock::Sync();
  }
  int count() const { return count_; }

 private:
  int skip_, count_ = 0;
};

// One launch's rows on the host, run block by block as the kernels' grids run them.
struct HostTopK {
  std::vector<float> scores;
  std::vector<uint32_t> keys;
  std::vector<int64_t> offset, len;
  int64_t k = 0;
  bool drop_zero = false;
  std::vector<int32_t> out, count, out_row;
  int64_t stride = 0;

  // The selection of every row (rows of several slices: the slices' candidates, then a merge).
  void Run() {
    TopKSlicePlan plan = PlanTopKSlices(len, k);
    std::vector<uint32_t> cand_key(std::max<int64_t>(1, plan.total * k));
    std::vector<int32_t> cand_index(cand_key.size()), cand_count(std::max<int64_t>(1, plan.total));
    TopKRows p;
    p.scores = scores.empty() ? nullptr : scores.data();
    p.keys = keys.empty() ? nullptr : keys.data();
    p.row_offset = offset.data();
    p.row_len = len.data();
    p.k = k;
    p.drop_zero = drop_zero;
    stride = k;
    const size_t rows = out_row.empty() ? len.size() : len.size() + 3;
    out.assign(rows * stride, -1);
    count.assign(rows, -1);
    p.out = out.data();
    p.out_stride = stride;
    p.out_count = count.data();
    p.out_row = out_row.empty() ? nullptr : out_row.data();
    p.slice_offset = plan.offset.data();
    p.cand_key = cand_key.data();
    p.cand_index = cand_index.data();
    p.cand_count = cand_count.data();
    const int64_t longest = *std::max_element(len.begin(), len.end());
    for (size_t q = 0; q < len.size(); ++q)
      for (int s = 0; s < TopKSlices(longest, k); ++s) {
        sim::SimBlock b(kTopKThreads, TopKWords::words);
        TopKSliceBlock(b, p, static_cast<int64_t>(q), s);
      }
    for (size_t q = 0; q < len.size(); ++q) {
      sim::SimBlock b(kTopKThreads, TopKWords::words);
      TopKMergeBlock(b, p, static_cast<int64_t>(q));
    }
  }
  std::vector<int32_t> Row(size_t q) const {
    const size_t r = out_row.empty() ? q : out_row[q];
    return {out.begin() + r * stride, out.begin() + r * stride + count[r]};
  }
};

// The host's rule for keys: the k largest non-excluded keys, ties to the lower index, ascending.
std::vector<int32_t> ReferenceKeys(const uint32_t* keys, int64_t n, int64_t k, bool drop_zero) {
  std::vector<int32_t> idx;
  for (int64_t i = 0; i < n; ++i)
    if (!drop_zero || keys[i] != 0) idx.push_back(static_cast<int32_t>(i));
  const size_t take = std::min<size_t>(k, idx.size());
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return keys[a] > keys[b]; });
  idx.resize(take);
  std::sort(idx.begin(), idx.end());
  return idx;
}

std::vector<int32_t> ReferenceScores(const float* s, int64_t n, int64_t k) {
  std::vector<int32_t> out(std::min(n, k));
  out.resize(ExactTopK(s, n, k, out.data()));
  return out;
}

TEST(TopKSim, KeyOrderIsTheHostsRanking) {
  const float values[] = {-INFINITY, -3.5f, -1e-30f, -0.0f, 0.0f, 1e-30f, 2.0f, INFINITY};
  for (size_t i = 0; i + 1 < std::size(values); ++i)
    EXPECT_LE(TopKKey(values[i]), TopKKey(values[i + 1])) << values[i];
  EXPECT_EQ(TopKKey(-0.0f), TopKKey(0.0f));
  EXPECT_EQ(TopKKey(NAN), TopKKey(-INFINITY));  // NaN ranks with -inf, below every number
  EXPECT_LT(TopKKey(NAN), TopKKey(-3e38f));
  for (float f : {-INFINITY, NAN, -1.0f, 0.0f, 5.0f}) EXPECT_NE(TopKKey(f), 0u);
}

TEST(TopKSim, OneBlockRowsEqualTheHostsExactTopK) {
  std::mt19937 rng(5);
  std::normal_distribution<float> n01(0, 1);
  struct Case {
    int64_t n, k;
    int levels;  // 0: continuous values; else this many distinct values (ties everywhere)
  };
  for (const Case c : {Case{5000, 2048, 0}, Case{5000, 2048, 7}, Case{2048, 2048, 0},
                       Case{2000, 2048, 3}, Case{1, 2048, 0}, Case{777, 1, 0}, Case{777, 1, 1},
                       Case{8192, 100, 0}, Case{3000, 24, 2}, Case{513, 512, 0}}) {
    HostTopK t;
    t.k = c.k;
    t.scores.resize(c.n);
    for (float& x : t.scores)
      x = c.levels ? static_cast<float>(static_cast<int>(rng() % c.levels)) - 1 : n01(rng);
    if (c.n > 10) {
      t.scores[3] = NAN;
      t.scores[4] = -0.0f;
      t.scores[5] = 0.0f;
    }
    t.offset = {0};
    t.len = {c.n};
    ASSERT_NO_THROW(t.Run()) << c.n << " " << c.k;
    EXPECT_EQ(t.Row(0), ReferenceScores(t.scores.data(), c.n, c.k))
        << "n " << c.n << " k " << c.k << " levels " << c.levels;
  }
}

TEST(TopKSim, PageKeysLeaveTheirZerosOut) {
  std::mt19937 rng(6);
  for (const auto& [n, k, zeros] : {std::tuple<int64_t, int64_t, int>{300, 8, 50},
                                    {300, 290, 50},  // fewer non-zero keys than k
                                    {64, 2, 0},
                                    {1000, 512, 999},
                                    {40, 3, 40}}) {  // nothing to take
    HostTopK t;
    t.k = k;
    t.drop_zero = true;
    t.keys.resize(n);
    for (auto& x : t.keys) x = 0x80000000u + rng() % 64;  // many ties
    for (int z = 0; z < zeros; ++z) t.keys[rng() % n] = 0;
    t.offset = {0};
    t.len = {n};
    ASSERT_NO_THROW(t.Run());
    EXPECT_EQ(t.Row(0), ReferenceKeys(t.keys.data(), n, k, true)) << n << " " << k;
  }
}

TEST(TopKSim, LongRowsRunInSlicesAndAMerge) {
  std::mt19937 rng(7);
  std::normal_distribution<float> n01(0, 1);
  // Several rows of one launch: two sliced (70,000 keys, top-2048: 5 slices of 14,000; 100,000
  // keys, top-24: 13 slices), one of one slice; ties across slice borders; output rows mapped.
  HostTopK t;
  t.k = 2048;
  const std::vector<int64_t> lens = {70000, 16384, 100000};
  for (int64_t n : lens) {
    t.offset.push_back(static_cast<int64_t>(t.scores.size()));
    t.len.push_back(n);
    for (int64_t i = 0; i < n; ++i)
      t.scores.push_back(i % 3 == 0 ? std::round(n01(rng) * 4) : n01(rng) * 3);
  }
  t.out_row = {2, 0, 4};
  EXPECT_EQ(TopKSlices(70000, 2048), 5);
  EXPECT_EQ(TopKSlices(16384, 2048), 1);
  ASSERT_NO_THROW(t.Run());
  for (size_t q = 0; q < lens.size(); ++q)
    EXPECT_EQ(t.Row(q), ReferenceScores(t.scores.data() + t.offset[q], lens[q], t.k)) << q;
  HostTopK small;
  small.k = 24;
  small.offset = {0};
  small.len = {100000};
  small.scores.resize(100000);
  for (float& x : small.scores) x = std::round(n01(rng) * 8);  // heavy ties
  EXPECT_EQ(TopKSlices(100000, 24), 13);
  ASSERT_NO_THROW(small.Run());
  EXPECT_EQ(small.Row(0), ReferenceScores(small.scores.data(), 100000, 24));
}

TEST(TopKSim, SlicesCoverEveryRowAndGrowWithIt) {
  for (int64_t k : {1, 24, 512, 2048})
    for (int64_t len = 1; len < (int64_t{1} << 23); len = len * 3 / 2 + 1) {
      const int s = TopKSlices(len, k);
      const int64_t size = TopKSliceKeys(len, k);
      ASSERT_GE(s, 1);
      ASSERT_LE(s, kTopKMaxSlices);
      ASSERT_GE(s * size, len);              // every key in a slice
      ASSERT_LT((s - 1) * size, len);        // no empty slice
      ASSERT_GE(TopKSlices(len + 1, k), s);  // a grid sized for the longest row covers all
    }
}

// Every barrier of the block is load-bearing: the simulation without any one of them reports a
// shared-memory race or gets a wrong selection.
TEST(TopKSim, EveryBarrierIsNeeded) {
  std::mt19937 rng(8);
  std::normal_distribution<float> n01(0, 1);
  std::vector<float> scores(3000);
  for (float& x : scores) x = std::round(n01(rng) * 20);
  const int64_t k = 700;
  const std::vector<int32_t> want = ReferenceScores(scores.data(), 3000, k);
  auto run = [&](SkippingBlock& b) {
    std::vector<int32_t> out(k, -1);
    int32_t count = -1;
    TopKOut emit{out.data(), &count, nullptr};
    auto key_at = [&](int64_t i, int) { return TopKKey(scores[i]); };
    BlockTopK(b, key_at, 3000, k, false, emit);
    out.resize(std::max(0, count));
    return out;
  };
  SkippingBlock all(-1);
  ASSERT_EQ(run(all), want);
  const int barriers = all.count();
  EXPECT_GT(barriers, 40);
  for (int skip = 0; skip < barriers; ++skip) {
    SkippingBlock b(skip);
    EXPECT_TRUE(testing::RefusedOrChanged([&] { return run(b) != want; }))
        << "barrier " << skip << " of " << barriers << " is not needed";
  }
}

}  // namespace
}  // namespace attnd::cuda
