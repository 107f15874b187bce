// The exact top-k of a row of 32-bit keys by one thread block, written once: the GPU runs it
// with DeviceBlock (kernels/cuda/ops/selection.cu), the CPU simulation thread by thread between
// barriers with checked shared memory (tests/sim/block_sim.h, tests/sim/topk_sim_test.cc).
//
// Rule (kernels/selection.h, bit for bit): the k largest keys, ties to the lower index, indices
// emitted in ascending order. Radix select over 4 digits of 8 bits: per pass every warp counts
// the matching keys into its own histogram (atomics spread over 16 histograms), the bins are
// summed and suffix-scanned by the block (no serial scan by one thread), and the one bin holding
// the k-th key extends the prefix. Then each thread counts the keys above and at the threshold in
// its own contiguous chunk, the block scans those counts, and each thread emits its chunk's
// taken keys at their places: ascending, each exactly once, without a loop over the row's
// blocks of 512.
//
// Rows of several TopKSlices run on several blocks (selection.cu): each slice's own top-k
// (its candidates: every key of the row's top-k is in its slice's), then one block over the
// candidates in slice order (ascending indices).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "common/host_device.h"

namespace attnd::cuda {

inline constexpr int kTopKThreads = 512;
inline constexpr int kTopKMaxSlices = 64;

// Order-preserving float -> uint32 (larger float, larger key), ranking like kernels/selection.h:
// NaN ties with -inf (lowest), -0 with +0. Never 0 (the "excluded" key of page selection).
ATTND_HD inline uint32_t TopKKey(float f) {
  if (f != f) return 0x007fffffu;     // NaN ranks as -inf
  if (f == 0.0f) return 0x80000000u;  // -0 == +0
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Slices of a row of `len` keys and top-`k`: one (a block that writes the row's selection
// itself) up to max(8k, 8192) keys, then one per that many keys, at most kTopKMaxSlices;
// non-decreasing in len, so a grid sized for the longest row covers every row.
ATTND_HD inline int TopKSlices(int64_t len, int64_t k) {
  const int64_t least = 8 * k > 8192 ? 8 * k : 8192;
  if (len <= least) return 1;
  const int64_t s = (len + least - 1) / least;
  return static_cast<int>(s < kTopKMaxSlices ? s : kTopKMaxSlices);
}
// Keys per slice: the row split evenly (the last slice may be shorter, never empty: len is at
// least 8192 > slices^2 when there are several).
ATTND_HD inline int64_t TopKSliceKeys(int64_t len, int64_t k) {
  const int s = TopKSlices(len, k);
  return (len + s - 1) / s;
}

// Where each row's slices keep their candidates: slice s of row q at entry
// (offset[q] + s) * k of the candidate buffers (k each) and count offset[q] + s. Rows of one slice
// take no entries. `total` slices in all.
struct TopKSlicePlan {
  std::vector<int64_t> offset;
  int64_t total = 0;
};
inline TopKSlicePlan PlanTopKSlices(const std::vector<int64_t>& lens, int64_t k) {
  TopKSlicePlan p;
  for (const int64_t len : lens) {
    p.offset.push_back(p.total);
    const int s = TopKSlices(len, k);
    if (s > 1) p.total += s;
  }
  return p;
}

// Shared-memory words of BlockTopK (26.6 KB), and after them what a caller adds.
struct TopKWords {
  static constexpr int kBins = 256, kWarps = kTopKThreads / 32;
  static constexpr int hist = 0;                       // [warps][bins] per-warp histograms
  static constexpr int total = hist + kWarps * kBins;  // [bins] bin totals, then their scan
  static constexpr int total2 = total + kBins;         // [bins] the scan's other buffer
  static constexpr int gt = total2 + kBins;            // [threads] keys above the threshold
  static constexpr int gt2 = gt + kTopKThreads;
  static constexpr int eq = gt2 + kTopKThreads;  // [threads] keys at the threshold
  static constexpr int eq2 = eq + kTopKThreads;
  // Two copies of {prefix, mask, want, all}: a pass reads one and writes the other.
  static constexpr int state = eq2 + kTopKThreads;
  static constexpr int words = state + 8;
};

// Inclusive scans of a[0, len) and, when c >= 0, c[0, len) together (prefix sums; suffix sums
// when `suffix`), each ping-ponging with its second buffer (a2, c2). Returns 0 when the results
// are in a (and c), 1 when in a2 (and c2).
template <typename Block>
ATTND_HD int BlockScan(Block& b, int a, int a2, int c, int c2, int len, bool suffix) {
  int from = 0;
  for (int off = 1; off < len; off <<= 1) {
    const int src_a = from ? a2 : a, dst_a = from ? a : a2;
    const int src_c = from ? c2 : c, dst_c = from ? c : c2;
    b.Each([&](int tid) {
      for (int i = tid; i < len; i += b.threads()) {
        const int j = suffix ? i + off : i - off;
        const bool in = j >= 0 && j < len;
        uint32_t v = b.Ld(src_a + i, tid);
        if (in) v += b.Ld(src_a + j, tid);
        b.St(dst_a + i, v, tid);
        if (c < 0) continue;
        uint32_t w = b.Ld(src_c + i, tid);
        if (in) w += b.Ld(src_c + j, tid);
        b.St(dst_c + i, w, tid);
      }
    });
    b.Sync();
    from ^= 1;
  }
  return from;
}

// The top-k (k >= 1) of keys key_at(i, tid) for i in [0, n), ties to the lower i; keys of 0 left
// out when drop_zero. emit(pos, i, key, tid) for each taken key at its place pos (ascending i),
// emit.Count(taken, tid) once; every thread of the block must call it. Uses TopKWords::words
// words of shared memory from word 0; ends without a barrier.
template <typename Block, typename KeyAt, typename Emit>
ATTND_HD void BlockTopK(Block& b, const KeyAt& key_at, int64_t n, int64_t k, bool drop_zero,
                        Emit& emit) {
  using W = TopKWords;
  const int T = b.threads();
  // Every key is taken when the row is no longer than k (and none is left out): no passes.
  const bool all_from_start = !drop_zero && n <= k;
  b.Each([&](int tid) {
    for (int i = tid; i < W::kWarps * W::kBins; i += T) b.St(W::hist + i, 0, tid);
    if (tid != 0) return;
    b.St(W::state + 0, 0, tid);                                     // prefix
    b.St(W::state + 1, 0, tid);                                     // mask
    b.St(W::state + 2, static_cast<uint32_t>(k < n ? k : n), tid);  // keys still wanted
    b.St(W::state + 3, all_from_start ? 1u : 0u, tid);              // take every key
  });
  b.Sync();
  int cur = W::state;  // the state this pass reads
  for (int shift = 24; shift >= 0 && !all_from_start; shift -= 8) {
    const int next = cur == W::state ? W::state + 4 : W::state;
    b.Each([&](int tid) {
      if (b.Ld(cur + 3, tid)) return;
      const uint32_t prefix = b.Ld(cur + 0, tid), mask = b.Ld(cur + 1, tid);
      const int h = W::hist + (tid / 32) * W::kBins;
      for (int64_t i = tid; i < n; i += T) {
        const uint32_t key = key_at(i, tid);
        if ((drop_zero && key == 0) || (key & mask) != prefix) continue;
        b.Add(h + static_cast<int>((key >> shift) & 255u), 1, tid);
      }
    });
    b.Sync();
    b.Each([&](int tid) {
      for (int d = tid; d < W::kBins; d += T) {
        uint32_t sum = 0;
        for (int w = 0; w < W::kWarps; ++w) sum += b.Ld(W::hist + w * W::kBins + d, tid);
        b.St(W::total + d, sum, tid);
      }
    });
    b.Sync();
    // suffix[d]: matching keys whose digit is d or more.
    const int suffix =
        BlockScan(b, W::total, W::total2, -1, -1, W::kBins, true) ? W::total2 : W::total;
    b.Each([&](int tid) {
      // The histograms, summed in an earlier phase, start again at 0 for the next pass.
      for (int i = tid; i < W::kWarps * W::kBins; i += T) b.St(W::hist + i, 0, tid);
      const uint32_t prefix = b.Ld(cur + 0, tid), mask = b.Ld(cur + 1, tid);
      const uint32_t want = b.Ld(cur + 2, tid), all = b.Ld(cur + 3, tid);
      // The first pass counts every eligible key: no more of them than wanted takes them all.
      if (all || (shift == 24 && b.Ld(suffix, tid) <= want)) {
        if (tid != 0) return;
        b.St(next + 0, prefix, tid);
        b.St(next + 1, mask, tid);
        b.St(next + 2, want, tid);
        b.St(next + 3, 1, tid);
        return;
      }
      // The one digit d with suffix[d] >= want > suffix[d + 1] holds the k-th key.
      for (int d = tid; d < W::kBins; d += T) {
        const uint32_t here = b.Ld(suffix + d, tid);
        const uint32_t above = d + 1 < W::kBins ? b.Ld(suffix + d + 1, tid) : 0;
        if (here < want || above >= want) continue;
        b.St(next + 0, prefix | (static_cast<uint32_t>(d) << shift), tid);
        b.St(next + 1, mask | (255u << shift), tid);
        b.St(next + 2, want - above, tid);
        b.St(next + 3, 0, tid);
      }
    });
    b.Sync();
    cur = next;
  }
  // Each thread's contiguous chunk: its keys above the threshold and at it, then their places.
  const int64_t chunk = (n + T - 1) / T;
  b.Each([&](int tid) {
    const uint32_t threshold = b.Ld(cur + 0, tid), all = b.Ld(cur + 3, tid);
    uint32_t above = 0, at = 0;
    const int64_t end = (tid + 1) * chunk < n ? (tid + 1) * chunk : n;
    for (int64_t i = tid * chunk; i < end; ++i) {
      const uint32_t key = key_at(i, tid);
      if (drop_zero && key == 0) continue;
      if (all || key > threshold) {
        ++above;
      } else if (key == threshold) {
        ++at;
      }
    }
    b.St(W::gt + tid, above, tid);
    b.St(W::eq + tid, at, tid);
  });
  b.Sync();
  const bool second = BlockScan(b, W::gt, W::gt2, W::eq, W::eq2, T, false);
  const int gt = second ? W::gt2 : W::gt, eq = second ? W::eq2 : W::eq;
  b.Each([&](int tid) {
    const uint32_t threshold = b.Ld(cur + 0, tid), want = b.Ld(cur + 2, tid);
    const uint32_t all = b.Ld(cur + 3, tid);
    const uint32_t above_before = tid ? b.Ld(gt + tid - 1, tid) : 0;
    uint32_t at_before = tid ? b.Ld(eq + tid - 1, tid) : 0;
    int64_t pos = above_before + (at_before < want ? at_before : want);
    const int64_t end = (tid + 1) * chunk < n ? (tid + 1) * chunk : n;
    for (int64_t i = tid * chunk; i < end; ++i) {
      const uint32_t key = key_at(i, tid);
      if (drop_zero && key == 0) continue;
      if (all || key > threshold) {
        emit(pos++, i, key, tid);
      } else if (key == threshold) {
        if (at_before < want) emit(pos++, i, key, tid);
        ++at_before;
      }
    }
    if (tid == T - 1) {
      const uint32_t above = b.Ld(gt + T - 1, tid), at = b.Ld(eq + T - 1, tid);
      emit.Count(above + (all ? 0 : (at < want ? at : want)), tid);
    }
  });
  // A caller that uses the shared memory again syncs first (the kernels do not).
}

// One top-k launch's rows (device pointers on the GPU, host pointers in the simulation): the
// part of TopKParams (kernels/cuda/ops/cuda_kernels.h) that the blocks read.
struct TopKRows {
  const float* scores = nullptr;        // row values (keys TopKKey(score)), or
  const uint32_t* keys = nullptr;       // keys (0 = excluded when drop_zero)
  const int64_t* row_offset = nullptr;  // [nq]
  const int64_t* row_len = nullptr;     // [nq]
  int64_t k = 0;                        // >= 1
  bool drop_zero = false;
  int32_t* out = nullptr;  // [rows, out_stride] ascending indices
  int64_t out_stride = 0;
  int32_t* out_count = nullptr;      // [rows]
  const int32_t* out_row = nullptr;  // [nq] output row of each query; null = the query index
  // Rows of several slices (PlanTopKSlices): candidates [total * k] keys and row indices, counts
  // [total]; unused (may be null) when every row is one slice.
  const int64_t* slice_offset = nullptr;  // [nq]
  uint32_t* cand_key = nullptr;
  int32_t* cand_index = nullptr;
  int32_t* cand_count = nullptr;

  // Each row's k best (at most) into out[row * stride ..], their count into count[row].
  void Into(int64_t k_, int32_t* out_, int64_t stride, int32_t* count) {
    k = k_;
    out = out_;
    out_stride = stride;
    out_count = count;
  }
  // Rows of several slices: where each query's slices start, and the candidates' scratch.
  void Sliced(const int64_t* offset, uint32_t* key, int32_t* index, int32_t* count) {
    slice_offset = offset;
    cand_key = key;
    cand_index = index;
    cand_count = count;
  }
};

// Emits a row's selection (indices) and its count.
struct TopKOut {
  int32_t* out;
  int32_t* count;
  const int32_t* index;  // null: emit i itself; else index[i] (a merge's candidates)
  ATTND_HD void operator()(int64_t pos, int64_t i, uint32_t, int) const {
    out[pos] = index ? index[i] : static_cast<int32_t>(i);
  }
  ATTND_HD void Count(uint32_t c, int) const { *count = static_cast<int32_t>(c); }
};
// Emits a slice's candidates: keys and row indices (the slice's first index added).
struct TopKCandidates {
  uint32_t* key;
  int32_t* index;
  int32_t* count;
  int64_t first;
  ATTND_HD void operator()(int64_t pos, int64_t i, uint32_t k, int) const {
    key[pos] = k;
    index[pos] = static_cast<int32_t>(first + i);
  }
  ATTND_HD void Count(uint32_t c, int) const { *count = static_cast<int32_t>(c); }
};

// Block (query qi, slice s): a row of one slice selects and writes its output; a slice of a
// longer row writes its candidates. Slices past the row's own do nothing (the grid is sized for
// the longest row).
template <typename Block>
ATTND_HD void TopKSliceBlock(Block& b, const TopKRows& p, int64_t qi, int s) {
  const int64_t n = p.row_len[qi], off = p.row_offset[qi];
  const int slices = TopKSlices(n, p.k);
  if (s >= slices) return;
  const int64_t size = TopKSliceKeys(n, p.k), first = s * size;
  const int64_t len = slices == 1 ? n : (n - first < size ? n - first : size);
  auto key_at = [&](int64_t i, int) -> uint32_t {
    return p.keys ? p.keys[off + first + i] : TopKKey(p.scores[off + first + i]);
  };
  if (slices == 1) {
    const int64_t row = p.out_row ? p.out_row[qi] : qi;
    TopKOut emit{p.out + row * p.out_stride, p.out_count + row, nullptr};
    BlockTopK(b, key_at, len, p.k, p.drop_zero, emit);
    return;
  }
  const int64_t slot = p.slice_offset[qi] + s;
  TopKCandidates emit{p.cand_key + slot * p.k, p.cand_index + slot * p.k, p.cand_count + slot,
                      first};
  BlockTopK(b, key_at, len, p.k, p.drop_zero, emit);
}

// Block (query qi) of a row of several slices: the top-k of its slices' candidates, in slice
// order (ascending row indices), empty places (a slice kept fewer than k) excluded as key 0.
template <typename Block>
ATTND_HD void TopKMergeBlock(Block& b, const TopKRows& p, int64_t qi) {
  const int slices = TopKSlices(p.row_len[qi], p.k);
  if (slices == 1) return;
  const int64_t first = p.slice_offset[qi];
  const uint32_t* keys = p.cand_key + first * p.k;
  const int32_t* count = p.cand_count + first;
  auto key_at = [&](int64_t j, int) -> uint32_t { return j % p.k < count[j / p.k] ? keys[j] : 0u; };
  const int64_t row = p.out_row ? p.out_row[qi] : qi;
  TopKOut emit{p.out + row * p.out_stride, p.out_count + row, p.cand_index + first * p.k};
  BlockTopK(b, key_at, slices * p.k, p.k, true, emit);
}

}  // namespace attnd::cuda
