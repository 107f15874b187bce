// The paged latent-KV and indexer-key caches of one device, in host memory.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/model_spec.h"

namespace attnd {

// Sizes a device's cache. Separate from the cache so callers can size before allocating.
struct KvCacheConfig {
  int num_layers = 0;
  int num_full_layers = 0;  // indexer-key slots
  int page_size = 64;
  int latent_dim = 576;  // L + R
  int index_dim = 128;   // Di
  DType dtype = DType::kBF16;
  int32_t num_pages = 0;  // including the reserved page 0

  static KvCacheConfig ForModel(const ModelSpec& spec, DType dtype, int32_t num_pages);
  // Bytes one page costs across every layer (latent rows) and full layer (indexer rows).
  size_t BytesPerPage() const;
  // Pages (including page 0) that fit in `bytes`.
  int32_t PagesForBytes(size_t bytes) const;
};

// Layout: latent[layer][page][offset][L+R], index[slot][page][offset][Di], row-major, `dtype`.
// Memory is mapped lazily (untouched pages cost nothing). Rows are plain bytes: callers convert.
// Thread safety: concurrent access to distinct rows is safe; the cache itself holds no locks.
class KvCache {
 public:
  static absl::StatusOr<KvCache> Create(const KvCacheConfig& config);
  KvCache(KvCache&& other) noexcept;
  KvCache& operator=(KvCache&& other) noexcept;
  ~KvCache();

  const KvCacheConfig& config() const { return config_; }
  size_t latent_row_bytes() const { return config_.latent_dim * DTypeSize(config_.dtype); }
  size_t index_row_bytes() const { return config_.index_dim * DTypeSize(config_.dtype); }

  uint8_t* LatentRow(int layer, int32_t page, int offset) const {
    return latent_ +
           ((static_cast<size_t>(layer) * config_.num_pages + page) * config_.page_size + offset) *
               latent_row_bytes();
  }
  uint8_t* IndexRow(int slot, int32_t page, int offset) const {
    return index_ +
           ((static_cast<size_t>(slot) * config_.num_pages + page) * config_.page_size + offset) *
               index_row_bytes();
  }
  // Copies the first `tokens` rows of page `src` to page `dst` in every layer and slot.
  void CopyPagePrefix(int32_t src, int32_t dst, int tokens) const;
  // The same into another cache of the same config (another device's pool).
  void CopyPagePrefixTo(const KvCache& dst_cache, int32_t src, int32_t dst, int tokens) const;

 private:
  KvCache() = default;
  KvCacheConfig config_;
  uint8_t* base_ = nullptr;
  size_t bytes_ = 0;
  uint8_t* latent_ = nullptr;
  uint8_t* index_ = nullptr;
};

}  // namespace attnd
