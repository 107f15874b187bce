// A pool of fixed-size cache pages with reference counts, for one device.
#pragma once

#include <cstdint>
#include <vector>

#include "kv_store/slot_pool.h"

namespace attnd {

// Page ids are 0..num_pages-1. Page 0 is reserved: never handed out, so padding writes can land
// there without touching a live page. Not thread safe: the owner serialises calls.
class PagePool {
 public:
  explicit PagePool(int32_t num_pages);

  int32_t num_pages() const { return static_cast<int32_t>(refcount_.size()); }
  // Pages that can be handed out (page 0 excluded).
  int32_t usable_pages() const { return num_pages() - 1; }
  int32_t free_pages() const { return slots_.free_slots(); }
  int32_t used_pages() const { return usable_pages() - free_pages(); }
  int32_t refcount(int32_t page) const { return refcount_[page]; }

  // Appends n fresh pages (refcount 1) to *out, or appends nothing and returns false when fewer
  // than n are free.
  bool Allocate(int32_t n, std::vector<int32_t>* out);
  // Adds a reference to a live page (prefix sharing). A page that is free, reserved (0) or out
  // of range aborts the process, in every build: a count gone wrong would hand one sequence's
  // page to another.
  void Ref(int32_t page);
  // Drops a reference; the page returns to the free list at zero. Aborts as Ref does.
  void Unref(int32_t page);

 private:
  std::vector<int32_t> refcount_;
  SlotPool slots_;  // which pages are free (page 0 taken for good); lowest ids handed out first
};

}  // namespace attnd
