#include "kernels/device.h"

#include "common/status_macros.h"
#include "kernels/selection.h"

namespace attnd {

LayerNeeds NeedsOf(const LayerCall& call) {
  LayerNeeds n;
  // Context-parallel calls may carry no key rows: another server holds the new tokens, or an
  // earlier call of the layer wrote them.
  n.keys = call.in->kv_latent.present;
  if (call.candidates != nullptr) {  // context parallelism: this slice's candidates, no attention
    n.indexer = true;
    return n;
  }
  if (call.out == nullptr) return n;  // write-only
  // A merged selection (context parallelism) is kept as given; otherwise full layers select.
  n.indexer = call.selection == nullptr && call.select;
  n.attend = true;
  return n;
}

absl::Status Device::RunLayer(const StepShare& share, DeviceStep& step, const LayerCall& call) {
  if (share.size() == 0) return absl::OkStatus();
  const LayerNeeds needs = NeedsOf(call);
  ASSIGN_OR_RETURN(const std::unique_ptr<LayerRun> run, StartLayer(share, step, call));
  if (needs.keys) RETURN_IF_ERROR(run->WriteKeys());
  if (call.candidates != nullptr) {  // this slice's candidates, no attention
    RETURN_IF_ERROR(run->Score([&](int64_t i, const float* scores, int64_t visible) {
      LayerCall::LocalCandidates& c = (*call.candidates)[i];
      LocalCandidatesOf(spec_, scores, visible, &c.keys, &c.scores);
    }));
    return run->Finish();
  }
  if (!needs.attend) return run->Finish();  // write-only
  // The selection, kept on the device for the layers that reuse it (IndexShare).
  if (call.selection != nullptr) {  // context parallelism: the merged selection's local part
    RETURN_IF_ERROR(run->Keep(*call.selection));
  } else if (needs.indexer) {
    RETURN_IF_ERROR(run->Select());
  }
  RETURN_IF_ERROR(run->Attend());
  return run->Finish();
}

absl::Status Device::ReadPages(const std::vector<int32_t>& pages,
                               const std::vector<uint8_t*>& staged) {
  for (size_t i = 0; i < pages.size(); ++i)
    RETURN_IF_ERROR(ReadPage(pages[i], layout_.page_size, staged[i]));
  return absl::OkStatus();
}

absl::Status Device::WritePages(const std::vector<int32_t>& pages,
                                const std::vector<const uint8_t*>& staged) {
  for (size_t i = 0; i < pages.size(); ++i)
    RETURN_IF_ERROR(WritePage(pages[i], layout_.page_size, staged[i]));
  return absl::OkStatus();
}

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

}  // namespace attnd
