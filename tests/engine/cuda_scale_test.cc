// The CUDA backend at real dimensions, the paths the tiny-preset parity tests cannot reach:
// DeepSeek-V3.2 dims (16 and 128 heads, page_size 64, top-2048 over thousands of keys, dynamic
// shared memory above 48 KB) with the SIMT and the tensor-core kernels (indexer and MLA; bf16
// and fp8 caches, absorbed calls; the MLA's wgmma form) against each other and the float64 oracle,
// a sequence's bits alone and in a batch of 64, all-equal indexer scores, more than 65,535
// queries in one step, a step too large for GPU
// scratch, and NCCL page moves between two GPUs. Every test skips with its reason without a GPU
// (fails with ATTND_REQUIRE_GPU=1); each can run alone (--gtest_filter) in its own process.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/absorption.h"
#include "kernels/cuda/backend/cublas_loader.h"
#include "kernels/cuda/backend/cuda_device.h"
#include "kernels/cuda/backend/cuda_device_state.h"
#include "kernels/cuda/backend/gpu_facts.h"
#include "kernels/cuda/ops/cuda_kernels.h"
#include "kernels/cuda/ops/mla_flashinfer.h"
#include "kernels/cuda/ops/mla_gemm.h"
#include "kernels/cuda/ops/topk_block.h"
#include "kernels/cuda/ops/topk_flashinfer.h"
#include "kernels/selection.h"
#include "tests/engine_harness.h"
#include "tests/gpu_skip.h"

namespace attnd::testing {
namespace {

ModelSpec DeepSeekDims(int heads) {
  ModelSpec s = PresetModelSpec("deepseek-v3.2").value();  // L 512, R 64, Hi 64, Di 128, ps 64
  s.layers = {LayerKind::kFull, LayerKind::kShared};
  s.num_heads = heads;
  s.index_topk = 2048;
  s.prefill = PrefillMode::kSparse;
  return s;
}

EngineOptions Options(const ModelSpec& spec, DType cache, std::vector<std::string> devices,
                      int32_t pages = 512) {
  EngineOptions o;
  o.spec = spec;
  o.cache_dtype = cache;
  o.devices = std::move(devices);
  o.pages_per_device = pages;
  o.threads = 0;
  o.limits.max_step_tokens = 1 << 20;
  return o;
}

// A tensor re-encoded after mapping each value through f.
void MapValues(HostTensor* t, double (*f)(double)) {
  std::vector<float> v(t->values.size());
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(f(t->values[i]));
  ConvertFromF32(t->dtype, v.data(), t->bytes.data(), v.size());
  std::vector<float> back(v.size());
  ConvertToF32(t->dtype, t->bytes.data(), back.data(), v.size());
  t->values.assign(back.begin(), back.end());
}

void ExpectClose(const std::vector<double>& got, const std::vector<double>& want, double tol,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (double x : got) ASSERT_FALSE(std::isnan(x)) << what;
  const double e = RelL2(got, want);
  std::printf("parity: %s: rel L2 %.2e (tolerance %.0e)\n", what.c_str(), e, tol);
  EXPECT_LE(e, tol) << what;
}

class DeepSeekDimsTest : public ::testing::TestWithParam<int> {};

TEST_P(DeepSeekDimsTest, SimtAndTensorCoreKernelsMatchTheReferenceOverThousandsOfKeys) {
  ATTND_SKIP_WITHOUT_GPU();
  const ModelSpec spec = DeepSeekDims(GetParam());
  Harness simt(Options(spec, DType::kBF16, {"cuda:0"}));
  Harness mma(Options(spec, DType::kBF16, {"cuda:0"}));
  for (Harness* h : {&simt, &mma}) {
    h->Open("a");
    h->Open("b");
  }
  // Histories of 2,600 and 700 keys, imported (write-only: no reference attention to compute).
  const std::vector<StepEntry> import = {{"a", 2600}, {"b", 700}};
  const auto keys = simt.MakeKeys(import, DType::kBF16, 1);
  for (Harness* h : {&simt, &mma})
    ASSERT_TRUE(h->Run(import, keys, StepOptions::WriteOnly()).status.ok());
  const std::vector<std::vector<StepEntry>> steps = {
      {{"a", 1}, {"b", 1}}, {{"a", 3}, {"b", 1}}, {{"b", 1}, {"a", 1}}};
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto in = simt.MakeInputs(steps[i], DType::kBF16, 10 + i);
    auto s = [&] {
      cuda::ScopedKernelChoice simt_kernels(false, false);
      return simt.Run(steps[i], in);
    }();
    auto m = [&] {
      cuda::ScopedKernelChoice tensor_core_kernels(true, true);
      return mma.Run(steps[i], in);
    }();
    ASSERT_TRUE(s.status.ok()) << s.status;
    ASSERT_TRUE(m.status.ok()) << m.status;
    std::vector<LayerCheck> checks;
    const auto ref = simt.Reference(steps[i], in, s.traces, &checks);
    const std::vector<int> beyond_ties =
        simt.SelectionsBeyondTies(steps[i], in, s.traces, m.traces);
    for (size_t l = 0; l < ref.size(); ++l) {
      const std::string at = "step " + std::to_string(i) + " layer " + std::to_string(l);
      ExpectClose(s.out[l], ref[l], 1e-2, "SIMT kernels vs reference, " + at);
      ExpectClose(m.out[l], ref[l], 1e-2, "tensor-core kernels vs reference, " + at);
      ExpectClose(m.out[l], s.out[l], 1e-2, "tensor-core vs SIMT kernels, " + at);
      EXPECT_EQ(checks[l].selection_mismatches, 0) << at;
      EXPECT_EQ(beyond_ties[l], 0) << "top-k sets: SIMT vs tensor-core beyond score ties, " << at;
      // a's first query: a top-2048 row over 2,601 keys (b's has all of its 701)
      const size_t a_row = steps[i][0].sequence_id == "a" ? 0 : steps[i][0].q_len;
      EXPECT_EQ(s.traces[l].keys[a_row].size(), 2048u) << at;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Heads, DeepSeekDimsTest, ::testing::Values(16, 128));

// One small step through every tensor-core kernel at DeepSeek-V3.2 dims (128 heads: the
// pipelined MLA, the streaming indexer, the block top-k), bf16 and fp8 caches, against float64:
// small enough for compute-sanitizer's racecheck and synccheck (scripts/gpu-check.sh).
TEST(CudaScale, OneSmallStepThroughEveryTensorCoreKernel) {
  ATTND_SKIP_WITHOUT_GPU();
  ModelSpec spec = DeepSeekDims(128);
  spec.index_topk = 64;  // 300 keys: a real selection
  cuda::ScopedKernelChoice tensor_core_kernels(true, true);
  for (DType cache : {DType::kBF16, DType::kFP8E4M3}) {
    Harness h(Options(spec, cache, {"cuda:0"}, 64));
    h.Open("a");
    const std::vector<StepEntry> import = {{"a", 300}};
    ASSERT_TRUE(
        h.Run(import, h.MakeKeys(import, DType::kBF16, 41), StepOptions::WriteOnly()).status.ok());
    h.RunAndCheck({{"a", 1}}, DType::kBF16, 42, 1e-2);
  }
}

// An fp8 cache on tensor cores (rows decoded to bf16 as they load) at DeepSeek-V3.2 dims, 128
// heads: bf16 requests on the tensor-core and SIMT kernels against float64 on the dequantised
// keys, and their top-k sets under the tie rule; the two kernels' bits differ (two paths ran).
TEST(CudaScale, AnFp8CacheTakesTensorCoresAndMatchesTheReference) {
  ATTND_SKIP_WITHOUT_GPU();
  const ModelSpec spec = DeepSeekDims(128);
  Harness simt(Options(spec, DType::kFP8E4M3, {"cuda:0"}));
  Harness mma(Options(spec, DType::kFP8E4M3, {"cuda:0"}));
  for (Harness* h : {&simt, &mma}) h->Open("a");
  const std::vector<StepEntry> import = {{"a", 2600}};
  const auto keys = simt.MakeKeys(import, DType::kBF16, 31);
  for (Harness* h : {&simt, &mma})
    ASSERT_TRUE(h->Run(import, keys, StepOptions::WriteOnly()).status.ok());
  const std::vector<StepEntry> step = {{"a", 2}};
  const auto in = simt.MakeInputs(step, DType::kBF16, 32);
  auto s = [&] {
    cuda::ScopedKernelChoice simt_kernels(false, false);
    return simt.Run(step, in);
  }();
  auto m = [&] {
    cuda::ScopedKernelChoice tensor_core_kernels(true, true);
    return mma.Run(step, in);
  }();
  ASSERT_TRUE(s.status.ok()) << s.status;
  ASSERT_TRUE(m.status.ok()) << m.status;
  std::vector<LayerCheck> checks;
  const auto ref = simt.Reference(step, in, s.traces, &checks);
  const std::vector<int> beyond_ties = simt.SelectionsBeyondTies(step, in, s.traces, m.traces);
  for (size_t l = 0; l < ref.size(); ++l) {
    ExpectClose(s.out[l], ref[l], 1e-2, "SIMT, fp8 cache, layer " + std::to_string(l));
    ExpectClose(m.out[l], ref[l], 1e-2, "tensor cores, fp8 cache, layer " + std::to_string(l));
    EXPECT_NE(m.out[l], s.out[l]) << "layer " << l << ": the same bits from both kernels";
    EXPECT_EQ(beyond_ties[l], 0) << "layer " << l;
  }
}

// What the launchers read once per device (gpu_facts.h) is the driver's answer for every device,
// and stays each device's own across switches; with no device it is an error, *f untouched.
TEST(CudaScale, TheGpuFactsAreTheDriversPerDevice) {
  cuda::GpuFacts f;
  f.sms = -7;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    EXPECT_NE(cuda::CurrentGpuFacts(&f), cudaSuccess);
    EXPECT_EQ(f.sms, -7);
    ATTND_SKIP_WITHOUT_GPU();  // fails here under ATTND_REQUIRE_GPU=1
    return;
  }
  for (int round = 0; round < 2; ++round)
    for (int d = 0; d < count; ++d) {
      ASSERT_EQ(cudaSetDevice(d), cudaSuccess);
      ASSERT_EQ(cuda::CurrentGpuFacts(&f), cudaSuccess);
      int major = 0, minor = 0, sms = 0, optin = 0;
      ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d), cudaSuccess);
      ASSERT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d), cudaSuccess);
      ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, d), cudaSuccess);
      ASSERT_EQ(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, d),
                cudaSuccess);
      EXPECT_EQ(f.ordinal, d);
      EXPECT_EQ(f.cc_major, major);
      EXPECT_EQ(f.cc_minor, minor);
      EXPECT_EQ(f.sms, sms);
      EXPECT_EQ(f.smem_optin, optin);
      EXPECT_GT(sms, 0);
    }
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

// An allocation the GPU or the host cannot give is RESOURCE_EXHAUSTED (a pod's memory limit,
// not a CUDA fault), and leaves no error behind for the thread's next CUDA call to report.
TEST(CudaScale, AnAllocationThatCannotBeMadeIsResourceExhaustedAndLeavesNoError) {
  ATTND_SKIP_WITHOUT_GPU();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  const size_t absurd = size_t{1} << 50;  // 1 PiB
  cuda::HostBuffer host;
  const absl::Status h = host.Reserve(absurd);
  EXPECT_EQ(h.code(), absl::StatusCode::kResourceExhausted) << h;
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  cuda::DeviceBuffer dev;
  const absl::Status d = dev.Reserve(absurd);
  EXPECT_EQ(d.code(), absl::StatusCode::kResourceExhausted) << d;
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  EXPECT_TRUE(host.Reserve(4096).ok() && dev.Reserve(4096).ok());  // and usable after
}

// A failed page move or layer upload leaves nothing queued behind it (DrainOnError): what was
// queued on the stream has ended when the guard goes out of scope undismissed.
TEST(CudaScale, AnUndismissedDrainWaitsForWhatWasQueued) {
  ATTND_SKIP_WITHOUT_GPU();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cuda::DeviceBuffer a, b;
  const size_t bytes = size_t{256} << 20;
  ASSERT_TRUE(a.Reserve(bytes).ok() && b.Reserve(bytes).ok());
  {
    cuda::DrainOnError drain(stream);
    for (int i = 0; i < 8; ++i)  // 2 GiB of copies: long past the scope's end if not waited
      ASSERT_EQ(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice, stream),
                cudaSuccess);
  }
  EXPECT_EQ(cudaStreamQuery(stream), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// cuda:0's compute capability.
void ComputeCapability(int* major, int* minor) {
  ASSERT_EQ(cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(minor, cudaDevAttrComputeCapabilityMinor, 0), cudaSuccess);
}

// wgmma on this GPU computes what the CPU simulation computes (wgmma_probe.h: the descriptor
// forms and fragment layouts the wgmma MLA uses, against float64); compute capability 9.0 only.
TEST(CudaScale, TheWgmmaSelfCheckPasses) {
  ATTND_SKIP_WITHOUT_GPU();
  if (!cuda::MlaWgmmaBuilt()) GTEST_SKIP() << "this build has no sm_90a image";
  int major = 0, minor = 0;
  ASSERT_NO_FATAL_FAILURE(ComputeCapability(&major, &minor));
  if (major != 9 || minor != 0) {
    EXPECT_FALSE(cuda::MlaWgmmaSelfCheck());  // refused, not trapped
    GTEST_SKIP() << "wgmma needs compute capability 9.0 (this GPU: " << major << "." << minor
                 << ")";
  }
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  EXPECT_TRUE(cuda::MlaWgmmaSelfCheck());
}

// The pipelined MLA's wgmma form (sm_90a: compute capability 9.0 only) at DeepSeek-V3.2 dims,
// 128 heads, bf16 and fp8 caches: a top-2048 selection over 2,600 keys (4 splits, merged) and a
// 3-query step, against float64 and against the mma.sync pipelined kernel; the wgmma kernel ran
// (its launch count grew). The same for its warp-specialised variant (mla_wgmma_ws.h).
TEST(CudaScale, TheWgmmaMlaMatchesTheReferenceAndThePipelinedKernel) {
  ATTND_SKIP_WITHOUT_GPU();
  if (!cuda::MlaWgmmaBuilt()) GTEST_SKIP() << "this build has no sm_90a image";
  int major = 0, minor = 0;
  ASSERT_NO_FATAL_FAILURE(ComputeCapability(&major, &minor));
  if (major != 9 || minor != 0)
    GTEST_SKIP() << "wgmma needs compute capability 9.0 (this GPU: " << major << "." << minor
                 << ")";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_TRUE(cuda::MlaWgmmaSelfCheck()) << "the wgmma layouts disagree with the simulation's";
  const ModelSpec spec = DeepSeekDims(128);
  for (DType cache : {DType::kBF16, DType::kFP8E4M3}) {
    const std::string c = cache == DType::kBF16 ? "bf16 cache" : "fp8 cache";
    Harness pipe(Options(spec, cache, {"cuda:0"}));
    Harness wg(Options(spec, cache, {"cuda:0"}));
    Harness ws(Options(spec, cache, {"cuda:0"}));
    for (Harness* h : {&pipe, &wg, &ws}) h->Open("a");
    const std::vector<StepEntry> import = {{"a", 2600}};
    const auto keys = pipe.MakeKeys(import, DType::kBF16, 51);
    for (Harness* h : {&pipe, &wg, &ws})
      ASSERT_TRUE(h->Run(import, keys, StepOptions::WriteOnly()).status.ok());
    const std::vector<StepEntry> step = {{"a", 3}};
    const auto in = pipe.MakeInputs(step, DType::kBF16, 52);
    auto p = [&] {
      cuda::ScopedKernelChoice pipelined(true, true, false);
      return pipe.Run(step, in);
    }();
    const int64_t before = cuda::MlaWgmmaLaunches();
    auto w = [&] {
      cuda::ScopedKernelChoice wgmma(true, true, true);
      return wg.Run(step, in);
    }();
    const int64_t wg_launches = cuda::MlaWgmmaLaunches() - before;
    const int64_t ws_before = cuda::MlaWgmmaWsLaunches();
    auto v = [&] {
      cuda::ScopedKernelChoice warp_specialised(true, true, true, true);
      return ws.Run(step, in);
    }();
    ASSERT_TRUE(p.status.ok()) << p.status;
    ASSERT_TRUE(w.status.ok()) << w.status;
    ASSERT_TRUE(v.status.ok()) << v.status;
    EXPECT_GT(cuda::MlaWgmmaLaunches(), before) << c << ": the wgmma kernel did not run";
    // Every launch the wgmma run made, the warp-specialised run made in its form.
    EXPECT_EQ(cuda::MlaWgmmaWsLaunches() - ws_before, wg_launches)
        << c << ": the warp-specialised wgmma kernel did not run for every MLA";
    std::vector<LayerCheck> checks;
    const auto ref = pipe.Reference(step, in, p.traces, &checks);
    for (size_t l = 0; l < ref.size(); ++l) {
      const std::string at = c + ", layer " + std::to_string(l);
      ExpectClose(w.out[l], ref[l], 1e-2, "wgmma MLA vs reference, " + at);
      // The same bf16 P from the same S, fp32 sums in another order.
      ExpectClose(w.out[l], p.out[l], 2e-3, "wgmma vs mma.sync pipelined MLA, " + at);
      ExpectClose(v.out[l], ref[l], 1e-2, "warp-specialised wgmma MLA vs reference, " + at);
      // The same tiles, products and sums as the wgmma kernel: the same bits.
      size_t differ = v.out[l].size() == w.out[l].size() ? 0 : v.out[l].size() + 1;
      for (size_t i = 0; differ == 0 && i < v.out[l].size(); ++i)
        differ += v.out[l][i] != w.out[l][i];
      EXPECT_EQ(differ, 0u) << "warp-specialised vs wgmma MLA, " << at;
    }
  }
}

// A library form of the sparse MLA (FlashInfer's Hopper MLA: compute capability 9.0 and a bf16
// cache; the gather + cuBLAS GEMMs: any GPU with cuBLAS, bf16 and fp8 caches) at DeepSeek-V3.2
// dims, 128 heads: a top-2048 selection over 2,600 keys for a 3-token sparse prefill, a
// 300-key range decode and a 100-token prefill of two more sequences in the same step, against
// float64 and the SIMT
// kernel (the same indexer: the same selections), outputs and log-sum-exps; the form ran.
void ExpectLibraryMlaMatches(cuda::LibraryMla form, DType cache) {
  const ModelSpec spec = DeepSeekDims(128);
  Harness simt(Options(spec, cache, {"cuda:0"}));
  Harness lib(Options(spec, cache, {"cuda:0"}));
  for (Harness* h : {&simt, &lib}) {
    h->Open("a");
    h->Open("b");
    h->Open("c");
  }
  const std::vector<StepEntry> import = {{"a", 2600}, {"b", 300}};
  const auto keys = simt.MakeKeys(import, DType::kBF16, 61);
  for (Harness* h : {&simt, &lib})
    ASSERT_TRUE(h->Run(import, keys, StepOptions::WriteOnly()).status.ok());
  // c: a 100-token prefill of a new sequence, every token a prefix of c's one key list.
  const std::vector<StepEntry> step = {{"a", 3}, {"b", 1}, {"c", 100}};
  const auto in = simt.MakeInputs(step, DType::kBF16, 62);
  auto s = [&] {
    cuda::ScopedKernelChoice simt_mla(false, true);
    cuda::ScopedLibraryMla off(cuda::LibraryMla::kOff);
    return simt.Run(step, in);
  }();
  const int64_t before = cuda::FlashInferMlaLaunches(), gemm_before = cuda::MlaGemmLaunches();
  auto f = [&] {
    cuda::ScopedKernelChoice tensor_cores(true, true);
    cuda::ScopedLibraryMla on(form);
    return lib.Run(step, in);
  }();
  ASSERT_TRUE(s.status.ok()) << s.status;
  ASSERT_TRUE(f.status.ok()) << f.status;
  if (form == cuda::LibraryMla::kFlashInfer) {
    EXPECT_GE(cuda::FlashInferMlaLaunches() - before, 2) << "the FlashInfer MLA did not run";
  } else {
    EXPECT_GE(cuda::MlaGemmLaunches() - gemm_before, 2) << "the GEMM MLA did not run";
  }
  const std::string name = form == cuda::LibraryMla::kFlashInfer ? "FlashInfer" : "GEMM";
  std::vector<LayerCheck> checks;
  const auto ref = simt.Reference(step, in, s.traces, &checks);
  for (size_t l = 0; l < ref.size(); ++l) {
    const std::string at = std::string(DTypeName(cache)) + " cache, layer " + std::to_string(l);
    EXPECT_EQ(f.traces[l].keys, s.traces[l].keys) << at << ": other keys attended";
    ExpectClose(f.out[l], ref[l], 1e-2, name + " MLA vs reference, " + at);
    ExpectClose(f.out[l], s.out[l], 1e-2, name + " vs SIMT MLA, " + at);
    ASSERT_EQ(f.lse[l].size(), s.lse[l].size());
    for (size_t i = 0; i < f.lse[l].size(); ++i)
      ASSERT_NEAR(f.lse[l][i], s.lse[l][i], 1e-2 * (1 + std::abs(s.lse[l][i]))) << at << " " << i;
  }
}

TEST(CudaScale, TheFlashInferMlaMatchesTheReferenceAndTheSimtKernel) {
  ATTND_SKIP_WITHOUT_GPU();
  if (!cuda::FlashInferMlaBuilt()) GTEST_SKIP() << "this build has no FlashInfer MLA";
  int major = 0, minor = 0;
  ASSERT_NO_FATAL_FAILURE(ComputeCapability(&major, &minor));
  if (major != 9 || minor != 0)
    GTEST_SKIP() << "FlashInfer's Hopper MLA needs compute capability 9.0 (this GPU: " << major
                 << "." << minor << ")";
  ExpectLibraryMlaMatches(cuda::LibraryMla::kFlashInfer, DType::kBF16);
}

TEST(CudaScale, TheGemmMlaMatchesTheReferenceAndTheSimtKernel) {
  ATTND_SKIP_WITHOUT_GPU();
  std::string why;
  if (cuda::LoadCublas(&why) == nullptr) GTEST_SKIP() << why;
  for (DType cache : {DType::kBF16, DType::kFP8E4M3})
    ExpectLibraryMlaMatches(cuda::LibraryMla::kGemm, cache);
}

// Absorbed calls (q_nope in, values out) on tensor cores at DeepSeek-V3.2 dims: the GPU's
// tensor-core and SIMT kernels and the CPU backend agree within the bf16 tolerance, on bf16
// and fp8 caches.
TEST(CudaScale, AbsorbedCallsTakeTensorCoresOnBf16AndFp8Caches) {
  ATTND_SKIP_WITHOUT_GPU();
  ModelSpec spec = DeepSeekDims(16);
  const int H = spec.num_heads, dn = 128, v = 128;
  std::mt19937_64 wrng(8);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  auto a = Absorption::Create(spec, dn, v, "test").value();
  for (int l = 0; l < spec.num_layers(); ++l) {
    std::vector<float> w(static_cast<size_t>(H) * (dn + v) * spec.kv_lora_rank);
    for (float& x : w) x = dist(wrng);
    ASSERT_TRUE(a->SetLayer(l, {int64_t{H} * (dn + v), spec.kv_lora_rank}, w.data()).ok());
  }
  const std::shared_ptr<const Absorption> absorb(std::move(a));
  for (DType cache : {DType::kBF16, DType::kFP8E4M3}) {
    // Engines: GPU with tensor cores, GPU SIMT, CPU.
    std::unique_ptr<Engine> e[3];
    for (int i = 0; i < 3; ++i) {
      EngineOptions o = Options(spec, cache, {i < 2 ? "cuda:0" : "cpu:0"});
      o.absorption = absorb;
      e[i] = Engine::Create(o).value();
      ASSERT_TRUE(e[i]->OpenSequence("a").ok());
    }
    const int64_t T = 700;  // a prefill of 700: sparse, top-2048 of at most 700 = all
    const auto layers = RandomLayers(spec, T, DType::kBF16, 50);
    std::mt19937_64 rng(51);
    uint64_t step[3];
    for (int i = 0; i < 3; ++i) step[i] = e[i]->BeginStep({{"a", T}}).value();
    for (int l = 0; l < spec.num_layers(); ++l) {
      const HostTensor qn = RandomTensor(DType::kBF16, {T, H, dn}, rng);
      LayerInputs in = layers[l].inputs();
      in.q_latent = {};
      in.q_nope = qn.view();
      std::vector<double> out[3];
      for (int i = 0; i < 3; ++i) {
        cuda::ScopedKernelChoice kernels(i == 0, i == 0);
        std::vector<uint8_t> bytes(static_cast<size_t>(T) * H * v * 2);
        LayerRequest r;
        r.layer = l;
        r.tensors = in;
        BufferSink sink(bytes.data(), bytes.size());
        ASSERT_TRUE(e[i]->RunLayer(step[i], r, &sink).ok()) << i;
        std::vector<float> x(bytes.size() / 2);
        ConvertToF32(DType::kBF16, bytes.data(), x.data(), x.size());
        out[i].assign(x.begin(), x.end());
      }
      const std::string at = std::string(DTypeName(cache)) + " layer " + std::to_string(l);
      ExpectClose(out[0], out[2], 1e-2, "tensor cores vs CPU, " + at);
      ExpectClose(out[1], out[2], 1e-2, "SIMT vs CPU, " + at);
      EXPECT_NE(out[0], out[1]) << at << ": the same bits from both kernels";
    }
  }
}

// Rows [begin, begin + count) of a step's inputs (every tensor's first dimension is the token).
std::vector<LayerData> Rows(const std::vector<LayerData>& layers, int64_t begin, int64_t count) {
  std::vector<LayerData> out = layers;
  for (LayerData& l : out)
    for (HostTensor* t :
         {&l.q_latent, &l.q_rope, &l.kv_latent, &l.k_rope, &l.index_q, &l.index_k, &l.index_w}) {
      if (!t->present) continue;
      const int64_t T = t->shape[0];
      const size_t bytes = t->bytes.size() / T, values = t->values.size() / T;
      t->bytes = std::vector<uint8_t>(t->bytes.begin() + begin * bytes,
                                      t->bytes.begin() + (begin + count) * bytes);
      t->values = std::vector<double>(t->values.begin() + begin * values,
                                      t->values.begin() + (begin + count) * values);
      t->shape[0] = count;
    }
  return out;
}

// A sequence's outputs do not depend on what shares its step (docs/numerics.md): decoded alone
// and in a batch of 64 of other lengths, its bits are the same, on the tensor-core kernels
// (whose split-K comes from each query's own keys) and on the SIMT ones.
TEST(CudaScale, ASequenceDecodedAloneOrInABatchOf64HasTheSameBits) {
  ATTND_SKIP_WITHOUT_GPU();
  const ModelSpec spec = DeepSeekDims(128);
  int major = 0, minor = 0;
  ASSERT_NO_FATAL_FAILURE(ComputeCapability(&major, &minor));
  const bool flashinfer = cuda::FlashInferMlaBuilt() && major == 9 && minor == 0;
  for (const int form : {0, 1, 2}) {  // tensor cores, SIMT, FlashInfer's MLA
    if (form == 2 && !flashinfer) continue;
    const bool tensor_cores = form != 1;
    const int64_t launches = cuda::FlashInferMlaLaunches();
    cuda::ScopedKernelChoice kernels(tensor_cores, tensor_cores);
    cuda::ScopedLibraryMla library(form == 2 ? cuda::LibraryMla::kFlashInfer
                                             : cuda::LibraryMla::kOff);
    Harness alone(Options(spec, DType::kBF16, {"cuda:0"}, 2560));
    Harness batch(Options(spec, DType::kBF16, {"cuda:0"}, 2560));
    std::vector<StepEntry> import = {{"a", 3000}}, decode = {{"a", 1}};
    for (int i = 0; i < 63; ++i) {  // 100 to 4,000 keys: splits from 1 to 8
      import.push_back({absl::StrCat("b", i), 100 + 62 * i});
      decode.push_back({absl::StrCat("b", i), 1});
    }
    alone.Open("a");
    for (const auto& e : import) batch.Open(e.sequence_id);
    const auto keys = batch.MakeKeys(import, DType::kBF16, 21);
    const absl::Status imported = batch.Run(import, keys, StepOptions::WriteOnly()).status;
    ASSERT_TRUE(imported.ok()) << imported;
    const absl::Status imported_alone =
        alone.Run({import[0]}, Rows(keys, 0, 3000), StepOptions::WriteOnly()).status;
    ASSERT_TRUE(imported_alone.ok()) << imported_alone;
    const auto in = batch.MakeInputs(decode, DType::kBF16, 22);
    auto many = batch.Run(decode, in);
    auto one = alone.Run({decode[0]}, Rows(in, 0, 1));
    ASSERT_TRUE(many.status.ok()) << many.status;
    ASSERT_TRUE(one.status.ok()) << one.status;
    EXPECT_EQ(cuda::FlashInferMlaLaunches() > launches, form == 2) << "form " << form;
    const size_t row = one.out[0].size();  // a's H x L outputs come first in the batch
    for (size_t l = 0; l < one.out.size(); ++l) {
      const std::vector<double> first(many.out[l].begin(), many.out[l].begin() + row);
      EXPECT_EQ(first, one.out[l])
          << "form " << form << " layer " << l << ": a's bits changed with the batch";
      const std::vector<double> first_lse(many.lse[l].begin(),
                                          many.lse[l].begin() + one.lse[l].size());
      EXPECT_EQ(first_lse, one.lse[l]) << "layer " << l << ": a's log-sum-exps changed";
      EXPECT_EQ(many.traces[l].keys[0], one.traces[l].keys[0]) << "layer " << l;
    }
  }
}

void AllEqualScoresSelectTheLowestPositions();

TEST(CudaScale, AllEqualScoresSelectTheLowestPositionsLikeTheCpu) {
  ATTND_SKIP_WITHOUT_GPU();
  for (const bool flashinfer_topk : {false, true}) {
    SCOPED_TRACE(flashinfer_topk ? "FlashInfer's top-k" : "attnd's top-k");
    if (flashinfer_topk && !cuda::FlashInferTopKApplies(2048)) continue;
    cuda::ScopedTopK topk(flashinfer_topk ? cuda::TopKKernel::kFlashInfer
                                          : cuda::TopKKernel::kAttnd);
    const int64_t launches = cuda::FlashInferTopKLaunches();
    AllEqualScoresSelectTheLowestPositions();
    EXPECT_EQ(cuda::FlashInferTopKLaunches() > launches, flashinfer_topk);
  }
}

// FlashInfer's top-k selects exactly what attnd's does at DeepSeek-V3.2 dims (scores from the
// same indexer): a 3,000-key prefill of 5 tokens and a 70,000-key decode (attnd's in slices).
TEST(CudaScale, FlashInfersTopKSelectsWhatAttndsSelects) {
  ATTND_SKIP_WITHOUT_GPU();
  if (!cuda::FlashInferTopKApplies(2048)) GTEST_SKIP() << "FlashInfer's top-k does not apply here";
  const ModelSpec spec = DeepSeekDims(16);
  Harness ours(Options(spec, DType::kBF16, {"cuda:0"}, 1400));
  Harness theirs(Options(spec, DType::kBF16, {"cuda:0"}, 1400));
  for (Harness* h : {&ours, &theirs}) {
    h->Open("a");
    h->Open("b");
  }
  const std::vector<StepEntry> import = {{"a", 3000}, {"b", 70000}};
  const auto keys = ours.MakeKeys(import, DType::kBF16, 71);
  for (Harness* h : {&ours, &theirs})
    ASSERT_TRUE(h->Run(import, keys, StepOptions::WriteOnly()).status.ok());
  const std::vector<StepEntry> step = {{"a", 5}, {"b", 1}};
  const auto in = ours.MakeInputs(step, DType::kBF16, 72);
  auto a = [&] {
    cuda::ScopedTopK off(cuda::TopKKernel::kAttnd);
    return ours.Run(step, in);
  }();
  const int64_t launches = cuda::FlashInferTopKLaunches();
  auto b = [&] {
    cuda::ScopedTopK on(cuda::TopKKernel::kFlashInfer);
    return theirs.Run(step, in);
  }();
  ASSERT_TRUE(a.status.ok()) << a.status;
  ASSERT_TRUE(b.status.ok()) << b.status;
  EXPECT_GT(cuda::FlashInferTopKLaunches(), launches) << "FlashInfer's top-k did not run";
  for (size_t l = 0; l < a.traces.size(); ++l) {
    EXPECT_EQ(b.traces[l].keys, a.traces[l].keys) << "layer " << l;
    EXPECT_EQ(b.out[l], a.out[l]) << "layer " << l << ": the same keys, other bits";
  }
}

void AllEqualScoresSelectTheLowestPositions() {
  const ModelSpec spec = DeepSeekDims(16);
  Harness gpu(Options(spec, DType::kBF16, {"cuda:0"}));
  Harness cpu(Options(spec, DType::kBF16, {"cpu:0"}));
  // Indexer queries <= 0 and keys >= 0: every dot product is <= 0, relu makes every score 0.
  const auto neg = [](double x) { return -std::abs(x) - 0.5; };
  const auto pos = [](double x) { return std::abs(x) + 0.5; };
  for (Harness* h : {&gpu, &cpu}) h->Open("a");
  const std::vector<StepEntry> import = {{"a", 3000}};
  auto keys = gpu.MakeKeys(import, DType::kBF16, 3);
  MapValues(&keys[0].index_k, pos);
  for (Harness* h : {&gpu, &cpu})
    ASSERT_TRUE(h->Run(import, keys, StepOptions::WriteOnly()).status.ok());
  const std::vector<StepEntry> step = {{"a", 2}};
  auto in = gpu.MakeInputs(step, DType::kBF16, 4);
  MapValues(&in[0].index_k, pos);
  MapValues(&in[0].index_q, neg);
  auto g = gpu.Run(step, in);
  auto c = cpu.Run(step, in);
  ASSERT_TRUE(g.status.ok()) << g.status;
  ASSERT_TRUE(c.status.ok()) << c.status;
  std::vector<int32_t> lowest(2048);
  for (int i = 0; i < 2048; ++i) lowest[i] = i;
  for (size_t l = 0; l < g.traces.size(); ++l) {
    EXPECT_EQ(g.traces[l].keys[0], lowest) << "layer " << l;
    EXPECT_EQ(g.traces[l].keys, c.traces[l].keys) << "layer " << l;
    ExpectClose(g.out[l], c.out[l], 1e-2, "GPU vs CPU layer " + std::to_string(l));
  }
}

TEST(CudaScale, MoreThan65535QueriesInOneStepMatchTheCpuBackend) {
  ATTND_SKIP_WITHOUT_GPU();
  ModelSpec spec = MixedLayerSpec(SelectionMode::kToken);
  spec.prefill = PrefillMode::kSparse;
  spec.max_context = 131072;
  const int64_t n = 70000;  // grid.y is limited to 65,535: the launchers must split
  Harness gpu(Options(spec, DType::kF32, {"cuda:0"}, 5000));
  Harness cpu(Options(spec, DType::kF32, {"cpu:0"}, 5000));
  for (Harness* h : {&gpu, &cpu}) h->Open("a");
  const std::vector<StepEntry> step = {{"a", n}};
  const auto in = gpu.MakeInputs(step, DType::kF32, 5);
  auto g = gpu.Run(step, in);
  auto c = cpu.Run(step, in);
  ASSERT_TRUE(g.status.ok()) << g.status;
  ASSERT_TRUE(c.status.ok()) << c.status;
  // fp32 scores summed in another order may rank two near-equal keys the other way: rows whose
  // selections differ are counted (a handful of 70,000), the rest must agree to fp32 rounding.
  const size_t row = static_cast<size_t>(spec.num_heads) * spec.kv_lora_rank;
  for (size_t l = 0; l < g.out.size(); ++l) {
    std::vector<double> same_g, same_c;
    int64_t differ = 0;
    for (int64_t q = 0; q < n; ++q) {
      auto a = g.traces[l].keys[q], b = c.traces[l].keys[q];
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      if (a != b) {
        ++differ;
        continue;
      }
      same_g.insert(same_g.end(), g.out[l].begin() + q * row, g.out[l].begin() + (q + 1) * row);
      same_c.insert(same_c.end(), c.out[l].begin() + q * row, c.out[l].begin() + (q + 1) * row);
    }
    std::printf("layer %zu: %lld of %lld queries selected other keys on the GPU\n", l,
                static_cast<long long>(differ), static_cast<long long>(n));
    EXPECT_LE(differ, n / 1000) << "layer " << l;
    ExpectClose(same_g, same_c, 1e-4, "GPU vs CPU, same selections, layer " + std::to_string(l));
  }
  // The last queries (past 65,535) attended keys, and the same ones on both backends.
  EXPECT_EQ(g.traces[0].keys[n - 1], c.traces[0].keys[n - 1]);
  EXPECT_EQ(g.traces[0].keys[n - 1].size(), 24u);
}

TEST(CudaScale, AStepTooLargeForGpuScratchIsRefusedAtBeginStepAndChangesNothing) {
  ATTND_SKIP_WITHOUT_GPU();
  ModelSpec spec = DeepSeekDims(128);
  spec.max_context = 1 << 20;
  // 600K tokens x 128 heads x 512 x 4 bytes is 150 GiB for one fp32 query buffer alone.
  const int64_t n = 600000;
  Harness h(Options(spec, DType::kBF16, {"cuda:0"}, static_cast<int32_t>(n / 64 + 64)));
  h.Open("a");
  auto step = h.engine().BeginStep({{"a", n}});
  ASSERT_EQ(step.status().code(), absl::StatusCode::kResourceExhausted) << step.status();
  EXPECT_NE(step.status().message().find("GPU scratch"), std::string::npos) << step.status();
  EXPECT_EQ(h.Length("a"), 0);
  EXPECT_EQ(h.engine().num_open_steps(), 0);
  // Nothing is held: a normal step runs and matches the reference.
  h.RunAndCheck({{"a", 40}}, DType::kBF16, 6, 1e-2);
}

// The top-k kernels on rows long enough to run in slices and a merge (70,000 and 131,072 keys,
// top-2048; 100,000 keys, top-24) next to one-slice rows, with ties across slice borders, NaN
// and -0: every row equals the host's ExactTopK bit for bit (kernels/selection.h).
TEST(CudaScale, TopKOfLongRowsInSlicesEqualsTheHost) {
  ATTND_SKIP_WITHOUT_GPU();
  std::mt19937 rng(12);
  std::normal_distribution<float> n01(0, 1);
  for (const int64_t k : {int64_t{2048}, int64_t{24}}) {
    const std::vector<int64_t> lens = {70000, 16384, 131072, 100000, 5};
    std::vector<int64_t> offset;
    std::vector<float> scores;
    for (const int64_t n : lens) {
      offset.push_back(static_cast<int64_t>(scores.size()));
      for (int64_t i = 0; i < n; ++i)
        scores.push_back(i % 5 == 0 ? std::round(n01(rng) * 3) : n01(rng));
      scores[offset.back() + 1] = NAN;
      if (n > 3) scores[offset.back() + 3] = -0.0f;
    }
    const cuda::TopKSlicePlan plan = cuda::PlanTopKSlices(lens, k);
    const int nq = static_cast<int>(lens.size());
    auto upload = [](const auto& v) {
      void* d = nullptr;
      EXPECT_EQ(cudaMalloc(&d, std::max<size_t>(1, v.size() * sizeof(v[0]))), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(d, v.data(), v.size() * sizeof(v[0]), cudaMemcpyHostToDevice),
                cudaSuccess);
      return d;
    };
    cuda::TopKParams p;
    p.rows.scores = static_cast<const float*>(upload(scores));
    p.rows.row_offset = static_cast<const int64_t*>(upload(offset));
    p.rows.row_len = static_cast<const int64_t*>(upload(lens));
    p.nq = nq;
    p.rows.k = k;
    p.max_len = *std::max_element(lens.begin(), lens.end());
    p.rows.out_stride = k;
    p.rows.out = static_cast<int32_t*>(upload(std::vector<int32_t>(nq * k, -1)));
    p.rows.out_count = static_cast<int32_t*>(upload(std::vector<int32_t>(nq, -1)));
    p.rows.slice_offset = static_cast<const int64_t*>(upload(plan.offset));
    p.rows.cand_key = static_cast<uint32_t*>(upload(std::vector<uint32_t>(plan.total * k + 1)));
    p.rows.cand_index = static_cast<int32_t*>(upload(std::vector<int32_t>(plan.total * k + 1)));
    p.rows.cand_count = static_cast<int32_t*>(upload(std::vector<int32_t>(plan.total + 1)));
    ASSERT_EQ(cuda::LaunchTopK(p, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<int32_t> out(nq * k), count(nq);
    ASSERT_EQ(cudaMemcpy(out.data(), p.rows.out, out.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(count.data(), p.rows.out_count, count.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (int q = 0; q < nq; ++q) {
      std::vector<int32_t> want(std::min(lens[q], k));
      want.resize(ExactTopK(scores.data() + offset[q], lens[q], k, want.data()));
      ASSERT_EQ(count[q], static_cast<int32_t>(want.size())) << "k " << k << " row " << q;
      EXPECT_TRUE(std::equal(want.begin(), want.end(), out.begin() + q * k))
          << "k " << k << " row " << q << " of " << lens[q] << " keys ("
          << cuda::TopKSlices(lens[q], k) << " slices)";
    }
    for (const void* d :
         {static_cast<const void*>(p.rows.scores), static_cast<const void*>(p.rows.row_offset),
          static_cast<const void*>(p.rows.row_len), static_cast<const void*>(p.rows.out),
          static_cast<const void*>(p.rows.out_count), static_cast<const void*>(p.rows.slice_offset),
          static_cast<const void*>(p.rows.cand_key), static_cast<const void*>(p.rows.cand_index),
          static_cast<const void*>(p.rows.cand_count)})
      cudaFree(const_cast<void*>(d));
  }
}

TEST(CudaScale, NcclMovesPagesBetweenTwoGpus) {
  ATTND_SKIP_WITHOUT_GPU();
  auto gpus = GpuDeviceNames();
  if (!gpus.ok() || gpus->size() < 2) GTEST_SKIP() << "needs two GPUs (one visible)";
  const ModelSpec spec = MixedLayerSpec(SelectionMode::kToken);
  Harness h(Options(spec, DType::kBF16, {"cuda:0", "cuda:1"}));
  h.Open("p", 0);
  h.RunAndCheck({{"p", 70}}, DType::kBF16, 1, 1e-2);
  h.Fork("q", "p", 65, 1);  // every page copied GPU to GPU
  ASSERT_TRUE(h.engine().MigrateSequence("p", 1).ok());
  h.RunAndCheck({{"p", 1}, {"q", 3}}, DType::kBF16, 2, 1e-2);
  ASSERT_TRUE(h.engine().MigrateSequence("q", 0).ok());
  h.RunAndCheck({{"p", 1}, {"q", 1}}, DType::kBF16, 3, 1e-2);
  for (int d = 0; d < 2; ++d) EXPECT_TRUE(h.engine().ReservedPageUntouched(d));
}

}  // namespace
}  // namespace attnd::testing
