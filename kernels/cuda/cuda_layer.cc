// One RunLayer call on a GPU (CudaDevice::Call, the LayerRun of Device::RunLayer): the call's
// rows uploaded and converted, key writes, the indexer and the selection, and MLA.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <mutex>

#include "absl/status/status.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/cuda_device_state.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/mla_split.h"
#include "kernels/fp8_rows.h"

namespace attnd::cuda {

// One RunLayer call on this GPU (Device::RunLayer's steps): its share, step and call, passed to
// every helper through this object, and the GPU's layer lock, held for the call's lifetime (the
// State's per-layer scratch is shared by every step).
struct CudaDevice::Call final : LayerRun {
  Call(State& state, const StepShare& share, Step& step, const LayerCall& call)
      : s(state), lock(state.mu), share(share), st(step), call(call) {}

  absl::Status WriteKeys() override;
  absl::Status Score(const ScoreSink& sink) override;
  absl::Status Select() override;
  absl::Status Keep(const std::vector<std::vector<int32_t>>& selection) override;
  absl::Status Attend() override;
  absl::Status Finish() override {
    CUDA_RETURN(cudaStreamSynchronize(s.stream));
    return absl::OkStatus();
  }

  QueryTables Tables() const { return st.Tables(); }
  bool IndexQueriesBf16() const { return call.in->index_q.dtype == DType::kBF16; }
  // out[t, h] = in[t, h] · w[h] ([k, cols] per head) for the share's tokens (absorption).
  cudaError_t Project(const DeviceBuffer& in, const DeviceBuffer& w, DeviceBuffer& out, int heads,
                      int k, int cols) {
    HeadProjectParams p;
    p.in = in.as<float>();
    p.w = w.as<float>();
    p.out = out.as<float>();
    p.n = static_cast<int>(st.n);
    p.heads = heads;
    p.k = k;
    p.cols = cols;
    return LaunchHeadProject(p, s.stream);
  }

  // Gathers the share's rows of `t` into pinned staging, uploads them and converts to fp32.
  absl::Status Rows(const TensorView& t, int64_t row_elems, DeviceBuffer& f32) {
    if (t.dtype == DType::kFP8E4M3) return Fp8QueryRows(t, row_elems, f32);
    const size_t es = DTypeSize(t.dtype), row = row_elems * es;
    RETURN_IF_ERROR(s.staging.Reserve(std::max<size_t>(1, st.n * row)));
    for (int64_t i = 0; i < st.n; ++i)
      std::memcpy(s.staging.data() + i * row,
                  static_cast<const uint8_t*>(t.data) + share.rows[i] * row, row);
    RETURN_IF_ERROR(s.raw.Reserve(std::max<size_t>(1, st.n * row)));
    RETURN_IF_ERROR(f32.Reserve(std::max<size_t>(4, st.n * row_elems * 4)));
    CUDA_RETURN(
        cudaMemcpyAsync(s.raw.ptr, s.staging.ptr, st.n * row, cudaMemcpyHostToDevice, s.stream));
    CUDA_RETURN(LaunchToF32(s.raw.ptr, t.dtype, f32.as<float>(), st.n * row_elems, s.stream));
    CUDA_RETURN(cudaStreamSynchronize(s.stream));  // staging is reused by the next tensor
    return absl::OkStatus();
  }

  // FP8_E4M3 queries (one scale per token and head): dequantised on the host by the function the
  // CPU backend uses, then uploaded as fp32.
  absl::Status Fp8QueryRows(const TensorView& t, int64_t row_elems, DeviceBuffer& f32) {
    const int64_t elems = t.dims[t.rank - 1], heads = row_elems / elems;
    const size_t row = row_elems * 4;
    RETURN_IF_ERROR(s.staging.Reserve(std::max<size_t>(1, st.n * row)));
    for (int64_t i = 0; i < st.n; ++i)
      for (int64_t h = 0; h < heads; ++h)
        QueryRowToF32(t, share.rows[i] * heads + h, elems,
                      reinterpret_cast<float*>(s.staging.data() + i * row) + h * elems);
    RETURN_IF_ERROR(f32.Reserve(std::max<size_t>(4, st.n * row)));
    CUDA_RETURN(
        cudaMemcpyAsync(f32.ptr, s.staging.ptr, st.n * row, cudaMemcpyHostToDevice, s.stream));
    CUDA_RETURN(cudaStreamSynchronize(s.stream));  // staging is reused by the next tensor
    return absl::OkStatus();
  }

  // fp8 caches: each share row packed by pack(step row, out) into pinned staging, uploaded, and
  // scattered to its slot.
  template <typename Pack>
  absl::Status WritePacked(const CacheRows& c, size_t row_bytes, Pack pack) {
    RETURN_IF_ERROR(s.staging.Reserve(std::max<size_t>(1, st.n * row_bytes)));
    for (int64_t i = 0; i < st.n; ++i) pack(share.rows[i], s.staging.data() + i * row_bytes);
    RETURN_IF_ERROR(s.raw.Reserve(std::max<size_t>(1, st.n * row_bytes)));
    CUDA_RETURN(cudaMemcpyAsync(s.raw.ptr, s.staging.ptr, st.n * row_bytes, cudaMemcpyHostToDevice,
                                s.stream));
    ScatterRowsParams w;
    w.src = static_cast<const uint8_t*>(s.raw.ptr);
    w.n = static_cast<int>(st.n);
    w.src_row_bytes = row_bytes;
    w.cache = c;
    w.slot = st.slot.as<int32_t>();
    CUDA_RETURN(LaunchScatterRows(w, s.stream));
    CUDA_RETURN(cudaStreamSynchronize(s.stream));  // staging and raw are reused next
    return absl::OkStatus();
  }

  absl::Status Write(const CacheRows& c, const DeviceBuffer& src, int dim, int col) {
    WriteRowsParams w;
    w.src = src.as<float>();
    w.n = static_cast<int>(st.n);
    w.dim = dim;
    w.cache = c;
    w.col_offset = col;
    w.slot = st.slot.as<int32_t>();
    CUDA_RETURN(LaunchWriteRows(w, s.stream));
    return absl::OkStatus();
  }

  // The indexer's queries and head weights of the share's tokens to fp32.
  absl::Status IndexQueries();
  // The indexer's scores of one wave into s.scores.
  absl::Status ScoreWave(int slot, const Step::Wave& wave);
  // Scores, then top-k or page selection, for one wave: its rows of st.sel and st.sel_count.
  absl::Status SelectWave(int slot, const Step::Wave& wave);
  // The selected positions to slot ids.
  absl::Status ToSlots();

  State& s;
  std::lock_guard<std::mutex> lock;
  const StepShare& share;
  Step& st;
  const LayerCall& call;
};

absl::StatusOr<std::unique_ptr<LayerRun>> CudaDevice::StartLayer(const StepShare& share,
                                                                 DeviceStep& step,
                                                                 const LayerCall& call) {
  auto run = std::make_unique<Call>(*s_, share, static_cast<Step&>(step), call);  // locks s_->mu
  CUDA_RETURN(cudaSetDevice(ordinal_));
  return std::unique_ptr<LayerRun>(std::move(run));
}

absl::Status CudaDevice::Call::IndexQueries() {
  const int64_t Hi = s.spec.index_n_heads, Di = s.spec.index_head_dim;
  RETURN_IF_ERROR(Rows(call.in->index_q, Hi * Di, s.idx_q));
  return Rows(call.in->index_w, Hi, s.idx_w);
}

absl::Status CudaDevice::Call::Select() {
  RETURN_IF_ERROR(IndexQueries());
  const int slot = s.spec.FullSlot(call.layer);
  for (const auto& w : st.waves) RETURN_IF_ERROR(SelectWave(slot, *w));
  RETURN_IF_ERROR(ToSlots());
  st.selected = true;
  return absl::OkStatus();
}

absl::Status CudaDevice::Call::ScoreWave(int slot, const Step::Wave& wave) {
  RETURN_IF_ERROR(s.scores.Reserve(wave.total * 4));
  IndexerParams ip;
  ip.q = s.idx_q.as<float>();
  ip.w = s.idx_w.as<float>();
  ip.heads = s.spec.index_n_heads;
  ip.dim = s.spec.index_head_dim;
  ip.keys = s.Index(slot);
  ip.tables = Tables();
  ip.queries = wave.rows.as<int32_t>();
  ip.score_offset = wave.offset.as<int64_t>();
  ip.nq = wave.nq;
  ip.max_keys = wave.max_len;
  ip.scores = s.scores.as<float>();
  ip.tensor_cores = TensorCoreIndexer() && IndexQueriesBf16();
  CUDA_RETURN(LaunchIndexerScores(ip, s.stream));
  return absl::OkStatus();
}

// Context parallelism: each query's scores read back for the sink (the rule every backend shares).
absl::Status CudaDevice::Call::Score(const ScoreSink& sink) {
  RETURN_IF_ERROR(IndexQueries());
  const int slot = s.spec.FullSlot(call.layer);
  std::vector<float> host;
  for (const auto& w : st.waves) {
    RETURN_IF_ERROR(ScoreWave(slot, *w));
    host.resize(w->total);
    CUDA_RETURN(
        cudaMemcpyAsync(host.data(), s.scores.ptr, w->total * 4, cudaMemcpyDeviceToHost, s.stream));
    CUDA_RETURN(cudaStreamSynchronize(s.stream));
    for (int q = 0; q < w->nq; ++q)
      sink(w->host_rows[q], host.data() + w->host_offset[q], w->host_len[q]);
  }
  return absl::OkStatus();
}

absl::Status CudaDevice::Call::Keep(const std::vector<std::vector<int32_t>>& selection) {
  std::vector<int32_t> pos(st.n * st.sel_cap, 0), count(st.n, 0);
  for (int64_t i = 0; i < st.n; ++i) {
    if (static_cast<int64_t>(selection[i].size()) > st.sel_cap)
      return absl::InternalError("a selection longer than the step's selection buffer");
    std::copy(selection[i].begin(), selection[i].end(), pos.begin() + i * st.sel_cap);
    count[i] = static_cast<int32_t>(selection[i].size());
  }
  RETURN_IF_ERROR(Upload(st.sel, pos, s.stream));
  RETURN_IF_ERROR(Upload(st.sel_count, count, s.stream));
  RETURN_IF_ERROR(ToSlots());
  st.selected = true;
  return absl::OkStatus();
}

// Indexer scores, then top-k or page selection, for one wave of queries.
absl::Status CudaDevice::Call::SelectWave(int slot, const Step::Wave& wave) {
  const int nq = wave.nq;
  RETURN_IF_ERROR(ScoreWave(slot, wave));

  TopKParams tk;
  tk.scores = s.scores.as<float>();
  tk.row_offset = wave.offset.as<int64_t>();
  tk.row_len = wave.len.as<int64_t>();
  tk.nq = nq;
  if (s.spec.selection == SelectionMode::kToken) {
    tk.k = s.spec.index_topk;
    tk.out = st.sel.as<int32_t>();
    tk.out_stride = st.sel_cap;
    tk.out_count = st.sel_count.as<int32_t>();
    tk.out_row = wave.rows.as<int32_t>();
    CUDA_RETURN(LaunchTopK(tk, s.stream));
    return absl::OkStatus();
  }
  // Page modes: per-query page keys, the best pages, then their positions.
  RETURN_IF_ERROR(s.page_keys.Reserve(wave.pages_total * 4));
  CUDA_RETURN(cudaMemsetAsync(s.page_keys.ptr, 0, wave.pages_total * 4, s.stream));
  int64_t keep = s.spec.page_budget;
  if (s.spec.selection == SelectionMode::kPageUnion) {
    keep = s.spec.page_union_max_pages;
    const int64_t k = s.spec.index_topk;
    RETURN_IF_ERROR(s.tmp_sel.Reserve(nq * k * 4));
    RETURN_IF_ERROR(s.tmp_count.Reserve(nq * 4));
    tk.k = k;
    tk.out = s.tmp_sel.as<int32_t>();
    tk.out_stride = k;
    tk.out_count = s.tmp_count.as<int32_t>();
    CUDA_RETURN(LaunchTopK(tk, s.stream));
    PageHitParams ph;
    ph.scores = s.scores.as<float>();
    ph.row_offset = wave.offset.as<int64_t>();
    ph.selected = s.tmp_sel.as<int32_t>();
    ph.selected_count = s.tmp_count.as<int32_t>();
    ph.sel_stride = k;
    ph.page_offset = wave.page_offset.as<int64_t>();
    ph.nq = nq;
    ph.page_size = s.spec.page_size;
    ph.max_sel = k;
    ph.page_keys = s.page_keys.as<uint32_t>();
    CUDA_RETURN(LaunchPageHits(ph, s.stream));
  } else {
    PageMaxParams pm;
    pm.scores = s.scores.as<float>();
    pm.row_offset = wave.offset.as<int64_t>();
    pm.row_len = wave.len.as<int64_t>();
    pm.page_offset = wave.page_offset.as<int64_t>();
    pm.nq = nq;
    pm.page_size = s.spec.page_size;
    pm.max_pages = wave.max_pages;
    pm.page_keys = s.page_keys.as<uint32_t>();
    CUDA_RETURN(LaunchPageMax(pm, s.stream));
  }
  RETURN_IF_ERROR(s.page_list.Reserve(nq * keep * 4));
  RETURN_IF_ERROR(s.page_count.Reserve(nq * 4));
  TopKParams pk;
  pk.keys = s.page_keys.as<uint32_t>();
  pk.row_offset = wave.page_offset.as<int64_t>();
  pk.row_len = wave.pages.as<int64_t>();
  pk.nq = nq;
  pk.k = keep;
  pk.drop_zero = true;
  pk.out = s.page_list.as<int32_t>();
  pk.out_stride = keep;
  pk.out_count = s.page_count.as<int32_t>();
  CUDA_RETURN(LaunchTopK(pk, s.stream));
  ExpandParams ex;
  ex.pages = s.page_list.as<int32_t>();
  ex.page_count = s.page_count.as<int32_t>();
  ex.page_stride = keep;
  ex.row_len = wave.len.as<int64_t>();
  ex.nq = nq;
  ex.page_size = s.spec.page_size;
  ex.out = st.sel.as<int32_t>();
  ex.out_stride = st.sel_cap;
  ex.out_count = st.sel_count.as<int32_t>();
  ex.out_row = wave.rows.as<int32_t>();
  CUDA_RETURN(LaunchExpandPages(ex, s.stream));
  return absl::OkStatus();
}

// The selected positions to slot ids, once per full layer: attention reads slots directly.
absl::Status CudaDevice::Call::ToSlots() {
  SlotsParams sp;
  sp.positions = st.sel.as<int32_t>();
  sp.count = st.sel_count.as<int32_t>();
  sp.stride = st.sel_cap;
  sp.n = static_cast<int>(st.n);
  sp.tables = Tables();
  sp.slots = st.sel_slots.as<int32_t>();
  CUDA_RETURN(LaunchPositionsToSlots(sp, s.stream));
  return absl::OkStatus();
}

// Keys into the caches: an fp8 cache's rows are quantised on the host, as on CPU devices.
absl::Status CudaDevice::Call::WriteKeys() {
  const ModelSpec& sp = s.spec;
  const int L = sp.kv_lora_rank, R = sp.qk_rope_head_dim, Di = sp.index_head_dim;
  const bool full = sp.layers[call.layer] == LayerKind::kFull;
  const LayerInputs& in = *call.in;
  if (s.layout.fp8()) {
    RETURN_IF_ERROR(WritePacked(
        s.Latent(call.layer), s.layout.latent_row_bytes(),
        [&](int64_t t, uint8_t* row) { PackLatentRow(in.kv_latent, in.k_rope, t, L, R, row); }));
    if (full)
      RETURN_IF_ERROR(WritePacked(
          s.Index(sp.FullSlot(call.layer)), size_t(Di) + 4,
          [&](int64_t t, uint8_t* row) { QuantizeKeyRow(in.index_k, t, Di, Di, row, row + Di); }));
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(Rows(in.kv_latent, L, s.kv_lat));
  RETURN_IF_ERROR(Write(s.Latent(call.layer), s.kv_lat, L, 0));
  RETURN_IF_ERROR(Rows(in.k_rope, R, s.k_rope));
  RETURN_IF_ERROR(Write(s.Latent(call.layer), s.k_rope, R, L));
  if (full) {
    RETURN_IF_ERROR(Rows(in.index_k, Di, s.idx_k));
    RETURN_IF_ERROR(Write(s.Index(sp.FullSlot(call.layer)), s.idx_k, Di, 0));
  }
  return absl::OkStatus();
}

// MLA over the kept selection (sparse layers) or the key ranges (absorbed calls first form
// q_latent = q_nope · W_UK per head), then the output rows back in the request's dtype (absorbed:
// the values, out_latent · W_UV^T).
absl::Status CudaDevice::Call::Attend() {
  const ModelSpec& sp = s.spec;
  const int H = sp.num_heads, L = sp.kv_lora_rank, R = sp.qk_rope_head_dim;
  const LayerKind kind = sp.layers[call.layer];
  const LayerInputs& in = *call.in;
  const Absorption* absorb = call.absorb;
  if (absorb != nullptr) {
    if (s.absorb_uk.size() != static_cast<size_t>(sp.num_layers()))
      return absl::InternalError("absorbed call on a GPU without its absorption weights");
    const int Dn = absorb->qk_nope_head_dim();
    RETURN_IF_ERROR(Rows(in.q_nope, int64_t{H} * Dn, s.q_nope));
    RETURN_IF_ERROR(s.q_lat.Reserve(std::max<size_t>(4, st.n * H * L * 4)));
    CUDA_RETURN(Project(s.q_nope, s.absorb_uk[call.layer], s.q_lat, H, Dn, L));
  } else {
    RETURN_IF_ERROR(Rows(in.q_latent, int64_t{H} * L, s.q_lat));
  }
  RETURN_IF_ERROR(Rows(in.q_rope, int64_t{H} * R, s.q_rope));
  RETURN_IF_ERROR(s.out_f32.Reserve(st.n * H * L * 4));
  MlaParams mp;
  mp.q_latent = s.q_lat.as<float>();
  mp.q_rope = s.q_rope.as<float>();
  mp.n = static_cast<int>(st.n);
  mp.heads = H;
  mp.latent = L;
  mp.rope = R;
  mp.sm_scale = static_cast<float>(sp.sm_scale);
  mp.kv = s.Latent(call.layer);
  mp.tables = Tables();
  if (kind == LayerKind::kDense) {
    mp.window = sp.sliding_window;
    mp.soft_cap = static_cast<float>(sp.soft_cap);
  } else {
    mp.sel = st.sel_slots.as<int32_t>();
    mp.sel_count = st.sel_count.as<int32_t>();
    mp.needs_index = st.needs_index.as<uint8_t>();
    mp.sel_stride = st.sel_cap;
  }
  mp.out = s.out_f32.as<float>();
  if (call.lse != nullptr) {
    RETURN_IF_ERROR(s.lse.Reserve(std::max<size_t>(4, st.n * H * 4)));
    mp.lse = s.lse.as<float>();
  }
  mp.tensor_cores = TensorCoreMla() && absorb == nullptr && in.q_latent.dtype == DType::kBF16 &&
                    in.q_rope.dtype == DType::kBF16;
  if (MlaUsesTensorCores(mp)) {  // split-K by each query's own keys (reserved at BeginStep)
    mp.max_keys = st.max_keys;
    const int splits = MlaQuerySplits(st.max_keys);
    mp.part_queries = MlaPartialQueries(mp.n, splits, H, L);
    const size_t rows = size_t(splits) * mp.part_queries * H;  // BeginStep reserved these
    RETURN_IF_ERROR(s.part_out.Reserve(rows * L * 4));
    RETURN_IF_ERROR(s.part_ml.Reserve(rows * 2 * 4));
    mp.part_out = s.part_out.as<float>();
    mp.part_ml = s.part_ml.as<float>();
  }
  CUDA_RETURN(LaunchMla(mp, s.stream));
  // The output rows back in the request's dtype.
  const float* result = s.out_f32.as<float>();
  int W = L;
  if (absorb != nullptr) {
    W = absorb->v_head_dim();
    RETURN_IF_ERROR(s.out_v.Reserve(std::max<size_t>(4, st.n * H * W * 4)));
    CUDA_RETURN(Project(s.out_f32, s.absorb_uv[call.layer], s.out_v, H, L, W));
    result = s.out_v.as<float>();
  }
  const size_t es = DTypeSize(call.out_dtype), row = size_t{static_cast<size_t>(H)} * W * es;
  RETURN_IF_ERROR(s.out_raw.Reserve(st.n * row));
  CUDA_RETURN(LaunchFromF32(result, call.out_dtype, s.out_raw.ptr, st.n * H * W, s.stream));
  RETURN_IF_ERROR(s.staging.Reserve(st.n * row));
  CUDA_RETURN(
      cudaMemcpyAsync(s.staging.ptr, s.out_raw.ptr, st.n * row, cudaMemcpyDeviceToHost, s.stream));
  CUDA_RETURN(cudaStreamSynchronize(s.stream));
  for (int64_t i = 0; i < st.n; ++i)
    std::memcpy(call.out + share.rows[i] * row, s.staging.data() + i * row, row);
  if (call.lse != nullptr) {  // [n, H] fp32, after the output (staging is reused)
    const size_t lrow = size_t{static_cast<size_t>(H)} * 4;
    RETURN_IF_ERROR(s.staging.Reserve(std::max<size_t>(1, st.n * lrow)));
    CUDA_RETURN(
        cudaMemcpyAsync(s.staging.ptr, s.lse.ptr, st.n * lrow, cudaMemcpyDeviceToHost, s.stream));
    CUDA_RETURN(cudaStreamSynchronize(s.stream));
    for (int64_t i = 0; i < st.n; ++i)
      std::memcpy(call.lse + share.rows[i] * H, s.staging.data() + i * lrow, lrow);
  }
  return absl::OkStatus();
}

}  // namespace attnd::cuda
