// float8_e4m3fn and the fp8 cache's token formats (common/fp8.h) against float64: every code's
// value, round-to-nearest-even encoding checked by brute force over all codes, power-of-two
// tile scales, and the 656-byte latent / 132-byte indexer tokens round-tripped on random data.
#include "common/fp8.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace attnd::fp8 {
namespace {

// Code -> value, straight from the format's definition, in double.
double Reference(int code) {
  const int sign = code >> 7, exp = (code >> 3) & 0xf, man = code & 7;
  if (exp == 15 && man == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag =
      exp == 0 ? man / 8.0 * std::pow(2.0, -6) : (1 + man / 8.0) * std::pow(2.0, exp - 7);
  return sign ? -mag : mag;
}

// The nearest finite e4m3 value to x (ties to the even code), saturating at +-448: brute force.
int NearestCode(double x) {
  if (std::fabs(x) >= 448) return x < 0 ? 0xfe : 0x7e;
  int best = -1;
  double best_err = INFINITY;
  for (int c = 0; c < 256; ++c) {
    const double v = Reference(c);
    if (std::isnan(v) || (std::signbit(v) != std::signbit(x) && v != 0)) continue;
    const double err = std::fabs(v - x);
    if (err < best_err || (err == best_err && (c & 1) == 0 && (best & 1) == 1)) {
      best = c;
      best_err = err;
    }
  }
  if (Reference(best) == 0) return std::signbit(x) ? 0x80 : 0x00;  // zero keeps the sign
  return best;
}

TEST(Fp8, EveryCodeDecodesToItsValue) {
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    const double want = Reference(c);
    const float got = E4M3ToF32(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
      ++nans;
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), want) << c;
    EXPECT_EQ(std::signbit(got), std::signbit(want)) << c;  // -0 stays -0
  }
  EXPECT_EQ(nans, 2);  // 0x7f and 0xff: e4m3fn has no infinities
  EXPECT_EQ(E4M3ToF32(0x7e), 448.0f);
  EXPECT_EQ(E4M3ToF32(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(E4M3ToF32(0x08), std::ldexp(1.0f, -6));  // the smallest normal
}

TEST(Fp8, EncodingRoundsToTheNearestEvenAndSaturates) {
  for (int c = 0; c < 256; ++c) {  // every finite value encodes to its own code
    const float v = E4M3ToF32(static_cast<uint8_t>(c));
    if (!std::isnan(v)) {
      EXPECT_EQ(F32ToE4M3(v), c) << c;
    }
  }
  // Midpoints between neighbours (exact ties) and random values, against brute force.
  std::vector<float> xs;
  for (int c = 0; c < 0x7e; ++c) {
    const double a = Reference(c), b = Reference(c + 1);
    xs.push_back(static_cast<float>((a + b) / 2));  // exact in fp32
    xs.push_back(-static_cast<float>((a + b) / 2));
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int i = 0; i < 20000; ++i) xs.push_back(u(rng) * std::ldexp(1.0f, i % 20 - 11));
  xs.insert(xs.end(), {500.0f, -1e30f, INFINITY, -INFINITY, 447.0f, 464.0f, 0.0f, -0.0f,
                       std::ldexp(1.0f, -10), std::ldexp(1.5f, -10), 1e-30f});
  for (float x : xs) EXPECT_EQ(F32ToE4M3(x), NearestCode(x)) << x;
  EXPECT_TRUE(std::isnan(E4M3ToF32(F32ToE4M3(NAN))));
}

TEST(Fp8, TileScalesAreTheSmallestPowerOfTwoThatFits) {
  for (float amax : {1e-6f, 0.3f, 1.0f, 447.0f, 448.0f, 449.0f, 896.0f, 1000.0f, 3e5f, 7.5e-3f}) {
    const float s = TileScale(amax);
    int e;
    EXPECT_EQ(std::frexp(s, &e), 0.5f) << amax;  // a power of two
    EXPECT_LE(amax / s, 448.0f) << amax;
    EXPECT_GT(amax / (s / 2), 448.0f) << amax;  // the next smaller one would not fit
  }
  EXPECT_EQ(TileScale(448.0f), 1.0f);
  EXPECT_EQ(TileScale(896.0f), 2.0f);
  EXPECT_EQ(TileScale(0.0f), 1.0f);  // an all-zero tile
}

TEST(Fp8, LatentAndIndexTokensRoundTripWithinHalfAStep) {
  EXPECT_EQ(LatentTokenBytes(kLatentValues, kRopeValues), 656);
  EXPECT_EQ(IndexTokenBytes(kIndexValues), 132);
  constexpr int kLatentTiles = 4;
  EXPECT_EQ(LatentTiles(kLatentValues), kLatentTiles);
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> ckv(kLatentValues), rope(kRopeValues), idx(kIndexValues);
    for (int i = 0; i < kLatentValues; ++i)  // tiles of very different magnitudes
      ckv[i] = n(rng) * std::ldexp(1.0f, (i / kLatentTile) * 3 - 4 + trial % 5);
    for (float& r : rope) r = n(rng) * 3;
    for (float& k : idx) k = n(rng) * std::ldexp(1.0f, trial % 7 - 3);
    std::vector<uint8_t> token(LatentTokenBytes(kLatentValues, kRopeValues));
    PackLatentToken(kLatentValues, kRopeValues, ckv.data(), rope.data(), token.data());
    std::vector<float> back(kLatentValues + kRopeValues);
    UnpackLatentToken(kLatentValues, kRopeValues, token.data(), back.data());
    for (int t = 0; t < kLatentTiles; ++t) {
      double amax = 0;
      for (int i = 0; i < kLatentTile; ++i) amax = std::fmax(amax, std::fabs(ckv[t * 128 + i]));
      const double s = TileScale(static_cast<float>(amax));
      for (int i = t * 128; i < (t + 1) * 128; ++i) {
        // Exactly the nearest e4m3 of x / s, times s; within half a step of x.
        const double want = Reference(NearestCode(ckv[i] / s)) * s;
        ASSERT_EQ(static_cast<double>(back[i]), want) << trial << " " << i;
        ASSERT_LE(std::fabs(back[i] - ckv[i]), std::fmax(std::fabs(ckv[i]) / 16, s / 1024))
            << trial << " " << i;
        ASSERT_FALSE(std::isnan(back[i]));
      }
    }
    for (int i = 0; i < kRopeValues; ++i)
      EXPECT_EQ(back[kLatentValues + i], BF16ToF32(F32ToBF16(rope[i])));
    std::vector<uint8_t> values(kIndexValues);
    float scale = 0;
    PackIndexKey(kIndexValues, idx.data(), values.data(), &scale);
    std::vector<float> idx_back(kIndexValues);
    UnpackIndexKey(kIndexValues, values.data(), scale, idx_back.data());
    for (int i = 0; i < kIndexValues; ++i) {
      const double want = Reference(NearestCode(idx[i] / scale)) * scale;
      ASSERT_EQ(static_cast<double>(idx_back[i]), want) << trial << " " << i;
    }
  }
}

TEST(Fp8, SmallModelsTakeOneTilePerRowAndScalesArePowersOfTwo) {
  EXPECT_TRUE(LatentDimFits(32));
  EXPECT_TRUE(LatentDimFits(256));
  EXPECT_FALSE(LatentDimFits(192));
  EXPECT_FALSE(LatentDimFits(0));
  EXPECT_EQ(LatentTiles(32), 1);
  EXPECT_EQ(LatentTokenBytes(32, 16), 32 + 4 + 32);
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0.0f, 5.0f);
  std::vector<float> ckv(32), rope(16), back(48);
  for (float& v : ckv) v = n(rng);
  for (float& v : rope) v = n(rng);
  std::vector<uint8_t> token(LatentTokenBytes(32, 16));
  PackLatentToken(32, 16, ckv.data(), rope.data(), token.data());
  UnpackLatentToken(32, 16, token.data(), back.data());
  float s;
  std::memcpy(&s, token.data() + 32, 4);
  EXPECT_TRUE(IsTileScale(s));
  for (int i = 0; i < 32; ++i)
    EXPECT_EQ(static_cast<double>(back[i]), Reference(NearestCode(ckv[i] / s)) * s) << i;
  for (int i = 0; i < 16; ++i) EXPECT_EQ(back[32 + i], BF16ToF32(F32ToBF16(rope[i])));
  for (float bad : {0.0f, -1.0f, 3.0f, 0.75f, INFINITY, NAN}) EXPECT_FALSE(IsTileScale(bad)) << bad;
  for (float good : {1.0f, 0.125f, 1024.0f, std::ldexp(1.0f, -126), std::ldexp(1.0f, 119)})
    EXPECT_TRUE(IsTileScale(good));
  EXPECT_FALSE(IsTileScale(std::ldexp(1.0f, -127)));  // subnormal
  EXPECT_FALSE(IsTileScale(std::ldexp(1.0f, 120)));   // 448 x 2^120 is beyond fp32
  // The largest keys saturate rather than dequantise to infinity.
  EXPECT_EQ(TileScale(3.39e38f), std::ldexp(1.0f, 119));
  const float top = E4M3ToF32(F32ToE4M3(3.39e38f / TileScale(3.39e38f))) * TileScale(3.39e38f);
  EXPECT_TRUE(std::isfinite(top));
  EXPECT_FLOAT_EQ(top, 448.0f * std::ldexp(1.0f, 119));
  // A tile of tiny keys still gets a normal scale, so its export can be imported.
  EXPECT_EQ(TileScale(1e-40f), std::ldexp(1.0f, -126));
  EXPECT_TRUE(IsTileScale(TileScale(1e-40f)));
  EXPECT_TRUE(IsTileScale(TileScale(3e38f)));
}

}  // namespace
}  // namespace attnd::fp8
