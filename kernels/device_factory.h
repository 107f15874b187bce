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

// What CPU devices compute with; they share the pool (which outlives the devices).
struct HostCompute {
  ThreadPool* pool = nullptr;
  const cpu::Kernels* kernels = nullptr;
};

// One device per name, in order, each with a cache of `layout`. INVALID_ARGUMENT for a malformed
// name, UNIMPLEMENTED for cuda:N in a build without CUDA, FAILED_PRECONDITION for a missing GPU,
// RESOURCE_EXHAUSTED when a cache cannot be allocated. GPUs of one server are connected so their
// page copies go device to device (NCCL when it loads, else peer copies).
absl::StatusOr<std::vector<std::unique_ptr<Device>>> CreateDevices(
    const std::vector<std::string>& names, const ModelSpec& spec, const CacheLayout& layout,
    const HostCompute& host);

// Whether this build can drive CUDA devices (nvcc was found at build time).
bool CudaBackendBuilt();
// Every usable GPU ("cuda:0", ...): empty in a build without CUDA or on a machine without a GPU;
// UNAVAILABLE when a GPU stack is present but broken (see cuda::ProbeDevices).
absl::StatusOr<std::vector<std::string>> GpuDeviceNames();
// GpuDeviceNames(), or {"cpu:0"} where there is no GPU (what --devices=auto serves on).
absl::StatusOr<std::vector<std::string>> DefaultDeviceNames();

}  // namespace attnd
