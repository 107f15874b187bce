#include "kernels/cuda/ops/mla_flashinfer_plan.h"

#include <algorithm>
#include <limits>
#include <queue>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/ops/mla_split.h"

namespace attnd::cuda {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
// FlashInfer forms a partial row's address as partial_indptr * latent in 32 unsigned bits.
constexpr int64_t kMaxWaveRows = (int64_t{1} << 32) / kFlashInferMlaLatent / 2;

// A work item before it is given to a block group.
struct Item {
  int32_t query, q_start, kv_start, kv_end, partial;
};

}  // namespace

int64_t FlashInferMlaChunkKeys(int64_t keys) {
  return MlaTilesPerSplit(keys) * kFlashInferMlaTileKeys;
}

int FlashInferMlaChunks(int64_t keys) { return keys <= 0 ? 0 : MlaQuerySplits(keys); }

FlashInferMlaPlanResult PlanFlashInferMla(const FlashInferMlaPlanInput& in) {
  FlashInferMlaPlanResult r;
  const int64_t n = static_cast<int64_t>(in.keys.size());
  if (in.heads < 1 || in.heads > 1024) {
    r.refused = absl::StrCat(in.heads, " heads: 1 to 1024 are planned");
    return r;
  }
  if (in.multiprocessors < 1 || in.partial_bytes < 1 ||
      static_cast<int64_t>(in.list_start.size()) != n) {
    r.refused = "no multiprocessors or partial budget, or not one list start a query";
    return r;
  }
  if (in.list_entries > kInt32Max || n * in.heads * kFlashInferMlaLatent > kInt32Max) {
    r.refused = absl::StrCat(n, " queries of ", in.heads, " heads over ", in.list_entries,
                             " listed keys overflow the kernel's 32-bit offsets");
    return r;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (in.keys[i] < 1 || in.list_start[i] < 0 || in.list_start[i] + in.keys[i] > in.list_entries) {
      r.refused = absl::StrCat("query ", i, " attends ", in.keys[i], " keys from list entry ",
                               in.list_start[i], ", not within the ", in.list_entries, " listed");
      return r;
    }
  }
  const int blocks_x = in.heads > kFlashInferMlaTileRows ? 2 : 1;
  const int cluster_rows = blocks_x * kFlashInferMlaTileRows;
  const int tiles = (in.heads + cluster_rows - 1) / cluster_rows;
  const int rows_per_chunk = tiles * cluster_rows;
  const int blocks_y = std::max(1, in.multiprocessors / blocks_x);
  const int64_t row_bytes = int64_t{kFlashInferMlaLatent} * 2 + 4;
  const int64_t budget_rows =
      std::min(kMaxWaveRows, std::max<int64_t>(1, in.partial_bytes / row_bytes));

  for (int64_t q = 0; q < n;) {
    FlashInferMlaWave w;
    w.first_query = static_cast<int>(q);
    w.blocks_x = blocks_x;
    w.blocks_y = blocks_y;
    w.rows_per_chunk = rows_per_chunk;
    std::vector<Item> items;
    for (; q < n; ++q) {
      const int chunks = FlashInferMlaChunks(in.keys[q]);
      const int64_t rows = int64_t{chunks} * rows_per_chunk;
      if (w.queries > 0 && w.partial_rows + rows > budget_rows) break;
      if (rows > kMaxWaveRows) {
        r.refused = absl::StrCat("query ", q, " needs ", rows, " partial rows in one wave");
        return r;
      }
      const int64_t chunk_keys = FlashInferMlaChunkKeys(in.keys[q]);
      w.merge_row.push_back(static_cast<int32_t>(w.partial_rows));
      w.merge_chunks.push_back(chunks);
      for (int c = 0; c < chunks; ++c) {
        const int64_t begin = c * chunk_keys, end = std::min(in.keys[q], begin + chunk_keys);
        for (int t = 0; t < tiles; ++t)
          items.push_back({static_cast<int32_t>(q), t * cluster_rows, static_cast<int32_t>(begin),
                           static_cast<int32_t>(end),
                           static_cast<int32_t>(w.partial_rows + int64_t{c} * rows_per_chunk +
                                                int64_t{t} * cluster_rows)});
      }
      w.partial_rows += rows;
      ++w.queries;
    }
    // Longest processing time first, each item to the least loaded group (ties: the lower
    // group, then the item's order): deterministic, and within 4/3 of the best makespan.
    std::vector<int32_t> order(items.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
    auto cost = [&](int32_t i) {
      return int64_t{items[i].kv_end - items[i].kv_start} + kFlashInferMlaTileKeys;
    };
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return cost(a) > cost(b); });
    using Load = std::pair<int64_t, int32_t>;  // (load, group): the least first
    std::priority_queue<Load, std::vector<Load>, std::greater<Load>> load;
    for (int32_t g = 0; g < blocks_y; ++g) load.push({0, g});
    std::vector<std::vector<int32_t>> group(blocks_y);
    for (const int32_t i : order) {
      auto [l, g] = load.top();
      load.pop();
      group[g].push_back(i);
      load.push({l + cost(i), g});
    }
    w.work_indptr.push_back(0);
    for (int32_t g = 0; g < blocks_y; ++g) {
      std::sort(group[g].begin(), group[g].end());  // a group walks its items in plan order
      for (const int32_t i : group[g]) {
        const Item& it = items[i];
        w.q_indptr.push_back(it.query);
        w.kv_indptr.push_back(static_cast<int32_t>(in.list_start[it.query]));
        w.partial_indptr.push_back(it.partial);
        w.q_len.push_back(1);
        w.kv_len.push_back(static_cast<int32_t>(in.keys[it.query]));
        w.q_start.push_back(it.q_start);
        w.kv_start.push_back(it.kv_start);
        w.kv_end.push_back(it.kv_end);
      }
      w.work_indptr.push_back(static_cast<int32_t>(w.q_indptr.size()));
    }
    r.plan.max_partial_rows = std::max(r.plan.max_partial_rows, w.partial_rows);
    r.plan.waves.push_back(std::move(w));
  }
  return r;
}

FlashInferMlaLayout FlashInferMlaLayoutFor(DType cache_dtype, size_t row_bytes, uintptr_t base,
                                           int latent, int rope, int heads) {
  FlashInferMlaLayout l;
  if (cache_dtype != DType::kBF16) {
    l.refused = absl::StrCat("a ", DTypeName(cache_dtype), " cache (the kernel reads bf16 rows)");
    return l;
  }
  if (latent != kFlashInferMlaLatent || rope != kFlashInferMlaRope) {
    l.refused = absl::StrCat("latent ", latent, " + RoPE ", rope, " (built for ",
                             kFlashInferMlaLatent, " + ", kFlashInferMlaRope, ")");
    return l;
  }
  const size_t need = static_cast<size_t>(latent + rope) * 2;
  if (row_bytes < need || row_bytes % 16 != 0 || base % 16 != 0 ||
      row_bytes / 2 > std::numeric_limits<uint32_t>::max()) {
    l.refused = absl::StrCat("cache rows of ", row_bytes, " bytes at ", base % 16,
                             " past 16-byte alignment (16-byte loads of ", need, "-byte keys)");
    return l;
  }
  if (heads < 1 || int64_t{heads} * latent > kInt32Max) {
    l.refused = absl::StrCat(heads, " heads");
    return l;
  }
  l.ckv_stride_page = l.kpe_stride_page = static_cast<uint32_t>(row_bytes / 2);
  l.kpe_offset_bytes = static_cast<size_t>(latent) * 2;
  l.q_nope_stride_h = static_cast<uint32_t>(latent);
  l.q_nope_stride_n = static_cast<uint32_t>(heads * latent);
  l.q_pe_stride_h = static_cast<uint32_t>(rope);
  l.q_pe_stride_n = static_cast<uint32_t>(heads * rope);
  return l;
}

}  // namespace attnd::cuda
