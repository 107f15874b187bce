#include "engine/row_reader.h"

#include <algorithm>

#include "common/fp8.h"
#include "common/status_macros.h"

namespace attnd {

absl::Status ReadLayerRows(const CacheLayout& c, const ModelSpec& spec, int layer, int64_t begin,
                           int64_t end, const PageRowReader& read, LayerRowBytes* out) {
  const int ps = c.page_size;
  const int slot = spec.FullSlot(layer);
  // Bytes of a latent row's parts: values, (fp8) scales, rope.
  const bool fp8 = c.fp8();
  const size_t es = DTypeSize(c.dtype);
  const size_t L = spec.kv_lora_rank * es;
  const size_t S = fp8 ? 4 * fp8::LatentTiles(spec.kv_lora_rank) : 0;
  const size_t R = spec.qk_rope_head_dim * (fp8 ? 2 : es);
  std::vector<uint8_t> lat(ps * c.latent_row_bytes()), idx(ps * c.index_row_bytes());
  out->kv_latent.reserve(out->kv_latent.size() + (end - begin) * L);
  out->k_rope.reserve(out->k_rope.size() + (end - begin) * R);
  if (slot >= 0) out->index_k.reserve(out->index_k.size() + (end - begin) * c.index_row_bytes());
  for (int64_t pos = begin; pos < end;) {
    const int off = static_cast<int>(pos % ps);
    const int rows = static_cast<int>(std::min<int64_t>(ps - off, end - pos));
    RETURN_IF_ERROR(
        read(static_cast<size_t>(pos / ps - begin / ps), off, rows, lat.data(), idx.data()));
    for (int r = 0; r < rows; ++r) {
      const char* row = reinterpret_cast<const char*>(lat.data()) + r * (L + S + R);
      out->kv_latent.append(row, L);
      out->kv_latent_scales.append(row + L, S);
      out->k_rope.append(row + L + S, R);
    }
    if (slot >= 0) {  // the rows (fp8: their values, then their scales)
      const char* from = reinterpret_cast<const char*>(idx.data());
      const size_t values = fp8 ? rows * spec.index_head_dim : rows * c.index_row_bytes();
      out->index_k.append(from, values);
      if (fp8) out->index_k_scales.append(from + values, 4 * rows);
    }
    pos += rows;
  }
  return absl::OkStatus();
}

absl::Status ReadLayerRows(Device& device, const ModelSpec& spec, int layer,
                           const std::vector<int32_t>& pages, int64_t begin, int64_t end,
                           LayerRowBytes* out) {
  const int slot = spec.FullSlot(layer);
  return ReadLayerRows(
      device.layout(), spec, layer, begin, end,
      [&](size_t i, int first, int rows, uint8_t* latent, uint8_t* index) {
        return device.ReadRows(layer, slot, pages[i], first, rows, latent, index);
      },
      out);
}

}  // namespace attnd
