#include "kernels/cuda/backend/span_chunks.h"

#include <algorithm>

namespace attnd::cuda {

SpanChunks PlanSpanChunks(const std::vector<SpanCopy>& spans, size_t chunk_bytes) {
  SpanChunks p;
  SpanChunks::Chunk chunk;
  auto close = [&] {
    if (chunk.count > 0) p.chunks.push_back(chunk);
    chunk = SpanChunks::Chunk();
    chunk.first = p.pieces.size();
  };
  for (const SpanCopy& s : spans) {
    for (uint64_t done = 0; done < s.bytes;) {
      size_t at = (chunk.bytes + kSpanAlign - 1) / kSpanAlign * kSpanAlign;
      if (at >= chunk_bytes) {  // this chunk is full
        close();
        at = 0;
      }
      const uint64_t take = std::min<uint64_t>(s.bytes - done, chunk_bytes - at);
      p.pieces.push_back({s.src + done, s.dst + done, take});
      p.offset.push_back(at);
      chunk.bytes = at + take;
      ++chunk.count;
      done += take;
    }
  }
  close();
  return p;
}

std::vector<SpanCopy> SpanChunks::GatherTable(uint8_t* src_staging) const {
  std::vector<SpanCopy> t(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i)
    t[i] = {pieces[i].src, src_staging + offset[i], pieces[i].bytes};
  return t;
}

std::vector<SpanCopy> SpanChunks::ScatterTable(const uint8_t* dst_staging) const {
  std::vector<SpanCopy> t(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i)
    t[i] = {dst_staging + offset[i], pieces[i].dst, pieces[i].bytes};
  return t;
}

namespace {

size_t StagedStride(const CacheLayout& layout) {
  return (layout.StagedBytes(layout.page_size) + kSpanAlign - 1) / kSpanAlign * kSpanAlign;
}

}  // namespace

size_t PageStagingBytes(const CacheLayout& layout, size_t max_staging_bytes) {
  const size_t stride = StagedStride(layout);
  return std::max<size_t>(1, max_staging_bytes / stride) * stride;
}

PageStaging PlanPageStaging(const CacheLayout& layout, uint8_t* cache,
                            const std::vector<int32_t>& pages, uint8_t* staging,
                            size_t max_staging_bytes, bool to_staging) {
  PageStaging plan;
  const int rows = layout.page_size;
  plan.page_bytes = layout.StagedBytes(rows);
  plan.stride = StagedStride(layout);
  plan.per_chunk = std::max<size_t>(1, max_staging_bytes / plan.stride);
  plan.first.reserve(pages.size() + 1);
  auto add = [&](uint8_t* in_cache, uint8_t* staged, size_t bytes) {
    if (bytes == 0) return;
    plan.spans.push_back(to_staging ? SpanCopy{in_cache, staged, bytes}
                                    : SpanCopy{staged, in_cache, bytes});
  };
  for (size_t i = 0; i < pages.size(); ++i) {
    plan.first.push_back(plan.spans.size());
    uint8_t* at = staging + (i % plan.per_chunk) * plan.stride;
    const int64_t row = int64_t{pages[i]} * rows;
    for (int l = 0; l < layout.num_layers; ++l)
      add(layout.Latent(cache, l).MutableRow(row), at + layout.StagedLatent(l, rows),
          rows * layout.latent_row_bytes());
    for (int k = 0; k < layout.num_full_layers; ++k) {
      uint8_t* staged = at + layout.StagedIndex(k, rows);
      for (const CacheLayout::ByteRange& r : layout.IndexRanges(0, rows)) {
        add(cache + layout.IndexPageOffset(k, pages[i]) + r.offset, staged, r.bytes);
        staged += r.bytes;
      }
    }
  }
  plan.first.push_back(plan.spans.size());
  return plan;
}

}  // namespace attnd::cuda
