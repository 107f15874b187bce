// One DSA layer at DeepSeek-V3.2 dims on the CPU backend, next to this machine's own limits
// measured in the same binary: a streaming copy (bandwidth) and a register FMA loop (arithmetic).
//
//   build/bench/engine_bench                      # everything
//   build/bench/engine_bench --benchmark_filter=Decode
//   build/bench/engine_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only
//       (min/max over the runs: on a shared machine the best run is the figure to compare)
//   build/bench/engine_bench --isa=avx2           # the inner loops of one ISA (default: the
//       widest this host has); the peak is that ISA's FMA loop too
//
// Each benchmark reports GFLOP/s and GB/s of the work it must do, and the fraction of the
// measured peak that bounds it (frac_peak_flops / frac_peak_bw).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "bench/bench_inputs.h"
#include "common/fp8.h"
#include "common/thread_pool.h"
#include "engine/engine.h"
#include "kernels/cpu/attention_cpu.h"
#include "kernels/cpu/cpu_isa.h"
#include "tests/run_layer.h"

namespace attnd {
namespace {
using testing::RunCandidatesInto;
using testing::RunLayerInto;

int Threads() { return static_cast<int>(std::thread::hardware_concurrency()); }

// The ISA every benchmark runs (--isa=NAME, else the widest supported).
cpu::Isa& BenchIsa() {
  static cpu::Isa isa = cpu::BestIsa();
  return isa;
}
const cpu::Kernels& BenchKernels() { return cpu::GetKernels(BenchIsa()); }

// Best and worst of --benchmark_repetitions (this may be a shared machine: the best run is the
// machine's capability, as the peaks are best-of-several too). For rates read "max".
double Lowest(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }
double Highest(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

// Peak fp32 FLOP/s of all cores running the best ISA's FMA loop, best of `reps` runs.
double FlopPeakNow(int reps, long iters) {
  const auto& k = BenchKernels();
  static ThreadPool pool(Threads());
  double best = 0;
  for (int rep = 0; rep < reps; ++rep) {  // best of several: the machine may be shared
    const auto t0 = std::chrono::steady_clock::now();
    pool.ParallelFor(pool.num_threads(),
                     [&](int64_t) { benchmark::DoNotOptimize(k.fma_loop(iters)); });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, double(iters) * k.fma_loop_flops * pool.num_threads() / s);
  }
  return best;
}

// The peak measured once, at the start.
double MeasureFlopPeak() {
  static const double peak = FlopPeakNow(7, 20'000'000);
  return peak;
}

// The peak again, right after a benchmark's runs (a shared machine's speed drifts), never
// below the first figure: a neighbour's burst during this short measurement must not inflate the
// benchmark's fraction (it once halved the peak and doubled a fraction). Never above 1.1x.
double FlopPeakAfterRun() {
  const double now = FlopPeakNow(3, 2'000'000);
  return std::clamp(now, MeasureFlopPeak(), 1.1 * MeasureFlopPeak());
}

// Streaming copy bandwidth (bytes read + written per second), all cores, 1 GiB total traffic.
double MeasureCopyBandwidth() {
  static const double bw = [] {
    ThreadPool pool(Threads());
    const size_t n = size_t{256} << 20;
    std::vector<char> a(n, 1), b(n, 2);
    const int parts = pool.num_threads() * 4;
    double best = 0;
    for (int rep = 0; rep < 5; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      pool.ParallelFor(parts, [&](int64_t i) {
        const size_t lo = n / parts * i;
        std::memcpy(b.data() + lo, a.data() + lo, n / parts);
      });
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::max(best, 2.0 * n / s);
      benchmark::DoNotOptimize(b.data());
    }
    return best;
  }();
  return bw;
}

void Peaks(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(MeasureFlopPeak() + MeasureCopyBandwidth());
  state.counters["peak_GFLOP/s"] = MeasureFlopPeak() / 1e9;
  state.counters["peak_copy_GB/s"] = MeasureCopyBandwidth() / 1e9;
  state.SetLabel(std::string(cpu::IsaName(BenchIsa())));
}
BENCHMARK(Peaks)->Iterations(1)->Unit(benchmark::kMillisecond);

// The GEMM shapes of the hot loops, one core, with their real row strides (ldb: B's): S^T = K·q^T
// (MLA, indexer), acc += P·V with V the key rows of a tile (stride 576), and the same P·V with the
// probabilities keys-major and the output's rescale folded in (GemmAtScaled, what MLA runs).
void Gemm(benchmark::State& state) {
  const int M = state.range(0), N = state.range(1), D = state.range(2), ldb = state.range(3);
  const bool at = state.range(4) == 1;
  const auto& k = BenchKernels();
  std::vector<float> a(M * D, 0.5f), b(D * ldb, 0.25f), c(M * N, 0.0f), scale(M, 1.0f);
  for (auto _ : state) {
    if (at) {
      k.gemm_at_scaled(M, N, D, a.data(), M, b.data(), ldb, c.data(), N, scale.data());
    } else {
      k.gemm(M, N, D, a.data(), D, b.data(), ldb, c.data(), N, true);
    }
    benchmark::DoNotOptimize(c.data());
  }
  const double flops = 2.0 * M * N * D;
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["frac_core_peak"] =
      benchmark::Counter(flops * std::thread::hardware_concurrency() / MeasureFlopPeak(),
                         benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(Gemm)
    ->Args({64, 16, 576, 16, 0})
    ->Args({16, 512, 64, 576, 0})
    ->Args({16, 512, 64, 576, 1})
    ->Args({128, 512, 64, 576, 1})
    ->Args({64, 64, 128, 64, 0})
    ->ArgNames({"M", "N", "D", "ldb", "at"});

// Converting 2048 cached rows of 576 values to fp32 (what every MLA tile starts with), one core:
// bf16 (a shift) against fp8 (e4m3 through F16C, times the tile scales). Arg: 1 = fp8.
void DecodeRows(benchmark::State& state) {
  const bool fp8 = state.range(0) == 1;
  const int L = 512, R = 64, D = L + R;
  const size_t n = 2048;
  std::vector<uint8_t> rows(n * D * 2);
  std::mt19937 rng(5);
  for (auto& b : rows) b = static_cast<uint8_t>(rng() & 0x77);  // finite codes / bf16 bits
  std::vector<float> scales(4, 0.25f), out(64 * D);
  const auto& k = BenchKernels();
  for (auto _ : state) {
    for (size_t r = 0; r < n; ++r) {
      float* o = out.data() + (r % 64) * D;  // one MLA tile's buffer, as MlaAttend
      if (fp8) {
        const uint8_t* row = rows.data() + r * 656;
        k.e4m3_to_f32(row, scales.data(), 128, o, L);
        k.bf16_to_f32(reinterpret_cast<const unsigned short*>(row + 528), o + L, R);
      } else {
        k.bf16_to_f32(reinterpret_cast<const unsigned short*>(rows.data()) + r * D, o, D);
      }
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["values/s"] =
      benchmark::Counter(double(n) * D, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(DecodeRows)->Arg(0)->Arg(1)->ArgName("fp8");

// One query's sparse MLA (2048 keys of a 32K history), one core. Arg 0: 1 = the keys are
// scattered (a top-k selection), 0 = contiguous (dense attention); arg 1: 1 = an fp8 cache
// (FlashMLA's 656-byte tokens), 0 = bf16; arg 2: heads in the call (each key tile is converted
// once per call, so more heads per call convert less per head).
void MlaOneQuery(benchmark::State& state) {
  const bool scattered = state.range(0) == 1, fp8 = state.range(1) == 1;
  const int H = static_cast<int>(state.range(2)), L = 512, R = 64, D = L + R, ps = 64;
  const int64_t n = 32768, K = 2048;
  const size_t row = fp8 ? fp8::LatentTokenBytes(L, R) : size_t{D} * 2;
  std::mt19937 rng(4);
  std::vector<uint8_t> cache((n + ps) * row);
  std::vector<float> x(D);
  for (int64_t t = 0; t < n + ps; ++t) {
    for (float& v : x) v = std::normal_distribution<float>(0, 1)(rng);
    if (fp8) {
      fp8::PackLatentToken(L, R, x.data(), x.data() + L, cache.data() + t * row);
    } else {
      ConvertFromF32(DType::kBF16, x.data(), cache.data() + t * row, D);
    }
  }
  std::vector<int32_t> pages(n / ps);
  for (int i = 0; i < n / ps; ++i) pages[i] = i + 1;
  std::shuffle(pages.begin(), pages.end(), rng);
  std::vector<int32_t> pos(n);
  for (int i = 0; i < n; ++i) pos[i] = i;
  if (scattered) std::shuffle(pos.begin(), pos.end(), rng);
  pos.resize(K);
  std::sort(pos.begin(), pos.end());
  std::vector<float> q(H * D, 0.01f), out(H * L);
  cpu::MlaParams p;
  p.q = q.data();
  p.num_heads = H;
  p.latent_dim = L;
  p.rope_dim = R;
  p.kv = CacheRows{cache.data(), row, fp8 ? DType::kFP8E4M3 : DType::kBF16, D, fp8 ? L : 0};
  // A selection reaches attention as physical slot ids.
  for (auto& s : pos) s = pages[s / ps] * ps + s % ps;
  p.slots = pos.data();
  p.num_keys = K;
  p.sm_scale = 0.1f;
  p.out = out.data();
  const auto& k = BenchKernels();
  for (auto _ : state) cpu::MlaAttend(k, p);
  const double flops = 2.0 * H * K * (D + L);
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["frac_core_peak"] =
      benchmark::Counter(flops * std::thread::hardware_concurrency() / MeasureFlopPeak(),
                         benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(MlaOneQuery)
    ->ComputeStatistics("min", Lowest)
    ->ComputeStatistics("max", Highest)
    ->ArgsProduct({{0, 1}, {0, 1}, {16, 64}})
    ->ArgNames({"scattered", "fp8", "heads"});

// DeepSeek-V3.2's dims with 16 query heads (a tensor-parallel shard's) unless told otherwise.
ModelSpec BenchSpec(int heads = 16) {
  ModelSpec s = PresetModelSpec("deepseek-v3.2").value();
  s.name = "bench";
  s.layers = {LayerKind::kFull, LayerKind::kShared};
  s.num_heads = heads;
  return s;
}

using bench::MakeInputs;
using bench::Tensors;

// Bytes per cached token: a latent row, an indexer key (fp8: with its scales).
double LatentBytes(const ModelSpec& s, DType cache) {
  return static_cast<double>(CacheLayout::ForModel(s, cache, 0).latent_row_bytes());
}
double IndexBytes(const ModelSpec& s, DType cache) {
  return static_cast<double>(CacheLayout::ForModel(s, cache, 0).index_row_bytes());
}
DType CacheArg(int64_t arg) { return arg == 1 ? DType::kFP8E4M3 : DType::kBF16; }

// An engine with `batch` sequences of `context` tokens, imported with write-only steps.
std::unique_ptr<Engine> MakeEngine(int batch, int64_t context, DType cache, int heads) {
  EngineOptions o;
  o.spec = BenchSpec(heads);
  o.cache_dtype = cache;
  o.device.cpu_isa = std::string(cpu::IsaName(BenchIsa()));
  const int64_t pages = batch * (context / o.spec.page_size + 64) + 16;
  o.pages_per_device = static_cast<int32_t>(pages);
  auto e = Engine::Create(o).value();
  std::mt19937 rng(1);
  for (int b = 0; b < batch; ++b) {
    const std::string id = absl::StrCat("s", b);
    if (!e->OpenSequence(id).ok()) std::abort();
    for (int64_t done = 0; done < context;) {
      const int64_t q = std::min<int64_t>(4096, context - done);
      auto step = e->BeginStep({{id, q}}, StepOptions::WriteOnly());
      for (int l = 0; l < 2; ++l) {
        Tensors tb;
        if (!RunLayerInto(*e, *step, l, MakeInputs(o.spec, q, l == 0, true, tb, rng), nullptr, 0)
                 .ok())
          std::abort();
      }
      done += q;
    }
  }
  return e;
}

void SetRates(benchmark::State& state, double flops, double bytes) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GB/s"] =
      benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  const double peak = FlopPeakAfterRun();
  state.counters["peak_now_GFLOP/s"] = peak / 1e9;
  state.counters["frac_peak_flops"] =
      benchmark::Counter(flops / peak, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["frac_peak_bw"] = benchmark::Counter(
      bytes / MeasureCopyBandwidth(), benchmark::Counter::kIsIterationInvariantRate);
}

// Decode: batch 8, K = 2048. Arg 0: context; arg 1: 0 = full layer (indexer over the whole
// context + top-k + sparse MLA), 1 = shared layer (sparse MLA over the carried selection);
// arg 2: the cache, 0 = bf16, 1 = fp8; arg 3: query heads (16: a shard's; 128: all of
// DeepSeek-V3.2's, as a sharded step brings them).
void Decode(benchmark::State& state) {
  const int batch = 8;
  const int64_t context = state.range(0);
  const bool shared = state.range(1) == 1;
  const DType cache = CacheArg(state.range(2));
  const int heads = static_cast<int>(state.range(3));
  static std::map<std::tuple<int64_t, DType, int>, std::unique_ptr<Engine>> engines;
  const auto key = std::make_tuple(context, cache, heads);
  if (!engines[key]) {
    engines.clear();  // one cache at a time: they are large
    engines[key] = MakeEngine(batch, context, cache, heads);
  }
  Engine& e = *engines[key];
  const ModelSpec& s = e.spec();
  std::mt19937 rng(2);
  Tensors tb;
  const LayerInputs full_in = MakeInputs(s, batch, true, false, tb, rng);
  const LayerInputs shared_in = MakeInputs(s, batch, false, false, tb, rng);
  std::vector<uint16_t> out(batch * s.num_heads * s.kv_lora_rank);
  std::vector<StepEntry> entries;
  for (int b = 0; b < batch; ++b) entries.push_back({absl::StrCat("s", b), 1});
  for (auto _ : state) {
    state.PauseTiming();
    auto step = e.BeginStep(entries).value();
    if (!shared) state.ResumeTiming();
    if (!RunLayerInto(e, step, 0, full_in, out.data(), out.size() * 2).ok()) std::abort();
    if (shared) {
      state.ResumeTiming();
      if (!RunLayerInto(e, step, 1, shared_in, out.data(), out.size() * 2).ok()) std::abort();
    } else {
      state.PauseTiming();
      (void)e.AbortStep(step);
      state.ResumeTiming();
    }
  }
  const double ctx = static_cast<double>(context);
  const double H = s.num_heads, D = s.latent_dim(), L = s.kv_lora_rank, K = s.index_topk;
  const double mla_flops = batch * H * K * (D + L) * 2;
  const double mla_bytes = batch * K * LatentBytes(s, cache);
  double flops = mla_flops, bytes = mla_bytes;
  if (!shared) {
    flops += batch * ctx * s.index_n_heads * s.index_head_dim * 2.0;
    bytes += batch * ctx * IndexBytes(s, cache);
  }
  SetRates(state, flops, bytes);
  state.SetLabel(absl::StrCat(shared ? "shared layer" : "full layer", ", ", DTypeName(cache)));
}
BENCHMARK(Decode)
    ->ComputeStatistics("min", Lowest)
    ->ComputeStatistics("max", Highest)
    ->ArgsProduct({{8192, 32768}, {0, 1}, {0, 1}, {16}})
    ->Args({8192, 1, 0, 128})
    ->Args({8192, 1, 1, 128})
    ->ArgNames({"ctx", "shared", "fp8", "heads"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Prefill: 2048 new tokens of one sequence in one full layer (K = 2048 covers every visible
// key, so this is dense causal MLA plus the indexer-key writes). Arg 1: bf16 (0) or fp8 (1) cache.
void Prefill(benchmark::State& state) {
  const int64_t T = state.range(0);
  const DType cache = CacheArg(state.range(1));
  EngineOptions o;
  o.spec = BenchSpec();
  o.cache_dtype = cache;
  o.device.cpu_isa = std::string(cpu::IsaName(BenchIsa()));
  o.pages_per_device = static_cast<int32_t>(T / o.spec.page_size + 8);
  auto e = Engine::Create(o).value();
  std::mt19937 rng(3);
  Tensors tb;
  const LayerInputs in = MakeInputs(o.spec, T, true, false, tb, rng);
  std::vector<uint16_t> out(T * o.spec.num_heads * o.spec.kv_lora_rank);
  if (!e->OpenSequence("p").ok()) std::abort();
  for (auto _ : state) {
    auto step = e->BeginStep({{"p", T}}).value();
    if (!RunLayerInto(*e, step, 0, in, out.data(), out.size() * 2).ok()) std::abort();
    state.PauseTiming();
    (void)e->AbortStep(step);
    state.ResumeTiming();
  }
  const ModelSpec& s = o.spec;
  const double pairs = static_cast<double>(T) * (T + 1) / 2;  // causal (query, key) pairs
  const double flops = pairs * s.num_heads * (s.latent_dim() + s.kv_lora_rank) * 2;
  const double bytes = static_cast<double>(T) * (LatentBytes(s, cache) + IndexBytes(s, cache)) +
                       2.0 * T * s.num_heads * (s.latent_dim() + s.kv_lora_rank);
  SetRates(state, flops, bytes);
  state.SetLabel(DTypeName(cache));
}
BENCHMARK(Prefill)
    ->ComputeStatistics("min", Lowest)
    ->ComputeStatistics("max", Highest)
    ->ArgsProduct({{2048}, {0, 1}})
    ->ArgNames({"tokens", "fp8"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Iterations(3);

}  // namespace
}  // namespace attnd

// --isa=NAME (taken out before Google Benchmark reads the rest).
int main(int argc, char** argv) {
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--isa=", 0) != 0) {
      rest.push_back(argv[i]);
      continue;
    }
    const auto isa = attnd::cpu::SupportedIsaNamed(arg.substr(6));
    if (!isa) {
      std::fprintf(stderr, "engine_bench: %s is not an ISA this host runs\n", arg.c_str());
      return 2;
    }
    attnd::BenchIsa() = *isa;
  }
  int n = static_cast<int>(rest.size());
  benchmark::Initialize(&n, rest.data());
  if (benchmark::ReportUnrecognizedArguments(n, rest.data())) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
