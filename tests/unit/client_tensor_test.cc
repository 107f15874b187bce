// The C++ client's wire-tensor helpers: MakeFp8Tensor (per-row power-of-two scales) and
// TensorValues against the float64 values they encode.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "client/attnd_client.h"
#include "common/fp8.h"

namespace attnd::client {
namespace {

TEST(ClientTensor, Fp8RowsDecodeWithinHalfAStepOfTheirValues) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const std::vector<int64_t> shape = {3, 4, 40};
  std::vector<float> x(3 * 4 * 40);
  for (size_t i = 0; i < x.size(); ++i) x[i] = dist(rng) * std::ldexp(1.0f, (i / 40) % 7 - 3);
  const v1::Tensor t = MakeFp8Tensor(shape, x.data());
  ASSERT_EQ(t.datatype(), "FP8_E4M3");
  ASSERT_EQ(t.data().size(), x.size());
  ASSERT_EQ(t.scales().shape_size(), 3);
  EXPECT_EQ(t.scales().shape(2), 1);
  auto f = TensorValues(t);
  ASSERT_TRUE(f.ok()) << f.status();
  double err2 = 0, ref2 = 0;
  for (size_t r = 0; r < 12; ++r) {
    float scale;
    std::memcpy(&scale, t.scales().data().data() + 4 * r, 4);
    int e;
    EXPECT_EQ(std::frexp(scale, &e), 0.5f) << "a power of two";
    double amax = 0;
    for (int i = 0; i < 40; ++i) amax = std::max(amax, std::fabs(double{x[r * 40 + i]}));
    EXPECT_LE(amax / scale, 448.0);
    EXPECT_GT(amax / scale, 224.0) << "the smallest power of two that fits";
    for (int i = 0; i < 40; ++i) {
      const double v = x[r * 40 + i], got = (*f)[r * 40 + i];
      ASSERT_FALSE(std::isnan(got));
      // Half an e4m3 step: 2^-4 of the value for normals, 2^-10 * scale below 2^-6 * scale.
      EXPECT_LE(std::fabs(got - v),
                std::max(std::fabs(v) / 16, std::ldexp(double{scale}, -10)) + 1e-12);
      err2 += (got - v) * (got - v);
      ref2 += v * v;
    }
  }
  EXPECT_GT(err2, 0.0);
  EXPECT_LT(std::sqrt(err2 / ref2), 0.04);
}

TEST(ClientTensor, ValuesOfEachDatatypeAndBadScales) {
  const std::vector<float> x = {1.5f, -2.25f, 3.0e-3f, 7.0f};
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    std::vector<uint8_t> b(x.size() * DTypeSize(dt));
    ConvertFromF32(dt, x.data(), b.data(), x.size());
    auto f = TensorValues(MakeTensor(dt, {2, 2}, b.data(), b.size()));
    ASSERT_TRUE(f.ok());
    for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ((*f)[i], RoundTo(dt, x[i])) << DTypeName(dt);
  }
  v1::Tensor t = MakeFp8Tensor({2, 2}, x.data());
  t.mutable_scales()->mutable_data()->resize(4);  // one scale for two rows
  EXPECT_EQ(TensorValues(t).status().code(), absl::StatusCode::kInvalidArgument);
  v1::Tensor short_data = MakeTensor(DType::kBF16, {2, 2}, x.data(), 6);
  EXPECT_EQ(TensorValues(short_data).status().code(), absl::StatusCode::kInvalidArgument);
  v1::Tensor unknown = short_data;
  unknown.set_datatype("INT8");
  EXPECT_EQ(TensorValues(unknown).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attnd::client
