#include "engine/context_parallel.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/selection.h"

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
    for (int32_t j = 0; j < count; ++j) tokens.emplace_back(keys[j], RankKey(scores[j]));
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
      cand.emplace_back(RankKey(scores[j]), static_cast<int32_t>(keys[j]));
  }
  const int keep =
      spec.selection == SelectionMode::kPageUnion ? spec.page_union_max_pages : spec.page_budget;
  const int32_t own = static_cast<int32_t>(query_pos / ps);
  for (int32_t page : BestPages(cand, keep, own)) {
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

absl::Status LocalSelections(const ModelSpec& spec, const StepPlan& plan, int64_t tokens,
                             const Candidates& sel,
                             std::vector<std::vector<std::vector<int32_t>>>* kept) {
  std::vector<int64_t> query_pos(tokens);
  std::vector<uint8_t> needs(tokens);
  for (const StepPlan::Share& sh : plan.shares)
    for (int64_t i = 0; i < sh.share.size(); ++i) {
      query_pos[sh.share.rows[i]] = sh.share.query_pos[i];
      needs[sh.share.rows[i]] = sh.share.needs_index[i];
    }
  RETURN_IF_ERROR(CheckSelection(spec, query_pos, needs, sel));
  std::vector<int64_t> first(tokens + 1, 0);
  for (int64_t t = 0; t < tokens; ++t) first[t + 1] = first[t] + sel.count[t];
  kept->assign(plan.shares.size(), {});
  for (size_t k = 0; k < plan.shares.size(); ++k) {
    const StepShare& sh = plan.shares[k].share;
    auto& mine = (*kept)[k];
    mine.assign(sh.size(), {});
    for (int64_t i = 0; i < sh.size(); ++i) {
      if (!sh.needs_index[i]) continue;
      const int64_t t = sh.rows[i];
      LocalSelection(spec, sel.count[t], sel.keys.data() + first[t], sel.scores.data() + first[t],
                     sh.query_pos[i], sh.offset[i], sh.pos[i] + 1, &mine[i]);
    }
  }
  return absl::OkStatus();
}

Candidates GatherCandidates(const ModelSpec& s, const StepPlan& plan, int64_t tokens,
                            const std::vector<std::vector<LayerCall::LocalCandidates>>& local) {
  std::vector<const LayerCall::LocalCandidates*> by_row(tokens, nullptr);
  std::vector<int64_t> shift(tokens, 0);
  const bool pages = s.selection == SelectionMode::kPageBudget;
  for (size_t k = 0; k < plan.shares.size(); ++k) {
    const StepShare& sh = plan.shares[k].share;
    for (int64_t i = 0; i < sh.size(); ++i) {
      by_row[sh.rows[i]] = &local[k][i];
      shift[sh.rows[i]] = pages ? sh.offset[i] / s.page_size : sh.offset[i];
    }
  }
  Candidates c;
  c.pages = pages;
  c.keep = CandidatesPerQuery(s);
  for (int64_t t = 0; t < tokens; ++t) {
    const LayerCall::LocalCandidates& l = *by_row[t];
    c.count.push_back(static_cast<int32_t>(l.keys.size()));
    for (size_t j = 0; j < l.keys.size(); ++j) {
      c.keys.push_back(l.keys[j] + shift[t]);
      c.scores.push_back(l.scores[j]);
    }
  }
  return c;
}

}  // namespace attnd
