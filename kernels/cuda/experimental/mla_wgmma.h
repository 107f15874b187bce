// Sparse (and range) MLA on sm_90a's warpgroup tensor cores (wgmma): a block body over the
// thread interface (GpuThread on the GPU in kernels/cuda/ops/mla.cu; SimtThread in the CPU
// simulation, tests/sim/mla_pipe_sim_test.cc), the same code.
//
// The pipelined kernel's block (mla_pipe.h: one query's 64 heads, one split of its keys, tiles
// of 32 key rows gathered by cp.async through a ring of stages, fp8 rows decoded in the block)
// with its math on wgmma: two warpgroups, each computing S = Q K^T for all 64 heads x 32 keys
// (36 wgmma m64n32k16 at DeepSeek dims, both operands read by the tensor cores from shared
// memory, no ldmatrix), the online softmax on S's accumulators in registers (m and l per row
// held by the row's 4 threads, no shared memory and no barrier), P rounded to bf16 into the
// registers of the next product's A operand, and O += P V for its half of the L output columns
// (V read from the same tile, MN-major). Each warpgroup computes S itself: sharing it would cost
// a shared-memory round trip and two barriers a tile, S is under half the products, and the
// kernel is bound by the key rows' bytes, not by tensor-core time. The two warpgroups' S, m and l
// are bit-identical (same operands, same instructions).
//
// Shared memory holds tiles as wgmma's core matrices (wgmma_layout.h, TileAt): Q [64][D] bf16 |
// stages (bf16: key tiles [32][D] as core matrices; fp8: rows as stored) | (fp8: one decoded
// tile). Every generic write a wgmma will read (the query, the landed copies, the decoded tile)
// is followed by fence.proxy.async before the barrier that publishes it.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "common/host_device.h"
#include "kernels/cuda/experimental/wgmma_layout.h"
#include "kernels/cuda/ops/fp8_chunks.h"
#include "kernels/cuda/ops/mla_pipe.h"
#include "kernels/cuda/ops/mla_split.h"

namespace attnd::cuda {

inline constexpr int kWgThreads = 2 * wgmma::kGroupThreads;
// Four 32-bit values stored at once (a 16-byte shared store).
struct alignas(16) U32x4 {
  uint32_t v[4];
};
// The one shape it takes, DeepSeek-V3.2's and GLM-5's (L 512, R 64): every loop over wgmma has a
// compile-time trip count, so ptxas sees the accumulators untouched between wgmma.fence and the
// wgmma (a branch or a loop-carried accumulator between them makes it insert warpgroup.arrive
// before each, serialising them). Other latents take the mma.sync pipelined kernel.
inline constexpr int kWgLatent = 512, kWgRope = 64;
inline constexpr int kWgChunks = kWgLatent / 64;  // 32-column chunks of O a warpgroup holds
static_assert(kPipeKeys == 32, "S is one m64n32 tile; P V two k-steps of 16 keys");
static_assert(kWgThreads / kPipeKeys == kPipePerKey, "the gather of mla_pipe.h, 8 threads a key");

// The shapes it takes: L 512, R 64, heads a multiple of 64, bf16 rows or fp8 rows that load in
// 16-byte chunks.
ATTND_HD inline bool MlaWgmmaTakes(int heads, int latent, int rope, DType kv) {
  return latent == kWgLatent && rope == kWgRope && MlaPipeTakes(heads, latent, rope, kv);
}

struct MlaWgmmaSmem {
  uint32_t q, stage_bytes, stages, decoded, bytes;
  ATTND_HD static MlaWgmmaSmem Of(int latent, int rope, bool fp8, int stages) {
    MlaWgmmaSmem o;
    const uint32_t D = static_cast<uint32_t>(latent + rope), tile = kPipeKeys * D * 2;
    o.q = 0;
    o.stages = kPipeHeads * D * 2;
    o.stage_bytes =
        fp8 ? kPipeKeys * static_cast<uint32_t>(fp8::LatentTokenBytes(latent, rope)) : tile;
    o.decoded = o.stages + static_cast<uint32_t>(stages) * o.stage_bytes;
    o.bytes = o.decoded + (fp8 ? tile : 0);
    return o;
  }
};

// This warpgroup's rows of the 64 heads: 16 wwarp + RowD (two of them, r = 0, 1), their
// running max and denominator (the same in the row's 4 threads and in both warpgroups), and O's
// columns [wg L / 2, (wg + 1) L / 2) in chunks of 32, in registers.
struct WgmmaRows {
  float m[2], l[2];
  float o[kWgChunks][16];
  ATTND_HD void Start() {
    ATTND_UNROLL
    for (int r = 0; r < 2; ++r) m[r] = -INFINITY, l[r] = 0.0f;
    ATTND_UNROLL
    for (int n = 0; n < kWgChunks; ++n) {
      ATTND_UNROLL
      for (int i = 0; i < 16; ++i) o[n][i] = 0.0f;
    }
  }
};

// The query's heads [h0, h0 + 64) into shared memory at q_off as bf16 core matrices, 4 values a
// 16-byte load and an 8-byte store (the query rows 16-byte aligned: MlaUsesWgmma), by the
// kWgThreads threads of the two warpgroups (tid).
template <typename G>
ATTND_HD void WgmmaStoreQuery(G& g, const MlaPipeParams& p, int q, int h0, uint32_t q_off,
                              int tid) {
  constexpr int D = kWgLatent + kWgRope;
  for (int i = tid; i < kPipeHeads * (D / 4); i += kWgThreads) {
    const int h = i / (D / 4), d = i % (D / 4) * 4;
    g.St(q_off + wgmma::TileAt(D, h, d / 8) + (d % 8) * 2, PipeQueryBf16x4(g, p, q, h0, h, d));
  }
}

// One tile of 32 keys (nk of them real) at k, in core matrices, through a warpgroup: S = Q K^T,
// the online softmax on its accumulators, O = corr O + P V for the warpgroup's columns from
// col0. Every operand it reads is published to the warpgroup before the call; every wgmma has
// landed when it returns.
template <typename G>
ATTND_HD void WgmmaTile(G& g, const MlaPipeParams& p, WgmmaRows& a, uint32_t q_off, uint32_t k,
                        int nk, int col0) {
  constexpr int D = kWgLatent + kWgRope;
  constexpr uint32_t sbo = static_cast<uint32_t>(D) * 16;  // rows of 8 apart in a tile
  const int lane = g.lane();
  // 1. S = Q K^T, 64 heads x 32 keys: D / 16 k-steps, both operands K-major from shared
  // memory (core matrices 128 bytes apart along K, rows of 8 sbo apart).
  float s[16];
  ATTND_UNROLL
  for (int i = 0; i < 16; ++i) s[i] = 0.0f;
  g.WgmmaHold(s, 16);
  g.WgmmaFence();
  ATTND_UNROLL
  for (int ks = 0; ks < D / 16; ++ks)
    g.Wgmma(s, wgmma::Desc(g.SmemAddr(q_off + ks * 256), 128, sbo),
            wgmma::Desc(g.SmemAddr(k + ks * 256), 128, sbo), false);
  g.WgmmaCommit();
  g.WgmmaWait(0);
  g.WgmmaLanded(s, 16);
  // 2. Online softmax on the accumulators: value i is row RowD(lane, i) (r = (i >> 1) & 1),
  // key ColD(lane, i); a row's 32 keys are in its 4 neighbouring lanes (shuffles 1, 2).
  float mx[2] = {-INFINITY, -INFINITY};
  ATTND_UNROLL
  for (int i = 0; i < 16; ++i) {
    float x = s[i] * p.sm_scale;
    if (p.soft_cap > 0) x = p.soft_cap * tanhf(x / p.soft_cap);
    s[i] = wgmma::ColD(lane, i) < nk ? x : -INFINITY;
    const int r = (i >> 1) & 1;
    mx[r] = s[i] > mx[r] ? s[i] : mx[r];
  }
  float corr[2], sum[2] = {0.0f, 0.0f};
  bool none[2];
  ATTND_UNROLL
  for (int r = 0; r < 2; ++r) {
    for (int off = 1; off < 4; off <<= 1) {
      const float other = g.ShflXor(mx[r], off);
      mx[r] = other > mx[r] ? other : mx[r];
    }
    if (a.m[r] > mx[r]) mx[r] = a.m[r];
    corr[r] = a.m[r] == -INFINITY ? 0.0f : expf(a.m[r] - mx[r]);
    none[r] = mx[r] == -INFINITY;  // nothing visible yet: probabilities stay 0
  }
  uint16_t pb[16];
  ATTND_UNROLL
  for (int i = 0; i < 16; ++i) {
    const int r = (i >> 1) & 1;
    pb[i] = F32ToBF16(none[r] ? 0.0f : expf(s[i] - mx[r]));
    sum[r] += BF16ToF32(pb[i]);  // the denominator sums what P holds
  }
  ATTND_UNROLL
  for (int r = 0; r < 2; ++r) {
    for (int off = 1; off < 4; off <<= 1) sum[r] += g.ShflXor(sum[r], off);
    a.l[r] = a.l[r] * corr[r] + sum[r];
    a.m[r] = mx[r];
  }
  uint32_t pa[2][4];  // P as A of the two 16-key k-steps
  ATTND_UNROLL
  for (int ks = 0; ks < 2; ++ks) {
    ATTND_UNROLL
    for (int r = 0; r < 4; ++r) {
      const int i = wgmma::AFromD(ks, r);
      pa[ks][r] = static_cast<uint32_t>(pb[i]) | (static_cast<uint32_t>(pb[i + 1]) << 16);
    }
  }
  // 3. O = corr O + P V: per 32-column chunk, two k-steps of 16 keys; V is the tile read
  // MN-major (keys along K: rows of 8 sbo apart; columns along N: chunks of 8 128 bytes apart).
  ATTND_UNROLL
  for (int n = 0; n < kWgChunks; ++n) {
    ATTND_UNROLL
    for (int i = 0; i < 16; ++i) a.o[n][i] *= corr[(i >> 1) & 1];
    g.WgmmaHold(a.o[n], 16);
  }
  g.WgmmaHoldA(pa[0], 4);
  g.WgmmaHoldA(pa[1], 4);
  g.WgmmaFence();
  ATTND_UNROLL
  for (int n = 0; n < kWgChunks; ++n) {
    ATTND_UNROLL
    for (int ks = 0; ks < 2; ++ks)
      g.WgmmaRegA(a.o[n], pa[ks],
                  wgmma::Desc(g.SmemAddr(k + 2 * ks * sbo + ((col0 + 32 * n) / 8) * 128), sbo, 128),
                  true);
  }
  g.WgmmaCommit();
  g.WgmmaWait(0);
  g.WgmmaLandedA(pa[0], 4);
  g.WgmmaLandedA(pa[1], 4);
  ATTND_UNROLL
  for (int n = 0; n < kWgChunks; ++n) {
    g.WgmmaLanded(a.o[n], 16);
  }
}

// The block's result for query first_query + qx (q), heads from h0, split z of `splits`: of
// one split the normalised output (and lse); of several this split's sums and (m, l) for
// MlaCombineKernel. m and l: written once, by warpgroup 0's first thread of a row.
template <typename G>
ATTND_HD void WgmmaStore(G& g, const MlaPipeParams& p, const WgmmaRows& a, int qx, int q, int h0,
                         int z, int splits, int wg, int col0) {
  constexpr int L = kWgLatent;
  const int H = p.heads, lane = g.lane(), wwarp = g.warp() % 4;
  const bool partial = splits > 1;
  const int64_t wave = p.part_queries;
  float* out = partial ? p.part_out + static_cast<int64_t>(z) * wave * H * L : p.out;
  const int row_q = partial ? qx : q;
  ATTND_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int h = 16 * wwarp + wgmma::RowD(lane, 2 * r);
    if (wg == 0 && mma::InGroup(lane) == 0) {
      if (partial) {
        float* ml = p.part_ml + ((static_cast<int64_t>(z) * wave + qx) * H + h0 + h) * 2;
        g.Gst(ml, a.m[r]);
        g.Gst(ml + 1, a.l[r]);
      } else if (p.lse != nullptr) {
        g.Gst(p.lse + static_cast<int64_t>(q) * H + h0 + h,
              a.l[r] == 0 ? -INFINITY : a.m[r] + logf(a.l[r]));
      }
    }
  }
  ATTND_UNROLL
  for (int n = 0; n < kWgChunks; ++n) {
    ATTND_UNROLL
    for (int i = 0; i < 16; ++i) {
      const int r = (i >> 1) & 1, h = 16 * wwarp + wgmma::RowD(lane, i);
      const float inv = partial ? 1.0f : a.l[r] > 0 ? 1.0f / a.l[r] : 0.0f;
      const int col = col0 + 32 * n + wgmma::ColD(lane, i);
      g.Gst(out + (static_cast<int64_t>(row_q) * H + h0 + h) * L + col, a.o[n][i] * inv);
    }
  }
}

// One block: query first_query + qx, heads [hy * 64, hy * 64 + 64), split z of the query's keys.
template <bool kFp8, typename G>
ATTND_HD void MlaWgmmaBlock(G& g, const MlaPipeParams& p, int qx, int hy, int z) {
  constexpr int L = kWgLatent, R = kWgRope, D = L + R;  // p.latent, p.rope (MlaWgmmaTakes)
  const int q = p.first_query + qx, h0 = hy * kPipeHeads;
  const int tid = g.tid(), wg = tid / wgmma::kGroupThreads;
  const PipeKeys keys = PipeKeysOf(g, p, q);
  PipeSplit sp;
  if (!PipeSplitOf(keys.total, z, &sp)) return;
  const MlaWgmmaSmem sm = MlaWgmmaSmem::Of(L, R, kFp8, p.stages);
  const int S = p.stages;

  // Tile t's rows into stage t % S, 16 bytes a copy: bf16 chunk c of key j at TileAt(j, c);
  // fp8 rows as stored. Rows past the split's end are zero-filled. kPipePerKey threads copy a
  // key (one slot lookup each per tile), chunks c0, c0 + 8, ...; the 8 neighbouring threads of a
  // quarter-warp take the 8 rows of one core matrix at the same chunk, 128 contiguous bytes (no
  // bank conflict; neighbouring chunks of a row are 128 bytes apart).
  const int chunks = kFp8 ? fp8::LatentTokenBytes(L, R) / 16 : D / 8;
  const uint32_t srow = static_cast<uint32_t>(fp8::LatentTokenBytes(L, R));
  const int my_key = 8 * (tid / 64) + tid % 8, c0 = (tid / 8) % 8;
  auto issue = [&](int t) {
    const uint32_t stage = sm.stages + static_cast<uint32_t>(t % S) * sm.stage_bytes;
    const int64_t key = sp.first + static_cast<int64_t>(t) * kPipeKeys + my_key;
    const bool valid = key < sp.last;
    const uint8_t* src = valid ? p.kv.Row(PipeSlot(g, p, q, keys, key)) : p.kv.base;
    for (int c = c0; c < chunks; c += kPipePerKey) {
      const uint32_t dst = kFp8 ? my_key * srow + c * 16 : wgmma::TileAt(D, my_key, c);
      g.CpAsync16(stage + dst, valid ? src + c * 16 : src, valid);
    }
  };
  for (int t = 0; t < S - 1; ++t) {
    if (t < sp.tiles) issue(t);
    g.CpCommit();
  }

  // While those gathers fly: the query's heads as bf16 core matrices.
  WgmmaStoreQuery(g, p, q, h0, sm.q, tid);

  WgmmaRows a;
  a.Start();
  const int col0 = wg * (L / 2);

  for (int t = 0; t < sp.tiles; ++t) {
    g.CpWait(S - 2);  // this thread's copies of tile t landed...
    // ...visible to the tensor cores, with its query stores (fp8 rows are read by the decode's
    // generic loads, and the fence after the decode covers the query stores)...
    if (!kFp8) g.FenceProxyAsync();
    g.Sync();  // ...everyone's; tile t - 1's stage (and decoded tile) are free
    if (t + S - 1 < sp.tiles) issue(t + S - 1);
    g.CpCommit();
    const int nk = sp.TileKeys(t);
    uint32_t k = sm.stages + static_cast<uint32_t>(t % S) * sm.stage_bytes;
    if (kFp8) {  // rows -> bf16 core matrices (codes x their tile's scale; rope copied)
      // Key fastest: a quarter-warp's 16-byte stores fill one core matrix (128 bytes).
      for (int i = tid; i < kPipeKeys * (D / 8); i += kWgThreads) {
        const int j = i % kPipeKeys, c = i / kPipeKeys;
        U32x4 w;
        PipeDecodeChunk(g, k + j * srow, L, c, w.v);
        g.St(sm.decoded + wgmma::TileAt(D, j, c), w);
      }
      g.FenceProxyAsync();
      g.Sync();
      k = sm.decoded;
    }
    WgmmaTile(g, p, a, sm.q, k, nk, col0);
  }
  WgmmaStore(g, p, a, qx, q, h0, z, sp.splits, wg, col0);
}

}  // namespace attnd::cuda
