#include "kv_store/slot_pool.h"

#include <cstdio>
#include <cstdlib>

namespace attnd {

SlotPool::SlotPool(int32_t slots) : used_(slots < 0 ? 0 : slots, 0) {
  free_.reserve(used_.size());
  for (int32_t s = this->slots() - 1; s >= 0; --s) free_.push_back(s);
}

bool SlotPool::Allocate(int32_t n, std::vector<int32_t>* out) {
  if (n < 0 || n > free_slots()) return false;
  out->reserve(out->size() + n);  // may throw: before any state changes
  for (int32_t i = 0; i < n; ++i) {
    const int32_t s = free_.back();
    free_.pop_back();
    used_[s] = 1;
    out->push_back(s);
  }
  return true;
}

void SlotPool::Free(int32_t slot) {
  if (slot < 0 || slot >= slots() || !used_[slot]) {
    std::fprintf(stderr, "attnd: SlotPool::Free(%d): not a slot in use\n", slot);
    std::abort();
  }
  used_[slot] = 0;
  free_.push_back(slot);
}

}  // namespace attnd
