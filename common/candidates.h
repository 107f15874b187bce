// A context-parallel full layer's candidates (docs/numerics.md, engine/context_parallel.h) and how
// the client merges the servers' lists. Header-only: the engine and the C++ client share it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace attnd {

// Each query's candidates for a full layer's selection, in absolute keys: positions (token and
// page_union modes: the top-K tokens) or page ids (page_budget: the best `budget` pages by their
// best token), best first, ties to the lower key. A query that needs no indexer (it attends
// every visible key) has none.
struct Candidates {
  bool pages = false;          // keys are page ids (page_budget)
  int64_t keep = 0;            // how many a query keeps after merging: K, or the budget
  std::vector<int32_t> count;  // [T] candidates per query
  std::vector<int64_t> keys;   // [sum(count)], query after query
  std::vector<float> scores;   // [sum(count)]
};

// Per query: every part's candidates, best first (score descending, ties to the lower key), the
// first `keep` of them. The parts must agree on T, keep and pages.
inline absl::Status MergeCandidates(const std::vector<const Candidates*>& parts,
                                    Candidates* merged) {
  if (parts.empty()) return absl::InvalidArgumentError("candidates: no parts");
  const Candidates& first = *parts[0];
  if (first.keep < 0) return absl::InvalidArgumentError("candidates: keep < 0");
  for (const Candidates* p : parts) {
    if (p->count.size() != first.count.size() || p->keep != first.keep || p->pages != first.pages)
      return absl::InvalidArgumentError(
          "candidates: the parts disagree on the queries, the keys' kind or how many to keep");
    int64_t n = 0;
    for (int32_t c : p->count) n += c;
    if (n != static_cast<int64_t>(p->keys.size()) || p->keys.size() != p->scores.size())
      return absl::InvalidArgumentError("candidates: counts, keys and scores disagree");
  }
  Candidates out;
  out.pages = first.pages;
  out.keep = first.keep;
  std::vector<size_t> at(parts.size(), 0);
  std::vector<std::pair<float, int64_t>> all;
  for (size_t t = 0; t < first.count.size(); ++t) {
    all.clear();
    for (size_t k = 0; k < parts.size(); ++k) {
      for (int32_t j = 0; j < parts[k]->count[t]; ++j, ++at[k])
        all.emplace_back(parts[k]->scores[at[k]], parts[k]->keys[at[k]]);
    }
    std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    if (static_cast<int64_t>(all.size()) > out.keep) all.resize(out.keep);
    out.count.push_back(static_cast<int32_t>(all.size()));
    for (const auto& [score, key] : all) {
      out.keys.push_back(key);
      out.scores.push_back(score);
    }
  }
  *merged = std::move(out);
  return absl::OkStatus();
}

}  // namespace attnd
