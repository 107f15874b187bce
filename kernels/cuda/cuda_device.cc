#include "kernels/cuda/cuda_device.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/nccl_peer.h"
#include "kernels/fp8_rows.h"
#include "kernels/selection.h"

namespace attnd::cuda {
namespace {

#define CUDA_RETURN(expr)                                                            \
  do {                                                                               \
    const cudaError_t attnd_cuda_err_ = (expr);                                      \
    if (attnd_cuda_err_ != cudaSuccess)                                              \
      return absl::InternalError(                                                    \
          absl::StrCat("CUDA: ", #expr, ": ", cudaGetErrorString(attnd_cuda_err_))); \
  } while (0)

// The most keys any query of a share can attend (its position + 1 bounds every mode).
int64_t MaxKeys(const StepShare& share) {
  int64_t most = 1;
  for (const int64_t p : share.pos) most = std::max(most, p + 1);
  return most;
}

// Bounds one wave of indexer scores (floats): 64 MiB of GPU scratch.
constexpr int64_t kMaxScoreFloats = int64_t{16} << 20;

// bf16 requests take the tensor-core kernels (MLA and indexer); ATTND_CUDA_MLA=simt and
// ATTND_CUDA_INDEXER=simt select the SIMT ones instead (gpu-check runs both; any other value
// keeps the default). SetTensorCoreMla / SetTensorCoreIndexer override them in tests.
bool FromEnv(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr || std::string(v) != "simt";
}
std::atomic<int> g_tensor_core_mla{-1};  // -1: from the environment
bool TensorCoreMla() {
  static const bool from_env = FromEnv("ATTND_CUDA_MLA");
  const int set = g_tensor_core_mla.load();
  return set < 0 ? from_env : set == 1;
}
std::atomic<int> g_tensor_core_indexer{-1};
bool TensorCoreIndexer() {
  static const bool from_env = FromEnv("ATTND_CUDA_INDEXER");
  const int set = g_tensor_core_indexer.load();
  return set < 0 ? from_env : set == 1;
}

// A device allocation that only grows: no allocation per layer once warm.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  absl::Status Reserve(size_t n) {
    if (n <= bytes) return absl::OkStatus();
    if (ptr) cudaFree(ptr);
    ptr = nullptr;
    bytes = 0;
    const cudaError_t e = cudaMalloc(&ptr, n);
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      ptr = nullptr;
      return absl::ResourceExhaustedError(
          absl::StrCat("GPU memory: cannot allocate ", n, " bytes of scratch"));
    }
    CUDA_RETURN(e);
    bytes = n;
    return absl::OkStatus();
  }
  void Release() {
    if (ptr) cudaFree(ptr);
    ptr = nullptr;
    bytes = 0;
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
};

// Pinned host staging, grown on demand.
struct HostBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  absl::Status Reserve(size_t n) {
    if (n <= bytes) return absl::OkStatus();
    if (ptr) cudaFreeHost(ptr);
    ptr = nullptr;
    bytes = 0;
    CUDA_RETURN(cudaMallocHost(&ptr, n));
    bytes = n;
    return absl::OkStatus();
  }
  uint8_t* data() const { return static_cast<uint8_t*>(ptr); }
  ~HostBuffer() {
    if (ptr) cudaFreeHost(ptr);
  }
};

template <typename T>
absl::Status Upload(DeviceBuffer& dst, const std::vector<T>& src, cudaStream_t s) {
  RETURN_IF_ERROR(dst.Reserve(std::max<size_t>(1, src.size() * sizeof(T))));
  if (!src.empty())
    CUDA_RETURN(
        cudaMemcpyAsync(dst.ptr, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice, s));
  // Pageable source: synchronise so the vector may change afterwards.
  CUDA_RETURN(cudaStreamSynchronize(s));
  return absl::OkStatus();
}

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

void SetTensorCoreMla(bool on) { g_tensor_core_mla = on ? 1 : 0; }
void SetTensorCoreIndexer(bool on) { g_tensor_core_indexer = on ? 1 : 0; }

// A step's share on this GPU: its uploaded plan and its kept selection (IndexShare carry).
struct CudaDevice::Step final : DeviceStep {
  explicit Step(int gpu) : ordinal(gpu) {}
  // The buffers are freed on their own GPU, whichever thread ends the step.
  ~Step() override { cudaSetDevice(ordinal); }
  int ordinal = 0;
  int64_t n = 0;
  int64_t sel_cap = 0;
  int32_t page_size = 0;
  int64_t max_keys = 1;  // the most keys any query attends (position + 1)
  DeviceBuffer pos, seq, indptr, pages, slot, needs_index;
  DeviceBuffer sel, sel_slots, sel_count;  // [n, sel_cap] positions and slot ids, [n] counts
  bool selected = false;                   // a full layer has run
  // The indexer's queries in waves whose score rows fit kMaxScoreFloats, planned and uploaded
  // once per step (every full layer reuses them).
  struct Wave {
    int nq = 0;
    int64_t total = 0, max_len = 0, pages_total = 0, max_pages = 0;
    DeviceBuffer rows, offset, len;   // [nq] local token, score offset, visible keys
    DeviceBuffer page_offset, pages;  // [nq] page-key offset, pages (page modes)
    std::vector<int32_t> host_rows;   // rows, offset and len on the host (candidates)
    std::vector<int64_t> host_offset, host_len;
  };
  std::vector<std::unique_ptr<Wave>> waves;
  QueryTables Tables() const {
    QueryTables t;
    t.table.indptr = indptr.as<int32_t>();
    t.table.pages = pages.as<int32_t>();
    t.table.page_size = page_size;
    t.seq = seq.as<int32_t>();
    t.pos = pos.as<int64_t>();
    return t;
  }
};

struct CudaDevice::State {
  ModelSpec spec;
  CacheLayout layout;
  cudaStream_t stream = nullptr;       // layers (mu held)
  cudaStream_t copy_stream = nullptr;  // page reads, writes and copies (copy_mu held)
  uint8_t* cache = nullptr;            // CacheLayout's one allocation
  std::mutex mu;                       // one layer at a time per GPU: the scratch below is shared
  std::mutex copy_mu;
  // Per-layer scratch.
  DeviceBuffer raw, q_lat, q_rope, kv_lat, k_rope, idx_q, idx_k, idx_w, scores, tmp_sel, tmp_count,
      page_keys, page_list, page_count, out_f32, out_raw, lse;
  DeviceBuffer part_out, part_ml;  // split-K partials of the tensor-core MLA
  DeviceBuffer q_nope, out_v;      // absorbed calls: q_nope and the values, fp32
  HostBuffer staging;
  // Server-side absorption: every layer's W_UK [H, Dn, L] and W_UV^T [H, L, V] (PrepareAbsorption).
  std::vector<DeviceBuffer> absorb_uk, absorb_uv;
  int absorb_dn = 0, absorb_v = 0;
  int sms = 1;                // multiprocessors: how many split-K blocks fill the GPU
  size_t scratch_budget = 0;  // the most per-layer scratch a step may need (bytes)

  CacheRows Latent(int layer) const { return layout.Latent(cache, layer); }
  CacheRows Index(int slot) const { return layout.Index(cache, slot); }

  // Plans the step's indexer waves from its share and uploads them (mu held).
  absl::Status PlanWaves(const StepShare& share, Step* step);
  // Grows the per-layer scratch to what a layer of `share` needs (mu held): a step that cannot
  // fit fails at BeginStep with RESOURCE_EXHAUSTED, never in the middle of a layer.
  absl::Status ReserveScratch(const StepShare& share);
  // Copies between a page's rows and host memory on the copy stream, then waits (copy_mu held).
  absl::Status PageToHost(int32_t page, int rows, uint8_t* staged);
  absl::Status HostToPage(int32_t page, int rows, const uint8_t* staged);
};

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
  // The kernels must have code for this GPU (a fat binary for sm_80 and sm_90, PTX for newer).
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
  CUDA_RETURN(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
  CUDA_RETURN(cudaStreamCreateWithFlags(&s.copy_stream, cudaStreamNonBlocking));
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
  if (s_->stream) cudaStreamDestroy(s_->stream);
  if (s_->copy_stream) cudaStreamDestroy(s_->copy_stream);
}

absl::Status CudaDevice::State::ReserveScratch(const StepShare& share) {
  const size_t n = std::max<size_t>(1, share.size());
  const size_t H = spec.num_heads, L = spec.kv_lora_rank, R = spec.qk_rope_head_dim;
  const size_t Hi = spec.index_n_heads, Di = spec.index_head_dim;
  // The widest row of any layer tensor, in the widest wire dtype (fp32).
  const size_t row = 4 * std::max({H * L, H * R, Hi * Di, L, R, Di, Hi});
  int64_t need_keys = 0;  // one wave's score rows
  for (int64_t i = 0; i < share.size(); ++i)
    if (share.needs_index[i]) need_keys = std::min(need_keys + share.pos[i] + 1, kMaxScoreFloats);
  const size_t k = static_cast<size_t>(std::max<int64_t>(1, spec.index_topk));
  const size_t keep =
      static_cast<size_t>(std::max({1, spec.page_budget, spec.page_union_max_pages}));
  const size_t pages = need_keys / spec.page_size + n;  // a wave's page keys
  // Split-K partials, sized for the smaller blocks (the most splits).
  const size_t splits = MlaSplits(static_cast<int>(n), spec.num_heads, sms, MaxKeys(share), 16);
  const std::pair<DeviceBuffer*, size_t> want[] = {
      {&raw, n * row},
      {&q_lat, n * H * L * 4},
      {&q_rope, n * H * R * 4},
      {&kv_lat, n * L * 4},
      {&k_rope, n * R * 4},
      {&idx_q, n * Hi * Di * 4},
      {&idx_k, n * Di * 4},
      {&idx_w, n * Hi * 4},
      {&out_f32, n * H * L * 4},
      {&out_raw, n * H * std::max<size_t>(L, absorb_v) * 4},
      {&q_nope, std::max<size_t>(4, n * H * absorb_dn * 4)},
      {&out_v, std::max<size_t>(4, n * H * absorb_v * 4)},
      {&lse, n * H * 4},
      {&scores, std::max<size_t>(4, need_keys * 4)},
      {&tmp_sel, n * k * 4},
      {&tmp_count, n * 4},
      {&page_keys, pages * 4},
      {&page_list, n * keep * 4},
      {&page_count, n * 4},
      {&part_out, splits > 1 ? splits * n * H * L * 4 : 4},
      {&part_ml, splits > 1 ? splits * n * H * 2 * 4 : 4}};
  // The step's own selection buffers (positions and slot ids) count too.
  size_t total = 2 * n * static_cast<size_t>(std::max<int64_t>(1, share.max_selected)) * 4;
  for (const auto& [buf, bytes] : want) total += bytes;
  if (total > scratch_budget)
    return absl::ResourceExhaustedError(
        absl::StrCat("a step of ", share.size(), " tokens needs about ", total >> 20,
                     " MiB of GPU scratch beyond the KV cache, over the ", scratch_budget >> 20,
                     " MiB budget (--gpu-scratch-bytes); send smaller steps"));
  total = 0;
  for (const auto& [buf, bytes] : want) {
    total += bytes;
    if (absl::Status r = buf->Reserve(bytes); !r.ok()) {
      for (const auto& w : want) w.first->Release();  // give back what this attempt grew
      return absl::ResourceExhaustedError(absl::StrCat(
          "a step of ", share.size(), " tokens needs about ", total >> 20,
          " MiB of GPU scratch beyond the KV cache: ", r.message(), "; send smaller steps"));
    }
  }
  return staging.Reserve(n * row);
}

absl::StatusOr<std::unique_ptr<DeviceStep>> CudaDevice::BeginStep(const StepShare& share) {
  State& s = *s_;
  std::lock_guard<std::mutex> lock(s.mu);
  CUDA_RETURN(cudaSetDevice(ordinal_));
  RETURN_IF_ERROR(s.ReserveScratch(share));
  auto st = std::make_unique<Step>(ordinal_);
  st->n = share.size();
  st->sel_cap = std::max<int64_t>(1, share.max_selected);
  st->page_size = share.page_size;
  st->max_keys = MaxKeys(share);
  RETURN_IF_ERROR(s.PlanWaves(share, st.get()));
  RETURN_IF_ERROR(Upload(st->pos, share.pos, s.stream));
  RETURN_IF_ERROR(Upload(st->seq, share.seq, s.stream));
  RETURN_IF_ERROR(Upload(st->indptr, share.indptr, s.stream));
  RETURN_IF_ERROR(Upload(st->pages, share.pages, s.stream));
  RETURN_IF_ERROR(Upload(st->slot, share.slot, s.stream));
  RETURN_IF_ERROR(Upload(st->needs_index, share.needs_index, s.stream));
  RETURN_IF_ERROR(st->sel.Reserve(std::max<size_t>(4, st->n * st->sel_cap * 4)));
  RETURN_IF_ERROR(st->sel_slots.Reserve(std::max<size_t>(4, st->n * st->sel_cap * 4)));
  RETURN_IF_ERROR(st->sel_count.Reserve(std::max<size_t>(4, st->n * 4)));
  // Rows that never select keep count 0 (PositionsToSlots and traces read every row).
  CUDA_RETURN(cudaMemsetAsync(st->sel_count.ptr, 0, st->sel_count.bytes, s.stream));
  CUDA_RETURN(cudaStreamSynchronize(s.stream));
  return std::unique_ptr<DeviceStep>(std::move(st));
}

absl::Status CudaDevice::State::PlanWaves(const StepShare& share, Step* step) {
  for (int64_t i = 0; i < share.size();) {
    std::vector<int32_t> rows;
    std::vector<int64_t> offset, len, page_offset, pages;
    auto w = std::make_unique<Step::Wave>();
    for (; i < share.size(); ++i) {
      if (!share.needs_index[i]) continue;
      const int64_t v = share.pos[i] + 1;
      if (!rows.empty() && w->total + v > kMaxScoreFloats) break;
      const int64_t np = (v + spec.page_size - 1) / spec.page_size;
      rows.push_back(static_cast<int32_t>(i));
      offset.push_back(w->total);
      len.push_back(v);
      page_offset.push_back(w->pages_total);
      pages.push_back(np);
      w->total += v;
      w->max_len = std::max(w->max_len, v);
      w->pages_total += np;
      w->max_pages = std::max(w->max_pages, np);
    }
    if (rows.empty()) break;
    w->nq = static_cast<int>(rows.size());
    RETURN_IF_ERROR(Upload(w->rows, rows, stream));
    RETURN_IF_ERROR(Upload(w->offset, offset, stream));
    RETURN_IF_ERROR(Upload(w->len, len, stream));
    RETURN_IF_ERROR(Upload(w->page_offset, page_offset, stream));
    RETURN_IF_ERROR(Upload(w->pages, pages, stream));
    w->host_rows = std::move(rows);
    w->host_offset = std::move(offset);
    w->host_len = std::move(len);
    step->waves.push_back(std::move(w));
  }
  return absl::OkStatus();
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

absl::StatusOr<std::unique_ptr<LayerRun>> CudaDevice::StartLayer(const StepShare& share,
                                                                 DeviceStep& step,
                                                                 const LayerCall& call) {
  auto run = std::make_unique<Call>(*s_, share, static_cast<Step&>(step), call);  // locks s_->mu
  CUDA_RETURN(cudaSetDevice(ordinal_));
  return std::unique_ptr<LayerRun>(std::move(run));
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
  if (MlaUsesTensorCores(mp)) {  // flash-decoding when the batch alone cannot fill the GPU
    mp.splits = MlaSplits(mp.n, H, s.sms, st.max_keys, MlaHeadsPerBlock(mp));
    RETURN_IF_ERROR(s.part_out.Reserve(size_t(mp.splits) * st.n * H * L * 4));
    RETURN_IF_ERROR(s.part_ml.Reserve(size_t(mp.splits) * st.n * H * 2 * 4));
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

absl::Status CudaDevice::ReadRows(int layer, int slot, int32_t page, int first, int rows,
                                  uint8_t* latent, uint8_t* index) {
  State& s = *s_;
  std::lock_guard<std::mutex> lock(s.copy_mu);
  CUDA_RETURN(cudaSetDevice(ordinal_));
  const int64_t at = int64_t{page} * s.layout.page_size + first;
  CUDA_RETURN(cudaMemcpyAsync(latent, s.Latent(layer).Row(at), rows * s.layout.latent_row_bytes(),
                              cudaMemcpyDeviceToHost, s.copy_stream));
  if (slot >= 0) {
    const uint8_t* page_start = s.cache + s.layout.IndexPageOffset(slot, page);
    for (const auto& r : s.layout.IndexRanges(first, rows)) {
      if (r.bytes)
        CUDA_RETURN(cudaMemcpyAsync(index, page_start + r.offset, r.bytes, cudaMemcpyDeviceToHost,
                                    s.copy_stream));
      index += r.bytes;
    }
  }
  CUDA_RETURN(cudaStreamSynchronize(s.copy_stream));
  return absl::OkStatus();
}

absl::Status CudaDevice::State::PageToHost(int32_t page, int rows, uint8_t* staged) {
  const int64_t at = int64_t{page} * layout.page_size;
  for (int l = 0; l < layout.num_layers; ++l)
    CUDA_RETURN(cudaMemcpyAsync(staged + layout.StagedLatent(l, rows), Latent(l).Row(at),
                                rows * layout.latent_row_bytes(), cudaMemcpyDeviceToHost,
                                copy_stream));
  for (int k = 0; k < layout.num_full_layers; ++k) {
    uint8_t* to = staged + layout.StagedIndex(k, rows);
    for (const auto& r : layout.IndexRanges(0, rows)) {
      if (r.bytes)
        CUDA_RETURN(cudaMemcpyAsync(to, cache + layout.IndexPageOffset(k, page) + r.offset, r.bytes,
                                    cudaMemcpyDeviceToHost, copy_stream));
      to += r.bytes;
    }
  }
  CUDA_RETURN(cudaStreamSynchronize(copy_stream));
  return absl::OkStatus();
}

absl::Status CudaDevice::State::HostToPage(int32_t page, int rows, const uint8_t* staged) {
  // On the copy stream, then waited for: a pageable copy may return before its DMA lands.
  const int64_t at = int64_t{page} * layout.page_size;
  for (int l = 0; l < layout.num_layers; ++l)
    CUDA_RETURN(cudaMemcpyAsync(Latent(l).MutableRow(at), staged + layout.StagedLatent(l, rows),
                                rows * layout.latent_row_bytes(), cudaMemcpyHostToDevice,
                                copy_stream));
  for (int k = 0; k < layout.num_full_layers; ++k) {
    const uint8_t* from = staged + layout.StagedIndex(k, rows);
    for (const auto& r : layout.IndexRanges(0, rows)) {
      if (r.bytes)
        CUDA_RETURN(cudaMemcpyAsync(cache + layout.IndexPageOffset(k, page) + r.offset, from,
                                    r.bytes, cudaMemcpyHostToDevice, copy_stream));
      from += r.bytes;
    }
  }
  CUDA_RETURN(cudaStreamSynchronize(copy_stream));
  return absl::OkStatus();
}

absl::Status CudaDevice::ReadPage(int32_t page, int rows, uint8_t* staged) {
  std::lock_guard<std::mutex> lock(s_->copy_mu);
  CUDA_RETURN(cudaSetDevice(ordinal_));
  return s_->PageToHost(page, rows, staged);
}

absl::Status CudaDevice::WritePage(int32_t page, int rows, const uint8_t* staged) {
  std::lock_guard<std::mutex> lock(s_->copy_mu);
  CUDA_RETURN(cudaSetDevice(ordinal_));
  return s_->HostToPage(page, rows, staged);
}

absl::Status CudaDevice::CopyPages(Device& dst, const std::vector<PageCopy>& copies) {
  auto* to = dynamic_cast<CudaDevice*>(&dst);
  if (to == nullptr) return Device::CopyPages(dst, copies);  // to the host through staging
  State& a = *s_;
  const State& b = *to->s_;
  // Every layer's and slot's rows of each page prefix: contiguous spans.
  std::vector<NcclPeers::Transfer> spans;
  for (const PageCopy& c : copies) {
    if (c.rows <= 0) continue;
    const int64_t from = int64_t{c.src} * a.layout.page_size,
                  into = int64_t{c.dst} * a.layout.page_size;
    for (int l = 0; l < a.layout.num_layers; ++l)
      spans.push_back({a.Latent(l).Row(from), b.Latent(l).MutableRow(into),
                       c.rows * a.layout.latent_row_bytes()});
    for (int k = 0; k < a.layout.num_full_layers; ++k)
      for (const auto& r : a.layout.IndexRanges(0, c.rows))
        if (r.bytes)
          spans.push_back({a.cache + a.layout.IndexPageOffset(k, c.src) + r.offset,
                           b.cache + b.layout.IndexPageOffset(k, c.dst) + r.offset, r.bytes});
  }
  if (to != this && nccl_ && nccl_ == to->nccl_)
    return nccl_->Move(nccl_rank_, to->nccl_rank_, spans);
  std::lock_guard<std::mutex> lock(a.copy_mu);
  CUDA_RETURN(cudaSetDevice(ordinal_));
  for (const NcclPeers::Transfer& t : spans)
    CUDA_RETURN(cudaMemcpyPeerAsync(t.dst, to->ordinal_, t.src, ordinal_, t.bytes, a.copy_stream));
  CUDA_RETURN(cudaStreamSynchronize(a.copy_stream));
  return absl::OkStatus();
}

absl::StatusOr<bool> CudaDevice::ReservedPageUntouched() {
  std::vector<uint8_t> host(layout().StagedBytes(layout().page_size));
  RETURN_IF_ERROR(ReadPage(0, layout().page_size, host.data()));
  return std::all_of(host.begin(), host.end(), [](uint8_t b) { return b == 0; });
}

void ConnectPeers(const std::vector<CudaDevice*>& gpus) {
  std::vector<int> ordinals;
  for (const CudaDevice* g : gpus) ordinals.push_back(g->ordinal());
  auto peers = NcclPeers::Create(ordinals);
  if (!peers.ok()) {  // cudaMemcpyPeer still works; say why NCCL is not used
    std::fprintf(stderr, "attnd: page moves between GPUs use cudaMemcpyPeer: %s\n",
                 std::string(peers.status().message()).c_str());
    return;
  }
  std::shared_ptr<NcclPeers> shared = std::move(peers).value();
  for (size_t i = 0; i < gpus.size(); ++i) {
    gpus[i]->nccl_ = shared;
    gpus[i]->nccl_rank_ = static_cast<int>(i);
  }
}

}  // namespace attnd::cuda
