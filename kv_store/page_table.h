// How kernels find cached rows, on the host and on a GPU: the page tables of a step's sequences
// (CSR, FlashInfer's layout) and a cache buffer addressed by global slot id. Plain structs of
// pointers, free of Abseil and the STL, so CUDA kernels take them as parameters unchanged.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "common/host_device.h"

namespace attnd {

// One layer's latent rows (or one full layer's indexer rows) of a cache: row `slot` of the layer,
// slot = page * page_size + offset, lives at base + slot * row_bytes.
// fp8 rows (dtype kFP8E4M3, docs/architecture.md): the row starts with fp8_dim e4m3 values. Latent
// rows keep one fp32 scale per tile right after them (fp8::LatentTiles) and then dim - fp8_dim bf16
// values. Indexer rows (scales_apart = page_size) keep their one scale apart: a page of them is its
// page_size rows of values, then their scales, so Row(slot) is where the row's values start.
struct CacheRows {
  const uint8_t* base = nullptr;  // the layer's first row (slot 0)
  size_t row_bytes = 0;           // bytes per row (fp8 indexer rows: values + scale)
  DType dtype = DType::kBF16;     // element type of the rows
  int dim = 0;                    // elements per row
  int fp8_dim = 0;                // fp8 rows: leading e4m3 values
  int32_t scales_apart = 0;       // fp8 indexer rows: the page size; 0 otherwise

  ATTND_HD const uint8_t* Row(int64_t slot) const {
    if (scales_apart == 0) return base + static_cast<size_t>(slot) * row_bytes;
    return PageStart(slot) + static_cast<size_t>(slot % scales_apart) * fp8_dim;
  }
  ATTND_HD uint8_t* MutableRow(int64_t slot) const { return const_cast<uint8_t*>(Row(slot)); }
  // fp8 rows: the first fp32 scale of the row.
  ATTND_HD const uint8_t* Scales(int64_t slot) const {
    if (scales_apart == 0) return Row(slot) + fp8_dim;
    return PageStart(slot) + static_cast<size_t>(scales_apart) * fp8_dim +
           static_cast<size_t>(slot % scales_apart) * 4;
  }

 private:
  ATTND_HD const uint8_t* PageStart(int64_t slot) const {
    return base + static_cast<size_t>(slot / scales_apart) * scales_apart * row_bytes;
  }
};

// The page tables of a batch of sequences: sequence s owns pages[indptr[s] .. indptr[s + 1]), in
// order, so its token at position pos lives in slot Slot(s, pos).
struct PageTable {
  const int32_t* indptr = nullptr;  // [num_sequences + 1]
  const int32_t* pages = nullptr;   // [indptr[num_sequences]] physical page ids
  int32_t page_size = 0;            // tokens per page

  ATTND_HD int64_t Slot(int32_t seq, int64_t pos) const {
    return static_cast<int64_t>(pages[indptr[seq] + pos / page_size]) * page_size + pos % page_size;
  }
};

// Where a step's queries find their keys: query q is token pos[q] of table sequence seq[q].
struct QueryTables {
  PageTable table;
  const int32_t* seq = nullptr;  // [n]
  const int64_t* pos = nullptr;  // [n] absolute position of each query
};

// A page prefix copy: rows [0, rows) of page `src` to page `dst`, in every layer and slot.
struct PageCopy {
  int32_t src = 0;
  int32_t dst = 0;
  int rows = 0;
};

}  // namespace attnd
