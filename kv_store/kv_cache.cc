#include "kv_store/kv_cache.h"

#include <sys/mman.h>

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attnd {

KvCacheConfig KvCacheConfig::ForModel(const ModelSpec& spec, DType dtype, int32_t num_pages) {
  KvCacheConfig c;
  c.num_layers = spec.num_layers();
  c.num_full_layers = spec.num_full_layers();
  c.page_size = spec.page_size;
  c.latent_dim = spec.latent_dim();
  c.index_dim = spec.index_head_dim;
  c.dtype = dtype;
  c.num_pages = num_pages;
  return c;
}

size_t KvCacheConfig::BytesPerPage() const {
  return static_cast<size_t>(page_size) * DTypeSize(dtype) *
         (static_cast<size_t>(num_layers) * latent_dim +
          static_cast<size_t>(num_full_layers) * index_dim);
}

int32_t KvCacheConfig::PagesForBytes(size_t bytes) const {
  const size_t n = bytes / BytesPerPage();
  return static_cast<int32_t>(n > (1u << 30) ? (1u << 30) : n);
}

absl::StatusOr<KvCache> KvCache::Create(const KvCacheConfig& config) {
  if (config.num_pages < 2)
    return absl::InvalidArgumentError(
        absl::StrCat("KV cache needs at least 2 pages (page 0 is reserved), got ", config.num_pages,
                     "; one page costs ", config.BytesPerPage(), " bytes"));
  KvCache c;
  c.config_ = config;
  const size_t latent = static_cast<size_t>(config.num_layers) * config.num_pages *
                        config.page_size * c.latent_row_bytes();
  const size_t index = static_cast<size_t>(config.num_full_layers) * config.num_pages *
                       config.page_size * c.index_row_bytes();
  c.bytes_ = latent + index;
  void* p = mmap(nullptr, c.bytes_, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", c.bytes_, " bytes of host memory for the KV cache"));
  c.base_ = static_cast<uint8_t*>(p);
  c.latent_ = c.base_;
  c.index_ = c.base_ + latent;
  return c;
}

KvCache::KvCache(KvCache&& o) noexcept { *this = std::move(o); }

KvCache& KvCache::operator=(KvCache&& o) noexcept {
  if (this != &o) {
    if (base_) munmap(base_, bytes_);
    config_ = o.config_;
    base_ = std::exchange(o.base_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    latent_ = std::exchange(o.latent_, nullptr);
    index_ = std::exchange(o.index_, nullptr);
  }
  return *this;
}

KvCache::~KvCache() {
  if (base_) munmap(base_, bytes_);
}

void KvCache::CopyPagePrefix(int32_t src, int32_t dst, int tokens) const {
  CopyPagePrefixTo(*this, src, dst, tokens);
}

void KvCache::CopyPagePrefixTo(const KvCache& d, int32_t src, int32_t dst, int tokens) const {
  if (tokens <= 0) return;
  for (int l = 0; l < config_.num_layers; ++l)
    std::memcpy(d.LatentRow(l, dst, 0), LatentRow(l, src, 0), tokens * latent_row_bytes());
  for (int s = 0; s < config_.num_full_layers; ++s)
    std::memcpy(d.IndexRow(s, dst, 0), IndexRow(s, src, 0), tokens * index_row_bytes());
}

}  // namespace attnd
