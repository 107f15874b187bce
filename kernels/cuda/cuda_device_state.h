// The CUDA device's internals, shared by its sources (cuda_device.cc: creation, steps and
// absorption; cuda_layer.cc: one RunLayer call; cuda_pages.cc: page reads, writes and copies
// between GPUs): growing device and pinned host buffers, a step's state on the GPU and the GPU's
// state. Not for use outside kernels/cuda/.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/cuda_kernels.h"

#define CUDA_RETURN(expr)                                                            \
  do {                                                                               \
    const cudaError_t attnd_cuda_err_ = (expr);                                      \
    if (attnd_cuda_err_ != cudaSuccess)                                              \
      return absl::InternalError(                                                    \
          absl::StrCat("CUDA: ", #expr, ": ", cudaGetErrorString(attnd_cuda_err_))); \
  } while (0)

namespace attnd::cuda {

// bf16 requests take the tensor-core kernels (MLA and indexer) unless ATTND_CUDA_MLA=simt /
// ATTND_CUDA_INDEXER=simt or a ScopedKernelChoice says otherwise.
bool TensorCoreMla();
bool TensorCoreIndexer();

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

}  // namespace attnd::cuda
