// Page moves between GPUs cut into chunks (kernels/cuda/backend/span_chunks.h), run on host memory
// the way the GPU runs them: gather each chunk's pieces into staging, send the staging, scatter it.
// Every byte of every span arrives once, nothing else is written, chunks fit their staging,
// pieces are aligned and disjoint, and a sequence's thousands of spans become a few transfers.
#include "kernels/cuda/backend/span_chunks.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "common/model_spec.h"

namespace attnd::cuda {
namespace {

// Runs the plan on host memory: gather, transfer, scatter, chunk by chunk.
void Move(const SpanChunks& plan, size_t chunk_bytes) {
  std::vector<uint8_t> src_staging(chunk_bytes), dst_staging(chunk_bytes);
  const std::vector<SpanCopy> gather = plan.GatherTable(src_staging.data());
  const std::vector<SpanCopy> scatter = plan.ScatterTable(dst_staging.data());
  for (const SpanChunks::Chunk& c : plan.chunks) {
    ASSERT_LE(c.bytes, chunk_bytes);
    for (size_t i = c.first; i < c.first + c.count; ++i) {
      ASSERT_LE(gather[i].dst + gather[i].bytes, src_staging.data() + chunk_bytes);
      std::memcpy(gather[i].dst, gather[i].src, gather[i].bytes);
    }
    std::memcpy(dst_staging.data(), src_staging.data(), c.bytes);  // the one transfer
    for (size_t i = c.first; i < c.first + c.count; ++i)
      std::memcpy(scatter[i].dst, scatter[i].src, scatter[i].bytes);
  }
}

TEST(SpanChunks, EveryByteArrivesOnceAndNothingElseIsWritten) {
  std::mt19937 rng(3);
  // Spans like a page move's: latent rows of 1..64 rows x 656 bytes, indexer values and their
  // 4-byte scales, at unaligned offsets; some longer than a chunk.
  std::vector<uint8_t> src(1 << 20), dst(1 << 20, 0xcc);
  for (uint8_t& b : src) b = static_cast<uint8_t>(rng());
  std::vector<SpanCopy> spans;
  std::vector<std::pair<size_t, size_t>> where;  // (offset, bytes) in both buffers
  size_t at = 3;
  while (true) {
    const int kind = static_cast<int>(rng() % 4);
    const size_t rows = 1 + rng() % 64;
    size_t bytes = kind == 0 ? rows * 656 : kind == 1 ? rows * 128 : kind == 2 ? rows * 4 : 70000;
    if (at + bytes + 7 > src.size()) break;
    spans.push_back({src.data() + at, dst.data() + at, bytes});
    where.push_back({at, bytes});
    at += bytes + rng() % 8;  // gaps stay untouched
  }
  const size_t chunk = 64 << 10;
  const SpanChunks plan = PlanSpanChunks(spans, chunk);
  // Pieces: aligned staging offsets, disjoint, inside their chunk.
  for (const SpanChunks::Chunk& c : plan.chunks) {
    size_t end = 0;
    for (size_t i = c.first; i < c.first + c.count; ++i) {
      EXPECT_EQ(plan.offset[i] % kSpanAlign, 0u);
      EXPECT_GE(plan.offset[i], end);
      end = plan.offset[i] + plan.pieces[i].bytes;
      EXPECT_LE(plan.pieces[i].bytes, chunk);
    }
    EXPECT_EQ(end, c.bytes);
  }
  Move(plan, chunk);
  std::vector<bool> covered(dst.size(), false);
  for (const auto& [off, bytes] : where) {
    EXPECT_EQ(std::memcmp(dst.data() + off, src.data() + off, bytes), 0) << "span at " << off;
    for (size_t i = off; i < off + bytes; ++i) covered[i] = true;
  }
  for (size_t i = 0; i < dst.size(); ++i) {
    if (covered[i]) continue;
    ASSERT_EQ(dst[i], 0xcc) << "byte " << i << " outside every span was written";
  }
  // Few transfers: the staged bytes (with at most 15 bytes of padding per piece) fill chunks.
  size_t total = 0;
  for (const auto& w : where) total += w.second;
  const size_t padded = total + plan.pieces.size() * (kSpanAlign - 1);
  EXPECT_LE(plan.chunks.size(), padded / chunk + 2) << spans.size() << " spans";
}

TEST(SpanChunks, ASequenceOf250000SpansMovesInAFewDozenTransfers) {
  // A 128K-token DeepSeek-V3.2 sequence on an fp8 cache: 2,048 pages x (61 latent spans of
  // 64 x 656 bytes + 61 indexer value spans of 64 x 128 + 61 scale spans of 64 x 4). Addresses
  // are never touched by the planner, so fake ones will do.
  std::vector<SpanCopy> spans;
  uintptr_t a = 0x10000000;
  for (int page = 0; page < 2048; ++page)
    for (int layer = 0; layer < 61; ++layer)
      for (size_t bytes : {size_t{64 * 656}, size_t{64 * 128}, size_t{64 * 4}}) {
        spans.push_back(
            {reinterpret_cast<const uint8_t*>(a), reinterpret_cast<uint8_t*>(a), bytes});
        a += bytes;
      }
  EXPECT_EQ(spans.size(), 374784u);
  const SpanChunks plan = PlanSpanChunks(spans, size_t{64} << 20);
  size_t total = 0;
  for (const SpanCopy& s : spans) total += s.bytes;
  EXPECT_EQ(total, size_t{2048} * 61 * 64 * 788);  // 6.3 GB
  // A span is cut only where a chunk fills up: at most one more piece per chunk.
  EXPECT_LE(plan.pieces.size(), spans.size() + plan.chunks.size());
  // Every span a multiple of 16 bytes: no padding, so the chunks are exactly full: 6.3 GB in 94
  // transfers of 64 MiB (was 374,784 send/recv pairs in one NCCL group).
  const size_t chunk = size_t{64} << 20;
  EXPECT_EQ(plan.chunks.size(), (total + chunk - 1) / chunk);
  EXPECT_EQ(plan.chunks.size(), 94u);
}

TEST(SpanChunks, EmptySpansAndEmptyListsMakeNoChunks) {
  uint8_t x[16];
  EXPECT_TRUE(PlanSpanChunks({}, 1024).chunks.empty());
  const SpanChunks p = PlanSpanChunks({{x, x, 0}, {x, x, 0}}, 1024);
  EXPECT_TRUE(p.chunks.empty());
  EXPECT_TRUE(p.pieces.empty());
}

// A page's staged form as CacheLayout documents it: every layer's rows, then every full layer's
// indexer ranges back to back.
std::vector<uint8_t> StagedPage(const CacheLayout& layout, const std::vector<uint8_t>& cache,
                                int32_t page) {
  std::vector<uint8_t> out;
  const int rows = layout.page_size;
  for (int l = 0; l < layout.num_layers; ++l) {
    const size_t at =
        layout.LatentOffset(l) + static_cast<size_t>(page) * rows * layout.latent_row_bytes();
    out.insert(out.end(), cache.begin() + at,
               cache.begin() + at + rows * layout.latent_row_bytes());
  }
  for (int k = 0; k < layout.num_full_layers; ++k)
    for (const CacheLayout::ByteRange& r : layout.IndexRanges(0, rows)) {
      const size_t at = layout.IndexPageOffset(k, page) + r.offset;
      out.insert(out.end(), cache.begin() + at, cache.begin() + at + r.bytes);
    }
  return out;
}

// The GPU's ReadPages and WritePages (kernels/cuda/backend/cuda_pages.cc) on host memory, in their
// order: per chunk the span kernel, then the copies out (a spill); the copies in, then the span
// kernel (a restore). The staging holds only the chunk's pages, so a chunk overwrites the last
// one's.
void RunPages(const PageStaging& plan, std::vector<uint8_t>& staging, size_t n,
              const std::vector<uint8_t*>& host, bool spill) {
  for (size_t a = 0; a < n; a += plan.per_chunk) {
    const size_t b = std::min(n, a + plan.per_chunk);
    std::fill(staging.begin(), staging.end(), 0xee);  // nothing of the last chunk may leak
    if (!spill)
      for (size_t i = a; i < b; ++i)
        std::memcpy(staging.data() + (i - a) * plan.stride, host[i], plan.page_bytes);
    for (size_t j = plan.first[a]; j < plan.first[b]; ++j)
      std::memcpy(plan.spans[j].dst, plan.spans[j].src, plan.spans[j].bytes);
    if (spill)
      for (size_t i = a; i < b; ++i)
        std::memcpy(host[i], staging.data() + (i - a) * plan.stride, plan.page_bytes);
  }
}

TEST(PageStaging, SpilledPagesAreTheirStagedFormsAndComeBackIntoOtherPagesExactly) {
  const ModelSpec spec = PresetModelSpec("tiny").value();
  for (DType dtype : {DType::kFP8E4M3, DType::kBF16, DType::kF32}) {
    const CacheLayout layout = CacheLayout::ForModel(spec, dtype, 12);
    std::mt19937 rng(5);
    std::vector<uint8_t> cache(layout.TotalBytes());
    for (uint8_t& b : cache) b = static_cast<uint8_t>(rng());
    const std::vector<int32_t> pages = {7, 3, 9, 1, 10};
    const size_t page_bytes = layout.StagedBytes(layout.page_size);
    // Room for two pages and a bit: three chunks (2, 2, 1).
    const size_t max_staging = 2 * ((page_bytes + 15) / 16 * 16) + 5;
    std::vector<uint8_t> staging(max_staging);
    PageStaging out =
        PlanPageStaging(layout, cache.data(), pages, staging.data(), max_staging, true);
    ASSERT_EQ(out.per_chunk, 2u);
    ASSERT_EQ(out.chunks(), 3u);
    ASSERT_EQ(out.page_bytes, page_bytes);
    ASSERT_LE(out.staging_bytes(), max_staging);
    std::vector<std::vector<uint8_t>> host(pages.size(), std::vector<uint8_t>(page_bytes, 0x11));
    std::vector<uint8_t*> host_ptrs;
    for (auto& h : host) host_ptrs.push_back(h.data());
    RunPages(out, staging, pages.size(), host_ptrs, true);
    for (size_t i = 0; i < pages.size(); ++i)
      EXPECT_EQ(host[i], StagedPage(layout, cache, pages[i])) << DTypeName(dtype) << " page " << i;
    // Restored into other pages of a blank cache: those pages' bytes, nothing else written.
    std::vector<uint8_t> blank(layout.TotalBytes(), 0xcc);
    const std::vector<int32_t> into = {2, 11, 4, 5, 8};
    PageStaging in =
        PlanPageStaging(layout, blank.data(), into, staging.data(), max_staging, false);
    RunPages(in, staging, into.size(), host_ptrs, false);
    std::vector<uint8_t> expect(layout.TotalBytes(), 0xcc);
    for (size_t i = 0; i < into.size(); ++i) {
      const std::vector<uint8_t> staged = StagedPage(layout, cache, pages[i]);
      EXPECT_EQ(StagedPage(layout, blank, into[i]), staged) << DTypeName(dtype) << " page " << i;
    }
    size_t untouched = 0, outside = 0;
    std::vector<bool> inside(blank.size(), false);
    for (int32_t p : into) {
      const int rows = layout.page_size;
      for (int l = 0; l < layout.num_layers; ++l) {
        const size_t at =
            layout.LatentOffset(l) + static_cast<size_t>(p) * rows * layout.latent_row_bytes();
        std::fill(inside.begin() + at, inside.begin() + at + rows * layout.latent_row_bytes(),
                  true);
      }
      for (int k = 0; k < layout.num_full_layers; ++k)
        for (const CacheLayout::ByteRange& r : layout.IndexRanges(0, rows))
          std::fill(inside.begin() + layout.IndexPageOffset(k, p) + r.offset,
                    inside.begin() + layout.IndexPageOffset(k, p) + r.offset + r.bytes, true);
    }
    for (size_t i = 0; i < blank.size(); ++i)
      if (!inside[i]) {
        ++outside;
        untouched += blank[i] == 0xcc;
      }
    EXPECT_GT(outside, 0u);
    EXPECT_EQ(untouched, outside) << DTypeName(dtype) << ": bytes written outside the pages";
  }
}

TEST(PageStaging, A32KTokenDeepSeekSequenceIsTwentyFiveKernelsAndOneCopyAPage) {
  const ModelSpec spec = PresetModelSpec("deepseek-v3.2").value();
  const CacheLayout layout = CacheLayout::ForModel(spec, DType::kFP8E4M3, 520);
  std::vector<int32_t> pages(512);
  for (int i = 0; i < 512; ++i) pages[i] = i + 1;
  // Addresses only: no byte is touched.
  auto* cache = reinterpret_cast<uint8_t*>(uintptr_t{1} << 40);
  auto* staging = reinterpret_cast<uint8_t*>(uintptr_t{1} << 44);
  const PageStaging p = PlanPageStaging(layout, cache, pages, staging, size_t{64} << 20, true);
  EXPECT_EQ(p.page_bytes, size_t{64} * 61 * (656 + 132));  // 3,076,352 bytes
  EXPECT_EQ(p.per_chunk, 21u);
  EXPECT_EQ(p.chunks(), 25u);
  EXPECT_EQ(p.spans.size(), 512u * (61 + 61 * 2));  // latent rows, indexer values and scales
}

// A page larger than the 64 MiB chunk (DeepSeek-V3.2 at page_size 1024, bf16: 61 layers of
// 1,152 + 256 bytes a row) is a chunk of its own, and the staging reserved for it
// (PageStagingBytes, what CudaDevice reserves) holds it: the plan never addresses past it.
TEST(PageStaging, APageLargerThanTheChunkGetsStagingOfItsSize) {
  ModelSpec spec = PresetModelSpec("deepseek-v3.2").value();
  auto* cache = reinterpret_cast<uint8_t*>(uintptr_t{1} << 40);
  auto* staging = reinterpret_cast<uint8_t*>(uintptr_t{1} << 44);
  const size_t chunk = size_t{64} << 20;
  for (int page_size : {64, 1024, 4096}) {
    spec.page_size = page_size;
    for (DType dtype : {DType::kFP8E4M3, DType::kBF16, DType::kF32}) {
      const CacheLayout layout = CacheLayout::ForModel(spec, dtype, 4);
      const PageStaging p = PlanPageStaging(layout, cache, {1, 2, 3}, staging, chunk, true);
      const size_t reserved = PageStagingBytes(layout, chunk);
      EXPECT_EQ(p.staging_bytes(), reserved) << page_size << " " << DTypeName(dtype);
      EXPECT_LE(reserved, std::max(chunk, p.stride));
      EXPECT_GE(p.per_chunk, 1u);
      for (size_t i = 0; i < 3; ++i)  // every span within the staging reserved
        for (size_t j = p.first[i]; j < p.first[i + 1]; ++j) {
          const uint8_t* at = p.spans[j].dst;
          ASSERT_GE(at, staging);
          ASSERT_LE(static_cast<size_t>(at - staging) + p.spans[j].bytes, reserved)
              << page_size << " " << DTypeName(dtype) << " page " << i;
        }
    }
  }
  spec.page_size = 1024;
  const CacheLayout big = CacheLayout::ForModel(spec, DType::kBF16, 4);
  EXPECT_EQ(big.StagedBytes(1024), size_t{1024} * 61 * (1152 + 256));  // 87.9 MB
  EXPECT_GT(PageStagingBytes(big, chunk), chunk);
}

}  // namespace
}  // namespace attnd::cuda
