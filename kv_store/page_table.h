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
struct CacheRows {
  const uint8_t* base = nullptr;  // the layer's first row (slot 0)
  size_t row_bytes = 0;           // bytes per row
  DType dtype = DType::kBF16;     // element type of the rows
  int dim = 0;                    // elements per row

  ATTND_HD const uint8_t* Row(int64_t slot) const {
    return base + static_cast<size_t>(slot) * row_bytes;
  }
  ATTND_HD uint8_t* MutableRow(int64_t slot) const { return const_cast<uint8_t*>(Row(slot)); }
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

// A page prefix copy: rows [0, rows) of page `src` to page `dst`, in every layer and slot.
struct PageCopy {
  int32_t src = 0;
  int32_t dst = 0;
  int rows = 0;
};

}  // namespace attnd
