#include "kv_store/kv_cache.h"

#include <sys/mman.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace attnd {

absl::StatusOr<KvCache> KvCache::Create(const CacheLayout& layout) {
  if (layout.num_pages < 2)
    return absl::InvalidArgumentError(
        absl::StrCat("KV cache needs at least 2 pages (page 0 is reserved), got ", layout.num_pages,
                     "; one page costs ", layout.BytesPerPage(), " bytes"));
  KvCache c;
  c.layout_ = layout;
  c.bytes_ = layout.TotalBytes();
  void* p = mmap(nullptr, c.bytes_, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", c.bytes_, " bytes of host memory for the KV cache"));
  // Transparent huge pages where the host allows them (THP "madvise" or "always"): attention
  // gathers rows scattered over the whole cache, and with 4 KiB pages nearly every row is a TLB
  // miss. Only advice: without THP the cache works the same on small pages.
  (void)madvise(p, c.bytes_, MADV_HUGEPAGE);
  c.base_ = static_cast<uint8_t*>(p);
  return c;
}

KvCache::KvCache(KvCache&& o) noexcept { *this = std::move(o); }

KvCache& KvCache::operator=(KvCache&& o) noexcept {
  if (this != &o) {
    if (base_) munmap(base_, bytes_);
    layout_ = o.layout_;
    base_ = std::exchange(o.base_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

KvCache::~KvCache() {
  if (base_) munmap(base_, bytes_);
}

}  // namespace attnd
