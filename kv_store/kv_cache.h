// A device's paged latent-KV and indexer-key caches in host memory (the CPU backend's storage),
// laid out as CacheLayout describes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "kv_store/cache_layout.h"
#include "kv_store/page_table.h"

namespace attnd {

// Memory is mapped lazily (untouched pages cost nothing). Rows are plain bytes: callers convert.
// Thread safety: concurrent access to distinct rows is safe; the cache itself holds no locks.
class KvCache {
 public:
  static absl::StatusOr<KvCache> Create(const CacheLayout& layout);
  KvCache(KvCache&& other) noexcept;
  KvCache& operator=(KvCache&& other) noexcept;
  ~KvCache();

  const CacheLayout& layout() const { return layout_; }
  // A layer's latent rows and a full layer's (slot's) indexer rows, by global slot id.
  CacheRows Latent(int layer) const { return layout_.Latent(base_, layer); }
  CacheRows Index(int slot) const { return layout_.Index(base_, slot); }
  uint8_t* LatentRow(int layer, int32_t page, int offset) const {
    return Latent(layer).MutableRow(int64_t{page} * layout_.page_size + offset);
  }
  // A page's first byte of a full layer's indexer rows (CacheLayout::IndexRanges from there).
  uint8_t* IndexPage(int slot, int32_t page) const {
    return base_ + layout_.IndexPageOffset(slot, page);
  }

 private:
  KvCache() = default;
  CacheLayout layout_;
  uint8_t* base_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace attnd
