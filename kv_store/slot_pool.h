// A tier's slots (the host or disk tier of kv_store/page_directory.h): which are free. A slot holds
// one page's bytes; the directory entry occupying it counts its holders. Not thread safe: the
// sequence table calls it under the engine's lock.
#pragma once

#include <cstdint>
#include <vector>

namespace attnd {

class SlotPool {
 public:
  explicit SlotPool(int32_t slots);
  int32_t slots() const { return static_cast<int32_t>(used_.size()); }
  int32_t free_slots() const { return static_cast<int32_t>(free_.size()); }
  int32_t used_slots() const { return slots() - free_slots(); }
  bool used(int32_t slot) const { return used_[slot]; }
  // Appends n slots to *out, or nothing and false when fewer than n are free.
  bool Allocate(int32_t n, std::vector<int32_t>* out);
  // A slot that is not in use aborts the process (a count gone wrong would hand one page's bytes
  // to another), in every build.
  void Free(int32_t slot);

 private:
  std::vector<uint8_t> used_;
  std::vector<int32_t> free_;  // a stack; lowest slots first
};

}  // namespace attnd
