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

PagePool::PagePool(int32_t num_pages)
    : refcount_(num_pages < 1 ? 1 : num_pages, 0), slots_(num_pages < 1 ? 1 : num_pages) {
  std::vector<int32_t> reserved;
  slots_.Allocate(1, &reserved);  // page 0, the lowest: never handed out
  refcount_[0] = 1;
}

bool PagePool::Allocate(int32_t n, std::vector<int32_t>* out) {
  const size_t first = out->size();
  if (!slots_.Allocate(n, out)) return false;
  for (size_t i = first; i < out->size(); ++i) refcount_[(*out)[i]] = 1;
  return true;
}

void PagePool::Ref(int32_t page) {
  CheckReferenced(refcount_, page, "Ref");
  ++refcount_[page];
}

void PagePool::Unref(int32_t page) {
  CheckReferenced(refcount_, page, "Unref");
  if (--refcount_[page] == 0) slots_.Free(page);
}

}  // namespace attnd
