// Page moves between GPUs as a few large transfers instead of one per span: every layer's rows
// of every page prefix are spans (thousands per sequence: a 128K-token DeepSeek-V3.2 sequence
// is about 250,000), packed back to back into a staging buffer on the source GPU by one kernel
// per chunk, sent as one transfer (NCCL send/recv or a peer copy), and unpacked on the
// destination by one kernel. Plain C++: the plan is tested on machines without a GPU
// (tests/unit/span_chunks_test.cc); kernels/cuda/backend/cuda_pages.cc moves the bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kv_store/cache_layout.h"

namespace attnd::cuda {

// `bytes` from `src` to `dst` (device addresses). Also the table entry CopySpans kernels read.
struct SpanCopy {
  const uint8_t* src = nullptr;
  uint8_t* dst = nullptr;
  uint64_t bytes = 0;
};

// Staging offsets are multiples of this, so aligned spans copy in 16-byte pieces.
inline constexpr size_t kSpanAlign = 16;

// Spans cut into pieces of at most chunk_bytes, each piece placed at a staging offset, and the
// pieces grouped into chunks whose staged bytes fit one staging buffer of chunk_bytes.
struct SpanChunks {
  struct Chunk {
    size_t first = 0, count = 0;  // pieces [first, first + count)
    size_t bytes = 0;             // staged bytes [0, bytes) of the chunk (padding included)
  };
  std::vector<SpanCopy> pieces;  // the spans in order, the long ones cut
  std::vector<size_t> offset;    // [pieces] where each piece sits in its chunk's staging
  std::vector<Chunk> chunks;
  // The tables the two kernels of chunk-wise moves read: gather[i] = pieces[i] from its source
  // into `src_staging` at offset[i]; scatter[i] from `dst_staging` at offset[i] to its
  // destination.
  std::vector<SpanCopy> GatherTable(uint8_t* src_staging) const;
  std::vector<SpanCopy> ScatterTable(const uint8_t* dst_staging) const;
};

// chunk_bytes must be a positive multiple of kSpanAlign. Spans of 0 bytes are dropped.
SpanChunks PlanSpanChunks(const std::vector<SpanCopy>& spans, size_t chunk_bytes);

// A tier move's whole pages between a GPU's cache and host memory (the host tier's pinned
// slots, or the disk tier's staging), as few operations as the bytes allow: the pages' staged
// forms (CacheLayout::StagedBytes) lie back to back in a device staging buffer, `per_chunk`
// pages at a time `stride` bytes apart. Per chunk, one span-table kernel moves every layer's
// rows of its pages between the cache and the staging, and one copy per page moves a staged
// page between the staging and its host buffer; all on the copy stream, waited for once. A
// 32K-token DeepSeek-V3.2 sequence (fp8) is 512 pages: 93,696 row spans, 25 kernels and 512
// copies instead of 93,696 copies.
struct PageStaging {
  size_t page_bytes = 0;  // StagedBytes(page_size)
  size_t stride = 0;      // page_bytes rounded up to kSpanAlign
  size_t per_chunk = 0;   // pages per staging chunk (at least 1)
  // [pages]: each page's spans, page i's at [first[i], first[i + 1]); cache -> staging when
  // `to_staging` (a spill), staging -> cache otherwise (a restore). Page i sits at
  // staging + (i % per_chunk) * stride.
  std::vector<SpanCopy> spans;
  std::vector<size_t> first;
  size_t chunks() const {
    return per_chunk == 0 ? 0 : (first.size() - 1 + per_chunk - 1) / per_chunk;
  }
  size_t staging_bytes() const { return per_chunk * stride; }
};

// The staging a plan of `layout`'s pages with chunks of at most `max_staging_bytes` uses
// (its staging_bytes()): what fits of them, or one page's staged form where that is larger
// (DeepSeek-V3.2 at page_size 1024, bf16: 88 MB a page).
size_t PageStagingBytes(const CacheLayout& layout, size_t max_staging_bytes);

// `cache` is the GPU's allocation (laid out by `layout`), `staging` a device buffer of at least
// PageStagingBytes(layout, max_staging_bytes) (per_chunk is what fits, at least one page).
PageStaging PlanPageStaging(const CacheLayout& layout, uint8_t* cache,
                            const std::vector<int32_t>& pages, uint8_t* staging,
                            size_t max_staging_bytes, bool to_staging);

}  // namespace attnd::cuda
