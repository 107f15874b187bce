#include "engine/context_parallel.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/attention_cpu.h"

namespace attnd {

void LocalSelection(const ModelSpec& spec, int32_t count, const int64_t* keys, const float* scores,
                    int64_t query_pos, int64_t offset, int64_t visible, std::vector<int32_t>* out) {
  out->clear();
  const int64_t end = offset + visible;  // this server's visible keys: [offset, end)
  if (spec.selection == SelectionMode::kToken) {
    for (int32_t j = 0; j < count; ++j)
      if (keys[j] >= offset && keys[j] < end)
        out->push_back(static_cast<int32_t>(keys[j] - offset));
    std::sort(out->begin(), out->end());
    return;
  }
  const int ps = spec.page_size;
  std::vector<std::pair<float, int32_t>> cand;
  if (spec.selection == SelectionMode::kPageUnion) {
    // Pages holding any of the top-k tokens, ranked by their best one.
    std::vector<std::pair<int64_t, float>> tokens;
    for (int32_t j = 0; j < count; ++j) tokens.emplace_back(keys[j], cpu::RankKey(scores[j]));
    std::sort(tokens.begin(), tokens.end());
    for (const auto& [pos, score] : tokens) {
      const int32_t page = static_cast<int32_t>(pos / ps);
      if (cand.empty() || cand.back().second != page) {
        cand.emplace_back(score, page);
      } else {
        cand.back().first = std::max(cand.back().first, score);
      }
    }
  } else {
    for (int32_t j = 0; j < count; ++j)
      cand.emplace_back(cpu::RankKey(scores[j]), static_cast<int32_t>(keys[j]));
  }
  const int keep =
      spec.selection == SelectionMode::kPageUnion ? spec.page_union_max_pages : spec.page_budget;
  const int32_t own = static_cast<int32_t>(query_pos / ps);
  for (int32_t page : cpu::BestPages(cand, keep, own)) {
    const int64_t lo = std::max<int64_t>(int64_t{page} * ps, offset);
    const int64_t hi = std::min({int64_t{page} * ps + ps, query_pos + 1, end});
    for (int64_t p = lo; p < hi; ++p) out->push_back(static_cast<int32_t>(p - offset));
  }
}

absl::Status CheckSelection(const ModelSpec& spec, const std::vector<int64_t>& query_pos,
                            const std::vector<uint8_t>& needs_index, const Candidates& sel) {
  const size_t T = query_pos.size();
  if (sel.count.size() != T)
    return absl::InvalidArgumentError(
        absl::StrCat("selection: ", sel.count.size(), " counts for a step of ", T, " queries"));
  const bool pages = spec.selection == SelectionMode::kPageBudget;
  if (sel.pages != pages)
    return absl::InvalidArgumentError(
        absl::StrCat("selection: keys must be ", pages ? "page ids" : "positions",
                     " under selection mode ", SelectionModeName(spec)));
  int64_t total = 0;
  for (int32_t c : sel.count) {
    if (c < 0 || c > CandidatesPerQuery(spec))
      return absl::InvalidArgumentError(
          absl::StrCat("selection: a query has ", c, " keys; at most ", CandidatesPerQuery(spec)));
    total += c;
  }
  if (total != static_cast<int64_t>(sel.keys.size()) || sel.keys.size() != sel.scores.size())
    return absl::InvalidArgumentError(absl::StrCat("selection: the counts add up to ", total,
                                                   " keys; ", sel.keys.size(), " keys and ",
                                                   sel.scores.size(), " scores given"));
  absl::flat_hash_set<int64_t> seen;
  size_t at = 0;
  for (size_t t = 0; t < T; ++t) {
    if (!needs_index[t] && sel.count[t] > 0)
      return absl::InvalidArgumentError(
          absl::StrCat("selection: query ", t, " attends every visible key; give it no keys"));
    const int64_t last = pages ? query_pos[t] / spec.page_size : query_pos[t];
    seen.clear();
    for (int32_t j = 0; j < sel.count[t]; ++j, ++at) {
      const int64_t k = sel.keys[at];
      if (k < 0 || k > last)
        return absl::InvalidArgumentError(absl::StrCat("selection: query ", t, " (position ",
                                                       query_pos[t], ") cannot see ",
                                                       pages ? "page " : "position ", k));
      if (!seen.insert(k).second)
        return absl::InvalidArgumentError(
            absl::StrCat("selection: query ", t, " lists key ", k, " twice"));
      if (std::isinf(sel.scores[at]) && sel.scores[at] > 0)
        return absl::InvalidArgumentError(
            absl::StrCat("selection: query ", t, " has an infinite score"));
    }
  }
  return absl::OkStatus();
}

}  // namespace attnd
