#include "kv_store/cache_layout.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/fp8.h"
#include "common/model_spec.h"

namespace attnd {

CacheLayout CacheLayout::ForModel(const ModelSpec& spec, DType dtype, int32_t num_pages) {
  CacheLayout c;
  c.num_layers = spec.num_layers();
  c.num_full_layers = spec.num_full_layers();
  c.page_size = spec.page_size;
  c.latent_dim = spec.latent_dim();
  c.rope_dim = spec.qk_rope_head_dim;
  c.index_dim = spec.index_head_dim;
  c.dtype = dtype;
  c.num_pages = num_pages;
  return c;
}

absl::StatusOr<CacheLayout> CacheLayout::ForCapacity(const ModelSpec& spec, DType dtype,
                                                     int32_t pages, size_t bytes) {
  CacheLayout c = ForModel(spec, dtype, 0);
  if (c.fp8() && !fp8::LatentDimFits(spec.kv_lora_rank))
    return absl::InvalidArgumentError(
        absl::StrCat("an fp8 cache keeps the latent in tiles of 128 values: kv_lora_rank ",
                     spec.kv_lora_rank, " must be a multiple of 128 (at most 8192) or below 128"));
  c.num_pages = pages > 0 ? pages : c.PagesForBytes(bytes);
  const int64_t max_pages = (int64_t{1} << 31) / spec.page_size;
  if (c.num_pages > max_pages)
    return absl::InvalidArgumentError(absl::StrCat(
        "KV cache of ", c.num_pages, " pages per device: at most ", max_pages, " pages of ",
        spec.page_size, " tokens (32-bit slot ids); lower the cache size"));
  return c;
}

size_t CacheLayout::latent_row_bytes() const {
  if (fp8()) return fp8::LatentTokenBytes(kv_lora_rank(), rope_dim);
  return static_cast<size_t>(latent_dim) * DTypeSize(dtype);
}

size_t CacheLayout::index_row_bytes() const {
  if (fp8()) return fp8::IndexTokenBytes(index_dim);
  return static_cast<size_t>(index_dim) * DTypeSize(dtype);
}

CacheRows CacheLayout::Latent(const uint8_t* base, int layer) const {
  CacheRows r{base + LatentOffset(layer), latent_row_bytes(), dtype, latent_dim};
  if (fp8()) r.fp8_dim = kv_lora_rank();
  return r;
}

CacheRows CacheLayout::Index(const uint8_t* base, int slot) const {
  CacheRows r{base + IndexOffset(slot), index_row_bytes(), dtype, index_dim};
  if (fp8()) {
    r.fp8_dim = index_dim;
    r.scales_apart = page_size;
  }
  return r;
}

std::array<CacheLayout::ByteRange, 2> CacheLayout::IndexRanges(int first, int rows) const {
  if (!fp8()) return {{{first * index_row_bytes(), rows * index_row_bytes()}, {0, 0}}};
  const size_t values = static_cast<size_t>(page_size) * index_dim;
  return {{{static_cast<size_t>(first) * index_dim, static_cast<size_t>(rows) * index_dim},
           {values + 4 * static_cast<size_t>(first), 4 * static_cast<size_t>(rows)}}};
}

void CacheLayout::StagedPageRows(const uint8_t* staged, int layer, int slot, int first, int rows,
                                 uint8_t* latent, uint8_t* index) const {
  const size_t row = latent_row_bytes();
  std::memcpy(latent, staged + StagedLatent(layer, page_size) + first * row, rows * row);
  if (slot < 0) return;
  // A whole page's indexer rows are staged as the device holds the page (IndexRanges(0, ps)).
  const uint8_t* page = staged + StagedIndex(slot, page_size);
  for (const ByteRange& r : IndexRanges(first, rows)) {
    std::memcpy(index, page + r.offset, r.bytes);
    index += r.bytes;
  }
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
