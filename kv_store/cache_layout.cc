#include "kv_store/cache_layout.h"

#include "absl/strings/str_cat.h"
#include "common/model_spec.h"

namespace attnd {

CacheLayout CacheLayout::ForModel(const ModelSpec& spec, DType dtype, int32_t num_pages) {
  CacheLayout c;
  c.num_layers = spec.num_layers();
  c.num_full_layers = spec.num_full_layers();
  c.page_size = spec.page_size;
  c.latent_dim = spec.latent_dim();
  c.index_dim = spec.index_head_dim;
  c.dtype = dtype;
  c.num_pages = num_pages;
  return c;
}

absl::StatusOr<CacheLayout> CacheLayout::ForCapacity(const ModelSpec& spec, DType dtype,
                                                     int32_t pages, size_t bytes) {
  CacheLayout c = ForModel(spec, dtype, 0);
  c.num_pages = pages > 0 ? pages : c.PagesForBytes(bytes);
  const int64_t max_pages = (int64_t{1} << 31) / spec.page_size;
  if (c.num_pages > max_pages)
    return absl::InvalidArgumentError(absl::StrCat(
        "KV cache of ", c.num_pages, " pages per device: at most ", max_pages, " pages of ",
        spec.page_size, " tokens (32-bit slot ids); lower the cache size"));
  return c;
}

size_t CacheLayout::BytesPerPage() const {
  return static_cast<size_t>(page_size) *
         (num_layers * latent_row_bytes() + num_full_layers * index_row_bytes());
}

int32_t CacheLayout::PagesForBytes(size_t bytes) const {
  const size_t n = bytes / BytesPerPage();
  return static_cast<int32_t>(n > (1u << 30) ? (1u << 30) : n);
}

}  // namespace attnd
