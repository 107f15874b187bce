// Split-K of the tensor-core MLA (flash-decoding), decided by each query's own key count, never
// by the batch: a query's output bits do not depend on what shares its step (docs/numerics.md),
// as on the CPU. Its keys go in splits of kMlaSplitTiles tiles of 64 (512 keys), more tiles per
// split past kMlaMaxSplits splits; a query of at most 512 keys is one block that writes its
// output itself, whatever the grid. Shared by the kernel, the host code that sizes the grid and
// the partials, and the lane-level simulation (tests/sim/mla_mma_sim.h).
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace attnd::cuda {

constexpr int kMlaTileKeys = 64;   // keys per tile (the kernel's kMmaKeys)
constexpr int kMlaSplitTiles = 8;  // tiles per split, at least
constexpr int kMlaMaxSplits = 16;  // splits per query, at most

// Tiles each split of a query with `keys` keys takes.
ATTND_HD inline int64_t MlaTilesPerSplit(int64_t keys) {
  const int64_t tiles = (keys + kMlaTileKeys - 1) / kMlaTileKeys;
  const int64_t spread = (tiles + kMlaMaxSplits - 1) / kMlaMaxSplits;
  return spread > kMlaSplitTiles ? spread : kMlaSplitTiles;
}

// Splits of a query with `keys` keys: 1 to kMlaMaxSplits, non-decreasing in `keys` (so the
// grid's split count is that of the step's longest query).
ATTND_HD inline int MlaQuerySplits(int64_t keys) {
  const int64_t tiles = (keys + kMlaTileKeys - 1) / kMlaTileKeys;
  if (tiles <= 1) return 1;
  const int64_t per = MlaTilesPerSplit(keys);
  return static_cast<int>((tiles + per - 1) / per);
}

// Bytes of split-K partials a step may hold at once (its queries run in waves beyond that).
constexpr int64_t kMlaPartialBytes = int64_t{512} << 20;

// The queries of an n-query step whose partials (`splits` each, [heads, latent + 2] fp32) fit in
// kMlaPartialBytes: all n, or a wave of them (at least one).
ATTND_HD inline int MlaPartialQueries(int n, int splits, int heads, int latent) {
  if (splits <= 1) return n;
  const int64_t per_query = int64_t{splits} * heads * (latent + 2) * 4;
  const int64_t fit = kMlaPartialBytes / per_query;
  return static_cast<int>(fit < 1 ? 1 : fit < n ? fit : n);
}

}  // namespace attnd::cuda
