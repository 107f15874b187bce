// Creates devices from their names ("cpu:N", "cuda:N"). The only code that knows which backends
// exist: everything above it sees kernels/device.h.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/model_spec.h"
#include "common/thread_pool.h"
#include "kernels/device.h"
#include "kv_store/host_tier.h"

namespace attnd {

// How devices are made, as the operator asked for it (--cpu-isa, --gpu-scratch-bytes); only the
// factory interprets it. CPU devices run the named inner loops ("auto": the widest this CPU
// runs; "avx512", "avx2", "generic"); each GPU keeps gpu_scratch_bytes of working memory beside
// its cache (fixed at startup: cache + scratch must fit the GPU; a step needing more is
// RESOURCE_EXHAUSTED at BeginStep).
struct DeviceSettings {
  std::string cpu_isa = "auto";
  size_t gpu_scratch_bytes = size_t{8} << 30;
  // The CUDA kernel forms (kernels/cuda/backend/kernel_choice.h: --cuda-mla, --cuda-indexer,
  // --cuda-topk; the ATTND_CUDA_* variables override them), for every GPU of the process.
  std::string cuda_mla = "default";
  std::string cuda_indexer = "default";
  std::string cuda_topk = "attnd";
};

// What devices are made with: the settings, and the pool CPU devices compute on (it outlives
// them).
struct DeviceOptions {
  ThreadPool* pool = nullptr;
  DeviceSettings settings;
};

// Whether CPU caches of cache_bytes_per_device each, on cpu_devices devices, fit the
// `available` bytes of host memory (MemAvailable, or what the cgroup limit leaves):
// RESOURCE_EXHAUSTED with both numbers otherwise (a cache that is accepted but does not fit is
// OOM-killed later, under load). CreateDevices checks it.
absl::Status CheckHostCacheFits(int cpu_devices, size_t cache_bytes_per_device, uint64_t available,
                                bool cgroup_limited);

// The ISA name `cpu_isa` resolves to on this CPU ("auto" to the widest supported).
// INVALID_ARGUMENT for an unknown name, FAILED_PRECONDITION when this CPU lacks it.
absl::StatusOr<std::string> ResolveCpuIsa(absl::string_view cpu_isa);

// One device per name, in order, each with a cache of `layout`. INVALID_ARGUMENT for a malformed
// or repeated name, UNIMPLEMENTED for cuda:N in a build without CUDA, FAILED_PRECONDITION for a
// missing GPU, RESOURCE_EXHAUSTED when a cache (plus a GPU's scratch budget) does not fit. GPUs of
// one server are connected so their page copies go device to device (NCCL when it loads, else peer
// copies).
absl::StatusOr<std::vector<std::unique_ptr<Device>>> CreateDevices(
    const std::vector<std::string>& names, const ModelSpec& spec, const CacheLayout& layout,
    const DeviceOptions& options);

// The cache size --kv-cache-fraction asks for: `fraction` (0, 1] of the memory each device has
// available now, the least over `names` (one layout serves every device). A GPU's share is of
// its free memory (cudaMemGetInfo) less `gpu_scratch_bytes`; CPU devices split the host's
// available memory (MemAvailable within the process's cgroup limit) evenly. `explanation` says
// how the figure was reached, for the startup log. INVALID_ARGUMENT for a fraction outside
// (0, 1] or a malformed name, RESOURCE_EXHAUSTED when nothing is left for the cache.
struct CacheBudget {
  size_t bytes = 0;
  std::string explanation;
};
absl::StatusOr<CacheBudget> CacheBytesForFraction(const std::vector<std::string>& names,
                                                  double fraction, size_t gpu_scratch_bytes);

// The host tier's memory (kv_store/host_tier.h) for these devices: pinned and portable when one
// is a GPU, so its spills and restores are DMA on the GPU's copy stream; otherwise anonymous
// memory mapped lazily.
HostAllocator HostTierAllocator(const std::vector<std::unique_ptr<Device>>& devices);

// Whether this build can drive CUDA devices (nvcc was found at build time).
bool CudaBackendBuilt();
// Every usable GPU ("cuda:0", ...): empty in a build without CUDA or on a machine without a GPU;
// UNAVAILABLE when a GPU stack is present but broken (see cuda::ProbeDevices).
absl::StatusOr<std::vector<std::string>> GpuDeviceNames();
// GpuDeviceNames(), or {"cpu:0"} where there is no GPU (what --devices=auto serves on).
absl::StatusOr<std::vector<std::string>> DefaultDeviceNames();

}  // namespace attnd
