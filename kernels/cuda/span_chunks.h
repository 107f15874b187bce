// Page moves between GPUs as a few large transfers instead of one per span: every layer's rows
// of every page prefix are spans (thousands per sequence: a 128K-token DeepSeek-V3.2 sequence
// is about 250,000), packed back to back into a staging buffer on the source GPU by one kernel
// per chunk, sent as one transfer (NCCL send/recv or a peer copy), and unpacked on the
// destination by one kernel. Plain C++: the plan is tested on machines without a GPU
// (tests/span_chunks_test.cc); kernels/cuda/cuda_pages.cc moves the bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

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

}  // namespace attnd::cuda
