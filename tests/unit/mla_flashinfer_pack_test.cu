// attnd's FlashInferMlaParams packed into FlashInfer's MLAParams
// (kernels/cuda/ops/mla_flashinfer.cu), on the host, without a GPU: every pointer, stride and count
// the Hopper MLA kernel reads.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kernels/cuda/ops/mla_flashinfer_pack.cuh"

namespace attnd::cuda {
namespace {

// Fake device addresses: the packer only does arithmetic on them.
template <typename T>
T* At(uintptr_t a) {
  return reinterpret_cast<T*>(a);
}

FlashInferMlaParams DeepSeekWave() {
  FlashInferMlaParams p;
  p.q_nope = At<void>(0x10000);
  p.q_pe = At<void>(0x20000);
  p.kv = CacheRows{At<const uint8_t>(0x100000), 1152, DType::kBF16, 576, 0, 0};
  p.heads = 128;
  p.sm_scale = 0.1352f;
  p.key_list = At<const int32_t>(0x30000);
  p.wave.q_indptr = At<const int32_t>(0x40000);
  p.wave.kv_indptr = At<const int32_t>(0x40100);
  p.wave.partial_indptr = At<const int32_t>(0x40200);
  p.wave.q_len = At<const int32_t>(0x40300);
  p.wave.kv_len = At<const int32_t>(0x40400);
  p.wave.q_start = At<const int32_t>(0x40500);
  p.wave.kv_start = At<const int32_t>(0x40600);
  p.wave.kv_end = At<const int32_t>(0x40700);
  p.wave.work_indptr = At<const int32_t>(0x40800);
  p.wave.zeros = At<const int32_t>(0x40900);
  p.wave.queries = 64;
  p.partial_o = At<void>(0x50000);
  p.partial_lse = At<float>(0x60000);
  return p;
}

TEST(FlashInferMlaPack, PointersAndStridesAddressAttndsRows) {
  const FlashInferMlaParams p = DeepSeekWave();
  FlashInferMlaKernelParams f;
  ASSERT_EQ(PackFlashInferMla(p, &f), cudaSuccess);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f.q_nope), 0x10000u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f.q_pe), 0x20000u);
  // A key's latent part starts its row; its RoPE part 512 bf16 values (1,024 bytes) in.
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f.ckv), 0x100000u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f.kpe), 0x100000u + 1024);
  EXPECT_EQ(f.ckv_stride_page, 576u);  // elements per row: slot s at ckv + s * 576
  EXPECT_EQ(f.kpe_stride_page, 576u);
  EXPECT_EQ(uint32_t(f.block_size), 1u);  // page size 1: a key list entry is a slot
  EXPECT_EQ(uint32_t(f.num_heads), 128u);
  EXPECT_EQ(f.q_nope_stride_n, 128u * 512);
  EXPECT_EQ(f.q_nope_stride_h, 512u);
  EXPECT_EQ(f.q_pe_stride_n, 128u * 64);
  EXPECT_EQ(f.q_pe_stride_h, 64u);
  EXPECT_EQ(f.kv_indices, p.key_list);
  EXPECT_EQ(f.q_indptr, p.wave.q_indptr);
  EXPECT_EQ(f.kv_indptr, p.wave.kv_indptr);
  EXPECT_EQ(f.partial_indptr, p.wave.partial_indptr);
  EXPECT_EQ(f.q_len, p.wave.q_len);
  EXPECT_EQ(f.kv_len, p.wave.kv_len);
  EXPECT_EQ(f.q_start, p.wave.q_start);
  EXPECT_EQ(f.kv_start, p.wave.kv_start);
  EXPECT_EQ(f.kv_end, p.wave.kv_end);
  EXPECT_EQ(f.work_indptr, p.wave.work_indptr);
  // Every item writes partials (attnd merges them); FlashInfer's own merge has nothing to do.
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f.partial_o), 0x50000u);
  EXPECT_EQ(f.partial_lse, p.partial_lse);
  EXPECT_EQ(f.final_lse, nullptr);
  for (const int32_t* m :
       {f.merge_packed_offset_start, f.merge_packed_offset_end, f.merge_partial_packed_offset_start,
        f.merge_partial_packed_offset_end, f.merge_partial_stride})
    EXPECT_EQ(m, p.wave.zeros);
  EXPECT_FLOAT_EQ(f.sm_scale, 0.1352f);
  EXPECT_FALSE(f.return_lse_base_on_e);  // partials in log2; the merge converts
}

TEST(FlashInferMlaPack, RowsTheKernelCannotReadAreRefused) {
  FlashInferMlaKernelParams f;
  FlashInferMlaParams p = DeepSeekWave();
  p.kv.dtype = DType::kFP8E4M3;  // 656-byte fp8 rows
  p.kv.row_bytes = 656;
  EXPECT_EQ(PackFlashInferMla(p, &f), cudaErrorInvalidValue);
  p = DeepSeekWave();
  p.kv.base = At<const uint8_t>(0x100008);  // not 16-byte aligned
  EXPECT_EQ(PackFlashInferMla(p, &f), cudaErrorInvalidValue);
  p = DeepSeekWave();
  p.kv.scales_apart = 64;  // indexer rows, not latent rows
  EXPECT_EQ(PackFlashInferMla(p, &f), cudaErrorInvalidValue);
  p = DeepSeekWave();
  p.heads = 0;
  EXPECT_EQ(PackFlashInferMla(p, &f), cudaErrorInvalidValue);
}

// A wave's arrays placed once (the step's plan, recording where each went and emptying it) are
// found again at launch by the same calls: every argument names its own array, the shape copied.
TEST(FlashInferWaveArgs, ArraysRecordedAtPlanTimeAreFoundAgainAtLaunch) {
  FlashInferMlaWave w;
  std::vector<std::vector<int32_t>*> arrays = {
      &w.q_indptr, &w.kv_indptr, &w.partial_indptr, &w.q_len,     &w.kv_len,      &w.q_start,
      &w.kv_start, &w.kv_end,    &w.work_indptr,    &w.merge_row, &w.merge_chunks};
  for (size_t i = 0; i < arrays.size(); ++i) *arrays[i] = {static_cast<int32_t>(100 + i), 7};
  w.first_query = 3, w.queries = 5, w.blocks_x = 66, w.blocks_y = 2, w.rows_per_chunk = 128;
  std::vector<std::vector<int32_t>> placed;
  FlashInferWaveArgs(w, nullptr, [&](std::vector<int32_t>& v) -> const int32_t* {
    placed.push_back(v);
    std::vector<int32_t>().swap(v);
    return nullptr;
  });
  ASSERT_EQ(placed.size(), arrays.size());
  for (const std::vector<int32_t>* v : arrays) EXPECT_TRUE(v->empty());
  const int32_t zeros[132] = {};
  size_t next = 0;
  const FlashInferMlaWaveArgs a = FlashInferWaveArgs(
      w, zeros, [&](const std::vector<int32_t>&) { return placed.at(next++).data(); });
  const int32_t* got[] = {a.q_indptr,    a.kv_indptr, a.partial_indptr, a.q_len,
                          a.kv_len,      a.q_start,   a.kv_start,       a.kv_end,
                          a.work_indptr, a.merge_row, a.merge_chunks};
  for (size_t i = 0; i < arrays.size(); ++i) EXPECT_EQ(got[i][0], static_cast<int32_t>(100 + i));
  EXPECT_EQ(a.zeros, zeros);
  EXPECT_EQ(a.first_query, 3);
  EXPECT_EQ(a.queries, 5);
  EXPECT_EQ(a.blocks_x, 66);
  EXPECT_EQ(a.blocks_y, 2);
  EXPECT_EQ(a.rows_per_chunk, 128);
}

}  // namespace
}  // namespace attnd::cuda
