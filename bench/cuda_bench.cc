// GPU benchmark of the CUDA backend's kernels at DeepSeek-V3.2 dims, next to this GPU's
// device-to-device copy bandwidth measured in the same run; every tensor-core row's result is
// checked against the SIMT kernel's on the same inputs, top-k against the host's exact top-k (the
// bf16 matmul rate comes from bench/torch_ref.py in the same gpu-check run, so this binary needs no
// cuBLAS to carry). Prints a table and writes JSON lines (--json=PATH) that scripts/gpu-check.sh
// joins with the PyTorch timings of the same ops. Exits 0 with a message when no GPU is visible.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/backend/gpu_facts.h"
#include "kernels/cuda/ops/cuda_kernels.h"
#include "kernels/cuda/ops/mla_flashinfer.h"
#include "kernels/cuda/ops/mla_flashinfer_plan.h"
#include "kernels/cuda/ops/mla_gemm.h"
#include "kernels/cuda/ops/mla_split.h"
#include "kernels/cuda/ops/topk_block.h"
#include "kernels/cuda/ops/topk_flashinfer.h"

namespace {

using attnd::CacheRows;
using attnd::PageTable;
using attnd::QueryTables;

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

template <typename T>
T* Alloc(size_t n) {
  void* p = nullptr;
  CHECK(cudaMalloc(&p, n * sizeof(T)));
  return static_cast<T*>(p);
}

template <typename T>
T* Upload(const std::vector<T>& v) {
  T* d = Alloc<T>(std::max<size_t>(1, v.size()));
  CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// N(0,1) bf16 generated on the device.
void RandomBf16(__nv_bfloat16* d, size_t n, uint64_t seed) {
  CHECK(attnd::cuda::LaunchFillNormalBf16(d, static_cast<int64_t>(n), seed, 0));
  CHECK(cudaDeviceSynchronize());
}

void RandomF32(float* d, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0, 1);
  std::vector<float> h(n);
  for (auto& x : h) x = dist(rng);
  CHECK(cudaMemcpy(d, h.data(), n * 4, cudaMemcpyHostToDevice));
}

// Median milliseconds of `reps` runs of fn on the default stream.
double TimeMs(const std::function<void()>& fn, int reps = 10) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  fn();  // warm up
  CHECK(cudaDeviceSynchronize());
  std::vector<float> ms;
  for (int r = 0; r < reps; ++r) {
    CHECK(cudaEventRecord(a));
    fn();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct Row {
  std::string op, shape;
  double ms, rate;  // GB/s or TFLOP/s
  const char* unit;
  double frac;
  std::string check;  // what the row's result was checked against, and how it came out
};
std::vector<Row> rows;
FILE* json = nullptr;

void Report(const std::string& op, const std::string& shape, double ms, double amount,
            const char* unit, double limit, const std::string& check = "") {
  const double rate = amount / (ms * 1e-3);
  const double frac = limit > 0 ? rate / limit : -1;
  rows.push_back({op, shape, ms, rate, unit, frac, check});
  if (json)
    std::fprintf(json,
                 "{\"op\": \"%s\", \"shape\": \"%s\", \"ms\": %.4f, \"rate\": %.2f, "
                 "\"unit\": \"%s\", \"frac\": %.3f, \"check\": \"%s\"}\n",
                 op.c_str(), shape.c_str(), ms, rate, unit, frac, check.c_str());
  if (json) std::fflush(json);  // a row survives a later timeout or fault
}

// The exact top-k of scores[0, n) by definition (kernels/selection.h's rule, written out here so
// this file needs no library beyond the kernels): the k best (ties to the lower position),
// ascending positions.
int64_t ExactTopK(const float* scores, int64_t n, int64_t k, int32_t* out) {
  std::vector<int32_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  k = std::min(k, n);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  });
  std::sort(idx.begin(), idx.begin() + k);
  std::copy(idx.begin(), idx.begin() + k, out);
  return k;
}

template <typename T>
std::vector<T> Download(const T* d, size_t n) {
  std::vector<T> h(n);
  CHECK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// Relative L2 distance of two result vectors, as text for a row's check ("NaN" if any is NaN).
std::string RelL2Text(const std::vector<float>& got, const std::vector<float>& want,
                      const char* against) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) || std::isnan(want[i])) return std::string("NaN vs ") + against;
    num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    den += double(want[i]) * want[i];
  }
  char buf[96];
  std::snprintf(buf, sizeof buf, "rel L2 %.1e vs %s", std::sqrt(num / std::max(den, 1e-300)),
                against);
  return buf;
}

// The gather + cuBLAS GEMMs floor (mla_gemm.h) on the same selection, where cuBLAS loads:
// the server's whole path for a layer (query packing, gather, two GEMMs, softmax).
template <typename Tflops>
void GemmDecodeRow(const attnd::cuda::MlaParams& mp, int K, const std::string& shape, double bytes,
                   double copy_bw, const std::vector<float>& simt_out, Tflops tflops) {
  std::string why;
  const attnd::cuda::CublasApi* blas = attnd::cuda::LoadCublas(&why);
  if (blas == nullptr) {
    std::fprintf(stderr, "cuda_bench: no GEMM MLA row: %s\n", why.c_str());
    return;
  }
  static attnd::cuda::CublasHandle handle;
  cublasHandle_t h = handle.Get(0, &why);
  CHECK(h != nullptr ? cudaSuccess : cudaErrorUnknown);
  attnd::cuda::MlaGemmParams g;
  g.mla = mp;
  g.mla.tensor_cores = true;
  g.max_keys = K;
  const int wave = attnd::cuda::MlaGemmWaveQueries(mp.n, mp.heads, mp.latent, mp.rope, K);
  g.scratch = Alloc<uint8_t>(size_t(wave) *
                             attnd::cuda::MlaGemmQueryBytes(mp.heads, mp.latent, mp.rope, K));
  const double ms = TimeMs([&] { CHECK(attnd::cuda::LaunchMlaGemm(g, *blas, h, 0, &why)); });
  CHECK(cudaDeviceSynchronize());
  const std::vector<float> got = Download(mp.out, size_t(mp.n) * mp.heads * mp.latent);
  Report("sparse MLA decode (gemm)", shape, ms, bytes / 1e9, "GB/s", copy_bw / 1e9,
         tflops(ms) + "; " + RelL2Text(got, simt_out, "SIMT"));
  CHECK(cudaFree(g.scratch));
}

// FlashInfer's Hopper MLA over `in`'s key lists (compute capability 9.0 and a build with it):
// the server's whole path for a layer, the queries' conversion to bf16 included, with attnd's
// plan (chunks by each query's own keys) and merge. Its time in ms and its output, or a negative
// time where it does not apply. (ATTND_BENCH_NO_FLASHINFER: gpu-check's nvcc-only rebuild,
// which has no FlashInfer headers, leaves the FlashInfer rows out.)
double TimeFlashInferMla(const attnd::cuda::MlaParams& mp, attnd::cuda::FlashInferMlaPlanInput in,
                         const int32_t* key_list, std::vector<float>* out, int reps = 10) {
#ifndef ATTND_BENCH_NO_FLASHINFER
  attnd::cuda::GpuFacts g;
  if (!attnd::cuda::FlashInferMlaBuilt() || attnd::cuda::CurrentGpuFacts(&g) != cudaSuccess ||
      g.cc_major != 9 || g.cc_minor != 0)
    return -1;
  in.heads = mp.heads;
  in.multiprocessors = g.sms;
  const attnd::cuda::FlashInferMlaPlanResult plan = attnd::cuda::PlanFlashInferMla(in);
  CHECK(plan.refused.empty() ? cudaSuccess : cudaErrorInvalidValue);
  const size_t nq = size_t(mp.n) * mp.heads;
  void* q_nope = Alloc<__nv_bfloat16>(nq * mp.latent);
  void* q_pe = Alloc<__nv_bfloat16>(nq * mp.rope);
  void* part_o = Alloc<__nv_bfloat16>(size_t(plan.plan.max_partial_rows) * mp.latent);
  float* part_lse = Alloc<float>(plan.plan.max_partial_rows);
  std::vector<attnd::cuda::FlashInferMlaParams> waves;
  int most = 1;
  for (const auto& w : plan.plan.waves) most = std::max(most, w.blocks_x * w.blocks_y);
  const int32_t* zeros = Upload(std::vector<int32_t>(most, 0));
  for (const auto& w : plan.plan.waves) {
    attnd::cuda::FlashInferMlaParams f;
    f.q_nope = q_nope;
    f.q_pe = q_pe;
    f.kv = mp.kv;
    f.heads = mp.heads;
    f.sm_scale = mp.sm_scale;
    f.key_list = key_list;
    f.wave = attnd::cuda::FlashInferWaveArgs(
        w, zeros, [](const std::vector<int32_t>& v) { return Upload(v); });
    f.partial_o = part_o;
    f.partial_lse = part_lse;
    f.out = mp.out;
    waves.push_back(f);
  }
  const double ms = TimeMs(
      [&] {
        CHECK(attnd::cuda::LaunchFromF32(mp.q_latent, attnd::DType::kBF16, q_nope,
                                         int64_t(nq) * mp.latent, 0));
        CHECK(attnd::cuda::LaunchFromF32(mp.q_rope, attnd::DType::kBF16, q_pe,
                                         int64_t(nq) * mp.rope, 0));
        for (const auto& f : waves) CHECK(attnd::cuda::LaunchFlashInferMla(f, 0));
      },
      reps);
  CHECK(cudaDeviceSynchronize());
  *out = Download(mp.out, nq * mp.latent);
  return ms;
#else
  return -1;
#endif
}

// The decode row: the selection rows are the key lists.
template <typename Tflops>
void FlashInferDecodeRow(const attnd::cuda::MlaParams& mp, int K, const std::string& shape,
                         double bytes, double copy_bw, const std::vector<float>& simt_out,
                         Tflops tflops) {
#ifndef ATTND_BENCH_NO_FLASHINFER
  attnd::cuda::FlashInferMlaPlanInput in;
  in.keys.assign(mp.n, K);
  for (int q = 0; q < mp.n; ++q) in.list_start.push_back(int64_t{q} * mp.sel_stride);
  in.list_entries = int64_t{mp.n} * mp.sel_stride;
  std::vector<float> got;
  const double ms = TimeFlashInferMla(mp, in, mp.sel, &got);
  if (ms < 0) return;
  Report("sparse MLA decode (flashinfer, split-K x" +
             std::to_string(attnd::cuda::FlashInferMlaChunks(K)) + ")",
         shape, ms, bytes / 1e9, "GB/s", copy_bw / 1e9,
         tflops(ms) + "; " + RelL2Text(got, simt_out, "SIMT"));
#endif
}

// A paged cache of `seqs` sequences of `ctx` tokens, rows of `dim` bf16, shuffled pages.
struct PagedCache {
  __nv_bfloat16* data = nullptr;
  std::vector<int32_t> tables;
  int page_size = 64;
  int dim = 0;
  PagedCache(int seqs, int64_t ctx, int dim_, uint64_t seed) : dim(dim_) {
    const int64_t pages_per_seq = (ctx + page_size - 1) / page_size;
    const int64_t pages = seqs * pages_per_seq + 1;
    data = Alloc<__nv_bfloat16>(static_cast<size_t>(pages) * page_size * dim);
    RandomBf16(data, static_cast<size_t>(pages) * page_size * dim, seed);
    tables.resize(seqs * pages_per_seq);
    std::iota(tables.begin(), tables.end(), 1);
    std::shuffle(tables.begin(), tables.end(), std::mt19937_64(seed));
  }
  CacheRows view() const {
    return {reinterpret_cast<const uint8_t*>(data), size_t(dim) * 2, attnd::DType::kBF16, dim};
  }
  // Query i reads sequence seq[i] of `seqs` equal-length page tables.
  QueryTables Tables(int seqs, const std::vector<int32_t>& seq,
                     const std::vector<int64_t>& pos) const {
    std::vector<int32_t> indptr(seqs + 1);
    const int32_t per = static_cast<int32_t>(tables.size() / seqs);
    for (int i = 0; i <= seqs; ++i) indptr[i] = i * per;
    return {PageTable{Upload(indptr), Upload(tables), page_size}, Upload(seq), Upload(pos)};
  }
  // The slot of position pos of sequence s (what a selection hands attention).
  int32_t Slot(int seqs, int s, int32_t pos) const {
    const int32_t per = static_cast<int32_t>(tables.size() / seqs);
    return tables[s * per + pos / page_size] * page_size + pos % page_size;
  }
};

// An MLA launch of n queries (sequence seq[i], position pos[i]) over the cache, at DeepSeek-V3.2
// dims: random queries from `seed`, its output, and the split-K partials for `max_keys`.
attnd::cuda::MlaParams MlaOver(const PagedCache& kv, int seqs, const std::vector<int32_t>& seq,
                               const std::vector<int64_t>& pos, int64_t max_keys, uint64_t seed) {
  const int n = static_cast<int>(seq.size()), H = 128, L = 512, R = 64;
  attnd::cuda::MlaParams mp;
  float* q_latent = Alloc<float>(size_t(n) * H * L);
  float* q_rope = Alloc<float>(size_t(n) * H * R);
  RandomF32(q_latent, size_t(n) * H * L, seed);
  RandomF32(q_rope, size_t(n) * H * R, seed + 1);
  mp.q_latent = q_latent;
  mp.q_rope = q_rope;
  mp.out = Alloc<float>(size_t(n) * H * L);
  mp.n = n;
  mp.heads = H;
  mp.latent = L;
  mp.rope = R;
  mp.sm_scale = 0.135f;
  mp.kv = kv.view();
  mp.tables = kv.Tables(seqs, seq, pos);
  mp.max_keys =
      max_keys;  // the tensor-core kernels' split-K (a fixed split per query, mla_split.h)
  const int splits = attnd::cuda::MlaQuerySplits(max_keys);
  mp.part_queries = attnd::cuda::MlaPartialQueries(n, splits, H, L);
  mp.part_out = Alloc<float>(size_t(splits) * mp.part_queries * H * L);
  mp.part_ml = Alloc<float>(size_t(splits) * mp.part_queries * H * 2);
  return mp;
}

}  // namespace

int main(int argc, char** argv) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("cuda_bench: no CUDA device visible; nothing to measure\n");
    return 0;
  }
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--json=", 7) == 0) json = std::fopen(argv[i] + 7, "w");
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("GPU: %s, %d SMs, %.1f GiB\n", prop.name, prop.multiProcessorCount,
              prop.totalGlobalMem / double(1 << 30));

  // Limits measured now: D2D copy (read + write bytes) and a bf16 GEMM.
  const size_t copy_bytes = size_t{2} << 30;
  char* a = Alloc<char>(copy_bytes);
  char* b = Alloc<char>(copy_bytes);
  const double copy_ms =
      TimeMs([&] { CHECK(cudaMemcpyAsync(b, a, copy_bytes, cudaMemcpyDeviceToDevice)); });
  const double copy_bw = 2.0 * copy_bytes / (copy_ms * 1e-3);
  CHECK(cudaFree(a));
  CHECK(cudaFree(b));
  Report("copy D2D (limit)", "2 GiB", copy_ms, 2.0 * copy_bytes / 1e9, "GB/s", copy_bw / 1e9);

  const int B = 64, H = 128, L = 512, R = 64, D = L + R, Hi = 64, Di = 128, K = 2048;
  std::mt19937_64 rng(7);
  // ---- indexer scoring + exact top-k at 64K, and at 8K (the end-to-end stage's context) ----
  for (const int64_t ctx : {int64_t{65536}, int64_t{8192}}) {
    const std::string at = std::to_string(ctx / 1024) + "K";
    PagedCache idx(B, ctx, Di, 11);
    std::vector<int64_t> pos(B, ctx - 1), off(B), len(B, ctx);
    std::vector<int32_t> seq(B), queries(B), out_row(B);
    for (int i = 0; i < B; ++i) {
      off[i] = i * ctx;
      seq[i] = queries[i] = out_row[i] = i;
    }
    float* q = Alloc<float>(size_t{B} * Hi * Di);
    float* w = Alloc<float>(size_t{B} * Hi);
    RandomF32(q, size_t{B} * Hi * Di, 3);
    RandomF32(w, size_t{B} * Hi, 4);
    float* scores = Alloc<float>(size_t{B} * ctx);
    int32_t* sel = Alloc<int32_t>(size_t{B} * K);
    int32_t* cnt = Alloc<int32_t>(B);
    const QueryTables t = idx.Tables(B, seq, pos);
    attnd::cuda::IndexerParams ip;
    ip.q = q;
    ip.w = w;
    ip.heads = Hi;
    ip.dim = Di;
    ip.keys = idx.view();
    ip.tables = t;
    ip.queries = Upload(queries);
    ip.score_offset = Upload(off);
    ip.nq = B;
    ip.max_keys = ctx;
    ip.scores = scores;
    attnd::cuda::TopKParams tk;
    tk.rows.scores = scores;
    tk.rows.row_offset = ip.score_offset;
    tk.rows.row_len = Upload(len);
    tk.nq = B;
    tk.rows.Into(K, sel, K, cnt);
    tk.max_len = ctx;  // 64K keys, top-2048: slices of 16K and a merge (topk_block.h)
    const attnd::cuda::TopKSlicePlan slices =
        attnd::cuda::PlanTopKSlices(std::vector<int64_t>(B, ctx), K);
    tk.rows.slice_offset = Upload(slices.offset);
    tk.rows.cand_key = Alloc<uint32_t>(std::max<int64_t>(1, slices.total * K));
    tk.rows.cand_index = Alloc<int32_t>(std::max<int64_t>(1, slices.total * K));
    tk.rows.cand_count = Alloc<int32_t>(std::max<int64_t>(1, slices.total));
    const double ms_idx = TimeMs([&] { CHECK(attnd::cuda::LaunchIndexerScores(ip, 0)); });
    CHECK(cudaDeviceSynchronize());
    const std::vector<float> simt_scores = Download(scores, size_t{B} * ctx);
    attnd::cuda::IndexerParams ip_mma = ip;
    ip_mma.tensor_cores = true;
    const double ms_idx_mma = TimeMs([&] { CHECK(attnd::cuda::LaunchIndexerScores(ip_mma, 0)); });
    CHECK(cudaDeviceSynchronize());
    const std::vector<float> mma_scores = Download(scores, size_t{B} * ctx);
    // Top-k alone, over the tensor-core scores now in `scores`: every row against the exact
    // top-k of the same scores on the host, which the GPU must equal (no NaN, ties to the lower
    // position; random scores).
    const double ms_topk = TimeMs([&] { CHECK(attnd::cuda::LaunchTopK(tk, 0)); });
    CHECK(cudaDeviceSynchronize());
    const std::vector<int32_t> got_sel = Download(sel, size_t{B} * K);
    int rows_equal = 0;
    std::vector<int32_t> want(K);
    for (int i = 0; i < B; ++i) {
      const int64_t n = ExactTopK(mma_scores.data() + size_t(i) * ctx, ctx, K, want.data());
      rows_equal += n == K && std::equal(want.begin(), want.end(), got_sel.begin() + size_t(i) * K);
    }
    const std::string topk_check =
        std::to_string(rows_equal) + "/" + std::to_string(B) + " rows = host exact top-k";
    const double ms_both = TimeMs([&] {
      CHECK(attnd::cuda::LaunchIndexerScores(ip_mma, 0));
      CHECK(attnd::cuda::LaunchTopK(tk, 0));
    });
    // The tensor-core pipeline's selections against the SIMT scores' own top-k (the kernels sum
    // in different orders and round the query to bf16, so keys near the cut may differ).
    size_t overlap = 0;
    for (int i = 0; i < B; ++i) {
      ExactTopK(simt_scores.data() + size_t(i) * ctx, ctx, K, want.data());
      std::vector<int32_t> both;
      std::set_intersection(want.begin(), want.end(), got_sel.begin() + size_t(i) * K,
                            got_sel.begin() + size_t(i + 1) * K, std::back_inserter(both));
      overlap += both.size();
    }
    char overlap_text[96];
    std::snprintf(overlap_text, sizeof overlap_text, "%.4f of the SIMT scores' top-k",
                  double(overlap) / (double(B) * K));
    const double bytes = double(B) * ctx * Di * 2;   // the indexer keys it must read
    const double score_bytes = double(B) * ctx * 4;  // top-k reads each score once at least
    Report("indexer scores", "B=64 ctx=" + at + " Hi=64 Di=128", ms_idx, bytes / 1e9, "GB/s",
           copy_bw / 1e9);
    const std::string kind = attnd::cuda::IndexerUsesStream(ip_mma) ? "stream" : "mma";
    Report("indexer scores (" + kind + ")", "B=64 ctx=" + at + " Hi=64 Di=128", ms_idx_mma,
           bytes / 1e9, "GB/s", copy_bw / 1e9, RelL2Text(mma_scores, simt_scores, "SIMT"));
    Report("top-k", "B=64 ctx=" + at + " K=2048", ms_topk, score_bytes / 1e9, "GB/s", copy_bw / 1e9,
           topk_check);
    Report("indexer (" + kind + ") + top-k", "B=64 ctx=" + at + " K=2048", ms_both, bytes / 1e9,
           "GB/s", copy_bw / 1e9, overlap_text);
#ifndef ATTND_BENCH_NO_FLASHINFER
    if (attnd::cuda::FlashInferTopKApplies(K)) {  // FlashInfer's top-k on the same scores
      attnd::cuda::FlashInferTopKParams fk;
      fk.scores = scores;  // B rows of ctx: already the padded layout it reads
      fk.len = Upload(std::vector<int32_t>(B, static_cast<int32_t>(ctx)));
      fk.nq = B;
      fk.max_len = ctx;
      fk.k = K;
      fk.tmp_index = Alloc<int32_t>(size_t{B} * K);
      fk.tmp_value = Alloc<float>(size_t{B} * K);
      fk.out = Alloc<int32_t>(size_t{B} * K);
      fk.out_stride = K;
      fk.out_count = Alloc<int32_t>(B);
      std::vector<int32_t> identity(B);
      std::iota(identity.begin(), identity.end(), 0);
      fk.out_row = Upload(identity);
      CHECK(attnd::cuda::LaunchIndexerScores(ip_mma, 0));  // the scores the host checked
      const double ms_fi = TimeMs([&] { CHECK(attnd::cuda::LaunchFlashInferTopK(fk, 0)); });
      CHECK(cudaDeviceSynchronize());
      const std::vector<int32_t> fi_sel = Download(fk.out, size_t{B} * K);
      int fi_equal = 0;
      for (int i = 0; i < B; ++i) {
        const int64_t n = ExactTopK(mma_scores.data() + size_t(i) * ctx, ctx, K, want.data());
        fi_equal += n == K && std::equal(want.begin(), want.end(), fi_sel.begin() + size_t(i) * K);
      }
      const double ms_fi_both = TimeMs([&] {
        CHECK(attnd::cuda::LaunchIndexerScores(ip_mma, 0));
        CHECK(attnd::cuda::LaunchFlashInferTopK(fk, 0));
      });
      Report("top-k (flashinfer)", "B=64 ctx=" + at + " K=2048", ms_fi, score_bytes / 1e9, "GB/s",
             copy_bw / 1e9,
             std::to_string(fi_equal) + "/" + std::to_string(B) + " rows = host exact top-k");
      Report("indexer (" + kind + ") + top-k (flashinfer)", "B=64 ctx=" + at + " K=2048",
             ms_fi_both, bytes / 1e9, "GB/s", copy_bw / 1e9);
    }
#endif
  }
  // ---- the indexer on an fp8 cache's keys (Di e4m3 codes per row, a page's scales after its
  // rows): the streaming tensor-core kernel against the SIMT one on the same keys ----
  {
    const int64_t ctx = 65536, ps = 64, pages_per_seq = ctx / ps, npages = B * pages_per_seq + 1;
    const size_t page_bytes = size_t(ps) * (Di + 4);
    std::vector<uint8_t> host(npages * page_bytes);
    std::mt19937_64 fill(13);
    for (int64_t pg = 0; pg < npages; ++pg) {
      uint8_t* page = host.data() + pg * page_bytes;
      for (int64_t i = 0; i < ps * Di; i += 8) {
        const uint64_t r = fill();
        for (int b = 0; b < 8; ++b) {
          uint8_t c = static_cast<uint8_t>(r >> (8 * b));
          if ((c & 0x7f) == 0x7f) c ^= 1;  // no NaN codes
          page[i + b] = c;
        }
      }
      for (int64_t r = 0; r < ps; ++r) {
        const float scale = std::ldexp(1.0f, -8 + static_cast<int>(fill() % 4));
        std::memcpy(page + ps * Di + 4 * r, &scale, 4);
      }
    }
    uint8_t* cache = Upload(host);
    std::vector<int32_t> tables(B * pages_per_seq), seq(B), queries(B), indptr(B + 1);
    std::iota(tables.begin(), tables.end(), 1);
    std::shuffle(tables.begin(), tables.end(), std::mt19937_64(14));
    std::vector<int64_t> pos(B, ctx - 1), off(B);
    for (int i = 0; i <= B; ++i) indptr[i] = static_cast<int32_t>(i * pages_per_seq);
    for (int i = 0; i < B; ++i) seq[i] = queries[i] = i, off[i] = i * ctx;
    float* q = Alloc<float>(size_t{B} * Hi * Di);
    float* w = Alloc<float>(size_t{B} * Hi);
    RandomF32(q, size_t{B} * Hi * Di, 15);
    RandomF32(w, size_t{B} * Hi, 16);
    float* scores = Alloc<float>(size_t{B} * ctx);
    attnd::cuda::IndexerParams ip;
    ip.q = q;
    ip.w = w;
    ip.heads = Hi;
    ip.dim = Di;
    ip.keys = {cache, size_t(Di) + 4, attnd::DType::kFP8E4M3, Di, Di, static_cast<int32_t>(ps)};
    ip.tables = {PageTable{Upload(indptr), Upload(tables), static_cast<int32_t>(ps)}, Upload(seq),
                 Upload(pos)};
    ip.queries = Upload(queries);
    ip.score_offset = Upload(off);
    ip.nq = B;
    ip.max_keys = ctx;
    ip.scores = scores;
    const double ms_simt = TimeMs([&] { CHECK(attnd::cuda::LaunchIndexerScores(ip, 0)); });
    CHECK(cudaDeviceSynchronize());
    const std::vector<float> simt = Download(scores, size_t{B} * ctx);
    ip.tensor_cores = true;
    const double ms_stream = TimeMs([&] { CHECK(attnd::cuda::LaunchIndexerScores(ip, 0)); });
    CHECK(cudaDeviceSynchronize());
    const std::vector<float> stream = Download(scores, size_t{B} * ctx);
    const double bytes = double(B) * ctx * (Di + 4);  // codes and scales
    Report("indexer scores, fp8 keys", "B=64 ctx=64K Hi=64 Di=128", ms_simt, bytes / 1e9, "GB/s",
           copy_bw / 1e9);
    Report(std::string("indexer scores, fp8 keys (") +
               (attnd::cuda::IndexerUsesStream(ip) ? "stream" : "SIMT") + ")",
           "B=64 ctx=64K Hi=64 Di=128", ms_stream, bytes / 1e9, "GB/s", copy_bw / 1e9,
           RelL2Text(stream, simt, "SIMT"));
    CHECK(cudaFree(cache));
    CHECK(cudaFree(scores));
  }
  // ---- sparse MLA decode over a top-k selection ----
  for (int64_t ctx : {int64_t{8192}, int64_t{65536}}) {
    PagedCache kv(B, ctx, D, 21);
    std::vector<int64_t> pos(B, ctx - 1);
    std::vector<int32_t> seq(B), sel(size_t{B} * K), cnt(B, K);
    std::vector<int32_t> all(ctx);
    std::iota(all.begin(), all.end(), 0);
    for (int i = 0; i < B; ++i) {
      seq[i] = i;
      std::shuffle(all.begin(), all.end(), rng);
      std::vector<int32_t> pick(all.begin(), all.begin() + K);
      std::sort(pick.begin(), pick.end());
      for (int j = 0; j < K; ++j) sel[static_cast<size_t>(i) * K + j] = kv.Slot(B, i, pick[j]);
    }
    attnd::cuda::MlaParams mp = MlaOver(kv, B, seq, pos, K, 5);
    float* out = mp.out;
    const int splits = attnd::cuda::MlaQuerySplits(K);
    mp.sel = Upload(sel);
    mp.sel_count = Upload(cnt);
    mp.sel_stride = K;
    const double bytes = double(B) * K * D * 2;            // the selected latent rows
    const double flops = double(B) * H * K * (D + L) * 2;  // Q K^T and P V
    const std::string shape = "B=64 H=128 K=2048 ctx=" + std::to_string(ctx / 1024) + "K";
    auto tflops = [&](double ms) {
      char buf[48];
      std::snprintf(buf, sizeof buf, "%.1f TFLOP/s", flops / (ms * 1e-3) / 1e12);
      return std::string(buf);
    };
    std::vector<float> simt_out;
    // SIMT; the pipelined tensor-core kernel (64 heads a block, cp.async ring); the
    // tile-per-block tensor-core kernel it replaces (64 heads a block); the pipelined kernel's
    // wgmma form and that form's warp-specialised variant (sm_90a; on other GPUs these rows
    // repeat the pipelined one, labelled so).
    attnd::cuda::MlaWgmmaSelfCheck();  // the wgmma rows need it passed (prints its verdict)
    for (int variant : {0, 1, 2, 3, 4}) {
      mp.tensor_cores = variant > 0;
      mp.pipeline = variant == 1 || variant >= 3;
      mp.wgmma = variant >= 3;
      mp.wgmma_ws = variant == 4;
      const double ms = TimeMs([&] { CHECK(attnd::cuda::LaunchMla(mp, 0)); });
      CHECK(cudaDeviceSynchronize());
      const std::vector<float> got = Download(out, size_t{B} * H * L);
      if (variant == 0) simt_out = got;
      const bool wg = attnd::cuda::MlaUsesWgmma(mp);
      const std::string kind = variant == 0                       ? ""
                               : wg && mp.wgmma_ws                ? "wgmma-ws"
                               : wg                               ? "wgmma"
                               : attnd::cuda::MlaUsesPipeline(mp) ? "pipe"
                                                                  : "mma";
      Report(variant ? "sparse MLA decode (" + kind + ", split-K x" + std::to_string(splits) + ")"
                     : "sparse MLA decode",
             shape, ms, bytes / 1e9, "GB/s", copy_bw / 1e9,
             tflops(ms) + (variant ? "; " + RelL2Text(got, simt_out, "SIMT") : ""));
    }
    mp.pipeline = true;
    mp.wgmma = mp.wgmma_ws = false;
    FlashInferDecodeRow(mp, K, shape, bytes, copy_bw, simt_out, tflops);
    GemmDecodeRow(mp, K, shape, bytes, copy_bw, simt_out, tflops);
    {  // the tensor-core kernel with 16 heads per block: each key read 8 times, not 2
      attnd::cuda::MlaParams h16 = mp;
      h16.tensor_cores = true;
      h16.heads_per_block = 16;
      const double ms = TimeMs([&] { CHECK(attnd::cuda::LaunchMla(h16, 0)); });
      CHECK(cudaDeviceSynchronize());
      Report("sparse MLA decode (mma, 16 heads/block)", shape, ms, bytes / 1e9, "GB/s",
             copy_bw / 1e9,
             tflops(ms) + "; " + RelL2Text(Download(out, size_t{B} * H * L), simt_out, "SIMT"));
    }
    // A small batch (4 queries): the same split per query (the batch does not choose it).
    {
      attnd::cuda::MlaParams small = mp;
      small.n = 4;
      small.tensor_cores = true;
      const double small_bytes = 4.0 * K * D * 2;
      const std::string small_shape = "B=4 H=128 K=2048 ctx=" + std::to_string(ctx / 1024) + "K";
      const double ms = TimeMs([&] { CHECK(attnd::cuda::LaunchMla(small, 0)); });
      Report("sparse MLA decode (mma, split-K x" + std::to_string(splits) + ")", small_shape, ms,
             small_bytes / 1e9, "GB/s", copy_bw / 1e9);
    }
    CHECK(cudaFree(mp.part_out));
    CHECK(cudaFree(mp.part_ml));
    CHECK(cudaFree(kv.data));
  }
  // ---- a 4K-token prefill layer: dense causal MLA, 128 heads ----
  {
    const int64_t T = 4096;
    PagedCache kv(1, T, D, 31);
    std::vector<int64_t> pos(T);
    std::iota(pos.begin(), pos.end(), 0);
    std::vector<int32_t> seq(T, 0);
    attnd::cuda::MlaParams mp = MlaOver(kv, 1, seq, pos, T, 8);
    float* out = mp.out;
    const double flops = double(T) * (T + 1) / 2 * H * (D + L) * 2;
    std::vector<float> simt_prefill;
    for (bool tc : {false, true}) {
      mp.tensor_cores = tc;
      const double ms = TimeMs([&] { CHECK(attnd::cuda::LaunchMla(mp, 0)); }, 3);
      // The fraction of the bf16 matmul rate is filled in by bench/gpu_report.py.
      Report(tc ? "prefill MLA (mma)" : "prefill MLA (dense causal)", "T=4096 H=128", ms,
             flops / 1e12, "TFLOP/s", 0);
      if (!tc) simt_prefill = Download(out, size_t{T} * H * L);
    }
#ifndef ATTND_BENCH_NO_FLASHINFER
    {  // FlashInfer's: each token a prefix of the sequence's one key list
      attnd::cuda::FlashInferMlaPlanInput in;
      for (int64_t t = 0; t < T; ++t) {
        in.keys.push_back(t + 1);
        in.list_start.push_back(0);
      }
      in.list_entries = T;
      std::vector<int32_t> slots(T);
      for (int64_t t = 0; t < T; ++t) slots[t] = static_cast<int32_t>(kv.Slot(1, 0, t));
      std::vector<float> got;
      const double ms = TimeFlashInferMla(mp, in, Upload(slots), &got, 3);
      if (ms >= 0)
        Report("prefill MLA (flashinfer)", "T=4096 H=128", ms, flops / 1e12, "TFLOP/s", 0,
               RelL2Text(got, simt_prefill, "SIMT"));
    }
#endif
  }
  std::printf("\n%-28s %-28s %10s %12s %8s  %s\n", "op", "shape", "time", "rate", "of limit",
              "check");
  for (const Row& r : rows)
    std::printf("%-28s %-28s %8.3fms %8.1f %-7s %7.1f%%  %s\n", r.op.c_str(), r.shape.c_str(), r.ms,
                r.rate, r.unit, 100 * r.frac, r.check.c_str());
  if (json) std::fclose(json);
  return 0;
}
