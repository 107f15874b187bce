// Engine::ReadRows (engine/engine.h): a sequence's cached rows of one layer, read where they are
// (device, host or disk tier) with their pages pinned meanwhile, for exports, drains and standby
// copies. Moved out of engine.cc unchanged.
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/guarded.h"
#include "common/status_macros.h"
#include "engine/engine.h"
#include "engine/engine_impl.h"
#include "engine/row_reader.h"

namespace attnd {

absl::StatusOr<Engine::LayerRows> Engine::ReadRows(const SequenceKey& seq, int layer, int64_t begin,
                                                   int64_t end) const {
  const ModelSpec& s = impl_->spec();
  int device = 0;
  std::vector<int32_t> pages;  // on the device: the pages holding [begin, end), pinned while read
  std::vector<TierPin> pins;   // off it: the same pages where they are
  bool off_device = false;
  if (layer < 0 || layer >= s.num_layers())
    return absl::OutOfRangeError(
        absl::StrCat("layer ", layer, " outside [0, ", s.num_layers(), ")"));
  {
    EngineLock lock(impl_->mu);
    if (impl_->tiers_on() && impl_->table->Find(seq) != nullptr) {
      // A spilled sequence is read where it is: exports, drains and standby copies leave the
      // device to the sequences in use (docs/architecture.md#tiers).
      RETURN_IF_ERROR(impl_->LiftForRead(lock, seq));
      off_device = impl_->table->Find(seq)->tier != Tier::kDevice;
    }
    RETURN_IF_ERROR(off_device ? impl_->table->PinTierRows(seq, begin, end, &device, &pins)
                               : impl_->table->PinRows(seq, begin, end, &device, &pages));
  }
  LayerRows out;
  const absl::Status read = Guarded([&] {
    return off_device ? impl_->ReadTierRows(device, layer, pins, begin, end, &out)
                      : ReadLayerRows(*impl_->devices[device], s, layer, pages, begin, end, &out);
  });
  std::lock_guard<EngineMutex> lock(impl_->mu);
  if (off_device) {
    impl_->table->UnpinTierRows(pins);
  } else {
    impl_->table->Unpin(device, pages);
  }
  impl_->step_ended.notify_all();  // its pages may move now (MakeRoom, AwaitSettled wait for that)
  if (!read.ok()) return read;
  return out;
}

absl::StatusOr<std::vector<BlockHash>> Engine::CompletedBlockHashes(const SequenceKey& seq,
                                                                    int64_t begin,
                                                                    int64_t end) const {
  const int64_t page = impl_->spec().page_size;
  std::lock_guard<EngineMutex> lock(impl_->mu);
  const Sequence* s = impl_->table->Find(seq);
  if (s == nullptr) return impl_->table->NotFound(seq);
  const int64_t first = begin / page, last = end / page;  // blocks [first, last)
  if (begin < 0 || end > s->length || begin > end || static_cast<int64_t>(s->hashes.size()) < last)
    return std::vector<BlockHash>();
  return std::vector<BlockHash>(s->hashes.begin() + first, s->hashes.begin() + last);
}

}  // namespace attnd
