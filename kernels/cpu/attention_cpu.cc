#include "kernels/cpu/attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

namespace attnd::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Per-thread scratch, grown on demand and reused across calls (no allocation per layer once warm).
struct Scratch {
  std::vector<float> a, b, c, d;
  std::vector<float> rank;
  std::vector<std::pair<float, int32_t>> pages;
};
Scratch& ThreadScratch() {
  thread_local Scratch s;
  return s;
}

float* Grow(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// Converts one cached row to fp32.
inline void LoadRow(const PagedRows& rows, int64_t pos, float* dst) {
  ConvertToF32(rows.dtype, rows.Row(pos), dst, rows.dim);
}

inline float RankKey(float s) { return std::isnan(s) ? kNegInf : s; }

void ExpandPages(const std::vector<int32_t>& pages, int64_t n, int page_size,
                 std::vector<int32_t>* out) {
  for (int32_t p : pages) {
    const int64_t lo = static_cast<int64_t>(p) * page_size;
    const int64_t hi = std::min<int64_t>(lo + page_size, n);
    for (int64_t s = lo; s < hi; ++s) out->push_back(static_cast<int32_t>(s));
  }
}

// Keeps the best `keep` of (score, page) pairs, ties to the lower page, then appends the own
// page if missing and sorts ascending.
std::vector<int32_t> BestPages(std::vector<std::pair<float, int32_t>>& cand, int keep,
                               int32_t own_page) {
  auto better = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  if (static_cast<int64_t>(cand.size()) > keep) {
    std::nth_element(cand.begin(), cand.begin() + keep, cand.end(), better);
    cand.resize(keep);
  }
  std::vector<int32_t> pages;
  pages.reserve(cand.size() + 1);
  bool has_own = false;
  for (auto& [score, page] : cand) {
    pages.push_back(page);
    has_own |= page == own_page;
  }
  if (!has_own) pages.push_back(own_page);
  std::sort(pages.begin(), pages.end());
  return pages;
}

}  // namespace

void IndexerScores(const Kernels& k, const IndexerScoreParams& p) {
  constexpr int kTile = 64;
  Scratch& ws = ThreadScratch();
  const int D = p.head_dim, H = p.num_heads;
  float* kt = Grow(ws.a, static_cast<size_t>(D) * kTile);
  float* s = Grow(ws.b, static_cast<size_t>(H) * kTile);
  float* row = Grow(ws.c, D);
  float* acc = Grow(ws.d, kTile);
  for (int64_t t0 = p.begin; t0 < p.end; t0 += kTile) {
    const int nk = static_cast<int>(std::min<int64_t>(kTile, p.end - t0));
    for (int j = 0; j < nk; ++j) {
      LoadRow(p.keys, t0 + j, row);
      for (int d = 0; d < D; ++d) kt[d * kTile + j] = row[d];
    }
    for (int j = nk; j < kTile; ++j)
      for (int d = 0; d < D; ++d) kt[d * kTile + j] = 0.0f;
    k.gemm(H, kTile, D, p.q, D, kt, kTile, s, kTile, false);
    for (int j = 0; j < kTile; ++j) acc[j] = 0.0f;
    for (int h = 0; h < H; ++h) {
      const float w = p.w[h];
      const float* sh = s + h * kTile;
      for (int j = 0; j < kTile; ++j) acc[j] += w * std::max(sh[j], 0.0f);
    }
    std::copy(acc, acc + nk, p.scores + (t0 - p.begin));
  }
}

int64_t ExactTopK(const float* scores, int64_t n, int64_t k, int32_t* out) {
  if (k >= n) {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(i);
    return n;
  }
  if (k <= 0) return 0;
  Scratch& ws = ThreadScratch();
  if (ws.rank.size() < static_cast<size_t>(n)) ws.rank.resize(n);
  float* r = ws.rank.data();
  for (int64_t i = 0; i < n; ++i) r[i] = RankKey(scores[i]);
  std::nth_element(r, r + (k - 1), r + n, std::greater<float>());
  const float threshold = r[k - 1];
  int64_t above = 0;
  for (int64_t i = 0; i < n; ++i) above += RankKey(scores[i]) > threshold;
  int64_t ties_left = k - above;  // ties at the threshold go to the lowest positions
  int64_t m = 0;
  for (int64_t i = 0; i < n && m < k; ++i) {
    const float v = RankKey(scores[i]);
    if (v > threshold || (v == threshold && ties_left-- > 0)) out[m++] = static_cast<int32_t>(i);
  }
  return m;
}

void PageUnionSelect(const float* scores, int64_t n, const int32_t* topk, int64_t num_topk,
                     int page_size, int max_pages, std::vector<int32_t>* out) {
  Scratch& ws = ThreadScratch();
  auto& cand = ws.pages;
  cand.clear();
  // topk is ascending, so tokens of one page are adjacent.
  for (int64_t i = 0; i < num_topk; ++i) {
    const int32_t page = topk[i] / page_size;
    const float v = RankKey(scores[topk[i]]);
    if (cand.empty() || cand.back().second != page) {
      cand.emplace_back(v, page);
    } else {
      cand.back().first = std::max(cand.back().first, v);
    }
  }
  const int32_t own = static_cast<int32_t>((n - 1) / page_size);
  ExpandPages(BestPages(cand, max_pages, own), n, page_size, out);
}

void PageBudgetSelect(const float* scores, int64_t n, int page_size, int budget,
                      std::vector<int32_t>* out) {
  Scratch& ws = ThreadScratch();
  auto& cand = ws.pages;
  cand.clear();
  const int64_t num_pages = (n + page_size - 1) / page_size;
  for (int64_t p = 0; p < num_pages; ++p) {
    float best = kNegInf;
    const int64_t hi = std::min<int64_t>((p + 1) * page_size, n);
    for (int64_t s = p * page_size; s < hi; ++s) best = std::max(best, RankKey(scores[s]));
    cand.emplace_back(best, static_cast<int32_t>(p));
  }
  const int32_t own = static_cast<int32_t>((n - 1) / page_size);
  ExpandPages(BestPages(cand, budget, own), n, page_size, out);
}

void MlaAttend(const Kernels& k, const MlaParams& p) {
  constexpr int kTile = 32;
  const int H = p.num_heads, L = p.latent_dim, D = p.latent_dim + p.rope_dim;
  Scratch& ws = ThreadScratch();
  float* kr = Grow(ws.a, static_cast<size_t>(kTile) * D);  // [kTile, D] keys as rows
  float* kt = Grow(ws.b, static_cast<size_t>(D) * kTile);  // [D, kTile] keys as columns
  float* s = Grow(ws.c, static_cast<size_t>(H) * kTile);   // scores, then probabilities
  float* state = Grow(ws.d, static_cast<size_t>(H) * (L + 3));
  float* acc = state;             // [H, L]
  float* m = state + H * L;       // running max per head
  float* l = m + H;               // running denominator per head
  float* corr = l + H;            // this tile's rescale per head
  std::fill(acc, acc + H * L, 0.0f);
  std::fill(m, m + H, kNegInf);
  std::fill(l, l + H, 0.0f);
  const int64_t total = p.positions ? p.num_keys : p.end - p.begin;
  const float cap = p.soft_cap;
  for (int64_t t0 = 0; t0 < total; t0 += kTile) {
    const int nk = static_cast<int>(std::min<int64_t>(kTile, total - t0));
    for (int j = 0; j < nk; ++j) {
      const int64_t pos = p.positions ? p.positions[t0 + j] : p.begin + t0 + j;
      LoadRow(p.kv, pos, kr + j * D);
    }
    std::fill(kr + nk * D, kr + kTile * D, 0.0f);
    for (int j = 0; j < kTile; ++j)
      for (int d = 0; d < D; ++d) kt[d * kTile + j] = kr[j * D + d];
    k.gemm(H, kTile, D, p.q, D, kt, kTile, s, kTile, false);
    for (int h = 0; h < H; ++h) {
      float* sh = s + h * kTile;
      float mx = kNegInf;
      for (int j = 0; j < nk; ++j) {
        float x = sh[j] * p.sm_scale;
        if (cap > 0) x = cap * std::tanh(x / cap);
        sh[j] = x;
        mx = std::max(mx, x);
      }
      const float m_new = std::max(m[h], mx);
      corr[h] = m[h] == kNegInf ? 0.0f : m[h] - m_new;  // log of the rescale factor
      m[h] = m_new;
      for (int j = 0; j < nk; ++j) sh[j] -= m_new;
      for (int j = nk; j < kTile; ++j) sh[j] = kNegInf;
    }
    k.exp_inplace(s, H * kTile);
    k.exp_inplace(corr, H);
    for (int h = 0; h < H; ++h) {
      const float* sh = s + h * kTile;
      float sum = 0.0f;
      for (int j = 0; j < nk; ++j) sum += sh[j];
      l[h] = l[h] * corr[h] + sum;
      if (corr[h] != 1.0f) {
        float* ah = acc + h * L;
        for (int d = 0; d < L; ++d) ah[d] *= corr[h];
      }
    }
    k.gemm(H, L, kTile, s, kTile, kr, D, acc, L, true);
  }
  for (int h = 0; h < H; ++h) {
    const float inv = l[h] > 0 ? 1.0f / l[h] : 0.0f;
    for (int d = 0; d < L; ++d) p.out[h * L + d] = acc[h * L + d] * inv;
  }
}

}  // namespace attnd::cpu
