#include "kernels/cuda/cuda_device.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"

namespace attnd::cuda {
namespace {

#define CUDA_RETURN(expr)                                                            \
  do {                                                                               \
    const cudaError_t attnd_cuda_err_ = (expr);                                      \
    if (attnd_cuda_err_ != cudaSuccess)                                              \
      return absl::InternalError(                                                    \
          absl::StrCat("CUDA: ", #expr, ": ", cudaGetErrorString(attnd_cuda_err_))); \
  } while (0)

int Code(DType t) { return t == DType::kF32 ? 0 : t == DType::kBF16 ? 1 : 2; }

// ATTND_CUDA_MLA=mma selects the bf16 tensor-core MLA kernel for bf16 requests; the SIMT kernel
// stays the default until the tensor-core one has passed the parity tests on a GPU.
bool TensorCoreMla() {
  static const bool on = [] {
    const char* v = std::getenv("ATTND_CUDA_MLA");
    return v != nullptr && std::string(v) == "mma";
  }();
  return on;
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
    CUDA_RETURN(cudaMalloc(&ptr, n));
    bytes = n;
    return absl::OkStatus();
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

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

struct CudaDevice::State {
  ModelSpec spec;
  KvCacheConfig config;
  cudaStream_t stream = nullptr;
  uint8_t* cache = nullptr;  // latent[layer][page][row] | index[slot][page][row]
  size_t latent_bytes = 0, total_bytes = 0;

  // Open steps: plan and IndexShare carry, per step (several steps may be open at once).
  struct StepState {
    StepPlan plan;
    int64_t n = 0;
    int64_t sel_cap = 0;
    DeviceBuffer pos, table_offset, tables, tok_page, tok_off, use_range, sel, sel_count;
    std::vector<uint8_t> use_range_host;
  };
  std::mutex mu;  // one layer at a time per GPU: the scratch below is shared
  std::map<uint64_t, std::unique_ptr<StepState>> steps;
  // The step whose layer runs now (mu held).
  StepState* st = nullptr;
  // Per-layer scratch.
  DeviceBuffer raw, q_lat, q_rope, kv_lat, k_rope, idx_q, idx_k, idx_w, scores, need, need_off,
      need_len, tmp_sel, tmp_count, page_keys, page_off, page_len, page_list, page_count, out_f32,
      out_raw;
  HostBuffer staging;

  size_t RowBytes(int dim) const { return dim * DTypeSize(config.dtype); }
  DevicePaged Latent(int layer) const {
    DevicePaged d;
    d.base = cache + static_cast<size_t>(layer) * config.num_pages * config.page_size *
                         RowBytes(config.latent_dim);
    d.row_stride = RowBytes(config.latent_dim);
    d.page_stride = d.row_stride * config.page_size;
    d.dtype = Code(config.dtype);
    return d;
  }
  DevicePaged Index(int slot) const {
    DevicePaged d;
    d.base = cache + latent_bytes +
             static_cast<size_t>(slot) * config.num_pages * config.page_size *
                 RowBytes(config.index_dim);
    d.row_stride = RowBytes(config.index_dim);
    d.page_stride = d.row_stride * config.page_size;
    d.dtype = Code(config.dtype);
    return d;
  }
  DeviceTables Tables() const {
    DeviceTables t;
    t.tables = st->tables.as<int32_t>();
    t.table_offset = st->table_offset.as<int32_t>();
    t.pos = st->pos.as<int64_t>();
    t.page_size = spec.page_size;
    return t;
  }

  // Gathers this device's rows of `t` into pinned staging, uploads them and converts to fp32.
  absl::Status Rows(const TensorView& t, int64_t row_elems, DeviceBuffer& f32) {
    const size_t es = DTypeSize(t.dtype), row = row_elems * es;
    RETURN_IF_ERROR(staging.Reserve(std::max<size_t>(1, st->n * row)));
    for (int64_t i = 0; i < st->n; ++i)
      std::memcpy(staging.data() + i * row,
                  static_cast<const uint8_t*>(t.data) + st->plan.rows[i] * row, row);
    RETURN_IF_ERROR(raw.Reserve(std::max<size_t>(1, st->n * row)));
    RETURN_IF_ERROR(f32.Reserve(std::max<size_t>(4, st->n * row_elems * 4)));
    CUDA_RETURN(cudaMemcpyAsync(raw.ptr, staging.ptr, st->n * row, cudaMemcpyHostToDevice, stream));
    CUDA_RETURN(LaunchToF32(raw.ptr, Code(t.dtype), f32.as<float>(), st->n * row_elems, stream));
    CUDA_RETURN(cudaStreamSynchronize(stream));  // staging is reused by the next tensor
    return absl::OkStatus();
  }

  absl::Status Write(const DevicePaged& c, const DeviceBuffer& src, int dim, int col) {
    WriteRowsParams w;
    w.src = src.as<float>();
    w.n = static_cast<int>(st->n);
    w.dim = dim;
    w.base = const_cast<uint8_t*>(c.base);
    w.page_stride = c.page_stride;
    w.row_stride = c.row_stride;
    w.dtype = c.dtype;
    w.col_offset = col;
    w.page = st->tok_page.as<int32_t>();
    w.offset = st->tok_off.as<int32_t>();
    CUDA_RETURN(LaunchWriteRows(w, stream));
    return absl::OkStatus();
  }

  absl::Status Select(int layer);
};

absl::StatusOr<std::unique_ptr<CudaDevice>> CudaDevice::Create(int ordinal, const ModelSpec& spec,
                                                               const KvCacheConfig& config) {
  if (ordinal < 0 || ordinal >= DeviceCount())
    return absl::FailedPreconditionError(
        absl::StrCat("cuda:", ordinal, ": no such GPU (", DeviceCount(), " visible)"));
  if (spec.kv_lora_rank > 512)
    return absl::InvalidArgumentError("CUDA backend supports kv_lora_rank <= 512");
  std::unique_ptr<CudaDevice> d(new CudaDevice());
  d->ordinal_ = ordinal;
  d->s_ = std::make_unique<State>();
  State& s = *d->s_;
  s.spec = spec;
  s.config = config;
  CUDA_RETURN(cudaSetDevice(ordinal));
  CUDA_RETURN(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
  s.latent_bytes = static_cast<size_t>(config.num_layers) * config.num_pages * config.page_size *
                   s.RowBytes(config.latent_dim);
  s.total_bytes = s.latent_bytes + static_cast<size_t>(config.num_full_layers) * config.num_pages *
                                       config.page_size * s.RowBytes(config.index_dim);
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, s.total_bytes);
  if (e != cudaSuccess)
    return absl::ResourceExhaustedError(
        absl::StrCat("cuda:", ordinal, ": cannot allocate ", s.total_bytes,
                     " bytes of KV cache: ", cudaGetErrorString(e)));
  s.cache = static_cast<uint8_t*>(p);
  // On `stream` and waited for: a legacy-stream memset is asynchronous to the host and unordered
  // with the non-blocking stream, so it could otherwise overwrite the first steps' writes.
  CUDA_RETURN(cudaMemsetAsync(s.cache, 0, s.total_bytes, s.stream));
  CUDA_RETURN(cudaStreamSynchronize(s.stream));
  return d;
}

CudaDevice::~CudaDevice() {
  if (!s_) return;
  cudaSetDevice(ordinal_);
  if (s_->cache) cudaFree(s_->cache);
  if (s_->stream) cudaStreamDestroy(s_->stream);
}

absl::Status CudaDevice::BeginStep(uint64_t step, const StepPlan& plan) {
  State& s = *s_;
  std::lock_guard<std::mutex> lock(s.mu);
  CUDA_RETURN(cudaSetDevice(ordinal_));
  auto owned = std::make_unique<State::StepState>();
  State::StepState& st = *owned;
  st.plan = plan;
  st.n = static_cast<int64_t>(plan.rows.size());
  std::vector<int32_t> page(st.n), off(st.n);
  int64_t max_visible = 1;
  for (int64_t i = 0; i < st.n; ++i) {
    page[i] = plan.tables[plan.table_offset[i] + plan.pos[i] / s.spec.page_size];
    off[i] = static_cast<int32_t>(plan.pos[i] % s.spec.page_size);
    max_visible = std::max(max_visible, plan.pos[i] + 1);
  }
  int64_t cap = s.spec.index_topk;
  if (s.spec.selection == SelectionMode::kPageUnion)
    cap = int64_t{s.spec.page_union_max_pages + 1} * s.spec.page_size;
  if (s.spec.selection == SelectionMode::kPageBudget)
    cap = int64_t{s.spec.page_budget + 1} * s.spec.page_size;
  st.sel_cap = std::min(cap, max_visible);
  RETURN_IF_ERROR(Upload(st.pos, plan.pos, s.stream));
  RETURN_IF_ERROR(Upload(st.table_offset, plan.table_offset, s.stream));
  RETURN_IF_ERROR(Upload(st.tables, plan.tables, s.stream));
  RETURN_IF_ERROR(Upload(st.tok_page, page, s.stream));
  RETURN_IF_ERROR(Upload(st.tok_off, off, s.stream));
  st.use_range_host.assign(st.n, 1);
  RETURN_IF_ERROR(Upload(st.use_range, st.use_range_host, s.stream));
  RETURN_IF_ERROR(st.sel.Reserve(std::max<size_t>(4, st.n * st.sel_cap * 4)));
  RETURN_IF_ERROR(st.sel_count.Reserve(std::max<size_t>(4, st.n * 4)));
  s.steps[step] = std::move(owned);
  return absl::OkStatus();
}

void CudaDevice::EndStep(uint64_t step) {
  std::lock_guard<std::mutex> lock(s_->mu);
  cudaSetDevice(ordinal_);
  s_->steps.erase(step);
}

absl::Status CudaDevice::State::Select(int layer) {
  const int slot = spec.FullSlot(layer);
  std::vector<int32_t> need_rows;
  std::vector<int64_t> offset, len;
  int64_t total = 0, max_len = 0;
  for (int64_t i = 0; i < st->n; ++i) {
    const int64_t v = st->plan.pos[i] + 1;
    bool all;
    if (st->plan.dense_prefill[i]) {
      all = true;
    } else {
      all = SelectsEveryVisibleKey(spec, v);
    }
    st->use_range_host[i] = all;
    if (all) continue;
    need_rows.push_back(static_cast<int32_t>(i));
    offset.push_back(total);
    len.push_back(v);
    total += v;
    max_len = std::max(max_len, v);
  }
  RETURN_IF_ERROR(Upload(st->use_range, st->use_range_host, stream));
  if (need_rows.empty()) return absl::OkStatus();
  const int nq = static_cast<int>(need_rows.size());
  RETURN_IF_ERROR(Upload(this->need, need_rows, stream));
  RETURN_IF_ERROR(Upload(need_off, offset, stream));
  RETURN_IF_ERROR(Upload(need_len, len, stream));
  RETURN_IF_ERROR(scores.Reserve(total * 4));
  IndexerParams ip;
  ip.q = idx_q.as<float>();
  ip.w = idx_w.as<float>();
  ip.heads = spec.index_n_heads;
  ip.dim = spec.index_head_dim;
  ip.keys = Index(slot);
  ip.tables = Tables();
  ip.queries = this->need.as<int32_t>();
  ip.score_offset = need_off.as<int64_t>();
  ip.nq = nq;
  ip.max_keys = max_len;
  ip.scores = scores.as<float>();
  CUDA_RETURN(LaunchIndexerScores(ip, stream));

  TopKParams tk;
  tk.scores = scores.as<float>();
  tk.row_offset = need_off.as<int64_t>();
  tk.row_len = need_len.as<int64_t>();
  tk.nq = nq;
  if (spec.selection == SelectionMode::kToken) {
    tk.k = spec.index_topk;
    tk.out = st->sel.as<int32_t>();
    tk.out_stride = st->sel_cap;
    tk.out_count = st->sel_count.as<int32_t>();
    tk.out_row = this->need.as<int32_t>();
    CUDA_RETURN(LaunchTopK(tk, stream));
    return absl::OkStatus();
  }
  // Page modes: per-query page keys, the best pages, then their positions.
  std::vector<int64_t> poff(nq);
  int64_t pages_total = 0, max_pages = 0;
  for (int i = 0; i < nq; ++i) {
    poff[i] = pages_total;
    const int64_t np = (len[i] + spec.page_size - 1) / spec.page_size;
    pages_total += np;
    max_pages = std::max(max_pages, np);
  }
  RETURN_IF_ERROR(Upload(page_off, poff, stream));
  RETURN_IF_ERROR(page_keys.Reserve(pages_total * 4));
  CUDA_RETURN(cudaMemsetAsync(page_keys.ptr, 0, pages_total * 4, stream));
  int64_t keep = spec.page_budget;
  if (spec.selection == SelectionMode::kPageUnion) {
    keep = spec.page_union_max_pages;
    const int64_t k = spec.index_topk;
    RETURN_IF_ERROR(tmp_sel.Reserve(nq * k * 4));
    RETURN_IF_ERROR(tmp_count.Reserve(nq * 4));
    tk.k = k;
    tk.out = tmp_sel.as<int32_t>();
    tk.out_stride = k;
    tk.out_count = tmp_count.as<int32_t>();
    CUDA_RETURN(LaunchTopK(tk, stream));
    PageHitParams ph;
    ph.scores = scores.as<float>();
    ph.row_offset = need_off.as<int64_t>();
    ph.selected = tmp_sel.as<int32_t>();
    ph.selected_count = tmp_count.as<int32_t>();
    ph.sel_stride = k;
    ph.page_offset = page_off.as<int64_t>();
    ph.nq = nq;
    ph.page_size = spec.page_size;
    ph.max_sel = k;
    ph.page_keys = page_keys.as<uint32_t>();
    CUDA_RETURN(LaunchPageHits(ph, stream));
  } else {
    PageMaxParams pm;
    pm.scores = scores.as<float>();
    pm.row_offset = need_off.as<int64_t>();
    pm.row_len = need_len.as<int64_t>();
    pm.page_offset = page_off.as<int64_t>();
    pm.nq = nq;
    pm.page_size = spec.page_size;
    pm.max_pages = max_pages;
    pm.page_keys = page_keys.as<uint32_t>();
    CUDA_RETURN(LaunchPageMax(pm, stream));
  }
  std::vector<int64_t> npages(nq);
  for (int i = 0; i < nq; ++i) npages[i] = (len[i] + spec.page_size - 1) / spec.page_size;
  RETURN_IF_ERROR(Upload(page_len, npages, stream));
  RETURN_IF_ERROR(page_list.Reserve(nq * keep * 4));
  RETURN_IF_ERROR(page_count.Reserve(nq * 4));
  TopKParams pk;
  pk.keys = page_keys.as<uint32_t>();
  pk.row_offset = page_off.as<int64_t>();
  pk.row_len = page_len.as<int64_t>();
  pk.nq = nq;
  pk.k = keep;
  pk.drop_zero = true;
  pk.out = page_list.as<int32_t>();
  pk.out_stride = keep;
  pk.out_count = page_count.as<int32_t>();
  CUDA_RETURN(LaunchTopK(pk, stream));
  ExpandParams ex;
  ex.pages = page_list.as<int32_t>();
  ex.page_count = page_count.as<int32_t>();
  ex.page_stride = keep;
  ex.row_len = need_len.as<int64_t>();
  ex.nq = nq;
  ex.page_size = spec.page_size;
  ex.out = st->sel.as<int32_t>();
  ex.out_stride = st->sel_cap;
  ex.out_count = st->sel_count.as<int32_t>();
  ex.out_row = this->need.as<int32_t>();
  CUDA_RETURN(LaunchExpandPages(ex, stream));
  return absl::OkStatus();
}

absl::Status CudaDevice::RunLayer(uint64_t step, const LayerCall& call) {
  State& s = *s_;
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.steps.find(step);
  if (it == s.steps.end()) return absl::InternalError("CUDA device: unknown step");
  s.st = it->second.get();
  State::StepState& st = *s.st;
  CUDA_RETURN(cudaSetDevice(ordinal_));
  const ModelSpec& sp = s.spec;
  const int H = sp.num_heads, L = sp.kv_lora_rank, R = sp.qk_rope_head_dim;
  const int Hi = sp.index_n_heads, Di = sp.index_head_dim;
  const LayerKind kind = sp.layers[call.layer];
  const LayerInputs& in = *call.in;
  if (st.n == 0) return absl::OkStatus();
  // 1. Keys into the caches.
  RETURN_IF_ERROR(s.Rows(in.kv_latent, L, s.kv_lat));
  RETURN_IF_ERROR(s.Write(s.Latent(call.layer), s.kv_lat, L, 0));
  RETURN_IF_ERROR(s.Rows(in.k_rope, R, s.k_rope));
  RETURN_IF_ERROR(s.Write(s.Latent(call.layer), s.k_rope, R, L));
  if (kind == LayerKind::kFull) {
    RETURN_IF_ERROR(s.Rows(in.index_k, Di, s.idx_k));
    RETURN_IF_ERROR(s.Write(s.Index(sp.FullSlot(call.layer)), s.idx_k, Di, 0));
  }
  if (call.out == nullptr) {  // write-only step
    CUDA_RETURN(cudaStreamSynchronize(s.stream));
    return absl::OkStatus();
  }
  // 2. Selection (full layers), kept on the device for the shared layers that follow.
  if (kind == LayerKind::kFull) {
    RETURN_IF_ERROR(s.Rows(in.index_q, int64_t{Hi} * Di, s.idx_q));
    RETURN_IF_ERROR(s.Rows(in.index_w, Hi, s.idx_w));
    RETURN_IF_ERROR(s.Select(call.layer));
  }
  // 3. Attention.
  RETURN_IF_ERROR(s.Rows(in.q_latent, int64_t{H} * L, s.q_lat));
  RETURN_IF_ERROR(s.Rows(in.q_rope, int64_t{H} * R, s.q_rope));
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
  mp.tables = s.Tables();
  if (kind == LayerKind::kDense) {
    mp.window = sp.sliding_window;
    mp.soft_cap = static_cast<float>(sp.soft_cap);
  } else {
    mp.sel = st.sel.as<int32_t>();
    mp.sel_count = st.sel_count.as<int32_t>();
    mp.use_range = st.use_range.as<uint8_t>();
    mp.sel_stride = st.sel_cap;
  }
  mp.out = s.out_f32.as<float>();
  mp.tensor_cores =
      TensorCoreMla() && in.q_latent.dtype == DType::kBF16 && in.q_rope.dtype == DType::kBF16;
  CUDA_RETURN(LaunchMla(mp, s.stream));
  // 4. Output rows back in the request's dtype.
  const size_t es = DTypeSize(call.out_dtype), row = size_t{static_cast<size_t>(H)} * L * es;
  RETURN_IF_ERROR(s.out_raw.Reserve(st.n * row));
  CUDA_RETURN(LaunchFromF32(s.out_f32.as<float>(), Code(call.out_dtype), s.out_raw.ptr,
                            st.n * H * L, s.stream));
  RETURN_IF_ERROR(s.staging.Reserve(st.n * row));
  CUDA_RETURN(
      cudaMemcpyAsync(s.staging.ptr, s.out_raw.ptr, st.n * row, cudaMemcpyDeviceToHost, s.stream));
  CUDA_RETURN(cudaStreamSynchronize(s.stream));
  for (int64_t i = 0; i < st.n; ++i)
    std::memcpy(call.out + st.plan.rows[i] * row, s.staging.data() + i * row, row);
  if (call.trace) {
    std::vector<int32_t> sel(st.n * st.sel_cap), count(st.n);
    CUDA_RETURN(cudaMemcpy(sel.data(), st.sel.ptr, sel.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_RETURN(
        cudaMemcpy(count.data(), st.sel_count.ptr, count.size() * 4, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < st.n; ++i) {
      auto& k = (*call.trace)[st.plan.rows[i]];
      k.clear();
      if (kind == LayerKind::kDense || st.use_range_host[i]) {
        for (int64_t j = FirstVisibleKey(sp, kind, st.plan.pos[i]); j <= st.plan.pos[i]; ++j)
          k.push_back(static_cast<int32_t>(j));
      } else {
        k.assign(sel.begin() + i * st.sel_cap, sel.begin() + i * st.sel_cap + count[i]);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CudaDevice::CopyPagePrefix(int32_t src, int32_t dst, int rows) {
  return CopyPagePrefixTo(*this, src, dst, rows);
}

absl::Status CudaDevice::CopyPagePrefixTo(CudaDevice& d, int32_t src, int32_t dst, int rows) {
  State& s = *s_;
  if (rows <= 0) return absl::OkStatus();
  CUDA_RETURN(cudaSetDevice(ordinal_));
  for (const Span& sp : PageCopySpans(d, src, dst, rows))
    CUDA_RETURN(cudaMemcpyPeerAsync(sp.dst, d.ordinal_, sp.src, ordinal_, sp.bytes, s.stream));
  CUDA_RETURN(cudaStreamSynchronize(s.stream));
  return absl::OkStatus();
}

absl::Status CudaDevice::ReadPage(int32_t page, int rows, std::vector<uint8_t>* host) {
  State& s = *s_;
  CUDA_RETURN(cudaSetDevice(ordinal_));
  const size_t lat = rows * s.RowBytes(s.config.latent_dim),
               idx = rows * s.RowBytes(s.config.index_dim);
  host->resize(s.config.num_layers * lat + s.config.num_full_layers * idx);
  // On the device's stream (ordered after its kernels), then waited for.
  for (int l = 0; l < s.config.num_layers; ++l)
    CUDA_RETURN(cudaMemcpyAsync(host->data() + l * lat,
                                s.Latent(l).base + page * s.Latent(l).page_stride, lat,
                                cudaMemcpyDeviceToHost, s.stream));
  for (int k = 0; k < s.config.num_full_layers; ++k)
    CUDA_RETURN(cudaMemcpyAsync(host->data() + s.config.num_layers * lat + k * idx,
                                s.Index(k).base + page * s.Index(k).page_stride, idx,
                                cudaMemcpyDeviceToHost, s.stream));
  CUDA_RETURN(cudaStreamSynchronize(s.stream));
  return absl::OkStatus();
}

absl::Status CudaDevice::WritePage(int32_t page, int rows, const std::vector<uint8_t>& host) {
  State& s = *s_;
  CUDA_RETURN(cudaSetDevice(ordinal_));
  const size_t lat = rows * s.RowBytes(s.config.latent_dim),
               idx = rows * s.RowBytes(s.config.index_dim);
  if (host.size() != s.config.num_layers * lat + s.config.num_full_layers * idx)
    return absl::InternalError("CUDA WritePage: staging size mismatch");
  // On the device's stream, then waited for: a pageable cudaMemcpy may return before its DMA
  // lands, and the legacy stream is unordered with the (non-blocking) stream the kernels use.
  for (int l = 0; l < s.config.num_layers; ++l)
    CUDA_RETURN(
        cudaMemcpyAsync(const_cast<uint8_t*>(s.Latent(l).base) + page * s.Latent(l).page_stride,
                        host.data() + l * lat, lat, cudaMemcpyHostToDevice, s.stream));
  for (int k = 0; k < s.config.num_full_layers; ++k)
    CUDA_RETURN(cudaMemcpyAsync(
        const_cast<uint8_t*>(s.Index(k).base) + page * s.Index(k).page_stride,
        host.data() + s.config.num_layers * lat + k * idx, idx, cudaMemcpyHostToDevice, s.stream));
  CUDA_RETURN(cudaStreamSynchronize(s.stream));
  return absl::OkStatus();
}

std::vector<CudaDevice::Span> CudaDevice::PageCopySpans(CudaDevice& d, int32_t src, int32_t dst,
                                                        int rows) {
  State& s = *s_;
  std::vector<Span> spans;
  for (int l = 0; l < s.config.num_layers; ++l) {
    const DevicePaged a = s.Latent(l), b = d.s_->Latent(l);
    spans.push_back({a.base + src * a.page_stride,
                     const_cast<uint8_t*>(b.base) + dst * b.page_stride, rows * a.row_stride});
  }
  for (int k = 0; k < s.config.num_full_layers; ++k) {
    const DevicePaged a = s.Index(k), b = d.s_->Index(k);
    spans.push_back({a.base + src * a.page_stride,
                     const_cast<uint8_t*>(b.base) + dst * b.page_stride, rows * a.row_stride});
  }
  return spans;
}

bool CudaDevice::ReservedPageUntouched() {
  State& s = *s_;
  if (cudaSetDevice(ordinal_) != cudaSuccess) return false;
  std::vector<uint8_t> host;
  if (!ReadPage(0, s.config.page_size, &host).ok()) return false;
  return std::all_of(host.begin(), host.end(), [](uint8_t b) { return b == 0; });
}

}  // namespace attnd::cuda
