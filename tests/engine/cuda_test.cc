// The CUDA backend against the float64 reference and against the CPU backend: every selection
// mode and dtype, prefix forks, chunked prefill, and pages moving between a GPU and the host.
// Every test skips, with the reason, where no GPU is visible.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <random>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/backend/cuda_device.h"
#include "kv_store/host_tier.h"
#include "tests/context_parallel_split.h"
#include "tests/engine_harness.h"
#include "tests/gpu_skip.h"
#include "tests/run_layer.h"

namespace attnd::testing {
namespace {

#define SKIP_WITHOUT_GPU() ATTND_SKIP_WITHOUT_GPU()

ModelSpec Spec(SelectionMode mode, int heads = 16) {
  ModelSpec s = MixedLayerSpec(mode);
  s.num_heads = heads;
  return s;
}

EngineOptions Options(const ModelSpec& spec, DType cache, std::vector<std::string> devices) {
  EngineOptions o;
  o.spec = spec;
  o.cache_dtype = cache;
  o.devices = std::move(devices);
  o.pages_per_device = 256;
  o.threads = 2;
  return o;
}

class CudaParity : public ::testing::TestWithParam<std::tuple<SelectionMode, DType>> {};

TEST_P(CudaParity, MatchesReferenceAndCpuBackend) {
  SKIP_WITHOUT_GPU();
  const auto [mode, param] = GetParam();
  // FP8_E4M3 stands for fp32 requests on an fp8 cache (the oracle on the dequantised keys).
  const DType dtype = param == DType::kFP8E4M3 ? DType::kF32 : param;
  const DType cache = param == DType::kFP8E4M3 ? param
                      : dtype == DType::kF32   ? DType::kF32
                                               : DType::kBF16;
  const double tol = dtype == DType::kF32 ? 1e-5 : 1e-2;
  Harness gpu(Options(Spec(mode), cache, {"cuda:0"}));
  Harness cpu(Options(Spec(mode), cache, {"cpu:0"}));
  for (Harness* h : {&gpu, &cpu}) {
    h->Open("a");
    h->Open("b");
  }
  const std::vector<std::vector<StepEntry>> steps = {
      {{"a", 70}, {"b", 33}}, {{"a", 1}, {"b", 20}}, {{"b", 1}, {"a", 1}}, {{"a", 1}, {"b", 1}}};
  double worst_ref = 0, worst_cpu = 0, worst_lse = 0;  // reported for bench/results/h200.md
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto in = gpu.MakeInputs(steps[i], dtype, 100 + i);
    auto g = gpu.Run(steps[i], in);
    auto c = cpu.Run(steps[i], in);
    ASSERT_TRUE(g.status.ok()) << g.status;
    ASSERT_TRUE(c.status.ok()) << c.status;
    std::vector<LayerCheck> checks;
    std::vector<std::vector<double>> ref_lse;
    const auto ref = gpu.Reference(steps[i], in, g.traces, &checks, &ref_lse);
    const std::vector<int> beyond_ties = gpu.SelectionsBeyondTies(steps[i], in, g.traces, c.traces);
    for (size_t l = 0; l < g.out.size(); ++l) {
      for (double x : g.out[l]) ASSERT_FALSE(std::isnan(x));
      EXPECT_LE(RelL2(g.out[l], ref[l]), tol) << "step " << i << " layer " << l;
      EXPECT_EQ(checks[l].selection_mismatches, 0) << "step " << i << " layer " << l;
      EXPECT_EQ(beyond_ties[l], 0) << "top-k sets: GPU vs CPU beyond score ties, layer " << l;
      EXPECT_LE(RelL2(g.out[l], c.out[l]), tol);
      worst_ref = std::max(worst_ref, RelL2(g.out[l], ref[l]));
      worst_cpu = std::max(worst_cpu, RelL2(g.out[l], c.out[l]));
      // Each query head's log-sum-exp against the float64 reference and the CPU backend
      // (scores accumulate in fp32 on every kernel; the tensor-core one, for bf16 requests, sums
      // bf16-rounded probabilities into the denominator).
      const double lse_tol = dtype == DType::kF32 ? 1e-5 : 2e-3;
      for (size_t j = 0; j < ref_lse[l].size(); ++j) {
        ASSERT_FALSE(std::isnan(g.lse[l][j])) << "layer " << l;
        EXPECT_NEAR(g.lse[l][j], ref_lse[l][j], lse_tol * (1 + std::abs(ref_lse[l][j])))
            << "step " << i << " layer " << l << " row " << j;
        EXPECT_NEAR(g.lse[l][j], c.lse[l][j], lse_tol * (1 + std::abs(c.lse[l][j])));
        worst_lse = std::max(worst_lse,
                             std::abs(g.lse[l][j] - ref_lse[l][j]) / (1 + std::abs(ref_lse[l][j])));
      }
    }
  }
  std::printf(
      "parity: worst rel L2 vs float64 %.2e, vs the CPU backend %.2e (tolerance %.0e); "
      "worst lse error %.2e\n",
      worst_ref, worst_cpu, tol, worst_lse);
  EXPECT_TRUE(gpu.engine().ReservedPageUntouched(0));
}

std::string ParityName(const ::testing::TestParamInfo<std::tuple<SelectionMode, DType>>& info) {
  const SelectionMode m = std::get<0>(info.param);
  const char* mode = m == SelectionMode::kToken       ? "token"
                     : m == SelectionMode::kPageUnion ? "union"
                                                      : "budget";
  return std::string(mode) + "_" + std::string(DTypeName(std::get<1>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(
    Modes, CudaParity,
    ::testing::Combine(::testing::Values(SelectionMode::kToken, SelectionMode::kPageUnion,
                                         SelectionMode::kPageBudget),
                       ::testing::Values(DType::kBF16, DType::kF32, DType::kF16, DType::kFP8E4M3)),
    ParityName);

// Server-side absorption on the GPU (the per-head projection kernels around the attention)
// against the CPU backend, whose absorbed calls tests/engine/absorption_test.cc checks against
// float64: outputs [T, H, V], log-sum-exps and selections, fp32 and bf16.
TEST(Cuda, AbsorbedCallsMatchTheCpuBackend) {
  SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const ModelSpec s = Spec(SelectionMode::kToken);
    const int dn = 32, v = 24, H = s.num_heads;
    std::mt19937_64 wrng(5);
    std::normal_distribution<float> dist(0.0f, 0.2f);
    auto a = Absorption::Create(s, dn, v, "test").value();
    for (int l = 0; l < s.num_layers(); ++l) {
      std::vector<float> w(static_cast<size_t>(H) * (dn + v) * s.kv_lora_rank);
      for (float& x : w) x = dist(wrng);
      ASSERT_TRUE(a->SetLayer(l, {int64_t{H} * (dn + v), s.kv_lora_rank}, w.data()).ok());
    }
    const std::shared_ptr<const Absorption> absorb(std::move(a));
    const DType cache = dtype == DType::kF32 ? DType::kF32 : DType::kBF16;
    const double tol = dtype == DType::kF32 ? 1e-5 : 1e-2;
    std::unique_ptr<Engine> engines[2];
    const char* devices[2] = {"cuda:0", "cpu:0"};
    for (int e = 0; e < 2; ++e) {
      EngineOptions o = Options(s, cache, {devices[e]});
      o.absorption = absorb;
      engines[e] = Engine::Create(o).value();
      ASSERT_TRUE(engines[e]->OpenSequence("a").ok());
      ASSERT_TRUE(engines[e]->OpenSequence("b").ok());
    }
    // The float64 histories, for the selections (absorption changes the queries of attention,
    // not the indexer's).
    reference::StepOracle oracle(s, cache);
    oracle.Open("a");
    oracle.Open("b");
    uint64_t seed = 40;
    double worst = 0;
    for (const std::vector<StepEntry>& batch : std::vector<std::vector<StepEntry>>{
             {{"a", 40}, {"b", 9}}, {{"a", 1}, {"b", 20}}, {{"b", 1}, {"a", 1}}}) {
      int64_t T = 0;
      std::vector<std::pair<std::string, int64_t>> pairs;
      for (const auto& e : batch) {
        T += e.q_len;
        pairs.emplace_back(e.sequence_id, e.q_len);
      }
      const auto layers = RandomLayers(s, T, dtype, seed++);
      std::vector<reference::LayerValues> values;
      for (const LayerData& d : layers) values.push_back(d.values());
      oracle.Commit(pairs, values);
      std::vector<std::vector<std::vector<int32_t>>> keys[2];
      std::mt19937_64 rng(seed++);
      uint64_t step[2];
      for (int e = 0; e < 2; ++e) step[e] = engines[e]->BeginStep(batch).value();
      for (int l = 0; l < s.num_layers(); ++l) {
        const HostTensor qn = RandomTensor(dtype, {T, H, dn}, rng);
        LayerInputs in = layers[l].inputs();
        in.q_latent = {};
        in.q_nope = qn.view();
        std::vector<uint8_t> out[2];
        std::vector<float> lse[2];
        LayerTrace trace[2];
        for (int e = 0; e < 2; ++e) {
          out[e].resize(static_cast<size_t>(T) * H * v * DTypeSize(dtype));
          lse[e].resize(static_cast<size_t>(T) * H);
          const absl::Status r = RunLayerInto(*engines[e], step[e], l, in, out[e].data(),
                                              out[e].size(), &trace[e], lse[e].data());
          ASSERT_TRUE(r.ok()) << devices[e] << ": " << r;
        }
        std::vector<double> f[2];
        for (int e = 0; e < 2; ++e) {
          std::vector<float> x(out[e].size() / DTypeSize(dtype));
          ConvertToF32(dtype, out[e].data(), x.data(), x.size());
          f[e].assign(x.begin(), x.end());
        }
        for (double x : f[0]) ASSERT_FALSE(std::isnan(x));
        const double err = RelL2(f[0], f[1]);
        EXPECT_LE(err, tol) << DTypeName(dtype) << " layer " << l;
        worst = std::max(worst, err);
        for (int e = 0; e < 2; ++e) keys[e].push_back(trace[e].keys);
        for (size_t j = 0; j < lse[0].size(); ++j)
          ASSERT_NEAR(lse[0][j], lse[1][j],
                      (dtype == DType::kF32 ? 1e-5 : 2e-3) * (1 + std::abs(lse[1][j])));
      }
      // Both backends' top-k sets are float64's up to score ties (the oracle's rule).
      for (int e = 0; e < 2; ++e) {
        std::vector<LayerCheck> checks;
        oracle.Expected(pairs, values, &keys[e], &checks);
        for (int l = 0; l < s.num_layers(); ++l)
          EXPECT_EQ(checks[l].selection_mismatches, 0) << devices[e] << " layer " << l;
      }
    }
    EXPECT_GT(worst, 0.0) << "two backends, two summation orders";
  }
}

// Context parallelism on GPUs: a sequence split over 3 engines on cuda:0 (candidates read back
// from the GPU's indexer scores, merged selections uploaded as slots) equals one GPU engine
// holding it all, itself checked against float64, in every selection mode: outputs and
// attended keys.
class CudaContextParallel : public ::testing::TestWithParam<SelectionMode> {};

TEST_P(CudaContextParallel, EqualsOneGpuHoldingTheWholeSequence) {
  SKIP_WITHOUT_GPU();
  ModelSpec spec = Spec(GetParam());
  spec.sliding_window = 0;
  Harness whole(Options(spec, DType::kF32, {"cuda:0"}));
  whole.Open("s");
  EngineOptions part = Options(spec, DType::kF32, {"cuda:0"});
  part.pages_per_device = 64;
  ContextParallelSplit split(part, {0, 32, 64, 1 << 20});
  double worst = 0;
  uint64_t seed = 700;
  for (int64_t q : {32, 20, 12, 9, 1, 1}) {
    ++seed;
    const auto layers = RandomLayers(spec, q, DType::kF32, seed);
    auto traced = whole.Run({{"s", q}}, layers);
    ASSERT_TRUE(traced.status.ok()) << traced.status;
    std::vector<LayerCheck> checks;
    const auto ref = whole.Reference({{"s", q}}, layers, traced.traces, &checks);
    auto got = split.Step(q, layers);
    ASSERT_TRUE(got.ok()) << got.status();
    for (int l = 0; l < spec.num_layers(); ++l) {
      EXPECT_EQ(checks[l].selection_mismatches, 0) << "layer " << l;
      const double err = RelL2(got->out[l], ref[l]);
      ASSERT_FALSE(std::isnan(err));
      EXPECT_LE(err, 1e-5) << "layer " << l << " q " << q;
      EXPECT_LE(RelL2(got->out[l], traced.out[l]), 1e-5);
      worst = std::max(worst, err);
      for (int64_t t = 0; t < q; ++t)
        EXPECT_EQ(got->keys[l][t], traced.traces[l].keys[t]) << "layer " << l << " query " << t;
    }
  }
  EXPECT_GT(worst, 0.0);
}

INSTANTIATE_TEST_SUITE_P(Modes, CudaContextParallel,
                         ::testing::Values(SelectionMode::kToken, SelectionMode::kPageUnion,
                                           SelectionMode::kPageBudget));

// An fp8 cache holds the same bytes on a GPU as on the host (one quantiser, kernels/fp8_rows.h),
// and its pages move between them unchanged.
TEST(Cuda, Fp8CachesHoldTheHostsBytesAndMoveBetweenHostAndGpu) {
  SKIP_WITHOUT_GPU();
  Harness h(Options(Spec(SelectionMode::kToken, 4), DType::kFP8E4M3, {"cpu:0", "cuda:0"}));
  h.Open("c", 0);
  h.Open("g", 1);
  const auto in = h.MakeInputs({{"c", 45}}, DType::kBF16, 1);
  ASSERT_TRUE(h.Run({{"c", 45}}, in).status.ok());
  ASSERT_TRUE(h.Run({{"g", 45}}, in).status.ok());
  for (int layer = 0; layer < h.spec().num_layers(); ++layer) {
    auto c = h.engine().ReadRows("c", layer, 0, 45);
    auto g = h.engine().ReadRows("g", layer, 0, 45);
    ASSERT_TRUE(c.ok() && g.ok());
    EXPECT_EQ(c->kv_latent, g->kv_latent) << layer;
    EXPECT_EQ(c->kv_latent_scales, g->kv_latent_scales) << layer;
    EXPECT_EQ(c->k_rope, g->k_rope) << layer;
    EXPECT_EQ(c->index_k, g->index_k) << layer;
    EXPECT_EQ(c->index_k_scales, g->index_k_scales) << layer;
  }
  h.RunAndCheck({{"c", 1}, {"g", 1}}, DType::kBF16, 2, 1e-2);
  ASSERT_TRUE(h.engine().MigrateSequence("g", 0).ok());  // GPU -> host
  ASSERT_TRUE(h.engine().MigrateSequence("c", 1).ok());  // host -> GPU
  h.RunAndCheck({{"c", 1}, {"g", 1}}, DType::kBF16, 3, 1e-2);
  EXPECT_TRUE(h.engine().ReservedPageUntouched(1));
}

TEST(Cuda, DensePrefillForksAndChunksMatchTheReference) {
  SKIP_WITHOUT_GPU();
  ModelSpec spec = Spec(SelectionMode::kToken, 4);
  spec.prefill = PrefillMode::kDense;
  Harness h(Options(spec, DType::kBF16, {"cuda:0"}));
  h.Open("p");
  h.RunAndCheck({{"p", 90}}, DType::kBF16, 1, 1e-2);
  h.RunAndCheck({{"p", 41}}, DType::kBF16, 2, 1e-2);
  h.Fork("c", "p", 77);
  h.RunAndCheck({{"c", 5}, {"p", 1}}, DType::kBF16, 3, 1e-2);
  h.RunAndCheck({{"c", 1}, {"p", 1}}, DType::kBF16, 4, 1e-2);
}

TEST(Cuda, PagesMoveBetweenHostAndGpuWithOutputsUnchanged) {
  SKIP_WITHOUT_GPU();
  Harness h(Options(Spec(SelectionMode::kToken, 4), DType::kBF16, {"cpu:0", "cuda:0"}));
  h.Open("p", 0);
  h.RunAndCheck({{"p", 60}}, DType::kBF16, 1, 1e-2);
  h.Fork("g", "p", 60, 1);  // copied host -> GPU
  h.Open("q", 1);
  h.RunAndCheck({{"q", 30}, {"g", 2}, {"p", 2}}, DType::kBF16, 2, 1e-2);  // spans both devices
  ASSERT_TRUE(h.engine().MigrateSequence("q", 0).ok());                   // GPU -> host
  ASSERT_TRUE(h.engine().MigrateSequence("p", 1).ok());                   // host -> GPU
  h.RunAndCheck({{"q", 1}, {"p", 1}, {"g", 1}}, DType::kBF16, 3, 1e-2);
}

// The tiered store on a GPU: 8 sequences on a GPU holding 4 (pinned host tier, disk below),
// spilled and restored through CudaDevice::ReadPages/WritePages while steps run, every output,
// lse and selection bit for bit those of a GPU holding them all.
TEST(Cuda, SpilledAndRestoredSequencesDecodeBitForBitAsIfTheyNeverMoved) {
  SKIP_WITHOUT_GPU();
  char dir[] = "/tmp/attnd-cuda-tiers-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const ModelSpec spec = Spec(SelectionMode::kToken, 4);
  for (DType cache : {DType::kBF16, DType::kFP8E4M3}) {
    EngineOptions small_o = Options(spec, cache, {"cuda:0"});
    small_o.pages_per_device = 9;  // 8 usable: 4 sequences of 2 pages
    const size_t page =
        TierStride(CacheLayout::ForModel(spec, cache, small_o.pages_per_device).BytesPerPage());
    small_o.tiers.host_bytes = 4 * page;
    small_o.tiers.disk_dir = dir;
    small_o.tiers.disk_bytes = 32 * page;
    Harness small(small_o), big(Options(spec, cache, {"cuda:0"}));
    std::vector<std::string> ids;
    for (int i = 0; i < 8; ++i) {
      ids.push_back(absl::StrCat("s", i));
      small.Open(ids.back(), 0);
      big.Open(ids.back(), 0);
    }
    uint64_t seed = 1;
    auto step = [&](const std::vector<StepEntry>& batch) {
      const auto in = small.MakeInputs(batch, DType::kBF16, ++seed);
      auto a = small.Run(batch, in);
      auto b = big.Run(batch, in);
      ASSERT_TRUE(a.status.ok()) << a.status;
      ASSERT_TRUE(b.status.ok()) << b.status;
      for (size_t l = 0; l < a.out.size(); ++l) {
        ASSERT_EQ(a.out[l], b.out[l]) << "layer " << l;
        ASSERT_EQ(a.lse[l], b.lse[l]) << "layer " << l;
        ASSERT_EQ(a.traces[l].keys, b.traces[l].keys) << "layer " << l;
      }
    };
    for (const std::string& id : ids) step({{id, 20}});
    for (int round = 0; round < 3; ++round)
      for (size_t i = 0; i < ids.size(); i += 2) step({{ids[i], 1}, {ids[i + 1], 1}});
    const EngineCounters c = small.engine().Counters();
    EXPECT_GT(c.spills, 8);
    EXPECT_GT(c.tier_bytes[static_cast<int>(Tier::kDisk)][static_cast<int>(Tier::kDevice)], 0);
    EXPECT_TRUE(small.engine().CheckInvariants().ok());
  }
  std::filesystem::remove_all(dir);
}

// This process's mapped and resident host memory, bytes (/proc/self/statm).
std::pair<size_t, size_t> HostMemory() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  long size = 0, resident = 0;
  if (f == nullptr || std::fscanf(f, "%ld %ld", &size, &resident) != 2) size = resident = 0;
  if (f) std::fclose(f);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return {static_cast<size_t>(size) * page, static_cast<size_t>(resident) * page};
}

TEST(Cuda, AGpuDevicesHostMemoryDoesNotGrowWithItsCache) {
  SKIP_WITHOUT_GPU();
  auto with_cache = [](size_t bytes) {
    EngineOptions o = Options(Spec(SelectionMode::kToken), DType::kBF16, {"cuda:0"});
    o.pages_per_device = 0;
    o.cache_bytes_per_device = bytes;
    Harness h(o);  // one step run, so every lazily grown buffer exists
    h.Open("a");
    h.RunAndCheck({{"a", 40}}, DType::kBF16, 1, 1e-2);
    return HostMemory();
  };
  const auto small = with_cache(size_t{256} << 20);
  const auto big = with_cache(size_t{8} << 30);
  std::printf(
      "host memory with a 256 MiB GPU cache: %zu MiB mapped, %zu MiB resident; with 8 GiB: "
      "%zu MiB mapped, %zu MiB resident\n",
      small.first >> 20, small.second >> 20, big.first >> 20, big.second >> 20);
  // A host mirror of the cache would touch the 7.75 GiB difference. Mapped bytes cannot tell:
  // unified addressing maps every device allocation into the process (on an H200, 8 GiB of
  // cache mapped 7.9 GiB more than 256 MiB did, with 14 MiB more resident).
  EXPECT_LT(big.second, small.second + (size_t{64} << 20));
}

TEST(Cuda, MissingGpuIsAClearStartupError) {
  if (!Engine::CudaBuilt() || !cuda::ProbeDevices().ok() || *cuda::ProbeDevices() > 0)
    GTEST_SKIP() << "needs a CUDA build on a machine without a GPU";
  auto e = Engine::Create(Options(Spec(SelectionMode::kToken), DType::kBF16, {"cuda:0"}));
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition) << e.status();
  EXPECT_NE(e.status().message().find("no such GPU"), std::string::npos);
}

}  // namespace
}  // namespace attnd::testing
