#include "kernels/device.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "common/status_macros.h"
#include "kernels/cpu/attention_cpu.h"

namespace attnd {

absl::Status Device::CopyPages(Device& dst, const std::vector<PageCopy>& copies) {
  std::vector<uint8_t> staged;
  for (const PageCopy& c : copies) {
    if (c.rows <= 0) continue;
    staged.resize(layout_.StagedBytes(c.rows));
    RETURN_IF_ERROR(ReadPage(c.src, c.rows, staged.data()));
    RETURN_IF_ERROR(dst.WritePage(c.dst, c.rows, staged.data()));
  }
  return absl::OkStatus();
}

void LocalCandidatesOf(const ModelSpec& spec, const float* sc, int64_t n,
                       LayerCall::LocalCandidates* out) {
  // Best first, ties to the lower key: what merging the servers' lists needs.
  std::vector<std::pair<float, int32_t>> best;
  if (spec.selection == SelectionMode::kPageBudget) {
    const int ps = spec.page_size;
    for (int64_t p = 0; p * ps < n; ++p) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t s = p * ps; s < std::min<int64_t>(n, (p + 1) * ps); ++s)
        top = std::max(top, cpu::RankKey(sc[s]));
      best.emplace_back(top, static_cast<int32_t>(p));
    }
  } else {
    thread_local std::vector<int32_t> topk;
    topk.resize(std::min<int64_t>(n, spec.index_topk));
    topk.resize(cpu::ExactTopK(sc, n, spec.index_topk, topk.data()));
    for (int32_t p : topk) best.emplace_back(cpu::RankKey(sc[p]), p);
  }
  const size_t keep = spec.selection == SelectionMode::kPageBudget
                          ? static_cast<size_t>(spec.page_budget)
                          : static_cast<size_t>(spec.index_topk);
  auto better = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  std::sort(best.begin(), best.end(), better);
  if (best.size() > keep) best.resize(keep);
  out->keys.clear();
  out->scores.clear();
  for (const auto& [score, key] : best) {
    out->keys.push_back(key);
    out->scores.push_back(score);
  }
}

}  // namespace attnd
