// The tensor-core kernels, lane by lane on the CPU (kernels/cuda/indexer_mma_sim.h,
// mla_mma_sim.h): fragment addressing against the PTX ISA tables, then whole blocks at real and
// edge shapes against the float64 reference, with race, bounds, alignment and coverage checks.
#include <gtest/gtest.h>

#include <random>

#include "common/model_spec.h"
#include "kernels/cuda/indexer_mma_sim.h"
#include "kernels/cuda/mla_mma_sim.h"
#include "kernels/reference/reference.h"

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
  // The project's float64 oracle on exactly what the kernel sees (q rounded to bf16).
  ModelSpec spec;
  spec.index_n_heads = H;
  spec.index_head_dim = D;
  std::vector<double> qd(q.size()), wd(w.begin(), w.end()), kd(keys.size());
  for (size_t i = 0; i < q.size(); ++i) qd[i] = BF16ToF32(F32ToBF16(q[i]));
  for (size_t i = 0; i < keys.size(); ++i) kd[i] = BF16ToF32(keys[i]);
  const auto ref = reference::IndexerScores(spec, qd.data(), wd.data(), kd.data(), nk);
  for (int j = 0; j < nk; ++j) {
    double mag = 0;  // sum |w| |dot|: the scale of the fp32 rounding
    for (int h = 0; h < H; ++h) {
      double dot = 0;
      for (int d = 0; d < D; ++d) dot += qd[h * D + d] * kd[size_t(j) * D + d];
      mag += std::abs(wd[h] * dot);
    }
    ASSERT_FALSE(std::isnan(got[j])) << "key " << j;
    EXPECT_NEAR(got[j], ref[j], 1e-5 * (1 + mag)) << "key " << j;
  }
}

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

struct MlaShape {
  int latent, rope;
  int64_t keys;
  float soft_cap;
  int splits;
  int heads_per_block;
};

class MlaMmaBlock : public ::testing::TestWithParam<MlaShape> {};

TEST_P(MlaMmaBlock, OutputsMatchTheFloat64Reference) {
  const auto [L, R, n, cap, splits, HB] = GetParam();
  const int D = L + R;
  std::mt19937_64 rng(L + R * 7 + n);
  std::normal_distribution<float> n01(0, 1);
  std::vector<float> q(HB * D);
  std::vector<uint16_t> keys(size_t(n) * D);
  for (auto& x : q) x = n01(rng);
  for (auto& x : keys) x = F32ToBF16(n01(rng));
  const float scale = 1.0f / std::sqrt(float(D));
  // Every split's block, then the merge (one split: the block's own normalised output).
  std::vector<sim::MlaBlock> parts(splits);
  for (int z = 0; z < splits; ++z)
    ASSERT_NO_THROW(parts[z] = sim::RunMlaMmaBlock(L, R, q, keys, n, scale, cap, splits, z, HB));
  const std::vector<float> got = splits == 1 ? parts[0].out : sim::CombineSplits(parts, L);
  ModelSpec spec;
  spec.num_heads = HB;
  spec.kv_lora_rank = L;
  spec.qk_rope_head_dim = R;
  spec.sm_scale = scale;
  std::vector<double> qd(q.size()), kd(keys.size());
  for (size_t i = 0; i < q.size(); ++i) qd[i] = BF16ToF32(F32ToBF16(q[i]));
  for (size_t i = 0; i < keys.size(); ++i) kd[i] = BF16ToF32(keys[i]);
  std::vector<int32_t> all(n);
  for (int64_t j = 0; j < n; ++j) all[j] = static_cast<int32_t>(j);
  std::vector<double> ref(size_t(HB) * L);
  reference::Attend(spec, qd.data(), kd.data(), all, cap, ref.data());
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_FALSE(std::isnan(got[i])) << "element " << i;
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  // Probabilities are rounded to bf16 for the P V product, as on the GPU.
  EXPECT_LE(std::sqrt(num / den), 1e-2);
}

// DeepSeek-V3.2 (512 + 64) over a top-2048 selection, partial and single tiles, a soft cap,
// a smaller latent; split-K over 2, 3 (uneven), 16 splits and more splits than tiles (empty
// splits merge as nothing); blocks of 64 heads.
INSTANTIATE_TEST_SUITE_P(
    Shapes, MlaMmaBlock,
    ::testing::Values(MlaShape{512, 64, 2048, 0, 1, 16}, MlaShape{512, 64, 100, 0, 1, 16},
                      MlaShape{512, 64, 1, 0, 1, 16}, MlaShape{128, 64, 200, 2.5f, 1, 16},
                      MlaShape{64, 16, 64, 0, 1, 16}, MlaShape{512, 64, 2048, 0, 16, 16},
                      MlaShape{512, 64, 300, 0, 3, 16}, MlaShape{128, 64, 200, 2.5f, 2, 16},
                      MlaShape{64, 16, 70, 0, 5, 16}, MlaShape{512, 64, 700, 0, 1, 64},
                      MlaShape{512, 64, 130, 0, 3, 64}, MlaShape{128, 64, 65, 2.5f, 1, 64}));

TEST(MlaMmaSim, AShapeOutsideTheContractIsRefused) {
  std::vector<float> q(16 * 48);
  std::vector<uint16_t> keys(48);
  EXPECT_THROW(sim::RunMlaMmaBlock(32, 16, q, keys, 1, 1.0f, 0.0f), std::runtime_error);
}

TEST(MlaMmaSim, SplitKMatchesOneBlockClosely) {
  const int L = 512, R = 64, D = L + R;
  const int64_t n = 777;
  std::mt19937_64 rng(9);
  std::normal_distribution<float> n01(0, 1);
  std::vector<float> q(16 * D);
  std::vector<uint16_t> keys(size_t(n) * D);
  for (auto& x : q) x = n01(rng);
  for (auto& x : keys) x = F32ToBF16(n01(rng));
  const auto one = sim::RunMlaMmaBlock(L, R, q, keys, n, 0.05f, 0.0f).out;
  std::vector<sim::MlaBlock> parts;
  for (int z = 0; z < 4; ++z)
    parts.push_back(sim::RunMlaMmaBlock(L, R, q, keys, n, 0.05f, 0.0f, 4, z));
  const auto split = sim::CombineSplits(parts, L);
  double num = 0, den = 0;
  for (size_t i = 0; i < one.size(); ++i) {
    num += (split[i] - one[i]) * (split[i] - one[i]);
    den += one[i] * one[i];
  }
  EXPECT_LE(std::sqrt(num / den), 5e-3);  // only the bf16 rounding of probabilities differs
}

}  // namespace
}  // namespace attnd::cuda
