// One RunLayer call on a GPU (CudaDevice::Call, the LayerRun of Device::RunLayer): the call's
// inputs gathered once into a pinned upload slot and copied up in two pieces (layer_upload.h),
// key writes, the indexer and the selection, MLA, and the output and its log-sum-exp copied back
// in one piece. The host waits once, for that copy; everything else is ordered by events.
//
// Overlap: a call packs and uploads its inputs before it takes the GPU's layer lock, so it does
// so while another step's layer computes; it releases the lock before it waits for its output,
// so the next layer's kernels queue behind its own. A step's own layers cannot overlap: the
// worker makes layer l + 1's inputs from layer l's output.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <mutex>

#include "absl/status/status.h"
#include "common/status_macros.h"
#include "kernels/cuda/backend/cuda_device.h"
#include "kernels/cuda/backend/cuda_device_state.h"
#include "kernels/cuda/backend/layer_upload.h"
#include "kernels/cuda/ops/cuda_kernels.h"
#include "kernels/cuda/ops/mla_flashinfer.h"
#include "kernels/cuda/ops/mla_gemm.h"
#include "kernels/cuda/ops/mla_split.h"
#include "kernels/cuda/ops/topk_flashinfer.h"

namespace attnd::cuda {

// One RunLayer call on this GPU (Device::RunLayer's steps): its share, step, call and upload
// slot, and the GPU's layer lock while it launches kernels.
struct CudaDevice::Call final : LayerRun {
  Call(State& state, std::unique_lock<std::mutex> slot_lock, UploadSlot& slot, LayerUpload plan,
       const StepShare& share, Step& step, const LayerCall& call)
      : s(state),
        slot_lock(std::move(slot_lock)),
        slot(slot),
        plan(std::move(plan)),
        lock(state.mu),
        share(share),
        st(step),
        call(call) {}
  // A call that did not finish (an error on the way) waits for its GPU work before the slot is
  // let go: the next holder overwrites the slot's buffers.
  ~Call() override {
    if (finished) return;
    cudaEventRecord(slot.computed.e, s.stream);
    cudaEventSynchronize(slot.computed.e);
    cudaStreamSynchronize(s.upload_stream);
    cudaStreamSynchronize(s.download_stream);
  }

  absl::Status WriteKeys() override;
  absl::Status Score(const ScoreSink& sink) override;
  absl::Status Select() override;
  absl::Status Keep(const std::vector<std::vector<int32_t>>& selection) override;
  absl::Status Attend() override;
  absl::Status Finish() override;
  absl::Status AttendFlashInfer(const MlaParams& mp);

  QueryTables Tables() const { return st.Tables(); }
  const uint8_t* In(const UploadSection& section) const {
    return slot.dev.as<uint8_t>() + section.offset;
  }
  uint8_t* Out(const UploadSection& section) const {
    return slot.dev.as<uint8_t>() + section.offset;
  }
  // A planned tensor's rows to fp32 (`f32`, n x row_elems), FP8_E4M3 with its scales.
  absl::Status ToF32(const UploadTensor& t, DeviceBuffer& f32) {
    const int64_t count = st.n * t.row_elems;
    RETURN_IF_ERROR(f32.Reserve(std::max<size_t>(4, count * 4)));
    const float* scales =
        t.scales.present() ? reinterpret_cast<const float*>(In(t.scales)) : nullptr;
    CUDA_RETURN(LaunchToF32(In(t.rows), t.dtype, f32.as<float>(), count, s.stream, scales,
                            t.row_elems / t.heads));
    return absl::OkStatus();
  }
  // The stream waits (on the GPU) for a part of the upload.
  absl::Status WaitFor(const Event& landed) {
    CUDA_RETURN(cudaStreamWaitEvent(s.stream, landed.e, 0));
    return absl::OkStatus();
  }
  // The indexer's queries are bf16 or coarser (fp8): the tensor-core indexers' precision.
  bool IndexQueriesBf16() const {
    return plan.index_q.dtype == DType::kBF16 || plan.index_q.dtype == DType::kFP8E4M3;
  }
  // out[t, h] = in[t, h] · w[h] ([k, cols] per head) for the share's tokens (absorption).
  cudaError_t Project(const DeviceBuffer& in, const DeviceBuffer& w, float* out, int heads, int k,
                      int cols) {
    HeadProjectParams p;
    p.in = in.as<float>();
    p.w = w.as<float>();
    p.out = out;
    p.n = static_cast<int>(st.n);
    p.heads = heads;
    p.k = k;
    p.cols = cols;
    return LaunchHeadProject(p, s.stream);
  }
  // Wire rows (a planned tensor) into `dim` columns from `col` of each share token's slot.
  absl::Status Write(const CacheRows& c, const UploadTensor& t, int dim, int col) {
    WriteRowsParams w;
    w.src = In(t.rows);
    w.src_dtype = t.dtype;
    w.n = static_cast<int>(st.n);
    w.dim = dim;
    w.cache = c;
    w.col_offset = col;
    w.slot = st.At<int32_t>(st.slot);
    CUDA_RETURN(LaunchWriteRows(w, s.stream));
    return absl::OkStatus();
  }
  // fp8 caches: rows packed on the host (row_bytes each) to their slots.
  absl::Status Scatter(const CacheRows& c, const UploadSection& rows, size_t row_bytes) {
    ScatterRowsParams w;
    w.src = In(rows);
    w.n = static_cast<int>(st.n);
    w.src_row_bytes = row_bytes;
    w.cache = c;
    w.slot = st.At<int32_t>(st.slot);
    CUDA_RETURN(LaunchScatterRows(w, s.stream));
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
  std::unique_lock<std::mutex> slot_lock;
  UploadSlot& slot;
  const LayerUpload plan;
  std::unique_lock<std::mutex> lock;  // s.mu, released in Finish before the wait
  const StepShare& share;
  Step& st;
  const LayerCall& call;
  bool attended = false;  // the output part is on its way back
  bool finished = false;
};

absl::StatusOr<std::unique_ptr<LayerRun>> CudaDevice::StartLayer(const StepShare& share,
                                                                 DeviceStep& step,
                                                                 const LayerCall& call) {
  State& s = *s_;
  CUDA_RETURN(cudaSetDevice(ordinal_));
  LayerUpload plan = PlanLayerUpload(s.spec, s.layout, share.size(), call, NeedsOf(call));
  std::unique_lock<std::mutex> slot_lock;
  UploadSlot& slot = s.AcquireSlot(&slot_lock);
  // BeginStep reserved both slots' GPU buffers for this step's largest call (no allocation
  // here); the pinned host buffer grows to the largest call it has carried.
  RETURN_IF_ERROR(slot.dev.Reserve(std::max<size_t>(1, plan.total_bytes)));
  RETURN_IF_ERROR(slot.host.Reserve(std::max<size_t>(1, plan.total_bytes)));
  // The one host copy of the inputs (the slot's previous holder waited for its copies).
  PackLayerUpload(plan, share, call, s.spec, s.layout, slot.host.data());
  // Until the Call owns the slot (its destructor drains), a failure waits for the copies queued
  // from the slot's pinned buffer before the slot is released for another call to refill.
  DrainOnError drain(s.upload_stream, ordinal_);
  if (plan.keys_bytes > 0)
    CUDA_RETURN(cudaMemcpyAsync(slot.dev.ptr, slot.host.ptr, plan.keys_bytes,
                                cudaMemcpyHostToDevice, s.upload_stream));
  CUDA_RETURN(cudaEventRecord(slot.keys_in.e, s.upload_stream));
  if (plan.input_bytes > plan.keys_bytes)
    CUDA_RETURN(cudaMemcpyAsync(
        slot.dev.as<uint8_t>() + plan.keys_bytes, slot.host.data() + plan.keys_bytes,
        plan.input_bytes - plan.keys_bytes, cudaMemcpyHostToDevice, s.upload_stream));
  CUDA_RETURN(cudaEventRecord(slot.queries_in.e, s.upload_stream));
  drain.Dismiss();
  return std::unique_ptr<LayerRun>(std::make_unique<Call>(  // takes the layer lock
      s, std::move(slot_lock), slot, std::move(plan), share, static_cast<Step&>(step), call));
}

absl::Status CudaDevice::Call::Finish() {
  CUDA_RETURN(cudaEventRecord(slot.computed.e, s.stream));
  lock.unlock();  // the next layer's kernels may queue now
  if (attended) {
    CUDA_RETURN(cudaEventSynchronize(slot.out_back.e));
    finished = true;
    UnpackLayerOutput(plan, share, slot.host.data(), call);
    return absl::OkStatus();
  }
  // No output: the keys are written (and any selection kept) when the kernels are done.
  finished = true;
  CUDA_RETURN(cudaEventSynchronize(slot.computed.e));
  return absl::OkStatus();
}

absl::Status CudaDevice::Call::IndexQueries() {
  RETURN_IF_ERROR(WaitFor(slot.keys_in));
  RETURN_IF_ERROR(ToF32(plan.index_q, s.idx_q));
  return ToF32(plan.index_w, s.idx_w);
}

absl::Status CudaDevice::Call::Select() {
  RETURN_IF_ERROR(IndexQueries());
  const int slot = s.spec.FullSlot(call.layer);
  for (const Step::Wave& w : st.waves) RETURN_IF_ERROR(SelectWave(slot, w));
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
  ip.queries = st.At<int32_t>(wave.rows);
  ip.score_offset = st.At<int64_t>(wave.offset);
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
  for (const Step::Wave& w : st.waves) {
    RETURN_IF_ERROR(ScoreWave(slot, w));
    host.resize(w.total);
    CUDA_RETURN(
        cudaMemcpyAsync(host.data(), s.scores.ptr, w.total * 4, cudaMemcpyDeviceToHost, s.stream));
    CUDA_RETURN(cudaStreamSynchronize(s.stream));
    for (int q = 0; q < w.nq; ++q)
      sink(w.host_rows[q], host.data() + w.host_offset[q], w.host_len[q]);
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

  // A top-k over the wave's rows at `offset` and `len` in the step's uploads; rows longer than a
  // slice by their `slices` (planned in BeginStep) through the candidates' scratch.
  auto top_k = [&](auto offset, auto len, auto slices, int64_t max_len) {
    TopKParams p;
    p.rows.row_offset = st.At<int64_t>(offset);
    p.rows.row_len = st.At<int64_t>(len);
    p.nq = nq;
    p.max_len = max_len;
    p.rows.Sliced(st.At<int64_t>(slices), s.cand_key.as<uint32_t>(), s.cand_index.as<int32_t>(),
                  s.cand_count.as<int32_t>());
    return p;
  };
  // The step's selection rows (each query's named by wave.rows) as where a selection goes.
  auto into_selection = [&](auto& p) {
    p.out = st.sel.as<int32_t>();
    p.out_stride = st.sel_cap;
    p.out_count = st.sel_count.as<int32_t>();
    p.out_row = st.At<int32_t>(wave.rows);
  };
  TopKParams tk = top_k(wave.offset, wave.len, wave.token_slices, wave.max_len);
  tk.rows.scores = s.scores.as<float>();
  if (wave.padded) {  // FlashInfer's top-k (token mode; the step planned padded rows)
    FlashInferTopKParams fk;
    fk.scores = s.scores.as<float>();
    fk.len = st.At<int32_t>(wave.len32);
    fk.nq = nq;
    fk.max_len = wave.stride;
    fk.k = static_cast<int>(s.spec.index_topk);
    fk.tmp_index = s.tmp_sel.as<int32_t>();
    fk.tmp_value = s.topk_values.as<float>();
    into_selection(fk);
    CUDA_RETURN(LaunchFlashInferTopK(fk, s.stream));
    return absl::OkStatus();
  }
  if (s.spec.selection == SelectionMode::kToken) {
    tk.rows.k = s.spec.index_topk;
    into_selection(tk.rows);
    CUDA_RETURN(LaunchTopK(tk, s.stream));
    return absl::OkStatus();
  }
  // Page modes: per-query page keys, the best pages, then their positions.
  RETURN_IF_ERROR(s.page_keys.Reserve(wave.pages_total * 4));
  CUDA_RETURN(cudaMemsetAsync(s.page_keys.ptr, 0, wave.pages_total * 4, s.stream));
  const int64_t keep = s.KeptPages();
  PageKeyRows page_rows;
  page_rows.scores = s.scores.as<float>();
  page_rows.row_offset = st.At<int64_t>(wave.offset);
  page_rows.page_offset = st.At<int64_t>(wave.page_offset);
  page_rows.nq = nq;
  page_rows.page_size = s.spec.page_size;
  page_rows.page_keys = s.page_keys.as<uint32_t>();
  if (s.spec.selection == SelectionMode::kPageUnion) {
    const int64_t k = s.spec.index_topk;
    RETURN_IF_ERROR(s.tmp_sel.Reserve(nq * k * 4));
    RETURN_IF_ERROR(s.tmp_count.Reserve(nq * 4));
    tk.rows.Into(k, s.tmp_sel.as<int32_t>(), k, s.tmp_count.as<int32_t>());
    CUDA_RETURN(LaunchTopK(tk, s.stream));
    PageHitParams ph;
    ph.rows = page_rows;
    ph.selected = s.tmp_sel.as<int32_t>();
    ph.selected_count = s.tmp_count.as<int32_t>();
    ph.sel_stride = k;
    ph.max_sel = k;
    CUDA_RETURN(LaunchPageHits(ph, s.stream));
  } else {
    PageMaxParams pm;
    pm.rows = page_rows;
    pm.row_len = st.At<int64_t>(wave.len);
    pm.max_pages = wave.max_pages;
    CUDA_RETURN(LaunchPageMax(pm, s.stream));
  }
  RETURN_IF_ERROR(s.page_list.Reserve(nq * keep * 4));
  RETURN_IF_ERROR(s.page_count.Reserve(nq * 4));
  TopKParams pk = top_k(wave.page_offset, wave.pages, wave.page_slices, wave.max_pages);
  pk.rows.keys = s.page_keys.as<uint32_t>();
  pk.rows.drop_zero = true;
  pk.rows.Into(keep, s.page_list.as<int32_t>(), keep, s.page_count.as<int32_t>());
  CUDA_RETURN(LaunchTopK(pk, s.stream));
  ExpandParams ex;
  ex.pages = s.page_list.as<int32_t>();
  ex.page_count = s.page_count.as<int32_t>();
  ex.page_stride = keep;
  ex.row_len = st.At<int64_t>(wave.len);
  ex.nq = nq;
  ex.page_size = s.spec.page_size;
  into_selection(ex);
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
  st.fi_lists_current = false;  // the FlashInfer MLA's lists follow the new selection
  return absl::OkStatus();
}

// Keys into the caches: an fp8 cache's rows were quantised on the host when they were packed,
// as on CPU devices; other caches convert the wire rows as they write them.
absl::Status CudaDevice::Call::WriteKeys() {
  const ModelSpec& sp = s.spec;
  const int L = sp.kv_lora_rank, R = sp.qk_rope_head_dim, Di = sp.index_head_dim;
  const bool full = sp.layers[call.layer] == LayerKind::kFull;
  RETURN_IF_ERROR(WaitFor(slot.keys_in));
  if (s.layout.fp8()) {
    RETURN_IF_ERROR(Scatter(s.Latent(call.layer), plan.latent_rows, s.layout.latent_row_bytes()));
    if (full) RETURN_IF_ERROR(Scatter(s.Index(sp.FullSlot(call.layer)), plan.index_rows, Di + 4));
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(Write(s.Latent(call.layer), plan.kv_latent, L, 0));
  RETURN_IF_ERROR(Write(s.Latent(call.layer), plan.k_rope, R, L));
  if (full) RETURN_IF_ERROR(Write(s.Index(sp.FullSlot(call.layer)), plan.index_k, Di, 0));
  return absl::OkStatus();
}

// The sparse MLA on FlashInfer's kernel (the step planned it: st.fi): bf16 queries, each
// query's key list as slot ids, then the plan's waves. Writes mp.out and mp.lse as LaunchMla.
absl::Status CudaDevice::Call::AttendFlashInfer(const MlaParams& mp) {
  const int64_t H = mp.heads, L = mp.latent, R = mp.rope;
  CUDA_RETURN(LaunchFromF32(mp.q_latent, DType::kBF16, s.fi_q_nope.ptr, st.n * H * L, s.stream));
  CUDA_RETURN(LaunchFromF32(mp.q_rope, DType::kBF16, s.fi_q_pe.ptr, st.n * H * R, s.stream));
  MlaKeyListParams kl;
  kl.sel = mp.sel;
  kl.sel_stride = mp.sel_stride;
  kl.tables = mp.tables;
  kl.start = st.At<int64_t>(st.fi_seg_start);
  kl.count = st.At<int32_t>(st.fi_seg_count);
  kl.query = st.At<int32_t>(st.fi_seg_query);
  kl.is_range = st.At<uint8_t>(st.fi_seg_range);
  kl.segments = st.fi_segments;
  kl.out = st.fi_keys.as<int32_t>();
  if (!st.fi_lists_current) {  // a new selection, or the step's first sparse layer
    CUDA_RETURN(LaunchMlaKeyList(kl, s.stream));
    st.fi_lists_current = true;
  }
  for (const Step::FiWave& w : st.fi_waves) {
    FlashInferMlaParams fp;
    fp.q_nope = s.fi_q_nope.ptr;
    fp.q_pe = s.fi_q_pe.ptr;
    fp.kv = mp.kv;
    fp.heads = mp.heads;
    fp.sm_scale = mp.sm_scale;
    fp.key_list = st.fi_keys.as<int32_t>();
    size_t next = 0;
    fp.wave = FlashInferWaveArgs(
        w.host, st.At<int32_t>(st.fi_zeros),
        [&](const std::vector<int32_t>&) { return st.At<int32_t>(w.at[next++]); });
    fp.partial_o = s.fi_part_o.ptr;
    fp.partial_lse = s.fi_part_lse.as<float>();
    fp.out = mp.out;
    fp.lse = mp.lse;
    CUDA_RETURN(LaunchFlashInferMla(fp, s.stream));
  }
  return absl::OkStatus();
}

// MLA over the kept selection (sparse layers) or the key ranges (absorbed calls first form
// q_latent = q_nope · W_UK per head), then the output rows in the request's dtype (absorbed: the
// values, out_latent · W_UV^T) and the log-sum-exps into the slot, and both back in one copy.
absl::Status CudaDevice::Call::Attend() {
  const ModelSpec& sp = s.spec;
  const int H = sp.num_heads, L = sp.kv_lora_rank, R = sp.qk_rope_head_dim;
  const LayerKind kind = sp.layers[call.layer];
  const Absorption* absorb = call.absorb;
  RETURN_IF_ERROR(WaitFor(slot.queries_in));
  if (absorb != nullptr) {
    if (s.absorb_uk.size() != static_cast<size_t>(sp.num_layers()))
      return absl::InternalError("absorbed call on a GPU without its absorption weights");
    const int Dn = absorb->qk_nope_head_dim();
    RETURN_IF_ERROR(ToF32(plan.query, s.q_nope));
    RETURN_IF_ERROR(s.q_lat.Reserve(std::max<size_t>(4, st.n * H * L * 4)));
    CUDA_RETURN(Project(s.q_nope, s.absorb_uk[call.layer], s.q_lat.as<float>(), H, Dn, L));
  } else {
    RETURN_IF_ERROR(ToF32(plan.query, s.q_lat));
  }
  RETURN_IF_ERROR(ToF32(plan.q_rope, s.q_rope));
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
    mp.needs_index = st.At<uint8_t>(st.needs_index);
    mp.sel_stride = st.sel_cap;
  }
  mp.out = s.out_f32.as<float>();
  if (plan.lse.present()) mp.lse = reinterpret_cast<float*>(Out(plan.lse));  // [n, H] fp32
  // Tensor cores round the query and the probabilities to bf16: for calls whose queries are
  // bf16 or coarser (BF16 or FP8_E4M3 q_latent / q_nope and q_rope), absorbed or not, on bf16
  // and fp8 caches; FP32 and FP16 requests keep the fp32 SIMT kernel's precision.
  auto bf16_precision = [](DType t) { return t == DType::kBF16 || t == DType::kFP8E4M3; };
  mp.tensor_cores =
      TensorCoreMla() && bf16_precision(plan.query.dtype) && bf16_precision(plan.q_rope.dtype);
  mp.pipeline = PipelinedMla();
  mp.wgmma = WgmmaMla();
  mp.wgmma_ws = WgmmaWsMla();
  std::string blas_why;
  cublasHandle_t blas = nullptr;
  if (st.gemm_keys > 0 && kind != LayerKind::kDense && mp.tensor_cores && mp.soft_cap == 0) {
    blas = s.blas.Get(s.stream, &blas_why);
    if (blas == nullptr && !s.blas_unavailable_said) {  // then the hand-written kernels
      std::fprintf(stderr, "attnd: the GEMM MLA needs cuBLAS: %s\n", blas_why.c_str());
      s.blas_unavailable_said = true;
    }
  }
  if (st.fi && kind != LayerKind::kDense && mp.tensor_cores) {
    RETURN_IF_ERROR(AttendFlashInfer(mp));
  } else if (blas != nullptr) {
    MlaGemmParams g;
    g.mla = mp;
    g.max_keys = st.gemm_keys;
    g.scratch = s.gemm_scratch.ptr;
    const cudaError_t e = LaunchMlaGemm(g, *LoadCublas(nullptr), blas, s.stream, &blas_why);
    if (e == cudaErrorUnknown) return absl::InternalError(blas_why);
    CUDA_RETURN(e);
  } else if (MlaUsesTensorCores(mp)) {  // split-K by each query's own keys (reserved at BeginStep)
    mp.max_keys = st.max_keys;
    const int splits = MlaQuerySplits(st.max_keys);
    mp.part_queries = MlaPartialQueries(mp.n, splits, H, L);
    const size_t rows = size_t(splits) * mp.part_queries * H;  // BeginStep reserved these
    RETURN_IF_ERROR(s.part_out.Reserve(rows * L * 4));
    RETURN_IF_ERROR(s.part_ml.Reserve(rows * 2 * 4));
    mp.part_out = s.part_out.as<float>();
    mp.part_ml = s.part_ml.as<float>();
    CUDA_RETURN(LaunchMla(mp, s.stream));
  } else {
    CUDA_RETURN(LaunchMla(mp, s.stream));
  }
  // The output rows in the request's dtype, into the slot.
  const float* result = s.out_f32.as<float>();
  if (absorb != nullptr) {
    RETURN_IF_ERROR(s.out_v.Reserve(std::max<size_t>(4, st.n * H * plan.width * 4)));
    CUDA_RETURN(Project(s.out_f32, s.absorb_uv[call.layer], s.out_v.as<float>(), H, L, plan.width));
    result = s.out_v.as<float>();
  }
  CUDA_RETURN(
      LaunchFromF32(result, call.out_dtype, Out(plan.out), st.n * H * plan.width, s.stream));
  // Output and log-sum-exps back in one copy, on the download stream once the kernels are done.
  CUDA_RETURN(cudaEventRecord(slot.computed.e, s.stream));
  CUDA_RETURN(cudaStreamWaitEvent(s.download_stream, slot.computed.e, 0));
  CUDA_RETURN(cudaMemcpyAsync(slot.host.data() + plan.output_offset(),
                              slot.dev.as<uint8_t>() + plan.output_offset(), plan.output_bytes(),
                              cudaMemcpyDeviceToHost, s.download_stream));
  CUDA_RETURN(cudaEventRecord(slot.out_back.e, s.download_stream));
  attended = true;
  return absl::OkStatus();
}

}  // namespace attnd::cuda
