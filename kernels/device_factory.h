// Creates devices from their names ("cpu:N", "cuda:N"). The only code that knows which backends
// exist: everything above it sees kernels/device.h.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_spec.h"
#include "common/thread_pool.h"
#include "kernels/cpu/cpu_isa.h"
#include "kernels/device.h"

namespace attnd {

// What devices are made with: CPU devices compute on the shared pool (which outlives them) with
// the given inner loops; each GPU keeps gpu_scratch_bytes of working memory beside its cache.
struct DeviceOptions {
  ThreadPool* pool = nullptr;
  const cpu::Kernels* kernels = nullptr;
  size_t gpu_scratch_bytes = size_t{8} << 30;
};

// One device per name, in order, each with a cache of `layout`. INVALID_ARGUMENT for a malformed
// name, UNIMPLEMENTED for cuda:N in a build without CUDA, FAILED_PRECONDITION for a missing GPU,
// RESOURCE_EXHAUSTED when a cache (plus a GPU's scratch budget) does not fit. GPUs of one server
// are connected so their page copies go device to device (NCCL when it loads, else peer copies).
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

// Whether this build can drive CUDA devices (nvcc was found at build time).
bool CudaBackendBuilt();
// Every usable GPU ("cuda:0", ...): empty in a build without CUDA or on a machine without a GPU;
// UNAVAILABLE when a GPU stack is present but broken (see cuda::ProbeDevices).
absl::StatusOr<std::vector<std::string>> GpuDeviceNames();
// GpuDeviceNames(), or {"cpu:0"} where there is no GPU (what --devices=auto serves on).
absl::StatusOr<std::vector<std::string>> DefaultDeviceNames();

}  // namespace attnd
