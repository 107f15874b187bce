// fp8 cache rows read as bf16, 8 values (16 bytes of shared memory) at a time: what the
// tensor-core kernels' loaders (kernels/cuda/ops/mla.cu, indexer.cu) put in shared memory for an
// fp8 cache, and what their lane-level simulations (tests/sim/mla_mma_sim.h,
// tests/sim/indexer_stream_sim_test.cc) put there, from this same code. Plain C++ with ATTND_HD:
// host and device.
//
// Exact: an e4m3 value has at most 4 significant bits and a cache's scales are powers of two
// (common/fp8.h), so code x scale is a bf16 value, and fp32's top half is that value. Only
// products below bf16's smallest subnormal (2^-133: a tile scale near 2^-126, i.e. a tile whose
// largest value is below 448 x 2^-126 ~ 5e-36) lose bits.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/fp8.h"
#include "common/host_device.h"

namespace attnd::cuda {

// code x scale as bf16 bits.
ATTND_HD inline uint16_t ScaledE4M3ToBF16(uint8_t code, float scale) {
  const float x = fp8::E4M3ToF32(code) * scale;
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return static_cast<uint16_t>(b >> 16);
}

// 8 codes (the little-endian bytes of `codes`) times `scale`, as 8 bf16 values packed two per
// 32-bit word, low first (a 16-byte shared-memory chunk).
ATTND_HD inline void DecodeE4M3x8(uint64_t codes, float scale, uint32_t out[4]) {
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = ScaledE4M3ToBF16(static_cast<uint8_t>(codes >> (16 * i)), scale);
    const uint32_t hi = ScaledE4M3ToBF16(static_cast<uint8_t>(codes >> (16 * i + 8)), scale);
    out[i] = lo | (hi << 16);
  }
}

// Chunk c (values [8c, 8c + 8)) of an fp8 latent row [L e4m3 | tile scales | R bf16]: the byte
// offsets of its 8 codes and their tile's scale, or of its 8 rope values.
struct Fp8LatentChunk {
  bool rope = false;
  int codes = 0, scale = 0;  // !rope
  int rope_bytes = 0;        // rope
};
ATTND_HD inline Fp8LatentChunk LatentChunkAt(int L, int c) {
  Fp8LatentChunk at;
  const int v = 8 * c;
  if (v < L) {
    at.codes = v;
    at.scale = L + 4 * (v / fp8::LatentTileSize(L));
  } else {
    at.rope = true;
    at.rope_bytes = L + 4 * fp8::LatentTiles(L) + 2 * (v - L);
  }
  return at;
}

// Whether 16-byte chunk loaders can read these rows (rows 16-byte aligned): no chunk straddles
// the codes and the rope, and every rope chunk is 16-byte aligned.
ATTND_HD inline bool Fp8LatentRowsTakeChunks(int L, int R) {
  return L % 8 == 0 && R % 8 == 0 && (L + 4 * fp8::LatentTiles(L)) % 16 == 0 &&
         fp8::LatentTokenBytes(L, R) % 16 == 0;
}

// An fp8 indexer key's 8 values [8c, 8c + 8) as bf16 (its one scale kept apart).
ATTND_HD inline void IndexChunk(const uint8_t* values, float scale, int c, uint32_t out[4]) {
  uint64_t codes;
  std::memcpy(&codes, values + 8 * c, 8);
  DecodeE4M3x8(codes, scale, out);
}

}  // namespace attnd::cuda
