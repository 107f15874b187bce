#include "kernels/fp8_rows.h"

#include <cstring>
#include <vector>

#include "common/fp8.h"

namespace attnd {

void QuantizeKeyRow(const TensorView& t, int64_t row, int n, int tile, uint8_t* values,
                    uint8_t* scales) {
  if (t.dtype == DType::kFP8E4M3) {
    std::memcpy(values, t.Row(row, n), n);
    std::memcpy(scales, static_cast<const uint8_t*>(t.scales) + row * t.scales_per_row * 4,
                4 * (n / tile));
    return;
  }
  thread_local std::vector<float> x, sc;
  x.resize(n);
  sc.resize(n / tile);
  ConvertToF32(t.dtype, t.Row(row, n), x.data(), n);
  fp8::QuantizeTiles(x.data(), n, tile, values, sc.data());
  std::memcpy(scales, sc.data(), 4 * sc.size());
}

void PackLatentRow(const TensorView& kv_latent, const TensorView& k_rope, int64_t row, int L, int R,
                   uint8_t* out) {
  QuantizeKeyRow(kv_latent, row, L, fp8::LatentTileSize(L), out, out + L);
  uint8_t* rope = out + L + 4 * fp8::LatentTiles(L);
  const uint8_t* src = k_rope.Row(row, R);
  if (k_rope.dtype == DType::kBF16) {
    std::memcpy(rope, src, 2 * static_cast<size_t>(R));
    return;
  }
  thread_local std::vector<float> x;
  x.resize(R);
  ConvertToF32(k_rope.dtype, src, x.data(), R);
  ConvertFromF32(DType::kBF16, x.data(), rope, R);
}

void QueryRowToF32(const TensorView& t, int64_t row, int64_t elems, float* dst) {
  if (t.dtype != DType::kFP8E4M3) {
    ConvertToF32(t.dtype, t.Row(row, elems), dst, elems);
    return;
  }
  float scale;
  std::memcpy(&scale, static_cast<const uint8_t*>(t.scales) + row * 4, 4);
  const uint8_t* codes = t.Row(row, elems);
  for (int64_t i = 0; i < elems; ++i) dst[i] = fp8::E4M3ToF32(codes[i]) * scale;
}

}  // namespace attnd
