// float8_e4m3fn and the fp8 cache's token formats (DESIGN §4): what --cache-dtype=fp8 stores.
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
inline constexpr int kLatentTile = 128;                           // values per latent scale
inline constexpr int kLatentValues = 512;                         // L (the layout is for L = 512)
inline constexpr int kLatentTiles = kLatentValues / kLatentTile;  // 4 scales
inline constexpr int kRopeValues = 64;                            // R
inline constexpr int kLatentTokenBytes = kLatentValues + 4 * kLatentTiles + 2 * kRopeValues;  // 656
inline constexpr int kIndexValues = 128;                                                      // Di
inline constexpr int kIndexTokenBytes = kIndexValues + 4;                                     // 132

// e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; 0x7f/0xff are NaN.
ATTND_HD inline float E4M3ToF32(uint8_t v) {
  const int sign = v >> 7, exp = (v >> 3) & 0xf, man = v & 0x7;
  float mag;
  if (exp == 0xf && man == 0x7) {
    mag = NAN;
  } else if (exp == 0) {
    mag = std::ldexp(static_cast<float>(man), -9);  // subnormal: man / 8 * 2^-6
  } else {
    mag = std::ldexp(static_cast<float>(8 + man), exp - 10);  // (1 + man/8) * 2^(exp-7)
  }
  return sign ? -mag : mag;
}

// Round to nearest even; beyond +-448 saturates to +-448; NaN stays NaN (0x7f with its sign).
inline uint8_t F32ToE4M3(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  if (std::isnan(f)) return sign | 0x7f;
  const float a = std::fabs(f);
  if (a >= kE4M3Max) return sign | 0x7e;       // 448 (infinities saturate too)
  if (a < std::ldexp(1.0f, -10)) return sign;  // below half the smallest subnormal: zero
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  // The step between e4m3 values around a: 2^(e-4) for normals (3 mantissa bits), 2^-9 below.
  const int step_exp = e - 1 < -6 ? -9 : e - 4;
  const float q = std::nearbyint(std::ldexp(a, -step_exp));  // round half to even
  const float r = std::ldexp(q, step_exp);
  if (r == 0) return sign;  // exactly half the smallest subnormal: ties to even, zero
  if (r >= kE4M3Max) return sign | 0x7e;
  // Encode r exactly (it is representable).
  int re;
  const float rm = std::frexp(r, &re);
  if (re - 1 < -6) return sign | static_cast<uint8_t>(std::ldexp(r, 9));  // subnormal
  const int exp = re - 1 + 7;
  const int man = static_cast<int>(std::ldexp(rm, 4)) - 8;  // rm in [0.5,1): 8 + man = rm * 16
  return sign | static_cast<uint8_t>(exp << 3) | static_cast<uint8_t>(man);
}

// The power-of-two scale of a tile with largest magnitude `amax` (1 for an all-zero tile).
inline float TileScale(float amax) {
  if (!(amax > 0) || !std::isfinite(amax)) return 1.0f;
  int e;
  std::frexp(amax / kE4M3Max, &e);  // amax/448 = m * 2^e, m in [0.5, 1): 2^e >= amax/448
  float s = std::ldexp(1.0f, e);
  if (amax / (s * 0.5f) <= kE4M3Max) s *= 0.5f;  // an exact power of two: the smaller one fits
  return s;
}

// Quantises `n` values (n a multiple of `tile`) into e4m3 with one scale per tile.
inline void QuantizeTiles(const float* x, int n, int tile, uint8_t* values, float* scales) {
  for (int t = 0; t < n / tile; ++t) {
    float amax = 0;
    for (int i = 0; i < tile; ++i) amax = std::fmax(amax, std::fabs(x[t * tile + i]));
    const float s = TileScale(amax);
    scales[t] = s;
    for (int i = 0; i < tile; ++i) values[t * tile + i] = F32ToE4M3(x[t * tile + i] / s);
  }
}

// A latent token: c_kv [512] and k_rope [64] (fp32) into its 656 bytes.
inline void PackLatentToken(const float* c_kv, const float* k_rope, uint8_t* out) {
  float scales[kLatentTiles];
  QuantizeTiles(c_kv, kLatentValues, kLatentTile, out, scales);
  std::memcpy(out + kLatentValues, scales, sizeof(scales));
  uint8_t* rope = out + kLatentValues + sizeof(scales);
  for (int i = 0; i < kRopeValues; ++i) {
    const uint16_t b = F32ToBF16(k_rope[i]);
    std::memcpy(rope + 2 * i, &b, 2);
  }
}

// Its 656 bytes back as the 576 fp32 values [c_kv | k_rope].
ATTND_HD inline void UnpackLatentToken(const uint8_t* in, float* out) {
  float scales[kLatentTiles];
  std::memcpy(scales, in + kLatentValues, sizeof(scales));
  for (int i = 0; i < kLatentValues; ++i) out[i] = E4M3ToF32(in[i]) * scales[i / kLatentTile];
  const uint8_t* rope = in + kLatentValues + sizeof(scales);
  for (int i = 0; i < kRopeValues; ++i) {
    uint16_t b;
    std::memcpy(&b, rope + 2 * i, 2);
    out[kLatentValues + i] = BF16ToF32(b);
  }
}

// An indexer key [128] into 128 e4m3 values and its scale (stored apart: a page's values, then
// its scales).
inline void PackIndexKey(const float* k, uint8_t* values, float* scale) {
  QuantizeTiles(k, kIndexValues, kIndexValues, values, scale);
}

ATTND_HD inline void UnpackIndexKey(const uint8_t* values, float scale, float* out) {
  for (int i = 0; i < kIndexValues; ++i) out[i] = E4M3ToF32(values[i]) * scale;
}

}  // namespace attnd::fp8
