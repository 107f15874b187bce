#include "kernels/cpu/attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/fp8.h"

namespace attnd::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Per-thread scratch, grown on demand and reused across calls (no allocation per layer once warm).
struct Scratch {
  std::vector<float> a, b, c, d;
};
Scratch& ThreadScratch() {
  thread_local Scratch s;
  return s;
}

float* Grow(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// Converts one cached row (by slot id) to fp32; fp8 rows are dequantised with their scales.
inline void LoadRow(const Kernels& k, const CacheRows& rows, int64_t slot, float* dst) {
  if (rows.dtype == DType::kFP8E4M3) {
    const uint8_t* row = rows.Row(slot);
    float scales[64];         // fp8::LatentDimFits bounds the tiles
    if (rows.scales_apart) {  // an indexer key: one scale
      std::memcpy(scales, rows.Scales(slot), 4);
      k.e4m3_to_f32(row, scales, rows.fp8_dim, dst, rows.fp8_dim);
      return;
    }
    const int L = rows.fp8_dim, tiles = fp8::LatentTiles(L);
    // One fixed-size copy per scale: a load each (a memcpy of a run-time size is a libc call,
    // which cost more than converting the row's 64 rope values).
    const uint8_t* sc = rows.Scales(slot);
    for (int t = 0; t < tiles; ++t) std::memcpy(scales + t, sc + 4 * t, 4);
    k.e4m3_to_f32(row, scales, fp8::LatentTileSize(L), dst, L);
    k.bf16_to_f32(reinterpret_cast<const unsigned short*>(row + L + 4 * tiles), dst + L,
                  rows.dim - L);
    return;
  }
  if (rows.dtype == DType::kBF16) {
    k.bf16_to_f32(reinterpret_cast<const unsigned short*>(rows.Row(slot)), dst, rows.dim);
  } else {
    ConvertToF32(rows.dtype, rows.Row(slot), dst, rows.dim);
  }
}

// A read prefetch of the line holding p. On x86 an asm statement: GCC's IPA pure-const pass
// judges a function holding only __builtin_prefetch free of side effects and deletes its calls
// (PrefetchRow's loop was compiled to nothing at -O1 and above).
inline void PrefetchLine(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  __asm__ volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// Asks for a cached row a few iterations ahead, so the gather's misses overlap with work: every
// line the row touches (rows need not start on a line).
inline void PrefetchRow(const CacheRows& rows, int64_t slot) {
  const uint8_t* r = rows.Row(slot);
  const uintptr_t first = reinterpret_cast<uintptr_t>(r) & ~uintptr_t{63};
  const uintptr_t last = reinterpret_cast<uintptr_t>(r) + rows.row_bytes - 1;
  for (uintptr_t line = first; line <= last; line += 64)
    PrefetchLine(reinterpret_cast<const void*>(line));
  if (rows.scales_apart != 0) PrefetchLine(rows.Scales(slot));  // an fp8 indexer key's scale
}

// dst[c * ldd + r] = src[r * lds + c] * scale for a rows x cols block.
void Transpose(const float* src, int rows, int cols, int lds, float* dst, int ldd,
               float scale = 1.0f) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c] * scale;
}

}  // namespace

void IndexerScores(const Kernels& k, const IndexerScoreParams& p) {
  // Scores are computed keys-major, S^T[key][head] = K[key,:] · q^T, so cached rows are used as
  // they are (no per-tile transpose); only the query is transposed, once.
  constexpr int kTile = 64;
  Scratch& ws = ThreadScratch();
  const int D = p.head_dim, H = p.num_heads;
  float* kr = Grow(ws.a, static_cast<size_t>(kTile) * D);
  float* st = Grow(ws.b, static_cast<size_t>(kTile) * H);
  float* qt = Grow(ws.c, static_cast<size_t>(D) * H);
  Transpose(p.q, H, D, D, qt, H);
  for (int64_t t0 = p.begin; t0 < p.end; t0 += kTile) {
    const int nk = static_cast<int>(std::min<int64_t>(kTile, p.end - t0));
    for (int j = 0; j < nk; ++j) {
      // The next tile's keys are asked for as this one's are converted: a tile is usually a
      // page, and pages are scattered, so no hardware prefetcher sees them coming.
      if (t0 + kTile + j < p.end) PrefetchRow(p.keys, p.table.Slot(p.seq, t0 + kTile + j));
      LoadRow(k, p.keys, p.table.Slot(p.seq, t0 + j), kr + j * D);
    }
    k.gemm(nk, H, D, kr, D, qt, H, st, H, false);
    k.relu_dot(st, nk, H, H, p.w, p.scores + (t0 - p.begin));
  }
}

void MlaAttend(const Kernels& k, const MlaParams& p) {
  // Per tile of keys: S^T[key][head] = K·(scale·q)^T straight from the cached rows, an online
  // softmax over those keys-major scores (vectors across heads, no transpose), then
  // acc[head] = corr[head]·acc[head] + P·c_kv in one pass. The query is transposed once per call.
  constexpr int kTile = 64;
  // H counts score rows: heads x queries of the block.
  const int H = p.num_heads * p.num_queries, L = p.latent_dim, D = p.latent_dim + p.rope_dim;
  const bool masked = p.row_begin != nullptr && p.slots == nullptr;
  Scratch& ws = ThreadScratch();
  float* kr = Grow(ws.a, static_cast<size_t>(kTile) * D);  // [kTile, D] keys as rows
  // Score columns padded to a multiple of 16 so every score takes the GEMM's vector path:
  // a row's arithmetic is then the same whatever the block size (chunked == single-shot).
  const int Hp = (H + 15) / 16 * 16;
  float* st = Grow(ws.b, static_cast<size_t>(kTile) * Hp + static_cast<size_t>(D) * Hp);
  float* qt = st + kTile * Hp;  // [D, Hp] scaled query, zero padded
  float* state = Grow(ws.d, static_cast<size_t>(H) * L + 3 * static_cast<size_t>(Hp));
  float* acc = state;        // [H, L]
  float* m = state + H * L;  // running max per score row (padded rows too)
  float* l = m + Hp;         // running denominator per score row
  float* corr = l + Hp;      // this tile's rescale per score row
  std::fill(acc, acc + H * L, 0.0f);
  std::fill(m, m + Hp, kNegInf);
  std::fill(l, l + Hp, 0.0f);
  std::fill(qt, qt + static_cast<size_t>(D) * Hp, 0.0f);
  Transpose(p.q, H, D, D, qt, Hp, p.sm_scale);
  const int64_t total = p.slots ? p.num_keys : p.end - p.begin;
  // The slot of key i: explicit (a selection) or through the page table (a range).
  auto slot_of = [&p](int64_t i) {
    return p.slots ? p.slots[i] : p.table.Slot(p.seq, p.begin + i);
  };
  const float cap = p.soft_cap;
  for (int64_t t0 = 0; t0 < total; t0 += kTile) {
    const int nk = static_cast<int>(std::min<int64_t>(kTile, total - t0));
    // Each row of this tile is converted while the row a tile ahead is asked for: the gather's
    // misses overlap with work, spread evenly rather than in one burst.
    for (int j = 0; j < nk; ++j) {
      if (t0 + kTile + j < total) PrefetchRow(p.kv, slot_of(t0 + kTile + j));
      LoadRow(k, p.kv, slot_of(t0 + j), kr + j * D);
    }
    k.gemm(nk, Hp, D, kr, D, qt, Hp, st, Hp, false);  // st is [nk, Hp]
    if (cap > 0) {
      for (int j = 0; j < nk; ++j)
        for (int h = 0; h < H; ++h) st[j * Hp + h] = cap * std::tanh(st[j * Hp + h] / cap);
    }
    if (masked) {  // query qi's score rows see keys [row_begin, row_end) only
      for (int qi = 0; qi < p.num_queries; ++qi) {
        const int64_t base = p.begin + t0;
        const int lo = static_cast<int>(std::clamp<int64_t>(p.row_begin[qi] - base, 0, nk));
        const int hi = static_cast<int>(std::clamp<int64_t>(p.row_end[qi] - base, lo, nk));
        for (int j = 0; j < nk; ++j) {
          if (j >= lo && j < hi) continue;
          std::fill_n(st + j * Hp + qi * p.num_heads, p.num_heads, kNegInf);
        }
      }
    }
    k.softmax_tile(st, nk, Hp, Hp, m, l, corr);
    k.gemm_at_scaled(H, L, nk, st, Hp, kr, D, acc, L, corr);
  }
  for (int h = 0; h < H; ++h) {
    const float inv = l[h] > 0 ? 1.0f / l[h] : 0.0f;
    for (int d = 0; d < L; ++d) p.out[h * L + d] = acc[h * L + d] * inv;
  }
  if (p.lse != nullptr)
    for (int h = 0; h < H; ++h) p.lse[h] = l[h] == 0 ? kNegInf : m[h] + std::log(l[h]);
}

}  // namespace attnd::cpu
