// kernels/selection: the host selection every backend and the interface share, against plain
// sorts (random scores with many exact ties) and the float64 reference.
#include "kernels/selection.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "kernels/reference/reference.h"
#include "tests/small_spec.h"

namespace attnd {
namespace {

std::vector<float> Randn(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0, 1);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// Small integers: many exact ties.
std::vector<float> Tied(size_t n, std::mt19937_64& rng) {
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(rng() % 7) - 3;
  return v;
}

// Indices of v ranked best first: value descending, index ascending.
template <typename T>
std::vector<int32_t> Ranked(const std::vector<T>& v) {
  std::vector<int32_t> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return v[a] > v[b]; });
  return idx;
}

using testing::SmallSpec;

TEST(ExactTopK, MatchesFullSortWithTiesToLowerPositionAndNaNLast) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t n = 1 + rng() % 400;
    const int64_t k = 1 + rng() % 64;
    std::vector<float> s(n);
    for (auto& x : s) x = static_cast<float>(rng() % 20) - 5;  // many exact ties
    if (trial % 3 == 0) s[rng() % n] = NAN;
    std::vector<double> sd(s.begin(), s.end());
    for (auto& x : sd)
      if (std::isnan(x)) x = -INFINITY;
    std::vector<int32_t> got(std::min(n, k));
    got.resize(ExactTopK(s.data(), n, k, got.data()));
    EXPECT_EQ(got, reference::TopK(sd, k)) << "n=" << n << " k=" << k;
  }
}

TEST(PageSelection, MatchesReferenceForUnionAndBudget) {
  std::mt19937_64 rng(11);
  for (auto mode : {SelectionMode::kPageUnion, SelectionMode::kPageBudget}) {
    ModelSpec spec = SmallSpec(mode);
    for (int trial = 0; trial < 100; ++trial) {
      const int64_t n = 1 + rng() % 200;
      auto s = Randn(n, rng);
      std::vector<double> sd(s.begin(), s.end());
      std::vector<int32_t> got;
      if (mode == SelectionMode::kPageUnion) {
        std::vector<int32_t> topk(std::min<int64_t>(n, spec.index_topk));
        topk.resize(ExactTopK(s.data(), n, spec.index_topk, topk.data()));
        PageUnionSelect(s.data(), n, topk.data(), topk.size(), spec.page_size,
                        spec.page_union_max_pages, &got);
      } else {
        PageBudgetSelect(s.data(), n, spec.page_size, spec.page_budget, &got);
      }
      const auto want = reference::SelectKeys(spec, sd, false);
      ASSERT_EQ(got, want) << "mode " << int(mode) << " n=" << n;
      // The own page is always there, up to the query.
      EXPECT_EQ(got.back(), n - 1);
    }
  }
}

TEST(Selection, ExactTopKIsTheFirstKOfASortWithTiesToTheLowerPosition) {
  std::mt19937_64 rng(21);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t n = 1 + rng() % 300;
    const int64_t k = rng() % 80;  // 0, k < n and k >= n all occur
    const auto s = trial % 2 ? Tied(n, rng) : Randn(n, rng);
    std::vector<int32_t> want = Ranked(s);
    want.resize(std::min(n, k));
    std::sort(want.begin(), want.end());
    std::vector<int32_t> got(std::min(n, k));
    got.resize(ExactTopK(s.data(), n, k, got.data()));
    EXPECT_EQ(got, want) << "n=" << n << " k=" << k;
  }
}

TEST(Selection, PageMaximaAreEachPagesBestScoreInPageOrder) {
  std::mt19937_64 rng(22);
  for (int trial = 0; trial < 100; ++trial) {
    const int64_t n = 1 + rng() % 300;
    const int ps = 1 + static_cast<int>(rng() % 40);
    const auto s = Randn(n, rng);
    std::vector<std::pair<float, int32_t>> got;
    PageMaxima(s.data(), n, ps, &got);
    ASSERT_EQ(static_cast<int64_t>(got.size()), (n + ps - 1) / ps);
    for (size_t p = 0; p < got.size(); ++p) {
      const auto lo = s.begin() + p * ps, hi = s.begin() + std::min<int64_t>((p + 1) * ps, n);
      EXPECT_EQ(got[p].first, *std::max_element(lo, hi)) << p;
      EXPECT_EQ(got[p].second, static_cast<int32_t>(p));
    }
  }
}

TEST(Selection, BestPagesKeepsTheBestTiesToTheLowerPageAndAddsTheOwnPage) {
  std::mt19937_64 rng(23);
  for (int trial = 0; trial < 200; ++trial) {
    const int pages = 1 + static_cast<int>(rng() % 50);
    const int keep = 1 + static_cast<int>(rng() % 10);
    const int32_t own = static_cast<int32_t>(rng() % pages);
    const auto s = Tied(pages, rng);
    std::vector<std::pair<float, int32_t>> cand;
    for (int p = 0; p < pages; ++p) cand.emplace_back(s[p], p);
    std::shuffle(cand.begin(), cand.end(), rng);  // any order in
    std::vector<int32_t> want = Ranked(s);
    want.resize(std::min(pages, keep));
    if (std::find(want.begin(), want.end(), own) == want.end()) want.push_back(own);
    std::sort(want.begin(), want.end());
    EXPECT_EQ(BestPages(cand, keep, own), want) << "pages=" << pages << " keep=" << keep;
  }
}

TEST(Selection, SelectKeysMatchesTheReferenceInEveryMode) {
  std::mt19937_64 rng(24);
  for (auto mode : {SelectionMode::kToken, SelectionMode::kPageUnion, SelectionMode::kPageBudget}) {
    const ModelSpec spec = SmallSpec(mode);
    for (int trial = 0; trial < 100; ++trial) {
      const int64_t n = 1 + rng() % 200;
      const auto s = trial % 2 ? Tied(n, rng) : Randn(n, rng);
      std::vector<int32_t> got = {-1};  // replaced, not appended to
      SelectKeys(spec, s.data(), n, &got);
      EXPECT_EQ(got, reference::SelectKeys(spec, {s.begin(), s.end()}, false))
          << "mode " << int(mode) << " n=" << n;
    }
  }
}

TEST(Selection, LocalCandidatesAreTheBestKeysBestFirstWithTiesToTheLowerKey) {
  std::mt19937_64 rng(25);
  for (auto mode : {SelectionMode::kToken, SelectionMode::kPageUnion, SelectionMode::kPageBudget}) {
    const ModelSpec spec = SmallSpec(mode);
    for (int trial = 0; trial < 100; ++trial) {
      const int64_t n = 1 + rng() % 200;
      const auto s = trial % 2 ? Tied(n, rng) : Randn(n, rng);
      // Tokens, or pages by their best token.
      std::vector<float> ranked = s;
      if (mode == SelectionMode::kPageBudget) {
        ranked.clear();
        for (int64_t p = 0; p * spec.page_size < n; ++p)
          ranked.push_back(
              *std::max_element(s.begin() + p * spec.page_size,
                                s.begin() + std::min<int64_t>((p + 1) * spec.page_size, n)));
      }
      std::vector<int32_t> want = Ranked(ranked);
      if (static_cast<int64_t>(want.size()) > CandidatesPerQuery(spec))
        want.resize(CandidatesPerQuery(spec));
      std::vector<float> want_scores;
      for (int32_t k : want) want_scores.push_back(ranked[k]);
      std::vector<int32_t> keys = {-1};
      std::vector<float> scores = {-1};
      LocalCandidatesOf(spec, s.data(), n, &keys, &scores);
      EXPECT_EQ(keys, want) << "mode " << int(mode) << " n=" << n;
      EXPECT_EQ(scores, want_scores) << "mode " << int(mode) << " n=" << n;
    }
  }
}

}  // namespace
}  // namespace attnd
