// The streaming tensor-core indexer, I[s] = sum_h w[h] relu(q[h] . k[s]), written once as a
// block body over a thread interface: the GPU runs it with GpuThread (kernels/cuda/ops/indexer.cu),
// the CPU simulation with SimtThread (tests/sim/simt_sim.h; tests/sim/indexer_stream_sim_test.cc)
// fiber by fiber, the same code.
//
// A block takes one query and a range of its keys (grid: key ranges x queries), so its query is
// read once for `range` keys (the tile-per-block kernel read and converted it for every 64).
// The query's bf16 fragments (the mma's B operand, dims x heads) and head weights stay in
// registers (every loop that indexes them is unrolled); key tiles of 64 stream through a ring of
// kStreamStages shared-memory stages by cp.async, up to two tiles ahead of the tile being
// scored, each key's row copied by kStreamPerKey neighbouring threads that look its page slot
// up once per tile (not once per 16-byte chunk). fp8 keys (an fp8 cache's indexer rows) are
// copied as codes and decoded to bf16 with their scale in the block (exact, fp8_chunks.h), so
// they take tensor cores too.
//
// Warps: HG head groups of 16 heads x (8 / HG) key groups; each warp scores its keys (A operand,
// from shared memory) against its 16 heads (m16n8k16, fp32 accumulation), applies relu and the
// head weights, and sums its lanes' heads by shuffles; the block then sums the head groups in
// order. A key's score depends on nothing but its query and itself: not on the range, the grid
// or the batch.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "common/host_device.h"
#include "kernels/cuda/ops/fp8_chunks.h"
#include "kernels/cuda/ops/mma_fragments.h"
#include "kv_store/page_table.h"

namespace attnd::cuda {

inline constexpr int kStreamThreads = 256, kStreamWarps = 8, kStreamTile = 64;
inline constexpr int kStreamStages = 3;
inline constexpr int kStreamPerKey = kStreamThreads / kStreamTile;  // threads copying one key
static_assert(kStreamThreads % kStreamTile == 0, "whole threads per key");

struct IndexerStreamParams {
  const float* q = nullptr;  // [n, heads, dim] fp32 (rounded to bf16)
  const float* w = nullptr;  // [n, heads]
  int heads = 0, dim = 0;
  CacheRows keys;                    // bf16 rows, or fp8 values with their scales apart
  QueryTables tables;                // each query's sequence and position (it sees pos + 1 keys)
  const int32_t* queries = nullptr;  // [nq] the queries scored (local indices)
  const int64_t* score_offset = nullptr;  // [nq] where each one's scores start
  int64_t range = 0;                      // keys per block: a positive multiple of kStreamTile
  float* scores = nullptr;
};

// Whether the streaming kernel takes these shapes: 32, 64 or 128 heads (2, 4 or 8 head groups),
// a head dim that is a multiple of 16 up to 128 (the query's fragments stay in registers), bf16
// or fp8 keys.
ATTND_HD inline bool IndexerStreamTakes(int heads, int dim, DType keys) {
  return (heads == 32 || heads == 64 || heads == 128) && dim > 0 && dim % 16 == 0 && dim <= 128 &&
         (keys == DType::kBF16 || keys == DType::kFP8E4M3);
}

// Shared memory (bytes): kStreamStages stages of 64 keys (bf16 rows padded by 8 values against
// bank conflicts; fp8: the codes), for fp8 one decoded bf16 tile, then the head groups' partial
// scores [HG][64] fp32.
ATTND_HD inline uint32_t StreamRowBytes(int dim) { return static_cast<uint32_t>(dim + 8) * 2; }
ATTND_HD inline uint32_t StreamStageBytes(int dim, bool fp8) {
  return kStreamTile * (fp8 ? static_cast<uint32_t>(dim) : StreamRowBytes(dim));
}
ATTND_HD inline uint32_t StreamDecodedOffset(int dim, bool fp8) {
  return kStreamStages * StreamStageBytes(dim, fp8);
}
ATTND_HD inline uint32_t StreamPartOffset(int dim, bool fp8) {
  return StreamDecodedOffset(dim, fp8) + (fp8 ? kStreamTile * StreamRowBytes(dim) : 0);
}
ATTND_HD inline uint32_t StreamSmemBytes(int heads, int dim, bool fp8) {
  return StreamPartOffset(dim, fp8) + static_cast<uint32_t>(heads / 16) * kStreamTile * 4;
}

// The slot of key `pos` of sequence `seq`, read through the thread's global loads.
template <typename G>
ATTND_HD int64_t StreamSlot(G& g, const PageTable& t, int32_t seq, int64_t pos) {
  const int32_t page = g.Gld(t.pages + g.Gld(t.indptr + seq) + pos / t.page_size);
  return static_cast<int64_t>(page) * t.page_size + pos % t.page_size;
}

// One block: keys [bx * range, (bx + 1) * range) of query queries[qi]. HG = heads / 16.
template <int HG, bool kFp8, typename G>
ATTND_HD void IndexerStreamBlock(G& g, const IndexerStreamParams& p, int64_t bx, int qi) {
  constexpr int KG = kStreamWarps / HG;      // key groups
  constexpr int MT = kStreamTile / KG / 16;  // m-tiles of 16 keys per warp
  constexpr int kMaxSteps = 8;               // k-steps of 16 dims (dim <= 128)
  const int D = p.dim, steps = D / 16;
  const int q = g.Gld(p.queries + qi);
  const int64_t n = g.Gld(p.tables.pos + q) + 1;  // keys the query sees
  const int64_t first = bx * p.range;
  if (first >= n) return;  // the whole block, before any barrier
  const int64_t last = first + p.range < n ? first + p.range : n;
  const int tiles = static_cast<int>((last - first + kStreamTile - 1) / kStreamTile);
  const int32_t seq = g.Gld(p.tables.seq + q);
  const int warp = g.warp(), lane = g.lane(), tid = g.tid();
  const int hg = warp % HG, kg = warp / HG;
  const uint32_t row = StreamRowBytes(D), stage_bytes = StreamStageBytes(D, kFp8);
  const uint32_t part = StreamPartOffset(D, kFp8);

  // The query as B fragments (k = dims, n = this warp's 16 heads in two n-tiles of 8) and the
  // weights of the heads this lane's accumulators hold, for every tile of the block.
  uint32_t bq[2][kMaxSteps][2];
  float wt[2][2];
  ATTND_UNROLL
  for (int nt = 0; nt < 2; ++nt) {
    const int head = hg * 16 + nt * 8 + mma::ColB(lane);
    const float* qh = p.q + (static_cast<int64_t>(q) * p.heads + head) * D;
    ATTND_UNROLL
    for (int ks = 0; ks < kMaxSteps; ++ks) {
      ATTND_UNROLL
      for (int r = 0; r < 2; ++r) {
        if (ks >= steps) continue;
        const int d = ks * 16 + mma::RowB(lane, r, 0);
        bq[nt][ks][r] = static_cast<uint32_t>(F32ToBF16(g.Gld(qh + d))) |
                        (static_cast<uint32_t>(F32ToBF16(g.Gld(qh + d + 1))) << 16);
      }
    }
    for (int e = 0; e < 2; ++e)
      wt[nt][e] =
          g.Gld(p.w + static_cast<int64_t>(q) * p.heads + hg * 16 + nt * 8 + mma::ColC(lane, e));
  }

  // Tile t's key rows into stage t % kStreamStages, 16 bytes per copy; rows past the last key
  // are zero-filled (their scores are computed and never written). Each key is copied by
  // kStreamPerKey neighbouring threads (chunks c0, c0 + kStreamPerKey, ...), so a thread looks
  // its key's slot up once per tile, not once per chunk.
  const int chunks = kFp8 ? D / 16 : D / 8;  // 16-byte pieces of a key row as stored
  const int my_key = tid / kStreamPerKey, c0 = tid % kStreamPerKey;
  auto issue = [&](int t) {
    const uint32_t stage = static_cast<uint32_t>(t % kStreamStages) * stage_bytes;
    const int64_t key = first + static_cast<int64_t>(t) * kStreamTile + my_key;
    const bool valid = key < last;
    const uint8_t* src = valid ? p.keys.Row(StreamSlot(g, p.tables.table, seq, key)) : p.keys.base;
    const uint32_t dst = stage + my_key * (kFp8 ? static_cast<uint32_t>(D) : row);
    for (int c = c0; c < chunks; c += kStreamPerKey)
      g.CpAsync16(dst + c * 16, valid ? src + c * 16 : src, valid);
  };
  for (int t = 0; t < kStreamStages - 1; ++t) {
    if (t < tiles) issue(t);
    g.CpCommit();  // empty groups keep the count the same in every thread
  }
  for (int t = 0; t < tiles; ++t) {
    g.CpWait(kStreamStages - 2);  // this thread's copies of tile t landed
    // bf16: everyone's (the warps read each other's copies), and tile t - 1's stage is free.
    // fp8: each thread decodes exactly the chunks it copied (its key's), and tile t - 1's readers
    // of the decoded tile and the partials are behind the partials' barrier: no barrier here.
    if (!kFp8) g.Sync();
    if (t + kStreamStages - 1 < tiles) issue(t + kStreamStages - 1);
    g.CpCommit();
    const int64_t tile_first = first + static_cast<int64_t>(t) * kStreamTile;
    uint32_t keys = static_cast<uint32_t>(t % kStreamStages) * stage_bytes;
    if (kFp8) {  // codes x scale -> bf16 rows of the decoded tile
      const uint32_t decoded = StreamDecodedOffset(D, true);
      const int64_t key = tile_first + my_key;  // the key this thread copied, once per tile
      const float scale = key < last ? g.Gld(reinterpret_cast<const float*>(
                                           p.keys.Scales(StreamSlot(g, p.tables.table, seq, key))))
                                     : 0.0f;
      for (int c = c0; c < D / 16; c += kStreamPerKey) {
        uint32_t lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
        if (key < last) {
          const uint32_t src = keys + my_key * static_cast<uint32_t>(D) + c * 16;
          DecodeE4M3x8(g.template Ld<uint64_t>(src), scale, lo);
          DecodeE4M3x8(g.template Ld<uint64_t>(src + 8), scale, hi);
        }
        const uint32_t dst = decoded + my_key * row + c * 32;
        for (int e = 0; e < 4; ++e) g.St(dst + 4 * e, lo[e]);
        for (int e = 0; e < 4; ++e) g.St(dst + 16 + 4 * e, hi[e]);
      }
      g.Sync();
      keys = decoded;
    }
    // Scores of this warp's keys for its 16 heads; relu, weights, the lanes' heads summed.
    for (int mt = 0; mt < MT; ++mt) {
      const int key0 = (kg * MT + mt) * 16;  // the m-tile's first key in the tile
      float c[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
      // Every k-step unrolled (those past the head dim skipped), so bq keeps constant indices
      // and stays in registers.
      ATTND_UNROLL
      for (int ks = 0; ks < kMaxSteps; ++ks) {
        if (ks >= steps) continue;
        uint32_t a[4];
        for (int r = 0; r < 4; ++r)
          a[r] = g.template Ld<uint32_t>(keys + (key0 + mma::RowA(lane, r)) * row +
                                         (ks * 16 + mma::ColA(lane, r, 0)) * 2);
        for (int nt = 0; nt < 2; ++nt) g.Mma(c[nt], a, bq[nt][ks]);
      }
      float s[2] = {0, 0};  // rows (keys) Group(lane) and Group(lane) + 8
      for (int nt = 0; nt < 2; ++nt)
        for (int i = 0; i < 4; ++i) {
          const float x = c[nt][i];  // relu like std::max(x, 0): NaN stays NaN
          s[i >> 1] += wt[nt][i & 1] * (x < 0.0f ? 0.0f : x);
        }
      for (int r = 0; r < 2; ++r) {
        s[r] += g.ShflXor(s[r], 1);
        s[r] += g.ShflXor(s[r], 2);
      }
      if (mma::InGroup(lane) == 0)
        for (int r = 0; r < 2; ++r)
          g.St(part + (hg * kStreamTile + key0 + mma::RowC(lane, 2 * r)) * 4, s[r]);
    }
    g.Sync();
    if (tid < kStreamTile && tile_first + tid < last) {  // the head groups, in order
      float sum = 0;
      for (int h = 0; h < HG; ++h) sum += g.template Ld<float>(part + (h * kStreamTile + tid) * 4);
      g.Gst(p.scores + g.Gld(p.score_offset + qi) + (tile_first + tid), sum);
    }
  }
}

}  // namespace attnd::cuda
