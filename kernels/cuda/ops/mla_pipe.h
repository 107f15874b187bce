// Sparse (and range) MLA on tensor cores with the key rows pipelined: a block body over the
// thread interface (GpuThread on the GPU in kernels/cuda/ops/mla.cu; SimtThread in the CPU
// simulation, tests/sim/mla_pipe_sim_test.cc), the same code.
//
// A block takes one query's 64 heads (the query in shared memory as bf16) and one split of its
// keys (mla_split.h: the split from the query's own key count, so its bits do not depend on the
// batch). Key rows, gathered by their slots, stream in tiles of 32 through a ring of stages by
// cp.async, up to stages - 1 tiles ahead of the tile being attended, so the gather of later
// tiles overlaps this one's math (the tile-per-block kernel loaded each tile through registers
// and waited). fp8 rows are copied as stored and decoded to bf16 in the block (exact). Per tile:
// S = Q K^T (each warp 16 heads x 16 keys), an online softmax by 4 threads per head (shuffles),
// P rounded to bf16, O += P V (each warp L / 8 output columns of all 64 heads). Operands come
// out of shared memory by ldmatrix (V's by ldmatrix.trans), four 8 x 8 quarters an instruction
// (88 shared loads a warp per tile at DeepSeek dims, from 384 32- and 16-bit loads); each
// thread looks up one key's row per tile; the 128 output accumulators stay in registers (no
// kernel may use local memory: the build refuses one that does).
//
// Shared memory (bytes): Q [64][D + 8] bf16 | stages | (fp8: one decoded tile) | S [64][32] f32 |
// P [64][40] bf16 | m, l [2][64] f32 (a tile reads one copy, writes the other) | corr [64] f32.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "common/host_device.h"
#include "kernels/cuda/ops/fp8_chunks.h"
#include "kernels/cuda/ops/mla_split.h"
#include "kernels/cuda/ops/mma_fragments.h"
#include "kv_store/page_table.h"

namespace attnd::cuda {

inline constexpr int kPipeThreads = 256, kPipeHeads = 64, kPipeKeys = 32;
inline constexpr int kPipePerKey = kPipeThreads / kPipeKeys;  // threads copying one key row
inline constexpr int kPipeMaxNtiles = 8;  // n-tiles of 8 output columns per warp (L <= 512)
static_assert(kPipeThreads % kPipeKeys == 0, "whole threads per key");
static_assert(kPipeKeys == 32, "P V takes a tile's keys as two k-steps, one per lane of a warp");

// Four fp32 values loaded at once (a 16-byte global load).
struct alignas(16) F32x4 {
  float v[4];
};

struct MlaPipeParams {
  const float* q_latent = nullptr;  // [n, H, L] fp32 (rounded to bf16)
  const float* q_rope = nullptr;    // [n, H, R]
  int heads = 0, latent = 0, rope = 0;
  float sm_scale = 1, soft_cap = 0;
  CacheRows kv;  // bf16 rows, or fp8 [L e4m3 | scales | R bf16]
  QueryTables tables;
  // Selection: [n, sel_stride] slot ids and counts; null: each query attends its range.
  const int32_t* sel = nullptr;
  const int32_t* sel_count = nullptr;
  const uint8_t* needs_index = nullptr;  // [n] 0: the range instead of sel
  int64_t sel_stride = 0;
  int window = 0;        // range mode: keys in (pos - window, pos]; 0 = all
  float* out = nullptr;  // [n, H, L] (a query of one split)
  float* lse = nullptr;  // optional [n, H]
  // Split-K partials (queries of several splits): [splits, part_queries, H, L] and [.., 2].
  float* part_out = nullptr;
  float* part_ml = nullptr;
  int part_queries = 0;
  int first_query = 0;  // the wave's first query (block x is a query of the wave)
  int stages = 3;       // 2 or 3 (what fits the GPU's shared memory)
};

// The shapes the kernel takes: L a multiple of 64 up to 512, (L + R) % 16 == 0, heads a multiple
// of 64, bf16 rows or fp8 rows that load in 16-byte chunks.
ATTND_HD inline bool MlaPipeTakes(int heads, int latent, int rope, DType kv) {
  const bool rows =
      kv == DType::kBF16 || (kv == DType::kFP8E4M3 && Fp8LatentRowsTakeChunks(latent, rope));
  return rows && heads % kPipeHeads == 0 && heads > 0 && latent % 64 == 0 && latent <= 512 &&
         (latent + rope) % 16 == 0;
}

// Shared-memory layout for rows of D = L + R values.
struct MlaPipeSmem {
  uint32_t q, stage_bytes, stages, decoded, s, p, m, l, corr, bytes;
  ATTND_HD static MlaPipeSmem Of(int latent, int rope, bool fp8, int stages) {
    MlaPipeSmem o;
    const uint32_t D = static_cast<uint32_t>(latent + rope), row = (D + 8) * 2;
    o.q = 0;
    o.stages = kPipeHeads * row;
    o.stage_bytes =
        kPipeKeys * (fp8 ? static_cast<uint32_t>(fp8::LatentTokenBytes(latent, rope)) : row);
    o.decoded = o.stages + static_cast<uint32_t>(stages) * o.stage_bytes;
    o.s = o.decoded + (fp8 ? kPipeKeys * row : 0);
    o.p = o.s + kPipeHeads * kPipeKeys * 4;
    o.m = o.p + kPipeHeads * (kPipeKeys + 8) * 2;
    o.l = o.m + 2 * kPipeHeads * 4;
    o.corr = o.l + 2 * kPipeHeads * 4;
    o.bytes = o.corr + kPipeHeads * 4;
    return o;
  }
};

// The keys query q attends: its selected slots, or its range [begin, begin + total) by the page
// table.
struct PipeKeys {
  const int32_t* sel;  // null: range
  int64_t begin, total;
};
template <typename G>
ATTND_HD PipeKeys PipeKeysOf(G& g, const MlaPipeParams& p, int q) {
  const int64_t pos = g.Gld(p.tables.pos + q);
  if (p.sel == nullptr || (p.needs_index && !g.Gld(p.needs_index + q))) {
    const int64_t begin = p.window > 0 && pos + 1 - p.window > 0 ? pos + 1 - p.window : 0;
    return {nullptr, begin, pos + 1 - begin};
  }
  return {p.sel + q * p.sel_stride, 0, g.Gld(p.sel_count + q)};
}
template <typename G>
ATTND_HD int64_t PipeSlot(G& g, const MlaPipeParams& p, int q, const PipeKeys& k, int64_t i) {
  if (k.sel) return g.Gld(k.sel + i);
  const int64_t pos = k.begin + i;
  const int32_t s = g.Gld(p.tables.seq + q);
  const PageTable& t = p.tables.table;
  const int32_t page = g.Gld(t.pages + g.Gld(t.indptr + s) + pos / t.page_size);
  return static_cast<int64_t>(page) * t.page_size + pos % t.page_size;
}

// Values [d, d + 4) of query q's head h0 + h as packed bf16, by one 16-byte load (L and R are
// multiples of 16 and the query rows 16-byte aligned: MlaUsesPipeline).
template <typename G>
ATTND_HD uint64_t PipeQueryBf16x4(G& g, const MlaPipeParams& p, int q, int h0, int h, int d) {
  const int L = p.latent, R = p.rope;
  const int64_t head = static_cast<int64_t>(q) * p.heads + h0 + h;
  const F32x4 v = g.Gld(reinterpret_cast<const F32x4*>(d < L ? p.q_latent + head * L + d
                                                             : p.q_rope + head * R + d - L));
  uint64_t packed = 0;
  for (int e = 0; e < 4; ++e) packed |= uint64_t{F32ToBF16(v.v[e])} << (16 * e);
  return packed;
}

// Chunk c (8 values) of the fp8 row at shared offset `row`, as 4 words of bf16 pairs: codes x
// their tile's scale, or the rope copied.
template <typename G>
ATTND_HD void PipeDecodeChunk(G& g, uint32_t row, int L, int c, uint32_t w[4]) {
  const Fp8LatentChunk at = LatentChunkAt(L, c);
  if (at.rope) {
    for (int e = 0; e < 4; ++e) w[e] = g.template Ld<uint32_t>(row + at.rope_bytes + 4 * e);
  } else {
    const uint64_t codes = g.template Ld<uint64_t>(row + at.codes);
    DecodeE4M3x8(codes, g.template Ld<float>(row + at.scale), w);
  }
}

// Split z's keys [first, last) of a query's `total` (the fixed partition of mla_split.h), in
// tiles of kPipeKeys.
struct PipeSplit {
  int64_t first, last;
  int tiles;
  int splits;  // the query's
  // Keys in tile t of the split (kPipeKeys but for the last).
  ATTND_HD int TileKeys(int t) const {
    const int64_t left = last - first - static_cast<int64_t>(t) * kPipeKeys;
    return static_cast<int>(left < kPipeKeys ? left : kPipeKeys);
  }
};
// Split z of a query's `total` keys; false when the query has fewer splits (the grid is sized
// for the step's longest query: the whole block returns).
ATTND_HD inline bool PipeSplitOf(int64_t total, int z, PipeSplit* s) {
  s->splits = MlaQuerySplits(total);
  if (z >= s->splits) return false;
  const int64_t tiles64 = (total + kMlaTileKeys - 1) / kMlaTileKeys;
  const int64_t per = MlaTilesPerSplit(total);
  s->first = (z * per < tiles64 ? z * per : tiles64) * kMlaTileKeys;
  s->last = (z + 1) * per * kMlaTileKeys < total ? (z + 1) * per * kMlaTileKeys : total;
  s->tiles = static_cast<int>((s->last - s->first + kPipeKeys - 1) / kPipeKeys);
  return true;
}

// One block: query first_query + qx, heads [hy * 64, hy * 64 + 64), split z of the query's keys.
template <bool kFp8, typename G>
ATTND_HD void MlaPipeBlock(G& g, const MlaPipeParams& p, int qx, int hy, int z) {
  const int L = p.latent, R = p.rope, D = L + R, H = p.heads;
  const int q = p.first_query + qx, h0 = hy * kPipeHeads;
  const int tid = g.tid(), warp = g.warp(), lane = g.lane();
  const PipeKeys keys = PipeKeysOf(g, p, q);
  PipeSplit sp;
  if (!PipeSplitOf(keys.total, z, &sp)) return;
  const MlaPipeSmem sm = MlaPipeSmem::Of(L, R, kFp8, p.stages);
  const uint32_t row = static_cast<uint32_t>(D + 8) * 2, prow = (kPipeKeys + 8) * 2;
  const int S = p.stages;

  // Tile t's rows into stage t % S, 16 bytes a copy (fp8 rows as stored); rows past the
  // split's end are zero-filled. Each key is copied by kPipePerKey neighbouring threads (chunks
  // c0, c0 + kPipePerKey, ...), so a thread looks its key's slot up once per tile, not once per
  // chunk.
  const int chunks = kFp8 ? fp8::LatentTokenBytes(L, R) / 16 : D / 8;
  const uint32_t srow = kFp8 ? static_cast<uint32_t>(fp8::LatentTokenBytes(L, R)) : row;
  const int my_key = tid / kPipePerKey, c0 = tid % kPipePerKey;
  auto issue = [&](int t) {
    const uint32_t stage = sm.stages + static_cast<uint32_t>(t % S) * sm.stage_bytes;
    const int64_t key = sp.first + static_cast<int64_t>(t) * kPipeKeys + my_key;
    const bool valid = key < sp.last;
    const uint8_t* src = valid ? p.kv.Row(PipeSlot(g, p, q, keys, key)) : p.kv.base;
    for (int c = c0; c < chunks; c += kPipePerKey)
      g.CpAsync16(stage + my_key * srow + c * 16, valid ? src + c * 16 : src, valid);
  };
  for (int t = 0; t < S - 1; ++t) {
    if (t < sp.tiles) issue(t);
    g.CpCommit();
  }

  // While those gathers fly: the query's heads as bf16, 4 values a 16-byte load and an 8-byte
  // store (L and R are multiples of 16, the query rows 16-byte aligned: MlaUsesPipeline), and
  // m = -inf, l = 0 (copy 0).
  for (int i = tid; i < kPipeHeads * (D / 4); i += kPipeThreads) {
    const int h = i / (D / 4), d = i % (D / 4) * 4;
    g.St(sm.q + h * row + d * 2, PipeQueryBf16x4(g, p, q, h0, h, d));
  }
  if (tid < kPipeHeads) {
    g.St(sm.m + tid * 4, -INFINITY);
    g.St(sm.l + tid * 4, 0.0f);
  }

  // Output accumulators: this warp's L / 8 columns (n-tiles of 8) of the 4 m-tiles of heads.
  // Every loop over them is unrolled to kPipeMaxNtiles (the n-tiles past L / 64 skipped), so
  // their indices are constants and the 128 accumulators stay in registers: a loop with a
  // run-time trip count over them put them in local memory (512 bytes a thread).
  const int cols = L / 8, ntiles = cols / 8;
  float acc[4][kPipeMaxNtiles][4];
  ATTND_UNROLL
  for (int mt = 0; mt < 4; ++mt) {
    ATTND_UNROLL
    for (int nt = 0; nt < kPipeMaxNtiles; ++nt) {
      ATTND_UNROLL
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;
    }
  }
  int cur = 0;  // the copy of m and l this tile reads

  for (int t = 0; t < sp.tiles; ++t) {
    g.CpWait(S - 2);  // this thread's copies of tile t landed...
    g.Sync();         // ...everyone's; tile t - 1's stage, S, P and corr are free
    if (t + S - 1 < sp.tiles) issue(t + S - 1);
    g.CpCommit();
    const int nk = sp.TileKeys(t);
    uint32_t k = sm.stages + static_cast<uint32_t>(t % S) * sm.stage_bytes;
    if (kFp8) {  // rows -> bf16 (codes x their tile's scale; rope copied)
      for (int i = tid; i < kPipeKeys * (D / 8); i += kPipeThreads) {
        const int j = i / (D / 8), c = i % (D / 8);
        uint32_t w[4];
        PipeDecodeChunk(g, k + j * srow, L, c, w);
        for (int e = 0; e < 4; ++e) g.St(sm.decoded + j * row + c * 16 + 4 * e, w[e]);
      }
      g.Sync();
      k = sm.decoded;
    }
    // 1. S = scale (Q K^T), masked past the split's end: warp w, heads [16 (w % 4), +16), keys
    // [16 (w / 4), +16) (two n-tiles of 8).
    // Fragments by ldmatrix.x4: Q's four 8 x 8 quarters of the warp's 16 heads x 16 dims (lane
    // l names head l % 16, dims + 8 (l / 16)), and K's rows of the two n-tiles' keys (lane l
    // names key 8 (l / 16) + l % 8, dims + 8 ((l / 8) % 2)), which are B's columns as stored.
    {
      const int mt = warp % 4, kb = (warp / 4) * 16;
      const uint32_t qrow = sm.q + (mt * 16 + lane % 16) * row + (lane / 16) * 16;
      const uint32_t krow = k + (kb + (lane / 16) * 8 + lane % 8) * row + ((lane / 8) % 2) * 16;
      float c[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
      for (int k0 = 0; k0 < D; k0 += 16) {
        uint32_t a[4], b[4];
        g.LdMatrixX4(a, qrow + k0 * 2, false);
        g.LdMatrixX4(b, krow + k0 * 2, false);  // n-tile 0: b[0], b[1]; n-tile 1: b[2], b[3]
        g.Mma(c[0], a, b);
        g.Mma(c[1], a, b + 2);
      }
      for (int nt = 0; nt < 2; ++nt)
        for (int i = 0; i < 4; ++i) {
          const int h = mt * 16 + mma::RowC(lane, i), j = kb + nt * 8 + mma::ColC(lane, i);
          float x = c[nt][i] * p.sm_scale;
          if (p.soft_cap > 0) x = p.soft_cap * tanhf(x / p.soft_cap);
          g.St(sm.s + (h * kPipeKeys + j) * 4, j < nk ? x : -INFINITY);
        }
    }
    g.Sync();
    // 2. Online softmax: head tid / 4, keys [8 (tid % 4), +8); the 4 threads of a head are
    // neighbouring lanes and combine by shuffles. P as bf16; the denominator sums what P holds.
    {
      const int h = tid / 4, j0 = (tid % 4) * 8;
      float s[8], mx = -INFINITY;
      for (int j = 0; j < 8; ++j) {
        s[j] = g.template Ld<float>(sm.s + (h * kPipeKeys + j0 + j) * 4);
        mx = s[j] > mx ? s[j] : mx;
      }
      for (int off = 1; off < 4; off <<= 1) {
        const float o = g.ShflXor(mx, off);
        mx = o > mx ? o : mx;
      }
      const float m_old = g.template Ld<float>(sm.m + (cur * kPipeHeads + h) * 4);
      const float l_old = g.template Ld<float>(sm.l + (cur * kPipeHeads + h) * 4);
      if (m_old > mx) mx = m_old;
      const float corr = m_old == -INFINITY ? 0.0f : expf(m_old - mx);
      const bool none = mx == -INFINITY;  // nothing visible yet: probabilities stay 0
      float sum = 0;
      for (int j = 0; j < 8; j += 2) {
        const uint16_t e0 = F32ToBF16(none ? 0.0f : expf(s[j] - mx));
        const uint16_t e1 = F32ToBF16(none ? 0.0f : expf(s[j + 1] - mx));
        sum += BF16ToF32(e0) + BF16ToF32(e1);
        g.St(sm.p + h * prow + (j0 + j) * 2,
             static_cast<uint32_t>(e0) | (static_cast<uint32_t>(e1) << 16));
      }
      for (int off = 1; off < 4; off <<= 1) sum += g.ShflXor(sum, off);
      if (tid % 4 == 0) {
        g.St(sm.m + ((cur ^ 1) * kPipeHeads + h) * 4, mx);
        g.St(sm.l + ((cur ^ 1) * kPipeHeads + h) * 4, l_old * corr + sum);
        g.St(sm.corr + h * 4, corr);
      }
    }
    g.Sync();
    cur ^= 1;
    // 3. O = corr O + P V: warp w's columns [w cols, (w + 1) cols), every m-tile of heads.
    ATTND_UNROLL
    for (int mt = 0; mt < 4; ++mt) {
      const float c_lo = g.template Ld<float>(sm.corr + (mt * 16 + mma::RowC(lane, 0)) * 4);
      const float c_hi = g.template Ld<float>(sm.corr + (mt * 16 + mma::RowC(lane, 2)) * 4);
      ATTND_UNROLL
      for (int nt = 0; nt < kPipeMaxNtiles; ++nt) {
        if (nt >= ntiles) continue;
        acc[mt][nt][0] *= c_lo;
        acc[mt][nt][1] *= c_lo;
        acc[mt][nt][2] *= c_hi;
        acc[mt][nt][3] *= c_hi;
      }
    }
    // P's fragments of both 16-key k-steps (ldmatrix.x4 as Q's), then per n-tile V's by one
    // ldmatrix.x4.trans: lane l names key l (k-step l / 16, half (l / 8) % 2) at the n-tile's 8
    // columns, and each register comes back as two keys of one column, B's layout.
    uint32_t pa[2][4][4];
    ATTND_UNROLL
    for (int ks = 0; ks < 2; ++ks) {
      ATTND_UNROLL
      for (int mt = 0; mt < 4; ++mt)
        g.LdMatrixX4(pa[ks][mt],
                     sm.p + (mt * 16 + lane % 16) * prow + (ks * 16 + (lane / 16) * 8) * 2, false);
    }
    ATTND_UNROLL
    for (int nt = 0; nt < kPipeMaxNtiles; ++nt) {
      if (nt >= ntiles) continue;
      uint32_t vb[4];  // k-step 0: vb[0], vb[1]; k-step 1: vb[2], vb[3]
      g.LdMatrixX4(vb, k + lane * row + (warp * cols + nt * 8) * 2, true);
      ATTND_UNROLL
      for (int mt = 0; mt < 4; ++mt) {
        g.Mma(acc[mt][nt], pa[0][mt], vb);
        g.Mma(acc[mt][nt], pa[1][mt], vb + 2);
      }
    }
  }
  if (sp.tiles == 0) g.Sync();  // m and l were written by other threads than their readers below
  // A query of one split: the normalised output (and lse); of several: this split's sums and
  // (m, l) for MlaCombineKernel.
  const bool partial = sp.splits > 1;
  const int64_t wave = p.part_queries;
  float* out = partial ? p.part_out + static_cast<int64_t>(z) * wave * H * L : p.out;
  const int row_q = partial ? qx : q;
  if (tid < kPipeHeads) {
    const float m = g.template Ld<float>(sm.m + (cur * kPipeHeads + tid) * 4);
    const float l = g.template Ld<float>(sm.l + (cur * kPipeHeads + tid) * 4);
    if (partial) {
      float* ml = p.part_ml + ((static_cast<int64_t>(z) * wave + qx) * H + h0 + tid) * 2;
      g.Gst(ml, m);
      g.Gst(ml + 1, l);
    } else if (p.lse != nullptr) {
      g.Gst(p.lse + static_cast<int64_t>(q) * H + h0 + tid, l == 0 ? -INFINITY : m + logf(l));
    }
  }
  ATTND_UNROLL
  for (int mt = 0; mt < 4; ++mt) {
    const int lo = mt * 16 + mma::RowC(lane, 0), hi = mt * 16 + mma::RowC(lane, 2);
    const float l_lo = g.template Ld<float>(sm.l + (cur * kPipeHeads + lo) * 4);
    const float l_hi = g.template Ld<float>(sm.l + (cur * kPipeHeads + hi) * 4);
    const float inv_lo = partial ? 1.0f : l_lo > 0 ? 1.0f / l_lo : 0.0f;
    const float inv_hi = partial ? 1.0f : l_hi > 0 ? 1.0f / l_hi : 0.0f;
    ATTND_UNROLL
    for (int nt = 0; nt < kPipeMaxNtiles; ++nt) {
      if (nt >= ntiles) continue;
      const int col = warp * cols + nt * 8 + mma::ColC(lane, 0);
      float* o_lo = out + (static_cast<int64_t>(row_q) * H + h0 + lo) * L + col;
      float* o_hi = out + (static_cast<int64_t>(row_q) * H + h0 + hi) * L + col;
      g.Gst(o_lo, acc[mt][nt][0] * inv_lo);
      g.Gst(o_lo + 1, acc[mt][nt][1] * inv_lo);
      g.Gst(o_hi, acc[mt][nt][2] * inv_hi);
      g.Gst(o_hi + 1, acc[mt][nt][3] * inv_hi);
    }
  }
}

}  // namespace attnd::cuda
