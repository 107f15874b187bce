#include "kernels/cuda/backend/cuda_device.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/backend/cuda_device_state.h"
#include "kernels/cuda/backend/gpu_facts.h"
#include "kernels/cuda/backend/layer_upload.h"
#include "kernels/cuda/ops/cuda_kernels.h"
#include "kernels/cuda/ops/mla_flashinfer.h"
#include "kernels/cuda/ops/mla_gemm.h"
#include "kernels/cuda/ops/mla_split.h"
#include "kernels/cuda/ops/topk_block.h"
#include "kernels/cuda/ops/topk_flashinfer.h"

namespace attnd::cuda {
namespace {

// The most keys any query of a share can attend (its position + 1 bounds every mode).
int64_t MaxKeys(const StepShare& share) {
  int64_t most = 1;
  for (const int64_t p : share.pos) most = std::max(most, p + 1);
  return most;
}

// Bounds one wave of indexer scores (floats): 64 MiB of GPU scratch.
constexpr int64_t kMaxScoreFloats = int64_t{16} << 20;

}  // namespace

absl::StatusOr<int> ProbeDevices() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaSuccess) return n;
  cudaGetLastError();  // clear the error
  if (e == cudaErrorNoDevice) return 0;
  // No NVIDIA driver at all (a CPU machine): the runtime reports an insufficient driver.
  if (void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL)) {
    dlclose(driver);
  } else {
    return 0;
  }
  return absl::UnavailableError(absl::StrCat("CUDA is installed but unusable: cudaGetDeviceCount: ",
                                             cudaGetErrorName(e), ": ", cudaGetErrorString(e)));
}

absl::StatusOr<GpuMemory> QueryGpuMemory(int ordinal) {
  ASSIGN_OR_RETURN(const int visible, ProbeDevices());
  if (ordinal < 0 || ordinal >= visible)
    return absl::FailedPreconditionError(
        absl::StrCat("cuda:", ordinal, ": no such GPU (", visible, " visible)"));
  GpuMemory m;
  CUDA_RETURN(cudaSetDevice(ordinal));
  CUDA_RETURN(cudaMemGetInfo(&m.free, &m.total));
  return m;
}

absl::StatusOr<std::unique_ptr<CudaDevice>> CudaDevice::Create(std::string name, int ordinal,
                                                               const ModelSpec& spec,
                                                               const CacheLayout& layout,
                                                               size_t scratch_bytes) {
  ASSIGN_OR_RETURN(const int visible, ProbeDevices());
  if (ordinal < 0 || ordinal >= visible)
    return absl::FailedPreconditionError(
        absl::StrCat(name, ": no such GPU (", visible, " visible)"));
  if (spec.kv_lora_rank > 512)
    return absl::InvalidArgumentError("CUDA backend supports kv_lora_rank <= 512");
  std::unique_ptr<CudaDevice> d(new CudaDevice(std::move(name), spec, layout));
  d->ordinal_ = ordinal;
  d->s_ = std::make_unique<State>();
  State& s = *d->s_;
  s.spec = spec;
  s.layout = layout;
  s.scratch_budget = scratch_bytes;
  CUDA_RETURN(cudaSetDevice(ordinal));
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_RETURN(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (layout.TotalBytes() + scratch_bytes > free_bytes)
    return absl::ResourceExhaustedError(absl::StrCat(
        d->name(), ": a KV cache of ", layout.TotalBytes() >> 20, " MiB and ", scratch_bytes >> 20,
        " MiB of step scratch (--gpu-scratch-bytes) do not fit in the GPU's ", free_bytes >> 20,
        " MiB free of ", total_bytes >> 20, " MiB; lower --kv-cache-bytes or the scratch"));
  // The kernels must have code for this GPU (a fat binary for sm_80 and sm_90a, PTX for newer).
  if (const cudaError_t k = ProbeKernels(); k != cudaSuccess) {
    cudaGetLastError();
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, ordinal);
    return absl::FailedPreconditionError(
        absl::StrCat(d->name(), " (", prop.name, ", sm_", prop.major, prop.minor,
                     "): this build's CUDA kernels do not load on it: ", cudaGetErrorString(k),
                     "; rebuild with CMAKE_CUDA_ARCHITECTURES including ", prop.major, prop.minor));
  }
  CUDA_RETURN(cudaDeviceGetAttribute(&s.sms, cudaDevAttrMultiProcessorCount, ordinal));
  // ATTND_CUDA_MLA=wgmma: check wgmma on this GPU now, not inside a step (it prints its verdict;
  // the mma.sync kernel runs if it fails). A probe that faulted leaves the context unusable.
  if (WgmmaMla() && !MlaWgmmaSelfCheck()) {
    if (const cudaError_t k = cudaDeviceSynchronize(); k != cudaSuccess)
      return absl::FailedPreconditionError(
          absl::StrCat(d->name(), ": the wgmma self-check (ATTND_CUDA_MLA=wgmma) left the GPU ",
                       "unusable: ", cudaGetErrorString(k), "; run without ATTND_CUDA_MLA=wgmma"));
  }
  for (cudaStream_t* st : {&s.stream, &s.upload_stream, &s.download_stream, &s.copy_stream})
    CUDA_RETURN(cudaStreamCreateWithFlags(st, cudaStreamNonBlocking));
  for (UploadSlot& slot : s.slots)
    for (Event* e : {&slot.keys_in, &slot.queries_in, &slot.computed, &slot.out_back})
      RETURN_IF_ERROR(e->Create());
  RETURN_IF_ERROR(s.plan_uploaded.Create());
  RETURN_IF_ERROR(s.move_done.Create());
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, layout.TotalBytes());
  if (e != cudaSuccess)
    return absl::ResourceExhaustedError(
        absl::StrCat(d->name(), ": cannot allocate ", layout.TotalBytes(),
                     " bytes of KV cache: ", cudaGetErrorString(e)));
  s.cache = static_cast<uint8_t*>(p);
  // On `stream` and waited for: a legacy-stream memset is asynchronous to the host and unordered
  // with the non-blocking stream, so it could otherwise overwrite the first steps' writes.
  CUDA_RETURN(cudaMemsetAsync(s.cache, 0, layout.TotalBytes(), s.stream));
  CUDA_RETURN(cudaStreamSynchronize(s.stream));
  return d;
}

CudaDevice::CudaDevice(std::string name, const ModelSpec& spec, const CacheLayout& layout)
    : Device(std::move(name), spec, layout) {}

CudaDevice::~CudaDevice() {
  if (!s_) return;
  cudaSetDevice(ordinal_);
  if (s_->cache) cudaFree(s_->cache);
  for (cudaStream_t st : {s_->stream, s_->upload_stream, s_->download_stream, s_->copy_stream})
    if (st) cudaStreamDestroy(st);
}

UploadSlot& CudaDevice::State::AcquireSlot(std::unique_lock<std::mutex>* lock) {
  const unsigned first = next_slot.fetch_add(1);
  for (unsigned i = 0; i < slots.size(); ++i) {  // a free one, starting from this call's turn
    UploadSlot& slot = slots[(first + i) % slots.size()];
    std::unique_lock<std::mutex> l(slot.mu, std::try_to_lock);
    if (l.owns_lock()) {
      *lock = std::move(l);
      return slot;
    }
  }
  UploadSlot& slot = slots[first % slots.size()];  // both in use: wait for this call's turn
  *lock = std::unique_lock<std::mutex>(slot.mu);
  return slot;
}

absl::Status CudaDevice::State::ReserveScratch(const StepShare& share, const Step& step) {
  const size_t n = std::max<size_t>(1, share.size());
  if (share.write_only) {  // an import: key rows in, nothing computed, nothing out
    const size_t slot_bytes = MaxImportUploadBytes(spec, layout, share.size());
    const std::pair<DeviceBuffer*, size_t> want[] = {{&slots[0].dev, slot_bytes},
                                                     {&slots[1].dev, slot_bytes}};
    return ReserveScratchBuffers(share, want);
  }
  const size_t H = spec.num_heads, L = spec.kv_lora_rank, R = spec.qk_rope_head_dim;
  const size_t Hi = spec.index_n_heads, Di = spec.index_head_dim;
  int64_t need_keys = 0;  // one wave's score rows (padded rows, FlashInfer's top-k, included)
  for (const Step::Wave& w : step.waves) need_keys = std::max(need_keys, w.total);
  const size_t k = static_cast<size_t>(std::max<int64_t>(1, spec.index_topk));
  const size_t keep =
      static_cast<size_t>(std::max({1, spec.page_budget, spec.page_union_max_pages}));
  const size_t pages = need_keys / spec.page_size + n;  // a wave's page keys
  // Split-K partials for the step's longest query (the most splits any layer of it takes), for
  // a wave of its queries at a time (mla_split.h).
  const int splits = MlaQuerySplits(MaxKeys(share));
  const size_t part_rows =
      size_t(splits) * MlaPartialQueries(static_cast<int>(n), splits, spec.num_heads, L) * H;
  // Each upload slot holds one call's packed inputs and outputs (layer_upload.h).
  const size_t slot_bytes = MaxLayerUploadBytes(spec, layout, share.size(), absorb_dn, absorb_v);
  const std::pair<DeviceBuffer*, size_t> want[] = {
      {&slots[0].dev, slot_bytes},
      {&slots[1].dev, slot_bytes},
      {&q_lat, n * H * L * 4},
      {&q_rope, n * H * R * 4},
      {&idx_q, n * Hi * Di * 4},
      {&idx_w, n * Hi * 4},
      {&out_f32, n * H * L * 4},
      {&q_nope, std::max<size_t>(4, n * H * absorb_dn * 4)},
      {&out_v, std::max<size_t>(4, n * H * absorb_v * 4)},
      {&scores, std::max<size_t>(4, need_keys * 4)},
      {&tmp_sel, n * k * 4},
      {&tmp_count, n * 4},
      {&page_keys, pages * 4},
      {&page_list, n * keep * 4},
      {&page_count, n * 4},
      {&part_out, splits > 1 ? part_rows * L * 4 : 4},
      {&part_ml, splits > 1 ? part_rows * 2 * 4 : 4},
      {&cand_key, std::max<size_t>(4, step.candidates * 4)},
      {&cand_index, std::max<size_t>(4, step.candidates * 4)},
      {&cand_count, std::max<size_t>(4, step.candidates * 4)},
      {&fi_q_nope, step.fi ? n * H * L * 2 : 4},
      {&fi_q_pe, step.fi ? n * H * R * 2 : 4},
      {&fi_part_o, step.fi ? static_cast<size_t>(step.fi_partial_rows) * L * 2 : 4},
      {&fi_part_lse, step.fi ? static_cast<size_t>(step.fi_partial_rows) * 4 : 4},
      {&topk_values, std::any_of(step.waves.begin(), step.waves.end(),
                                 [](const Step::Wave& w) { return w.padded; })
                         ? n * k * 4
                         : 4},
      {&gemm_scratch,
       step.gemm_keys > 0 ? MlaGemmWaveQueries(static_cast<int>(n), H, L, R, step.gemm_keys) *
                                MlaGemmQueryBytes(H, L, R, step.gemm_keys)
                          : 4}};
  // The FlashInfer MLA's key lists are the step's own, as its selection is.
  return ReserveScratchBuffers(share, want, static_cast<size_t>(step.fi_list_entries) * 4);
}

absl::Status CudaDevice::State::ReserveScratchBuffers(
    const StepShare& share, absl::Span<const std::pair<DeviceBuffer*, size_t>> want,
    size_t step_own_bytes) {
  // The step's own selection buffers (positions and slot ids) count too.
  const size_t n = std::max<size_t>(1, share.size());
  size_t total =
      2 * n * static_cast<size_t>(std::max<int64_t>(1, share.max_selected)) * 4 + step_own_bytes;
  for (const auto& [buf, bytes] : want) total += bytes;
  if (total > scratch_budget)
    return absl::ResourceExhaustedError(
        absl::StrCat("a step of ", share.size(), " tokens needs about ", total >> 20,
                     " MiB of GPU scratch beyond the KV cache, over the ", scratch_budget >> 20,
                     " MiB budget (--gpu-scratch-bytes); send smaller steps"));
  // The sizes before this attempt: a failed one puts back exactly these, so the scratch the
  // other open steps' layers use stays as it was.
  std::vector<size_t> before;
  for (const auto& [buf, bytes] : want) before.push_back(buf->bytes);
  total = 0;
  for (const auto& [buf, bytes] : want) {
    total += bytes;
    if (absl::Status r = buf->Reserve(bytes); !r.ok()) {
      // Page moves allocate their staging under copy_mu (never held while taking mu): held
      // here, none takes the memory freed below before it is allocated again.
      std::lock_guard<std::mutex> moves(copy_mu);
      size_t i = 0;
      for (const auto& w : want)  // first free what this attempt grew (or lost)...
        if (w.first->bytes != before[i++]) w.first->Release();
      i = 0;
      for (const auto& w : want)  // ...then restore
        if (absl::Status back = w.first->Reserve(before[i++]); !back.ok())
          std::fprintf(stderr,
                       "attnd: GPU scratch could not be restored after a failed reserve (%s): "
                       "open steps' layers may allocate it again or fail\n",
                       std::string(back.message()).c_str());
      return absl::ResourceExhaustedError(absl::StrCat(
          "a step of ", share.size(), " tokens needs about ", total >> 20,
          " MiB of GPU scratch beyond the KV cache: ", r.message(), "; send smaller steps"));
    }
  }
  // The slots' pinned host buffers grow to each call's own size (StartLayer), not to this bound:
  // pinned memory is the host's, and fp32 worst cases would pin gigabytes for bf16 traffic.
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DeviceStep>> CudaDevice::BeginStep(const StepShare& share) {
  State& s = *s_;
  // Both upload slots (they may grow), then the layer lock: the order every call takes them in.
  std::scoped_lock lock(s.slots[0].mu, s.slots[1].mu, s.mu);
  CUDA_RETURN(cudaSetDevice(ordinal_));
  auto st = std::make_unique<Step>(ordinal_);
  st->n = share.size();
  st->sel_cap = std::max<int64_t>(1, share.max_selected);
  st->page_size = share.page_size;
  st->max_keys = MaxKeys(share);
  // The plan in one copy: no stream sync (the layers' kernels follow on the same stream); the
  // pinned staging is reused once the previous step's copy has passed.
  PlanPacker plan;
  st->pos = plan.Add(share.pos);
  st->seq = plan.Add(share.seq);
  st->indptr = plan.Add(share.indptr);
  st->pages = plan.Add(share.pages);
  st->slot = plan.Add(share.slot);
  st->needs_index = plan.Add(share.needs_index);
  s.PlanWaves(share, st.get(), &plan);
  s.PlanFlashInfer(share, st.get(), &plan);
  if (GemmMla() && !share.write_only) {  // the GEMM MLA's key blocks: the longest list
    st->gemm_keys = st->sel_cap;
    for (int64_t i = 0; i < share.size(); ++i)
      if (!share.needs_index[i]) st->gemm_keys = std::max(st->gemm_keys, share.pos[i] + 1);
  }
  RETURN_IF_ERROR(s.ReserveScratch(share, *st));
  const std::vector<uint8_t>& bytes = plan.bytes();
  RETURN_IF_ERROR(st->plan.Reserve(bytes.size()));
  CUDA_RETURN(cudaEventSynchronize(s.plan_uploaded.e));
  RETURN_IF_ERROR(s.plan_host.Reserve(bytes.size()));
  std::memcpy(s.plan_host.data(), bytes.data(), bytes.size());
  CUDA_RETURN(cudaMemcpyAsync(st->plan.ptr, s.plan_host.ptr, bytes.size(), cudaMemcpyHostToDevice,
                              s.stream));
  CUDA_RETURN(cudaEventRecord(s.plan_uploaded.e, s.stream));
  RETURN_IF_ERROR(st->sel.Reserve(std::max<size_t>(4, st->n * st->sel_cap * 4)));
  RETURN_IF_ERROR(st->sel_slots.Reserve(std::max<size_t>(4, st->n * st->sel_cap * 4)));
  RETURN_IF_ERROR(st->sel_count.Reserve(std::max<size_t>(4, st->n * 4)));
  if (st->fi) RETURN_IF_ERROR(st->fi_keys.Reserve(static_cast<size_t>(st->fi_list_entries) * 4));
  // Rows that never select keep count 0 (PositionsToSlots and traces read every row).
  CUDA_RETURN(cudaMemsetAsync(st->sel_count.ptr, 0, st->sel_count.bytes, s.stream));
  return std::unique_ptr<DeviceStep>(std::move(st));
}

void CudaDevice::State::PlanFlashInfer(const StepShare& share, Step* step, PlanPacker* plan) const {
  // What does not change from layer to layer: the switch, the build, a compute capability 9.0
  // GPU, the cache's rows, the model's dims. Context-parallel and page-mode selections have
  // counts the host does not know: those steps keep the hand-written kernels.
  if (!FlashInferMla() || !FlashInferMlaBuilt() || share.write_only || !share.offset.empty() ||
      share.size() == 0)
    return;
  GpuFacts g;
  if (CurrentGpuFacts(&g) != cudaSuccess || g.cc_major != 9 || g.cc_minor != 0) return;
  for (int l = 0; l < spec.num_layers(); ++l) {
    const CacheRows c = Latent(l);
    if (c.scales_apart != 0 ||
        !FlashInferMlaLayoutFor(c.dtype, c.row_bytes, reinterpret_cast<uintptr_t>(c.base),
                                spec.kv_lora_rank, spec.qk_rope_head_dim, spec.num_heads)
             .refused.empty())
      return;
  }
  // Each query's keys, exactly, and its list: a selecting query (token mode) keeps min(K,
  // visible) keys, what the top-k keeps, in a row of its own; the range queries of a sequence
  // read prefixes of one list of its slots from position 0 (a prefill's tokens share it).
  FlashInferMlaPlanInput in;
  in.heads = spec.num_heads;
  in.multiprocessors = g.sms;
  std::vector<int64_t> seg_start;
  std::vector<int32_t> seg_count, seg_query;
  std::vector<uint8_t> seg_range;
  absl::flat_hash_map<int32_t, size_t> seq_segment;  // a sequence's range list: its segment
  std::vector<size_t> segment_of(share.size());      // each query's segment
  std::vector<int64_t> offset_in(share.size(), 0);   // and where its keys start in it
  for (int64_t i = 0; i < share.size(); ++i) {
    const int64_t first = FirstVisibleKey(spec, LayerKind::kFull, share.pos[i]);
    const int64_t visible = share.pos[i] - first + 1;
    if (share.needs_index[i] && spec.selection != SelectionMode::kToken) return;
    in.keys.push_back(share.needs_index[i] ? std::min<int64_t>(spec.index_topk, visible) : visible);
    auto [it, fresh] = share.needs_index[i]
                           ? std::make_pair(seq_segment.end(), true)
                           : seq_segment.try_emplace(share.seq[i], seg_start.size());
    if (fresh) {
      segment_of[i] = seg_start.size();
      seg_start.push_back(0);  // placed below, once every segment's length is known
      seg_count.push_back(0);
      seg_query.push_back(static_cast<int32_t>(i));
      seg_range.push_back(share.needs_index[i] ? 0 : 1);
    } else {
      segment_of[i] = it->second;
    }
    if (share.needs_index[i]) {
      seg_count[segment_of[i]] = static_cast<int32_t>(in.keys.back());
    } else {
      offset_in[i] = first;
      seg_count[segment_of[i]] =
          std::max<int32_t>(seg_count[segment_of[i]], static_cast<int32_t>(share.pos[i] + 1));
    }
  }
  for (size_t j = 0; j < seg_start.size(); ++j) {
    seg_start[j] = in.list_entries;
    in.list_entries += seg_count[j];
  }
  for (int64_t i = 0; i < share.size(); ++i)
    in.list_start.push_back(seg_start[segment_of[i]] + offset_in[i]);
  FlashInferMlaPlanResult r = PlanFlashInferMla(in);
  if (!r.refused.empty()) return;
  step->fi = true;
  step->fi_segments = static_cast<int>(seg_start.size());
  step->fi_seg_start = plan->Add(seg_start);
  step->fi_seg_count = plan->Add(seg_count);
  step->fi_seg_query = plan->Add(seg_query);
  step->fi_seg_range = plan->Add(seg_range);
  step->fi_list_entries = in.list_entries;
  int most = 1;
  for (const FlashInferMlaWave& w : r.plan.waves) most = std::max(most, w.blocks_x * w.blocks_y);
  step->fi_zeros = plan->Add(std::vector<int32_t>(most, 0));
  for (FlashInferMlaWave& w : r.plan.waves) {
    Step::FiWave f;
    FlashInferWaveArgs(w, nullptr, [&](std::vector<int32_t>& v) -> const int32_t* {
      f.at.push_back(plan->Add(v));
      std::vector<int32_t>().swap(v);  // uploaded: the launch needs only the wave's shape
      return nullptr;
    });
    f.host = std::move(w);
    step->fi_waves.push_back(std::move(f));
  }
  step->fi_partial_rows = r.plan.max_partial_rows;
}

void CudaDevice::State::PlanWaves(const StepShare& share, Step* step, PlanPacker* plan) const {
  // FlashInfer's top-k (topk_flashinfer.h) reads rows at a fixed stride: the longest row of the
  // wave, rounded up to 4 floats (its 16-byte loads). Token mode only, where it applies.
  const bool padded = FlashInferTopK() && spec.selection == SelectionMode::kToken &&
                      share.offset.empty() && FlashInferTopKApplies(spec.index_topk);
  auto stride = [](int64_t len) { return (len + 3) / 4 * 4; };
  for (int64_t i = 0; i < share.size();) {
    std::vector<int32_t> rows;
    std::vector<int64_t> offset, len, page_offset, pages;
    Step::Wave w;
    for (; i < share.size(); ++i) {
      if (!share.needs_index[i]) continue;
      const int64_t v = share.pos[i] + 1;
      if (!rows.empty() && (padded ? int64_t(rows.size() + 1) * stride(std::max(w.max_len, v))
                                   : w.total + v) > kMaxScoreFloats)
        break;
      const int64_t np = (v + spec.page_size - 1) / spec.page_size;
      rows.push_back(static_cast<int32_t>(i));
      offset.push_back(w.total);
      len.push_back(v);
      page_offset.push_back(w.pages_total);
      pages.push_back(np);
      w.total += v;
      w.max_len = std::max(w.max_len, v);
      w.pages_total += np;
      w.max_pages = std::max(w.max_pages, np);
    }
    if (rows.empty()) break;
    w.nq = static_cast<int>(rows.size());
    if (padded) {  // row q at q x stride; lengths also as int32 (FlashInfer's)
      w.padded = true;
      w.stride = stride(w.max_len);
      for (size_t q = 0; q < rows.size(); ++q) offset[q] = int64_t(q) * w.stride;
      w.total = int64_t(rows.size()) * w.stride;
      w.len32 = plan->Add(std::vector<int32_t>(len.begin(), len.end()));
    }
    w.rows = plan->Add(rows);
    w.offset = plan->Add(offset);
    w.len = plan->Add(len);
    w.page_offset = plan->Add(page_offset);
    w.pages = plan->Add(pages);
    // Long rows' top-k runs in slices whose candidates need scratch: the token top-k (token and
    // page_union modes) and the page top-k (page modes) of a wave run one after the other.
    const int64_t k = spec.index_topk, keep = std::max<int64_t>(1, KeptPages());
    const TopKSlicePlan by_token = PlanTopKSlices(len, k), by_page = PlanTopKSlices(pages, keep);
    w.token_slices = plan->Add(by_token.offset);
    w.page_slices = plan->Add(by_page.offset);
    if (spec.selection != SelectionMode::kPageBudget)
      step->candidates = std::max(step->candidates, by_token.total * k);
    if (spec.selection != SelectionMode::kToken)
      step->candidates = std::max(step->candidates, by_page.total * keep);
    w.host_rows = std::move(rows);
    w.host_offset = std::move(offset);
    w.host_len = std::move(len);
    step->waves.push_back(std::move(w));
  }
}

absl::Status CudaDevice::PrepareAbsorption(const Absorption& weights) {
  State& s = *s_;
  std::lock_guard<std::mutex> lock(s.mu);
  CUDA_RETURN(cudaSetDevice(ordinal_));
  std::vector<DeviceBuffer> uk(weights.num_layers()), uv(weights.num_layers());
  for (int l = 0; l < weights.num_layers(); ++l) {
    RETURN_IF_ERROR(Upload(uk[l], weights.uk(l), s.stream));
    RETURN_IF_ERROR(Upload(uv[l], weights.uv_t(l), s.stream));
  }
  s.absorb_uk = std::move(uk);
  s.absorb_uv = std::move(uv);
  s.absorb_dn = weights.qk_nope_head_dim();
  s.absorb_v = weights.v_head_dim();
  return absl::OkStatus();
}

absl::Status CudaDevice::SelectedPositions(const StepShare& share, DeviceStep& step,
                                           std::vector<std::vector<int32_t>>* out) {
  State& s = *s_;
  std::lock_guard<std::mutex> lock(s.mu);
  Step& st = static_cast<Step&>(step);
  out->assign(st.n, {});
  if (!st.selected || st.n == 0) return absl::OkStatus();
  CUDA_RETURN(cudaSetDevice(ordinal_));
  std::vector<int32_t> sel(st.n * st.sel_cap), count(st.n);
  CUDA_RETURN(
      cudaMemcpyAsync(sel.data(), st.sel.ptr, sel.size() * 4, cudaMemcpyDeviceToHost, s.stream));
  CUDA_RETURN(cudaMemcpyAsync(count.data(), st.sel_count.ptr, count.size() * 4,
                              cudaMemcpyDeviceToHost, s.stream));
  CUDA_RETURN(cudaStreamSynchronize(s.stream));
  for (int64_t i = 0; i < st.n; ++i)
    if (share.needs_index[i])
      (*out)[i].assign(sel.begin() + i * st.sel_cap, sel.begin() + i * st.sel_cap + count[i]);
  return absl::OkStatus();
}

}  // namespace attnd::cuda
