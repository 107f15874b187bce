// The sequence table's page accounting: a page's entry in the directory, its holders by tier
// (a page goes when nothing holds it), and the slots of each tier that hold its bytes.
#include "kv_store/sequence_table.h"

namespace attnd {

int32_t SequenceTable::NewPage(int device, int32_t page) {
  const int32_t id = dir_.Add(device, Tier::kDevice, page, Tier::kDevice);
  owner_[device][page] = id;
  return id;
}

void SequenceTable::Hold(int32_t id, Tier holder) {
  PageDirectory::Entry& e = dir_.at(id);
  const bool was = CacheOnly(e);
  ++e.holders[static_cast<int>(holder)];
  if (e.tier == Tier::kDevice) pools_[e.device].Ref(e.slot);
  cache_only_ += int{CacheOnly(e)} - int{was};
}

void SequenceTable::Drop(int32_t id, Tier holder) {
  PageDirectory::Entry& e = dir_.at(id);
  const bool was = CacheOnly(e);
  --e.holders[static_cast<int>(holder)];
  if (e.tier == Tier::kDevice) pools_[e.device].Unref(e.slot);  // its last: the page is free
  cache_only_ += int{CacheOnly(e)} - int{was};
  RemoveIfUnheld(id);
}

void SequenceTable::RemoveIfUnheld(int32_t id) {
  const PageDirectory::Entry& e = dir_.at(id);
  // A moving page without holders goes at EndTierMove, a page being read at UnpinTierRows.
  if (e.refs() > 0 || e.busy()) return;
  if (e.tier == Tier::kDevice) owner_[e.device][e.slot] = -1;
  if (e.tier == Tier::kHost) host_.Free(e.slot);
  if (e.tier == Tier::kDisk) disk_.Free(e.slot);
  dir_.Remove(id);
}

bool SequenceTable::Reserve(Tier tier, int device, int32_t* slot) {
  if (FreeSlots(tier, device) == 0) MakeFree(tier, device, 1);
  std::vector<int32_t> got;
  const bool ok = tier == Tier::kDevice ? pools_[device].Allocate(1, &got)
                  : tier == Tier::kHost ? host_.Allocate(1, &got)
                                        : disk_.Allocate(1, &got);
  if (ok) *slot = got[0];
  return ok;
}

void SequenceTable::FreeSlot(Tier tier, int device, int32_t slot) {
  if (tier == Tier::kDevice) {
    pools_[device].Unref(slot);
    owner_[device][slot] = -1;
  } else if (tier == Tier::kHost) {
    host_.Free(slot);
  } else {
    disk_.Free(slot);
  }
}

}  // namespace attnd
