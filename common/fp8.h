// float8_e4m3fn and the fp8 cache's token formats (docs/architecture.md): what --cache-dtype=fp8
// stores.
//   latent token (FlashMLA's DeepSeek-V3.2 layout), 656 B:
//     [512 x e4m3 c_kv][4 x fp32 scale, one per 128-value tile][64 x bf16 k_rope]
//   indexer key (DeepGEMM's paged layout stores a page's values, then its scales), 132 B:
//     [128 x e4m3][1 x fp32 scale]
// Scales are powers of two: the smallest 2^e with amax / 2^e <= 448 (e4m3's largest finite), so
// dequantising is exact in fp32 and a value's error is at most half an e4m3 step of its tile.
// Header-only and free of Abseil so the CUDA kernels can share the decode.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/dtype.h"
#include "common/host_device.h"

namespace attnd::fp8 {

inline constexpr float kE4M3Max = 448.0f;
inline constexpr int kLatentTile = 128;  // values per latent scale
// DeepSeek-V3.2's dims, for which the layouts are the field's (FlashMLA, DeepGEMM).
inline constexpr int kLatentValues = 512;  // L
inline constexpr int kRopeValues = 64;     // R
inline constexpr int kIndexValues = 128;   // Di

// Other dims keep the same shape: L e4m3 values in tiles of 128 (or one tile when L < 128: the
// small test models), one fp32 scale per tile, then R bf16; an indexer key is Di e4m3 values and
// one fp32 scale.
// L a multiple of 4 keeps the row's scales and bf16 rope aligned.
ATTND_HD constexpr bool LatentDimFits(int L) {
  return L > 0 && L % 4 == 0 && L <= 64 * kLatentTile && (L < kLatentTile || L % kLatentTile == 0);
}
ATTND_HD constexpr int LatentTiles(int L) { return L < kLatentTile ? 1 : L / kLatentTile; }
ATTND_HD constexpr int LatentTileSize(int L) { return L < kLatentTile ? L : kLatentTile; }
ATTND_HD constexpr int LatentTokenBytes(int L, int R) { return L + 4 * LatentTiles(L) + 2 * R; }
ATTND_HD constexpr int IndexTokenBytes(int Di) { return Di + 4; }
static_assert(LatentTokenBytes(kLatentValues, kRopeValues) == 656, "FlashMLA's V3.2 token");
static_assert(IndexTokenBytes(kIndexValues) == 132, "DeepGEMM's indexer key");

// e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; 0x7f/0xff are NaN.
// Built from bits (every e4m3 value is an fp32 one), so CUDA kernels share it.
ATTND_HD inline float E4M3ToF32(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80) << 24;
  const uint32_t exp = (v >> 3) & 0xfu, man = v & 0x7u;
  uint32_t bits;
  if (exp == 0xf && man == 0x7) {
    bits = sign | 0x7fc00000u;  // NaN
  } else if (exp == 0) {
    const float mag = static_cast<float>(man) * 0.001953125f;  // subnormal: man * 2^-9, exact
    std::memcpy(&bits, &mag, 4);
    bits |= sign;
  } else {
    bits = sign | ((exp + 120) << 23) | (man << 20);  // (1 + man/8) * 2^(exp-7)
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even; beyond +-448 saturates to +-448; NaN stays NaN (0x7f with its sign).
// Normal results round the fp32 mantissa to 3 bits in place (a carry moves into the exponent, as
// it should); below 2^-6 the result is a multiple of the subnormal step 2^-9.
inline uint8_t F32ToE4M3(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7f;   // NaN
  if (abs >= 0x43e00000u) return sign | 0x7e;  // >= 448 (and infinities): saturate
  if (abs < 0x3c800000u) {                     // below 2^-6: subnormal (or zero)
    float a;
    std::memcpy(&a, &abs, 4);
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));  // 8 is 2^-6's code
  }
  const uint32_t rounded = abs + 0x7ffffu + ((abs >> 20) & 1u);  // to 3 mantissa bits, RNE
  const uint32_t code = (rounded >> 20) - ((127u - 7u) << 3);
  return sign | static_cast<uint8_t>(code > 0x7eu ? 0x7eu : code);
}

// The scales an fp8 cache keeps: powers of two in [2^-126, 2^119] (a normal fp32, and 448 times
// the largest is still finite, so no cached key dequantises to infinity).
inline constexpr int kMinScaleExp = -126, kMaxScaleExp = 119;

// The power-of-two scale of a tile with largest magnitude `amax` (1 for an all-zero tile),
// within the range above: tinier tiles use fewer codes, keys beyond 448 * 2^119 (~3e38) saturate.
inline float TileScale(float amax) {
  if (!(amax > 0) || !std::isfinite(amax)) return 1.0f;
  int e;
  std::frexp(amax / kE4M3Max, &e);  // amax/448 = m * 2^e, m in [0.5, 1): 2^e >= amax/448
  float s = std::ldexp(1.0f, e);
  if (amax / (s * 0.5f) <= kE4M3Max) s *= 0.5f;  // an exact power of two: the smaller one fits
  return std::fmin(std::fmax(s, std::ldexp(1.0f, kMinScaleExp)), std::ldexp(1.0f, kMaxScaleExp));
}

// Quantises `n` values (n a multiple of `tile`) into e4m3 with one scale per tile.
inline void QuantizeTiles(const float* x, int64_t n, int tile, uint8_t* values, float* scales) {
  for (int64_t t = 0; t < n / tile; ++t) {
    float amax = 0;
    for (int i = 0; i < tile; ++i) amax = std::fmax(amax, std::fabs(x[t * tile + i]));
    const float s = TileScale(amax), inv = 1.0f / s;  // exact: powers of two in range
    scales[t] = s;
    for (int i = 0; i < tile; ++i) values[t * tile + i] = F32ToE4M3(x[t * tile + i] * inv);
  }
}

// A latent token: c_kv [L] and k_rope [R] (fp32) into its LatentTokenBytes(L, R) bytes.
inline void PackLatentToken(int L, int R, const float* c_kv, const float* k_rope, uint8_t* out) {
  const int tiles = LatentTiles(L);
  float scales[64];  // L <= 8192
  QuantizeTiles(c_kv, L, LatentTileSize(L), out, scales);
  std::memcpy(out + L, scales, 4 * tiles);
  uint8_t* rope = out + L + 4 * tiles;
  for (int i = 0; i < R; ++i) {
    const uint16_t b = F32ToBF16(k_rope[i]);
    std::memcpy(rope + 2 * i, &b, 2);
  }
}

// Its bytes back as the L + R fp32 values [c_kv | k_rope].
ATTND_HD inline void UnpackLatentToken(int L, int R, const uint8_t* in, float* out) {
  const int tiles = LatentTiles(L), tile = LatentTileSize(L);
  for (int i = 0; i < L; ++i) {
    float scale;
    std::memcpy(&scale, in + L + 4 * (i / tile), 4);
    out[i] = E4M3ToF32(in[i]) * scale;
  }
  const uint8_t* rope = in + L + 4 * tiles;
  for (int i = 0; i < R; ++i) {
    uint16_t b;
    std::memcpy(&b, rope + 2 * i, 2);
    out[L + i] = BF16ToF32(b);
  }
}

// An indexer key [Di] into Di e4m3 values and its scale (stored apart: a page's values, then
// its scales).
inline void PackIndexKey(int Di, const float* k, uint8_t* values, float* scale) {
  QuantizeTiles(k, Di, Di, values, scale);
}

ATTND_HD inline void UnpackIndexKey(int Di, const uint8_t* values, float scale, float* out) {
  for (int i = 0; i < Di; ++i) out[i] = E4M3ToF32(values[i]) * scale;
}

// Whether `s` is a scale an fp8 cache can hold: a power of two in [2^-126, 2^119] (what TileScale
// gives), so dequantising stays exact and finite in fp32.
inline bool IsTileScale(float s) {
  if (!(s >= std::ldexp(1.0f, kMinScaleExp)) || !(s <= std::ldexp(1.0f, kMaxScaleExp)))
    return false;
  int e;
  return std::frexp(s, &e) == 0.5f;
}

}  // namespace attnd::fp8
