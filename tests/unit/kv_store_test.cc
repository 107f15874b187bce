#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "common/model_spec.h"
#include "kv_store/cache_layout.h"
#include "kv_store/kv_cache.h"
#include "kv_store/page_pool.h"
#include "kv_store/page_table.h"

namespace attnd {
namespace {

TEST(PagePool, NeverHandsOutPageZero) {
  PagePool pool(9);
  EXPECT_EQ(pool.usable_pages(), 8);
  std::vector<int32_t> got;
  ASSERT_TRUE(pool.Allocate(8, &got));
  EXPECT_EQ(std::set<int32_t>(got.begin(), got.end()).count(0), 0u);
  EXPECT_EQ(std::set<int32_t>(got.begin(), got.end()).size(), 8u);
  EXPECT_EQ(pool.free_pages(), 0);
}

TEST(PagePool, AllocationIsAllOrNothing) {
  PagePool pool(5);
  std::vector<int32_t> got;
  EXPECT_FALSE(pool.Allocate(5, &got));
  EXPECT_TRUE(got.empty());
  EXPECT_EQ(pool.free_pages(), 4);
  EXPECT_TRUE(pool.Allocate(4, &got));
}

TEST(PagePool, SharedPagesReturnOnLastUnref) {
  PagePool pool(4);
  std::vector<int32_t> got;
  ASSERT_TRUE(pool.Allocate(1, &got));
  pool.Ref(got[0]);
  EXPECT_EQ(pool.refcount(got[0]), 2);
  pool.Unref(got[0]);
  EXPECT_EQ(pool.free_pages(), 2);
  pool.Unref(got[0]);
  EXPECT_EQ(pool.free_pages(), 3);
  EXPECT_EQ(pool.refcount(got[0]), 0);
}

TEST(PagePoolDeathTest, AReferenceToAPageNotAllocatedAbortsInEveryBuild) {
  PagePool pool(4);
  std::vector<int32_t> got;
  ASSERT_TRUE(pool.Allocate(1, &got));
  pool.Unref(got[0]);  // free again
  EXPECT_DEATH(pool.Unref(got[0]), "PagePool::Unref\\(page [0-9]+\\): not an allocated page");
  EXPECT_DEATH(pool.Ref(got[0]), "PagePool::Ref");
  EXPECT_DEATH(pool.Unref(0), "page 0");  // the reserved page
  EXPECT_DEATH(pool.Ref(4), "page 4");    // out of range
  EXPECT_EQ(pool.free_pages(), 3);        // and this process's pool is as it was
}

TEST(CacheLayout, SizesByBytesAndLaysOutRowsWithoutOverlap) {
  ModelSpec spec = PresetModelSpec("tiny").value();
  auto layout = CacheLayout::ForModel(spec, DType::kBF16, 0);
  // 4 layers x 48 dims + 2 full layers x 16 dims, x 16 tokens x 2 bytes.
  EXPECT_EQ(layout.BytesPerPage(), size_t{16} * 2 * (4 * 48 + 2 * 16));
  layout.num_pages = layout.PagesForBytes(layout.BytesPerPage() * 10 + 5);
  EXPECT_EQ(layout.num_pages, 10);
  EXPECT_EQ(layout.TotalBytes(), layout.BytesPerPage() * 10);
  auto cache = KvCache::Create(layout);
  ASSERT_TRUE(cache.ok());
  EXPECT_EQ(cache->LatentRow(0, 1, 0) - cache->LatentRow(0, 0, 0), 16 * 96);
  EXPECT_EQ(cache->LatentRow(1, 0, 0) - cache->LatentRow(0, 0, 0), 10 * 16 * 96);
  EXPECT_EQ(cache->IndexPage(0, 0) - cache->LatentRow(0, 0, 0), 4 * 10 * 16 * 96);
  EXPECT_EQ(cache->Index(1).Row(2 * 16 + 3) - cache->IndexPage(0, 0), (10 * 16 + 2 * 16 + 3) * 32);
  // The last indexer row ends where the allocation does.
  EXPECT_EQ(cache->Index(1).Row(9 * 16 + 15) + 32 - cache->LatentRow(0, 0, 0),
            static_cast<ptrdiff_t>(layout.TotalBytes()));
  // Slot addressing: CacheRows row `slot` is the page's row.
  EXPECT_EQ(cache->Latent(2).Row(3 * 16 + 5), cache->LatentRow(2, 3, 5));
  EXPECT_EQ(cache->Index(1).Row(7 * 16), cache->IndexPage(1, 7));
}

TEST(CacheLayout, Fp8RowsAreFlashMlaTokensAndDeepGemmIndexerPages) {
  ModelSpec spec = PresetModelSpec("deepseek-v3.2").value();
  const auto bf16 = CacheLayout::ForModel(spec, DType::kBF16, 4);
  auto layout = CacheLayout::ForCapacity(spec, DType::kFP8E4M3, 4, 0).value();
  EXPECT_EQ(layout.latent_row_bytes(), 656u);
  EXPECT_EQ(layout.index_row_bytes(), 132u);
  EXPECT_LE(layout.BytesPerPage(), 0.6 * bf16.BytesPerPage());
  EXPECT_EQ(layout.BytesPerPage(), size_t{64} * (61 * 656 + 61 * 132));
  auto cache = KvCache::Create(layout);
  ASSERT_TRUE(cache.ok());
  const CacheRows lat = cache->Latent(3), idx = cache->Index(2);
  // A latent row is one 656-byte token; its scales follow its 512 values.
  EXPECT_EQ(lat.Row(2 * 64 + 7) - lat.Row(0), (2 * 64 + 7) * 656);
  EXPECT_EQ(lat.Scales(5) - lat.Row(5), 512);
  // An indexer page: 64 rows of 128 values, then their 64 scales; pages 64 x 132 bytes apart.
  const uint8_t* page2 = cache->IndexPage(2, 2);
  EXPECT_EQ(page2 - cache->IndexPage(2, 1), 64 * 132);
  EXPECT_EQ(idx.Row(2 * 64), page2);
  EXPECT_EQ(idx.Row(2 * 64 + 9) - page2, 9 * 128);
  EXPECT_EQ(idx.Scales(2 * 64) - page2, 64 * 128);
  EXPECT_EQ(idx.Scales(2 * 64 + 9) - page2, 64 * 128 + 9 * 4);
  // Rows [3, 8) of a page: their values, then their scales.
  const auto r = layout.IndexRanges(3, 5);
  EXPECT_EQ(r[0].offset, 3u * 128);
  EXPECT_EQ(r[0].bytes, 5u * 128);
  EXPECT_EQ(r[1].offset, 64u * 128 + 3 * 4);
  EXPECT_EQ(r[1].bytes, 5u * 4);
  EXPECT_EQ(r[0].bytes + r[1].bytes, 5 * layout.index_row_bytes());
  // The last scale ends where the allocation does.
  EXPECT_EQ(cache->Index(60).Scales(4 * 64 - 1) + 4 - cache->LatentRow(0, 0, 0),
            static_cast<ptrdiff_t>(layout.TotalBytes()));
  // A latent the tiles cannot cover is refused.
  spec.kv_lora_rank = 192;
  EXPECT_EQ(CacheLayout::ForCapacity(spec, DType::kFP8E4M3, 4, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CacheLayout, StagedPageBlocksTileTheStagingBuffer) {
  ModelSpec spec = PresetModelSpec("tiny").value();
  const auto layout = CacheLayout::ForModel(spec, DType::kF32, 8);
  const int rows = 5;
  size_t next = 0;
  for (int l = 0; l < layout.num_layers; ++l) {
    EXPECT_EQ(layout.StagedLatent(l, rows), next);
    next += rows * layout.latent_row_bytes();
  }
  for (int k = 0; k < layout.num_full_layers; ++k) {
    EXPECT_EQ(layout.StagedIndex(k, rows), next);
    next += rows * layout.index_row_bytes();
  }
  EXPECT_EQ(layout.StagedBytes(rows), next);
  EXPECT_EQ(layout.StagedBytes(layout.page_size), layout.BytesPerPage());
}

TEST(KvCache, RejectsAPoolWithoutUsablePages) {
  ModelSpec spec = PresetModelSpec("tiny").value();
  auto layout = CacheLayout::ForModel(spec, DType::kBF16, 1);
  EXPECT_EQ(KvCache::Create(layout).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PageTable, SlotsFollowEachSequencesPagesInOrder) {
  // Two sequences, page size 4: a owns pages 7, 2; b owns 5, 9, 1.
  const std::vector<int32_t> indptr = {0, 2, 5}, pages = {7, 2, 5, 9, 1};
  const PageTable t{indptr.data(), pages.data(), 4};
  EXPECT_EQ(t.Slot(0, 0), 28);
  EXPECT_EQ(t.Slot(0, 3), 31);
  EXPECT_EQ(t.Slot(0, 4), 8);
  EXPECT_EQ(t.Slot(0, 7), 11);
  EXPECT_EQ(t.Slot(1, 0), 20);
  EXPECT_EQ(t.Slot(1, 6), 38);
  EXPECT_EQ(t.Slot(1, 9), 5);
  // Every position of every sequence maps to a distinct slot on its own page.
  std::set<int64_t> seen;
  for (int s = 0; s < 2; ++s)
    for (int64_t p = 0; p < (indptr[s + 1] - indptr[s]) * 4; ++p) {
      const int64_t slot = t.Slot(s, p);
      EXPECT_EQ(slot / 4, pages[indptr[s] + p / 4]);
      EXPECT_EQ(slot % 4, p % 4);
      EXPECT_TRUE(seen.insert(slot).second);
    }
}

TEST(CacheRows, AddressesRowsBySlot) {
  std::vector<uint8_t> buf(64);
  const CacheRows r{buf.data() + 8, 6, DType::kBF16, 3};
  EXPECT_EQ(r.Row(0), buf.data() + 8);
  EXPECT_EQ(r.Row(5), buf.data() + 38);
  EXPECT_EQ(r.MutableRow(2), buf.data() + 20);
}

}  // namespace
}  // namespace attnd
