// A one-warpgroup check of wgmma as the kernels use it (wgmma_layout.h): out = A B + A B2 for a
// 64 x 16 A, a 16 x 32 B and a 16 x 32 B2 (bf16 in, fp32 out), by the two forms the wgmma MLA
// issues: A and B K-major from shared memory (S = Q K^T), then A from registers and B2 MN-major
// (O += P V), chained into the same accumulators. A body over the thread interface: the CPU
// simulation runs it (tests/sim/mla_pipe_sim_test.cc), and the GPU runs it once before the wgmma
// MLA is first used (MlaWgmmaSelfCheck, kernels/cuda/ops/mla.cu): if the hardware disagrees with
// the layouts the simulation assumed, the wgmma MLA stays off and the mma.sync kernel runs.
#pragma once

#include <cstdint>

#include "common/host_device.h"
#include "kernels/cuda/experimental/wgmma_layout.h"
#include "kernels/cuda/ops/mma_fragments.h"

namespace attnd::cuda {

// Shared memory: A as a [64][16] tile (TileAt, dim 16), B as [32 n][16 k] (K-major), B2 as
// [16 k][32 n] (rows of N values: MN-major).
struct WgmmaProbeSmem {
  static constexpr uint32_t kA = 0, kB = 64 * 16 * 2, kB2 = kB + 32 * 16 * 2,
                            kBytes = kB2 + 16 * 32 * 2;
};

// 128 threads. a: [64][16], b, b2: [16][32] bf16 bits, row-major; out: [64][32] fp32.
template <typename G>
ATTND_HD void WgmmaProbeBlock(G& g, const uint16_t* a, const uint16_t* b, const uint16_t* b2,
                              float* out) {
  using S = WgmmaProbeSmem;
  const int tid = g.tid(), w = g.warp(), l = g.lane();
  for (int i = tid; i < 64 * 16; i += wgmma::kGroupThreads) {  // A: element (m, k)
    const int m = i / 16, k = i % 16;
    g.St(S::kA + wgmma::TileAt(16, m, k / 8) + (k % 8) * 2, g.Gld(a + i));
  }
  for (int i = tid; i < 16 * 32; i += wgmma::kGroupThreads) {  // B, B2: element (k, n)
    const int k = i / 32, n = i % 32;
    g.St(S::kB + wgmma::TileAt(16, n, k / 8) + (k % 8) * 2, g.Gld(b + i));
    g.St(S::kB2 + wgmma::TileAt(32, k, n / 8) + (n % 8) * 2, g.Gld(b2 + i));
  }
  g.FenceProxyAsync();
  g.Sync();
  // A's registers for the second product: rows 16 w + RowA of this warp, m16n8k16's layout.
  uint32_t ar[4];
  for (int r = 0; r < 4; ++r)
    ar[r] = static_cast<uint32_t>(g.Gld(a + (16 * w + mma::RowA(l, r)) * 16 + mma::ColA(l, r, 0))) |
            (static_cast<uint32_t>(g.Gld(a + (16 * w + mma::RowA(l, r)) * 16 + mma::ColA(l, r, 1)))
             << 16);
  float d[16];
  for (int i = 0; i < 16; ++i) d[i] = 0.0f;
  g.WgmmaHold(d, 16);
  g.WgmmaHoldA(ar, 4);
  g.WgmmaFence();
  g.Wgmma(d, wgmma::Desc(g.SmemAddr(S::kA), 128, 16 * 16),
          wgmma::Desc(g.SmemAddr(S::kB), 128, 16 * 16), false);
  g.WgmmaRegA(d, ar, wgmma::Desc(g.SmemAddr(S::kB2), 32 * 16, 128), true);
  g.WgmmaCommit();
  g.WgmmaWait(0);
  g.WgmmaLanded(d, 16);
  g.WgmmaLandedA(ar, 4);
  for (int i = 0; i < 16; ++i)
    g.Gst(out + (16 * w + wgmma::RowD(l, i)) * 32 + wgmma::ColD(l, i), d[i]);
}

}  // namespace attnd::cuda
