// The streaming tensor-core indexer (kernels/cuda/ops/indexer_stream.h) run on the CPU by the fiber
// simulation (tests/sim/simt_sim.h): the kernel's own code, every thread, every barrier,
// cp.async landing only when waited for, mma.sync and shuffles from the lanes' registers.
// Scores against float64 on what the kernel sees (the query rounded to bf16; fp8 keys
// dequantised), every score written exactly once and nothing else, at DeepSeek-V3.2 and GLM-5
// dims and edge shapes; and every barrier the kernel passes is needed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <stdexcept>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "common/fp8.h"
#include "kernels/cuda/ops/indexer_stream.h"
#include "tests/sim/sim_mutation.h"
#include "tests/sim/simt_sim.h"

namespace attnd::cuda {
namespace {

// One sequence's paged indexer keys (shuffled pages) and a few queries of it, in host memory.
struct Problem {
  int heads = 64, dim = 128, page_size = 64;
  bool fp8 = false;
  std::vector<int64_t> positions;  // each query's position
  int64_t range = 1024;

  Problem() = default;
  Problem(int heads_, int dim_, bool fp8_, std::vector<int64_t> positions_, int64_t range_)
      : heads(heads_), dim(dim_), fp8(fp8_), positions(std::move(positions_)), range(range_) {}

  int64_t keys = 0;
  std::vector<uint8_t> cache;  // pages of rows (fp8: a page's codes, then its scales)
  std::vector<int32_t> indptr, pages, seq, queries;
  std::vector<int64_t> pos, offset;
  std::vector<float> q, w, scores;
  std::vector<double> key_values;  // [keys, dim] as the kernel reads them (dequantised)
  IndexerStreamParams p;

  void Make(uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> n01(0, 1);
    keys = *std::max_element(positions.begin(), positions.end()) + 1;
    const int64_t npages = (keys + page_size - 1) / page_size;
    const size_t row = fp8 ? dim + 4 : dim * 2;
    cache.assign((npages + 1) * page_size * row, 0);  // page 0 unused, as in the server
    pages.resize(npages);
    std::iota(pages.begin(), pages.end(), 1);
    std::shuffle(pages.begin(), pages.end(), rng);
    indptr = {0, static_cast<int32_t>(npages)};
    key_values.resize(keys * dim);
    std::vector<float> k(dim);
    for (int64_t s = 0; s < keys; ++s) {
      for (float& x : k) x = n01(rng);
      const int64_t slot = int64_t{pages[s / page_size]} * page_size + s % page_size;
      if (fp8) {
        uint8_t* page = cache.data() + slot / page_size * page_size * row;
        uint8_t* values = page + (slot % page_size) * dim;
        float scale;
        fp8::PackIndexKey(dim, k.data(), values, &scale);
        std::memcpy(page + page_size * dim + (slot % page_size) * 4, &scale, 4);
        for (int d = 0; d < dim; ++d) key_values[s * dim + d] = fp8::E4M3ToF32(values[d]) * scale;
      } else {
        for (int d = 0; d < dim; ++d) {
          const uint16_t b = F32ToBF16(k[d]);
          std::memcpy(cache.data() + slot * row + 2 * d, &b, 2);
          key_values[s * dim + d] = BF16ToF32(b);
        }
      }
    }
    const int nq = static_cast<int>(positions.size());
    q.resize(size_t(nq) * heads * dim);
    w.resize(size_t(nq) * heads);
    for (float& x : q) x = n01(rng);
    for (float& x : w) x = n01(rng);
    seq.assign(nq, 0);
    pos = positions;
    queries.resize(nq);
    std::iota(queries.begin(), queries.end(), 0);
    offset.clear();
    int64_t total = 0;
    for (int64_t x : positions) offset.push_back(total), total += x + 1;
    scores.assign(total, NAN);
    p.q = q.data();
    p.w = w.data();
    p.heads = heads;
    p.dim = dim;
    p.keys.base = cache.data();
    p.keys.row_bytes = row;
    p.keys.dtype = fp8 ? DType::kFP8E4M3 : DType::kBF16;
    p.keys.dim = dim;
    if (fp8) {
      p.keys.fp8_dim = dim;
      p.keys.scales_apart = page_size;
    }
    p.tables = {{indptr.data(), pages.data(), page_size}, seq.data(), pos.data()};
    p.queries = queries.data();
    p.score_offset = offset.data();
    p.range = range;
    p.scores = scores.data();
  }

  sim::SimtMemory Memory() {
    sim::SimtMemory m;
    m.Input(q.data(), q.size() * 4, "q");
    m.Input(w.data(), w.size() * 4, "w");
    m.Input(cache.data(), cache.size(), "cache");
    m.Input(indptr.data(), indptr.size() * 4, "indptr");
    m.Input(pages.data(), pages.size() * 4, "pages");
    m.Input(seq.data(), seq.size() * 4, "seq");
    m.Input(pos.data(), pos.size() * 8, "pos");
    m.Input(queries.data(), queries.size() * 4, "queries");
    m.Input(offset.data(), offset.size() * 8, "offset");
    m.Output(scores.data(), scores.size() * 4, "scores");
    return m;
  }

  // Every block of the grid (key ranges x queries), each run by the simulation with thread
  // type T (SimtThread, or a wrapper of it).
  template <template <typename> class Wrap = std::type_identity_t>
  void Run(sim::SimtMemory& m) {
    const int64_t blocks = (keys + range - 1) / range;
    for (int qi = 0; qi < static_cast<int>(positions.size()); ++qi)
      for (int64_t bx = 0; bx < blocks; ++bx) {
        sim::SimtBlock b(m, kStreamThreads, StreamSmemBytes(heads, dim, fp8));
        b.Run([&](sim::SimtThread& t) {
          Wrap<sim::SimtThread> g(t);
          Dispatch(g, bx, qi);
        });
      }
  }
  template <typename G>
  void Dispatch(G& g, int64_t bx, int qi) {
    const int hg = heads / 16;
    if (hg == 2)
      fp8 ? IndexerStreamBlock<2, true>(g, p, bx, qi) : IndexerStreamBlock<2, false>(g, p, bx, qi);
    if (hg == 4)
      fp8 ? IndexerStreamBlock<4, true>(g, p, bx, qi) : IndexerStreamBlock<4, false>(g, p, bx, qi);
    if (hg == 8)
      fp8 ? IndexerStreamBlock<8, true>(g, p, bx, qi) : IndexerStreamBlock<8, false>(g, p, bx, qi);
  }

  // float64 on the kernel's inputs, and each score's magnitude scale (sum |w| |dot|).
  void Expect(double tol) const {
    for (size_t qi = 0; qi < positions.size(); ++qi)
      for (int64_t s = 0; s <= positions[qi]; ++s) {
        double ref = 0, mag = 0;
        for (int h = 0; h < heads; ++h) {
          double dot = 0;
          for (int d = 0; d < dim; ++d)
            dot += double(BF16ToF32(F32ToBF16(q[(qi * heads + h) * dim + d]))) *
                   key_values[s * dim + d];
          ref += w[qi * heads + h] * std::max(dot, 0.0);
          mag += std::abs(w[qi * heads + h] * dot);
        }
        const float got = scores[offset[qi] + s];
        ASSERT_FALSE(std::isnan(got)) << "query " << qi << " key " << s;
        ASSERT_NEAR(got, ref, tol * (1 + mag)) << "query " << qi << " key " << s;
      }
  }
};

struct Shape {
  int heads, dim;
  bool fp8;
  std::vector<int64_t> positions;
  int64_t range;
};

class IndexerStreamSim : public ::testing::TestWithParam<Shape> {};

TEST_P(IndexerStreamSim, ScoresMatchFloat64AndEachIsWrittenOnce) {
  const Shape s = GetParam();
  Problem pr(s.heads, s.dim, s.fp8, s.positions, s.range);
  pr.Make(s.heads * 7 + s.dim + s.fp8);
  sim::SimtMemory m = pr.Memory();
  ASSERT_NO_THROW(pr.Run(m));
  pr.Expect(1e-5);
  const std::vector<int>& writes = m.Writes("scores");
  for (size_t i = 0; i < writes.size(); ++i) ASSERT_EQ(writes[i], 1) << "score byte " << i;
}

// DeepSeek-V3.2 (64 x 128), GLM-5 (32 x 128), 128 heads; bf16 and fp8 keys; ranges of one and
// many tiles, partial last tiles, a key range past one query's end, a one-key query; head dims
// below 128 (k-steps of the unrolled loops skipped) down to one 16-byte chunk of a key (fewer
// chunks than the threads that copy a key).
INSTANTIATE_TEST_SUITE_P(
    Shapes, IndexerStreamSim,
    ::testing::Values(Shape{64, 128, false, {700, 99}, 256}, Shape{64, 128, true, {700, 99}, 256},
                      Shape{32, 128, false, {300}, 128}, Shape{32, 128, true, {300, 0}, 64},
                      Shape{128, 128, false, {130}, 128}, Shape{64, 64, true, {200}, 192},
                      Shape{64, 128, false, {63, 64, 65}, 64}, Shape{32, 64, false, {150}, 128},
                      Shape{64, 16, true, {70}, 64}, Shape{32, 16, false, {90}, 64}));

// A thread type that skips the body's barrier number `skip` (every thread the same one), to show
// each barrier is needed: the simulation then reports a race, a read of a copy in flight, or
// wrong scores.
template <typename T>
struct SkipOneBarrier : sim::ForwardingThread<T> {
  static inline int skip = -1;
  int count = 0;
  explicit SkipOneBarrier(T& inner) : sim::ForwardingThread<T>(inner) {}
  void Sync() {
    if (count++ != skip) this->t.Sync();
  }
};

TEST(IndexerStreamSim, EveryBarrierIsNeeded) {
  for (bool fp8 : {false, true}) {
    Problem pr;
    pr.fp8 = fp8;
    pr.positions = {250};
    pr.range = 256;  // one block of 4 tiles
    pr.Make(3);
    sim::SimtMemory m = pr.Memory();
    SkipOneBarrier<sim::SimtThread>::skip = -1;
    ASSERT_NO_THROW(pr.Run<SkipOneBarrier>(m));
    const std::vector<float> want = pr.scores;
    // Per tile: bf16, the copies' and the partials'; fp8, the decoded tile's and the partials'.
    const int barriers = 2 * 4;
    for (int skip = 0; skip < barriers; ++skip) {
      Problem again = pr;
      again.Make(3);
      sim::SimtMemory m2 = again.Memory();
      SkipOneBarrier<sim::SimtThread>::skip = skip;
      EXPECT_TRUE(testing::RefusedOrChanged([&] {
        again.Run<SkipOneBarrier>(m2);
        return std::memcmp(again.scores.data(), want.data(), want.size() * 4) != 0;
      })) << (fp8 ? "fp8" : "bf16")
          << ": barrier " << skip << " is not needed";
    }
    SkipOneBarrier<sim::SimtThread>::skip = -1;
  }
}

TEST(IndexerStreamSim, TheKernelTakesTheServersShapes) {
  EXPECT_TRUE(IndexerStreamTakes(64, 128, DType::kBF16));     // DeepSeek-V3.2
  EXPECT_TRUE(IndexerStreamTakes(32, 128, DType::kFP8E4M3));  // GLM-5, fp8 cache
  EXPECT_FALSE(IndexerStreamTakes(4, 16, DType::kBF16));      // the tiny test model: SIMT
  EXPECT_FALSE(IndexerStreamTakes(64, 256, DType::kBF16));    // fragments past the registers
  EXPECT_FALSE(IndexerStreamTakes(64, 128, DType::kF32));     // fp32 caches: SIMT
  // DeepSeek dims, bf16: 3 stages of 17 KB and 1 KB of partials; fp8: 3 x 8 KB + 17 KB + 1 KB.
  EXPECT_EQ(StreamSmemBytes(64, 128, false), 3u * 64 * 272 + 4 * 64 * 4);
  EXPECT_EQ(StreamSmemBytes(64, 128, true), 3u * 64 * 128 + 64 * 272 + 4 * 64 * 4);
}

}  // namespace
}  // namespace attnd::cuda
