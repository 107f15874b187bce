// client::MergeAttention against float64 softmax attention over the union of the parts' keys.
#include "client/attention_merge.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace attnd::client {
namespace {

// float64 attention of `rows` query rows over keys [lo, hi) of scores s [rows, n] and values
// v [n, dim]: out [rows, dim] and lse [rows] (-inf and 0 when the range is empty).
void Attend(const std::vector<double>& s, const std::vector<double>& v, int rows, int n, int dim,
            int lo, int hi, std::vector<double>* out, std::vector<double>* lse) {
  out->assign(static_cast<size_t>(rows) * dim, 0.0);
  lse->assign(rows, -std::numeric_limits<double>::infinity());
  for (int r = 0; r < rows; ++r) {
    if (lo == hi) continue;
    double top = -std::numeric_limits<double>::infinity();
    for (int j = lo; j < hi; ++j) top = std::max(top, s[r * n + j]);
    double sum = 0;
    for (int j = lo; j < hi; ++j) {
      const double p = std::exp(s[r * n + j] - top);
      sum += p;
      for (int d = 0; d < dim; ++d) (*out)[r * dim + d] += p * v[j * dim + d];
    }
    for (int d = 0; d < dim; ++d) (*out)[r * dim + d] /= sum;
    (*lse)[r] = top + std::log(sum);
  }
}

TEST(MergeAttention, PartsOverDisjointKeysMergeToTheAttentionOverTheirUnion) {
  std::mt19937_64 rng(7);
  std::normal_distribution<double> nd(0, 3);
  const int rows = 6, n = 50, dim = 9;
  std::vector<double> s(rows * n), v(n * dim);
  for (auto& x : s) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  // Three parts, one of them empty (a server holding none of the keys a query sees).
  const std::vector<std::pair<int, int>> bounds = {{0, 20}, {20, 20}, {20, 50}};
  std::vector<std::vector<float>> outs, lses;
  for (auto [lo, hi] : bounds) {
    std::vector<double> o, l;
    Attend(s, v, rows, n, dim, lo, hi, &o, &l);
    outs.emplace_back(o.begin(), o.end());
    lses.emplace_back(l.begin(), l.end());
  }
  std::vector<AttentionPart> parts;
  for (size_t i = 0; i < bounds.size(); ++i) parts.push_back({outs[i].data(), lses[i].data()});
  std::vector<float> out(rows * dim, NAN), lse(rows, NAN);
  MergeAttention(parts, rows, dim, out.data(), lse.data());
  std::vector<double> ref, ref_lse;
  Attend(s, v, rows, n, dim, 0, n, &ref, &ref_lse);
  for (int r = 0; r < rows; ++r) {
    ASSERT_FALSE(std::isnan(lse[r]));
    EXPECT_NEAR(lse[r], ref_lse[r], 1e-6 * std::abs(ref_lse[r]) + 1e-6);
    for (int d = 0; d < dim; ++d) {
      ASSERT_FALSE(std::isnan(out[r * dim + d]));
      EXPECT_NEAR(out[r * dim + d], ref[r * dim + d], 1e-5 * (1 + std::abs(ref[r * dim + d])));
    }
  }
}

TEST(MergeAttention, RowsNoPartSawGetZeroAndMinusInfinityAndNaNStaysNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> o1 = {1, 2, 3, 4}, o2 = {5, 6, 7, 8};
  const std::vector<float> l1 = {-inf, 0.5f}, l2 = {-inf, NAN};
  std::vector<float> out(4, 9), lse(2, 9);
  MergeAttention({{o1.data(), l1.data()}, {o2.data(), l2.data()}}, 2, 2, out.data(), lse.data());
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[1], 0.0f);
  EXPECT_EQ(lse[0], -inf);
  EXPECT_TRUE(std::isnan(lse[1]));
  EXPECT_TRUE(std::isnan(out[2]) && std::isnan(out[3]));
  // One part alone is itself.
  MergeAttention({{o2.data(), l1.data()}}, 2, 2, out.data(), lse.data());
  EXPECT_EQ(out[2], 7.0f);
  EXPECT_EQ(out[3], 8.0f);
  EXPECT_EQ(lse[1], 0.5f);
}

}  // namespace
}  // namespace attnd::client
