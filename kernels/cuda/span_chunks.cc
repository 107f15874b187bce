#include "kernels/cuda/span_chunks.h"

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

}  // namespace attnd::cuda
