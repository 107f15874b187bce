// Where wgmma (sm_90a's warpgroup-wide asynchronous mma) finds its operands and leaves its
// results, as the PTX ISA defines them ("Asynchronous Warpgroup Level Matrix Multiply-Accumulate":
// the matrix descriptor, the canonical no-swizzle layouts, the register fragments). Kernels
// address shared memory and registers through these, and the CPU simulation
// (tests/sim/simt_sim.h) executes wgmma by the same functions, so the two cannot drift apart.
//
// Shared-memory operands are tiles of "core matrices": 8 rows of 16 bytes (8 bf16), 128
// contiguous bytes. A descriptor names the first core matrix and two strides: LBO, between core
// matrices adjacent along K, and SBO, between core matrices adjacent along M or N (for both
// K-major and MN-major operands without swizzle). K-major: a core matrix's 16-byte rows are 8 K
// values of one M/N row; MN-major (B "transposed"): 8 N values of one K row.
#pragma once

#include <cstdint>

#include "common/host_device.h"
#include "kernels/cuda/ops/mma_fragments.h"

namespace attnd::cuda::wgmma {

inline constexpr int kGroupThreads =
    128;  // a warpgroup: 4 consecutive warps, the first a multiple of 4

// The 64-bit matrix descriptor: start address, LBO and SBO in 16-byte units (14 bits each),
// base offset 0, no swizzle (bits 62-63 = 0).
ATTND_HD inline uint64_t Desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t{(addr >> 4) & 0x3fffu} | (uint64_t{(lbo >> 4) & 0x3fffu} << 16) |
         (uint64_t{(sbo >> 4) & 0x3fffu} << 32);
}
ATTND_HD inline uint32_t DescAddr(uint64_t d) { return static_cast<uint32_t>(d & 0x3fff) << 4; }
ATTND_HD inline uint32_t DescLbo(uint64_t d) {
  return static_cast<uint32_t>((d >> 16) & 0x3fff) << 4;
}
ATTND_HD inline uint32_t DescSbo(uint64_t d) {
  return static_cast<uint32_t>((d >> 32) & 0x3fff) << 4;
}
// Whether only the fields above are set (base offset 0, no swizzle, reserved bits 0).
ATTND_HD inline bool DescPlain(uint64_t d) { return (d & 0xffffc000c000c000ull) == 0; }

// The byte offset, from the descriptor's start, of element (mn, k) of a K-major operand (A: mn is
// the row m; B: the column n) and of element (k, n) of an MN-major B.
ATTND_HD inline uint32_t KMajorAt(uint64_t d, int mn, int k) {
  return static_cast<uint32_t>(mn / 8) * DescSbo(d) + static_cast<uint32_t>(k / 8) * DescLbo(d) +
         static_cast<uint32_t>(mn % 8) * 16 + static_cast<uint32_t>(k % 8) * 2;
}
ATTND_HD inline uint32_t MnMajorAt(uint64_t d, int k, int n) {
  return static_cast<uint32_t>(n / 8) * DescSbo(d) + static_cast<uint32_t>(k / 8) * DescLbo(d) +
         static_cast<uint32_t>(k % 8) * 16 + static_cast<uint32_t>(n % 8) * 2;
}

// A tile of rows of `dim` bf16 values stored as core matrices, K-major: row r's values
// [8 c, 8 c + 8) at TileAt(r, c). Rows of 8 are dim * 16 bytes apart (SBO), 16-byte chunks of a
// row 128 bytes apart (LBO). As an MN-major B (K = rows, N = values) the same tile has LBO =
// dim * 16 (K, rows of 8) and SBO = 128 (N, chunks of 8 values).
ATTND_HD inline uint32_t TileAt(int dim, int r, int c) {
  return static_cast<uint32_t>(r / 8) * static_cast<uint32_t>(dim) * 16 +
         static_cast<uint32_t>(c) * 128 + static_cast<uint32_t>(r % 8) * 16;
}

// Accumulators of m64nNk16 (fp32): the thread of lane `lane` in warp `w` of the warpgroup holds
// N / 2 values; value i sits at row 16 w + RowD(lane, i), column ColD(lane, i) — m16n8's C
// layout, one n-tile of 8 columns per 4 values.
ATTND_HD inline int RowD(int lane, int i) { return mma::Group(lane) + ((i >> 1) & 1) * 8; }
ATTND_HD inline int ColD(int lane, int i) {
  return (i >> 2) * 8 + mma::InGroup(lane) * 2 + (i & 1);
}

// A from registers (bf16): 4 registers of 2 values, m16n8k16's A layout within the warp's 16 rows.
// The accumulators of m64n32 as A of the next product's two k-steps (k-step s: columns
// [16 s, 16 s + 16)): register r of k-step s packs values AFromD(s, r) and AFromD(s, r) + 1.
ATTND_HD inline int AFromD(int s, int r) { return (2 * s + (r >> 1)) * 4 + (r & 1) * 2; }

}  // namespace attnd::cuda::wgmma
