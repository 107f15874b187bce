// A lane-level CPU simulation of MlaMmaKernel<HB> (kernels/cuda/ops/mla.cu) for one block:
// one query, HB = 16 or 64 heads, its keys in tiles of 64 (one split of them): the same
// shared-memory layout, the same fragment addressing (mma_fragments.h), the same barriers;
// mma.sync and shared memory as in mma_sim.h. Used by tests/sim/mma_sim_test.cc; keep it in step
// with the kernel.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "common/dtype.h"
#include "kernels/cuda/ops/fp8_chunks.h"
#include "kernels/cuda/ops/mla_split.h"
#include "kernels/cuda/ops/mma_fragments.h"
#include "tests/sim/mma_sim.h"

namespace attnd::cuda::sim {

// What one block leaves: for a query of one split the normalised out [HB][L]; of several, this
// split's unnormalised sums out [HB][L] and its running max m and denominator l per head; a
// block past the query's own splits (the grid's are for the step's longest query) nothing
// (`idle`).
struct MlaBlock {
  std::vector<float> out, m, l;
  bool idle = false;
};

// q [HB][L+R] (fp32; rounded to bf16 as the kernel does), keys [n][L+R] bf16 bits (the query's
// keys in order); block `split` of a grid of `splits` (blockIdx.z); the query's own partition is
// from n alone (mla_split.h). Throws on any shared-memory fault, a grid with fewer splits than
// the query needs, or a shape outside the kernel's contract (L % 64 == 0, L <= 512,
// (L+R) % 16 == 0, HB 16 or 64).
//
// `fp8_rows` set: the keys are an fp8 cache's rows instead (n x fp8::LatentTokenBytes(L, R)
// bytes, `keys` unused), loaded as the kernel's KeyChunk<true> loads them: codes decoded with
// their tile's scale (fp8_chunks.h), rope copied, every global access checked for alignment.
inline MlaBlock RunMlaMmaBlock(int L, int R, const std::vector<float>& q,
                               const std::vector<uint16_t>& keys, int64_t n, float sm_scale,
                               float soft_cap, int splits = 1, int split = 0, int HB = 16,
                               const std::vector<uint8_t>* fp8_rows = nullptr) {
  constexpr int kKeys = 64, kThreads = 256;
  const int D = L + R, DP = D + 8, PP = kKeys + 8, MT = HB / 16;
  if (L % 64 != 0 || L > 512 || D % 16 != 0 || (HB != 16 && HB != 64))
    throw std::runtime_error("shape outside contract");
  if (fp8_rows != nullptr && !Fp8LatentRowsTakeChunks(L, R))
    throw std::runtime_error("fp8 rows the chunk loader cannot read");
  const size_t row_bytes = fp8::LatentTokenBytes(L, R);
  // Chunk c of key j as the kernel's loader reads it (4 words of 2 bf16).
  auto chunk = [&](int64_t j, int c, uint16_t out[8]) {
    if (fp8_rows == nullptr) {
      for (int e = 0; e < 8; ++e) out[e] = keys[size_t(j) * D + c * 8 + e];
      return;
    }
    const uint8_t* row = fp8_rows->data() + size_t(j) * row_bytes;  // rows 16-byte aligned
    const Fp8LatentChunk at = LatentChunkAt(L, c);
    uint32_t w[4];
    if (at.rope) {
      if ((size_t(j) * row_bytes + at.rope_bytes) % 16 != 0)
        throw std::runtime_error("misaligned 16-byte rope load");
      std::memcpy(w, row + at.rope_bytes, 16);
    } else {
      if ((size_t(j) * row_bytes + at.codes) % 8 != 0 || (size_t(j) * row_bytes + at.scale) % 4)
        throw std::runtime_error("misaligned fp8 code or scale load");
      uint64_t codes;
      float scale;
      std::memcpy(&codes, row + at.codes, 8);
      std::memcpy(&scale, row + at.scale, 4);
      DecodeE4M3x8(codes, scale, w);
    }
    for (int e = 0; e < 4; ++e) out[2 * e] = w[e] & 0xffff, out[2 * e + 1] = w[e] >> 16;
  };
  const int query_splits = MlaQuerySplits(n);
  if (splits < query_splits) throw std::runtime_error("grid has fewer splits than the query");
  if (split >= query_splits) {
    MlaBlock none;
    none.idle = true;
    return none;
  }
  // Cells: qs [HB][DP] | ks [64][DP] | ps [HB][PP] | sf [HB][64] f32 | m, l, corr [HB] f32.
  const size_t qs = 0, ks = size_t(HB) * DP, ps = ks + size_t(kKeys) * DP,
               sf = ps + size_t(HB) * PP, m = sf + 2 * size_t(HB) * kKeys, l = m + 2 * size_t(HB),
               corr = l + 2 * size_t(HB);
  Smem smem(corr + 2 * size_t(HB));
  auto pair = [&](size_t cell, int th) {
    if ((cell * 2) % 4 != 0) throw std::runtime_error("misaligned 32-bit fragment load");
    return std::make_pair(BF16ToF32(smem.Read(cell, th)), BF16ToF32(smem.Read(cell + 1, th)));
  };
  const int cols = L / 8, ntiles = cols / 8;
  // acc[warp][lane][m-tile][n-tile][element]
  std::vector<float> acc_store(size_t(8) * 32 * MT * 8 * 4, 0.0f);
  auto acc = [&](int w, int lane, int mt, int nt) {
    return &acc_store[(((size_t(w) * 32 + lane) * MT + mt) * 8 + nt) * 4];
  };
  for (int th = 0; th < kThreads; ++th) {
    for (int i = th; i < HB * D; i += kThreads)
      smem.Write(qs + size_t(i / D) * DP + i % D, F32ToBF16(q[i]), th);
    if (th < HB) {
      smem.WriteF32(m + 2 * th, -INFINITY, th);
      smem.WriteF32(l + 2 * th, 0.0f, th);
    }
  }
  smem.Barrier();
  const int64_t tiles = (n + kKeys - 1) / kKeys, per = MlaTilesPerSplit(n);
  const int64_t first = std::min(tiles, split * per) * kKeys;
  const int64_t last = std::min<int64_t>(n, (split + 1) * per * kKeys);
  for (int64_t t0 = first; t0 < last; t0 += kKeys) {
    const int nk = static_cast<int>(std::min<int64_t>(kKeys, last - t0));
    const int chunks = D / 8;
    for (int th = 0; th < kThreads; ++th)  // 1. key rows, 16 bytes at a time
      for (int i = th; i < kKeys * chunks; i += kThreads) {
        const int j = i / chunks, c = i % chunks;
        const size_t dst = ks + size_t(j) * DP + c * 8;
        if ((dst * 2) % 16 != 0) throw std::runtime_error("misaligned 16-byte store to ks");
        uint16_t v[8] = {};
        if (j < nk) chunk(t0 + j, c, v);
        for (int e = 0; e < 8; ++e) smem.Write(dst + e, v[e], th);
      }
    smem.Barrier();
    for (int warp = 0; warp < 8; ++warp) {  // 2. scores: warp w takes keys [8w, 8w + 8)
      for (int mt = 0; mt < MT; ++mt) {
        float c[32][4] = {};
        for (int k0 = 0; k0 < D; k0 += 16) {
          float a[32][8], b[32][4];
          for (int lane = 0; lane < 32; ++lane) {
            const int th = warp * 32 + lane;
            const size_t krow = ks + size_t(warp * 8 + mma::ColB(lane)) * DP;
            for (int r = 0; r < 4; ++r) {
              const auto v = pair(
                  qs + size_t(mt * 16 + mma::RowA(lane, r)) * DP + k0 + mma::ColA(lane, r, 0), th);
              a[lane][2 * r] = v.first, a[lane][2 * r + 1] = v.second;
            }
            for (int r = 0; r < 2; ++r) {
              const auto v = pair(krow + k0 + mma::RowB(lane, r, 0), th);
              b[lane][2 * r] = v.first, b[lane][2 * r + 1] = v.second;
            }
          }
          MmaSync(a, b, c);
        }
        for (int lane = 0; lane < 32; ++lane)
          for (int i = 0; i < 4; ++i) {
            const int h = mt * 16 + mma::RowC(lane, i), j = warp * 8 + mma::ColC(lane, i);
            float x = c[lane][i] * sm_scale;
            if (soft_cap > 0) x = soft_cap * std::tanh(x / soft_cap);
            smem.WriteF32(sf + 2 * (size_t(h) * kKeys + j), j < nk ? x : -INFINITY,
                          warp * 32 + lane);
          }
      }
    }
    smem.Barrier();
    for (int h = 0; h < HB; ++h) {  // 3. online softmax, one thread per head
      float mx = smem.ReadF32(m + 2 * h, h);
      for (int j = 0; j < nk; ++j)
        mx = std::max(mx, smem.ReadF32(sf + 2 * (size_t(h) * kKeys + j), h));
      const float mh = smem.ReadF32(m + 2 * h, h);
      const float cr = mh == -INFINITY ? 0.0f : std::exp(mh - mx);
      const bool none = mx == -INFINITY;
      float sum = 0.0f;
      for (int j = 0; j < kKeys; ++j) {
        const float e =
            j < nk && !none ? std::exp(smem.ReadF32(sf + 2 * (size_t(h) * kKeys + j), h) - mx) : 0;
        const uint16_t eb = F32ToBF16(e);
        smem.Write(ps + size_t(h) * PP + j, eb, h);
        sum += BF16ToF32(eb);
      }
      smem.WriteF32(l + 2 * h, smem.ReadF32(l + 2 * h, h) * cr + sum, h);
      smem.WriteF32(m + 2 * h, mx, h);
      smem.WriteF32(corr + 2 * h, cr, h);
    }
    smem.Barrier();
    for (int warp = 0; warp < 8; ++warp) {  // 4. O += P V: warp w owns columns [w cols, ...)
      for (int lane = 0; lane < 32; ++lane) {
        const int th = warp * 32 + lane;
        for (int mt = 0; mt < MT; ++mt) {
          const float c_lo = smem.ReadF32(corr + 2 * (mt * 16 + mma::RowC(lane, 0)), th);
          const float c_hi = smem.ReadF32(corr + 2 * (mt * 16 + mma::RowC(lane, 2)), th);
          for (int nt = 0; nt < ntiles; ++nt) {
            float* x = acc(warp, lane, mt, nt);
            x[0] *= c_lo, x[1] *= c_lo, x[2] *= c_hi, x[3] *= c_hi;
          }
        }
      }
      for (int k0 = 0; k0 < kKeys; k0 += 16) {
        std::vector<std::array<std::array<float, 8>, 32>> a(MT);
        for (int mt = 0; mt < MT; ++mt)
          for (int lane = 0; lane < 32; ++lane)
            for (int r = 0; r < 4; ++r) {
              const auto v =
                  pair(ps + size_t(mt * 16 + mma::RowA(lane, r)) * PP + k0 + mma::ColA(lane, r, 0),
                       warp * 32 + lane);
              a[mt][lane][2 * r] = v.first, a[mt][lane][2 * r + 1] = v.second;
            }
        for (int nt = 0; nt < ntiles; ++nt) {
          float b[32][4];
          for (int lane = 0; lane < 32; ++lane) {
            const int th = warp * 32 + lane;
            const size_t v = ks + size_t(warp * cols + nt * 8 + mma::ColB(lane));
            for (int r = 0; r < 2; ++r)
              for (int hh = 0; hh < 2; ++hh)
                b[lane][2 * r + hh] =
                    BF16ToF32(smem.Read(v + size_t(k0 + mma::RowB(lane, r, hh)) * DP, th));
          }
          for (int mt = 0; mt < MT; ++mt) {
            float am[32][8], c[32][4];
            for (int lane = 0; lane < 32; ++lane) {
              std::memcpy(am[lane], a[mt][lane].data(), sizeof(am[lane]));
              std::memcpy(c[lane], acc(warp, lane, mt, nt), sizeof(c[lane]));
            }
            MmaSync(am, b, c);
            for (int lane = 0; lane < 32; ++lane)
              std::memcpy(acc(warp, lane, mt, nt), c[lane], sizeof(c[lane]));
          }
        }
      }
    }
    smem.Barrier();
  }
  const bool partial = query_splits > 1;
  MlaBlock block;
  std::vector<float>& out = block.out;
  out.assign(size_t(HB) * L, NAN);
  std::vector<uint8_t> written(out.size(), 0);
  if (partial)
    for (int h = 0; h < HB; ++h) {
      block.m.push_back(smem.ReadF32(m + 2 * h, h));
      block.l.push_back(smem.ReadF32(l + 2 * h, h));
    }
  for (int warp = 0; warp < 8; ++warp)
    for (int lane = 0; lane < 32; ++lane) {
      const int th = warp * 32 + lane;
      for (int mt = 0; mt < MT; ++mt) {
        const int lo = mt * 16 + mma::RowC(lane, 0), hi = mt * 16 + mma::RowC(lane, 2);
        const float l_lo = smem.ReadF32(l + 2 * lo, th), l_hi = smem.ReadF32(l + 2 * hi, th);
        const float inv_lo = partial    ? 1.0f
                             : l_lo > 0 ? 1.0f / l_lo
                                        : 0.0f,
                    inv_hi = partial    ? 1.0f
                             : l_hi > 0 ? 1.0f / l_hi
                                        : 0.0f;
        for (int nt = 0; nt < ntiles; ++nt) {
          const int col = warp * cols + nt * 8 + mma::ColC(lane, 0);
          const size_t cells[4] = {size_t(lo) * L + col, size_t(lo) * L + col + 1,
                                   size_t(hi) * L + col, size_t(hi) * L + col + 1};
          for (int e = 0; e < 4; ++e) {
            if (written[cells[e]]++) throw std::runtime_error("output element written twice");
            out[cells[e]] = acc(warp, lane, mt, nt)[e] * (e < 2 ? inv_lo : inv_hi);
          }
        }
      }
    }
  return block;
}

// The query's output from its grid's blocks, as the kernels leave it: a query of one split, its
// block's own output (MlaCombineKernel skips it); of several, MlaCombineKernel's merge of its
// own splits' partials (the grid's idle blocks add nothing).
inline std::vector<float> CombineSplits(const std::vector<MlaBlock>& blocks, int L) {
  std::vector<const MlaBlock*> parts;
  for (const MlaBlock& b : blocks)
    if (!b.idle) parts.push_back(&b);
  if (parts.size() == 1 && parts[0]->m.empty()) return parts[0]->out;  // one split
  const int HB = static_cast<int>(parts.at(0)->m.size());
  std::vector<float> out(size_t(HB) * L);
  for (int h = 0; h < HB; ++h) {
    float M = -INFINITY, denom = 0.0f;
    for (const MlaBlock* b : parts) M = std::max(M, b->m[h]);
    for (const MlaBlock* b : parts)
      if (b->m[h] != -INFINITY) denom += std::exp(b->m[h] - M) * b->l[h];
    const float inv = denom > 0 ? 1.0f / denom : 0.0f;
    for (int d = 0; d < L; ++d) {
      float v = 0.0f;
      for (const MlaBlock* b : parts)
        if (b->m[h] != -INFINITY) v += std::exp(b->m[h] - M) * b->out[size_t(h) * L + d];
      out[size_t(h) * L + d] = v * inv;
    }
  }
  return out;
}

}  // namespace attnd::cuda::sim
