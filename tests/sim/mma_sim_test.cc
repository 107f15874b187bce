// The tensor-core kernels, lane by lane on the CPU (tests/sim/indexer_mma_sim.h,
// mla_mma_sim.h): fragment addressing against the PTX ISA tables, then whole blocks at real and
// edge shapes against the float64 reference, with race, bounds, alignment and coverage checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <tuple>

#include "common/fp8.h"
#include "common/model_spec.h"
#include "kernels/reference/reference.h"
#include "tests/sim/indexer_mma_sim.h"
#include "tests/sim/mla_mma_sim.h"

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
  // Every block of a grid of `splits`, then the merge (a query of one split: its block's own
  // normalised output; blocks past the query's own splits do nothing).
  std::vector<sim::MlaBlock> parts(splits);
  for (int z = 0; z < splits; ++z)
    ASSERT_NO_THROW(parts[z] = sim::RunMlaMmaBlock(L, R, q, keys, n, scale, cap, splits, z, HB));
  const std::vector<float> got = sim::CombineSplits(parts, L);
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

// DeepSeek-V3.2 (512 + 64) over a top-2048 selection (4 splits of 512 keys), partial and single
// tiles, a soft cap, a smaller latent; grids wider than the query needs (its blocks past its own
// splits idle; a one-split query writes its output itself), 3 uneven splits (1200 keys), 16
// splits of more than 8 tiles (9000 keys); blocks of 64 heads.
INSTANTIATE_TEST_SUITE_P(
    Shapes, MlaMmaBlock,
    ::testing::Values(MlaShape{512, 64, 2048, 0, 4, 16}, MlaShape{512, 64, 100, 0, 1, 16},
                      MlaShape{512, 64, 1, 0, 1, 16}, MlaShape{128, 64, 200, 2.5f, 1, 16},
                      MlaShape{64, 16, 64, 0, 1, 16}, MlaShape{512, 64, 2048, 0, 16, 16},
                      MlaShape{512, 64, 1200, 0, 3, 16}, MlaShape{128, 64, 200, 2.5f, 2, 16},
                      MlaShape{64, 16, 70, 0, 5, 16}, MlaShape{64, 16, 9000, 0, 16, 16},
                      MlaShape{512, 64, 700, 0, 2, 64}, MlaShape{512, 64, 130, 0, 3, 64},
                      MlaShape{128, 64, 65, 2.5f, 1, 64}));

// An fp8 cache on tensor cores: the loader decodes each row's codes with their tile's scale into
// the same bf16 bits the bf16 path would load for the dequantised keys (exact), so the block's
// output is bit for bit the bf16 block's on those keys, and within the bf16 tolerance of
// float64 on them. DeepSeek-V3.2's 656-byte rows; one, partial and four splits; 16 and 64 heads.
TEST(MlaMmaSim, Fp8RowsDecodeToTheBf16PathsBitsAndMatchTheReference) {
  const int L = 512, R = 64, D = L + R;
  ASSERT_TRUE(Fp8LatentRowsTakeChunks(L, R));
  const size_t row = fp8::LatentTokenBytes(L, R);
  for (const auto& [n, splits, HB] :
       {std::tuple<int64_t, int, int>{2048, 4, 16}, {100, 1, 16}, {1, 1, 16}, {700, 2, 64}}) {
    std::mt19937_64 rng(n + HB);
    std::normal_distribution<float> n01(0, 1);
    std::vector<float> q(size_t(HB) * D);
    for (auto& x : q) x = n01(rng);
    std::vector<uint8_t> rows(size_t(n) * row);
    std::vector<uint16_t> dequant(size_t(n) * D);
    std::vector<float> kv(L), rope(R), back(D);
    for (int64_t j = 0; j < n; ++j) {
      // Tiles of very different magnitudes: each takes its own scale.
      for (int i = 0; i < L; ++i) kv[i] = n01(rng) * std::ldexp(1.0f, (i / 128) * 5 - 8);
      for (auto& x : rope) x = n01(rng);
      fp8::PackLatentToken(L, R, kv.data(), rope.data(), rows.data() + j * row);
      fp8::UnpackLatentToken(L, R, rows.data() + j * row, back.data());
      for (int i = 0; i < D; ++i) {
        dequant[size_t(j) * D + i] = F32ToBF16(back[i]);
        ASSERT_EQ(BF16ToF32(dequant[size_t(j) * D + i]), back[i]) << "not exact in bf16";
      }
    }
    const float scale = 0.05f;
    std::vector<sim::MlaBlock> fp8_parts(splits), bf16_parts(splits);
    for (int z = 0; z < splits; ++z) {
      ASSERT_NO_THROW(fp8_parts[z] =
                          sim::RunMlaMmaBlock(L, R, q, {}, n, scale, 0, splits, z, HB, &rows));
      bf16_parts[z] = sim::RunMlaMmaBlock(L, R, q, dequant, n, scale, 0, splits, z, HB);
    }
    const std::vector<float> got = sim::CombineSplits(fp8_parts, L);
    const std::vector<float> same = sim::CombineSplits(bf16_parts, L);
    ASSERT_EQ(std::memcmp(got.data(), same.data(), got.size() * sizeof(float)), 0) << n;
    ModelSpec spec;
    spec.num_heads = HB;
    spec.kv_lora_rank = L;
    spec.qk_rope_head_dim = R;
    spec.sm_scale = scale;
    std::vector<double> qd(q.size()), kd(dequant.size());
    for (size_t i = 0; i < q.size(); ++i) qd[i] = BF16ToF32(F32ToBF16(q[i]));
    for (size_t i = 0; i < kd.size(); ++i) kd[i] = BF16ToF32(dequant[i]);
    std::vector<int32_t> all(n);
    for (int64_t j = 0; j < n; ++j) all[j] = static_cast<int32_t>(j);
    std::vector<double> ref(size_t(HB) * L);
    reference::Attend(spec, qd.data(), kd.data(), all, 0, ref.data());
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      ASSERT_FALSE(std::isnan(got[i]));
      num += (got[i] - ref[i]) * (got[i] - ref[i]);
      den += ref[i] * ref[i];
    }
    EXPECT_LE(std::sqrt(num / den), 1e-2) << n;
  }
  // Rows whose rope would sit off a 16-byte boundary go to the SIMT kernel; the simulation
  // refuses them as the launcher does not take them.
  EXPECT_FALSE(Fp8LatentRowsTakeChunks(256, 64));
  std::vector<float> q(16 * 320);
  std::vector<uint8_t> rows(fp8::LatentTokenBytes(256, 64));
  EXPECT_THROW(sim::RunMlaMmaBlock(256, 64, q, {}, 1, 1.0f, 0, 1, 0, 16, &rows),
               std::runtime_error);
}

TEST(MlaMmaSim, AShapeOutsideTheContractIsRefused) {
  std::vector<float> q(16 * 48);
  std::vector<uint16_t> keys(48);
  EXPECT_THROW(sim::RunMlaMmaBlock(32, 16, q, keys, 1, 1.0f, 0.0f), std::runtime_error);
}

// A query's split-K comes from its own keys, never from the batch: its bits are the same in a
// grid sized for itself as in one sized for the step's longest query (docs/numerics.md; on the
// GPU, a sequence decoded alone or in a batch of 64).
TEST(MlaMmaSim, AQuerysBitsDoNotDependOnWhatSharesItsStep) {
  const int L = 512, R = 64, D = L + R;
  std::mt19937_64 rng(9);
  std::normal_distribution<float> n01(0, 1);
  std::vector<float> q(16 * D);
  for (auto& x : q) x = n01(rng);
  for (const int64_t n : {300, 777, 2048}) {  // one split, 2 (uneven), 4
    std::vector<uint16_t> keys(size_t(n) * D);
    for (auto& x : keys) x = F32ToBF16(n01(rng));
    auto run = [&](int grid) {
      std::vector<sim::MlaBlock> parts;
      for (int z = 0; z < grid; ++z)
        parts.push_back(sim::RunMlaMmaBlock(L, R, q, keys, n, 0.05f, 0.0f, grid, z));
      return sim::CombineSplits(parts, L);
    };
    const std::vector<float> alone = run(MlaQuerySplits(n)), shared = run(kMlaMaxSplits);
    ASSERT_EQ(alone.size(), shared.size());
    EXPECT_EQ(std::memcmp(alone.data(), shared.data(), alone.size() * sizeof(float)), 0)
        << n << " keys: the bits changed with the grid";
    for (float x : alone) ASSERT_TRUE(std::isfinite(x)) << n;
  }
  EXPECT_EQ(MlaQuerySplits(300), 1);
  EXPECT_EQ(MlaQuerySplits(777), 2);
  EXPECT_EQ(MlaQuerySplits(2048), 4);
  EXPECT_EQ(MlaQuerySplits(int64_t{1} << 20), kMlaMaxSplits);  // more tiles per split instead
  // A grid too small for the query would drop keys: the simulation refuses it, as LaunchMla
  // sizes the grid from the longest query.
  std::vector<uint16_t> keys(size_t(2048) * D, 0x3f80);
  EXPECT_THROW(sim::RunMlaMmaBlock(L, R, q, keys, 2048, 0.05f, 0.0f, 2, 0), std::runtime_error);
}

// The wave size bounds the partials a step holds at once, and every query gets one.
TEST(MlaMmaSim, PartialsComeInWavesThatFitTheirBudget) {
  for (const int n : {1, 64, 4096, 65536}) {
    const int splits = MlaQuerySplits(4096), w = MlaPartialQueries(n, splits, 128, 512);
    EXPECT_GE(w, 1);
    EXPECT_LE(w, n);
    EXPECT_LE(int64_t{w} * splits * 128 * 514 * 4, kMlaPartialBytes) << n;
  }
  EXPECT_EQ(MlaPartialQueries(4096, 1, 128, 512), 4096);  // no partials: one wave
  EXPECT_EQ(MlaPartialQueries(64, 4, 128, 512), 64);      // a decode batch: one wave
}

}  // namespace
}  // namespace attnd::cuda
