// The wgmma MLA (mla_wgmma.h) with its gather in a producer warpgroup of its own: warp
// specialisation. A block body over the thread interface (GpuThread on the GPU in
// kernels/cuda/ops/mla.cu; SimtThread in the CPU simulation, tests/sim/mla_pipe_sim_test.cc).
//
// Three warpgroups: the two consumer warpgroups (warps 0-7) do what the wgmma kernel's do per
// tile (S, the online softmax, P V: WgmmaTile), and the third only gathers: it issues every
// tile's cp.async copies into a ring of S stages (up to 4), and hands each tile over through
// mbarriers instead of block barriers:
//  - full[s]: the producer's 128 threads arrive once their copies of the stage's tile landed
//    (after fence.proxy.async for bf16 tiles, which the tensor cores read); the consumers wait
//    on it (parity: the tile's round through the ring);
//  - empty[s]: the 256 consumer threads arrive when their wgmma reading the stage (or, fp8,
//    their decode of its rows) has landed; the producer waits on it before copying the tile S
//    on into the stage.
// So the gather runs ahead by up to S tiles without ever waiting for the consumers' math, the
// consumers never wait for a straggling copy of a tile they are not on, and a bf16 tile costs the
// consumers no block barrier at all (the wgmma kernel: one a tile, which every thread, gathering
// or not, waits at). fp8 rows are decoded by the consumers into one of two bf16 tiles, with one
// named barrier among the 256 (bar.sync 1, 256) a tile: two tiles, so the decode of tile t + 1
// never waits for tile t's products.
//
// Before it blocks on an empty stage the producer lands (and hands over) every tile but the
// newest S - 2, oldest first: those stay in flight, and each tile's full arrival follows its own
// copies only. 384 threads at one block an SM get 168 registers a
// thread, under the consumers' ~200: setmaxnreg moves them, the producer down to 40 and the
// consumers up to 232 (ptxas allocates the code after each at its count: no spills).
#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "common/host_device.h"
#include "kernels/cuda/experimental/mla_wgmma.h"
#include "kernels/cuda/experimental/wgmma_layout.h"
#include "kernels/cuda/ops/fp8_chunks.h"
#include "kernels/cuda/ops/mla_pipe.h"

namespace attnd::cuda {

inline constexpr int kWsProducerThreads = wgmma::kGroupThreads;
// Registers a thread after setmaxnreg: 128 x 40 + 256 x 232 = 64,512 of the SM's 65,536.
inline constexpr int kWsProducerRegs = 40, kWsConsumerRegs = 232;
inline constexpr int kWsThreads = kWgThreads + kWsProducerThreads;
inline constexpr int kWsMaxStages = 4;
inline constexpr int kWsConsumerBarrier = 1;  // the consumers' named barrier (0 is Sync's)

// Q [64][D] bf16 | stages (bf16: key tiles as core matrices; fp8: rows as stored) | (fp8: two
// decoded tiles) | full[S], empty[S] mbarriers (8 bytes each).
struct MlaWgmmaWsSmem {
  uint32_t q, stage_bytes, stages, tile, decoded, full, empty, bytes;
  ATTND_HD static MlaWgmmaWsSmem Of(int latent, int rope, bool fp8, int stages) {
    MlaWgmmaWsSmem o;
    const uint32_t D = static_cast<uint32_t>(latent + rope), S = static_cast<uint32_t>(stages);
    o.tile = kPipeKeys * D * 2;
    o.q = 0;
    o.stages = kPipeHeads * D * 2;
    o.stage_bytes =
        fp8 ? kPipeKeys * static_cast<uint32_t>(fp8::LatentTokenBytes(latent, rope)) : o.tile;
    o.decoded = o.stages + S * o.stage_bytes;
    o.full = o.decoded + (fp8 ? 2 * o.tile : 0);
    o.empty = o.full + 8 * S;
    o.bytes = o.empty + 8 * S;
    return o;
  }
};

// One block: query first_query + qx, heads [hy * 64, hy * 64 + 64), split z of the query's keys
// (p.stages: 2 to kWsMaxStages).
template <bool kFp8, typename G>
ATTND_HD void MlaWgmmaWsBlock(G& g, const MlaPipeParams& p, int qx, int hy, int z) {
  constexpr int L = kWgLatent, R = kWgRope, D = L + R;  // p.latent, p.rope (MlaWgmmaTakes)
  const int q = p.first_query + qx, h0 = hy * kPipeHeads;
  const int tid = g.tid();
  const PipeKeys keys = PipeKeysOf(g, p, q);
  PipeSplit sp;
  if (!PipeSplitOf(keys.total, z, &sp)) return;
  const MlaWgmmaWsSmem sm = MlaWgmmaWsSmem::Of(L, R, kFp8, p.stages);
  const int S = p.stages;
  const uint32_t srow = static_cast<uint32_t>(fp8::LatentTokenBytes(L, R));
  if (tid == 0)
    for (int s = 0; s < S; ++s) {
      g.MbarInit(sm.full + 8 * s, kWsProducerThreads);
      g.MbarInit(sm.empty + 8 * s, kWgThreads);
    }
  g.Sync();  // the mbarriers initialised, for everyone

  if (tid >= kWgThreads) {
    // The producer warpgroup gives its registers to the consumers. Warp w copies keys
    // [8 w, 8 w + 8) of a tile, a thread one key (one slot lookup a tile): row r8, chunks cg,
    // cg + 4, ...; a warp's copy takes 4 neighbouring 16-byte chunks of 8 rows (64 contiguous
    // bytes of each row; bf16: 4 whole core matrices, 512 contiguous bytes of shared memory).
    // Rows past the split's end are zero-filled.
    g.template RegsDown<kWsProducerRegs>();
    const int pl = tid - kWgThreads, j = 8 * (pl / 32) + pl % 8, cg = (pl / 8) % 4;
    const int chunks = kFp8 ? static_cast<int>(srow / 16) : D / 8;
    int landed = 0, issued = 0;
    // Tiles [landed, upto) landed and handed over, oldest first.
    auto land = [&](int upto) {
      for (; landed < upto; ++landed) {
        g.CpWait(issued - landed - 1);
        if (!kFp8) g.FenceProxyAsync();  // the tensor cores read them (fp8: the decode's loads)
        g.MbarArrive(sm.full + 8 * (landed % S));
      }
    };
    for (int t = 0; t < sp.tiles; ++t) {
      // The key's row first: its slot lookup (dependent global loads) overlaps the wait.
      const int64_t key = sp.first + static_cast<int64_t>(t) * kPipeKeys + j;
      const bool valid = key < sp.last;
      const uint8_t* src = valid ? p.kv.Row(PipeSlot(g, p, q, keys, key)) : p.kv.base;
      if (t >= S) {
        // The stage's last tile (t - S) must be done with. The consumers need every tile up to
        // it, and get one more of slack; the newest S - 2 stay in flight meanwhile.
        land(t - S + 2);
        g.MbarWait(sm.empty + 8 * (t % S), (t / S - 1) & 1);
      }
      const uint32_t stage = sm.stages + static_cast<uint32_t>(t % S) * sm.stage_bytes;
      for (int c = cg; c < chunks; c += 4) {
        const uint32_t dst = kFp8 ? j * srow + c * 16 : wgmma::TileAt(D, j, c);
        g.CpAsync16(stage + dst, valid ? src + c * 16 : src, valid);
      }
      g.CpCommit();
      ++issued;
    }
    land(issued);
    return;
  }

  // The consumers: the producer's registers, then the query's heads as bf16 core matrices,
  // published among themselves (fp8: by the first decode's fence and barrier).
  g.template RegsUp<kWsConsumerRegs>();
  WgmmaStoreQuery(g, p, q, h0, sm.q, tid);
  if (!kFp8) {
    g.FenceProxyAsync();
    g.NamedSync(kWsConsumerBarrier, kWgThreads);
  }
  WgmmaRows a;
  a.Start();
  const int col0 = (tid / wgmma::kGroupThreads) * (L / 2);
  for (int t = 0; t < sp.tiles; ++t) {
    const uint32_t s = static_cast<uint32_t>(t % S);
    g.MbarWait(sm.full + 8 * s, (t / S) & 1);
    const int nk = sp.TileKeys(t);
    uint32_t k = sm.stages + s * sm.stage_bytes;
    const bool refill = t + S < sp.tiles;  // the producer waits for the stage (else nobody does)
    if (kFp8) {  // rows -> bf16 core matrices in decoded tile t % 2 (as the wgmma kernel)
      const uint32_t dec = sm.decoded + static_cast<uint32_t>(t % 2) * sm.tile;
      for (int i = tid; i < kPipeKeys * (D / 8); i += kWgThreads) {
        const int j = i % kPipeKeys, c = i / kPipeKeys;
        U32x4 w;
        PipeDecodeChunk(g, k + j * srow, L, c, w.v);
        g.St(dec + wgmma::TileAt(D, j, c), w);
      }
      if (refill) g.MbarArrive(sm.empty + 8 * s);  // its rows are read: the stage is free
      g.FenceProxyAsync();
      g.NamedSync(kWsConsumerBarrier, kWgThreads);
      k = dec;
    }
    WgmmaTile(g, p, a, sm.q, k, nk, col0);
    if (!kFp8 && refill) g.MbarArrive(sm.empty + 8 * s);  // the tensor cores are done with it
  }
  WgmmaStore(g, p, a, qx, q, h0, z, sp.splits, tid / wgmma::kGroupThreads, col0);
}

}  // namespace attnd::cuda
