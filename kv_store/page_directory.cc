#include "kv_store/page_directory.h"

#include <cstdio>
#include <cstdlib>

namespace attnd {

const char* TierName(Tier tier) {
  switch (tier) {
    case Tier::kDevice:
      return "device";
    case Tier::kHost:
      return "host";
    case Tier::kDisk:
      return "disk";
  }
  return "?";
}

int32_t PageDirectory::Add(int device, Tier tier, int32_t slot, Tier holder) {
  int32_t id;
  if (free_.empty()) {
    id = static_cast<int32_t>(entries_.size());
    entries_.emplace_back();
  } else {
    id = free_.back();
    free_.pop_back();
  }
  Entry& e = entries_[id];
  e = Entry();
  e.device = device;
  e.tier = tier;
  e.slot = slot;
  e.holders[static_cast<int>(holder)] = 1;
  e.live = true;
  return id;
}

void PageDirectory::Remove(int32_t id) {
  // A page removed while held would hand its slot to another sequence: never go on.
  if (!live(id) || entries_[id].refs() != 0) {
    std::fprintf(stderr, "attnd: PageDirectory::Remove(%d): not a free page\n", id);
    std::abort();
  }
  entries_[id].live = false;
  free_.push_back(id);
}

}  // namespace attnd
