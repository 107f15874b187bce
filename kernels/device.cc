#include "kernels/device.h"

#include <algorithm>
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
    cpu::PageMaxima(sc, n, spec.page_size, &best);
  } else {
    thread_local std::vector<int32_t> topk;
    topk.resize(std::min<int64_t>(n, spec.index_topk));
    topk.resize(cpu::ExactTopK(sc, n, spec.index_topk, topk.data()));
    for (int32_t p : topk) best.emplace_back(cpu::RankKey(sc[p]), p);
  }
  const size_t keep = static_cast<size_t>(CandidatesPerQuery(spec));
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
