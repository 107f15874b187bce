#include "kv_store/page_pool.h"

#include <cstdio>
#include <cstdlib>

namespace attnd {
namespace {

// A reference count gone wrong would hand one sequence's (one tenant's) page to another: never
// go on. Checked in every build (an assert vanishes in the ones that serve).
void CheckReferenced(const std::vector<int32_t>& refcount, int32_t page, const char* op) {
  if (page > 0 && page < static_cast<int32_t>(refcount.size()) && refcount[page] > 0) return;
  std::fprintf(stderr, "attnd: PagePool::%s(page %d): not an allocated page (refcount %d)\n", op,
               page,
               page >= 0 && page < static_cast<int32_t>(refcount.size()) ? refcount[page] : -1);
  std::abort();
}

}  // namespace

PagePool::PagePool(int32_t num_pages) : refcount_(num_pages < 1 ? 1 : num_pages, 0) {
  refcount_[0] = 1;  // reserved forever
  free_.reserve(refcount_.size());
  for (int32_t p = this->num_pages() - 1; p >= 1; --p) free_.push_back(p);
}

bool PagePool::Allocate(int32_t n, std::vector<int32_t>* out) {
  if (n < 0 || n > free_pages()) return false;
  out->reserve(out->size() + n);  // may throw: before any state changes
  for (int32_t i = 0; i < n; ++i) {
    const int32_t p = free_.back();
    free_.pop_back();
    refcount_[p] = 1;
    out->push_back(p);
  }
  return true;
}

void PagePool::Ref(int32_t page) {
  CheckReferenced(refcount_, page, "Ref");
  ++refcount_[page];
}

void PagePool::Unref(int32_t page) {
  CheckReferenced(refcount_, page, "Unref");
  if (--refcount_[page] == 0) free_.push_back(page);
}

}  // namespace attnd
