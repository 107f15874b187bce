#include "kernels/reference/reference.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

namespace attnd::reference {

std::vector<double> IndexerScores(const ModelSpec& spec, const double* q, const double* w,
                                  const double* keys, int64_t n) {
  const int Hi = spec.index_n_heads, Di = spec.index_head_dim;
  std::vector<double> out(n, 0.0);
  for (int64_t s = 0; s < n; ++s) {
    double total = 0;
    for (int h = 0; h < Hi; ++h) {
      double dot = 0;
      for (int d = 0; d < Di; ++d) dot += q[h * Di + d] * keys[s * Di + d];
      total += w[h] * std::max(dot, 0.0);
    }
    out[s] = total;
  }
  return out;
}

std::vector<int32_t> TopK(const std::vector<double>& scores, int64_t k) {
  std::vector<int32_t> order(scores.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return scores[a] > scores[b]; });
  order.resize(std::min<int64_t>(k, static_cast<int64_t>(order.size())));
  std::sort(order.begin(), order.end());
  return order;
}

namespace {

// Best `keep` pages of a page->score map (score descending, page ascending), plus `own`.
std::vector<int32_t> KeepPages(const std::map<int32_t, double>& page_score, int keep, int32_t own) {
  std::vector<std::pair<int32_t, double>> v(page_score.begin(), page_score.end());
  std::stable_sort(v.begin(), v.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  std::vector<int32_t> pages;
  for (int i = 0; i < static_cast<int>(v.size()) && i < keep; ++i) pages.push_back(v[i].first);
  if (std::find(pages.begin(), pages.end(), own) == pages.end()) pages.push_back(own);
  std::sort(pages.begin(), pages.end());
  return pages;
}

std::vector<int32_t> PagesToKeys(const std::vector<int32_t>& pages, int ps, int64_t n) {
  std::vector<int32_t> keys;
  for (int32_t p : pages)
    for (int64_t s = static_cast<int64_t>(p) * ps; s < (p + 1) * static_cast<int64_t>(ps) && s < n;
         ++s)
      keys.push_back(static_cast<int32_t>(s));
  return keys;
}

}  // namespace

std::vector<int32_t> SelectKeys(const ModelSpec& spec, const std::vector<double>& scores,
                                bool dense_prefill) {
  const int64_t n = static_cast<int64_t>(scores.size());
  if (dense_prefill) {
    std::vector<int32_t> all(n);
    std::iota(all.begin(), all.end(), 0);
    return all;
  }
  const int ps = spec.page_size;
  const int32_t own = static_cast<int32_t>((n - 1) / ps);
  switch (spec.selection) {
    case SelectionMode::kToken:
      return TopK(scores, spec.index_topk);
    case SelectionMode::kPageUnion: {
      std::map<int32_t, double> best;
      for (int32_t s : TopK(scores, spec.index_topk)) {
        auto [it, fresh] = best.emplace(s / ps, scores[s]);
        if (!fresh) it->second = std::max(it->second, scores[s]);
      }
      return PagesToKeys(KeepPages(best, spec.page_union_max_pages, own), ps, n);
    }
    case SelectionMode::kPageBudget: {
      std::map<int32_t, double> best;
      for (int64_t s = 0; s < n; ++s) {
        auto [it, fresh] = best.emplace(static_cast<int32_t>(s / ps), scores[s]);
        if (!fresh) it->second = std::max(it->second, scores[s]);
      }
      return PagesToKeys(KeepPages(best, spec.page_budget, own), ps, n);
    }
  }
  return {};
}

void Attend(const ModelSpec& spec, const double* q, const double* kv,
            const std::vector<int32_t>& keys, double soft_cap, double* out, double* lse) {
  const int H = spec.num_heads, L = spec.kv_lora_rank, D = spec.latent_dim();
  std::vector<double> s(keys.size());
  for (int h = 0; h < H; ++h) {
    const double* qh = q + h * D;
    double mx = -INFINITY;
    for (size_t j = 0; j < keys.size(); ++j) {
      const double* k = kv + static_cast<int64_t>(keys[j]) * D;
      double dot = 0;
      for (int d = 0; d < D; ++d) dot += qh[d] * k[d];
      double x = spec.sm_scale * dot;
      if (soft_cap > 0) x = soft_cap * std::tanh(x / soft_cap);
      s[j] = x;
      mx = std::max(mx, x);
    }
    double denom = 0;
    for (double& x : s) denom += (x = std::exp(x - mx));
    if (lse != nullptr) lse[h] = keys.empty() ? -INFINITY : mx + std::log(denom);
    for (int d = 0; d < L; ++d) {
      double acc = 0;
      for (size_t j = 0; j < keys.size(); ++j)
        acc += s[j] * kv[static_cast<int64_t>(keys[j]) * D + d];
      out[h * L + d] = keys.empty() ? 0.0 : acc / denom;
    }
  }
}

}  // namespace attnd::reference
