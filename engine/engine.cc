#include "engine/engine.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <new>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/client_text.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "kernels/cpu/attention_cpu.h"
#include "kv_store/kv_cache.h"
#include "kv_store/page_pool.h"
#ifdef ATTND_HAVE_CUDA
#include <future>

#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/nccl_peer.h"
#endif

namespace attnd {
namespace {

using Clock = std::chrono::steady_clock;

// Bounds the indexer-score scratch of one wave of queries (floats).
constexpr int64_t kMaxScoreFloats = int64_t{16} << 20;
// Keys per indexer-scoring task, so one long query still spreads over all threads.
constexpr int64_t kScoreChunk = 8192;
// Heads per attention task.
constexpr int kHeadGroup = 16;
// Consecutive prefill queries sharing key tiles in one attention task.
constexpr int kQueryBlock = 8;
// Ended steps whose fate a late layer message is told (CANCELLED, DEADLINE_EXCEEDED, ...).
constexpr size_t kRememberedFates = 8192;

// One device's pool and caches: host memory for cpu:N, device memory (held by `gpu`) for
// cuda:N, whose host-side KvCache is then an untouched, lazily mapped placeholder.
struct Device {
  std::string name;
  PagePool pool;
  KvCache cache;
#ifdef ATTND_HAVE_CUDA
  std::unique_ptr<cuda::CudaDevice> gpu;
#endif
  int64_t sequences = 0;
  Device(std::string n, PagePool p, KvCache c)
      : name(std::move(n)), pool(std::move(p)), cache(std::move(c)) {}
  bool is_gpu() const {
#ifdef ATTND_HAVE_CUDA
    return gpu != nullptr;
#else
    return false;
#endif
  }
};

struct Sequence {
  std::string id;
  int device = 0;
  std::vector<int32_t> pages;
  int64_t length = 0;
  uint64_t step = 0;  // the open step holding it, 0 if none
};

struct StepSeq {
  Sequence* seq = nullptr;
  int64_t q_len = 0;
  int64_t new_len = 0;
  std::vector<int32_t> new_pages;  // reserved by the step, owned by it until commit
  std::vector<int32_t> table;      // seq->pages + new_pages
};

struct Step {
  uint64_t id = 0;
  std::vector<StepSeq> seqs;
  int64_t tokens = 0;
  StepOptions options;
  int next_layer = 0;
  bool busy = false;
  bool abort_requested = false;
  Clock::time_point last_used;
  // Plan, built once per step: per token, its batch entry and absolute position; the tokens
  // the CPU backend computes; the GPUs holding the rest.
  std::vector<int32_t> tok_entry;
  std::vector<int64_t> tok_pos;
  std::vector<int64_t> cpu_tokens;
  std::vector<int> gpu_devices;
  // IndexShare carry: per token, the keys the last full layer selected (or all visible keys).
  std::vector<std::vector<int32_t>> selected;
  std::vector<uint8_t> select_all;
  // Per-layer fp32 workspaces, reused across layers.
  std::vector<float> q, index_q, index_w, scores;
};

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

const uint8_t* Bytes(const TensorView& t) { return static_cast<const uint8_t*>(t.data); }

}  // namespace

struct Engine::Impl {
  EngineOptions options;
  const ModelSpec& spec() const { return options.spec; }
  const cpu::Kernels* kernels = nullptr;
  std::unique_ptr<ThreadPool> pool;

  mutable std::mutex mu;               // guards everything below
  std::condition_variable step_ended;  // notified whenever a step ends or a layer finishes
  std::vector<Device> devices;
#ifdef ATTND_HAVE_CUDA
  // With two or more GPUs: NCCL communicators (rank per GPU device, -1 for CPU devices).
  std::unique_ptr<cuda::NcclPeers> nccl;
  std::vector<int> nccl_rank;
#endif
  absl::flat_hash_map<std::string, std::unique_ptr<Sequence>> sequences;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Step>> steps;
  uint64_t next_step_id = 1;
  int64_t steps_aborted = 0;
  int64_t steps_committed = 0;
  // What became of recently ended steps: the status a late message for one of them gets.
  absl::flat_hash_map<uint64_t, absl::Status> fates;
  std::deque<uint64_t> fate_order;

  // mu held.
  void RememberFate(uint64_t id, absl::Status why) {
    if (fates.insert_or_assign(id, std::move(why)).second) fate_order.push_back(id);
    while (fate_order.size() > kRememberedFates) {
      fates.erase(fate_order.front());
      fate_order.pop_front();
    }
  }
  void EndGpuSteps(Step* step) {
#ifdef ATTND_HAVE_CUDA
    for (int d : step->gpu_devices) devices[d].gpu->EndStep(step->id);
#endif
  }
  // `why` is what a later message for this step is told (CANCELLED or DEADLINE_EXCEEDED).
  void AbortLocked(Step* step, absl::Status why) {
    EndGpuSteps(step);
    for (StepSeq& s : step->seqs) {
      for (int32_t p : s.new_pages) devices[s.seq->device].pool.Unref(p);
      s.seq->step = 0;
    }
    ++steps_aborted;
    RememberFate(step->id, std::move(why));
    steps.erase(step->id);
    step_ended.notify_all();
  }
  void CommitLocked(Step* step) {
    EndGpuSteps(step);
    for (StepSeq& s : step->seqs) {
      s.seq->pages.insert(s.seq->pages.end(), s.new_pages.begin(), s.new_pages.end());
      s.seq->length = s.new_len;
      s.seq->step = 0;
    }
    ++steps_committed;
    RememberFate(step->id,
                 absl::FailedPreconditionError(absl::StrCat(
                     "step ", step->id, " already committed at its last layer; begin a new step")));
    steps.erase(step->id);
    step_ended.notify_all();
  }
  // The open step `id`, or the status its fate (or absence) gives. mu held.
  absl::StatusOr<Step*> FindStep(uint64_t id) const {
    auto it = steps.find(id);
    if (it != steps.end()) return it->second.get();
    auto f = fates.find(id);
    if (f != fates.end()) return f->second;
    return absl::NotFoundError(absl::StrCat("step ", id, " not found"));
  }
  absl::Status CheckNewId(const std::string& id) const;
  // One attempt at BeginStep under mu; *wait_for is set to a conflicting step running a layer.
  absl::StatusOr<uint64_t> TryBegin(const std::vector<StepEntry>& batch, const StepOptions& options,
                                    uint64_t* wait_for);

  // A sequence's rows in one cache buffer of its device (a layer's latent rows or a full
  // layer's indexer rows).
  PagedRows Rows(const StepSeq& s, const uint8_t* base, size_t row_bytes, int dim) const {
    PagedRows r;
    r.base = base;
    r.pages = s.table.data();
    r.page_size = spec().page_size;
    r.row_stride = row_bytes;
    r.page_stride = row_bytes * spec().page_size;
    r.dtype = options.cache_dtype;
    r.dim = dim;
    return r;
  }
  PagedRows LatentRows(const StepSeq& s, int layer) const {
    const KvCache& c = devices[s.seq->device].cache;
    return Rows(s, c.LatentRow(layer, 0, 0), c.latent_row_bytes(), spec().latent_dim());
  }
  PagedRows IndexRows(const StepSeq& s, int slot) const {
    const KvCache& c = devices[s.seq->device].cache;
    return Rows(s, c.IndexRow(slot, 0, 0), c.index_row_bytes(), spec().index_head_dim);
  }

  bool CopyToDevice(const std::vector<int32_t>& pages, int64_t length, int from, int to,
                    std::vector<int32_t>* out);
  // Copies `rows` rows of a page in every layer and slot, across devices of any kind.
  void CopyPage(int from, int32_t src, int to, int32_t dst, int rows);
  absl::Status ValidateInputs(const Step& st, int layer, const LayerInputs& in,
                              size_t out_bytes) const;
  absl::Status ValidateShapes(const Step& st, int layer, const LayerInputs& in,
                              size_t out_bytes) const;
  void WriteKeys(Step& st, int layer, const LayerInputs& in);
  void Select(Step& st, int layer);
  void Attend(Step& st, int layer, DType out_dtype, uint8_t* out);
  absl::Status Compute(Step& st, int layer, const LayerInputs& in, void* out, size_t out_bytes,
                       LayerTrace* trace);
  absl::Status ComputeCpu(Step& st, int layer, const LayerInputs& in, void* out, LayerTrace* trace);
  absl::Status BeginGpuSteps(Step& st);
};

absl::Status Engine::Impl::ValidateInputs(const Step& st, int layer, const LayerInputs& in,
                                          size_t out_bytes) const {
  RETURN_IF_ERROR(ValidateShapes(st, layer, in, out_bytes));
  if (!options.limits.check_finite) return absl::OkStatus();
  const std::pair<const char*, const TensorView*> all[] = {
      {"q_latent", &in.q_latent}, {"q_rope", &in.q_rope},   {"kv_latent", &in.kv_latent},
      {"k_rope", &in.k_rope},     {"index_q", &in.index_q}, {"index_k", &in.index_k},
      {"index_w", &in.index_w}};
  for (const auto& [name, t] : all) RETURN_IF_ERROR(CheckFinite(name, *t));
  return absl::OkStatus();
}

absl::Status Engine::Impl::ValidateShapes(const Step& st, int layer, const LayerInputs& in,
                                          size_t out_bytes) const {
  const ModelSpec& s = spec();
  const int64_t T = st.tokens;
  RETURN_IF_ERROR(CheckTensor("kv_latent", in.kv_latent, {T, s.kv_lora_rank}));
  RETURN_IF_ERROR(CheckTensor("k_rope", in.k_rope, {T, s.qk_rope_head_dim}));
  if (st.options.write_only) {
    if (s.layers[layer] == LayerKind::kFull) {
      RETURN_IF_ERROR(CheckTensor("index_k", in.index_k, {T, s.index_head_dim}));
    } else if (in.index_k.present) {
      return absl::InvalidArgumentError(
          absl::StrCat("index_k: given for layer ", layer, ", a ", LayerKindName(s.layers[layer]),
                       " layer; indexer tensors belong to full layers only"));
    }
    if (in.q_latent.present || in.q_rope.present || in.index_q.present || in.index_w.present ||
        out_bytes != 0)
      return absl::InvalidArgumentError(
          "write-only step: give only kv_latent, k_rope and (full layers) index_k; no output");
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(CheckTensor("q_latent", in.q_latent, {T, s.num_heads, s.kv_lora_rank}));
  RETURN_IF_ERROR(CheckTensor("q_rope", in.q_rope, {T, s.num_heads, s.qk_rope_head_dim}));
  if (s.layers[layer] == LayerKind::kFull) {
    RETURN_IF_ERROR(CheckTensor("index_q", in.index_q, {T, s.index_n_heads, s.index_head_dim}));
    RETURN_IF_ERROR(CheckTensor("index_k", in.index_k, {T, s.index_head_dim}));
    RETURN_IF_ERROR(CheckTensor("index_w", in.index_w, {T, s.index_n_heads}));
  } else {
    const char* given = in.index_q.present   ? "index_q"
                        : in.index_k.present ? "index_k"
                        : in.index_w.present ? "index_w"
                                             : nullptr;
    if (given)
      return absl::InvalidArgumentError(
          absl::StrCat(given, ": given for layer ", layer, ", a ", LayerKindName(s.layers[layer]),
                       " layer; indexer tensors belong to full layers only"));
  }
  const size_t want =
      static_cast<size_t>(T) * s.num_heads * s.kv_lora_rank * DTypeSize(in.q_latent.dtype);
  if (out_bytes != want)
    return absl::InvalidArgumentError(absl::StrCat("output buffer: ", out_bytes,
                                                   " bytes, expected ", want, " ([T, H, L] in ",
                                                   DTypeName(in.q_latent.dtype), ")"));
  return absl::OkStatus();
}

void Engine::Impl::WriteKeys(Step& st, int layer, const LayerInputs& in) {
  const ModelSpec& s = spec();
  const int L = s.kv_lora_rank, R = s.qk_rope_head_dim, Di = s.index_head_dim;
  const int slot = s.FullSlot(layer);
  const DType ct = options.cache_dtype;
  const size_t ce = DTypeSize(ct);
  pool->ParallelFor(static_cast<int64_t>(st.cpu_tokens.size()), [&](int64_t i) {
    const int64_t t = st.cpu_tokens[i];
    const StepSeq& e = st.seqs[st.tok_entry[t]];
    const Device& d = devices[e.seq->device];
    const int64_t pos = st.tok_pos[t];
    const int32_t page = e.table[pos / s.page_size];
    const int off = static_cast<int>(pos % s.page_size);
    uint8_t* row = d.cache.LatentRow(layer, page, off);
    CopyConvert(in.kv_latent.dtype, Bytes(in.kv_latent) + t * L * DTypeSize(in.kv_latent.dtype), ct,
                row, L);
    CopyConvert(in.k_rope.dtype, Bytes(in.k_rope) + t * R * DTypeSize(in.k_rope.dtype), ct,
                row + L * ce, R);
    if (slot >= 0)
      CopyConvert(in.index_k.dtype, Bytes(in.index_k) + t * Di * DTypeSize(in.index_k.dtype), ct,
                  d.cache.IndexRow(slot, page, off), Di);
  });
}

void Engine::Impl::Select(Step& st, int layer) {
  const ModelSpec& s = spec();
  const int slot = s.FullSlot(layer);
  const int Hi = s.index_n_heads, Di = s.index_head_dim;
  // Which queries need the indexer at all: those whose selection could miss a visible key.
  std::vector<int64_t> need;
  for (const int64_t t : st.cpu_tokens) {
    const int64_t n = st.tok_pos[t] + 1;
    const StepSeq& e = st.seqs[st.tok_entry[t]];
    bool all = false;
    if (s.prefill == PrefillMode::kDense && e.q_len > 1) {
      all = true;
    } else {
      all = SelectsEveryVisibleKey(s, n);
    }
    st.select_all[t] = all;
    if (all) {
      st.selected[t].clear();
    } else {
      need.push_back(t);
    }
  }
  for (size_t w0 = 0; w0 < need.size();) {
    // A wave of queries whose score rows fit the scratch bound.
    std::vector<int64_t> offset = {0};
    size_t w1 = w0;
    while (w1 < need.size()) {
      const int64_t n = st.tok_pos[need[w1]] + 1;
      if (w1 > w0 && offset.back() + n > kMaxScoreFloats) break;
      offset.push_back(offset.back() + n);
      ++w1;
    }
    if (st.scores.size() < static_cast<size_t>(offset.back())) st.scores.resize(offset.back());
    // Tasks: (query, chunk of keys).
    std::vector<std::pair<int32_t, int64_t>> tasks;
    for (size_t i = w0; i < w1; ++i)
      for (int64_t k0 = 0; k0 < st.tok_pos[need[i]] + 1; k0 += kScoreChunk)
        tasks.emplace_back(static_cast<int32_t>(i - w0), k0);
    pool->ParallelFor(static_cast<int64_t>(tasks.size()), [&](int64_t j) {
      const auto [qi, k0] = tasks[j];
      const int64_t t = need[w0 + qi];
      const int64_t n = st.tok_pos[t] + 1;
      cpu::IndexerScoreParams p;
      p.q = st.index_q.data() + t * Hi * Di;
      p.w = st.index_w.data() + t * Hi;
      p.num_heads = Hi;
      p.head_dim = Di;
      p.keys = IndexRows(st.seqs[st.tok_entry[t]], slot);
      p.begin = k0;
      p.end = std::min(n, k0 + kScoreChunk);
      p.scores = st.scores.data() + offset[qi] + k0;
      cpu::IndexerScores(*kernels, p);
    });
    pool->ParallelFor(static_cast<int64_t>(w1 - w0), [&](int64_t qi) {
      const int64_t t = need[w0 + qi];
      const int64_t n = st.tok_pos[t] + 1;
      const float* sc = st.scores.data() + offset[qi];
      std::vector<int32_t>& sel = st.selected[t];
      sel.clear();
      switch (s.selection) {
        case SelectionMode::kToken:
          sel.resize(std::min<int64_t>(n, s.index_topk));
          sel.resize(cpu::ExactTopK(sc, n, s.index_topk, sel.data()));
          break;
        case SelectionMode::kPageUnion: {
          thread_local std::vector<int32_t> topk;
          topk.resize(std::min<int64_t>(n, s.index_topk));
          topk.resize(cpu::ExactTopK(sc, n, s.index_topk, topk.data()));
          cpu::PageUnionSelect(sc, n, topk.data(), static_cast<int64_t>(topk.size()), s.page_size,
                               s.page_union_max_pages, &sel);
          break;
        }
        case SelectionMode::kPageBudget:
          cpu::PageBudgetSelect(sc, n, s.page_size, s.page_budget, &sel);
          break;
      }
    });
    w0 = w1;
  }
}

void Engine::Impl::Attend(Step& st, int layer, DType out_dtype, uint8_t* out) {
  const ModelSpec& s = spec();
  const int H = s.num_heads, L = s.kv_lora_rank, D = s.latent_dim();
  const bool dense = s.layers[layer] == LayerKind::kDense;
  const int groups = (H + kHeadGroup - 1) / kHeadGroup;
  const size_t oe = DTypeSize(out_dtype);
  // A query attends a contiguous range (dense layer, or a selection covering every visible key)
  // or an explicit selection. Consecutive range queries of one sequence form a block that shares
  // each converted key tile (prefill).
  auto range_of = [&](int64_t t) {
    const int64_t pos = st.tok_pos[t];
    return std::make_pair(FirstVisibleKey(s, s.layers[layer], pos), pos + 1);
  };
  auto is_range = [&](int64_t t) { return dense || st.select_all[t]; };
  std::vector<std::pair<int64_t, int>> units;  // (index into cpu_tokens, queries)
  const int64_t ncpu = static_cast<int64_t>(st.cpu_tokens.size());
  for (int64_t i = 0; i < ncpu;) {
    int n = 1;
    const int64_t t = st.cpu_tokens[i];
    if (is_range(t)) {
      while (n < kQueryBlock && i + n < ncpu) {
        const int64_t u = st.cpu_tokens[i + n];
        if (!is_range(u) || st.tok_entry[u] != st.tok_entry[t] ||
            st.tok_pos[u] != st.tok_pos[t] + n)
          break;
        ++n;
      }
    }
    units.emplace_back(i, n);
    i += n;
  }
  pool->ParallelFor(static_cast<int64_t>(units.size()) * groups, [&](int64_t task) {
    const auto [i0, qn] = units[task / groups];
    const int h0 = static_cast<int>(task % groups) * kHeadGroup;
    const int hn = std::min(kHeadGroup, H - h0);
    const int64_t t0 = st.cpu_tokens[i0];
    thread_local std::vector<float> q, o;
    thread_local std::vector<int64_t> lo, hi;
    q.resize(static_cast<size_t>(qn) * hn * D);
    o.resize(static_cast<size_t>(qn) * hn * L);
    lo.resize(qn);
    hi.resize(qn);
    for (int j = 0; j < qn; ++j) {
      const int64_t t = st.cpu_tokens[i0 + j];
      std::copy_n(st.q.data() + (t * H + h0) * D, static_cast<size_t>(hn) * D,
                  q.data() + static_cast<size_t>(j) * hn * D);
      std::tie(lo[j], hi[j]) = range_of(t);
    }
    cpu::MlaParams p;
    p.q = q.data();
    p.num_heads = hn;
    p.num_queries = qn;
    p.latent_dim = L;
    p.rope_dim = s.qk_rope_head_dim;
    p.kv = LatentRows(st.seqs[st.tok_entry[t0]], layer);
    p.sm_scale = static_cast<float>(s.sm_scale);
    p.out = o.data();
    if (dense) p.soft_cap = static_cast<float>(s.soft_cap);
    if (is_range(t0)) {
      p.begin = lo[0];
      p.end = hi[qn - 1];
      if (qn > 1) {
        p.row_begin = lo.data();
        p.row_end = hi.data();
      }
    } else {
      p.positions = st.selected[t0].data();
      p.num_keys = static_cast<int64_t>(st.selected[t0].size());
    }
    cpu::MlaAttend(*kernels, p);
    for (int j = 0; j < qn; ++j) {
      const int64_t t = st.cpu_tokens[i0 + j];
      ConvertFromF32(out_dtype, o.data() + static_cast<size_t>(j) * hn * L,
                     out + (t * H + h0) * L * oe, static_cast<size_t>(hn) * L);
    }
  });
}

absl::Status Engine::Impl::BeginGpuSteps(Step& st) {
#ifdef ATTND_HAVE_CUDA
  for (int d = 0; d < static_cast<int>(devices.size()); ++d) {
    if (!devices[d].is_gpu()) continue;
    cuda::StepPlan plan;
    std::vector<int32_t> entry_offset(st.seqs.size(), -1);
    for (int64_t t = 0; t < st.tokens; ++t) {
      const int e = st.tok_entry[t];
      const StepSeq& s = st.seqs[e];
      if (s.seq->device != d) continue;
      if (entry_offset[e] < 0) {
        entry_offset[e] = static_cast<int32_t>(plan.tables.size());
        plan.tables.insert(plan.tables.end(), s.table.begin(), s.table.end());
      }
      plan.rows.push_back(t);
      plan.pos.push_back(st.tok_pos[t]);
      plan.dense_prefill.push_back(spec().prefill == PrefillMode::kDense && s.q_len > 1);
      plan.table_offset.push_back(entry_offset[e]);
    }
    if (plan.rows.empty()) continue;
    RETURN_IF_ERROR(devices[d].gpu->BeginStep(st.id, plan));
    st.gpu_devices.push_back(d);
  }
#endif
  return absl::OkStatus();
}

absl::Status Engine::Impl::Compute(Step& st, int layer, const LayerInputs& in, void* out,
                                   size_t out_bytes, LayerTrace* trace) {
  RETURN_IF_ERROR(ValidateInputs(st, layer, in, out_bytes));
  if (trace) trace->keys.assign(st.tokens, {});
#ifdef ATTND_HAVE_CUDA
  // The GPUs' shares run concurrently with the CPU backend's.
  std::vector<std::future<absl::Status>> gpu_work;
  for (int d : st.gpu_devices) {
    cuda::LayerCall call;
    call.layer = layer;
    call.in = &in;
    call.out_dtype = in.q_latent.present ? in.q_latent.dtype : DType::kBF16;
    call.out = st.options.write_only ? nullptr : static_cast<uint8_t*>(out);
    call.trace = trace && !st.options.write_only ? &trace->keys : nullptr;
    cuda::CudaDevice* gpu = devices[d].gpu.get();
    const uint64_t id = st.id;
    gpu_work.push_back(
        std::async(std::launch::async, [gpu, id, call] { return gpu->RunLayer(id, call); }));
  }
  absl::Status cpu_status = ComputeCpu(st, layer, in, out, trace);
  for (auto& f : gpu_work) {
    absl::Status g = f.get();
    if (cpu_status.ok() && !g.ok()) cpu_status = g;
  }
  return cpu_status;
#else
  return ComputeCpu(st, layer, in, out, trace);
#endif
}

absl::Status Engine::Impl::ComputeCpu(Step& st, int layer, const LayerInputs& in, void* out,
                                      LayerTrace* trace) {
  if (st.cpu_tokens.empty()) return absl::OkStatus();
  if (st.options.write_only) {
    WriteKeys(st, layer, in);
    return absl::OkStatus();
  }
  const ModelSpec& s = spec();
  const int H = s.num_heads, L = s.kv_lora_rank, R = s.qk_rope_head_dim, D = L + R;
  const LayerKind kind = s.layers[layer];
  // Queries to fp32: [T, H, L+R] with q_latent | q_rope per head.
  st.q.resize(static_cast<size_t>(st.tokens) * H * D);
  const int64_t ncpu = static_cast<int64_t>(st.cpu_tokens.size());
  pool->ParallelFor(ncpu, [&](int64_t i) {
    const int64_t t = st.cpu_tokens[i];
    const size_t el = DTypeSize(in.q_latent.dtype), er = DTypeSize(in.q_rope.dtype);
    for (int h = 0; h < H; ++h) {
      float* q = st.q.data() + (t * H + h) * D;
      ConvertToF32(in.q_latent.dtype, Bytes(in.q_latent) + (t * H + h) * L * el, q, L);
      ConvertToF32(in.q_rope.dtype, Bytes(in.q_rope) + (t * H + h) * R * er, q + L, R);
    }
  });
  if (kind == LayerKind::kFull) {
    const int64_t row = int64_t{s.index_n_heads} * s.index_head_dim;
    st.index_q.resize(st.tokens * row);
    const size_t es = DTypeSize(in.index_q.dtype);
    pool->ParallelFor(ncpu, [&](int64_t i) {
      const int64_t t = st.cpu_tokens[i];
      ConvertToF32(in.index_q.dtype, Bytes(in.index_q) + t * row * es, st.index_q.data() + t * row,
                   row);
    });
    st.index_w.resize(st.tokens * s.index_n_heads);  // all rows: a cheap conversion
    ConvertToF32(in.index_w.dtype, in.index_w.data, st.index_w.data(), st.tokens * s.index_n_heads);
  }
  WriteKeys(st, layer, in);
  if (kind == LayerKind::kFull) Select(st, layer);
  Attend(st, layer, in.q_latent.dtype, static_cast<uint8_t*>(out));
  if (trace) {
    for (const int64_t t : st.cpu_tokens) {
      const int64_t pos = st.tok_pos[t];
      auto& k = trace->keys[t];
      if (kind == LayerKind::kDense || st.select_all[t]) {
        for (int64_t j = FirstVisibleKey(s, kind, pos); j <= pos; ++j)
          k.push_back(static_cast<int32_t>(j));
      } else {
        k = st.selected[t];
      }
    }
  }
  return absl::OkStatus();
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options) {
  RETURN_IF_ERROR(ValidateModelSpec(options.spec));
  if (options.num_devices < 1) return absl::InvalidArgumentError("need at least one device");
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->kernels = &cpu::GetKernels(options.isa);
  impl->pool = std::make_unique<ThreadPool>(options.threads);
  KvCacheConfig config = KvCacheConfig::ForModel(options.spec, options.cache_dtype, 0);
  config.num_pages = options.pages_per_device > 0
                         ? options.pages_per_device
                         : config.PagesForBytes(options.cache_bytes_per_device);
  std::vector<std::string> names = options.devices;
  if (names.empty())
    for (int i = 0; i < options.num_devices; ++i) names.push_back(absl::StrCat("cpu:", i));
  for (const std::string& name : names) {
    const bool gpu = name.rfind("cuda:", 0) == 0;
    int ordinal = -1;
    if ((!gpu && name.rfind("cpu:", 0) != 0) ||
        !absl::SimpleAtoi(name.substr(gpu ? 5 : 4), &ordinal) || ordinal < 0)
      return absl::InvalidArgumentError(
          absl::StrCat("device ", Quote(name), ": expected cpu:N or cuda:N"));
    ASSIGN_OR_RETURN(KvCache cache, KvCache::Create(config));
    impl->devices.emplace_back(name, PagePool(config.num_pages), std::move(cache));
    if (gpu) {
#ifdef ATTND_HAVE_CUDA
      ASSIGN_OR_RETURN(impl->devices.back().gpu,
                       cuda::CudaDevice::Create(ordinal, options.spec, config));
#else
      return absl::UnimplementedError(absl::StrCat(
          "device ", Quote(name), ": this build has no CUDA backend (nvcc not found)"));
#endif
    }
  }
#ifdef ATTND_HAVE_CUDA
  std::vector<int> ordinals;
  for (const Device& d : impl->devices) {
    impl->nccl_rank.push_back(d.is_gpu() ? static_cast<int>(ordinals.size()) : -1);
    if (d.is_gpu()) ordinals.push_back(d.gpu->ordinal());
  }
  if (ordinals.size() >= 2) {
    auto peers = cuda::NcclPeers::Create(ordinals);
    if (peers.ok()) {
      impl->nccl = std::move(peers).value();
    } else {  // cudaMemcpyPeer still works; say why NCCL is not used
      std::fprintf(stderr, "attnd: page moves between GPUs use cudaMemcpyPeer: %s\n",
                   std::string(peers.status().message()).c_str());
    }
  }
#endif
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

const ModelSpec& Engine::spec() const { return impl_->spec(); }
const EngineOptions& Engine::options() const { return impl_->options; }

absl::Status Engine::Impl::CheckNewId(const std::string& id) const {
  if (id.empty()) return absl::InvalidArgumentError("sequence id: empty");
  if (id.size() > options.limits.max_id_bytes)
    return absl::InvalidArgumentError(absl::StrCat("sequence id ", Quote(id), ": longer than ",
                                                   options.limits.max_id_bytes,
                                                   " bytes (--max-id-bytes)"));
  if (sequences.contains(id))
    return absl::AlreadyExistsError(absl::StrCat("sequence ", Quote(id), " already exists"));
  if (static_cast<int64_t>(sequences.size()) >= options.limits.max_sequences)
    return absl::ResourceExhaustedError(
        absl::StrCat("open sequences: the server holds its limit of ", options.limits.max_sequences,
                     " (--max-sequences); close some first"));
  return absl::OkStatus();
}

absl::Status Engine::OpenSequence(const std::string& id, int device) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  RETURN_IF_ERROR(impl_->CheckNewId(id));
  const int n = static_cast<int>(impl_->devices.size());
  if (device >= n)
    return absl::OutOfRangeError(absl::StrCat("device ", device, " outside [0, ", n, ")"));
  int best = device;
  if (best < 0) {
    best = 0;
    for (int i = 1; i < n; ++i)
      if (impl_->devices[i].pool.free_pages() > impl_->devices[best].pool.free_pages()) best = i;
  }
  auto seq = std::make_unique<Sequence>();
  seq->id = id;
  seq->device = best;
  ++impl_->devices[best].sequences;
  impl_->sequences.emplace(id, std::move(seq));
  return absl::OkStatus();
}

int Engine::num_devices() const { return static_cast<int>(impl_->devices.size()); }

std::vector<std::string> Engine::DefaultDevices() {
  std::vector<std::string> out;
#ifdef ATTND_HAVE_CUDA
  for (int i = 0; i < cuda::DeviceCount(); ++i) out.push_back(absl::StrCat("cuda:", i));
#endif
  if (out.empty()) out.push_back("cpu:0");
  return out;
}

bool Engine::CudaBuilt() {
#ifdef ATTND_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

// mu held. Copies the first `length` tokens of `pages` (on device `from`) into fresh pages on
// device `to`, appending them to *out; false (nothing allocated) when `to` lacks pages.
bool Engine::Impl::CopyToDevice(const std::vector<int32_t>& pages, int64_t length, int from, int to,
                                std::vector<int32_t>* out) {
  const int ps = spec().page_size;
  const int32_t n = static_cast<int32_t>((length + ps - 1) / ps);
  std::vector<int32_t> fresh;
  if (!devices[to].pool.Allocate(n, &fresh)) return false;
  for (int32_t i = 0; i < n; ++i) {
    const int rows = static_cast<int>(std::min<int64_t>(ps, length - int64_t{i} * ps));
    CopyPage(from, pages[i], to, fresh[i], rows);
  }
  out->insert(out->end(), fresh.begin(), fresh.end());
  return true;
}

void Engine::Impl::CopyPage(int from, int32_t src, int to, int32_t dst, int rows) {
  Device& a = devices[from];
  Device& b = devices[to];
  if (!a.is_gpu() && !b.is_gpu()) {
    a.cache.CopyPagePrefixTo(b.cache, src, dst, rows);
    return;
  }
#ifdef ATTND_HAVE_CUDA
  absl::Status st;
  if (a.is_gpu() && b.is_gpu() && nccl && from != to) {
    std::vector<cuda::NcclPeers::Transfer> moves;
    for (const auto& sp : a.gpu->PageCopySpans(*b.gpu, src, dst, rows))
      moves.push_back({sp.src, sp.dst, sp.bytes});
    st = nccl->Move(nccl_rank[from], nccl_rank[to], moves);
  } else if (a.is_gpu() && b.is_gpu()) {
    st = a.gpu->CopyPagePrefixTo(*b.gpu, src, dst, rows);
  } else {
    // Between host and GPU through staging laid out as [layers x rows x (L+R) | slots x rows x Di].
    const KvCache& host = a.is_gpu() ? b.cache : a.cache;
    const int32_t hp = a.is_gpu() ? dst : src;
    std::vector<uint8_t> buf;
    if (a.is_gpu()) st = a.gpu->ReadPage(src, rows, &buf);
    const size_t lat = rows * host.latent_row_bytes(), idx = rows * host.index_row_bytes();
    const auto& c = host.config();
    if (!a.is_gpu()) buf.resize(c.num_layers * lat + c.num_full_layers * idx);
    for (int l = 0; l < c.num_layers; ++l) {
      uint8_t* h = host.LatentRow(l, hp, 0);
      if (a.is_gpu())
        std::memcpy(h, buf.data() + l * lat, lat);
      else
        std::memcpy(buf.data() + l * lat, h, lat);
    }
    for (int k = 0; k < c.num_full_layers; ++k) {
      uint8_t* h = host.IndexRow(k, hp, 0);
      uint8_t* staged = buf.data() + c.num_layers * lat + k * idx;
      if (a.is_gpu())
        std::memcpy(h, staged, idx);
      else
        std::memcpy(staged, h, idx);
    }
    if (!a.is_gpu()) st = b.gpu->WritePage(dst, rows, buf);
  }
  if (!st.ok()) {
    std::fprintf(stderr, "attnd: page copy %s -> %s failed: %s\n", a.name.c_str(), b.name.c_str(),
                 std::string(st.message()).c_str());
    std::abort();  // a device that cannot copy memory is broken; never serve wrong keys
  }
#endif
}

absl::Status Engine::ForkSequence(const std::string& id, const std::string& parent,
                                  int64_t prefix_len, int device) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto pit = impl_->sequences.find(parent);
  if (pit == impl_->sequences.end())
    return absl::NotFoundError(absl::StrCat("fork parent ", Quote(parent), " not found"));
  RETURN_IF_ERROR(impl_->CheckNewId(id));
  const Sequence& par = *pit->second;
  if (prefix_len < 0 || prefix_len > par.length)
    return absl::OutOfRangeError(absl::StrCat("fork prefix_len ", prefix_len, " outside [0, ",
                                              par.length, "] (parent ", Quote(parent), " length)"));
  const int n = static_cast<int>(impl_->devices.size());
  if (device >= n)
    return absl::OutOfRangeError(absl::StrCat("device ", device, " outside [0, ", n, ")"));
  const int target = device < 0 ? par.device : device;
  auto seq = std::make_unique<Sequence>();
  seq->id = id;
  seq->device = target;
  seq->length = prefix_len;
  Device& dev = impl_->devices[target];
  if (target != par.device) {
    if (!impl_->CopyToDevice(par.pages, prefix_len, par.device, target, &seq->pages))
      return absl::ResourceExhaustedError(
          absl::StrCat("KV cache full on ", dev.name, ": a fork across devices copies every page"));
  } else {
    const int ps = impl_->spec().page_size;
    const int64_t full = prefix_len / ps;
    const int rem = static_cast<int>(prefix_len % ps);
    seq->pages.assign(par.pages.begin(), par.pages.begin() + full);
    if (rem > 0) {
      if (!dev.pool.Allocate(1, &seq->pages))
        return absl::ResourceExhaustedError(
            absl::StrCat("KV cache full on ", dev.name,
                         ": fork needs 1 page for the partial last page, 0 free"));
      impl_->CopyPage(target, par.pages[full], target, seq->pages.back(), rem);
    }
    for (int64_t i = 0; i < full; ++i) dev.pool.Ref(seq->pages[i]);
  }
  ++dev.sequences;
  impl_->sequences.emplace(id, std::move(seq));
  return absl::OkStatus();
}

absl::StatusOr<Engine::LayerRows> Engine::ReadRows(const std::string& id, int layer, int64_t begin,
                                                   int64_t end) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->sequences.find(id);
  if (it == impl_->sequences.end())
    return absl::NotFoundError(absl::StrCat("sequence ", Quote(id), " not found"));
  const Sequence& seq = *it->second;
  const ModelSpec& s = impl_->spec();
  if (layer < 0 || layer >= s.num_layers())
    return absl::OutOfRangeError(
        absl::StrCat("layer ", layer, " outside [0, ", s.num_layers(), ")"));
  if (begin < 0 || end < begin || end > seq.length)
    return absl::OutOfRangeError(absl::StrCat("rows [", begin, ", ", end, ") outside the ",
                                              seq.length, " committed tokens of ", Quote(id)));
  const Device& dev = impl_->devices[seq.device];
  const int slot = s.FullSlot(layer);
  const size_t es = DTypeSize(impl_->options.cache_dtype);
  const size_t L = s.kv_lora_rank * es, R = s.qk_rope_head_dim * es, Di = s.index_head_dim * es;
  LayerRows out;
  out.kv_latent.reserve((end - begin) * L);
  out.k_rope.reserve((end - begin) * R);
  const int ps = s.page_size;
  std::vector<uint8_t> staged;  // a GPU page, all layers and slots (see CudaDevice::ReadPage)
  for (int64_t pos = begin; pos < end;) {
    const int32_t page = seq.pages[pos / ps];
    const int off = static_cast<int>(pos % ps);
    const int rows = static_cast<int>(std::min<int64_t>(ps - off, end - pos));
    const uint8_t* lat = nullptr;
    const uint8_t* idx = nullptr;
    size_t lat_stride = L + R, idx_stride = Di;
    if (!dev.is_gpu()) {
      lat = dev.cache.LatentRow(layer, page, off);
      if (slot >= 0) idx = dev.cache.IndexRow(slot, page, off);
    } else {
#ifdef ATTND_HAVE_CUDA
      const int full_rows = off + rows;
      RETURN_IF_ERROR(dev.gpu->ReadPage(page, full_rows, &staged));
      lat = staged.data() + layer * full_rows * (L + R) + off * (L + R);
      if (slot >= 0)
        idx =
            staged.data() + s.num_layers() * full_rows * (L + R) + slot * full_rows * Di + off * Di;
#endif
    }
    for (int r = 0; r < rows; ++r) {
      out.kv_latent.append(reinterpret_cast<const char*>(lat + r * lat_stride), L);
      out.k_rope.append(reinterpret_cast<const char*>(lat + r * lat_stride + L), R);
      if (idx) out.index_k.append(reinterpret_cast<const char*>(idx + r * idx_stride), Di);
    }
    pos += rows;
  }
  return out;
}

absl::Status Engine::MigrateSequence(const std::string& id, int device) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->sequences.find(id);
  if (it == impl_->sequences.end())
    return absl::NotFoundError(absl::StrCat("sequence ", Quote(id), " not found"));
  Sequence& seq = *it->second;
  const int n = static_cast<int>(impl_->devices.size());
  if (device < 0 || device >= n)
    return absl::OutOfRangeError(absl::StrCat("device ", device, " outside [0, ", n, ")"));
  if (seq.step != 0)
    return absl::FailedPreconditionError(absl::StrCat("sequence ", Quote(id), " is in open step ",
                                                      seq.step, "; migrate between steps"));
  if (device == seq.device) return absl::OkStatus();
  std::vector<int32_t> moved;
  if (!impl_->CopyToDevice(seq.pages, seq.length, seq.device, device, &moved))
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache full on ", impl_->devices[device].name, ": migration needs ",
                     seq.pages.size(), " pages"));
  Device& from = impl_->devices[seq.device];
  for (int32_t p : seq.pages) from.pool.Unref(p);
  --from.sequences;
  ++impl_->devices[device].sequences;
  seq.pages = std::move(moved);
  seq.device = device;
  return absl::OkStatus();
}

absl::Status Engine::CloseSequence(const std::string& id) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->sequences.find(id);
  if (it == impl_->sequences.end())
    return absl::NotFoundError(absl::StrCat("sequence ", Quote(id), " not found"));
  Sequence& seq = *it->second;
  if (seq.step != 0)
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", Quote(id), " is in open step ", seq.step, "; abort it first"));
  Device& dev = impl_->devices[seq.device];
  for (int32_t p : seq.pages) dev.pool.Unref(p);
  --dev.sequences;
  impl_->sequences.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<SequenceInfo> Engine::DescribeSequence(const std::string& id) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->sequences.find(id);
  if (it == impl_->sequences.end())
    return absl::NotFoundError(absl::StrCat("sequence ", Quote(id), " not found"));
  const Sequence& s = *it->second;
  return SequenceInfo{s.id, s.length, s.device, s.pages, s.step != 0};
}

std::vector<DeviceCapacity> Engine::Capacity() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<DeviceCapacity> out;
  for (const Device& d : impl_->devices)
    out.push_back({d.name, d.pool.usable_pages(), d.pool.free_pages(),
                   d.cache.config().BytesPerPage(), d.sequences});
  return out;
}

int64_t Engine::num_sequences() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return static_cast<int64_t>(impl_->sequences.size());
}

int64_t Engine::num_open_steps() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return static_cast<int64_t>(impl_->steps.size());
}

int64_t Engine::steps_aborted() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->steps_aborted;
}

absl::StatusOr<uint64_t> Engine::BeginStep(const std::vector<StepEntry>& batch,
                                           const StepOptions& options) {
  const EngineLimits& lim = impl_->options.limits;
  if (batch.empty()) return absl::InvalidArgumentError("step batch: empty");
  if (static_cast<int64_t>(batch.size()) > lim.max_batch_entries)
    return absl::InvalidArgumentError(absl::StrCat("step batch: ", batch.size(),
                                                   " entries, at most ", lim.max_batch_entries,
                                                   " (--max-batch-entries)"));
  std::unique_lock<std::mutex> lock(impl_->mu);
  const auto deadline = Clock::now() + lim.abort_wait;
  for (;;) {
    uint64_t wait_for = 0;
    auto r = impl_->TryBegin(batch, options, &wait_for);
    if (wait_for == 0) return r;
    // A sequence is held by a step that is running a layer (and may be aborting): wait until
    // that step ends or its layer does (a client that cancelled a step may retry at once), then
    // validate again from scratch.
    if (!impl_->step_ended.wait_until(lock, deadline, [&] {
          auto it = impl_->steps.find(wait_for);
          return it == impl_->steps.end() || (!it->second->busy && !it->second->abort_requested);
        }))
      return r;
  }
}

absl::StatusOr<uint64_t> Engine::Impl::TryBegin(const std::vector<StepEntry>& batch,
                                                const StepOptions& options, uint64_t* wait_for) {
  const ModelSpec& spec = this->spec();
  const EngineLimits& lim = this->options.limits;
  auto step = std::make_unique<Step>();
  step->options = options;
  std::vector<int32_t> need(devices.size(), 0);
  absl::flat_hash_set<const Sequence*> seen;
  seen.reserve(batch.size());
  step->seqs.reserve(batch.size());
  int64_t tokens = 0;
  // Every check before any state changes; every sum is bounded before it is formed.
  for (size_t i = 0; i < batch.size(); ++i) {
    const StepEntry& e = batch[i];
    auto it = sequences.find(e.sequence_id);
    if (it == sequences.end())
      return absl::NotFoundError(
          absl::StrCat("step batch[", i, "]: sequence ", Quote(e.sequence_id), " not found"));
    Sequence* seq = it->second.get();
    if (e.q_len < 1)
      return absl::InvalidArgumentError(absl::StrCat("step batch[", i, "] (", Quote(seq->id),
                                                     "): q_len ", e.q_len, " must be >= 1"));
    // seq->length <= max_context always, so the subtraction cannot overflow.
    if (e.q_len > spec.max_context - seq->length)
      return absl::OutOfRangeError(absl::StrCat("sequence ", Quote(seq->id), ": length ",
                                                seq->length, " + q_len ", e.q_len,
                                                " exceeds max_context ", spec.max_context));
    if (e.q_len > lim.max_step_tokens - tokens)
      return absl::InvalidArgumentError(
          absl::StrCat("step batch[", i, "]: the step's tokens would exceed ", lim.max_step_tokens,
                       " (--max-step-tokens); split it into several steps"));
    if (!seen.insert(seq).second)
      return absl::InvalidArgumentError(
          absl::StrCat("step batch: sequence ", Quote(seq->id), " appears twice"));
    if (seq->step != 0) {
      auto other = steps.find(seq->step);
      // A step running a layer may be about to abort (its client cancelled, and the cancel
      // reaches the engine only when the layer ends): wait for that layer, then look again.
      if (other != steps.end() && (other->second->abort_requested || other->second->busy))
        *wait_for = seq->step;
      return absl::FailedPreconditionError(
          absl::StrCat("sequence ", Quote(seq->id), " is already in open step ", seq->step));
    }
    tokens += e.q_len;
    StepSeq s;
    s.seq = seq;
    s.q_len = e.q_len;
    s.new_len = seq->length + e.q_len;
    need[seq->device] += static_cast<int32_t>((s.new_len + spec.page_size - 1) / spec.page_size -
                                              static_cast<int64_t>(seq->pages.size()));
    step->seqs.push_back(std::move(s));
  }
  for (size_t d = 0; d < devices.size(); ++d) {
    const PagePool& pool = devices[d].pool;
    if (need[d] > pool.free_pages())
      return absl::ResourceExhaustedError(
          absl::StrCat("KV cache full on ", devices[d].name, ": step needs ", need[d],
                       " new pages, ", pool.free_pages(), " of ", pool.usable_pages(), " free"));
  }
  // The plan's memory before any state changes (an allocation failure changes nothing).
  step->tokens = tokens;
  step->tok_entry.reserve(tokens);
  step->tok_pos.reserve(tokens);
  for (size_t i = 0; i < step->seqs.size(); ++i) {
    StepSeq& s = step->seqs[i];
    const int64_t pages = (s.new_len + spec.page_size - 1) / spec.page_size;
    s.new_pages.reserve(pages - static_cast<int64_t>(s.seq->pages.size()));
    s.table.reserve(pages);
    for (int64_t j = 0; j < s.q_len; ++j) {
      step->tok_entry.push_back(static_cast<int32_t>(i));
      step->tok_pos.push_back(s.seq->length + j);
    }
  }
  for (int64_t t = 0; t < step->tokens; ++t)
    if (!devices[step->seqs[step->tok_entry[t]].seq->device].is_gpu())
      step->cpu_tokens.push_back(t);
  step->selected.resize(step->tokens);
  step->select_all.assign(step->tokens, 1);
  // Everything checked and allocated: reserve pages (cannot fail now) and bind the sequences.
  step->id = next_step_id++;
  for (StepSeq& s : step->seqs) {
    const int64_t pages = (s.new_len + spec.page_size - 1) / spec.page_size;
    devices[s.seq->device].pool.Allocate(
        static_cast<int32_t>(pages - static_cast<int64_t>(s.seq->pages.size())), &s.new_pages);
    s.table = s.seq->pages;
    s.table.insert(s.table.end(), s.new_pages.begin(), s.new_pages.end());
    s.seq->step = step->id;
  }
  if (absl::Status g = BeginGpuSteps(*step); !g.ok()) {
    AbortLocked(step.get(), g);  // not registered yet: releases pages, frees sequences
    return g;
  }
  step->last_used = Clock::now();
  const uint64_t id = step->id;
  steps.emplace(id, std::move(step));
  return id;
}

absl::StatusOr<Engine::StepInfo> Engine::DescribeStep(uint64_t step) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  ASSIGN_OR_RETURN(const Step* st, impl_->FindStep(step));
  return StepInfo{st->tokens, st->options.write_only, st->next_layer};
}

absl::Status Engine::CheckLayer(uint64_t step, int layer, const LayerInputs& in,
                                size_t out_bytes) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  ASSIGN_OR_RETURN(const Step* st, impl_->FindStep(step));
  if (layer != st->next_layer)
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step, ": layer ", layer, " out of order, expected layer ", st->next_layer));
  return impl_->ValidateShapes(*st, layer, in, out_bytes);
}

absl::Status Engine::RunLayer(uint64_t step_id, int layer, const LayerInputs& in, void* out,
                              size_t out_bytes, LayerTrace* trace) {
  Step* st = nullptr;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    ASSIGN_OR_RETURN(st, impl_->FindStep(step_id));
    if (st->busy) {
      st->abort_requested = true;  // every error aborts the step: the running layer does it
      return absl::FailedPreconditionError(
          absl::StrCat("step ", step_id, ": a layer is already running; step aborted"));
    }
    if (layer != st->next_layer) {
      const absl::Status why = absl::FailedPreconditionError(
          absl::StrCat("step ", step_id, ": layer ", layer, " out of order, expected layer ",
                       st->next_layer, "; step aborted"));
      impl_->AbortLocked(st, absl::CancelledError(
                                 absl::StrCat("step ", step_id, " was aborted: ", why.message())));
      return why;
    }
    st->busy = true;
  }
  absl::Status status;
  try {
    status = impl_->Compute(*st, layer, in, out, out_bytes, trace);
  } catch (const std::bad_alloc&) {
    status = absl::ResourceExhaustedError(
        absl::StrCat("step ", step_id, " layer ", layer, ": out of host memory; step aborted"));
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrCat("step ", step_id, " layer ", layer, ": ", e.what()));
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  st->busy = false;
  st->last_used = Clock::now();
  if (!status.ok() || st->abort_requested) {
    const absl::Status fate =
        status.ok() ? absl::CancelledError(absl::StrCat("step ", step_id, " was aborted"))
                    : absl::CancelledError(absl::StrCat(
                          "step ", step_id, " was aborted after an error: ", status.message()));
    impl_->AbortLocked(st, fate);
    return status.ok() ? fate : status;
  }
  if (++st->next_layer == impl_->spec().num_layers()) {
    impl_->CommitLocked(st);
  } else {
    impl_->step_ended.notify_all();  // BeginStep may wait for this layer (see TryBegin)
  }
  return absl::OkStatus();
}

absl::Status Engine::AbortStep(uint64_t step_id) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->steps.find(step_id);
  if (it == impl_->steps.end())
    return absl::NotFoundError(absl::StrCat("step ", step_id, " not found"));
  if (it->second->busy) {
    it->second->abort_requested = true;  // the running layer aborts it when done
  } else {
    impl_->AbortLocked(it->second.get(),
                       absl::CancelledError(absl::StrCat("step ", step_id, " was aborted")));
  }
  return absl::OkStatus();
}

int64_t Engine::steps_committed() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->steps_committed;
}

std::vector<int32_t> Engine::PageRefcounts(int device) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const PagePool& pool = impl_->devices.at(device).pool;
  std::vector<int32_t> out(pool.num_pages());
  for (int32_t p = 0; p < pool.num_pages(); ++p) out[p] = pool.refcount(p);
  return out;
}

bool Engine::ReservedPageUntouched(int device) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
#ifdef ATTND_HAVE_CUDA
  if (impl_->devices.at(device).is_gpu())
    return impl_->devices[device].gpu->ReservedPageUntouched();
#endif
  const KvCache& c = impl_->devices.at(device).cache;
  const auto zero = [](const uint8_t* p, size_t n) {
    for (size_t i = 0; i < n; ++i)
      if (p[i] != 0) return false;
    return true;
  };
  const int ps = c.config().page_size;
  for (int l = 0; l < c.config().num_layers; ++l)
    if (!zero(c.LatentRow(l, 0, 0), ps * c.latent_row_bytes())) return false;
  for (int s = 0; s < c.config().num_full_layers; ++s)
    if (!zero(c.IndexRow(s, 0, 0), ps * c.index_row_bytes())) return false;
  return true;
}

int Engine::ExpireIdleSteps(std::chrono::steady_clock::duration idle) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const auto now = Clock::now();
  std::vector<Step*> expired;
  for (auto& [id, st] : impl_->steps)
    if (!st->busy && now - st->last_used > idle) expired.push_back(st.get());
  const int64_t ms = std::chrono::duration_cast<std::chrono::milliseconds>(idle).count();
  for (Step* st : expired)
    impl_->AbortLocked(
        st, absl::DeadlineExceededError(absl::StrCat("step ", st->id, " expired: idle longer than ",
                                                     ms, " ms; its sequences are as before it")));
  return static_cast<int>(expired.size());
}

}  // namespace attnd
