#include "engine/step_plan.h"

#include <algorithm>

namespace attnd {

int64_t MaxSelected(const ModelSpec& spec, int64_t visible) {
  int64_t cap = spec.index_topk;
  if (spec.selection == SelectionMode::kPageUnion)
    cap = int64_t{spec.page_union_max_pages + 1} * spec.page_size;
  if (spec.selection == SelectionMode::kPageBudget)
    cap = int64_t{spec.page_budget + 1} * spec.page_size;
  return std::min(cap, visible);
}

namespace {

// Appends blocks of up to kQueryBlock consecutive local tokens [first, end) that satisfy `take`
// (the caller's tokens are of one sequence at consecutive positions).
template <typename Take>
void AppendBlocks(int32_t first, int32_t end, Take take, std::vector<QueryBlock>* out) {
  for (int32_t i = first; i < end;) {
    if (!take(i)) {
      ++i;
      continue;
    }
    int32_t n = 1;
    while (n < kQueryBlock && i + n < end && take(i + n)) ++n;
    out->push_back({i, n});
    i += n;
  }
}

}  // namespace

StepPlan StepPlan::Build(const ModelSpec& spec, const std::vector<PlanEntry>& batch,
                         bool write_only) {
  StepPlan plan;
  std::vector<int64_t> first_row(batch.size());
  int max_device = -1;
  for (size_t e = 0; e < batch.size(); ++e) {
    first_row[e] = plan.tokens;
    plan.tokens += batch[e].q_len;
    max_device = std::max(max_device, batch[e].device);
  }
  for (int d = 0; d <= max_device; ++d) {
    StepShare s;
    s.page_size = spec.page_size;
    s.write_only = write_only;
    s.indptr.push_back(0);
    int64_t max_visible = 1;
    for (size_t e = 0; e < batch.size(); ++e) {
      const PlanEntry& b = batch[e];
      if (b.device != d) continue;
      const int32_t seq = static_cast<int32_t>(s.indptr.size() - 1);
      s.pages.insert(s.pages.end(), b.pages->begin(), b.pages->end());
      s.indptr.push_back(static_cast<int32_t>(s.pages.size()));
      const int32_t first = static_cast<int32_t>(s.rows.size());
      // Dense prefill attends every visible key; otherwise only a query whose selection covers
      // every visible key can skip the indexer.
      const bool dense_prefill = spec.prefill == PrefillMode::kDense && b.q_len > 1;
      for (int64_t j = 0; j < b.q_len; ++j) {
        // An attend-only query sees every local key (they all precede it) and writes nothing
        // (its slot is the reserved page 0's, never written).
        const int64_t pos = b.attend_only ? b.length - 1 : b.length + j;
        const int64_t abs = b.attend_only ? b.query_pos + j : b.offset + pos;
        s.rows.push_back(first_row[e] + j);
        s.pos.push_back(pos);
        s.seq.push_back(seq);
        s.slot.push_back(b.attend_only ? 0 : static_cast<int32_t>(s.table().Slot(seq, pos)));
        // Whether the indexer runs is the whole sequence's question: its absolute position.
        s.needs_index.push_back(!write_only && !dense_prefill &&
                                !SelectsEveryVisibleKey(spec, abs + 1));
        if (b.context_parallel) {
          s.query_pos.push_back(abs);
          s.offset.push_back(b.offset);
        }
        max_visible = std::max(max_visible, pos + 1);
      }
      const int32_t end = static_cast<int32_t>(s.rows.size());
      // An import has no queries: nothing attends, no query blocks.
      if (write_only) continue;
      if (b.attend_only) {  // every query at the same local position: no shared causal ranges
        for (int32_t i = first; i < end; ++i) {
          s.dense_blocks.push_back({i, 1});
          if (!s.needs_index[i]) s.sparse_blocks.push_back({i, 1});
        }
      } else {
        AppendBlocks(
            first, end, [](int32_t) { return true; }, &s.dense_blocks);
        AppendBlocks(
            first, end, [&s](int32_t i) { return !s.needs_index[i]; }, &s.sparse_blocks);
      }
    }
    if (s.rows.empty()) continue;
    s.max_selected = write_only ? 0 : MaxSelected(spec, max_visible);
    plan.shares.push_back({d, std::move(s)});
  }
  return plan;
}

void TraceAttended(const ModelSpec& spec, LayerKind kind, const StepShare& share,
                   std::vector<std::vector<int32_t>>* selected,
                   std::vector<std::vector<int32_t>>* keys) {
  for (int64_t i = 0; i < share.size(); ++i) {
    auto& k = (*keys)[share.rows[i]];
    k.clear();
    if (kind == LayerKind::kDense || !share.needs_index[i]) {
      for (int64_t p = FirstVisibleKey(spec, kind, share.pos[i]); p <= share.pos[i]; ++p)
        k.push_back(static_cast<int32_t>(p));
    } else {
      k = std::move((*selected)[i]);
    }
    if (!share.offset.empty())  // context parallelism: local positions to absolute ones
      for (int32_t& p : k) p = static_cast<int32_t>(p + share.offset[i]);
  }
}

}  // namespace attnd
