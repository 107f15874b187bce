#include "kernels/cpu/cpu_device.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>

#include "common/stream_copy.h"
#include "kernels/cpu/attention_cpu.h"
#include "kernels/fp8_rows.h"
#include "kernels/selection.h"

namespace attnd {
namespace {

// Bounds the indexer-score scratch of one wave of queries (floats).
constexpr int64_t kMaxScoreFloats = int64_t{16} << 20;
// Keys per indexer-scoring task, so one long query still spreads over all threads.
constexpr int64_t kScoreChunk = 8192;
// Heads per attention task. A task converts each of its keys once for all its heads, so wider
// groups convert less per head (one query's MLA over 2048 fp8 keys costs ~12% less per head at
// 64 heads than at 16), but a task's score rows (queries x heads) stay within kMaxTaskRows so its
// query, scores and running output keep to L2, and a group wider than kMinHeadGroup must still
// leave kTasksPerThread tasks for every thread.
constexpr int kMinHeadGroup = 16, kMaxHeadGroup = 64, kMaxTaskRows = 128, kTasksPerThread = 4;
// Tokens per absorption GEMM task (q_nope · W_UK of one head).
constexpr int64_t kAbsorbTokens = 64;

void CopyConvert(DType src_t, const void* src, DType dst_t, void* dst, size_t n) {
  if (src_t == dst_t) {
    std::memcpy(dst, src, n * DTypeSize(src_t));
    return;
  }
  thread_local std::vector<float> tmp;
  if (tmp.size() < n) tmp.resize(n);
  ConvertToF32(src_t, src, tmp.data(), n);
  ConvertFromF32(dst_t, tmp.data(), dst, n);
}

struct HeadTask {
  int32_t unit;  // index into the units
  int32_t h0;    // first head
  int32_t hn;    // heads
};

// Every unit's heads split into groups (see kMinHeadGroup): the widest groups that leave work for
// every thread. Outputs do not depend on the grouping (each head's arithmetic is its own).
std::vector<HeadTask> PlanHeadTasks(const std::vector<QueryBlock>& units, int H, int threads) {
  for (int cap = kMaxHeadGroup;; cap /= 2) {
    std::vector<HeadTask> tasks;
    for (size_t u = 0; u < units.size(); ++u) {
      const int qn = std::max(1, units[u].count);  // count 0: one query attending a selection
      int g = cap;
      while (g > kMinHeadGroup && qn * g > kMaxTaskRows) g /= 2;
      for (int h0 = 0; h0 < H; h0 += g)
        tasks.push_back({static_cast<int32_t>(u), h0, std::min(g, H - h0)});
    }
    if (cap <= kMinHeadGroup || static_cast<int64_t>(tasks.size()) >= kTasksPerThread * threads)
      return tasks;
  }
}

}  // namespace

// The kept selection (IndexShare carry) and per-layer fp32 workspaces of one step's share.
struct CpuDevice::Step final : DeviceStep {
  std::vector<std::vector<int32_t>> positions;  // [n] selected key positions, ascending
  std::vector<std::vector<int32_t>> slots;      // [n] the same keys as physical slot ids
  std::vector<float> q, q_nope, index_q, index_w, scores;
};

absl::StatusOr<std::unique_ptr<CpuDevice>> CpuDevice::Create(std::string name,
                                                             const ModelSpec& spec,
                                                             const CacheLayout& layout,
                                                             ThreadPool* pool,
                                                             const cpu::Kernels* kernels) {
  auto cache = KvCache::Create(layout);
  if (!cache.ok()) return cache.status();
  return std::unique_ptr<CpuDevice>(
      new CpuDevice(std::move(name), spec, std::move(cache).value(), pool, kernels));
}

CpuDevice::CpuDevice(std::string name, const ModelSpec& spec, KvCache cache, ThreadPool* pool,
                     const cpu::Kernels* kernels)
    : Device(std::move(name), spec, cache.layout()),
      cache_(std::move(cache)),
      pool_(pool),
      kernels_(kernels) {}

absl::StatusOr<std::unique_ptr<DeviceStep>> CpuDevice::BeginStep(const StepShare& share) {
  auto st = std::make_unique<Step>();
  st->positions.resize(share.size());
  st->slots.resize(share.size());
  return std::unique_ptr<DeviceStep>(std::move(st));
}

// One RunLayer call: Device::RunLayer's steps on the thread pool.
struct CpuDevice::Call final : LayerRun {
  Call(CpuDevice& d, const StepShare& share, Step& st, const LayerCall& call)
      : d(d), share(share), st(st), call(call) {}
  absl::Status WriteKeys() override {
    d.WriteKeys(share, call.layer, *call.in);
    return absl::OkStatus();
  }
  absl::Status Score(const ScoreSink& sink) override {
    d.ConvertIndexQueries(share, st, *call.in);
    d.Score(share, st, call.layer, sink);
    return absl::OkStatus();
  }
  absl::Status Select() override {
    return Score([this](int64_t i, const float* scores, int64_t visible) {
      SelectKeys(d.spec(), scores, visible, &st.positions[i]);
      d.KeepSlots(share, st, i);
    });
  }
  absl::Status Keep(const std::vector<std::vector<int32_t>>& selection) override {
    d.Keep(share, st, selection);
    return absl::OkStatus();
  }
  absl::Status Attend() override {
    d.ConvertQueries(share, st, call);
    d.Attend(share, st, call);
    return absl::OkStatus();
  }

  CpuDevice& d;
  const StepShare& share;
  Step& st;
  const LayerCall& call;
};

absl::StatusOr<std::unique_ptr<LayerRun>> CpuDevice::StartLayer(const StepShare& share,
                                                                DeviceStep& step,
                                                                const LayerCall& call) {
  return std::make_unique<Call>(*this, share, static_cast<Step&>(step), call);
}

absl::Status CpuDevice::SelectedPositions(const StepShare& share, DeviceStep& step,
                                          std::vector<std::vector<int32_t>>* out) {
  *out = static_cast<Step&>(step).positions;
  return absl::OkStatus();
}

void CpuDevice::WriteKeys(const StepShare& share, int layer, const LayerInputs& in) {
  const int L = spec().kv_lora_rank, R = spec().qk_rope_head_dim, Di = spec().index_head_dim;
  const int slot = spec().FullSlot(layer);
  const DType ct = layout().dtype;
  const CacheRows latent = cache_.Latent(layer);
  const CacheRows index = slot >= 0 ? cache_.Index(slot) : CacheRows{};
  if (layout().fp8()) {
    pool_->ParallelFor(share.size(), [&](int64_t i) {
      const int64_t t = share.rows[i];
      PackLatentRow(in.kv_latent, in.k_rope, t, L, R, latent.MutableRow(share.slot[i]));
      if (slot >= 0)
        QuantizeKeyRow(in.index_k, t, Di, Di, index.MutableRow(share.slot[i]),
                       const_cast<uint8_t*>(index.Scales(share.slot[i])));
    });
    return;
  }
  pool_->ParallelFor(share.size(), [&](int64_t i) {
    const int64_t t = share.rows[i];
    uint8_t* row = latent.MutableRow(share.slot[i]);
    CopyConvert(in.kv_latent.dtype, in.kv_latent.Row(t, L), ct, row, L);
    CopyConvert(in.k_rope.dtype, in.k_rope.Row(t, R), ct, row + L * DTypeSize(ct), R);
    if (slot >= 0)
      CopyConvert(in.index_k.dtype, in.index_k.Row(t, Di), ct, index.MutableRow(share.slot[i]), Di);
  });
}

void CpuDevice::QueryRow(const TensorView& t, int64_t row, int64_t elems, float* dst) const {
  if (t.dtype != DType::kFP8E4M3) return QueryRowToF32(t, row, elems, dst);
  // The same code x scale as QueryRowToF32 (one rounding each), by the vector e4m3 decode.
  float scale;
  std::memcpy(&scale, static_cast<const uint8_t*>(t.scales) + row * 4, 4);
  kernels_->e4m3_to_f32(t.Row(row, elems), &scale, static_cast<int>(elems), dst,
                        static_cast<int>(elems));
}

void CpuDevice::ConvertQueries(const StepShare& share, Step& st, const LayerCall& call) {
  const LayerInputs& in = *call.in;
  const int H = spec().num_heads, L = spec().kv_lora_rank, R = spec().qk_rope_head_dim, D = L + R;
  const int64_t n = share.size();
  // Queries to fp32: [n, H, L+R] with q_latent | q_rope per head.
  st.q.resize(static_cast<size_t>(n) * H * D);
  if (call.absorb == nullptr) {
    pool_->ParallelFor(n, [&](int64_t i) {
      const int64_t t = share.rows[i];
      for (int h = 0; h < H; ++h) {
        float* q = st.q.data() + (i * H + h) * D;
        QueryRow(in.q_latent, t * H + h, L, q);
        QueryRow(in.q_rope, t * H + h, R, q + L);
      }
    });
  } else {
    // Absorbed on the server: q_latent[i, h] = q_nope[i, h] · W_UK[h], one GEMM per head and
    // block of tokens.
    const Absorption& a = *call.absorb;
    const int Dn = a.qk_nope_head_dim();
    st.q_nope.resize(static_cast<size_t>(n) * H * Dn);
    pool_->ParallelFor(n, [&](int64_t i) {
      const int64_t t = share.rows[i];
      for (int h = 0; h < H; ++h) {
        QueryRow(in.q_nope, t * H + h, Dn, st.q_nope.data() + (i * H + h) * Dn);
        QueryRow(in.q_rope, t * H + h, R, st.q.data() + (i * H + h) * D + L);
      }
    });
    const int64_t blocks = (n + kAbsorbTokens - 1) / kAbsorbTokens;
    pool_->ParallelFor(blocks * H, [&](int64_t task) {
      const int h = static_cast<int>(task % H);
      const int64_t i0 = task / H * kAbsorbTokens;
      const int m = static_cast<int>(std::min<int64_t>(kAbsorbTokens, n - i0));
      kernels_->gemm(m, L, Dn, st.q_nope.data() + (i0 * H + h) * Dn, H * Dn, a.Uk(call.layer, h), L,
                     st.q.data() + (i0 * H + h) * D, H * D, false);
    });
  }
}

void CpuDevice::ConvertIndexQueries(const StepShare& share, Step& st, const LayerInputs& in) {
  const int64_t n = share.size();
  const int Hi = spec().index_n_heads;
  const int64_t row = int64_t{Hi} * spec().index_head_dim;
  st.index_q.resize(n * row);
  st.index_w.resize(n * Hi);
  pool_->ParallelFor(n, [&](int64_t i) {
    const int64_t t = share.rows[i];
    for (int h = 0; h < Hi; ++h)  // a row per head: fp8 queries have a scale each
      QueryRow(in.index_q, t * Hi + h, spec().index_head_dim,
               st.index_q.data() + i * row + h * spec().index_head_dim);
    ConvertToF32(in.index_w.dtype, in.index_w.Row(t, Hi), st.index_w.data() + i * Hi, Hi);
  });
}

// Token i's kept positions to physical slots, once: every layer until the next full one reads
// them.
void CpuDevice::KeepSlots(const StepShare& share, Step& st, int64_t i) {
  const PageTable table = share.table();
  const auto& sel = st.positions[i];
  auto& slots = st.slots[i];
  slots.resize(sel.size());
  for (size_t j = 0; j < sel.size(); ++j)
    slots[j] = static_cast<int32_t>(table.Slot(share.seq[i], sel[j]));
}

void CpuDevice::Keep(const StepShare& share, Step& st,
                     const std::vector<std::vector<int32_t>>& selection) {
  for (int64_t i = 0; i < share.size(); ++i) {
    st.positions[i] = selection[i];
    KeepSlots(share, st, i);
  }
}

void CpuDevice::Score(const StepShare& share, Step& st, int layer,
                      const LayerRun::ScoreSink& sink) {
  const int Hi = spec().index_n_heads, Di = spec().index_head_dim;
  const CacheRows keys = cache_.Index(spec().FullSlot(layer));
  const PageTable table = share.table();
  std::vector<int64_t> need;  // local tokens whose selection could miss a visible key
  for (int64_t i = 0; i < share.size(); ++i)
    if (share.needs_index[i]) need.push_back(i);
  for (size_t w0 = 0; w0 < need.size();) {
    // A wave of queries whose score rows fit the scratch bound.
    std::vector<int64_t> offset = {0};
    size_t w1 = w0;
    while (w1 < need.size()) {
      const int64_t n = share.pos[need[w1]] + 1;
      if (w1 > w0 && offset.back() + n > kMaxScoreFloats) break;
      offset.push_back(offset.back() + n);
      ++w1;
    }
    if (st.scores.size() < static_cast<size_t>(offset.back())) st.scores.resize(offset.back());
    // Tasks: (query, chunk of keys).
    std::vector<std::pair<int32_t, int64_t>> tasks;
    for (size_t w = w0; w < w1; ++w)
      for (int64_t k0 = 0; k0 < share.pos[need[w]] + 1; k0 += kScoreChunk)
        tasks.emplace_back(static_cast<int32_t>(w - w0), k0);
    pool_->ParallelFor(static_cast<int64_t>(tasks.size()), [&](int64_t j) {
      const auto [qi, k0] = tasks[j];
      const int64_t i = need[w0 + qi];
      cpu::IndexerScoreParams p;
      p.q = st.index_q.data() + i * Hi * Di;
      p.w = st.index_w.data() + i * Hi;
      p.num_heads = Hi;
      p.head_dim = Di;
      p.keys = keys;
      p.table = table;
      p.seq = share.seq[i];
      p.begin = k0;
      p.end = std::min(share.pos[i] + 1, k0 + kScoreChunk);
      p.scores = st.scores.data() + offset[qi] + k0;
      cpu::IndexerScores(*kernels_, p);
    });
    pool_->ParallelFor(static_cast<int64_t>(w1 - w0), [&](int64_t qi) {
      const int64_t i = need[w0 + qi];
      sink(i, st.scores.data() + offset[qi], share.pos[i] + 1);
    });
    w0 = w1;
  }
}

void CpuDevice::Attend(const StepShare& share, Step& st, const LayerCall& call) {
  const int layer = call.layer;
  const DType out_dtype = call.out_dtype;
  uint8_t* out = call.out;
  float* lse = call.lse;
  const Absorption* absorb = call.absorb;
  const int H = spec().num_heads, L = spec().kv_lora_rank, D = spec().latent_dim();
  // The output's per-head width: V when absorbed (out_latent · W_UV^T), else L.
  const int W = absorb != nullptr ? absorb->v_head_dim() : L;
  const LayerKind kind = spec().layers[layer];
  const bool dense = kind == LayerKind::kDense;
  const size_t oe = DTypeSize(out_dtype);
  // Units of work: the plan's blocks of range queries, and on sparse layers one unit per query
  // attending its kept selection (count 0 marks those).
  std::vector<QueryBlock> units = dense ? share.dense_blocks : share.sparse_blocks;
  if (!dense)
    for (int64_t i = 0; i < share.size(); ++i)
      if (share.needs_index[i]) units.push_back({static_cast<int32_t>(i), 0});
  const CacheRows kv = cache_.Latent(layer);
  const PageTable table = share.table();
  const std::vector<HeadTask> tasks = PlanHeadTasks(units, H, pool_->num_threads());
  pool_->ParallelFor(static_cast<int64_t>(tasks.size()), [&](int64_t task) {
    const QueryBlock u = units[tasks[task].unit];
    const bool range = u.count > 0;
    const int qn = range ? u.count : 1;
    const int h0 = tasks[task].h0, hn = tasks[task].hn;
    thread_local std::vector<float> q, o, e, v;
    thread_local std::vector<int64_t> lo, hi;
    q.resize(static_cast<size_t>(qn) * hn * D);
    o.resize(static_cast<size_t>(qn) * hn * L);
    e.resize(static_cast<size_t>(qn) * hn);
    lo.resize(qn);
    hi.resize(qn);
    for (int j = 0; j < qn; ++j) {
      const int64_t i = u.first + j;
      std::copy_n(st.q.data() + (i * H + h0) * D, static_cast<size_t>(hn) * D,
                  q.data() + static_cast<size_t>(j) * hn * D);
      lo[j] = FirstVisibleKey(spec(), kind, share.pos[i]);
      hi[j] = share.pos[i] + 1;
    }
    cpu::MlaParams p;
    p.q = q.data();
    p.num_heads = hn;
    p.num_queries = qn;
    p.latent_dim = L;
    p.rope_dim = spec().qk_rope_head_dim;
    p.kv = kv;
    p.sm_scale = static_cast<float>(spec().sm_scale);
    p.out = o.data();
    if (lse != nullptr) p.lse = e.data();
    if (dense) p.soft_cap = static_cast<float>(spec().soft_cap);
    if (range) {
      p.table = table;
      p.seq = share.seq[u.first];
      p.begin = lo[0];
      p.end = hi[qn - 1];
      if (qn > 1) {
        p.row_begin = lo.data();
        p.row_end = hi.data();
      }
    } else {
      p.slots = st.slots[u.first].data();
      p.num_keys = static_cast<int64_t>(st.slots[u.first].size());
    }
    cpu::MlaAttend(*kernels_, p);
    const float* res = o.data();  // [qn, hn, W]
    if (absorb != nullptr) {      // the values: out_latent[h] · W_UV[h]^T, a GEMM per head
      v.resize(static_cast<size_t>(qn) * hn * W);
      for (int hh = 0; hh < hn; ++hh)
        kernels_->gemm(qn, W, L, o.data() + hh * L, hn * L, absorb->UvT(layer, h0 + hh), W,
                       v.data() + hh * W, hn * W, false);
      res = v.data();
    }
    for (int j = 0; j < qn; ++j) {
      const int64_t t = share.rows[u.first + j];
      ConvertFromF32(out_dtype, res + static_cast<size_t>(j) * hn * W, out + (t * H + h0) * W * oe,
                     static_cast<size_t>(hn) * W);
      if (lse != nullptr) std::copy_n(e.data() + static_cast<size_t>(j) * hn, hn, lse + t * H + h0);
    }
  });
}

absl::Status CpuDevice::ReadRows(int layer, int slot, int32_t page, int first, int rows,
                                 uint8_t* latent, uint8_t* index) {
  std::memcpy(latent, cache_.LatentRow(layer, page, first), rows * layout().latent_row_bytes());
  if (slot >= 0) CopyIndexRows(cache_.IndexPage(slot, page), first, rows, index);
  return absl::OkStatus();
}

void CpuDevice::CopyIndexRows(const uint8_t* page, int first, int rows, uint8_t* to) const {
  for (const auto& r : layout().IndexRanges(first, rows)) {
    std::memcpy(to, page + r.offset, r.bytes);
    to += r.bytes;
  }
}

namespace {
void PlainCopy(void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); }
}  // namespace

void CpuDevice::StagePage(int32_t page, int rows, uint8_t* staged, bool to_staged,
                          void (*copy)(void*, const void*, size_t)) {
  const CacheLayout& c = layout();
  auto move = [&](uint8_t* cache, uint8_t* stage, size_t bytes) {
    if (to_staged) {
      copy(stage, cache, bytes);
    } else {
      copy(cache, stage, bytes);
    }
  };
  for (int l = 0; l < c.num_layers; ++l)
    move(cache_.LatentRow(l, page, 0), staged + c.StagedLatent(l, rows),
         rows * c.latent_row_bytes());
  for (int k = 0; k < c.num_full_layers; ++k) {
    uint8_t* at = staged + c.StagedIndex(k, rows);
    for (const auto& r : c.IndexRanges(0, rows)) {
      move(cache_.IndexPage(k, page) + r.offset, at, r.bytes);
      at += r.bytes;
    }
  }
}

absl::Status CpuDevice::ReadPage(int32_t page, int rows, uint8_t* staged) {
  StagePage(page, rows, staged, true, PlainCopy);
  return absl::OkStatus();
}

absl::Status CpuDevice::WritePage(int32_t page, int rows, const uint8_t* staged) {
  StagePage(page, rows, const_cast<uint8_t*>(staged), false, PlainCopy);
  return absl::OkStatus();
}

absl::Status CpuDevice::ReadPages(const std::vector<int32_t>& pages,
                                  const std::vector<uint8_t*>& staged) {
  pool_->ParallelFor(static_cast<int64_t>(pages.size()), [&](int64_t i) {
    StagePage(pages[i], layout().page_size, staged[i], true, StreamCopy);
  });
  return absl::OkStatus();
}

absl::Status CpuDevice::WritePages(const std::vector<int32_t>& pages,
                                   const std::vector<const uint8_t*>& staged) {
  pool_->ParallelFor(static_cast<int64_t>(pages.size()), [&](int64_t i) {
    StagePage(pages[i], layout().page_size, const_cast<uint8_t*>(staged[i]), false, StreamCopy);
  });
  return absl::OkStatus();
}

absl::Status CpuDevice::CopyPages(Device& dst, const std::vector<PageCopy>& copies) {
  auto* to = dynamic_cast<CpuDevice*>(&dst);
  if (to == nullptr) return Device::CopyPages(dst, copies);  // through host staging
  const CacheLayout& c = layout();
  for (const PageCopy& p : copies) {
    if (p.rows <= 0) continue;
    for (int l = 0; l < c.num_layers; ++l)
      std::memcpy(to->cache_.LatentRow(l, p.dst, 0), cache_.LatentRow(l, p.src, 0),
                  p.rows * c.latent_row_bytes());
    for (int k = 0; k < c.num_full_layers; ++k)
      for (const auto& r : c.IndexRanges(0, p.rows))
        std::memcpy(to->cache_.IndexPage(k, p.dst) + r.offset,
                    cache_.IndexPage(k, p.src) + r.offset, r.bytes);
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> CpuDevice::ReservedPageUntouched() {
  const CacheLayout& c = layout();
  const auto zero = [](const uint8_t* p, size_t n) {
    return std::all_of(p, p + n, [](uint8_t b) { return b == 0; });
  };
  for (int l = 0; l < c.num_layers; ++l)
    if (!zero(cache_.LatentRow(l, 0, 0), c.page_size * c.latent_row_bytes())) return false;
  for (int k = 0; k < c.num_full_layers; ++k)
    if (!zero(cache_.IndexPage(k, 0), c.page_size * c.index_row_bytes())) return false;
  return true;
}

}  // namespace attnd
