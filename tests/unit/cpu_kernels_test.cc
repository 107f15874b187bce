// The CPU backend's inner loops and per-query ops against naive float64 code, for every ISA the
// host supports.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include "common/fp8.h"
#include "kernels/cpu/attention_cpu.h"
#include "kernels/cpu/cpu_isa.h"
#include "kernels/reference/reference.h"
#include "tests/small_spec.h"

namespace attnd::cpu {
namespace {

std::vector<float> Randn(size_t n, std::mt19937_64& rng, float scale = 1.0f) {
  std::normal_distribution<float> d(0, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

class PerIsa : public ::testing::TestWithParam<Isa> {};

TEST_P(PerIsa, GemmMatchesNaiveOnRaggedShapes) {
  const Kernels& k = GetKernels(GetParam());
  std::mt19937_64 rng(1);
  for (int M : {1, 5, 6, 7, 16}) {
    for (int N : {3, 16, 32, 37, 64}) {
      for (int D : {1, 8, 33, 128}) {
        const int lda = D + 3, ldb = N + 5, ldc = N + 2;
        auto A = Randn(M * lda, rng), B = Randn(D * ldb, rng), C = Randn(M * ldc, rng);
        for (bool acc : {false, true}) {
          auto got = C;
          k.gemm(M, N, D, A.data(), lda, B.data(), ldb, got.data(), ldc, acc);
          double err = 0, norm = 0;
          for (int m = 0; m < M; ++m)
            for (int n = 0; n < N; ++n) {
              double ref = acc ? C[m * ldc + n] : 0.0;
              for (int d = 0; d < D; ++d) ref += double(A[m * lda + d]) * B[d * ldb + n];
              err = std::max(err, std::abs(ref - got[m * ldc + n]));
              norm = std::max(norm, std::abs(ref));
            }
          EXPECT_LE(err, 1e-5 * (norm + 1)) << M << "x" << N << "x" << D << " acc=" << acc;
          // Padding columns beyond N are untouched.
          for (int m = 0; m < M; ++m)
            for (int n = N; n < ldc; ++n) ASSERT_EQ(got[m * ldc + n], C[m * ldc + n]);
        }
      }
    }
  }
}

TEST_P(PerIsa, GemmAtScaledMatchesNaiveAndScaleThenGemmBitForBit) {
  const Kernels& k = GetKernels(GetParam());
  std::mt19937_64 rng(2);
  for (int M : {1, 3, 4, 5, 16, 17}) {
    for (int N : {3, 8, 24, 37, 64}) {
      for (int D : {1, 33, 64}) {
        const int lda = M + 3, ldb = N + 5, ldc = N + 2;
        auto At = Randn(D * lda, rng), B = Randn(D * ldb, rng), C = Randn(M * ldc, rng);
        auto scale = Randn(M, rng);
        scale[0] = 1.0f;  // the online softmax's usual case
        if (M > 1) scale[1] = 0.0f;
        auto got = C;
        k.gemm_at_scaled(M, N, D, At.data(), lda, B.data(), ldb, got.data(), ldc, scale.data());
        // The same as scaling C's rows and accumulating with gemm on A = At^T, bit for bit.
        std::vector<float> A(M * D), two = C;
        for (int m = 0; m < M; ++m) {
          for (int d = 0; d < D; ++d) A[m * D + d] = At[d * lda + m];
          for (int n = 0; n < N; ++n) two[m * ldc + n] *= scale[m];
        }
        k.gemm(M, N, D, A.data(), D, B.data(), ldb, two.data(), ldc, true);
        double err = 0, norm = 0;
        for (int m = 0; m < M; ++m) {
          for (int n = 0; n < N; ++n) {
            double ref = double(C[m * ldc + n]) * scale[m];
            for (int d = 0; d < D; ++d) ref += double(At[d * lda + m]) * B[d * ldb + n];
            ASSERT_FALSE(std::isnan(got[m * ldc + n]));
            err = std::max(err, std::abs(ref - got[m * ldc + n]));
            norm = std::max(norm, std::abs(ref));
            if (N % 16 == 0) {  // where both take their vector paths (scalar tails may fuse)
              ASSERT_EQ(got[m * ldc + n], two[m * ldc + n]) << M << "x" << N << "x" << D;
            }
          }
          for (int n = N; n < ldc; ++n) ASSERT_EQ(got[m * ldc + n], C[m * ldc + n]);
        }
        EXPECT_LE(err, 1e-5 * (norm + 1)) << M << "x" << N << "x" << D;
      }
    }
  }
}

TEST_P(PerIsa, SoftmaxTileIsOneOnlineSoftmaxStepPerColumn) {
  // Columns: ordinary ones (a running max below and above the tile's), one whose scores are all
  // -inf with nothing seen before (stays invisible), one with a NaN (which never counts in the
  // max and stays NaN), and one seeing its first keys now (old max -inf).
  const Kernels& k = GetKernels(GetParam());
  std::mt19937_64 rng(3);
  const int rows = 37, cols = 32, ld = cols + 16;
  auto s = Randn(rows * ld, rng, 3.0f);
  std::vector<float> m(cols), l(cols), corr(cols, NAN);
  for (int h = 0; h < cols; ++h) {
    m[h] = (h % 2 ? 4.0f : -1.0f) + 0.1f * h;
    l[h] = 1.0f + 0.5f * h;
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (int j = 0; j < rows; ++j) s[j * ld + 5] = -inf;
  m[5] = -inf;
  l[5] = 0;
  s[7 * ld + 9] = NAN;
  m[12] = -inf;
  l[12] = 0;
  const auto s0 = s, m0 = m, l0 = l;
  k.softmax_tile(s.data(), rows, cols, ld, m.data(), l.data(), corr.data());
  for (int h = 0; h < cols; ++h) {
    double mx = m0[h];
    for (int j = 0; j < rows; ++j)
      if (!std::isnan(s0[j * ld + h])) mx = std::max(mx, double(s0[j * ld + h]));
    ASSERT_EQ(m[h], static_cast<float>(mx)) << h;
    if (h == 5) {
      EXPECT_EQ(corr[h], 1.0f);
      EXPECT_EQ(l[h], 0.0f);
      for (int j = 0; j < rows; ++j) EXPECT_EQ(s[j * ld + h], 0.0f);
      continue;
    }
    // exp of the fp32 differences (the kernel subtracts in fp32, as the reference contract's
    // fp32 arithmetic does), to within the exp's own error.
    const double c = std::isinf(m0[h]) ? 1.0 : std::exp(double(m0[h] - m[h]));
    EXPECT_NEAR(corr[h], c, 3e-7 * c) << h;
    double sum = 0;
    for (int j = 0; j < rows; ++j) {
      const double x = s0[j * ld + h];
      if (std::isnan(x)) {
        EXPECT_TRUE(std::isnan(s[j * ld + h]));
        continue;
      }
      const double p = std::exp(double(s0[j * ld + h] - m[h]));
      EXPECT_NEAR(s[j * ld + h], p, 3e-7 * p + 1e-30) << h << " " << j;
      sum += p;
    }
    if (h == 9) {
      EXPECT_TRUE(std::isnan(l[h]));  // a NaN probability poisons its row's sum, as everywhere
    } else {
      EXPECT_NEAR(l[h], l0[h] * c + sum, 1e-5 * (l0[h] * c + sum)) << h;
    }
  }
  for (int j = 0; j < rows; ++j)  // columns beyond `cols` are untouched
    for (int h = cols; h < ld; ++h) ASSERT_EQ(s[j * ld + h], s0[j * ld + h]);
}

TEST_P(PerIsa, ExpIsAccurateAndHandlesInfinity) {
  const Kernels& k = GetKernels(GetParam());
  std::vector<float> x;
  for (float v = -87.0f; v <= 88.0f; v += 0.0137f) x.push_back(v);
  x.push_back(-INFINITY);
  x.push_back(-1000.0f);
  auto y = x;
  k.exp_inplace(y.data(), static_cast<int>(y.size()));
  for (size_t i = 0; i + 2 < x.size(); ++i) {
    const double ref = std::exp(double(x[i]));
    ASSERT_LE(std::abs(y[i] - ref), 3e-7 * ref) << x[i];
  }
  EXPECT_EQ(y[y.size() - 2], 0.0f);
  EXPECT_EQ(y.back(), 0.0f);
}

TEST_P(PerIsa, ReluDotIsTheIndexersWeightedReluOnRaggedRows) {
  const Kernels& k = GetKernels(GetParam());
  std::mt19937_64 rng(12);
  for (int n : {1, 7, 8, 61, 64}) {
    const int rows = 9, ld = n + 3;
    const auto s = Randn(static_cast<size_t>(rows) * ld, rng), w = Randn(n, rng);
    std::vector<float> out(rows, NAN);
    k.relu_dot(s.data(), rows, n, ld, w.data(), out.data());
    for (int j = 0; j < rows; ++j) {
      double want = 0, mag = 0;
      for (int h = 0; h < n; ++h) {
        want += double(w[h]) * std::max(0.0, double(s[j * ld + h]));
        mag += std::abs(double(w[h]) * s[j * ld + h]);
      }
      ASSERT_FALSE(std::isnan(out[j]));
      EXPECT_NEAR(out[j], want, 1e-6 * (mag + 1)) << "n " << n << " row " << j;
    }
    // A NaN score stays NaN (as in the reference and the CUDA kernels), in the vector part and
    // in the tail alike; its row's neighbours are untouched.
    for (int at : {0, n - 1}) {
      auto t = s;
      t[ld + at] = NAN;
      k.relu_dot(t.data(), rows, n, ld, w.data(), out.data());
      EXPECT_TRUE(std::isnan(out[1])) << "n " << n << " at " << at;
      EXPECT_FALSE(std::isnan(out[0]) || std::isnan(out[2]));
    }
  }
}

TEST_P(PerIsa, E4M3NaNCodesDecodeToNaN) {
  const Kernels& k = GetKernels(GetParam());
  std::vector<unsigned char> codes(40, 0x38);  // 1.0
  codes[3] = 0x7f;
  codes[21] = 0xff;  // in the vector part and the scalar tail of a 16-wide loop
  codes[37] = 0x7f;
  const float scale = 2.0f;
  std::vector<float> out(codes.size());
  k.e4m3_to_f32(codes.data(), &scale, 40, out.data(), 40);
  for (size_t i = 0; i < codes.size(); ++i)
    EXPECT_EQ(std::isnan(out[i]), (codes[i] & 0x7f) == 0x7f) << i << " " << out[i];
  EXPECT_EQ(out[0], 2.0f);
}

TEST_P(PerIsa, E4M3DecodeIsExactForEveryFiniteCodeAndScale) {
  const Kernels& k = GetKernels(GetParam());
  // Every finite code (NaN codes 0x7f/0xff are never stored), over ragged lengths and tiles so
  // the vector and scalar tails both run, with power-of-two scales far from 1.
  std::vector<unsigned char> codes;
  for (int c = 0; c < 256; ++c)
    if ((c & 0x7f) != 0x7f) codes.push_back(static_cast<unsigned char>(c));
  for (int tile : {7, 16, 127, 254}) {
    const int n = static_cast<int>(codes.size());
    std::vector<float> scales((n + tile - 1) / tile), out(n, NAN);
    // The extremes too: 2^-126 (subnormal products) and 2^120 (256 * scale overflows).
    for (size_t t = 0; t < scales.size(); ++t)
      scales[t] = t % 5 == 3   ? std::ldexp(1.0f, -126)
                  : t % 5 == 4 ? std::ldexp(1.0f, 120)
                               : std::ldexp(1.0f, static_cast<int>(t * 7 % 40) - 20);
    k.e4m3_to_f32(codes.data(), scales.data(), tile, out.data(), n);
    for (int i = 0; i < n; ++i) {
      const double want = static_cast<double>(fp8::E4M3ToF32(codes[i])) * scales[i / tile];
      ASSERT_EQ(static_cast<double>(out[i]), want) << "code " << int(codes[i]) << " tile " << tile;
      ASSERT_EQ(std::signbit(out[i]), (codes[i] & 0x80) != 0) << int(codes[i]);  // -0 stays -0
    }
  }
}

// Every inner loop of the AVX-512 table gives the AVX2 table's bits on the same inputs: GEMMs of
// shapes whose columns fill whole vectors, or leave scalar tails, on both; the online softmax, exp,
// the indexer's reduction, and both row decodes.
TEST(Isas, Avx512GivesTheBitsOfAvx2) {
  const auto isas = SupportedIsas();
  if (std::find(isas.begin(), isas.end(), Isa::kAvx512) == isas.end())
    GTEST_SKIP() << "this host has no AVX-512";
  const Kernels &a = GetKernels(Isa::kAvx2), &b = GetKernels(Isa::kAvx512);
  std::mt19937_64 rng(21);
  const auto same = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  for (int M : {1, 5, 8, 13, 64}) {
    for (int N : {16, 24, 40, 64, 100, 512}) {
      for (int D : {7, 64, 576}) {
        const int lda = D + 1, ldb = N + 3, ldc = N + 5;
        const auto A = Randn(M * lda, rng), B = Randn(D * ldb, rng), C = Randn(M * ldc, rng);
        for (bool acc : {false, true}) {
          auto x = C, y = C;
          a.gemm(M, N, D, A.data(), lda, B.data(), ldb, x.data(), ldc, acc);
          b.gemm(M, N, D, A.data(), lda, B.data(), ldb, y.data(), ldc, acc);
          ASSERT_TRUE(same(x, y)) << "gemm " << M << "x" << N << "x" << D << " acc " << acc;
          ASSERT_FALSE(same(x, C));
        }
        // gemm_at_scaled: At is [D, M] with row stride M + 2.
        const auto At = Randn(D * (M + 2), rng), scale = Randn(M, rng);
        auto x = C, y = C;
        a.gemm_at_scaled(M, N, D, At.data(), M + 2, B.data(), ldb, x.data(), ldc, scale.data());
        b.gemm_at_scaled(M, N, D, At.data(), M + 2, B.data(), ldb, y.data(), ldc, scale.data());
        ASSERT_TRUE(same(x, y)) << "gemm_at_scaled " << M << "x" << N << "x" << D;
      }
    }
  }
  for (int cols : {16, 32, 128}) {
    const int rows = 64, ld = cols + 16;
    auto s = Randn(rows * ld, rng, 4.0f);
    s[3 * ld + 1] = -std::numeric_limits<float>::infinity();
    auto m = Randn(cols, rng), l = Randn(cols, rng), corr = std::vector<float>(cols);
    for (float& v : l) v = std::abs(v);
    m[0] = -std::numeric_limits<float>::infinity();
    auto s2 = s, m2 = m, l2 = l, corr2 = corr;
    a.softmax_tile(s.data(), rows, cols, ld, m.data(), l.data(), corr.data());
    b.softmax_tile(s2.data(), rows, cols, ld, m2.data(), l2.data(), corr2.data());
    ASSERT_TRUE(same(s, s2) && same(m, m2) && same(l, l2) && same(corr, corr2)) << cols;
  }
  {
    auto x = Randn(1001, rng, 30.0f), y = x;
    a.exp_inplace(x.data(), 1001);
    b.exp_inplace(y.data(), 1001);
    ASSERT_TRUE(same(x, y));
  }
  for (int n : {61, 64, 128}) {
    const int rows = 17, ld = n + 4;
    const auto s = Randn(rows * ld, rng), w = Randn(n, rng);
    std::vector<float> x(rows), y(rows);
    a.relu_dot(s.data(), rows, n, ld, w.data(), x.data());
    b.relu_dot(s.data(), rows, n, ld, w.data(), y.data());
    ASSERT_TRUE(same(x, y)) << n;
  }
  for (int n : {64, 100, 576}) {
    std::vector<unsigned char> codes(n);
    std::vector<unsigned short> bf(n);
    for (int i = 0; i < n; ++i) {
      codes[i] = static_cast<unsigned char>(rng() & 0xff);
      bf[i] = static_cast<unsigned short>(rng());
    }
    const std::vector<float> scales = {0.5f, 0x1p-20f, 0x1p119f, 8.0f, 1.0f};
    std::vector<float> x(n), y(n);
    a.e4m3_to_f32(codes.data(), scales.data(), 128, x.data(), n);
    b.e4m3_to_f32(codes.data(), scales.data(), 128, y.data(), n);
    ASSERT_TRUE(same(x, y)) << n;  // NaN codes too: the same NaN bits
    a.bf16_to_f32(bf.data(), x.data(), n);
    b.bf16_to_f32(bf.data(), y.data(), n);
    ASSERT_TRUE(same(x, y)) << n;
  }
}

TEST(Isas, EverySupportedIsaIsFoundByItsName) {
  for (Isa isa : SupportedIsas()) EXPECT_EQ(SupportedIsaNamed(IsaName(isa)), isa);
  EXPECT_EQ(SupportedIsaNamed("sse9"), std::nullopt);
  EXPECT_EQ(SupportedIsaNamed(""), std::nullopt);
}

INSTANTIATE_TEST_SUITE_P(Isas, PerIsa, ::testing::ValuesIn(SupportedIsas()),
                         [](const auto& info) { return std::string(IsaName(info.param)); });

using testing::SmallSpec;

// One sequence's rows, scattered over shuffled pages of a small pool.
struct PagedSeq {
  int ps = 16, dim = 0;
  DType dtype = DType::kF32;
  std::vector<int32_t> pages;
  std::vector<uint8_t> pool;
  std::vector<double> rows;  // unpaged values, as stored

  PagedSeq(int64_t n, int dim_, DType t, std::mt19937_64& rng) : dim(dim_), dtype(t) {
    const int64_t np = (n + ps - 1) / ps;
    pages.resize(np);
    std::iota(pages.begin(), pages.end(), 1);
    std::shuffle(pages.begin(), pages.end(), rng);
    pool.assign((np + 1) * ps * dim * DTypeSize(t), 0);
    auto v = Randn(n * dim, rng);
    for (int64_t s = 0; s < n; ++s) {
      uint8_t* dst = pool.data() + ((pages[s / ps] * ps) + s % ps) * dim * DTypeSize(t);
      ConvertFromF32(t, v.data() + s * dim, dst, dim);
      std::vector<float> back(dim);
      ConvertToF32(t, dst, back.data(), dim);
      rows.insert(rows.end(), back.begin(), back.end());
    }
  }
  std::vector<int32_t> indptr() const { return {0, static_cast<int32_t>(pages.size())}; }
  CacheRows rows_view() const { return {pool.data(), dim * DTypeSize(dtype), dtype, dim}; }
  PageTable table(const std::vector<int32_t>& indptr) const {
    return {indptr.data(), pages.data(), ps};
  }
  // The physical slots of positions (what a selection hands attention).
  std::vector<int32_t> Slots(const std::vector<int32_t>& positions) const {
    std::vector<int32_t> out;
    for (int32_t s : positions) out.push_back(pages[s / ps] * ps + s % ps);
    return out;
  }
};

TEST_P(PerIsa, IndexerScoresMatchReference) {
  const Kernels& k = GetKernels(GetParam());
  std::mt19937_64 rng(21);
  ModelSpec spec = SmallSpec(SelectionMode::kToken);
  spec.index_n_heads = 5;
  spec.index_head_dim = 24;
  for (DType t : {DType::kF32, DType::kBF16}) {
    const int64_t n = 150;
    PagedSeq seq(n, spec.index_head_dim, t, rng);
    auto q = Randn(spec.index_n_heads * spec.index_head_dim, rng);
    auto w = Randn(spec.index_n_heads, rng);
    std::vector<double> qd(q.begin(), q.end()), wd(w.begin(), w.end());
    const auto ref = reference::IndexerScores(spec, qd.data(), wd.data(), seq.rows.data(), n);
    std::vector<float> got(n, NAN);
    // Two chunks, as the engine splits long queries.
    const auto indptr = seq.indptr();
    for (auto [b, e] : {std::pair<int64_t, int64_t>{0, 70}, {70, n}}) {
      IndexerScoreParams p;
      p.q = q.data();
      p.w = w.data();
      p.num_heads = spec.index_n_heads;
      p.head_dim = spec.index_head_dim;
      p.keys = seq.rows_view();
      p.table = seq.table(indptr);
      p.begin = b;
      p.end = e;
      p.scores = got.data() + b;
      IndexerScores(k, p);
    }
    for (int64_t s = 0; s < n; ++s) ASSERT_NEAR(got[s], ref[s], 1e-4 * (1 + std::abs(ref[s])));
  }
}

TEST_P(PerIsa, MlaAttendMatchesReferenceForListsRangesAndSoftCap) {
  const Kernels& k = GetKernels(GetParam());
  std::mt19937_64 rng(31);
  ModelSpec spec = SmallSpec(SelectionMode::kToken);
  spec.num_heads = 7;
  const int D = spec.latent_dim(), L = spec.kv_lora_rank, H = spec.num_heads;
  const int64_t n = 101;
  PagedSeq seq(n, D, DType::kF32, rng);
  auto q = Randn(H * D, rng);
  std::vector<double> qd(q.begin(), q.end());
  std::vector<int32_t> list;
  for (int32_t s = 0; s < n; s += 1 + rng() % 4) list.push_back(s);
  const std::vector<int32_t> slots = seq.Slots(list);
  const auto indptr = seq.indptr();
  for (double cap : {0.0, 2.5}) {
    for (bool use_list : {true, false}) {
      std::vector<int32_t> keys = list;
      MlaParams p;
      p.q = q.data();
      p.num_heads = H;
      p.latent_dim = L;
      p.rope_dim = spec.qk_rope_head_dim;
      p.kv = seq.rows_view();
      p.sm_scale = static_cast<float>(spec.sm_scale);
      p.soft_cap = static_cast<float>(cap);
      if (use_list) {
        p.slots = slots.data();
        p.num_keys = static_cast<int64_t>(slots.size());
      } else {
        p.table = seq.table(indptr);
        p.begin = 13;
        p.end = n;
        keys.clear();
        for (int32_t s = 13; s < n; ++s) keys.push_back(s);
      }
      std::vector<float> out(H * L, NAN), lse(H, NAN);
      p.out = out.data();
      p.lse = lse.data();
      MlaAttend(k, p);
      std::vector<double> ref(H * L);
      reference::Attend(spec, qd.data(), seq.rows.data(), keys, cap, ref.data());
      double num = 0, den = 0;
      for (int i = 0; i < H * L; ++i) {
        ASSERT_FALSE(std::isnan(out[i]));
        num += (out[i] - ref[i]) * (out[i] - ref[i]);
        den += ref[i] * ref[i];
      }
      EXPECT_LE(std::sqrt(num / den), 1e-5) << "cap=" << cap << " list=" << use_list;
      // Each head's log-sum-exp of its scaled (capped) scores over the keys, in float64.
      for (int h = 0; h < H; ++h) {
        std::vector<double> sc;
        for (int32_t key : keys) {
          double dot = 0;
          for (int d = 0; d < D; ++d) dot += qd[h * D + d] * seq.rows[int64_t{key} * D + d];
          dot *= spec.sm_scale;
          sc.push_back(cap > 0 ? cap * std::tanh(dot / cap) : dot);
        }
        const double top = *std::max_element(sc.begin(), sc.end());
        double sum = 0;
        for (double x : sc) sum += std::exp(x - top);
        ASSERT_FALSE(std::isnan(lse[h]));
        EXPECT_NEAR(lse[h], top + std::log(sum), 1e-5 * (1 + std::abs(top))) << h;
      }
    }
  }
}

}  // namespace
}  // namespace attnd::cpu
