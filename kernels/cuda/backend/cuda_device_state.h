// The CUDA device's internals, shared by its sources (cuda_device.cc: creation, steps and
// absorption; cuda_layer.cc: one RunLayer call; cuda_pages.cc: page reads, writes and copies
// between GPUs): growing device and pinned host buffers, a step's state on the GPU and the GPU's
// state. Not for use outside kernels/cuda/.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/status_macros.h"
#include "kernels/cuda/backend/cublas_loader.h"
#include "kernels/cuda/backend/cuda_device.h"
#include "kernels/cuda/ops/cuda_kernels.h"
#include "kernels/cuda/ops/mla_flashinfer_plan.h"

#define CUDA_RETURN(expr)                                                            \
  do {                                                                               \
    const cudaError_t attnd_cuda_err_ = (expr);                                      \
    if (attnd_cuda_err_ != cudaSuccess) {                                            \
      cudaGetLastError(); /* not left for this thread's next call to report */       \
      return absl::InternalError(                                                    \
          absl::StrCat("CUDA: ", #expr, ": ", cudaGetErrorString(attnd_cuda_err_))); \
    }                                                                                \
  } while (0)

namespace attnd::cuda {

// Which kernel forms run: kernels/cuda/backend/kernel_choice.h.

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
    const cudaError_t e = cudaMallocHost(&ptr, n);
    if (e == cudaErrorMemoryAllocation) {  // a pod's memory limit, say: not a CUDA fault
      cudaGetLastError();                  // or the thread's next launch would report it
      ptr = nullptr;
      return absl::ResourceExhaustedError(
          absl::StrCat("pinned host memory: cannot allocate ", n, " bytes of staging"));
    }
    CUDA_RETURN(e);
    bytes = n;
    return absl::OkStatus();
  }
  uint8_t* data() const { return static_cast<uint8_t*>(ptr); }
  ~HostBuffer() {
    if (ptr) cudaFreeHost(ptr);
  }
};

// On an early (error) return, waits for what was queued on `stream` of GPU `device` (-1: the
// current one) before the caller frees the pages, slots or buffers that work reads or writes (a
// stale copy landing on pages handed to another sequence, or a DMA reading a slot reused); the
// normal path synchronises itself and calls Dismiss().
class DrainOnError {
 public:
  explicit DrainOnError(cudaStream_t stream, int device = -1) : device_(device), stream_(stream) {
    if (device_ < 0 && cudaGetDevice(&device_) != cudaSuccess) {
      cudaGetLastError();
      device_ = 0;
    }
  }
  DrainOnError(const DrainOnError&) = delete;
  DrainOnError& operator=(const DrainOnError&) = delete;
  ~DrainOnError() {
    if (stream_ == nullptr) return;
    int was = -1;
    const bool had = cudaGetDevice(&was) == cudaSuccess;
    cudaSetDevice(device_);
    // Bounded: after a failed NCCL call a queued receive may never complete, and a wait for it
    // would hold the copy locks for good. A stream not drained in 30 s is reported (the GPU's
    // later work fails or the operator restarts it), not waited for.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    cudaError_t q;
    while ((q = cudaStreamQuery(stream_)) == cudaErrorNotReady &&
           std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    if (q == cudaErrorNotReady)
      std::fprintf(stderr,
                   "attnd: cuda:%d: work queued before a failed copy did not finish in 30 s; "
                   "the GPU may need a restart\n",
                   device_);
    if (had) cudaSetDevice(was);
    cudaGetLastError();
  }
  void Dismiss() { stream_ = nullptr; }

 private:
  int device_;
  cudaStream_t stream_;
};

// An event for ordering and waiting (no timing).
struct Event {
  cudaEvent_t e = nullptr;
  absl::Status Create() {
    CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return absl::OkStatus();
  }
  ~Event() {
    if (e) cudaEventDestroy(e);
  }
};

// One layer call's packed inputs and outputs (kernels/cuda/backend/layer_upload.h), in pinned host
// memory and on the GPU. A call holds its slot from StartLayer until its work on the GPU is done
// (it waits before it lets go), so the next holder finds both buffers free.
struct UploadSlot {
  std::mutex mu;
  HostBuffer host;
  DeviceBuffer dev;
  Event keys_in, queries_in;  // upload stream: the key part, the query part landed
  Event computed;             // compute stream: the call's kernels are done
  Event out_back;             // download stream: the output part is in `host`
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

// A step's plan as one upload: host vectors appended to a packed buffer (each 16-byte aligned),
// then copied to the GPU in one copy; Add returns where each vector will be on the GPU.
class PlanPacker {
 public:
  template <typename T>
  size_t Add(const std::vector<T>& v) {
    const size_t at = (bytes_.size() + 15) / 16 * 16;
    bytes_.resize(at + std::max<size_t>(1, v.size()) * sizeof(T));
    if (!v.empty()) std::memcpy(bytes_.data() + at, v.data(), v.size() * sizeof(T));
    return at;
  }
  const std::vector<uint8_t>& bytes() const { return bytes_; }

 private:
  std::vector<uint8_t> bytes_;
};

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
  // The plan in one buffer (PlanPacker): the share's positions, sequences, page tables, slots,
  // needs_index and every wave's vectors, at these offsets.
  DeviceBuffer plan;
  size_t pos = 0, seq = 0, indptr = 0, pages = 0, slot = 0, needs_index = 0;
  template <typename T>
  const T* At(size_t offset) const {
    return reinterpret_cast<const T*>(plan.as<uint8_t>() + offset);
  }
  DeviceBuffer sel, sel_slots, sel_count;  // [n, sel_cap] positions and slot ids, [n] counts
  bool selected = false;                   // a full layer has run
  // The indexer's queries in waves whose score rows fit kMaxScoreFloats, planned and uploaded
  // once per step (every full layer reuses them).
  struct Wave {
    int nq = 0;
    int64_t total = 0, max_len = 0, pages_total = 0, max_pages = 0;
    // In `plan`: [nq] local token, score offset, visible keys; page-key offset, pages.
    size_t rows = 0, offset = 0, len = 0, page_offset = 0, pages = 0;
    // Top-k in slices (topk_block.h): [nq] where each query's slices keep their candidates, for
    // the top-k over its scores (k = index_topk) and over its page keys (k = the pages kept).
    size_t token_slices = 0, page_slices = 0;
    // FlashInfer's top-k: rows at q x stride (offset says so too), lengths as int32 at len32.
    bool padded = false;
    int64_t stride = 0;
    size_t len32 = 0;
    std::vector<int32_t> host_rows;  // rows, offset and len on the host (candidates)
    std::vector<int64_t> host_offset, host_len;
  };
  std::vector<Wave> waves;
  int64_t candidates = 0;  // the most top-k candidates a wave keeps (entries)
  // The FlashInfer MLA's plan (mla_flashinfer_plan.h), when the step takes it (fi): the key
  // lists' segments and per wave its work arrays, in `plan`.
  bool fi = false;
  size_t fi_zeros = 0;
  // The key lists' segments (MlaKeyListParams), in `plan`.
  int fi_segments = 0;
  size_t fi_seg_start = 0, fi_seg_count = 0, fi_seg_query = 0, fi_seg_range = 0;
  int64_t fi_list_entries = 0;
  // The key lists themselves (slot ids), built at the step's first sparse layer and again after
  // each new selection (ToSlots): shared layers reuse them.
  DeviceBuffer fi_keys;
  bool fi_lists_current = false;
  struct FiWave {
    FlashInferMlaWave host;  // the shape (its arrays emptied once uploaded)
    std::vector<size_t> at;  // where its arrays are in `plan`, in FlashInferWaveArgs's order
  };
  std::vector<FiWave> fi_waves;
  int64_t fi_partial_rows = 0;
  // The GEMM MLA (GemmMla() when the step began): the longest key list; 0 = not taken.
  int64_t gemm_keys = 0;
  QueryTables Tables() const {
    QueryTables t;
    t.table.indptr = At<int32_t>(indptr);
    t.table.pages = At<int32_t>(pages);
    t.table.page_size = page_size;
    t.seq = At<int32_t>(seq);
    t.pos = At<int64_t>(pos);
    return t;
  }
};

struct CudaDevice::State {
  ModelSpec spec;
  CacheLayout layout;
  cudaStream_t stream = nullptr;           // layers' kernels (mu held while launching)
  cudaStream_t upload_stream = nullptr;    // layer inputs to the GPU (a slot held)
  cudaStream_t download_stream = nullptr;  // layer outputs back (a slot held)
  cudaStream_t copy_stream = nullptr;      // page reads, writes and copies (copy_mu held)
  uint8_t* cache = nullptr;                // CacheLayout's one allocation
  // One layer's kernels launched at a time per GPU: the scratch below is shared. Lock order: a
  // slot's mu (a layer call holds one, BeginStep both), then mu.
  std::mutex mu;
  std::mutex copy_mu;
  // Per-layer fp32 scratch (converted inputs, intermediate results).
  DeviceBuffer q_lat, q_rope, idx_q, idx_w, scores, tmp_sel, tmp_count, page_keys, page_list,
      page_count, out_f32;
  DeviceBuffer part_out, part_ml;                 // split-K partials of the tensor-core MLA
  DeviceBuffer cand_key, cand_index, cand_count;  // top-k candidates of long rows' slices
  DeviceBuffer q_nope, out_v;                     // absorbed calls: q_nope and the values, fp32
  // The FlashInfer MLA: bf16 queries, key lists [n, sel_cap], chunk partials (bf16, log2 fp32).
  DeviceBuffer fi_q_nope, fi_q_pe, fi_part_o, fi_part_lse;
  // The GEMM MLA: its waves' key blocks, queries, scores and probabilities; cuBLAS's handle.
  DeviceBuffer gemm_scratch;
  DeviceBuffer topk_values;  // FlashInfer's top-k: its values output [n, k] (unused after)
  CublasHandle blas;
  bool blas_unavailable_said = false;
  // Two calls' packed inputs and outputs: one call's upload and download overlap another's
  // kernels (kernels/cuda/backend/layer_upload.h).
  std::array<UploadSlot, 2> slots;
  std::atomic<unsigned> next_slot{0};
  // BeginStep's plan upload (mu held): pinned staging, reused once `plan_uploaded` passed.
  HostBuffer plan_host;
  Event plan_uploaded;
  // Page moves (copy_mu held): the span table of a move, and between GPUs a staging chunk
  // (kMoveChunkBytes, made on the first such move) and the event that orders its reuse.
  DeviceBuffer move_table, move_staging;
  Event move_done;
  // Server-side absorption: every layer's W_UK [H, Dn, L] and W_UV^T [H, L, V] (PrepareAbsorption).
  std::vector<DeviceBuffer> absorb_uk, absorb_uv;
  int absorb_dn = 0, absorb_v = 0;
  int sms = 1;                // multiprocessors: how many split-K blocks fill the GPU
  size_t scratch_budget = 0;  // the most per-layer scratch a step may need (bytes)

  CacheRows Latent(int layer) const { return layout.Latent(cache, layer); }
  CacheRows Index(int slot) const { return layout.Index(cache, slot); }

  // Plans the step's indexer waves from its share into `plan` (mu held), with their top-k
  // slices (step->candidates).
  void PlanWaves(const StepShare& share, Step* step, PlanPacker* plan) const;
  // The FlashInfer MLA's plan, where the step can take it (sets step->fi).
  void PlanFlashInfer(const StepShare& share, Step* step, PlanPacker* plan) const;
  // The pages a page-mode selection keeps per query (its page top-k's k).
  int64_t KeptPages() const {
    return spec.selection == SelectionMode::kPageUnion ? spec.page_union_max_pages
                                                       : spec.page_budget;
  }
  // Grows the per-layer scratch and both upload slots to what a layer of `share` needs (mu and
  // both slots held): a step that cannot fit fails at BeginStep with RESOURCE_EXHAUSTED, never in
  // the middle of a layer.
  absl::Status ReserveScratch(const StepShare& share, const Step& step);
  // Grows each buffer of `want` to its size when they, the share's selection buffers and
  // `step_own_bytes` of the step's other own buffers fit the budget; a failure puts every buffer
  // back as it was (other open steps' layers use them).
  absl::Status ReserveScratchBuffers(const StepShare& share,
                                     absl::Span<const std::pair<DeviceBuffer*, size_t>> want,
                                     size_t step_own_bytes = 0);
  // A free upload slot, locked into *lock (waits for one when both are in use).
  UploadSlot& AcquireSlot(std::unique_lock<std::mutex>* lock);
  // Copies between a page's rows and host memory on the copy stream, then waits (copy_mu held).
  absl::Status PageToHost(int32_t page, int rows, uint8_t* staged);
  absl::Status HostToPage(int32_t page, int rows, const uint8_t* staged);
  // A tier move's whole pages to (to_host) or from the host buffers `host[i]` through
  // move_staging (PlanPageStaging), on the copy stream, waited for once. copy_mu held.
  absl::Status PagesThroughStaging(const std::vector<int32_t>& pages,
                                   const std::vector<uint8_t*>& host, bool to_host);
};

}  // namespace attnd::cuda
