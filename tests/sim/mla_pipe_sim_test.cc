// The pipelined tensor-core MLA (kernels/cuda/ops/mla_pipe.h), its wgmma twin (mla_wgmma.h) and
// that one's warp-specialised form (mla_wgmma_ws.h) run on the CPU by the fiber simulation
// (tests/sim/simt_sim.h): the kernel's own code on every thread, cp.async landing only when
// waited for, mma.sync, wgmma and shuffles from the lanes' registers and shared memory. Outputs and
// log-sum-exps against float64 on what the kernel sees (queries rounded to bf16, fp8 rows
// dequantised), over selections and ranges, one split and several (merged as MlaCombineKernel
// merges them), bf16 and fp8 rows, 2 to 4 stages, 64 and 128 heads; every output written exactly
// once; every barrier (and mbarrier wait and arrive) the kernel passes is needed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "common/dtype.h"
#include "common/fp8.h"
#include "common/model_spec.h"
#include "kernels/cuda/experimental/mla_wgmma.h"
#include "kernels/cuda/experimental/mla_wgmma_ws.h"
#include "kernels/cuda/experimental/wgmma_probe.h"
#include "kernels/cuda/ops/mla_pipe.h"
#include "kernels/cuda/ops/mma_fragments.h"
#include "kernels/reference/reference.h"
#include "tests/sim/sim_mutation.h"
#include "tests/sim/simt_sim.h"

namespace attnd::cuda {
namespace {

// Which kernel a Problem runs.
enum class Kernel { kPipe, kWgmma, kWgmmaWs };

struct Case {
  int heads = 64, latent = 512, rope = 64;
  bool fp8 = false;
  int stages = 3;
  std::vector<int64_t> counts;  // each query's selection size; 0: a range (its position + 1)
  int64_t history = 3000;       // keys in the sequence
  float soft_cap = 0;
};

struct Problem {
  Case c;
  int D = 0;
  size_t row = 0;
  std::vector<uint8_t> cache;
  std::vector<int32_t> indptr, pages, seq, sel, sel_count;
  std::vector<uint8_t> needs_index;
  std::vector<int64_t> pos;
  std::vector<float> q_latent, q_rope, out, lse, part_out, part_ml;
  std::vector<double> kv;                  // [history, D] dequantised
  std::vector<std::vector<int32_t>> keys;  // each query's attended positions
  int64_t stride = 1;
  int splits = 1, part_queries = 0;
  Kernel kernel = Kernel::kPipe;
  MlaPipeParams p;

  explicit Problem(Case cs, uint64_t seed, Kernel k = Kernel::kPipe) : c(std::move(cs)), kernel(k) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> n01(0, 1);
    const int L = c.latent, R = c.rope, H = c.heads, ps = 64;
    D = L + R;
    row = c.fp8 ? fp8::LatentTokenBytes(L, R) : size_t(D) * 2;
    const int64_t np = (c.history + ps - 1) / ps;
    pages.resize(np);
    std::iota(pages.begin(), pages.end(), 1);
    std::shuffle(pages.begin(), pages.end(), rng);
    indptr = {0, static_cast<int32_t>(np)};
    cache.assign((np + 1) * ps * row, 0);
    kv.resize(c.history * D);
    std::vector<float> x(D), back(D);
    auto slot_of = [&](int64_t s) { return int64_t{pages[s / ps]} * ps + s % ps; };
    for (int64_t s = 0; s < c.history; ++s) {
      for (float& v : x) v = n01(rng);
      uint8_t* r = cache.data() + slot_of(s) * row;
      if (c.fp8) {
        fp8::PackLatentToken(L, R, x.data(), x.data() + L, r);
        fp8::UnpackLatentToken(L, R, r, back.data());
        for (int d = 0; d < D; ++d) kv[s * D + d] = back[d];
      } else {
        for (int d = 0; d < D; ++d) {
          const uint16_t b = F32ToBF16(x[d]);
          std::memcpy(r + 2 * d, &b, 2);
          kv[s * D + d] = BF16ToF32(b);
        }
      }
    }
    const int n = static_cast<int>(c.counts.size());
    stride = std::max<int64_t>(1, *std::max_element(c.counts.begin(), c.counts.end()));
    sel.assign(n * stride, 0);
    sel_count.assign(n, 0);
    needs_index.assign(n, 0);
    seq.assign(n, 0);
    pos.resize(n);
    int64_t longest = 1;
    for (int i = 0; i < n; ++i) {
      pos[i] = c.history - 1 - i;
      std::vector<int32_t> k;
      if (c.counts[i] == 0) {
        k.resize(pos[i] + 1);
        std::iota(k.begin(), k.end(), 0);
      } else {
        std::vector<int32_t> all(pos[i] + 1);
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng);
        k.assign(all.begin(), all.begin() + c.counts[i]);
        std::sort(k.begin(), k.end());
        needs_index[i] = 1;
        sel_count[i] = static_cast<int32_t>(k.size());
        for (size_t j = 0; j < k.size(); ++j)
          sel[i * stride + j] = static_cast<int32_t>(slot_of(k[j]));
      }
      longest = std::max<int64_t>(longest, k.size());
      keys.push_back(std::move(k));
    }
    q_latent.resize(size_t(n) * H * L);
    q_rope.resize(size_t(n) * H * R);
    for (float& v : q_latent) v = n01(rng);
    for (float& v : q_rope) v = n01(rng);
    out.assign(size_t(n) * H * L, NAN);
    lse.assign(size_t(n) * H, NAN);
    splits = MlaQuerySplits(longest);
    part_queries = n;
    part_out.assign(std::max<size_t>(1, size_t(splits) * n * H * L), NAN);
    part_ml.assign(std::max<size_t>(1, size_t(splits) * n * H * 2), NAN);
    p.q_latent = q_latent.data();
    p.q_rope = q_rope.data();
    p.heads = H;
    p.latent = L;
    p.rope = R;
    p.sm_scale = 1.0f / std::sqrt(float(D));
    p.soft_cap = c.soft_cap;
    p.kv.base = cache.data();
    p.kv.row_bytes = row;
    p.kv.dtype = c.fp8 ? DType::kFP8E4M3 : DType::kBF16;
    p.kv.dim = D;
    p.kv.fp8_dim = c.fp8 ? L : 0;
    p.tables = {{indptr.data(), pages.data(), ps}, seq.data(), pos.data()};
    p.sel = sel.data();
    p.sel_count = sel_count.data();
    p.needs_index = needs_index.data();
    p.sel_stride = stride;
    p.out = out.data();
    p.lse = lse.data();
    p.part_out = part_out.data();
    p.part_ml = part_ml.data();
    p.part_queries = part_queries;
    p.stages = c.stages;
  }

  sim::SimtMemory Memory() {
    sim::SimtMemory m;
    m.Input(q_latent.data(), q_latent.size() * 4, "q_latent");
    m.Input(q_rope.data(), q_rope.size() * 4, "q_rope");
    m.Input(cache.data(), cache.size(), "cache");
    m.Input(indptr.data(), indptr.size() * 4, "indptr");
    m.Input(pages.data(), pages.size() * 4, "pages");
    m.Input(seq.data(), seq.size() * 4, "seq");
    m.Input(pos.data(), pos.size() * 8, "pos");
    m.Input(sel.data(), sel.size() * 4, "sel");
    m.Input(sel_count.data(), sel_count.size() * 4, "sel_count");
    m.Input(needs_index.data(), needs_index.size(), "needs_index");
    m.Output(out.data(), out.size() * 4, "out");
    m.Output(lse.data(), lse.size() * 4, "lse");
    m.Output(part_out.data(), part_out.size() * 4, "part_out");
    m.Output(part_ml.data(), part_ml.size() * 4, "part_ml");
    return m;
  }

  template <typename Wrap>
  void Run(sim::SimtMemory& m) {
    const int n = static_cast<int>(c.counts.size());
    const uint32_t smem =
        kernel == Kernel::kWgmmaWs ? MlaWgmmaWsSmem::Of(c.latent, c.rope, c.fp8, c.stages).bytes
        : kernel == Kernel::kWgmma ? MlaWgmmaSmem::Of(c.latent, c.rope, c.fp8, c.stages).bytes
                                   : MlaPipeSmem::Of(c.latent, c.rope, c.fp8, c.stages).bytes;
    const int threads = kernel == Kernel::kWgmmaWs ? kWsThreads
                        : kernel == Kernel::kWgmma ? kWgThreads
                                                   : kPipeThreads;
    for (int qx = 0; qx < n; ++qx)
      for (int hy = 0; hy < c.heads / kPipeHeads; ++hy)
        for (int z = 0; z < splits; ++z) {
          sim::SimtBlock b(m, threads, smem);
          b.Run([&](sim::SimtThread& t) {
            Wrap g(t);
            if (kernel == Kernel::kWgmmaWs) {
              if (c.fp8) {
                MlaWgmmaWsBlock<true>(g, p, qx, hy, z);
              } else {
                MlaWgmmaWsBlock<false>(g, p, qx, hy, z);
              }
            } else if (kernel == Kernel::kWgmma) {
              if (c.fp8) {
                MlaWgmmaBlock<true>(g, p, qx, hy, z);
              } else {
                MlaWgmmaBlock<false>(g, p, qx, hy, z);
              }
            } else if (c.fp8) {
              MlaPipeBlock<true>(g, p, qx, hy, z);
            } else {
              MlaPipeBlock<false>(g, p, qx, hy, z);
            }
          });
        }
  }

  // The outputs as the kernels leave them: one split's own, or MlaCombineKernel's merge.
  std::vector<float> Merged(int qi, std::vector<float>* lse_out) const {
    const int H = c.heads, L = c.latent;
    const int own = MlaQuerySplits(static_cast<int64_t>(keys[qi].size()));
    std::vector<float> o(size_t(H) * L);
    lse_out->assign(H, 0);
    for (int h = 0; h < H; ++h) {
      if (own == 1) {
        std::copy_n(out.begin() + (size_t(qi) * H + h) * L, L, o.begin() + size_t(h) * L);
        (*lse_out)[h] = lse[size_t(qi) * H + h];
        continue;
      }
      auto ml = [&](int z, int e) {
        return part_ml[((size_t(z) * part_queries + qi) * H + h) * 2 + e];
      };
      float M = -INFINITY, denom = 0;
      for (int z = 0; z < own; ++z) M = std::max(M, ml(z, 0));
      for (int z = 0; z < own; ++z)
        if (ml(z, 0) != -INFINITY) denom += std::exp(ml(z, 0) - M) * ml(z, 1);
      for (int d = 0; d < L; ++d) {
        float v = 0;
        for (int z = 0; z < own; ++z)
          if (ml(z, 0) != -INFINITY)
            v += std::exp(ml(z, 0) - M) *
                 part_out[((size_t(z) * part_queries + qi) * H + h) * L + d];
        o[size_t(h) * L + d] = v / denom;
      }
      (*lse_out)[h] = M + std::log(denom);
    }
    return o;
  }

  void Expect() const {
    const int H = c.heads, L = c.latent;
    ModelSpec spec;
    spec.num_heads = H;
    spec.kv_lora_rank = L;
    spec.qk_rope_head_dim = c.rope;
    spec.sm_scale = p.sm_scale;
    for (size_t qi = 0; qi < keys.size(); ++qi) {
      std::vector<double> qd(size_t(H) * D);
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d)
          qd[h * D + d] = BF16ToF32(F32ToBF16(d < L ? q_latent[(qi * H + h) * L + d]
                                                    : q_rope[(qi * H + h) * c.rope + d - L]));
      std::vector<double> ref(size_t(H) * L), ref_lse(H);
      reference::Attend(spec, qd.data(), kv.data(), keys[qi], c.soft_cap, ref.data(),
                        ref_lse.data());
      std::vector<float> got_lse;
      const std::vector<float> got = Merged(static_cast<int>(qi), &got_lse);
      double num = 0, den = 0;
      for (size_t i = 0; i < ref.size(); ++i) {
        ASSERT_FALSE(std::isnan(got[i])) << "query " << qi << " element " << i;
        num += (got[i] - ref[i]) * (got[i] - ref[i]);
        den += ref[i] * ref[i];
      }
      EXPECT_LE(std::sqrt(num / den), 1e-2) << "query " << qi;  // bf16 P, as on the GPU
      for (int h = 0; h < H; ++h)
        EXPECT_NEAR(got_lse[h], ref_lse[h], 2e-3 * (1 + std::abs(ref_lse[h]))) << qi << " " << h;
    }
  }
};

// The wgmma kernels and the mma.sync one round the same S to the same bf16 P; the simulation
// executes wgmma by the m16n8k16 model in the same k order, so here they agree to the bit (on the
// GPU the order of fp32 sums may differ: cuda_scale_test allows 2e-3).
constexpr double kWgmmaVsMma = 1e-6;

// The parameter: a shape, and the kernel that runs it.
class MlaPipeSim : public ::testing::TestWithParam<std::tuple<Case, Kernel>> {};

TEST_P(MlaPipeSim, OutputsMatchFloat64AndEachIsWrittenOnce) {
  Problem pr(std::get<0>(GetParam()), 11, std::get<1>(GetParam()));
  sim::SimtMemory m = pr.Memory();
  ASSERT_NO_THROW(pr.Run<sim::SimtThread>(m));
  pr.Expect();
  if (pr.kernel != Kernel::kPipe) {  // and the mma.sync kernel's outputs, much closer
    Problem mma(std::get<0>(GetParam()), 11, Kernel::kPipe);
    sim::SimtMemory m2 = mma.Memory();
    ASSERT_NO_THROW(mma.Run<sim::SimtThread>(m2));
    for (size_t qi = 0; qi < pr.keys.size(); ++qi) {
      std::vector<float> l1, l2;
      const std::vector<float> a = pr.Merged(static_cast<int>(qi), &l1);
      const std::vector<float> b = mma.Merged(static_cast<int>(qi), &l2);
      double num = 0, den = 0;
      for (size_t i = 0; i < a.size(); ++i)
        num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]), den += double(b[i]) * b[i];
      std::printf("wgmma vs mma.sync, query %zu: rel L2 %.2e\n", qi, std::sqrt(num / den));
      EXPECT_LE(std::sqrt(num / den), kWgmmaVsMma) << "query " << qi;
    }
  }
  // Each query's outputs come from exactly one place: its own block (one split) or its splits'
  // partials, never both; nothing written twice.
  const int H = pr.c.heads, L = pr.c.latent;
  for (const char* name : {"out", "lse", "part_out", "part_ml"})
    for (int w : m.Writes(name)) ASSERT_LE(w, 1) << name;
  for (size_t qi = 0; qi < pr.keys.size(); ++qi) {
    const bool split = MlaQuerySplits(static_cast<int64_t>(pr.keys[qi].size())) > 1;
    const auto& out = m.Writes("out");
    for (size_t b = qi * H * L * 4; b < (qi + 1) * H * L * 4; ++b)
      ASSERT_EQ(out[b], split ? 0 : 1) << "query " << qi;
  }
}

// DeepSeek-V3.2 rows (512 + 64) and heads: top-2048 selections (4 splits), a short selection (one
// split of one partial tile), a range of 3000 keys (6 splits) and one of 70 keys; fp8 rows; two
// stages; 128 heads (two head groups); a soft cap on a smaller latent; latents of 2 and 3
// n-tiles a warp (the unrolled accumulator loops skip the rest).
INSTANTIATE_TEST_SUITE_P(
    Shapes, MlaPipeSim,
    ::testing::Combine(::testing::Values(Case{64, 512, 64, false, 3, {2048, 13}},
                                         Case{64, 512, 64, true, 3, {2048, 100}},
                                         Case{64, 512, 64, false, 2, {0}, 3000},
                                         Case{128, 512, 64, false, 3, {300}, 1000},
                                         Case{64, 128, 64, false, 3, {0}, 70, 2.5f},
                                         Case{64, 512, 64, true, 2, {0}, 33},
                                         Case{64, 192, 64, false, 3, {150, 40}, 400}),
                       ::testing::Values(Kernel::kPipe)));
// The wgmma kernel takes L 512, R 64 only: the DeepSeek shapes above, and a soft cap.
INSTANTIATE_TEST_SUITE_P(
    Wgmma, MlaPipeSim,
    ::testing::Combine(::testing::Values(Case{64, 512, 64, false, 3, {2048, 13}},
                                         Case{64, 512, 64, true, 3, {2048, 100}},
                                         Case{64, 512, 64, false, 2, {0}, 3000},
                                         Case{128, 512, 64, false, 3, {300}, 1000},
                                         Case{64, 512, 64, false, 3, {0}, 70, 2.5f},
                                         Case{64, 512, 64, true, 2, {0}, 33}),
                       ::testing::Values(Kernel::kWgmma)));
// Its warp-specialised form: the same shapes but the long range (two stages are the fp8 range's
// here and MlaWgmmaWsSim's), and four stages, the deepest ring that fits (bf16 and fp8 rows); a
// 13-key query has fewer tiles than stages.
INSTANTIATE_TEST_SUITE_P(
    WgmmaWs, MlaPipeSim,
    ::testing::Combine(::testing::Values(Case{64, 512, 64, false, 3, {2048, 13}},
                                         Case{64, 512, 64, true, 3, {2048, 100}},
                                         Case{128, 512, 64, false, 3, {300}, 1000},
                                         Case{64, 512, 64, false, 3, {0}, 70, 2.5f},
                                         Case{64, 512, 64, true, 2, {0}, 33},
                                         Case{64, 512, 64, false, 4, {700}, 900},
                                         Case{64, 512, 64, true, 4, {0}, 300}),
                       ::testing::Values(Kernel::kWgmmaWs)));

// Skips one barrier (or, with count_fences, one fence: wgmma.fence or fence.proxy.async) by its
// index in the thread's order.
template <typename T>
struct SkipOneBarrier : sim::ForwardingThread<T> {
  static inline int skip = -1;
  static inline bool count_fences = false;
  static inline int seen_barriers = 0, seen_fences = 0;  // the most any thread passed
  int count = 0, fences = 0;
  explicit SkipOneBarrier(T& inner) : sim::ForwardingThread<T>(inner) {}
  ~SkipOneBarrier() {
    seen_barriers = std::max(seen_barriers, count);
    seen_fences = std::max(seen_fences, fences);
  }
  // Whether to drop this barrier (or fence), counting it.
  bool Drop(bool fence) {
    int& n = fence ? fences : count;
    const bool at_skip = n++ == skip;
    return count_fences == fence && at_skip;
  }
  void Sync() {
    if (!Drop(false)) this->t.Sync();
  }
  void WgmmaFence() {
    if (!Drop(true)) this->t.WgmmaFence();
  }
  void FenceProxyAsync() {
    if (!Drop(true)) this->t.FenceProxyAsync();
  }
};

TEST(MlaPipeSim, EveryBarrierIsNeeded) {
  for (bool fp8 : {false, true}) {
    const Case c{64, 512, 64, fp8, 3, {100}};  // 4 tiles of 32 keys, one split
    Problem pr(c, 5);
    sim::SimtMemory m = pr.Memory();
    SkipOneBarrier<sim::SimtThread>::skip = -1;
    SkipOneBarrier<sim::SimtThread>::seen_barriers = 0;
    ASSERT_NO_THROW(pr.Run<SkipOneBarrier<sim::SimtThread>>(m));
    const std::vector<float> want = pr.out;
    const int barriers = (fp8 ? 4 : 3) * 4;  // per tile: copies, (decode), S, softmax
    ASSERT_EQ(SkipOneBarrier<sim::SimtThread>::seen_barriers, barriers) << "every one tried";
    for (int skip = 0; skip < barriers; ++skip) {
      Problem again(c, 5);
      sim::SimtMemory m2 = again.Memory();
      SkipOneBarrier<sim::SimtThread>::skip = skip;
      EXPECT_TRUE(testing::RefusedOrChanged([&] {
        again.Run<SkipOneBarrier<sim::SimtThread>>(m2);
        return std::memcmp(again.out.data(), want.data(), want.size() * 4) != 0;
      })) << (fp8 ? "fp8" : "bf16")
          << ": barrier " << skip << " is not needed";
    }
    SkipOneBarrier<sim::SimtThread>::skip = -1;
  }
}

// The wgmma kernel: removing any one barrier, wgmma.fence or fence.proxy.async is caught (an
// error of the simulation, or other outputs).
TEST(MlaWgmmaSim, EveryBarrierAndFenceIsNeeded) {
  using Skip = SkipOneBarrier<sim::SimtThread>;
  for (bool fp8 : {false, true}) {
    const Case c{64, 512, 64, fp8, 3, {100}};  // 4 tiles of 32 keys, one split
    Problem pr(c, 5, Kernel::kWgmma);
    sim::SimtMemory m = pr.Memory();
    Skip::skip = -1;
    Skip::seen_barriers = Skip::seen_fences = 0;
    ASSERT_NO_THROW(pr.Run<Skip>(m));
    const std::vector<float> want = pr.out;
    // Per tile: barriers: copies (and decode); fences: proxy (after the copies land, or fp8:
    // after the decode), wgmma.fence before S and before P V. Every one is tried.
    ASSERT_EQ(Skip::seen_barriers, (fp8 ? 2 : 1) * 4);
    ASSERT_EQ(Skip::seen_fences, 3 * 4);
    for (const bool fences : {false, true}) {
      const int count = fences ? 3 * 4 : (fp8 ? 2 : 1) * 4;
      Skip::count_fences = fences;
      for (int skip = 0; skip < count; ++skip) {
        Problem again(c, 5, Kernel::kWgmma);
        sim::SimtMemory m2 = again.Memory();
        Skip::skip = skip;
        EXPECT_TRUE(testing::RefusedOrChanged([&] {
          again.Run<Skip>(m2);
          return std::memcmp(again.out.data(), want.data(), want.size() * 4) != 0;
        })) << (fp8 ? "fp8" : "bf16")
            << ": " << (fences ? "fence " : "barrier ") << skip << " is not needed";
      }
    }
    Skip::skip = -1;
    Skip::count_fences = false;
  }
}

// Skips one mbarrier wait, mbarrier arrive, named barrier or fence.proxy.async (`kind`) of the
// producer's or the consumers' (`producer`), by its index in the thread's order; or makes one
// cp.async wait of the producer's wait for one group fewer (kCpWait).
template <typename T>
struct SkipOneHandOff : sim::ForwardingThread<T> {
  enum Kind { kWait, kArrive, kNamed, kProxyFence, kCpWait, kKinds };
  static inline int kind = kWait, skip = -1;
  static inline bool producer = false;
  static inline int seen[2][kKinds] = {};  // [producer][kind]: thread 0's and the producer's 0's
  // Clears the choice (and the counts) when made and when it goes, a failed test included.
  struct Choice {
    Choice(bool p, int k, int s) { producer = p, kind = k, skip = s; }
    ~Choice() { producer = false, kind = kWait, skip = -1; }
  };
  int count[kKinds] = {};
  explicit SkipOneHandOff(T& inner) : sim::ForwardingThread<T>(inner) {}
  bool Skip(int k) {
    const bool prod = this->tid() >= kWgThreads;
    if (this->tid() == 0 || this->tid() == kWgThreads) ++seen[prod][k];
    return prod == producer && k == kind && count[k]++ == skip;
  }
  void MbarWait(uint32_t off, int parity) {
    if (!Skip(kWait)) this->t.MbarWait(off, parity);
  }
  void MbarArrive(uint32_t off) {
    if (!Skip(kArrive)) this->t.MbarArrive(off);
  }
  void NamedSync(int id, int n) {
    if (!Skip(kNamed)) this->t.NamedSync(id, n);
  }
  void FenceProxyAsync() {
    if (!Skip(kProxyFence)) this->t.FenceProxyAsync();
  }
  void CpWait(int n) { this->t.CpWait(Skip(kCpWait) ? n + 1 : n); }
};

// The errors a missing hand-over may cause: a race, an operand not ordered or not fenced, a copy
// read before it landed (or a stage before its first copy), a deadlock, a phase confused by
// parity.
bool IsSyncError(const std::string& e) {
  for (const char* what : {"no barrier", "race", "another thread read", "not waited for",
                           "block stuck", "parity aliasing", "without fence.proxy.async",
                           "in flight", "a wgmma of thread", "never written", "never-written"})
    if (e.find(what) != std::string::npos) return true;
  return false;
}

// The warp-specialised wgmma kernel: every mbarrier wait and arrive, named barrier, proxy fence
// and cp.async wait of the producer and of the consumers is needed: each removed (or, a wait,
// made one group short) in turn is caught — by one of the simulation's sync errors, or by other
// outputs or log-sum-exps. Two stages (the producer lands everything before it waits) and four
// (it keeps two tiles in flight).
TEST(MlaWgmmaWsSim, EveryWaitArriveAndFenceIsNeeded) {
  using Skip = SkipOneHandOff<sim::SimtThread>;
  struct Ring {
    bool fp8;
    int stages, tiles;
  };
  for (const Ring r : {Ring{false, 2, 5}, Ring{true, 2, 5}, Ring{false, 4, 7}}) {
    const Case c{64, 512, 64, r.fp8, r.stages, {32 * r.tiles - 10}};  // one split
    const std::string at =
        std::string(r.fp8 ? "fp8" : "bf16") + ", " + std::to_string(r.stages) + " stages: ";
    Problem pr(c, 5, Kernel::kWgmmaWs);
    sim::SimtMemory m = pr.Memory();
    std::memset(Skip::seen, 0, sizeof(Skip::seen));
    ASSERT_NO_THROW(pr.Run<Skip>(m));
    pr.Expect();  // the run the mutations are compared with is right
    const std::vector<float> want = pr.out, want_lse = pr.lse;
    // Consumers: a full wait a tile, an empty arrive for each stage the producer refills; the
    // query's fence and named barrier (bf16) or the decode's a tile (fp8). Producer: an empty
    // wait for each tile past the ring, a full arrive, a cp.async wait and (bf16) a fence a tile.
    const int t = r.tiles, refills = r.tiles - r.stages;
    const int per[2][Skip::kKinds] = {{t, refills, r.fp8 ? t : 1, r.fp8 ? t : 1, 0},
                                      {refills, t, 0, r.fp8 ? 0 : t, t}};
    for (int who = 0; who < 2; ++who)
      for (int k = 0; k < Skip::kKinds; ++k)
        ASSERT_EQ(Skip::seen[who][k], per[who][k]) << at << who << " " << k;
    for (int who = 0; who < 2; ++who)
      for (int k = 0; k < Skip::kKinds; ++k)
        for (int skip = 0; skip < per[who][k]; ++skip) {
          Problem again(c, 5, Kernel::kWgmmaWs);
          sim::SimtMemory m2 = again.Memory();
          const typename Skip::Choice choice(who == 1, k, skip);
          std::string error;
          try {
            again.Run<Skip>(m2);
          } catch (const std::runtime_error& e) {
            error = e.what();
          }
          const bool caught =
              error.empty()
                  ? std::memcmp(again.out.data(), want.data(), want.size() * 4) != 0 ||
                        std::memcmp(again.lse.data(), want_lse.data(), want_lse.size() * 4) != 0
                  : IsSyncError(error);
          EXPECT_TRUE(caught) << at << (who ? "producer" : "consumers") << " kind " << k << " #"
                              << skip << (error.empty() ? ": not needed" : ": " + error);
        }
  }
}

// One misuse of wgmma injected into a body: the thread interface with one rule broken, and the
// error the simulation must name for it.
enum class Misuse {
  kNone,
  kNoFence,            // wgmma.fence dropped
  kRegsAfterFence,     // an accumulator written between the fence and the wgmma
  kNoProxyFence,       // one thread's fence.proxy.async dropped
  kProxyFenceLate,     // ...or moved after the barrier
  kNoBarrier,          // the barrier between the operand stores and the wgmma dropped
  kWriteInFlight,      // an operand overwritten before the wait
  kARegsInFlight,      // A's registers changed before the wait
  kAccInFlight,        // accumulators changed before the wait
  kNoWait,             // wgmma.wait_group dropped
  kSwizzle,            // a descriptor with a swizzle mode
  kDivergentOperands,  // one thread names another A
};
const char* MisuseError(Misuse m) {
  switch (m) {
    case Misuse::kNoFence:
      return "without wgmma.fence";
    case Misuse::kRegsAfterFence:
      return "written after wgmma.fence";
    case Misuse::kNoProxyFence:
    case Misuse::kProxyFenceLate:
      return "without fence.proxy.async";
    case Misuse::kNoBarrier:
      return "no barrier before the wgmma";
    case Misuse::kWriteInFlight:
      return "operand of a wgmma in flight";
    case Misuse::kARegsInFlight:
      return "A's registers changed";
    case Misuse::kAccInFlight:
      return "accumulators changed";
    case Misuse::kNoWait:
      return "not waited for";
    case Misuse::kSwizzle:
      return "swizzle";
    case Misuse::kDivergentOperands:
      return "different wgmma instructions or operands";
    case Misuse::kNone:
      break;
  }
  return "";
}
template <typename T>
struct Misusing : sim::ForwardingThread<T> {
  static inline Misuse misuse = Misuse::kNone;
  uint32_t* a_regs = nullptr;  // the last register-A wgmma's A
  float* acc = nullptr;        // the last wgmma's accumulators
  bool fence_owed = false;     // kProxyFenceLate: the fence to run after the barrier
  explicit Misusing(T& inner) : sim::ForwardingThread<T>(inner) {}
  void Sync() {
    if (misuse != Misuse::kNoBarrier) this->t.Sync();
    if (fence_owed) this->t.FenceProxyAsync(), fence_owed = false;
  }
  void WgmmaFence() {
    if (misuse != Misuse::kNoFence) this->t.WgmmaFence();
  }
  void Wgmma(float d[16], uint64_t a, uint64_t b, bool tr) {
    acc = d;
    if (misuse == Misuse::kRegsAfterFence && this->tid() == 4) d[1] += 1;
    if (misuse == Misuse::kSwizzle) b |= uint64_t{1} << 62;
    if (misuse == Misuse::kDivergentOperands && this->tid() == 9) a += 1;  // 16 bytes on
    this->t.Wgmma(d, a, b, tr);
  }
  void WgmmaRegA(float d[16], uint32_t a[4], uint64_t b, bool tr) {
    a_regs = a;
    acc = d;
    this->t.WgmmaRegA(d, a, b, tr);
  }
  void WgmmaCommit() {
    this->t.WgmmaCommit();
    const int tid = this->tid();
    if (misuse == Misuse::kWriteInFlight && tid == 0) this->t.St(WgmmaProbeSmem::kB2, uint16_t{0});
    if (misuse == Misuse::kARegsInFlight && tid == 7) a_regs[2] ^= 1;
    if (misuse == Misuse::kAccInFlight && tid == 3) acc[0] += 1;
  }
  void WgmmaWait(int n) {
    if (misuse != Misuse::kNoWait) this->t.WgmmaWait(n);
  }
  void FenceProxyAsync() {
    if (this->tid() == 5 && misuse == Misuse::kNoProxyFence) return;
    if (this->tid() == 5 && misuse == Misuse::kProxyFenceLate) {
      fence_owed = true;
      return;
    }
    this->t.FenceProxyAsync();
  }
};

// The simulation's wgmma against a float64 product over the layouts of wgmma_layout.h, by the
// body the GPU also runs before it first uses the wgmma MLA (wgmma_probe.h): A (64 x 16) and B
// (16 x 32) K-major from shared memory, then A from registers and B2 MN-major, chained into the
// same accumulators; every output written once. And the eleven misuses it must refuse, each by
// its own error.
TEST(MlaWgmmaSim, WgmmaComputesFromTheLayoutsAndRefusesMisuse) {
  std::mt19937 rng(9);
  std::normal_distribution<float> n01(0, 1);
  std::vector<uint16_t> a(64 * 16), b(16 * 32), b2(16 * 32);
  for (auto* v : {&a, &b, &b2})
    for (uint16_t& x : *v) x = F32ToBF16(n01(rng));
  using M = Misuse;
  for (const M misuse : {M::kNone, M::kNoFence, M::kRegsAfterFence, M::kNoProxyFence,
                         M::kProxyFenceLate, M::kNoBarrier, M::kWriteInFlight, M::kARegsInFlight,
                         M::kAccInFlight, M::kNoWait, M::kSwizzle, M::kDivergentOperands}) {
    std::vector<float> out(64 * 32, NAN);
    sim::SimtMemory mem;
    mem.Input(a.data(), a.size() * 2, "a");
    mem.Input(b.data(), b.size() * 2, "b");
    mem.Input(b2.data(), b2.size() * 2, "b2");
    mem.Output(out.data(), out.size() * 4, "out");
    sim::SimtBlock blk(mem, wgmma::kGroupThreads, WgmmaProbeSmem::kBytes);
    Misusing<sim::SimtThread>::misuse = misuse;
    std::string error;
    try {
      blk.Run([&](sim::SimtThread& t) {
        Misusing<sim::SimtThread> g(t);
        WgmmaProbeBlock(g, a.data(), b.data(), b2.data(), out.data());
      });
    } catch (const std::runtime_error& e) {
      error = e.what();
    }
    if (misuse != M::kNone) {
      EXPECT_NE(error.find(MisuseError(misuse)), std::string::npos)
          << "misuse " << static_cast<int>(misuse) << ": " << (error.empty() ? "none" : error);
      continue;
    }
    ASSERT_EQ(error, "");
    for (int w : mem.Writes("out")) ASSERT_EQ(w, 1);
    for (int m = 0; m < 64; ++m)
      for (int n = 0; n < 32; ++n) {
        double want = 0;
        for (int k = 0; k < 16; ++k)
          want += double(BF16ToF32(a[m * 16 + k])) *
                  (double(BF16ToF32(b[k * 32 + n])) + double(BF16ToF32(b2[k * 32 + n])));
        ASSERT_FALSE(std::isnan(out[m * 32 + n])) << m << " " << n;
        EXPECT_NEAR(out[m * 32 + n], want, 1e-4 * (1 + std::abs(want))) << m << " " << n;
      }
  }
  Misusing<sim::SimtThread>::misuse = M::kNone;
}

// The simulation's ldmatrix against the mma.sync fragment layout (mma_fragments.h, which the
// H200 parity runs confirmed): x4 of a row-major 16 x 16 tile gives A's registers; x4.trans of a
// [k][n] tile (two k-steps of 16 keys x 8 columns, as V is stored) gives B's for both k-steps.
// A row address off its 16-byte grain, or a row nobody wrote, is an error.
TEST(MlaPipeSim, LdMatrixGivesTheMmaFragments) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> bits(0, 0xffff);
  constexpr uint32_t kRow = 48;  // 24 values: 16 used, 8 of padding
  uint16_t tile[32][24];
  for (auto& r : tile)
    for (uint16_t& v : r) v = static_cast<uint16_t>(bits(rng));
  sim::SimtMemory mem;
  for (const bool bad_align : {false, true}) {
    sim::SimtBlock b(mem, 32, 32 * kRow);
    auto run = [&] {
      b.Run([&](sim::SimtThread& t) {
        const int l = t.lane();
        if (l == 0)
          for (int r = 0; r < 32; ++r)
            for (int c = 0; c < 24; c += 2)
              t.St(r * kRow + c * 2, uint32_t{tile[r][c]} | (uint32_t{tile[r][c + 1]} << 16));
        t.Sync();
        auto pack = [](uint16_t lo, uint16_t hi) { return uint32_t{lo} | (uint32_t{hi} << 16); };
        uint32_t a[4], v[4];
        t.LdMatrixX4(a, (l % 16) * kRow + (l / 16) * 16 + (bad_align ? 4 : 0), false);
        for (int r = 0; r < 4; ++r) {
          const int row = mma::RowA(l, r);
          if (a[r] != pack(tile[row][mma::ColA(l, r, 0)], tile[row][mma::ColA(l, r, 1)]))
            throw std::runtime_error("A register " + std::to_string(r) + " of lane " +
                                     std::to_string(l));
        }
        t.LdMatrixX4(v, l * kRow, true);  // keys 0-31 (two k-steps), columns 0-7
        for (int ks = 0; ks < 2; ++ks)
          for (int r = 0; r < 2; ++r) {
            const int col = mma::ColB(l), k0 = ks * 16;
            if (v[ks * 2 + r] !=
                pack(tile[k0 + mma::RowB(l, r, 0)][col], tile[k0 + mma::RowB(l, r, 1)][col]))
              throw std::runtime_error("B register " + std::to_string(ks * 2 + r) + " of lane " +
                                       std::to_string(l));
          }
      });
    };
    if (bad_align) {
      EXPECT_THROW(run(), std::runtime_error);
    } else {
      EXPECT_NO_THROW(run());
    }
  }
  sim::SimtBlock unwritten(mem, 32, 32 * kRow);
  EXPECT_THROW(unwritten.Run([&](sim::SimtThread& t) {
    uint32_t a[4];
    t.LdMatrixX4(a, t.lane() % 8 * kRow, false);
  }),
               std::runtime_error);
}

TEST(MlaPipeSim, SharedMemoryFitsTheGpus) {
  // DeepSeek-V3.2 rows: 3 stages fit an H100/H200 block (227 KB), 2 an A100's (163 KB).
  EXPECT_LE(MlaPipeSmem::Of(512, 64, false, 3).bytes, 227u * 1024);
  EXPECT_LE(MlaPipeSmem::Of(512, 64, true, 3).bytes, 227u * 1024);
  EXPECT_LE(MlaPipeSmem::Of(512, 64, false, 2).bytes, 163u * 1024);
  EXPECT_TRUE(MlaPipeTakes(128, 512, 64, DType::kFP8E4M3));
  EXPECT_FALSE(MlaPipeTakes(16, 512, 64, DType::kBF16));  // 16 heads: the 16-head kernel
  EXPECT_FALSE(MlaPipeTakes(64, 32, 16, DType::kBF16));   // the tiny model: SIMT
  // The wgmma kernel: 3 stages at DeepSeek dims on an H100/H200 (bf16 and fp8 rows); that shape
  // only.
  EXPECT_LE(MlaWgmmaSmem::Of(512, 64, false, 3).bytes, 227u * 1024);
  EXPECT_LE(MlaWgmmaSmem::Of(512, 64, true, 3).bytes, 227u * 1024);
  EXPECT_TRUE(MlaWgmmaTakes(128, 512, 64, DType::kFP8E4M3));
  // Its warp-specialised form: 4 stages on an H100/H200, bf16 and fp8 rows (two decoded tiles).
  EXPECT_LE(MlaWgmmaWsSmem::Of(512, 64, false, kWsMaxStages).bytes, 227u * 1024);
  EXPECT_LE(MlaWgmmaWsSmem::Of(512, 64, true, kWsMaxStages).bytes, 227u * 1024);
  EXPECT_FALSE(MlaWgmmaTakes(64, 128, 64, DType::kBF16));
  EXPECT_FALSE(MlaWgmmaTakes(64, 512, 32, DType::kBF16));
}

}  // namespace
}  // namespace attnd::cuda
