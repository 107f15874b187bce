// A lane-level CPU simulation of IndexerMmaKernel (kernels/cuda/ops/indexer.cu) for one block:
// 8 warps x 32 lanes run the kernel's code with the same shared-memory layout and the same
// fragment addressing (mma_fragments.h); each mma.sync runs from the 32 lanes' registers as the
// PTX ISA defines it, shuffles as butterflies across the warp, shared memory through the checks
// of mma_sim.h. Used by tests/sim/mma_sim_test.cc; keep it in step with the kernel.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "kernels/cuda/ops/mma_fragments.h"
#include "tests/sim/mma_sim.h"

namespace attnd::cuda::sim {

// One block: query q [H, D] (fp32, rounded to bf16 as the kernel does), head weights w [H], the
// tile's nk key rows [nk, D] (bf16 bits). Returns the kernel's scores [nk]; throws on a race,
// an out-of-bounds or unwritten access, or a misaligned 16-byte or 4-byte access.
inline std::vector<float> RunIndexerMmaBlock(int H, int D, const std::vector<float>& q,
                                             const std::vector<float>& w,
                                             const std::vector<uint16_t>& keys, int nk) {
  constexpr int kKeys = 64, kThreads = 256;
  if (H % 16 != 0 || D % 16 != 0) throw std::runtime_error("shape outside the kernel's contract");
  const int DP = D + 8;
  // Layout in 16-bit cells: qs [H][DP] | ks [64][DP] | ws [H] floats (2 cells each).
  const size_t qs = 0, ks = size_t(H) * DP, ws = ks + size_t(kKeys) * DP;
  Smem smem(ws + 2 * size_t(H));
  // Phase 1: every thread's loads, as the kernel's loops stride them (the key rows arrive by
  // cp.async; they are complete once each thread has waited and the barrier has passed).
  for (int tid = 0; tid < kThreads; ++tid) {
    for (int i = tid; i < H * D; i += kThreads)
      smem.Write(qs + size_t(i / D) * DP + i % D, F32ToBF16(q[i]), tid);
    for (int i = tid; i < H; i += kThreads) smem.WriteF32(ws + 2 * size_t(i), w[i], tid);
    const int chunks = D / 8;
    for (int i = tid; i < kKeys * chunks; i += kThreads) {
      const int j = i / chunks, c = i % chunks;
      const size_t dst = ks + size_t(j) * DP + c * 8;
      if ((dst * 2) % 16 != 0) throw std::runtime_error("misaligned 16-byte store to ks");
      for (int e = 0; e < 8; ++e)
        smem.Write(dst + e, j < nk ? keys[size_t(j) * D + c * 8 + e] : 0, tid);
    }
  }
  smem.Barrier();
  // Phase 2: each warp's lanes gather fragments exactly as the kernel addresses them.
  auto pair = [&](size_t cell, int thread) {  // the kernel's Pair(): a 32-bit load of 2 bf16
    if ((cell * 2) % 4 != 0) throw std::runtime_error("misaligned 32-bit fragment load");
    return std::make_pair(BF16ToF32(smem.Read(cell, thread)),
                          BF16ToF32(smem.Read(cell + 1, thread)));
  };
  std::vector<float> scores(nk, NAN);
  for (int warp = 0; warp < kThreads / 32; ++warp) {
    float part[32][2] = {};
    for (int m0 = 0; m0 < H; m0 += 16) {
      float c[32][4] = {};
      for (int k0 = 0; k0 < D; k0 += 16) {
        float a[32][8], b[32][4];
        for (int lane = 0; lane < 32; ++lane) {
          const size_t krow = ks + size_t(warp * 8 + mma::ColB(lane)) * DP;
          for (int r = 0; r < 4; ++r) {
            const auto v =
                pair(qs + size_t(m0 + mma::RowA(lane, r)) * DP + k0 + mma::ColA(lane, r, 0),
                     warp * 32 + lane);
            a[lane][2 * r] = v.first;
            a[lane][2 * r + 1] = v.second;
          }
          for (int r = 0; r < 2; ++r) {
            const auto v = pair(krow + k0 + mma::RowB(lane, r, 0), warp * 32 + lane);
            b[lane][2 * r] = v.first;
            b[lane][2 * r + 1] = v.second;
          }
        }
        MmaSync(a, b, c);
      }
      for (int lane = 0; lane < 32; ++lane)
        for (int i = 0; i < 4; ++i) {
          const float x = c[lane][i];
          part[lane][i & 1] +=
              smem.ReadF32(ws + 2 * size_t(m0 + mma::RowC(lane, i)), warp * 32 + lane) *
              (x < 0.0f ? 0.0f : x);
        }
    }
    for (int off = 4; off < 32; off <<= 1) {  // __shfl_xor_sync butterflies
      float next[32][2];
      for (int lane = 0; lane < 32; ++lane)
        for (int e = 0; e < 2; ++e) next[lane][e] = part[lane][e] + part[lane ^ off][e];
      std::memcpy(part, next, sizeof(part));
    }
    for (int lane = 0; lane < 32; ++lane) {
      if (mma::Group(lane) != 0) continue;
      for (int e = 0; e < 2; ++e) {
        const int j = warp * 8 + mma::ColC(lane, e);
        if (j < nk) {
          if (!std::isnan(scores[j])) throw std::runtime_error("score written twice");
          scores[j] = part[lane][e];
        }
      }
    }
  }
  return scores;
}

}  // namespace attnd::cuda::sim
