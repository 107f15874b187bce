// The tensor-core indexer kernel, lane by lane on the CPU (kernels/cuda/indexer_mma_sim.h):
// fragment addressing against the PTX ISA tables, then whole blocks at real and edge shapes
// against the float64 reference, with race, bounds, alignment and coverage checks.
#include "kernels/cuda/indexer_mma_sim.h"

#include <gtest/gtest.h>

#include <random>

namespace attnd::cuda {
namespace {

TEST(IndexerMmaSim, FragmentAddressingIsThePtxLayout) {
  for (int lane = 0; lane < 32; ++lane) {
    int row, col;
    for (int r = 0; r < 4; ++r)
      for (int h = 0; h < 2; ++h) {
        sim::PtxA(lane, 2 * r + h, &row, &col);
        EXPECT_EQ(mma::RowA(lane, r), row) << lane << " a" << 2 * r + h;
        EXPECT_EQ(mma::ColA(lane, r, h), col) << lane << " a" << 2 * r + h;
      }
    for (int r = 0; r < 2; ++r)
      for (int h = 0; h < 2; ++h) {
        sim::PtxB(lane, 2 * r + h, &row, &col);
        EXPECT_EQ(mma::RowB(lane, r, h), row);
        EXPECT_EQ(mma::ColB(lane), col);
      }
    for (int i = 0; i < 4; ++i) {
      sim::PtxC(lane, i, &row, &col);
      EXPECT_EQ(mma::RowC(lane, i), row);
      EXPECT_EQ(mma::ColC(lane, i), col);
    }
  }
}

struct Shape {
  int heads, dim, keys;
};

class IndexerMmaBlock : public ::testing::TestWithParam<Shape> {};

TEST_P(IndexerMmaBlock, ScoresMatchTheFloat64Reference) {
  const auto [H, D, nk] = GetParam();
  std::mt19937_64 rng(H * 1000 + D + nk);
  std::normal_distribution<float> n01(0, 1);
  std::vector<float> q(H * D), w(H);
  std::vector<uint16_t> keys(size_t(nk) * D);
  for (auto& x : q) x = n01(rng);
  for (auto& x : w) x = n01(rng);
  for (auto& x : keys) x = F32ToBF16(n01(rng));
  std::vector<float> got;
  ASSERT_NO_THROW(got = sim::RunIndexerMmaBlock(H, D, q, w, keys, nk));
  for (int j = 0; j < nk; ++j) {
    double ref = 0, mag = 0;
    for (int h = 0; h < H; ++h) {
      double dot = 0;
      for (int d = 0; d < D; ++d)
        dot += double(BF16ToF32(F32ToBF16(q[h * D + d]))) * BF16ToF32(keys[size_t(j) * D + d]);
      ref += w[h] * std::max(dot, 0.0);
      mag += std::abs(w[h]) * std::abs(dot);
    }
    ASSERT_FALSE(std::isnan(got[j])) << "key " << j;
    EXPECT_NEAR(got[j], ref, 1e-5 * (1 + mag)) << "key " << j;
  }
}

// DeepSeek-V3.2 (64 x 128), other head counts and dims, full and partial tiles of keys.
INSTANTIATE_TEST_SUITE_P(Shapes, IndexerMmaBlock,
                         ::testing::Values(Shape{64, 128, 64}, Shape{64, 128, 37},
                                           Shape{16, 128, 1}, Shape{32, 64, 64},
                                           Shape{128, 128, 50}, Shape{16, 16, 9}));

TEST(IndexerMmaSim, NegativeDotsScoreExactlyZeroAndNaNPropagates) {
  const int H = 16, D = 32, nk = 20;
  std::vector<float> q(H * D, -0.25f), w(H, 1.0f);
  std::vector<uint16_t> keys(size_t(nk) * D, F32ToBF16(0.5f));
  auto got = sim::RunIndexerMmaBlock(H, D, q, w, keys, nk);
  for (float s : got) EXPECT_EQ(s, 0.0f);
  keys[3 * D + 5] = F32ToBF16(NAN);
  got = sim::RunIndexerMmaBlock(H, D, q, w, keys, nk);
  EXPECT_TRUE(std::isnan(got[3]));
  EXPECT_EQ(got[4], 0.0f);
}

TEST(IndexerMmaSim, AShapeOutsideTheContractIsRefused) {
  std::vector<float> q(24 * 32), w(24);
  std::vector<uint16_t> keys(32);
  EXPECT_THROW(sim::RunIndexerMmaBlock(24, 32, q, w, keys, 1), std::runtime_error);
}

}  // namespace
}  // namespace attnd::cuda
