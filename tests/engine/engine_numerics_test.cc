// The engine's per-layer results against the float64 reference, and the equivalences the
// contract promises (chunking, prefix forks, batch composition, K >= visible, IndexShare).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <optional>
#include <tuple>

#include "kernels/cpu/cpu_isa.h"
#include "tests/engine_harness.h"
#include "tests/run_layer.h"

namespace attnd::testing {
namespace {

ModelSpec TestSpec(int page_size, int heads, SelectionMode mode) {
  ModelSpec s = MixedLayerSpec(mode);
  s.name = "test";
  // full, shared, full, shared, dense: a second shared layer after the last full one.
  s.layers = {LayerKind::kFull, LayerKind::kShared, LayerKind::kFull, LayerKind::kShared,
              LayerKind::kDense};
  s.page_size = page_size;
  s.num_heads = heads;
  return s;
}

double Tolerance(DType t) { return t == DType::kF32 ? 1e-5 : 1e-2; }
DType CacheFor(DType t) { return t == DType::kF32 ? DType::kF32 : DType::kBF16; }

EngineOptions Options(const ModelSpec& spec, DType input, int pages = 512,
                      std::optional<DType> cache = std::nullopt) {
  EngineOptions o;
  o.spec = spec;
  o.cache_dtype = cache.value_or(CacheFor(input));
  o.pages_per_device = pages;
  o.threads = 2;
  return o;
}

using SweepParam = std::tuple<int, DType, int, SelectionMode>;

class Sweep : public ::testing::TestWithParam<SweepParam> {};

// Prefill (page-aligned and not), a mixed batch of decode and extend with a cached prefix, then
// decode until kv_len >> K; every layer of every step checked against float64.
void SweepSteps(const SweepParam& param, std::optional<DType> cache) {
  const auto [ps, dtype, heads, mode] = param;
  Harness h(Options(TestSpec(ps, heads, mode), dtype, 512, cache));
  h.Open("a");
  h.Open("b");
  h.Open("c");
  uint64_t seed = 100;
  h.RunAndCheck({{"a", 37}, {"b", ps}, {"c", 5}}, dtype, seed++, Tolerance(dtype));
  h.RunAndCheck({{"a", 1}, {"b", 70}, {"c", 1}}, dtype, seed++, Tolerance(dtype));
  for (int i = 0; i < 3; ++i)
    h.RunAndCheck({{"c", 1}, {"a", 1}, {"b", 1}}, dtype, seed++, Tolerance(dtype));
  h.RunAndCheck({{"a", 2 * ps + 3}, {"c", 1}}, dtype, seed++, Tolerance(dtype));
  EXPECT_GT(h.Length("b"), 3 * 24);  // kv_len >> K
  EXPECT_GT(h.worst_rel_l2(), 0.0);  // the comparison is live
}

TEST_P(Sweep, EveryStepMatchesFloat64Reference) { SweepSteps(GetParam(), std::nullopt); }

// The same steps on an fp8 cache, against the float64 oracle on the dequantised keys
// (docs/architecture.md).
class Fp8Sweep : public ::testing::TestWithParam<SweepParam> {};
TEST_P(Fp8Sweep, EveryStepMatchesFloat64ReferenceOnDequantisedKeys) {
  SweepSteps(GetParam(), DType::kFP8E4M3);
}

std::string SweepName(const ::testing::TestParamInfo<SweepParam>& info) {
  const int ps = std::get<0>(info.param), heads = std::get<2>(info.param);
  const DType dt = std::get<1>(info.param);
  const SelectionMode mode = std::get<3>(info.param);
  const char* m = mode == SelectionMode::kToken       ? "token"
                  : mode == SelectionMode::kPageUnion ? "union"
                                                      : "budget";
  return "ps" + std::to_string(ps) + "_" + std::string(DTypeName(dt)) + "_h" +
         std::to_string(heads) + "_" + m;
}

INSTANTIATE_TEST_SUITE_P(
    Engine, Sweep,
    ::testing::Combine(::testing::Values(16, 64),
                       ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                       ::testing::Values(1, 4, 16),
                       ::testing::Values(SelectionMode::kToken, SelectionMode::kPageUnion,
                                         SelectionMode::kPageBudget)),
    SweepName);

// FP8_E4M3 queries (q_latent, q_rope, index_q with one scale per token and head; keys BF16): the
// same steps against the float64 oracle on the dequantised queries; outputs come back in BF16.
class Fp8QuerySweep : public ::testing::TestWithParam<SweepParam> {};
TEST_P(Fp8QuerySweep, EveryStepMatchesFloat64ReferenceOnDequantisedQueries) {
  SweepSteps(GetParam(), std::nullopt);
}
INSTANTIATE_TEST_SUITE_P(Engine, Fp8QuerySweep,
                         ::testing::Combine(::testing::Values(16, 64),
                                            ::testing::Values(DType::kFP8E4M3),
                                            ::testing::Values(1, 16),
                                            ::testing::Values(SelectionMode::kToken,
                                                              SelectionMode::kPageUnion,
                                                              SelectionMode::kPageBudget)),
                         SweepName);

INSTANTIATE_TEST_SUITE_P(Engine, Fp8Sweep,
                         ::testing::Combine(::testing::Values(16, 64),
                                            ::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::Values(1, 16),
                                            ::testing::Values(SelectionMode::kToken,
                                                              SelectionMode::kPageUnion,
                                                              SelectionMode::kPageBudget)),
                         SweepName);

// What fp8 keys cost in accuracy (docs/architecture.md asks for it measured, not hidden): the same
// steps on an fp8 and on an fp32 cache at DeepSeek-V3.2's row shapes (L 512 in four tiles, R 64, Di
// 128), fp32 and bf16 queries. With K above every context the layers attend the same keys on both
// caches (the attention's own error); with K = 64 of up to 304 keys the indexer's selections
// move too (random keys: many near ties), measured as the share of selected keys both keep; a
// swapped key is 1/64 of a near-uniform average, so the outputs move far more than the keys do.
// Printed; asserted only to be visible (quantisation is live) and sane.
TEST(Fp8Cache, EndToEndErrorAgainstAnUnquantisedCacheIsMeasured) {
  ModelSpec spec = TestSpec(64, 8, SelectionMode::kToken);
  spec.kv_lora_rank = 512;
  spec.qk_rope_head_dim = 64;
  spec.index_head_dim = 128;
  spec.index_n_heads = 8;
  spec.sm_scale = 1.0 / std::sqrt(192.0);
  for (int topk : {1024, 64}) {
    spec.index_topk = topk;
    for (DType q : {DType::kF32, DType::kBF16}) {
      Harness fp8(Options(spec, q, 64, DType::kFP8E4M3)), exact(Options(spec, q, 64, DType::kF32));
      for (Harness* h : {&fp8, &exact}) h->Open("s");
      double worst = 0, sum = 0, kept = 0;
      int n = 0, queries = 0;
      for (int step = 0; step < 5; ++step) {
        const std::vector<StepEntry> batch = {{"s", step == 0 ? 300 : 1}};
        const auto in = fp8.MakeInputs(batch, q, 40 + step);
        auto a = fp8.Run(batch, in);
        auto b = exact.Run(batch, in);
        ASSERT_TRUE(a.status.ok() && b.status.ok()) << a.status << b.status;
        for (int l = 0; l < spec.num_layers(); ++l) {
          for (double x : a.out[l]) ASSERT_FALSE(std::isnan(x));
          const double e = RelL2(a.out[l], b.out[l]);
          worst = std::max(worst, e);
          sum += e;
          ++n;
          if (spec.layers[l] != LayerKind::kFull) continue;
          for (size_t t = 0; t < a.traces[l].keys.size(); ++t) {
            const auto &x = a.traces[l].keys[t], &y = b.traces[l].keys[t];
            if (static_cast<int>(y.size()) < topk) continue;  // attends every key
            std::vector<int32_t> both;
            std::set_intersection(x.begin(), x.end(), y.begin(), y.end(), std::back_inserter(both));
            kept += static_cast<double>(both.size()) / y.size();
            ++queries;
          }
        }
      }
      std::printf(
          "fp8 vs fp32 cache, %s queries, top-%d: output rel-L2 mean %.3g, worst %.3g "
          "(%d layer outputs); selected keys kept %.3f (%d queries)\n",
          DTypeName(q), topk, sum / n, worst, n, queries ? kept / queries : 1.0, queries);
      RecordProperty(std::string("fp8_rel_l2_worst_") + DTypeName(q) + "_k" + std::to_string(topk),
                     std::to_string(worst));
      EXPECT_GT(worst, 1e-4);  // the keys were quantised
      if (topk > 300) {
        // The same keys: e4m3 keeps 3 mantissa bits (about 3% rms per value), so ~4% here.
        EXPECT_LT(worst, 0.1);
      } else {
        ASSERT_GT(queries, 0);
        EXPECT_GT(kept / queries, 0.5);
      }
    }
  }
}

class PerIsa : public ::testing::TestWithParam<cpu::Isa> {};

TEST_P(PerIsa, LongContextDecodeMatchesReference) {
  ModelSpec spec = TestSpec(16, 4, SelectionMode::kToken);
  EngineOptions o = Options(spec, DType::kF32);
  o.device.cpu_isa = std::string(cpu::IsaName(GetParam()));
  Harness h(o);
  h.Open("x");
  h.Open("y");
  h.RunAndCheck({{"x", 600}, {"y", 300}}, DType::kF32, 1, 1e-5);
  for (int i = 0; i < 3; ++i) h.RunAndCheck({{"x", 1}, {"y", 1}}, DType::kF32, 2 + i, 1e-5);
}

TEST_P(PerIsa, LongContextDecodeOnAnFp8CacheMatchesReference) {
  ModelSpec spec = TestSpec(16, 4, SelectionMode::kToken);
  EngineOptions o = Options(spec, DType::kF32, 512, DType::kFP8E4M3);
  o.device.cpu_isa = std::string(cpu::IsaName(GetParam()));
  Harness h(o);
  h.Open("x");
  h.RunAndCheck({{"x", 600}}, DType::kF32, 1, 1e-5);
  for (int i = 0; i < 3; ++i) h.RunAndCheck({{"x", 1}}, DType::kF32, 2 + i, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Isas, PerIsa, ::testing::ValuesIn(cpu::SupportedIsas()),
                         [](const auto& info) { return std::string(cpu::IsaName(info.param)); });

// AVX-512 changes only the speed: every output, log-sum-exp and selection of a prefill and a few
// decode steps equals AVX2's bit for bit, on fp32, bf16 and fp8 caches (each output element is
// one FMA chain in the same order on both ISAs).
TEST(Engine, Avx512GivesTheBitsOfAvx2) {
  const auto isas = cpu::SupportedIsas();
  if (std::find(isas.begin(), isas.end(), cpu::Isa::kAvx512) == isas.end())
    GTEST_SKIP() << "this host has no AVX-512";
  for (DType cache : {DType::kF32, DType::kBF16, DType::kFP8E4M3}) {
    std::vector<Harness::Result> runs[2];
    for (int i = 0; i < 2; ++i) {
      EngineOptions o = Options(TestSpec(16, 16, SelectionMode::kToken), DType::kF32, 512, cache);
      o.device.cpu_isa = i == 0 ? "avx2" : "avx512";
      Harness h(o);
      h.Open("x");
      h.Open("y");
      std::vector<StepEntry> batch = {{"x", 300}, {"y", 77}};
      runs[i].push_back(h.Run(batch, h.MakeInputs(batch, DType::kF32, 5)));
      batch = {{"x", 1}, {"y", 1}};
      for (int s = 0; s < 3; ++s)
        runs[i].push_back(h.Run(batch, h.MakeInputs(batch, DType::kF32, 6 + s)));
    }
    for (size_t s = 0; s < runs[0].size(); ++s) {
      const Harness::Result &a = runs[0][s], &b = runs[1][s];
      ASSERT_TRUE(a.status.ok() && b.status.ok()) << a.status << " " << b.status;
      ASSERT_EQ(a.out.size(), b.out.size());
      for (size_t l = 0; l < a.out.size(); ++l) {
        ASSERT_FALSE(a.out[l].empty());
        double mag = 0;
        for (size_t j = 0; j < a.out[l].size(); ++j) {
          ASSERT_FALSE(std::isnan(a.out[l][j]));
          // Bits, not values: 0 and -0 differ.
          ASSERT_EQ(std::signbit(a.out[l][j]), std::signbit(b.out[l][j]));
          ASSERT_EQ(a.out[l][j], b.out[l][j])
              << DTypeName(cache) << " step " << s << " layer " << l << " element " << j;
          mag = std::max(mag, std::abs(a.out[l][j]));
        }
        EXPECT_GT(mag, 1e-3);  // real outputs, not zeros
        EXPECT_EQ(a.lse[l], b.lse[l]) << DTypeName(cache) << " step " << s << " layer " << l;
        EXPECT_EQ(a.traces[l].keys, b.traces[l].keys) << DTypeName(cache) << " layer " << l;
      }
    }
  }
}

TEST(Engine, DensePrefillModeAttendsEveryVisibleKeyButDecodeStaysSparse) {
  ModelSpec spec = TestSpec(16, 4, SelectionMode::kToken);
  spec.prefill = PrefillMode::kDense;
  Harness h(Options(spec, DType::kF32));
  h.Open("p");
  const auto layers = h.MakeInputs({{"p", 80}}, DType::kF32, 9);
  auto r = h.Run({{"p", 80}}, layers);
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.traces[0].keys[79].size(), 80u);  // > K = 24 keys: dense
  std::vector<LayerCheck> checks;
  auto ref = h.Reference({{"p", 80}}, layers, r.traces, &checks);
  for (int l = 0; l < spec.num_layers(); ++l) EXPECT_LE(RelL2(r.out[l], ref[l]), 1e-5);
  const auto dec = h.MakeInputs({{"p", 1}}, DType::kF32, 10);
  auto d = h.Run({{"p", 1}}, dec);
  ASSERT_TRUE(d.status.ok());
  EXPECT_EQ(d.traces[0].keys[0].size(), 24u);  // decode: top-k
}

// Copies token rows [begin, end) of every layer's tensors.
std::vector<LayerData> Slice(const std::vector<LayerData>& in, int64_t begin, int64_t end) {
  auto cut = [&](const HostTensor& t) {
    if (!t.present) return t;
    HostTensor o = t;
    int64_t row = 1;
    for (size_t i = 1; i < t.shape.size(); ++i) row *= t.shape[i];
    o.shape[0] = end - begin;
    const size_t es = DTypeSize(t.dtype);
    o.bytes.assign(t.bytes.begin() + begin * row * es, t.bytes.begin() + end * row * es);
    o.values.assign(t.values.begin() + begin * row, t.values.begin() + end * row);
    return o;
  };
  std::vector<LayerData> out;
  for (const auto& l : in)
    out.push_back({cut(l.q_latent), cut(l.q_rope), cut(l.kv_latent), cut(l.k_rope), cut(l.index_q),
                   cut(l.index_k), cut(l.index_w)});
  return out;
}

// Concatenates two inputs' token rows.
std::vector<LayerData> Concat(const std::vector<LayerData>& a, const std::vector<LayerData>& b) {
  auto cat = [](const HostTensor& x, const HostTensor& y) {
    if (!x.present) return x;
    HostTensor o = x;
    o.shape[0] += y.shape[0];
    o.bytes.insert(o.bytes.end(), y.bytes.begin(), y.bytes.end());
    o.values.insert(o.values.end(), y.values.begin(), y.values.end());
    return o;
  };
  std::vector<LayerData> out;
  for (size_t l = 0; l < a.size(); ++l)
    out.push_back({cat(a[l].q_latent, b[l].q_latent), cat(a[l].q_rope, b[l].q_rope),
                   cat(a[l].kv_latent, b[l].kv_latent), cat(a[l].k_rope, b[l].k_rope),
                   cat(a[l].index_q, b[l].index_q), cat(a[l].index_k, b[l].index_k),
                   cat(a[l].index_w, b[l].index_w)});
  return out;
}

// Rows [begin, end) of a layer output [T, H, L].
std::vector<double> Rows(const std::vector<double>& out, const ModelSpec& s, int64_t begin,
                         int64_t end) {
  const int64_t row = int64_t{s.num_heads} * s.kv_lora_rank;
  return {out.begin() + begin * row, out.begin() + end * row};
}

TEST(Engine, ChunkedPrefillEqualsSingleShot) {
  for (auto mode : {SelectionMode::kToken, SelectionMode::kPageBudget}) {
    ModelSpec spec = TestSpec(16, 4, mode);
    Harness h(Options(spec, DType::kBF16));
    h.Open("whole");
    h.Open("chunked");
    const auto all = h.MakeInputs({{"whole", 150}}, DType::kBF16, 77);
    auto single = h.Run({{"whole", 150}}, all);
    ASSERT_TRUE(single.status.ok());
    const int64_t cuts[] = {0, 41, 100, 150};  // 3 chunks, none page aligned
    for (int c = 0; c < 3; ++c) {
      auto part = h.Run({{"chunked", cuts[c + 1] - cuts[c]}}, Slice(all, cuts[c], cuts[c + 1]));
      ASSERT_TRUE(part.status.ok()) << part.status;
      for (int l = 0; l < spec.num_layers(); ++l)
        EXPECT_EQ(part.out[l], Rows(single.out[l], spec, cuts[c], cuts[c + 1]))
            << "chunk " << c << " layer " << l;
    }
  }
}

TEST(Engine, ForkedPrefixPlusExtendEqualsRecomputingTheWholeSequence) {
  ModelSpec spec = TestSpec(16, 4, SelectionMode::kToken);
  Harness h(Options(spec, DType::kF32));
  h.Open("parent");
  const auto prefix = h.MakeInputs({{"parent", 100}}, DType::kF32, 5);
  ASSERT_TRUE(h.Run({{"parent", 100}}, prefix).status.ok());
  // Fork at 70: 4 shared full pages, a copied partial page (70 % 16 = 6).
  h.Fork("child", "parent", 70);
  const auto ext = h.MakeInputs({{"child", 30}}, DType::kF32, 6);
  auto forked = h.Run({{"child", 30}}, ext);
  ASSERT_TRUE(forked.status.ok());
  std::vector<LayerCheck> checks;
  auto ref = h.Reference({{"child", 30}}, ext, forked.traces, &checks);
  h.Open("fresh");
  auto whole = h.Run({{"fresh", 100}}, Concat(Slice(prefix, 0, 70), ext));
  ASSERT_TRUE(whole.status.ok());
  for (int l = 0; l < spec.num_layers(); ++l) {
    EXPECT_EQ(forked.out[l], Rows(whole.out[l], spec, 70, 100)) << "layer " << l;
    EXPECT_LE(RelL2(forked.out[l], ref[l]), 1e-5);
  }
  auto info = h.engine().DescribeSequence("child");
  auto pinfo = h.engine().DescribeSequence("parent");
  ASSERT_TRUE(info.ok() && pinfo.ok());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(info->pages[i], pinfo->pages[i]);
  EXPECT_NE(info->pages[4], pinfo->pages[4]);
}

// Many query heads (as a sharded step brings them): the CPU device splits a step's heads into
// groups of 16 to 64 by the work there is (one query alone: narrow groups so both threads work;
// a batch: wide ones). The outputs match the float64 oracle either way and a query's output is
// the same bits alone as in a batch.
TEST(Engine, ManyHeadsMatchTheReferenceWhateverTheHeadGrouping) {
  for (int heads : {40, 64}) {
    ModelSpec spec = TestSpec(16, heads, SelectionMode::kToken);
    Harness h(Options(spec, DType::kF32));
    std::vector<StepEntry> prefill, decode;
    for (int i = 0; i < 8; ++i) {
      const std::string id = "s" + std::to_string(i);
      h.Open(id);
      prefill.push_back({id, 40 + 9 * i});
      decode.push_back({id, 1});
    }
    h.RunAndCheck(prefill, DType::kF32, 1, 1e-5);
    h.Fork("alone", "s3", h.Length("s3"));
    const auto mine = h.MakeInputs({{"alone", 1}}, DType::kF32, 2);
    std::vector<StepEntry> batch(decode.begin(), decode.begin() + 3);
    const auto rest = h.MakeInputs(batch, DType::kF32, 3);
    batch.push_back({"s3", 1});
    auto in_batch = h.Run(batch, Concat(rest, mine));
    ASSERT_TRUE(in_batch.status.ok()) << in_batch.status;
    std::vector<LayerCheck> checks;
    const auto ref = h.Reference(batch, Concat(rest, mine), in_batch.traces, &checks);
    auto alone = h.Run({{"alone", 1}}, mine);
    ASSERT_TRUE(alone.status.ok()) << alone.status;
    for (int l = 0; l < spec.num_layers(); ++l) {
      EXPECT_LE(RelL2(in_batch.out[l], ref[l]), 1e-5) << heads << " heads, layer " << l;
      EXPECT_EQ(alone.out[l], Rows(in_batch.out[l], spec, 3, 4)) << heads << " heads, layer " << l;
    }
    h.RunAndCheck(decode, DType::kF32, 4, 1e-5);
  }
}

TEST(Engine, ResultsDoNotDependOnBatchCompositionOrOrder) {
  ModelSpec spec = TestSpec(16, 4, SelectionMode::kPageUnion);
  Harness h(Options(spec, DType::kBF16));
  h.Open("base");
  h.Open("other1");
  h.Open("other2");
  ASSERT_TRUE(h.Run({{"base", 90}, {"other1", 50}, {"other2", 33}},
                    h.MakeInputs({{"base", 90}, {"other1", 50}, {"other2", 33}}, DType::kBF16, 1))
                  .status.ok());
  h.Fork("alone", "base", 90);
  h.Fork("mixed", "base", 90);
  const auto mine = h.MakeInputs({{"alone", 3}}, DType::kBF16, 2);
  auto alone = h.Run({{"alone", 3}}, mine);
  ASSERT_TRUE(alone.status.ok());
  const auto o1 = h.MakeInputs({{"other1", 1}}, DType::kBF16, 3);
  const auto o2 = h.MakeInputs({{"other2", 7}}, DType::kBF16, 4);
  auto mixed = h.Run({{"other2", 7}, {"mixed", 3}, {"other1", 1}}, Concat(Concat(o2, mine), o1));
  ASSERT_TRUE(mixed.status.ok());
  for (int l = 0; l < spec.num_layers(); ++l)
    EXPECT_EQ(alone.out[l], Rows(mixed.out[l], spec, 7, 10)) << "layer " << l;
}

TEST(Engine, TopKCoveringEveryVisibleKeyEqualsDenseCausalAttention) {
  ModelSpec sparse = TestSpec(16, 4, SelectionMode::kToken);
  sparse.layers = {LayerKind::kFull, LayerKind::kShared, LayerKind::kFull};
  sparse.index_topk = 1 << 20;
  ModelSpec dense = sparse;
  dense.layers.assign(3, LayerKind::kDense);
  dense.sliding_window = 0;
  dense.soft_cap = 0;
  Harness hs(Options(sparse, DType::kF32));
  Harness hd(Options(dense, DType::kF32));
  hs.Open("s");
  hd.Open("s");
  for (auto [q, seed] : {std::pair<int64_t, uint64_t>{130, 1}, {1, 2}, {17, 3}}) {
    const auto in = hs.MakeInputs({{"s", q}}, DType::kF32, seed);
    auto a = hs.Run({{"s", q}}, in);
    std::vector<LayerData> din = in;
    for (auto& l : din) l.index_q = l.index_k = l.index_w = HostTensor{};
    auto b = hd.Run({{"s", q}}, din);
    ASSERT_TRUE(a.status.ok() && b.status.ok()) << a.status << b.status;
    for (int l = 0; l < 3; ++l) EXPECT_LE(RelL2(a.out[l], b.out[l]), 1e-6);
  }
}

TEST(Engine, SharedLayerAttendsThePrecedingFullLayersSelection) {
  ModelSpec spec = TestSpec(16, 4, SelectionMode::kToken);
  spec.layers = {LayerKind::kFull,   LayerKind::kShared, LayerKind::kDense,
                 LayerKind::kShared, LayerKind::kFull,   LayerKind::kShared};
  Harness h(Options(spec, DType::kF32));
  h.Open("s");
  ASSERT_TRUE(h.Run({{"s", 200}}, h.MakeInputs({{"s", 200}}, DType::kF32, 1)).status.ok());
  const auto in = h.MakeInputs({{"s", 2}}, DType::kF32, 2);
  auto r = h.Run({{"s", 2}}, in);
  ASSERT_TRUE(r.status.ok());
  for (int t = 0; t < 2; ++t) {
    EXPECT_EQ(r.traces[1].keys[t], r.traces[0].keys[t]);
    EXPECT_EQ(r.traces[3].keys[t], r.traces[0].keys[t]);  // a dense layer in between
    EXPECT_EQ(r.traces[5].keys[t], r.traces[4].keys[t]);
    EXPECT_NE(r.traces[4].keys[t], r.traces[0].keys[t]);  // each full layer selects anew
    EXPECT_EQ(r.traces[0].keys[t].size(), 24u);
  }
  std::vector<LayerCheck> checks;
  auto ref = h.Reference({{"s", 2}}, in, r.traces, &checks);
  for (int l = 0; l < spec.num_layers(); ++l) EXPECT_LE(RelL2(r.out[l], ref[l]), 1e-5);
}

TEST(Engine, WriteOnlyImportThenDecodeEqualsComputingThePrefix) {
  ModelSpec spec = TestSpec(16, 4, SelectionMode::kToken);
  Harness h(Options(spec, DType::kBF16));
  h.Open("computed");
  h.Open("imported");
  const auto prefix = h.MakeInputs({{"computed", 90}}, DType::kBF16, 1);
  ASSERT_TRUE(h.Run({{"computed", 90}}, prefix).status.ok());
  auto imp = h.Run({{"imported", 90}}, prefix, StepOptions::WriteOnly());
  ASSERT_TRUE(imp.status.ok()) << imp.status;
  EXPECT_EQ(h.engine().DescribeSequence("imported")->length, 90);
  const auto dec = h.MakeInputs({{"computed", 1}}, DType::kBF16, 2);
  auto a = h.Run({{"computed", 1}}, dec);
  auto b = h.Run({{"imported", 1}}, dec);
  ASSERT_TRUE(a.status.ok() && b.status.ok());
  for (int l = 0; l < spec.num_layers(); ++l) EXPECT_EQ(a.out[l], b.out[l]) << "layer " << l;
  h.RunAndCheck({{"imported", 3}}, DType::kBF16, 3, 1e-2);
  // A write-only step refuses queries and outputs.
  auto step = h.engine().BeginStep({{"imported", 1}}, StepOptions::WriteOnly());
  ASSERT_TRUE(step.ok());
  const auto in = h.MakeInputs({{"imported", 1}}, DType::kBF16, 4);
  std::vector<uint8_t> out(4 * 32 * 2);
  EXPECT_EQ(RunLayerInto(h.engine(), *step, 0, in[0].inputs(), out.data(), out.size()).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attnd::testing
