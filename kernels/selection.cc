#include "kernels/selection.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

namespace attnd {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Per-thread scratch, grown on demand and reused across calls (no allocation per query once warm).
struct Scratch {
  std::vector<float> rank;
  std::vector<int32_t> topk;
  std::vector<std::pair<float, int32_t>> pages;
};
Scratch& ThreadScratch() {
  thread_local Scratch s;
  return s;
}

bool Better(const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

void ExpandPages(const std::vector<int32_t>& pages, int64_t n, int page_size,
                 std::vector<int32_t>* out) {
  for (int32_t p : pages) {
    const int64_t lo = static_cast<int64_t>(p) * page_size;
    const int64_t hi = std::min<int64_t>(lo + page_size, n);
    for (int64_t s = lo; s < hi; ++s) out->push_back(static_cast<int32_t>(s));
  }
}

// The top-k of scores[0, n) (ExactTopK) into the thread's scratch.
const std::vector<int32_t>& TopKScratch(const float* scores, int64_t n, int64_t k) {
  std::vector<int32_t>& topk = ThreadScratch().topk;
  topk.resize(std::min<int64_t>(n, k));
  topk.resize(ExactTopK(scores, n, k, topk.data()));
  return topk;
}

}  // namespace

float RankKey(float s) { return std::isnan(s) ? kNegInf : s; }

std::vector<int32_t> BestPages(std::vector<std::pair<float, int32_t>>& cand, int keep,
                               int32_t own_page) {
  if (static_cast<int64_t>(cand.size()) > keep) {
    std::nth_element(cand.begin(), cand.begin() + keep, cand.end(), Better);
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
  auto& cand = ThreadScratch().pages;
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

void PageMaxima(const float* scores, int64_t n, int page_size,
                std::vector<std::pair<float, int32_t>>* out) {
  out->clear();
  const int64_t num_pages = (n + page_size - 1) / page_size;
  for (int64_t p = 0; p < num_pages; ++p) {
    float best = kNegInf;
    const int64_t hi = std::min<int64_t>((p + 1) * page_size, n);
    for (int64_t s = p * page_size; s < hi; ++s) best = std::max(best, RankKey(scores[s]));
    out->emplace_back(best, static_cast<int32_t>(p));
  }
}

void PageBudgetSelect(const float* scores, int64_t n, int page_size, int budget,
                      std::vector<int32_t>* out) {
  auto& cand = ThreadScratch().pages;
  PageMaxima(scores, n, page_size, &cand);
  const int32_t own = static_cast<int32_t>((n - 1) / page_size);
  ExpandPages(BestPages(cand, budget, own), n, page_size, out);
}

void SelectKeys(const ModelSpec& spec, const float* sc, int64_t n, std::vector<int32_t>* out) {
  out->clear();
  switch (spec.selection) {
    case SelectionMode::kToken:
      out->resize(std::min<int64_t>(n, spec.index_topk));
      out->resize(ExactTopK(sc, n, spec.index_topk, out->data()));
      break;
    case SelectionMode::kPageUnion: {
      const std::vector<int32_t>& topk = TopKScratch(sc, n, spec.index_topk);
      PageUnionSelect(sc, n, topk.data(), static_cast<int64_t>(topk.size()), spec.page_size,
                      spec.page_union_max_pages, out);
      break;
    }
    case SelectionMode::kPageBudget:
      PageBudgetSelect(sc, n, spec.page_size, spec.page_budget, out);
      break;
  }
}

void LocalCandidatesOf(const ModelSpec& spec, const float* sc, int64_t n,
                       std::vector<int32_t>* keys, std::vector<float>* key_scores) {
  // Best first, ties to the lower key: what merging the servers' lists needs.
  std::vector<std::pair<float, int32_t>> best;
  if (spec.selection == SelectionMode::kPageBudget) {
    PageMaxima(sc, n, spec.page_size, &best);
  } else {
    for (int32_t p : TopKScratch(sc, n, spec.index_topk)) best.emplace_back(RankKey(sc[p]), p);
  }
  const size_t keep = static_cast<size_t>(CandidatesPerQuery(spec));
  std::sort(best.begin(), best.end(), Better);
  if (best.size() > keep) best.resize(keep);
  keys->clear();
  key_scores->clear();
  for (const auto& [score, key] : best) {
    keys->push_back(key);
    key_scores->push_back(score);
  }
}

}  // namespace attnd
