// The one description of a device's cache layout: sizes, where every row lives, and how a page is
// staged in host memory when it moves between devices. Every backend and the engine use it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "kv_store/page_table.h"

namespace attnd {

struct ModelSpec;

// Layout of one device's cache, one allocation:
//   latent[layer][page][offset][L+R] | index[slot][page][offset][Di]    (row-major, `dtype`)
// A row is addressed by its global slot id, slot = page * page_size + offset (FlashMLA's global
// indices): a layer's rows start at LatentOffset(layer) and row `slot` is slot rows further.
// An fp8 cache (dtype kFP8E4M3, docs/architecture.md) has the same shape with other rows: a latent
// row is [L e4m3 | one fp32 scale per tile | R bf16] (common/fp8.h), and a page of indexer rows
// holds its page_size rows of Di e4m3 values, then their page_size fp32 scales (DeepGEMM's paged
// layout).
struct CacheLayout {
  int num_layers = 0;
  int num_full_layers = 0;  // indexer-key slots
  int page_size = 64;
  int latent_dim = 576;  // L + R
  int rope_dim = 64;     // R
  int index_dim = 128;   // Di
  DType dtype = DType::kBF16;
  int32_t num_pages = 0;  // including the reserved page 0

  static CacheLayout ForModel(const ModelSpec& spec, DType dtype, int32_t num_pages);
  // The layout of a device with `pages` pages (page 0 included) or, when pages is 0, as many as
  // fit in `bytes`. INVALID_ARGUMENT when slot ids would not fit in 32 bits (every kernel's).
  static absl::StatusOr<CacheLayout> ForCapacity(const ModelSpec& spec, DType dtype, int32_t pages,
                                                 size_t bytes);

  bool fp8() const { return dtype == DType::kFP8E4M3; }
  int kv_lora_rank() const { return latent_dim - rope_dim; }  // L
  // Bytes per token: a latent row, and an indexer row with (fp8) its scale.
  size_t latent_row_bytes() const;
  size_t index_row_bytes() const;
  size_t slots() const { return static_cast<size_t>(num_pages) * page_size; }
  // Byte offsets inside the allocation of a layer's latent rows and a full layer's indexer rows.
  size_t LatentOffset(int layer) const { return layer * slots() * latent_row_bytes(); }
  size_t IndexOffset(int slot) const {
    return num_layers * slots() * latent_row_bytes() + slot * slots() * index_row_bytes();
  }
  size_t TotalBytes() const { return IndexOffset(num_full_layers); }
  // A layer's latent rows and a full layer's (slot's) indexer rows in the allocation at `base`.
  CacheRows Latent(const uint8_t* base, int layer) const;
  CacheRows Index(const uint8_t* base, int slot) const;
  // Where rows [first, first + rows) of one page of a full layer's indexer rows lie, as byte
  // ranges from the page's first byte: the rows, or in an fp8 cache their values, then their
  // scales (the second range is empty otherwise). Staged and exported copies keep the ranges in
  // this order, back to back: rows * index_row_bytes() bytes in all.
  struct ByteRange {
    size_t offset = 0, bytes = 0;
  };
  std::array<ByteRange, 2> IndexRanges(int first, int rows) const;
  // Byte offset in the allocation of a page's first indexer row (or value) of a full layer.
  size_t IndexPageOffset(int slot, int32_t page) const {
    return IndexOffset(slot) + static_cast<size_t>(page) * page_size * index_row_bytes();
  }
  // Bytes one page costs across every layer (latent rows) and full layer (indexer rows).
  size_t BytesPerPage() const;
  // Pages (including page 0) that fit in `bytes`.
  int32_t PagesForBytes(size_t bytes) const;

  // A page's first `rows` rows staged in host memory (moves between devices of different kinds):
  //   [layer 0 rows | ... | layer n-1 rows | slot 0 index rows | ...], each block rows x row bytes.
  size_t StagedBytes(int rows) const {
    return static_cast<size_t>(rows) *
           (num_layers * latent_row_bytes() + num_full_layers * index_row_bytes());
  }
  size_t StagedLatent(int layer, int rows) const {
    return static_cast<size_t>(layer) * rows * latent_row_bytes();
  }
  size_t StagedIndex(int slot, int rows) const {
    return static_cast<size_t>(rows) * num_layers * latent_row_bytes() +
           static_cast<size_t>(slot) * rows * index_row_bytes();
  }
  // Rows [first, first + rows) of `layer` and, when slot >= 0, of that full layer's indexer rows,
  // from a whole page staged as above (page_size rows: how the host and disk tiers hold it), to
  // `latent` and `index` as Device::ReadRows gives them from the device.
  void StagedPageRows(const uint8_t* staged, int layer, int slot, int first, int rows,
                      uint8_t* latent, uint8_t* index) const;
};

}  // namespace attnd
