#include "common/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

namespace attnd {
namespace {

TEST(DType, ParsesOipNamesAndRejectsOthers) {
  EXPECT_EQ(ParseDType("BF16"), DType::kBF16);
  EXPECT_EQ(ParseDType("FP16"), DType::kF16);
  EXPECT_EQ(ParseDType("FP32"), DType::kF32);
  EXPECT_FALSE(ParseDType("bf16").has_value());
  EXPECT_FALSE(ParseDType("INT32").has_value());
  EXPECT_EQ(std::string(DTypeName(DType::kBF16)), "BF16");
}

TEST(DType, Fp16RoundTripsEveryBitPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = F16ToF32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(F32ToF16(f), h) << std::hex << h;
  }
}

TEST(DType, Fp16ConversionMatchesCompilerFloat16) {
#if !defined(__FLT16_MAX__)
  GTEST_SKIP() << "this compiler has no _Float16 on this target (the gcc build runs this test)";
#else
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mag(-30.0f, 17.0f);
  for (int i = 0; i < 200000; ++i) {
    const float f = std::ldexp(1.0f + (rng() % 1000000) / 1e6f, static_cast<int>(mag(rng))) *
                    ((rng() & 1) ? -1.0f : 1.0f);
    const _Float16 h = static_cast<_Float16>(f);
    uint16_t bits;
    std::memcpy(&bits, &h, 2);
    ASSERT_EQ(F32ToF16(f), bits) << f;
  }
#endif
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(F32ToBF16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly half way between two bf16 values: ties to even (down).
  EXPECT_EQ(F32ToBF16(1.00390625f), 0x3f80);
  // 1 + 3·2^-8 is half way too: ties to even (up).
  EXPECT_EQ(F32ToBF16(1.01171875f), 0x3f82);
  EXPECT_TRUE(std::isnan(BF16ToF32(F32ToBF16(NAN))));
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0, 10);
  for (int i = 0; i < 10000; ++i) {
    const float f = d(rng);
    EXPECT_LE(std::abs(BF16ToF32(F32ToBF16(f)) - f), std::abs(f) * (1.0f / 256));
  }
}

TEST(DType, BulkConversionsAgreeWithScalar) {
  std::vector<float> src = {0.5f, -3.25f, 1e-3f, 65504.0f, -1e5f, 7.0f};
  for (DType t : {DType::kBF16, DType::kF16, DType::kF32}) {
    std::vector<uint8_t> bytes(src.size() * DTypeSize(t));
    ConvertFromF32(t, src.data(), bytes.data(), src.size());
    std::vector<float> back(src.size());
    ConvertToF32(t, bytes.data(), back.data(), src.size());
    for (size_t i = 0; i < src.size(); ++i) EXPECT_EQ(back[i], RoundTo(t, src[i])) << i;
  }
}

}  // namespace
}  // namespace attnd
