// How a kernel finds a sequence's cached rows: a page table over one cache buffer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"

namespace attnd {

// Row `pos` of a sequence lives at base + pages[pos / page_size] * page_stride
//   + (pos % page_size) * row_stride. Shared by host bookkeeping and every backend.
struct PagedRows {
  const uint8_t* base = nullptr;   // the layer's (or indexer slot's) cache buffer
  const int32_t* pages = nullptr;  // [num_pages of the sequence] physical page ids
  int32_t page_size = 0;           // tokens per page
  size_t page_stride = 0;          // bytes between pages
  size_t row_stride = 0;           // bytes between rows inside a page
  DType dtype = DType::kBF16;      // element type of the rows
  int dim = 0;                     // elements per row

  const uint8_t* Row(int64_t pos) const {
    return base + static_cast<size_t>(pages[pos / page_size]) * page_stride +
           static_cast<size_t>(pos % page_size) * row_stride;
  }
};

}  // namespace attnd
