#include <gtest/gtest.h>

#include <set>

#include "kv_store/kv_cache.h"
#include "kv_store/page_pool.h"

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

TEST(KvCache, SizesByBytesAndLaysOutRowsWithoutOverlap) {
  ModelSpec spec = PresetModelSpec("tiny").value();
  auto cfg = KvCacheConfig::ForModel(spec, DType::kBF16, 0);
  // 4 layers x 48 dims + 2 full layers x 16 dims, x 16 tokens x 2 bytes.
  EXPECT_EQ(cfg.BytesPerPage(), size_t{16} * 2 * (4 * 48 + 2 * 16));
  cfg.num_pages = cfg.PagesForBytes(cfg.BytesPerPage() * 10 + 5);
  EXPECT_EQ(cfg.num_pages, 10);
  auto cache = KvCache::Create(cfg);
  ASSERT_TRUE(cache.ok());
  EXPECT_EQ(cache->LatentRow(0, 1, 0) - cache->LatentRow(0, 0, 0), 16 * 96);
  EXPECT_EQ(cache->LatentRow(1, 0, 0) - cache->LatentRow(0, 0, 0), 10 * 16 * 96);
  // Copy a partial page across every layer and slot.
  for (int l = 0; l < 4; ++l) cache->LatentRow(l, 3, 4)[7] = static_cast<uint8_t>(l + 1);
  cache->IndexRow(1, 3, 2)[5] = 9;
  cache->CopyPagePrefix(3, 5, 5);
  for (int l = 0; l < 4; ++l) EXPECT_EQ(cache->LatentRow(l, 5, 4)[7], l + 1);
  EXPECT_EQ(cache->IndexRow(1, 5, 2)[5], 9);
  cache->LatentRow(0, 3, 6)[0] = 1;
  cache->CopyPagePrefix(3, 6, 5);
  EXPECT_EQ(cache->LatentRow(0, 6, 6)[0], 0);  // beyond the prefix: not copied
}

TEST(KvCache, RejectsAPoolWithoutUsablePages) {
  ModelSpec spec = PresetModelSpec("tiny").value();
  auto cfg = KvCacheConfig::ForModel(spec, DType::kBF16, 1);
  EXPECT_EQ(KvCache::Create(cfg).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attnd
